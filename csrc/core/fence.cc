#include "fence.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <ctime>

namespace kvtier::fence {

namespace {

// Not FUTEX_PRIVATE_FLAG: waiters and wakers are different processes
// mapping the same shared page.
long futex(const Word* f, int op, Word val, const timespec* ts) noexcept {
  return ::syscall(SYS_futex, const_cast<Word*>(f), op, val, ts, nullptr, 0);
}

}  // namespace

Word arm(Word* f) noexcept {
  const Word old = __atomic_load_n(f, __ATOMIC_ACQUIRE);
  const Word armed = (((old >> 2) + 1) << 2) | kPending;
  __atomic_store_n(f, armed, __ATOMIC_RELEASE);
  return armed;
}

bool settle(Word* f, Word armed, bool ok) noexcept {
  if ((armed & kStateMask) != kPending) return false;
  Word expected = armed;
  const Word done = (armed & ~kStateMask) | (ok ? 0 : kFailed);
  // Release: the slot's bytes are visible to whoever sees the word ready.
  if (!__atomic_compare_exchange_n(f, &expected, done, false, __ATOMIC_RELEASE, __ATOMIC_RELAXED))
    return false;
  futex(f, FUTEX_WAKE, INT_MAX, nullptr);
  return true;
}

State wait(const Word* f, Word armed, std::chrono::milliseconds timeout) noexcept {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  const Word ready = armed & ~kStateMask;
  for (;;) {
    const Word v = __atomic_load_n(f, __ATOMIC_ACQUIRE);
    if (v == ready) return State::kReady;
    if (v != armed) return State::kFailed;  // failed, or armed again by a later write
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) return State::kTimedOut;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    // Returns at once (EAGAIN) when the word changed since the load above.
    futex(f, FUTEX_WAIT, armed, &ts);
  }
}

const char* describe(State s) noexcept {
  switch (s) {
    case State::kReady:
      return "ready";
    case State::kFailed:
      return "its read from the lower tier failed";
    case State::kTimedOut:
      return "its read from the lower tier did not end in time";
  }
  return "?";
}

}  // namespace kvtier::fence

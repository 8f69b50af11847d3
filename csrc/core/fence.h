// Readiness of host-pool slots whose bytes are still arriving: a promotion
// from a lower tier that a load is already allowed to wait for, so that the
// copy into the engine's KV cache overlaps the reads instead of following
// them. One 32-bit word per slot in the pool's shared mapping (the reads run
// in the scheduler's process, the copies in the worker's). The low two bits
// say pending, ready or failed; the rest count arms, so that a waiter never
// takes a later write into the same slot for the one it waits for.
#pragma once

#include <chrono>
#include <cstdint>

namespace kvtier::fence {

using Word = std::uint32_t;
constexpr Word kPending = 1;
constexpr Word kFailed = 2;
constexpr Word kStateMask = 3;

// Starts a write into the slot of `f`: returns its armed value (a new
// generation, pending). One arming party per word (the scheduler's tiers).
Word arm(Word* f) noexcept;

// Ends the write armed as `armed`, ready (ok) or failed, and wakes its
// waiters in every process. False (and no change) when the word has moved on:
// settled already, or armed again.
bool settle(Word* f, Word armed, bool ok) noexcept;

enum class State { kReady, kFailed, kTimedOut };

// Blocks (futex, no spinning) until the write armed as `armed` settles or
// `timeout` passes. A word armed again since counts as failed.
State wait(const Word* f, Word armed, std::chrono::milliseconds timeout) noexcept;

// Why a wait did not end ready, for job errors.
const char* describe(State s) noexcept;

}  // namespace kvtier::fence

// The named codes of kvtier, one owner for C++ and Python: the binding
// exposes both enums as IntEnums in kvtier._native and kvtier.codes
// re-exports them, so Python compares names, never raw numbers.
#pragma once

#include <cerrno>
#include <cstdint>
#include <string>
#include <vector>

namespace kvtier {

// What a public entry point failed with; kvtier::Error carries one and the
// binding maps each to a class of kvtier.errors.
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,
  kIoError = 2,
  kBusy = 3,
  kCuda = 4,
  kClosed = 5,
  kTimeout = 6,
  kCancelled = 7,
  kInternal = 8,
  kTls = 9,  // a TLS handshake or certificate failed (an IoError too)
};

// Outcome of one item of a job (a disk record, a remote key), as reported in
// JobResult::items: 0 ok, > 0 an errno, < 0 an integrity or protocol failure.
// Any errno may appear; the ones named here are those the library itself
// assigns or acts upon. Values are fixed: Python code and journals compare
// against them.
enum class ItemStatus : std::int32_t {
  kOk = 0,
  // errnos with a meaning of their own to the tiers
  kBusy = EBUSY,           // never submitted: the queue was at its byte budget
  kNoSpace = ENOSPC,       // the medium is full: stop admitting for a while
  kTimedOut = ETIMEDOUT,   // the job passed its queue's deadline
  kCancelled = ECANCELED,  // the job was cancelled (engine closed) before it ran
  // integrity failures of a record or value (disk/record.h)
  kBadTrailer = -1,   // magic, version or trailer crc wrong (torn or foreign record)
  kWrongKey = -2,     // namespace, key or length differ
  kBadChecksum = -3,  // payload crc32c differs
  kShortRead = -4,    // end of file inside the record
  // remote store outcomes (remote/client.h)
  kMissing = -5,      // no such key (GET nil, EXISTS 0)
  kBadLength = -6,    // value too short or of another length
  kServerError = -7,  // the server answered an error
};

static_assert(EBUSY == 16 && ENOSPC == 28 && ETIMEDOUT == 110 && ECANCELED == 125,
              "item codes are Linux errno values");

constexpr std::int32_t item_code(ItemStatus s) { return static_cast<std::int32_t>(s); }

// Every named item status with its Python name and message (nullptr: the
// errno's strerror), for item_error() and the binding: one table, so a new
// code is named once.
struct ItemStatusInfo {
  ItemStatus value;
  const char* name;
  const char* message;
};
inline constexpr ItemStatusInfo kItemStatuses[] = {
    {ItemStatus::kOk, "OK", "ok"},
    {ItemStatus::kBusy, "BUSY", nullptr},
    {ItemStatus::kNoSpace, "NO_SPACE", nullptr},
    {ItemStatus::kTimedOut, "TIMED_OUT", nullptr},
    {ItemStatus::kCancelled, "CANCELLED", nullptr},
    {ItemStatus::kBadTrailer, "BAD_TRAILER", "bad record trailer (torn or foreign record)"},
    {ItemStatus::kWrongKey, "WRONG_KEY", "record belongs to another key, namespace or length"},
    {ItemStatus::kBadChecksum, "BAD_CHECKSUM", "payload checksum mismatch"},
    {ItemStatus::kShortRead, "SHORT_READ", "short read at end of file"},
    {ItemStatus::kMissing, "MISSING", "no such key"},
    {ItemStatus::kBadLength, "BAD_LENGTH", "value too short or of another length"},
    {ItemStatus::kServerError, "SERVER_ERROR", "the server answered an error"},
};

// A message for any item code: the named integrity failures, else strerror.
const char* item_error(std::int32_t code);

// A job's error message from its items: "" when every item is ok (or
// `also_ok`), else "<bad> of <n> <noun> failed; first: <message>".
std::string item_summary(const std::vector<std::int32_t>& items, const char* noun,
                         ItemStatus also_ok = ItemStatus::kOk);

}  // namespace kvtier

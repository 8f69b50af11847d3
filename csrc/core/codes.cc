#include "codes.h"

#include <cstring>

namespace kvtier {

const char* item_error(std::int32_t code) {
  switch (static_cast<ItemStatus>(code)) {
    case ItemStatus::kOk:
      return "ok";
    case ItemStatus::kBadTrailer:
      return "bad record trailer (torn or foreign record)";
    case ItemStatus::kWrongKey:
      return "record belongs to another key, namespace or length";
    case ItemStatus::kBadChecksum:
      return "payload checksum mismatch";
    case ItemStatus::kShortRead:
      return "short read at end of file";
    case ItemStatus::kMissing:
      return "no such key";
    case ItemStatus::kBadLength:
      return "value too short or of another length";
    case ItemStatus::kServerError:
      return "the server answered an error";
    default:
      return code > 0 ? std::strerror(code) : "unknown error";
  }
}

std::string item_summary(const std::vector<std::int32_t>& items, const char* noun,
                         ItemStatus also_ok) {
  std::size_t bad = 0;
  std::int32_t first = 0;
  for (std::int32_t x : items)
    if (x != 0 && x != item_code(also_ok) && bad++ == 0) first = x;
  if (bad == 0) return {};
  return std::to_string(bad) + " of " + std::to_string(items.size()) + " " + noun +
         " failed; first: " + item_error(first);
}

}  // namespace kvtier

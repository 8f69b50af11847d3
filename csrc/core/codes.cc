#include "codes.h"

#include <cstring>

namespace kvtier {

const char* item_error(std::int32_t code) {
  for (const auto& s : kItemStatuses)
    if (item_code(s.value) == code && s.message) return s.message;
  return code > 0 ? std::strerror(code) : "unknown error";
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

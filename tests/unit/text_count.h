// Counting what a log or a report says: for tests that check how often a line was
// written (a refusal logged once, a rate-limited warning a few times a second).
#pragma once

#include <cstddef>
#include <string_view>

namespace kvagent::testing {

// Where `needle` starts in `text`, overlapping matches included ("aa" is twice in
// "aaa"); 0 for an empty needle.
inline size_t Occurrences(std::string_view text, std::string_view needle) {
  if (needle.empty()) return 0;
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string_view::npos; at = text.find(needle, at + 1)) {
    ++n;
  }
  return n;
}

}  // namespace kvagent::testing

// fmt support for Abseil types. Debian's Abseil is built with its own
// absl::string_view (ABSL_OPTION_USE_STD_STRING_VIEW 0), which fmt 9 cannot print
// by itself; every file that formats a Status message includes this.
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "fmt/format.h"

template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<std::string_view> {
  template <typename FormatContext>
  auto format(absl::string_view s, FormatContext& ctx) const {
    return fmt::formatter<std::string_view>::format(std::string_view(s.data(), s.size()), ctx);
  }
};

template <>
struct fmt::formatter<absl::Status> : fmt::formatter<std::string_view> {
  template <typename FormatContext>
  auto format(const absl::Status& s, FormatContext& ctx) const {
    const std::string text = s.ToString();
    return fmt::formatter<std::string_view>::format(std::string_view(text), ctx);
  }
};

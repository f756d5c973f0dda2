// A thin fmt logger: one named logger per component, one process-wide level set by
// --log-level. Lines go to stderr as "LEVEL component: message".
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "base/format.h"
#include "fmt/format.h"

namespace kvagent::log {

enum class Level { kTrace = 0, kDebug = 1, kInfo = 2, kWarn = 3, kError = 4, kOff = 5 };

void SetLevel(Level level);
Level GetLevel();
// Parses "trace", "debug", "info", "warn", "error" or "off".
absl::StatusOr<Level> ParseLevel(std::string_view text);
void Write(Level level, std::string_view component, std::string_view message);

// Whether the `n`-th (counted from 1) of an event that a peer can repeat at will is
// logged: the first four and every 1,024th, so a flood does not flood the log.
constexpr bool Sampled(uint64_t n) { return n <= 4 || n % 1024 == 0; }

class Logger {
 public:
  explicit constexpr Logger(std::string_view component) : component_(component) {}

  template <typename... Args>
  void Log(Level level, fmt::format_string<Args...> format, Args&&... args) const {
    if (level < GetLevel()) return;
    Write(level, component_, fmt::format(format, std::forward<Args>(args)...));
  }
  template <typename... Args>
  void Debug(fmt::format_string<Args...> f, Args&&... a) const { Log(Level::kDebug, f, std::forward<Args>(a)...); }
  template <typename... Args>
  void Info(fmt::format_string<Args...> f, Args&&... a) const { Log(Level::kInfo, f, std::forward<Args>(a)...); }
  template <typename... Args>
  void Warn(fmt::format_string<Args...> f, Args&&... a) const { Log(Level::kWarn, f, std::forward<Args>(a)...); }
  template <typename... Args>
  void Error(fmt::format_string<Args...> f, Args&&... a) const { Log(Level::kError, f, std::forward<Args>(a)...); }

 private:
  std::string_view component_;
};

}  // namespace kvagent::log

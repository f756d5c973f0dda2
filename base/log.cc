#include "base/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/status/status.h"

namespace kvagent::log {
namespace {
std::atomic<int> g_level{static_cast<int>(Level::kInfo)};

const char* Name(Level level) {
  switch (level) {
    case Level::kTrace: return "TRACE";
    case Level::kDebug: return "DEBUG";
    case Level::kInfo: return "INFO";
    case Level::kWarn: return "WARN";
    case Level::kError: return "ERROR";
    case Level::kOff: return "OFF";
  }
  return "?";
}
}  // namespace

void SetLevel(Level level) { g_level.store(static_cast<int>(level)); }
Level GetLevel() { return static_cast<Level>(g_level.load(std::memory_order_relaxed)); }

absl::StatusOr<Level> ParseLevel(std::string_view text) {
  if (text == "trace") return Level::kTrace;
  if (text == "debug") return Level::kDebug;
  if (text == "info") return Level::kInfo;
  if (text == "warn") return Level::kWarn;
  if (text == "error") return Level::kError;
  if (text == "off") return Level::kOff;
  return absl::InvalidArgumentError(fmt::format(
      "log level '{}' is not known; use one of trace, debug, info, warn, error, off", text));
}

void Write(Level level, std::string_view component, std::string_view message) {
  auto now = std::chrono::system_clock::now().time_since_epoch();
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now).count();
  std::string line = fmt::format("{}.{:03d} {:<5} {}: {}\n", ms / 1000, static_cast<int>(ms % 1000),
                                 Name(level), component, message);
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace kvagent::log

// Microsecond clocks the agent's components and kvagentctl share: wall time for what
// a person or another host reads (submitted_unix_us), steady time for spans.
#pragma once

#include <chrono>
#include <cstdint>

namespace kvagent {

// Microseconds since the Unix epoch (system clock).
inline uint64_t UnixMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Microseconds on the steady clock (an arbitrary epoch; only differences mean anything).
inline uint64_t MonotonicMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace kvagent

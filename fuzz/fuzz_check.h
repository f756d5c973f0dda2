// Invariant checks shared by the fuzz targets in fuzz/: a failed FUZZ_CHECK prints the
// condition, the detail and the input being run, then aborts, which libFuzzer reports
// as a crash (saving the input) and which fails the gcc-built replay test.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "fmt/format.h"

namespace kvagent::fuzz {

// Prints "FUZZ_CHECK failed at file:line: cond: detail", the running input (hex and
// where it came from, set by the replay driver) and aborts.
[[noreturn]] void Fail(const char* file, int line, const char* condition,
                       const std::string& detail);

// The replay driver names the input it runs ("seed fuzz/seeds/x/a.bin", "mutation
// 17 of ...") so that a failure says how to reproduce it. libFuzzer prints its own.
void SetCurrentInput(const std::string& description, const uint8_t* data, size_t size);

// Shm objects a target created: Fail() unlinks them before it aborts (an abort skips
// the destructors that would), so failed runs leave nothing in /dev/shm.
void UnlinkOnFailure(const std::string& shm_name);

// "/kvagent-fuzz-<pid>-<random>-<suffix>": unique even between sandboxed tests, which
// all see the same pid while /dev/shm is shared. fuzz/run.sh cleans up by pid.
std::string ShmName(const std::string& suffix);

}  // namespace kvagent::fuzz

#define FUZZ_CHECK(condition, ...)                                                    \
  do {                                                                                \
    if (!(condition)) {                                                               \
      ::kvagent::fuzz::Fail(__FILE__, __LINE__, #condition, fmt::format(__VA_ARGS__)); \
    }                                                                                 \
  } while (0)

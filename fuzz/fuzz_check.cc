#include "fuzz/fuzz_check.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <vector>

namespace kvagent::fuzz {
namespace {

struct CurrentInput {
  std::string description;
  std::string bytes;
  std::vector<std::string> shm_names;
};

CurrentInput& Current() {
  static CurrentInput* current = new CurrentInput();  // never destroyed: used at abort
  return *current;
}

}  // namespace

void SetCurrentInput(const std::string& description, const uint8_t* data, size_t size) {
  Current().description = description;
  Current().bytes.assign(reinterpret_cast<const char*>(data), size);
}

std::string ShmName(const std::string& suffix) {
  static const uint64_t run = (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  return fmt::format("/kvagent-fuzz-{}-{:x}-{}", getpid(), run, suffix);
}

void UnlinkOnFailure(const std::string& shm_name) { Current().shm_names.push_back(shm_name); }

void Fail(const char* file, int line, const char* condition, const std::string& detail) {
  for (const std::string& name : Current().shm_names) shm_unlink(name.c_str());
  std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s: %s\n", file, line, condition,
               detail.c_str());
  const CurrentInput& input = Current();
  if (!input.description.empty()) {
    std::string hex;
    for (unsigned char c : input.bytes) hex += fmt::format("{:02x}", c);
    std::fprintf(stderr, "input: %s (%zu bytes): %s\n", input.description.c_str(),
                 input.bytes.size(), hex.c_str());
    // Under Bazel, keep the input so that it can become a fuzz/regressions/ entry.
    if (const char* dir = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR")) {
      const std::string path = std::string(dir) + "/failing-input.bin";
      std::ofstream(path, std::ios::binary) << input.bytes;
      std::fprintf(stderr, "input saved to %s\n", path.c_str());
    }
  }
  std::fflush(stderr);
  std::abort();
}

}  // namespace kvagent::fuzz

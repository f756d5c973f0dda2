// main() for a fuzz target built without libFuzzer (the gcc build): runs every file
// or folder named on the command line through LLVMFuzzerTestOneInput, e.g. to
// reproduce a crash input with `bazel run //fuzz:plan_fuzzer -- /path/to/crash-...`.
#include <cstdio>
#include <string>
#include <vector>

#include "fuzz/corpus_files.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_target.h"
#include "google/protobuf/stubs/logging.h"

int main(int argc, char** argv) {
  google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in inputs is expected
  std::vector<std::string> paths(argv + 1, argv + argc);
  if (paths.empty()) {
    std::fprintf(stderr, "usage: %s FILE_OR_FOLDER...  (inputs for the '%s' fuzz target)\n",
                 argv[0], kvagent::fuzz::TargetName());
    return 2;
  }
  const auto inputs = kvagent::fuzz::ReadInputs(paths);
  for (const auto& [path, bytes] : inputs) {
    const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
    kvagent::fuzz::SetCurrentInput(path, data, bytes.size());
    LLVMFuzzerTestOneInput(data, bytes.size());
  }
  std::printf("%zu inputs ran clean through the '%s' target\n", inputs.size(),
              kvagent::fuzz::TargetName());
  return inputs.empty() ? 1 : 0;
}

// The gcc build of a fuzz target, as a test that `bazel test //...` runs: every
// checked-in seed and regression input, then a few thousand deterministic mutations
// of them, through the target's LLVMFuzzerTestOneInput. A broken invariant aborts
// (FUZZ_CHECK) and prints the input; the input is also saved under the test's
// undeclared outputs so that it can be added to fuzz/regressions/<target>/.
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "fuzz/corpus_files.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_target.h"
#include "fuzz/mutator.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/text_format.h"

namespace kvagent::fuzz {
namespace {

// Inputs with invalid UTF-8 in string fields are expected; protobuf would log each.
const bool kQuietProtobuf = [] {
  google::protobuf::SetLogHandler(nullptr);
  return true;
}();

constexpr size_t kMaxInputBytes = 4096;  // libFuzzer's default -max_len

bool IsSeed(const std::string& path) { return path.size() > 7 && path.substr(path.size() - 7) == ".textpb"; }

// Seeds are text protos (encoded here); regressions are the raw bytes that failed.
std::vector<std::pair<std::string, std::string>> CheckedInInputs() {
  const std::string target = TargetName();
  auto inputs = ReadInputs({"fuzz/seeds/" + target, "fuzz/regressions/" + target});
  for (auto& [path, bytes] : inputs) {
    if (!IsSeed(path)) continue;
    std::unique_ptr<google::protobuf::Message> message(InputPrototype().New());
    INFO("seed " << path << " must be a valid text proto of " << message->GetTypeName());
    REQUIRE(google::protobuf::TextFormat::ParseFromString(bytes, message.get()));
    bytes = message->SerializeAsString();
  }
  return inputs;
}

void RunOne(const std::string& description, const std::string& bytes) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  SetCurrentInput(description, data, bytes.size());
  LLVMFuzzerTestOneInput(data, bytes.size());
}

uint64_t MutationCount() {
  const char* env = std::getenv("KVAGENT_FUZZ_REPLAY_MUTATIONS");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : 3000;
}

TEST_CASE("fuzz target: every seed and regression input runs clean") {
  const auto inputs = CheckedInInputs();
  size_t seeds = 0;
  for (const auto& [path, bytes] : inputs) seeds += IsSeed(path) ? 1 : 0;
  INFO("target " << TargetName() << ": seeds under fuzz/seeds/" << TargetName());
  REQUIRE(seeds >= 3);  // the runfiles hold the checked-in seeds
  for (const auto& [path, bytes] : inputs) RunOne("checked-in " + path, bytes);
}

TEST_CASE("fuzz target: deterministic mutations of the seeds run clean") {
  std::vector<std::string> pool;
  for (auto& [path, bytes] : CheckedInInputs()) pool.push_back(std::move(bytes));
  REQUIRE(!pool.empty());
  const size_t checked_in = pool.size();
  Mutator mutator(0x6b76616765 /* fixed: the same inputs on every run */);
  const uint64_t count = MutationCount();
  size_t parsed = 0;
  for (uint64_t i = 0; i < count; ++i) {
    // Mostly mutate a checked-in input; sometimes build on an earlier mutation.
    const std::string& base = pool[mutator.Next(4) == 0 ? mutator.Next(pool.size())
                                                         : mutator.Next(checked_in)];
    std::string input = mutator.Mutate(base, pool, InputPrototype());
    if (input.size() > kMaxInputBytes) input.resize(kMaxInputBytes);
    std::unique_ptr<google::protobuf::Message> message(InputPrototype().New());
    if (message->ParseFromString(input)) ++parsed;
    RunOne(fmt::format("mutation {} of {} (KVAGENT_FUZZ_REPLAY_MUTATIONS)", i, count), input);
    if (pool.size() < checked_in + 256) pool.push_back(std::move(input));
  }
  // Mutations that never parse would only test the protobuf parser.
  INFO(parsed << " of " << count << " mutations parsed");
  CHECK(parsed * 2 >= count);
}

}  // namespace
}  // namespace kvagent::fuzz

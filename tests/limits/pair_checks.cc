#include "tests/limits/pair_checks.h"

#include <utility>

#include "catch2/catch.hpp"

namespace kvagent::testing {

AgentPairOptions WithArgs(std::vector<std::string> args) {
  AgentPairOptions options;
  options.extra_args = std::move(args);
  return options;
}

const v1::LimitState* FindLimit(const v1::AgentStatus& status, const std::string& name) {
  for (const auto& limit : status.limits()) {
    if (limit.name() == name) return &limit;
  }
  return nullptr;
}

void HonestWrite(AgentPair& pair, const std::string& id, uint64_t src, uint64_t dst) {
  pair.ResetContents();
  auto request = KvWrite(id, {src}, {dst}, "honest");
  request.set_wait(true);
  auto done = pair.prefill().Submit(request);
  INFO(done.status().ToString());
  REQUIRE(done.ok());
  INFO(done->error_message());
  CHECK(done->phase() == v1::COMPLETED);
  CHECK(pair.PageEqual(src, dst));
}

}  // namespace kvagent::testing

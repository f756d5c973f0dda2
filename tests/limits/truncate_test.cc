// Engines share memory they own with the agent (an unsealed memfd here) and may shrink
// it under the agent. Each access to the lost pages is a SIGBUS; registry::FaultGuard
// must turn it into a failed transfer that names the region, never a dead agent.
// Two real kvagentd processes on one host: data moves shm-direct (the sender maps
// the receiver's memory), so the SENDER catches a fault in the receiver's memory too.
#include <cstdint>
#include <cstring>
#include <string>

#include "base/format.h"
#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"
#include "tests/limits/engine_memory.h"
#include "tests/limits/status_probe.h"

namespace kvagent::testing {
namespace {

constexpr uint64_t kSmall = 1 << 20;

TEST_CASE("the sender's own region truncated: the transfer fails naming it, the agent lives") {
  FaultScene scene;
  AgentPair& pair = scene.pair;

  auto doomed = ShareEngineMemory(pair.prefill(), "src-doomed", kSmall, 1);
  auto intact = ShareEngineMemory(pair.prefill(), "src-intact", kSmall, 2);
  auto dst_a = ShareEngineMemory(pair.decode(), "dst-a", kSmall, 0);
  auto dst_b = ShareEngineMemory(pair.decode(), "dst-b", kSmall, 0);
  RegisterRegion(pair.prefill(), "src.doomed", *doomed);
  RegisterRegion(pair.prefill(), "src.intact", *intact);
  RegisterRegion(pair.decode(), "dst.a", *dst_a);
  RegisterRegion(pair.decode(), "dst.b", *dst_b);

  doomed->Truncate();
  auto failed = pair.prefill().Submit(ByteWrite("from-doomed", "src.doomed", "dst.a", kSmall, true));
  INFO(failed.status().ToString());
  REQUIRE(failed.ok());
  RequireBrokenFailure(*failed, "local region 'src.doomed'");
  scene.RequireAlive();

  // An honest transfer from intact memory still moves every byte.
  auto honest = pair.prefill().Submit(ByteWrite("from-intact", "src.intact", "dst.b", kSmall, true));
  REQUIRE(honest.ok());
  INFO(honest->DebugString());
  REQUIRE(honest->phase() == v1::COMPLETED);
  CHECK(std::memcmp(intact->data, dst_b->data, kSmall) == 0);

  RequireRefused(pair.prefill(), ByteWrite("from-doomed-again", "src.doomed", "dst.a", kSmall, true),
                 "src.doomed");

  // Re-registered from fresh memory, the region moves bytes again.
  REQUIRE(pair.prefill().Deregister({"src.doomed"}).ok());
  auto fresh = ShareEngineMemory(pair.prefill(), "src-fresh", kSmall, 3);
  RegisterRegion(pair.prefill(), "src.doomed", *fresh);
  auto renewed = pair.prefill().Submit(ByteWrite("from-renewed", "src.doomed", "dst.a", kSmall, true));
  REQUIRE(renewed.ok());
  INFO(renewed->DebugString());
  REQUIRE(renewed->phase() == v1::COMPLETED);
  CHECK(std::memcmp(fresh->data, dst_a->data, kSmall) == 0);
  scene.RequireAlive();
  scene.sampler.Report("sender's region truncated");
}

TEST_CASE("the receiver's region truncated: the sender catches it and names the peer's region") {
  FaultScene scene;
  AgentPair& pair = scene.pair;

  auto src = ShareEngineMemory(pair.prefill(), "src", kSmall, 4);
  auto doomed = ShareEngineMemory(pair.decode(), "dst-doomed", kSmall, 0);
  auto intact = ShareEngineMemory(pair.decode(), "dst-intact", kSmall, 0);
  RegisterRegion(pair.prefill(), "src", *src);
  RegisterRegion(pair.decode(), "dst.doomed", *doomed);
  RegisterRegion(pair.decode(), "dst.intact", *intact);

  // A first transfer maps the peer's memory here (shm-direct) and works.
  auto before = pair.prefill().Submit(ByteWrite("before", "src", "dst.doomed", kSmall, true));
  REQUIRE(before.ok());
  REQUIRE(before->phase() == v1::COMPLETED);

  doomed->Truncate();
  auto failed = pair.prefill().Submit(ByteWrite("into-doomed", "src", "dst.doomed", kSmall, true));
  REQUIRE(failed.ok());
  RequireBrokenFailure(*failed, "peer 'decode' region 'dst.doomed'");
  scene.RequireAlive();

  auto honest = pair.prefill().Submit(ByteWrite("into-intact", "src", "dst.intact", kSmall, true));
  REQUIRE(honest.ok());
  INFO(honest->DebugString());
  REQUIRE(honest->phase() == v1::COMPLETED);
  CHECK(std::memcmp(src->data, intact->data, kSmall) == 0);

  RequireRefused(pair.prefill(), ByteWrite("into-doomed-again", "src", "dst.doomed", kSmall, true),
                 "dst.doomed");
  scene.sampler.Report("receiver's region truncated");
}

TEST_CASE("truncation under a big transfer in flight: FAILED or COMPLETED, never a crash") {
  constexpr uint64_t kBig = 128ull << 20;  // 256 pieces of 512 KiB: two 64 MiB batches
  FaultScene scene;
  AgentPair& pair = scene.pair;

  for (const bool sender_side : {true, false}) {
    const std::string tag = sender_side ? "src" : "dst";
    auto src = ShareEngineMemory(pair.prefill(), tag + "-big-src", kBig, 5);
    auto dst = ShareEngineMemory(pair.decode(), tag + "-big-dst", kBig, 0);
    RegisterRegion(pair.prefill(), tag + ".big.src", *src);
    RegisterRegion(pair.decode(), tag + ".big.dst", *dst);
    const std::string id = tag + "-big";
    REQUIRE(pair.prefill()
                .Submit(ByteWrite(id, tag + ".big.src", tag + ".big.dst", kBig, false, 256))
                .ok());
    const absl::Status moving = WaitTransferring(pair.prefill(), id);
    (sender_side ? src : dst)->Truncate();
    auto state = pair.prefill().WaitTransfer(id, 30000);
    REQUIRE(state.ok());
    const std::string message =
        fmt::format("truncated the {} {} TRANSFERRING was seen ({}); it ended {}: {}", tag,
                    moving.ok() ? "once" : "without", moving.message(),
                    v1::TransferPhase_Name(state->phase()), state->error_message());
    fmt::print("{}\n", message);
    INFO(message);
    CHECK((state->phase() == v1::COMPLETED || state->phase() == v1::FAILED));
    if (state->phase() == v1::FAILED) {
      CHECK(state->error_code() == static_cast<int32_t>(absl::StatusCode::kDataLoss));
      CHECK_THAT(state->error_message(), Catch::Contains(tag + ".big."));
    }
    scene.RequireAlive();
  }
  scene.sampler.Report("truncation in flight");
}

}  // namespace
}  // namespace kvagent::testing

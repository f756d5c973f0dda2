// Engines share memory they own with the agent (an unsealed memfd here) and may shrink
// it under the agent. Each access to the lost pages is a SIGBUS; registry::FaultGuard
// must turn it into a failed transfer that names the region, never a dead agent.
// Two real kvagentd processes on one host: data moves shm-direct (the sender maps
// the receiver's memory), so the SENDER catches a fault in the receiver's memory too.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"
#include "tests/limits/status_probe.h"
#include "transport/base/format.h"
#include "transport/base/unique_fd.h"

namespace kvagent::testing {
namespace {

using Clock = std::chrono::steady_clock;

// Memory this process owns, as an engine's: an unsealed memfd (it can shrink), mapped
// here and shared with an agent through its session.
struct EngineMemory {
  UniqueFd fd;
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
  uint64_t handle = 0;

  EngineMemory() = default;
  EngineMemory(const EngineMemory&) = delete;
  EngineMemory& operator=(const EngineMemory&) = delete;
  ~EngineMemory() {
    if (data != nullptr) munmap(data, bytes);
  }
  // Shrinks the file to nothing: every page of it is lost to every mapping. This
  // process does not touch `data` after that.
  void Truncate() { REQUIRE(ftruncate(fd.get(), 0) == 0); }
};

std::unique_ptr<EngineMemory> ShareEngineMemory(cli::AgentClient& agent, const std::string& label,
                                                uint64_t bytes, uint8_t fill) {
  auto memory = std::make_unique<EngineMemory>();
  memory->fd = UniqueFd(memfd_create(label.c_str(), MFD_CLOEXEC));
  REQUIRE(memory->fd.valid());
  REQUIRE(ftruncate(memory->fd.get(), static_cast<off_t>(bytes)) == 0);
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memory->fd.get(), 0);
  REQUIRE(data != MAP_FAILED);
  memory->data = static_cast<uint8_t*>(data);
  memory->bytes = bytes;
  for (uint64_t i = 0; i < bytes; ++i) memory->data[i] = static_cast<uint8_t>(fill + i * 7);
  auto shared = agent.ShareMemory(memory->fd.get(), label);
  INFO(shared.status().ToString());
  REQUIRE(shared.ok());
  memory->handle = shared->handle();
  return memory;
}

void RegisterRegion(cli::AgentClient& agent, const std::string& name, const EngineMemory& memory) {
  v1::RegisterRegionsRequest request;
  auto* spec = request.add_regions();
  spec->set_name(name);
  spec->set_kind(v1::AUX);
  spec->set_memory(v1::DRAM);
  spec->set_length(memory.bytes);
  spec->mutable_layout()->set_num_items(1);
  spec->mutable_layout()->set_item_bytes(memory.bytes);
  spec->mutable_shm()->set_memory_handle(memory.handle);
  auto registered = agent.Register(request);
  INFO(registered.status().ToString());
  REQUIRE(registered.ok());
}

// A WRITE of `local` to `remote` in `pieces` byte segments (so, as many operations:
// several batches for a big transfer), the remote pieces in reverse order.
v1::SubmitTransferRequest ByteWrite(const std::string& id, const std::string& local,
                                    const std::string& remote, uint64_t bytes, bool wait,
                                    uint32_t pieces = 1) {
  v1::SubmitTransferRequest request;
  request.set_transfer_id(id);
  request.set_peer("decode");
  request.set_op(v1::WRITE);
  request.set_wait(wait);
  request.set_timeout_ms(20000);
  const uint64_t piece = bytes / pieces;
  for (uint32_t i = 0; i < pieces; ++i) {
    auto* segment = request.add_segments()->mutable_bytes();
    segment->set_local_region(local);
    segment->set_local_offset(i * piece);
    segment->set_remote_region(remote);
    segment->set_remote_offset((pieces - 1 - i) * piece);
    segment->set_length(piece);
  }
  return request;
}

uint32_t Pid(cli::AgentClient& agent) {
  auto status = agent.Status();
  INFO(status.status().ToString());
  REQUIRE(status.ok());
  return status->pid();
}

void RequireBrokenFailure(const v1::TransferState& state, const std::string& names) {
  INFO(state.DebugString());
  REQUIRE(state.phase() == v1::FAILED);
  CHECK(state.error_code() == static_cast<int32_t>(absl::StatusCode::kDataLoss));
  CHECK_THAT(state.error_message(), Catch::Contains(names));
  CHECK_THAT(state.error_message(), Catch::Contains("broken"));
  CHECK_THAT(state.error_message(), Catch::Contains("truncated"));
  CHECK_THAT(state.error_message(), Catch::Contains("re-register"));
}

// A later transfer touching broken memory: refused at submit, or failed naming it.
void RequireRefused(cli::AgentClient& agent, const v1::SubmitTransferRequest& request,
                    const std::string& names) {
  auto again = agent.Submit(request);
  if (again.ok()) {
    INFO(again->DebugString());
    REQUIRE(again->phase() == v1::FAILED);
    CHECK_THAT(again->error_message(), Catch::Contains(names));
    CHECK_THAT(again->error_message(), Catch::Contains("broken"));
  } else {
    INFO(again.status().ToString());
    CHECK(again.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(again.status().message()), Catch::Contains(names));
    CHECK_THAT(std::string(again.status().message()), Catch::Contains("broken"));
  }
}

void RequireShmDirect(cli::AgentClient& prefill) {
  auto peers = prefill.Peers();
  REQUIRE(peers.ok());
  REQUIRE(peers->peers_size() == 1);
  // Otherwise the bytes would move by UCX and the case would test something else.
  REQUIRE(peers->peers(0).data_path() == "shm-direct");
}


// Two agents on one host (data shm-direct), GetStatus sampled on the sender while the
// case runs, and both pids, to tell a restarted agent from one that lived.
struct Scene {
  AgentPair pair;
  StatusProbe sampler{{pair.prefill_process().address()}, 2};
  const uint32_t prefill_pid = Pid(pair.prefill());
  const uint32_t decode_pid = Pid(pair.decode());

  Scene() { RequireShmDirect(pair.prefill()); }
  void RequireAlive() {
    CHECK(Pid(pair.prefill()) == prefill_pid);
    CHECK(Pid(pair.decode()) == decode_pid);
  }
};

constexpr uint64_t kSmall = 1 << 20;

TEST_CASE("the sender's own region truncated: the transfer fails naming it, the agent lives") {
  Scene scene;
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
  Scene scene;
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
  Scene scene;
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

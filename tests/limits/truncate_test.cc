// Engines share memory they own with the agent (an unsealed memfd here) and may shrink
// it under the agent. Each access to the lost pages is a SIGBUS; registry::FaultGuard
// must turn it into a failed transfer that names the region, never a dead agent.
// Two real kvagentd processes on one host: data moves shm-direct (the sender maps
// the receiver's memory), so the SENDER catches a fault in the receiver's memory too.
// The tcp cases move it as the agents' own active messages (data path ucx-am, as
// between hosts without RDMA): there the RECEIVER copies each chunk in, and the agent
// whose memory a READ reads copies it out, so each side catches its own faults.
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

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

// The agent maps an engine's object whole. A sparse memfd larger than RAM costs the
// engine nothing; truncated under a copy, the guard replaces the rest of that mapping
// with zero pages, and such a mapping (tens of GiB) would be refused if it counted as
// committed memory: the SIGBUS would then kill the agent.
uint64_t LargerThanMemory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0, total = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemTotal:" || key == "SwapTotal:") total += kib * 1024;
  }
  REQUIRE(total > 0);
  return std::max<uint64_t>(uint64_t{64} << 30, (2 * total + (1 << 30)) & ~uint64_t{(1 << 30) - 1});
}

TEST_CASE("a sparse object larger than memory truncated under the agent: the transfer fails, the agent lives") {
  FaultScene scene;
  AgentPair& pair = scene.pair;
  const uint64_t size = LargerThanMemory();
  UniqueFd fd(memfd_create("sparse", MFD_CLOEXEC));
  REQUIRE(fd.valid());
  REQUIRE(ftruncate(fd.get(), static_cast<off_t>(size)) == 0);
  auto sparse = ShareDescriptor(pair.prefill(), std::move(fd), "sparse", size, -1);
  for (uint64_t i = 0; i < kSmall; ++i) sparse->data[i] = static_cast<uint8_t>(i * 13);
  v1::RegisterRegionsRequest request = WholeRegion("src.sparse", *sparse);
  request.mutable_regions(0)->set_length(kSmall);
  request.mutable_regions(0)->mutable_layout()->set_item_bytes(kSmall);
  auto registered = pair.prefill().Register(request);
  INFO(registered.status().ToString());
  REQUIRE(registered.ok());
  auto dst = SharedRegion(pair.decode(), "dst.sparse", kSmall, 0);
  auto before = pair.prefill().Submit(ByteWrite("sparse-before", "src.sparse", "dst.sparse", kSmall, true));
  REQUIRE(before.ok());
  REQUIRE(before->phase() == v1::COMPLETED);
  CHECK(std::memcmp(sparse->data, dst->data, kSmall) == 0);
  std::printf("sparse object of %llu GiB, a 1 MiB region of it\n",
              static_cast<unsigned long long>(size >> 30));

  sparse->Truncate();
  auto failed = pair.prefill().Submit(ByteWrite("sparse-after", "src.sparse", "dst.sparse", kSmall, true));
  INFO(failed.status().ToString());
  REQUIRE(failed.ok());
  RequireBrokenFailure(*failed, "local region 'src.sparse'");
  scene.RequireAlive();
  scene.sampler.Report("sparse object truncated");
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

// A big WRITE (256 pieces of 512 KiB: several batches) whose source (then whose
// destination) is truncated once it moves: FAILED naming the region, or COMPLETED if it
// won the race, never a crash.
void TruncateInFlight(FaultScene& scene, const std::string& label) {
  constexpr uint64_t kBig = 128ull << 20;
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
        fmt::format("{}: truncated the {} {} TRANSFERRING was seen ({}); it ended {}: {}", label,
                    tag, moving.ok() ? "once" : "without", moving.message(),
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
  scene.sampler.Report(label);
}

TEST_CASE("truncation under a big transfer in flight: FAILED or COMPLETED, never a crash") {
  FaultScene scene;
  TruncateInFlight(scene, "truncation in flight");
}

// Peer error mode: UCX serves the endpoint over tcp, which has no RMA of its own, so
// data moves as the agents' eager messages; no same-host mapping.
AgentPairOptions TcpPair() {
  AgentPairOptions options;
  options.extra_args = {"--ucx-error-mode", "peer", "--shm-direct", "off"};
  return options;
}

// The incoming record on the receiver of transfer `id`: it ended as the sender says.
// The sender's outcome reaches the receiver by message, after the sender answered its
// client: the record may not be there yet (NOT_FOUND, when the sender failed before
// anything of it was sent) or not ended yet (TRANSFERRING).
void RequireIncomingFailed(AgentPair& pair, const std::string& id) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto incoming = pair.decode().Get(id, "prefill");
  while (((!incoming.ok() && incoming.status().code() == absl::StatusCode::kNotFound) ||
          (incoming.ok() && incoming->phase() == v1::TRANSFERRING)) &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    incoming = pair.decode().Get(id, "prefill");
  }
  INFO(id << ": " << incoming.status().ToString());
  REQUIRE(incoming.ok());
  INFO(incoming->DebugString());
  CHECK(incoming->phase() == v1::FAILED);
}

// `dst` holds the four quarters of `src` in reverse order (ByteWrite with 4 pieces).
void CheckReversed(const EngineMemory& src, const EngineMemory& dst) {
  const uint64_t q = kSmall / 4;
  for (uint64_t i = 0; i < 4; ++i) {
    INFO("quarter " << i);
    CHECK(std::memcmp(src.data + i * q, dst.data + (3 - i) * q, q) == 0);
  }
}

// A 4-piece WRITE of kSmall bytes, waited for: it must complete.
void RequireWritten(AgentPair& pair, const std::string& id, const std::string& local,
                    const std::string& remote) {
  auto written = pair.prefill().Submit(ByteWrite(id, local, remote, kSmall, true, 4));
  REQUIRE(written.ok());
  INFO(written->DebugString());
  REQUIRE(written->phase() == v1::COMPLETED);
}

TEST_CASE("over tcp (ucx-am): a region truncated on either side fails its WRITE or READ naming "
          "it, both agents live") {
  FaultScene scene(TcpPair(), "ucx-am");
  AgentPair& pair = scene.pair;

  // prefill: src.ok, src.w (WRITE from it), src.r (READ into it); decode: dst.ok, dst.w
  // (WRITE into it), dst.r (READ from it).
  auto src_ok = SharedRegion(pair.prefill(), "src.ok", kSmall, 11);
  auto src_w = SharedRegion(pair.prefill(), "src.w", kSmall, 12);
  auto src_r = SharedRegion(pair.prefill(), "src.r", kSmall, 0);
  auto dst_ok = SharedRegion(pair.decode(), "dst.ok", kSmall, 0);
  auto dst_w = SharedRegion(pair.decode(), "dst.w", kSmall, 0);
  auto dst_r = SharedRegion(pair.decode(), "dst.r", kSmall, 13);

  // Every one of these regions moves bytes over tcp before anything is truncated.
  RequireWritten(pair, "warm-w", "src.w", "dst.w");
  RequireWritten(pair, "warm-ok", "src.ok", "dst.ok");
  auto warm_read = pair.prefill().Submit(ByteRead("warm-r", "src.r", "dst.r", kSmall, true, 4));
  REQUIRE(warm_read.ok());
  INFO(warm_read->DebugString());
  REQUIRE(warm_read->phase() == v1::COMPLETED);
  CheckReversed(*src_ok, *dst_ok);

  src_w->Truncate();
  src_r->Truncate();
  dst_w->Truncate();
  dst_r->Truncate();

  // The sender's own source: caught copying it into the bounce buffer.
  auto from = pair.prefill().Submit(ByteWrite("from-truncated", "src.w", "dst.ok", kSmall, true, 4));
  REQUIRE(from.ok());
  fmt::print("WRITE from a truncated region over tcp: {}\n", from->error_message());
  RequireBrokenFailure(*from, "local region 'src.w'");
  RequireIncomingFailed(pair, "from-truncated");

  // The receiver's destination: caught by the receiver copying the chunk in; it refuses
  // DATA_READY and the sender's transfer fails with its reason.
  auto into = pair.prefill().Submit(ByteWrite("into-truncated", "src.ok", "dst.w", kSmall, true, 4));
  REQUIRE(into.ok());
  fmt::print("WRITE into a truncated region over tcp: {}\n", into->error_message());
  RequireBrokenFailure(*into, "dst.w");
  CHECK_THAT(into->error_message(), Catch::Contains("did not take the data"));
  RequireIncomingFailed(pair, "into-truncated");

  // A READ of the peer's truncated memory: caught by the peer copying it out.
  auto read_from = pair.prefill().Submit(ByteRead("read-truncated", "src.ok", "dst.r", kSmall, true, 4));
  REQUIRE(read_from.ok());
  fmt::print("READ from a truncated region over tcp: {}\n", read_from->error_message());
  RequireBrokenFailure(*read_from, "dst.r");
  CHECK_THAT(read_from->error_message(),
             Catch::Contains("refused the data it served") && Catch::Contains("read from there"));
  RequireIncomingFailed(pair, "read-truncated");

  // A READ into our own truncated memory: caught placing the replies.
  auto read_into = pair.prefill().Submit(ByteRead("read-into-truncated", "src.r", "dst.ok", kSmall, true, 4));
  REQUIRE(read_into.ok());
  fmt::print("READ into a truncated region over tcp: {}\n", read_into->error_message());
  RequireBrokenFailure(*read_into, "local region 'src.r'");
  RequireIncomingFailed(pair, "read-into-truncated");
  scene.RequireAlive();

  // Intact memory still moves every byte both ways.
  std::memset(dst_ok->data, 0x5A, kSmall);
  RequireWritten(pair, "honest-w", "src.ok", "dst.ok");
  CheckReversed(*src_ok, *dst_ok);
  auto back = SharedRegion(pair.prefill(), "src.back", kSmall, 0);
  auto honest_read = pair.prefill().Submit(ByteRead("honest-r", "src.back", "dst.ok", kSmall, true, 4));
  REQUIRE(honest_read.ok());
  INFO(honest_read->DebugString());
  REQUIRE(honest_read->phase() == v1::COMPLETED);
  CHECK(std::memcmp(back->data, src_ok->data, kSmall) == 0);  // reversed twice

  // Later transfers naming the broken regions are refused (or fail naming them).
  RequireRefused(pair.prefill(), ByteWrite("from-again", "src.w", "dst.ok", kSmall, true), "src.w");
  RequireRefused(pair.prefill(), ByteWrite("into-again", "src.ok", "dst.w", kSmall, true), "dst.w");
  scene.RequireAlive();
  scene.sampler.Report("over tcp: regions truncated on either side");
}

TEST_CASE("over tcp (ucx-am): truncation under a big transfer in flight, never a crash") {
  FaultScene scene(TcpPair(), "ucx-am");
  TruncateInFlight(scene, "over tcp: truncation in flight");
}

// True when the address space of process `pid` maps `address` from the file whose
// inode is `inode` (/proc/PID/maps). The inode, not the address alone: once the region
// is unmapped the agent may map something else there (a thread's stack, a heap).
bool MapsFile(uint32_t pid, uint64_t address, uint64_t inode) {
  std::ifstream maps(fmt::format("/proc/{}/maps", pid));
  std::string line;
  while (std::getline(maps, line)) {
    unsigned long start = 0, end = 0, ino = 0;  // perms, offset and device skipped
    if (std::sscanf(line.c_str(), "%lx-%lx %*s %*x %*x:%*x %lu", &start, &end, &ino) == 3 &&
        start <= address && address < end && ino == inode) {
      return true;
    }
  }
  return false;
}

// Engine memory is the engine's again once DeregisterRegions answers: the receiver of
// chunks over tcp looks each one up in an index of its regions, which must not keep a
// deregistered one (and its mapping) alive past the answer. Several rounds: the index
// is let go on the receiver's worker thread, and a reply that did not wait for it
// raced it (seen under CI's load).
TEST_CASE("over tcp (ucx-am): once DeregisterRegions answers, the receiver maps the region no "
          "more") {
  FaultScene scene(TcpPair(), "ucx-am");
  AgentPair& pair = scene.pair;
  auto src = SharedRegion(pair.prefill(), "src.d", kSmall, 21);
  for (int round = 0; round < 8; ++round) {
    INFO("round " << round);
    const std::string name = fmt::format("dst.d{}", round);
    auto dst = SharedRegion(pair.decode(), name, kSmall, 0);
    RequireWritten(pair, fmt::format("into-dst-d{}", round), "src.d", name);
    CheckReversed(*src, *dst);

    auto regions = pair.decode().Regions();
    REQUIRE(regions.ok());
    uint64_t base = 0;
    for (const auto& r : regions->regions()) {
      if (r.spec().name() == name) base = r.base_address();
    }
    REQUIRE(base != 0);
    struct stat st {};
    REQUIRE(fstat(dst->fd.get(), &st) == 0);
    REQUIRE(MapsFile(scene.decode_pid, base, st.st_ino));
    REQUIRE(pair.decode().Deregister({name}).ok());
    CHECK_FALSE(MapsFile(scene.decode_pid, base, st.st_ino));
  }
  scene.RequireAlive();
}

}  // namespace
}  // namespace kvagent::testing

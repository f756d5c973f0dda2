// Limits, tried as a careless or hostile client would: two real kvagentd processes,
// each pushed past one limit (small ones, or the load where it is cheap:
// 100,000 queued notifications, 2,000 ConnectPeer to a silent peer; a fifth of that
// under sanitizers). In every case the refusal is RESOURCE_EXHAUSTED naming the
// limit, its value and its flag; nothing already registered or in flight is lost;
// GetStatus keeps answering (its latency, sampled all along, is printed and loosely
// asserted); an honest transfer still completes byte-exact afterwards; GetStatus
// counts the refusals; after a load, the agent's RssAnon comes back within a stated
// bound (printed; checked in the normal build).
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/process_memory.h"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"
#include "tests/limits/pair_checks.h"
#include "tests/limits/status_probe.h"
#include "tests/unit/catch_main.h"

namespace kvagent::testing {
namespace {

using Catch::Matchers::Contains;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

uint64_t Refused(cli::AgentClient& client, const std::string& limit) {
  auto status = client.Status();
  REQUIRE(status.ok());
  const v1::LimitState* found = FindLimit(*status, limit);
  REQUIRE(found != nullptr);
  return found->refused();
}

// Every refusal names the limit, its flag and the docs.
void CheckRefusal(const absl::Status& status, const std::string& limit, const std::string& flag) {
  INFO(status.ToString());
  CHECK(status.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(Message(status), Contains("limit " + limit) && Contains(flag) &&
                                  Contains("docs/LIMITS.md"));
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
// Sanitizer builds run the same paths at a fifth of the load (several times slower).
constexpr int kQueueLimit = 20000, kQueueTransfers = 22000, kConnects = 1000;
#else
// The figures: 100,000 queued notifications, 2,000 bogus connects.
constexpr int kQueueLimit = 100000, kQueueTransfers = 110000, kConnects = 2000;
#endif

// One fill of the queue: `count` one-page WRITEs with a notification each, `per_call`
// per SubmitTransfers (each page written once per call). Returns the ids that
// completed; the refused ones (their sender's transfer FAILED naming the limit), in
// submission order, to `failed`.
std::set<std::string> FillQueue(AgentPair& pair, const std::string& prefix, int count,
                                int per_call, std::vector<std::string>* failed) {
  std::set<std::string> completed;
  for (int base = 0; base < count; base += per_call) {
    v1::SubmitTransfersRequest batch;
    batch.set_wait(true);
    for (int i = base; i < std::min(base + per_call, count); ++i) {
      const uint64_t page = static_cast<uint64_t>(i - base);
      *batch.add_transfers() =
          KvWrite(fmt::format("{}{}", prefix, i), {page}, {page}, fmt::format("p{}", i));
    }
    auto results = pair.prefill().SubmitBatch(batch);
    REQUIRE(results.ok());
    for (const auto& r : results->results()) {
      INFO(r.error_message());
      REQUIRE(r.error_code() == 0);
      if (r.state().phase() == v1::COMPLETED) {
        completed.insert(r.state().transfer_id());
        continue;
      }
      // The receiver refused its acknowledgement: the sender's transfer fails with why.
      REQUIRE(r.state().phase() == v1::FAILED);
      REQUIRE(r.state().error_code() == static_cast<int>(absl::StatusCode::kResourceExhausted));
      REQUIRE_THAT(r.state().error_message(),
                   Contains("queued_notifications") && Contains("--max-queued-notifications"));
      failed->push_back(r.state().transfer_id());
    }
  }
  return completed;
}

// Polls until the queue is empty; what was delivered, by transfer id.
std::multiset<std::string> TakeQueue(AgentPair& pair) {
  std::multiset<std::string> delivered;
  for (;;) {
    auto polled = pair.decode().Poll(10000);
    REQUIRE(polled.ok());
    if (polled->notifications_size() == 0) return delivered;
    for (const auto& n : polled->notifications()) {
      REQUIRE(n.kind() == v1::DATA_READY);
      delivered.insert(n.transfer_id());
    }
  }
}

TEST_CASE("a full notification queue refuses new transfers back to their sender; none is lost") {
  constexpr int kPerCall = 128;
  AgentPairOptions options = WithArgs({"--max-queued-notifications", std::to_string(kQueueLimit)});
  options.shape.pages = kPerCall;
  AgentPair pair(options);
  StatusProbe probe({pair.prefill_process().address(), pair.decode_process().address()});
  const pid_t decode_pid = pair.decode_process().pid();
  const uint64_t rss_before = RssAnon(decode_pid);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> failed;
  const std::set<std::string> completed =
      FillQueue(pair, "n", kQueueTransfers, kPerCall, &failed);
  std::printf("queue limit %d: %d transfers in %.1f s, %zu completed, %zu refused back to the "
              "sender\n",
              kQueueLimit, kQueueTransfers, MillisSince(start) / 1000.0, completed.size(),
              failed.size());
  CHECK(completed.size() == kQueueLimit);
  CHECK(failed.size() == kQueueTransfers - kQueueLimit);

  // Room was reserved at each acknowledgement; a notification is queued when its
  // sender's commit arrives, a moment after the sender reported COMPLETED.
  absl::StatusOr<v1::AgentStatus> status;
  for (int i = 0; i < 2500; ++i) {
    status = pair.decode().Status();
    REQUIRE(status.ok());
    if (status->notifications_queued() == kQueueLimit) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  CHECK(status->notifications_queued() == kQueueLimit);
  CHECK(FindLimit(*status, "queued_notifications")->refused() == kQueueTransfers - kQueueLimit);
  CHECK(FindLimit(*status, "queued_notifications")->in_use() == kQueueLimit);
  const uint64_t rss_full = RssAnon(decode_pid);

  // Every completed transfer's notification is there, once; no refused one is.
  const std::multiset<std::string> delivered = TakeQueue(pair);
  CHECK(delivered.size() == completed.size());
  CHECK(std::set<std::string>(delivered.begin(), delivered.end()) == completed);
  // The receiver's own record says why the others failed (it keeps the last 10,000).
  auto incoming = pair.decode().Get(failed.back(), "prefill");
  REQUIRE(incoming.ok());
  CHECK(incoming->phase() == v1::FAILED);
  CHECK_THAT(incoming->error_message(), Contains("queued_notifications"));

  // What stays: the 10,000 ended incoming records kept for queries (~9 MB of heap in
  // use), scattered over the pages the queue had used, so glibc can give back little
  // of the free memory around them (the agent trims what it can). Measured after
  // 100,000: +41 to +65 MiB, about the peak; so the bound is loose.
  const std::string what = fmt::format("{} queued notifications, taken", kQueueLimit);
  CheckRssBack(what, decode_pid, rss_before, rss_full, 96u << 20);
  // Not a leak: half the load again reuses that memory.
  const uint64_t rss_first = RssAnon(decode_pid);
  std::vector<std::string> failed_again;
  CHECK(FillQueue(pair, "again", kQueueLimit / 2, kPerCall, &failed_again).size() ==
        kQueueLimit / 2);
  const uint64_t rss_full_again = RssAnon(decode_pid);
  CHECK(TakeQueue(pair).size() == kQueueLimit / 2);
  CheckRssBack(what + " again", decode_pid, rss_first, rss_full_again, 8u << 20);
  HonestWrite(pair, "after-queue", 3, 4);
  probe.Report(fmt::format("{} queued notifications, then {}", kQueueLimit, kQueueLimit / 2));
}

// An ended transfer's record stays for queries (the engine keeps the last 10,000), but
// not its notification payload: that went to the peer with DATA_READY. Each record
// used to keep it, so 10,000 transfers with 64 KiB notifications (the largest
// allowed) held 625 MiB until they aged out; here 2,048 with 32 KiB would hold 64 MiB.
TEST_CASE("ended transfers kept for queries do not keep their notification payloads") {
  constexpr int kPerCall = 32, kTransfers = 2048;
  AgentPairOptions options;
  options.shape.pages = kPerCall;
  AgentPair pair(options);
  const pid_t prefill_pid = pair.prefill_process().pid();
  const uint64_t rss_before = RssAnon(prefill_pid);
  uint64_t rss_peak = rss_before;
  const std::string payload(32 << 10, 'n');  // under --max-notification-bytes (64 KiB)
  size_t delivered = 0;
  auto take = [&] {
    for (;;) {
      auto polled = pair.decode().Poll(1000);
      REQUIRE(polled.ok());
      if (polled->notifications_size() == 0) return;
      for (const auto& n : polled->notifications()) {
        REQUIRE(n.kind() == v1::DATA_READY);
        REQUIRE(n.payload() == payload);
        ++delivered;
      }
    }
  };
  for (int base = 0; base < kTransfers; base += kPerCall) {
    v1::SubmitTransfersRequest batch;
    batch.set_wait(true);
    for (int i = base; i < base + kPerCall; ++i) {
      const uint64_t page = static_cast<uint64_t>(i - base);
      *batch.add_transfers() = KvWrite(fmt::format("big-note{}", i), {page}, {page}, payload);
    }
    auto results = pair.prefill().SubmitBatch(batch);
    REQUIRE(results.ok());
    for (const auto& r : results->results()) {
      INFO(r.error_message());
      REQUIRE(r.state().phase() == v1::COMPLETED);
    }
    rss_peak = std::max(rss_peak, RssAnon(prefill_pid));
    take();  // the receiver's queue holds each payload until taken; not measured here
  }
  // A notification is queued when its sender's commit arrives, just after COMPLETED.
  for (int i = 0; i < 500 && delivered < kTransfers; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    take();
  }
  CHECK(delivered == kTransfers);
  // Every record still answers (the first one too: 2,048 is under the 10,000 kept).
  auto first = pair.prefill().Get("big-note0");
  REQUIRE(first.ok());
  CHECK(first->phase() == v1::COMPLETED);
  auto transfers = pair.prefill().Transfers(false);
  REQUIRE(transfers.ok());
  CHECK(transfers->transfers_size() == kTransfers);
  // Measured: +71.5 MiB with the payloads kept; without, +11 to +19 MiB (the records,
  // ~2 KiB each, and heap the 1 MiB requests left scattered; 10 s later, +11).
  CheckRssBack("2,048 ended transfers with 32 KiB notifications", prefill_pid, rss_before,
               rss_peak, 32u << 20);
  HonestWrite(pair, "after-big-notes", 1, 2);
}

TEST_CASE("a chunk that would expand past ops_per_chunk is refused before it is built") {
  AgentPair pair(WithArgs({"--max-ops-per-chunk", "100000"}));
  StatusProbe probe({pair.prefill_process().address(), pair.decode_process().address()});
  const uint64_t rss_before = cli::ReadProcessMemory(pair.prefill_process().pid())->rss_anon;
  // 8 regions x 100,000 copies of index 0: 800,000 operations from a ~200 KB request.
  std::vector<uint64_t> zeros(100000, 0);
  auto refused = pair.prefill().Submit(KvWrite("amplified", zeros, zeros));
  CheckRefusal(refused.status(), "ops_per_chunk", "--max-ops-per-chunk");
  CHECK_THAT(Message(refused.status()), Contains("800000 operations"));
  const uint64_t rss_after = cli::ReadProcessMemory(pair.prefill_process().pid())->rss_anon;
  std::printf("amplified chunk refused: prefill RssAnon %.1f -> %.1f MiB\n", rss_before / 1048576.0,
              rss_after / 1048576.0);
  CHECK(rss_after < rss_before + (16u << 20));
  CHECK(Refused(pair.prefill(), "ops_per_chunk") == 1);
  auto transfers = pair.prefill().Transfers(false);
  REQUIRE(transfers.ok());
  CHECK(transfers->transfers_size() == 0);  // nothing was created
  HonestWrite(pair, "after-amplified", 1, 2);
  probe.Report("plan amplification");
}

TEST_CASE("regions: a batch past regions_per_owner is refused whole; long error texts stay bounded") {
  AgentPair pair(WithArgs({"--max-regions-per-owner", "40"}));
  auto memory = pair.prefill().AllocateMemory("many", 1 << 20);
  REQUIRE(memory.ok());
  auto batch = [&](int count, const std::string& prefix, uint64_t item_bytes) {
    v1::RegisterRegionsRequest request;
    for (int i = 0; i < count; ++i) {
      auto* spec = request.add_regions();
      spec->set_name(fmt::format("{}{}", prefix, i));
      spec->set_kind(v1::AUX);
      spec->set_memory(v1::DRAM);
      spec->mutable_shm()->set_memory_handle(memory->info.handle());
      spec->mutable_shm()->set_offset(static_cast<uint64_t>(i) * 4096);
      spec->set_length(4096);
      spec->mutable_layout()->set_num_items(1);
      spec->mutable_layout()->set_item_bytes(item_bytes);
    }
    return pair.prefill().Register(request);
  };
  const int before = pair.prefill().Regions()->regions_size();  // the pool's 8
  auto refused = batch(40, "r", 4096);
  CheckRefusal(refused.status(), "regions_per_owner", "--max-regions-per-owner");
  CHECK(pair.prefill().Regions()->regions_size() == before);  // nothing of the batch
  auto fits = batch(40 - before, "ok", 4096);
  INFO(fits.status().ToString());
  CHECK(fits.ok());
  CHECK(Refused(pair.prefill(), "regions_per_owner") == 1);
  auto counted = pair.prefill().Status();
  REQUIRE(counted.ok());
  CHECK(counted->regions() == 40);
  CHECK(FindLimit(*counted, "regions")->in_use() == 40);
  CHECK(FindLimit(*counted, "regions_per_owner")->in_use() == 40);
  CHECK(FindLimit(*counted, "metadata_bytes")->in_use() > 40 * 100);

  // 200 bad entries: one line each, far over gRPC's trailer; the client still gets
  // INVALID_ARGUMENT and the start of the text, not gRPC's own RESOURCE_EXHAUSTED.
  auto long_error = batch(200, "bad-item-size-", 0);
  INFO(long_error.status().ToString().substr(0, 300));
  CHECK(long_error.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(long_error.status().message().size() <= 4096);
  CHECK_THAT(Message(long_error.status()), Contains("bad-item-size-0") && Contains("more bytes cut"));
  HonestWrite(pair, "after-regions", 5, 6);
}

TEST_CASE("allocations are counted across calls and given back by FreeMemory") {
  AgentPair pair(WithArgs({"--max-allocated-bytes", "96M"}));
  // The pools took some already (each agent allocated its own pool).
  auto start = pair.prefill().Status();
  REQUIRE(start.ok());
  const uint64_t held = FindLimit(*start, "allocated_bytes")->in_use();
  CHECK(held > 0);
  auto a = pair.prefill().AllocateMemory("a", 40u << 20);
  REQUIRE(a.ok());
  auto b = pair.prefill().AllocateMemory("b", 40u << 20);
  REQUIRE(b.ok());
  auto c = pair.prefill().AllocateMemory("c", 40u << 20);
  CheckRefusal(c.status(), "allocated_bytes", "--max-allocated-bytes");
  auto session = pair.prefill().Session();
  REQUIRE(session.ok());
  REQUIRE((*session)->FreeMemory(a->info.handle()).ok());
  a->mapping = registry::ShmMapping();
  auto again = pair.prefill().AllocateMemory("c", 40u << 20);
  INFO(again.status().ToString());
  CHECK(again.ok());
  auto now = pair.prefill().Status();
  REQUIRE(now.ok());
  CHECK(FindLimit(*now, "allocated_bytes")->in_use() == held + (80u << 20));
  HonestWrite(pair, "after-allocations", 7, 8);
}

// Every memory handle holds a descriptor in the agent: a session sharing one memfd
// again and again would fill the agent's descriptor table, and every engine's calls,
// UCX and the rings would then fail. Bounded per session and in all; freed handles and
// a session's end give them back.
TEST_CASE("memory handles are bounded per session and in all; free and a session's end give them back") {
  AgentPair pair(WithArgs({"--max-memory-handles-per-session", "8", "--max-memory-handles", "14"}));
  const int fd = memfd_create("handles", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(ftruncate(fd, 1 << 20) == 0);
  auto share = [fd](cli::AgentClient& client, int i) {
    return client.ShareMemory(fd, fmt::format("again.{}", i));
  };
  // Each agent's pool is one handle of its client's session already.
  std::vector<uint64_t> handles;
  for (int i = 0; i < 7; ++i) {
    auto shared = share(pair.prefill(), i);
    INFO(shared.status().ToString());
    REQUIRE(shared.ok());
    handles.push_back(shared->handle());
  }
  CheckRefusal(share(pair.prefill(), 7).status(), "memory_handles_per_session",
               "--max-memory-handles-per-session");
  // Another engine's session still shares, up to the agent's bound (8 held + 6).
  auto other = std::make_unique<cli::AgentClient>(pair.prefill_process().address());
  for (int i = 0; i < 6; ++i) {
    auto shared = share(*other, i);
    INFO(shared.status().ToString());
    REQUIRE(shared.ok());
  }
  CheckRefusal(share(*other, 6).status(), "memory_handles", "--max-memory-handles");
  auto status = pair.prefill().Status();
  REQUIRE(status.ok());
  CHECK(FindLimit(*status, "memory_handles")->in_use() == 14);
  CHECK(FindLimit(*status, "memory_handles_per_session")->in_use() == 8);
  CHECK(FindLimit(*status, "memory_handles")->refused() == 1);
  CHECK(FindLimit(*status, "memory_handles_per_session")->refused() == 1);
  // Free gives one back; so does the end of the other session (all six).
  auto session = pair.prefill().Session();
  REQUIRE(session.ok());
  REQUIRE((*session)->FreeMemory(handles[0]).ok());
  CHECK(share(*other, 7).ok());
  CheckRefusal(share(pair.prefill(), 8).status(), "memory_handles", "--max-memory-handles");
  other.reset();
  // Its end reaches the agent a moment after its socket closes.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  absl::StatusOr<v1::MemoryHandleInfo> shared;
  do {
    shared = share(pair.prefill(), 100);
  } while (!shared.ok() && std::chrono::steady_clock::now() < deadline);
  INFO(shared.status().ToString());
  REQUIRE(shared.ok());
  CheckRefusal(share(pair.prefill(), 101).status(), "memory_handles_per_session",
               "--max-memory-handles-per-session");
  close(fd);
  HonestWrite(pair, "after-handles", 7, 8);
}

uint64_t VmSizeKib(uint32_t pid) {
  std::ifstream status(fmt::format("/proc/{}/status", pid));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7));
  }
  FAIL("no VmSize in /proc/" << pid << "/status");
  return 0;
}

// An object is mapped whole. A sparse memfd of 768 GiB costs an engine nothing; two or
// three such objects with one 4 KiB region each took the agent's address space (128
// TiB) before --max-mapped-bytes bounded what it maps.
TEST_CASE("sparse objects past --max-mapped-bytes are refused; the agent's address space stays bounded") {
  constexpr uint64_t kBound = uint64_t{1} << 40;
  constexpr uint64_t kObject = uint64_t{768} << 30;
  AgentPair pair(WithArgs({"--max-mapped-bytes", std::to_string(kBound)}));
  auto status = pair.prefill().Status();
  REQUIRE(status.ok());
  const uint32_t pid = status->pid();
  const uint64_t before_kib = VmSizeKib(pid);
  std::vector<int> fds;
  std::vector<absl::Status> results;
  for (int i = 0; i < 3; ++i) {
    const int fd = memfd_create("sparse", MFD_CLOEXEC);
    REQUIRE(fd >= 0);
    fds.push_back(fd);
    REQUIRE(ftruncate(fd, static_cast<off_t>(kObject)) == 0);
    auto shared = pair.prefill().ShareMemory(fd, fmt::format("sparse.{}", i));
    INFO(shared.status().ToString());
    REQUIRE(shared.ok());
    v1::RegisterRegionsRequest request;
    *request.add_regions() = AuxRegion(fmt::format("sparse.{}", i), shared->handle(), 0, 4096);
    results.push_back(pair.prefill().Register(request).status());
  }
  INFO(results[0].ToString());
  CHECK(results[0].ok());
  for (int i = 1; i < 3; ++i) {
    INFO(results[i].ToString());
    CHECK(results[i].code() == absl::StatusCode::kResourceExhausted);
    CHECK_THAT(Message(results[i]), Contains("sparse." + std::to_string(i)) &&
                                        Contains("--max-mapped-bytes") && Contains("mapped whole"));
  }
  const uint64_t grown_kib = VmSizeKib(pid) - before_kib;
  std::printf("prefill's VmSize grew %.1f GiB (bound %.0f GiB)\n", grown_kib / 1048576.0,
              kBound / 1073741824.0);
  CHECK(grown_kib * 1024 < kBound);
  for (int fd : fds) close(fd);
  HonestWrite(pair, "after-sparse", 7, 8);
}

// A same-host peer's memory objects mapped here are bounded per peer: each takes one of
// this process's 65,536 guarded mappings, which our own engines' regions need too.
// With --max-peer-memory-objects 1, decode's pool object maps and a second object's
// region moves through UCX (named in the peer's fallbacks), byte-exact.
TEST_CASE("a same-host peer's memory objects mapped here are bounded; the rest move by UCX") {
  AgentPair pair(WithArgs({"--max-peer-memory-objects", "1"}));
  constexpr uint64_t kBytes = 4096;
  auto extra = pair.decode().AllocateMemory("extra", kBytes);
  REQUIRE(extra.ok());
  auto source = pair.prefill().AllocateMemory("source", kBytes);
  REQUIRE(source.ok());
  auto* bytes = static_cast<uint8_t*>(source->mapping.data());
  for (uint64_t i = 0; i < kBytes; ++i) bytes[i] = static_cast<uint8_t>(i * 13 + 1);
  auto aux = [](const std::string& name, uint64_t handle) {
    v1::RegisterRegionsRequest request;
    *request.add_regions() = AuxRegion(name, handle, 0, kBytes);
    return request;
  };
  auto added = pair.decode().Register(aux("extra.0", extra->info.handle()));
  REQUIRE(added.ok());
  REQUIRE(pair.prefill().Register(aux("source", source->info.handle())).ok());
  // prefill's view of decode: the pool maps, extra.0 falls back with the reason.
  auto view = WaitPeerVersion(pair.prefill(), added->version(), 20000);
  INFO(view.status().ToString());
  REQUIRE(view.ok());
  const v1::PeerInfo& seen = *view;
  INFO(seen.DebugString());
  CHECK(seen.data_path() == "shm-direct+ucx");
  CHECK(seen.direct_fallback_regions() == 1);
  REQUIRE(seen.direct_fallbacks_size() == 1);
  CHECK_THAT(seen.direct_fallbacks(0), Contains("region 'extra.0'") &&
                                           Contains("past the 1 of this peer mapped here") &&
                                           Contains("--max-peer-memory-objects"));
  auto done = pair.prefill().Submit(BytesWrite("to-extra", "source", "extra.0", kBytes));
  REQUIRE(done.ok());
  INFO(done->error_message());
  CHECK(done->phase() == v1::COMPLETED);
  CHECK(std::memcmp(extra->mapping.data(), bytes, kBytes) == 0);
  HonestWrite(pair, "pool-still-direct", 3, 4);
}

TEST_CASE("active transfers per owner are bounded while a peer is stopped") {
  AgentPair pair(WithArgs({"--max-active-transfers-per-owner", "8"}));
  REQUIRE(SuspendAgent(pair.decode_process().pid()) == "");
  std::vector<std::string> accepted;
  int refused = 0;
  for (int i = 0; i < 20; ++i) {
    auto state = pair.prefill().Submit(KvWrite(fmt::format("a{}", i), {static_cast<uint64_t>(i)},
                                               {static_cast<uint64_t>(i)}));
    if (state.ok()) {
      accepted.push_back(state->transfer_id());
    } else {
      CheckRefusal(state.status(), "active_transfers_per_owner",
                   "--max-active-transfers-per-owner");
      ++refused;
    }
  }
  REQUIRE(kill(pair.decode_process().pid(), SIGCONT) == 0);
  CHECK(accepted.size() == 8);
  CHECK(refused == 12);
  for (const auto& id : accepted) {
    auto done = pair.prefill().WaitTransfer(id, 20000);
    REQUIRE(done.ok());
    INFO(done->error_message());
    CHECK(done->phase() == v1::COMPLETED);
  }
  HonestWrite(pair, "after-active", 30, 31);
}

// Polls GetStatus for up to 3 s until `count` Watch* streams are open.
void WaitStreamsOpen(cli::AgentClient& client, uint64_t count) {
  uint64_t open = 0;
  for (int i = 0; i < 300; ++i) {
    auto status = client.Status();
    REQUIRE(status.ok());
    open = FindLimit(*status, "streams")->in_use();
    if (open == count) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  FAIL(fmt::format("{} streams open after 3 s, waited for {}", open, count));
}

TEST_CASE("watch streams per caller are bounded and given back when a stream ends") {
  AgentPair pair(WithArgs({"--max-streams-per-caller", "3"}));
  std::vector<std::thread> watchers;
  std::atomic<int> ended{0};
  for (int i = 0; i < 3; ++i) {
    // One caller (one session) holds them all.
    watchers.emplace_back([&pair, &ended] {
      (void)pair.decode().WatchNotifications({"none"}, 1500,
                                             [](const v1::Notification&) { return true; });
      ended.fetch_add(1);
    });
  }
  WaitStreamsOpen(pair.decode(), 3);
  absl::Status fourth = pair.decode().WatchNotifications(
      {"none"}, 1000, [](const v1::Notification&) { return true; });
  CheckRefusal(fourth, "streams_per_caller", "--max-streams-per-caller");
  for (auto& t : watchers) t.join();
  CHECK(ended.load() == 3);
  // Given back once the agent sees each stream end (the client's deadline cancels it).
  WaitStreamsOpen(pair.decode(), 0);
  absl::Status later = pair.decode().WatchNotifications(
      {"none"}, 300, [](const v1::Notification&) { return true; });
  CHECK(later.code() == absl::StatusCode::kDeadlineExceeded);
}

// ConnectPeer calls sent at once over `clients` (callback API: many calls per
// connection, under its cap of 1,024), each with its answer and how long it took.
struct ConnectCalls {
  struct Call {
    grpc::ClientContext context;
    v1::ConnectPeerRequest request;
    v1::PeerInfo reply;
    grpc::Status status;
    int64_t ms = 0;
  };
  std::vector<std::unique_ptr<Call>> calls;
  std::mutex mu;
  std::condition_variable all_done;
  size_t done = 0;

  ConnectCalls(std::vector<std::unique_ptr<cli::AgentClient>>& clients, int count,
               const std::string& address) {
    for (int i = 0; i < count; ++i) calls.push_back(std::make_unique<Call>());
    for (int i = 0; i < count; ++i) {
      Call* call = calls[i].get();
      cli::AgentClient& client = *clients[i % clients.size()];
      REQUIRE(client.Prepare(&call->context, 30000).ok());
      call->request.set_address(address);
      const auto start = std::chrono::steady_clock::now();
      client.stub()->async()->ConnectPeer(&call->context, &call->request, &call->reply,
                                          [this, call, start](grpc::Status status) {
                                            std::lock_guard<std::mutex> lock(mu);
                                            call->status = std::move(status);
                                            call->ms = MillisSince(start);
                                            if (++done == calls.size()) all_done.notify_all();
                                          });
    }
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(all_done.wait_for(lock, std::chrono::seconds(60), [&] { return done == calls.size(); }));
  }
};

TEST_CASE("ConnectPeer calls to peers that never answer are bounded; GetStatus stays fast") {
  constexpr int kPending = 64;  // --max-pending-connects' default
  AgentPair pair;
  // An "agent" whose sockets (the session socket and the gRPC one) accept
  // connections and never speak: each call waits for the connect timeout (5 s).
  const std::string silent = UniqueSocketName("/tmp/kvagent-silent") + ".sock";
  auto listen_on = [](const std::string& path, int type) {
    unlink(path.c_str());
    const int fd = socket(AF_UNIX, type, 0);
    REQUIRE(fd >= 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::snprintf(address.sun_path, sizeof address.sun_path, "%s", path.c_str());
    REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
    REQUIRE(listen(fd, 4096) == 0);
    return fd;
  };
  const int grpc_fd = listen_on(silent, SOCK_STREAM);
  const int session_fd = listen_on(silent + ".session", SOCK_SEQPACKET);
  const pid_t prefill_pid = pair.prefill_process().pid();
  const uint64_t rss_before = RssAnon(prefill_pid);
  StatusProbe probe({pair.prefill_process().address(), pair.decode_process().address()});
  std::vector<std::unique_ptr<cli::AgentClient>> clients;
  for (int i = 0; i < 4; ++i) {
    clients.push_back(std::make_unique<cli::AgentClient>(pair.prefill_process().address(), 30000));
  }
  std::atomic<uint64_t> rss_peak{rss_before};
  std::atomic<bool> loaded{true};
  std::thread sampler([&] {
    while (loaded.load()) {
      // Not RssAnon: Catch2's assertions are for the test's own thread.
      auto memory = cli::ReadProcessMemory(prefill_pid);
      if (memory.ok()) rss_peak = std::max(rss_peak.load(), memory->rss_anon);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  const auto start = std::chrono::steady_clock::now();
  ConnectCalls connects(clients, kConnects, "unix:" + silent);
  const int64_t all_ms = MillisSince(start);
  loaded = false;
  sampler.join();
  close(grpc_fd);
  close(session_fd);
  unlink(silent.c_str());
  unlink((silent + ".session").c_str());

  int refused = 0, failed = 0;
  int64_t refused_max_ms = 0, failed_min_ms = INT64_MAX;
  for (const auto& call : connects.calls) {
    if (call->status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      CHECK_THAT(call->status.error_message(),
                 Contains("limit pending_connects") && Contains("--max-pending-connects"));
      ++refused;
      refused_max_ms = std::max(refused_max_ms, call->ms);
    } else {
      INFO(call->status.error_message());
      CHECK(!call->status.ok());
      if (failed++ == 0) {
        std::printf("a ConnectPeer that was let through ended: %d %s\n",
                    static_cast<int>(call->status.error_code()),
                    call->status.error_message().c_str());
      }
      failed_min_ms = std::min(failed_min_ms, call->ms);
    }
  }
  std::printf("%d ConnectPeer to a silent socket, limit %d: %d refused (the slowest answered in "
              "%lld ms), %d let through and timed out (the first after %lld ms); all answered in "
              "%lld ms\n",
              kConnects, kPending, refused, static_cast<long long>(refused_max_ms), failed,
              static_cast<long long>(failed_min_ms), static_cast<long long>(all_ms));
  // Calls end and free slots while others arrive: a few more than the limit may pass.
  CHECK(failed >= kPending);
  CHECK(refused >= kConnects - 2 * kPending);
  CHECK(Refused(pair.prefill(), "pending_connects") == static_cast<uint64_t>(refused));
  probe.Report(fmt::format("{} silent peers", kConnects), 500);
  CheckRssBack(fmt::format("{} silent peers", kConnects), prefill_pid, rss_before, rss_peak,
               16u << 20);
  HonestWrite(pair, "after-connects", 9, 10);
}

}  // namespace
}  // namespace kvagent::testing

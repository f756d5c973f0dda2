// Limits, tried as a careless or hostile client would: two real kvagentd processes
// with small limits, each pushed past one. In every case the refusal is
// RESOURCE_EXHAUSTED naming the limit, its value and its flag; nothing already
// registered or in flight is lost; GetStatus keeps answering (its latency, sampled
// all along, is printed and loosely asserted); an honest transfer still completes
// byte-exact afterwards; GetStatus counts the refusals.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
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
#include "tests/limits/status_probe.h"

namespace kvagent::testing {
namespace {

using Catch::Matchers::Contains;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

const v1::LimitState* FindLimit(const v1::AgentStatus& status, const std::string& name) {
  for (const auto& limit : status.limits()) {
    if (limit.name() == name) return &limit;
  }
  return nullptr;
}

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

// An honest one-page WRITE after the load: completes, bytes equal.
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

AgentPairOptions WithArgs(std::vector<std::string> args) {
  AgentPairOptions options;
  options.extra_args = std::move(args);
  return options;
}

TEST_CASE("a full notification queue refuses new transfers back to their sender; none is lost") {
  constexpr int kLimit = 300, kTransfers = 500, kPerCall = 32;
  AgentPair pair(WithArgs({"--max-queued-notifications", std::to_string(kLimit)}));
  StatusProbe probe({pair.prefill_process().address(), pair.decode_process().address()});
  auto rss = [&pair] { return cli::ReadProcessMemory(pair.decode_process().pid())->rss_anon; };
  const uint64_t rss_before = rss();
  std::set<std::string> completed, failed;
  for (int base = 0; base < kTransfers; base += kPerCall) {
    v1::SubmitTransfersRequest batch;
    batch.set_wait(true);
    for (int i = base; i < std::min(base + kPerCall, kTransfers); ++i) {
      const uint64_t page = static_cast<uint64_t>(i - base);
      *batch.add_transfers() = KvWrite(fmt::format("n{}", i), {page}, {page}, fmt::format("p{}", i));
    }
    auto results = pair.prefill().SubmitBatch(batch);
    REQUIRE(results.ok());
    for (const auto& r : results->results()) {
      INFO(r.error_message());
      REQUIRE(r.error_code() == 0);
      if (r.state().phase() == v1::COMPLETED) {
        completed.insert(r.state().transfer_id());
      } else {
        // The receiver refused its acknowledgement: the sender's transfer fails with why.
        CHECK(r.state().phase() == v1::FAILED);
        CHECK(r.state().error_code() == static_cast<int>(absl::StatusCode::kResourceExhausted));
        CHECK_THAT(r.state().error_message(),
                   Contains("queued_notifications") && Contains("--max-queued-notifications"));
        failed.insert(r.state().transfer_id());
      }
    }
  }
  std::printf("queue limit %d: %zu completed, %zu refused back to the sender\n", kLimit,
              completed.size(), failed.size());
  CHECK(completed.size() == kLimit);
  CHECK(failed.size() == kTransfers - kLimit);

  const uint64_t rss_full = rss();
  // Room was reserved at each acknowledgement; a notification is queued when its
  // sender's commit arrives, a moment after the sender reported COMPLETED.
  absl::StatusOr<v1::AgentStatus> status;
  for (int i = 0; i < 500; ++i) {
    status = pair.decode().Status();
    REQUIRE(status.ok());
    if (status->notifications_queued() == kLimit) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  CHECK(status->notifications_queued() == kLimit);
  CHECK(FindLimit(*status, "queued_notifications")->refused() == kTransfers - kLimit);
  CHECK(FindLimit(*status, "queued_notifications")->in_use() == kLimit);

  // Every completed transfer's notification is there, once; no refused one is.
  std::multiset<std::string> delivered;
  for (;;) {
    auto polled = pair.decode().Poll(0);
    REQUIRE(polled.ok());
    if (polled->notifications_size() == 0) break;
    for (const auto& n : polled->notifications()) {
      CHECK(n.kind() == v1::DATA_READY);
      delivered.insert(n.transfer_id());
    }
  }
  const uint64_t rss_after = rss();
  std::printf("decode RssAnon: %.1f MiB before, %.1f with the queue full, %.1f once taken\n",
              rss_before / 1048576.0, rss_full / 1048576.0, rss_after / 1048576.0);
  CHECK(rss_after < rss_before + (32u << 20));
  CHECK(delivered.size() == completed.size());
  CHECK(std::set<std::string>(delivered.begin(), delivered.end()) == completed);
  // The receiver's own record says why the others failed.
  auto incoming = pair.decode().Get(*failed.begin(), "prefill");
  REQUIRE(incoming.ok());
  CHECK(incoming->phase() == v1::FAILED);
  CHECK_THAT(incoming->error_message(), Contains("queued_notifications"));

  HonestWrite(pair, "after-queue", 3, 4);
  probe.Report("notification queue");
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

// Waits until `pid` is stopped (state T in /proc/PID/stat): SIGSTOP is asynchronous,
// and a peer still running for a moment could complete a transfer.
void WaitStopped(pid_t pid) {
  for (int i = 0; i < 1000; ++i) {
    std::ifstream stat(fmt::format("/proc/{}/stat", pid));
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    if (paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'T') return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  FAIL(fmt::format("process {} did not stop", pid));
}

TEST_CASE("active transfers per owner are bounded while a peer is stopped") {
  AgentPair pair(WithArgs({"--max-active-transfers-per-owner", "8"}));
  REQUIRE(kill(pair.decode_process().pid(), SIGSTOP) == 0);
  WaitStopped(pair.decode_process().pid());
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

TEST_CASE("ConnectPeer calls to peers that never answer are bounded; GetStatus stays fast") {
  AgentPair pair(WithArgs({"--max-pending-connects", "8"}));
  // An "agent" whose sockets (the session socket and the gRPC one) accept
  // connections and never speak: each call waits for the connect timeout (5 s).
  const std::string silent = fmt::format("/tmp/kvagent-silent-{}.sock", getpid());
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
  StatusProbe probe({pair.prefill_process().address(), pair.decode_process().address()});
  std::atomic<int> refused{0}, failed{0};
  std::vector<std::thread> callers;
  for (int i = 0; i < 64; ++i) {
    callers.emplace_back([&] {
      cli::AgentClient client(pair.prefill_process().address(), 15000);
      auto connected = client.Connect("unix:" + silent);
      if (connected.status().code() == absl::StatusCode::kResourceExhausted) {
        CHECK_THAT(Message(connected.status()), Contains("pending_connects"));
        refused.fetch_add(1);
      } else {
        CHECK(!connected.ok());
        if (failed.fetch_add(1) == 0) {
          std::printf("a ConnectPeer that was let through ended: %s\n",
                      connected.status().ToString().c_str());
        }
      }
    });
  }
  for (auto& t : callers) t.join();
  close(grpc_fd);
  close(session_fd);
  unlink(silent.c_str());
  unlink((silent + ".session").c_str());
  std::printf("64 ConnectPeer to a silent socket, limit 8: %d refused at once, %d timed out\n",
              refused.load(), failed.load());
  CHECK(refused.load() >= 56 - 8);  // calls end and free slots while others arrive
  CHECK(failed.load() >= 8);
  probe.Report("silent peers");
  HonestWrite(pair, "after-connects", 9, 10);
}

}  // namespace
}  // namespace kvagent::testing

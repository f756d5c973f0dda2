// Clients that vanish in the middle of a stream: in-process streams cut with
// TryCancel, and `kvagentctl notifications --watch` processes killed with SIGKILL
// (the connection just closes). Round after round the agents must free every
// stream's state (AgentStatus.open_streams back to 0), keep their memory flat, keep
// serving, and hand no notification to two takers.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "base/format.h"
#include "catch2/catch.hpp"
#include "cli/process_memory.h"
#include "fmt/format.h"
#include "grpcpp/grpcpp.h"
#include "tests/integration/agent_pair.h"

namespace kvagent::testing {
namespace {

using Clock = std::chrono::steady_clock;

pid_t SpawnWatcher(const std::string& address) {
  auto pid = SpawnKvagentctl({"--agent", address, "notifications", "--watch"});
  INFO(pid.status().ToString());
  REQUIRE(pid.ok());
  return *pid;
}

// Waits until the agent reports `want` open streams; returns the milliseconds it took.
double WaitStreams(cli::AgentClient& agent, uint64_t want, const char* what) {
  const auto start = Clock::now();
  uint64_t open = 0;
  while (Clock::now() - start < std::chrono::seconds(15)) {
    auto status = agent.Status();
    REQUIRE(status.ok());
    open = status->open_streams();
    if (open == want) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  INFO(what << ": the agent reports " << open << " open streams, expected " << want);
  REQUIRE(open == want);
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

uint64_t BeyondPools(pid_t pid) {
  auto memory = cli::ReadProcessMemory(pid);
  INFO(memory.status().ToString());
  REQUIRE(memory.ok());
  return memory->rss_anon;
}

TEST_CASE("clients that vanish mid-stream leave nothing behind") {
  AgentPair pair;
  constexpr int kRounds = 20;
  constexpr int kInProcess = 8;  // per agent, cut by TryCancel
  constexpr int kProcesses = 3;  // kvagentctl watchers on decode, SIGKILLed
  constexpr int kDone = 6;       // completed transfers per round, while the streams are open
  // Rounds before the first memory reading: the agents' first rounds of streams grow
  // their thread pools and allocator caches (2-3 MiB of RssAnon, up to 4 under a loaded
  // CI run), which a leak check must not count. A leak grows with every round after.
  constexpr int kWarmRounds = 4;

  REQUIRE(pair.prefill().Submit(KvWrite("warm", {0}, {0}, "warm")).ok());
  REQUIRE(pair.prefill().WaitTransfer("warm", 10000).ok());
  uint64_t prefill_before = 0, decode_before = 0;

  std::set<std::string> completed = {"warm"};
  double worst_ms = 0;
  for (int round = 0; round < kRounds; ++round) {
    if (round == kWarmRounds) {
      prefill_before = BeyondPools(pair.prefill_process().pid());
      decode_before = BeyondPools(pair.decode_process().pid());
    }
    const std::string open_id = fmt::format("open-{}", round);
    // Pages 20-29: apart from the completed transfers' 10-15 (the agent refuses two
    // transfers writing the same destination at once).
    auto open = KvWrite(open_id, {static_cast<uint64_t>(20 + round % 10)},
                        {static_cast<uint64_t>(20 + round % 10)});
    open.set_more_chunks(true);
    REQUIRE(pair.prefill().Submit(open).ok());

    std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
    std::vector<std::unique_ptr<grpc::ClientReader<v1::TransferState>>> transfer_streams;
    std::vector<std::unique_ptr<grpc::ClientReader<v1::Notification>>> notification_streams;
    for (int i = 0; i < kInProcess; ++i) {
      contexts.push_back(std::make_unique<grpc::ClientContext>());
      REQUIRE(pair.prefill().Prepare(contexts.back().get(), 600000).ok());
      v1::GetTransferRequest request;
      request.set_transfer_id(open_id);
      transfer_streams.push_back(pair.prefill().stub()->WatchTransfer(contexts.back().get(), request));
      contexts.push_back(std::make_unique<grpc::ClientContext>());
      REQUIRE(pair.decode().Prepare(contexts.back().get(), 600000).ok());
      notification_streams.push_back(
          pair.decode().stub()->WatchNotifications(contexts.back().get(), v1::WatchNotificationsRequest()));
    }
    std::vector<pid_t> watchers;
    for (int i = 0; i < kProcesses; ++i) watchers.push_back(SpawnWatcher(pair.decode().address()));
    WaitStreams(pair.prefill(), kInProcess, "prefill, streams opened");
    WaitStreams(pair.decode(), kInProcess + kProcesses, "decode, streams opened");

    // Notifications flow to the open streams (each goes to one of them).
    for (int k = 0; k < kDone; ++k) {
      const std::string id = fmt::format("done-{}-{}", round, k);
      auto w = KvWrite(id, {static_cast<uint64_t>(k)}, {static_cast<uint64_t>(10 + k)}, id);
      w.set_wait(true);
      auto state = pair.prefill().Submit(w);
      REQUIRE(state.ok());
      REQUIRE(state->phase() == v1::COMPLETED);
      completed.insert(id);
    }

    // Everyone vanishes at once.
    for (pid_t pid : watchers) ::kill(pid, SIGKILL);
    for (auto& context : contexts) context->TryCancel();
    for (pid_t pid : watchers) {
      int status = 0;
      ::waitpid(pid, &status, 0);
      CHECK(WIFSIGNALED(status));  // it was still watching when killed
    }
    for (auto& s : transfer_streams) (void)s->Finish();
    for (auto& s : notification_streams) (void)s->Finish();
    REQUIRE(pair.prefill().Cancel(open_id).ok());
    worst_ms = std::max(worst_ms, WaitStreams(pair.prefill(), 0, "prefill, after the cut"));
    worst_ms = std::max(worst_ms, WaitStreams(pair.decode(), 0, "decode, after the cut"));
  }

  const uint64_t prefill_after = BeyondPools(pair.prefill_process().pid());
  const uint64_t decode_after = BeyondPools(pair.decode_process().pid());
  std::printf("%d rounds of %d streams cut (%d by SIGKILLed processes): every stream freed within "
              "%.0f ms; RssAnon over the last %d rounds: prefill %.1f -> %.1f MiB, decode %.1f -> "
              "%.1f MiB\n",
              kRounds, 2 * kInProcess + kProcesses, kProcesses, worst_ms, kRounds - kWarmRounds,
              prefill_before / 1048576.0,
              prefill_after / 1048576.0, decode_before / 1048576.0, decode_after / 1048576.0);
  // 16 rounds x 19 streams: a stream's state leaking (reactor, watcher, queue
  // subscriber, copies of messages; 14 KiB a stream) would show; after the warm-up
  // rounds the noise is well under 4 MiB.
  // Under ASan the agents hold freed memory in quarantine, so RSS grows without a
  // leak; there LeakSanitizer checks the agents at exit instead.
#if defined(__SANITIZE_ADDRESS__)
  std::printf("ASan build: the RSS bound is not checked (quarantine holds freed memory)\n");
#else
  CHECK(prefill_after < prefill_before + (4u << 20));
  CHECK(decode_after < decode_before + (4u << 20));
#endif

  // Still serving, and no notification went to two takers: those that reached a
  // vanished client are gone, the rest wait in the queue, each once.
  auto status = pair.prefill().Status();
  REQUIRE(status.ok());
  CHECK(status->transfers_active() == 0);
  auto last = KvWrite("after", {1}, {2}, "after");
  last.set_wait(true);
  auto after = pair.prefill().Submit(last);
  REQUIRE(after.ok());
  CHECK(after->phase() == v1::COMPLETED);
  completed.insert("after");
  // COMPLETED means the notification was sent; it may still be on its way.
  std::set<std::string> seen;
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (seen.count("after") == 0 && Clock::now() < until) {
    auto rest = pair.decode().Poll(0);
    REQUIRE(rest.ok());
    for (const auto& n : rest->notifications()) {
      if (n.kind() != v1::DATA_READY) continue;
      INFO(n.transfer_id());
      CHECK(completed.count(n.transfer_id()) == 1);
      CHECK(seen.insert(n.transfer_id()).second);
    }
    if (seen.count("after") == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  CHECK(seen.count("after") == 1);
}

}  // namespace
}  // namespace kvagent::testing

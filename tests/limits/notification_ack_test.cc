// Notifications that are not lost (issue 13): a decode-side client watching through a
// durable subscription (`kvagentctl notifications --watch --subscription S`, a real
// child process) is SIGKILLed while 200 transfers with notifications land; a restarted
// client of the same uid and client name reattaches to the subscription and gets,
// first and in order, what was not acknowledged, then the rest. Every COMPLETED
// transfer's notification reaches the clients at least once on the wire and exactly
// once after dropping sequences already seen. Another client name is another
// subscription and cannot acknowledge this one's; a subscription left idle past
// --subscription-ttl-ms gives what it held back to the queue; GetStatus counts what
// is in flight. Figures are printed.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"
#include "tests/limits/pair_checks.h"

namespace kvagent::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kSubscription[] = "decode-worker-0";

// `kvagentctl --json notifications --watch --subscription S`, its stdout to `out`.
pid_t SpawnSubscriber(const std::string& address, const std::string& out) {
  auto pid = SpawnKvagentctl(
      {"--agent", address, "--json", "notifications", "--watch", "--subscription", kSubscription},
      out);
  INFO(pid.status().ToString());
  REQUIRE(pid.ok());
  return *pid;
}

// A JSON string field of one line ("name":"value"); "" when absent.
std::string Field(const std::string& line, const std::string& name) {
  const std::string key = "\"" + name + "\":\"";
  const size_t at = line.find(key);
  if (at == std::string::npos) return "";
  const size_t end = line.find('"', at + key.size());
  return line.substr(at + key.size(), end - at - key.size());
}

struct Seen {
  uint64_t sequence;
  std::string transfer_id;
};

std::vector<Seen> ReadPrinted(const std::string& path) {
  std::vector<Seen> seen;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line.back() != '}') continue;  // cut by the kill mid-line
    seen.push_back({std::stoull(Field(line, "sequence")), Field(line, "transfer_id")});
  }
  return seen;
}

uint64_t WaitFor(const std::function<bool()>& done, uint32_t limit_ms = 10000) {
  const auto start = Clock::now();
  while (!done()) {
    REQUIRE(MillisSince(start) < limit_ms);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return MillisSince(start);
}

TEST_CASE("a killed subscriber's unacknowledged notifications come again to its restart") {
  constexpr int kTransfers = 200, kPerCall = 20;
  AgentPair pair;
  const std::string out = pair.work_dir() + "/subscriber.out";
  const pid_t child = SpawnSubscriber(pair.decode_process().address(), out);
  WaitFor([&] {
    auto status = pair.decode().Status();
    return status.ok() && status->subscriptions() == 1;
  });

  // The transfers land while the subscriber prints and acknowledges; it is killed
  // after the third batch, mid-stream, and the rest land with nobody attached.
  std::set<std::string> completed;
  int other = 0;
  uint64_t printed_at_kill = 0;
  for (int base = 0, call = 0; base < kTransfers; base += kPerCall, ++call) {
    if (call == 3) {
      printed_at_kill = ReadPrinted(out).size();
      REQUIRE(kill(child, SIGKILL) == 0);
    }
    v1::SubmitTransfersRequest batch;
    batch.set_wait(true);
    for (int i = base; i < std::min(base + kPerCall, kTransfers); ++i) {
      const uint64_t page = static_cast<uint64_t>(i % 32);
      *batch.add_transfers() = KvWrite(fmt::format("t{}", i), {page}, {page}, fmt::format("p{}", i));
    }
    auto results = pair.prefill().SubmitBatch(batch);
    REQUIRE(results.ok());
    for (const auto& r : results->results()) {
      if (r.state().phase() == v1::COMPLETED) {
        completed.insert(r.state().transfer_id());
      } else {
        ++other;
      }
    }
  }
  int wstatus = 0;
  REQUIRE(waitpid(child, &wstatus, 0) == child);
  CHECK(WIFSIGNALED(wstatus));
  CHECK(completed.size() == kTransfers);  // nothing pushes back at the default limits

  const std::vector<Seen> before = ReadPrinted(out);
  std::set<std::string> printed_before;
  for (const auto& s : before) printed_before.insert(s.transfer_id);
  // Unacknowledged (in flight) and not yet delivered (queued): all the child did not
  // ack. The sender reports COMPLETED before its commit reaches the receiver, which
  // queues the notification then: wait for the last commits (a few milliseconds).
  absl::StatusOr<v1::AgentStatus> held;
  WaitFor([&] {
    held = pair.decode().Status();
    return held.ok() && held->notifications_in_flight() + held->notifications_queued() >=
                            kTransfers - before.size();
  });
  REQUIRE(held.ok());
  const uint64_t pending = held->notifications_in_flight() + held->notifications_queued();
  CHECK(pending <= kTransfers - (before.empty() ? 0 : before.size() - 1));
  CHECK(pending >= kTransfers - before.size());
  CHECK(FindLimit(*held, "queued_notifications")->in_use() == pending);
  std::printf("subscriber killed after %zu printed (%lu at the kill); decode agent holds %lu in "
              "flight, %lu queued; %d transfers not completed\n",
              before.size(), static_cast<unsigned long>(printed_at_kill),
              static_cast<unsigned long>(held->notifications_in_flight()),
              static_cast<unsigned long>(held->notifications_queued()), other);

  // Another client name of the same uid names another subscription: it cannot ack
  // this one's (NOT_FOUND: it has none yet).
  cli::AgentClientOptions other_options;
  other_options.client_name = "other-worker";
  cli::AgentClient other_client(pair.decode_process().address(), other_options);
  CHECK(other_client.Ack(kSubscription, 1'000'000).status().code() ==
        absl::StatusCode::kNotFound);

  // The restart: same uid, same client name ("kvagentctl"), same subscription.
  cli::AgentClient restarted(pair.decode_process().address());
  std::map<uint64_t, std::string> by_sequence;  // dedupe
  for (const auto& s : before) by_sequence[s.sequence] = s.transfer_id;
  uint64_t wire = 0, duplicates = 0, last_sequence = 0;
  bool in_order = true;
  const auto start = Clock::now();
  int64_t first_ms = -1;
  std::set<std::string> all;
  for (const auto& [seq, id] : by_sequence) all.insert(id);
  absl::Status watched = restarted.WatchNotifications(
      {}, 20000,
      [&](const v1::Notification& n) {
        if (first_ms < 0) first_ms = MillisSince(start);
        ++wire;
        in_order = in_order && n.sequence() > last_sequence;
        last_sequence = n.sequence();
        if (!by_sequence.emplace(n.sequence(), n.transfer_id()).second) {
          ++duplicates;
          CHECK(by_sequence[n.sequence()] == n.transfer_id());
        } else {
          all.insert(n.transfer_id());
        }
        // Processed: acknowledge.
        auto acked = restarted.Ack(kSubscription, n.sequence());
        CHECK(acked.ok());
        return all.size() < completed.size();
      },
      kSubscription);
  const int64_t all_ms = MillisSince(start);
  REQUIRE(watched.ok());
  CHECK(in_order);
  // At least once on the wire, exactly once after dedupe: one sequence per transfer.
  CHECK(all == completed);
  std::set<std::string> ids;
  for (const auto& [seq, id] : by_sequence) ids.insert(id);
  CHECK(ids.size() == by_sequence.size());
  CHECK(by_sequence.size() == completed.size());
  std::printf("restart: %lu on the wire (%lu already printed by the killed client: at-least-once), "
              "%zu distinct after dedupe by sequence; first after %ld ms, all %zu after %ld ms\n",
              static_cast<unsigned long>(wire), static_cast<unsigned long>(duplicates),
              by_sequence.size(), static_cast<long>(first_ms), completed.size(),
              static_cast<long>(all_ms));

  // Its own subscription of the same name is apart: it holds nothing of the other's
  // (all acknowledged there), and acking in it releases nothing there.
  auto theirs = other_client.Poll(0, {}, kSubscription);
  REQUIRE(theirs.ok());
  CHECK(theirs->notifications_size() == 0);
  CHECK(*other_client.Ack(kSubscription, 1'000'000) == 0);

  auto after = pair.decode().Status();
  REQUIRE(after.ok());
  CHECK(after->notifications_in_flight() == 0);
  CHECK(after->notifications_queued() == 0);
  CHECK(after->subscriptions() == 2);
  CHECK(FindLimit(*after, "subscriptions")->in_use() == 2);
}

TEST_CASE("an idle subscription's unacknowledged notifications go back to the queue") {
  constexpr int kTransfers = 5;
  AgentPair pair(WithArgs({"--subscription-ttl-ms", "300"}));
  for (int i = 0; i < kTransfers; ++i) {
    auto request = KvWrite(fmt::format("ttl{}", i), {static_cast<uint64_t>(i)},
                           {static_cast<uint64_t>(i)}, "x");
    request.set_wait(true);
    auto done = pair.prefill().Submit(request);
    REQUIRE(done.ok());
    REQUIRE(done->phase() == v1::COMPLETED);
  }
  // The last commit may still be on its way (the sender is final first).
  WaitFor([&] {
    auto status = pair.decode().Status();
    return status.ok() && status->notifications_queued() == kTransfers;
  });
  cli::AgentClientOptions options;
  options.client_name = "decode-a";
  cli::AgentClient worker(pair.decode_process().address(), options);
  auto taken = worker.Poll(0, {}, "s");
  REQUIRE(taken.ok());
  REQUIRE(taken->notifications_size() == kTransfers);
  auto status = pair.decode().Status();
  REQUIRE(status.ok());
  CHECK(status->notifications_in_flight() == kTransfers);
  CHECK(status->notifications_queued() == 0);
  CHECK(FindLimit(*status, "queued_notifications")->in_use() == kTransfers);
  CHECK(FindLimit(*status, "in_flight_per_subscription")->in_use() == kTransfers);
  CHECK(pair.decode().Poll(0)->notifications_size() == 0);  // held: nobody else takes them

  // The worker died without acknowledging: after the TTL they are queued again.
  const auto start = Clock::now();
  const uint64_t ms = WaitFor([&] {
    auto s = pair.decode().Status();
    return s.ok() && s->subscriptions() == 0;
  });
  status = pair.decode().Status();
  REQUIRE(status.ok());
  CHECK(status->notifications_in_flight() == 0);
  CHECK(status->notifications_queued() == kTransfers);
  CHECK(status->subscriptions_expired() == 1);
  auto back = pair.decode().Poll(0);
  REQUIRE(back.ok());
  CHECK(back->notifications_size() == kTransfers);
  CHECK(back->notifications(0).sequence() == 0);
  CHECK(worker.Ack("s", 1000).status().code() == absl::StatusCode::kNotFound);
  std::printf("ttl 300 ms: %d held notifications back in the queue %lu ms after the last poll "
              "(%ld ms measured)\n",
              kTransfers, static_cast<unsigned long>(ms), static_cast<long>(MillisSince(start)));
}

}  // namespace
}  // namespace kvagent::testing

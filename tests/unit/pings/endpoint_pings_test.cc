// EndpointPings between two real UCX workers in one process, each with its own context
// as two agents would have, the pings served through the agent's Inbox.
#include "agent/endpoint_pings.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "agent/am_ids.h"
#include "agent/inbox.h"
#include "catch2/catch.hpp"
#include "proto/wire.pb.h"
#include "transport/ucx_context.h"
#include "transport/ucx_worker.h"

namespace kvagent::agent {
namespace {

using Catch::Matchers::Contains;
using transport::Completion;
using transport::Endpoint;
using transport::ErrorMode;

constexpr absl::Duration kWait = absl::Seconds(20);

// One agent's side: its worker, and (answers) pings served by its Inbox as an agent
// serves them; without, ids 8 and 9 reach no handler (an agent of an older build).
struct Side {
  std::unique_ptr<transport::UcxContext> context;
  std::unique_ptr<transport::UcxWorker> worker;
  SecurityCounters counters;
  PeerSecrets secrets;
  std::unique_ptr<EndpointPings> pings;
  std::unique_ptr<Inbox> inbox;

  Side(const std::string& name, bool answers, EndpointPingLimits limits = {}) {
    auto made = transport::UcxContext::Create();
    INFO(made.status().ToString());
    REQUIRE(made.ok());
    context = *std::move(made);
    auto w = transport::UcxWorker::Create(*context, name);
    INFO(w.status().ToString());
    REQUIRE(w.ok());
    worker = *std::move(w);
    pings = std::make_unique<EndpointPings>(worker.get(), &counters, limits);
    inbox = std::make_unique<Inbox>(worker.get(), &secrets, &counters, name);
    inbox->Install(nullptr, nullptr, answers ? pings.get() : nullptr);
  }
  // As the Agent: silenced, then the worker (its last completions and timers run into
  // the pings), then the rest.
  ~Side() { Stop(); }
  void Stop() {
    if (worker == nullptr) return;
    inbox->Silence();
    worker.reset();
  }
  uint64_t dropped() const { return counters.dropped_peer_messages.load(); }
  // Worker-thread state, read on it.
  size_t waiting() {
    size_t n = 0;
    worker->RunSync([&] { n = pings->waiting(); });
    return n;
  }
  uint64_t answered() {
    uint64_t n = 0;
    worker->RunSync([&] { n = pings->answered(); });
    return n;
  }
};

std::unique_ptr<Endpoint> Connect(Side& from, const Side& to, ErrorMode mode) {
  std::unique_ptr<Endpoint> endpoint;
  absl::Status status;
  from.worker->RunSync([&] {
    auto connected = Endpoint::Connect(*from.worker, to.worker->address(), mode, nullptr);
    status = connected.status();
    if (connected.ok()) endpoint = *std::move(connected);
  });
  INFO(status.ToString());
  REQUIRE(status.ok());
  return endpoint;
}

void Close(Side& side, std::unique_ptr<Endpoint>& endpoint) {
  side.worker->RunSync([&] { endpoint.reset(); });
}

// A ping's outcome, set on the worker thread.
struct Outcome {
  absl::Notification done;
  absl::StatusOr<uint64_t> result = absl::UnknownError("not ended");
  std::atomic<int> calls{0};
  std::chrono::steady_clock::time_point at;
};

std::shared_ptr<Outcome> Ping(Side& from, Endpoint& endpoint, const std::string& peer,
                              std::chrono::milliseconds timeout) {
  auto outcome = std::make_shared<Outcome>();
  from.worker->Post([&from, &endpoint, peer, timeout, outcome] {
    from.pings->Ping(endpoint, peer, timeout, [outcome](absl::StatusOr<uint64_t> result) {
      if (outcome->calls.fetch_add(1) > 0) return;  // counted: must stay 1
      outcome->result = std::move(result);
      outcome->at = std::chrono::steady_clock::now();
      outcome->done.Notify();
    });
  });
  return outcome;
}

// Sends active message `id` with `header` over `endpoint`, with a reply endpoint or not.
void Send(Side& from, Endpoint& endpoint, AmId id, const std::string& header, bool request) {
  absl::Notification sent;
  absl::Status status;
  from.worker->Post([&] {
    auto done = [&](absl::Status s) {
      status = s;
      sent.Notify();
    };
    if (request) {
      endpoint.SendAmRequest(Wire(id), header, done);
    } else {
      endpoint.SendAm(Wire(id), header, {}, done);
    }
  });
  REQUIRE(sent.WaitForNotificationWithTimeout(kWait));
  INFO(status.ToString());
  REQUIRE(status.ok());
}

void WaitDropped(Side& side, uint64_t count) {
  const auto until = absl::Now() + kWait;
  while (side.dropped() < count && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  CHECK(side.dropped() == count);
}

ErrorMode Mode(const std::string& name) {
  return name == "peer" ? ErrorMode::kPeer : ErrorMode::kNone;
}

TEST_CASE("a ping over a new endpoint comes back as its pong, with the round trip") {
  const std::string mode = GENERATE("none", "peer");
  const char* tls = std::getenv("UCX_TLS");
  INFO("error mode " << mode << ", UCX_TLS=" << (tls ? tls : "(unset)"));
  Side a("ping-a", true);
  Side b("ping-b", true);
  auto a_to_b = Connect(a, b, Mode(mode));
  // No flush first: the ping is the endpoint's first message, as it may be for an agent.
  for (int round = 1; round <= 3; ++round) {
    auto outcome = Ping(a, *a_to_b, "b", std::chrono::milliseconds(10000));
    REQUIRE(outcome->done.WaitForNotificationWithTimeout(kWait));
    INFO(outcome->result.status().ToString());
    REQUIRE(outcome->result.ok());
    std::printf("error mode %s, UCX_TLS=%s: ping %d round trip %lu us\n", mode.c_str(),
                tls ? tls : "(unset)", round, static_cast<unsigned long>(*outcome->result));
    CHECK(*outcome->result > 0);
    CHECK(b.answered() == static_cast<uint64_t>(round));
  }
  CHECK(a.waiting() == 0);
  CHECK(a.dropped() == 0);
  CHECK(b.dropped() == 0);
  CHECK(b.worker->am_received(Wire(AmId::kPing)) == 3);
  CHECK(a.worker->am_received(Wire(AmId::kPong)) == 3);
  Close(a, a_to_b);
}

TEST_CASE("a ping a peer does not answer fails at its timeout, naming the peer and what to "
          "check") {
  const std::string mode = GENERATE("none", "peer");
  INFO("error mode " << mode);
  Side a("mute-a", true);
  Side b("mute-b", /*answers=*/false);  // an agent whose pongs never come back
  auto a_to_b = Connect(a, b, Mode(mode));
  const auto start = std::chrono::steady_clock::now();
  auto outcome = Ping(a, *a_to_b, "mute", std::chrono::milliseconds(300));
  REQUIRE(outcome->done.WaitForNotificationWithTimeout(kWait));
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(outcome->at - start).count();
  INFO(outcome->result.status().ToString() << " after " << ms << " ms");
  REQUIRE(absl::IsDeadlineExceeded(outcome->result.status()));
  CHECK_THAT(std::string(outcome->result.status().message()),
             Contains("peer 'mute': its UCX did not answer this agent's ping within 300 ms") &&
                 Contains("The peer's log says why") && Contains("kvagentctl doctor"));
  CHECK(ms >= 300);
  // It reached b (dropped there as an id without a handler), and nothing waits in a.
  const auto until = absl::Now() + kWait;
  while (b.worker->unknown_messages() < 1 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  CHECK(b.worker->unknown_messages() == 1);
  CHECK(a.waiting() == 0);
  uint64_t timed_out = 0;
  a.worker->RunSync([&] { timed_out = a.pings->timed_out(); });
  CHECK(timed_out == 1);
  CHECK(outcome->calls.load() == 1);
  Close(a, a_to_b);
}

TEST_CASE("forged and malformed pongs and pings are dropped and counted; the waiting ping "
          "still ends by its own pong") {
  Side a("forge-a", true);
  Side b("forge-b", true);
  auto a_to_b = Connect(a, b, ErrorMode::kNone);
  auto b_to_a = Connect(b, a, ErrorMode::kNone);
  // A pong no ping of a waits for, a pong whose header does not parse, and one over
  // the header bound (1,024 bytes): each dropped, counted, and nothing else happens.
  wire::EndpointPing forged;
  forged.set_token(0x1234567890abcdefULL);
  Send(b, *b_to_a, AmId::kPong, forged.SerializeAsString(), false);
  WaitDropped(a, 1);
  Send(b, *b_to_a, AmId::kPong, std::string("\xff\xff\xff", 3), false);
  WaitDropped(a, 2);
  std::string over;
  forged.set_token(7);
  while (over.size() <= 1024) over += forged.SerializeAsString();
  Send(b, *b_to_a, AmId::kPong, over, false);
  WaitDropped(a, 3);
  // A ping without a reply endpoint cannot be answered; one that does not parse is
  // not answered. Both dropped and counted by a.
  Send(b, *b_to_a, AmId::kPing, forged.SerializeAsString(), false);
  WaitDropped(a, 4);
  Send(b, *b_to_a, AmId::kPing, std::string("\xff\xff\xff", 3), true);
  WaitDropped(a, 5);
  CHECK(a.answered() == 0);
  // a's real ping still comes back.
  auto outcome = Ping(a, *a_to_b, "b", std::chrono::milliseconds(10000));
  REQUIRE(outcome->done.WaitForNotificationWithTimeout(kWait));
  INFO(outcome->result.status().ToString());
  CHECK(outcome->result.ok());
  CHECK(a.dropped() == 5);
  CHECK(b.dropped() == 0);
  Close(a, a_to_b);
  Close(b, b_to_a);
}

TEST_CASE("pings waiting and pongs being sent are bounded, each refusal said or counted") {
  SECTION("a ping past max_waiting fails at once, not sent") {
    Side a("bound-a", true, EndpointPingLimits{/*max_waiting=*/2, /*max_answering=*/256});
    Side b("bound-b", /*answers=*/false);
    auto a_to_b = Connect(a, b, ErrorMode::kNone);
    auto first = Ping(a, *a_to_b, "b", std::chrono::milliseconds(60000));
    auto second = Ping(a, *a_to_b, "b", std::chrono::milliseconds(60000));
    auto third = Ping(a, *a_to_b, "b", std::chrono::milliseconds(60000));
    REQUIRE(third->done.WaitForNotificationWithTimeout(kWait));
    INFO(third->result.status().ToString());
    CHECK(absl::IsResourceExhausted(third->result.status()));
    CHECK_THAT(std::string(third->result.status().message()),
               Contains("peer 'b': not pinged: 2 pings") && Contains("(the bound)"));
    CHECK(a.waiting() == 2);
    CHECK_FALSE(first->done.HasBeenNotified());
    CHECK_FALSE(second->done.HasBeenNotified());
    Close(a, a_to_b);
    // The two waiting end when a's worker stops (below, with the Side): not left hanging.
    a.Stop();
    for (const auto& waiting : {first, second}) {
      REQUIRE(waiting->done.HasBeenNotified());
      INFO(waiting->result.status().ToString());
      CHECK(absl::IsUnavailable(waiting->result.status()));
      CHECK_THAT(std::string(waiting->result.status().message()),
                 Contains("peer 'b': this agent stopped before the peer answered its ping"));
      CHECK(waiting->calls.load() == 1);
    }
  }
  SECTION("a ping past max_answering is dropped and counted, unanswered") {
    Side a("answer-a", true);
    Side b("answer-b", true, EndpointPingLimits{/*max_waiting=*/1024, /*max_answering=*/0});
    auto a_to_b = Connect(a, b, ErrorMode::kNone);
    auto outcome = Ping(a, *a_to_b, "b", std::chrono::milliseconds(300));
    REQUIRE(outcome->done.WaitForNotificationWithTimeout(kWait));
    CHECK(absl::IsDeadlineExceeded(outcome->result.status()));
    WaitDropped(b, 1);
    CHECK(b.answered() == 0);
    Close(a, a_to_b);
  }
}

}  // namespace
}  // namespace kvagent::agent

#include "agent/endpoint_pings.h"

#include <cstring>
#include <utility>

#include "agent/am_ids.h"
#include "agent/peer_secrets.h"
#include "base/log.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {

constexpr log::Logger kLog("pings");

}  // namespace

EndpointPings::EndpointPings(transport::UcxWorker* worker, SecurityCounters* counters,
                             EndpointPingLimits limits)
    : worker_(worker), counters_(counters), limits_(limits) {}

void EndpointPings::Ping(transport::Endpoint& endpoint, const std::string& peer,
                         std::chrono::milliseconds timeout,
                         std::function<void(absl::StatusOr<uint64_t>)> done) {
  if (waiting_.size() >= limits_.max_waiting) {
    done(absl::ResourceExhaustedError(fmt::format(
        "peer '{}': not pinged: {} pings of new UCX endpoints wait for their answer already "
        "(the bound); connect fewer peers at once, or look for peers that do not answer "
        "(their last_error in `kvagentctl peers`)",
        peer, waiting_.size())));
    return;
  }
  // From the kernel: a token a peer could guess would let it answer for another.
  uint64_t token = 0;
  while (token == 0 || waiting_.contains(token)) {
    const std::string bytes = RandomBytes(sizeof(token));
    std::memcpy(&token, bytes.data(), sizeof(token));
  }
  waiting_.emplace(token, Waiting{peer, std::chrono::steady_clock::now(),
                                  static_cast<uint32_t>(timeout.count()), std::move(done)});
  wire::EndpointPing ping;
  ping.set_token(token);
  endpoint.SendAmRequest(Wire(AmId::kPing), ping.SerializeAsString(),
                         [this, token](absl::Status sent) {
                           if (sent.ok()) return;
                           End(token, absl::UnavailableError(fmt::format(
                                          "its ping could not be sent: {}", sent.message())));
                         });
  worker_->PostAfter(timeout, [this, token] {
    if (!waiting_.contains(token)) return;
    if (worker_->stopping()) {
      End(token, absl::UnavailableError("this agent stopped before the peer answered its ping"));
      return;
    }
    ++timed_out_;
    End(token, absl::DeadlineExceededError(""));
  });
}

void EndpointPings::End(uint64_t token, absl::Status result) {
  auto it = waiting_.find(token);
  if (it == waiting_.end()) return;
  Waiting waiting = std::move(it->second);
  waiting_.erase(it);
  const auto elapsed = std::chrono::duration_cast<std::chrono::microseconds>(
                           std::chrono::steady_clock::now() - waiting.sent)
                           .count();
  if (result.ok()) {
    waiting.done(static_cast<uint64_t>(elapsed));
    return;
  }
  if (absl::IsDeadlineExceeded(result)) {
    result = absl::DeadlineExceededError(fmt::format(
        "peer '{}': its UCX did not answer this agent's ping within {} ms: this agent's UCX "
        "reaches the peer, but nothing the peer sends over UCX reaches this agent (its UCX "
        "could not connect back, or its worker is stuck), so its acknowledgements and "
        "notices would be lost. The peer's log says why (UCX warnings at this time); check "
        "with `kvagentctl doctor` on both that each agent's transports reach the other",
        waiting.peer, waiting.timeout_ms));
  } else {
    result = absl::Status(result.code(),
                          fmt::format("peer '{}': {}", waiting.peer, result.message()));
  }
  waiting.done(std::move(result));
}

void EndpointPings::OnPong(const wire::EndpointPing& pong) {
  if (!waiting_.contains(pong.token())) {
    Drop("a pong that answers no ping waiting here (late, or not from a peer pinged)");
    return;
  }
  End(pong.token(), absl::OkStatus());
}

void EndpointPings::Answer(const wire::EndpointPing& ping,
                           const transport::ReplyEndpoint& reply_ep) {
  if (answering_ >= limits_.max_answering) {
    Drop(fmt::format("a ping while {} pongs are being sent (the bound): a peer pings faster "
                     "than its pongs leave",
                     answering_));
    return;
  }
  ++answering_;
  wire::EndpointPing pong;
  pong.set_token(ping.token());
  worker_->SendAmReply(
      reply_ep, Wire(AmId::kPong), pong.SerializeAsString(), nullptr, 0,
      [this](absl::Status sent) {
        --answering_;
        if (sent.ok()) {
          ++answered_;
          return;
        }
        // The peer waits for this pong; its ConnectPeer fails at its timeout, naming
        // this agent's log.
        static LogBudget budget(5);
        uint64_t skipped = 0;
        if (budget.Take(&skipped)) {
          kLog.Warn("could not answer a peer's ping over UCX: {}; that peer's connect to this "
                    "agent fails ({} more not logged)",
                    sent.message(), skipped);
        }
      },
      /*eager=*/true);
}

void EndpointPings::Drop(std::string_view why) {
  counters_->dropped_peer_messages.fetch_add(1);
  static LogBudget budget(5);
  uint64_t skipped = 0;
  if (budget.Take(&skipped)) {
    kLog.Warn("dropped {} ({} more dropped messages not logged)", why, skipped);
  }
}

}  // namespace kvagent::agent

// EndpointPings: the round trip that proves a new UCX endpoint works both ways.
//
// An endpoint's flush completes once this agent's UCX has sent what it had; it says
// nothing about the way back. Every acknowledgement, read reply and notice the peer
// sends comes over the peer's own UCX endpoint to this agent's worker, which the peer's
// UCX sets up when the first message arrives (over shared memory it attaches this
// agent's receive queue; over tcp it answers on the connection it accepted): if that
// fails (its attach refused, its worker stuck), the peer takes this agent's pages and
// notices and nothing it answers ever arrives. Both sides then end at a transfer's
// deadline, with no reason given. So a new endpoint to a peer that takes pings
// (kWirePing) carries one first: a ping (active message 8) with a reply endpoint, which
// the peer answers with a pong (9) over that reply endpoint, the way every answer
// comes. PeerManager calls the peer connected only once the pong came, and gives the
// round trip in PeerInfo.ucx_round_trip_us.
//
// Both roles are bounded: pings waiting for their pong here (max_waiting: a further
// one fails at once), and pongs being sent (max_answering: a further ping is dropped,
// counted). A pong no ping waits for is dropped and counted. Worker thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "agent/access.h"
#include "proto/wire.pb.h"
#include "transport/ucx_worker.h"

namespace kvagent::agent {

struct EndpointPingLimits {
  uint32_t max_waiting = 1024;   // pings sent whose pong has not come
  uint32_t max_answering = 256;  // pongs whose send has not completed
};

class EndpointPings {
 public:
  // `counters`: where dropped pings and pongs count (dropped_peer_messages); outlives
  // this. `worker` outlives this too.
  EndpointPings(transport::UcxWorker* worker, SecurityCounters* counters,
                EndpointPingLimits limits = {});
  EndpointPings(const EndpointPings&) = delete;
  EndpointPings& operator=(const EndpointPings&) = delete;

  // Worker thread. Pings `peer` over `endpoint`; `done` runs once, on the worker
  // thread: with the round trip in µs when the pong came; DEADLINE_EXCEEDED when none
  // came within `timeout`; UNAVAILABLE when the ping could not be sent or the worker
  // stopped first; RESOURCE_EXHAUSTED (not sent) when max_waiting pings wait already.
  // Each message names `peer` and says what to check.
  void Ping(transport::Endpoint& endpoint, const std::string& peer,
            std::chrono::milliseconds timeout, std::function<void(absl::StatusOr<uint64_t>)> done);

  // Worker thread (the Inbox, message 8): answers `ping` with a pong over `reply_ep`.
  // Dropped and counted when max_answering pongs are being sent.
  void Answer(const wire::EndpointPing& ping, const transport::ReplyEndpoint& reply_ep);
  // Worker thread (the Inbox, message 9): ends the ping waiting for this token; a pong
  // for no waiting ping (late, or forged) is dropped and counted.
  void OnPong(const wire::EndpointPing& pong);
  // Counts a ping or pong the Inbox could not take (no reply endpoint, a header that
  // does not parse), logging `why`.
  void Drop(std::string_view why);

  // Worker thread (tests, status).
  size_t waiting() const { return waiting_.size(); }
  uint32_t answering() const { return answering_; }
  uint64_t answered() const { return answered_; }
  uint64_t timed_out() const { return timed_out_; }

 private:
  struct Waiting {
    std::string peer;
    std::chrono::steady_clock::time_point sent;
    uint32_t timeout_ms = 0;
    std::function<void(absl::StatusOr<uint64_t>)> done;
  };
  // Ends the ping of `token` (if it still waits) with `result`, or with the round trip
  // when `result` is OK.
  void End(uint64_t token, absl::Status result);

  transport::UcxWorker* worker_;
  SecurityCounters* counters_;
  const EndpointPingLimits limits_;
  absl::flat_hash_map<uint64_t, Waiting> waiting_;
  uint32_t answering_ = 0;
  uint64_t answered_ = 0;
  uint64_t timed_out_ = 0;
};

}  // namespace kvagent::agent

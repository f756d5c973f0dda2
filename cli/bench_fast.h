// The local fast path in `kvagentctl bench` (issue 15): the `fast` column beside the
// gRPC one, measured in the same run against the same agents, pools and baselines.
// - FastRing: a session of the initiator agent with a fast path ring
//   (client/fast_path), keeping up to N transfers in flight and timing each one,
//   submit -> completion reaped.
// - RunFastCell: a grid cell through the ring (one transfer at a time, then 4 in
//   flight); bench.cc prints it beside the cell's gRPC figures (FastCellColumns,
//   FastCellJson) with the same perftest and memcpy ratios.
// - RunFastPhase: one 4 KiB page, gRPC vs fast path vs a ring ping (p50/p99/p999), the
//   one-page WRITE rate (64 in flight, 1 and 2 clients; the target's notifications
//   taken on a ring of its pool owner's session when the target delivers them there,
//   as a decode engine would, else by gRPC polls: "drain") and the agents' idle CPU
//   with a ring open, with the load average.
// docs/BENCHMARKS.md ("Fast path") shows its output.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cli/agent_client.h"
#include "cli/notification_waiter.h"
#include "client/fast_path.h"
#include "proto/kvagent.pb.h"

namespace kvagent::cli {

// Transfer `n` of in-flight lane `lane` (0 .. depth-1), without its transfer id (the
// ring names it). Lanes let a caller keep transfers in flight at once on disjoint
// destinations (the agent refuses two transfers writing one page at once).
using LaneRequest = std::function<v1::SubmitTransferRequest(uint32_t lane, uint64_t n)>;

struct FastRun {
  uint64_t transfers = 0;
  double seconds = 0;
  std::vector<double> latencies_us;  // submit -> completion reaped, per transfer
  std::vector<double> agent_us;      // the agent's own: taken -> ended (completion's latency_us)
  double per_s() const { return seconds > 0 ? transfers / seconds : 0; }
};

// One session of an agent (address "unix:PATH") with its fast path ring. Not
// thread-safe: one thread drives one FastRing.
class FastRing {
 public:
  // `spin_us`: how long Reap polls before it sleeps (0: the library's default).
  static absl::StatusOr<std::unique_ptr<FastRing>> Open(const std::string& address,
                                                        uint32_t timeout_ms,
                                                        const std::string& client_name,
                                                        uint32_t spin_us = 0);
  FastRing(const FastRing&) = delete;
  FastRing& operator=(const FastRing&) = delete;

  // Keeps up to `depth` transfers in flight, ids "<prefix><lane>.<n>", until at least
  // `min_transfers` completed and `seconds` passed (or `max_transfers` were
  // submitted); completions are reaped in batches and each must be COMPLETED. With
  // `reap_batch` > 1 each reap sleeps until that many have come (at most those in flight).
  absl::StatusOr<FastRun> Run(const std::string& prefix, uint32_t depth, uint64_t min_transfers,
                              double seconds, uint64_t max_transfers, const LaneRequest& make,
                              uint32_t reap_batch = 1);
  // One transfer (its id set), submit -> completion; an error unless COMPLETED.
  absl::Status Transfer(const v1::SubmitTransferRequest& request);
  // `count` pings one after another, each submit -> completion (us); with `idle`, a
  // pause before each, so that the agent's ring thread and this client are asleep.
  absl::StatusOr<std::vector<double>> Pings(uint64_t count,
                                            absl::Duration idle = absl::ZeroDuration());
  // How many times this ring's Reap slept on its completion doorbell.
  uint64_t sleeps() const { return path_->sleeps(); }
  // The ring's session's gRPC client (its transfers' states: GetTransfer answers only
  // the session's client name).
  AgentClient& agent() { return *client_; }

 private:
  FastRing(std::unique_ptr<AgentClient> client, std::unique_ptr<client::FastPath> path,
           uint32_t timeout_ms)
      : client_(std::move(client)), path_(std::move(path)), timeout_ms_(timeout_ms) {}
  // Reaps at least `min` completions into `out` (cleared first), or at least one when
  // the timeout passes first, or fails.
  absl::Status ReapSome(std::vector<client::FastCompletion>* out, size_t max, size_t min = 1);

  std::unique_ptr<AgentClient> client_;  // holds the session; outlives path_
  std::unique_ptr<client::FastPath> path_;
  uint32_t timeout_ms_;
};

// ---- grid cells ----

// Takes the target agent's (`address`) notifications by PollNotifications in batches
// while a measurement runs, counting those whose transfer id starts with `prefix`: a
// ring moving 100,000s of WRITEs a second would otherwise fill the target's queue
// (65,536 by default), and one stream message per notification costs the target more
// than the transfers. Waits first until no notification stream is open there.
std::unique_ptr<NotificationWaiter> StartDrain(const std::string& address, std::string prefix,
                                               uint32_t timeout_ms);
// Notifications of `expected` transfers not taken by `drain` within 30 s.
absl::StatusOr<uint64_t> Missing(NotificationWaiter& drain, uint64_t expected);

struct FastCellSpec {
  std::string prefix;            // transfer ids
  uint64_t bytes_per_transfer = 0;
  uint64_t slots = 1;            // disjoint index groups: transfer i and i + slots collide
  LaneRequest make;              // lane 0 with n = i: the cell's transfer i (see RunFastCell)
  std::string notify_address;    // the target agent: its notifications are taken (WRITE)
  double seconds = 0.3;
  uint64_t min_transfers = 20;
};

struct FastCell {
  uint64_t transfers = 0;
  double gbps = 0, p50_us = 0, p99_us = 0;
  double gbps_inflight = 0;      // 4 transfers in flight on the ring
  uint64_t notifications_missing = 0;
  bool verified = false;         // set by the caller
};

// One transfer at a time (transfer i: make(0, i)), then 4 in flight (lane k's n-th:
// make(0, k + 4 * (n % (slots / 4))), the gRPC column's slots).
absl::StatusOr<FastCell> RunFastCell(FastRing& ring, const FastCellSpec& spec);

// The fast columns of a table row, and the keys of a JSON line (", \"fast_gbps\": ...",
// null / "-" without a fast cell), with ratios to the gRPC column's baselines.
std::string FastCellColumns(const std::optional<FastCell>& cell,
                            const std::optional<double>& perftest_gbps,
                            const std::optional<double>& memcpy_gbps);
std::string FastCellHeader();
std::string FastCellJson(const std::optional<FastCell>& cell,
                         const std::optional<double>& perftest_gbps,
                         const std::optional<double>& memcpy_gbps);

// ---- the fast path phase: latency, rate, idle CPU ----

struct FastPhaseOptions {
  std::string initiator_address, target_address;
  uint32_t timeout_ms = 60000;
  uint32_t spin_us = 0;          // the rings' Reap spin (0: the library's default)
  // Completions the rate phase's clients and notification taker wait for per wake-up.
  uint32_t reap_batch = 16;
  bool quick = false;
  bool json = false;
  // One 4 KiB page WRITE of transfer i (its pool items are i's, modulo the pool),
  // with or without a notification, without transfer id and wait.
  std::function<v1::SubmitTransferRequest(uint64_t i, bool notify)> one_page;
  uint64_t pages = 0;            // pool items: transfers i and i + pages collide
  // The gRPC rate phase's figures (one client, one and 64 per call), for the summary.
  std::optional<double> grpc_rate_single, grpc_rate_batch64;
  // The agents' pids when started here (idle CPU is read from /proc); 0: not here.
  pid_t initiator_pid = 0, target_pid = 0;
  // The client whose session registered the target's pool (it may take their
  // notifications): its ring watches them for the "submit -> the target's ring
  // notification" line and drains them in the rate part. Null: that line is left out
  // and the rate part drains by gRPC.
  AgentClient* target_owner = nullptr;
};

// Runs and prints the phase. `ring` is the grid's ring; the phase closes it (for the
// idle measurement without one). Errors end the bench.
absl::Status RunFastPhase(const FastPhaseOptions& options, AgentClient& initiator,
                          std::unique_ptr<FastRing>* ring);

// The 1-minute load average (/proc/loadavg); nullopt when unreadable.
std::optional<double> LoadAverage();

}  // namespace kvagent::cli

// TransferMetrics counts what ended transfers moved, for the Prometheus endpoint
// (agent/metrics): transfers and bytes by op, data path, peer and outcome, the
// submit-to-outcome latency and each timeline stage's share of it as histograms, the
// receiver's side (peers' transfers into or out of this agent, by op, peer and
// outcome); also submits and registrations refused, by cause. The transfer engine
// hands each transfer's final state here once, when it ends (gRPC and fast path
// submits alike; a retried or later chunk is the same transfer). Label sets are
// bounded: past kMaxSeries, new peers count under peer="_other".
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "proto/kvagent.pb.h"

namespace kvagent::agent {

// Upper bounds of the latency buckets, in microseconds (100 us to 60 s); +Inf follows.
inline constexpr std::array<uint64_t, 18> kLatencyBucketsUs = {
    100,     250,     500,      1000,     2500,     5000,     10000,    25000,    50000,
    100000,  250000,  500000,   1000000,  2500000,  5000000,  10000000, 30000000, 60000000};

struct TransferSeries {
  std::string op;         // "WRITE", "READ"
  std::string data_path;  // the peer's at submit: "shm-direct", "ucx", "shm-direct+ucx"
  std::string peer;
  std::string outcome;    // "COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"
  uint64_t transfers = 0;
  uint64_t bytes = 0;     // bytes_done: what reached the destination
  uint64_t errors_by_code[17] = {};  // by google.rpc code (outcome != COMPLETED)
};

// Observations in kLatencyBucketsUs (not cumulative; the last is +Inf).
struct Histogram {
  std::array<uint64_t, kLatencyBucketsUs.size() + 1> buckets{};
  uint64_t count = 0;
  uint64_t sum_us = 0;
  void Observe(uint64_t us);
};

struct LatencyHistogram : Histogram {
  std::string op;
  std::string outcome;
};

// The time from one timeline stage to the next (the stage named is the later one),
// for outgoing transfers and the receiver's records: summed over a direction's stages
// it is the whole submit-to-outcome time of every transfer counted.
struct StageHistogram : Histogram {
  std::string direction;  // "outgoing", "incoming"
  std::string op;
  std::string stage;      // "STAGE_PLANNED", ...
};

// Transfers peers ran into or out of this agent's regions, ended (the receiver's
// records: IncomingTransfers), by op, peer and outcome.
struct IncomingSeries {
  std::string op;
  std::string peer;
  std::string outcome;
  uint64_t transfers = 0;
  uint64_t bytes = 0;  // bytes_done: what the sender moved, as its DATA_READY said
};

class TransferMetrics {
 public:
  static constexpr size_t kMaxSeries = 4096;

  // A transfer ended with `state`; it was submitted over `data_path` ("ucx",
  // "shm-direct", "shm-direct+ucx"). Called once per transfer, under the engine's
  // lock: takes only this object's lock.
  void Ended(const v1::TransferState& state, std::string_view data_path);

  // A peer's transfer into or out of this agent's regions ended with `state` (the
  // receiver's record; called once per record, under IncomingTransfers' lock).
  void IncomingEnded(const v1::TransferState& state);

  // A SubmitTransfer chunk or a RegisterRegions batch refused with `code`.
  void SubmitRefused(absl::StatusCode code);
  void RegistrationFailed(absl::StatusCode code);
  // Refusals by google.rpc code (index = code).
  using ByCode = std::array<uint64_t, 17>;
  ByCode submit_refusals() const;
  ByCode registration_failures() const;

  std::vector<TransferSeries> Series() const;
  std::vector<LatencyHistogram> Latency() const;
  std::vector<IncomingSeries> Incoming() const;
  std::vector<StageHistogram> Stages() const;

 private:
  // Ordered by the label strings (the exposition's order); looked up with string_views
  // (std::less<>), so counting an ended transfer builds no key strings.
  using Key = std::tuple<std::string, std::string, std::string, std::string>;
  using IncomingKey = std::tuple<std::string, std::string, std::string>;
  using StageKey = std::tuple<std::string, std::string, std::string>;
  mutable absl::Mutex mu_;
  std::map<Key, TransferSeries, std::less<>> series_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, LatencyHistogram> latency_ ABSL_GUARDED_BY(mu_);
  std::map<IncomingKey, IncomingSeries, std::less<>> incoming_ ABSL_GUARDED_BY(mu_);
  std::map<StageKey, StageHistogram> stages_ ABSL_GUARDED_BY(mu_);
  // The histograms by enum value (map nodes do not move): the per-transfer path
  // indexes these instead of building label strings; null until first observed.
  // Values outside the enums (a newer peer's) take the maps by name.
  static constexpr int kOps = v1::TransferOp_ARRAYSIZE;
  static constexpr int kPhases = v1::TransferPhase_ARRAYSIZE;
  static constexpr int kStages = v1::TransferStage_ARRAYSIZE;
  LatencyHistogram* latency_index_[kOps][kPhases] ABSL_GUARDED_BY(mu_) = {};
  StageHistogram* stage_index_[2][kOps][kStages] ABSL_GUARDED_BY(mu_) = {};  // outgoing, incoming
  LatencyHistogram& LatencyOf(v1::TransferOp op, v1::TransferPhase phase)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  StageHistogram& StageOf(bool incoming, v1::TransferOp op, v1::TransferStage stage)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds each stage's time since the one before to stages_.
  void ObserveStages(bool incoming, const v1::TransferState& state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The series the last Ended counted, with its op and outcome (Ended's shortcut).
  TransferSeries* last_series_ ABSL_GUARDED_BY(mu_) = nullptr;
  v1::TransferOp last_op_ ABSL_GUARDED_BY(mu_) = v1::TRANSFER_OP_UNSPECIFIED;
  v1::TransferPhase last_phase_ ABSL_GUARDED_BY(mu_) = v1::TransferPhase(0);
  ByCode submit_refusals_ ABSL_GUARDED_BY(mu_) = {};
  ByCode registration_failures_ ABSL_GUARDED_BY(mu_) = {};
};

}  // namespace kvagent::agent

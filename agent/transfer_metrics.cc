#include "agent/transfer_metrics.h"

namespace kvagent::agent {

bool TransferMetrics::Track(const std::string& transfer_id, const std::string& data_path) {
  absl::MutexLock lock(&mu_);
  if (active_.count(transfer_id) != 0 || ended_.contains(transfer_id)) return false;
  active_.emplace(transfer_id, data_path);
  return true;
}

void TransferMetrics::Ended(const v1::TransferState& state) {
  absl::MutexLock lock(&mu_);
  auto it = active_.find(state.transfer_id());
  if (it == active_.end()) return;
  const std::string data_path = std::move(it->second);
  active_.erase(it);
  ended_.insert(state.transfer_id());
  ended_order_.push_back(state.transfer_id());
  if (ended_order_.size() > kRememberEnded) {
    ended_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
  const std::string op = v1::TransferOp_Name(state.op());
  const std::string outcome = v1::TransferPhase_Name(state.phase());
  Key key{op, data_path, state.peer(), outcome};
  if (series_.count(key) == 0 && series_.size() >= kMaxSeries) std::get<2>(key) = "_other";
  TransferSeries& series = series_[key];
  if (series.transfers == 0) {
    series.op = op;
    series.data_path = data_path;
    series.peer = std::get<2>(key);
    series.outcome = outcome;
  }
  ++series.transfers;
  series.bytes += state.bytes_done();
  if (state.phase() != v1::COMPLETED) {
    const int code = state.error_code();
    ++series.errors_by_code[code >= 0 && code < 17 ? code : 2 /* UNKNOWN */];
  }
  LatencyHistogram& histogram = latency_[{op, outcome}];
  if (histogram.count == 0) {
    histogram.op = op;
    histogram.outcome = outcome;
  }
  histogram.Observe(state.latency_us());
  ObserveStages("outgoing", state);
}

void TransferMetrics::IncomingEnded(const v1::TransferState& state) {
  absl::MutexLock lock(&mu_);
  const std::string op = v1::TransferOp_Name(state.op());
  const std::string outcome = v1::TransferPhase_Name(state.phase());
  std::tuple<std::string, std::string, std::string> key{op, state.peer(), outcome};
  if (incoming_.count(key) == 0 && incoming_.size() >= kMaxSeries) std::get<1>(key) = "_other";
  IncomingSeries& series = incoming_[key];
  if (series.transfers == 0) {
    series.op = op;
    series.peer = std::get<1>(key);
    series.outcome = outcome;
  }
  ++series.transfers;
  series.bytes += state.bytes_done();
  ObserveStages("incoming", state);
}

void TransferMetrics::ObserveStages(const std::string& direction, const v1::TransferState& state) {
  const std::string op = v1::TransferOp_Name(state.op());
  for (int i = 1; i < state.timeline_size(); ++i) {
    const std::string stage = v1::TransferStage_Name(state.timeline(i).stage());
    StageHistogram& histogram = stages_[{direction, op, stage}];
    if (histogram.count == 0) {
      histogram.direction = direction;
      histogram.op = op;
      histogram.stage = stage;
    }
    const uint64_t at = state.timeline(i).at_us(), before = state.timeline(i - 1).at_us();
    histogram.Observe(at > before ? at - before : 0);
  }
}

void Histogram::Observe(uint64_t us) {
  size_t bucket = 0;
  while (bucket < kLatencyBucketsUs.size() && us > kLatencyBucketsUs[bucket]) ++bucket;
  ++buckets[bucket];
  ++count;
  sum_us += us;
}

namespace {
// The values of a map of series, in key order (labels sorted).
template <typename Map>
std::vector<typename Map::mapped_type> ValuesOf(const Map& map) {
  std::vector<typename Map::mapped_type> out;
  out.reserve(map.size());
  for (const auto& entry : map) out.push_back(entry.second);
  return out;
}
}  // namespace

std::vector<TransferSeries> TransferMetrics::Series() const {
  absl::MutexLock lock(&mu_);
  return ValuesOf(series_);
}

std::vector<LatencyHistogram> TransferMetrics::Latency() const {
  absl::MutexLock lock(&mu_);
  return ValuesOf(latency_);
}

std::vector<IncomingSeries> TransferMetrics::Incoming() const {
  absl::MutexLock lock(&mu_);
  return ValuesOf(incoming_);
}

std::vector<StageHistogram> TransferMetrics::Stages() const {
  absl::MutexLock lock(&mu_);
  return ValuesOf(stages_);
}

namespace {
size_t CodeIndex(absl::StatusCode code) {
  const int c = static_cast<int>(code);
  return c >= 0 && c < 17 ? static_cast<size_t>(c) : 2;  // UNKNOWN
}
}  // namespace

void TransferMetrics::SubmitRefused(absl::StatusCode code) {
  absl::MutexLock lock(&mu_);
  ++submit_refusals_[CodeIndex(code)];
}

void TransferMetrics::RegistrationFailed(absl::StatusCode code) {
  absl::MutexLock lock(&mu_);
  ++registration_failures_[CodeIndex(code)];
}

TransferMetrics::ByCode TransferMetrics::submit_refusals() const {
  absl::MutexLock lock(&mu_);
  return submit_refusals_;
}

TransferMetrics::ByCode TransferMetrics::registration_failures() const {
  absl::MutexLock lock(&mu_);
  return registration_failures_;
}

uint64_t TransferMetrics::tracked() const {
  absl::MutexLock lock(&mu_);
  return active_.size();
}

}  // namespace kvagent::agent

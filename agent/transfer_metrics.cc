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
  size_t bucket = 0;
  while (bucket < kLatencyBucketsUs.size() && state.latency_us() > kLatencyBucketsUs[bucket]) {
    ++bucket;
  }
  ++histogram.buckets[bucket];
  ++histogram.count;
  histogram.sum_us += state.latency_us();
}

std::vector<TransferSeries> TransferMetrics::Series() const {
  absl::MutexLock lock(&mu_);
  std::vector<TransferSeries> out;
  out.reserve(series_.size());
  for (const auto& [key, series] : series_) out.push_back(series);
  return out;
}

std::vector<LatencyHistogram> TransferMetrics::Latency() const {
  absl::MutexLock lock(&mu_);
  std::vector<LatencyHistogram> out;
  for (const auto& [key, histogram] : latency_) out.push_back(histogram);
  return out;
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

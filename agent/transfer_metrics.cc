#include "agent/transfer_metrics.h"

#include <algorithm>

namespace kvagent::agent {

namespace {
// An enum value's name, from a table made once: the generated *_Name looks the value up
// in the descriptor each time, and this runs for every transfer that ends.
template <int kSize, typename Enum>
const std::string& CachedName(Enum value, const std::string& (*name)(Enum)) {
  static const std::array<const std::string*, kSize> names = [name] {
    std::array<const std::string*, kSize> table{};
    for (int i = 0; i < kSize; ++i) table[i] = &name(static_cast<Enum>(i));
    return table;
  }();
  return value >= 0 && value < kSize ? *names[value] : name(value);
}
const std::string& OpLabel(v1::TransferOp op) {
  return CachedName<v1::TransferOp_ARRAYSIZE>(op, &v1::TransferOp_Name<v1::TransferOp>);
}
const std::string& PhaseLabel(v1::TransferPhase phase) {
  return CachedName<v1::TransferPhase_ARRAYSIZE>(phase, &v1::TransferPhase_Name<v1::TransferPhase>);
}
}  // namespace

void TransferMetrics::Ended(const v1::TransferState& state, std::string_view data_path) {
  absl::MutexLock lock(&mu_);
  // Most transfers end like the one before (same op, outcome, path and peer): that
  // series is kept at hand, and the map searched only when they differ.
  TransferSeries* last = last_series_;
  if (last == nullptr || last_op_ != state.op() || last_phase_ != state.phase() ||
      last->data_path != data_path || last->peer != state.peer()) {
    const std::string& op = OpLabel(state.op());
    const std::string& outcome = PhaseLabel(state.phase());
    using View = std::tuple<std::string_view, std::string_view, std::string_view, std::string_view>;
    auto found = series_.find(View{op, data_path, state.peer(), outcome});
    if (found == series_.end()) {
      Key key{op, std::string(data_path), state.peer(), outcome};
      if (series_.size() >= kMaxSeries) std::get<2>(key) = "_other";
      found = series_.try_emplace(std::move(key)).first;
    }
    last = &found->second;
    if (last->transfers == 0) {
      last->op = op;
      last->data_path = std::string(data_path);
      last->peer = std::get<2>(found->first);
      last->outcome = outcome;
    }
    last_series_ = last;  // map nodes do not move
    last_op_ = state.op();
    last_phase_ = state.phase();
  }
  TransferSeries& series = *last;
  ++series.transfers;
  series.bytes += state.bytes_done();
  if (state.phase() != v1::COMPLETED) {
    const int code = state.error_code();
    ++series.errors_by_code[code >= 0 && code < 17 ? code : 2 /* UNKNOWN */];
  }
  LatencyOf(state.op(), state.phase()).Observe(state.latency_us());
  ObserveStages(/*incoming=*/false, state);
}

void TransferMetrics::IncomingEnded(const v1::TransferState& state) {
  absl::MutexLock lock(&mu_);
  const std::string& op = v1::TransferOp_Name(state.op());
  const std::string& outcome = v1::TransferPhase_Name(state.phase());
  using View = std::tuple<std::string_view, std::string_view, std::string_view>;
  auto found = incoming_.find(View{op, state.peer(), outcome});
  if (found == incoming_.end()) {
    IncomingKey key{op, state.peer(), outcome};
    if (incoming_.size() >= kMaxSeries) std::get<1>(key) = "_other";
    found = incoming_.try_emplace(std::move(key)).first;
  }
  IncomingSeries& series = found->second;
  if (series.transfers == 0) {
    series.op = op;
    series.peer = std::get<1>(found->first);
    series.outcome = outcome;
  }
  ++series.transfers;
  series.bytes += state.bytes_done();
  ObserveStages(/*incoming=*/true, state);
}

LatencyHistogram& TransferMetrics::LatencyOf(v1::TransferOp op, v1::TransferPhase phase) {
  const bool indexed = op >= 0 && op < kOps && phase >= 0 && phase < kPhases;
  if (indexed && latency_index_[op][phase] != nullptr) return *latency_index_[op][phase];
  const std::string& op_name = v1::TransferOp_Name(op);
  const std::string& outcome = v1::TransferPhase_Name(phase);
  LatencyHistogram& histogram = latency_[{op_name, outcome}];
  if (histogram.count == 0) {
    histogram.op = op_name;
    histogram.outcome = outcome;
  }
  if (indexed) latency_index_[op][phase] = &histogram;
  return histogram;
}

StageHistogram& TransferMetrics::StageOf(bool incoming, v1::TransferOp op,
                                         v1::TransferStage stage) {
  const bool indexed = op >= 0 && op < kOps && stage >= 0 && stage < kStages;
  if (indexed && stage_index_[incoming][op][stage] != nullptr) {
    return *stage_index_[incoming][op][stage];
  }
  const std::string direction = incoming ? "incoming" : "outgoing";
  const std::string& op_name = v1::TransferOp_Name(op);
  const std::string& stage_name = v1::TransferStage_Name(stage);
  StageHistogram& histogram = stages_[{direction, op_name, stage_name}];
  if (histogram.count == 0) {
    histogram.direction = direction;
    histogram.op = op_name;
    histogram.stage = stage_name;
  }
  if (indexed) stage_index_[incoming][op][stage] = &histogram;
  return histogram;
}

void TransferMetrics::ObserveStages(bool incoming, const v1::TransferState& state) {
  for (int i = 1; i < state.timeline_size(); ++i) {
    const uint64_t at = state.timeline(i).at_us(), before = state.timeline(i - 1).at_us();
    StageOf(incoming, state.op(), state.timeline(i).stage()).Observe(at > before ? at - before : 0);
  }
}

void Histogram::Observe(uint64_t us) {
  // The first bucket whose bound is >= us; past the last bound, +Inf.
  const size_t bucket = static_cast<size_t>(
      std::lower_bound(kLatencyBucketsUs.begin(), kLatencyBucketsUs.end(), us) -
      kLatencyBucketsUs.begin());
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

}  // namespace kvagent::agent

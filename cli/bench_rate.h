// `kvagentctl bench`'s rate phase: many one-page WRITEs at once through the gRPC API
// (SubmitTransfer one at a time, or SubmitTransfers batches, from several clients),
// every transfer's notification taken by a client of the target; and its lines.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "cli/bench_layout.h"
#include "cli/bench_options.h"
#include "proto/kvagent.pb.h"

namespace kvagent::cli {

struct RateResult {
  std::string mode;       // "single" (SubmitTransfer) or "batch" (SubmitTransfers)
  uint32_t clients = 0;   // client threads, each with its own channel
  uint32_t per_call = 0;  // transfers per RPC
  uint64_t transfers = 0;
  double transfers_per_s = 0, p50_us = 0, p99_us = 0;  // latency per call
  uint64_t notifications = 0;  // DATA_READY seen by the target's client
  uint64_t late_notifications = 0;  // of those, taken after the closing transfer's
};

// One 4 KiB WRITE of the pages of transfer `i` (entry i of each side's permutation),
// with `notification` unless empty; without id and wait.
v1::SubmitTransferRequest OnePageWrite(const BenchOptions& options, const std::string& peer,
                                       const Layout& layout, uint64_t i,
                                       const std::string& notification);

// `clients` threads submit one-page WRITEs (each with a notification, waiting for the
// end) for about `seconds`; a client of the target takes the notifications, and
// every transfer's must arrive.
absl::StatusOr<RateResult> RunRate(const BenchOptions& options, const std::string& initiator_address,
                                   const std::string& target_address, const std::string& peer,
                                   const Layout& layout, uint32_t clients, uint32_t per_call,
                                   double seconds, const std::string& prefix);

std::string RateJson(const RateResult& r);  // one JSON object, one line
std::string RateLine(const RateResult& r);  // the table's line

}  // namespace kvagent::cli

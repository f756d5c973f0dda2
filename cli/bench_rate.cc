#include "cli/bench_rate.h"

#include <chrono>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/format.h"
#include "cli/agent_client.h"
#include "cli/local_agents.h"
#include "cli/notification_waiter.h"
#include "fmt/format.h"

namespace kvagent::cli {

using Clock = std::chrono::steady_clock;

v1::SubmitTransferRequest OnePageWrite(const BenchOptions& options, const std::string& peer,
                                       const Layout& layout, uint64_t i,
                                       const std::string& notification) {
  const uint64_t local = layout.local_order[i % layout.items];
  const uint64_t remote = layout.remote_order[i % layout.items];
  v1::SubmitTransferRequest request =
      LayoutRequest(layout, v1::WRITE, peer, options.timeout_ms, {&local, 1}, {&remote, 1});
  if (!notification.empty()) request.set_notification(notification);
  return request;
}

absl::StatusOr<RateResult> RunRate(const BenchOptions& options, const std::string& initiator_address,
                                   const std::string& target_address, const std::string& peer,
                                   const Layout& layout, uint32_t clients, uint32_t per_call,
                                   double seconds, const std::string& prefix) {
  RateResult result;
  result.mode = per_call == 1 ? "single" : "batch";
  result.clients = clients;
  result.per_call = per_call;
  const std::string end_id = prefix + "end";

  NotificationWaiter watch(StreamUntil(target_address, prefix, end_id));

  auto one_page = [&](const std::string& id, uint64_t i) {
    v1::SubmitTransferRequest request = OnePageWrite(options, peer, layout, i, "rate");
    request.set_transfer_id(id);
    request.set_wait(true);
    return request;
  };

  absl::Mutex mu;
  std::vector<double> latencies;
  uint64_t completed = 0;
  absl::Status failure;
  const auto start = Clock::now();
  const auto stop_at = start + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(seconds));
  std::vector<std::thread> threads;
  for (uint32_t c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      AgentClient client(initiator_address, options.timeout_ms);
      std::vector<double> mine;
      uint64_t done = 0;
      absl::Status error;
      for (uint64_t call = 0; error.ok() && Clock::now() < stop_at; ++call) {
        const auto t0 = Clock::now();
        if (per_call == 1) {
          const uint64_t i = call * clients + c;
          auto state = client.Submit(one_page(fmt::format("{}{}.{}", prefix, c, call), i));
          if (!state.ok()) {
            error = state.status();
          } else if (state->phase() != v1::COMPLETED) {
            error = absl::InternalError(fmt::format("transfer '{}' ended {}: {}",
                                                    state->transfer_id(),
                                                    v1::TransferPhase_Name(state->phase()),
                                                    state->error_message()));
          } else {
            ++done;
          }
        } else {
          v1::SubmitTransfersRequest batch;
          batch.set_wait(true);
          for (uint32_t k = 0; k < per_call; ++k) {
            const uint64_t i = (call * clients + c) * per_call + k;
            *batch.add_transfers() = one_page(fmt::format("{}{}.{}.{}", prefix, c, call, k), i);
          }
          auto answer = client.SubmitBatch(batch);
          if (!answer.ok()) {
            error = answer.status();
          } else {
            for (const auto& r : answer->results()) {
              if (r.error_code() != 0 || r.state().phase() != v1::COMPLETED) {
                error = absl::InternalError(fmt::format(
                    "a batched transfer failed: {}",
                    r.error_code() != 0 ? r.error_message() : r.state().error_message()));
                break;
              }
              ++done;
            }
          }
        }
        mine.push_back(Micros(Clock::now() - t0));
      }
      absl::MutexLock lock(&mu);
      latencies.insert(latencies.end(), mine.begin(), mine.end());
      completed += done;
      if (!error.ok() && failure.ok()) failure = error;
    });
  }
  for (auto& t : threads) t.join();
  const double elapsed = Seconds(Clock::now() - start);

  // The closing transfer ends the notification stream once everything before it came.
  AgentClient closer(initiator_address, options.timeout_ms);
  auto closed = closer.Submit(one_page(end_id, 0));
  watch.Finish(absl::Seconds(10));
  result.notifications = watch.kept();
  // Notifications of different transfers carry no order between them: those that
  // came after the closing one are still queued at the target.
  AgentClient target(target_address, options.timeout_ms);
  for (int round = 0; round < 50 && result.notifications < completed; ++round) {
    auto late = target.Poll(0);
    if (!late.ok()) break;
    uint64_t mine = 0;
    for (const auto& n : late->notifications()) {
      if (n.transfer_id().rfind(prefix, 0) == 0 && n.transfer_id() != end_id) ++mine;
    }
    result.notifications += mine;
    result.late_notifications += mine;
    if (result.notifications < completed) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!failure.ok()) return failure;
  if (!closed.ok()) return closed.status();
  result.transfers = completed;
  result.transfers_per_s = completed / elapsed;
  result.p50_us = Percentile(latencies, 50);
  result.p99_us = Percentile(latencies, 99);
  if (result.notifications != completed) {
    return absl::DataLossError(fmt::format(
        "{} {} transfers completed but the target's client saw {} notifications for them",
        result.mode, completed, result.notifications));
  }
  return result;
}

std::string RateJson(const RateResult& r) {
  return fmt::format(
      "{{\"kind\": \"rate\", \"op\": \"WRITE\", \"block_bytes\": 4096, \"mode\": \"{}\", "
      "\"clients\": {}, \"transfers_per_call\": {}, \"transfers\": {}, "
      "\"transfers_per_s\": {:.1f}, \"call_p50_us\": {:.1f}, \"call_p99_us\": {:.1f}, "
      "\"notifications\": {}, \"late_notifications\": {}}}",
      r.mode, r.clients, r.per_call, r.transfers, r.transfers_per_s, r.p50_us, r.p99_us,
      r.notifications, r.late_notifications);
}

std::string RateLine(const RateResult& r) {
  return fmt::format("rate  {:<6} clients {:>2} x {:>3} per call: {:>7} transfers, {:>8.0f} /s, "
                     "call p50 {:>6.0f} us, p99 {:>6.0f} us, notifications {}",
                     r.mode, r.clients, r.per_call, r.transfers, r.transfers_per_s, r.p50_us,
                     r.p99_us, r.notifications == r.transfers ? "all" : "MISSING");
}

}  // namespace kvagent::cli

#include "cli/bench_sweep.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/format.h"
#include "base/status_macros.h"
#include "cli/local_agents.h"
#include "cli/notification_waiter.h"
#include "fmt/format.h"

namespace kvagent::cli {

using Clock = std::chrono::steady_clock;

// Writes a buffer larger than the last-level cache, so the next copy starts cold.
class CacheEvictor {
 public:
  explicit CacheEvictor(uint64_t bytes) : buffer_(bytes, 1) {}
  void Evict() {
    ++round_;
    for (size_t i = 0; i < buffer_.size(); i += 64) buffer_[i] = static_cast<uint8_t>(round_ + i);
  }

 private:
  std::vector<uint8_t> buffer_;
  uint64_t round_ = 0;
};

// The speed of the second against the first (the first's times over the second's, per
// round): the ratio of the medians, and the interquartile range of the rounds' ratios.
PairedRatio Paired(const std::vector<double>& first_us, const std::vector<double>& second_us) {
  PairedRatio ratio;
  const double second = Percentile(second_us, 50);
  if (second <= 0) return ratio;
  ratio.of_medians = Percentile(first_us, 50) / second;
  std::vector<double> rounds;
  for (size_t k = 0; k < first_us.size() && k < second_us.size(); ++k) {
    if (second_us[k] > 0) rounds.push_back(first_us[k] / second_us[k]);
  }
  ratio.q1 = Percentile(rounds, 25);
  ratio.q3 = Percentile(rounds, 75);
  return ratio;
}

class CellBench::Impl {
 public:
  Impl(const BenchOptions& options, AgentClient& initiator, std::string target_address,
       std::string peer, Pools& pools, Perftest& perftest, FastRing* fast)
      : options_(options),
        initiator_(initiator),
        target_address_(std::move(target_address)),
        peer_(std::move(peer)),
        pools_(pools),
        perftest_(perftest),
        fast_(fast),
        evictor_(64ull << 20),
        prefix_(fmt::format("bench{}.", getpid())) {}

  absl::StatusOr<CellResult> Run(const Layout& layout, const Cell& cell) {
    CellResult result;
    result.cell = cell;
    const std::string base = fmt::format("{}{}.", prefix_, cell_number_++);
    const bool write = cell.op == v1::WRITE;
    std::vector<uint64_t> local, remote;

    // WRITE: the target's notifications, timed when they reach a client of the
    // target agent, as a decode worker sees them.
    const std::string end_id = base + "end";
    std::optional<NotificationWaiter> watch;
    if (write) watch.emplace(StreamUntil(target_address_, base, end_id));

    // Warm-up: maps and registrations in place, and (WRITE) the notification
    // stream open before anything is timed. The last one carries the notification
    // waited for below.
    for (int w = 0; w < 3; ++w) {
      Indices(layout, cell, w, &local, &remote);
      const std::string id = w == 2 ? base + "warmup" : fmt::format("{}warmup{}", base, w);
      if (auto s = Transfer(layout, cell, id, local, remote, write); !s.ok()) {
        return s.status();
      }
    }
    if (auto peers = initiator_.Peers(); peers.ok()) {
      for (const auto& p : peers->peers()) {
        if (p.name() == peer_) result.data_path = p.data_path();
      }
    }
    if (write) {
      const std::string warm = base + "warmup";
      if (absl::Status why = watch->WaitForId(warm, absl::Seconds(10)); !why.ok()) {
        return absl::DeadlineExceededError(fmt::format(
            "the target agent at {} delivered no notification for '{}' within 10 s ({}); check "
            "its log", target_address_, warm, why.message()));
      }
    }

    const double target_s = options_.quick ? 0.1 : 0.3;
    const uint64_t min_transfers = MinTransfers(cell);
    const uint64_t max_transfers = 100000;
    std::vector<double> latencies;
    std::vector<std::pair<std::string, Clock::time_point>> submitted;
    const auto start = Clock::now();
    for (uint64_t i = 0; i < max_transfers; ++i) {
      if (i >= min_transfers && Seconds(Clock::now() - start) >= target_s) break;
      Indices(layout, cell, i, &local, &remote);
      const std::string id = fmt::format("{}{}", base, i);
      const auto t0 = Clock::now();
      auto state = Transfer(layout, cell, id, local, remote, write);
      const auto t1 = Clock::now();
      if (!state.ok()) {
        return state.status();
      }
      result.runs = state->runs();
      latencies.push_back(Micros(t1 - t0));
      if (write) submitted.emplace_back(id, t0);
    }
    const double seconds = Seconds(Clock::now() - start);
    result.transfers = latencies.size();
    const double bytes = static_cast<double>(result.transfers) * cell.batch * cell.block;
    result.gbps = bytes / seconds / 1e9;
    result.transfers_per_s = result.transfers / seconds;
    result.avg_us = std::accumulate(latencies.begin(), latencies.end(), 0.0) / latencies.size();
    result.p50_us = Percentile(latencies, 50);
    result.p99_us = Percentile(latencies, 99);

    // The same cell with kInflight transfers in flight at once (a scheduler keeps
    // many requests moving; ucx_perftest keeps a window of puts outstanding too).
    {
      // The agent refuses two transfers writing the same destination at once, so each
      // thread keeps to its own slots (a slot: `batch` items; a pool of fewer slots
      // than kInflight runs fewer threads).
      constexpr uint32_t kInflight = 4;
      const uint64_t slots = std::max<uint64_t>(1, layout.items / cell.batch);
      const uint32_t inflight = static_cast<uint32_t>(std::min<uint64_t>(kInflight, slots));
      absl::Mutex mu;
      uint64_t moved = 0;
      absl::Status failed;
      const auto pipelined_start = Clock::now();
      std::vector<std::thread> threads;
      for (uint32_t k = 0; k < inflight; ++k) {
        threads.emplace_back([&, k] {
          std::vector<uint64_t> l, r;
          uint64_t done = 0;
          absl::Status error;
          for (uint64_t n = 0; error.ok(); ++n) {
            if (n >= min_transfers && Seconds(Clock::now() - pipelined_start) >= target_s) break;
            // Slot k, k + inflight, k + 2 * inflight, ... below slots (whole rounds only).
            const uint64_t per_thread = slots / inflight;
            const uint64_t i = k + inflight * (n % per_thread);
            Indices(layout, cell, i, &l, &r);
            auto state = Transfer(layout, cell, fmt::format("{}p{}.{}", base, k, n), l, r, write);
            if (state.ok()) {
              ++done;
            } else {
              error = state.status();
            }
          }
          absl::MutexLock lock(&mu);
          moved += done;
          if (!error.ok() && failed.ok()) failed = error;
        });
      }
      for (auto& t : threads) t.join();
      if (!failed.ok()) {
        return failed;
      }
      result.gbps_inflight = static_cast<double>(moved) * cell.batch * cell.block /
                             Seconds(Clock::now() - pipelined_start) / 1e9;
    }

    // One more transfer whose destination was scribbled first: its bytes must
    // equal the source afterwards. For WRITE it also ends the notification stream.
    Indices(layout, cell, result.transfers, &local, &remote);
    if (pools_.shared) Scribble(layout, cell, local, remote);
    if (auto s = Transfer(layout, cell, end_id, local, remote, write); !s.ok()) {
      return s.status();
    }
    result.verified = pools_.shared && Verify(layout, cell, local, remote);
    if (write) {
      watch->Finish(absl::Seconds(10));
      std::vector<double> notify;
      const auto seen = watch->Kept();
      for (const auto& [id, t0] : submitted) {
        auto it = seen.find(id);
        if (it == seen.end()) {
          ++result.notifications_missing;
        } else {
          notify.push_back(Micros(it->second - t0));
        }
      }
      if (!notify.empty()) {
        result.notify_p50_us = Percentile(notify, 50);
        result.notify_p99_us = Percentile(notify, 99);
      }
    }

    if (fast_ != nullptr) {
      ASSIGN_OR_RETURN(result.fast, RunFast(layout, cell, base + "f."));
    }

    result.memcpy_gbps = Memcpy(layout, cell, result.transfers);
    const uint64_t perftest_size = cell.scattered ? cell.block : cell.block * cell.batch;
    result.perftest_gbps = perftest_.Gbps(write ? "ucp_put_bw" : "ucp_get", perftest_size);
    if (!write) RETURN_IF_ERROR(TakeReadNotices());
    return result;
  }

  // READ: the target agent keeps one notification per transfer for its own clients
  // (their pages were read), which nothing takes during a READ cell (WRITE cells time
  // theirs). Taken here, between cells and untimed, so that a whole run stays under
  // the target's queued_notifications limit (65,536): on a host that ran the fast path
  // at 25,000 one-page READs a second, the first 4 KiB READ cells of a full run
  // filled it, and the target refused the next READ.
  absl::Status TakeReadNotices() {
    AgentClient target(target_address_, options_.timeout_ms);
    while (true) {
      ASSIGN_OR_RETURN(v1::PollNotificationsResponse taken, target.Poll(8192));
      if (taken.notifications_size() == 0) return absl::OkStatus();
    }
  }

  absl::StatusOr<std::optional<PairedCell>> Pair(const Layout& layout, const Cell& shape) {
    if (fast_ == nullptr) return std::optional<PairedCell>();
    const Cell contiguous{shape.op, false, shape.block, shape.batch};
    const Cell scattered{shape.op, true, shape.block, shape.batch};
    const bool write = shape.op == v1::WRITE;
    std::optional<Copier> copier = MakeCopier(layout, contiguous);
    if (!copier) return std::optional<PairedCell>();
    const std::string prefix = fmt::format("{}{}.pair.", prefix_, cell_number_++);
    // WRITE: notified as the fast column's transfers are, the target's taken meanwhile.
    std::unique_ptr<NotificationWaiter> drain;
    if (write) drain = StartDrain(target_address_, prefix, options_.timeout_ms);
    // At least `min_rounds`, then until `seconds` have passed (at most `max_rounds`).
    const uint64_t min_rounds = options_.quick ? 5 : 9;
    const uint64_t max_rounds = options_.quick ? 20 : 40;
    const double seconds = options_.quick ? 0.05 : 0.3;
    std::vector<double> memcpy_us, memcpy_scattered_us, contiguous_us, scattered_us;
    std::vector<uint64_t> local, remote;
    uint64_t transfers = 0;
    // Transfer `i` of `cell` through the ring from a cold cache, the agent awake.
    auto timed_transfer = [&](const Cell& cell, uint64_t i) -> absl::StatusOr<double> {
      Indices(layout, cell, i, &local, &remote);
      v1::SubmitTransferRequest request =
          Request(layout, cell, fmt::format("{}{}.{}", prefix, cell.scattered ? "s" : "c", i),
                  local, remote, write);
      request.clear_wait();
      copier->before();
      RETURN_IF_ERROR(fast_->Pings(1).status());
      const auto t0 = Clock::now();
      RETURN_IF_ERROR(fast_->Transfer(request));
      ++transfers;
      return Micros(Clock::now() - t0);
    };
    // (d), completing when placed: measured once the first one shows the agent honours
    // complete_when (an older one completes it when acknowledged).
    std::vector<double> placed_us;
    bool placed = true;
    auto timed_placed = [&](uint64_t i) -> absl::StatusOr<double> {
      Indices(layout, contiguous, i, &local, &remote);
      v1::SubmitTransferRequest request =
          Request(layout, contiguous, fmt::format("{}p.{}", prefix, i), local, remote, write);
      request.clear_wait();
      request.set_complete_when(v1::COMPLETE_WHEN_PLACED);
      copier->before();
      RETURN_IF_ERROR(fast_->Pings(1).status());
      const auto t0 = Clock::now();
      RETURN_IF_ERROR(fast_->Transfer(request));
      const double us = Micros(Clock::now() - t0);
      ++transfers;
      if (i == 0) {
        ASSIGN_OR_RETURN(v1::TransferState state, fast_->agent().Get(request.transfer_id()));
        placed = state.complete_when() == v1::COMPLETE_WHEN_PLACED;
      }
      return us;
    };
    // (a) or (e): one thread's copy of transfer `i` of `cell`'s pages from a cold cache,
    // into `out`; false when the copier failed.
    auto timed_copy = [&](const Cell& cell, uint64_t i, std::vector<double>* out) {
      Indices(layout, cell, i, &local, &remote);
      copier->before();
      const auto t0 = Clock::now();
      if (!copier->copy(write ? local : remote, write ? remote : local)) return false;
      out->push_back(Micros(Clock::now() - t0));
      return true;
    };
    const auto start = Clock::now();
    for (uint64_t r = 0; r < max_rounds; ++r) {
      if (r >= min_rounds && Seconds(Clock::now() - start) >= seconds) break;
      if (!timed_copy(contiguous, r, &memcpy_us) ||
          !timed_copy(scattered, r, &memcpy_scattered_us)) {
        return std::optional<PairedCell>();
      }
      // (b), (c) and (d) in turn first.
      for (int k = 0; k < 3; ++k) {
        const int which = static_cast<int>((r + k) % 3);
        if (which == 2) {
          if (!placed) continue;
          ASSIGN_OR_RETURN(double us, timed_placed(r));
          if (placed) placed_us.push_back(us);
          continue;
        }
        const bool s = which == 1;
        ASSIGN_OR_RETURN(double us, timed_transfer(s ? scattered : contiguous, r));
        (s ? scattered_us : contiguous_us).push_back(us);
      }
    }
    if (drain) {
      ASSIGN_OR_RETURN(uint64_t missing, Missing(*drain, transfers));
      if (missing > 0) {
        return absl::DataLossError(fmt::format(
            "paired rounds, WRITE {} x {}: {} of {} notifications did not reach the target's "
            "client", SizeName(shape.block), shape.batch, missing, transfers));
      }
    } else {
      RETURN_IF_ERROR(TakeReadNotices());
    }
    PairedCell paired;
    paired.cell = contiguous;
    paired.rounds = memcpy_us.size();
    paired.memcpy_p50_us = Percentile(memcpy_us, 50);
    paired.contiguous_p50_us = Percentile(contiguous_us, 50);
    paired.scattered_p50_us = Percentile(scattered_us, 50);
    paired.fast_over_memcpy = Paired(memcpy_us, contiguous_us);
    paired.scattered_over_contiguous = Paired(contiguous_us, scattered_us);
    paired.memcpy_scattered_p50_us = Percentile(memcpy_scattered_us, 50);
    paired.memcpy_scattered_over_contiguous = Paired(memcpy_us, memcpy_scattered_us);
    if (placed && !placed_us.empty()) {
      // Round r's (d) pairs with round r's (a): both vectors have one entry a round.
      paired.placed_rounds = placed_us.size();
      paired.placed_p50_us = Percentile(placed_us, 50);
      paired.placed_over_memcpy = Paired(memcpy_us, placed_us);
    }
    // (b)'s and (c)'s stages, from the initiator's timelines (read after the timing).
    paired.contiguous_split = Split(prefix + "c.", contiguous_us);
    paired.scattered_split = Split(prefix + "s.", scattered_us);
    return std::optional<PairedCell>(paired);
  }

 private:
  // Where the transfers `prefix` + round went: round r's client time is `client_us[r]`.
  TimeSplit Split(const std::string& prefix, const std::vector<double>& client_us) {
    std::vector<double> agent, before_copy, copy, receiver, ring;
    for (size_t r = 0; r < client_us.size(); ++r) {
      auto state = fast_->agent().Get(fmt::format("{}{}", prefix, r));
      if (!state.ok()) continue;
      std::optional<uint64_t> at[v1::TransferStage_ARRAYSIZE];
      for (const auto& e : state->timeline()) {
        if (e.stage() > 0 && e.stage() < v1::TransferStage_ARRAYSIZE) at[e.stage()] = e.at_us();
      }
      if (!at[v1::STAGE_ENDED]) continue;
      const double in_agent = static_cast<double>(*at[v1::STAGE_ENDED]);
      agent.push_back(in_agent);
      ring.push_back(std::max(0.0, client_us[r] - in_agent));
      if (at[v1::STAGE_FIRST_POSTED]) {
        before_copy.push_back(static_cast<double>(*at[v1::STAGE_FIRST_POSTED]));
        if (at[v1::STAGE_DATA_FLUSHED]) {
          copy.push_back(static_cast<double>(*at[v1::STAGE_DATA_FLUSHED]) -
                         static_cast<double>(*at[v1::STAGE_FIRST_POSTED]));
        }
      }
      if (at[v1::STAGE_NOTIFICATION_SENT] && at[v1::STAGE_ACKNOWLEDGED]) {
        receiver.push_back(static_cast<double>(*at[v1::STAGE_ACKNOWLEDGED]) -
                           static_cast<double>(*at[v1::STAGE_NOTIFICATION_SENT]));
      }
    }
    TimeSplit split;
    split.timelines = agent.size();
    split.agent_p50_us = Percentile(agent, 50);
    split.ring_p50_us = Percentile(ring, 50);
    split.before_copy_p50_us = Percentile(before_copy, 50);
    split.copy_p50_us = Percentile(copy, 50);
    split.receiver_p50_us = Percentile(receiver, 50);
    return split;
  }

  // Transfers each timed window of a cell takes at least (then until its time is up):
  // 20, and 10 from 256 MiB a transfer up, where 20 took seconds a window and the
  // paired rounds needed the time.
  uint64_t MinTransfers(const Cell& cell) const {
    if (options_.quick) return 5;
    return cell.block * cell.batch >= (256ull << 20) ? 10 : 20;
  }

  // The cell through the fast path ring: transfer i has the gRPC column's indices;
  // then one more into scribbled destination pages, checked byte for byte.
  absl::StatusOr<FastCell> RunFast(const Layout& layout, const Cell& cell, const std::string& prefix) {
    const bool write = cell.op == v1::WRITE;
    FastCellSpec spec;
    spec.prefix = prefix;
    spec.bytes_per_transfer = cell.batch * cell.block;
    spec.slots = std::max<uint64_t>(1, layout.items / cell.batch);
    spec.make = [&](uint32_t, uint64_t i) {
      std::vector<uint64_t> local, remote;
      Indices(layout, cell, i, &local, &remote);
      return Request(layout, cell, "", local, remote, write);
    };
    if (write) spec.notify_address = target_address_;
    spec.seconds = options_.quick ? 0.1 : 0.3;
    spec.min_transfers = MinTransfers(cell);
    ASSIGN_OR_RETURN(FastCell fast, RunFastCell(*fast_, spec));
    std::vector<uint64_t> local, remote;
    Indices(layout, cell, fast.transfers + 1, &local, &remote);
    if (pools_.shared) Scribble(layout, cell, local, remote);
    v1::SubmitTransferRequest last = Request(layout, cell, prefix + "end", local, remote, false);
    last.clear_wait();
    RETURN_IF_ERROR(fast_->Transfer(last));
    fast.verified = pools_.shared && Verify(layout, cell, local, remote);
    if (fast.notifications_missing > 0) {
      std::fprintf(stderr, "bench: fast path, %s %s %s x %u: %lu notifications did not arrive\n",
                   v1::TransferOp_Name(cell.op).c_str(), cell.scattered ? "scattered" : "contiguous",
                   SizeName(cell.block).c_str(), cell.batch,
                   static_cast<unsigned long>(fast.notifications_missing));
    }
    return fast;
  }

  v1::SubmitTransferRequest Request(const Layout& layout, const Cell& cell, const std::string& id,
                                    const std::vector<uint64_t>& local,
                                    const std::vector<uint64_t>& remote, bool notify) const {
    v1::SubmitTransferRequest request =
        LayoutRequest(layout, cell.op, peer_, options_.timeout_ms, local, remote);
    request.set_transfer_id(id);
    if (notify) request.set_notification("bench");
    // The agent answers when the transfer has ended: one round trip per transfer.
    request.set_wait(true);
    return request;
  }

  absl::StatusOr<v1::TransferState> Transfer(const Layout& layout, const Cell& cell,
                                             const std::string& id,
                                             const std::vector<uint64_t>& local,
                                             const std::vector<uint64_t>& remote, bool notify) {
    auto state = initiator_.Submit(Request(layout, cell, id, local, remote, notify));
    if (!state.ok()) return state.status();
    if (state->phase() != v1::COMPLETED) {
      return absl::InternalError(fmt::format(
          "transfer '{}' ({} x {} bytes, {}) ended {}: {}", id, cell.batch, cell.block,
          v1::TransferOp_Name(cell.op), v1::TransferPhase_Name(state->phase()),
          state->error_message()));
    }
    return state;
  }

  // The (source, destination) bases: WRITE moves initiator -> target pages,
  // READ target -> initiator; local indices address the initiator.
  std::pair<uint8_t*, uint8_t*> Ends(const Cell& cell) const {
    return cell.op == v1::WRITE ? std::make_pair(pools_.initiator, pools_.target)
                                : std::make_pair(pools_.target, pools_.initiator);
  }

  // VRAM: the (source, destination) device pointers, as Ends.
  std::pair<uint64_t, uint64_t> DeviceEnds(const Cell& cell) const {
    const uint64_t i = pools_.initiator_device->dptr(), t = pools_.target_device->dptr();
    return cell.op == v1::WRITE ? std::make_pair(i, t) : std::make_pair(t, i);
  }

  void Scribble(const Layout& layout, const Cell& cell, const std::vector<uint64_t>& local,
                const std::vector<uint64_t>& remote) {
    if (pools_.vram) {
      const uint64_t dst = DeviceEnds(cell).second;
      std::vector<uint8_t> scribble(layout.block, 0xEE);
      for (uint64_t i : cell.op == v1::WRITE ? remote : local) {
        (void)pools_.initiator_device->driver()->Copy(
            dst + i * layout.block, reinterpret_cast<uint64_t>(scribble.data()), layout.block);
      }
      return;
    }
    uint8_t* dst = Ends(cell).second;
    const auto& dst_idx = cell.op == v1::WRITE ? remote : local;
    for (uint64_t i : dst_idx) std::memset(dst + i * layout.block, 0xEE, layout.block);
  }

  bool Verify(const Layout& layout, const Cell& cell, const std::vector<uint64_t>& local,
              const std::vector<uint64_t>& remote) {
    auto [src, dst] = Ends(cell);
    const auto& src_idx = cell.op == v1::WRITE ? local : remote;
    const auto& dst_idx = cell.op == v1::WRITE ? remote : local;
    // VRAM: both blocks are copied back to the host and compared there.
    std::vector<uint8_t> src_host, dst_host;
    if (pools_.vram) {
      src_host.resize(layout.block);
      dst_host.resize(layout.block);
    }
    for (size_t k = 0; k < src_idx.size(); ++k) {
      const uint8_t* a = nullptr;
      const uint8_t* b = nullptr;
      if (pools_.vram) {
        auto [dsrc, ddst] = DeviceEnds(cell);
        cuda::CudaDriver* cuda = pools_.initiator_device->driver();
        absl::Status copied = cuda->Copy(reinterpret_cast<uint64_t>(src_host.data()),
                                         dsrc + src_idx[k] * layout.block, layout.block);
        if (copied.ok()) {
          copied = cuda->Copy(reinterpret_cast<uint64_t>(dst_host.data()),
                              ddst + dst_idx[k] * layout.block, layout.block);
        }
        if (!copied.ok()) {
          std::fprintf(stderr, "bench: copying blocks back from the device to verify them: %s\n",
                       std::string(copied.message()).c_str());
          return false;
        }
        a = dst_host.data();
        b = src_host.data();
      } else {
        a = dst + dst_idx[k] * layout.block;
        b = src + src_idx[k] * layout.block;
      }
      if (std::memcmp(a, b, layout.block) != 0) {
        std::fprintf(stderr, "bench: %s %s block %lu: destination item %lu differs from source %lu\n",
                     v1::TransferOp_Name(cell.op).c_str(), cell.scattered ? "scattered" : "contiguous",
                     static_cast<unsigned long>(layout.block), static_cast<unsigned long>(dst_idx[k]),
                     static_cast<unsigned long>(src_idx[k]));
        return false;
      }
    }
    return true;
  }

  // Times `copy(src_idx, dst_idx)` over the page lists of the first transfers the
  // agents moved (bounded in count and bytes); `before` runs untimed before each.
  template <typename Before, typename Copy>
  std::optional<double> TimedCopies(const Layout& layout, const Cell& cell, uint64_t transfers,
                                    Before before, Copy copy) {
    const uint64_t max_reps = options_.quick ? 10 : 30;
    const uint64_t max_bytes = options_.quick ? (256ull << 20) : (2ull << 30);
    std::vector<uint64_t> local, remote;
    double seconds = 0, bytes = 0;
    for (uint64_t i = 0; i < std::max<uint64_t>(transfers, 1); ++i) {
      if (i >= max_reps || (i >= 3 && bytes >= max_bytes)) break;
      Indices(layout, cell, i, &local, &remote);
      const auto& src_idx = cell.op == v1::WRITE ? local : remote;
      const auto& dst_idx = cell.op == v1::WRITE ? remote : local;
      before();
      const auto t0 = Clock::now();
      if (!copy(src_idx, dst_idx)) return std::nullopt;
      seconds += Seconds(Clock::now() - t0);
      bytes += static_cast<double>(src_idx.size()) * layout.block;
    }
    if (seconds <= 0) return std::nullopt;
    return bytes / seconds / 1e9;
  }

  // The memcpy column's copy of one transfer's pages (source and destination item
  // lists) and what runs untimed before each: one thread's memcpy from a cold cache,
  // or (VRAM) device-to-device cuMemcpyAsync of each page on one stream, then a sync
  // (what one engine-side copy loop reaches on that GPU). Null: nothing to copy with
  // (the agents' pools are not mapped here, or no stream).
  using CopyFn = std::function<bool(const std::vector<uint64_t>&, const std::vector<uint64_t>&)>;
  struct Copier {
    std::function<void()> before;
    CopyFn copy;
  };
  std::optional<Copier> MakeCopier(const Layout& layout, const Cell& cell) {
    if (!pools_.vram) {
      auto [src, dst] = Ends(cell);
      if (src == nullptr || dst == nullptr) return std::nullopt;
      return Copier{[this] { evictor_.Evict(); },
                    [&layout, src = src, dst = dst](const std::vector<uint64_t>& src_idx,
                                                    const std::vector<uint64_t>& dst_idx) {
                      for (size_t k = 0; k < src_idx.size(); ++k) {
                        std::memcpy(dst + dst_idx[k] * layout.block,
                                    src + src_idx[k] * layout.block, layout.block);
                      }
                      return true;
                    }};
    }
    cuda::CudaDriver* cuda = pools_.initiator_device->driver();
    if (stream_ == nullptr) {
      auto stream = cuda->CreateStream(pools_.initiator_device->device());
      if (!stream.ok()) {
        std::fprintf(stderr, "bench: device copy baseline: %s\n",
                     std::string(stream.status().message()).c_str());
        return std::nullopt;
      }
      stream_ = *stream;
    }
    auto [src, dst] = DeviceEnds(cell);
    return Copier{[] {}, [this, cuda, &layout, src = src, dst = dst](
                             const std::vector<uint64_t>& src_idx,
                             const std::vector<uint64_t>& dst_idx) {
                    absl::Status s;
                    for (size_t k = 0; k < src_idx.size() && s.ok(); ++k) {
                      s = cuda->CopyAsync(dst + dst_idx[k] * layout.block,
                                          src + src_idx[k] * layout.block, layout.block, stream_);
                    }
                    if (s.ok()) s = cuda->SynchronizeStream(stream_);
                    if (!s.ok()) {
                      std::fprintf(stderr, "bench: device copy baseline: %s\n",
                                   std::string(s.message()).c_str());
                    }
                    return s.ok();
                  }};
  }

  // The copies of the page lists the agents moved, each from a cold cache (the
  // eviction is not timed); the one-host ceiling.
  std::optional<double> Memcpy(const Layout& layout, const Cell& cell, uint64_t transfers) {
    std::optional<Copier> copier = MakeCopier(layout, cell);
    if (!copier) return std::nullopt;
    return TimedCopies(layout, cell, transfers, copier->before, copier->copy);
  }

 public:
  ~Impl() {
    if (stream_ != nullptr) (void)pools_.initiator_device->driver()->DestroyStream(stream_);
  }

 private:
  CUstream_st* stream_ = nullptr;  // VRAM baseline
  const BenchOptions& options_;
  AgentClient& initiator_;
  std::string target_address_;
  std::string peer_;
  Pools& pools_;
  Perftest& perftest_;
  FastRing* fast_;  // null: no fast column
  CacheEvictor evictor_;
  std::string prefix_;
  uint64_t cell_number_ = 0;
};

CellBench::CellBench(const BenchOptions& options, AgentClient& initiator,
                     std::string target_address, std::string peer, Pools& pools,
                     Perftest& perftest, FastRing* fast)
    : impl_(std::make_unique<Impl>(options, initiator, std::move(target_address),
                                   std::move(peer), pools, perftest, fast)) {}

CellBench::~CellBench() = default;

absl::StatusOr<CellResult> CellBench::Run(const Layout& layout, const Cell& cell) {
  return impl_->Run(layout, cell);
}

absl::StatusOr<std::optional<PairedCell>> CellBench::Pair(const Layout& layout, const Cell& cell) {
  return impl_->Pair(layout, cell);
}

}  // namespace kvagent::cli

#include "cli/bench_fast.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "base/cpu_list.h"
#include "base/status_macros.h"
#include "cli/local_agents.h"
#include "cli/notification_waiter.h"
#include "cli/process_cpu.h"
#include "fmt/format.h"

namespace kvagent::cli {
namespace {

using Clock = std::chrono::steady_clock;


absl::Status Unfinished(const client::FastCompletion& c, const std::string& id) {
  if (c.code != absl::StatusCode::kOk) {
    return absl::Status(c.code, fmt::format("fast path transfer '{}': {}", id, c.message));
  }
  return absl::InternalError(fmt::format("fast path transfer '{}' ended {}: {}", id,
                                         v1::TransferPhase_Name(c.phase), c.message));
}

// Waits (up to 3 s) until no notification stream is open on `address`: a watch stream
// that is closing (the gRPC column's) would take notifications meant for a drain's count.
void WaitForNoStreams(const std::string& address, uint32_t timeout_ms) {
  AgentClient target(address, timeout_ms);
  for (int i = 0; i < 300; ++i) {
    auto status = target.Status();
    if (!status.ok() || status->open_streams() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Keeps the notifications whose transfer id starts with `prefix`.
std::function<bool(const v1::Notification&)> KeepPrefix(std::string prefix) {
  return [prefix = std::move(prefix)](const v1::Notification& n) {
    return n.transfer_id().rfind(prefix, 0) == 0;
  };
}

}  // namespace

std::unique_ptr<NotificationWaiter> StartDrain(const std::string& address, std::string prefix,
                                               uint32_t timeout_ms) {
  WaitForNoStreams(address, timeout_ms);
  NotificationWaiterOptions drain;
  drain.address = address;
  drain.timeout_ms = timeout_ms;
  drain.poll = true;
  drain.poll_max = 8192;
  drain.keep = KeepPrefix(std::move(prefix));
  return std::make_unique<NotificationWaiter>(std::move(drain));
}

absl::StatusOr<uint64_t> Missing(NotificationWaiter& drain, uint64_t expected) {
  ASSIGN_OR_RETURN(uint64_t seen, drain.WaitForCount(expected, absl::Seconds(30)));
  return seen >= expected ? 0 : expected - seen;
}

namespace {

// A ring of the session that owns the target's pool (options.target_owner, not null),
// watching the notifications of `ids` (empty: every one the session may take), the
// watch taken and answered on the ring; null when the agent delivers no notifications
// on the ring (an agent older than them: the caller falls back to gRPC). `what` names
// the watch in errors.
absl::StatusOr<std::unique_ptr<client::FastPath>> WatchTargetRing(
    const FastPhaseOptions& options, client::FastPathOptions ring_options,
    const std::vector<std::string>& ids, const std::string& what) {
  ASSIGN_OR_RETURN(client::LocalSession * session, options.target_owner->Session());
  if (options.spin_us != 0) ring_options.spin_us = options.spin_us;
  ASSIGN_OR_RETURN(std::unique_ptr<client::FastPath> ring,
                   client::FastPath::Open(session, ring_options));
  if (!ring->delivers_notifications()) return nullptr;  // closes it: the session's one ring
  RETURN_IF_ERROR(ring->WatchNotifications(ids, 0));
  std::vector<client::FastCompletion> got;
  ASSIGN_OR_RETURN(size_t n, ring->Reap(&got, 1, absl::Milliseconds(options.timeout_ms)));
  if (n != 1 || got[0].opcode != client::fastring::kWatchNotifications || !got[0].status().ok()) {
    return absl::FailedPreconditionError(fmt::format(
        "the target's ring did not take {}: {}", what,
        n != 1 ? "no answer in time"
               : got[0].opcode != client::fastring::kWatchNotifications
                     ? fmt::format("an unexpected completion (opcode {})", got[0].opcode)
                     : got[0].status().ToString()));
  }
  return ring;
}

// The rate phase's drain: a ring of the session that owns the target's pool, watching
// every notification it may take, as a decode engine on the node takes them (no gRPC
// message or thread per notification), when the target announces notifications on the
// ring; else (an older agent, or no owner session here) StartDrain's gRPC polls.
// `how` says which: "ring" or "grpc".
absl::StatusOr<std::unique_ptr<NotificationWaiter>> StartRateDrain(const FastPhaseOptions& options,
                                                                   std::string prefix,
                                                                   std::string* how,
                                                                   uint32_t reap_batch = 1) {
  *how = "grpc";
  if (options.target_owner == nullptr) {
    return StartDrain(options.target_address, std::move(prefix), options.timeout_ms);
  }
  WaitForNoStreams(options.target_address, options.timeout_ms);
  client::FastPathOptions ring_options;
  ring_options.submission_slots = 8;        // the watch entry only
  ring_options.completion_entries = 4096;   // the most: room for bursts of notifications
  ASSIGN_OR_RETURN(std::unique_ptr<client::FastPath> ring,
                   WatchTargetRing(options, ring_options, {}, "the rate phase's notification watch"));
  if (ring == nullptr) {
    return StartDrain(options.target_address, std::move(prefix), options.timeout_ms);
  }
  NotificationWaiterOptions drain;
  drain.ring = std::move(ring);
  drain.keep = KeepPrefix(std::move(prefix));
  drain.ring_batch = reap_batch;
  *how = "ring";
  return std::make_unique<NotificationWaiter>(std::move(drain));
}

// What an agent's threads spent between two ThreadTicks readings over `wall` seconds:
// the total in % of one core and per transfer, and the threads that used at least
// `shown` (a fraction of one core).
struct AgentCpu {
  double percent = 0, us_per_transfer = 0;
  std::string threads;  // "name 45%, name 12%, ..."
};

AgentCpu DescribeCpu(const std::map<std::string, CpuTicks>& before,
                     const std::map<std::string, CpuTicks>& after, double wall,
                     uint64_t transfers, double shown) {
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  std::vector<std::pair<double, std::string>> busy;
  double total = 0;
  for (const auto& [tid, t] : after) {
    auto it = before.find(tid);
    const double seconds = (t.ticks - (it == before.end() ? 0 : it->second.ticks)) / tick;
    total += seconds;
    if (seconds > 0 && seconds / wall >= shown) busy.emplace_back(seconds / wall * 100, t.name);
  }
  std::sort(busy.rbegin(), busy.rend());
  AgentCpu cpu;
  cpu.percent = total / wall * 100;
  cpu.us_per_transfer = transfers ? total * 1e6 / transfers : 0;
  for (const auto& [percent, name] : busy) {
    cpu.threads += fmt::format("{}{} {:.1f}%", cpu.threads.empty() ? "" : ", ", name, percent);
  }
  if (cpu.threads.empty()) cpu.threads = "none";
  return cpu;
}

// Each pid's CPU (and its threads') over `seconds` of wall time.
absl::StatusOr<std::vector<AgentCpu>> IdleCpu(const std::vector<pid_t>& pids, double seconds) {
  std::vector<std::map<std::string, CpuTicks>> before;
  for (pid_t pid : pids) {
    before.push_back(ThreadCpuTicks(pid));
    if (before.back().empty()) {
      return absl::NotFoundError(fmt::format("/proc/{}/task is unreadable (the agent is gone?)", pid));
    }
  }
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  const double wall = Seconds(Clock::now() - t0);
  std::vector<AgentCpu> cpu;
  for (size_t k = 0; k < pids.size(); ++k) {
    cpu.push_back(DescribeCpu(before[k], ThreadCpuTicks(pids[k]), wall, 0, 0));
  }
  return cpu;
}

std::string Opt(const std::optional<double>& v, const char* format) {
  return v ? fmt::format(fmt::runtime(format), *v) : "null";
}

std::string Cellf(const std::optional<double>& v, const char* format) {
  return v ? fmt::format(fmt::runtime(format), *v) : "-";
}

std::optional<double> Ratio(double num, const std::optional<double>& den) {
  if (!den || *den <= 0) return std::nullopt;
  return num / *den;
}

struct Latency {
  std::string path;  // grpc, fast, fast_ring_notification, fast_grpc_notification,
                     // fast_no_notification, fast_placed, fast_placed_ring_notification,
                     // fast_placed_no_notification, fast_ping, fast_ping_idle
  std::string what;
  std::vector<double> us;
  std::vector<double> agent_us;  // the agent's own part (TransferState.latency_us)
  // Why the line was not measured (printed as "-" with it; no JSON line); empty: it was.
  std::string absent = {};
};

const Latency& ByPath(const std::vector<Latency>& latency, const std::string& path) {
  for (const Latency& l : latency) {
    if (l.path == path) return l;
  }
  std::abort();  // the paths are this file's own
}

// Puts `l` right after the line of `path`.
void InsertAfter(std::vector<Latency>* latency, const std::string& path, Latency l) {
  auto it = std::find_if(latency->begin(), latency->end(),
                         [&](const Latency& x) { return x.path == path; });
  if (it == latency->end()) std::abort();  // the paths are this file's own
  latency->insert(it + 1, std::move(l));
}

// The request completing when placed (SubmitTransferRequest.complete_when): COMPLETED
// once every byte is in place, DATA_READY and its commit sent at once, the peer's
// acknowledgement only recorded afterwards.
v1::SubmitTransferRequest Placed(v1::SubmitTransferRequest request) {
  request.set_complete_when(v1::COMPLETE_WHEN_PLACED);
  return request;
}

const char* CompletionName(bool placed) { return placed ? "placed" : "acknowledged"; }

void PrintLatency(const Latency& l, bool json, const std::optional<double>& load) {
  if (!l.absent.empty()) {
    if (!json) {
      std::printf("  %-60s %6s %9s %9s %9s  (%s)\n", l.what.c_str(), "-", "-", "-", "-",
                  l.absent.c_str());
    }
    return;
  }
  const double p50 = Percentile(l.us, 50), p99 = Percentile(l.us, 99), p999 = Percentile(l.us, 99.9);
  std::optional<double> a50, a99, a999;
  if (!l.agent_us.empty()) {
    a50 = Percentile(l.agent_us, 50);
    a99 = Percentile(l.agent_us, 99);
    a999 = Percentile(l.agent_us, 99.9);
  }
  if (json) {
    std::printf("{\"kind\": \"fast_latency\", \"path\": \"%s\", \"n\": %zu, \"p50_us\": %.1f, "
                "\"p99_us\": %.1f, \"p999_us\": %.1f, \"agent_p50_us\": %s, \"agent_p99_us\": %s, "
                "\"agent_p999_us\": %s, \"loadavg_1m\": %s}\n",
                l.path.c_str(), l.us.size(), p50, p99, p999, Opt(a50, "{:.1f}").c_str(),
                Opt(a99, "{:.1f}").c_str(), Opt(a999, "{:.1f}").c_str(), Opt(load, "{:.2f}").c_str());
  } else {
    std::printf("  %-60s %6zu %9.1f %9.1f %9.1f\n", l.what.c_str(), l.us.size(), p50, p99, p999);
    if (a50) {
      std::printf("  %-60s %6s %9.1f %9.1f %9.1f\n", "  of which the agent's (accepted -> ended)", "",
                  *a50, *a99, *a999);
    }
  }
}

// Active messages an agent's worker sent, by kind (GetStatus.active_messages); empty
// when the status is unreadable (the figures are then not printed).
std::map<std::string, uint64_t> AmSent(AgentClient& agent) {
  std::map<std::string, uint64_t> sent;
  auto status = agent.Status();
  if (!status.ok()) return sent;
  for (const auto& am : status->active_messages()) sent[am.kind()] = am.sent();
  return sent;
}

// Adds after - before, kind by kind, into `total`.
void AddAmDelta(const std::map<std::string, uint64_t>& before,
                const std::map<std::string, uint64_t>& after, std::map<std::string, uint64_t>* total) {
  for (const auto& [kind, n] : after) {
    auto was = before.find(kind);
    (*total)[kind] += n - (was == before.end() ? 0 : std::min(n, was->second));
  }
}

// "kind a.bb, kind c.dd" per transfer, and the sum.
std::string AmPerTransfer(const std::map<std::string, uint64_t>& sent, uint64_t transfers,
                          double* sum) {
  std::string out;
  *sum = 0;
  for (const auto& [kind, n] : sent) {
    if (n == 0 || transfers == 0) continue;
    const double per = static_cast<double>(n) / transfers;
    *sum += per;
    out += fmt::format("{}{} {:.2f}", out.empty() ? "" : ", ", kind, per);
  }
  return out.empty() ? "none" : out;
}

// "thread 1.02, thread 0.98" per transfer, the threads woken at least 0.05 times each.
std::string WakeupsPerTransfer(const std::map<std::string, uint64_t>& wakeups, uint64_t transfers) {
  std::vector<std::pair<double, std::string>> busy;
  for (const auto& [name, n] : wakeups) {
    const double per = transfers ? static_cast<double>(n) / transfers : 0;
    if (per >= 0.05) busy.emplace_back(per, name);
  }
  std::sort(busy.rbegin(), busy.rend());
  std::string out;
  for (const auto& [per, name] : busy) out += fmt::format("{}{} {:.2f}", out.empty() ? "" : ", ", name, per);
  return out.empty() ? "none" : out;
}

// The median offset (us after the transfer's first stage) of each stage reached in
// `states`' timelines, "stage 12, stage 40, ..." in the stages' order.
std::string StageMedians(const std::vector<v1::TransferState>& states) {
  std::map<int, std::vector<double>> at;
  for (const auto& s : states) {
    for (const auto& e : s.timeline()) at[e.stage()].push_back(static_cast<double>(e.at_us()));
  }
  std::string out;
  for (auto& [stage, us] : at) {
    std::string name = v1::TransferStage_Name(static_cast<v1::TransferStage>(stage));
    if (name.rfind("STAGE_", 0) == 0) name = name.substr(6);
    for (auto& c : name) c = c == '_' ? ' ' : static_cast<char>(std::tolower(c));
    out += fmt::format("{}{} {:.0f}", out.empty() ? "" : ", ", name, Percentile(us, 50));
  }
  return out.empty() ? "none" : out;
}

// Target lines: "met" / "not met" with the figure.
std::string Verdict(bool met) { return met ? "met" : "NOT met"; }

}  // namespace

// ---- FastRing ----

absl::StatusOr<std::unique_ptr<FastRing>> FastRing::Open(const std::string& address,
                                                         uint32_t timeout_ms,
                                                         const std::string& client_name,
                                                         uint32_t spin_us) {
  AgentClientOptions options;
  options.timeout_ms = timeout_ms;
  options.client_name = client_name;
  auto agent = std::make_unique<AgentClient>(address, options);
  ASSIGN_OR_RETURN(client::LocalSession * session, agent->Session());
  client::FastPathOptions fast;
  if (spin_us != 0) fast.spin_us = spin_us;
  ASSIGN_OR_RETURN(auto path, client::FastPath::Open(session, fast));
  return std::unique_ptr<FastRing>(new FastRing(std::move(agent), std::move(path), timeout_ms));
}

absl::Status FastRing::ReapSome(std::vector<client::FastCompletion>* out, size_t max,
                                size_t min) {
  out->clear();
  ASSIGN_OR_RETURN(size_t n, path_->Reap(out, max, absl::Milliseconds(timeout_ms_), min));
  if (n == 0) {
    return absl::DeadlineExceededError(fmt::format(
        "no fast path completion within {} ms ({} entries outstanding)", timeout_ms_,
        path_->outstanding()));
  }
  return absl::OkStatus();
}

absl::StatusOr<FastRun> FastRing::Run(const std::string& prefix, uint32_t depth,
                                      uint64_t min_transfers, double seconds,
                                      uint64_t max_transfers, const LaneRequest& make,
                                      uint32_t reap_batch) {
  FastRun run;
  run.latencies_us.reserve(std::min<uint64_t>(max_transfers, 1 << 20));
  std::vector<Clock::time_point> started(depth);
  std::vector<uint64_t> next(depth, 0);
  std::vector<std::string> ids(depth);
  uint64_t submitted = 0, inflight = 0;
  auto submit = [&](uint32_t lane) -> absl::Status {
    v1::SubmitTransferRequest request = make(lane, next[lane]);
    ids[lane] = fmt::format("{}{}.{}", prefix, lane, next[lane]++);
    request.set_transfer_id(ids[lane]);
    request.clear_wait();  // the ring answers when the transfer ends anyway
    started[lane] = Clock::now();
    RETURN_IF_ERROR(path_->Submit(request, lane, /*publish=*/false));
    ++submitted;
    ++inflight;
    return absl::OkStatus();
  };
  const auto start = Clock::now();
  auto more = [&] {
    if (submitted >= max_transfers) return false;
    return run.transfers < min_transfers || Seconds(Clock::now() - start) < seconds;
  };
  for (uint32_t lane = 0; lane < depth && more(); ++lane) RETURN_IF_ERROR(submit(lane));
  path_->Publish();
  std::vector<client::FastCompletion> done;
  while (inflight > 0) {
    RETURN_IF_ERROR(ReapSome(&done, depth, std::min<uint64_t>(inflight, reap_batch)));
    const auto now = Clock::now();
    for (const auto& c : done) {
      const uint32_t lane = static_cast<uint32_t>(c.user_data);
      if (c.opcode != client::fastring::kSubmit || lane >= depth) {
        return absl::InternalError(fmt::format("unexpected fast path completion (opcode {}, "
                                               "user data {})", c.opcode, c.user_data));
      }
      if (c.code != absl::StatusCode::kOk || c.phase != v1::COMPLETED) {
        return Unfinished(c, ids[lane]);
      }
      run.latencies_us.push_back(Micros(now - started[lane]));
      run.agent_us.push_back(static_cast<double>(c.latency_us));
      ++run.transfers;
      --inflight;
      if (more()) RETURN_IF_ERROR(submit(lane));
    }
    path_->Publish();
  }
  run.seconds = Seconds(Clock::now() - start);
  return run;
}

absl::Status FastRing::Transfer(const v1::SubmitTransferRequest& request) {
  RETURN_IF_ERROR(path_->Submit(request, 0));
  std::vector<client::FastCompletion> done;
  RETURN_IF_ERROR(ReapSome(&done, 1));
  if (done[0].code != absl::StatusCode::kOk || done[0].phase != v1::COMPLETED) {
    return Unfinished(done[0], request.transfer_id());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<double>> FastRing::Pings(uint64_t count, absl::Duration idle) {
  std::vector<double> us;
  us.reserve(count);
  std::vector<client::FastCompletion> done;
  for (uint64_t i = 0; i < count; ++i) {
    if (idle > absl::ZeroDuration()) absl::SleepFor(idle);
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(path_->Ping(i));
    RETURN_IF_ERROR(ReapSome(&done, 1));
    us.push_back(Micros(Clock::now() - t0));
  }
  return us;
}

// ---- grid cells ----

absl::StatusOr<FastCell> RunFastCell(FastRing& ring, const FastCellSpec& spec) {
  FastCell cell;
  std::unique_ptr<NotificationWaiter> drain;
  if (!spec.notify_address.empty()) drain = StartDrain(spec.notify_address, spec.prefix, 10000);
  // Warm-up (untimed): the ring's first use in this cell's layout.
  RETURN_IF_ERROR(ring.Run(spec.prefix + "w", 1, 3, 0, 3, spec.make).status());
  ASSIGN_OR_RETURN(FastRun one, ring.Run(spec.prefix, 1, spec.min_transfers, spec.seconds, 100000,
                                         spec.make));
  cell.transfers = one.transfers;
  cell.gbps = static_cast<double>(one.transfers) * spec.bytes_per_transfer / one.seconds / 1e9;
  cell.p50_us = Percentile(one.latencies_us, 50);
  cell.p99_us = Percentile(one.latencies_us, 99);
  // 4 in flight on the ring: lane k keeps to slots k, k + 4, ... (as the gRPC column's
  // 4 threads do).
  const uint32_t depth = static_cast<uint32_t>(std::min<uint64_t>(4, spec.slots));
  const uint64_t per_lane = std::max<uint64_t>(1, spec.slots / depth);
  ASSIGN_OR_RETURN(FastRun four,
                   ring.Run(spec.prefix + "p", depth, spec.min_transfers, spec.seconds, 100000,
                            [&](uint32_t lane, uint64_t n) {
                              return spec.make(0, lane + depth * (n % per_lane));
                            }));
  cell.gbps_inflight =
      static_cast<double>(four.transfers) * spec.bytes_per_transfer / four.seconds / 1e9;
  if (drain) {
    // 3 warm-ups, the one-at-a-time and the in-flight transfers.
    ASSIGN_OR_RETURN(cell.notifications_missing, Missing(*drain, 3 + one.transfers + four.transfers));
  }
  return cell;
}

std::string FastCellHeader() {
  return fmt::format("{:>7} {:>6} {:>6} {:>6} {:>6} {:>7} {:>7} {:>7} {:>3}", "fGB/s", "f_p50",
                     "f_p99", "fx_pt", "fx_mc", "fGB/s@4", "fx_pt@4", "fx_mc@4", "fok");
}

std::string FastCellColumns(const std::optional<FastCell>& cell,
                            const std::optional<double>& perftest_gbps,
                            const std::optional<double>& memcpy_gbps) {
  if (!cell) return fmt::format("{:>7} {:>6} {:>6} {:>6} {:>6} {:>7} {:>7} {:>7} {:>3}", "-", "-",
                                "-", "-", "-", "-", "-", "-", "-");
  return fmt::format("{:>7} {:>6} {:>6} {:>6} {:>6} {:>7} {:>7} {:>7} {:>3}",
                     fmt::format("{:.2f}", cell->gbps), fmt::format("{:.0f}", cell->p50_us),
                     fmt::format("{:.0f}", cell->p99_us),
                     Cellf(Ratio(cell->gbps, perftest_gbps), "{:.2f}"),
                     Cellf(Ratio(cell->gbps, memcpy_gbps), "{:.2f}"),
                     fmt::format("{:.2f}", cell->gbps_inflight),
                     Cellf(Ratio(cell->gbps_inflight, perftest_gbps), "{:.2f}"),
                     Cellf(Ratio(cell->gbps_inflight, memcpy_gbps), "{:.2f}"),
                     cell->verified ? "yes" : "NO");
}

std::string FastCellJson(const std::optional<FastCell>& cell,
                         const std::optional<double>& perftest_gbps,
                         const std::optional<double>& memcpy_gbps) {
  if (!cell) {
    return ", \"fast_transfers\": 0, \"fast_gbps\": null, \"fast_p50_us\": null, "
           "\"fast_p99_us\": null, \"ratio_perftest_fast\": null, \"ratio_memcpy_fast\": null, "
           "\"fast_gbps_inflight4\": null, \"ratio_perftest_fast_inflight4\": null, "
           "\"ratio_memcpy_fast_inflight4\": null, \"fast_verified\": null";
  }
  return fmt::format(
      ", \"fast_transfers\": {}, \"fast_gbps\": {:.3f}, \"fast_p50_us\": {:.1f}, "
      "\"fast_p99_us\": {:.1f}, \"ratio_perftest_fast\": {}, \"ratio_memcpy_fast\": {}, "
      "\"fast_gbps_inflight4\": {:.3f}, \"ratio_perftest_fast_inflight4\": {}, "
      "\"ratio_memcpy_fast_inflight4\": {}, \"fast_verified\": {}",
      cell->transfers, cell->gbps, cell->p50_us, cell->p99_us,
      Opt(Ratio(cell->gbps, perftest_gbps), "{:.3f}"), Opt(Ratio(cell->gbps, memcpy_gbps), "{:.3f}"),
      cell->gbps_inflight, Opt(Ratio(cell->gbps_inflight, perftest_gbps), "{:.3f}"),
      Opt(Ratio(cell->gbps_inflight, memcpy_gbps), "{:.3f}"), cell->verified ? "true" : "false");
}

// ---- the phase ----

std::optional<double> LoadAverage() {
  std::ifstream in("/proc/loadavg");
  double one = 0;
  if (!(in >> one)) return std::nullopt;
  return one;
}

// Submit -> the notification on the target's own ring: the session that owns the
// target's pool watches its ring (for these transfers' ids only, so no other phase's
// notification is taken), one page WRITE at a time through `ring`. Timed from the fast
// Submit until the target's Reap returns the notification; the initiator's completion
// is reaped first (DATA_READY follows the sender's COMPLETED when acknowledged; when
// `placed`, the two go out together).
absl::StatusOr<Latency> RingNotificationLatency(const FastPhaseOptions& options, FastRing& ring,
                                                const std::string& prefix, uint64_t count,
                                                bool placed) {
  Latency latency = placed ? Latency{"fast_placed_ring_notification",
                                     "fast Submit (PLACED) -> target's ring notification", {}, {}}
                           : Latency{"fast_ring_notification",
                                     "fast Submit -> target's ring notification", {}, {}};
  constexpr uint64_t kWarm = 50;
  std::vector<std::string> ids;
  for (uint64_t i = 0; i < count + kWarm; ++i) {
    ids.push_back(fmt::format("{}{}.{}", prefix, placed ? "rnp" : "rn", i));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<client::FastPath> watch,
                   WatchTargetRing(options, {}, ids, "the notification watch"));
  if (watch == nullptr) {  // an agent older than them: the bench goes on
    latency.absent = "the agent delivers no notifications on the ring";
    return latency;
  }
  const absl::Duration timeout = absl::Milliseconds(options.timeout_ms);
  std::vector<client::FastCompletion> got;
  size_t n = 0;
  for (uint64_t i = 0; i < ids.size(); ++i) {
    v1::SubmitTransferRequest request = options.one_page(i, true);
    if (placed) request = Placed(std::move(request));
    request.set_transfer_id(ids[i]);
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(ring.Transfer(request));
    for (bool seen = false; !seen;) {
      got.clear();
      ASSIGN_OR_RETURN(n, watch->Reap(&got, 1, timeout));
      if (n == 0) {
        return absl::DeadlineExceededError(fmt::format(
            "the notification of '{}' did not come on the target's ring within {} ms (the "
            "ring's session must own the target's pool or be a scheduler's)",
            ids[i], options.timeout_ms));
      }
      seen = got[0].notification && got[0].notification->transfer_id() == ids[i];
    }
    if (i >= kWarm) latency.us.push_back(Micros(Clock::now() - t0));
  }
  return latency;
}

// The ring line's comparison: the same one-page WRITE at a time through `ring`, the
// target's notification taken by a gRPC WatchNotifications stream asking for these
// transfers' ids only. Timed from the fast Submit until the stream's thread holds it.
absl::StatusOr<Latency> GrpcNotificationLatency(const FastPhaseOptions& options, FastRing& ring,
                                                const std::string& prefix, uint64_t count) {
  Latency latency{"fast_grpc_notification", "fast Submit -> target's gRPC WatchNotifications",
                  {}, {}};
  constexpr uint64_t kWarm = 50;
  NotificationWaiterOptions stream;
  stream.address = options.target_address;
  for (uint64_t i = 0; i < count + kWarm; ++i) stream.ids.push_back(fmt::format("{}gn.{}", prefix, i));
  stream.stop_after = stream.ids.size();
  const std::vector<std::string> ids = stream.ids;
  NotificationWaiter waiter(std::move(stream));
  const absl::Duration timeout = absl::Milliseconds(options.timeout_ms);
  std::vector<Clock::time_point> submitted(ids.size());
  for (uint64_t i = 0; i < ids.size(); ++i) {
    v1::SubmitTransferRequest request = options.one_page(i, true);
    request.set_transfer_id(ids[i]);
    submitted[i] = Clock::now();
    RETURN_IF_ERROR(ring.Transfer(request));
    if (absl::Status s = waiter.WaitForId(ids[i], timeout); !s.ok()) {
      return absl::Status(s.code(), fmt::format(
          "the notification of '{}' did not come on the target's gRPC WatchNotifications "
          "stream within {} ms: {}", ids[i], options.timeout_ms, std::string(s.message())));
    }
  }
  // The stream's thread kept when each came: read once, after the loop.
  const auto kept = waiter.Kept();
  for (uint64_t i = kWarm; i < ids.size(); ++i) {
    latency.us.push_back(Micros(kept.at(ids[i]) - submitted[i]));
  }
  waiter.Finish(absl::Seconds(5));
  return latency;
}

absl::Status RunFastPhase(const FastPhaseOptions& options, AgentClient& initiator,
                          std::unique_ptr<FastRing>* ring) {
  const std::string prefix = fmt::format("bench{}.fast.", getpid());
  const std::optional<double> load_start = LoadAverage();
  const bool json = options.json;
  if (!json) {
    std::printf("\nfast path (client/fast_path ring) beside gRPC: 4 KiB WRITEs, load average "
                "(1 min) %s at the start\n",
                Cellf(load_start, "{:.2f}").c_str());
  }

  // Whether the initiator completes a transfer when placed: an agent older than
  // complete_when skips the field it does not know, and its transfers would complete
  // when acknowledged under the placed lines' names. One placed transfer, then its state.
  std::string placed_absent;  // empty: the placed lines are measured
  {
    v1::SubmitTransferRequest probe = Placed(options.one_page(0, false));
    probe.set_transfer_id(prefix + "placed_probe");
    RETURN_IF_ERROR((*ring)->Transfer(probe));
    ASSIGN_OR_RETURN(v1::TransferState state, initiator.Get(probe.transfer_id()));
    if (state.complete_when() != v1::COMPLETE_WHEN_PLACED) {
      placed_absent = fmt::format(
          "the initiator completed '{}' {} when asked for COMPLETE_WHEN_PLACED: its data path "
          "confirms placement only by the peer's acknowledgement (ucx-am, host staging), or "
          "the agent is older than complete_when",
          probe.transfer_id(), v1::CompletionPoint_Name(state.complete_when()));
    }
  }

  // 1. Latency: one page at a time, submit -> completion, rounds interleaved so that
  // load changes hit every path alike.
  const uint64_t iterations = options.quick ? 1000 : 5000;
  const int rounds = options.quick ? 2 : 5;
  const uint64_t per_round = iterations / rounds;
  enum : size_t { kGrpc, kFast, kFastQuiet, kPlaced, kPlacedQuiet, kPing, kPingIdle };
  std::vector<Latency> latency = {
      {"grpc", "gRPC SubmitTransfer(wait), with notification", {}, {}},
      {"fast", "fast Submit + Reap, with notification", {}, {}},
      {"fast_no_notification", "fast Submit + Reap, no notification", {}, {}},
      {"fast_placed", "fast Submit + Reap, with notification, complete_when PLACED", {}, {}},
      {"fast_placed_no_notification", "fast Submit + Reap, no notification, complete_when PLACED",
       {}, {}},
      {"fast_ping", "fast Ping + Reap, back to back (ring only)", {}, {}},
      {"fast_ping_idle", "fast Ping + Reap after 1 ms idle (wake-ups)", {}, {}},
  };
  // Each round's ring paths: transfers completing when acknowledged (the default) and
  // when placed, with and without notification.
  struct RingPath {
    size_t line;
    bool notify, placed;
  };
  std::vector<RingPath> ring_paths = {{kFast, true, false}, {kFastQuiet, false, false}};
  if (placed_absent.empty()) {
    ring_paths.push_back({kPlaced, true, true});
    ring_paths.push_back({kPlacedQuiet, false, true});
  } else {
    latency[kPlaced].absent = latency[kPlacedQuiet].absent = placed_absent;
  }
  // Per completion point (acknowledged, placed): a lone notified transfer's active
  // messages (initiator, target), its threads' wake-ups (agents started here only) and
  // the stages of a sample of them (initiator, target).
  struct Lone {
    std::map<std::string, uint64_t> am_sent[2];
    uint64_t transfers = 0;
    std::map<std::string, uint64_t> wakeups[2];
    std::vector<v1::TransferState> stages[2];
  };
  Lone lone[2];
  const bool here = options.initiator_pid != 0 && options.target_pid != 0;
  std::string latency_drain;  // how the target's notifications were taken: ring, grpc
  {
    // The target's notifications taken as the rate phase takes them: on the ring of the
    // session that owns its pool where it can (an engine on the node), else by gRPC polls.
    ASSIGN_OR_RETURN(std::unique_ptr<NotificationWaiter> drain,
                     StartRateDrain(options, prefix + "l", &latency_drain));
    uint64_t notified = 0;
    AgentClient target(options.target_address, options.timeout_ms);
    uint64_t page = 0;
    auto one = [&](bool notify, bool placed) -> LaneRequest {
      return [&, notify, placed](uint32_t, uint64_t) {
        v1::SubmitTransferRequest request = options.one_page(page++, notify);
        return placed ? Placed(std::move(request)) : request;
      };
    };
    for (int r = 0; r < rounds; ++r) {
      Progress(r, rounds, "fast path: latency");
      // gRPC, with the warm-up of its first round.
      for (uint64_t i = 0; i < per_round + (r == 0 ? 50 : 0); ++i) {
        v1::SubmitTransferRequest request = options.one_page(page++, true);
        request.set_transfer_id(fmt::format("{}lg{}.{}", prefix, r, i));
        request.set_wait(true);
        const auto t0 = Clock::now();
        auto state = initiator.Submit(request);
        const double us = Micros(Clock::now() - t0);
        if (!state.ok()) return state.status();
        if (state->phase() != v1::COMPLETED) {
          return absl::InternalError(fmt::format("transfer '{}' ended {}: {}", request.transfer_id(),
                                                 v1::TransferPhase_Name(state->phase()),
                                                 state->error_message()));
        }
        ++notified;
        if (r > 0 || i >= 50) {
          latency[kGrpc].us.push_back(us);
          latency[kGrpc].agent_us.push_back(static_cast<double>(state->latency_us()));
        }
      }
      for (const RingPath& path : ring_paths) {
        const uint64_t warm = r == 0 ? 50 : 0;
        Lone* stats = path.notify ? &lone[path.placed ? 1 : 0] : nullptr;
        // The active messages a lone notified transfer costs, both agents' workers.
        std::map<std::string, uint64_t> am_before[2];
        std::map<std::string, uint64_t> wake_before[2];
        if (stats != nullptr) {
          am_before[0] = AmSent(initiator), am_before[1] = AmSent(target);
          if (here) {
            wake_before[0] = ThreadWakeups(options.initiator_pid);
            wake_before[1] = ThreadWakeups(options.target_pid);
          }
        }
        ASSIGN_OR_RETURN(FastRun run,
                         (*ring)->Run(fmt::format("{}l{}.{}.", prefix, path.line, r), 1,
                                      per_round + warm, 0, per_round + warm,
                                      one(path.notify, path.placed)));
        // Placed or not, each notified transfer's notification must reach the target.
        if (path.notify) notified += run.transfers;
        if (stats != nullptr) {
          stats->transfers += run.transfers;
          AddAmDelta(am_before[0], AmSent(initiator), &stats->am_sent[0]);
          AddAmDelta(am_before[1], AmSent(target), &stats->am_sent[1]);
          if (here) {
            AddAmDelta(wake_before[0], ThreadWakeups(options.initiator_pid), &stats->wakeups[0]);
            AddAmDelta(wake_before[1], ThreadWakeups(options.target_pid), &stats->wakeups[1]);
          }
        }
        Latency& l = latency[path.line];
        l.us.insert(l.us.end(), run.latencies_us.begin() + warm, run.latencies_us.end());
        l.agent_us.insert(l.agent_us.end(), run.agent_us.begin() + warm, run.agent_us.end());
      }
      ASSIGN_OR_RETURN(std::vector<double> pings, (*ring)->Pings(per_round + (r == 0 ? 50 : 0)));
      latency[kPing].us.insert(latency[kPing].us.end(), pings.begin() + (r == 0 ? 50 : 0),
                               pings.end());
      // After a pause the agent's UCX thread sleeps (past --fast-path-spin-us) and so
      // does this client (past its Reap spin): the submission and completion doorbells'
      // wake-ups, which a transfer longer than the spins pays too.
      ASSIGN_OR_RETURN(pings, (*ring)->Pings(std::min<uint64_t>(per_round, 1000 / rounds),
                                             absl::Milliseconds(1)));
      latency[kPingIdle].us.insert(latency[kPingIdle].us.end(), pings.begin(), pings.end());
    }
    ASSIGN_OR_RETURN(uint64_t missing, Missing(*drain, notified));
    if (missing > 0) {
      return absl::DataLossError(fmt::format(
          "{} of {} latency transfers' notifications did not reach the target's client (the "
          "gRPC, fast and fast complete_when PLACED ones; ids '{}l*')",
          missing, notified, prefix));
    }
    // Where a lone notified transfer's time goes: the stages of the last round's last
    // (up to) 200, on the sender and on the receiver (each from its own first stage).
    const uint64_t sample = std::min<uint64_t>(per_round, 200);
    for (int k = 0; k < 2; ++k) {
      if (k == 1 && !placed_absent.empty()) continue;
      for (uint64_t n = per_round - sample; n < per_round; ++n) {
        const std::string id =
            fmt::format("{}l{}.{}.0.{}", prefix, static_cast<size_t>(k == 1 ? kPlaced : kFast),
                        rounds - 1, n);
        if (auto s = initiator.Get(id); s.ok()) lone[k].stages[0].push_back(*std::move(s));
        if (auto s = target.Get(id); s.ok()) lone[k].stages[1].push_back(*std::move(s));
      }
    }
  }
  if (options.target_owner != nullptr) {
    // Beside "fast Submit + Reap, with notification": the same transfer, until the
    // target's engine holds its notification, from its ring and from a gRPC stream;
    // and from its ring completing when placed (the sender's COMPLETED no longer waits
    // for the target, but its engine's notification still does).
    const uint64_t count = std::min<uint64_t>(per_round, 500);
    ASSIGN_OR_RETURN(Latency notified,
                     RingNotificationLatency(options, **ring, prefix, count, /*placed=*/false));
    ASSIGN_OR_RETURN(Latency streamed, GrpcNotificationLatency(options, **ring, prefix, count));
    InsertAfter(&latency, "fast", std::move(notified));
    InsertAfter(&latency, "fast_ring_notification", std::move(streamed));
    if (placed_absent.empty()) {
      ASSIGN_OR_RETURN(Latency placed,
                       RingNotificationLatency(options, **ring, prefix, count, /*placed=*/true));
      InsertAfter(&latency, "fast_placed", std::move(placed));
    }
  }
  const std::optional<double> load_latency = LoadAverage();
  if (!json) {
    std::printf("latency, one 4 KiB page WRITE at a time, one client (us; load average %s; the "
                "target's notifications taken %s):\n",
                Cellf(load_latency, "{:.2f}").c_str(),
                latency_drain == "ring" ? "on its ring" : "by gRPC polls");
    std::printf("  %-60s %6s %9s %9s %9s\n", "", "n", "p50", "p99", "p999");
  }
  for (const auto& l : latency) PrintLatency(l, json, load_latency);
  for (int k = 0; k < 2; ++k) {
    if (k == 1 && !placed_absent.empty()) continue;
    const Lone& l = lone[k];
    double am_initiator = 0, am_target = 0;
    const std::string am_text[2] = {AmPerTransfer(l.am_sent[0], l.transfers, &am_initiator),
                                    AmPerTransfer(l.am_sent[1], l.transfers, &am_target)};
    // Placed: the peer's acknowledgements recorded after COMPLETED, and its notes (a
    // notification it did not take), in the sample.
    uint64_t acknowledged = 0, noted = 0;
    std::string note;
    for (const auto& s : l.stages[0]) {
      acknowledged += s.peer_acknowledged() ? 1 : 0;
      if (!s.peer_note().empty()) {
        ++noted;
        if (note.empty()) note = fmt::format("'{}': {}", s.transfer_id(), s.peer_note());
      }
    }
    if (json) {
      std::printf("{\"kind\": \"fast_lone_transfer\", \"complete_when\": \"%s\", "
                  "\"transfers\": %llu, \"active_messages_per_transfer\": %.2f, "
                  "\"initiator_sent\": \"%s\", \"target_sent\": \"%s\", "
                  "\"initiator_stages_p50_us\": \"%s\", \"target_stages_p50_us\": \"%s\", "
                  "\"sampled\": %zu, \"peer_acknowledged\": %s, \"peer_notes\": %s}\n",
                  CompletionName(k == 1), static_cast<unsigned long long>(l.transfers),
                  am_initiator + am_target, am_text[0].c_str(), am_text[1].c_str(),
                  StageMedians(l.stages[0]).c_str(), StageMedians(l.stages[1]).c_str(),
                  l.stages[0].size(), k == 1 ? std::to_string(acknowledged).c_str() : "null",
                  k == 1 ? std::to_string(noted).c_str() : "null");
    } else {
      std::printf("  one notified transfer at a time%s: %.2f active messages each (initiator "
                  "sent: %s; target sent: %s)\n",
                  k == 1 ? ", complete_when PLACED" : "", am_initiator + am_target,
                  am_text[0].c_str(), am_text[1].c_str());
      if (here) {
        std::printf("    thread wake-ups per transfer: initiator %s; target %s\n",
                    WakeupsPerTransfer(l.wakeups[0], l.transfers).c_str(),
                    WakeupsPerTransfer(l.wakeups[1], l.transfers).c_str());
      }
      std::printf("    its stages, median us after accepted (%zu sampled): %s\n",
                  l.stages[0].size(), StageMedians(l.stages[0]).c_str());
      std::printf("    the receiver's, after its first notice of it (%zu): %s\n",
                  l.stages[1].size(), StageMedians(l.stages[1]).c_str());
      if (k == 1) {
        std::printf("    the peer's acknowledgement recorded after COMPLETED: %llu of %zu "
                    "sampled; notifications it did not take: %llu%s%s\n",
                    static_cast<unsigned long long>(acknowledged), l.stages[0].size(),
                    static_cast<unsigned long long>(noted), note.empty() ? "" : " (first: ",
                    note.empty() ? "" : (note + ")").c_str());
      }
    }
  }

  // 2. Rate: one-page WRITEs with notifications, 64 in flight per client, reaped in
  // batches; 1 client, then 2 (two sessions, two threads); each completing when
  // acknowledged, then when placed (every notification must still reach the target).
  constexpr uint32_t kDepth = 64;
  const double seconds = options.quick ? 1.0 : 3.0;
  struct Rate {
    uint32_t clients;
    bool placed = false;             // complete_when PLACED
    uint64_t transfers = 0;
    double per_s = 0, p50_us = 0, p99_us = 0;
    std::optional<AgentCpu> cpu[2];  // initiator, target (agents started here)
    // Each agent's threads' sleeps (voluntary context switches) over the run, per
    // transfer, all threads summed, and "thread 0.05, ..." for the threads woken at least
    // 0.05 times per transfer: on a VM a sleep and its wake-up cost the waker and the
    // woken several µs of CPU, so this says how much of an agent's CPU per transfer
    // could be wake-ups rather than its own work.
    std::optional<double> wakeups[2];
    std::string wakeup_threads[2];
    // The bench's own threads over the run, per transfer: the submitting client(s)
    // and the target's notification taker (as a decode engine's thread takes them).
    double client_cpu_us = 0, taker_cpu_us = 0;
    // The clients' sleeps on their completion doorbells, per transfer (Reap waits for
    // options.reap_batch at a time).
    double client_sleeps = 0;
    std::string drain;               // how the target's notifications were taken: ring, grpc
    // The initiator's AgentStatus counters over the run (agent-wide: its other
    // clients' transfers count too).
    uint64_t completed_when_placed = 0, placed_not_taken = 0;
  };
  std::vector<Rate> rates;
  // A transfer's CPU in all four (initiator, target, the bench's client and
  // notification taker), and the rate that would use every CPU here for it: an upper
  // bound, whatever the waits; nullopt unless both agents ran here.
  auto TotalCpuUs = [](const Rate& r) -> std::optional<double> {
    if (!r.cpu[0] || !r.cpu[1]) return std::nullopt;
    return r.cpu[0]->us_per_transfer + r.cpu[1]->us_per_transfer + r.client_cpu_us +
           r.taker_cpu_us;
  };
  const long cpus = std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN));  // online here
  auto CpuBoundRate = [&TotalCpuUs, cpus](const Rate& r) -> std::optional<double> {
    const std::optional<double> total = TotalCpuUs(r);
    if (!total || *total <= 0) return std::nullopt;
    return static_cast<double>(cpus) * 1e6 / *total;
  };
  std::unique_ptr<FastRing> second;
  std::vector<std::pair<uint32_t, bool>> shapes;  // clients, placed
  for (uint32_t clients : {1u, 2u}) {
    shapes.emplace_back(clients, false);
    if (placed_absent.empty()) shapes.emplace_back(clients, true);
  }
  for (size_t s = 0; s < shapes.size(); ++s) {
    const auto [clients, placed] = shapes[s];
    Progress(s, shapes.size(), fmt::format("fast path: rate, {} client(s), complete when {}",
                                           clients, CompletionName(placed)));
    if (clients == 2 && !second) {
      ASSIGN_OR_RETURN(second, FastRing::Open(options.initiator_address, options.timeout_ms,
                                              "kvagentctl-bench-fast-2", options.spin_us));
    }
    const std::string run_prefix = fmt::format("{}r{}{}.", prefix, clients, placed ? "p" : "");
    Rate rate;
    rate.clients = clients;
    rate.placed = placed;
    ASSIGN_OR_RETURN(std::unique_ptr<NotificationWaiter> drain,
                     StartRateDrain(options, run_prefix, &rate.drain, options.reap_batch));
    ASSIGN_OR_RETURN(v1::AgentStatus status_before, initiator.Status());
    std::vector<FastRing*> rings = {ring->get(), second.get()};
    std::vector<absl::StatusOr<FastRun>> runs(clients, absl::UnknownError("not run"));
    const uint64_t span = clients * kDepth;
    const uint64_t per_lane = std::max<uint64_t>(1, options.pages / span);
    std::map<std::string, CpuTicks> cpu_before[2];
    std::map<std::string, uint64_t> wake_before[2];
    if (here) {
      cpu_before[0] = ThreadCpuTicks(options.initiator_pid);
      cpu_before[1] = ThreadCpuTicks(options.target_pid);
      wake_before[0] = ThreadWakeups(options.initiator_pid);
      wake_before[1] = ThreadWakeups(options.target_pid);
    }
    auto ClientSleeps = [&rings, clients = clients] {
      uint64_t sleeps = 0;
      for (uint32_t c = 0; c < clients; ++c) sleeps += rings[c]->sleeps();
      return sleeps;
    };
    const uint64_t sleeps_before = ClientSleeps();
    const auto start = Clock::now();
    std::vector<std::thread> threads;
    std::vector<double> client_cpu_s(clients, 0.0);
    for (uint32_t c = 0; c < clients; ++c) {
      threads.emplace_back([&, c] {
        const double cpu_start = ThreadCpuSeconds();
        auto cpu_end = absl::MakeCleanup(
            [&, c, cpu_start] { client_cpu_s[c] = ThreadCpuSeconds() - cpu_start; });
        runs[c] = rings[c]->Run(fmt::format("{}{}.", run_prefix, c), kDepth, 0, seconds,
                                uint64_t{1} << 40, [&, c](uint32_t lane, uint64_t n) {
                                  v1::SubmitTransferRequest request = options.one_page(
                                      c * kDepth + lane + span * (n % per_lane), true);
                                  return placed ? Placed(std::move(request)) : request;
                                }, options.reap_batch);
      });
    }
    for (auto& t : threads) t.join();
    const double elapsed = Seconds(Clock::now() - start);
    std::vector<double> all;
    for (auto& run : runs) {
      if (!run.ok()) return run.status();
      rate.transfers += run->transfers;
      all.insert(all.end(), run->latencies_us.begin(), run->latencies_us.end());
    }
    if (here) {
      rate.cpu[0] = DescribeCpu(cpu_before[0], ThreadCpuTicks(options.initiator_pid), elapsed,
                                rate.transfers, 0.03);
      rate.cpu[1] = DescribeCpu(cpu_before[1], ThreadCpuTicks(options.target_pid), elapsed,
                                rate.transfers, 0.03);
      const pid_t pids[2] = {options.initiator_pid, options.target_pid};
      for (int k = 0; k < 2 && rate.transfers > 0; ++k) {
        std::map<std::string, uint64_t> woken;
        AddAmDelta(wake_before[k], ThreadWakeups(pids[k]), &woken);
        uint64_t sum = 0;
        for (const auto& [name, n] : woken) sum += n;
        rate.wakeups[k] = static_cast<double>(sum) / static_cast<double>(rate.transfers);
        rate.wakeup_threads[k] = WakeupsPerTransfer(woken, rate.transfers);
      }
    }
    rate.per_s = rate.transfers / elapsed;
    rate.p50_us = Percentile(all, 50);
    rate.p99_us = Percentile(all, 99);
    ASSIGN_OR_RETURN(uint64_t missing, Missing(*drain, rate.transfers));
    drain->Finish(absl::Seconds(5));  // a ring's taker stops within one reap
    if (rate.transfers > 0) {
      double client_s = 0;
      for (double c : client_cpu_s) client_s += c;
      rate.client_cpu_us = client_s * 1e6 / static_cast<double>(rate.transfers);
      rate.taker_cpu_us = drain->cpu_seconds() * 1e6 / static_cast<double>(rate.transfers);
      rate.client_sleeps = static_cast<double>(ClientSleeps() - sleeps_before) /
                           static_cast<double>(rate.transfers);
    }
    if (missing > 0) {
      return absl::DataLossError(fmt::format(
          "fast rate, {} client(s), complete when {}: {} transfers completed but the target's "
          "client saw {} notifications for them (taken by {}){}",
          clients, CompletionName(placed), rate.transfers, rate.transfers - missing, rate.drain,
          placed ? "; completed when placed, a notification the target refused is a "
                   "COMPLETED transfer whose owners never hear of it: see `kvagentctl "
                   "transfers --timeline ID` (peer_note) on the initiator"
                 : ""));
    }
    // Read after every notification came, so each transfer's acknowledgement had its
    // round trip: a refusal is counted by now.
    ASSIGN_OR_RETURN(v1::AgentStatus status_after, initiator.Status());
    rate.completed_when_placed =
        status_after.completed_when_placed() - status_before.completed_when_placed();
    rate.placed_not_taken = status_after.placed_not_taken() - status_before.placed_not_taken();
    if (placed && rate.completed_when_placed < rate.transfers) {
      return absl::InternalError(fmt::format(
          "fast rate, {} client(s), complete when placed: the initiator completed {} of the {} "
          "transfers when placed (AgentStatus.completed_when_placed); the others waited for the "
          "target's acknowledgement (host-staged chunks?), so this line would not measure "
          "COMPLETE_WHEN_PLACED",
          clients, rate.completed_when_placed, rate.transfers));
    }
    if (rate.placed_not_taken > 0) {
      return absl::DataLossError(fmt::format(
          "fast rate, {} client(s), complete when {}: the target did not take {} notifications "
          "of transfers the initiator completed when placed (AgentStatus.placed_not_taken; "
          "`kvagentctl transfers --timeline ID` on the initiator shows each one's peer_note)",
          clients, CompletionName(placed), rate.placed_not_taken));
    }
    rates.push_back(rate);
  }
  const std::optional<double> load_rate = LoadAverage();
  if (!json) {
    std::printf("rate, one-page WRITEs with a notification each (load average %s):\n",
                Cellf(load_rate, "{:.2f}").c_str());
    std::printf("  gRPC, 1 client, 1 per SubmitTransfer (rate phase above): %s /s\n",
                Cellf(options.grpc_rate_single, "{:.0f}").c_str());
    std::printf("  gRPC, 1 client, 64 per SubmitTransfers (rate phase above): %s /s\n",
                Cellf(options.grpc_rate_batch64, "{:.0f}").c_str());
    if (!placed_absent.empty()) {
      std::printf("  fast, complete_when PLACED: not measured (%s)\n", placed_absent.c_str());
    }
  }
  for (const Rate& r : rates) {
    if (json) {
      // Each completion point its own kind: tools that key fast_rate lines by their
      // clients (tools/bench_ab.py) keep comparing the acknowledged figures alone.
      std::printf("{\"kind\": \"%s\", \"complete_when\": \"%s\", \"op\": \"WRITE\", "
                  "\"block_bytes\": 4096, "
                  "\"clients\": %u, \"in_flight_per_client\": %u, \"transfers\": %lu, "
                  "\"transfers_per_s\": %.1f, \"p50_us\": %.1f, \"p99_us\": %.1f, "
                  "\"notifications\": %lu, \"completed_when_placed\": %lu, "
                  "\"placed_not_taken\": %lu, \"grpc_transfers_per_s\": %s, "
                  "\"grpc_batch64_transfers_per_s\": %s, \"initiator_cpu_us_per_transfer\": %s, "
                  "\"target_cpu_us_per_transfer\": %s, \"client_cpu_us_per_transfer\": %.1f, "
                  "\"notification_taker_cpu_us_per_transfer\": %.1f, \"reap_batch\": %u, "
                  "\"client_sleeps_per_transfer\": %.3f, "
                  "\"initiator_wakeups_per_transfer\": %s, \"target_wakeups_per_transfer\": %s, "
                  "\"total_cpu_us_per_transfer\": %s, \"cpu_bound_transfers_per_s\": %s, "
                  "\"drain\": \"%s\", \"loadavg_1m\": %s}\n",
                  r.placed ? "fast_rate_placed" : "fast_rate", CompletionName(r.placed),
                  r.clients, kDepth, static_cast<unsigned long>(r.transfers), r.per_s, r.p50_us,
                  r.p99_us, static_cast<unsigned long>(r.transfers),
                  static_cast<unsigned long>(r.completed_when_placed),
                  static_cast<unsigned long>(r.placed_not_taken),
                  Opt(options.grpc_rate_single, "{:.1f}").c_str(),
                  Opt(options.grpc_rate_batch64, "{:.1f}").c_str(),
                  r.cpu[0] ? fmt::format("{:.1f}", r.cpu[0]->us_per_transfer).c_str() : "null",
                  r.cpu[1] ? fmt::format("{:.1f}", r.cpu[1]->us_per_transfer).c_str() : "null",
                  r.client_cpu_us, r.taker_cpu_us, options.reap_batch, r.client_sleeps,
                  Opt(r.wakeups[0], "{:.3f}").c_str(), Opt(r.wakeups[1], "{:.3f}").c_str(),
                  Opt(TotalCpuUs(r), "{:.1f}").c_str(),
                  Opt(CpuBoundRate(r), "{:.0f}").c_str(), r.drain.c_str(),
                  Opt(load_rate, "{:.2f}").c_str());
    } else {
      std::printf("  fast, %u client%s x %u in flight, complete when %-13s %9lu transfers, "
                  "%8.0f /s, submit -> completion p50 %.0f us, p99 %.0f us, notifications all "
                  "(taken on the target's %s)\n",
                  r.clients, r.clients == 1 ? " " : "s", kDepth,
                  (std::string(CompletionName(r.placed)) + ":").c_str(),
                  static_cast<unsigned long>(r.transfers), r.per_s, r.p50_us, r.p99_us,
                  r.drain == "ring" ? "ring" : "gRPC PollNotifications");
      const char* names[] = {"initiator", "target"};
      for (int k = 0; k < 2; ++k) {
        if (!r.cpu[k]) continue;
        // The threads that slept 0.05 times per transfer or more, when any did.
        const std::string& woken = r.wakeup_threads[k];
        std::printf("    %-9s CPU %3.0f%% of one core, %5.1f us per transfer; threads: %s; "
                    "sleeps per transfer %s%s\n",
                    names[k], r.cpu[k]->percent, r.cpu[k]->us_per_transfer,
                    r.cpu[k]->threads.c_str(), Cellf(r.wakeups[k], "{:.3f}").c_str(),
                    woken.empty() || woken == "none" ? "" : (" (" + woken + ")").c_str());
      }
      std::printf("    bench     CPU %5.1f us per transfer submitting and reaping (%u thread%s, "
                  "waiting for %u completions per wake-up, %.3f sleeps per transfer), "
                  "%5.1f us taking the target's notifications (as a decode engine's thread "
                  "would)\n",
                  r.client_cpu_us, r.clients, r.clients == 1 ? "" : "s", options.reap_batch,
                  r.client_sleeps, r.taker_cpu_us);
      if (const auto total = TotalCpuUs(r)) {
        std::printf("    together  %5.1f us of CPU per transfer: at most %.0f /s on the %ld CPUs "
                    "here\n",
                    *total, CpuBoundRate(r).value_or(0), cpus);
      }
    }
  }
  std::fflush(stdout);

  // 3. Idle CPU of the agents with the rings open, then with none.
  std::optional<std::vector<AgentCpu>> idle_open, idle_closed;
  constexpr double kIdleSeconds = 2.0;
  if (options.initiator_pid != 0 && options.target_pid != 0) {
    Progress(0, 2, "fast path: idle CPU");
    const std::vector<pid_t> pids = {options.initiator_pid, options.target_pid};
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // spinning ends
    ASSIGN_OR_RETURN(idle_open, IdleCpu(pids, kIdleSeconds));
    second.reset();
    ring->reset();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    Progress(1, 2, "fast path: idle CPU");
    ASSIGN_OR_RETURN(idle_closed, IdleCpu(pids, kIdleSeconds));
    Progress(2, 2, "fast path: idle CPU");
    if (isatty(STDERR_FILENO)) std::fprintf(stderr, "\r%80s\r", "");
    const char* names[] = {"initiator", "target"};
    if (!json) {
      std::printf("idle CPU over %.0f s (%% of one core, /proc/PID/task/*/stat utime+stime, "
                  "%.0f ms ticks):\n",
                  kIdleSeconds, 1000.0 / static_cast<double>(sysconf(_SC_CLK_TCK)));
    }
    for (int k = 0; k < 2; ++k) {
      if (json) {
        std::printf("{\"kind\": \"fast_idle\", \"agent\": \"%s\", \"pid\": %d, \"seconds\": %.1f, "
                    "\"cpu_percent_ring_open\": %.2f, \"cpu_percent_no_ring\": %.2f}\n",
                    names[k], pids[k], kIdleSeconds, (*idle_open)[k].percent,
                    (*idle_closed)[k].percent);
      } else {
        std::printf("  %-9s pid %d: %4.1f%% with the bench's 2 rings open (on the initiator; "
                    "threads: %s), %4.1f%% with none (threads: %s)\n",
                    names[k], pids[k], (*idle_open)[k].percent, (*idle_open)[k].threads.c_str(),
                    (*idle_closed)[k].percent, (*idle_closed)[k].threads.c_str());
      }
    }
  } else {
    ring->reset();
    if (!json) std::printf("idle CPU: not measured (the agents run elsewhere)\n");
  }

  // 4. The targets, as measured in this run, for each completion point: when
  // acknowledged (the transfer contract's default) and when placed (complete_when).
  const std::optional<double> load_end = LoadAverage();
  // Where the agents' UCX progress threads (which take the rings and move the data) may
  // run, as they report it: on 2 shared cores, whether they take turns with this
  // client's thread decides most of a lone transfer's latency (docs/BENCHMARKS.md).
  std::string worker_cpus[2];
  {
    AgentClient target(options.target_address, options.timeout_ms);
    AgentClient* agents[2] = {&initiator, &target};
    for (int k = 0; k < 2; ++k) {
      absl::StatusOr<v1::AgentStatus> status = agents[k]->Status();
      worker_cpus[k] = status.ok() && !status->worker_cpus().empty() ? status->worker_cpus() : "?";
    }
  }
  std::string here_cpus = FormatCpuList(AllowedCpus());
  if (here_cpus.empty()) here_cpus = "?";
  // The agents' other threads (started here: read from the kernel; else unknown).
  std::string agent_cpus[2];
  for (int k = 0; k < 2; ++k) {
    const pid_t pid = k == 0 ? options.initiator_pid : options.target_pid;
    agent_cpus[k] = pid > 0 ? FormatCpuList(ProcessCpus(pid)) : "";
    if (agent_cpus[k].empty()) agent_cpus[k] = "?";
  }
  if (json) {
    std::printf("{\"kind\": \"fast_cpus\", \"initiator_worker_cpus\": \"%s\", "
                "\"target_worker_cpus\": \"%s\", \"initiator_cpus\": \"%s\", "
                "\"target_cpus\": \"%s\", \"bench_cpus\": \"%s\"}\n",
                worker_cpus[0].c_str(), worker_cpus[1].c_str(), agent_cpus[0].c_str(),
                agent_cpus[1].c_str(), here_cpus.c_str());
  } else {
    std::printf("targets (issue 15; load average %s now, %s at the start; UCX progress threads "
                "on CPUs %s (initiator) and %s (target), the agents' processes on %s and %s, "
                "this client on %s):\n",
                Cellf(load_end, "{:.2f}").c_str(), Cellf(load_start, "{:.2f}").c_str(),
                worker_cpus[0].c_str(), worker_cpus[1].c_str(), agent_cpus[0].c_str(),
                agent_cpus[1].c_str(), here_cpus.c_str());
  }
  for (const bool placed : {false, true}) {
    const char* what = placed ? "complete_when PLACED (COMPLETED once the bytes are in place)"
                              : "complete when acknowledged (the contract's default)";
    if (placed && !placed_absent.empty()) {
      if (json) {
        std::printf("{\"kind\": \"fast_targets\", \"issue\": 15, \"complete_when\": \"placed\", "
                    "\"measured\": false, \"loadavg_1m_start\": %s, \"loadavg_1m\": %s}\n",
                    Opt(load_start, "{:.2f}").c_str(), Opt(load_end, "{:.2f}").c_str());
      } else {
        std::printf("  %s: not measured (%s)\n", what, placed_absent.c_str());
      }
      continue;
    }
    const std::vector<double>& notified = ByPath(latency, placed ? "fast_placed" : "fast").us;
    const double p50 = Percentile(notified, 50), p99 = Percentile(notified, 99);
    const double p50_quiet =
        Percentile(ByPath(latency, placed ? "fast_placed_no_notification" : "fast_no_notification").us,
                   50);
    double rate1 = 0, rate2 = 0;
    std::optional<double> cpu1;  // all four's CPU per transfer, 1 client
    for (const Rate& r : rates) {
      if (r.placed == placed) (r.clients == 1 ? rate1 : rate2) = r.per_s;
      if (r.placed == placed && r.clients == 1) cpu1 = TotalCpuUs(r);
    }
    // The CPU a transfer may take, in all four together, for 200,000 /s on this host's
    // CPUs (were nothing ever waited for).
    const double budget_us = static_cast<double>(cpus) * 1e6 / 200000;
    const bool p50_met = p50 <= 20, p99_met = p99 <= 100, rate_met = rate1 >= 200000;
    if (json) {
      std::printf("{\"kind\": \"fast_targets\", \"issue\": 15, \"complete_when\": \"%s\", "
                  "\"measured\": true, \"p50_us\": %.1f, \"p50_no_notification_us\": %.1f, "
                  "\"p50_target_us\": 20, \"p50_met\": %s, \"p99_us\": %.1f, "
                  "\"p99_target_us\": 100, \"p99_met\": %s, \"transfers_per_s\": %.1f, "
                  "\"transfers_per_s_2_clients\": %.1f, \"transfers_per_s_target\": 200000, "
                  "\"rate_met\": %s, \"total_cpu_us_per_transfer\": %s, "
                  "\"cpu_us_per_transfer_for_target\": %.1f, \"loadavg_1m_start\": %s, "
                  "\"loadavg_1m\": %s}\n",
                  CompletionName(placed), p50, p50_quiet, p50_met ? "true" : "false", p99,
                  p99_met ? "true" : "false", rate1, rate2, rate_met ? "true" : "false",
                  Opt(cpu1, "{:.1f}").c_str(), budget_us, Opt(load_start, "{:.2f}").c_str(),
                  Opt(load_end, "{:.2f}").c_str());
    } else {
      std::printf("  %s:\n", what);
      std::printf("    one 4 KiB page p50 <= 20 us: %.1f us (%.1f us without notification): %s\n",
                  p50, p50_quiet, Verdict(p50_met).c_str());
      std::printf("    one 4 KiB page p99 <= 100 us: %.1f us: %s\n", p99, Verdict(p99_met).c_str());
      std::printf("    >= 200,000 one-page WRITEs/s from one client: %.0f /s: %s (2 clients: "
                  "%.0f /s)\n",
                  rate1, Verdict(rate_met).c_str(), rate2);
      if (cpu1) {
        std::printf("      CPU per transfer, agents and bench together: %.1f us; 200,000 /s on "
                    "the %ld CPUs here allows %.1f us\n",
                    *cpu1, cpus, budget_us);
      }
    }
  }
  if (idle_open && !json) {
    std::printf("  idle CPU near zero with a ring open: initiator %.1f%%, target %.1f%%\n",
                (*idle_open)[0].percent, (*idle_open)[1].percent);
  }
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace kvagent::cli

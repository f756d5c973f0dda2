#include "cli/bench_memory.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "base/format.h"
#include "base/status_macros.h"
#include "cli/notification_waiter.h"
#include "fmt/format.h"

namespace kvagent::cli {
namespace {

using Clock = std::chrono::steady_clock;

absl::Status CheckOptions(const MemoryBenchOptions& o) {
  if (o.regions == 0 || o.regions_per_group == 0 || o.regions % o.regions_per_group != 0 ||
      o.items_per_region == 0 || o.item_bytes == 0 || o.transfers == 0 || o.threads == 0) {
    return absl::InvalidArgumentError(fmt::format(
        "memory bench: {} regions in groups of {}, {} items of {} bytes, {} transfers on {} "
        "threads; every count must be > 0 and regions a multiple of regions_per_group",
        o.regions, o.regions_per_group, o.items_per_region, o.item_bytes, o.transfers, o.threads));
  }
  return absl::OkStatus();
}

absl::StatusOr<MemorySample> Sample(pid_t initiator_pid, pid_t target_pid) {
  MemorySample s;
  ASSIGN_OR_RETURN(s.initiator, ReadProcessMemory(initiator_pid));
  ASSIGN_OR_RETURN(s.target, ReadProcessMemory(target_pid));
  return s;
}

std::string GroupName(const std::string& label, uint32_t group) {
  return fmt::format("{}.g{}", label, group);
}

// One sealed memfd from the agent, cut into the regions, registered in one
// batch. Returns the region names.
absl::StatusOr<std::vector<std::string>> RegisterRegions(AgentClient& agent, const std::string& role,
                                                         const std::string& label,
                                                         const MemoryBenchOptions& o) {
  const uint64_t region_bytes = o.items_per_region * o.item_bytes;
  auto allocation = agent.AllocateMemory(label, region_bytes * o.regions);
  if (!allocation.ok()) {
    return absl::Status(allocation.status().code(),
                        fmt::format("memory bench: allocating the {} pool on {}: {}", role,
                                    agent.address(), allocation.status().message()));
  }
  v1::RegisterRegionsRequest request;
  std::vector<std::string> names;
  for (uint32_t r = 0; r < o.regions; ++r) {
    const uint32_t group = r / o.regions_per_group;
    auto* spec = request.add_regions();
    spec->set_name(fmt::format("{}.r{}", GroupName(label, group), r % o.regions_per_group));
    spec->set_kind(v1::KV);
    spec->set_group(GroupName(label, group));
    spec->set_memory(v1::DRAM);
    spec->set_length(region_bytes);
    spec->mutable_layout()->set_num_items(o.items_per_region);
    spec->mutable_layout()->set_item_bytes(o.item_bytes);
    spec->mutable_shm()->set_memory_handle(allocation->info.handle());
    spec->mutable_shm()->set_offset(uint64_t{r} * region_bytes);
    names.push_back(spec->name());
  }
  auto registered = agent.Register(request);
  if (!registered.ok()) {
    return absl::Status(registered.status().code(),
                        fmt::format("memory bench: registering {} regions on the {} ({}): {}",
                                    o.regions, role, agent.address(), registered.status().message()));
  }
  return names;
}

bool Terminal(v1::TransferPhase p) {
  return p == v1::COMPLETED || p == v1::FAILED || p == v1::CANCELLED || p == v1::TIMED_OUT;
}

// Submits and waits for one transfer; OK only when it COMPLETED.
absl::Status RunOne(AgentClient& initiator, const v1::SubmitTransferRequest& request) {
  const std::string& id = request.transfer_id();
  auto state = initiator.Submit(request);
  if (!state.ok()) {
    return absl::Status(state.status().code(),
                        fmt::format("memory bench: submitting '{}': {}", id, state.status().message()));
  }
  v1::TransferState s = *state;
  for (uint32_t polls = 0; !Terminal(s.phase()); ++polls) {
    // A one-item transfer takes well under a millisecond; poll fast at first.
    std::this_thread::sleep_for(std::chrono::microseconds(polls < 4 ? 100 : 1000));
    auto got = initiator.Get(id);
    if (!got.ok()) {
      return absl::Status(got.status().code(),
                          fmt::format("memory bench: GetTransfer('{}'): {}", id, got.status().message()));
    }
    s = *std::move(got);
  }
  if (s.phase() != v1::COMPLETED) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        fmt::format("memory bench: transfer '{}' ended {}: {}", id,
                                    v1::TransferPhase_Name(s.phase()), s.error_message()));
  }
  return absl::OkStatus();
}

// The load between the second and third sample.
absl::Status RunTransfers(const MemoryBenchOptions& o, AgentClient& initiator,
                          const std::string& peer_name, const std::string& label,
                          MemoryBenchResult* result) {
  const uint32_t groups = o.regions / o.regions_per_group;
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> completed{0};
  absl::Mutex mu;
  absl::Status first_error;
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < o.threads; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t mine = 0;; ++mine) {
        const uint64_t j = next.fetch_add(1);
        if (j >= o.transfers || failed.load()) return;
        v1::SubmitTransferRequest request;
        request.set_transfer_id(fmt::format("{}.t{}", label, j));
        request.set_peer(peer_name);
        request.set_op(v1::WRITE);
        request.set_notification(request.transfer_id());
        auto* items = request.add_segments()->mutable_items();
        const std::string group = GroupName(label, static_cast<uint32_t>(j % groups));
        items->set_local_group(group);
        items->set_remote_group(group);
        // Transfers in flight at once write distinct pages (the agent refuses two
        // transfers writing the same destination at once): (group, item) walks
        // groups x items, far more than the threads in flight.
        const uint64_t item = (j / groups) % o.items_per_region;
        items->add_local_indices(item);
        items->add_remote_indices(item);
        absl::Status done = RunOne(initiator, request);
        if (!done.ok()) {
          absl::MutexLock lock(&mu);
          if (first_error.ok()) first_error = done;
          failed.store(true);
          return;
        }
        // One thread reports, so the callback need not be thread-safe.
        const uint64_t done_now = completed.fetch_add(1) + 1;
        if (t == 0 && o.progress && mine % 64 == 0) o.progress(done_now, o.transfers);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  result->seconds = std::chrono::duration<double>(Clock::now() - start).count();
  absl::MutexLock lock(&mu);
  if (!first_error.ok()) return first_error;
  if (o.progress) o.progress(o.transfers, o.transfers);
  result->transfers = o.transfers;
  result->transfers_per_second = o.transfers / std::max(result->seconds, 1e-9);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MemoryBenchResult> RunMemoryBench(const MemoryBenchOptions& options,
                                                 AgentClient& initiator, AgentClient& target,
                                                 const std::string& peer_name, pid_t initiator_pid,
                                                 pid_t target_pid) {
  RETURN_IF_ERROR(CheckOptions(options));
  MemoryBenchResult result;
  result.regions = options.regions;
  result.pool_bytes = uint64_t{options.regions} * options.items_per_region * options.item_bytes;
  result.limit_bytes = options.limit_bytes;
  // Unique per run, so a second run against the same agents does not collide with
  // the first's region names or (kept) transfer ids.
  const std::string label =
      fmt::format("membench{}.{:x}", getpid(), std::random_device{}() & 0xffffff);

  ASSIGN_OR_RETURN(result.before_regions, Sample(initiator_pid, target_pid));
  std::vector<std::string> initiator_regions, target_regions;
  absl::Status run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(target_regions, RegisterRegions(target, "target", label, options));
    ASSIGN_OR_RETURN(initiator_regions, RegisterRegions(initiator, "initiator", label, options));
    ASSIGN_OR_RETURN(result.after_regions, Sample(initiator_pid, target_pid));
    // Every notification queued at the target is taken while the transfers run, so the
    // queue does not grow with the count; the DATA_READY of ours are counted.
    NotificationWaiterOptions taken;
    taken.address = target.address();
    taken.timeout_ms = 10000;
    taken.poll = true;
    taken.keep = [prefix = label + ".t"](const v1::Notification& n) {
      return n.kind() == v1::DATA_READY && n.transfer_id().rfind(prefix, 0) == 0;
    };
    NotificationWaiter drain(std::move(taken));
    RETURN_IF_ERROR(RunTransfers(options, initiator, peer_name, label, &result));
    auto kept = drain.WaitForCount(options.transfers, absl::Seconds(10));
    drain.Finish(absl::ZeroDuration());
    if (!kept.ok()) {
      return absl::Status(kept.status().code(),
                          fmt::format("memory bench: PollNotifications on the target ({}): {}",
                                      target.address(), kept.status().message()));
    }
    result.notifications = drain.kept();
    if (result.notifications != options.transfers) {
      return absl::DataLossError(fmt::format(
          "memory bench: {} transfers COMPLETED at the initiator but the target received {} "
          "DATA_READY notifications for them within 10 s; an agent lost notifications (check "
          "both agents' logs)",
          options.transfers, result.notifications));
    }
    ASSIGN_OR_RETURN(result.after_transfers, Sample(initiator_pid, target_pid));
    return absl::OkStatus();
  }();

  // Deregister on every path, the initiator first (it is the one that uses the
  // target's regions).
  std::string cleanup;
  for (auto [agent, names, role] : {std::tuple{&initiator, &initiator_regions, "initiator"},
                                    std::tuple{&target, &target_regions, "target"}}) {
    if (names->empty()) continue;
    auto removed = agent->Deregister(*names);
    if (!removed.ok()) {
      cleanup += fmt::format("; deregistering the {} regions on the {} ({}) failed: {}",
                             names->size(), role, agent->address(), removed.status().message());
    }
  }
  if (!run.ok()) return absl::Status(run.code(), std::string(run.message()) + cleanup);
  if (!cleanup.empty()) {
    return absl::InternalError(
        fmt::format("memory bench: the run succeeded but{}; deregister them by hand "
                    "(`kvagentctl regions`) or restart the agents",
                    cleanup.substr(1)));
  }
  result.meets_target = options.limit_bytes == 0 ||
                        (result.after_transfers.initiator.beyond_pools() < options.limit_bytes &&
                         result.after_transfers.target.beyond_pools() < options.limit_bytes);
  return result;
}

std::string FormatMemoryBench(const MemoryBenchResult& r) {
  std::string out = fmt::format(
      "agent memory beyond the registered pools (RssAnon + RssFile), {}: {} "
      "regions per agent ({} of shared memory), {} transfers at {:.0f}/s\n",
      r.limit_bytes == 0 ? std::string("no target at this scale")
                         : fmt::format("target < {} per agent", FormatMiB(r.limit_bytes)),
      r.regions, FormatMiB(r.pool_bytes), r.transfers,
      r.transfers_per_second);
  for (auto [role, pick] :
       {std::pair{"initiator", +[](const MemorySample& s) { return &s.initiator; }},
        std::pair{"target", +[](const MemorySample& s) { return &s.target; }}}) {
    const ProcessMemory& a = *pick(r.before_regions);
    const ProcessMemory& b = *pick(r.after_regions);
    const ProcessMemory& c = *pick(r.after_transfers);
    out += fmt::format(
        "  {:<9} pid {}: {} before regions, {} with regions, {} after transfers ({}); RssAnon {} "
        "-> {} -> {}, RssShmem {}, VmHWM {}: {}\n",
        role, c.pid, FormatMiB(a.beyond_pools()), FormatMiB(b.beyond_pools()),
        FormatMiB(c.beyond_pools()), FormatDeltaMiB(a.beyond_pools(), c.beyond_pools()),
        FormatMiB(a.rss_anon), FormatMiB(b.rss_anon), FormatMiB(c.rss_anon),
        FormatMiB(c.rss_shmem), FormatMiB(c.vm_hwm),
        r.limit_bytes == 0 ? "measured" : c.beyond_pools() < r.limit_bytes ? "met" : "NOT MET");
  }
  return out;
}

std::string MemoryBenchJson(const MemoryBenchResult& r) {
  auto agent = [](const ProcessMemory& a, const ProcessMemory& b, const ProcessMemory& c) {
    return fmt::format(
        "{{\"pid\":{},\"beyond_pools\":[{},{},{}],\"rss_anon\":[{},{},{}],\"rss_file\":[{},{},{}],"
        "\"rss_shmem\":[{},{},{}],\"vm_hwm\":{}}}",
        c.pid, a.beyond_pools(), b.beyond_pools(), c.beyond_pools(), a.rss_anon, b.rss_anon,
        c.rss_anon, a.rss_file, b.rss_file, c.rss_file, a.rss_shmem, b.rss_shmem, c.rss_shmem,
        c.vm_hwm);
  };
  return fmt::format(
      "{{\"kind\": \"memory\", \"regions\":{},\"pool_bytes\":{},\"transfers\":{},"
      "\"notifications\":{},\"seconds\":{:.3f},\"transfers_per_second\":{:.1f},"
      "\"limit_bytes\":{},\"meets_target\":{},\"moments\":[\"before_regions\",\"after_regions\","
      "\"after_transfers\"],\"initiator\":{},\"target\":{}}}",
      r.regions, r.pool_bytes, r.transfers, r.notifications, r.seconds, r.transfers_per_second,
      r.limit_bytes, r.meets_target ? "true" : "false",
      agent(r.before_regions.initiator, r.after_regions.initiator, r.after_transfers.initiator),
      agent(r.before_regions.target, r.after_regions.target, r.after_transfers.target));
}

}  // namespace kvagent::cli

// kvagentctl: the operator's and scheduler's command line for kvagentd.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/time/time.h"
#include "base/cpu_list.h"
#include "base/format.h"
#include "cli/agent_client.h"
#include "cli/bench.h"
#include "cli/bench_peers.h"
#include "cli/demo.h"
#include "fmt/format.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"

namespace {

constexpr std::string_view kUsage = R"(usage: kvagentctl [--agent ADDR] [--tls-cert PATH --tls-key PATH --tls-ca PATH]
                  [--json] [--timeout-ms N] [--client-name NAME] COMMAND [ARGS]

--agent: unix:PATH, the agent's local door on this host (default
unix:/run/kvagent/kvagent.sock; this process attaches a session, the kernel says
who it is), or HOST:PORT, its network door: mutual TLS with --tls-* (a certificate
the agent grants a role, e.g. --scheduler-identities), or plain TCP to an agent's
--insecure-listen door when no --tls-* is given. What you see and may change depends
on your roles (status shows them).

commands:
  status                     name, doors, UCX, regions, peers, transfer counters,
                             and who you are to the agent (principal, roles)
  regions                    registered regions with layouts
  peers                      connected peers: transports, error mode, UCX round trip
                             at connect, state
  agents                     the fleet in the agent's etcd directory (--directory):
                             name, doors, incarnation, age, whether it is a peer here
  transfers [--active] [--incoming]
                             this agent's transfers and their states (or, with
                             --incoming, peers' transfers into its regions);
                             one completing when placed says whether its
                             peer took the notification
  transfers --timeline TRANSFER_ID [--peer NAME]
                             where one transfer's time went: each stage it
                             reached (submitted, planned, first posted, data
                             flushed, notification sent, acknowledged, ended),
                             its time since submit and since the stage before;
                             an incoming one by id (from peer NAME)
  connect PEER_ADDR          connect this agent to the agent at PEER_ADDR (unix:PATH,
                             HOST:PORT, or agent:NAME through the directory)
                             (unix:PATH on this host, HOST:PORT over mutual TLS)
  disconnect PEER_NAME       forget a peer (its active transfers fail); scheduler role
  cancel TRANSFER_ID         cancel a transfer
  notifications [--max N] [--subscription NAME]
                             take queued notifications
  notifications --watch [--for-ms N] [--id TRANSFER_ID]... [--subscription NAME]
                             stream notifications as they arrive (one line
                             each, or one JSON object per line with --json),
                             for N ms or until interrupted; the agent gives
                             each notification to one taker. With a
                             subscription (yours: your uid and --client-name,
                             default kvagentctl) each is acknowledged after it
                             is printed; what was not comes again to the next
                             watch or poll of it (dedupe by its sequence)
  doctor                     host and peer checks with fixes; exit 1 on any FAIL

  demo [--prefill ADDR --decode ADDR] [--pool-mib N] [--requests N]
       [--pages N] [--chunks N] [--timeout-ms N] [--kvagentd PATH]
       [--shm-direct auto|off] [--model llama|hybrid]
       [--ssm-layers N] [--state-slots N] [--memory dram|vram]
       [--device N] [--submit auto|fast|grpc]
                             two agents (started here when no addresses are
                             given), Llama-3.1-8B-shaped KV pools, chunked
                             pushes of several requests' pages, every byte
                             verified; the last line is a JSON object.
                             --model hybrid: 4 attention layers' KV pages plus
                             N Mamba2-2.7B SSM layers (default 8; the real
                             model has 64) with conv and SSM state slots and
                             aux records; --pool-mib sizes the KV pages, the
                             state slots come on top.
                             --memory vram: this process plays the engine:
                             it allocates each pool on CUDA device N
                             (--device, default 0), registers it by CUDA IPC
                             handle, and checks the bytes through host copies;
                             needs the NVIDIA driver (libcuda.so.1)
                             --submit: fast submits through the local fast
                             path's rings, grpc one SubmitTransfer per chunk;
                             auto (default): fast on a unix: address

  bench [--quick] [--pool-mib N] [--initiator ADDR --target ADDR]
        [--shm-direct auto|off] [--kvagentd PATH] [--perftest PATH]
        [--memory dram|vram] [--device N] [--memory-regions N]
        [--fast-spin-us N] [--fast-reap-batch N] [--cells BLOCK:BATCH,...]
        [--copy-lanes N]
        [--worker-cpus LIST] [--agent-cpus LIST]
        [--fast-only]
                             two agents (started here when no addresses are
                             given) move blocks through the gRPC API: block
                             size x batch x WRITE/READ x contiguous/scattered,
                             GB/s, transfers/s, latency avg/p50/p99, WRITE
                             notification p50/p99, beside ucx_perftest and a
                             single-thread memcpy of the same pages, and each
                             cell again through the local fast path (the f*
                             columns; a unix: initiator); then one 4 KiB page
                             gRPC vs fast path p50/p99/p999 and ring pings,
                             one fast path WRITE to the target's notification
                             on its ring (fast_ring_notification; '-' when the
                             target's ring has no notifications) and through
                             a gRPC WatchNotifications (fast_grpc_notification),
                             fast path WRITEs/s (64 in flight, 1 and 2
                             clients; each process's CPU and the agents'
                             sleeps per transfer) and the agents' idle CPU
                             with a ring open, with the load average; the
                             fast path's latency and rate again with
                             complete_when PLACED (fast_placed*: COMPLETED
                             once the bytes are in place, the target's
                             acknowledgement recorded after; every
                             notification still counted), and issue 15's
                             targets for both completion points
                             (--fast-spin-us: how long the bench's Reap
                             polls before it sleeps, default 20;
                             --fast-reap-batch N: the rate phase's clients
                             and notification taker sleep until N
                             completions have come, default 16, 1: wake
                             for each); --json
                             prints one JSON object per cell; --quick runs a
                             smaller sweep in well under a minute;
                             --cells 64K:16,4M:64 runs only those cells
                             and no later phase; --fast-only runs only
                             the fast path phase (quick sizes; its gRPC
                             rate lines print -); --copy-lanes N starts
                             the agents with that many copy lanes;
                             --worker-cpus LIST starts them with their
                             UCX progress threads on those CPUs (the
                             fast path's targets line says where they ran);
                             --agent-cpus LIST starts them with every
                             thread on those CPUs (as taskset -c), to keep
                             them off this client's CPU;
                             --memory-regions N: the agent-memory phase
                             registers N regions per agent (default 1000;
                             100000 is issue 13's scale line)
                             --memory vram: pools on CUDA device N (--device),
                             registered by IPC handle; the memcpy column is a
                             device-to-device cuMemcpy of the same pages, and
                             bytes are checked through host copies; the rate
                             and agent-memory phases are skipped; needs the
                             NVIDIA driver (libcuda.so.1)

  bench-peers [--peers N] [--window-s S] [--idle-s S] [--poll-ms N]
              [--metadata-push on|off|both] [--kvagentd PATH]
                             a hub agent with N fake peers watching it (one
                             session and connection each; default 1000):
                             its CPU idle and with the peers (/proc), per
                             peer, one change's time to reach all, and how
                             long it takes to see a real peer killed and
                             hung; both (default) also runs the polling
                             baseline (a GetMetadata per peer every --poll-ms,
                             default 200)
)";

int Usage(const std::string& error) {
  if (!error.empty()) std::fprintf(stderr, "kvagentctl: %s\n", error.c_str());
  std::fwrite(kUsage.data(), 1, kUsage.size(), stderr);
  return 2;
}

std::string Json(const google::protobuf::Message& message) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

int Report(const absl::Status& status, const std::string& what) {
  std::fprintf(stderr, "kvagentctl %s: %s (%s)\n", what.c_str(),
               std::string(status.message()).c_str(),
               absl::StatusCodeToString(status.code()).c_str());
  return 1;
}

template <typename T>
int Print(const absl::StatusOr<T>& result, const std::string& what, bool json,
          void (*text)(const T&)) {
  if (!result.ok()) return Report(result.status(), what);
  if (json) {
    std::printf("%s\n", Json(*result).c_str());
  } else {
    text(*result);
  }
  return 0;
}

void PrintStatus(const kvagent::v1::AgentStatus& s) {
  std::printf("agent        %s (pid %u, incarnation %lx, up %.1f s)\n", s.name().c_str(), s.pid(),
              static_cast<unsigned long>(s.incarnation()), s.uptime_ms() / 1000.0);
  std::printf("doors        local %s (sessions %s.session), network %s\n",
              s.local_socket().c_str(), s.local_socket().c_str(), s.network_door().c_str());
  std::string roles;
  for (const auto& r : s.caller_roles()) roles += (roles.empty() ? "" : ",") + r;
  std::printf("you          %s [%s]\n", s.caller().c_str(), roles.c_str());
  std::string transports;
  for (const auto& t : s.ucx_transports()) transports += (transports.empty() ? "" : ",") + t;
  std::printf("ucx          %s [%s]%s\n", s.ucx_version().c_str(), transports.c_str(),
              s.worker_cpus().empty()
                  ? ""
                  : (", progress thread on CPUs " + s.worker_cpus()).c_str());
  if (!s.heap_allocator().empty()) std::printf("heap         %s\n", s.heap_allocator().c_str());
  std::printf("regions      %u (%lu bytes, metadata version %lu)\n", s.regions(),
              static_cast<unsigned long>(s.registered_bytes()),
              static_cast<unsigned long>(s.metadata_version()));
  std::printf("peers        %u\n", s.peers());
  // Completed when placed (complete_when) only once some were: of those, the
  // notifications the peer did not take (their owners never heard of the transfer).
  const std::string placed =
      s.completed_when_placed() == 0
          ? ""
          : fmt::format(" ({} completed when placed, {} of them not taken by the peer)",
                        s.completed_when_placed(), s.placed_not_taken());
  std::printf("transfers    %lu active, %lu completed, %lu failed%s\n",
              static_cast<unsigned long>(s.transfers_active()),
              static_cast<unsigned long>(s.transfers_completed()),
              static_cast<unsigned long>(s.transfers_failed()), placed.c_str());
  std::printf("notifications %lu queued, %lu in flight in %lu subscriptions (%lu bytes), "
              "%lu not queued: queue full\n",
              static_cast<unsigned long>(s.notifications_queued()),
              static_cast<unsigned long>(s.notifications_in_flight()),
              static_cast<unsigned long>(s.subscriptions()),
              static_cast<unsigned long>(s.queued_notification_bytes()),
              static_cast<unsigned long>(s.notifications_overflowed()));
  std::printf("streams      %lu open; %lu metadata streams of peers watching this agent\n",
              static_cast<unsigned long>(s.open_streams()),
              static_cast<unsigned long>(s.metadata_streams()));
  // Ended sessions waiting for their regions' release only when there are some.
  const std::string releasing =
      s.sessions_releasing() == 0
          ? ""
          : fmt::format(", {} ended and not released yet (the oldest ended {} ms ago)",
                        s.sessions_releasing(), s.oldest_release_wait_ms());
  // And the session socket's refusals, each when there were some: new sessions refused
  // while ended ones counted against --max-sessions, connections that sent no hello in
  // time or were over the bounds of those waiting for it, and all refused as they
  // connected (the first among them).
  const struct {
    uint64_t count;
    const char* what;
  } refusals[] = {
      {s.sessions_refused_releasing(), "refused while ended ones counted against --max-sessions"},
      {s.sessions_hello_timeouts(), "closed for no hello in time"},
      {s.sessions_refused_waiting(), "closed over the bounds of connections waiting for a hello"},
      {s.sessions_refused_connecting(), "refused as they connected"},
  };
  std::string refused;
  for (const auto& r : refusals) {
    if (r.count != 0) refused += fmt::format(", {} {}", r.count, r.what);
  }
  std::printf("sessions     %lu attached%s%s\n", static_cast<unsigned long>(s.sessions()),
              releasing.c_str(), refused.c_str());
  std::printf("fast path    %lu rings, %lu entries taken, %lu rings closed for protocol errors, "
              "%lu closed by their session's request\n",
              static_cast<unsigned long>(s.fast_path_rings()),
              static_cast<unsigned long>(s.fast_path_entries()),
              static_cast<unsigned long>(s.fast_path_protocol_errors()),
              static_cast<unsigned long>(s.fast_path_closed_by_request()));
  std::printf("             notifications on rings: %lu posted, %lu too large for their ring "
              "(left to gRPC), %lu acks, %lu dropped from a ring's pending list\n",
              static_cast<unsigned long>(s.fast_path_notifications()),
              static_cast<unsigned long>(s.fast_path_notifications_too_large()),
              static_cast<unsigned long>(s.fast_path_acks()),
              static_cast<unsigned long>(s.fast_path_pending_dropped()));
  const auto& lanes = s.copy_lanes();
  std::printf("copy lanes   %u: %lu same-host host copy batches (%lu split across lanes, "
              "%lu chunks copied by the other lanes, %lu shares taken back by the worker "
              "thread), %lu bytes; device copy %s: %lu batches (%lu split across streams), "
              "%lu bytes\n",
              lanes.lanes(), static_cast<unsigned long>(lanes.batches()),
              static_cast<unsigned long>(lanes.split_batches()),
              static_cast<unsigned long>(lanes.lane_chunks()),
              static_cast<unsigned long>(lanes.stolen_parts()),
              static_cast<unsigned long>(lanes.bytes()), s.device_copy().c_str(),
              static_cast<unsigned long>(lanes.device_batches()),
              static_cast<unsigned long>(lanes.device_split_batches()),
              static_cast<unsigned long>(lanes.device_bytes()));
  std::printf("memory       %lu faults caught (regions whose memory vanished)\n",
              static_cast<unsigned long>(s.memory_faults()));
  std::printf("refused      %lu calls, %lu peer messages dropped (%lu connections to UCX's "
              "TCP port, %lu software puts and gets over --ucx-held-replies and %lu wireup "
              "requests over --ucx-peer-endpoints among them); UCX's TCP port keeps "
              "connections from %lu peer hosts; %lu replies wait unread in UCX; UCX holds %lu "
              "endpoints for peers\n",
              static_cast<unsigned long>(s.refused_calls()),
              static_cast<unsigned long>(s.dropped_peer_messages()),
              static_cast<unsigned long>(s.ucx_tcp_refused_connections()),
              static_cast<unsigned long>(s.ucx_held_replies_refused()),
              static_cast<unsigned long>(s.ucx_peer_endpoints_refused()),
              static_cast<unsigned long>(s.ucx_tcp_allowed_hosts()),
              static_cast<unsigned long>(s.ucx_held_replies()),
              static_cast<unsigned long>(s.ucx_peer_endpoints()));
  std::printf("liveness     %lu pings answered, %lu datagrams dropped (malformed, unknown key, "
              "bad MAC, wrong incarnation, replayed); %lu peers lost, %lu pings refused by a "
              "full door\n",
              static_cast<unsigned long>(s.liveness_answered()),
              static_cast<unsigned long>(s.liveness_dropped()),
              static_cast<unsigned long>(s.liveness_peers_lost()),
              static_cast<unsigned long>(s.liveness_pings_refused()));
  std::printf("limits       %-28s %14s %14s %8s  %s\n", "name", "in use", "limit", "refused",
              "flag");
  for (const auto& l : s.limits()) {
    std::printf("             %-28s %14lu %14lu %8lu  %s\n", l.name().c_str(),
                static_cast<unsigned long>(l.in_use()), static_cast<unsigned long>(l.value()),
                static_cast<unsigned long>(l.refused()), l.flag().c_str());
  }
}

void PrintRegions(const kvagent::v1::ListRegionsResponse& r) {
  std::printf("%-24s %-6s %-10s %-4s %-10s %-10s %-10s %s\n", "name", "kind", "group", "pos",
              "items", "item_bytes", "stride", "source / owner");
  for (const auto& info : r.regions()) {
    const auto& s = info.spec();
    const std::string source =
        s.has_cuda_ipc()              ? fmt::format("cuda:{}+{}", s.cuda_ipc().device(), s.cuda_ipc().offset())
        : s.has_cuda_vmm()             ? fmt::format("vmm:{}+{}", s.cuda_vmm().memory_handle(), s.cuda_vmm().offset())
        : s.shm().memory_handle() != 0 ? fmt::format("handle:{}+{}", s.shm().memory_handle(), s.shm().offset())
                                       : fmt::format("{}+{}", s.shm().name(), s.shm().offset());
    std::printf("%-24s %-6s %-10s %-4u %-10lu %-10lu %-10lu %s (%s) %s%s\n", s.name().c_str(),
                kvagent::v1::RegionKind_Name(s.kind()).c_str(), s.group().c_str(),
                info.group_position(), static_cast<unsigned long>(s.layout().num_items()),
                static_cast<unsigned long>(s.layout().item_bytes()),
                static_cast<unsigned long>(s.layout().item_stride()), source.c_str(),
                info.memory_path().c_str(), info.owner().c_str(),
                info.broken() ? " BROKEN: memory vanished, register it again" : "");
  }
  std::printf("%d regions, metadata version %lu\n", r.regions_size(),
              static_cast<unsigned long>(r.version()));
}

void PrintAgents(const kvagent::v1::ListAgentsResponse& r) {
  std::printf("directory etcd://%s prefix %s: this agent %s, list %s (%lu publishes%s)%s%s\n",
              r.directory().c_str(), r.prefix().c_str(),
              r.published() ? "published" : "NOT published",
              r.watching() ? "live" : "STALE (etcd not answering)",
              static_cast<unsigned long>(r.publishes()),
              r.ignored_records() == 0
                  ? ""
                  : fmt::format(", {} records under the prefix ignored: not agents' records",
                                r.ignored_records())
                        .c_str(),
              r.last_error().empty() ? "" : "; last error: ", r.last_error().c_str());
  std::printf("%-16s %-22s %-40s %-16s %-9s %s\n", "name", "address", "local_socket",
              "incarnation", "age_s", "here");
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  for (const auto& a : r.agents()) {
    std::string here = a.self() ? "self" : a.peer_state().empty() ? "-" : "peer " + a.peer_state();
    std::printf("%-16s %-22s %-40s %-16lx %-9.1f %s\n", a.name().c_str(),
                a.address().empty() ? "-" : a.address().c_str(), a.local_socket().c_str(),
                static_cast<unsigned long>(a.incarnation()),
                (now_ms - a.published_unix_ms()) / 1000.0, here.c_str());
  }
}

// The peer's regions that shm-direct could not map here, and why (PeerInfo).
void PrintDirectFallbacks(const kvagent::v1::PeerInfo& p) {
  if (p.vmm_import_failures() > 0) {
    std::printf("  %lu CUDA VMM import(s) failed\n",
                static_cast<unsigned long>(p.vmm_import_failures()));
  }
  for (const auto& why : p.direct_fallbacks()) std::printf("  not direct: %s\n", why.c_str());
  const uint64_t listed = static_cast<uint64_t>(p.direct_fallbacks_size());
  if (p.direct_fallback_regions() > listed) {
    std::printf("  not direct: %lu more region(s) (the agent lists the first %lu; its log names "
                "each)\n",
                static_cast<unsigned long>(p.direct_fallback_regions() - listed),
                static_cast<unsigned long>(listed));
  }
}

// PeerInfo.ucx_round_trip_us as shown: "-" for a peer that takes no pings.
std::string RoundTrip(const kvagent::v1::PeerInfo& p) {
  return p.ucx_round_trip_us() == 0 ? std::string("-") : std::to_string(p.ucx_round_trip_us());
}

void PrintPeers(const kvagent::v1::ListPeersResponse& r) {
  std::printf("%-16s %-22s %-12s %-16s %-16s %-6s %-10s %-8s %-9s %s\n", "name", "address",
              "state", "data_path", "ucx_transports", "mode", "ucx_rtt_us", "regions", "same_host",
              "metadata (push|poll|reconnecting: last refresh; deltas/full fetches)"
              "[; device copy]");
  for (const auto& p : r.peers()) {
    std::printf("%-16s %-22s %-12s %-16s %-16s %-6s %-10s %-8u %-9s %s: %lu bytes in %.1f ms; "
                "%lu/%lu%s%s\n",
                p.name().c_str(), p.address().c_str(), p.state().c_str(), p.data_path().c_str(),
                p.transports().c_str(), p.error_mode().c_str(), RoundTrip(p).c_str(), p.regions(),
                p.same_host() ? "yes" : "no", p.metadata_source().c_str(),
                static_cast<unsigned long>(p.metadata_bytes_last()),
                p.refresh_us_last() / 1000.0, static_cast<unsigned long>(p.deltas_applied()),
                static_cast<unsigned long>(p.full_fetches()),
                p.device_copy().empty() ? "" : "; device copy ", p.device_copy().c_str());
    if (p.metadata_views_ignored() > 0 || p.metadata_paced_us_total() > 0) {
      std::printf("  its metadata: %lu whole catalogs at a version held here ignored; applying "
                  "its views took %.1f ms, and its next views waited %.1f ms for their share "
                  "(--peer-metadata-share)\n",
                  static_cast<unsigned long>(p.metadata_views_ignored()),
                  p.metadata_apply_us_total() / 1000.0, p.metadata_paced_us_total() / 1000.0);
    }
    PrintDirectFallbacks(p);
  }
}

void PrintPeer(const kvagent::v1::PeerInfo& p) {
  std::printf("connected to '%s' at %s: %u regions, data path %s, UCX transports %s, error mode "
              "%s, UCX round trip %s\n",
              p.name().c_str(), p.address().c_str(), p.regions(), p.data_path().c_str(),
              p.transports().c_str(), p.error_mode().c_str(),
              p.ucx_round_trip_us() == 0
                  ? "not measured (an older peer)"
                  : (std::to_string(p.ucx_round_trip_us()) + " us").c_str());
  PrintDirectFallbacks(p);
}

// An outgoing transfer that completes when placed (complete_when): whether its peer
// took the notification, which it answers after COMPLETED. Empty for one completing
// when acknowledged (COMPLETED already says the peer took it).
std::string PlacedNote(const kvagent::v1::TransferState& t) {
  if (t.direction() == kvagent::v1::INCOMING ||
      t.complete_when() != kvagent::v1::COMPLETE_WHEN_PLACED) {
    return "";
  }
  if (!t.peer_note().empty()) return "placed, NOT taken by the peer: " + t.peer_note();
  if (t.peer_acknowledged()) return "placed, peer acknowledged";
  return t.phase() == kvagent::v1::COMPLETED ? "placed, peer not answered yet" : "placed";
}

void PrintTransfer(const kvagent::v1::TransferState& t) {
  const char* drain = t.drained()         ? "drained"
                      : t.drain_unknown() ? "drain-unknown"
                                          : "draining";
  const std::string placed = PlacedNote(t);
  std::printf("%-24s %-3s %-12s %-6s %-12s %12lu/%-12lu %8.3f ms %-13s %s%s%s%s\n",
              t.transfer_id().c_str(), t.direction() == kvagent::v1::INCOMING ? "in" : "out",
              t.peer().c_str(), kvagent::v1::TransferOp_Name(t.op()).c_str(),
              kvagent::v1::TransferPhase_Name(t.phase()).c_str(),
              static_cast<unsigned long>(t.bytes_done()), static_cast<unsigned long>(t.bytes_total()),
              t.latency_us() / 1000.0, drain, t.error_message().c_str(),
              placed.empty() || t.error_message().empty() ? "" : " ",
              placed.empty() ? "" : "[", placed.empty() ? "" : (placed + "]").c_str());
}

void PrintTimeline(const kvagent::v1::TransferState& t) {
  std::printf("transfer '%s'%s%s%s %s %s peer '%s': %s, %lu/%lu bytes%s%s\n",
              t.transfer_id().c_str(), t.request_id().empty() ? "" : " (request '",
              t.request_id().c_str(), t.request_id().empty() ? "" : "')",
              t.direction() == kvagent::v1::INCOMING ? "incoming" : "outgoing",
              kvagent::v1::TransferOp_Name(t.op()).c_str(), t.peer().c_str(),
              kvagent::v1::TransferPhase_Name(t.phase()).c_str(),
              static_cast<unsigned long>(t.bytes_done()), static_cast<unsigned long>(t.bytes_total()),
              t.error_message().empty() ? "" : ": ", t.error_message().c_str());
  if (const std::string placed = PlacedNote(t); !placed.empty()) {
    // COMPLETED came before the peer's answer: the timeline's ACKNOWLEDGED (if any)
    // follows ENDED.
    std::printf("complete_when COMPLETE_WHEN_PLACED: %s\n", placed.c_str());
  }
  const absl::Time submitted = absl::FromUnixMicros(static_cast<int64_t>(t.submitted_unix_us()));
  std::printf("submitted %s\n",
              absl::FormatTime("%Y-%m-%d %H:%M:%E6S UTC", submitted, absl::UTCTimeZone()).c_str());
  std::printf("%-28s %14s %14s\n", "stage", "since submit", "delta");
  uint64_t previous = 0;
  for (const auto& e : t.timeline()) {
    std::printf("%-28s %11.3f ms %11.3f ms\n", kvagent::v1::TransferStage_Name(e.stage()).c_str(),
                e.at_us() / 1000.0, (e.at_us() - std::min(previous, e.at_us())) / 1000.0);
    previous = e.at_us();
  }
}

void PrintTransfers(const kvagent::v1::ListTransfersResponse& r) {
  for (const auto& t : r.transfers()) PrintTransfer(t);
  std::printf("%d transfers\n", r.transfers_size());
}

void PrintNotifications(const kvagent::v1::PollNotificationsResponse& r) {
  for (const auto& n : r.notifications()) {
    const std::string sequence =
        n.sequence() == 0 ? "" : fmt::format(" seq {}", n.sequence());
    std::printf("%-24s from %-12s %-18s %lu bytes, payload %zu bytes%s%s%s\n",
                n.transfer_id().c_str(), n.from_agent().c_str(),
                kvagent::v1::NotificationKind_Name(n.kind()).c_str(),
                static_cast<unsigned long>(n.bytes()), n.payload().size(), sequence.c_str(),
                n.error_message().empty() ? "" : ": ", n.error_message().c_str());
  }
}

// check, result, detail; the fix on its own line under a check that is not PASS.
void PrintDoctor(const kvagent::v1::DoctorReport& r) {
  int width = 5;
  for (const auto& c : r.checks()) width = std::max(width, static_cast<int>(c.name().size()));
  int counts[4] = {};
  std::printf("%-*s  %-6s %s\n", width, "check", "result", "detail / fix");
  for (const auto& c : r.checks()) {
    ++counts[c.result() >= 0 && c.result() < 4 ? c.result() : 0];
    std::printf("%-*s  %-6s %s\n", width, c.name().c_str(),
                kvagent::v1::DoctorCheck::Result_Name(c.result()).c_str(), c.detail().c_str());
    if (!c.fix().empty()) std::printf("%-*s  %-6s fix: %s\n", width, "", "", c.fix().c_str());
  }
  std::printf("agent '%s': %d checks, %d pass, %d warn, %d fail\n", r.agent().c_str(),
              r.checks_size(), counts[kvagent::v1::DoctorCheck::PASS],
              counts[kvagent::v1::DoctorCheck::WARN], counts[kvagent::v1::DoctorCheck::FAIL]);
}

bool ParseNumber(const std::string& flag, const std::string& value, uint64_t* out) {
  if (absl::SimpleAtoi(value, out)) return true;
  std::fprintf(stderr, "kvagentctl: %s '%s' is not a non-negative integer\n", flag.c_str(),
               value.c_str());
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  std::string agent_address = "unix:/run/kvagent/kvagent.sock";
  kvagent::agent::TlsFiles tls;
  bool json = false;
  uint64_t timeout_ms = 10000;
  std::string client_name = "kvagentctl";
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);

  // Global flags may appear anywhere; the rest is the command and its arguments.
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--agent" || a == "--timeout-ms" || a == "--tls-cert" || a == "--tls-key" ||
               a == "--tls-ca" || a == "--client-name") {
      if (i + 1 >= args.size()) return Usage(a + " needs a value");
      if (a == "--client-name") {
        client_name = args[++i];
      } else if (a == "--agent") {
        agent_address = args[++i];
      } else if (a == "--tls-cert") {
        tls.cert = args[++i];
      } else if (a == "--tls-key") {
        tls.key = args[++i];
      } else if (a == "--tls-ca") {
        tls.ca = args[++i];
      } else if (!ParseNumber(a, args[++i], &timeout_ms)) {
        return 2;
      }
    } else if (a == "--help" || a == "-h") {
      return Usage("");
    } else {
      rest.push_back(a);
    }
  }
  if (rest.empty()) return Usage("no command given");
  const std::string command = rest[0];

  if (command == "demo") {
    kvagent::cli::DemoOptions options;
    options.argv0 = argv[0];
    options.json = json;
    if (timeout_ms != 10000) options.timeout_ms = static_cast<uint32_t>(timeout_ms);
    for (size_t i = 1; i < rest.size(); ++i) {
      const std::string& a = rest[i];
      if (i + 1 >= rest.size()) return Usage("demo flag " + a + " needs a value (or is unknown)");
      const std::string& v = rest[++i];
      uint64_t n = 0;
      if (a == "--prefill") {
        options.prefill_address = v;
      } else if (a == "--decode") {
        options.decode_address = v;
      } else if (a == "--shm-direct") {
        if (v != "auto" && v != "off") return Usage("--shm-direct takes auto or off");
        options.shm_direct = v == "auto";
      } else if (a == "--memory") {
        if (v != "dram" && v != "vram") return Usage("--memory takes dram or vram");
        options.memory = v;
      } else if (a == "--submit") {
        if (v != "auto" && v != "fast" && v != "grpc") {
          return Usage("--submit takes auto, fast or grpc");
        }
        options.submit = v;
      } else if (a == "--device") {
        if (!ParseNumber(a, v, &n)) return 2;
        if (n > 1023) return Usage("--device takes a CUDA device ordinal (0, 1, ...)");
        options.device = static_cast<int>(n);
      } else if (a == "--kvagentd") {
        options.kvagentd = v;
      } else if (a == "--model") {
        if (v != "llama" && v != "hybrid") return Usage("--model takes llama or hybrid");
        options.model = v;
      } else if (a == "--ssm-layers" || a == "--state-slots") {
        if (!ParseNumber(a, v, &n)) return 2;
        if (n == 0 || n > 4096) return Usage(a + " takes 1 to 4096");
        if (a == "--ssm-layers") options.ssm_layers = static_cast<uint32_t>(n);
        if (a == "--state-slots") options.state_slots = static_cast<uint32_t>(n);
      } else if (a == "--pool-mib" || a == "--requests" || a == "--pages" || a == "--chunks") {
        if (!ParseNumber(a, v, &n)) return 2;
        if (a == "--pool-mib") options.pool_mib = n;
        if (a == "--requests") options.requests = static_cast<uint32_t>(n);
        if (a == "--pages") options.pages_per_request = static_cast<uint32_t>(n);
        if (a == "--chunks") options.chunks = static_cast<uint32_t>(n);
      } else {
        return Usage("unknown demo flag " + a);
      }
    }
    if (options.requests == 0) return Usage("--requests must be at least 1");
    return kvagent::cli::RunDemo(options);
  }

  if (command == "bench-peers") {
    kvagent::cli::BenchPeersOptions options;
    options.argv0 = argv[0];
    for (size_t i = 1; i < rest.size(); ++i) {
      const std::string& a = rest[i];
      if (i + 1 >= rest.size()) return Usage("bench-peers flag " + a + " needs a value");
      const std::string& v = rest[++i];
      uint64_t n = 0;
      if (a == "--peers" || a == "--window-s" || a == "--idle-s" || a == "--poll-ms") {
        if (!ParseNumber(a, v, &n)) return 2;
        if (n == 0 || n > 100000) return Usage(a + " takes 1 to 100000");
        if (a == "--peers") options.peers = static_cast<uint32_t>(n);
        if (a == "--window-s") options.window_s = static_cast<double>(n);
        if (a == "--idle-s") options.idle_s = static_cast<double>(n);
        if (a == "--poll-ms") options.poll_ms = static_cast<uint32_t>(n);
      } else if (a == "--metadata-push") {
        if (v != "on" && v != "off" && v != "both") {
          return Usage("--metadata-push takes on, off or both");
        }
        options.modes = v == "both" ? std::vector<std::string>{"on", "off"}
                                    : std::vector<std::string>{v};
      } else if (a == "--kvagentd") {
        options.kvagentd = v;
      } else {
        return Usage("unknown bench-peers flag " + a);
      }
    }
    return kvagent::cli::RunBenchPeers(options);
  }

  if (command == "bench") {
    kvagent::cli::BenchOptions options;
    options.argv0 = argv[0];
    options.json = json;
    if (timeout_ms != 10000) options.timeout_ms = static_cast<uint32_t>(timeout_ms);
    for (size_t i = 1; i < rest.size(); ++i) {
      const std::string& a = rest[i];
      if (a == "--quick") {
        options.quick = true;
        continue;
      }
      if (a == "--fast-only") {
        options.fast_only = options.quick = true;
        continue;
      }
      if (i + 1 >= rest.size()) return Usage("bench flag " + a + " needs a value (or is unknown)");
      const std::string& v = rest[++i];
      uint64_t n = 0;
      if (a == "--initiator") {
        options.initiator_address = v;
      } else if (a == "--target") {
        options.target_address = v;
      } else if (a == "--shm-direct") {
        if (v != "auto" && v != "off") return Usage("--shm-direct takes auto or off");
        options.shm_direct = v == "auto";
      } else if (a == "--kvagentd") {
        options.kvagentd = v;
      } else if (a == "--perftest") {
        options.perftest = v;
      } else if (a == "--pool-mib") {
        if (!ParseNumber(a, v, &n)) return 2;
        if (n == 0 || n > (1 << 20)) return Usage("--pool-mib takes 1 to 1048576");
        options.pool_mib = n;
      } else if (a == "--memory") {
        if (v != "dram" && v != "vram") return Usage("--memory takes dram or vram");
        options.memory = v;
      } else if (a == "--memory-regions") {
        if (!ParseNumber(a, v, &n)) return 2;
        if (n < 10 || n > 131072 || n % 10 != 0) {
          return Usage("--memory-regions takes a multiple of 10 from 10 to 131072");
        }
        options.memory_regions = static_cast<uint32_t>(n);
      } else if (a == "--fast-spin-us") {
        if (!ParseNumber(a, v, &n)) return 2;
        if (n > 1000000) return Usage("--fast-spin-us takes 0 to 1000000");
        options.fast_spin_us = static_cast<uint32_t>(n);
      } else if (a == "--fast-reap-batch") {
        if (!ParseNumber(a, v, &n)) return 2;
        if (n < 1 || n > 64) return Usage("--fast-reap-batch takes 1 to 64");
        options.fast_reap_batch = static_cast<uint32_t>(n);
      } else if (a == "--device") {
        if (!ParseNumber(a, v, &n)) return 2;
        if (n > 1024) return Usage("--device takes a CUDA device ordinal");
        options.device = static_cast<int>(n);
      } else if (a == "--cells") {
        auto cells = kvagent::cli::ParseCells(v);
        if (!cells.ok()) return Usage(std::string(cells.status().message()));
        options.cells = *std::move(cells);
      } else if (a == "--copy-lanes") {
        if (!ParseNumber(a, v, &n)) return 2;
        if (n == 0 || n > 64) return Usage("--copy-lanes takes 1 to 64");
        options.copy_lanes = static_cast<uint32_t>(n);
      } else if (a == "--worker-cpus") {
        options.worker_cpus = v;  // the agents check it and refuse a bad one
      } else if (a == "--agent-cpus") {
        // Applied here, as the agents start: checked here.
        auto cpus = kvagent::ParseCpuList(v);
        if (cpus.ok() && cpus->empty()) {
          cpus = absl::InvalidArgumentError("the list is empty; give CPUs such as 1 or 2-3");
        }
        if (cpus.ok()) {
          if (absl::Status allowed = kvagent::CheckCpusAllowed(*cpus, "--agent-cpus"); !allowed.ok()) {
            return Usage(std::string(allowed.message()));
          }
        } else {
          return Usage(fmt::format("--agent-cpus '{}': {}", v, cpus.status().message()));
        }
        options.agent_cpus = *std::move(cpus);
      } else {
        return Usage("unknown bench flag " + a);
      }
    }
    if (!options.agent_cpus.empty() && !options.initiator_address.empty()) {
      return Usage("--agent-cpus places the agents the bench starts; agents given by --initiator "
                   "and --target run where they were started (start them under taskset -c)");
    }
    return kvagent::cli::RunBench(options);
  }

  if (!tls.empty()) {
    if (absl::Status files = kvagent::agent::CheckTlsFiles(tls, "kvagentctl"); !files.ok()) {
      return Report(files, "--tls-*");
    }
  }
  kvagent::cli::AgentClientOptions client_options;
  client_options.timeout_ms = static_cast<uint32_t>(timeout_ms);
  client_options.tls = tls;
  client_options.client_name = client_name;
  kvagent::cli::AgentClient client(agent_address, client_options);
  if (command == "status") return Print(client.Status(), command, json, &PrintStatus);
  if (command == "regions") return Print(client.Regions(), command, json, &PrintRegions);
  if (command == "peers") return Print(client.Peers(), command, json, &PrintPeers);
  if (command == "agents") return Print(client.Agents(), command, json, &PrintAgents);
  if (command == "transfers") {
    bool active = false, incoming = false;
    std::string timeline, peer;
    for (size_t i = 1; i < rest.size(); ++i) {
      if (rest[i] == "--active") {
        active = true;
      } else if (rest[i] == "--incoming") {
        incoming = true;
      } else if ((rest[i] == "--timeline" || rest[i] == "--peer") && i + 1 < rest.size()) {
        (rest[i] == "--timeline" ? timeline : peer) = rest[i + 1];
        ++i;
      } else {
        return Usage("unknown transfers flag " + rest[i]);
      }
    }
    if (!timeline.empty()) {
      if (active || incoming) return Usage("transfers --timeline takes no --active or --incoming");
      return Print(client.Get(timeline, peer), command, json, &PrintTimeline);
    }
    if (!peer.empty()) return Usage("transfers --peer goes with --timeline TRANSFER_ID");
    return Print(client.Transfers(active, incoming), command, json, &PrintTransfers);
  }
  if (command == "disconnect") {
    if (rest.size() != 2) return Usage("disconnect takes one PEER_NAME");
    auto gone = client.Disconnect(rest[1]);
    if (!gone.ok()) return Report(gone.status(), command);
    std::printf("disconnected '%s' (%u active transfers failed)\n", rest[1].c_str(),
                gone->failed_transfers());
    return 0;
  }
  if (command == "connect") {
    if (rest.size() != 2) return Usage("connect takes one PEER_ADDR (unix:PATH or HOST:PORT)");
    return Print(client.Connect(rest[1]), command, json, &PrintPeer);
  }
  if (command == "cancel") {
    if (rest.size() != 2) return Usage("cancel takes one TRANSFER_ID");
    return Print(client.Cancel(rest[1]), command, json, &PrintTransfer);
  }
  if (command == "notifications") {
    const bool watch = rest.size() >= 2 && rest[1] == "--watch";
    uint64_t for_ms = 0, max = 0;
    std::vector<std::string> ids;
    std::string subscription;
    for (size_t i = watch ? 2 : 1; i < rest.size(); i += 2) {
      if (i + 1 >= rest.size()) return Usage("notifications " + rest[i] + " needs a value");
      if (rest[i] == "--subscription") {
        subscription = rest[i + 1];
      } else if (watch && rest[i] == "--for-ms") {
        if (!ParseNumber("--for-ms", rest[i + 1], &for_ms)) return 2;
      } else if (watch && rest[i] == "--id") {
        ids.push_back(rest[i + 1]);
      } else if (!watch && rest[i] == "--max") {
        if (!ParseNumber("--max", rest[i + 1], &max)) return 2;
      } else {
        return Usage("unknown notifications flag " + rest[i]);
      }
    }
    auto print = [json](const kvagent::v1::Notification& n) {
      if (json) {
        std::printf("%s\n", Json(n).c_str());
      } else {
        kvagent::v1::PollNotificationsResponse one;
        *one.add_notifications() = n;
        PrintNotifications(one);
      }
      std::fflush(stdout);
    };
    if (!watch) {
      auto polled = client.Poll(static_cast<uint32_t>(max), {}, subscription);
      if (!polled.ok()) return Report(polled.status(), command);
      if (!json) {
        PrintNotifications(*polled);
      } else {
        std::printf("%s\n", Json(*polled).c_str());
      }
      // Printed (and flushed, so a kill cannot lose printed-and-acknowledged lines in
      // stdio's buffer): acknowledged (a failure says so; they come again on the next poll).
      std::fflush(stdout);
      if (!subscription.empty() && polled->notifications_size() > 0) {
        uint64_t through = 0;
        for (const auto& n : polled->notifications()) through = std::max(through, n.sequence());
        if (auto acked = client.Ack(subscription, through); !acked.ok()) {
          return Report(acked.status(), "notifications (ack)");
        }
      }
      return 0;
    }
    // 0 = until interrupted: the stream's deadline is then a year away.
    const uint64_t limit = for_ms == 0 ? 365ull * 24 * 3600 * 1000 : for_ms;
    absl::Status acked = absl::OkStatus();
    absl::Status ended = client.WatchNotifications(
        ids, static_cast<uint32_t>(std::min<uint64_t>(limit, UINT32_MAX)),
        [&](const kvagent::v1::Notification& n) {
          print(n);
          if (subscription.empty()) return true;
          // After printing and flushing (stdout may be a pipe, fully buffered): a crash
          // before the ack means it comes again (same sequence), never that it is lost.
          std::fflush(stdout);
          auto released = client.Ack(subscription, n.sequence());
          if (!released.ok()) acked = released.status();
          return released.ok();
        },
        subscription);
    if (!acked.ok()) return Report(acked, "notifications (ack)");
    if (ended.ok() || (for_ms != 0 && ended.code() == absl::StatusCode::kDeadlineExceeded)) {
      return 0;
    }
    return Report(ended, command);
  }
  if (command == "doctor") {
    auto report = client.Doctor();
    if (Print(report, command, json, &PrintDoctor) != 0) return 1;
    for (const auto& c : report->checks()) {
      if (c.result() == kvagent::v1::DoctorCheck::FAIL) return 1;
    }
    return 0;
  }
  return Usage("unknown command '" + command + "'");
}

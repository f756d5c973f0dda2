#include "agent/metrics.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <vector>

#include "absl/types/span.h"
#include "base/log.h"
#include "fmt/format.h"
#include "registry/shm_mapping.h"
#include "transport/ucx_hardening.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("metrics");

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string CodeName(size_t code) {
  static constexpr const char* kNames[17] = {
      "OK",           "CANCELLED",          "UNKNOWN",          "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED", "NOT_FOUND",     "ALREADY_EXISTS",   "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",   "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL",          "UNAVAILABLE",      "DATA_LOSS",
      "UNAUTHENTICATED"};
  return code < 17 ? kNames[code] : "UNKNOWN";
}

// One metric family of the text format: HELP and TYPE once, then its samples.
class Family {
 public:
  Family(std::string* out, std::string_view name, std::string_view type, std::string_view help)
      : out_(out), name_(name) {
    fmt::format_to(std::back_inserter(*out_), "# HELP {} {}\n# TYPE {} {}\n", name, help, name,
                   type);
  }
  // `labels`: name, value pairs; values are escaped here.
  using Labels = absl::Span<const std::pair<std::string_view, std::string_view>>;
  Family& Sample(Labels labels, double value, std::string_view suffix = "") {
    out_->append(name_).append(suffix);
    if (labels.size() != 0) {
      out_->push_back('{');
      bool first = true;
      for (const auto& [k, v] : labels) {
        if (!first) out_->push_back(',');
        first = false;
        fmt::format_to(std::back_inserter(*out_), "{}=\"{}\"", k, EscapeLabelValue(v));
      }
      out_->push_back('}');
    }
    fmt::format_to(std::back_inserter(*out_), " {}\n", value);
    return *this;
  }
  Family& Sample(double value) { return Sample({}, value); }

 private:
  std::string* out_;
  std::string name_;
};

std::string Seconds(uint64_t us) { return fmt::format("{}", static_cast<double>(us) / 1e6); }

// A histogram's _bucket (cumulative, le in seconds, then +Inf), _sum and _count
// samples under `labels`.
void HistogramSamples(Family& family, std::vector<std::pair<std::string_view, std::string_view>> labels,
                      const Histogram& h) {
  const size_t plain = labels.size();
  uint64_t cumulative = 0;
  for (size_t b = 0; b <= kLatencyBucketsUs.size(); ++b) {
    cumulative += h.buckets[b];
    const std::string le = b < kLatencyBucketsUs.size() ? Seconds(kLatencyBucketsUs[b]) : "+Inf";
    labels.resize(plain);
    labels.emplace_back("le", le);
    family.Sample(labels, static_cast<double>(cumulative), "_bucket");
  }
  labels.resize(plain);
  family.Sample(labels, static_cast<double>(h.sum_us) / 1e6, "_sum");
  family.Sample(labels, static_cast<double>(h.count), "_count");
}

}  // namespace

std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

std::string RenderMetrics(const MetricsSources& sources) {
  const ServiceDeps& deps = *sources.deps;
  v1::AgentStatus status;
  FillAgentStatus(deps, &status);
  std::string out;
  out.reserve(16 << 10);

  Family(&out, "kvagent_info", "gauge",
         "This agent: name, incarnation, UCX version, heap allocator (always 1).")
      .Sample({{"name", status.name()},
               {"incarnation", fmt::format("{:x}", status.incarnation())},
               {"ucx_version", status.ucx_version()},
               {"heap_allocator", status.heap_allocator()}},
              1);
  Family(&out, "kvagent_uptime_seconds", "gauge", "Seconds since the agent started.")
      .Sample(static_cast<double>(status.uptime_ms()) / 1000);
  Family(&out, "kvagent_health_serving", "gauge",
         "1 when grpc.health.v1 answers SERVING (UCX progressing, every condition held).")
      .Sample(status.health() == "SERVING" ? 1 : 0);

  // Transfers that ended, as TransferMetrics counted them.
  if (sources.transfers != nullptr) {
    const auto series = sources.transfers->Series();
    Family transfers(&out, "kvagent_transfers_total", "counter",
                     "Outgoing transfers ended, by op, data path, peer and outcome.");
    for (const auto& s : series) {
      transfers.Sample({{"op", s.op}, {"data_path", s.data_path}, {"peer", s.peer},
                        {"outcome", s.outcome}},
                       static_cast<double>(s.transfers));
    }
    Family bytes(&out, "kvagent_transfer_bytes_total", "counter",
                 "Bytes that reached the destination (bytes_done) of ended outgoing transfers.");
    for (const auto& s : series) {
      bytes.Sample({{"op", s.op}, {"data_path", s.data_path}, {"peer", s.peer},
                    {"outcome", s.outcome}},
                   static_cast<double>(s.bytes));
    }
    Family errors(&out, "kvagent_transfer_errors_total", "counter",
                  "Outgoing transfers that did not complete, by op, peer and cause (gRPC code).");
    std::map<std::tuple<std::string, std::string, size_t>, uint64_t> by_cause;
    for (const auto& s : series) {
      for (size_t code = 0; code < 17; ++code) {
        if (s.errors_by_code[code] != 0) by_cause[{s.op, s.peer, code}] += s.errors_by_code[code];
      }
    }
    for (const auto& [key, n] : by_cause) {
      errors.Sample({{"op", std::get<0>(key)}, {"peer", std::get<1>(key)},
                     {"cause", CodeName(std::get<2>(key))}},
                    static_cast<double>(n));
    }
    Family latency(&out, "kvagent_transfer_latency_seconds", "histogram",
                   "First submit to outcome (COMPLETED: the peer has the data in place and its "
                   "notification queued), by op and outcome.");
    for (const auto& h : sources.transfers->Latency()) {
      HistogramSamples(latency, {{"op", h.op}, {"outcome", h.outcome}}, h);
    }
    Family stages(&out, "kvagent_transfer_stage_seconds", "histogram",
                  "Time from one timeline stage to the next (the stage named is the later one) "
                  "of ended transfers, by direction (outgoing; incoming: the receiver's record), "
                  "op and stage; a direction's stages add up to its whole submit-to-outcome time.");
    for (const auto& h : sources.transfers->Stages()) {
      HistogramSamples(stages, {{"direction", h.direction}, {"op", h.op}, {"stage", h.stage}}, h);
    }
    const auto incoming = sources.transfers->Incoming();
    Family incoming_transfers(&out, "kvagent_incoming_transfers_total", "counter",
                              "Peers' transfers into (WRITE) or out of (READ) this agent's regions, "
                              "ended, by op, peer and outcome.");
    for (const auto& s : incoming) {
      incoming_transfers.Sample({{"op", s.op}, {"peer", s.peer}, {"outcome", s.outcome}},
                                static_cast<double>(s.transfers));
    }
    Family incoming_bytes(&out, "kvagent_incoming_bytes_total", "counter",
                          "Bytes of ended incoming transfers (what each sender's DATA_READY "
                          "announced, for those that completed), by op, peer and outcome.");
    for (const auto& s : incoming) {
      incoming_bytes.Sample({{"op", s.op}, {"peer", s.peer}, {"outcome", s.outcome}},
                            static_cast<double>(s.bytes));
    }
    Family refused(&out, "kvagent_refused_total", "counter",
                   "Requests refused before anything ran, by request and cause (gRPC code).");
    const auto submits = sources.transfers->submit_refusals();
    const auto registrations = sources.transfers->registration_failures();
    for (size_t code = 0; code < 17; ++code) {
      if (submits[code] != 0) {
        refused.Sample({{"request", "submit_transfer"}, {"cause", CodeName(code)}},
                       static_cast<double>(submits[code]));
      }
      if (registrations[code] != 0) {
        refused.Sample({{"request", "register_regions"}, {"cause", CodeName(code)}},
                       static_cast<double>(registrations[code]));
      }
    }
  }

  // GetStatus's totals and queue depths.
  Family(&out, "kvagent_transfers_active", "gauge", "Outgoing transfers not yet ended.")
      .Sample(static_cast<double>(status.transfers_active()));
  const struct {
    const char* name;
    const char* help;
    uint64_t value;
  } transfer_counters[] = {
      {"kvagent_transfers_completed_total", "Outgoing transfers completed.",
       status.transfers_completed()},
      {"kvagent_transfers_completed_when_placed_total",
       "Outgoing transfers completed when placed (complete_when), before the peer's "
       "acknowledgement.",
       status.completed_when_placed()},
      {"kvagent_transfers_placed_not_taken_total",
       "Transfers completed when placed whose peer then did not take the notification.",
       status.placed_not_taken()},
      {"kvagent_transfers_failed_total", "Outgoing transfers failed, cancelled or timed out.",
       status.transfers_failed()},
  };
  for (const auto& c : transfer_counters) {
    Family(&out, c.name, "counter", c.help).Sample(static_cast<double>(c.value));
  }
  Family queues(&out, "kvagent_queue_depth", "gauge",
                "Work waiting, by queue (the limits' use; see kvagent_limit).");
  for (const auto& limit : status.limits()) {
    if (limit.name() == "planned_ops" || limit.name() == "pending_connects" ||
        limit.name() == "streams") {
      queues.Sample({{"queue", limit.name()}}, static_cast<double>(limit.in_use()));
    }
  }
  queues.Sample({{"queue", "notifications_queued"}}, static_cast<double>(status.notifications_queued()));
  queues.Sample({{"queue", "notifications_in_flight"}},
                static_cast<double>(status.notifications_in_flight()));
  queues.Sample({{"queue", "sessions_releasing"}},
                static_cast<double>(status.sessions_releasing()));
  Family(&out, "kvagent_oldest_release_wait_seconds", "gauge",
         "Since the oldest ended session whose regions are not released yet ended.")
      .Sample(status.oldest_release_wait_ms() / 1000.0);
  // The session socket's refusals.
  const struct {
    const char* name;
    const char* help;
    uint64_t value;
  } session_counters[] = {
      {"kvagent_sessions_refused_releasing_total",
       "Sessions refused because those attached and those ended whose regions are not "
       "released yet reached --max-sessions.",
       status.sessions_refused_releasing()},
      {"kvagent_sessions_hello_timeouts_total",
       "Session socket connections closed because they sent no hello within 5 s.",
       status.sessions_hello_timeouts()},
      {"kvagent_sessions_refused_waiting_total",
       "Session socket connections closed over the bounds of connections waiting for their "
       "hello (per uid, all uids together).",
       status.sessions_refused_waiting()},
      {"kvagent_sessions_refused_connecting_total",
       "Session socket connections refused as they connected: over --max-sessions, out of "
       "descriptors, or epoll failed.",
       status.sessions_refused_connecting()},
  };
  for (const auto& c : session_counters) {
    Family(&out, c.name, "counter", c.help).Sample(static_cast<double>(c.value));
  }
  Family(&out, "kvagent_queued_notification_bytes", "gauge",
         "Bytes of the notifications waiting for a client.")
      .Sample(static_cast<double>(status.queued_notification_bytes()));
  Family(&out, "kvagent_notifications_overflowed_total", "counter",
         "Failure notices not queued because the queue was full.")
      .Sample(static_cast<double>(status.notifications_overflowed()));
  Family(&out, "kvagent_sessions", "gauge", "Local sessions attached.")
      .Sample(static_cast<double>(status.sessions()));
  Family(&out, "kvagent_subscriptions", "gauge", "Durable notification subscriptions.")
      .Sample(static_cast<double>(status.subscriptions()));
  Family(&out, "kvagent_refused_calls_total", "counter",
         "RPCs refused: unauthenticated or not permitted.")
      .Sample(static_cast<double>(status.refused_calls()));
  Family(&out, "kvagent_dropped_peer_messages_total", "counter",
         "UCX messages dropped: no or wrong secret, oversized.")
      .Sample(static_cast<double>(status.dropped_peer_messages()));
  Family(&out, "kvagent_ucx_tcp_refused_connections_total", "counter",
         "Connections to UCX's TCP port closed by the guard: unread, from a local uid not a "
         "peer's or a host no authenticated peer vouched for, or at a frame UCT would abort "
         "the agent on (also a peer's answer on a connection the agent's UCX dialled).")
      .Sample(static_cast<double>(status.ucx_tcp_refused_connections()));
  Family(&out, "kvagent_ucx_tcp_allowed_hosts", "gauge",
         "Hosts authenticated peers vouched for, whose connections UCX's TCP port keeps.")
      .Sample(static_cast<double>(status.ucx_tcp_allowed_hosts()));
  Family(&out, "kvagent_liveness_answered_total", "counter",
         "Liveness pings from watching peers answered by this agent's liveness door.")
      .Sample(static_cast<double>(status.liveness_answered()));
  Family(&out, "kvagent_liveness_dropped_total", "counter",
         "Datagrams the liveness door dropped: malformed, unknown key, bad MAC, wrong "
         "incarnation, replayed.")
      .Sample(static_cast<double>(status.liveness_dropped()));
  Family(&out, "kvagent_liveness_peers_lost_total", "counter",
         "Peers this agent's liveness prober found silent past the timeout (their transfers "
         "failed).")
      .Sample(static_cast<double>(status.liveness_peers_lost()));
  Family(&out, "kvagent_liveness_pings_refused_total", "counter",
         "Liveness pings the kernel refused for a full queue at a peer's door: a door that "
         "stopped reading, or one flooded with datagrams.")
      .Sample(static_cast<double>(status.liveness_pings_refused()));
  Family(&out, "kvagent_memory_faults_total", "counter",
         "SIGBUS faults caught in registered or peer memory that vanished.")
      .Sample(static_cast<double>(status.memory_faults()));
  Family(&out, "kvagent_fast_path_rings", "gauge", "Fast path rings open.")
      .Sample(static_cast<double>(status.fast_path_rings()));
  const struct {
    const char* name;
    const char* help;
    uint64_t value;
  } fast_counters[] = {
      {"kvagent_fast_path_entries_total", "Fast path entries taken.", status.fast_path_entries()},
      {"kvagent_fast_path_notifications_total",
       "Notifications posted on fast path rings that watch them.",
       status.fast_path_notifications()},
      {"kvagent_fast_path_notifications_too_large_total",
       "Offers to a watching fast path ring of a notification spanning more than half its "
       "completion ring (left to gRPC; open the ring with more completion_entries).",
       status.fast_path_notifications_too_large()},
      {"kvagent_fast_path_acks_total",
       "Fast path kAckNotifications entries answered OK (durable subscriptions on the ring).",
       status.fast_path_acks()},
      {"kvagent_fast_path_pending_dropped_total",
       "Notifications a ring attached to a subscription dropped from its list waiting for "
       "room (sequences acknowledged before the ring wrote them).",
       status.fast_path_pending_dropped()},
      {"kvagent_fast_path_closed_by_request_total",
       "Fast path rings closed by their session's close_fast_path request (the session stayed).",
       status.fast_path_closed_by_request()},
  };
  for (const auto& c : fast_counters) {
    Family(&out, c.name, "counter", c.help).Sample(static_cast<double>(c.value));
  }

  // Background first touch of mapped host memory (--warm-mappings).
  const registry::ShmMapping::WarmingStats warming = registry::ShmMapping::warming();
  Family(&out, "kvagent_mapping_pages_warmed_total", "counter",
         "Pages of mapped host memory the map-warm thread has read once (--warm-mappings).")
      .Sample(static_cast<double>(warming.pages_touched));
  Family(&out, "kvagent_mapping_pages_to_warm", "gauge",
         "Pages of mapped host memory waiting for the map-warm thread now.")
      .Sample(static_cast<double>(warming.pages_queued));

  // Memory released while a peer's software get reply may still read it: mapped to
  // zero pages until the UCX worker flushed (transport/ucx_hardening.h, RetireMapping);
  // the replies to peers' software puts and gets waiting unread in UCX (HeldReplies);
  // peers' remote key entries refused (UnpackRkeyEntry); UCX's reach into other
  // processes of this host refused (SameHostTargetAdmitted).
  const transport::RetiredMappings retired = transport::RetiredMappingsNow();
  const transport::HeldReplies held = transport::HeldRepliesNow();
  const transport::PeerEndpoints peer_made = transport::PeerEndpointsNow();
  const transport::AmAssembly assembly = transport::AmAssemblyNow();
  const struct {
    const char* name;
    const char* type;
    const char* help;
    uint64_t value;
  } ucx_memory_families[] = {
      {"kvagent_retired_mappings", "gauge",
       "Released host memory kept as zero pages until every UCX worker flushed what a "
       "peer's software get may still read from it; one that stays names a peer that "
       "stopped taking a reply.",
       retired.held},
      {"kvagent_retired_mapping_bytes", "gauge",
       "Address space of kvagent_retired_mappings (zero pages: no memory).", retired.held_bytes},
      {"kvagent_retired_mappings_released_total", "counter",
       "Retired mappings unmapped once every UCX worker flushed.", retired.released},
      {"kvagent_ucx_held_replies", "gauge",
       "Replies to peers' software puts and gets waiting in UCX for the requester to read "
       "them (about 350 bytes each).",
       held.held},
      {"kvagent_ucx_held_replies_most", "gauge",
       "The most of them waiting for one endpoint; at --ucx-held-replies its requests are "
       "dropped.",
       held.most},
      {"kvagent_ucx_held_replies_peak", "gauge",
       "The most replies that ever waited for one endpoint: what honest peers need of "
       "--ucx-held-replies.",
       held.peak},
      {"kvagent_ucx_held_replies_refused_total", "counter",
       "Software puts and gets dropped because their endpoint had --ucx-held-replies "
       "replies waiting unread (also in dropped_peer_messages).",
       held.refused},
      {"kvagent_ucx_endpoints", "gauge",
       "Endpoints UCX holds now, the agent's own and those made for peers (about 17.5 KiB "
       "each). UCX 1.13 keeps one each side per restart of a same-host peer.",
       peer_made.all},
      {"kvagent_ucx_replies_to_gone_endpoints_total", "counter",
       "Answers due after their handler returned (acknowledgements, staged read parts) "
       "not sent because UCX had destroyed the endpoint their request came over: its "
       "requester's connection ended before the answer was ready.",
       transport::RepliesToGoneEndpoints()},
      {"kvagent_ucx_endpoints_reclaimed_total", "counter",
       "Endpoints to a same-host peer process that ended, destroyed where UCX would keep "
       "them until the agent restarts: about one per restart of a same-host peer.",
       transport::EndpointsReclaimed()},
      {"kvagent_ucx_peer_endpoints", "gauge",
       "Endpoints UCX made for peers' wireup requests and checks that this agent did not "
       "open itself (about 17.5 KiB each): one per peer endpoint connected to this agent.",
       peer_made.live},
      {"kvagent_ucx_peer_endpoints_peak", "gauge",
       "The most of them UCX's worker ever held: what honest peers need of "
       "--ucx-peer-endpoints.",
       peer_made.peak},
      {"kvagent_ucx_peer_endpoints_refused_total", "counter",
       "Peers' wireup requests and checks refused because UCX's worker held "
       "--ucx-peer-endpoints endpoints made for peers (also in dropped_peer_messages).",
       peer_made.refused},
      {"kvagent_ucx_am_assembling", "gauge",
       "Peers' active messages of several fragments being assembled now.", assembly.messages},
      {"kvagent_ucx_am_assembling_bytes", "gauge",
       "Memory held for them (data and user header, allocated at their first fragment).",
       assembly.bytes},
      {"kvagent_ucx_am_assembling_bytes_peak", "gauge",
       "The most memory ever held for messages being assembled.", assembly.peak_bytes},
      {"kvagent_ucx_am_assembled_total", "counter",
       "Peers' fragmented active messages assembled whole and handed to their handler.",
       assembly.assembled},
      {"kvagent_ucx_am_fragments_refused_total", "counter",
       "Fragments of peers' active messages dropped: out of order, past their message, a "
       "first fragment again, or a message over the bounds (also in dropped_peer_messages).",
       assembly.refused},
      {"kvagent_ucx_am_abandoned_total", "counter",
       "Messages being assembled dropped after 30 s without a fragment (a sender that "
       "stopped mid-message).",
       assembly.abandoned},
      {"kvagent_ucx_rkey_entries_refused_total", "counter",
       "Entries of peers' remote keys refused: naming a shared memory segment to attach "
       "(UCX's posix or sysv domain), or failing to unpack. A peer key holding one is "
       "refused whole (the peer's view names the region).",
       transport::UcxRefusedRkeyEntries()},
      {"kvagent_ucx_same_host_refused_total", "counter",
       "Shared memory attaches and cma reads or writes of UCX refused: the process they "
       "named is no peer a local door proved (or, for cma, this agent itself; for a FIFO "
       "named by file, no such process maps it; for a local-door peer's TCP, none "
       "listens on the port), or a peer's posix FIFO lies in a directory UCX 1.13 cannot "
       "attach. A peer's endpoint fails at the first; the log names the pid, file or "
       "port.",
       transport::SameHostRefusals()},
  };
  for (const auto& f : ucx_memory_families) {
    Family(&out, f.name, f.type, f.help).Sample(static_cast<double>(f.value));
  }

  // Limits: value, use and refusals of each (docs/LIMITS.md).
  Family limit_value(&out, "kvagent_limit", "gauge", "Each limit's value (its --max-* flag).");
  for (const auto& l : status.limits()) {
    limit_value.Sample({{"limit", l.name()}, {"unit", l.unit()}}, static_cast<double>(l.value()));
  }
  Family limit_use(&out, "kvagent_limit_in_use", "gauge",
                   "Each limit's use now (per-owner limits: the largest owner's).");
  for (const auto& l : status.limits()) {
    limit_use.Sample({{"limit", l.name()}}, static_cast<double>(l.in_use()));
  }
  Family limit_refused(&out, "kvagent_limit_refusals_total", "counter",
                       "Requests each limit refused since the agent started.");
  for (const auto& l : status.limits()) {
    limit_refused.Sample({{"limit", l.name()}}, static_cast<double>(l.refused()));
  }

  // Regions by kind and memory path.
  std::map<std::pair<std::string, std::string>, std::pair<uint64_t, uint64_t>> regions;
  for (const auto& region : deps.registry->List()) {
    auto& [count, bytes] = regions[{v1::RegionKind_Name(region->spec.kind()), region->memory_path}];
    ++count;
    bytes += region->spec.length();
  }
  Family region_count(&out, "kvagent_regions", "gauge", "Registered regions by kind and memory path.");
  for (const auto& [key, v] : regions) {
    region_count.Sample({{"kind", key.first}, {"memory_path", key.second}},
                        static_cast<double>(v.first));
  }
  Family region_bytes(&out, "kvagent_registered_bytes", "gauge",
                      "Registered bytes by kind and memory path.");
  for (const auto& [key, v] : regions) {
    region_bytes.Sample({{"kind", key.first}, {"memory_path", key.second}},
                        static_cast<double>(v.second));
  }

  // Peers (bounded by the peer table).
  const auto peers = deps.peers->List();
  Family peer_up(&out, "kvagent_peer_up", "gauge",
                 "1 when the peer is connected, 0 when unreachable; by data path and error mode.");
  for (const auto& p : peers) {
    peer_up.Sample({{"peer", p.name()}, {"state", p.state()}, {"data_path", p.data_path()},
                    {"error_mode", p.error_mode()}},
                   p.state() == "connected" ? 1 : 0);
  }
  Family peer_seen(&out, "kvagent_peer_last_seen_seconds", "gauge",
                   "Seconds since the peer last answered a poll.");
  for (const auto& p : peers) {
    peer_seen.Sample({{"peer", p.name()}}, static_cast<double>(p.last_seen_ms_ago()) / 1000);
  }
  // Same-host peers whose memory is not all mapped here: what `peers` lists per peer
  // (PeerInfo.direct_fallbacks, vmm_import_failures of the views in use), summed. Both
  // are of the current views, so gauges: a peer re-registering or leaving lowers them.
  uint64_t fallbacks = 0, vmm_failures = 0;
  for (const auto& p : peers) {
    // An older peer manager sent no count: its list is the count, up to its cap.
    fallbacks += std::max<uint64_t>(p.direct_fallback_regions(),
                                    static_cast<uint64_t>(p.direct_fallbacks_size()));
    vmm_failures += p.vmm_import_failures();
  }
  Family(&out, "kvagent_peer_direct_fallbacks", "gauge",
         "Regions of same-host peers that could not be mapped here (shm-direct) and move "
         "through host staging (VRAM) or UCX (host memory) instead, summed over peers. "
         "Nonzero: `kvagentctl peers` names each region and why, "
         "`kvagentctl doctor` says what to check.")
      .Sample(static_cast<double>(fallbacks));
  Family(&out, "kvagent_peer_vmm_import_failures", "gauge",
         "CUDA VMM allocations of same-host peers that this agent's driver could not import "
         "for the views in use (their regions move through host staging), summed over peers. "
         "Nonzero: check that the exporting engine created them with the POSIX file "
         "descriptor handle type (cuMemCreate requestedHandleTypes), that both agents load the "
         "same NVIDIA driver and run as the same uid (or one in --peer-uids); `kvagentctl "
         "peers` gives the driver's error.")
      .Sample(static_cast<double>(vmm_failures));
  Family(&out, "kvagent_vmm_import_failures_total", "counter",
         "Failed attempts to import a same-host peer's CUDA VMM allocation here, since this "
         "agent started. Each rebuild of a peer's view (each change of its metadata) retries "
         "the allocations that failed, so it rises with every metadata change of a peer whose "
         "imports keep failing; kvagent_peer_vmm_import_failures is the current views' count.")
      .Sample(static_cast<double>(deps.peers->vmm_import_failures_total()));

  if (sources.stager != nullptr) {
    Family staged(&out, "kvagent_staging_total", "counter",
                  "Host staging: chunks received and rejected, chunks and read replies that "
                  "came by rendezvous (from another host, or a same-host agent of an older "
                  "version), peer reads served and refused, bounce buffers written off (held "
                  "by sends a peer never confirmed, or by read replies a reader never took; "
                  "replaced) and those that could not be replaced.");
    staged.Sample({{"event", "chunks_received"}}, static_cast<double>(sources.stager->chunks_received()));
    staged.Sample({{"event", "chunks_rejected"}}, static_cast<double>(sources.stager->chunks_rejected()));
    staged.Sample({{"event", "received_by_rendezvous"}},
                  static_cast<double>(sources.stager->rendezvous_received()));
    staged.Sample({{"event", "reads_served"}}, static_cast<double>(sources.stager->reads_served()));
    staged.Sample({{"event", "reads_refused"}}, static_cast<double>(sources.stager->reads_refused()));
    staged.Sample({{"event", "buffers_written_off"}},
                  static_cast<double>(sources.stager->buffers_written_off()));
    staged.Sample({{"event", "write_offs_refused"}},
                  static_cast<double>(sources.stager->write_offs_refused()));
  }
  if (sources.server != nullptr) {
    const MetricsServerCounters c = sources.server->counters();
    Family endpoint(&out, "kvagent_metrics_requests_total", "counter",
                    "Requests to this endpoint, by result.");
    endpoint.Sample({{"result", "ok"}}, static_cast<double>(c.requests));
    endpoint.Sample({{"result", "refused_connection"}}, static_cast<double>(c.refused_connections));
    endpoint.Sample({{"result", "bad_request"}}, static_cast<double>(c.bad_requests));
    endpoint.Sample({{"result", "too_large"}}, static_cast<double>(c.too_large));
    endpoint.Sample({{"result", "timeout"}}, static_cast<double>(c.timeouts));
  }
  return out;
}

// ---------------------------------------------------------------- the HTTP responder

struct MetricsServer::Connection {
  int fd = -1;
  int64_t deadline_ms = 0;
  std::string in;
  std::string out;  // the response, once there is one
  size_t written = 0;
  bool eof = false;  // the client closed its side (or the read failed)
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const MetricsServerOptions& options, Render render) {
  std::string host = "127.0.0.1";
  std::string port = options.listen;
  if (auto colon = options.listen.rfind(':'); colon != std::string::npos) {
    host = options.listen.substr(0, colon);
    port = options.listen.substr(colon + 1);
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host == "localhost") host = "127.0.0.1";
  const bool wildcard = host.empty() || host == "0.0.0.0" || host == "::";
  if (wildcard && !options.allow_any) {
    return absl::InvalidArgumentError(fmt::format(
        "--metrics-listen {}: a wildcard address serves the metrics (peer names, regions, "
        "transfer counts) on every interface; give the address the scraper uses (the pod's "
        "or node's IP, or 127.0.0.1), or add --metrics-listen-any to mean it",
        options.listen));
  }
  if (options.max_connections == 0) {
    return absl::InvalidArgumentError("--metrics-max-connections: give at least 1");
  }
  struct addrinfo hints {};
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | AI_PASSIVE;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* found = nullptr;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    return absl::InvalidArgumentError(fmt::format(
        "--metrics-listen {}: not HOST:PORT with an IP address and a port number (e.g. "
        "127.0.0.1:9464, [::1]:9464, or 9464 for loopback)",
        options.listen));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->options_ = options;
  server->render_ = std::move(render);
  server->listen_fd_ = socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(server->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool bound = server->listen_fd_ >= 0 &&
                     bind(server->listen_fd_, found->ai_addr, found->ai_addrlen) == 0 &&
                     listen(server->listen_fd_, 64) == 0;
  const int error = errno;
  freeaddrinfo(found);
  if (!bound) {
    return absl::UnavailableError(fmt::format(
        "--metrics-listen {}: cannot listen there: {}; use a free port (0 picks one) on an "
        "address of this host",
        options.listen, std::strerror(error)));
  }
  struct sockaddr_storage addr {};
  socklen_t len = sizeof(addr);
  getsockname(server->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  const int bound_port = addr.ss_family == AF_INET6
                             ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                             : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  server->address_ = host.find(':') != std::string::npos
                         ? fmt::format("[{}]:{}", host, bound_port)
                         : fmt::format("{}:{}", host, bound_port);
  server->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  kLog.Info("Prometheus metrics at http://{}/metrics (at most {} connections)", server->address_,
            options.max_connections);
  return server;
}

MetricsServer::~MetricsServer() {
  Stop();
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void MetricsServer::Stop() {
  if (stopping_.exchange(true)) return;
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
}

MetricsServerCounters MetricsServer::counters() const {
  return {requests_.load(), refused_.load(), bad_.load(), too_large_.load(), timeouts_.load()};
}

void MetricsServer::Respond(Connection& c, int code, std::string_view reason, std::string body,
                            std::string_view content_type) {
  c.out = fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
      code, reason, content_type, body.size());
  c.out += body;
  c.written = 0;
}

bool MetricsServer::OnReadable(Connection& c) {
  char buffer[4096];
  for (;;) {
    const ssize_t n = read(c.fd, buffer, sizeof(buffer));
    if (n > 0) {
      // Past the bound the rest is read and dropped (so the answer is not lost to a
      // reset for unread data when the connection closes).
      const size_t room = kMaxRequestBytes + 1 - std::min(c.in.size(), kMaxRequestBytes + 1);
      c.in.append(buffer, std::min(room, static_cast<size_t>(n)));
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n < 0 && errno == EINTR) continue;
    c.eof = true;  // closed (or failed): answer what came, if it is a whole request
    break;
  }
  const size_t head_end = c.in.find("\r\n\r\n");
  if (head_end == std::string::npos || head_end + 4 > kMaxRequestBytes) {
    if (c.in.size() <= kMaxRequestBytes) return false;  // wait for more
    too_large_.fetch_add(1);
    Respond(c, 431, "Request Header Fields Too Large",
            fmt::format("request head over {} bytes\n", kMaxRequestBytes));
    return true;
  }
  const std::string_view line(c.in.data(), c.in.find("\r\n"));
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || line.substr(sp2 + 1).rfind("HTTP/1.", 0) != 0) {
    bad_.fetch_add(1);
    Respond(c, 400, "Bad Request", "expected: GET /metrics HTTP/1.1\n");
    return true;
  }
  const std::string_view method = line.substr(0, sp1);
  std::string_view path = line.substr(sp1 + 1, sp2 - sp1 - 1);
  path = path.substr(0, path.find('?'));
  if (method != "GET") {
    bad_.fetch_add(1);
    Respond(c, 405, "Method Not Allowed", "only GET /metrics\n");
    return true;
  }
  if (path != "/metrics") {
    bad_.fetch_add(1);
    Respond(c, 404, "Not Found", "only GET /metrics\n");
    return true;
  }
  requests_.fetch_add(1);
  Respond(c, 200, "OK", render_(), "text/plain; version=0.0.4; charset=utf-8");
  return true;
}

void MetricsServer::Loop() {
  pthread_setname_np(pthread_self(), "metrics");
  std::vector<Connection> connections;
  std::vector<pollfd> fds;
  while (!stopping_.load()) {
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    int64_t next_deadline = NowMs() + 1000;
    for (const auto& c : connections) {
      fds.push_back({c.fd, static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
      next_deadline = std::min(next_deadline, c.deadline_ms);
    }
    // With no connection open nothing can time out: asleep until one comes or Stop.
    const int wait = connections.empty()
                         ? -1
                         : static_cast<int>(std::max<int64_t>(0, next_deadline - NowMs()));
    if (poll(fds.data(), fds.size(), wait) < 0 && errno != EINTR) break;
    if (fds[0].revents != 0) break;  // Stop
    const int64_t now = NowMs();
    // Connections first (fds[2 + i] is connections[i]); those done are closed.
    std::vector<Connection> kept;
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      const short revents = fds[2 + i].revents;
      bool done = false;
      if (c.out.empty() && (revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
        // Closed before a whole request: nothing to answer.
        done = !OnReadable(c) && (c.eof || (revents & (POLLHUP | POLLERR)) != 0);
      }
      if (!done && !c.out.empty() && (revents & (POLLOUT | POLLERR | POLLHUP)) != 0) {
        const ssize_t n = send(c.fd, c.out.data() + c.written, c.out.size() - c.written,
                               MSG_NOSIGNAL);
        if (n > 0) c.written += static_cast<size_t>(n);
        if (n < 0 && errno != EAGAIN && errno != EINTR) done = true;
        if (c.written == c.out.size()) done = true;
      }
      if (!done && now >= c.deadline_ms) {
        if (c.out.empty()) timeouts_.fetch_add(1);
        done = true;
      }
      if (done) {
        close(c.fd);
      } else {
        kept.push_back(std::move(c));
      }
    }
    connections = std::move(kept);
    if ((fds[1].revents & POLLIN) != 0) {
      for (;;) {
        const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        if (connections.size() >= options_.max_connections) {
          // Refused at once, with a best-effort answer; the scraper retries next round.
          refused_.fetch_add(1);
          static constexpr std::string_view kBusy =
              "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
          (void)!send(fd, kBusy.data(), kBusy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
          close(fd);
          continue;
        }
        Connection c;
        c.fd = fd;
        c.deadline_ms = NowMs() + kRequestTimeoutMs;
        connections.push_back(std::move(c));
      }
    }
  }
  for (auto& c : connections) close(c.fd);
}

}  // namespace kvagent::agent

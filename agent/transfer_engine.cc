#include "agent/transfer_engine.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <utility>

#include "agent/peer_secrets.h"
#include "agent/request_digest.h"
#include "agent/status_util.h"
#include "agent/timeline.h"
#include "agent/wire_encoding.h"
#include "base/format.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "cuda/driver.h"
#include "fmt/format.h"
#include "registry/fault_guard.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("transfers");
constexpr size_t kMaxTransferIdBytes = 256;
// A transfer's deadline, at most: a receiving agent holds an incoming transfer's
// record no longer than this either (IncomingOptions::max_peer_timeout_ms), and a
// transfer holds its slots, ledger claims and pinned regions until it ends.
constexpr uint32_t kMaxTimeoutMs = 600000;
// Notification.targets: distinct peer groups and regions one transfer names.
constexpr size_t kMaxTargets = 256;

// A DATA_READY's acknowledgement token: 8 bytes from the kernel's CSPRNG, drawn 64 at a
// time (one getrandom() per 64 transfers, not one each; each thread its own pool).
uint64_t RandomToken() {
  constexpr size_t kPool = 64;
  thread_local uint64_t pool[kPool];
  thread_local size_t left = 0;
  uint64_t token = 0;
  while (token == 0) {
    if (left == 0) {
      const std::string bytes = RandomBytes(sizeof pool);
      std::memcpy(pool, bytes.data(), sizeof pool);
      left = kPool;
    }
    token = std::exchange(pool[--left], 0);
  }
  return token;
}

std::string_view OpName(v1::TransferOp op) { return op == v1::READ ? "READ" : "WRITE"; }

// The first memory that a caught SIGBUS broke (registry/fault_guard.h) among the local
// `regions` and the peer's regions mapped here directly that `ops` reach, as "local
// region 'x'" or "peer 'p' region 'y'"; empty when none. Atomic loads only, and none
// at all until the process caught its first fault.
std::string BrokenMemory(const std::vector<registry::RegionPtr>& regions, const PeerSnapshot& peer,
                         const std::vector<planning::PlanOp>& ops) {
  if (registry::FaultGuard::faults_caught() == 0) return "";
  for (const auto& region : regions) {
    if (region->mapping.broken()) return fmt::format("local region '{}'", region->spec.name());
  }
  const DirectMappings* direct = peer.direct.get();
  if (direct == nullptr) return "";
  uint32_t checked = UINT32_MAX;  // ops come region by region: check each slot once per run
  for (const auto& o : ops) {
    if (o.rkey_slot == checked) continue;
    checked = o.rkey_slot;
    const auto& mapping = direct->mappings[o.rkey_slot];
    if (mapping != nullptr && mapping->broken()) {
      return fmt::format("peer '{}' region '{}'", peer.name,
                         peer.catalog->regions()[o.rkey_slot].name);
    }
  }
  return "";
}
// One active message to a peer, with the authentication header every message to it
// carries (our name and the secret the peer issued us).
void SendAuthenticated(transport::Endpoint& endpoint, const std::string& from,
                       const std::string& secret, AmId id, std::string_view body,
                       transport::Completion done, bool want_reply) {
  // Built in this thread's kept storage (SendAm copies the header into its send before
  // anything it calls can come back here): no allocation per message once warm.
  thread_local wire::PeerMessageAuth auth;
  thread_local std::string header;
  auth.set_from_agent(from);
  auth.set_secret(secret);
  auth.SerializeToString(&header);
  endpoint.SendAm(Wire(id), header, body, std::move(done), want_reply);
}

}  // namespace

TransferEngine::TransferEngine(transport::UcxWorker* worker, registry::RegionRegistry* registry,
                               PeerManager* peers, NotificationQueue* notifications,
                               TransferEngineOptions options)
    : worker_(worker),
      registry_(registry),
      peers_(peers),
      notifications_(notifications),
      options_(std::move(options)),
      lanes_(options_.copy_lanes),
      live_ended_(LiveEnded(options_.max_finished)),
      ended_(options_.max_finished - live_ended_) {
  paths_[static_cast<size_t>(Route::kHostCopy)] = MakeHostCopyPath(&lanes_);
  paths_[static_cast<size_t>(Route::kDeviceCopy)] = MakeDeviceCopyPath(lanes_.lanes());
  paths_[static_cast<size_t>(Route::kUcxRma)] = MakeUcxRmaPath();
  if (options_.stager != nullptr) {
    std::shared_ptr<DataPath> staging = MakeStagingPath(options_.stager);
    for (Route r : {Route::kStagedChunks, Route::kStagedBounce, Route::kStagedRemoteRead,
                    Route::kAmWrite, Route::kAmRead}) {
      paths_[static_cast<size_t>(r)] = staging;
    }
  }
}

TransferEngine::~TransferEngine() { Stop(absl::ZeroDuration()); }

void TransferEngine::Start() {
  deadline_thread_ = std::thread([this] { DeadlineLoop(); });
}

void TransferEngine::Stop(absl::Duration grace) {
  if (stopping_.exchange(true)) return;
  {
    absl::MutexLock lock(&deadline_mu_);
    deadline_wake_ = true;
    deadline_cv_.SignalAll();
  }
  if (deadline_thread_.joinable()) deadline_thread_.join();
  absl::Time until = absl::Now() + grace;
  absl::MutexLock lock(&mu_);
  // Let running transfers finish within the grace period, then fail the rest.
  auto all_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_.empty(); };
  mu_.AwaitWithDeadline(absl::Condition(&all_done), until);
  const std::vector<TransferPtr> running(active_.begin(), active_.end());
  for (const auto& t : running) {
    Finish(*t, v1::FAILED,
           absl::UnavailableError(fmt::format("transfer '{}' was still running when agent '{}' "
                                              "shut down",
                                              t->state.transfer_id(), options_.self_name)),
           -1);
  }
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [id, t] : transfers_) {
      if (t->inflight) return false;
    }
    return true;
  };
  mu_.AwaitWithTimeout(absl::Condition(&drained), absl::Seconds(2));
}

void TransferEngine::ReleasePeers() {
  absl::MutexLock lock(&mu_);
  for (auto& [id, t] : transfers_) {
    t->chunks.clear();
    t->last_peer.reset();
  }
}

bool TransferEngine::Terminal(v1::TransferPhase phase) {
  return phase == v1::COMPLETED || phase == v1::FAILED || phase == v1::CANCELLED ||
         phase == v1::TIMED_OUT;
}

void TransferEngine::Publish(Transfer& t) {
  for (auto& [token, watcher] : t.watchers) watcher(t.state);
}

void TransferEngine::Finish(Transfer& t, v1::TransferPhase phase, absl::Status status,
                            int32_t segment) {
  if (Terminal(t.state.phase())) return;
  t.state.set_phase(phase);
  t.state.set_error_code(static_cast<int32_t>(status.code()));
  t.state.set_error_message(std::string(status.message()));
  t.state.set_failed_segment(segment);
  const uint64_t now = MonotonicMicros();
  t.state.set_latency_us(now - t.start_us);
  MarkStage(t.state, v1::STAGE_ENDED, t.start_us, now);
  if (!t.inflight) {
    SetDrained(t);
  } else {
    t.stopped_us = now;
    draining_.insert(t.state.transfer_id());
    WakeDeadlinesBy(now + uint64_t{options_.drain_timeout_ms} * 1000);
  }
  t.awaiting_ack = false;
  t.chunks.clear();
  // The record stays for queries (max_finished) with only the endpoint of its last view
  // of the peer, which its outcome and commit notices need: without the peer's catalog
  // and keys, or its memory mapped here (shm, CUDA IPC, CUDA VMM imports), or memory
  // the peer freed (its VRAM too) stays held until the record goes. Batches in flight
  // hold their own view.
  if (t.last_peer != nullptr && t.last_peer->catalog != nullptr) {
    t.last_peer = t.last_peer->endpoint_only != nullptr ? t.last_peer->endpoint_only
                                                        : EndpointOnly(*t.last_peer);
  }
  std::string().swap(t.notification);  // ended before DATA_READY: never sent
  planned_ops_ -= std::min(planned_ops_, t.planned_ops);
  t.planned_ops = 0;
  if (active_.erase(&t) > 0) {
    auto owner = active_by_owner_.find(t.state.owner());
    if (owner != active_by_owner_.end() && --owner->second == 0) active_by_owner_.erase(owner);
  }
  finished_order_.Add(t.state.transfer_id());
  if (phase == v1::COMPLETED) {
    ++completed_;
  } else {
    ++failed_;
    kLog.Info("{} {}: {}", TransferLabel(t.state), v1::TransferPhase_Name(phase),
              status.message());
  }
  Publish(t);
  if (t.metrics_path != nullptr) options_.metrics->Ended(t.state, t.metrics_path);
  std::vector<Watcher> done;
  done.swap(t.on_terminal);
  for (auto& fn : done) fn(t.state);
  done.clear();
  if (t.on_terminal.empty()) t.on_terminal.swap(done);  // its storage, for a reused record
  PruneLocked();
}

void TransferEngine::SetDrained(Transfer& t) {
  destinations_.Release(t.state.transfer_id());
  t.state.set_drained(true);
  t.state.set_drain_unknown(false);
  t.state.clear_drain_note();
  t.pinned.clear();
  // Most transfers never drain late: no id hashed for an empty set.
  if (!draining_.empty()) draining_.erase(t.state.transfer_id());
  if (!drain_waits_.empty()) WakeDeadlinesBy(0);  // a drain wait may be settled
}

absl::Status TransferEngine::NotKnown(const std::string& id) const {
  return absl::NotFoundError(fmt::format(
      "transfer '{}' is not known here (or is another client's; finished transfers are kept "
      "for the last {}); list yours with `kvagentctl transfers`",
      Printable(id, 256), options_.max_finished));
}

absl::StatusOr<TransferEngine::TransferPtr> TransferEngine::FindVisible(const std::string& id,
                                                                        const Caller& caller) const {
  auto it = transfers_.find(id);
  if (it == transfers_.end() || !caller.MayUse(it->second->state.owner())) return NotKnown(id);
  return it->second;
}

absl::StatusOr<v1::TransferState> TransferEngine::FindEndedVisible(const std::string& id,
                                                                   const Caller& caller) const {
  v1::TransferState state;
  if (!ended_.Find(id, &state) || !caller.MayUse(state.owner())) return NotKnown(id);
  return state;
}

size_t TransferEngine::LiveEnded(uint32_t max_finished) {
  // Enough that a placed transfer's acknowledgement, a drain or a watcher's last look
  // nearly always comes while its record is whole (64 transfers are in flight at once
  // in the bench); few enough that they stay in cache (256 records, ~0.4 MiB).
  constexpr size_t kLiveEnded = 256;
  return std::min<size_t>(kLiveEnded, max_finished);
}

void TransferEngine::PruneLocked() {
  finished_order_.Prune(live_ended_, [this](const std::string& id)
                                         ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = transfers_.find(id);
    if (it == transfers_.end()) return true;
    Transfer& t = *it->second;
    // Entries whose operations still drain, or that a watcher holds, stay for now.
    if (t.inflight || !t.watchers.empty()) return false;
    if (!t.awaiting_ack) {
      CompactLocked(it);
      return true;
    }
    // A placed transfer whose peer has not answered yet stays whole, parked, so that
    // its answer is recorded; the oldest parked one past the bound is kept compact.
    t.parked = true;
    parked_.push_back(id);
    while (parked_.size() > live_ended_) {
      auto oldest = transfers_.find(parked_.front());
      parked_.pop_front();
      if (oldest == transfers_.end() || !oldest->second->parked) continue;  // answered since
      oldest->second->parked = false;
      CompactLocked(oldest);
    }
    return true;
  });
}

void TransferEngine::CompactLocked(Transfers::iterator it) {
  Transfer& t = *it->second;
  if (t.inflight || !t.watchers.empty()) {
    finished_order_.Add(it->first);  // its state changes yet: a later pass takes it
    return;
  }
  // Its state is final (drained, nothing attached; a holder still queued, a Pump, only
  // sends notices), so its compact copy is its one truth from now on.
  if (ended_.capacity() > 0) {
    ended_extra_.assign(reinterpret_cast<const char*>(&t.ack_token), sizeof t.ack_token);
    ended_extra_.append(reinterpret_cast<const char*>(t.chunk_digests.data()),
                        t.chunk_digests.size() * sizeof(uint64_t));
    ended_.Add(it->first, t.state, ended_extra_);
  }
  // Only the table holds it (every other holder copied its pointer from here, under
  // this lock, or from a holder): nothing can reach it once it is erased. Every other
  // holder read and wrote it under this lock, which orders those accesses before the
  // reset below (no fence: GCC's TSan does not support atomic_thread_fence).
  if (spare_records_.size() < kSpareRecords && it->second.use_count() == 1) {
    it->second->Reset();
    spare_records_.push_back(std::move(it->second));
  }
  transfers_.erase(it);
}

TransferEngine::TransferPtr TransferEngine::EndedRecordLocked(const std::string& id) const {
  // One probe of the log, and a record allocated only for an entry found (a submit of a
  // new id, or an acknowledgement naming no transfer, allocates nothing).
  v1::TransferState state;
  std::string extra;
  if (!ended_.Find(id, &state, &extra) || extra.size() < sizeof(uint64_t)) return nullptr;
  auto t = std::make_shared<Transfer>();
  t->state = std::move(state);
  std::memcpy(&t->ack_token, extra.data(), sizeof t->ack_token);
  t->chunk_digests.resize((extra.size() - sizeof t->ack_token) / sizeof(uint64_t));
  if (!t->chunk_digests.empty()) {
    std::memcpy(t->chunk_digests.data(), extra.data() + sizeof t->ack_token,
                t->chunk_digests.size() * sizeof(uint64_t));
  }
  return t;
}

void TransferEngine::UnparkLocked(Transfers::iterator it) {
  it->second->parked = false;  // its id in parked_ is skipped when it comes to the front
  CompactLocked(it);
}

void TransferEngine::Transfer::Reset() {
  // Every field of Transfer, in order; the size check catches one added without a line
  // here (x86-64 libstdc++, the build's only target).
  static_assert(sizeof(Transfer) == 472, "a field was added to Transfer: reset it here too");
  state.Clear();  // keeps its strings' capacity and its timeline's events
  chunk_digests.clear();
  notification.clear();
  chunks.clear();
  planned_ops = 0;
  last_peer.reset();  // lets go of the peer's view (its mappings, its endpoint)
  pinned.clear();     // and of the regions
  targets.clear();
  segments = 0;
  inflight = false;
  inflight_segment = -1;
  notified = false;
  opened = false;
  late_open = false;
  late_open_bytes = 0;
  awaiting_ack = false;
  parked = false;
  ack_token = 0;
  outcome_sent = false;
  stopped_us = 0;
  staged_bytes = 0;
  start_us = 0;
  deadline_us = 0;
  watchers.clear();
  on_terminal.clear();  // the callbacks' captures go now, their vector's storage stays
  metrics_path = nullptr;
}

TransferEngine::TransferPtr TransferEngine::NewRecordLocked() {
  if (spare_records_.empty()) return std::make_shared<Transfer>();
  TransferPtr t = std::move(spare_records_.back());
  spare_records_.pop_back();
  return t;
}

absl::Status TransferEngine::AdmitLocked(const std::string& id, const std::string& owner,
                                         bool is_new, uint64_t ops) {
  const Limits* limits = options_.limits;
  if (limits == nullptr) return absl::OkStatus();
  // The text is made only for a refusal (not once per transfer admitted).
  auto what = [&] { return fmt::format("transfer '{}' for {}", Printable(id, 256), owner); };
  if (is_new) {
    constexpr std::string_view kFix = "wait for transfers to end before submitting more";
    if (!limits->Fits(Limit::kActiveTransfers, active_.size(), 1)) {
      return limits->Refuse(Limit::kActiveTransfers, what(), active_.size(), 1, kFix);
    }
    auto mine = active_by_owner_.find(owner);
    const uint64_t owned = mine == active_by_owner_.end() ? 0 : mine->second;
    if (!limits->Fits(Limit::kActiveTransfersPerOwner, owned, 1)) {
      return limits->Refuse(Limit::kActiveTransfersPerOwner, what(), owned, 1, kFix);
    }
  }
  if (limits->Fits(Limit::kPlannedOps, planned_ops_, ops)) return absl::OkStatus();
  return limits->Refuse(Limit::kPlannedOps, what(), planned_ops_, ops,
                        "wait for transfers to end, or submit large transfers in chunks as "
                        "earlier ones finish");
}

namespace {

// True when the request names a remote group or region that `catalog` lacks.
bool NamesUnknownRemote(const v1::SubmitTransferRequest& request,
                        const registry::RemoteCatalog& catalog) {
  for (const auto& segment : request.segments()) {
    if (segment.has_items() && catalog.GroupSlots(segment.items().remote_group()).empty()) return true;
    if (segment.has_bytes() && catalog.Find(segment.bytes().remote_region()) == nullptr) return true;
  }
  return false;
}

}  // namespace

absl::Status TransferEngine::Submit(const v1::SubmitTransferRequest& request,
                                    const Caller& caller, v1::TransferState* accepted,
                                    Watcher* when_terminal, bool* unknown_remote) {
  // The accepted chunk's answer, under mu_: a copy of the state when the caller wants
  // one, and its watcher of the end taken (run now if it has ended: a retry).
  auto Accept = [accepted, when_terminal](Transfer& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (accepted != nullptr) *accepted = t.state;
    if (when_terminal != nullptr && *when_terminal) {
      if (Terminal(t.state.phase())) {
        (*when_terminal)(t.state);
      } else {
        t.on_terminal.push_back(std::move(*when_terminal));
      }
    }
    return absl::OkStatus();
  };
  const std::string& id = request.transfer_id();
  if (id.empty() || id.size() > kMaxTransferIdBytes) {
    return absl::InvalidArgumentError(fmt::format(
        "transfer_id '{}' is {} bytes; give each transfer a non-empty id of at most {} bytes "
        "(the request id or bootstrap room)",
        Printable(id), id.size(), kMaxTransferIdBytes));
  }
  if (request.request_id().size() > kMaxTransferIdBytes) {
    return absl::InvalidArgumentError(fmt::format(
        "transfer '{}': request_id '{}' is {} bytes, over the limit of {}; pass the engine's "
        "request id (or leave it empty)",
        Printable(id), Printable(request.request_id()), request.request_id().size(),
        kMaxTransferIdBytes));
  }
  if (request.timeout_ms() > kMaxTimeoutMs) {
    return absl::InvalidArgumentError(fmt::format(
        "transfer '{}': timeout_ms {} is over the limit of {} (10 minutes, what a receiving "
        "agent waits for an open transfer); send a long stream in chunks or as several "
        "transfers",
        Printable(id), request.timeout_ms(), kMaxTimeoutMs));
  }
  if (request.op() != v1::WRITE && request.op() != v1::READ) {
    return absl::InvalidArgumentError(fmt::format(
        "transfer '{}': op {} is {}; use WRITE (1: push local items to the peer) or READ (2: "
        "pull the peer's items)",
        Printable(id), static_cast<int>(request.op()),
        request.op() == v1::TRANSFER_OP_UNSPECIFIED ? "not set" : "not an operation"));
  }
  if (request.notification().size() > options_.max_notification_bytes) {
    return absl::InvalidArgumentError(fmt::format(
        "transfer '{}': notification is {} bytes, over the limit of {}; send a short token and "
        "move bulk data as an AUX byte segment",
        id, request.notification().size(), options_.max_notification_bytes));
  }
  if (request.wait() && request.more_chunks()) {
    return absl::InvalidArgumentError(fmt::format(
        "transfer '{}' chunk {}: wait is set on a chunk with more_chunks=true; the transfer "
        "cannot end before its last chunk, so set wait only on the last chunk",
        id, request.chunk()));
  }
  if (!v1::CompletionPoint_IsValid(request.complete_when())) {
    return absl::InvalidArgumentError(fmt::format(
        "transfer '{}': complete_when {} is not a completion point; use "
        "COMPLETE_WHEN_ACKNOWLEDGED (0, the default) or COMPLETE_WHEN_PLACED (1)",
        Printable(id), static_cast<int>(request.complete_when())));
  }
  if (request.segments_size() == 0 && (request.chunk() == 0 || request.more_chunks())) {
    return absl::InvalidArgumentError(fmt::format(
        "transfer '{}' chunk {}: no segments; only a closing chunk (more_chunks=false after "
        "chunk 0) may be empty",
        id, request.chunk()));
  }
  const uint64_t digest = RequestDigest(request);

  // Idempotency and chunk order are checked before planning, so a retry of a chunk
  // that was accepted returns the state even if the peer changed since.
  TransferPtr existing;
  uint32_t first_segment = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = transfers_.find(id);
    if (it != transfers_.end()) {
      existing = it->second;
    } else {
      // Ended and kept compact, if at all: a record of its own, for the checks below
      // only (an ended transfer takes no chunk: each of them answers).
      existing = EndedRecordLocked(id);
    }
    if (existing != nullptr) {
      Transfer& t = *existing;
      if (!caller.MayUse(t.state.owner())) {
        return absl::AlreadyExistsError(fmt::format(
            "transfer id '{}' is in use by another client on this agent; choose another id "
            "(ids are unique per agent)",
            Printable(id, 256)));
      }
      if (request.chunk() < t.chunk_digests.size()) {
        if (t.chunk_digests[request.chunk()] == digest) return Accept(t);
        return absl::AlreadyExistsError(fmt::format(
            "transfer '{}' chunk {} was already submitted with different content; a retry must "
            "repeat the request exactly, a new transfer needs a new transfer_id",
            id, request.chunk()));
      }
      if (t.state.peer() != request.peer() || t.state.op() != request.op()) {
        return absl::AlreadyExistsError(fmt::format(
            "transfer '{}' exists with peer '{}' and op {}; chunk {} names peer '{}' and op {}; "
            "use a new transfer_id",
            id, t.state.peer(), OpName(t.state.op()), request.chunk(), request.peer(),
            OpName(request.op())));
      }
      if (Terminal(t.state.phase())) {
        return absl::FailedPreconditionError(fmt::format(
            "transfer '{}' is already {} ; chunk {} cannot be added; submit a new transfer_id",
            id, v1::TransferPhase_Name(t.state.phase()), request.chunk()));
      }
      if (t.state.last_chunk_received()) {
        return absl::FailedPreconditionError(fmt::format(
            "transfer '{}' already received its last chunk ({}); chunk {} comes after it",
            id, t.chunk_digests.size() - 1, request.chunk()));
      }
      if (request.chunk() != t.chunk_digests.size()) {
        return absl::FailedPreconditionError(fmt::format(
            "transfer '{}': chunk {} arrived but chunk {} is next; submit chunks in order",
            id, request.chunk(), t.chunk_digests.size()));
      }
      // Still chunk 0's: it changes (a staged transfer's) only after the last chunk.
      if (request.complete_when() != v1::COMPLETE_WHEN_ACKNOWLEDGED &&
          request.complete_when() != t.state.complete_when()) {
        return absl::InvalidArgumentError(fmt::format(
            "transfer '{}' chunk {}: complete_when {} differs from chunk 0's ({}); the "
            "completion point is the transfer's, set on chunk 0: leave it unset on later "
            "chunks or repeat it",
            id, request.chunk(), v1::CompletionPoint_Name(request.complete_when()),
            v1::CompletionPoint_Name(t.state.complete_when())));
      }
      first_segment = t.segments;
    } else if (request.chunk() != 0) {
      return absl::FailedPreconditionError(fmt::format(
          "transfer '{}' is not known and chunk {} is not its first; submit chunk 0 first", id,
          request.chunk()));
    }
  }

  auto peer = peers_->Get(request.peer());
  if (!peer.ok()) {
    return absl::Status(peer.status().code(),
                        fmt::format("transfer '{}': {}", id, peer.status().message()));
  }
  const uint64_t max_ops =
      options_.limits ? options_.limits->value(Limit::kOpsPerChunk) : UINT64_MAX;
  auto plan = planning::PlanTransfer(*registry_, *(*peer)->catalog, request.segments(),
                                     first_segment, request.op(), max_ops);
  if (!plan.ok()) {
    if (unknown_remote != nullptr && NamesUnknownRemote(request, *(*peer)->catalog)) {
      *unknown_remote = true;  // the caller looks again and submits again
      return plan.status();
    }
    if (plan.status().code() == absl::StatusCode::kResourceExhausted && options_.limits) {
      options_.limits->Count(Limit::kOpsPerChunk);
    }
    return absl::Status(plan.status().code(),
                        fmt::format("transfer '{}' to peer '{}': {}", id, request.peer(),
                                    plan.status().message()));
  }
  if (!caller.scheduler) {
    for (const auto& region : plan->local_regions) {
      if (region->owner == caller.principal) continue;
      return absl::PermissionDeniedError(fmt::format(
          "transfer '{}': local region '{}' belongs to {}, not to {}; a client moves only the "
          "regions it registered (the node's scheduler role may move any: --scheduler-uids)",
          Printable(id), region->spec.name(), region->owner, caller.principal));
    }
  }
  std::vector<Route> routes;
  if (absl::Status paths = RouteChunk(id, request.op(), *plan, **peer, &routes); !paths.ok()) {
    return paths;
  }
  // The last check that may refuse the chunk: no destination byte is written by two
  // transfers at once, nor twice by this one. The peer's incarnation is part of the
  // key: a restarted peer's memory is new.
  // The key in this thread's string, which keeps its storage from submit to submit;
  // the ranges (views of the catalog's names) inline: no allocation for either.
  thread_local std::string destination_key;
  planning::DestinationKeyInto(request.op(), request.peer(), (*peer)->incarnation,
                               &destination_key);
  const planning::DestinationRangeList destinations =
      planning::DestinationRanges(*plan, request.op(), *(*peer)->catalog);

  TransferPtr t;
  {
    absl::MutexLock lock(&mu_);
    if (auto known = peer_incarnation_.find(request.peer());
        known != peer_incarnation_.end() && known->second != (*peer)->incarnation) {
      return absl::UnavailableError(fmt::format(
          "transfer '{}' chunk {}: peer '{}' restarted while the chunk was planned (incarnation "
          "{:x} is gone, {:x} runs now); submit again",
          id, request.chunk(), request.peer(), (*peer)->incarnation, known->second));
    }
    auto it = transfers_.find(id);
    if (existing == nullptr) {
      if (it != transfers_.end()) {
        // Lost a race with an identical or conflicting first chunk.
        if (it->second->chunk_digests.size() > 0 && it->second->chunk_digests[0] == digest) {
          return Accept(*it->second);
        }
        return absl::AlreadyExistsError(
            fmt::format("transfer '{}' was submitted concurrently with different content", id));
      }
      // The same race, and the other submit ended since.
      if (TransferPtr ended = EndedRecordLocked(id); ended != nullptr) {
        if (!ended->chunk_digests.empty() && ended->chunk_digests[0] == digest &&
            caller.MayUse(ended->state.owner())) {
          return Accept(*ended);
        }
        return absl::AlreadyExistsError(
            fmt::format("transfer '{}' was submitted concurrently with different content", id));
      }
      if (absl::Status fits = AdmitLocked(id, caller.principal, /*is_new=*/true, plan->ops.size());
          !fits.ok()) {
        return fits;
      }
      // Claimed under the lock, after every other check: nothing below can fail.
      if (absl::Status claimed = destinations_.Claim(id, destination_key, destinations);
          !claimed.ok()) {
        return claimed;
      }
      ++active_by_owner_[caller.principal];
      t = NewRecordLocked();
      t->state.set_transfer_id(id);
      t->state.set_peer(request.peer());
      t->state.set_op(request.op());
      t->state.set_phase(v1::PENDING);
      t->state.set_failed_segment(-1);
      t->state.set_submitted_unix_us(UnixMicros());
      t->state.set_owner(caller.principal);
      t->state.set_direction(v1::OUTGOING);
      t->state.set_request_id(request.request_id());
      t->state.set_complete_when(request.complete_when());
      if (options_.metrics != nullptr) t->metrics_path = (*peer)->data_path();
      t->start_us = MonotonicMicros();
      // Room for every stage a transfer reaches (7 on success): one allocation of the
      // timeline's array instead of its growth by doubling.
      t->state.mutable_timeline()->Reserve(8);
      MarkStage(t->state, v1::STAGE_SUBMITTED, t->start_us, t->start_us);
      const uint32_t timeout_ms =
          request.timeout_ms() ? request.timeout_ms() : options_.default_timeout_ms;
      t->deadline_us = t->start_us + uint64_t{timeout_ms} * 1000;
      transfers_.emplace(id, t);
      active_.insert(t);
      WakeDeadlinesBy(t->deadline_us);
    } else {
      t = existing;
      if (it == transfers_.end() || it->second != t || Terminal(t->state.phase()) ||
          t->chunk_digests.size() != request.chunk()) {
        return absl::AbortedError(fmt::format(
            "transfer '{}' changed while chunk {} was planned (cancelled, timed out or a "
            "concurrent chunk); query it and resubmit",
            id, request.chunk()));
      }
      if (absl::Status fits = AdmitLocked(id, caller.principal, /*is_new=*/false, plan->ops.size());
          !fits.ok()) {
        return fits;
      }
      if (absl::Status claimed = destinations_.Claim(id, destination_key, destinations);
          !claimed.ok()) {
        return claimed;
      }
    }
    planned_ops_ += plan->ops.size();
    t->planned_ops += plan->ops.size();
    t->chunk_digests.push_back(digest);
    t->segments += request.segments_size();
    t->state.set_chunks(t->chunk_digests.size());
    t->state.set_bytes_total(t->state.bytes_total() + plan->bytes);
    t->state.set_items(t->state.items() + plan->items);
    t->state.set_runs(t->state.runs() + plan->ops.size());
    if (!request.more_chunks()) {
      t->state.set_last_chunk_received(true);
      t->notification = request.notification();
      MarkStage(t->state, v1::STAGE_PLANNED, t->start_us, MonotonicMicros());
    }
    t->last_peer = *peer;
    t->pinned.insert(t->pinned.end(), plan->local_regions.begin(), plan->local_regions.end());
    for (const auto& segment : request.segments()) {
      const std::string& target =
          segment.has_items() ? segment.items().remote_group() : segment.bytes().remote_region();
      if (t->targets.size() < kMaxTargets &&
          std::find(t->targets.begin(), t->targets.end(), target) == t->targets.end()) {
        t->targets.push_back(target);
      }
    }
    if (!plan->ops.empty()) t->chunks.push_back(Chunk{*std::move(plan), *peer, 0, std::move(routes), nullptr});
    Publish(*t);
    SchedulePump(t);
    return Accept(*t);
  }
}

void TransferEngine::SchedulePump(const TransferPtr& t) {
  bool post = false;
  {
    absl::MutexLock lock(&pump_mu_);
    post = pump_queue_.empty();
    pump_queue_.push_back(t);
  }
  // One closure, and one wake-up of the worker, per batch: a Pump scheduled while an
  // earlier one still waits joins it (a burst of fast path entries, or a
  // SubmitTransfers call, costs one closure, not one per transfer).
  if (post) worker_->Post([this] { PumpQueued(); });
}

void TransferEngine::PumpQueued() {
  std::vector<TransferPtr> batch;
  {
    absl::MutexLock lock(&pump_mu_);
    batch.swap(pump_queue_);
    // The Pumps scheduled meanwhile (a batch that completes inline, a submit) go into
    // storage an earlier round gave back, not into a vector grown from nothing.
    pump_queue_.swap(pump_spare_);
  }
  // One round: what the Pumps send to a peer goes as one message where it can, and
  // the data batches start after their transfers' opens went.
  Outbox outbox = TakeOutbox();
  outbox_ = &outbox;
  for (const TransferPtr& t : batch) Pump(t);
  outbox_ = nullptr;
  FlushOutbox(outbox);
  GiveBackOutbox(std::move(outbox));
  batch.clear();
  // Hand the storage back (a later round reuses it instead of allocating).
  absl::MutexLock lock(&pump_mu_);
  if (pump_spare_.capacity() < batch.capacity()) pump_spare_.swap(batch);
}

namespace {

// A PEER_TRANSFER_OPEN's timeout_ms: what is left of the transfer's deadline now.
uint32_t MsLeft(uint64_t deadline_us) {
  const uint64_t now = MonotonicMicros();
  return static_cast<uint32_t>(deadline_us > now ? (deadline_us - now) / 1000 : 0);
}

}  // namespace

void TransferEngine::LateOpen::Send() {
  if (notice == nullptr) return;
  engine.SendNotice(peer, *notice, nullptr);
  Drop();
}

void TransferEngine::LateOpen::Drop() {
  if (notice != nullptr) engine.notices_.GiveBack(std::move(notice));
}

void TransferEngine::Pump(const TransferPtr& t) {
  enum class Action { kNone, kOutcomeNotice, kNotify, kNotifyPlaced, kBatch };
  Action action = Action::kNone;
  std::shared_ptr<const PeerSnapshot> peer;
  std::vector<planning::PlanOp> ops;
  uint64_t bytes = 0;
  // Built in kept storage: a notice's strings allocate nothing once warm. Taken when
  // one is built (most Pumps build none, or one), cleared, and handed back as Pump
  // returns, after it was sent.
  std::optional<KeptMessages<v1::Notification>::Lease> notice_lease, open_lease;
  auto lease = [this](std::optional<KeptMessages<v1::Notification>::Lease>& slot) {
    slot.emplace(&notices_, notices_.TakeMessage());
    slot->get()->Clear();
    return slot->get();
  };
  v1::Notification* notice = nullptr;  // the outcome, or DATA_READY
  v1::Notification* open = nullptr;  // sent before the first batch
  v1::Notification* commit = nullptr;  // a transfer completed when placed: with DATA_READY
  v1::TransferOp op;
  Route route = Route::kUcxRma;
  // A same-host copy's open, held back while its first batch copied: it goes before
  // whatever this Pump sends, and also when this Pump sends nothing (a chunked
  // transfer waiting for its next chunk), on every way out of it below.
  LateOpen late(*this);
  {
    absl::MutexLock lock(&mu_);
    if (t->inflight) return;  // the pending flush pumps again
    op = t->state.op();
    // What every notice about the transfer carries; filled only for one that is sent
    // (most Pumps send none, or only the open).
    auto address = [&](v1::Notification& n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      n.set_from_agent(options_.self_name);
      n.set_transfer_id(t->state.transfer_id());
      n.set_sender_incarnation(options_.incarnation);
      n.set_request_id(t->state.request_id());
      n.mutable_targets()->Reserve(static_cast<int>(t->targets.size()));
      for (const auto& target : t->targets) n.add_targets(target);
    };
    // The open an earlier Pump's same-host copy left due, as it would have been made
    // then (its bytes then), its timeout from now (when it is sent).
    auto make_open = [&](v1::Notification& n, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      n.Clear();
      address(n);
      n.set_kind(v1::PEER_TRANSFER_OPEN);
      n.set_op(op);
      n.set_bytes(bytes);
    };
    if (t->late_open && t->last_peer != nullptr) {
      late.peer = t->last_peer;
      late.notice = notices_.TakeMessage();
      make_open(*late.notice, t->late_open_bytes);
      late.notice->set_timeout_ms(MsLeft(t->deadline_us));
    }
    t->late_open = false;
    if (Terminal(t->state.phase())) {
      if (!t->state.drained()) {
        SetDrained(*t);
        Publish(*t);
      }
      // Tell the peer how it ended (it completes by the commit, in OnAck), once nothing
      // of ours can still touch its memory, so its clients hear exactly one outcome,
      // even of a transfer that ended before its first operation (they may wait for it).
      if (t->state.phase() != v1::COMPLETED && !t->outcome_sent && t->last_peer) {
        t->outcome_sent = true;
        notice = lease(notice_lease);
        address(*notice);
        notice->set_kind(t->state.phase() == v1::CANCELLED   ? v1::CANCELLED_BY_PEER
                        : t->state.phase() == v1::TIMED_OUT ? v1::TRANSFER_TIMED_OUT
                                                            : v1::TRANSFER_FAILED);
        notice->set_bytes(t->state.bytes_done());
        notice->set_error_code(t->state.error_code());
        notice->set_error_message(t->state.error_message());
        peer = t->last_peer;
        action = Action::kOutcomeNotice;
      }
    } else if (t->chunks.empty()) {
      if (!t->state.last_chunk_received() || t->notified) return;
      t->notified = true;
      t->ack_token = RandomToken();
      notice = lease(notice_lease);
      address(*notice);
      // Moved, not copied: the record stays for queries after the transfer ends
      // (max_finished of them), and its payload (up to max_notification_bytes) with it.
      notice->set_payload(std::move(t->notification));
      notice->set_kind(v1::DATA_READY);
      notice->set_bytes(t->state.bytes_total());
      notice->set_ack_token(t->ack_token);
      // Every byte is in place by now; a transfer whose data was flushed before its
      // (empty) closing chunk came records the flush here.
      const uint64_t now = MonotonicMicros();
      MarkStage(t->state, v1::STAGE_DATA_FLUSHED, t->start_us, now);
      MarkStage(t->state, v1::STAGE_NOTIFICATION_SENT, t->start_us, now);
      // The peer holds this notification until it has copied these bytes in.
      if (t->staged_bytes > 0) notice->set_staged_bytes(t->staged_bytes);
      peer = t->last_peer;
      action = Action::kNotify;
      if (t->state.complete_when() == v1::COMPLETE_WHEN_PLACED) {
        if (t->staged_bytes > 0) {
          // The peer still copies staged bytes in: only its acknowledgement says they
          // are in place, so this transfer completes by it.
          t->state.set_complete_when(v1::COMPLETE_WHEN_ACKNOWLEDGED);
        } else {
          // Every byte is in place in the peer's memory (our copy returned, or UCX's
          // flush completed): COMPLETED now, and DATA_READY goes with its commit, so
          // the peer hands it to its owners as it takes it. Its acknowledgement is only
          // recorded (OnAckLocked): peer_acknowledged, or peer_note.
          Finish(*t, v1::COMPLETED, absl::OkStatus(), -1);
          ++completed_when_placed_;
          if (peer != nullptr && (peer->wire_features & kWireCommitInDataReady) != 0) {
            notice->set_committed(true);  // the peer delivers it once acknowledged
          } else {
            commit = lease(open_lease);  // no open goes with DATA_READY
            MakeCommit(*t, commit);
          }
          action = Action::kNotifyPlaced;
        }
      }
      t->inflight = true;
      // Waiting for the ack from now on: it may come back before the send completes.
      t->awaiting_ack = true;
    } else {
      Chunk& chunk = t->chunks.front();
      // Only a batch needs the peer's current view (a chunk planned earlier may name a
      // region deregistered since). Taking PeerManager's lock under ours is safe: it
      // never calls into the engine under its own.
      auto current = peers_->Get(t->state.peer());
      if (current.ok()) {
        if (absl::Status still = CheckRegionsCurrent(t->state.transfer_id(), chunk, **current);
            !still.ok()) {
          Finish(*t, v1::FAILED, still, static_cast<int32_t>(chunk.plan.ops[chunk.next_op].segment));
          SchedulePump(t);  // tells the peer
          return;
        }
      }
      peer = chunk.peer;
      std::vector<planning::PlanOp>& planned = chunk.plan.ops;
      const size_t planned_count = planned.size();
      // A batch takes consecutive ops of one route (chosen at submit), for one path.
      const size_t first = chunk.next_op;
      route = chunk.routes[first];
      size_t end = first;
      while (end < planned_count && end - first < options_.batch_ops &&
             bytes < options_.batch_bytes && chunk.routes[end] == route) {
        bytes += planned[end++].length;
      }
      if (first == 0 && end == planned_count) {
        ops = std::move(planned);  // the whole chunk in one batch (a small transfer): no copy
      } else {
        ops.assign(planned.begin() + static_cast<std::ptrdiff_t>(first),
                   planned.begin() + static_cast<std::ptrdiff_t>(end));
      }
      chunk.next_op = end;
      if (route == Route::kStagedChunks || route == Route::kAmWrite) t->staged_bytes += bytes;
      t->inflight_segment = static_cast<int32_t>(ops.front().segment);
      if (end == planned_count) {  // (its ops may have moved into the batch: not read again)
        t->planned_ops -= std::min<uint64_t>(t->planned_ops, planned_count);
        planned_ops_ -= std::min<uint64_t>(planned_ops_, planned_count);
        t->chunks.pop_front();
      }
      t->inflight = true;
      MarkStage(t->state, v1::STAGE_FIRST_POSTED, t->start_us, MonotonicMicros());
      if (t->state.phase() == v1::PENDING) {
        t->state.set_phase(v1::TRANSFERRING);
        Publish(*t);
      }
      if (!t->opened) {
        // The peer learns of the transfer before anything of it lands (it can list it,
        // and it ends it by its deadline if we never say more), except on a same-host
        // copy: there this process copies the batch itself, and the open waits for the
        // next Pump, which sends it right after the copy (with DATA_READY when this is
        // the only batch). Sent first, it would wake the peer's worker during the copy
        // and again for DATA_READY. What that costs the contract: a sender that dies
        // during its first copy leaves the peer without word of the transfer, as one
        // that dies before its first operation does (ARCHITECTURE.md, the transfer
        // contract).
        t->opened = true;
        if (route == Route::kHostCopy || route == Route::kDeviceCopy) {
          t->late_open = true;  // built and sent by the next Pump
          t->late_open_bytes = t->state.bytes_total();
        } else {
          open = lease(open_lease);
          make_open(*open, t->state.bytes_total());
          open->set_timeout_ms(MsLeft(t->deadline_us));
        }
      }
      action = Action::kBatch;
    }
  }
  // An open left due by the copy, going out with this DATA_READY to a peer that takes it
  // inside (kWireOpenInDataReady): one notice fewer for every same-host transfer. Not
  // with no time left (an open with timeout_ms 0 ends the transfer at once there; a
  // DATA_READY with 0 would not open it), nor to another view of the peer.
  if (late.notice != nullptr && (action == Action::kNotify || action == Action::kNotifyPlaced) &&
      late.peer == peer && peer != nullptr && (peer->wire_features & kWireOpenInDataReady) != 0 &&
      late.notice->timeout_ms() > 0) {
    notice->set_op(op);
    notice->set_timeout_ms(late.notice->timeout_ms());
    late.Drop();
  }
  late.Send();

  switch (action) {
    case Action::kNone:
      return;
    case Action::kOutcomeNotice:
      SendNotice(peer, *notice, nullptr);
      return;
    case Action::kNotify:
      // COMPLETED comes with the peer's TransferAck (OnAck): the data is in place there
      // and the notification queued, so a peer lost before it gives FAILED, not a
      // COMPLETED nobody received.
      SendNotice(
          peer, *notice,
          [this, t](absl::Status status) {
            {
              absl::MutexLock lock(&mu_);
              t->inflight = false;
              if (!status.ok()) {
                Finish(*t, v1::FAILED,
                       absl::UnavailableError(fmt::format(
                           "transfer '{}': the data is in place but the notification to peer "
                           "'{}' failed: {}",
                           t->state.transfer_id(), t->state.peer(), status.message())),
                       -1);
              }
            }
            SchedulePump(t);
          },
          /*want_reply=*/true);
      return;
    case Action::kNotifyPlaced:
      // COMPLETED is recorded: DATA_READY and its commit go together (one message to
      // the peer within a round), the acknowledgement still asked for and recorded.
      SendNotice(
          peer, *notice,
          [this, t](absl::Status status) {
            absl::MutexLock lock(&mu_);
            t->inflight = false;
            if (!status.ok() && t->awaiting_ack) {
              t->awaiting_ack = false;
              NotTakenLocked(*t, fmt::format("DATA_READY could not be sent: {}", status.message()));
            }
          },
          /*want_reply=*/true);
      if (commit != nullptr) SendNotice(peer, *commit, nullptr);
      return;
    case Action::kBatch:
      if (open != nullptr) SendNotice(peer, *open, nullptr);
      break;
  }

  // The batch goes to its route's path; the engine keeps only the state machine.
  auto batch = std::make_shared<DataBatch>();
  batch->transfer_id = t->state.transfer_id();
  batch->peer_name = t->state.peer();
  batch->op = op;
  batch->route = route;
  batch->ops = std::move(ops);
  batch->bytes = bytes;
  batch->peer = std::move(peer);
  if (IsStaged(route)) {
    // Staging keeps its own copy of `stopped` in its job: it holds the record.
    batch->stopped = [this, t] {
      absl::MutexLock lock(&mu_);
      return Terminal(t->state.phase());
    };
  } else {
    // The other paths poll it only before the batch's done, and the run and its done
    // hold `t` until then: a raw pointer, so the callable needs no allocation.
    batch->stopped = [this, record = t.get()] {
      absl::MutexLock lock(&mu_);
      return Terminal(record->state.phase());
    };
  }
  auto run = [this, t, batch, route] {
    paths_[static_cast<size_t>(route)]->Run(*batch, [this, t, batch](BatchOutcome outcome) {
      const int32_t first = static_cast<int32_t>(batch->ops.front().segment);
      {
        absl::MutexLock lock(&mu_);
        t->inflight = false;
        // Memory that vanished under the copies (FaultGuard caught the SIGBUS) explains
        // whatever else went wrong, and makes the bytes moved worthless.
        if (absl::Status lost = MemoryLost(*t, *batch->peer, batch->ops, first); !lost.ok()) {
          Finish(*t, v1::FAILED, lost, first);
        } else if (!outcome.status.ok()) {
          Finish(*t, v1::FAILED, LocalRegionGone(*t, outcome), outcome.failed_segment);
        } else if (!Terminal(t->state.phase())) {
          t->state.set_bytes_done(t->state.bytes_done() + batch->bytes);
          if (t->chunks.empty() && t->state.last_chunk_received()) {
            MarkStage(t->state, v1::STAGE_DATA_FLUSHED, t->start_us, MonotonicMicros());
          }
          Publish(*t);
        }
        // Else the transfer ended while this batch was posted (its peer was lost, it
        // was cancelled or timed out): its state is final as reported, and the error
        // said "N of M bytes in place, a batch still posted". Counting the batch now
        // would make a later GetTransfer contradict that answer.
      }
      // A path may complete inline; posting keeps the stack flat over many batches.
      SchedulePump(t);
    });
  };
  // Pump runs inside a round (PumpQueued): the batch starts once the round's notices,
  // this transfer's open among them, are sent.
  if (outbox_ != nullptr) {
    outbox_->runs.push_back(std::move(run));
  } else {
    run();
  }
}

absl::Status TransferEngine::LocalRegionGone(const Transfer& t, const BatchOutcome& outcome) const {
  // A path's own check (the Stager's) can see a local region deregistered a moment
  // before StopUsersOf fails the transfer: name the region, as StopUsersOf does.
  if (outcome.status.code() != absl::StatusCode::kAborted) return outcome.status;
  for (const auto& pin : t.pinned) {
    if (registry_->Find(pin->spec.name()) == pin) continue;
    return absl::AbortedError(fmt::format(
        "transfer '{}' segment {}: local region '{}' was deregistered while the transfer used "
        "it; nothing more was posted. Deregister regions only after their transfers ended "
        "(cancel them and wait for drained). The path said: {}",
        t.state.transfer_id(), outcome.failed_segment, pin->spec.name(), outcome.status.message()));
  }
  return outcome.status;
}

absl::Status TransferEngine::MemoryLost(const Transfer& t, const PeerSnapshot& peer,
                                        const std::vector<planning::PlanOp>& ops,
                                        int32_t segment) const {
  const std::string lost = BrokenMemory(t.pinned, peer, ops);
  if (lost.empty()) return absl::OkStatus();
  return absl::DataLossError(fmt::format(
      "transfer '{}' segment {}: {} is broken: {}; the bytes of this transfer are not valid. Fix: "
      "{}",
      t.state.transfer_id(), segment, lost, registry::kLostMemoryCause, registry::kLostMemoryFix));
}

absl::Status TransferEngine::CheckRegionsCurrent(const std::string& id, Chunk& chunk,
                                                 const PeerSnapshot& current) {
  // Same catalog, already checked, or another incarnation (FailPeer's business).
  if (chunk.peer->catalog == current.catalog || chunk.checked_catalog == current.catalog ||
      chunk.peer->incarnation != current.incarnation) {
    return absl::OkStatus();
  }
  const auto& planned_regions = chunk.peer->catalog->regions();
  std::vector<bool> seen(planned_regions.size(), false);
  const auto& ops = chunk.plan.ops;
  for (size_t i = chunk.next_op; i < ops.size(); ++i) {
    const uint32_t slot = ops[i].rkey_slot;
    if (seen[slot]) continue;
    seen[slot] = true;
    const registry::RemoteRegion& was = planned_regions[slot];
    const registry::RemoteRegion* now = current.catalog->Find(was.name);
    if (now == nullptr || now->base_address != was.base_address || now->length != was.length) {
      return absl::AbortedError(fmt::format(
          "transfer '{}' segment {}: peer '{}' {} region '{}' while the transfer was moving "
          "its pages; nothing more was posted to it. The peer must not release pages that a "
          "transfer still targets: cancel the transfer first (its `drained` tells when), then "
          "deregister",
          id, ops[i].segment, current.name, now == nullptr ? "deregistered" : "re-registered",
          was.name));
    }
  }
  chunk.checked_catalog = current.catalog;
  return absl::OkStatus();
}

void TransferEngine::SendNotice(const std::shared_ptr<const PeerSnapshot>& peer,
                                const v1::Notification& notice, transport::Completion done,
                                bool want_reply) {
  if (outbox_ != nullptr) {
    // Into a kept body's storage (SerializeToString clears it, keeping its capacity).
    std::string body;
    if (!outbox_->bodies.empty()) {
      body = std::move(outbox_->bodies.back());
      outbox_->bodies.pop_back();
    }
    notice.SerializeToString(&body);
    outbox_->notices.push_back(HeldNotice{peer, std::move(body), std::move(done), want_reply});
    return;
  }
  SendAuthenticated(*peer->endpoint, options_.self_name, peer->notify_secret, AmId::kNotification,
                    notice.SerializeAsString(), std::move(done), want_reply);
}

void TransferEngine::FlushOutbox(Outbox& outbox) {
  // Each endpoint's notices in the order they were made: runs of small ones as one
  // NoticeBatch (when the peer takes batches), a large one alone between them.
  // Scratch kept with the outbox's storage (TakeOutbox): no allocation per round.
  std::vector<bool>& sent = outbox.sent;
  sent.assign(outbox.notices.size(), false);
  std::vector<HeldNotice*>& batch = outbox.batch;
  batch.clear();
  for (size_t first = 0; first < outbox.notices.size(); ++first) {
    if (sent[first]) continue;
    const transport::Endpoint* endpoint = outbox.notices[first].peer->endpoint.get();
    const bool batches = (outbox.notices[first].peer->wire_features & kWireBatches) != 0;
    uint64_t bytes = 0;
    for (size_t i = first; i < outbox.notices.size(); ++i) {
      HeldNotice& held = outbox.notices[i];
      if (sent[i] || held.peer->endpoint.get() != endpoint) continue;
      sent[i] = true;
      const bool fits = batches && held.body.size() <= kMaxBatchedNoticeBytes;
      if (fits && (batch.size() == kMaxBatchEntries ||
                   bytes + held.body.size() + 8 > kMaxBatchBytes)) {
        SendBatch(batch);
        bytes = 0;
      }
      if (fits) {
        batch.push_back(&held);
        bytes += held.body.size() + 8;  // with the entry's framing
        continue;
      }
      SendBatch(batch);
      bytes = 0;
      batch.push_back(&held);
      SendBatch(batch);
    }
    SendBatch(batch);
  }
  for (HeldNotice& held : outbox.notices) {
    if (outbox.bodies.size() >= kKeptBodies) break;
    if (held.body.capacity() <= kKeptBodyBytes) outbox.bodies.push_back(std::move(held.body));
  }
  outbox.notices.clear();
  for (auto& run : outbox.runs) run();
  outbox.runs.clear();
}

void TransferEngine::SendBatch(std::vector<HeldNotice*>& notices) {
  if (notices.empty()) return;
  HeldNotice& front = *notices.front();
  if (notices.size() == 1) {
    SendAuthenticated(*front.peer->endpoint, options_.self_name, front.peer->notify_secret,
                      AmId::kNotification, front.body, std::move(front.done), front.want_reply);
    notices.clear();
    return;
  }
  // NoticeBatch's encoding (each entry field 1, a length-delimited serialized
  // Notification: the bytes a NoticeBatch of these bodies serializes to), written into
  // this thread's kept scratch instead of a message of moved bodies serialized into a
  // new string. SendAm copies it before anything it calls can come back here.
  thread_local std::string message;
  message.clear();
  bool want_reply = false;
  std::vector<transport::Completion> dones;  // one allocation, only when some wait
  const size_t waiting = static_cast<size_t>(std::count_if(
      notices.begin(), notices.end(), [](const HeldNotice* held) { return bool(held->done); }));
  if (waiting > 0) dones.reserve(waiting);
  for (HeldNotice* held : notices) {
    AppendLengthDelimited(wire::NoticeBatch::kNoticesFieldNumber, held->body, &message);
    want_reply = want_reply || held->want_reply;
    if (held->done) dones.push_back(std::move(held->done));
  }
  transport::Completion all;  // none when no notice waits for its send (opens, commits)
  if (!dones.empty()) {
    all = [dones = std::move(dones)](absl::Status status) {
      for (const auto& done : dones) done(status);
    };
  }
  SendAuthenticated(*front.peer->endpoint, options_.self_name, front.peer->notify_secret,
                    AmId::kNoticeBatch, message, std::move(all), want_reply);
  constexpr size_t kKeepBytes = 64 << 10;  // a rare larger batch's storage is let go
  if (message.capacity() > kKeepBytes) std::string().swap(message);
  notices.clear();
}

void TransferEngine::OnAuthenticatedNotice(v1::Notification& n,
                                           const transport::ReplyEndpoint& reply_ep) {
  notifications_received_.fetch_add(1);
  IncomingTransfers& incoming = *options_.incoming;
  switch (n.kind()) {
    case v1::DATA_READY:
      if (n.staged_bytes() > 0 && options_.stager != nullptr) {
        incoming.OnNotice(n, reply_ep);
        // Acknowledged once its staged bytes are in place (the Stager runs on this thread).
        options_.stager->Hold(std::move(n));
      } else {
        const bool staged = n.staged_bytes() > 0;
        incoming.OnDataReady(std::move(n), reply_ep,
                             staged ? absl::FailedPreconditionError(
                                          "staged bytes were announced, but this agent stages "
                                          "nothing")
                                    : absl::OkStatus());
      }
      // A DATA_READY without an open made its record here, with a deadline of its own.
      WakeDeadlinesBy(incoming.NextExpiry());
      return;
    case v1::CANCELLED_BY_PEER:
    case v1::TRANSFER_FAILED:
    case v1::TRANSFER_TIMED_OUT:
      if (options_.stager != nullptr) options_.stager->Forget(n);
      incoming.OnNotice(n, {});
      return;
    default:
      incoming.OnNotice(n, {});
      if (n.kind() == v1::PEER_TRANSFER_OPEN) WakeDeadlinesBy(incoming.NextExpiry());
  }
}

void TransferEngine::StagedDataInPlace(v1::Notification n, absl::Status data) {
  options_.incoming->DataInPlace(n, data);
}

void TransferEngine::OnAcks(absl::Span<const wire::TransferAck* const> acks) {
  // The commits go out together (one round), each after its COMPLETED is recorded.
  Outbox outbox = TakeOutbox();
  outbox_ = &outbox;
  const auto commit = notices_.Take();  // each serialized as it is held
  for (const wire::TransferAck* each : acks) {
    const wire::TransferAck& ack = *each;
    TransferPtr t;
    bool committed = false;
    {
      absl::MutexLock lock(&mu_);
      committed = OnAckLocked(ack, &t, commit.get());
    }
    // COMPLETED is recorded: only now may the peer's clients see DATA_READY.
    if (committed) SendNotice(t->last_peer, *commit, nullptr);
  }
  outbox_ = nullptr;
  FlushOutbox(outbox);
  GiveBackOutbox(std::move(outbox));
}

TransferEngine::Outbox TransferEngine::TakeOutbox() {
  Outbox outbox;
  outbox.notices.swap(spare_outbox_.notices);
  outbox.runs.swap(spare_outbox_.runs);
  outbox.sent.swap(spare_outbox_.sent);
  outbox.batch.swap(spare_outbox_.batch);
  outbox.bodies.swap(spare_outbox_.bodies);
  return outbox;
}

void TransferEngine::GiveBackOutbox(Outbox outbox) {
  // FlushOutbox emptied it; the storage stays for the next round (a round of 64
  // transfers would otherwise grow both vectors from nothing, several KiB each time).
  if (outbox.notices.capacity() > spare_outbox_.notices.capacity()) {
    spare_outbox_.notices.swap(outbox.notices);
  }
  if (outbox.runs.capacity() > spare_outbox_.runs.capacity()) spare_outbox_.runs.swap(outbox.runs);
  if (outbox.sent.capacity() > spare_outbox_.sent.capacity()) spare_outbox_.sent.swap(outbox.sent);
  if (outbox.batch.capacity() > spare_outbox_.batch.capacity()) {
    spare_outbox_.batch.swap(outbox.batch);
  }
  if (outbox.bodies.size() > spare_outbox_.bodies.size()) spare_outbox_.bodies.swap(outbox.bodies);
}

bool TransferEngine::OnAckLocked(const wire::TransferAck& ack, TransferPtr* found,
                                 v1::Notification* commit_out) {
  auto it = transfers_.find(ack.transfer_id());
  if (it == transfers_.end() && ack.ack_token() != 0 &&
      ack.sender_incarnation() == options_.incarnation) {
    // A late answer for a transfer that ended meanwhile (a deadline, a lost peer) and is
    // kept compact now: nothing to record, as for a whole record not awaiting it.
    if (TransferPtr ended = EndedRecordLocked(ack.transfer_id());
        ended != nullptr && ended->ack_token == ack.ack_token() &&
        ended->state.peer() == ack.from_agent()) {
      return false;
    }
  }
  // Only the receiver of our DATA_READY knows its token.
  const bool ours = it != transfers_.end() && ack.ack_token() != 0 &&
                    it->second->ack_token == ack.ack_token() &&
                    ack.sender_incarnation() == options_.incarnation &&
                    it->second->state.peer() == ack.from_agent();
  if (!ours) {
    options_.counters->dropped_peer_messages.fetch_add(1);
    LogRefusal(fmt::format("'{}' (UCX active message)", Printable(ack.from_agent())),
               "a transfer acknowledgement",
               absl::PermissionDeniedError(fmt::format(
                   "it matches no DATA_READY of ours (transfer '{}')",
                   Printable(ack.transfer_id()))));
    return false;
  }
  const TransferPtr& t = it->second;
  *found = t;
  // A late one: the transfer ended meanwhile (deadline, lost peer) and told the peer so.
  if (!t->awaiting_ack) return false;
  t->awaiting_ack = false;
  MarkStage(t->state, v1::STAGE_ACKNOWLEDGED, t->start_us, MonotonicMicros());
  if (CompletedPlaced(*t)) {
    // COMPLETED already, its commit sent with DATA_READY: the answer is only recorded.
    if (ack.error_code() != 0) {
      NotTakenLocked(*t, fmt::format("it refused the notification: {}",
                                     Printable(ack.error_message(), 1024)));
    } else {
      t->state.set_peer_acknowledged(true);
      Publish(*t);
    }
    if (t->parked) UnparkLocked(it);  // `t` is not used after: `it` may go
    return false;
  }
  if (ack.error_code() != 0) {
    Finish(*t, v1::FAILED,
           absl::Status(static_cast<absl::StatusCode>(ack.error_code()),
                        fmt::format("transfer '{}': peer '{}' {}: {}", t->state.transfer_id(),
                                    t->state.peer(),
                                    t->state.op() == v1::READ ? "refused the data it served"
                                                              : "did not take the data",
                                    Printable(ack.error_message(), 1024))),
           -1);
    t->outcome_sent = true;  // the peer ended it on its side already
    return false;
  }
  Finish(*t, v1::COMPLETED, absl::OkStatus(), -1);
  MakeCommit(*t, commit_out);
  return true;
}

void TransferEngine::MakeCommit(const Transfer& t, v1::Notification* commit) const {
  commit->Clear();  // kept storage: its strings are reused
  commit->set_from_agent(options_.self_name);
  commit->set_transfer_id(t.state.transfer_id());
  commit->set_sender_incarnation(options_.incarnation);
  commit->set_kind(v1::PEER_DATA_COMMIT);
  for (const auto& target : t.targets) commit->add_targets(target);
}

void TransferEngine::NotTakenLocked(Transfer& t, const std::string& why) {
  ++placed_not_taken_;
  t.state.set_peer_note(why);
  kLog.Warn("{} COMPLETED when placed, but peer '{}' did not take its notification: {}",
            TransferLabel(t.state), Printable(t.state.peer()), Printable(why, 1024));
  Publish(t);
}

absl::Status TransferEngine::RouteChunk(const std::string& id, v1::TransferOp op,
                                       const planning::TransferPlan& plan,
                                       const PeerSnapshot& peer, std::vector<Route>* routes) const {
  // Memory a caught fault broke stays refused until it is mapped anew: the local
  // region re-registered, or the peer's region re-registered (a new direct mapping).
  if (const std::string lost = BrokenMemory(plan.local_regions, peer, plan.ops); !lost.empty()) {
    return absl::FailedPreconditionError(fmt::format(
        "transfer '{}': {} is broken since an earlier transfer: {}; it is refused until "
        "re-registered. Fix: {}",
        id, lost, registry::kLostMemoryCause, registry::kLostMemoryFix));
  }
  ASSIGN_OR_RETURN(*routes, RouteOps(id, op, plan, peer, options_.stager != nullptr,
                                     options_.ucx_cuda));
  return absl::OkStatus();
}

absl::StatusOr<v1::TransferState> TransferEngine::Get(const std::string& transfer_id,
                                                      const Caller& caller) const {
  absl::MutexLock lock(&mu_);
  auto t = FindVisible(transfer_id, caller);
  if (!t.ok()) return FindEndedVisible(transfer_id, caller);
  return (*t)->state;
}

absl::StatusOr<v1::TransferState> TransferEngine::Cancel(const std::string& transfer_id,
                                                         const Caller& caller) {
  TransferPtr t;
  {
    absl::MutexLock lock(&mu_);
    auto found = FindVisible(transfer_id, caller);
    if (!found.ok()) return FindEndedVisible(transfer_id, caller);  // ended: its state
    t = *std::move(found);
    if (Terminal(t->state.phase())) return t->state;
    // Every byte is in place and DATA_READY is on its way: the peer may already use
    // the pages, so the transfer completes rather than telling it both things.
    if (t->notified) return t->state;
    Finish(*t, v1::CANCELLED,
           absl::CancelledError(fmt::format("transfer '{}' was cancelled", transfer_id)), -1);
  }
  SchedulePump(t);
  absl::MutexLock lock(&mu_);
  return t->state;
}

std::vector<v1::TransferState> TransferEngine::List(bool active_only, const Caller& caller) const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::TransferState> out;
  for (const auto& [id, t] : transfers_) {
    if (!caller.MayUse(t->state.owner())) continue;
    if (!active_only || !Terminal(t->state.phase())) out.push_back(t->state);
  }
  if (!active_only) {
    ended_.ForEach([&](absl::string_view, const v1::TransferState& state, absl::string_view) {
      if (caller.MayUse(state.owner())) out.push_back(state);
    });
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.submitted_unix_us() < b.submitted_unix_us();
  });
  return out;
}

int32_t TransferEngine::SegmentInProgress(const Transfer& t) {
  if (t.inflight && !t.notified) return t.inflight_segment;
  if (!t.chunks.empty()) {
    const Chunk& chunk = t.chunks.front();
    if (chunk.next_op < chunk.plan.ops.size()) {
      return static_cast<int32_t>(chunk.plan.ops[chunk.next_op].segment);
    }
  }
  return -1;
}

void TransferEngine::FailPeer(const PeerLoss& loss) {
  absl::MutexLock lock(&mu_);
  if (loss.current_incarnation != 0) peer_incarnation_[loss.name] = loss.current_incarnation;
  // Planned against the incarnation that was lost (any, when the peer stopped answering).
  auto lost_with_peer = [&](const Transfer& t) {
    return t.state.peer() == loss.name &&
           !(loss.current_incarnation != 0 && t.last_peer &&
             t.last_peer->incarnation == loss.current_incarnation);
  };
  std::vector<TransferPtr> lost;
  for (const auto& t : active_) {
    if (lost_with_peer(*t)) lost.push_back(t);
  }
  // Completed when placed, not yet answered: whether the peer took the notification
  // before it was lost is not known here. Found among the records kept whole, parked
  // ones included (a peer's loss is rare; an index of them would cost every placed
  // transfer an insert and an erase). A compact one awaits no answer any more.
  std::vector<std::string> unparked;
  for (auto& [id, t] : transfers_) {
    if (!CompletedPlaced(*t) || !t->awaiting_ack || !lost_with_peer(*t)) continue;
    t->awaiting_ack = false;
    NotTakenLocked(*t, fmt::format("the peer was lost before it answered, so whether its owners "
                                   "got the notification is unknown: {}",
                                   loss.cause.message()));
    if (t->parked) unparked.push_back(id);
  }
  for (const auto& id : unparked) {
    if (auto it = transfers_.find(id); it != transfers_.end()) UnparkLocked(it);
  }
  for (const auto& t : lost) {
    Finish(*t, v1::FAILED,
           absl::UnavailableError(fmt::format(
               "transfer '{}' ({} of {} bytes in place{}): {}", t->state.transfer_id(),
               t->state.bytes_done(), t->state.bytes_total(),
               t->awaiting_ack ? "; the peer never confirmed it received them: delivery unknown"
               : t->inflight   ? ", a batch still posted"
               : t->state.bytes_done() == t->state.bytes_total()
                   ? "; its DATA_READY was not sent yet, so the peer's owners were not told"
                   : "",
               loss.cause.message())),
           SegmentInProgress(*t));
  }
}

TransferCounters TransferEngine::counters() const {
  absl::MutexLock lock(&mu_);
  TransferCounters c;
  c.active = active_.size();
  c.planned_ops = planned_ops_;
  for (const auto& [owner, n] : active_by_owner_) {
    c.largest_owner_active = std::max(c.largest_owner_active, n);
  }
  c.completed = completed_;
  c.completed_when_placed = completed_when_placed_;
  c.placed_not_taken = placed_not_taken_;
  c.failed = failed_;
  c.notifications_received = notifications_received_.load();
  c.copy_lanes = lanes_.counters();
  c.lanes = lanes_.lanes();
  return c;
}

std::string TransferEngine::device_copy_mode() {
  return DeviceCopyMode(cuda::CudaDriver::Load().ok());
}

absl::StatusOr<uint64_t> TransferEngine::Watch(const std::string& transfer_id,
                                               const Caller& caller, Watcher watcher) {
  absl::MutexLock lock(&mu_);
  auto found = FindVisible(transfer_id, caller);
  const uint64_t token = next_token_++;
  if (!found.ok()) {
    // Ended and kept compact: its state is final, so the first call is the last.
    ASSIGN_OR_RETURN(v1::TransferState ended, FindEndedVisible(transfer_id, caller));
    watcher(ended);
    return token;
  }
  const TransferPtr& t = *found;
  watcher(t->state);
  t->watchers.emplace_back(token, std::move(watcher));
  return token;
}

absl::Status TransferEngine::WhenTerminal(const std::string& transfer_id, Watcher done) {
  absl::MutexLock lock(&mu_);
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) {
    if (v1::TransferState ended; ended_.Find(transfer_id, &ended)) {
      done(ended);
      return absl::OkStatus();
    }
    return absl::NotFoundError(fmt::format(
        "transfer '{}' is not known here (finished transfers are kept for the last {})",
        transfer_id, options_.max_finished));
  }
  Transfer& t = *it->second;
  if (Terminal(t.state.phase())) {
    done(t.state);
  } else {
    t.on_terminal.push_back(std::move(done));
  }
  return absl::OkStatus();
}

void TransferEngine::Unwatch(const std::string& transfer_id, uint64_t token) {
  absl::MutexLock lock(&mu_);
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) return;
  auto& watchers = it->second->watchers;
  watchers.erase(std::remove_if(watchers.begin(), watchers.end(),
                                [token](const auto& w) { return w.first == token; }),
                 watchers.end());
}

void TransferEngine::DeadlineLoop() {
  pthread_setname_np(pthread_self(), "deadlines");
  std::vector<std::shared_ptr<DrainWait>> ready_waits;
  while (!stopping_.load()) {
    {
      // Asleep until the earliest deadline or a wake: an idle agent does not tick.
      absl::MutexLock lock(&deadline_mu_);
      const uint64_t next = deadline_next_us_.load();
      while (!deadline_wake_ && !stopping_.load()) {
        if (next == UINT64_MAX) {
          deadline_cv_.Wait(&deadline_mu_);
          continue;
        }
        const uint64_t now = MonotonicMicros();
        if (now >= next) break;
        deadline_cv_.WaitWithTimeout(&deadline_mu_, absl::Microseconds(next - now));
      }
      deadline_wake_ = false;
      // Awake: anything added from here on wakes the next wait at once, until the
      // scan below has seen it and set when to look next.
      deadline_next_us_.store(UINT64_MAX);
    }
    uint64_t next_us = UINT64_MAX;
    std::vector<TransferPtr> expired;
    {
      absl::MutexLock lock(&mu_);
      const uint64_t now = MonotonicMicros();
      // One pass over the active transfers: the expired ones, and the earliest deadline
      // of the rest (expiring them below removes none of the rest from active_).
      for (const auto& t : active_) {
        if (now >= t->deadline_us) {
          expired.push_back(t);
        } else {
          next_us = std::min(next_us, t->deadline_us);
        }
      }
      for (const auto& t : expired) {
        const int32_t segment = t->chunks.empty()
                                    ? -1
                                    : static_cast<int32_t>(
                                          t->chunks.front().plan.ops[t->chunks.front().next_op == 0
                                                                         ? 0
                                                                         : t->chunks.front().next_op - 1]
                                              .segment);
        Finish(*t, v1::TIMED_OUT,
               absl::DeadlineExceededError(fmt::format(
                   "transfer '{}' to peer '{}' passed its deadline of {} ms with {} of {} bytes "
                   "in place{}; raise timeout_ms or --transfer-timeout-ms, or check the peer "
                   "(`kvagentctl peers`)",
                   t->state.transfer_id(), t->state.peer(),
                   (t->deadline_us - t->start_us) / 1000, t->state.bytes_done(),
                   t->state.bytes_total(),
                   t->awaiting_ack ? ", and the peer never confirmed it received them "
                                     "(delivery unknown; the peer is told it timed out)"
                   : t->state.last_chunk_received() ? ""
                                                    : " and its last chunk never submitted")),
               segment);
      }
      ExpireDrains();
      for (auto it = drain_waits_.begin(); it != drain_waits_.end();) {
        DrainWait& wait = **it;
        for (auto id = wait.ids.begin(); id != wait.ids.end();) {
          auto t = transfers_.find(*id);
          const bool settled = t == transfers_.end() || t->second->state.drained() ||
                               t->second->state.drain_unknown();
          if (settled) {
            wait.ids.erase(id++);
          } else {
            ++id;
          }
        }
        if (wait.ids.empty() || now >= wait.deadline_us) {
          ready_waits.push_back(*it);
          it = drain_waits_.erase(it);
        } else {
          ++it;
        }
      }
      next_us = std::min(next_us, NextDrainDeadlineLocked());
    }
    for (const auto& t : expired) SchedulePump(t);
    for (auto& wait : ready_waits) {
      wait->done(std::vector<std::string>(wait->ids.begin(), wait->ids.end()));
    }
    ready_waits.clear();
    options_.incoming->Expire();  // returns at once before its next expiry
    next_us = std::min(next_us, options_.incoming->NextExpiry());
    deadline_next_us_.store(next_us);
  }
}

uint64_t TransferEngine::NextDrainDeadlineLocked() const {
  uint64_t next = UINT64_MAX;
  const uint64_t drain_us = uint64_t{options_.drain_timeout_ms} * 1000;
  for (const auto& id : draining_) {
    auto found = transfers_.find(id);
    if (found != transfers_.end()) next = std::min(next, found->second->stopped_us + drain_us);
  }
  for (const auto& wait : drain_waits_) next = std::min(next, wait->deadline_us);
  return next;
}

void TransferEngine::WakeDeadlinesBy(uint64_t due_us) {
  if (due_us >= deadline_next_us_.load()) return;  // it looks by then anyway
  absl::MutexLock lock(&deadline_mu_);
  deadline_wake_ = true;
  deadline_cv_.Signal();
}

void TransferEngine::ExpireDrains() {
  if (draining_.empty()) return;
  const uint64_t now = MonotonicMicros();
  const uint64_t limit = uint64_t{options_.drain_timeout_ms} * 1000;
  for (auto it = draining_.begin(); it != draining_.end();) {
    auto found = transfers_.find(*it);
    if (found == transfers_.end() || !found->second->inflight) {
      draining_.erase(it++);
      continue;
    }
    Transfer& t = *found->second;
    if (now - t.stopped_us < limit) {
      ++it;
      continue;
    }
    // The operations went to a peer that no longer answers: nothing says whether they
    // were delivered or dropped, nor, if it resumes, whether they still will be.
    t.state.set_drain_unknown(true);
    t.state.set_drain_note(fmt::format(
        "operations posted to peer '{}' before the transfer ended were not confirmed within "
        "{} ms; if the peer resumes they may still land {} (drained turns true if they "
        "complete); reuse those pages only once the peer is gone or restarted",
        t.state.peer(), options_.drain_timeout_ms,
        t.state.op() == v1::WRITE ? "in the peer's pages" : "in this agent's pages"));
    kLog.Warn("{}: {}", TransferLabel(t.state), t.state.drain_note());
    Publish(t);
    // Bounce buffers its staged chunks' sends still hold are shared by every staged
    // transfer: written off and replaced, or staging would wait on this peer for good.
    if (options_.stager != nullptr) {
      worker_->TryPost([stager = options_.stager, id = t.state.transfer_id()] {
        stager->WriteOffTransfer(id);
      });
    }
    draining_.erase(it++);
  }
}

void TransferEngine::StopUsersOf(const std::vector<registry::RegionPtr>& regions,
                                 const std::string& who, absl::Duration timeout,
                                 std::function<void(std::vector<std::string>)> done) {
  // The Stager's index of our regions holds them too. It lets go on the worker thread
  // (the index's only user), and `done` runs there after it, however the wait ends: run
  // elsewhere, `done` raced the worker, and the caller's reply (after which the memory
  // is the engine's again) could come while the index still kept a region mapped.
  if (options_.stager != nullptr) {
    done = [worker = worker_, stager = options_.stager,
            inner = std::make_shared<std::function<void(std::vector<std::string>)>>(
                std::move(done))](std::vector<std::string> draining) {
      auto let_go = [stager, inner, draining] {
        stager->DropStaleRegions();
        (*inner)(draining);
      };
      // The worker stopped: nothing stages any more.
      if (!worker->TryPost(let_go)) (*inner)(std::move(draining));
    };
  }
  auto wait = std::make_shared<DrainWait>();
  std::vector<TransferPtr> stopped;
  // Decided under mu_: once the wait is queued, the deadline loop owns it (it erases
  // settled ids and calls `done`, which was moved into the wait).
  bool nothing_to_wait_for = false;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, t] : transfers_) {
      if (t->state.drained()) continue;
      const registry::Region* used = nullptr;
      for (const auto& pin : t->pinned) {
        for (const auto& region : regions) {
          if (pin == region) used = region.get();
        }
      }
      if (used == nullptr) continue;
      wait->ids.insert(id);
      if (Terminal(t->state.phase())) continue;  // ended already; still draining
      Finish(*t, v1::FAILED,
             absl::AbortedError(fmt::format(
                 "transfer '{}': local region '{}' was deregistered by {} while the transfer "
                 "used it; nothing more was posted. Deregister regions only after their "
                 "transfers ended (cancel them and wait for drained)",
                 id, used->spec.name(), who)),
             SegmentInProgress(*t));
      stopped.push_back(t);
    }
    nothing_to_wait_for = wait->ids.empty();
    if (!nothing_to_wait_for) {
      wait->deadline_us = MonotonicMicros() + absl::ToInt64Microseconds(timeout);
      wait->done = std::move(done);
      drain_waits_.push_back(wait);
      WakeDeadlinesBy(wait->deadline_us);
    }
  }
  for (const auto& t : stopped) SchedulePump(t);
  if (nothing_to_wait_for) done({});
}

uint32_t TransferEngine::FailTransfersTo(const std::string& name, const absl::Status& cause) {
  std::vector<TransferPtr> failed;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& t : active_) {
      if (t->state.peer() == name) failed.push_back(t);
    }
    for (const auto& t : failed) {
      Finish(*t, v1::FAILED,
             absl::Status(cause.code(), fmt::format("transfer '{}': {}", t->state.transfer_id(),
                                                    cause.message())),
             SegmentInProgress(*t));
    }
  }
  for (const auto& t : failed) SchedulePump(t);
  return static_cast<uint32_t>(failed.size());
}

}  // namespace kvagent::agent

#include "agent/agent_service.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "agent/am_ids.h"
#include "agent/doctor.h"
#include "agent/gpu/device_batch.h"
#include "agent/heap_trimmer.h"
#include "agent/status_util.h"
#include "agent/tls.h"
#include "base/cpu_list.h"
#include "base/format.h"
#include "base/log.h"
#include "client/session_wire.h"
#include "fmt/format.h"
#include "registry/fault_guard.h"
#include "registry/remote_catalog.h"
#include "transport/ucx_hardening.h"
#include "transport/ucx_tcp_guard.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("service");
constexpr log::Logger kAudit("audit");

grpc::ByteBuffer ToByteBuffer(const google::protobuf::MessageLite& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

using Reply = std::function<void(absl::Status)>;

// Parses a request gRPC handed over as bytes: INVALID_ARGUMENT with the parser's
// reason when it does not parse (gRPC's own handlers answer UNIMPLEMENTED, empty).
absl::Status ParseRequest(const grpc::ByteBuffer& bytes, std::string_view method,
                          google::protobuf::MessageLite* request) {
  std::vector<grpc::Slice> slices;
  std::string data;
  if (bytes.Dump(&slices).ok()) {
    for (const auto& slice : slices) {
      data.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    if (request->ParseFromString(data)) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(fmt::format(
      "{}: the request does not parse: {}; send a serialized {} (proto/kvagent.proto)", method,
      client::DescribeParseFailure(data, request->GetTypeName()), request->GetTypeName()));
}

// A unary call: parse, run `handler(context, &request, &response, reply)`, and on
// reply(status) serialize the response and finish.
template <typename Request, typename Response, typename Handler>
grpc::ServerUnaryReactor* RunUnary(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* in, grpc::ByteBuffer* out,
                                   std::string_view method, Handler handler) {
  auto* reactor = context->DefaultReactor();
  struct Call {
    Request request;
    Response response;
  };
  auto call = std::make_shared<Call>();
  if (absl::Status parsed = ParseRequest(*in, method, &call->request); !parsed.ok()) {
    reactor->Finish(ToGrpcStatus(parsed));
    return reactor;
  }
  auto finished = std::make_shared<std::atomic<bool>>(false);
  try {
    handler(context, &call->request, &call->response,
            Reply([reactor, out, call, finished](absl::Status status) {
              if (finished->exchange(true)) return;  // answered already (see below)
              if (status.ok()) *out = ToByteBuffer(call->response);
              reactor->Finish(ToGrpcStatus(status));
            }));
  } catch (const std::exception& e) {
    // A bug, never an answer: gRPC would turn the escaping exception into an empty
    // UNIMPLEMENTED, which names nothing. Say what failed instead.
    kLog.Error("{}: the handler threw: {}", method, e.what());
    if (!finished->exchange(true)) {
      reactor->Finish(ToGrpcStatus(absl::InternalError(fmt::format(
          "{}: internal error in the agent ({}); the call's effect is unknown: check its "
          "state (regions, transfers) and report this with the agent's log",
          method, e.what()))));
    }
  }
  return reactor;
}

// A stream whose request did not parse: it ends at once with the reason.
class RefusedStream final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit RefusedStream(const absl::Status& why) { Finish(ToGrpcStatus(why)); }
  void OnDone() override { delete this; }
};

bool TerminalPhase(v1::TransferPhase phase) {
  return phase == v1::COMPLETED || phase == v1::FAILED || phase == v1::CANCELLED ||
         phase == v1::TIMED_OUT;
}

// Counts a stream from its reactor's construction to its deletion (AgentStatus
// open_streams), so a client that vanishes mid-stream is seen to leave nothing behind.
class StreamCount {
 public:
  explicit StreamCount(std::atomic<int64_t>* count) : count_(count) { count_->fetch_add(1); }
  ~StreamCount() {
    count_->fetch_sub(1);
    NoteHeapActivity();  // what the stream held is freed: the trimmer looks soon after
  }
  StreamCount(const StreamCount&) = delete;
  StreamCount& operator=(const StreamCount&) = delete;

 private:
  std::atomic<int64_t>* count_;
};

// Streams a transfer's states until it ends; always writes the newest state.
class TransferWatchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  TransferWatchReactor(TransferEngine* engine, std::string id, std::atomic<int64_t>* streams,
                       const absl::StatusOr<Caller>& caller, StreamTable::Lease lease)
      : counted_(streams), lease_(std::move(lease)), engine_(engine), id_(std::move(id)) {
    if (!caller.ok()) {
      absl::MutexLock lock(&mu_);
      finishing_ = true;
      Finish(ToGrpcStatus(caller.status()));
      return;
    }
    auto token =
        engine_->Watch(id_, *caller, [this](const v1::TransferState& s) { OnState(s); });
    if (!token.ok()) {
      absl::MutexLock lock(&mu_);
      finishing_ = true;
      Finish(ToGrpcStatus(token.status()));
      return;
    }
    token_ = *token;
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (finishing_) {
      Finish(grpc::Status::CANCELLED);
      return;
    }
    if (!ok) {
      finishing_ = true;
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the watcher went away"));
      return;
    }
    if (TerminalPhase(current_.phase()) && !has_pending_) {
      finishing_ = true;
      Finish(grpc::Status::OK);
      return;
    }
    WriteLocked();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    if (finishing_) return;
    finishing_ = true;
    if (!writing_) Finish(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    if (token_) engine_->Unwatch(id_, token_);
    delete this;
  }

 private:
  void OnState(const v1::TransferState& state) {
    absl::MutexLock lock(&mu_);
    if (finishing_) return;
    pending_ = state;
    has_pending_ = true;
    WriteLocked();
  }
  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || !has_pending_) return;
    current_ = pending_;
    has_pending_ = false;
    writing_ = true;
    current_bytes_ = ToByteBuffer(current_);
    StartWrite(&current_bytes_);
  }

  StreamCount counted_;
  StreamTable::Lease lease_;
  TransferEngine* engine_;
  std::string id_;
  uint64_t token_ = 0;
  absl::Mutex mu_;
  v1::TransferState current_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer current_bytes_ ABSL_GUARDED_BY(mu_);
  v1::TransferState pending_ ABSL_GUARDED_BY(mu_);
  bool has_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
};

// Streams notifications as they arrive; what it took but did not write goes back
// to the queue when the client leaves. Through a subscription, the queue holds every
// one it wrote until the client acknowledges it, so nothing is handed back: the next
// attachment gets what was not acknowledged.
class NotificationWatchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  NotificationWatchReactor(NotificationQueue* queue, const v1::WatchNotificationsRequest& request,
                           std::atomic<int64_t>* streams, const absl::StatusOr<Caller>& caller,
                           StreamTable::Lease lease)
      : counted_(streams),
        lease_(std::move(lease)),
        queue_(queue),
        ids_(request.transfer_ids().begin(), request.transfer_ids().end()),
        subscribed_(!request.subscription().empty()) {
    absl::StatusOr<uint64_t> token = absl::InternalError("unset");
    if (!caller.ok()) {
      token = caller.status();
    } else {
      reader_.principal = caller->principal;
      reader_.any = caller->scheduler;
      auto offer = [this](const QueuedNotification& n) { return Offer(n); };
      token = subscribed_
                  ? queue_->Attach(SubscriptionKey{caller->durable_identity, request.subscription()},
                                   NotificationFilter{reader_, ids_}, offer)
                  : queue_->Subscribe(offer);
    }
    if (!token.ok()) {
      absl::MutexLock lock(&mu_);
      finishing_ = true;
      Finish(ToGrpcStatus(token.status()));
      return;
    }
    token_ = *token;
  }

  void OnWriteDone(bool ok) override {
    bool pull = false;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      // A failed write is not known to have reached the client: hand it back (a
      // subscription still holds it).
      if (!ok && !subscribed_) unwritten_.push_front(std::move(current_));

      if (!ok || finishing_) {
        finishing_ = true;
        Finish(grpc::Status::CANCELLED);
        return;
      }
      WriteLocked();
      // Caught up after refusing some (backlog full): take what waits in the queue.
      pull = starved_ && unwritten_.empty();
      if (pull) starved_ = false;
    }
    if (pull) queue_->OfferQueued(token_);
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    if (finishing_) return;
    finishing_ = true;
    if (!writing_) Finish(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    if (token_ != 0) queue_->Unsubscribe(token_);
    std::vector<QueuedNotification> back;
    if (!subscribed_) {
      absl::MutexLock lock(&mu_);
      back.assign(std::make_move_iterator(unwritten_.begin()),
                  std::make_move_iterator(unwritten_.end()));
    }
    if (!back.empty()) queue_->Requeue(std::move(back));
    delete this;
  }

 private:
  bool Offer(const QueuedNotification& n) {
    if (subscribed_) {
      // The queue filtered it and holds it; the subscription's cap bounds the backlog.
      absl::MutexLock lock(&mu_);
      if (!finishing_) {
        unwritten_.push_back(n);
        WriteLocked();
      }
      return true;
    }
    if (!ids_.empty() && !ids_.contains(n.notification.transfer_id())) return false;
    if (!reader_.Takes(n)) return false;
    absl::MutexLock lock(&mu_);
    // A client that does not read leaves the rest in the queue, under its limits.
    if (finishing_) return false;
    if (unwritten_.size() >= kMaxUnwritten) {
      starved_ = true;
      return false;
    }
    unwritten_.push_back(n);
    WriteLocked();
    return true;
  }
  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || unwritten_.empty()) return;
    current_ = std::move(unwritten_.front());
    unwritten_.pop_front();
    writing_ = true;
    current_bytes_ = ToByteBuffer(current_.notification);
    StartWrite(&current_bytes_);
  }

  static constexpr size_t kMaxUnwritten = 1024;
  StreamCount counted_;
  StreamTable::Lease lease_;
  NotificationQueue* queue_;
  absl::flat_hash_set<std::string> ids_;
  const bool subscribed_;
  NotificationReader reader_;
  uint64_t token_ = 0;
  absl::Mutex mu_;
  std::deque<QueuedNotification> unwritten_ ABSL_GUARDED_BY(mu_);
  QueuedNotification current_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer current_bytes_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool starved_ ABSL_GUARDED_BY(mu_) = false;  // refused one: backlog was full
};

}  // namespace

absl::StatusOr<Caller> IdentifyCaller(Door door, const ServiceDeps& deps,
                                      grpc::CallbackServerContext* context) {
  // Every call of the Agent and Peer services starts here: the heap trimmer wakes
  // after activity only (one relaxed load while it is awake).
  NoteHeapActivity();
  switch (door) {
    case Door::kLocal: {
      const auto& metadata = context->client_metadata();
      auto it = metadata.find(kSessionTokenKey);
      if (it == metadata.end()) {
        return absl::UnauthenticatedError(fmt::format(
            "the local door needs a session: attach over the session socket ({}.session), then "
            "send its token as gRPC metadata '{}'",
            deps.identity->local_socket, kSessionTokenKey));
      }
      return deps.local_door->FindToken(std::string_view(it->second.data(), it->second.size()));
    }
    case Door::kNetwork: {
      std::shared_ptr<const grpc::AuthContext> auth = context->auth_context();
      std::vector<std::string> identities =
          auth ? PeerIdentities(*auth) : std::vector<std::string>{};
      if (identities.empty()) {
        return absl::UnauthenticatedError(
            "the network door needs a client certificate from the cluster CA (mutual TLS)");
      }
      return deps.policy->NetworkCaller(identities.front());
    }
    case Door::kInsecure:
      return AccessPolicy::InsecureCaller("");
  }
  return absl::InternalError("unknown door");
}

absl::StatusOr<Caller> AgentService::Authorize(grpc::CallbackServerContext* context, Need need,
                                               std::string_view call) {
  auto caller = IdentifyCaller(door_, deps_, context);
  absl::Status status = caller.ok() ? CheckRole(*caller, need, call) : caller.status();
  if (status.ok()) return caller;
  deps_.counters->refused_calls.fetch_add(1);
  LogRefusal(caller.ok() ? caller->principal
                         : fmt::format("{} ({} door)", Printable(context->peer(), 128),
                                       DoorName(door_)),
             call, status);
  return status;
}

absl::StatusOr<StreamTable::Lease> AgentService::OpenStream(const absl::StatusOr<Caller>& caller,
                                                           std::string_view call) {
  // A refused caller gets its refusal from the reactor, as before.
  if (!caller.ok()) return StreamTable::Lease();
  auto lease = deps_.streams->Open(caller->principal, call);
  if (!lease.ok()) kLog.Warn("{}", lease.status().message());
  return lease;
}

void AgentService::HandleRegisterRegions(grpc::CallbackServerContext* context,
    const v1::RegisterRegionsRequest* request, v1::RegisterRegionsResponse* response, Reply reply) {
  if (deps_.transfer_metrics != nullptr) {
    reply = [reply, metrics = deps_.transfer_metrics](absl::Status status) {
      if (!status.ok()) metrics->RegistrationFailed(status.code());
      reply(status);
    };
  }
  auto caller = Authorize(context, Need::kEngine, "RegisterRegions");
  if (!caller.ok()) return reply(caller.status());
  std::vector<v1::RegionSpec> specs(request->regions().begin(), request->regions().end());
  registry::RegisterContext register_context;
  register_context.owner = caller->principal;
  register_context.path_policy = *deps_.path_policy;
  register_context.path_policy.required_uid = caller->uid;
  if (caller->door == Door::kLocal) {
    register_context.resolve_handle = [door = deps_.local_door,
                                       session = caller->session_id](uint64_t handle) {
      return door->ResolveHandle(session, handle);
    };
    register_context.resolve_device_handle = [door = deps_.local_door,
                                              session = caller->session_id](uint64_t handle) {
      return door->ResolveDeviceHandle(session, handle);
    };
  }
  register_context.admit = [limits = deps_.limits,
                            owner = caller->principal](const registry::RegisterUsage& u) {
    const std::string what = fmt::format("RegisterRegions: {} regions ({} bytes) for {}",
                                         u.new_regions, u.new_bytes, owner);
    absl::Status fits = limits->Check(Limit::kRegions, what, u.regions, u.new_regions,
                                      "deregister regions no longer used");
    if (fits.ok()) {
      fits = limits->Check(Limit::kRegionsPerOwner, what, u.owner_regions, u.new_regions,
                           "register fewer, larger regions (a region holds many items)");
    }
    if (fits.ok()) {
      fits = limits->Check(Limit::kRegisteredBytesPerOwner, what, u.owner_bytes, u.new_bytes,
                           "deregister regions no longer used");
    }
    if (fits.ok()) {
      fits = limits->Check(Limit::kMetadataBytes, what, u.metadata_bytes, u.new_metadata_bytes,
                           "use shorter names, groups and roles, or fewer regions");
    }
    return fits;
  };
  auto result = deps_.registry->Register(specs, request->skip_empty(), register_context);
  if (!result.ok()) return reply(result.status());
  if (deps_.push != nullptr) deps_.push->Changed();  // watching peers get the regions now
  for (const auto& region : result->regions) *response->add_regions() = region->Info();
  for (const auto& name : result->skipped) response->add_skipped(name);
  response->set_version(result->version);
  return reply(absl::OkStatus());
}

void DeregisterAndWait(const ServiceDeps& deps, const std::vector<std::string>& names,
                       const Caller& caller,
                       std::function<void(absl::StatusOr<uint64_t>, std::vector<std::string>)> done) {
  // The memory stays registered and mapped until every polling peer holds the new
  // version (a peer acknowledges it only after its operations posted under the old
  // one completed), or the wait ends: only then is it released.
  auto retired = std::make_shared<std::vector<registry::RegionPtr>>();
  auto version = deps.registry->Deregister(names, retired.get(), caller.principal, caller.scheduler);
  if (!version.ok()) {
    done(version.status(), {});
    return;
  }
  if (deps.push != nullptr) deps.push->Changed();  // watching peers drain and acknowledge
  // Our own transfers that use the regions fail first and drain, then peers must hold
  // the new version; only then may the engine reuse the memory.
  const ServiceDeps* d = &deps;
  deps.engine->StopUsersOf(
      *retired, caller.principal, absl::Milliseconds(deps.deregister_wait_ms),
      [d, version = *version, retired, done = std::move(done)](std::vector<std::string> draining) {
        for (const auto& id : draining) {
          kLog.Warn("transfer '{}' using a deregistered region had not drained within the "
                    "wait; its memory stays mapped until it does",
                    id);
        }
        d->watchers->WaitForVersion(
            version, d->deregister_wait_ms,
            [version, retired, done](std::vector<std::string> unconfirmed) {
              for (const auto& name : unconfirmed) {
                kLog.Warn("peer '{}' had not picked up the deregistration within the wait; "
                          "its late writes, if any, may reach released memory",
                          name);
              }
              retired->clear();
              done(version, std::move(unconfirmed));
            });
      });
}

void AgentService::HandleDeregisterRegions(grpc::CallbackServerContext* context,
    const v1::DeregisterRegionsRequest* request, v1::DeregisterRegionsResponse* response, Reply reply) {
  auto caller = Authorize(context, Need::kEngineOrScheduler, "DeregisterRegions");
  if (!caller.ok()) return reply(caller.status());
  std::vector<std::string> names(request->names().begin(), request->names().end());
  DeregisterAndWait(deps_, names, *caller,
                    [reply, response](absl::StatusOr<uint64_t> version,
                                        std::vector<std::string> unconfirmed) {
                      if (version.ok()) {
                        response->set_version(*version);
                        for (auto& name : unconfirmed) {
                          response->add_unconfirmed_peers(std::move(name));
                        }
                      }
                      reply(version.status());
                    });
}

void AgentService::HandleListRegions(grpc::CallbackServerContext* context,
    const v1::ListRegionsRequest* request, v1::ListRegionsResponse* response, Reply reply) {
  auto caller = Authorize(context, Need::kAny, "ListRegions");
  if (!caller.ok()) return reply(caller.status());
  for (const auto& region : deps_.registry->List()) {
    if (caller->MayUse(region->owner)) *response->add_regions() = region->Info();
  }
  response->set_version(deps_.registry->version());
  return reply(absl::OkStatus());
}

// AgentStatus.limits: each limit's value, use and refusals.
static void FillLimits(const ServiceDeps& deps, const TransferCounters& counters,
                const registry::RegistryUsage& registered, v1::AgentStatus* status) {
  std::array<uint64_t, kLimitCount> in_use{};
  auto use = [&in_use](Limit limit) -> uint64_t& { return in_use[static_cast<int>(limit)]; };
  use(Limit::kRegions) = registered.regions;
  use(Limit::kRegionsPerOwner) = registered.largest_owner_regions;
  use(Limit::kRegisteredBytesPerOwner) = registered.largest_owner_bytes;
  use(Limit::kMetadataBytes) = registered.metadata_bytes;
  if (deps.local_door != nullptr) {
    use(Limit::kAllocatedBytes) = deps.local_door->allocated_bytes();
    use(Limit::kAllocatedBytesPerOwner) = deps.local_door->largest_allocation_owner();
    use(Limit::kMemoryHandles) = deps.local_door->memory_handles();
    use(Limit::kMemoryHandlesPerSession) = deps.local_door->largest_session_handles();
  }
  use(Limit::kActiveTransfers) = counters.active;
  use(Limit::kActiveTransfersPerOwner) = counters.largest_owner_active;
  use(Limit::kPlannedOps) = counters.planned_ops;
  // In flight (held for a subscription until acknowledged) counts against the queue.
  use(Limit::kQueuedNotifications) =
      deps.notifications->queued() + deps.notifications->in_flight();
  use(Limit::kQueuedNotificationBytes) = deps.notifications->queued_bytes();
  use(Limit::kStreams) = deps.streams->open();
  use(Limit::kStreamsPerCaller) = deps.streams->largest_caller();
  use(Limit::kPendingConnects) = deps.pending_connects->load();
  use(Limit::kPeerCallers) = deps.watchers->size();
  use(Limit::kSubscriptions) = deps.notifications->subscriptions();
  use(Limit::kInFlightPerSubscription) = deps.notifications->largest_subscription();
  for (int i = 0; i < kLimitCount; ++i) {
    const Limit limit = static_cast<Limit>(i);
    const LimitInfo& info = InfoOf(limit);
    v1::LimitState* out = status->add_limits();
    out->set_name(std::string(info.name));
    out->set_flag(std::string(info.flag));
    out->set_unit(std::string(info.unit));
    out->set_value(deps.limits->value(limit));
    out->set_in_use(in_use[i]);
    out->set_refused(deps.limits->refused(limit));
  }
}


// The same-host copy paths: the host copy lanes' counters and the device copy mode.
static void FillCopyPaths(const TransferCounters& counters, v1::AgentStatus* status) {
  v1::CopyLaneStatus* lanes = status->mutable_copy_lanes();
  lanes->set_lanes(counters.lanes);
  lanes->set_batches(counters.copy_lanes.batches);
  lanes->set_split_batches(counters.copy_lanes.split_batches);
  lanes->set_bytes(counters.copy_lanes.bytes);
  lanes->set_stolen_parts(counters.copy_lanes.stolen_parts);
  lanes->set_lane_chunks(counters.copy_lanes.lane_chunks);
  const DeviceLaneCounters device = DeviceLaneTotals();
  lanes->set_device_batches(device.batches);
  lanes->set_device_split_batches(device.split_batches);
  lanes->set_device_bytes(device.bytes);
  status->set_device_copy(TransferEngine::device_copy_mode());
}

void FillAgentStatus(const ServiceDeps& deps, v1::AgentStatus* status) {
  status->set_metadata_streams(deps.watchers->streams());
  if (deps.liveness != nullptr) status->set_liveness_answered(deps.liveness->answered());
  status->set_liveness_dropped((deps.liveness != nullptr ? deps.liveness->dropped() : 0) +
                               deps.peers->liveness_dropped());
  status->set_liveness_peers_lost(deps.peers->liveness_lost());
  status->set_liveness_pings_refused(deps.peers->liveness_refused());
  const auto& id = *deps.identity;
  const auto& caps = deps.context->capabilities();
  status->set_name(id.name);
  status->set_incarnation(id.incarnation);
  status->set_listen_address(id.listen_address);
  status->set_ucx_version(caps.version);
  for (const auto& t : caps.transports) status->add_ucx_transports(t);
  static const std::string* const heap_allocator = new std::string(HeapAllocatorName());
  status->set_heap_allocator(*heap_allocator);
  if (deps.worker != nullptr) status->set_worker_cpus(FormatCpuList(deps.worker->cpus()));
  const registry::RegistryUsage registered = deps.registry->Usage();
  status->set_regions(static_cast<uint32_t>(registered.regions));
  status->set_registered_bytes(registered.bytes);
  status->set_peers(static_cast<uint32_t>(deps.peers->size()));
  const TransferCounters counters = deps.engine->counters();
  status->set_transfers_active(counters.active);
  status->set_transfers_completed(counters.completed);
  status->set_completed_when_placed(counters.completed_when_placed);
  status->set_placed_not_taken(counters.placed_not_taken);
  status->set_transfers_failed(counters.failed);
  status->set_notifications_queued(deps.notifications->queued());
  status->set_uptime_ms((MonotonicMicros() - id.start_us) / 1000);
  status->set_metadata_version(deps.registry->version());
  status->set_pid(static_cast<uint32_t>(getpid()));
  status->set_open_streams(
      static_cast<uint64_t>(std::max<int64_t>(deps.open_streams->load(), 0)));
  status->set_sessions(deps.local_door ? deps.local_door->sessions() : 0);
  if (deps.releases != nullptr) {
    const SessionReleases::Backlog releasing = deps.releases->backlog(absl::Now());
    status->set_sessions_releasing(releasing.sessions);
    status->set_oldest_release_wait_ms(
        static_cast<uint64_t>(absl::ToInt64Milliseconds(releasing.oldest_wait)));
  }
  if (deps.session_server != nullptr) {
    status->set_sessions_refused_releasing(deps.session_server->releasing_refusals());
    status->set_sessions_hello_timeouts(deps.session_server->hello_timeouts());
    status->set_sessions_refused_waiting(deps.session_server->waiting_refusals());
    status->set_sessions_refused_connecting(deps.session_server->accept_refusals());
  }
  status->set_refused_calls(deps.counters->refused_calls.load());
  // With the messages of ids no handler takes and the tagged ones (the worker drops
  // them itself), those of UCX protocols the process refuses (ucx_hardening.h), and the
  // connections to UCX's TCP port it closed unread (ucx_tcp_guard.h).
  status->set_ucx_tcp_refused_connections(transport::UcxTcpRefusedConnections());
  status->set_ucx_tcp_allowed_hosts(transport::UcxTcpAllowedHosts());
  const transport::HeldReplies held = transport::HeldRepliesNow();
  status->set_ucx_held_replies(held.held);
  status->set_ucx_held_replies_refused(held.refused);
  const transport::PeerEndpoints peer_made = transport::PeerEndpointsNow();
  status->set_ucx_peer_endpoints(peer_made.live);
  status->set_ucx_peer_endpoints_refused(peer_made.refused);
  status->set_dropped_peer_messages(deps.counters->dropped_peer_messages.load() +
                                    deps.worker->unknown_messages() +
                                    transport::UcxRefusedMessages() +
                                    transport::UcxTcpRefusedConnections());
  for (uint16_t am = 1; am <= kMaxAmId; ++am) {
    const uint64_t sent = deps.worker->am_sent(am);
    const uint64_t received = deps.worker->am_received(am);
    if (sent == 0 && received == 0) continue;
    v1::ActiveMessageCount* count = status->add_active_messages();
    count->set_id(am);
    count->set_kind(std::string(AmName(static_cast<AmId>(am))));
    count->set_sent(sent);
    count->set_received(received);
  }
  status->set_local_socket(id.local_socket);
  status->set_network_door(id.network_door);
  status->set_queued_notification_bytes(deps.notifications->queued_bytes());
  status->set_notifications_overflowed(deps.notifications->overflowed());
  status->set_memory_faults(registry::FaultGuard::faults_caught());
  deps.notifications->ExpireIdle();
  status->set_notifications_in_flight(deps.notifications->in_flight());
  status->set_subscriptions(deps.notifications->subscriptions());
  status->set_subscriptions_expired(deps.notifications->expired_subscriptions());
  if (deps.fast_path != nullptr) {
    const FastPathCounters fast = deps.fast_path->counters();
    status->set_fast_path_rings(fast.rings);
    status->set_fast_path_entries(fast.entries);
    status->set_fast_path_protocol_errors(fast.protocol_errors);
    status->set_fast_path_notifications(fast.notifications);
    status->set_fast_path_notifications_too_large(fast.notifications_too_large);
    status->set_fast_path_acks(fast.acks);
    status->set_fast_path_pending_dropped(fast.pending_dropped);
    status->set_fast_path_closed_by_request(fast.closed_by_request);
  }
  if (deps.health != nullptr) status->set_health(deps.health->Describe());
  status->set_health_address(id.health_address);
  status->set_metrics_address(id.metrics_address);
  FillCopyPaths(counters, status);
  FillLimits(deps, counters, registered, status);
}

void AgentService::HandleGetStatus(grpc::CallbackServerContext* context,
    const v1::GetStatusRequest* request, v1::AgentStatus* response, Reply reply) {
  auto caller = Authorize(context, Need::kAny, "GetStatus");
  if (!caller.ok()) return reply(caller.status());
  FillAgentStatus(deps_, response);
  response->set_caller(caller->principal);
  for (const auto& role : caller->Roles()) response->add_caller_roles(role);
  return reply(absl::OkStatus());
}

void AgentService::HandleConnectPeer(grpc::CallbackServerContext* context,
    const v1::ConnectPeerRequest* request, v1::PeerInfo* response, Reply reply) {
  auto caller = Authorize(context, Need::kEngineOrScheduler, "ConnectPeer");
  if (!caller.ok()) return reply(caller.status());
  if (request->address().empty()) {
    return reply(absl::InvalidArgumentError(
                             "ConnectPeer: address is empty; give the peer agent's unix:PATH "
                             "(same host) or HOST:PORT (its network door)"));
  }
  if (absl::Status slot = deps_.limits->TakeSlot(
          Limit::kPendingConnects, deps_.pending_connects,
          fmt::format("ConnectPeer {} for {}", Printable(request->address(), 256),
                      caller->principal),
          "retry when earlier ConnectPeer calls answered (each ends within the connect "
          "timeout)");
      !slot.ok()) {
    return reply(slot);
  }
  kAudit.Info("{} asks to connect peer at {}", caller->principal,
              Printable(request->address(), 256));
  std::string address = request->address();
  if (address.rfind(kAgentPrefix, 0) == 0) {
    absl::StatusOr<std::string> resolved = ResolveAgent(address.substr(kAgentPrefix.size()));
    if (!resolved.ok()) {
      deps_.pending_connects->fetch_sub(1);
      return reply(resolved.status());
    }
    address = *std::move(resolved);
  }
  deps_.peers->Connect(address, [reply, response, pending = deps_.pending_connects](
                                    absl::StatusOr<v1::PeerInfo> info) {
    pending->fetch_sub(1);
    if (info.ok()) *response = *std::move(info);
    reply(info.status());
  });
}

absl::StatusOr<std::string> AgentService::ResolveAgent(const std::string& name) const {
  if (deps_.directory == nullptr) {
    return absl::FailedPreconditionError(fmt::format(
        "ConnectPeer agent:{}: this agent runs without a directory; start it with --directory "
        "etcd://HOST:PORT, or give the peer's address (unix:PATH or HOST:PORT)",
        Printable(name, 128)));
  }
  absl::StatusOr<directory::AgentRecord> record = deps_.directory->Lookup(name);
  if (!record.ok()) return record.status();
  return DialAddress(*record, deps_.identity->host_id);
}

void AgentService::HandleListAgents(grpc::CallbackServerContext* context,
    const v1::ListAgentsRequest* request, v1::ListAgentsResponse* response, Reply reply) {
  auto caller = Authorize(context, Need::kAny, "ListAgents");
  if (!caller.ok()) return reply(caller.status());
  if (deps_.directory == nullptr) {
    return reply(absl::FailedPreconditionError(
        "ListAgents: this agent runs without a directory (peers are connected by address); "
        "start every agent with --directory etcd://HOST:PORT[,...] to list the fleet"));
  }
  DirectoryState state = deps_.directory->State();
  response->set_directory(state.endpoints);
  response->set_prefix(state.prefix);
  response->set_published(state.published);
  response->set_watching(state.watching);
  response->set_last_error(state.last_error);
  response->set_publishes(state.publishes);
  response->set_ignored_records(state.ignored);
  std::map<std::string, std::string> peer_states;
  for (const auto& peer : deps_.peers->List()) peer_states[peer.name()] = peer.state();
  for (const auto& record : state.agents) {
    v1::DirectoryAgent* agent = response->add_agents();
    agent->set_name(record.name());
    agent->set_address(record.address());
    agent->set_local_socket(record.local_socket());
    agent->set_host(record.host());
    agent->set_incarnation(record.incarnation());
    agent->set_metadata_version(record.metadata_version());
    agent->set_published_unix_ms(record.published_unix_ms());
    agent->set_self(record.name() == deps_.identity->name);
    if (auto it = peer_states.find(record.name()); it != peer_states.end()) {
      agent->set_peer_state(it->second);
    }
  }
  return reply(absl::OkStatus());
}

void AgentService::HandleDisconnectPeer(grpc::CallbackServerContext* context,
    const v1::DisconnectPeerRequest* request, v1::DisconnectPeerResponse* response, Reply reply) {
  auto caller = Authorize(context, Need::kScheduler, "DisconnectPeer");
  if (!caller.ok()) return reply(caller.status());
  if (absl::Status gone = deps_.peers->Disconnect(request->name()); !gone.ok()) {
    return reply(gone);
  }
  response->set_failed_transfers(deps_.engine->FailTransfersTo(
      request->name(),
      absl::UnavailableError(fmt::format("peer '{}' was disconnected by {}; submit again after "
                                         "ConnectPeer",
                                         Printable(request->name()), caller->principal))));
  kAudit.Info("{} disconnected peer '{}' ({} transfers failed)", caller->principal,
              Printable(request->name()), response->failed_transfers());
  return reply(absl::OkStatus());
}

std::vector<v1::PeerInfo> AgentService::ListPeersWithPaths() const {
  std::vector<v1::PeerInfo> peers = deps_.peers->List();
  const std::string device_copy = TransferEngine::device_copy_mode();
  for (auto& p : peers) {
    if (p.data_path() != "ucx") p.set_device_copy(device_copy);
  }
  return peers;
}

void AgentService::HandleListPeers(grpc::CallbackServerContext* context,
    const v1::ListPeersRequest* request, v1::ListPeersResponse* response, Reply reply) {
  auto caller = Authorize(context, Need::kAny, "ListPeers");
  if (!caller.ok()) return reply(caller.status());
  for (auto& info : ListPeersWithPaths()) *response->add_peers() = std::move(info);
  return reply(absl::OkStatus());
}

void SubmitTransfer(const ServiceDeps& deps, const v1::SubmitTransferRequest& request,
                    const Caller& caller, bool wait, SubmitDone done) {
  TransferEngine* engine = deps.engine;
  // Submits and, when asked to wait, answers with the final state instead. Called at
  // once (the usual case: the caller is borrowed, not copied) or after a refresh
  // (with a copy the refresh's callback owns).
  // Submits and answers `done`, unless `unknown_remote` is given and the chunk was
  // refused for naming a remote group or region the peer's catalog lacks: then `done`
  // comes back unanswered (the refusal was not counted), for a submit after a refresh.
  auto submit = [engine, &request, wait, &deps](const Caller& caller, SubmitDone done,
                                                bool* unknown_remote) -> std::optional<SubmitDone> {
    // With wait the accepted state is not wanted (the answer is the final one), so it
    // is not copied (issue 15: the fast path's last chunk).
    if (!wait) {
      v1::TransferState accepted;
      absl::Status submitted = engine->Submit(request, caller, &accepted, nullptr, unknown_remote);
      if (!submitted.ok()) {
        if (unknown_remote != nullptr && *unknown_remote) return done;
        if (deps.transfer_metrics != nullptr) deps.transfer_metrics->SubmitRefused(submitted.code());
        done(submitted, v1::TransferState::default_instance());
        return std::nullopt;
      }
      // The engine counts its outcome in the metrics when it ends.
      done(absl::OkStatus(), accepted);
      return std::nullopt;
    }
    // Answers with the final state: the engine takes the watcher as it accepts the
    // chunk, and calls it when the transfer ends (at once, under its lock, if it has:
    // a retry of a finished transfer). A refused chunk leaves it here, unmoved.
    struct AnswerAtEnd {
      SubmitDone done;
      void operator()(const v1::TransferState& s) const { done(absl::OkStatus(), s); }
    };
    TransferEngine::Watcher at_end = AnswerAtEnd{std::move(done)};
    absl::Status submitted = engine->Submit(request, caller, nullptr, &at_end, unknown_remote);
    if (!submitted.ok()) {
      SubmitDone& unanswered = at_end.target<AnswerAtEnd>()->done;
      if (unknown_remote != nullptr && *unknown_remote) return std::move(unanswered);
      if (deps.transfer_metrics != nullptr) deps.transfer_metrics->SubmitRefused(submitted.code());
      unanswered(submitted, v1::TransferState::default_instance());
    }
    return std::nullopt;
  };
  bool unknown_remote = false;
  std::optional<SubmitDone> again = submit(caller, std::move(done), &unknown_remote);
  if (!again.has_value()) return;
  // The peer may have registered it after our last poll: look again, then submit (and
  // answer whatever that gives).
  deps.peers->RefreshAsync(request.peer(),
                           [submit, caller, done = std::move(*again)](absl::Status) mutable {
                             submit(caller, std::move(done), nullptr);
                           });
}

void AgentService::HandleSubmitTransfer(grpc::CallbackServerContext* context,
    const v1::SubmitTransferRequest* request, v1::TransferState* response, Reply reply) {
  auto caller = Authorize(context, Need::kEngineOrScheduler, "SubmitTransfer");
  if (!caller.ok()) return reply(caller.status());
  agent::SubmitTransfer(deps_, *request, *caller, request->wait(),
         [reply, response](const absl::Status& refused, const v1::TransferState& state) {
           if (refused.ok()) *response = state;
           reply(refused);
         });
}

void AgentService::HandleSubmitTransfers(grpc::CallbackServerContext* context,
    const v1::SubmitTransfersRequest* request, v1::SubmitTransfersResponse* response, Reply reply) {
  auto caller = Authorize(context, Need::kEngineOrScheduler, "SubmitTransfers");
  if (!caller.ok()) return reply(caller.status());
  const int n = request->transfers_size();
  if (n == 0) {
    reply(absl::OkStatus());
    return;
  }
  for (int i = 0; i < n; ++i) response->add_results();
  // Each entry answers into its own slot; the last one to answer ends the call.
  struct Call {
    std::atomic<int> pending;
    Reply reply;
    v1::SubmitTransfersResponse* response;
  };
  auto call = std::make_shared<Call>();
  call->pending.store(n);
  call->reply = std::move(reply);
  call->response = response;
  for (int i = 0; i < n; ++i) {
    const v1::SubmitTransferRequest& entry = request->transfers(i);
    agent::SubmitTransfer(deps_, entry, *caller, request->wait() || entry.wait(),
           [call, i](const absl::Status& refused, const v1::TransferState& state) {
             v1::SubmitResult* result = call->response->mutable_results(i);
             if (refused.ok()) {
               *result->mutable_state() = state;
             } else {
               result->set_error_code(static_cast<int32_t>(refused.code()));
               result->set_error_message(std::string(refused.message()));
             }
             if (call->pending.fetch_sub(1) == 1) call->reply(absl::OkStatus());
           });
  }
}

void AgentService::HandleGetTransfer(grpc::CallbackServerContext* context,
    const v1::GetTransferRequest* request, v1::TransferState* response, Reply reply) {
  auto caller = Authorize(context, Need::kAny, "GetTransfer");
  if (!caller.ok()) return reply(caller.status());
  absl::StatusOr<v1::TransferState> state =
      request->peer().empty() ? deps_.engine->Get(request->transfer_id(), *caller)
                              : absl::NotFoundError("");
  if (!state.ok() && state.status().code() == absl::StatusCode::kNotFound) {
    auto incoming = deps_.incoming->Get(request->peer(), request->transfer_id(), *caller);
    if (incoming.ok() || !request->peer().empty()) state = std::move(incoming);
  }
  if (state.ok()) *response = *std::move(state);
  return reply(state.status());
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* AgentService::WatchTransfer(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes) {
  v1::GetTransferRequest request;
  if (absl::Status parsed = ParseRequest(*bytes, "WatchTransfer", &request); !parsed.ok()) {
    return new RefusedStream(parsed);
  }
  auto caller = Authorize(context, Need::kAny, "WatchTransfer");
  auto lease = OpenStream(caller, "WatchTransfer");
  if (!lease.ok()) return new RefusedStream(lease.status());
  return new TransferWatchReactor(deps_.engine, request.transfer_id(), deps_.open_streams, caller,
                                  *std::move(lease));
}

void AgentService::HandleListTransfers(grpc::CallbackServerContext* context,
    const v1::ListTransfersRequest* request, v1::ListTransfersResponse* response, Reply reply) {
  auto caller = Authorize(context, Need::kAny, "ListTransfers");
  if (!caller.ok()) return reply(caller.status());
  constexpr uint32_t kDefaultPage = 1000, kMaxPage = 10000;
  if (request->page_size() > kMaxPage) {
    return reply(absl::InvalidArgumentError(fmt::format(
                             "ListTransfers: page_size {} is over {}; ask for at most {} and "
                             "follow next_page_token",
                             request->page_size(), kMaxPage, kMaxPage)));
  }
  const uint32_t page = request->page_size() == 0 ? kDefaultPage : request->page_size();
  // A page starts after the (submitted time, id) its token names: stable while
  // transfers are added or pruned.
  uint64_t after_us = 0;
  std::string after_id;
  if (!request->page_token().empty()) {
    const std::string& token = request->page_token();
    const size_t colon = token.find(':');
    if (colon == std::string::npos || !absl::SimpleAtoi(token.substr(0, colon), &after_us)) {
      return reply(absl::InvalidArgumentError(fmt::format(
                               "ListTransfers: page_token '{}' is not one this agent handed out; "
                               "pass next_page_token unchanged, or none for the first page",
                               Printable(token))));
    }
    after_id = token.substr(colon + 1);
  }
  std::vector<v1::TransferState> states =
      request->incoming() ? deps_.incoming->List(request->active_only(), *caller)
                          : deps_.engine->List(request->active_only(), *caller);
  auto before = [](const v1::TransferState& a, uint64_t us, const std::string& id) {
    return a.submitted_unix_us() < us || (a.submitted_unix_us() == us && a.transfer_id() <= id);
  };
  std::sort(states.begin(), states.end(), [](const auto& a, const auto& b) {
    return a.submitted_unix_us() != b.submitted_unix_us()
               ? a.submitted_unix_us() < b.submitted_unix_us()
               : a.transfer_id() < b.transfer_id();
  });
  for (auto& state : states) {
    if (!request->page_token().empty() && before(state, after_us, after_id)) continue;
    if (static_cast<uint32_t>(response->transfers_size()) == page) {
      const auto& last = response->transfers(response->transfers_size() - 1);
      response->set_next_page_token(
          fmt::format("{}:{}", last.submitted_unix_us(), last.transfer_id()));
      break;
    }
    *response->add_transfers() = std::move(state);
  }
  return reply(absl::OkStatus());
}

void AgentService::HandleCancelTransfer(grpc::CallbackServerContext* context,
    const v1::CancelTransferRequest* request, v1::TransferState* response, Reply reply) {
  auto caller = Authorize(context, Need::kAny, "CancelTransfer");
  if (!caller.ok()) return reply(caller.status());
  auto state = deps_.engine->Cancel(request->transfer_id(), *caller);
  if (state.ok()) *response = *std::move(state);
  return reply(state.status());
}

void AgentService::HandlePollNotifications(grpc::CallbackServerContext* context,
    const v1::PollNotificationsRequest* request, v1::PollNotificationsResponse* response, Reply reply) {
  auto caller = Authorize(context, Need::kAny, "PollNotifications");
  if (!caller.ok()) return reply(caller.status());
  if (absl::Status ids = CheckFilterTransferIds("PollNotifications", request->transfer_ids_size());
      !ids.ok()) {
    return reply(ids);
  }
  absl::flat_hash_set<std::string> ids(request->transfer_ids().begin(),
                                       request->transfer_ids().end());
  NotificationReader reader{caller->principal, caller->scheduler};
  if (!request->subscription().empty()) {
    auto held = deps_.notifications->PollSubscription(
        SubscriptionKey{caller->durable_identity, request->subscription()}, request->max(),
        NotificationFilter{reader, std::move(ids)});
    if (!held.ok()) return reply(held.status());
    for (auto& n : *held) *response->add_notifications() = std::move(n);
    return reply(absl::OkStatus());
  }
  for (auto& n : deps_.notifications->Poll(request->max(), ids, reader)) {
    *response->add_notifications() = std::move(n);
  }
  return reply(absl::OkStatus());
}

void AgentService::HandleAckNotifications(grpc::CallbackServerContext* context,
    const v1::AckNotificationsRequest* request, v1::AckNotificationsResponse* response,
    Reply reply) {
  auto caller = Authorize(context, Need::kAny, "AckNotifications");
  if (!caller.ok()) return reply(caller.status());
  if (absl::Status listed = CheckAckSequences("AckNotifications", request->sequences_size());
      !listed.ok()) {
    return reply(listed);
  }
  // Only the caller's own subscription is found: the key is its durable identity.
  auto released = deps_.notifications->Ack(
      SubscriptionKey{caller->durable_identity, request->subscription()},
      request->through_sequence(),
      std::vector<uint64_t>(request->sequences().begin(), request->sequences().end()));
  if (!released.ok()) return reply(released.status());
  response->set_released(*released);
  return reply(absl::OkStatus());
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* AgentService::WatchNotifications(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes) {
  v1::WatchNotificationsRequest request;
  if (absl::Status parsed = ParseRequest(*bytes, "WatchNotifications", &request); !parsed.ok()) {
    return new RefusedStream(parsed);
  }
  auto caller = Authorize(context, Need::kAny, "WatchNotifications");
  if (absl::Status ids =
          CheckFilterTransferIds("WatchNotifications", request.transfer_ids_size());
      caller.ok() && !ids.ok()) {
    return new RefusedStream(ids);
  }
  auto lease = OpenStream(caller, "WatchNotifications");
  if (!lease.ok()) return new RefusedStream(lease.status());
  return new NotificationWatchReactor(deps_.notifications, request, deps_.open_streams, caller,
                                      *std::move(lease));
}

void AgentService::HandleDoctor(grpc::CallbackServerContext* context,
    const v1::DoctorRequest* request, v1::DoctorReport* response, Reply reply) {
  auto caller = Authorize(context, Need::kAny, "Doctor");
  if (!caller.ok()) return reply(caller.status());
  DoctorInputs inputs;
  inputs.agent = deps_.identity->name;
  inputs.ucx = &deps_.context->capabilities();
  inputs.peers = ListPeersWithPaths();
  inputs.device_copy = TransferEngine::device_copy_mode();
  *response = RunDoctor(inputs);
  return reply(absl::OkStatus());
}

absl::StatusOr<Caller> PeerService::AuthorizePeer(grpc::CallbackServerContext* context,
                                                  std::string_view call) {
  auto caller = IdentifyCaller(door_, deps_, context);
  absl::Status allowed = caller.ok() ? CheckRole(*caller, Need::kPeer, call) : caller.status();
  if (allowed.ok()) return caller;
  deps_.counters->refused_calls.fetch_add(1);
  LogRefusal(caller.ok() ? caller->principal : Printable(context->peer(), 128), call, allowed);
  return allowed;
}

namespace {
// Who polls or watches is who authenticated; on the insecure door, whoever it claims
// to be (bounded as the agent names peers are).
// The name is bound to who proved it the first time (PeerSecrets::Claim): a local
// session's uid, the certificate, or the insecure door.
absl::StatusOr<std::string> PeerIdentity(Door door, const Caller& caller,
                                         const v1::GetMetadataRequest& request,
                                         std::string_view call, PeerSecrets* secrets) {
  std::string identity = door == Door::kInsecure ? request.caller() : caller.peer_name;
  if (identity.size() > registry::CatalogLimits{}.max_name_bytes) {
    return absl::InvalidArgumentError(
        fmt::format("{}: caller name is {} bytes; agent names are at most {}", call,
                    identity.size(), registry::CatalogLimits{}.max_name_bytes));
  }
  if (identity.empty()) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: the caller names no agent; a peer agent's session carries its name (the "
        "session's client name, or on the insecure door GetMetadataRequest.caller)",
        call));
  }
  using Holder = PeerSecrets::Holder;
  const Holder holder = door == Door::kNetwork    ? Holder::kCertificate
                        : door == Door::kInsecure ? Holder::kInsecure
                        : caller.uid == geteuid() ? Holder::kOwnUid
                                                  : Holder::kOtherUid;
  absl::Status claimed = secrets->Claim(identity, holder, caller.uid);
  if (!claimed.ok()) {
    return absl::Status(claimed.code(), fmt::format("{}: {}", call, claimed.message()));
  }
  return identity;
}
}  // namespace

void ExportMetadataFor(const ServiceDeps& deps, Door door, const std::string& identity,
                       const std::string& principal, const v1::GetMetadataRequest& request,
                       v1::AgentMetadata* response) {
  const auto& id = *deps.identity;
  response->set_name(id.name);
  response->set_incarnation(id.incarnation);
  response->set_host_id(id.host_id);
  response->set_pid(static_cast<uint32_t>(getpid()));
  const uint64_t version = deps.registry->version();
  if (request.known_incarnation() == id.incarnation && request.known_version() == version) {
    response->set_version(version);  // unchanged: the caller keeps what it has
    return;
  }
  response->set_worker_address(deps.worker->address());
  response->set_notify_secret(deps.secrets->Issue(identity));
  if (deps.liveness != nullptr) {
    deps.liveness->Admit(response->notify_secret());
    response->set_liveness_address(deps.liveness->AnnounceFor(door == Door::kLocal));
  }
  response->set_wire_features(deps.wire_features);
  for (const std::string& address : deps.data_addresses) response->add_data_addresses(address);
  const bool same_host = door == Door::kLocal;
  // A caller that holds a version of this incarnation gets what changed since, when
  // the registry's change log still reaches back to it; any other the whole catalog.
  const bool delta = request.accept_delta() && request.known_incarnation() == id.incarnation &&
                     deps.registry->ExportDelta(request.known_version(), response, same_host);
  if (!delta) deps.registry->Export(response, same_host);
  // At most 20 lines a second (a peer polling for the whole catalog in a loop would
  // otherwise write one per call); the rest are counted into the next line.
  static LogBudget budget(20);
  uint64_t skipped = 0;
  if (!budget.Take(&skipped)) return;
  kAudit.Info("metadata version {} ({}{} regions{}) sent to peer '{}' ({}, {} door){}",
              response->version(), response->regions_size(), delta ? " changed" : "",
              delta ? fmt::format(", {} removed, delta from {}", response->removed_regions_size(),
                                  request.known_version())
                    : "",
              Printable(identity), principal, DoorName(door),
              skipped ? fmt::format(" ({} more sent, not logged)", skipped) : std::string());
}

namespace {
// The hosts an authorized peer's UCX may connect here from (transport/ucx_tcp_guard.h):
// where its call came from and the data addresses it announced. A peer on the local
// door is on this host, where the guard checks the connecting uid instead.
void AllowPeerHosts(Door door, const std::string& identity, const std::string& grpc_peer,
                    const v1::GetMetadataRequest& request) {
  if (door == Door::kLocal) return;
  std::vector<std::string> hosts;
  if (std::string source = transport::HostOfGrpcPeer(grpc_peer); !source.empty()) {
    hosts.push_back(std::move(source));
  }
  hosts.insert(hosts.end(), request.data_addresses().begin(), request.data_addresses().end());
  transport::AllowUcxTcpHosts(transport::UcxTcpCallerOwner(identity), hosts);
}
}  // namespace

void PeerService::HandleGetMetadata(grpc::CallbackServerContext* context,
    const v1::GetMetadataRequest* request, v1::AgentMetadata* response, Reply reply) {
  auto caller = AuthorizePeer(context, "GetMetadata");
  if (!caller.ok()) return reply(caller.status());
  auto identity = PeerIdentity(door_, *caller, *request, "GetMetadata", deps_.secrets);
  if (!identity.ok()) return reply(identity.status());
  if (absl::Status tracked = deps_.watchers->Polled(
          *identity, request->known_version(),
          request->known_incarnation() == deps_.identity->incarnation, deps_.limits);
      !tracked.ok()) {
    kLog.Warn("{}", tracked.message());
    return reply(tracked);
  }
  // After Polled: its hosts are forgotten with its entry in the watcher table.
  AllowPeerHosts(door_, *identity, context->peer(), *request);
  ExportMetadataFor(deps_, door_, *identity, caller->principal, *request, response);
  return reply(absl::OkStatus());
}

namespace {
using MetadataStreamReactor = grpc::ServerBidiReactor<v1::GetMetadataRequest, v1::AgentMetadata>;

class RefusedMetadataWatch final : public MetadataStreamReactor {
 public:
  explicit RefusedMetadataWatch(const absl::Status& why) { Finish(ToGrpcStatus(why)); }
  void OnDone() override { delete this; }
};

// One peer's WatchMetadata stream: reads its acknowledgements (recorded in
// MetadataWatchers) and writes a new view whenever the version moves past what it
// last wrote (MetadataPush wakes it). One write in flight at a time; a version that
// moves meanwhile is sent when it completes, as one delta.
//
// Counted against the watcher limits (streams per identity, --max-peer-callers) from
// the moment it is created where the door names the caller (TLS, local): a caller
// that opens streams and never writes on them holds no more than the limit. On the
// insecure door the identity comes in the first message, so it is counted then.
class MetadataWatchReactor final : public MetadataStreamReactor, public MetadataPush::Stream {
 public:
  MetadataWatchReactor(const ServiceDeps& deps, Door door, Caller caller, std::string source)
      : deps_(deps), door_(door), caller_(std::move(caller)), source_(std::move(source)) {
    if (door_ != Door::kInsecure && !Open(v1::GetMetadataRequest())) return;
    StartRead(&read_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the watcher closed its side, went away or the server stops
      absl::MutexLock lock(&mu_);
      FinishLocked(grpc::Status::OK);
      return;
    }
    const v1::GetMetadataRequest request = read_;
    if (!opened_ && !Open(request)) return;
    AllowPeerHosts(door_, identity_, source_, request);
    if (!pushed_) {
      pushed_ = true;
      deps_.push->Add(this);
    }
    const bool current_incarnation = request.known_incarnation() == deps_.identity->incarnation;
    deps_.watchers->StreamAcked(identity_, request.known_version(), current_incarnation);
    {
      absl::MutexLock lock(&mu_);
      // The first request, and one asking for the whole catalog again, reset what the
      // next write starts from; an acknowledgement only records what the peer holds.
      if (!answered_ || !request.accept_delta() || !current_incarnation) {
        basis_ = request;
        reply_now_ = true;
      }
      if (finishing_) return;
    }
    StartRead(&read_);
    Push();
  }

  void Push() override {
    absl::MutexLock lock(&mu_);
    if (finishing_) return;
    if (writing_) {
      push_again_ = true;
      return;
    }
    if (!reply_now_ && basis_.known_incarnation() == deps_.identity->incarnation &&
        basis_.known_version() == deps_.registry->version()) {
      return;  // the peer has (or is being sent) the current version
    }
    write_.Clear();
    ExportMetadataFor(deps_, door_, identity_, caller_.principal, basis_, &write_);
    basis_.set_known_version(write_.version());
    basis_.set_known_incarnation(write_.incarnation());
    basis_.set_accept_delta(true);
    reply_now_ = false;
    answered_ = true;
    writing_ = true;
    StartWrite(&write_);
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {
        FinishLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the watcher went away"));
        return;
      }
      if (finishing_) {
        Finish(finish_status_);
        return;
      }
      if (!push_again_) return;
      push_again_ = false;
    }
    Push();
  }

  void OnDone() override {
    if (pushed_) deps_.push->Remove(this);
    if (opened_) {
      deps_.watchers->StreamClosed(identity_);
      kAudit.Info("peer '{}' stopped watching this agent's metadata", Printable(identity_));
    }
    delete this;
  }

 private:
  // Counts the stream against the watcher limits under the caller's identity (from
  // the door, or from `first` on the insecure door). Refused: counted and logged, the
  // stream finished with the reason, false.
  bool Open(const v1::GetMetadataRequest& first) {
    auto identity = PeerIdentity(door_, caller_, first, "WatchMetadata", deps_.secrets);
    absl::Status opened =
        identity.ok() ? deps_.watchers->StreamOpened(*identity, deps_.limits) : identity.status();
    if (!opened.ok()) {
      deps_.counters->refused_calls.fetch_add(1);
      LogRefusal(caller_.principal, "WatchMetadata", opened);
      absl::MutexLock lock(&mu_);
      FinishLocked(ToGrpcStatus(opened));
      return false;
    }
    identity_ = *std::move(identity);
    opened_ = true;
    kAudit.Info("peer '{}' ({}, {} door) watches this agent's metadata", Printable(identity_),
                caller_.principal, DoorName(door_));
    return true;
  }

  // Finishes now, or once the write in flight completes.
  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finishing_) return;
    finishing_ = true;
    if (writing_) {
      finish_status_ = status;
      return;
    }
    Finish(status);
  }

  const ServiceDeps deps_;
  const Door door_;
  const Caller caller_;
  const std::string source_;  // the gRPC peer (its address)
  v1::GetMetadataRequest read_;  // reads are serial: only the read callback touches it
  // Counted in MetadataWatchers: at creation, or on the insecure door at the first
  // read. Both are set before any Push and only read afterwards (OnDone).
  bool opened_ = false;
  bool pushed_ = false;  // added to MetadataPush (at the first read)
  std::string identity_;
  absl::Mutex mu_;
  v1::GetMetadataRequest basis_ ABSL_GUARDED_BY(mu_);  // what the peer holds once writes land
  v1::AgentMetadata write_ ABSL_GUARDED_BY(mu_);
  bool reply_now_ ABSL_GUARDED_BY(mu_) = false;
  bool answered_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool push_again_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
};
}  // namespace

MetadataStreamReactor* PeerService::WatchMetadata(grpc::CallbackServerContext* context) {
  if (deps_.push == nullptr) {
    return new RefusedMetadataWatch(
        absl::UnimplementedError("WatchMetadata: this agent serves metadata by GetMetadata only"));
  }
  auto caller = AuthorizePeer(context, "WatchMetadata");
  if (!caller.ok()) return new RefusedMetadataWatch(caller.status());
  // Bounded by MetadataWatchers (peer identities, and streams per identity), not by
  // the engines' Watch* stream limits.
  return new MetadataWatchReactor(deps_, door_, *std::move(caller), context->peer());
}

// The raw methods gRPC calls: each parses its request (an unparseable one is
// INVALID_ARGUMENT with the parser's reason, not gRPC's empty UNIMPLEMENTED) and hands
// it to its handler.
grpc::ServerUnaryReactor* AgentService::RegisterRegions(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::RegisterRegionsRequest, v1::RegisterRegionsResponse>(context, request, response, "RegisterRegions",
                                  [this](auto... args) { HandleRegisterRegions(args...); });
}

grpc::ServerUnaryReactor* AgentService::DeregisterRegions(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::DeregisterRegionsRequest, v1::DeregisterRegionsResponse>(context, request, response, "DeregisterRegions",
                                  [this](auto... args) { HandleDeregisterRegions(args...); });
}

grpc::ServerUnaryReactor* AgentService::ListRegions(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::ListRegionsRequest, v1::ListRegionsResponse>(context, request, response, "ListRegions",
                                  [this](auto... args) { HandleListRegions(args...); });
}

grpc::ServerUnaryReactor* AgentService::GetStatus(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::GetStatusRequest, v1::AgentStatus>(context, request, response, "GetStatus",
                                  [this](auto... args) { HandleGetStatus(args...); });
}

grpc::ServerUnaryReactor* AgentService::ConnectPeer(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::ConnectPeerRequest, v1::PeerInfo>(context, request, response, "ConnectPeer",
                                  [this](auto... args) { HandleConnectPeer(args...); });
}

grpc::ServerUnaryReactor* AgentService::DisconnectPeer(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::DisconnectPeerRequest, v1::DisconnectPeerResponse>(context, request, response, "DisconnectPeer",
                                  [this](auto... args) { HandleDisconnectPeer(args...); });
}

grpc::ServerUnaryReactor* AgentService::ListPeers(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::ListPeersRequest, v1::ListPeersResponse>(context, request, response, "ListPeers",
                                  [this](auto... args) { HandleListPeers(args...); });
}

grpc::ServerUnaryReactor* AgentService::ListAgents(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::ListAgentsRequest, v1::ListAgentsResponse>(context, request, response, "ListAgents",
                                  [this](auto... args) { HandleListAgents(args...); });
}

grpc::ServerUnaryReactor* AgentService::SubmitTransfer(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::SubmitTransferRequest, v1::TransferState>(context, request, response, "SubmitTransfer",
                                  [this](auto... args) { HandleSubmitTransfer(args...); });
}

grpc::ServerUnaryReactor* AgentService::SubmitTransfers(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::SubmitTransfersRequest, v1::SubmitTransfersResponse>(context, request, response, "SubmitTransfers",
                                  [this](auto... args) { HandleSubmitTransfers(args...); });
}

grpc::ServerUnaryReactor* AgentService::GetTransfer(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::GetTransferRequest, v1::TransferState>(context, request, response, "GetTransfer",
                                  [this](auto... args) { HandleGetTransfer(args...); });
}

grpc::ServerUnaryReactor* AgentService::ListTransfers(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::ListTransfersRequest, v1::ListTransfersResponse>(context, request, response, "ListTransfers",
                                  [this](auto... args) { HandleListTransfers(args...); });
}

grpc::ServerUnaryReactor* AgentService::CancelTransfer(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::CancelTransferRequest, v1::TransferState>(context, request, response, "CancelTransfer",
                                  [this](auto... args) { HandleCancelTransfer(args...); });
}

grpc::ServerUnaryReactor* AgentService::PollNotifications(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::PollNotificationsRequest, v1::PollNotificationsResponse>(context, request, response, "PollNotifications",
                                  [this](auto... args) { HandlePollNotifications(args...); });
}

grpc::ServerUnaryReactor* AgentService::AckNotifications(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::AckNotificationsRequest, v1::AckNotificationsResponse>(context, request, response, "AckNotifications",
                                  [this](auto... args) { HandleAckNotifications(args...); });
}

grpc::ServerUnaryReactor* AgentService::Doctor(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) {
  return RunUnary<v1::DoctorRequest, v1::DoctorReport>(context, request, response, "Doctor",
                                  [this](auto... args) { HandleDoctor(args...); });
}

grpc::ServerUnaryReactor* PeerService::GetMetadata(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  return RunUnary<v1::GetMetadataRequest, v1::AgentMetadata>(
      context, request, response, "GetMetadata",
      [this](auto... args) { HandleGetMetadata(args...); });
}

}  // namespace kvagent::agent

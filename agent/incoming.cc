#include "agent/incoming.h"

#include "registry/fault_guard.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <utility>

#include "agent/status_util.h"
#include "agent/timeline.h"
#include "base/format.h"
#include "base/log.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("incoming");

bool Terminal(v1::TransferPhase phase) {
  return phase == v1::COMPLETED || phase == v1::FAILED || phase == v1::CANCELLED ||
         phase == v1::TIMED_OUT;
}
}  // namespace

IncomingTransfers::IncomingTransfers(IncomingOptions options,
                                     const registry::RegionRegistry* registry,
                                     NotificationQueue* queue, SendAck send_ack)
    : options_(std::move(options)),
      registry_(registry),
      queue_(queue),
      send_ack_(std::move(send_ack)),
      // Few: an ended incoming record takes no later change (a late notice finds it
      // ended), so it needs to stay whole only while its node is warm for reuse.
      live_ended_(std::min<size_t>(64, options_.max_finished)),
      ended_(options_.max_finished - live_ended_) {
  ended_here_.ended = true;
}

void IncomingTransfers::KeyInto(const v1::Notification& n, Key* key) {
  char hex[16];
  const auto incarnation = std::to_chars(hex, hex + sizeof hex, n.sender_incarnation(), 16);
  key->clear();
  key->reserve(n.from_agent().size() + (incarnation.ptr - hex) + n.transfer_id().size() + 2);
  key->append(n.from_agent()).push_back('\n');
  key->append(hex, incarnation.ptr).push_back('\n');
  key->append(n.transfer_id());
}

IncomingTransfers::Key IncomingTransfers::KeyOf(const v1::Notification& n) {
  Key key;
  KeyInto(n, &key);
  return key;
}

const IncomingTransfers::Key& IncomingTransfers::LookupKey(const v1::Notification& n) {
  KeyInto(n, &lookup_key_);
  return lookup_key_;
}

void IncomingTransfers::ForEachRegionOf(
    const std::string& target, absl::FunctionRef<void(const registry::Region&)> visit) const {
  if (registry_->VisitGroup(target, visit)) return;
  if (auto region = registry_->Find(target)) visit(*region);
}

absl::Status IncomingTransfers::CheckTargetsIntact(const v1::Notification& n,
                                                   v1::TransferOp op) const {
  // Nothing to look at while no fault was ever caught (the common case).
  if (registry::FaultGuard::faults_caught() == 0) return absl::OkStatus();
  std::string broken;
  for (const auto& target : n.targets()) {
    ForEachRegionOf(target, [&broken](const registry::Region& region) {
      if (broken.empty() && region.mapping.broken()) broken = region.spec.name();
    });
    if (broken.empty()) continue;
    return absl::DataLossError(fmt::format(
        "transfer '{}' from '{}': region '{}' of this agent ('{}') is broken: {}; the bytes "
        "{} there are not valid. Fix: {}",
        Printable(n.transfer_id(), 256), Printable(n.from_agent()), broken, options_.self_name,
        registry::kLostMemoryCause, op == v1::READ ? "read from" : "written",
        registry::kLostMemoryFix));
  }
  return absl::OkStatus();
}

void IncomingTransfers::OwnersOf(const v1::Notification& n,
                                 std::vector<std::string>* owners) const {
  // The vector's strings are overwritten in place, not cleared and copied again: a
  // steady stream of transfers into the same pools allocates nothing here.
  size_t count = 0;
  for (const auto& target : n.targets()) {
    ForEachRegionOf(target, [owners, &count](const registry::Region& region) {
      const auto end = owners->begin() + static_cast<std::ptrdiff_t>(count);
      if (std::find(owners->begin(), end, region.owner) != end) return;
      if (count < owners->size()) {
        (*owners)[count].assign(region.owner);
      } else {
        owners->push_back(region.owner);
      }
      ++count;
    });
  }
  owners->resize(count);
}

IncomingTransfers::Record& IncomingTransfers::AddRecordLocked(const Key& key) {
  if (spare_.empty()) return records_[key];
  auto node = std::move(spare_.back());
  spare_.pop_back();
  node.key().assign(key);
  // A new record's values; the state's strings and timeline entries and the owners'
  // vector keep their storage (Clear and clear keep it).
  Record& old = node.mapped();
  Record fresh;
  fresh.state.Swap(&old.state);
  fresh.state.Clear();
  fresh.owners.swap(old.owners);  // not cleared: FindOrMake's OwnersOf overwrites it
  old = std::move(fresh);
  return records_.insert(std::move(node)).position->second;
}

IncomingTransfers::Record* IncomingTransfers::FindOrMake(const v1::Notification& n) {
  const Key& key = LookupKey(n);
  auto it = records_.find(key);
  if (it != records_.end()) return &it->second;
  // Ended here and kept compact: whatever comes now is late (no new record, no ack).
  if (ended_.Contains(key)) return &ended_here_;
  const bool outcome = n.kind() == v1::CANCELLED_BY_PEER || n.kind() == v1::TRANSFER_FAILED ||
                       n.kind() == v1::TRANSFER_TIMED_OUT;
  // Its sender's count of open records (made at zero the first time; kept at zero).
  auto sender = senders_.find(n.from_agent());
  if (sender == senders_.end()) {
    if (senders_.size() >= kSenderEntries) {
      for (auto s = senders_.begin(); s != senders_.end();) {
        if (s->second == 0) {
          senders_.erase(s++);
        } else {
          ++s;
        }
      }
    }
    sender = senders_.emplace(n.from_agent(), 0).first;
  }
  // An outcome always gets its record (it ends at once); a new transfer only while
  // there is room, in all and in its sender's share.
  if (!outcome && (active_ >= options_.max_active ||
                   sender->second >= options_.max_active_per_sender)) {
    if (untracked_++ % 1024 == 0) {
      kLog.Warn("not tracking incoming {} from '{}': {} incoming transfers are open already, "
                "{} of them from '{}' (limits {} in all, {} per sender); its outcome still "
                "reaches its owners ({} not tracked so far)",
                TransferLabel(n.transfer_id(), n.request_id()), Printable(n.from_agent()), active_,
                sender->second, Printable(n.from_agent()), options_.max_active,
                options_.max_active_per_sender, untracked_);
    }
    return nullptr;
  }
  Record& r = AddRecordLocked(key);
  ++sender->second;
  r.sender_open = &sender->second;
  r.state.set_transfer_id(n.transfer_id());
  CountLocked(r, key);
  r.state.set_peer(n.from_agent());
  r.state.set_direction(v1::INCOMING);
  r.state.set_phase(v1::TRANSFERRING);
  r.state.set_failed_segment(-1);
  r.state.set_submitted_unix_us(UnixMicros());
  r.state.set_request_id(n.request_id());
  r.start_us = MonotonicMicros();
  // A deadline from the start: an open replaces it with its sender's; a record that no
  // open ever comes for (a DATA_READY alone, then no commit) still ends, and gives back
  // its slot and its room in the notification queue.
  r.deadline_ms = options_.unopened_timeout_ms;
  r.expires_us = r.start_us + (uint64_t{r.deadline_ms} + options_.grace_ms) * 1000;
  if (!outcome) next_expiry_us_ = std::min(next_expiry_us_, r.expires_us);
  MarkStage(r.state, v1::STAGE_SUBMITTED, r.start_us, r.start_us);
  OwnersOf(n, &r.owners);
  std::string* owner = r.state.mutable_owner();
  for (const auto& principal : r.owners) {
    if (!owner->empty()) owner->push_back(',');
    owner->append(principal);
  }
  ++active_;
  return &r;
}

void IncomingTransfers::OpenLocked(Record& r, const v1::Notification& n) {
  if (n.op() == v1::WRITE || n.op() == v1::READ) r.state.set_op(n.op());
  // The sender's deadline, up to max_peer_timeout_ms (a peer's UINT32_MAX would hold
  // the record, its slot and its reservation for 49 days), and no later than that from
  // when the transfer was first heard of (an open sent again does not push it further).
  const uint64_t now = MonotonicMicros();
  const uint64_t most_us = uint64_t{options_.max_peer_timeout_ms} * 1000;
  const uint64_t asked_us = uint64_t{n.timeout_ms()} * 1000;
  const uint64_t until = std::min(now + asked_us, r.start_us + most_us);
  r.opened = true;
  r.capped = until < now + asked_us;
  r.deadline_ms = static_cast<uint32_t>((until > now ? until - now : 0) / 1000);
  r.expires_us = until + uint64_t{options_.grace_ms} * 1000;
  next_expiry_us_ = std::min(next_expiry_us_, r.expires_us);
}

void IncomingTransfers::CommitLocked(Records::iterator it) {
  Record& r = it->second;
  if (r.ended || r.held == nullptr) return;
  // Its strings go to the notification delivered, not copied (EndLocked).
  EndLocked(it->first, r, v1::COMPLETED, v1::DATA_READY, r.held.get(), absl::OkStatus());
}

void IncomingTransfers::ClearBetweenAgents(v1::Notification& n) {
  n.clear_timeout_ms();
  n.clear_op();
  n.clear_committed();
}

void IncomingTransfers::OnNotice(const v1::Notification& n,
                                 const transport::ReplyEndpoint& reply_ep) {
  absl::MutexLock lock(&mu_);
  switch (n.kind()) {
    case v1::PEER_TRANSFER_OPEN: {
      Record* r = FindOrMake(n);
      if (r == nullptr || r->ended) return;
      OpenLocked(*r, n);
      return;
    }
    case v1::DATA_READY:
      HoldLocked(v1::Notification(n), reply_ep);
      return;
    case v1::PEER_DATA_COMMIT: {
      auto it = records_.find(LookupKey(n));
      if (it != records_.end()) CommitLocked(it);
      return;
    }
    case v1::CANCELLED_BY_PEER:
    case v1::TRANSFER_FAILED:
    case v1::TRANSFER_TIMED_OUT: {
      Record* r = FindOrMake(n);
      if (r == nullptr || r->ended) return;
      const v1::TransferPhase phase = n.kind() == v1::CANCELLED_BY_PEER    ? v1::CANCELLED
                                      : n.kind() == v1::TRANSFER_FAILED ? v1::FAILED
                                                                        : v1::TIMED_OUT;
      absl::Status why(static_cast<absl::StatusCode>(n.error_code()), n.error_message());
      if (phase == v1::CANCELLED && why.ok()) {
        why = absl::CancelledError(fmt::format("the sender '{}' cancelled it", n.from_agent()));
      }
      v1::Notification from(n);  // an outcome from the sender: rare, copied
      EndLocked(lookup_key_, *r, phase, n.kind(), &from, why);  // FindOrMake's key
      return;
    }
    default:
      kLog.Warn("ignored a notice of kind {} from '{}' (a newer agent?)", static_cast<int>(n.kind()),
                Printable(n.from_agent()));
  }
}

void IncomingTransfers::HoldLocked(v1::Notification&& n, const transport::ReplyEndpoint& reply_ep) {
  Record* r = FindOrMake(n);
  if (r == nullptr) {
    // Untracked (no room): acknowledge and deliver at once; the commit finds nothing.
    Record lone;
    OwnersOf(n, &lone.owners);
    lone.reply_ep = reply_ep;
    lone.ack_token = n.ack_token();
    // An open inside it has no record to set; delivered once acknowledged, committed or not.
    ClearBetweenAgents(n);
    Key key = KeyOf(n);
    lone.held = spare_held_.TakeMessage();
    lone.held->Swap(&n);
    records_.emplace(std::move(key), std::move(lone));
    ++active_;
    return;
  }
  // Ended already (its deadline passed here): no ack, so the sender fails too.
  if (r->ended) return;
  // A DATA_READY that also opens the transfer (kWireOpenInDataReady: a same-host copy
  // whose open was due with it): the open's op and deadline, then held as a plain
  // DATA_READY (its owners get what they got when the open came apart).
  if (n.timeout_ms() > 0) OpenLocked(*r, n);
  ClearBetweenAgents(n);  // OnDataReady read `committed`
  r->reply_ep = reply_ep;
  r->ack_token = n.ack_token();
  r->state.set_bytes_total(n.bytes());
  MarkStage(r->state, v1::STAGE_NOTIFICATION_RECEIVED, r->start_us, MonotonicMicros());
  // Swapped, not moved: `n` (the inbox's kept notice) gets the spare's strings, whose
  // storage the next parse reuses.
  if (r->held == nullptr) r->held = spare_held_.TakeMessage();
  r->held->Swap(&n);
}

void IncomingTransfers::OnDataReady(v1::Notification&& n, const transport::ReplyEndpoint& reply_ep,
                                    const absl::Status& data) {
  transport::ReplyEndpoint ack_ep;
  wire::TransferAck& ack = ack_;
  {
    absl::MutexLock lock(&mu_);
    const bool committed = n.committed();
    HoldLocked(std::move(n), reply_ep);
    // HoldLocked's lookup left the key in lookup_key_; what was held stands for `n`.
    auto it = records_.find(lookup_key_);
    if (it == records_.end() || !it->second.reply_ep) return;
    // An untracked record is delivered (and erased) by its acknowledgement.
    const bool tracked = it->second.state.direction() == v1::INCOMING;
    ack_ep = AcknowledgeLocked(it, *it->second.held, data, &ack);
    // Its sender recorded COMPLETED before it sent it (kWireCommitInDataReady): delivered
    // now, as the PEER_DATA_COMMIT it replaces would be; refused (no room, memory gone),
    // it ended FAILED above, as it does with the commit beside it.
    if (committed && tracked && ack.error_code() == 0) CommitLocked(it);
  }
  send_ack_(ack_ep, ack);
}

void IncomingTransfers::DataInPlace(const v1::Notification& n, const absl::Status& status) {
  transport::ReplyEndpoint reply_ep;
  wire::TransferAck& ack = ack_;
  {
    absl::MutexLock lock(&mu_);
    auto it = records_.find(LookupKey(n));
    if (it == records_.end() || !it->second.reply_ep) return;
    reply_ep = AcknowledgeLocked(it, n, status, &ack);
  }
  send_ack_(reply_ep, ack);
}

transport::ReplyEndpoint IncomingTransfers::AcknowledgeLocked(Records::iterator it,
                                                              const v1::Notification& n,
                                                              const absl::Status& status,
                                                              wire::TransferAck* ack_out) {
  wire::TransferAck& ack = *ack_out;
  ack.Clear();  // ack_, reused: its strings keep their storage
  Record& r = it->second;
  transport::ReplyEndpoint reply_ep = std::exchange(r.reply_ep, {});
  ack.set_from_agent(options_.self_name);
  ack.set_transfer_id(n.transfer_id());
  ack.set_sender_incarnation(n.sender_incarnation());
  ack.set_ack_token(r.ack_token);
  absl::Status outcome = status;
  // Memory that vanished under a write (caught by the fault guard) makes the data
  // invalid: the sender's transfer fails instead of being acknowledged.
  if (outcome.ok() && r.held != nullptr) outcome = CheckTargetsIntact(*r.held, r.state.op());
  // Push-back: a success whose notification this agent could not keep is refused
  // to its sender (its transfer fails with the reason), never accepted and dropped.
  if (outcome.ok() && r.held != nullptr && r.reserved_bytes == 0) {
    const uint64_t bytes = NotificationQueue::Size(*r.held);
    outcome = queue_->Reserve(
        [&] {
          return fmt::format("peer '{}': transfer '{}' into this agent", options_.self_name,
                             Printable(n.transfer_id(), 256));
        },
        bytes);
    if (outcome.ok()) r.reserved_bytes = bytes;
  }
  if (!outcome.ok()) {
    ack.set_error_code(static_cast<int32_t>(outcome.code()));
    ack.set_error_message(std::string(outcome.message()));
    if (r.state.direction() != v1::INCOMING) {
      records_.erase(it);  // untracked: only its sender learns of it
      --active_;
    } else if (!r.ended) {
      v1::Notification from(n);  // a refused success: rare, copied
      EndLocked(it->first, r, v1::FAILED, v1::TRANSFER_FAILED, &from, outcome);
    }
  } else if (r.state.direction() == v1::INCOMING) {
    MarkStage(r.state, v1::STAGE_ACKNOWLEDGED, r.start_us, MonotonicMicros());
  } else {
    // Untracked: nobody will look it up, so deliver now.
    v1::Notification out = *r.held;
    out.clear_ack_token();
    out.set_received_unix_us(UnixMicros());
    queue_->Push(QueuedNotification{std::move(out), r.owners}, r.reserved_bytes);
    records_.erase(it);
    --active_;
  }
  return reply_ep;
}

void IncomingTransfers::EndLocked(const Key& key, Record& r, v1::TransferPhase phase,
                                  v1::NotificationKind kind, v1::Notification* from,
                                  const absl::Status& status) {
  if (r.ended) return;
  r.ended = true;
  --active_;
  if (r.sender_open != nullptr) --*std::exchange(r.sender_open, nullptr);
  // Kept alive until the end (`from` may be it), then spare for the next DATA_READY.
  std::unique_ptr<v1::Notification> held = std::move(r.held);
  r.reply_ep = {};
  r.state.set_phase(phase);
  r.state.set_error_code(static_cast<int32_t>(status.code()));
  r.state.set_error_message(std::string(status.message()));
  const uint64_t now = MonotonicMicros();
  r.state.set_latency_us(now - r.start_us);
  MarkStage(r.state, v1::STAGE_ENDED, r.start_us, now);
  if (phase == v1::COMPLETED) {
    r.state.set_bytes_done(r.state.bytes_total());
    r.state.set_drained(true);
  }
  if (options_.on_ended) options_.on_ended(r.state);
  // Built in end_out_, whose storage a ring or stream taking it at once leaves here
  // for the next one (PushOrKeep).
  v1::Notification& out = end_out_.notification;
  out.Clear();
  // `from`'s strings are swapped in, not copied or moved: both sides keep their string
  // objects and the buffers go round between them (no allocation once warm).
  out.mutable_from_agent()->swap(*from->mutable_from_agent());
  out.mutable_transfer_id()->swap(*from->mutable_transfer_id());
  out.set_kind(kind);
  out.set_sender_incarnation(from->sender_incarnation());
  out.set_received_unix_us(UnixMicros());
  out.mutable_targets()->Swap(from->mutable_targets());
  if (kind == v1::DATA_READY) {
    if (!from->payload().empty()) out.mutable_payload()->swap(*from->mutable_payload());
    out.set_bytes(from->bytes());
    out.set_staged_bytes(from->staged_bytes());
  } else {
    out.set_bytes(from->bytes());
    out.set_error_code(static_cast<int32_t>(status.code()));
    out.set_error_message(std::string(status.message()));
  }
  // The owners as they were when the transfer began; the targets' owners now, when it
  // was never opened here.
  end_out_.owners = r.owners;
  if (end_out_.owners.empty()) OwnersOf(out, &end_out_.owners);
  queue_->PushOrKeep(end_out_, std::exchange(r.reserved_bytes, 0));
  // Into the ring of ended keys: the slot past the newest (its string reused), else a
  // new slot while the ring is still growing (the oldest is then at the front).
  if (ended_count_ < ended_keys_.size()) {
    ended_keys_[(ended_head_ + ended_count_) % ended_keys_.size()].assign(key);
  } else {
    std::rotate(ended_keys_.begin(), ended_keys_.begin() + ended_head_, ended_keys_.end());
    ended_head_ = 0;
    ended_keys_.push_back(key);
  }
  ++ended_count_;
  PruneLocked();
  spare_held_.GiveBack(std::move(held));
}

void IncomingTransfers::Expire() {
  const uint64_t now = MonotonicMicros();
  absl::MutexLock lock(&mu_);
  if (now < next_expiry_us_) return;
  next_expiry_us_ = UINT64_MAX;
  if (active_ == 0) return;
  for (auto& [key, r] : records_) {
    if (r.ended || r.expires_us == 0) continue;
    if (now < r.expires_us) {
      next_expiry_us_ = std::min(next_expiry_us_, r.expires_us);
      continue;
    }
    v1::Notification from;
    from.set_from_agent(r.state.peer());
    from.set_transfer_id(r.state.transfer_id());
    const std::string deadline =
        r.opened ? fmt::format("its deadline ({} ms{})", r.deadline_ms,
                               r.capped ? fmt::format(", cut to the {} ms from its first "
                                                      "notice this agent allows a peer",
                                                      options_.max_peer_timeout_ms)
                                        : "")
                 : fmt::format("{} ms (it never opened the transfer here, so no deadline of "
                               "its own was known)",
                               r.deadline_ms);
    EndLocked(key, r, v1::TIMED_OUT, v1::TRANSFER_TIMED_OUT, &from,
              absl::DeadlineExceededError(fmt::format(
                  "transfer '{}' from '{}': no outcome came from the {} within {} plus {} ms "
                  "(it may have died or lost the link); {}",
                  Printable(r.state.transfer_id()), Printable(r.state.peer()),
                  r.state.op() == v1::READ ? "agent reading our memory" : "sender", deadline,
                  options_.grace_ms,
                  r.state.op() == v1::READ
                      ? "our pages were only read, not changed"
                      : "the pages it targets hold no reliable data")));
  }
}

uint64_t IncomingTransfers::NextExpiry() const {
  absl::MutexLock lock(&mu_);
  return next_expiry_us_;
}

void IncomingTransfers::PruneLocked() {
  while (ended_count_ > live_ended_) {
    const Key& oldest = ended_keys_[ended_head_];
    if (auto it = records_.find(oldest); it != records_.end()) {
      // Into ended_, still counted under its source until it goes from there; uncounted
      // now when ended_ keeps none (max_finished within live_ended_), or it is untracked.
      EndedExtraInto(it->second, &ended_extra_);
      const bool kept =
          it->second.source != nullptr &&
          ended_.Add(oldest, it->second.state, ended_extra_,
                     [this](absl::string_view key, absl::string_view extra)
                         ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                           UncountPrefixLocked(key.substr(0, EndedPrefixBytes(extra)));
                         });
      if (kept) {
        it->second.source = nullptr;
      } else {
        UncountLocked(it->second);
      }
      if (spare_.size() < kSpareRecords) {
        spare_.push_back(records_.extract(it));
      } else {
        records_.erase(it);
      }
    }
    ended_head_ = (ended_head_ + 1) % ended_keys_.size();
    --ended_count_;
  }
}

bool IncomingTransfers::Visible(const Record& r, const Caller& caller) const {
  if (caller.scheduler) return true;
  return std::find(r.owners.begin(), r.owners.end(), caller.principal) != r.owners.end();
}

void IncomingTransfers::CountLocked(Record& r, const Key& key) {
  const absl::string_view prefix(key.data(), key.size() - r.state.transfer_id().size());
  if (last_source_ == nullptr || last_source_->first != prefix) {
    auto it = sources_.find(prefix);
    if (it == sources_.end()) it = sources_.emplace(std::string(prefix), 0).first;
    last_source_ = &*it;
  }
  ++last_source_->second;
  r.source = last_source_;
}

void IncomingTransfers::EndedExtraInto(const Record& r, std::string* extra) const {
  const uint32_t prefix =
      r.source != nullptr ? static_cast<uint32_t>(r.source->first.size()) : 0;
  extra->assign(reinterpret_cast<const char*>(&prefix), sizeof prefix);
  for (const auto& owner : r.owners) extra->append(owner).push_back('\0');
}

size_t IncomingTransfers::EndedPrefixBytes(absl::string_view extra) {
  uint32_t prefix = 0;
  if (extra.size() >= sizeof prefix) std::memcpy(&prefix, extra.data(), sizeof prefix);
  return prefix;
}

bool IncomingTransfers::VisibleEnded(absl::string_view extra, const Caller& caller) {
  if (caller.scheduler) return true;
  if (extra.size() < sizeof(uint32_t)) return false;
  extra.remove_prefix(sizeof(uint32_t));
  while (!extra.empty()) {
    const size_t end = extra.find('\0');
    if (end == absl::string_view::npos) return false;
    if (extra.substr(0, end) == caller.principal) return true;
    extra.remove_prefix(end + 1);
  }
  return false;
}

void IncomingTransfers::UncountPrefixLocked(absl::string_view prefix) {
  auto it = sources_.find(prefix);
  if (it == sources_.end()) return;  // not reached: each entry of ended_ is counted
  if (--it->second == 0) {
    if (last_source_ == &*it) last_source_ = nullptr;
    sources_.erase(it);
  }
}

void IncomingTransfers::UncountLocked(Record& r) {
  if (r.source == nullptr) return;  // untracked
  if (--r.source->second == 0) {
    if (last_source_ == r.source) last_source_ = nullptr;
    sources_.erase(sources_.find(r.source->first));
  }
  r.source = nullptr;
}

absl::StatusOr<v1::TransferState> IncomingTransfers::Get(const std::string& peer,
                                                         const std::string& id,
                                                         const Caller& caller) const {
  absl::MutexLock lock(&mu_);
  const v1::TransferState* found = nullptr;
  v1::TransferState compact;  // one from ended_, when it is the newest
  v1::TransferState scratch;
  std::string extra;
  Key key;
  for (const auto& source : sources_) {
    // The prefix is "sender\nincarnation\n" (KeyInto): another sender's are skipped.
    const std::string& prefix = source.first;
    if (!peer.empty() && (prefix.size() <= peer.size() + 1 ||
                          prefix.compare(0, peer.size(), peer) != 0 || prefix[peer.size()] != '\n')) {
      continue;
    }
    key.assign(prefix).append(id);
    auto it = records_.find(key);
    if (it == records_.end()) {
      if (!ended_.Find(key, &scratch, &extra) || !VisibleEnded(extra, caller)) continue;
      if (!peer.empty() && scratch.peer() != peer) continue;
      if (found == nullptr || scratch.submitted_unix_us() > found->submitted_unix_us()) {
        compact.Swap(&scratch);
        found = &compact;
      }
      continue;
    }
    const Record& r = it->second;
    if (r.state.direction() != v1::INCOMING || !Visible(r, caller)) continue;
    if (!peer.empty() && r.state.peer() != peer) continue;
    // The newest when a peer reused the id across restarts.
    if (found == nullptr || r.state.submitted_unix_us() > found->submitted_unix_us()) {
      found = &r.state;
    }
  }
  if (found == nullptr) {
    return absl::NotFoundError(fmt::format(
        "no incoming transfer '{}'{} is known here that you may see (ended ones are kept for the "
        "last {}); list them with `kvagentctl transfers --incoming`",
        Printable(id, 256), peer.empty() ? "" : fmt::format(" from '{}'", Printable(peer)),
        options_.max_finished));
  }
  return *found;
}

std::vector<v1::TransferState> IncomingTransfers::List(bool active_only, const Caller& caller) const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::TransferState> out;
  for (const auto& [key, r] : records_) {
    if (r.state.direction() != v1::INCOMING || !Visible(r, caller)) continue;
    if (active_only && Terminal(r.state.phase())) continue;
    out.push_back(r.state);
  }
  if (!active_only) {
    ended_.ForEach([&](absl::string_view, const v1::TransferState& state, absl::string_view extra) {
      if (VisibleEnded(extra, caller)) out.push_back(state);
    });
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.submitted_unix_us() < b.submitted_unix_us();
  });
  return out;
}

size_t IncomingTransfers::sources() const {
  absl::MutexLock lock(&mu_);
  return sources_.size();
}

uint64_t IncomingTransfers::active() const {
  absl::MutexLock lock(&mu_);
  return active_;
}

uint64_t IncomingTransfers::untracked() const {
  absl::MutexLock lock(&mu_);
  return untracked_;
}

}  // namespace kvagent::agent

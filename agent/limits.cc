#include "agent/limits.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {

constexpr uint64_t kKiB = 1024, kMiB = kKiB << 10, kGiB = kMiB << 10, kTiB = kGiB << 10;

// Same order as enum Limit.
constexpr std::array<LimitInfo, kLimitCount> kInfo = {{
    {"regions", "--max-regions", "regions", 131072,
     "regions registered on this agent (peers accept at most 131072)"},
    {"regions_per_owner", "--max-regions-per-owner", "regions", 16384,
     "regions one engine (principal) may register"},
    {"registered_bytes_per_owner", "--max-registered-bytes-per-owner", "bytes", 4 * kTiB,
     "bytes of regions one engine may register"},
    {"metadata_bytes", "--max-metadata-bytes", "bytes", 48 * kMiB,
     "bytes of region catalog peers fetch (their limit is 64 MiB)"},
    {"allocated_bytes", "--max-allocated-bytes", "bytes", 0,
     "AllocateMemory bytes held at once, all engines"},
    {"allocated_bytes_per_owner", "--max-allocated-bytes-per-owner", "bytes", 0,
     "AllocateMemory bytes one engine may hold"},
    {"active_transfers", "--max-active-transfers", "transfers", 65536,
     "outgoing transfers not yet ended, all callers"},
    {"active_transfers_per_owner", "--max-active-transfers-per-owner", "transfers", 16384,
     "outgoing transfers not yet ended, one caller"},
    {"ops_per_chunk", "--max-ops-per-chunk", "operations", 1u << 20,
     "operations (item copies x regions) one submitted chunk may expand to"},
    {"planned_ops", "--max-planned-ops", "operations", 1u << 22,
     "operations planned and not yet finished, all transfers (~40 bytes each)"},
    {"queued_notifications", "--max-queued-notifications", "notifications", 65536,
     "notifications waiting for a client to take them"},
    {"queued_notification_bytes", "--max-queued-notification-bytes", "bytes", 64 * kMiB,
     "bytes of notifications waiting for a client"},
    {"streams", "--max-streams", "streams", 4096,
     "WatchTransfer and WatchNotifications streams open, all callers"},
    {"streams_per_caller", "--max-streams-per-caller", "streams", 256,
     "Watch* streams one caller may hold open"},
    {"pending_connects", "--max-pending-connects", "calls", 64,
     "ConnectPeer calls in progress at once"},
    {"peer_callers", "--max-peer-callers", "peers", 4096,
     "peer identities this agent tracks (metadata watchers, notification secrets)"},
    {"subscriptions", "--max-subscriptions", "subscriptions", 1024,
     "durable notification subscriptions (idle ones expire: --subscription-ttl-ms)"},
    {"in_flight_per_subscription", "--max-in-flight-per-subscription", "notifications", 4096,
     "notifications one subscription holds unacknowledged (more wait in the queue)"},
    {"memory_handles", "--max-memory-handles", "handles", 65536,
     "memory handles (share, share_device, allocate) held, all sessions; each holds a descriptor"},
    {"memory_handles_per_session", "--max-memory-handles-per-session", "handles", 4096,
     "memory handles one session holds"},
}};

uint64_t HalfOfMemTotal() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 64 * kGiB;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 2;
}

}  // namespace

const LimitInfo& InfoOf(Limit limit) { return kInfo[static_cast<int>(limit)]; }

Limits::Limits() {
  for (int i = 0; i < kLimitCount; ++i) {
    values_[i] = kInfo[i].default_value != 0 ? kInfo[i].default_value : HalfOfMemTotal();
  }
}

absl::Status Limits::Refuse(Limit limit, std::string_view what, uint64_t in_use, uint64_t asking,
                            std::string_view fix) const {
  refused_[static_cast<int>(limit)].fetch_add(1, std::memory_order_relaxed);
  const LimitInfo& info = InfoOf(limit);
  return absl::ResourceExhaustedError(fmt::format(
      "{}: limit {} ({} {}) reached: {} in use, {} more asked; {}; or raise {} on the agent "
      "(docs/LIMITS.md)",
      what, info.name, value(limit), info.unit, in_use, asking, fix, info.flag));
}

absl::Status Limits::SetFromFlag(std::string_view flag, std::string_view value) {
  for (int i = 0; i < kLimitCount; ++i) {
    if (kInfo[i].flag != flag) continue;
    std::string digits(value);
    uint64_t scale = 1;
    if (!digits.empty() && kInfo[i].unit == "bytes") {
      switch (std::toupper(static_cast<unsigned char>(digits.back()))) {
        case 'K': scale = kKiB; break;
        case 'M': scale = kMiB; break;
        case 'G': scale = kGiB; break;
        case 'T': scale = kTiB; break;
        default: break;
      }
      if (scale != 1) digits.pop_back();
    }
    uint64_t parsed = 0;
    if (!absl::SimpleAtoi(digits, &parsed) || parsed > UINT64_MAX / scale) {
      return absl::InvalidArgumentError(fmt::format(
          "flag {}: '{}' is not a non-negative integer{}", flag, value,
          kInfo[i].unit == "bytes" ? " (bytes; K, M, G or T may follow)" : ""));
    }
    values_[i] = parsed * scale;
    return absl::OkStatus();
  }
  return absl::NotFoundError(fmt::format("no limit has flag {}", flag));
}

std::string Limits::Usage() {
  std::string out = "\n Limits (each refusal is RESOURCE_EXHAUSTED naming it; docs/LIMITS.md):\n";
  auto human = [](uint64_t bytes) {
    for (auto [unit, suffix] : {std::pair{kTiB, "T"}, {kGiB, "G"}, {kMiB, "M"}, {kKiB, "K"}}) {
      if (bytes % unit == 0) return fmt::format("{}{}", bytes / unit, suffix);
    }
    return fmt::format("{}", bytes);
  };
  for (const LimitInfo& info : kInfo) {
    const std::string value = info.default_value == 0 ? std::string("half of MemTotal")
                              : info.unit == "bytes"  ? human(info.default_value)
                                                      : fmt::format("{}", info.default_value);
    out += fmt::format("  {:<34}{}\n  {:<34}(default {})\n", fmt::format("{} N", info.flag),
                       info.help, "", value);
  }
  return out;
}

absl::StatusOr<StreamTable::Lease> StreamTable::Open(const std::string& principal,
                                                    std::string_view call) {
  absl::MutexLock lock(&mu_);
  const std::string what = fmt::format("{} for {}", call, principal);
  uint64_t& mine = by_principal_[principal];
  absl::Status fits = limits_->Check(Limit::kStreams, what, open_, 1,
                                     "close streams clients no longer read");
  if (fits.ok()) {
    fits = limits_->Check(Limit::kStreamsPerCaller, what, mine, 1,
                          "watch several transfers from one stream's client, or poll");
  }
  if (!fits.ok()) {
    if (mine == 0) by_principal_.erase(principal);
    return fits;
  }
  ++mine;
  ++open_;
  Lease lease;
  lease.table_ = this;
  lease.principal_ = principal;
  return lease;
}

void StreamTable::Close(const std::string& principal) {
  absl::MutexLock lock(&mu_);
  --open_;
  auto it = by_principal_.find(principal);
  if (it != by_principal_.end() && --it->second == 0) by_principal_.erase(it);
}

uint64_t StreamTable::largest_caller() const {
  absl::MutexLock lock(&mu_);
  uint64_t most = 0;
  for (const auto& [principal, n] : by_principal_) most = std::max(most, n);
  return most;
}

uint64_t StreamTable::open() const {
  absl::MutexLock lock(&mu_);
  return open_;
}

std::string BoundedErrorText(std::string_view message, size_t max_bytes,
                             std::string_view whole_text_at) {
  if (message.size() <= max_bytes) return std::string(message);
  const std::string tail = fmt::format(" ... [{} more bytes cut; {} has the whole text]",
                                       message.size() - max_bytes, whole_text_at);
  size_t keep = max_bytes > tail.size() ? max_bytes - tail.size() : 0;
  // Do not cut a UTF-8 sequence in half.
  while (keep > 0 && (static_cast<unsigned char>(message[keep]) & 0xC0) == 0x80) --keep;
  return std::string(message.substr(0, keep)) + tail;
}

}  // namespace kvagent::agent

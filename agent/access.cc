#include "agent/access.h"

#include <grp.h>
#include <pwd.h>

#include <unistd.h>

#include <cstdlib>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/format.h"
#include "base/log.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kAudit("audit");
}  // namespace

bool LogBudget::Take(uint64_t* skipped) {
  absl::MutexLock lock(&mu_);
  const int64_t now = absl::ToUnixSeconds(absl::Now());
  if (now != second_) {
    second_ = now;
    written_ = 0;
  }
  if (written_ >= burst_) {
    ++suppressed_;
    return false;
  }
  ++written_;
  *skipped = std::exchange(suppressed_, 0);
  return true;
}

void LogRefusal(std::string_view who, std::string_view what, const absl::Status& why) {
  static LogBudget budget(20);
  uint64_t skipped = 0;
  if (!budget.Take(&skipped)) return;
  kAudit.Warn("refused {} from {}: {}{}", what, who, Printable(std::string(why.message()), 512),
              skipped ? fmt::format(" ({} more refusals not logged)", skipped) : std::string());
}

std::string_view DoorName(Door door) {
  switch (door) {
    case Door::kLocal: return "local";
    case Door::kNetwork: return "mtls";
    case Door::kInsecure: return "insecure";
  }
  return "?";
}

std::vector<std::string> Caller::Roles() const {
  std::vector<std::string> roles;
  if (engine) roles.push_back("engine");
  if (scheduler) roles.push_back("scheduler");
  if (peer) roles.push_back("peer");
  return roles;
}

Caller AccessPolicy::LocalCaller(uint64_t session_id, uid_t uid, pid_t pid,
                                 std::string_view client_name) const {
  Caller c;
  c.door = Door::kLocal;
  c.session_id = session_id;
  c.principal = fmt::format("session:{} uid:{} pid:{}", session_id, uid, pid);
  c.durable_identity = fmt::format("uid:{} client:{}", uid, Printable(client_name, 128));
  c.uid = uid;
  c.engine = any_engine_uid || engine_uids.count(uid) > 0;
  c.scheduler = scheduler_uids.count(uid) > 0;
  c.peer = peer_uids.count(uid) > 0;
  if (c.peer) c.peer_name = std::string(client_name);
  return c;
}

Caller AccessPolicy::NetworkCaller(std::string_view identity) const {
  Caller c;
  c.door = Door::kNetwork;
  c.principal = fmt::format("cert:{}", Printable(identity, 128));
  c.durable_identity = c.principal;
  c.uid = geteuid();
  c.scheduler = scheduler_identities.count(std::string(identity)) > 0;
  c.peer = any_peer_identity || peer_identities.count(std::string(identity)) > 0;
  if (c.peer) c.peer_name = std::string(identity);
  return c;
}

Caller AccessPolicy::InsecureCaller(std::string_view claimed_peer_name) {
  Caller c;
  c.door = Door::kInsecure;
  c.principal = "insecure";
  c.durable_identity = c.principal;
  c.uid = geteuid();
  c.engine = c.scheduler = c.peer = true;
  c.peer_name = std::string(claimed_peer_name);
  return c;
}

absl::Status CheckRole(const Caller& caller, Need need, std::string_view call) {
  bool ok = false;
  std::string_view role, grant;
  switch (need) {
    case Need::kAny: return absl::OkStatus();
    case Need::kEngine:
      ok = caller.engine;
      role = "engine";
      grant = "--engine-uids";
      break;
    case Need::kEngineOrScheduler:
      ok = caller.engine || caller.scheduler;
      role = "engine or scheduler";
      grant = "--engine-uids or --scheduler-uids (--scheduler-identities for certificates)";
      break;
    case Need::kScheduler:
      ok = caller.scheduler;
      role = "scheduler";
      grant = "--scheduler-uids (local) or --scheduler-identities (certificates)";
      break;
    case Need::kPeer:
      ok = caller.peer;
      role = "peer";
      grant = "--peer-uids (same-host agents) or --peer-identities (certificates)";
      break;
  }
  if (ok) return absl::OkStatus();
  return absl::PermissionDeniedError(fmt::format(
      "{}: {} (via the {} door) does not have the {} role this call needs; the operator grants "
      "it with {}",
      call, caller.principal, DoorName(caller.door), role, grant));
}

absl::StatusOr<std::set<uid_t>> ParseUidList(std::string_view text, std::string_view flag) {
  std::set<uid_t> out;
  if (text.empty() || text == "none") return out;
  for (absl::string_view part :
       absl::StrSplit(absl::string_view(text.data(), text.size()), ',', absl::SkipWhitespace())) {
    part = absl::StripAsciiWhitespace(part);
    uint32_t uid = 0;
    if (absl::SimpleAtoi(part, &uid)) {
      out.insert(static_cast<uid_t>(uid));
      continue;
    }
    std::string name(part);
    struct passwd pw {};
    struct passwd* found = nullptr;
    char buffer[4096];
    if (getpwnam_r(name.c_str(), &pw, buffer, sizeof(buffer), &found) != 0 || found == nullptr) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: '{}' is neither a uid nor a user name known here; give numeric uids or "
          "existing user names, comma separated (or 'none')",
          flag, Printable(name)));
    }
    out.insert(found->pw_uid);
  }
  return out;
}

std::set<std::string> ParseIdentityList(std::string_view text) {
  std::set<std::string> out;
  if (text.empty() || text == "none") return out;
  for (absl::string_view part :
       absl::StrSplit(absl::string_view(text.data(), text.size()), ',', absl::SkipWhitespace())) {
    out.insert(std::string(absl::StripAsciiWhitespace(part)));
  }
  return out;
}


}  // namespace kvagent::agent

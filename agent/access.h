// Who is calling and what it may do. Every Agent and Peer call, and every local
// session, is identified here: local callers by the kernel (SO_PEERCRED, through
// their session), remote ones by their certificate; roles come from the operator's
// policy flags. Used by the gRPC services, the local door and the peer manager.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/text.h"

namespace kvagent::agent {

// The door a call came through.
enum class Door {
  kLocal,     // the Unix socket; callers identified by their session
  kNetwork,   // mutual TLS; callers identified by their certificate
  kInsecure,  // --insecure-listen: nobody is identified, everybody may do everything
};
std::string_view DoorName(Door door);

struct Caller {
  Door door = Door::kLocal;
  // What objects record as their owner and what logs show: "session:7 uid:1000 pid:42",
  // "cert:scheduler-1", or "insecure" (every insecure caller is the same owner).
  std::string principal;
  uint64_t session_id = 0;  // local sessions only
  // Local sessions: the kernel's uid (files registered by path must be owned by it).
  // Other doors: the agent's own effective uid.
  uid_t uid = 0;
  // The agent name this caller speaks for as a peer: its certificate's name, a local
  // session's client name (when its uid may act as a peer), or, on the insecure door,
  // what it claims.
  std::string peer_name;
  // Who this caller is across its own restarts (what a notification subscription
  // belongs to): "uid:1000 client:NAME" for a local session (uid from the kernel,
  // NAME from its hello, escaped), "cert:NAME" on the network door, "insecure".
  std::string durable_identity;
  bool engine = false;     // may register memory and move what it registered
  bool scheduler = false;  // may act on every engine's regions, transfers and notifications
  bool peer = false;       // may fetch metadata (and so receive rkeys and a secret)

  std::vector<std::string> Roles() const;
  // May this caller act on an object owned by `owner`?
  bool MayUse(std::string_view owner) const { return scheduler || owner == principal; }
};

// Operator policy: which local uids and which certificate identities get which role.
struct AccessPolicy {
  // Local callers (any uid that can open the socket may attach; the socket's mode and
  // group are the first gate). any_engine_uid (the default, no --engine-uids): every
  // uid may act as an engine; otherwise only engine_uids ("none": nobody).
  bool any_engine_uid = true;
  std::set<uid_t> engine_uids;
  std::set<uid_t> scheduler_uids;
  std::set<uid_t> peer_uids;
  // Network callers, by certificate identity (DNS SAN or CN).
  std::set<std::string> scheduler_identities;
  std::set<std::string> peer_identities;
  bool any_peer_identity = true;  // every certificate of the cluster CA may act as a peer

  // Roles of a local session from its uid.
  Caller LocalCaller(uint64_t session_id, uid_t uid, pid_t pid, std::string_view client_name) const;
  // Roles of a network caller from its certificate identity.
  Caller NetworkCaller(std::string_view identity) const;
  static Caller InsecureCaller(std::string_view claimed_peer_name);
};

// What a call needs of its caller.
enum class Need { kAny, kEngine, kEngineOrScheduler, kScheduler, kPeer };
// OK when `caller` has the role; PERMISSION_DENIED naming the caller, the call, the
// role it lacks and the flag that grants it.
absl::Status CheckRole(const Caller& caller, Need need, std::string_view call);

// Parses a comma-separated list of uids or user names ("0,kvagent,1000"); "none" or ""
// is the empty set. `flag` names the flag in errors.
absl::StatusOr<std::set<uid_t>> ParseUidList(std::string_view text, std::string_view flag);
// Parses a comma-separated list of certificate identities; "none" or "" is empty.
std::set<std::string> ParseIdentityList(std::string_view text);

// Refusals and drops, for status and logs.
struct SecurityCounters {
  std::atomic<uint64_t> refused_calls{0};
  std::atomic<uint64_t> dropped_peer_messages{0};
};

// Logs (component "audit") a refused call or message: who, what it tried and why.
// At most 20 lines a second are written; the rest are counted into the next line.
void LogRefusal(std::string_view who, std::string_view what, const absl::Status& why);

// A budget of log lines: at most `burst` a second (wall clock); the lines past it are
// counted and reported by the next line allowed. One per place that logs what a
// caller or a peer can make happen at will.
class LogBudget {
 public:
  explicit constexpr LogBudget(int burst) : burst_(burst) {}
  // True when a line may be written now; `skipped` then gets how many were not
  // written since the last one that was.
  bool Take(uint64_t* skipped);

 private:
  const int burst_;
  absl::Mutex mu_{absl::kConstInit};
  int64_t second_ ABSL_GUARDED_BY(mu_) = 0;
  int written_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};



}  // namespace kvagent::agent

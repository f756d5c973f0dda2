// SessionServer: the agent's session socket (proto "Local session protocol"), one
// thread serving SOCK_SEQPACKET connections. Transport only: it identifies callers
// (SO_PEERCRED), frames and bounds datagrams and hands requests to a SessionHandler,
// which the agent implements (policy lives there). Used by agent/agent and its tests.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agent/access.h"
#include "base/unique_fd.h"
#include "client/session_wire.h"
#include "proto/kvagent.pb.h"

namespace kvagent::agent {

// The caller of a session, as the kernel identified it when it connected.
using PeerCredentials = client::ProcessCredentials;

// The agent's side of the protocol. Every call is made on the server's thread, one at
// a time, and must not block for long (every other session waits meanwhile).
class SessionHandler {
 public:
  virtual ~SessionHandler() = default;

  // First request of a connection. The welcome is sent with session_id, uid, gid and
  // pid filled in by the server (the handler need not). An error is sent as the
  // SessionReply and the connection closed; OnClose is not called for it.
  virtual absl::StatusOr<v1::SessionWelcome> OnHello(uint64_t session_id,
                                                     const PeerCredentials& credentials,
                                                     const v1::SessionHello& hello) = 0;

  // Every later request (share, allocate, free, peer_memory). `fds`: the descriptors
  // that came with it (the handler keeps what it moves out; the rest are closed).
  // Fills `reply` (seq is set by the server) and may add descriptors to `reply_fds`
  // (at most client::kMaxSessionFds; sent, then closed by the server).
  virtual void OnRequest(uint64_t session_id, const v1::SessionRequest& request,
                         std::vector<UniqueFd> fds, v1::SessionReply* reply,
                         std::vector<UniqueFd>* reply_fds) = 0;

  // The connection of a welcomed session closed: the client exited or crashed, broke
  // the protocol or stopped reading, or the server stopped. Once per session.
  virtual void OnClose(uint64_t session_id) = 0;
};

struct SessionServerOptions {
  std::string path;         // the session socket: <local gRPC socket path>.session
  mode_t mode = 0660;       // the socket file's mode
  std::string group;        // --local-socket-group: name or numeric gid; empty: leave it
  // Connections open at once, welcomed or not. Those still waiting for their hello
  // are bounded too: per uid (MaxWaitingPerUid), all uids together (MaxWaitingInAll)
  // and in time (kHelloDeadline).
  uint32_t max_sessions = 1024;
  // Sessions that ended and whose regions are not released yet (the agent's
  // SessionReleases): they count against max_sessions too, since each still holds its
  // regions. Called on the server's thread for each connection; must not block (it
  // takes only the release queue's own mutex). Empty: none are counted.
  std::function<uint64_t()> releasing;
};

// A connection must send its hello within this long or it is closed: connections
// that never say hello would otherwise hold --max-sessions slots for ever.
inline constexpr std::chrono::seconds kHelloDeadline{5};
// Connections waiting for their hello, per uid, are bounded to max_sessions divided by
// this (at least 1), so one uid cannot take every slot with connections that never
// say hello (the rest stay for others' engines). Honest clients hold one such
// connection for the moment between connect() and their hello.
inline constexpr uint32_t kWaitingShareDivisor = 4;
uint32_t MaxWaitingPerUid(uint32_t max_sessions);
// And all uids together to half of max_sessions (at least 1): several uids, each within
// its share, could otherwise still hold every slot between them. Past it, the
// connection waiting longest is closed (not the newcomer, which may be an engine whose
// hello is on its way).
uint32_t MaxWaitingInAll(uint32_t max_sessions);

class SessionServer {
 public:
  // Lines a second logged for connections refused as they connect (the rest are
  // counted into the next line).
  static constexpr int kRefusalLinesPerSecond = 5;
  // Creates the socket (see agent/unix_listener.h: stale sockets are replaced, live
  // ones and other files refused) and starts the thread. `handler` must outlive the
  // server.
  static absl::StatusOr<std::unique_ptr<SessionServer>> Start(const SessionServerOptions& options,
                                                              SessionHandler* handler);
  ~SessionServer();
  SessionServer(const SessionServer&) = delete;
  SessionServer& operator=(const SessionServer&) = delete;

  // Stops the thread, closes every connection (OnClose for each session, on the
  // server's thread) and removes the socket file if it is still this server's.
  // Idempotent; must not be called from a handler callback.
  void Stop();

  // Welcomed sessions open now.
  size_t sessions() const { return sessions_.load(std::memory_order_relaxed); }
  // Connections closed because no hello came within kHelloDeadline, since the start.
  uint64_t hello_timeouts() const { return hello_timeouts_.load(std::memory_order_relaxed); }
  // Connections refused because their uid already had MaxWaitingPerUid() connections
  // waiting for their hello, or closed because all uids had MaxWaitingInAll() and they
  // had waited longest, since the start.
  uint64_t waiting_refusals() const { return waiting_refusals_.load(std::memory_order_relaxed); }
  // Connections refused because the sessions attached (and connections waiting for
  // their hello) and the ended sessions not released yet reached max_sessions, while
  // the attached alone had not, since the start.
  uint64_t releasing_refusals() const {
    return releasing_refusals_.load(std::memory_order_relaxed);
  }
  // Connections refused as they connected, since the start: over max_sessions with the
  // sessions attached alone or with the ended ones not released yet (releasing_refusals
  // counts those too), out of descriptors, or epoll failed.
  uint64_t accept_refusals() const { return accept_refusals_.load(std::memory_order_relaxed); }
  const std::string& path() const { return options_.path; }

 private:
  struct Connection;

  SessionServer(const SessionServerOptions& options, SessionHandler* handler);
  void Run();
  void AcceptAll();
  void Refuse(UniqueFd fd, const PeerCredentials& credentials, const absl::Status& reason);
  // The connection's hello came, or it closed: it no longer waits for one.
  void StopWaitingForHello(Connection& connection);
  // Refuses a connection whose uid has too many waiting for their hello.
  void RefuseOverWaitingShare(Connection& connection);
  // Closes a connection waiting for its hello for `reason` (counted in
  // waiting_refusals, logged once per burst).
  void CloseOverWaitingBound(Connection& connection, const absl::Status& reason);
  // Closes the connections whose hello is overdue (logged once per burst) and returns
  // how long epoll may wait until the next one is due (-1: none waits).
  int CloseOverdueHellos();
  // Handles up to a few queued datagrams; false when the connection was closed.
  bool ServeReadable(Connection& connection);
  // Sends a reply; false (after logging why) when the connection must be closed.
  bool Reply(Connection& connection, const v1::SessionReply& reply, std::vector<UniqueFd> fds);
  void SendErrorAndClose(Connection& connection, uint64_t seq, const absl::Status& error);
  // Closes and forgets the connection (OnClose for a session). `refused`: the agent
  // turned the caller away, as opposed to the caller leaving before its hello.
  // `logged`: the caller logged it already.
  void Close(Connection& connection, std::string_view reason, bool refused = true,
             bool logged = false);

  const SessionServerOptions options_;
  SessionHandler* const handler_;
  UniqueFd listen_fd_;
  UniqueFd epoll_fd_;
  UniqueFd stop_fd_;     // eventfd: Stop() wakes the thread
  UniqueFd reserve_fd_;  // spare descriptor, to refuse connections when out of them
  dev_t socket_dev_ = 0;
  ino_t socket_ino_ = 0;
  std::thread thread_;
  std::atomic<bool> stopped_{false};
  std::atomic<size_t> sessions_{0};
  std::atomic<uint64_t> hello_timeouts_{0};
  std::atomic<uint64_t> waiting_refusals_{0};
  std::atomic<uint64_t> releasing_refusals_{0};
  std::atomic<uint64_t> accept_refusals_{0};  // written by Refuse, on the server's thread

  // Touched by the server's thread only (and by Stop after it joined).
  std::unordered_map<int, std::unique_ptr<Connection>> connections_;
  uint64_t next_session_id_ = 1;
  // Connections waiting for their hello: by accept time (the oldest is due first) and
  // how many per uid.
  std::set<std::pair<std::chrono::steady_clock::time_point, int>> waiting_;
  std::unordered_map<uid_t, uint32_t> waiting_per_uid_;
  // Floods come in bursts: their log lines are rate-limited, the rest summed.
  std::chrono::steady_clock::time_point last_timeout_log_{};
  uint64_t timeouts_not_logged_ = 0;
  std::chrono::steady_clock::time_point last_refusal_log_{};
  uint64_t refusals_not_logged_ = 0;
  // The budget of the lines for connections refused as they were accepted (Refuse).
  LogBudget refusal_log_budget_{kRefusalLinesPerSecond};
};


}  // namespace kvagent::agent

#include "agent/session_server.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <set>
#include <utility>

#include "agent/unix_listener.h"
#include "base/format.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "fmt/format.h"
#include "transport/ucx_hardening.h"

namespace kvagent::agent {
namespace {

constexpr log::Logger kLog("session");

// The session protocol version this server speaks (SessionHello.protocol).
constexpr uint32_t kSessionProtocol = 1;
// Datagrams served per connection per wake-up, so one busy client cannot starve the
// others (epoll is level-triggered: the rest is served on the next round).
constexpr int kMaxRequestsPerWakeup = 16;
// Datagrams read from a refused connection to find its hello's seq.
constexpr int kMaxDrainedOnRefusal = 4;
// Connections whose hello falls due this soon are closed with the overdue ones, so
// that a burst of them is closed (and logged) in one go.
constexpr std::chrono::milliseconds kOverdueSlack{100};
// Floods of connections are logged at most once in this long; the lines between are
// summed into the next one (and counted in hello_timeouts, waiting_refusals).
constexpr std::chrono::seconds kFloodLogInterval{1};

std::string ErrnoText(int err) { return fmt::format("{} ({})", std::strerror(err), err); }


void SetError(v1::SessionReply* reply, const absl::Status& status) {
  reply->set_error_code(static_cast<int32_t>(status.code()));
  reply->set_error_message(std::string(status.message()));
}

std::vector<int> RawFds(const std::vector<UniqueFd>& fds) {
  std::vector<int> raw;
  raw.reserve(fds.size());
  for (const UniqueFd& fd : fds) raw.push_back(fd.get());
  return raw;
}

std::string Describe(const PeerCredentials& c) {
  return fmt::format("uid {} gid {} pid {}", c.uid, c.gid, c.pid);
}

}  // namespace

static_assert(kWaitingShareDivisor == 4, "RefuseOverWaitingShare's message says 'a quarter'");

uint32_t MaxWaitingPerUid(uint32_t max_sessions) {
  return std::max<uint32_t>(1, max_sessions / kWaitingShareDivisor);
}

uint32_t MaxWaitingInAll(uint32_t max_sessions) { return std::max<uint32_t>(1, max_sessions / 2); }

struct SessionServer::Connection {
  UniqueFd fd;
  PeerCredentials credentials;
  std::chrono::steady_clock::time_point accepted_at;
  bool waiting = false;     // for its hello: counted in waiting_ and waiting_per_uid_
  uint64_t session_id = 0;  // 0 until welcomed
  std::string client_name;  // escaped, for logs
  // Welcomed with the peer role: its process's shared memory is within UCX's reach
  // while the session lasts.
  transport::SameHostPeerHold same_host;
};

SessionServer::SessionServer(const SessionServerOptions& options, SessionHandler* handler)
    : options_(options), handler_(handler) {}

absl::StatusOr<std::unique_ptr<SessionServer>> SessionServer::Start(
    const SessionServerOptions& options, SessionHandler* handler) {
  if (handler == nullptr) {
    return absl::InvalidArgumentError("session server: no handler given; this is a bug");
  }
  if (options.max_sessions == 0) {
    return absl::InvalidArgumentError(
        "--max-sessions is 0, so no engine could attach; give at least 1 (default 1024)");
  }
  std::unique_ptr<SessionServer> server(new SessionServer(options, handler));
  ASSIGN_OR_RETURN(server->listen_fd_,
                   ListenOnUnixSocket(options.path, SOCK_SEQPACKET, options.mode, options.group));
  struct stat st {};
  if (lstat(options.path.c_str(), &st) == 0) {
    server->socket_dev_ = st.st_dev;
    server->socket_ino_ = st.st_ino;
  }
  // From here on the destructor (Stop) removes the socket file.
  server->epoll_fd_.reset(epoll_create1(EPOLL_CLOEXEC));
  server->stop_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  server->reserve_fd_.reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!server->epoll_fd_ || !server->stop_fd_) {
    return absl::ResourceExhaustedError(fmt::format(
        "session server at {}: cannot create its epoll or eventfd descriptor: {}; raise the "
        "agent's descriptor limit (LimitNOFILE)",
        options.path, ErrnoText(errno)));
  }
  for (int fd : {server->listen_fd_.get(), server->stop_fd_.get()}) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    if (epoll_ctl(server->epoll_fd_.get(), EPOLL_CTL_ADD, fd, &event) != 0) {
      return absl::InternalError(fmt::format("session server at {}: epoll_ctl failed: {}",
                                             options.path, ErrnoText(errno)));
    }
  }
  server->thread_ = std::thread([s = server.get()] { s->Run(); });
  kLog.Info(
      "session socket listening at {} (mode {:04o}{}{}, at most {} sessions; a connection "
      "says hello within {} s, at most {} per uid wait for theirs)",
      options.path, static_cast<unsigned>(options.mode), options.group.empty() ? "" : ", group ",
      options.group, options.max_sessions, kHelloDeadline.count(),
      MaxWaitingPerUid(options.max_sessions));
  return server;
}

SessionServer::~SessionServer() { Stop(); }

void SessionServer::Stop() {
  if (stopped_.exchange(true)) return;
  if (thread_.joinable()) {
    const uint64_t one = 1;
    if (write(stop_fd_.get(), &one, sizeof(one)) != sizeof(one)) {
      kLog.Error("cannot wake the session thread to stop it: {}", ErrnoText(errno));
    }
    thread_.join();
  }
  if (listen_fd_) {
    listen_fd_.reset();
    // Remove the file only if it is still ours (not a successor's socket).
    struct stat st {};
    if (lstat(options_.path.c_str(), &st) == 0 && st.st_dev == socket_dev_ &&
        st.st_ino == socket_ino_) {
      unlink(options_.path.c_str());
    }
  }
}

void SessionServer::Run() {
  pthread_setname_np(pthread_self(), "sessions");
  epoll_event events[64];
  bool stopping = false;
  while (!stopping) {
    const int timeout_ms = CloseOverdueHellos();
    const int n = epoll_wait(epoll_fd_.get(), events, 64, timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      kLog.Error("session server at {}: epoll_wait failed: {}; no more sessions are served",
                 options_.path, ErrnoText(errno));
      break;
    }
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == stop_fd_.get()) {
        stopping = true;
      } else if (fd == listen_fd_.get()) {
        AcceptAll();
      } else {
        auto it = connections_.find(fd);
        if (it == connections_.end()) continue;  // closed earlier in this round
        ServeReadable(*it->second);
      }
    }
  }
  std::vector<int> open;
  open.reserve(connections_.size());
  for (const auto& [fd, connection] : connections_) open.push_back(fd);
  for (int fd : open) Close(*connections_.at(fd), "the agent stopped");
}

void SessionServer::AcceptAll() {
  while (true) {
    int fd = accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      if ((err == EMFILE || err == ENFILE) && reserve_fd_) {
        // Out of descriptors: free the spare one to take the connection and tell the
        // client why, rather than leave it hanging (and this loop spinning).
        reserve_fd_.reset();
        UniqueFd refused(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (refused) {
          PeerCredentials credentials;
          if (auto c = client::PeerCredentialsOf(refused.get()); c.ok()) credentials = *c;
          Refuse(std::move(refused), credentials,
                 absl::ResourceExhaustedError(fmt::format(
                     "the agent is out of file descriptors ({}); the operator raises its "
                     "descriptor limit (LimitNOFILE) or lowers --max-sessions",
                     ErrnoText(err))));
        }
        reserve_fd_.reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
        if (refused) continue;
        return;
      }
      kLog.Error("session server at {}: accept failed: {}", options_.path, ErrnoText(err));
      return;
    }
    UniqueFd connection_fd(fd);
    absl::StatusOr<PeerCredentials> credentials = client::PeerCredentialsOf(fd);
    if (!credentials.ok()) {
      kLog.Warn("refused a connection on {}: {}", options_.path, credentials.status());
      continue;
    }
    // Ended sessions not released yet still hold their regions: they count too.
    const uint64_t releasing = options_.releasing ? options_.releasing() : 0;
    if (connections_.size() + releasing >= options_.max_sessions) {
      const size_t attached = connections_.size() - waiting_.size();
      const std::string waiting =
          waiting_.empty()
              ? std::string()
              : fmt::format(" and {} connections waiting for their hello", waiting_.size());
      if (connections_.size() >= options_.max_sessions) {
        Refuse(std::move(connection_fd), *credentials,
               absl::ResourceExhaustedError(fmt::format(
                   "{} sessions attached{}, the limit of --max-sessions ({}); detach unused "
                   "engines or raise --max-sessions",
                   attached, waiting, options_.max_sessions)));
      } else {
        releasing_refusals_.fetch_add(1, std::memory_order_relaxed);
        Refuse(std::move(connection_fd), *credentials,
               absl::ResourceExhaustedError(fmt::format(
                   "{} sessions attached{} and {} ended sessions whose regions are not "
                   "released yet reach the limit of --max-sessions ({}): an ended session "
                   "holds its regions until the agent releases them, and releases wait "
                   "behind registrations holding the registry (while they map and register "
                   "memory); retry shortly, or raise --max-sessions",
                   attached, waiting, releasing, options_.max_sessions)));
      }
      continue;
    }
    epoll_event event{};
    event.events = EPOLLIN | EPOLLRDHUP;
    event.data.fd = fd;
    if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &event) != 0) {
      Refuse(std::move(connection_fd), *credentials,
             absl::InternalError(fmt::format("epoll_ctl failed: {}", ErrnoText(errno))));
      continue;
    }
    auto connection = std::make_unique<Connection>();
    connection->fd = std::move(connection_fd);
    connection->credentials = *credentials;
    connection->accepted_at = std::chrono::steady_clock::now();
    connection->waiting = true;
    Connection& added = *connection;
    connections_.emplace(fd, std::move(connection));
    waiting_.emplace(added.accepted_at, fd);
    const bool uid_over =
        ++waiting_per_uid_[added.credentials.uid] > MaxWaitingPerUid(options_.max_sessions);
    const bool all_over = waiting_.size() > MaxWaitingInAll(options_.max_sessions);
    if (!uid_over && !all_over) continue;
    // Over its uid's share, or all uids' together. A client whose hello came with its
    // connect() is served now (and waits no more).
    if (!ServeReadable(added)) continue;  // closed
    if (!added.waiting) continue;
    // One that sent nothing yet is refused when its own uid has its share waiting. Over
    // the bound for all uids, the connection waiting longest is closed instead: an
    // honest client waits for the moment between connect() and its hello, one that
    // never says hello waits longest, and refusing the newcomer would refuse an engine
    // whose hello merely had not arrived yet.
    if (uid_over) {
      RefuseOverWaitingShare(added);
    } else {
      Connection& longest = *connections_.at(waiting_.begin()->second);
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - longest.accepted_at);
      CloseOverWaitingBound(
          longest,
          absl::ResourceExhaustedError(fmt::format(
              "{} connections of all uids were waiting for their hello on {}, over the bound "
              "for all together ({}: half of --max-sessions {}), and this one, of uid {}, had "
              "waited longest ({} ms): it is closed to make room; a client sends its hello as "
              "soon as it connects (LocalSession::Attach does)",
              waiting_.size(), options_.path, MaxWaitingInAll(options_.max_sessions),
              options_.max_sessions, longest.credentials.uid, waited.count())));
    }
  }
}

void SessionServer::StopWaitingForHello(Connection& connection) {
  if (!connection.waiting) return;
  connection.waiting = false;
  waiting_.erase({connection.accepted_at, connection.fd.get()});
  auto it = waiting_per_uid_.find(connection.credentials.uid);
  if (it != waiting_per_uid_.end() && --it->second == 0) waiting_per_uid_.erase(it);
}

void SessionServer::RefuseOverWaitingShare(Connection& connection) {
  CloseOverWaitingBound(
      connection,
      absl::ResourceExhaustedError(fmt::format(
          "uid {} already has {} connections waiting for their hello on {}, the bound per uid "
          "({}: a quarter of --max-sessions {}); a client sends its hello as soon as it "
          "connects (LocalSession::Attach does), and a connection without one is closed {} s "
          "after it connected",
          connection.credentials.uid, waiting_per_uid_[connection.credentials.uid] - 1,
          options_.path, MaxWaitingPerUid(options_.max_sessions), options_.max_sessions,
          kHelloDeadline.count())));
}

void SessionServer::CloseOverWaitingBound(Connection& connection, const absl::Status& reason) {
  const uint64_t total = waiting_refusals_.fetch_add(1, std::memory_order_relaxed) + 1;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_refusal_log_ >= kFloodLogInterval) {
    kLog.Warn("closed a connection from {} that sent no hello: {} ({} closed over these "
              "bounds in all{})",
              Describe(connection.credentials), reason.message(), total,
              refusals_not_logged_ == 0
                  ? std::string()
                  : fmt::format(", {} of them not logged", refusals_not_logged_));
    last_refusal_log_ = now;
    refusals_not_logged_ = 0;
  } else {
    ++refusals_not_logged_;
  }
  v1::SessionReply reply;
  SetError(&reply, reason);
  (void)client::SendMessage(connection.fd.get(), reply, {});  // best effort: closing anyway
  Close(connection, std::string(reason.message()), /*refused=*/true, /*logged=*/true);
}

int SessionServer::CloseOverdueHellos() {
  if (waiting_.empty()) return -1;
  const auto now = std::chrono::steady_clock::now();
  auto due = waiting_.begin()->first + kHelloDeadline;
  if (due > now + kOverdueSlack) {
    return static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(due - now).count());
  }
  size_t closed = 0;
  std::set<uid_t> uids;
  const std::string why = fmt::format(
      "no hello within {} s of connecting; a client sends its hello as soon as it connects "
      "(LocalSession::Attach does): attach again",
      kHelloDeadline.count());
  while (!waiting_.empty() && waiting_.begin()->first + kHelloDeadline <= now + kOverdueSlack) {
    Connection& connection = *connections_.at(waiting_.begin()->second);
    uids.insert(connection.credentials.uid);
    // Counted before the client hears of it.
    hello_timeouts_.fetch_add(1, std::memory_order_relaxed);
    v1::SessionReply reply;
    SetError(&reply, absl::DeadlineExceededError(why));
    (void)client::SendMessage(connection.fd.get(), reply, {});  // best effort: closing anyway
    Close(connection, why, /*refused=*/true, /*logged=*/true);  // no longer in waiting_
    ++closed;
  }
  if (closed > 0) {
    const uint64_t total = hello_timeouts_.load(std::memory_order_relaxed);
    if (now - last_timeout_log_ >= kFloodLogInterval) {
      std::string from;
      for (uid_t uid : uids) from += fmt::format("{}{}", from.empty() ? "" : ", ", uid);
      kLog.Warn(
          "closed {} connection(s) on {} from uid {} that sent no hello within {} s ({} in all{}); "
          "if these are engines, they do not send their hello on connecting",
          closed, options_.path, from, kHelloDeadline.count(), total,
          timeouts_not_logged_ == 0
              ? std::string()
              : fmt::format(", {} of them not logged", timeouts_not_logged_));
      last_timeout_log_ = now;
      timeouts_not_logged_ = 0;
    } else {
      timeouts_not_logged_ += closed;
    }
  }
  if (waiting_.empty()) return -1;
  due = waiting_.begin()->first + kHelloDeadline;
  return static_cast<int>(
      std::max<int64_t>(0, std::chrono::ceil<std::chrono::milliseconds>(due - now).count()));
}

void SessionServer::Refuse(UniqueFd fd, const PeerCredentials& credentials,
                           const absl::Status& reason) {
  // Read what the client already sent, so that the reply carries its hello's seq and
  // closing with unread data does not reset the connection before the reply is read.
  uint64_t seq = 0;
  for (int i = 0; i < kMaxDrainedOnRefusal; ++i) {
    v1::SessionRequest request;
    std::vector<UniqueFd> fds;
    if (!client::ReceiveMessage(fd.get(), &request, &fds, 0).ok()) break;
    if (request.has_hello()) seq = request.seq();
  }
  // Counted before the client hears of it: one that reads the count after its refusal
  // sees it.
  const uint64_t total = accept_refusals_.fetch_add(1, std::memory_order_relaxed) + 1;
  v1::SessionReply reply;
  reply.set_seq(seq);
  SetError(&reply, reason);
  (void)client::SendMessage(fd.get(), reply, {});  // best effort: it is closed either way
  // A client retrying in a loop is refused as often as it connects: a few lines a
  // second, the rest counted into the next one written.
  uint64_t skipped = 0;
  if (!refusal_log_budget_.Take(&skipped)) return;
  kLog.Warn("refused a connection on {} from {}: {} ({} refused as they connected in all{})",
            options_.path, Describe(credentials), reason.message(), total,
            skipped == 0 ? std::string()
                         : fmt::format(", {} since the last such line not logged", skipped));
}

bool SessionServer::ServeReadable(Connection& connection) {
  for (int i = 0; i < kMaxRequestsPerWakeup; ++i) {
    v1::SessionRequest request;
    std::vector<UniqueFd> fds;
    absl::Status received = client::ReceiveMessage(connection.fd.get(), &request, &fds, 0);
    if (absl::IsDeadlineExceeded(received)) return true;  // nothing more queued
    if (absl::IsUnavailable(received)) {
      Close(connection, "the client closed the connection", /*refused=*/false);
      return false;
    }
    if (absl::IsInvalidArgument(received)) {
      SendErrorAndClose(connection, 0, received);
      return false;
    }
    if (!received.ok()) {
      Close(connection, fmt::format("cannot read from the connection: {}", received.message()));
      return false;
    }

    if (connection.session_id == 0) {
      fds.clear();  // a hello carries none; close any before answering
      if (!request.has_hello()) {
        SendErrorAndClose(connection, request.seq(),
                          absl::InvalidArgumentError(fmt::format(
                              "the first session request must be hello, not {}; send "
                              "SessionHello first (LocalSession::Attach does)",
                              client::SessionRequestName(request))));
        return false;
      }
      const v1::SessionHello& hello = request.hello();
      connection.client_name = Printable(hello.client_name(), 64);
      if (hello.protocol() != kSessionProtocol) {
        SendErrorAndClose(connection, request.seq(),
                          absl::FailedPreconditionError(fmt::format(
                              "client '{}' speaks session protocol {}, this agent speaks {}; "
                              "use a client library that matches the agent's version",
                              connection.client_name, hello.protocol(), kSessionProtocol)));
        return false;
      }
      const uint64_t session_id = next_session_id_++;
      absl::StatusOr<v1::SessionWelcome> welcome =
          handler_->OnHello(session_id, connection.credentials, hello);
      if (!welcome.ok()) {
        SendErrorAndClose(connection, request.seq(), welcome.status());
        return false;
      }
      v1::SessionReply reply;
      reply.set_seq(request.seq());
      v1::SessionWelcome* out = reply.mutable_welcome();
      *out = *std::move(welcome);
      out->set_session_id(session_id);
      out->set_uid(connection.credentials.uid);
      out->set_gid(connection.credentials.gid);
      out->set_pid(static_cast<uint32_t>(connection.credentials.pid));
      connection.session_id = session_id;
      if (std::find(out->roles().begin(), out->roles().end(), "peer") != out->roles().end()) {
        connection.same_host = transport::SameHostPeerHold(connection.credentials.pid);
      }
      StopWaitingForHello(connection);
      sessions_.fetch_add(1, std::memory_order_relaxed);
      kLog.Info("session {} opened: {} client '{}'", session_id,
                Describe(connection.credentials), connection.client_name);
      if (!Reply(connection, reply, {})) return false;
      continue;
    }

    if (request.has_hello()) {
      fds.clear();
      SendErrorAndClose(connection, request.seq(),
                        absl::InvalidArgumentError(fmt::format(
                            "session {} sent a second hello; a connection carries one "
                            "session: attach again on a new connection",
                            connection.session_id)));
      return false;
    }
    v1::SessionReply reply;
    std::vector<UniqueFd> reply_fds;
    if (request.body_case() == v1::SessionRequest::BODY_NOT_SET) {
      // A newer client's request type arrives as an unknown field: say so, keep going.
      SetError(&reply, absl::UnimplementedError(
                           "this agent does not know the session request's type (no known "
                           "body); upgrade the agent or use a matching client library"));
    } else {
      handler_->OnRequest(connection.session_id, request, std::move(fds), &reply, &reply_fds);
    }
    reply.set_seq(request.seq());
    if (!Reply(connection, reply, std::move(reply_fds))) return false;
  }
  return true;
}

bool SessionServer::Reply(Connection& connection, const v1::SessionReply& reply,
                          std::vector<UniqueFd> fds) {
  absl::Status sent = client::SendMessage(connection.fd.get(), reply, RawFds(fds));
  if (absl::IsInvalidArgument(sent)) {
    // Too large or too many descriptors: the handler's bug, not the client's.
    kLog.Error("session {}: cannot send the reply to request seq {}: {}", connection.session_id,
               reply.seq(), sent.message());
    v1::SessionReply error;
    error.set_seq(reply.seq());
    SetError(&error, absl::InternalError(fmt::format(
                         "the agent could not send its reply: {}; report this agent bug",
                         sent.message())));
    sent = client::SendMessage(connection.fd.get(), error, {});
  }
  if (sent.ok()) return true;
  if (absl::IsResourceExhausted(sent)) {
    Close(connection,
          "the client is not reading its replies (its socket queue is full): disconnected");
  } else if (absl::IsUnavailable(sent)) {
    Close(connection, "the client closed the connection");
  } else {
    Close(connection, fmt::format("cannot send a reply: {}", sent.message()));
  }
  return false;
}

void SessionServer::SendErrorAndClose(Connection& connection, uint64_t seq,
                                      const absl::Status& error) {
  v1::SessionReply reply;
  reply.set_seq(seq);
  SetError(&reply, error);
  (void)client::SendMessage(connection.fd.get(), reply, {});  // best effort: closing anyway
  Close(connection, std::string(error.message()));
}

void SessionServer::Close(Connection& connection, std::string_view reason, bool refused,
                          bool logged) {
  const int fd = connection.fd.get();
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, fd, nullptr);
  StopWaitingForHello(connection);
  const uint64_t session_id = connection.session_id;
  if (logged) {
    // The caller logged it (rate-limited: floods of connections without a hello).
  } else if (session_id != 0) {
    const bool warn = reason.find("not reading") != std::string_view::npos;
    kLog.Log(warn ? log::Level::kWarn : log::Level::kInfo, "session {} closed ({}): {} client '{}'",
             session_id, reason, Describe(connection.credentials), connection.client_name);
  } else if (!refused) {
    kLog.Debug("a connection on {} from {} closed before its hello ({})", options_.path,
               Describe(connection.credentials), reason);
  } else {
    kLog.Warn("refused a connection on {} from {}{}: {}", options_.path,
              Describe(connection.credentials),
              connection.client_name.empty() ? "" : " client '" + connection.client_name + "'",
              reason);
  }
  connections_.erase(fd);  // closes the socket; `connection` is gone from here on
  if (session_id != 0) {
    sessions_.fetch_sub(1, std::memory_order_relaxed);
    handler_->OnClose(session_id);
  }
}

}  // namespace kvagent::agent

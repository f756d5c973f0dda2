// Shared by the session server tests: TestHandler (what an agent would do, minus the
// policy), a server on a short temporary path, raw-socket helpers and forked clients.
// Used by tests/unit/session/session_{server,access}_test.cc only.
#pragma once

#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "agent/session_server.h"
#include "base/format.h"
#include "base/text.h"
#include "catch2/catch.hpp"
#include "client/local_session.h"
#include "client/session_wire.h"
#include "fmt/format.h"
#include "tests/unit/session/test_util.h"

namespace kvagent::agent::session_test {

using client::LocalSession;
using kvagent::testing::TempDir;

inline std::string Message(const absl::Status& status) { return std::string(status.message()); }

inline uint64_t SizeOf(int fd) {
  struct stat st {};
  return fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

inline unsigned char Pattern(size_t i) { return static_cast<unsigned char>(i * 7 + 3); }

// What an agent would do, minus the policy: keeps shared memory per session, allocates
// memfds, gives descriptors of kept objects to peers; records every call.
class TestHandler : public SessionHandler {
 public:
  struct Hello {
    uint64_t session_id;
    PeerCredentials credentials;
    std::string client_name;
  };

  absl::StatusOr<v1::SessionWelcome> OnHello(uint64_t session_id,
                                             const PeerCredentials& credentials,
                                             const v1::SessionHello& hello) override {
    absl::MutexLock lock(&mu_);
    hellos_.push_back({session_id, credentials, hello.client_name()});
    if (hello.client_name() == "refuse-me") {
      return absl::PermissionDeniedError("uid is not allowed here; ask the operator");
    }
    v1::SessionWelcome welcome;
    welcome.set_agent("test-agent");
    welcome.set_token(fmt::format("token-{}", session_id));
    welcome.set_principal(fmt::format("session:{} ({})", session_id,
                                      Printable(hello.client_name(), 64)));
    welcome.add_roles("engine");
    return welcome;
  }

  void OnRequest(uint64_t session_id, const v1::SessionRequest& request,
                 std::vector<UniqueFd> fds, v1::SessionReply* reply,
                 std::vector<UniqueFd>* reply_fds) override {
    if (request.has_share() && request.share().label() == "slow") {
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
    }
    absl::MutexLock lock(&mu_);
    ++requests_;
    auto fail = [&](absl::Status status) {
      reply->set_error_code(static_cast<int>(status.code()));
      reply->set_error_message(std::string(status.message()));
      reply_fds->clear();
    };
    switch (request.body_case()) {
      case v1::SessionRequest::kShare: {
        if (fds.size() != 1) {
          return fail(absl::InvalidArgumentError(
              fmt::format("share wants 1 descriptor, got {}", fds.size())));
        }
        const uint64_t handle = next_handle_++;
        const uint64_t bytes = SizeOf(fds[0].get());
        objects_[handle] = Object{session_id, std::move(fds[0]), bytes};
        FillInfo(reply->mutable_memory(), handle, bytes, request.share().label());
        return;
      }
      case v1::SessionRequest::kAllocate: {
        const uint64_t bytes = request.allocate().bytes();
        UniqueFd fd(memfd_create("kvs-alloc", MFD_CLOEXEC | MFD_ALLOW_SEALING));
        if (!fd || ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
          return fail(absl::ResourceExhaustedError("memfd failed"));
        }
        std::vector<unsigned char> pattern(bytes);
        for (size_t i = 0; i < bytes; ++i) pattern[i] = Pattern(i);
        if (pwrite(fd.get(), pattern.data(), bytes, 0) != static_cast<ssize_t>(bytes) ||
            fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
          return fail(absl::InternalError("memfd write failed"));
        }
        const uint64_t handle = next_handle_++;
        reply_fds->emplace_back(dup(fd.get()));
        objects_[handle] = Object{session_id, std::move(fd), bytes};
        FillInfo(reply->mutable_memory(), handle, bytes, request.allocate().label());
        reply->mutable_memory()->set_sealed(true);
        return;
      }
      case v1::SessionRequest::kFree: {
        auto it = objects_.find(request.free().handle());
        if (it == objects_.end() || it->second.session_id != session_id) {
          return fail(absl::NotFoundError(fmt::format(
              "memory handle {} is not this session's", request.free().handle())));
        }
        objects_.erase(it);
        return;
      }
      case v1::SessionRequest::kPeerMemory: {
        ++peer_memory_requests_;
        for (uint64_t id : request.peer_memory().memory_ids()) {
          auto it = objects_.find(id);
          if (it == objects_.end()) {
            return fail(absl::NotFoundError(fmt::format("memory id {} is not exported", id)));
          }
          reply->mutable_peer_memory()->add_memory_ids(id);
          reply->mutable_peer_memory()->add_bytes(it->second.bytes);
          reply_fds->emplace_back(dup(it->second.fd.get()));
        }
        return;
      }
      default:
        return fail(absl::UnimplementedError("not in this test"));
    }
  }

  void OnClose(uint64_t session_id) override {
    absl::MutexLock lock(&mu_);
    closes_.push_back(session_id);
    for (auto it = objects_.begin(); it != objects_.end();) {
      it = it->second.session_id == session_id ? objects_.erase(it) : std::next(it);
    }
  }

  std::vector<Hello> hellos() {
    absl::MutexLock lock(&mu_);
    return hellos_;
  }
  std::vector<uint64_t> closes() {
    absl::MutexLock lock(&mu_);
    return closes_;
  }
  size_t close_count(uint64_t session_id) {
    absl::MutexLock lock(&mu_);
    return static_cast<size_t>(std::count(closes_.begin(), closes_.end(), session_id));
  }
  bool closed(uint64_t session_id) { return close_count(session_id) > 0; }
  // A duplicate of the descriptor kept for `handle`.
  UniqueFd Kept(uint64_t handle) {
    absl::MutexLock lock(&mu_);
    auto it = objects_.find(handle);
    return it == objects_.end() ? UniqueFd() : UniqueFd(dup(it->second.fd.get()));
  }
  size_t objects() {
    absl::MutexLock lock(&mu_);
    return objects_.size();
  }
  int peer_memory_requests() {
    absl::MutexLock lock(&mu_);
    return peer_memory_requests_;
  }

 private:
  struct Object {
    uint64_t session_id = 0;
    UniqueFd fd;
    uint64_t bytes = 0;
  };
  static void FillInfo(v1::MemoryHandleInfo* info, uint64_t handle, uint64_t bytes,
                       const std::string& label) {
    info->set_handle(handle);
    info->set_bytes(bytes);
    info->set_kind("memfd");
    info->set_label(label);
  }

  absl::Mutex mu_;
  std::vector<Hello> hellos_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> closes_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Object> objects_ ABSL_GUARDED_BY(mu_);
  uint64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;
  int requests_ ABSL_GUARDED_BY(mu_) = 0;
  int peer_memory_requests_ ABSL_GUARDED_BY(mu_) = 0;
};

// A server on <tmp>/a.session with a TestHandler.
struct Fixture {
  explicit Fixture(SessionServerOptions options = {}) {
    if (options.path.empty()) options.path = dir / "a.session";
    auto started = SessionServer::Start(options, &handler);
    REQUIRE(started.ok());
    server = std::move(started).value();
  }
  const std::string& path() const { return server->path(); }
  std::unique_ptr<LocalSession> Attach(const std::string& name = "engine-a",
                                       uint32_t timeout_ms = 10000) {
    auto session = LocalSession::Attach(path(), name, timeout_ms);
    REQUIRE(session.ok());
    return std::move(session).value();
  }

  TempDir dir;
  TestHandler handler;
  std::unique_ptr<SessionServer> server;
};

// A raw connection to the session socket, for abuse tests.
inline UniqueFd RawConnect(const std::string& path) {
  auto address = client::MakeUnixAddress(path);
  REQUIRE(address.ok());
  UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  REQUIRE(fd.valid());
  REQUIRE(connect(fd.get(), reinterpret_cast<const sockaddr*>(&address->address),
                  address->length) == 0);
  return fd;
}

inline std::string Serialized(const v1::SessionRequest& request) {
  std::string bytes;
  REQUIRE(request.SerializeToString(&bytes));
  return bytes;
}

inline v1::SessionRequest Hello(uint64_t seq, const std::string& name = "raw",
                                uint32_t protocol = 1) {
  v1::SessionRequest request;
  request.set_seq(seq);
  request.mutable_hello()->set_client_name(name);
  request.mutable_hello()->set_protocol(protocol);
  return request;
}

inline v1::SessionRequest Free(uint64_t seq, uint64_t handle) {
  v1::SessionRequest request;
  request.set_seq(seq);
  request.mutable_free()->set_handle(handle);
  return request;
}

// Replies read until the server closes the connection (or 5 s pass: `closed` false).
struct Transcript {
  std::vector<v1::SessionReply> replies;
  bool closed = false;
};
inline Transcript ReadUntilClosed(int fd) {
  Transcript transcript;
  while (true) {
    v1::SessionReply reply;
    std::vector<UniqueFd> fds;
    absl::Status status = client::ReceiveMessage(fd, &reply, &fds, 5000);
    if (absl::IsUnavailable(status)) {
      transcript.closed = true;
      return transcript;
    }
    if (!status.ok()) return transcript;
    transcript.replies.push_back(reply);
  }
}

inline v1::SessionReply ReadOne(int fd) {
  v1::SessionReply reply;
  std::vector<UniqueFd> fds;
  absl::Status status = client::ReceiveMessage(fd, &reply, &fds, 5000);
  INFO(status.ToString());
  REQUIRE(status.ok());
  return reply;
}

// A child process, forked while this process has no other thread, that waits for "go",
// attaches to `path` (after dropping to uid/gid 65534 when asked) and reports the
// result on a pipe, then exits or kills itself.
class ChildClient {
 public:
  enum class End { kExit, kKillSelf };
  ChildClient(End end, bool drop_to_nobody) {
    int to_child[2], from_child[2];
    REQUIRE(pipe2(to_child, O_CLOEXEC) == 0);
    REQUIRE(pipe2(from_child, O_CLOEXEC) == 0);
    pid_ = fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      close(to_child[1]);
      close(from_child[0]);
      RunChild(to_child[0], from_child[1], end, drop_to_nobody);
    }
    close(to_child[0]);
    close(from_child[1]);
    go_.reset(to_child[1]);
    result_.reset(from_child[0]);
  }
  ~ChildClient() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  // Sends the path; returns what the child reported: "ok <session id>" or
  // "error <code> <message>".
  std::string Attach(const std::string& path) {
    const std::string line = path + "\n";
    REQUIRE(write(go_.get(), line.data(), line.size()) == static_cast<ssize_t>(line.size()));
    std::string report;
    char buffer[512];
    ssize_t n;
    while ((n = read(result_.get(), buffer, sizeof(buffer))) > 0) {
      report.append(buffer, static_cast<size_t>(n));
      if (report.find('\n') != std::string::npos) break;
    }
    return report;
  }
  // Waits for the child to end; returns its wait status.
  int Reap() {
    int status = 0;
    REQUIRE(waitpid(pid_, &status, 0) == pid_);
    reaped_ = true;
    return status;
  }
  pid_t pid() const { return pid_; }

 private:
  [[noreturn]] static void RunChild(int go, int out, End end, bool drop_to_nobody) {
    auto report = [out](const std::string& text) {
      const std::string line = text + "\n";
      (void)!write(out, line.data(), line.size());
    };
    std::string path;
    char c;
    while (read(go, &c, 1) == 1 && c != '\n') path += c;
    if (drop_to_nobody && (setgroups(0, nullptr) != 0 || setgid(65534) != 0 ||
                           setuid(65534) != 0)) {
      report(fmt::format("error setuid: {}", std::strerror(errno)));
      _exit(3);
    }
    auto session = LocalSession::Attach(path, "child", 5000);
    if (!session.ok()) {
      report(fmt::format("error {} {}", static_cast<int>(session.status().code()),
                         session.status().message()));
      _exit(1);
    }
    report(fmt::format("ok {}", (*session)->welcome().session_id()));
    if (end == End::kKillSelf) raise(SIGKILL);
    _exit(0);  // no destructors: the kernel closes the socket, as on a crash
  }

  pid_t pid_ = -1;
  bool reaped_ = false;
  UniqueFd go_;
  UniqueFd result_;
};

inline uint64_t SessionIdOf(const std::string& report) {
  REQUIRE(report.rfind("ok ", 0) == 0);
  return std::stoull(report.substr(3));
}

}  // namespace kvagent::agent::session_test

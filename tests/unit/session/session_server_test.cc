// SessionServer and LocalSession together: a test SessionHandler that keeps shared
// memory, allocates memfds and hands out peers' descriptors, a real server on a socket
// under /tmp, and real clients (LocalSession, raw sockets, forked processes).
#include "agent/session_server.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/format.h"
#include "catch2/catch.hpp"
#include "client/local_session.h"
#include "client/session_wire.h"
#include "fmt/format.h"
#include "tests/unit/session/session_fixture.h"
#include "tests/unit/session/test_util.h"
#include "tests/unit/text_count.h"

namespace kvagent::agent {
namespace {

using client::LocalSession;
using testing::CountOpenFds;
using testing::MakeMemfd;
using testing::Occurrences;
using testing::Mapping;
using testing::SendRaw;
using testing::TempDir;
using testing::WaitFor;
using namespace session_test;  // NOLINT: the fixture's helpers

TEST_CASE("Hello gives a welcome with the caller's credentials as the kernel says") {
  Fixture f;
  auto session = f.Attach("engine-a");
  const v1::SessionWelcome& welcome = session->welcome();
  CHECK(welcome.agent() == "test-agent");
  CHECK(welcome.session_id() == 1);
  CHECK(session->token() == "token-1");
  CHECK(welcome.uid() == getuid());
  CHECK(welcome.gid() == getgid());
  CHECK(welcome.pid() == static_cast<uint32_t>(getpid()));
  CHECK(welcome.roles_size() == 1);

  auto hellos = f.handler.hellos();
  REQUIRE(hellos.size() == 1);
  CHECK(hellos[0].credentials.uid == getuid());
  CHECK(hellos[0].credentials.gid == getgid());
  CHECK(hellos[0].credentials.pid == getpid());
  CHECK(hellos[0].client_name == "engine-a");
  // The listener is this process too.
  CHECK(session->agent_credentials().pid == getpid());
  CHECK(session->agent_credentials().uid == getuid());
  CHECK(f.server->sessions() == 1);

  auto second = f.Attach("engine-b");
  CHECK(second->welcome().session_id() == 2);
  CHECK(f.server->sessions() == 2);
}

TEST_CASE("Memory shared in either direction is the same memory") {
  Fixture f;
  auto session = f.Attach();
  constexpr size_t kBytes = 2 * 4096;

  SECTION("ShareMemory: the client's memfd, seen by the agent") {
    UniqueFd memfd = MakeMemfd(kBytes);
    auto info = session->ShareMemory(memfd.get(), "kv-pool");
    REQUIRE(info.ok());
    CHECK(info->bytes() == kBytes);
    CHECK(info->label() == "kv-pool");
    CHECK(fcntl(memfd.get(), F_GETFD) >= 0);  // still the caller's

    UniqueFd kept = f.handler.Kept(info->handle());
    REQUIRE(kept.valid());
    Mapping client_side(memfd.get(), kBytes);
    Mapping agent_side(kept.get(), kBytes);
    client_side.bytes()[5000] = 0xa5;
    CHECK(agent_side.bytes()[5000] == 0xa5);
    agent_side.bytes()[17] = 0x3c;
    CHECK(client_side.bytes()[17] == 0x3c);

    CHECK(session->FreeMemory(info->handle()).ok());
    absl::Status again = session->FreeMemory(info->handle());
    CHECK(again.code() == absl::StatusCode::kNotFound);
    CHECK_THAT(Message(again), Catch::Contains("is not this session's"));
  }

  SECTION("AllocateMemory: the agent's memfd, seen by the client") {
    auto allocated = session->AllocateMemory("staging", kBytes);
    REQUIRE(allocated.ok());
    auto& [info, fd] = *allocated;
    CHECK(info.bytes() == kBytes);
    CHECK(info.sealed());
    REQUIRE(SizeOf(fd.get()) == kBytes);
    Mapping client_side(fd.get(), kBytes);
    bool pattern_ok = true;
    for (size_t i = 0; i < kBytes; ++i) pattern_ok &= client_side.bytes()[i] == Pattern(i);
    CHECK(pattern_ok);
    client_side.bytes()[100] = 0x77;
    UniqueFd kept = f.handler.Kept(info.handle());
    Mapping agent_side(kept.get(), kBytes);
    CHECK(agent_side.bytes()[100] == 0x77);
    CHECK(ftruncate(fd.get(), 0) != 0);  // sealed: cannot shrink
  }

  SECTION("PeerMemory: descriptors of kept objects, in order, 64 per request") {
    std::vector<uint64_t> ids;
    std::vector<UniqueFd> memfds;
    for (int i = 0; i < 3; ++i) {
      memfds.push_back(MakeMemfd(4096 * (i + 1)));
      auto info = session->ShareMemory(memfds.back().get(), fmt::format("m{}", i));
      REQUIRE(info.ok());
      ids.push_back(info->handle());
    }
    std::vector<uint64_t> asked;
    for (int i = 0; i < 100; ++i) asked.push_back(ids[static_cast<size_t>(i) % 3]);
    auto peers = session->PeerMemory(asked);
    REQUIRE(peers.ok());
    REQUIRE(peers->size() == 100);
    CHECK(f.handler.peer_memory_requests() == 2);  // 64 + 36
    for (size_t i = 0; i < 100; ++i) {
      CHECK((*peers)[i].first == asked[i]);
      CHECK(SizeOf((*peers)[i].second.get()) == 4096 * (i % 3 + 1));
    }
    Mapping peer_view((*peers)[1].second.get(), 8192);
    Mapping owner_view(memfds[1].get(), 8192);
    owner_view.bytes()[8000] = 0x42;
    CHECK(peer_view.bytes()[8000] == 0x42);

    auto unknown = session->PeerMemory({ids[0], 9999});
    CHECK(unknown.status().code() == absl::StatusCode::kNotFound);
    CHECK(session->PeerMemory({})->empty());
  }
  SECTION("Errors of the handler come back with their code and message, and the session "
          "goes on") {
    auto share = session->ShareMemory(-1, "bad");
    CHECK(share.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(session->FreeMemory(12345).code() == absl::StatusCode::kNotFound);
    UniqueFd memfd = MakeMemfd(4096);
    CHECK(session->ShareMemory(memfd.get(), "fine").ok());
  }
}

TEST_CASE("One LocalSession serves several threads one request at a time") {
  Fixture f;
  auto session = f.Attach();
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        auto allocated = session->AllocateMemory("t", 4096);
        if (!allocated.ok() || !session->FreeMemory(allocated->first.handle()).ok()) ++failures;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(failures == 0);
  CHECK(f.handler.objects() == 0);
}

TEST_CASE("A reply that comes after its call timed out is discarded, not misread") {
  Fixture f;
  auto session = f.Attach("slow-engine", 150);
  UniqueFd memfd = MakeMemfd(4096);
  auto slow = session->ShareMemory(memfd.get(), "slow");  // the handler takes 400 ms
  CHECK(slow.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(Message(slow.status()), Catch::Contains("no reply from the agent"));
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the late reply is queued
  // The next call skips the late reply (seq 2) and gets its own (seq 3).
  auto next = session->AllocateMemory("next", 4096);
  REQUIRE(next.ok());
  CHECK(next->first.label() == "next");
}

TEST_CASE("OnClose runs once when the client object is destroyed") {
  Fixture f;
  auto session = f.Attach();
  const uint64_t id = session->welcome().session_id();
  UniqueFd memfd = MakeMemfd(4096);
  REQUIRE(session->ShareMemory(memfd.get(), "kv").ok());
  CHECK(f.handler.objects() == 1);
  session.reset();
  REQUIRE(WaitFor([&] { return f.handler.closed(id); }));
  CHECK(f.handler.close_count(id) == 1);
  CHECK(f.server->sessions() == 0);
  CHECK(f.handler.objects() == 0);
}


TEST_CASE("OnClose runs when the client process exits or is killed") {
  // Forked before the server's thread starts: the children are single-threaded copies.
  ChildClient exits(ChildClient::End::kExit, false);
  ChildClient killed(ChildClient::End::kKillSelf, false);
  Fixture f;

  const uint64_t first = SessionIdOf(exits.Attach(f.path()));
  CHECK(WIFEXITED(exits.Reap()));
  REQUIRE(WaitFor([&] { return f.handler.closed(first); }));

  const uint64_t second = SessionIdOf(killed.Attach(f.path()));
  const int status = killed.Reap();
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
  REQUIRE(WaitFor([&] { return f.handler.closed(second); }));
  CHECK(f.server->sessions() == 0);

  auto hellos = f.handler.hellos();
  REQUIRE(hellos.size() == 2);
  CHECK(hellos[0].credentials.pid == exits.pid());
  CHECK(hellos[1].credentials.pid == killed.pid());
}

TEST_CASE("Protocol abuse gets an error reply or a close, leaks nothing, and the server "
          "goes on serving") {
  Fixture f;
  UniqueFd memfd = MakeMemfd(4096);
  const int before = CountOpenFds();

  SECTION("a first request that is not hello") {
    UniqueFd raw = RawConnect(f.path());
    REQUIRE(SendRaw(raw.get(), Serialized(Free(5, 1)), {memfd.get()}) > 0);
    Transcript t = ReadUntilClosed(raw.get());
    CHECK(t.closed);
    REQUIRE(t.replies.size() == 1);
    CHECK(t.replies[0].seq() == 5);
    CHECK(t.replies[0].error_code() == static_cast<int>(absl::StatusCode::kInvalidArgument));
    CHECK_THAT(t.replies[0].error_message(), Catch::Contains("must be hello, not free"));
  }
  SECTION("garbage bytes") {
    UniqueFd raw = RawConnect(f.path());
    REQUIRE(SendRaw(raw.get(), "\xff\xff\xff\xff\xff\xff\xff\xff") > 0);
    Transcript t = ReadUntilClosed(raw.get());
    CHECK(t.closed);
    REQUIRE(t.replies.size() == 1);
    CHECK(t.replies[0].error_code() == static_cast<int>(absl::StatusCode::kInvalidArgument));
    CHECK_THAT(t.replies[0].error_message(), Catch::Contains("malformed protobuf wire format"));
  }
  SECTION("a second hello") {
    UniqueFd raw = RawConnect(f.path());
    REQUIRE(SendRaw(raw.get(), Serialized(Hello(1))) > 0);
    v1::SessionReply welcome = ReadOne(raw.get());
    REQUIRE(welcome.has_welcome());
    const uint64_t id = welcome.welcome().session_id();
    REQUIRE(SendRaw(raw.get(), Serialized(Hello(2))) > 0);
    Transcript t = ReadUntilClosed(raw.get());
    CHECK(t.closed);
    REQUIRE(t.replies.size() == 1);
    CHECK(t.replies[0].seq() == 2);
    CHECK_THAT(t.replies[0].error_message(), Catch::Contains("second hello"));
    REQUIRE(WaitFor([&] { return f.handler.closed(id); }));
  }
  SECTION("65 descriptors") {
    UniqueFd raw = RawConnect(f.path());
    REQUIRE(SendRaw(raw.get(), Serialized(Hello(1))) > 0);
    const uint64_t id = ReadOne(raw.get()).welcome().session_id();
    v1::SessionRequest share;
    share.set_seq(2);
    share.mutable_share()->set_label("many");
    REQUIRE(SendRaw(raw.get(), Serialized(share), std::vector<int>(65, memfd.get())) > 0);
    Transcript t = ReadUntilClosed(raw.get());
    CHECK(t.closed);
    REQUIRE(t.replies.size() == 1);
    CHECK(t.replies[0].error_code() == static_cast<int>(absl::StatusCode::kInvalidArgument));
    CHECK_THAT(t.replies[0].error_message(), Catch::Contains("more than 64 descriptors"));
    REQUIRE(WaitFor([&] { return f.handler.closed(id); }));
    CHECK(f.handler.objects() == 0);
  }
  SECTION("an oversized datagram") {
    UniqueFd raw = RawConnect(f.path());
    REQUIRE(SendRaw(raw.get(), Serialized(Hello(1))) > 0);
    const uint64_t id = ReadOne(raw.get()).welcome().session_id();
    REQUIRE(SendRaw(raw.get(), std::string(70000, '\0'), {memfd.get()}) > 0);
    Transcript t = ReadUntilClosed(raw.get());
    CHECK(t.closed);
    REQUIRE(t.replies.size() == 1);
    CHECK_THAT(t.replies[0].error_message(), Catch::Contains("over the limit of 65536 bytes"));
    REQUIRE(WaitFor([&] { return f.handler.closed(id); }));
  }
  SECTION("a hello of another protocol version") {
    UniqueFd raw = RawConnect(f.path());
    REQUIRE(SendRaw(raw.get(), Serialized(Hello(1, "future", 2))) > 0);
    Transcript t = ReadUntilClosed(raw.get());
    CHECK(t.closed);
    REQUIRE(t.replies.size() == 1);
    CHECK(t.replies[0].error_code() == static_cast<int>(absl::StatusCode::kFailedPrecondition));
    CHECK_THAT(t.replies[0].error_message(), Catch::Contains("protocol 2"));
  }
  SECTION("a request type the agent does not know is UNIMPLEMENTED; the session goes on") {
    UniqueFd raw = RawConnect(f.path());
    REQUIRE(SendRaw(raw.get(), Serialized(Hello(1))) > 0);
    const uint64_t id = ReadOne(raw.get()).welcome().session_id();
    // seq 2, then field 99 (varint 1): an unknown field, so no body.
    REQUIRE(SendRaw(raw.get(), std::string("\x08\x02\x98\x06\x01", 5)) > 0);
    v1::SessionReply unknown = ReadOne(raw.get());
    CHECK(unknown.seq() == 2);
    CHECK(unknown.error_code() == static_cast<int>(absl::StatusCode::kUnimplemented));
    REQUIRE(SendRaw(raw.get(), Serialized(Free(3, 77))) > 0);
    CHECK(ReadOne(raw.get()).error_code() == static_cast<int>(absl::StatusCode::kNotFound));
    raw.reset();
    REQUIRE(WaitFor([&] { return f.handler.closed(id); }));
  }
  SECTION("a client that does not read its replies is disconnected") {
    UniqueFd raw = RawConnect(f.path());
    REQUIRE(SendRaw(raw.get(), Serialized(Hello(1))) > 0);
    const uint64_t id = ReadOne(raw.get()).welcome().session_id();
    const std::string request = Serialized(Free(2, 77));
    for (int i = 0; i < 100000 && !f.handler.closed(id); ++i) {
      if (SendRaw(raw.get(), request, {}, MSG_DONTWAIT) < 0) {
        if (errno != EAGAIN) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    REQUIRE(WaitFor([&] { return f.handler.closed(id); }));
    CHECK(f.server->sessions() == 0);
  }

  REQUIRE(WaitFor([&] { return f.server->sessions() == 0; }));
  CHECK(CountOpenFds() == before);

  // A good client is served as before.
  auto session = f.Attach("good");
  UniqueFd good = MakeMemfd(4096);
  CHECK(session->ShareMemory(good.get(), "kv").ok());
}

TEST_CASE("A refused hello is the handler's status; no session, no OnClose") {
  Fixture f;
  auto refused = LocalSession::Attach(f.path(), "refuse-me");
  REQUIRE(refused.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(Message(refused.status()), Catch::Contains("uid is not allowed here"));
  CHECK_THAT(Message(refused.status()), Catch::Contains(f.path()));
  CHECK(f.server->sessions() == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(f.handler.closes().empty());
  CHECK(f.Attach("welcome")->welcome().session_id() == 2);
}

TEST_CASE("Sessions ended and not released yet count against --max-sessions") {
  std::atomic<uint64_t> releasing{2};
  SessionServerOptions options;
  options.max_sessions = 3;
  options.releasing = [&releasing] { return releasing.load(); };
  Fixture f(options);
  auto a = f.Attach("a");
  auto refused = LocalSession::Attach(f.path(), "b");
  REQUIRE(refused.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(Message(refused.status()),
             Catch::Contains("1 sessions attached and 2 ended sessions whose regions are not "
                             "released yet reach the limit of --max-sessions (3)") &&
                 Catch::Contains("retry shortly, or raise --max-sessions"));
  CHECK(f.server->releasing_refusals() == 1);
  CHECK(f.server->accept_refusals() == 1);  // refused as it connected, too
  CHECK(f.server->sessions() == 1);
  // One released: room again; the attached one was never touched.
  releasing = 1;
  auto c = f.Attach("c");
  CHECK(c->welcome().agent() == "test-agent");
  CHECK(f.server->sessions() == 2);
  CHECK(f.server->releasing_refusals() == 1);
  CHECK(f.server->accept_refusals() == 1);
}

TEST_CASE("Connections over --max-sessions are refused with RESOURCE_EXHAUSTED") {
  SessionServerOptions options;
  options.max_sessions = 2;
  Fixture f(options);
  auto a = f.Attach("a");
  auto b = f.Attach("b");
  auto c = LocalSession::Attach(f.path(), "c");
  REQUIRE(c.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(Message(c.status()), Catch::Contains("2 sessions attached"));
  CHECK_THAT(Message(c.status()), Catch::Contains("--max-sessions (2)"));
  CHECK(f.server->accept_refusals() == 1);
  CHECK(f.server->releasing_refusals() == 0);

  // A raw client gets the refusal too, then the end of the stream.
  UniqueFd raw = RawConnect(f.path());
  SendRaw(raw.get(), Serialized(Hello(9)));  // the agent may have refused it already
  Transcript t = ReadUntilClosed(raw.get());
  CHECK(t.closed);
  REQUIRE(t.replies.size() == 1);
  CHECK(t.replies[0].error_code() == static_cast<int>(absl::StatusCode::kResourceExhausted));
  CHECK(f.server->accept_refusals() == 2);

  const uint64_t a_id = a->welcome().session_id();
  a.reset();
  REQUIRE(WaitFor([&] { return f.handler.closed(a_id); }));
  CHECK(f.Attach("d")->welcome().agent() == "test-agent");
  CHECK(f.server->accept_refusals() == 2);
}

TEST_CASE("A connection over its uid's share of those waiting for a hello is counted apart") {
  SessionServerOptions options;
  options.max_sessions = 4;  // one connection waiting for its hello per uid
  Fixture f(options);
  UniqueFd waiting = RawConnect(f.path());  // accepted first: the backlog is in order
  // The second one that sends nothing is refused at once, counted with the bounds of
  // those waiting for their hello, not with those refused as they connected.
  UniqueFd over = RawConnect(f.path());
  Transcript t = ReadUntilClosed(over.get());
  CHECK(t.closed);
  REQUIRE(t.replies.size() == 1);
  CHECK(t.replies[0].error_code() == static_cast<int>(absl::StatusCode::kResourceExhausted));
  CHECK_THAT(t.replies[0].error_message(), Catch::Contains("the bound per uid (1"));
  CHECK(f.server->waiting_refusals() == 1);
  CHECK(f.server->accept_refusals() == 0);
  CHECK(f.server->hello_timeouts() == 0);
}


std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// This process's stderr (the agent's log) goes to a file while it lives.
class StderrToFile {
 public:
  explicit StderrToFile(const std::string& path) : saved_(dup(STDERR_FILENO)) {
    std::fflush(stderr);
    UniqueFd file(open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    REQUIRE(file.valid());
    REQUIRE(dup2(file.get(), STDERR_FILENO) == STDERR_FILENO);
  }
  ~StderrToFile() {
    std::fflush(stderr);
    dup2(saved_.get(), STDERR_FILENO);
  }

 private:
  UniqueFd saved_;
};

TEST_CASE("A client refused in a loop gets a few log lines a second, the rest counted") {
  SessionServerOptions options;
  options.max_sessions = 1;
  Fixture f(options);
  auto attached = f.Attach("a");
  TempDir dir;
  const std::string log_path = dir.path() + "/refusals.log";
  constexpr int kFlood = 300;
  {
    StderrToFile capture(log_path);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kFlood; ++i) {
      UniqueFd raw = RawConnect(f.path());
      Transcript t = ReadUntilClosed(raw.get());
      REQUIRE(t.replies.size() == 1);
      REQUIRE(t.replies[0].error_code() == static_cast<int>(absl::StatusCode::kResourceExhausted));
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // The next second: one more refusal's line says how many were not logged.
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    UniqueFd raw = RawConnect(f.path());
    CHECK(ReadUntilClosed(raw.get()).closed);
    const std::string log = ReadFile(log_path);
    const size_t lines = Occurrences(log, "refused a connection on");
    INFO("log:\n" << log << "\n" << kFlood << " refused in " << seconds << " s");
    // At most kRefusalLinesPerSecond in each wall-clock second the flood touched, and
    // the one after.
    CHECK(lines <= static_cast<size_t>(SessionServer::kRefusalLinesPerSecond) *
                       (static_cast<size_t>(seconds) + 3));
    CHECK(lines >= 2);
    CHECK(Occurrences(log, fmt::format("({} refused as they connected in all, ", kFlood + 1)) == 1);
    CHECK(Occurrences(log, "since the last such line not logged") >= 1);
  }
  // Each was counted. The attached session was never touched.
  CHECK(f.server->accept_refusals() == kFlood + 1);
  CHECK(f.server->sessions() == 1);
  CHECK(attached->welcome().agent() == "test-agent");
}

TEST_CASE("What is already at the socket path: stale sockets go, live ones and files stay") {
  TempDir dir;
  TestHandler handler;
  SessionServerOptions options;
  options.path = dir / "s.session";

  SECTION("a stale socket is replaced") {
    auto address = client::MakeUnixAddress(options.path);
    REQUIRE(address.ok());
    UniqueFd dead(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    REQUIRE(bind(dead.get(), reinterpret_cast<const sockaddr*>(&address->address),
                 address->length) == 0);
    dead.reset();  // the file stays, nobody listens
    auto server = SessionServer::Start(options, &handler);
    REQUIRE(server.ok());
    CHECK(LocalSession::Attach(options.path, "after-stale").ok());
  }
  SECTION("a live socket is refused, and keeps serving") {
    auto first = SessionServer::Start(options, &handler);
    REQUIRE(first.ok());
    auto second = SessionServer::Start(options, &handler);
    REQUIRE(second.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(Message(second.status()),
               Catch::Contains("another agent is listening at " + options.path));
    CHECK(LocalSession::Attach(options.path, "still-first").ok());
  }
  SECTION("a live socket of another type (a gRPC stream socket) is refused too") {
    auto address = client::MakeUnixAddress(options.path);
    REQUIRE(address.ok());
    UniqueFd grpc(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    REQUIRE(bind(grpc.get(), reinterpret_cast<const sockaddr*>(&address->address),
                 address->length) == 0);
    REQUIRE(listen(grpc.get(), 4) == 0);
    auto server = SessionServer::Start(options, &handler);
    CHECK(server.status().code() == absl::StatusCode::kFailedPrecondition);
    auto attach = LocalSession::Attach(options.path, "wrong-socket");
    CHECK(attach.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(Message(attach.status()), Catch::Contains("not a session socket"));
  }
  SECTION("a regular file is refused and left alone") {
    { std::ofstream(options.path) << "keep me"; }
    auto server = SessionServer::Start(options, &handler);
    REQUIRE(server.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(Message(server.status()), Catch::Contains("a regular file, not a socket"));
    std::ifstream in(options.path);
    std::stringstream content;
    content << in.rdbuf();
    CHECK(content.str() == "keep me");
  }
  SECTION("a missing parent directory is created with mode 0755") {
    options.path = dir / "run/kvagent/s.session";
    auto server = SessionServer::Start(options, &handler);
    REQUIRE(server.ok());
    struct stat st {};
    REQUIRE(stat((dir / "run/kvagent").c_str(), &st) == 0);
    CHECK((st.st_mode & 07777) == 0755);
    REQUIRE(stat((dir / "run").c_str(), &st) == 0);
    CHECK((st.st_mode & 07777) == 0755);
  }
  SECTION("a parent that cannot be a directory is reported") {
    { std::ofstream(dir / "file") << "x"; }
    options.path = dir / "file/s.session";
    auto server = SessionServer::Start(options, &handler);
    REQUIRE(server.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(Message(server.status()), Catch::Contains("is not a directory"));
  }
  SECTION("a path over 107 bytes is refused with its length, at both ends") {
    options.path = dir.path() + "/" + std::string(120, 's');
    auto server = SessionServer::Start(options, &handler);
    REQUIRE(server.status().code() == absl::StatusCode::kInvalidArgument);
    const std::string length = fmt::format("{} bytes", options.path.size());
    CHECK_THAT(Message(server.status()), Catch::Contains(length));
    CHECK_THAT(Message(server.status()), Catch::Contains("107 bytes"));
    CHECK_THAT(Message(server.status()), Catch::Contains("shorter path"));
    auto attach = LocalSession::Attach(options.path, "long");
    CHECK(attach.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(attach.status()), Catch::Contains(length));
  }
}

TEST_CASE("Attaching where no agent listens says what to do") {
  TempDir dir;
  auto missing = LocalSession::Attach(dir / "kvagent.sock.session", "e");
  REQUIRE(missing.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(Message(missing.status()),
             Catch::Contains("no agent listens at " + (dir / "kvagent.sock.session")));
  CHECK_THAT(Message(missing.status()),
             Catch::Contains("--local-socket " + (dir / "kvagent.sock")));
}

TEST_CASE("Stop closes every session (OnClose each) and later calls fail fast") {
  Fixture f;
  auto a = f.Attach("a");
  auto b = f.Attach("b");
  f.server->Stop();
  CHECK(f.server->sessions() == 0);
  auto closes = f.handler.closes();
  CHECK(std::set<uint64_t>(closes.begin(), closes.end()) == std::set<uint64_t>{1, 2});
  CHECK(closes.size() == 2);
  CHECK(access(f.path().c_str(), F_OK) != 0);

  pollfd p{a->fd(), POLLIN, 0};
  REQUIRE(poll(&p, 1, 1000) == 1);
  CHECK((p.revents & (POLLHUP | POLLIN)) != 0);

  const auto start = std::chrono::steady_clock::now();
  UniqueFd memfd = MakeMemfd(4096);
  auto share = a->ShareMemory(memfd.get(), "late");
  CHECK(share.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(Message(share.status()), Catch::Contains(f.path()));
  CHECK_THAT(Message(share.status()), Catch::Contains("attach again"));
  auto again = a->FreeMemory(1);
  CHECK(again.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(Message(again), Catch::Contains("broken"));
  CHECK(b->AllocateMemory("late", 4096).status().code() == absl::StatusCode::kUnavailable);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(1));

  f.server->Stop();  // idempotent
  auto gone = LocalSession::Attach(f.path(), "after-stop");
  CHECK(gone.status().code() == absl::StatusCode::kUnavailable);
}


}  // namespace
}  // namespace kvagent::agent

#include "client/session_wire.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "proto/kvagent.pb.h"
#include "tests/unit/session/test_util.h"

namespace kvagent::client {
namespace {

using testing::CountOpenFds;
using testing::MakeMemfd;
using testing::SendRaw;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

struct Pair {
  Pair() {
    int fds[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, fds) == 0);
    a.reset(fds[0]);
    b.reset(fds[1]);
  }
  UniqueFd a, b;
};

ino_t InodeOf(int fd) {
  struct stat st {};
  REQUIRE(fstat(fd, &st) == 0);
  return st.st_ino;
}

TEST_CASE("A message and its descriptors arrive as one datagram") {
  Pair pair;
  UniqueFd memfd = MakeMemfd(4096);
  v1::SessionRequest request;
  request.set_seq(7);
  request.mutable_share()->set_label("kv");
  REQUIRE(SendMessage(pair.a.get(), request, {memfd.get(), memfd.get()}).ok());

  v1::SessionRequest received;
  std::vector<UniqueFd> fds;
  REQUIRE(ReceiveMessage(pair.b.get(), &received, &fds, 1000).ok());
  CHECK(received.seq() == 7);
  CHECK(received.share().label() == "kv");
  REQUIRE(fds.size() == 2);
  CHECK(InodeOf(fds[0].get()) == InodeOf(memfd.get()));
  CHECK(InodeOf(fds[1].get()) == InodeOf(memfd.get()));
  CHECK((fcntl(fds[0].get(), F_GETFD) & FD_CLOEXEC) != 0);
}

TEST_CASE("An empty message is not mistaken for the end of the stream") {
  Pair pair;
  v1::SessionReply empty;  // all defaults: serializes to zero bytes
  REQUIRE(empty.ByteSizeLong() == 0);
  REQUIRE(SendMessage(pair.a.get(), empty, {}).ok());
  v1::SessionReply received;
  received.set_seq(99);
  std::vector<UniqueFd> fds;
  REQUIRE(ReceiveMessage(pair.b.get(), &received, &fds, 1000).ok());
  CHECK(received.seq() == 0);

  pair.a.reset();
  absl::Status end = ReceiveMessage(pair.b.get(), &received, &fds, 1000);
  CHECK(end.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(Message(end), Catch::Contains("the peer closed the session"));
}

TEST_CASE("Receiving waits only as long as asked") {
  Pair pair;
  v1::SessionReply reply;
  std::vector<UniqueFd> fds;
  CHECK(ReceiveMessage(pair.b.get(), &reply, &fds, 0).code() ==
        absl::StatusCode::kDeadlineExceeded);
  const auto start = std::chrono::steady_clock::now();
  CHECK(ReceiveMessage(pair.b.get(), &reply, &fds, 50).code() ==
        absl::StatusCode::kDeadlineExceeded);
  CHECK(std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(45));
}

TEST_CASE("SendMessage refuses what the receiver would refuse") {
  Pair pair;
  v1::SessionRequest big;
  big.mutable_share()->set_label(std::string(kMaxSessionMessageBytes, 'x'));
  absl::Status too_big = SendMessage(pair.a.get(), big, {});
  CHECK(too_big.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(too_big), Catch::Contains("65536"));

  UniqueFd memfd = MakeMemfd(4096);
  std::vector<int> fds(kMaxSessionFds + 1, memfd.get());
  absl::Status too_many = SendMessage(pair.a.get(), v1::SessionRequest(), fds);
  CHECK(too_many.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(too_many), Catch::Contains("65 descriptors"));
  fds.pop_back();
  CHECK(SendMessage(pair.a.get(), v1::SessionRequest(), fds).ok());
}

TEST_CASE("Oversized datagrams and too many descriptors are errors that close what came") {
  Pair pair;
  UniqueFd memfd = MakeMemfd(4096);
  const int before = CountOpenFds();
  v1::SessionRequest received;
  std::vector<UniqueFd> fds;

  REQUIRE(SendRaw(pair.a.get(), std::string(kMaxSessionMessageBytes + 100, '\x08'),
                  {memfd.get(), memfd.get()}) > 0);
  absl::Status truncated = ReceiveMessage(pair.b.get(), &received, &fds, 1000);
  CHECK(truncated.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(truncated), Catch::Contains("over the limit of 65536 bytes"));
  CHECK(fds.empty());
  CHECK(CountOpenFds() == before);

  std::vector<int> many(kMaxSessionFds + 1, memfd.get());
  REQUIRE(SendRaw(pair.a.get(), "", many) >= 0);
  absl::Status ctrunc = ReceiveMessage(pair.b.get(), &received, &fds, 1000);
  CHECK(ctrunc.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(ctrunc), Catch::Contains("more than 64 descriptors"));
  CHECK(fds.empty());
  CHECK(CountOpenFds() == before);

  // The stream goes on: the next datagram is intact.
  v1::SessionRequest ok;
  ok.set_seq(3);
  REQUIRE(SendMessage(pair.a.get(), ok, {memfd.get()}).ok());
  REQUIRE(ReceiveMessage(pair.b.get(), &received, &fds, 1000).ok());
  CHECK(received.seq() == 3);
  CHECK(fds.size() == 1);
}

TEST_CASE("Bytes that do not parse say why, and their descriptors are closed") {
  Pair pair;
  UniqueFd memfd = MakeMemfd(4096);
  const int before = CountOpenFds();
  v1::SessionRequest received;
  std::vector<UniqueFd> fds;

  REQUIRE(SendRaw(pair.a.get(), "\xff\xff\xff\xff\xff\xff", {memfd.get()}) > 0);
  absl::Status garbage = ReceiveMessage(pair.b.get(), &received, &fds, 1000);
  CHECK(garbage.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(garbage), Catch::Contains("malformed protobuf wire format at byte 0"));
  CHECK_THAT(Message(garbage), Catch::Contains("kvagent.v1.SessionRequest"));
  CHECK(fds.empty());
  CHECK(CountOpenFds() == before);

  // Field 3 (share), length 3, holding field 1 (label) with bytes that are not UTF-8.
  std::string bad_utf8 = std::string("\x1a\x05\x0a\x03\xff\xfe\xfd", 7);
  REQUIRE(SendRaw(pair.a.get(), bad_utf8) > 0);
  absl::Status not_utf8 = ReceiveMessage(pair.b.get(), &received, &fds, 1000);
  CHECK(not_utf8.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(not_utf8), Catch::Contains("not UTF-8"));
}

TEST_CASE("A full peer is RESOURCE_EXHAUSTED at once, or DEADLINE_EXCEEDED after the wait") {
  Pair pair;
  v1::SessionReply reply;
  reply.set_error_message(std::string(1000, 'x'));
  absl::Status status;
  for (int i = 0; i < 100000 && status.ok(); ++i) status = SendMessage(pair.a.get(), reply, {});
  CHECK(status.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(Message(status), Catch::Contains("not reading"));
  CHECK(SendMessage(pair.a.get(), reply, {}, 30).code() == absl::StatusCode::kDeadlineExceeded);

  pair.b.reset();
  CHECK(SendMessage(pair.a.get(), reply, {}).code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("What a peer sent before closing on unread data is still received") {
  Pair pair;
  v1::SessionRequest unread;
  unread.set_seq(1);
  REQUIRE(SendMessage(pair.a.get(), unread, {}).ok());
  v1::SessionReply last;
  last.set_seq(1);
  last.set_error_code(8);
  last.set_error_message("refused");
  REQUIRE(SendMessage(pair.b.get(), last, {}).ok());
  pair.b.reset();  // closes with `unread` in its queue: `a` is reset

  v1::SessionReply received;
  std::vector<UniqueFd> fds;
  REQUIRE(ReceiveMessage(pair.a.get(), &received, &fds, 1000).ok());
  CHECK(received.error_message() == "refused");
  CHECK(ReceiveMessage(pair.a.get(), &received, &fds, 1000).code() ==
        absl::StatusCode::kUnavailable);
}

TEST_CASE("Unix socket addresses over sun_path are refused with their length") {
  CHECK(MakeUnixAddress("/tmp/a.session").ok());
  const std::string path = "/tmp/" + std::string(110, 'p');
  auto address = MakeUnixAddress(path);
  REQUIRE(address.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(address.status()), Catch::Contains("115 bytes"));
  CHECK_THAT(Message(address.status()), Catch::Contains("107 bytes"));
  CHECK_THAT(Message(address.status()), Catch::Contains("shorter path"));
  CHECK(MakeUnixAddress("/tmp/" + std::string(102, 'p')).ok());  // exactly 107
}

}  // namespace
}  // namespace kvagent::client

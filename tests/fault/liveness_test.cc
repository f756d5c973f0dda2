// The liveness door between two real agents whose metadata polls are a minute apart
// (--peer-refresh-ms 60000), so that only the door can see a hung peer: a stopped
// decode (its gRPC connection up, its door silent) is unreachable at prefill within
// 2 s, and connected again once it resumes; junk sprayed at decode's door is dropped
// and counted while the pair stays connected and moves bytes; a peer without a door
// (--liveness off, as an older kvagentd) is polled for liveness and still seen hung
// within 2 s. Waits are for states; the only bound is the 2 s the fault target sets.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>

#include "base/unique_fd.h"
#include "catch2/catch.hpp"
#include "cli/daemon_process.h"
#include "tests/fault/peer_view.h"
#include "tests/integration/agent_pair.h"

namespace kvagent::testing {
namespace {

v1::AgentStatus StatusOf(cli::AgentClient& agent) {
  auto status = agent.Status();
  REQUIRE(status.ok());
  return *status;
}

bool Pushed(const v1::PeerInfo& p) { return p.metadata_source() == "push"; }

void RequireTransferWorks(AgentPair& pair, const std::string& id) {
  pair.ResetContents();
  auto write = pair.prefill().Submit(KvWrite(id, {0, 1}, {5, 6}));
  REQUIRE(write.ok());
  auto done = pair.prefill().WaitTransfer(id, 20000);
  REQUIRE(done.ok());
  CHECK(done->phase() == v1::COMPLETED);
  CHECK(pair.PageEqual(0, 5));
  CHECK(pair.PageEqual(1, 6));
}

TEST_CASE("a hung peer is seen by its liveness door within 2 s, and is connected again once "
          "it resumes") {
  AgentPair pair(LongPolls());
  REQUIRE(MillisUntil(pair.prefill(), "decode", 5000, Pushed) >= 0);
  RequireDoorAnswering(pair);
  CHECK(StatusOf(pair.decode()).metadata_streams() == 1);

  const pid_t decode = pair.decode_process().pid();
  const uint64_t lost_before = StatusOf(pair.prefill()).liveness_peers_lost();
  HangDecode(pair, "liveness");
  CHECK(StatusOf(pair.prefill()).liveness_peers_lost() == lost_before + 1);
  const std::string why = PeerView(pair.prefill(), "decode").last_error();
  CHECK_THAT(why, Catch::Contains("liveness door at unix " + pair.decode_process().local_socket() +
                                  ".live"));
  CHECK_THAT(why, Catch::Contains("answered no ping for"));

  REQUIRE(::kill(decode, SIGCONT) == 0);
  // The 60 s poll retries an unreachable peer every period... of 60 s: what brings it
  // back sooner is the monitor's retry of unreachable peers, kicked by the loss.
  const int64_t back = MillisUntil(pair.prefill(), "decode", 90000, [](const v1::PeerInfo& p) {
    return p.state() == "connected";
  });
  std::printf("liveness: connected again %lld ms after SIGCONT\n", static_cast<long long>(back));
  REQUIRE(back >= 0);
  RequireDoorAnswering(pair);
  RequireTransferWorks(pair, "after-resume");
}

TEST_CASE("junk sprayed at a liveness door is dropped and counted; the pair stays connected") {
  AgentPair pair(LongPolls());
  REQUIRE(MillisUntil(pair.prefill(), "decode", 5000, Pushed) >= 0);
  RequireDoorAnswering(pair);
  const v1::AgentStatus before = StatusOf(pair.decode());

  UniqueFd fd(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  REQUIRE(fd.valid());
  sa_family_t family = AF_UNIX;
  REQUIRE(bind(fd.get(), reinterpret_cast<const sockaddr*>(&family), sizeof family) == 0);
  const std::string path = pair.decode_process().local_socket() + ".live";
  sockaddr_un to{};
  to.sun_family = AF_UNIX;
  REQUIRE(path.size() < sizeof to.sun_path);
  std::memcpy(to.sun_path, path.data(), path.size());

  // 4,000 datagrams in 80 batches, 20 ms apart: random bytes of random lengths, and
  // well-formed headers whose key, MAC or incarnation the door cannot accept. The
  // kernel refuses (EAGAIN) those the door's queue cannot hold between two reads
  // (max_dgram_qlen, 10 by default): they are not counted as sent. Every one sent
  // reaches the door.
  std::mt19937_64 random(17);
  uint64_t sent = 0;
  bool stayed = true;
  for (int batch = 0; batch < 80; ++batch) {
    for (int i = 0; i < 50; ++i) {
      uint8_t d[200];
      for (auto& b : d) b = static_cast<uint8_t>(random());
      size_t n = random() % sizeof d;
      if (i % 2 == 0) {
        // "KVLP", version 1, a ping, reserved 0, then random key id, incarnation,
        // nonce, seq and MAC: the exact length of a datagram.
        const uint8_t head[8] = {'K', 'V', 'L', 'P', 1, 1, 0, 0};
        std::memcpy(d, head, sizeof head);
        n = 72;
      }
      if (sendto(fd.get(), d, n, MSG_DONTWAIT, reinterpret_cast<const sockaddr*>(&to),
                 sizeof to) == static_cast<ssize_t>(n)) {
        ++sent;
      }
    }
    if (PeerView(pair.prefill(), "decode").state() != "connected") stayed = false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::printf("liveness: %llu junk datagrams sent\n", static_cast<unsigned long long>(sent));
  REQUIRE(sent > 0);
  // Every one that reached the door is counted, and none is answered.
  const auto start = std::chrono::steady_clock::now();
  while (StatusOf(pair.decode()).liveness_dropped() < before.liveness_dropped() + sent &&
         MillisSince(start) < 20000) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const v1::AgentStatus after = StatusOf(pair.decode());
  CHECK(after.liveness_dropped() == before.liveness_dropped() + sent);
  uint8_t answer[128];
  CHECK(recv(fd.get(), answer, sizeof answer, MSG_DONTWAIT) < 0);
  CHECK(stayed);
  CHECK(PeerView(pair.prefill(), "decode").state() == "connected");
  RequireDoorAnswering(pair);
  RequireTransferWorks(pair, "after-junk");
}

TEST_CASE("a peer without a liveness door (--liveness off) is polled, and a hung one is still "
          "seen within 2 s") {
  AgentPair pair;  // polls every 200 ms
  // decode's door answers, so prefill's monitor has nothing to poll and sleeps: the
  // peer without a door must wake it (it once did not, and was never polled).
  RequireDoorAnswering(pair);
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  cli::DaemonProcess old = StartOldPeer(pair, {"--liveness", "off"});
  REQUIRE(MillisUntil(pair.prefill(), "oldpeer", 5000, Pushed) >= 0);
  REQUIRE(SuspendAgent(old.pid()) == "");
  const int64_t ms = MillisUntil(pair.prefill(), "oldpeer", 5000, [](const v1::PeerInfo& p) {
    return p.state() == "unreachable";
  });
  std::printf("liveness off: SIGSTOP seen by polls after %lld ms\n", static_cast<long long>(ms));
  CHECK(ms >= 0);
  CHECK(ms <= 2000);
  CHECK_THAT(PeerView(pair.prefill(), "oldpeer").last_error(), Catch::Contains("GetMetadata"));
  // decode, which has a door, stayed connected meanwhile.
  CHECK(PeerView(pair.prefill(), "decode").state() == "connected");
  ::kill(old.pid(), SIGCONT);
  old.Kill();
}

}  // namespace
}  // namespace kvagent::testing

// The liveness door and prober over real sockets: the door answers a signed ping on
// UDP (127.0.0.1, port 0) and on its Unix datagram socket, answers nothing else and
// counts what it dropped; a prober watching a door sees it answer, and reports the
// peer lost once the door is gone (and as never answered when nothing was there), and
// keeps a Unix door whose queue junk keeps full answering, trying a refused ping again
// at once rather than after its retry interval, and keeps a Unix door answering while
// junk is sprayed at the prober's own sockets (connected to the door: refused), and
// keeps a UDP door answering while another watched peer floods the prober with
// datagrams (each door has its own connected socket).
// Waits are for states, with generous deadlines; nothing here is timed.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <atomic>
#include <random>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "agent/liveness.h"
#include "agent/liveness_wire.h"
#include "base/unique_fd.h"
#include "catch2/catch.hpp"

namespace kvagent::agent {
namespace {

constexpr uint64_t kIncarnation = 0xfeed;
constexpr char kSecret[] = "issued-to-the-watcher";

// A short folder of its own: Bazel's TEST_TMPDIR can be longer than a Unix socket path
// may be.
std::string TempPath(const std::string& name) {
  static const std::string dir = [] {
    char pattern[] = "/tmp/kvlive-XXXXXX";
    REQUIRE(mkdtemp(pattern) != nullptr);
    return std::string(pattern);
  }();
  return dir + "/" + name;
}

bool WaitFor(const std::function<bool()>& done, int limit_ms = 20000) {
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(limit_ms)) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return done();
}

// A UDP client socket aimed at 127.0.0.1:port.
// A door on 127.0.0.1 (any free UDP port) holding the watcher's key.
absl::StatusOr<std::unique_ptr<LivenessDoor>> StartUdpDoor() {
  LivenessDoorOptions options;
  options.udp_host = "127.0.0.1";
  options.incarnation = kIncarnation;
  auto door = LivenessDoor::Start(options);
  REQUIRE(door.ok());
  (*door)->Admit(kSecret);
  return door;
}

struct UdpClient {
  UniqueFd fd{socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)};
  sockaddr_in to{};
  explicit UdpClient(uint32_t port) {
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  }
  void Send(const void* data, size_t n) {
    REQUIRE(sendto(fd.get(), data, n, 0, reinterpret_cast<const sockaddr*>(&to), sizeof to) ==
            static_cast<ssize_t>(n));
  }
  // The next datagram (up to 20 s: a loaded machine), its length; -1 when none came.
  ssize_t Receive(uint8_t* out, size_t room) {
    pollfd p{fd.get(), POLLIN, 0};
    if (poll(&p, 1, 20000) != 1) return -1;
    return recv(fd.get(), out, room, 0);
  }
};

TEST_CASE("the door answers a signed ping over UDP, and junk only raises its drop count") {
  auto door = StartUdpDoor();
  REQUIRE((*door)->udp_port() != 0);
  CHECK((*door)->AnnounceFor(false) == "udp:" + std::to_string((*door)->udp_port()));
  CHECK((*door)->AnnounceFor(true).empty());  // no Unix socket asked for

  LivenessKey key(kSecret);
  LivenessKey stranger("never-issued");
  UdpClient client((*door)->udp_port());
  uint8_t d[kLivenessDatagramBytes];
  // Junk first: short, long, unknown key, bad MAC, wrong incarnation, an answer.
  client.Send("x", 1);
  uint8_t big[200] = {};
  client.Send(big, sizeof big);
  stranger.Encode({LivenessKind::kPing, stranger.id(), kIncarnation, 1, 1}, d);
  client.Send(d, sizeof d);
  key.Encode({LivenessKind::kPing, key.id(), kIncarnation, 1, 2}, d);
  d[20] ^= 1;
  client.Send(d, sizeof d);
  key.Encode({LivenessKind::kPing, key.id(), kIncarnation + 1, 1, 3}, d);
  client.Send(d, sizeof d);
  key.Encode({LivenessKind::kAnswer, key.id(), kIncarnation, 1, 4}, d);
  client.Send(d, sizeof d);
  // Then a good ping: its answer is the first datagram back (loopback keeps order, so
  // nothing was answered before it).
  key.Encode({LivenessKind::kPing, key.id(), kIncarnation, 42, 9}, d);
  client.Send(d, sizeof d);
  uint8_t back[256];
  const ssize_t n = client.Receive(back, sizeof back);
  REQUIRE(n == static_cast<ssize_t>(kLivenessDatagramBytes));
  LivenessExpectation expect{&key, kIncarnation, 0, 9, 16};
  LivenessMessage answer;
  CHECK(CheckAnswer(back, static_cast<size_t>(n),
                    [&](uint64_t nonce) { return nonce == 42 ? &expect : nullptr; },
                    &answer) == LivenessVerdict::kOk);
  CHECK(answer.seq == 9);
  CHECK(WaitFor([&] { return (*door)->dropped() == 6; }));
  CHECK((*door)->dropped() == 6);
  CHECK((*door)->answered() == 1);
}

TEST_CASE("a flood is read in bounded batches, a wake-up each window, not one per datagram") {
  auto door = StartUdpDoor();
  LivenessKey key(kSecret);
  UdpClient client((*door)->udp_port());
  uint8_t d[kLivenessDatagramBytes];
  // 2,000 pings in bursts of 100, faster than the door's window: some may overflow
  // its socket's buffer (a flood is allowed to lose pings), the rest come in batches.
  constexpr int kPings = 2000;
  uint8_t back[128];
  for (int i = 1; i <= kPings; ++i) {
    key.Encode({LivenessKind::kPing, key.id(), kIncarnation, 5, static_cast<uint64_t>(i)}, d);
    client.Send(d, sizeof d);
    if (i % 100 == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      while (recv(client.fd.get(), back, sizeof back, MSG_DONTWAIT) > 0) {
      }
    }
  }
  CHECK(WaitFor([&] { return (*door)->answered() > 0 && (*door)->wakeups() > 0; }));
  INFO("answered " << (*door)->answered() << " in " << (*door)->wakeups() << " wake-ups");
  CHECK((*door)->answered() > 0);
  // Each wake-up reads up to max_per_wake (512): far fewer wake-ups than datagrams.
  CHECK((*door)->wakeups() * 10 < (*door)->answered() + 10);
}

TEST_CASE("the door answers on its Unix datagram socket") {
  const std::string path = TempPath("door.sock.live");
  LivenessDoorOptions options;
  options.unix_path = path;
  options.incarnation = kIncarnation;
  auto door = LivenessDoor::Start(options);
  INFO(door.status().ToString());
  REQUIRE(door.ok());
  (*door)->Admit(kSecret);
  CHECK((*door)->AnnounceFor(true) == "unix:" + path);
  CHECK((*door)->AnnounceFor(false).empty());

  auto target = ResolveLivenessTarget("unix:" + path, "unix:" + TempPath("door.sock"));
  REQUIRE(target.ok());
  // A peer reached at one path cannot send this agent's pings to another socket.
  CHECK(ResolveLivenessTarget("unix:/tmp/elsewhere", "unix:" + TempPath("door.sock")).status().code() ==
        absl::StatusCode::kPermissionDenied);
  CHECK(ResolveLivenessTarget("", "unix:" + TempPath("door.sock")).status().code() ==
        absl::StatusCode::kNotFound);
  CHECK(ResolveLivenessTarget("udp:0", "127.0.0.1:5").status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(ResolveLivenessTarget("tcp:5", "127.0.0.1:5").status().code() ==
        absl::StatusCode::kInvalidArgument);
  // A peer's door path no Unix socket can hold (past sun_path, or with a NUL byte) is
  // refused with the reason, before any address is built from it.
  for (const std::string& dialed :
       {"/tmp/" + std::string(200, 'd') + ".sock", std::string("/tmp/a\0b.sock", 14)}) {
    const auto refused = ResolveLivenessTarget("unix:" + LivenessUnixPath(dialed), "unix:" + dialed);
    INFO(refused.status().ToString());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(refused.status().message()),
               Catch::Contains("liveness door (the peer's)") &&
                   (Catch::Contains("over the limit") || Catch::Contains("NUL byte")));
  }
  {
    LivenessDoorOptions long_path;
    long_path.unix_path = "/tmp/" + std::string(200, 'd') + ".sock.live";
    long_path.incarnation = kIncarnation;
    const auto refused = LivenessDoor::Start(long_path);
    INFO(refused.status().ToString());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(refused.status().message()),
               Catch::Contains("--local-socket") && Catch::Contains("over the limit"));
  }

  UniqueFd fd(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sa_family_t family = AF_UNIX;
  REQUIRE(bind(fd.get(), reinterpret_cast<const sockaddr*>(&family), sizeof family) == 0);
  LivenessKey key(kSecret);
  uint8_t d[kLivenessDatagramBytes];
  key.Encode({LivenessKind::kPing, key.id(), kIncarnation, 8, 1}, d);
  REQUIRE(sendto(fd.get(), d, sizeof d, 0, reinterpret_cast<const sockaddr*>(&target->address),
                 target->length) == static_cast<ssize_t>(sizeof d));
  pollfd p{fd.get(), POLLIN, 0};
  REQUIRE(poll(&p, 1, 20000) == 1);
  uint8_t back[128];
  CHECK(recv(fd.get(), back, sizeof back, 0) == static_cast<ssize_t>(kLivenessDatagramBytes));
  CHECK((*door)->answered() == 1);
  door->reset();
  CHECK(access(path.c_str(), F_OK) != 0);  // removed at stop
  rmdir(TempPath("").c_str());
}

struct Losses {
  absl::Mutex mu;
  std::vector<std::pair<std::string, bool>> seen;  // why, ever answered
  size_t size() {
    absl::MutexLock lock(&mu);
    return seen.size();
  }
};

// A prober that pings often and gives up soon, so a loss shows within half a second.
LivenessProberOptions QuickProbing() {
  LivenessProberOptions probing;
  probing.period_ms = 50;
  probing.retry_ms = 20;
  probing.timeout_ms = 400;
  probing.answer_grace_ms = 200;
  return probing;
}

TEST_CASE("the prober sees a door answer, then reports it lost once it is gone") {
  auto door = StartUdpDoor();
  const uint32_t port = (*door)->udp_port();

  Losses losses;
  const LivenessProberOptions probing = QuickProbing();
  auto prober = LivenessProber::Start(
      probing, [&](const std::string& name, uint64_t incarnation, const std::string& why,
                   bool ever_answered) {
        // On the prober's thread: recorded, checked on the test's (Catch is not
        // thread-safe).
        absl::MutexLock lock(&losses.mu);
        losses.seen.emplace_back(name == "decode" && incarnation == kIncarnation ? why
                                                                                 : "wrong peer",
                                 ever_answered);
      });
  REQUIRE(prober.ok());
  auto target = ResolveLivenessTarget("udp:" + std::to_string(port), "127.0.0.1:1");
  REQUIRE(target.ok());
  (*prober)->Watch("decode", kIncarnation, *target, kSecret);
  CHECK(WaitFor([&] { return (*door)->answered() >= 5; }));
  CHECK((*prober)->Answering("decode"));
  CHECK(losses.size() == 0);
  CHECK((*prober)->dropped() == 0);

  door->reset();  // the peer stops answering
  REQUIRE(WaitFor([&] { return losses.size() == 1; }));
  CHECK_FALSE((*prober)->Answering("decode"));
  {
    absl::MutexLock lock(&losses.mu);
    CHECK(losses.seen[0].second);  // it had answered
    CHECK_THAT(losses.seen[0].first, Catch::Contains("liveness door at udp 127.0.0.1:"));
  }

  // Watching a port where nothing answers: reported as never answered.
  (*prober)->Unwatch("decode");
  (*prober)->Watch("decode", kIncarnation, *target, kSecret);
  REQUIRE(WaitFor([&] { return losses.size() == 2; }));
  absl::MutexLock lock(&losses.mu);
  CHECK_FALSE(losses.seen[1].second);
  CHECK_THAT(losses.seen[1].first, Catch::Contains("never answered"));
}

TEST_CASE("a Unix door that is not there: its own socket cannot connect, the peer is lost") {
  // The prober's socket for the door cannot be connected (no socket at the path): it
  // pings from the shared socket instead, nothing answers, and the peer is reported as
  // never answered, the prober still serving its other peers.
  Losses losses;
  const LivenessProberOptions probing = QuickProbing();
  auto prober = LivenessProber::Start(
      probing, [&](const std::string& name, uint64_t, const std::string& why, bool ever) {
        absl::MutexLock lock(&losses.mu);
        losses.seen.emplace_back(name + ": " + why, ever);
      });
  REQUIRE(prober.ok());
  mkdir(TempPath("").c_str(), 0700);
  const std::string missing = TempPath("missing.sock.live");
  auto target = ResolveLivenessTarget("unix:" + missing, "unix:" + TempPath("missing.sock"));
  REQUIRE(target.ok());
  (*prober)->Watch("absent", kIncarnation, *target, kSecret);
  REQUIRE(WaitFor([&] { return losses.size() == 1; }));
  {
    absl::MutexLock lock(&losses.mu);
    CHECK_FALSE(losses.seen[0].second);
    CHECK_THAT(losses.seen[0].first,
               Catch::StartsWith("absent: ") && Catch::Contains("never answered"));
  }
  // A live door watched beside it still answers.
  auto door = StartUdpDoor();
  auto live = ResolveLivenessTarget("udp:" + std::to_string((*door)->udp_port()), "127.0.0.1:1");
  REQUIRE(live.ok());
  (*prober)->Watch("decode", kIncarnation, *live, kSecret);
  CHECK(WaitFor([&] { return (*door)->answered() >= 3; }));
  CHECK((*prober)->Answering("decode"));
  rmdir(TempPath("").c_str());
}

// A Unix door at TempPath(name + ".sock.live") and a prober with the agent's settings
// watching it as "decode", once the door has answered; losses recorded.
struct WatchedUnixDoor {
  std::string path;
  absl::StatusOr<std::unique_ptr<LivenessDoor>> door;
  absl::StatusOr<LivenessTarget> target;
  Losses losses;
  absl::StatusOr<std::unique_ptr<LivenessProber>> prober;  // last: goes first

  explicit WatchedUnixDoor(const std::string& name) {
    mkdir(TempPath("").c_str(), 0700);  // an earlier case may have removed it
    path = TempPath(name + ".sock.live");
    LivenessDoorOptions options;
    options.unix_path = path;
    options.incarnation = kIncarnation;
    door = LivenessDoor::Start(options);
    REQUIRE(door.ok());
    (*door)->Admit(kSecret);
    target = ResolveLivenessTarget("unix:" + path, "unix:" + TempPath(name + ".sock"));
    REQUIRE(target.ok());
    prober = LivenessProber::Start(
        LivenessProberOptions{},  // the agent's: pings every 600 ms, lost after 1 s
        [this](const std::string&, uint64_t, const std::string& why, bool ever_answered) {
          absl::MutexLock lock(&losses.mu);
          losses.seen.emplace_back(why, ever_answered);
        });
    REQUIRE(prober.ok());
    (*prober)->Watch("decode", kIncarnation, *target, kSecret);
    REQUIRE(WaitFor([&] { return (*door)->answered() >= 1; }));
  }
};

// The abstract Unix addresses this process's sockets are bound to, found as anyone on
// the host finds them: /proc/net/unix lists every socket with its name ("@xxxxx" for
// an autobound one); the inodes of our own fds pick ours out.
std::vector<std::string> OwnAbstractUnixAddresses() {
  std::set<std::string> inodes;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    char link[128];
    const ssize_t n = readlink(entry.path().c_str(), link, sizeof link - 1);
    if (n <= 0) continue;
    const std::string text(link, static_cast<size_t>(n));
    if (text.rfind("socket:[", 0) == 0) inodes.insert(text.substr(8, text.size() - 9));
  }
  std::ifstream table("/proc/net/unix");
  std::string line;
  std::getline(table, line);  // Num RefCount Protocol Flags Type St Inode Path
  std::vector<std::string> found;
  while (std::getline(table, line)) {
    std::istringstream fields(line);
    std::string num, refs, protocol, flags, type, state, inode, path;
    fields >> num >> refs >> protocol >> flags >> type >> state >> inode >> path;
    if (path.size() > 1 && path[0] == '@' && inodes.count(inode) > 0) {
      found.push_back(path.substr(1));
    }
  }
  return found;
}

TEST_CASE("junk sprayed at the prober's own Unix socket does not make it lose a peer") {
  // A prober's Unix socket has an abstract address, which no file mode guards: any
  // process on the host may find it (/proc/net/unix) and spray it. Its queue holds
  // 10 datagrams; a door's answer that finds it full is refused and lost. A sprayer
  // that keeps it full (one thread sending as fast as it can) must not make the
  // prober lose a live same-host peer: it did at the first timeout, every run, before
  // the prober had a socket of its own per Unix door.
  WatchedUnixDoor watched("sprayed");
  const std::vector<std::string> targets = OwnAbstractUnixAddresses();
  REQUIRE_FALSE(targets.empty());  // the prober's, at least

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> sprayed{0};
  std::atomic<uint64_t> refused_full{0};
  std::atomic<uint64_t> refused_foreign{0};  // EPERM: the socket is connected to another
  std::atomic<uint64_t> refused_other{0};
  std::thread sprayer([&] {
    UniqueFd fd(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return;  // sprayed stays 0: checked below
    std::mt19937_64 random(7);
    while (!stop.load()) {
      for (const std::string& name : targets) {
        sockaddr_un to{};
        to.sun_family = AF_UNIX;
        std::memcpy(to.sun_path + 1, name.data(), name.size());
        const socklen_t length =
            static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
        for (int i = 0; i < 20; ++i) {
          uint8_t d[kLivenessDatagramBytes];
          for (auto& b : d) b = static_cast<uint8_t>(random());
          if (sendto(fd.get(), d, sizeof d, MSG_DONTWAIT, reinterpret_cast<const sockaddr*>(&to),
                     length) == static_cast<ssize_t>(sizeof d)) {
            sprayed.fetch_add(1);
          } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            refused_full.fetch_add(1);
          } else if (errno == EPERM) {
            refused_foreign.fetch_add(1);
          } else {
            refused_other.fetch_add(1);
          }
        }
      }
      std::this_thread::yield();  // others on a loaded machine (CI) get their turn
    }
  });
  std::this_thread::sleep_for(std::chrono::seconds(3));  // three loss timeouts
  stop.store(true);
  sprayer.join();
  INFO("sprayed " << sprayed.load() << ", refused for a full queue " << refused_full.load()
                  << ", refused as not the connected peer " << refused_foreign.load()
                  << ", refused otherwise " << refused_other.load() << "; door answered "
                  << (*watched.door)->answered() << "; prober dropped " << (*watched.prober)->dropped());
  // The socket the door's answers come to took none of it.
  CHECK(refused_foreign.load() > 0);
  CHECK(refused_other.load() == 0);
  CHECK((*watched.prober)->Answering("decode"));
  {
    absl::MutexLock lock(&watched.losses.mu);
    for (const auto& [why, ever] : watched.losses.seen) UNSCOPED_INFO(why);
    CHECK(watched.losses.seen.empty());
  }
  watched.door->reset();
  rmdir(TempPath("").c_str());
}

// A door on another host, played on 127.0.0.1: a UDP socket that answers each signed
// ping after `delay` (the round trip between hosts, during which the prober waits
// for answers to gather); counts what it answered.
// A UDP socket bound to 127.0.0.1 on a free port, and the port.
UniqueFd LoopbackUdp(uint32_t* port) {
  UniqueFd fd(socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(fd.get(), reinterpret_cast<const sockaddr*>(&at), sizeof at) == 0);
  socklen_t length = sizeof at;
  REQUIRE(getsockname(fd.get(), reinterpret_cast<sockaddr*>(&at), &length) == 0);
  *port = ntohs(at.sin_port);
  return fd;
}

struct RemoteUdpDoor {
  uint32_t port = 0;
  UniqueFd fd = LoopbackUdp(&port);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> answered{0};
  std::thread thread;

  explicit RemoteUdpDoor(std::chrono::milliseconds delay) {
    thread = std::thread([this, delay] {
      LivenessKey key(kSecret);
      while (!stop.load()) {
        pollfd p{fd.get(), POLLIN, 0};
        if (poll(&p, 1, 50) != 1) continue;
        uint8_t d[kLivenessDatagramBytes + 1];
        sockaddr_storage from{};
        socklen_t from_length = sizeof from;
        const ssize_t n =
            recvfrom(fd.get(), d, sizeof d, 0, reinterpret_cast<sockaddr*>(&from), &from_length);
        LivenessMessage ping;
        if (n != static_cast<ssize_t>(kLivenessDatagramBytes) ||
            ParseLivenessDatagram(d, kLivenessDatagramBytes, &ping) != LivenessVerdict::kOk ||
            !key.Verify(d)) {
          continue;
        }
        std::this_thread::sleep_for(delay);
        key.Encode({LivenessKind::kAnswer, key.id(), kIncarnation, ping.nonce, ping.seq}, d);
        if (sendto(fd.get(), d, kLivenessDatagramBytes, 0, reinterpret_cast<const sockaddr*>(&from),
                   from_length) == static_cast<ssize_t>(kLivenessDatagramBytes)) {
          answered.fetch_add(1);
        }
      }
    });
  }
  ~RemoteUdpDoor() {
    stop.store(true);
    thread.join();
  }
};

TEST_CASE("a watched peer flooding the prober's UDP port does not make it lose another peer") {
  // Every ping shows its door the address it came from. A watched peer (mallory, a
  // plain UDP socket) reads one, then floods that address with empty datagrams. With
  // one socket shared by every UDP door, the flood kept its queue full while the
  // prober let answers gather, and the answers of a door 3 ms away were dropped: the
  // prober lost a live peer. Each door's own connected socket takes datagrams from
  // that door alone.
  RemoteUdpDoor door(std::chrono::milliseconds(5));
  Losses losses;
  auto prober = LivenessProber::Start(
      LivenessProberOptions{},  // the agent's: pings every 600 ms, lost after 1 s
      [&](const std::string& name, uint64_t, const std::string& why, bool ever_answered) {
        absl::MutexLock lock(&losses.mu);
        losses.seen.emplace_back(name + ": " + why, ever_answered);
      });
  REQUIRE(prober.ok());
  auto good = ResolveLivenessTarget("udp:" + std::to_string(door.port), "127.0.0.1:1");
  REQUIRE(good.ok());
  (*prober)->Watch("decode", kIncarnation, *good, kSecret);
  REQUIRE(WaitFor([&] { return door.answered.load() >= 1; }));

  uint32_t fake_port = 0;
  UniqueFd fake = LoopbackUdp(&fake_port);
  auto bad = ResolveLivenessTarget("udp:" + std::to_string(fake_port), "127.0.0.1:1");
  REQUIRE(bad.ok());
  (*prober)->Watch("mallory", kIncarnation, *bad, "mallory's own secret");
  sockaddr_storage prober_address{};
  socklen_t prober_length = sizeof prober_address;
  uint8_t ping[128];
  pollfd p{fake.get(), POLLIN, 0};
  REQUIRE(poll(&p, 1, 20000) == 1);
  REQUIRE(recvfrom(fake.get(), ping, sizeof ping, 0, reinterpret_cast<sockaddr*>(&prober_address),
                   &prober_length) > 0);

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> flooded{0};
  auto flood = [&] {
    while (!stop.load()) {
      for (int i = 0; i < 256; ++i) {
        if (sendto(fake.get(), "", 0, MSG_DONTWAIT,
                   reinterpret_cast<const sockaddr*>(&prober_address), prober_length) == 0) {
          flooded.fetch_add(1);
        }
      }
    }
  };
  std::thread flooder(flood), flooder2(flood);
  std::this_thread::sleep_for(std::chrono::seconds(4));  // four loss timeouts
  const uint64_t answered = door.answered.load();
  stop.store(true);
  flooder.join();
  flooder2.join();
  INFO("flooded " << flooded.load() << " datagrams; the door answered " << answered
                  << "; the prober dropped " << (*prober)->dropped());
  CHECK(flooded.load() > 0);
  CHECK((*prober)->Answering("decode"));
  absl::MutexLock lock(&losses.mu);
  for (const auto& [why, ever] : losses.seen) {
    UNSCOPED_INFO(why);
    CHECK(why.rfind("mallory: ", 0) == 0);  // it never answers: lost, alone
  }
}

TEST_CASE("junk that keeps a Unix door's queue full does not make its prober lose the peer") {
  // The kernel holds 10 datagrams (net.unix.max_dgram_qlen) for a Unix datagram socket,
  // whoever sent them, and refuses more with EAGAIN; the door empties it once a window
  // (15 ms). A sprayer refilling it every 2 ms leaves a ping a gap of a few ms in each
  // window: one retried after retry_ms (150) would miss every gap for a timeout within
  // seconds; one retried at once after a refusal finds one. (Retried every 5 ms, which
  // divides the window, the retries fell on the same points of each window and missed
  // the gap for a whole second in a CI run: the delay is now drawn from 1-5 ms.)
  WatchedUnixDoor watched("flooded");
  const std::string& path = watched.path;
  auto& door = watched.door;
  auto& target = watched.target;
  auto& prober = watched.prober;
  Losses& losses = watched.losses;

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> sprayed{0};
  std::thread sprayer([&] {
    UniqueFd fd(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sa_family_t family = AF_UNIX;
    if (!fd.valid() ||
        bind(fd.get(), reinterpret_cast<const sockaddr*>(&family), sizeof family) != 0) {
      return;  // sprayed stays 0: checked below
    }
    std::mt19937_64 random(5);
    while (!stop.load()) {
      for (int i = 0; i < 40; ++i) {
        uint8_t d[kLivenessDatagramBytes];
        for (auto& b : d) b = static_cast<uint8_t>(random());
        if (sendto(fd.get(), d, sizeof d, MSG_DONTWAIT,
                   reinterpret_cast<const sockaddr*>(&target->address),
                   target->length) == static_cast<ssize_t>(sizeof d)) {
          sprayed.fetch_add(1);
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  // At least 4 s (four timeouts), and until the flood has refused the prober a ping.
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < std::chrono::seconds(4) ||
         ((*prober)->refused() < 3 &&
          std::chrono::steady_clock::now() - start < std::chrono::seconds(30))) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const uint64_t answered_during = (*door)->answered();
  stop.store(true);
  sprayer.join();
  std::printf("flood: sprayed %llu, door dropped %llu, answered %llu; prober refused %llu\n",
              static_cast<unsigned long long>(sprayed.load()),
              static_cast<unsigned long long>((*door)->dropped()),
              static_cast<unsigned long long>(answered_during),
              static_cast<unsigned long long>((*prober)->refused()));
  INFO("sprayed " << sprayed.load() << ", door dropped " << (*door)->dropped() << ", answered "
                  << answered_during << "; prober refused " << (*prober)->refused());
  CHECK(sprayed.load() > 0);
  CHECK((*prober)->refused() >= 3);  // the flood did fill the queue when pings came
  CHECK((*prober)->Answering("decode"));
  {
    absl::MutexLock lock(&losses.mu);
    for (const auto& [why, ever] : losses.seen) UNSCOPED_INFO(why);
    CHECK(losses.seen.empty());
  }

  // A door that stops reading (its process stopped) with a full queue is still lost,
  // and the why says its queue refused the pings: a socket nobody reads takes the
  // door's place, filled until the kernel refuses more.
  door->reset();
  UniqueFd squatter(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_un at{};
  at.sun_family = AF_UNIX;
  std::memcpy(at.sun_path, path.data(), path.size());
  REQUIRE(bind(squatter.get(), reinterpret_cast<const sockaddr*>(&at), sizeof at) == 0);
  {
    UniqueFd filler(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    uint8_t d[kLivenessDatagramBytes] = {};
    int queued = 0;
    while (queued < 1000 && sendto(filler.get(), d, sizeof d, MSG_DONTWAIT,
                                   reinterpret_cast<const sockaddr*>(&at), sizeof at) > 0) {
      ++queued;
    }
    CHECK(errno == EAGAIN);
  }
  REQUIRE(WaitFor([&] { return losses.size() == 1; }));
  CHECK_FALSE((*prober)->Answering("decode"));
  {
    absl::MutexLock lock(&losses.mu);
    CHECK(losses.seen[0].second);
    CHECK_THAT(losses.seen[0].first, Catch::Contains("refused by its full queue"));
  }
  unlink(path.c_str());
  rmdir(TempPath("").c_str());
}

}  // namespace
}  // namespace kvagent::agent

#include "agent/liveness.h"

#include <pthread.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bitset>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "agent/peer_secrets.h"
#include "base/clock.h"
#include "base/interfaces.h"
#include "base/log.h"
#include "client/session_wire.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("liveness");

// One recvmmsg/sendmmsg batch. Room for one byte more than a datagram, so a longer
// one shows as MSG_TRUNC or as its length, and is dropped.
constexpr size_t kBatch = 64;
constexpr size_t kRoom = kLivenessDatagramBytes + 1;
constexpr int kAnswerWindowMs = 10;

// Left uninitialized (ForReceive and ForSend set what the kernel reads): zeroing its
// 18 KiB on every wake-up was 2 % of the door's samples at 1,000 peers.
struct Batch {
  std::array<std::array<uint8_t, kRoom>, kBatch> data;
  std::array<sockaddr_storage, kBatch> from;
  std::array<iovec, kBatch> iov;
  std::array<mmsghdr, kBatch> msgs;

  // Prepares msgs[0..n) to receive.
  void ForReceive(size_t n) {
    for (size_t i = 0; i < n; ++i) {
      iov[i] = {data[i].data(), kRoom};
      msgs[i] = {};
      msgs[i].msg_hdr.msg_name = &from[i];
      msgs[i].msg_hdr.msg_namelen = sizeof(sockaddr_storage);
      msgs[i].msg_hdr.msg_iov = &iov[i];
      msgs[i].msg_hdr.msg_iovlen = 1;
    }
  }
  // Sets msgs[i] to send data[i] (kLivenessDatagramBytes) to `to`.
  void ForSend(size_t i, const sockaddr_storage& to, socklen_t length) {
    from[i] = to;
    iov[i] = {data[i].data(), kLivenessDatagramBytes};
    msgs[i] = {};
    msgs[i].msg_hdr.msg_name = &from[i];
    msgs[i].msg_hdr.msg_namelen = length;
    msgs[i].msg_hdr.msg_iov = &iov[i];
    msgs[i].msg_hdr.msg_iovlen = 1;
  }
};

// Sends msgs[0..n) (best effort: a datagram the kernel will not take now is a ping
// or an answer lost, which the protocol tolerates). Those refused because a queue was
// full (EAGAIN: a Unix datagram socket's receiver holds net.unix.max_dgram_qlen, 10 by
// default, whoever sent them) are marked in `full` when given.
void SendAll(int fd, Batch& batch, size_t n, std::bitset<kBatch>* full = nullptr) {
  size_t done = 0;
  while (done < n) {
    int sent = sendmmsg(fd, batch.msgs.data() + done, static_cast<unsigned>(n - done),
                        MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (full != nullptr && (errno == EAGAIN || errno == EWOULDBLOCK)) full->set(done);
      ++done;  // that one failed (unreachable, buffer full): go on with the rest
      continue;
    }
    done += static_cast<size_t>(sent);
  }
}

// A ping refused by a full queue is tried again soon, not after retry_ms: the door
// empties its queue once a window (15 ms), and junk sprayed at it refills the queue
// within a few ms, so a ping gets in only in the short gap after each drain. The
// retry is 1-5 ms, drawn afresh each time: a fixed 5 ms divides the window, so its
// retries fell on the same three points of each window and could miss the gap for a
// whole timeout (a CI run: 79 refusals, none let in, the peer lost).
constexpr uint64_t kRefusedRetryMinUs = 1000;
constexpr uint64_t kRefusedRetrySpanUs = 4000;

// The delay before the `n`th retry of the peer with `nonce` (random per peer): a
// splitmix64 step, spread over [kRefusedRetryMinUs, +kRefusedRetrySpanUs).
uint64_t RefusedRetryUs(uint64_t nonce, uint64_t n) {
  uint64_t z = nonce + (n + 1) * 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return kRefusedRetryMinUs + z % kRefusedRetrySpanUs;
}

absl::StatusOr<UniqueFd> MakeEventFd() {
  UniqueFd fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!fd) {
    return absl::ResourceExhaustedError(
        fmt::format("liveness: eventfd failed: {}; raise the open-files limit", strerror(errno)));
  }
  return fd;
}

void Signal(int fd) {
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(fd, &one, sizeof one);
}

// The address of a liveness door's Unix socket (client::MakeUnixAddress's checks), or why
// `path` cannot be one; `whose` says where the path came from.
absl::StatusOr<client::UnixAddress> DoorAddress(const std::string& path, std::string_view whose) {
  absl::StatusOr<client::UnixAddress> address = client::MakeUnixAddress(path);
  if (!address.ok()) {
    return absl::InvalidArgumentError(
        fmt::format("liveness door ({}): {}", whose, address.status().message()));
  }
  return address;
}

// Resolves HOST (a name or a numeric address, brackets allowed) and PORT for UDP.
absl::StatusOr<LivenessTarget> ResolveUdp(std::string host, uint32_t port, bool passive) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    return absl::UnavailableError(fmt::format("cannot resolve '{}' for UDP: {}", host,
                                              rc != 0 ? gai_strerror(rc) : "no address"));
  }
  LivenessTarget target;
  std::memcpy(&target.address, found->ai_addr, found->ai_addrlen);
  target.length = found->ai_addrlen;
  freeaddrinfo(found);
  target.text = fmt::format("udp {}:{}", host, port);
  return target;
}

uint64_t Random64() {
  std::string bytes = RandomBytes(8);
  uint64_t v = 0;
  std::memcpy(&v, bytes.data(), 8);
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------------
// The door.

absl::StatusOr<std::unique_ptr<LivenessDoor>> LivenessDoor::Start(LivenessDoorOptions options) {
  if (options.udp_port > 65535) {
    return absl::InvalidArgumentError(fmt::format(
        "--liveness-port {}: a UDP port is at most 65535; give a free port, or 0 for any",
        options.udp_port));
  }
  std::unique_ptr<LivenessDoor> door(new LivenessDoor(options));
  auto stop = MakeEventFd();
  if (!stop.ok()) return stop.status();
  door->stop_ = *std::move(stop);
  if (!options.udp_host.empty() || options.udp_port != 0) {
    const std::string& host = options.udp_host;
    auto where = ResolveUdp(host, options.udp_port, /*passive=*/true);
    if (!where.ok()) {
      return absl::InvalidArgumentError(fmt::format(
          "liveness door: {}; the UDP socket binds the network door's host", where.status().message()));
    }
    door->udp_.reset(socket(where->address.ss_family, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!door->udp_ ||
        bind(door->udp_.get(), reinterpret_cast<const sockaddr*>(&where->address), where->length) != 0) {
      return absl::UnavailableError(fmt::format(
          "liveness door: cannot bind UDP {}:{}: {}; free that UDP port or pick another with "
          "--liveness-port (0: any free port, announced to peers)",
          host, options.udp_port, strerror(errno)));
    }
    sockaddr_storage bound{};
    socklen_t length = sizeof bound;
    getsockname(door->udp_.get(), reinterpret_cast<sockaddr*>(&bound), &length);
    door->udp_port_ = ntohs(bound.ss_family == AF_INET6
                                ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  }
  if (!options.unix_path.empty()) {
    auto addr = DoorAddress(options.unix_path, "this agent's, beside --local-socket");
    if (!addr.ok()) return addr.status();
    door->unix_.reset(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    unlink(options.unix_path.c_str());  // a stale one from a process that died
    if (!door->unix_ ||
        bind(door->unix_.get(), reinterpret_cast<const sockaddr*>(&addr->address),
             addr->length) != 0) {
      return absl::UnavailableError(fmt::format(
          "liveness door: cannot bind Unix datagram socket {}: {}; the directory of "
          "--local-socket must be writable",
          options.unix_path, strerror(errno)));
    }
  }
  door->thread_ = std::thread([d = door.get()] { d->Loop(); });
  kLog.Info("liveness door: {}{}{}", door->udp_ ? fmt::format("udp port {}", door->udp_port_) : "",
            door->udp_ && door->unix_ ? ", " : "",
            door->unix_ ? fmt::format("unix {}", options.unix_path) : "");
  return door;
}

LivenessDoor::~LivenessDoor() {
  if (thread_.joinable()) {
    Signal(stop_.get());
    thread_.join();
  }
  if (unix_) unlink(options_.unix_path.c_str());
}

void LivenessDoor::Admit(std::string_view secret) {
  if (secret.empty()) return;
  {
    // Every whole view sent admits its watcher's secret again: most are known.
    absl::ReaderMutexLock lock(&mu_);
    if (admitted_.contains(absl::string_view(secret.data(), secret.size())) ||
        keys_.size() >= kMaxKeys) {
      return;
    }
  }
  auto key = std::make_unique<LivenessKey>(secret);
  absl::MutexLock lock(&mu_);
  if (keys_.size() >= kMaxKeys || keys_.contains(key->id())) return;
  admitted_.emplace(std::string(secret));
  const uint64_t id = key->id();
  keys_.emplace(id, std::move(key));
}

std::string LivenessDoor::AnnounceFor(bool local) const {
  if (local) return unix_ ? "unix:" + options_.unix_path : "";
  return udp_ ? fmt::format("udp:{}", udp_port_) : "";
}

void LivenessDoor::Loop() {
  pthread_setname_np(pthread_self(), "liveness-door");
  std::vector<pollfd> fds;  // what each pass polls (kept: no allocation a pass)
  fds.push_back({stop_.get(), POLLIN, 0});
  if (udp_) fds.push_back({udp_.get(), POLLIN, 0});
  if (unix_) fds.push_back({unix_.get(), POLLIN, 0});
  for (;;) {
    if (poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) break;
    if (fds[0].revents != 0) break;
    wakeups_.fetch_add(1, std::memory_order_relaxed);
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0) Drain(fds[i].fd);
    }
    // The window: pings that come meanwhile are answered together on the next pass.
    pollfd stop{stop_.get(), POLLIN, 0};
    if (poll(&stop, 1, static_cast<int>(options_.window_ms)) > 0) break;
  }
}

void LivenessDoor::Drain(int fd) {
  Batch in;
  Batch out;
  size_t taken = 0;
  while (taken < options_.max_per_wake) {
    const size_t want = std::min<size_t>(kBatch, options_.max_per_wake - taken);
    in.ForReceive(want);
    int got = recvmmsg(fd, in.msgs.data(), static_cast<unsigned>(want), MSG_DONTWAIT, nullptr);
    if (got <= 0) {
      if (got < 0 && errno == EINTR) continue;
      break;
    }
    taken += static_cast<size_t>(got);
    size_t answers = 0;
    uint64_t dropped = 0;
    {
      absl::ReaderMutexLock lock(&mu_);
      for (int i = 0; i < got; ++i) {
        const mmsghdr& m = in.msgs[i];
        LivenessMessage ping;
        const LivenessKey* key = nullptr;
        LivenessVerdict verdict =
            (m.msg_hdr.msg_flags & MSG_TRUNC) != 0
                ? LivenessVerdict::kMalformed
                : CheckPing(in.data[i].data(), m.msg_len, options_.incarnation,
                            [this](uint64_t id) ABSL_NO_THREAD_SAFETY_ANALYSIS -> const LivenessKey* {
                              auto it = keys_.find(id);
                              return it == keys_.end() ? nullptr : it->second.get();
                            },
                            &ping, &key);
        // An unbound Unix sender has no address to answer to.
        if (verdict == LivenessVerdict::kOk &&
            m.msg_hdr.msg_namelen <= static_cast<socklen_t>(sizeof(sa_family_t))) {
          verdict = LivenessVerdict::kMalformed;
        }
        if (verdict != LivenessVerdict::kOk) {
          ++dropped;
          continue;
        }
        LivenessMessage answer = ping;
        answer.kind = LivenessKind::kAnswer;
        key->Encode(answer, out.data[answers].data());
        out.ForSend(answers, in.from[i], m.msg_hdr.msg_namelen);
        ++answers;
      }
    }
    if (dropped != 0) dropped_.fetch_add(dropped, std::memory_order_relaxed);
    if (answers != 0) {
      answered_.fetch_add(answers, std::memory_order_relaxed);
      SendAll(fd, out, answers);
    }
    if (static_cast<size_t>(got) < want) break;  // drained
  }
}

// ---------------------------------------------------------------------------------
// Where a peer's door is.

std::string LivenessUnixPath(const std::string& local_socket) { return local_socket + ".live"; }

absl::StatusOr<LivenessTarget> ResolveLivenessTarget(const std::string& announced,
                                                     const std::string& dialed) {
  if (announced.empty()) {
    return absl::NotFoundError("it announces no liveness door (an older kvagentd, or --liveness off)");
  }
  if (absl::StartsWith(dialed, "unix:")) {
    const std::string expected = "unix:" + LivenessUnixPath(dialed.substr(5));
    if (announced != expected) {
      return absl::PermissionDeniedError(fmt::format(
          "it announces liveness door '{}' but a peer reached at {} must use {}", announced,
          dialed, expected));
    }
    LivenessTarget target;
    auto addr = DoorAddress(expected.substr(5), "the peer's");
    if (!addr.ok()) return addr.status();
    std::memcpy(&target.address, &addr->address, sizeof addr->address);
    target.length = addr->length;
    target.text = "unix " + expected.substr(5);
    return target;
  }
  uint32_t port = 0;
  if (!absl::StartsWith(announced, "udp:") || !absl::SimpleAtoi(announced.substr(4), &port) ||
      port == 0 || port > 65535) {
    return absl::InvalidArgumentError(fmt::format(
        "its liveness door '{}' is not udp:PORT (a peer reached over the network)", announced));
  }
  bool had_port = false;
  const std::string host = HostOfDialled(dialed, &had_port);
  if (!had_port) {
    return absl::InvalidArgumentError(fmt::format("cannot find the host in '{}'", dialed));
  }
  return ResolveUdp(host, port, /*passive=*/false);
}

// ---------------------------------------------------------------------------------
// The prober.

struct LivenessProber::Watched {
  std::string name;
  uint64_t incarnation = 0;
  LivenessTarget target;
  std::string secret;
  std::unique_ptr<LivenessKey> key;
  uint64_t nonce = 0;
  uint64_t seq = 0;           // the last ping sent
  uint64_t answered_seq = 0;  // the newest ping answered
  static constexpr size_t kRing = 16;
  std::array<uint64_t, kRing> sent_us{};  // by seq % kRing
  uint64_t alive_us = 0;  // when the newest answered ping was sent (or watching began)
  uint64_t last_sent_us = 0;
  // Pings the kernel refused because the door's queue was full: they never left, so
  // they take no seq; the peer is tried again at retry_at_us. refused_since_us: the
  // first refusal since a ping last left (0: none), which the loss check counts as an
  // unanswered ping; refused: how many since the last answer (for the loss's why).
  uint64_t refused_since_us = 0;
  uint64_t retry_at_us = 0;
  uint64_t refused = 0;
  bool answering = true;
  bool ever_answered = false;
  // The door's own socket, connected to it (invalid: the shared one is used).
  UniqueFd own;
};

namespace {

// A Unix datagram socket with an abstract address of its own (autobind), for the
// answers to come back to; invalid (errno says why) when it cannot be made.
UniqueFd AutoboundUnixSocket() {
  UniqueFd fd(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  sa_family_t family = AF_UNIX;
  if (fd && bind(fd.get(), reinterpret_cast<const sockaddr*>(&family), sizeof family) != 0) {
    fd.reset();
  }
  return fd;
}

// A socket for one door, connected to it, so that the kernel takes datagrams for it
// from that door alone: a Unix one autobound (the door answers to its address; other
// senders are refused, EPERM), a UDP one on a port of its own (datagrams from any other
// address are dropped before its queue, so a watched peer that learned the port from a
// ping cannot crowd out another door's answers). Invalid (with the cause logged) when
// it cannot be made.
UniqueFd ConnectedSocket(const LivenessTarget& target) {
  const bool unix_door = target.address.ss_family == AF_UNIX;
  UniqueFd fd = unix_door ? AutoboundUnixSocket()
                          : UniqueFd(socket(target.address.ss_family,
                                            SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  const char* step = unix_door ? "an autobound socket" : "a socket";
  if (fd) {
    step = "connect";
    if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&target.address), target.length) ==
        0) {
      return fd;
    }
  }
  kLog.Warn("liveness prober: no socket of its own for the door at {} ({}: {}); pinging it "
            "from the shared socket, where datagrams others send the prober can crowd out "
            "its answers",
            target.text, step, strerror(errno));
  return UniqueFd();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LivenessProber>> LivenessProber::Start(
    LivenessProberOptions options, LivenessLostFn lost, LivenessBackFn back) {
  std::unique_ptr<LivenessProber> prober(
      new LivenessProber(options, std::move(lost), std::move(back)));
  auto wake = MakeEventFd();
  if (!wake.ok()) return wake.status();
  prober->wake_ = *std::move(wake);
  // Sockets for each kind of target; one that cannot be made (IPv6 off) leaves those
  // targets unanswered, and so polled instead.
  prober->udp4_.reset(socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  prober->udp6_.reset(socket(AF_INET6, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  prober->unix_ = AutoboundUnixSocket();
  if (!prober->udp4_ && !prober->udp6_ && !prober->unix_) {
    return absl::UnavailableError(
        fmt::format("liveness prober: no datagram socket: {}", strerror(errno)));
  }
  prober->thread_ = std::thread([p = prober.get()] { p->Loop(); });
  return prober;
}

LivenessProber::LivenessProber(LivenessProberOptions options, LivenessLostFn lost,
                               LivenessBackFn back)
    : options_(options), lost_fn_(std::move(lost)), back_fn_(std::move(back)) {}

LivenessProber::~LivenessProber() {
  stopping_.store(true);
  if (thread_.joinable()) {
    Wake();
    thread_.join();
  }
}

void LivenessProber::Wake() { Signal(wake_.get()); }

void LivenessProber::Watch(const std::string& name, uint64_t incarnation,
                           const LivenessTarget& target, std::string_view secret) {
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it != peers_.end()) {
      Watched& w = *it->second;
      if (w.incarnation == incarnation && w.secret == secret && w.target.length == target.length &&
          std::memcmp(&w.target.address, &target.address, target.length) == 0) {
        return;
      }
      by_nonce_.erase(w.nonce);
      retired_.push_back(std::move(it->second));
      peers_.erase(it);
    }
    auto w = std::make_unique<Watched>();
    w->own = ConnectedSocket(target);
    w->name = name;
    w->incarnation = incarnation;
    w->target = target;
    w->secret = std::string(secret);
    w->key = std::make_unique<LivenessKey>(secret);
    do {
      w->nonce = Random64();
    } while (by_nonce_.contains(w->nonce));
    w->alive_us = MonotonicMicros();
    by_nonce_[w->nonce] = w.get();
    peers_[name] = std::move(w);
  }
  Wake();  // pings it now, and the loop leaves its idle wait
}

void LivenessProber::Unwatch(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(name);
  if (it == peers_.end()) return;
  by_nonce_.erase(it->second->nonce);
  retired_.push_back(std::move(it->second));
  peers_.erase(it);
  Wake();  // the loop lets the retired socket go
}

bool LivenessProber::Answering(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(name);
  return it != peers_.end() && it->second->answering;
}

void LivenessProber::ReadAnswers(int fd, std::vector<std::string>* back) {
  Batch in;
  for (int rounds = 0; rounds < 16; ++rounds) {  // bounded: a flood waits for the next pass
    in.ForReceive(kBatch);
    int got = recvmmsg(fd, in.msgs.data(), kBatch, MSG_DONTWAIT, nullptr);
    if (got <= 0) {
      if (got < 0 && errno == EINTR) continue;
      return;
    }
    uint64_t dropped = 0;
    {
      absl::MutexLock lock(&mu_);
      for (int i = 0; i < got; ++i) {
        const mmsghdr& m = in.msgs[i];
        LivenessMessage answer;
        Watched* w = nullptr;
        LivenessExpectation expect;
        LivenessVerdict verdict =
            (m.msg_hdr.msg_flags & MSG_TRUNC) != 0
                ? LivenessVerdict::kMalformed
                : CheckAnswer(
                      in.data[i].data(), m.msg_len,
                      [&](uint64_t nonce) ABSL_NO_THREAD_SAFETY_ANALYSIS
                      -> const LivenessExpectation* {
                        auto it = by_nonce_.find(nonce);
                        if (it == by_nonce_.end()) return nullptr;
                        w = it->second;
                        expect = {w->key.get(), w->incarnation, w->answered_seq, w->seq,
                                  Watched::kRing};
                        return &expect;
                      },
                      &answer);
        if (verdict != LivenessVerdict::kOk) {
          ++dropped;
          continue;
        }
        w->answered_seq = answer.seq;
        w->alive_us = std::max(w->alive_us, w->sent_us[answer.seq % Watched::kRing]);
        w->refused = 0;
        if (!w->answering) {
          kLog.Info("peer '{}' answers liveness pings again at {}", w->name, w->target.text);
          back->push_back(w->name);
        }
        w->answering = true;
        w->ever_answered = true;
      }
    }
    if (dropped != 0) dropped_.fetch_add(dropped, std::memory_order_relaxed);
    if (static_cast<size_t>(got) < kBatch) return;
  }
}

void LivenessProber::Loop() {
  pthread_setname_np(pthread_self(), "liveness-probe");
  const uint64_t period_us = uint64_t{options_.period_ms} * 1000;
  const uint64_t timeout_us = uint64_t{options_.timeout_ms} * 1000;
  const uint64_t grace_us = uint64_t{options_.answer_grace_ms} * 1000;
  const uint64_t retry_us = uint64_t{options_.retry_ms} * 1000;
  uint64_t next_ping_us = 0;
  // A batch of pings, and for each the peer it is to and what sending it changed
  // there, so that one the kernel refuses can be taken back.
  struct Pings {
    Batch batch;
    struct Sent {
      Watched* to;
      uint64_t slot_us;  // what sent_us[seq % kRing] held before
      uint64_t last_sent_us;
    };
    std::array<Sent, kBatch> sent;
    size_t n = 0;
  };
  Pings out4, out6, outu;
  Pings single;  // one ping on a door's own socket
  std::vector<int> own_fds;  // peers' own sockets, polled this pass
  std::vector<pollfd> fds;  // what each pass polls (kept: no allocation a pass)
  // Some Unix door is pinged from the shared socket: it is read. (Else it is not: what
  // comes to it is only junk, which then waits in its queue, refused once that is full.)
  bool shared_unix_used = false;
  struct Loss {
    std::string name;
    uint64_t incarnation;
    std::string why;
    bool ever_answered;
  };
  while (!stopping_.load()) {
    uint64_t now = MonotonicMicros();
    uint64_t wake_at = UINT64_MAX;
    std::vector<Loss> losses;
    bool any = false;
    {
      absl::MutexLock lock(&mu_);
      retired_.clear();  // the last pass's poll and reads are over
      own_fds.clear();
      shared_unix_used = false;
      any = !peers_.empty();
      const bool ping_all = any && now >= next_ping_us;
      if (ping_all) next_ping_us = now + period_us;
      // Sends a batch; a ping the kernel refused for a full queue is taken back (its
      // seq, send time and ring slot restored) and tried again in 1-5 ms (RefusedRetryUs).
      auto flush = [&](int fd, Pings& out) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        std::bitset<kBatch> full;
        SendAll(fd, out.batch, out.n, &full);
        for (size_t i = 0; i < out.n; ++i) {
          Watched& w = *out.sent[i].to;
          if (!full.test(i)) {
            w.refused_since_us = 0;
            continue;
          }
          w.sent_us[w.seq % Watched::kRing] = out.sent[i].slot_us;
          w.last_sent_us = out.sent[i].last_sent_us;
          --w.seq;
          if (w.refused_since_us == 0) w.refused_since_us = now;
          w.retry_at_us = now + RefusedRetryUs(w.nonce, w.refused);
          ++w.refused;
          refused_.fetch_add(1, std::memory_order_relaxed);
          if (w.answering) wake_at = std::min(wake_at, w.retry_at_us);
        }
        out.n = 0;
      };
      for (auto& [name, wp] : peers_) {
        Watched& w = *wp;
        if (w.own) {
          own_fds.push_back(w.own.get());
        } else if (w.target.address.ss_family == AF_UNIX) {
          shared_unix_used = true;
        }
        // Every period; and, while a ping of an answering peer is overdue, again each
        // retry interval (a lost datagram costs a retry, not the peer); and soon after
        // the kernel refused one (the door's queue was full).
        const bool overdue = w.answering && w.seq > w.answered_seq;
        const bool refused = w.answering && w.refused_since_us != 0;
        const bool ping = ping_all || (overdue && now >= w.last_sent_us + retry_us) ||
                          (refused && now >= w.retry_at_us);
        if (ping) {
          Pings* out = nullptr;
          int fd = -1;
          const int family = w.target.address.ss_family;
          if (family == AF_INET && udp4_) out = &out4, fd = udp4_.get();
          if (family == AF_INET6 && udp6_) out = &out6, fd = udp6_.get();
          if (family == AF_UNIX && unix_) out = &outu, fd = unix_.get();
          if (w.own) out = &single, fd = w.own.get();
          if (out != nullptr) {
            ++w.seq;
            out->sent[out->n] = {&w, w.sent_us[w.seq % Watched::kRing], w.last_sent_us};
            w.sent_us[w.seq % Watched::kRing] = now;
            w.last_sent_us = now;
            w.key->Encode({LivenessKind::kPing, w.key->id(), w.incarnation, w.nonce, w.seq},
                          out->batch.data[out->n].data());
            out->batch.ForSend(out->n, w.target.address, w.target.length);
            // A batch is full: send it and go on (1 sendmmsg per 64 peers).
            if (++out->n == kBatch || out == &single) flush(fd, *out);
          }
        }
        if (!w.answering) continue;
        // Lost: nothing sent in the last timeout was answered, and the oldest
        // unanswered ping (or the first one refused since a ping last left) has had
        // its grace.
        const bool unanswered = w.answered_seq < w.seq;
        if (!unanswered && w.refused_since_us == 0) continue;  // checked after the next ping
        uint64_t first_unanswered = UINT64_MAX;
        if (unanswered) {
          wake_at = std::min(wake_at, w.last_sent_us + retry_us);
          // The oldest unanswered ping whose send time the ring still holds.
          const uint64_t first = std::max(
              w.answered_seq + 1, w.seq >= Watched::kRing ? w.seq - Watched::kRing + 1 : 1);
          first_unanswered = w.sent_us[first % Watched::kRing];
        }
        if (w.refused_since_us != 0) {
          wake_at = std::min(wake_at, w.retry_at_us);
          first_unanswered = std::min(first_unanswered, w.refused_since_us);
        }
        const uint64_t due = std::max(w.alive_us + timeout_us, first_unanswered + grace_us);
        if (now >= due) {
          w.answering = false;
          losses.push_back(
              {w.name, w.incarnation,
               fmt::format("its liveness door at {} answered no ping for {} ms (pings every {} "
                           "ms, retried after {} ms; {} unanswered{}{})",
                           w.target.text, (now - w.alive_us) / 1000, options_.period_ms,
                           options_.retry_ms, w.seq - w.answered_seq,
                           w.refused == 0
                               ? ""
                               : fmt::format("; {} more refused by its full queue: a door that "
                                             "stopped reading, or one flooded with datagrams",
                                             w.refused),
                           w.ever_answered ? "" : "; it never answered: check that UDP reaches it"),
               w.ever_answered});
        } else {
          wake_at = std::min(wake_at, due);
        }
      }
      if (out4.n != 0) flush(udp4_.get(), out4);
      if (out6.n != 0) flush(udp6_.get(), out6);
      if (outu.n != 0) flush(unix_.get(), outu);
    }
    for (const auto& loss : losses) {
      lost_count_.fetch_add(1, std::memory_order_relaxed);
      kLog.Warn("peer '{}': {}", loss.name, loss.why);
      lost_fn_(loss.name, loss.incarnation, loss.why, loss.ever_answered);
    }
    if (any) wake_at = std::min(wake_at, next_ping_us);
    // Each fd collected under the lock stays open until the next pass (retired_).
    fds.clear();
    fds.push_back({wake_.get(), POLLIN, 0});
    for (int fd : {udp4_.get(), udp6_.get(), shared_unix_used ? unix_.get() : -1}) {
      if (fd >= 0) fds.push_back({fd, POLLIN, 0});
    }
    for (int fd : own_fds) fds.push_back({fd, POLLIN, 0});
    const size_t nfds = fds.size();
    now = MonotonicMicros();
    const int timeout_ms =
        wake_at == UINT64_MAX ? -1
        : wake_at <= now      ? 0
                              : static_cast<int>((wake_at - now + 999) / 1000);
    if (poll(fds.data(), nfds, timeout_ms) <= 0) continue;
    if (fds[0].revents != 0) {
      uint64_t count = 0;
      [[maybe_unused]] ssize_t n = read(wake_.get(), &count, sizeof count);
    }
    bool read = false;
    std::vector<std::string> back;
    for (size_t i = 1; i < nfds; ++i) {
      if (fds[i].revents != 0) {
        ReadAnswers(fds[i].fd, &back);
        read = true;
      }
    }
    if (back_fn_) {
      for (const auto& name : back) back_fn_(name);
    }
    // Answers from many peers come one by one: let them gather for a moment rather
    // than wake for each (a watcher of 1,000 peers would wake 3,000 times a second).
    if (read && !stopping_.load()) {
      pollfd wake{wake_.get(), POLLIN, 0};
      poll(&wake, 1, kAnswerWindowMs);
    }
  }
}

}  // namespace kvagent::agent

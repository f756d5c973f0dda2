// Peer liveness without a thread wake-up per ping. LivenessDoor is the watched side:
// one thread per agent answers signed ping datagrams (UDP beside the network door, a
// Unix datagram socket beside the local door) in batches, recvmmsg then one
// sendmmsg, then lets a short window pass before it looks again, so it wakes at most
// ~60 times a second however many peers ping. LivenessProber is the watching side:
// one thread pings every watched peer each period and reports a peer none of whose
// pings was answered for the timeout. Datagrams: agent/liveness_wire.h. Used by
// Agent (the door) and PeerManager (the prober).
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/liveness_wire.h"
#include "base/unique_fd.h"

namespace kvagent::agent {

struct LivenessDoorOptions {
  // UDP: the network door's host ("" with no network door: no UDP socket) and port
  // (0: any free one; announced to peers either way).
  std::string udp_host;
  uint32_t udp_port = 0;
  // Unix datagram socket for same-host peers ("" none); created (replacing a stale
  // socket file) and removed at stop.
  std::string unix_path;
  uint64_t incarnation = 0;
  // After a wake-up's batch is answered, the door sleeps this long before it looks
  // again: pings arriving meanwhile wait (they are answered late by at most this),
  // and are answered together.
  uint32_t window_ms = 15;
  // Datagrams read per wake-up at most, per socket: a flood costs a bounded share of
  // a core (the rest wait in, or overflow, the socket's buffer).
  uint32_t max_per_wake = 512;
};

class LivenessDoor {
 public:
  static absl::StatusOr<std::unique_ptr<LivenessDoor>> Start(LivenessDoorOptions options);
  ~LivenessDoor();

  // A watcher's key: pings signed with the key derived from `secret` (the secret
  // this agent issued it) are answered from now on. At most kMaxKeys.
  void Admit(std::string_view secret);
  // What AgentMetadata.liveness_address tells a peer that reached this agent through
  // the local door (`local`) or the network door: "unix:PATH", "udp:PORT", or "".
  std::string AnnounceFor(bool local) const;
  uint32_t udp_port() const { return udp_port_; }

  uint64_t answered() const { return answered_.load(std::memory_order_relaxed); }
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }
  uint64_t wakeups() const { return wakeups_.load(std::memory_order_relaxed); }

  static constexpr size_t kMaxKeys = 65536;

 private:
  explicit LivenessDoor(LivenessDoorOptions options) : options_(std::move(options)) {}
  void Loop();
  // Reads, checks and answers what `fd` holds (at most max_per_wake datagrams).
  void Drain(int fd);

  const LivenessDoorOptions options_;
  UniqueFd udp_;
  UniqueFd unix_;
  UniqueFd stop_;  // eventfd
  uint32_t udp_port_ = 0;
  std::thread thread_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<LivenessKey>> keys_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> admitted_ ABSL_GUARDED_BY(mu_);  // their secrets
  std::atomic<uint64_t> answered_{0};
  std::atomic<uint64_t> dropped_{0};
  std::atomic<uint64_t> wakeups_{0};
};

// Where a watched peer's door is, resolved from what it announced and how it was
// reached: "udp:PORT" at the host of the HOST:PORT it was dialed at; "unix:PATH" only
// for a peer reached through its local door at unix:P, and only when PATH is
// P + ".live" (a peer cannot make this agent send datagrams to another socket).
struct LivenessTarget {
  sockaddr_storage address{};
  socklen_t length = 0;
  std::string text;  // for messages: "udp 127.0.0.1:4242", "unix /run/kvagent.sock.live"
};
absl::StatusOr<LivenessTarget> ResolveLivenessTarget(const std::string& announced,
                                                     const std::string& dialed);
// The Unix datagram socket beside a local door at `local_socket`.
std::string LivenessUnixPath(const std::string& local_socket);

struct LivenessProberOptions {
  // A ping to every peer each period; to a peer whose last ping is unanswered after
  // retry_ms, another (one each retry_ms while it is overdue): a lost datagram costs a
  // retry, while an answering peer costs one ping a period.
  uint32_t period_ms = 600;
  uint32_t retry_ms = 150;
  // A peer is lost when none of the pings sent over this span was answered, and the
  // oldest unanswered one had answer_grace_ms to be (so a prober that was itself held
  // up, and sent no pings, reports nobody).
  uint32_t timeout_ms = 1000;
  uint32_t answer_grace_ms = 400;
};

// name, incarnation, why (names the peer's door and how long it was silent), and
// whether the door ever answered (never: UDP may not reach it; the peer is not
// known to be hung).
using LivenessLostFn = std::function<void(const std::string& name, uint64_t incarnation,
                                          const std::string& why, bool ever_answered)>;

// A lost peer's door answers again (name).
using LivenessBackFn = std::function<void(const std::string& name)>;

class LivenessProber {
 public:
  // `lost` and `back` run on the prober's thread, with no lock of the prober held.
  static absl::StatusOr<std::unique_ptr<LivenessProber>> Start(LivenessProberOptions options,
                                                               LivenessLostFn lost,
                                                               LivenessBackFn back = nullptr);
  ~LivenessProber();  // stops: no `lost` call after it returns

  // Pings `name` (incarnation `incarnation`) at `target` from now on, signed with the
  // key from `secret`. The same name, incarnation, target and secret again: nothing
  // changes; anything else starts afresh (a grace of one timeout before it can be lost).
  // Each door gets a socket of its own, connected to it. A Unix one: the kernel then
  // refuses datagrams to it from any other socket (EPERM), so junk sprayed at the
  // prober's abstract address, which no file mode guards, cannot fill the queue its
  // answers need. A UDP one: datagrams from any other address are dropped before its
  // queue, so a peer that floods the port its pings come from (it sees it in every
  // ping) crowds out no other door's answers. (If that socket cannot be made, the
  // shared one is used.)
  void Watch(const std::string& name, uint64_t incarnation, const LivenessTarget& target,
             std::string_view secret);
  void Unwatch(const std::string& name);
  // True while `name` is watched and not lost (answering, or not yet timed out).
  bool Answering(const std::string& name) const;
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }
  uint64_t lost() const { return lost_count_.load(std::memory_order_relaxed); }
  // Pings the kernel refused because the door's queue was full (each tried again
  // within 5 ms; a peer refusing every one for the timeout is lost).
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  struct Watched;
  LivenessProber(LivenessProberOptions options, LivenessLostFn lost, LivenessBackFn back);
  void Loop();
  // Reads and checks answers; adds to `back` the lost peers that answered.
  void ReadAnswers(int fd, std::vector<std::string>* back);
  void Wake();

  const LivenessProberOptions options_;
  const LivenessLostFn lost_fn_;
  const LivenessBackFn back_fn_;
  UniqueFd udp4_, udp6_, unix_, wake_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<Watched>> peers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Watched*> by_nonce_ ABSL_GUARDED_BY(mu_);
  // Replaced or unwatched peers, kept until the loop's next pass: their sockets may be
  // in the poll it is in.
  std::vector<std::unique_ptr<Watched>> retired_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> dropped_{0};
  std::atomic<uint64_t> lost_count_{0};
  std::atomic<uint64_t> refused_{0};
};

}  // namespace kvagent::agent

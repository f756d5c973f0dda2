#include "cli/bench_peers.h"

#include <signal.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/liveness.h"
#include "agent/liveness_wire.h"
#include "agent/peer_manager.h"
#include "base/unique_fd.h"
#include "base/status_macros.h"
#include "cli/agent_client.h"
#include "cli/child_process.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "cli/local_agents.h"
#include "cli/process_cpu.h"
#include "client/local_session.h"
#include "fmt/format.h"
#include "grpcpp/grpcpp.h"
#include "proto/kvagent.grpc.pb.h"

namespace kvagent::cli {
namespace {

using Clock = std::chrono::steady_clock;

// `pid`'s CPU in % of one core over `seconds` of wall time.
absl::StatusOr<double> CpuPercent(pid_t pid, double seconds) {
  ASSIGN_OR_RETURN(double before, ProcessCpuSeconds(pid));
  const auto start = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  const double wall = Seconds(Clock::now() - start);
  ASSIGN_OR_RETURN(double after, ProcessCpuSeconds(pid));
  return (after - before) / wall * 100;
}

// One fake peer: a local-door session of its own (so the hub counts it as peer
// "bench-peer-I"), its own gRPC connection, and what it last received.
struct FakePeer {
  std::string name;
  std::unique_ptr<client::LocalSession> session;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Peer::Stub> stub;
  std::atomic<uint64_t> version{0};
  std::atomic<uint64_t> incarnation{0};
  std::atomic<bool> answered{false};
  std::atomic<bool> in_flight{false};  // polling: a GetMetadata outstanding
  // The secret the hub issued it and its liveness door as announced (the first whole
  // view; read by the pingers once every peer answered).
  absl::Mutex mu;
  std::string secret ABSL_GUARDED_BY(mu);
  std::string liveness_address ABSL_GUARDED_BY(mu);

  void Received(const v1::AgentMetadata& m) {
    if (!m.notify_secret().empty()) {
      absl::MutexLock lock(&mu);
      secret = m.notify_secret();
      liveness_address = m.liveness_address();
    }
    version.store(m.version());
    incarnation.store(m.incarnation());
    answered.store(true);
  }
  v1::GetMetadataRequest Holding() const {
    v1::GetMetadataRequest r;
    r.set_caller(name);
    r.set_known_version(version.load());
    r.set_known_incarnation(incarnation.load());
    r.set_accept_delta(true);
    return r;
  }
};

// Streams that ended (cancelled at the end of a run, or lost: an error).
struct WatchTally {
  absl::Mutex mu;
  int live ABSL_GUARDED_BY(mu) = 0;
  int failed ABSL_GUARDED_BY(mu) = 0;
  std::string last_error ABSL_GUARDED_BY(mu);
};

// A fake peer's WatchMetadata stream: acknowledges every view it receives, as an
// agent does once installed (here at once).
class FakeWatch final : public grpc::ClientBidiReactor<v1::GetMetadataRequest, v1::AgentMetadata> {
 public:
  FakeWatch(FakePeer* peer, WatchTally* tally) : peer_(peer), tally_(tally) {
    {
      absl::MutexLock lock(&tally_->mu);
      ++tally_->live;
    }
    context_.AddMetadata("kvagent-session", peer_->session->token());
    peer_->stub->async()->WatchMetadata(&context_, this);
    AddHold();  // the read side
    Send(peer_->Holding());
    StartRead(&read_);
    StartCall();
  }
  void Cancel() { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      RemoveHold();
      return;
    }
    peer_->Received(read_);
    Send(peer_->Holding());
    StartRead(&read_);
  }
  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (ok && pending_) {
        write_ = *std::move(pending_);
        pending_.reset();
        StartWriteLocked();
      }
    }
    RemoveHold();
  }
  void OnDone(const grpc::Status& status) override {
    {
      absl::MutexLock lock(&tally_->mu);
      --tally_->live;
      if (!status.ok() && status.error_code() != grpc::StatusCode::CANCELLED) {
        ++tally_->failed;
        tally_->last_error = status.error_message();
      }
    }
  }

 private:
  void Send(const v1::GetMetadataRequest& request) {
    absl::MutexLock lock(&mu_);
    if (writing_) {
      pending_ = request;
      return;
    }
    write_ = request;
    StartWriteLocked();
  }
  void StartWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    writing_ = true;
    AddHold();
    StartWrite(&write_);
  }

  FakePeer* const peer_;
  WatchTally* const tally_;
  grpc::ClientContext context_;
  v1::AgentMetadata read_;
  absl::Mutex mu_;
  v1::GetMetadataRequest write_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::GetMetadataRequest> pending_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
};

// Polling: one thread issues every peer's GetMetadata (callback API) each period, as
// each polling agent would (a peer with a poll still outstanding skips a round).
class FakePollers {
 public:
  FakePollers(std::vector<std::unique_ptr<FakePeer>>* peers, uint32_t period_ms)
      : peers_(peers), period_ms_(period_ms), thread_([this] { Loop(); }) {}
  ~FakePollers() {
    stop_.store(true);
    thread_.join();
    for (auto& p : *peers_) {
      while (p->in_flight.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  uint64_t failures() const { return failures_.load(); }

 private:
  struct Call {
    grpc::ClientContext context;
    v1::GetMetadataRequest request;
    v1::AgentMetadata reply;
  };
  void Loop() {
    while (!stop_.load()) {
      const auto round = Clock::now();
      for (auto& p : *peers_) {
        if (p->in_flight.exchange(true)) continue;
        auto call = std::make_shared<Call>();
        call->request = p->Holding();
        call->context.AddMetadata("kvagent-session", p->session->token());
        call->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
        FakePeer* peer = p.get();
        peer->stub->async()->GetMetadata(&call->context, &call->request, &call->reply,
                                         [this, call, peer](grpc::Status status) {
                                           if (status.ok()) {
                                             peer->Received(call->reply);
                                           } else {
                                             failures_.fetch_add(1);
                                           }
                                           peer->in_flight.store(false);
                                         });
      }
      std::this_thread::sleep_until(round + std::chrono::milliseconds(period_ms_));
    }
  }
  std::vector<std::unique_ptr<FakePeer>>* peers_;
  const uint32_t period_ms_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> failures_{0};
  std::thread thread_;
};

// Pushed: each fake peer pings the hub's liveness door as a watching agent's prober
// does (a signed datagram every agent::kLivenessPeriodMs, its own key), the peers'
// pings spread evenly over the period as independent watchers' are, not in bursts.
// One thread and one UDP socket send them all; it checks every answer.
class FakePingers {
 public:
  // Pings every peer that announced a door at the hub's UDP door `door` ("udp:PORT"
  // on 127.0.0.1); UNAVAILABLE when none did (an older hub).
  static absl::StatusOr<std::unique_ptr<FakePingers>> Start(
      std::vector<std::unique_ptr<FakePeer>>* peers, const std::string& door) {
    std::unique_ptr<FakePingers> p(new FakePingers());
    ASSIGN_OR_RETURN(agent::LivenessTarget where,
                     agent::ResolveLivenessTarget(door, "127.0.0.1:0"));
    for (auto& peer : *peers) {
      absl::MutexLock lock(&peer->mu);
      if (peer->liveness_address.empty() || peer->secret.empty()) continue;
      auto w = std::make_unique<Pinger>();
      w->key = std::make_unique<agent::LivenessKey>(peer->secret);
      w->target = where;
      w->incarnation = peer->incarnation.load();
      w->nonce = p->pingers_.size() + 1;
      p->pingers_.push_back(std::move(w));
    }
    if (p->pingers_.empty()) {
      return absl::UnavailableError("the hub announces no liveness door: nothing to ping");
    }
    p->fd_.reset(socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!p->fd_) {
      return absl::InternalError(fmt::format("liveness socket: {}", std::strerror(errno)));
    }
    p->thread_ = std::thread([raw = p.get()] { raw->Loop(); });
    return p;
  }
  ~FakePingers() {
    stop_.store(true);
    thread_.join();
  }
  size_t size() const { return pingers_.size(); }
  uint64_t sent() const { return sent_.load(); }
  uint64_t answered() const { return answered_.load(); }

 private:
  struct Pinger {
    std::unique_ptr<agent::LivenessKey> key;
    agent::LivenessTarget target;
    uint64_t incarnation = 0;
    uint64_t nonce = 0;
    uint64_t seq = 0;
    uint64_t answered_seq = 0;
  };
  FakePingers() = default;

  void Loop() {
    const auto period = std::chrono::milliseconds(agent::kLivenessPeriodMs);
    const size_t n = pingers_.size();
    const auto start = Clock::now();
    size_t next = 0;     // the next pinger due
    uint64_t round = 0;  // rounds of all pingers sent
    std::vector<uint8_t> buf(n * agent::kLivenessDatagramBytes);
    std::vector<mmsghdr> msgs(n);
    std::vector<iovec> iov(n);
    while (!stop_.load()) {
      // Pinger i is due at start + round * period + i * period / n.
      const auto now = Clock::now();
      size_t batch = 0;
      while (!stop_.load()) {
        const auto due = start + round * period + next * period / n;
        if (due > now || batch == n) break;
        Pinger& w = *pingers_[next];
        uint8_t* d = buf.data() + batch * agent::kLivenessDatagramBytes;
        w.key->Encode({agent::LivenessKind::kPing, w.key->id(), w.incarnation, w.nonce, ++w.seq}, d);
        iov[batch] = {d, agent::kLivenessDatagramBytes};
        msgs[batch] = {};
        msgs[batch].msg_hdr.msg_name = &w.target.address;
        msgs[batch].msg_hdr.msg_namelen = w.target.length;
        msgs[batch].msg_hdr.msg_iov = &iov[batch];
        msgs[batch].msg_hdr.msg_iovlen = 1;
        ++batch;
        if (++next == n) {
          next = 0;
          ++round;
        }
      }
      for (size_t done = 0; done < batch;) {
        int sent = sendmmsg(fd_.get(), msgs.data() + done, batch - done, 0);
        if (sent <= 0) break;  // a full socket buffer: those pings are lost
        done += static_cast<size_t>(sent);
        sent_.fetch_add(static_cast<uint64_t>(sent));
      }
      ReadAnswers();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  void ReadAnswers() {
    uint8_t d[agent::kLivenessDatagramBytes + 1];
    for (;;) {
      ssize_t got = recv(fd_.get(), d, sizeof d, MSG_DONTWAIT);
      if (got < 0) return;
      agent::LivenessMessage answer;
      agent::LivenessExpectation expect;
      const agent::LivenessVerdict verdict = agent::CheckAnswer(
          d, static_cast<size_t>(got),
          [&](uint64_t nonce) -> const agent::LivenessExpectation* {
            if (nonce == 0 || nonce > pingers_.size()) return nullptr;
            const Pinger& w = *pingers_[nonce - 1];
            expect = {w.key.get(), w.incarnation, w.answered_seq, w.seq, 16};
            return &expect;
          },
          &answer);
      if (verdict != agent::LivenessVerdict::kOk) continue;
      pingers_[answer.nonce - 1]->answered_seq = answer.seq;
      answered_.fetch_add(1);
    }
  }

  std::vector<std::unique_ptr<Pinger>> pingers_;
  UniqueFd fd_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> sent_{0};
  std::atomic<uint64_t> answered_{0};
  std::thread thread_;
};

// A UDP port on 127.0.0.1 free a moment ago (for the hub's --liveness-port).
absl::StatusOr<uint32_t> FreeUdpPort() {
  UniqueFd fd(socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof addr;
  if (!fd || bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 ||
      getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    return absl::InternalError(fmt::format("no free UDP port: {}", std::strerror(errno)));
  }
  return ntohs(addr.sin_port);
}

absl::StatusOr<std::vector<std::unique_ptr<FakePeer>>> AttachFakePeers(const DaemonProcess& hub,
                                                                      uint32_t n, bool push) {
  std::vector<std::unique_ptr<FakePeer>> peers;
  for (uint32_t i = 0; i < n; ++i) {
    auto p = std::make_unique<FakePeer>();
    p->name = fmt::format("bench-peer-{}", i);
    ASSIGN_OR_RETURN(p->session,
                     client::LocalSession::Attach(hub.local_socket() + ".session", p->name));
    // A connection of its own, with the (slow) keepalive pings a real watching agent
    // sends (connected below); its liveness pings go to the hub's door (FakePingers).
    p->channel = grpc::CreateCustomChannel(hub.address(), grpc::InsecureChannelCredentials(),
                                           agent::PeerChannelArgs(push));
    p->stub = v1::Peer::NewStub(p->channel);
    peers.push_back(std::move(p));
    if (i % 50 == 0) Progress(i, n, "attaching fake peers");
  }
  Progress(n, n, "attaching fake peers");
  // Connected one after another before any stream opens: a storm of 1,000 connects at
  // once left up to a quarter of them timed out before the hub's SETTINGS under load,
  // and the run then measured fewer peers than asked.
  constexpr size_t kBatch = 1;
  for (size_t first = 0; first < peers.size(); first += kBatch) {
    const size_t end = std::min(peers.size(), first + kBatch);
    for (size_t i = first; i < end; ++i) peers[i]->channel->GetState(/*try_to_connect=*/true);
    const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(60);
    for (size_t i = first; i < end; ++i) {
      if (!peers[i]->channel->WaitForConnected(deadline)) {
        return absl::DeadlineExceededError(fmt::format(
            "fake peer {} did not connect to the hub at {} within 60 s (the machine is too "
            "loaded for {} connections: try fewer --peers)",
            peers[i]->name, hub.address(), n));
      }
    }
    if (end % 50 == 0 || end == n) Progress(end, n, "connecting fake peers");
  }
  return peers;
}

// Waits (up to `limit`) until `done()`; false when it did not happen.
bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds limit) {
  const auto until = Clock::now() + limit;
  while (Clock::now() < until) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return done();
}

// The run's watches. A watch stays alive after its stream ends (cancelling it is then
// harmless); they go once every stream has ended, cancelled here on the way out, or
// are left (leaked) when one has not after 30 s, since its reactor could still run.
struct FakeWatches {
  WatchTally tally;
  std::vector<std::unique_ptr<FakeWatch>> watches;

  bool AllEnded() {
    absl::MutexLock lock(&tally.mu);
    return tally.live == 0;
  }
  ~FakeWatches() {
    for (auto& w : watches) w->Cancel();
    if (!WaitFor([&] { return AllEnded(); }, std::chrono::seconds(30))) {
      for (auto& w : watches) (void)w.release();
    }
  }
};

// Milliseconds until the hub lists `peer` as unreachable, or an error after 10 s.
absl::StatusOr<double> DetectionMs(AgentClient& hub, const std::string& peer, pid_t pid,
                                   int signal) {
  const auto start = Clock::now();
  if (signal == SIGSTOP) {
    // Hung means every thread stopped: kill() returns before they are.
    RETURN_IF_ERROR(SuspendChild(pid));
  } else if (::kill(pid, signal) != 0) {
    return absl::InternalError(fmt::format("kill {} {}: {}", signal, pid, std::strerror(errno)));
  }
  bool seen = false;
  absl::Status error;
  WaitFor(
      [&] {
        auto peers = hub.Peers();
        if (!peers.ok()) {
          error = peers.status();
          return true;
        }
        for (const auto& p : peers->peers()) {
          if (p.name() == peer && p.state() == "unreachable") seen = true;
        }
        return seen;
      },
      std::chrono::seconds(10));
  if (!error.ok()) return error;
  if (!seen) {
    return absl::DeadlineExceededError(
        fmt::format("the hub did not see '{}' go within 10 s", peer));
  }
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

struct ModeResult {
  std::string mode;
  double idle = 0, busy = 0, fanout_ms = -1, kill_ms = -1, stop_ms = -1;
  uint32_t connected = 0;
  // Pushed: fake peers pinging the hub's liveness door, and the share of their pings
  // answered (validly signed, not replayed) while the CPU was measured.
  size_t pinging = 0;
  double answered_pct = -1;
  double pings_per_s = 0;
};

absl::StatusOr<ModeResult> RunMode(const BenchPeersOptions& options, const std::string& mode,
                                   LocalAgents* agents, std::optional<DaemonProcess>* third) {
  const bool push = mode == "on";
  ModeResult r;
  r.mode = push ? "push" : fmt::format("poll ({} ms)", options.poll_ms);
  LocalAgentsOptions start;
  start.argv0 = options.argv0;
  start.kvagentd = options.kvagentd;
  start.label = "bench-peers";
  start.first_name = "hub";
  start.second_name = "peer-b";
  start.extra_args = {"--metadata-push", mode, "--peer-refresh-ms",
                      std::to_string(options.poll_ms), "--max-sessions",
                      std::to_string(options.peers + 64)};
  // Pushed, the fake peers ping the hub's liveness door over UDP on loopback, as
  // watchers on other hosts would (its Unix datagram socket, for same-host peers,
  // queues only max_dgram_qlen, 10, pings between two reads).
  uint32_t liveness_port = 0;
  if (push) {
    ASSIGN_OR_RETURN(liveness_port, FreeUdpPort());
    start.first_args = {"--liveness-port", std::to_string(liveness_port)};
  }
  RETURN_IF_ERROR(StartLocalAgents(start, agents));
  DaemonOptions c;
  c.binary = options.kvagentd.empty() ? *FindKvagentd(options.argv0) : options.kvagentd;
  c.name = "peer-c";
  c.work_dir = agents->work_dir;
  c.extra_args = start.extra_args;
  ASSIGN_OR_RETURN(*third, DaemonProcess::Start(c));
  agents->log_paths.push_back((*third)->log_path());
  const pid_t hub_pid = agents->first->pid();
  AgentClient hub(agents->first->address());
  RETURN_IF_ERROR(hub.WaitReady(10000));

  Progress(0, 1, fmt::format("{}: idle CPU", r.mode));
  ASSIGN_OR_RETURN(r.idle, CpuPercent(hub_pid, options.idle_s));

  // Two real peers the hub watches (or polls), to see their loss.
  RETURN_IF_ERROR(hub.Connect(agents->second->address()).status());
  RETURN_IF_ERROR(hub.Connect((*third)->address()).status());

  ASSIGN_OR_RETURN(auto peers, AttachFakePeers(*agents->first, options.peers, push));
  FakeWatches fakes;
  std::optional<FakePollers> pollers;
  if (push) {
    for (auto& p : peers) {
      fakes.watches.push_back(std::make_unique<FakeWatch>(p.get(), &fakes.tally));
    }
  } else {
    pollers.emplace(&peers, options.poll_ms);
  }
  auto answered = [&] {
    return static_cast<uint32_t>(std::count_if(
        peers.begin(), peers.end(), [](const auto& p) { return p->answered.load(); }));
  };
  WaitFor([&] { return answered() == options.peers; }, std::chrono::seconds(60));
  r.connected = answered();
  if (push) {
    ASSIGN_OR_RETURN(v1::AgentStatus status, hub.Status());
    r.connected = std::min<uint32_t>(r.connected, status.metadata_streams());
  }
  std::unique_ptr<FakePingers> pingers;
  if (push) {
    auto started = FakePingers::Start(&peers, fmt::format("udp:{}", liveness_port));
    if (started.ok()) {
      pingers = *std::move(started);
      r.pinging = pingers->size();
    } else {
      std::fprintf(stderr, "%s: %s\n", r.mode.c_str(), std::string(started.status().message()).c_str());
    }
  }
  // Let the connection storm settle before measuring.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  Progress(0, 1, fmt::format("{}: CPU with {} peers", r.mode, options.peers));
  const uint64_t sent_before = pingers ? pingers->sent() : 0;
  const uint64_t answered_before = pingers ? pingers->answered() : 0;
  const auto window_start = Clock::now();
  ASSIGN_OR_RETURN(r.busy, CpuPercent(hub_pid, options.window_s));
  if (pingers && pingers->sent() > sent_before) {
    r.pings_per_s = static_cast<double>(pingers->sent() - sent_before) /
                    Seconds(Clock::now() - window_start);
    // Answers lag their pings by up to the door's window: a little under 100 % is normal.
    r.answered_pct = 100.0 * static_cast<double>(pingers->answered() - answered_before) /
                     static_cast<double>(pingers->sent() - sent_before);
  }

  // One change (a region registered on the hub) until every fake peer holds it.
  KvPoolShape shape;
  shape.layers = 1;
  shape.pages = 1;
  shape.page_bytes = 4096;
  const auto change = Clock::now();
  ASSIGN_OR_RETURN(KvPool pool, CreateKvPool(hub, "fanout", shape));
  ASSIGN_OR_RETURN(v1::ListRegionsResponse regions, hub.Regions());
  if (WaitFor(
          [&] {
            return std::all_of(peers.begin(), peers.end(), [&](const auto& p) {
              return p->version.load() >= regions.version();
            });
          },
          std::chrono::seconds(30))) {
    r.fanout_ms = std::chrono::duration<double, std::milli>(Clock::now() - change).count();
  }

  ASSIGN_OR_RETURN(r.kill_ms, DetectionMs(hub, "peer-b", agents->second->pid(), SIGKILL));
  ASSIGN_OR_RETURN(r.stop_ms, DetectionMs(hub, "peer-c", (*third)->pid(), SIGSTOP));
  ::kill((*third)->pid(), SIGCONT);
  pingers.reset();

  for (auto& w : fakes.watches) w->Cancel();
  WaitFor([&] { return fakes.AllEnded(); }, std::chrono::seconds(30));
  {
    absl::MutexLock lock(&fakes.tally.mu);
    if (fakes.tally.failed > 0) {
      std::fprintf(stderr, "%s: %d fake watch streams failed (last: %s)\n", r.mode.c_str(),
                   fakes.tally.failed, fakes.tally.last_error.c_str());
    }
  }
  if (pollers && pollers->failures() > 0) {
    std::fprintf(stderr, "%s: %llu fake polls failed\n", r.mode.c_str(),
                 static_cast<unsigned long long>(pollers->failures()));
  }
  pollers.reset();
  return r;
}

}  // namespace

int RunBenchPeers(const BenchPeersOptions& options) {
  std::vector<ModeResult> results;
  for (const std::string& mode : options.modes) {
    LocalAgents agents;
    std::optional<DaemonProcess> third;
    auto r = RunMode(options, mode, &agents, &third);
    if (!r.ok()) {
      std::fprintf(stderr, "kvagentctl bench-peers (metadata push %s): %s\n", mode.c_str(),
                   std::string(r.status().message()).c_str());
      PrintAgentLogs(agents.log_paths);
      if (third) (void)third->Stop();
      agents.StopAndClean();
      return 1;
    }
    if (third) (void)third->Stop();
    agents.StopAndClean();
    results.push_back(*r);
  }
  std::ifstream loadavg("/proc/loadavg");
  std::string load;
  std::getline(loadavg, load);
  std::printf("hub agent CPU (%% of one core, /proc/PID/stat utime+stime, 10 ms ticks; idle "
              "over %.0f s, with peers over %.0f s); %u fake peers, one session and "
              "connection each; load average %s\n",
              options.idle_s, options.window_s, options.peers, load.c_str());
  std::printf("%-16s %10s %12s %14s %12s %14s %12s %12s %28s\n", "metadata", "idle %",
              "connected", "with peers %", "per peer %", "change to all", "SIGKILL seen",
              "SIGSTOP seen", "liveness pings (window)");
  for (const auto& r : results) {
    const double per_peer = r.connected ? (r.busy - r.idle) / r.connected : 0;
    const std::string pings =
        r.pinging == 0 ? std::string("none")
                       : fmt::format("{} peers, {:.0f}/s, {:.1f} % answered", r.pinging,
                                     r.pings_per_s, r.answered_pct);
    std::printf("%-16s %10.3f %12u %14.2f %12.5f %11.0f ms %9.0f ms %9.0f ms %28s\n",
                r.mode.c_str(), r.idle, r.connected, r.busy, per_peer, r.fanout_ms, r.kill_ms,
                r.stop_ms, pings.c_str());
  }
  return 0;
}

}  // namespace kvagent::cli

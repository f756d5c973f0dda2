#include "cli/bench_peers.h"

#include <signal.h>
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
#include "agent/peer_manager.h"
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

  void Received(const v1::AgentMetadata& m) {
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

absl::StatusOr<std::vector<std::unique_ptr<FakePeer>>> AttachFakePeers(const DaemonProcess& hub,
                                                                      uint32_t n, bool push) {
  std::vector<std::unique_ptr<FakePeer>> peers;
  for (uint32_t i = 0; i < n; ++i) {
    auto p = std::make_unique<FakePeer>();
    p->name = fmt::format("bench-peer-{}", i);
    ASSIGN_OR_RETURN(p->session,
                     client::LocalSession::Attach(hub.local_socket() + ".session", p->name));
    // A connection of its own, with the keepalive pings a real watching agent sends
    // (connected below).
    p->channel = grpc::CreateCustomChannel(hub.address(), grpc::InsecureChannelCredentials(),
                                           agent::PeerChannelArgs(push));
    p->stub = v1::Peer::NewStub(p->channel);
    peers.push_back(std::move(p));
    if (i % 50 == 0) Progress(i, n, "attaching fake peers");
  }
  Progress(n, n, "attaching fake peers");
  // Connected one after another before any stream opens: a storm of 1,000 connects at
  // once left up to a quarter of them timed out before the hub's SETTINGS under load,
  // and the run then measured fewer peers than asked. One at a time also spreads their
  // keepalive pings over the period, as peers connecting at their own times do (a
  // batch connected together pings together).
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
  // Let the connection storm settle before measuring.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  Progress(0, 1, fmt::format("{}: CPU with {} peers", r.mode, options.peers));
  ASSIGN_OR_RETURN(r.busy, CpuPercent(hub_pid, options.window_s));

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
  std::printf("%-16s %10s %12s %14s %12s %14s %12s %12s\n", "metadata", "idle %",
              "connected", "with peers %", "per peer %", "change to all", "SIGKILL seen",
              "SIGSTOP seen");
  for (const auto& r : results) {
    const double per_peer = r.connected ? (r.busy - r.idle) / r.connected : 0;
    std::printf("%-16s %10.3f %12u %14.2f %12.5f %11.0f ms %9.0f ms %9.0f ms\n", r.mode.c_str(),
                r.idle, r.connected, r.busy, per_peer, r.fanout_ms, r.kill_ms, r.stop_ms);
  }
  return 0;
}

}  // namespace kvagent::cli

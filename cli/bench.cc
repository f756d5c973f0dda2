#include "cli/bench.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cli/agent_client.h"
#include "cli/bench_fast.h"
#include "cli/bench_memory.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "cli/local_agents.h"
#include "fmt/format.h"
#include "proto/kvagent.pb.h"
#include "registry/shm_mapping.h"
#include "transport/base/format.h"
#include "transport/base/status_macros.h"
#include "transport/base/text.h"
#include "transport/cuda_driver.h"

extern char** environ;

namespace kvagent::cli {
namespace {

using Clock = std::chrono::steady_clock;


std::string SizeName(uint64_t bytes) {
  if (bytes >= (1 << 20) && bytes % (1 << 20) == 0) return fmt::format("{}M", bytes >> 20);
  if (bytes >= (1 << 10) && bytes % (1 << 10) == 0) return fmt::format("{}K", bytes >> 10);
  return fmt::format("{}", bytes);
}

// Agents this run started; their logs are shown when it fails.
std::vector<std::string> g_agent_logs;

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "bench: %s: %s\n", what.c_str(), std::string(status.message()).c_str());
  PrintAgentLogs(g_agent_logs);
  return 1;
}

// ---- ucx_perftest: UCX's own ceiling between two processes on loopback ----


// The binary as found on PATH (or as given, when it has a slash); empty when absent.
std::string FindOnPath(const std::string& binary) {
  if (binary.empty()) return "";
  if (binary.find('/') != std::string::npos) return access(binary.c_str(), X_OK) == 0 ? binary : "";
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + binary;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// Starts `args` with stdout+stderr into `out_fd` (or /dev/null when -1).
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& args, int out_fd) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (out_fd >= 0) {
    posix_spawn_file_actions_adddup2(&actions, out_fd, STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, out_fd, STDERR_FILENO);
  } else {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  }
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::InternalError(fmt::format("starting {}: {}", args[0], std::strerror(rc)));
  }
  return pid;
}

// Waits for `pid` up to `timeout_ms`, then SIGKILLs it. Returns the wait status.
int Reap(pid_t pid, int timeout_ms) {
  int status = 0;
  const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < until) {
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return status;
}

// Runs the client once: its whole output, or an error when it failed or hung.
absl::StatusOr<std::string> RunClient(const std::vector<std::string>& args, int timeout_ms) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return absl::InternalError(fmt::format("pipe(): {}", std::strerror(errno)));
  }
  auto pid = Spawn(args, fds[1]);
  ::close(fds[1]);
  if (!pid.ok()) {
    ::close(fds[0]);
    return pid.status();
  }
  std::string out;
  const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
  char buf[4096];
  bool timed_out = false;
  while (true) {
    const int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count());
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    if (poll(&p, 1, left) <= 0) continue;
    const ssize_t n = ::read(fds[0], buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  const int status = Reap(*pid, timed_out ? 0 : 5000);
  if (timed_out) {
    return absl::DeadlineExceededError(
        fmt::format("{} did not finish within {} ms", fmt::join(args, " "), timeout_ms));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(fmt::format("{} exited with status {}: {}", fmt::join(args, " "),
                                           status, out.substr(out.size() > 400 ? out.size() - 400 : 0)));
  }
  return out;
}

// The "Final:" line's overall bandwidth: the columns are iterations, overhead
// p50/average/overall (us), bandwidth average/overall (MB/s, where UCX's MB is
// 2^20 bytes), message rate average/overall.
absl::StatusOr<double> ParsePerftestGbps(const std::string& output) {
  std::stringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("Final:", 0) != 0) continue;
    std::stringstream fields(line.substr(6));
    std::vector<double> values;
    double v;
    while (fields >> v) values.push_back(v);
    if (values.size() < 7) break;
    return values[5] * 1048576.0 / 1e9;
  }
  return absl::InternalError(fmt::format(
      "ucx_perftest printed no 'Final:' line with 8 numbers; its output ends: {}",
      output.substr(output.size() > 400 ? output.size() - 400 : 0)));
}

class Perftest {
 public:
  Perftest(std::string binary, bool quick) : binary_(std::move(binary)), quick_(quick) {}
  bool available() const { return !binary_.empty(); }

  // GB/s of `test` (ucp_put_bw or ucp_get) at `size`, cached per (test, size);
  // nullopt (with one line on stderr) when it could not be measured.
  std::optional<double> Gbps(const std::string& test, uint64_t size) {
    if (binary_.empty()) return std::nullopt;
    const auto key = std::make_pair(test, size);
    if (auto it = cache_.find(key); it != cache_.end()) return it->second;
    auto gbps = Measure(test, size);
    std::optional<double> result;
    if (gbps.ok()) {
      result = *gbps;
    } else {
      std::fprintf(stderr, "bench: ucx_perftest -t %s -s %lu: %s\n", test.c_str(),
                   static_cast<unsigned long>(size), std::string(gbps.status().message()).c_str());
    }
    cache_[key] = result;
    return result;
  }

 private:
  absl::StatusOr<double> Measure(const std::string& test, uint64_t size) {
    // Enough iterations to move a few hundred MiB, at least 3 of even the largest.
    const uint64_t budget = quick_ ? (64ull << 20) : (512ull << 20);
    const uint64_t iterations = std::clamp<uint64_t>(budget / size, 3, 20000);
    const uint64_t warmup = std::max<uint64_t>(1, iterations / 10);
    absl::Status last;
    for (int attempt = 0; attempt < 3; ++attempt) {
      auto port = FreePort();
      if (!port.ok()) return port.status();
      auto server = Spawn({binary_, "-p", std::to_string(*port)}, -1);
      if (!server.ok()) return server.status();
      // The server needs a moment to listen; a refused client exits at once, so
      // retry it until it connects.
      absl::StatusOr<std::string> out;
      for (int tries = 0; tries < 40; ++tries) {
        std::this_thread::sleep_for(std::chrono::milliseconds(tries == 0 ? 30 : 50));
        out = RunClient({binary_, "127.0.0.1", "-p", std::to_string(*port), "-t", test, "-s",
                         std::to_string(size), "-n", std::to_string(iterations), "-w",
                         std::to_string(warmup)},
                        120000);
        if (out.ok() || out.status().code() == absl::StatusCode::kDeadlineExceeded) break;
        if (waitpid(*server, nullptr, WNOHANG) == *server) break;  // server gone: new port
      }
      Reap(*server, 3000);
      if (out.ok()) return ParsePerftestGbps(*out);
      last = out.status();
    }
    return last;
  }

  std::string binary_;
  bool quick_;
  std::map<std::pair<std::string, uint64_t>, std::optional<double>> cache_;
};

// ---- the sweep ----

struct Cell {
  v1::TransferOp op = v1::WRITE;
  bool scattered = false;
  uint64_t block = 0;
  uint32_t batch = 0;
};

struct CellResult {
  Cell cell;
  uint64_t transfers = 0;
  double gbps = 0, transfers_per_s = 0, avg_us = 0, p50_us = 0, p99_us = 0;
  std::optional<double> notify_p50_us, notify_p99_us;
  uint64_t notifications_missing = 0;
  std::optional<double> perftest_gbps, memcpy_gbps;
  double gbps_inflight = 0;  // with 4 transfers in flight at once
  uint64_t runs = 0;  // UCX/memcpy operations per transfer after coalescing
  std::string data_path;  // the initiator's path to the target when the cell ran
  bool verified = false;
  std::optional<FastCell> fast;  // the same cell through the fast path ring
};

// What one block size's cells share: the pool viewed as items of `block` bytes, the
// region names, and the item orders the scattered pattern walks.
struct Layout {
  uint64_t block = 0;
  uint64_t items = 0;
  std::string group;
  std::string region;
  std::vector<uint64_t> local_order, remote_order;  // scattered: random permutations
};

// Indices of transfer `i`: contiguous runs of `batch` items at the same place on
// both sides, or `batch` consecutive entries of the two permutations.
void Indices(const Layout& layout, const Cell& cell, uint64_t i, std::vector<uint64_t>* local,
             std::vector<uint64_t>* remote) {
  local->clear();
  remote->clear();
  if (!cell.scattered) {
    const uint64_t slots = layout.items / cell.batch;
    const uint64_t start = (i % slots) * cell.batch;
    for (uint64_t k = 0; k < cell.batch; ++k) {
      local->push_back(start + k);
      remote->push_back(start + k);
    }
    return;
  }
  for (uint64_t k = 0; k < cell.batch; ++k) {
    const uint64_t at = (i * cell.batch + k) % layout.items;
    local->push_back(layout.local_order[at]);
    remote->push_back(layout.remote_order[at]);
  }
}

// Memory of both pools as this process sees it: the agents' shm objects mapped here
// when on this host, else private buffers (the memcpy baseline only; nothing verified).
struct Pools {
  // VRAM (--memory vram): device pools, owned by RunBench's VramMemory; the host
  // pointers stay null and every byte check goes through device copies.
  bool vram = false;
  const DeviceAllocation* initiator_device = nullptr;
  const DeviceAllocation* target_device = nullptr;
  uint64_t initiator_handle = 0, target_handle = 0;  // the sessions' memory handles
  registry::ShmMapping initiator_mapping, target_mapping;
  uint8_t* initiator = nullptr;
  uint8_t* target = nullptr;
  bool shared = false;  // the agents' own memory: results can be verified
  std::vector<void*> private_buffers;
  uint64_t bytes = 0;
  ~Pools() {
    for (void* p : private_buffers) munmap(p, bytes);
  }
};

// Writes a buffer larger than the last-level cache, so the next copy starts cold.
class CacheEvictor {
 public:
  explicit CacheEvictor(uint64_t bytes) : buffer_(bytes, 1) {}
  void Evict() {
    ++round_;
    for (size_t i = 0; i < buffer_.size(); i += 64) buffer_[i] = static_cast<uint8_t>(round_ + i);
  }

 private:
  std::vector<uint8_t> buffer_;
  uint64_t round_ = 0;
};

// A client of the target agent taking its notifications on one stream, as a decode
// worker would, until the one for `end_id` arrives; records when each notification
// whose transfer id starts with `prefix` came.
class NotificationWatch {
 public:
  NotificationWatch(std::string address, std::string prefix, std::string end_id)
      : state_(std::make_shared<State>()) {
    thread_ = std::thread([state = state_, address = std::move(address),
                           prefix = std::move(prefix), end_id = std::move(end_id)] {
      AgentClient client(address);
      absl::Status status = client.WatchNotifications(
          {}, 30 * 60 * 1000, [&](const v1::Notification& n) {
            if (n.transfer_id().rfind(prefix, 0) != 0) return true;
            if (n.transfer_id() == end_id) return false;
            absl::MutexLock lock(&state->mu);
            state->seen.emplace(n.transfer_id(), Clock::now());
            return true;
          });
      absl::MutexLock lock(&state->mu);
      state->ended = true;
      state->status = status;
    });
  }
  ~NotificationWatch() { Finish(false); }
  NotificationWatch(const NotificationWatch&) = delete;
  NotificationWatch& operator=(const NotificationWatch&) = delete;

  // Waits up to `timeout` for `id`'s notification: OK when it came, else why not.
  absl::Status WaitFor(const std::string& id, absl::Duration timeout) {
    absl::MutexLock lock(&state_->mu);
    struct Arg {
      State* state;
      const std::string* id;
    } arg{state_.get(), &id};
    state_->mu.AwaitWithTimeout(absl::Condition(+[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                  return a->state->ended || a->state->seen.count(*a->id) > 0;
                                }, &arg),
                                timeout);
    if (state_->seen.count(id) > 0) return absl::OkStatus();
    return state_->status.ok() ? absl::DeadlineExceededError("not delivered in time")
                               : state_->status;
  }
  // When `wait`, waits up to 10 s for the end notification; then lets the thread go
  // (joined if the stream ended, else detached: it owns its state and ends with it).
  void Finish(bool wait) {
    if (!thread_.joinable()) return;
    bool ended;
    {
      absl::MutexLock lock(&state_->mu);
      if (wait) {
        state_->mu.AwaitWithTimeout(
            absl::Condition(+[](bool* e) { return *e; }, &state_->ended), absl::Seconds(10));
      }
      ended = state_->ended;
    }
    if (ended) {
      thread_.join();
    } else {
      thread_.detach();
    }
  }
  // Notifications seen so far: transfer id -> when it came.
  std::map<std::string, Clock::time_point> Seen() const {
    absl::MutexLock lock(&state_->mu);
    return state_->seen;
  }

 private:
  struct State {
    absl::Mutex mu;
    std::map<std::string, Clock::time_point> seen ABSL_GUARDED_BY(mu);
    bool ended ABSL_GUARDED_BY(mu) = false;
    absl::Status status ABSL_GUARDED_BY(mu);
  };
  std::shared_ptr<State> state_;
  std::thread thread_;
};

class Bench {
 public:
  Bench(const BenchOptions& options, AgentClient& initiator, std::string target_address,
        std::string peer, Pools& pools, Perftest& perftest, FastRing* fast)
      : options_(options),
        initiator_(initiator),
        target_address_(std::move(target_address)),
        peer_(std::move(peer)),
        pools_(pools),
        perftest_(perftest),
        fast_(fast),
        evictor_(64ull << 20),
        prefix_(fmt::format("bench{}.", getpid())) {}

  absl::StatusOr<CellResult> Run(const Layout& layout, const Cell& cell) {
    CellResult result;
    result.cell = cell;
    const std::string base = fmt::format("{}{}.", prefix_, cell_number_++);
    const bool write = cell.op == v1::WRITE;
    std::vector<uint64_t> local, remote;

    // WRITE: the target's notifications, timed when they reach a client of the
    // target agent, as a decode worker sees them.
    const std::string end_id = base + "end";
    std::optional<NotificationWatch> watch;
    if (write) watch.emplace(target_address_, base, end_id);

    // Warm-up: maps and registrations in place, and (WRITE) the notification
    // stream open before anything is timed. The last one carries the notification
    // waited for below.
    for (int w = 0; w < 3; ++w) {
      Indices(layout, cell, w, &local, &remote);
      const std::string id = w == 2 ? base + "warmup" : fmt::format("{}warmup{}", base, w);
      if (auto s = Transfer(layout, cell, id, local, remote, write); !s.ok()) {
        return s.status();
      }
    }
    if (auto peers = initiator_.Peers(); peers.ok()) {
      for (const auto& p : peers->peers()) {
        if (p.name() == peer_) result.data_path = p.data_path();
      }
    }
    if (write) {
      const std::string warm = base + "warmup";
      if (absl::Status why = watch->WaitFor(warm, absl::Seconds(10)); !why.ok()) {
        return absl::DeadlineExceededError(fmt::format(
            "the target agent at {} delivered no notification for '{}' within 10 s ({}); check "
            "its log", target_address_, warm, why.message()));
      }
    }

    const double target_s = options_.quick ? 0.1 : 0.3;
    const uint64_t min_transfers = options_.quick ? 5 : 20;
    const uint64_t max_transfers = 100000;
    std::vector<double> latencies;
    std::vector<std::pair<std::string, Clock::time_point>> submitted;
    const auto start = Clock::now();
    for (uint64_t i = 0; i < max_transfers; ++i) {
      if (i >= min_transfers && Seconds(Clock::now() - start) >= target_s) break;
      Indices(layout, cell, i, &local, &remote);
      const std::string id = fmt::format("{}{}", base, i);
      const auto t0 = Clock::now();
      auto state = Transfer(layout, cell, id, local, remote, write);
      const auto t1 = Clock::now();
      if (!state.ok()) {
        return state.status();
      }
      result.runs = state->runs();
      latencies.push_back(Micros(t1 - t0));
      if (write) submitted.emplace_back(id, t0);
    }
    const double seconds = Seconds(Clock::now() - start);
    result.transfers = latencies.size();
    const double bytes = static_cast<double>(result.transfers) * cell.batch * cell.block;
    result.gbps = bytes / seconds / 1e9;
    result.transfers_per_s = result.transfers / seconds;
    result.avg_us = std::accumulate(latencies.begin(), latencies.end(), 0.0) / latencies.size();
    result.p50_us = Percentile(latencies, 50);
    result.p99_us = Percentile(latencies, 99);

    // The same cell with kInflight transfers in flight at once (a scheduler keeps
    // many requests moving; ucx_perftest keeps a window of puts outstanding too).
    {
      // The agent refuses two transfers writing the same destination at once, so each
      // thread keeps to its own slots (a slot: `batch` items; a pool of fewer slots
      // than kInflight runs fewer threads).
      constexpr uint32_t kInflight = 4;
      const uint64_t slots = std::max<uint64_t>(1, layout.items / cell.batch);
      const uint32_t inflight = static_cast<uint32_t>(std::min<uint64_t>(kInflight, slots));
      absl::Mutex mu;
      uint64_t moved = 0;
      absl::Status failed;
      const auto pipelined_start = Clock::now();
      std::vector<std::thread> threads;
      for (uint32_t k = 0; k < inflight; ++k) {
        threads.emplace_back([&, k] {
          std::vector<uint64_t> l, r;
          uint64_t done = 0;
          absl::Status error;
          for (uint64_t n = 0; error.ok(); ++n) {
            if (n >= min_transfers && Seconds(Clock::now() - pipelined_start) >= target_s) break;
            // Slot k, k + inflight, k + 2 * inflight, ... below slots (whole rounds only).
            const uint64_t per_thread = slots / inflight;
            const uint64_t i = k + inflight * (n % per_thread);
            Indices(layout, cell, i, &l, &r);
            auto state = Transfer(layout, cell, fmt::format("{}p{}.{}", base, k, n), l, r, write);
            if (state.ok()) {
              ++done;
            } else {
              error = state.status();
            }
          }
          absl::MutexLock lock(&mu);
          moved += done;
          if (!error.ok() && failed.ok()) failed = error;
        });
      }
      for (auto& t : threads) t.join();
      if (!failed.ok()) {
        return failed;
      }
      result.gbps_inflight = static_cast<double>(moved) * cell.batch * cell.block /
                             Seconds(Clock::now() - pipelined_start) / 1e9;
    }

    // One more transfer whose destination was scribbled first: its bytes must
    // equal the source afterwards. For WRITE it also ends the notification stream.
    Indices(layout, cell, result.transfers, &local, &remote);
    if (pools_.shared) Scribble(layout, cell, local, remote);
    if (auto s = Transfer(layout, cell, end_id, local, remote, write); !s.ok()) {
      return s.status();
    }
    result.verified = pools_.shared && Verify(layout, cell, local, remote);
    if (write) {
      watch->Finish(true);
      std::vector<double> notify;
      const auto seen = watch->Seen();
      for (const auto& [id, t0] : submitted) {
        auto it = seen.find(id);
        if (it == seen.end()) {
          ++result.notifications_missing;
        } else {
          notify.push_back(Micros(it->second - t0));
        }
      }
      if (!notify.empty()) {
        result.notify_p50_us = Percentile(notify, 50);
        result.notify_p99_us = Percentile(notify, 99);
      }
    }

    if (fast_ != nullptr) {
      ASSIGN_OR_RETURN(result.fast, RunFast(layout, cell, base + "f."));
    }

    result.memcpy_gbps = Memcpy(layout, cell, result.transfers);
    const uint64_t perftest_size = cell.scattered ? cell.block : cell.block * cell.batch;
    result.perftest_gbps = perftest_.Gbps(write ? "ucp_put_bw" : "ucp_get", perftest_size);
    return result;
  }

 private:
  // The cell through the fast path ring: transfer i has the gRPC column's indices;
  // then one more into scribbled destination pages, checked byte for byte.
  absl::StatusOr<FastCell> RunFast(const Layout& layout, const Cell& cell, const std::string& prefix) {
    const bool write = cell.op == v1::WRITE;
    FastCellSpec spec;
    spec.prefix = prefix;
    spec.bytes_per_transfer = cell.batch * cell.block;
    spec.slots = std::max<uint64_t>(1, layout.items / cell.batch);
    spec.make = [&](uint32_t, uint64_t i) {
      std::vector<uint64_t> local, remote;
      Indices(layout, cell, i, &local, &remote);
      return Request(layout, cell, "", local, remote, write);
    };
    if (write) spec.notify_address = target_address_;
    spec.seconds = options_.quick ? 0.1 : 0.3;
    spec.min_transfers = options_.quick ? 5 : 20;
    ASSIGN_OR_RETURN(FastCell fast, RunFastCell(*fast_, spec));
    std::vector<uint64_t> local, remote;
    Indices(layout, cell, fast.transfers + 1, &local, &remote);
    if (pools_.shared) Scribble(layout, cell, local, remote);
    v1::SubmitTransferRequest last = Request(layout, cell, prefix + "end", local, remote, false);
    last.clear_wait();
    RETURN_IF_ERROR(fast_->Transfer(last));
    fast.verified = pools_.shared && Verify(layout, cell, local, remote);
    if (fast.notifications_missing > 0) {
      std::fprintf(stderr, "bench: fast path, %s %s %s x %u: %lu notifications did not arrive\n",
                   v1::TransferOp_Name(cell.op).c_str(), cell.scattered ? "scattered" : "contiguous",
                   SizeName(cell.block).c_str(), cell.batch,
                   static_cast<unsigned long>(fast.notifications_missing));
    }
    return fast;
  }

  v1::SubmitTransferRequest Request(const Layout& layout, const Cell& cell, const std::string& id,
                                    const std::vector<uint64_t>& local,
                                    const std::vector<uint64_t>& remote, bool notify) const {
    v1::SubmitTransferRequest request;
    request.set_transfer_id(id);
    request.set_peer(peer_);
    request.set_op(cell.op);
    request.set_timeout_ms(options_.timeout_ms);
    if (notify) request.set_notification("bench");
    auto* segment = request.add_segments()->mutable_items();
    segment->set_local_group(layout.group);
    segment->set_remote_group(layout.group);
    for (uint64_t i : local) segment->add_local_indices(i);
    for (uint64_t i : remote) segment->add_remote_indices(i);
    // The agent answers when the transfer has ended: one round trip per transfer.
    request.set_wait(true);
    return request;
  }

  absl::StatusOr<v1::TransferState> Transfer(const Layout& layout, const Cell& cell,
                                             const std::string& id,
                                             const std::vector<uint64_t>& local,
                                             const std::vector<uint64_t>& remote, bool notify) {
    auto state = initiator_.Submit(Request(layout, cell, id, local, remote, notify));
    if (!state.ok()) return state.status();
    if (state->phase() != v1::COMPLETED) {
      return absl::InternalError(fmt::format(
          "transfer '{}' ({} x {} bytes, {}) ended {}: {}", id, cell.batch, cell.block,
          v1::TransferOp_Name(cell.op), v1::TransferPhase_Name(state->phase()),
          state->error_message()));
    }
    return state;
  }

  // The (source, destination) bases: WRITE moves initiator -> target pages,
  // READ target -> initiator; local indices address the initiator.
  std::pair<uint8_t*, uint8_t*> Ends(const Cell& cell) const {
    return cell.op == v1::WRITE ? std::make_pair(pools_.initiator, pools_.target)
                                : std::make_pair(pools_.target, pools_.initiator);
  }

  // VRAM: the (source, destination) device pointers, as Ends.
  std::pair<uint64_t, uint64_t> DeviceEnds(const Cell& cell) const {
    const uint64_t i = pools_.initiator_device->dptr(), t = pools_.target_device->dptr();
    return cell.op == v1::WRITE ? std::make_pair(i, t) : std::make_pair(t, i);
  }

  void Scribble(const Layout& layout, const Cell& cell, const std::vector<uint64_t>& local,
                const std::vector<uint64_t>& remote) {
    if (pools_.vram) {
      const uint64_t dst = DeviceEnds(cell).second;
      std::vector<uint8_t> scribble(layout.block, 0xEE);
      for (uint64_t i : cell.op == v1::WRITE ? remote : local) {
        (void)pools_.initiator_device->driver()->Copy(
            dst + i * layout.block, reinterpret_cast<uint64_t>(scribble.data()), layout.block);
      }
      return;
    }
    uint8_t* dst = Ends(cell).second;
    const auto& dst_idx = cell.op == v1::WRITE ? remote : local;
    for (uint64_t i : dst_idx) std::memset(dst + i * layout.block, 0xEE, layout.block);
  }

  bool Verify(const Layout& layout, const Cell& cell, const std::vector<uint64_t>& local,
              const std::vector<uint64_t>& remote) {
    auto [src, dst] = Ends(cell);
    const auto& src_idx = cell.op == v1::WRITE ? local : remote;
    const auto& dst_idx = cell.op == v1::WRITE ? remote : local;
    // VRAM: both blocks are copied back to the host and compared there.
    std::vector<uint8_t> src_host, dst_host;
    if (pools_.vram) {
      src_host.resize(layout.block);
      dst_host.resize(layout.block);
    }
    for (size_t k = 0; k < src_idx.size(); ++k) {
      const uint8_t* a = nullptr;
      const uint8_t* b = nullptr;
      if (pools_.vram) {
        auto [dsrc, ddst] = DeviceEnds(cell);
        transport::CudaDriver* cuda = pools_.initiator_device->driver();
        absl::Status copied = cuda->Copy(reinterpret_cast<uint64_t>(src_host.data()),
                                         dsrc + src_idx[k] * layout.block, layout.block);
        if (copied.ok()) {
          copied = cuda->Copy(reinterpret_cast<uint64_t>(dst_host.data()),
                              ddst + dst_idx[k] * layout.block, layout.block);
        }
        if (!copied.ok()) {
          std::fprintf(stderr, "bench: copying blocks back from the device to verify them: %s\n",
                       std::string(copied.message()).c_str());
          return false;
        }
        a = dst_host.data();
        b = src_host.data();
      } else {
        a = dst + dst_idx[k] * layout.block;
        b = src + src_idx[k] * layout.block;
      }
      if (std::memcmp(a, b, layout.block) != 0) {
        std::fprintf(stderr, "bench: %s %s block %lu: destination item %lu differs from source %lu\n",
                     v1::TransferOp_Name(cell.op).c_str(), cell.scattered ? "scattered" : "contiguous",
                     static_cast<unsigned long>(layout.block), static_cast<unsigned long>(dst_idx[k]),
                     static_cast<unsigned long>(src_idx[k]));
        return false;
      }
    }
    return true;
  }

  // Times `copy(src_idx, dst_idx)` over the page lists of the first transfers the
  // agents moved (bounded in count and bytes); `before` runs untimed before each.
  template <typename Before, typename Copy>
  std::optional<double> TimedCopies(const Layout& layout, const Cell& cell, uint64_t transfers,
                                    Before before, Copy copy) {
    const uint64_t max_reps = options_.quick ? 10 : 30;
    const uint64_t max_bytes = options_.quick ? (256ull << 20) : (2ull << 30);
    std::vector<uint64_t> local, remote;
    double seconds = 0, bytes = 0;
    for (uint64_t i = 0; i < std::max<uint64_t>(transfers, 1); ++i) {
      if (i >= max_reps || (i >= 3 && bytes >= max_bytes)) break;
      Indices(layout, cell, i, &local, &remote);
      const auto& src_idx = cell.op == v1::WRITE ? local : remote;
      const auto& dst_idx = cell.op == v1::WRITE ? remote : local;
      before();
      const auto t0 = Clock::now();
      if (!copy(src_idx, dst_idx)) return std::nullopt;
      seconds += Seconds(Clock::now() - t0);
      bytes += static_cast<double>(src_idx.size()) * layout.block;
    }
    if (seconds <= 0) return std::nullopt;
    return bytes / seconds / 1e9;
  }

  // One thread copies the same page lists the agents moved, from a cold cache each
  // time (the eviction is not timed); the one-host ceiling.
  std::optional<double> Memcpy(const Layout& layout, const Cell& cell, uint64_t transfers) {
    if (pools_.vram) return DeviceMemcpy(layout, cell, transfers);
    auto [src, dst] = Ends(cell);
    if (src == nullptr || dst == nullptr) return std::nullopt;
    return TimedCopies(
        layout, cell, transfers, [this] { evictor_.Evict(); },
        [&](const std::vector<uint64_t>& src_idx, const std::vector<uint64_t>& dst_idx) {
          for (size_t k = 0; k < src_idx.size(); ++k) {
            std::memcpy(dst + dst_idx[k] * layout.block, src + src_idx[k] * layout.block,
                        layout.block);
          }
          return true;
        });
  }

  // VRAM: the same page lists as device-to-device cuMemcpyAsync on one stream, then a
  // stream sync per transfer (what one engine-side copy loop reaches on this GPU).
  std::optional<double> DeviceMemcpy(const Layout& layout, const Cell& cell, uint64_t transfers) {
    transport::CudaDriver* cuda = pools_.initiator_device->driver();
    if (stream_ == nullptr) {
      auto stream = cuda->CreateStream(pools_.initiator_device->device());
      if (!stream.ok()) {
        std::fprintf(stderr, "bench: device copy baseline: %s\n",
                     std::string(stream.status().message()).c_str());
        return std::nullopt;
      }
      stream_ = *stream;
    }
    auto [src, dst] = DeviceEnds(cell);
    return TimedCopies(
        layout, cell, transfers, [] {},
        [&](const std::vector<uint64_t>& src_idx, const std::vector<uint64_t>& dst_idx) {
          absl::Status s;
          for (size_t k = 0; k < src_idx.size() && s.ok(); ++k) {
            s = cuda->CopyAsync(dst + dst_idx[k] * layout.block, src + src_idx[k] * layout.block,
                                layout.block, stream_);
          }
          if (s.ok()) s = cuda->SynchronizeStream(stream_);
          if (!s.ok()) {
            std::fprintf(stderr, "bench: device copy baseline: %s\n",
                         std::string(s.message()).c_str());
          }
          return s.ok();
        });
  }

 public:
  ~Bench() {
    if (stream_ != nullptr) (void)pools_.initiator_device->driver()->DestroyStream(stream_);
  }

 private:
  CUstream_st* stream_ = nullptr;  // VRAM baseline
  const BenchOptions& options_;
  AgentClient& initiator_;
  std::string target_address_;
  std::string peer_;
  Pools& pools_;
  Perftest& perftest_;
  FastRing* fast_;  // null: no fast column
  CacheEvictor evictor_;
  std::string prefix_;
  uint64_t cell_number_ = 0;
};

// ---- rate: many one-page transfers at once through the gRPC API ----

struct RateResult {
  std::string mode;       // "single" (SubmitTransfer) or "batch" (SubmitTransfers)
  uint32_t clients = 0;   // client threads, each with its own channel
  uint32_t per_call = 0;  // transfers per RPC
  uint64_t transfers = 0;
  double transfers_per_s = 0, p50_us = 0, p99_us = 0;  // latency per call
  uint64_t notifications = 0;  // DATA_READY seen by the target's client
  uint64_t late_notifications = 0;  // of those, taken after the closing transfer's
};

// One 4 KiB WRITE of the pages of transfer `i` (entry i of each side's permutation),
// with `notification` unless empty; without id and wait.
v1::SubmitTransferRequest OnePageWrite(const BenchOptions& options, const std::string& peer,
                                       const Layout& layout, uint64_t i,
                                       const std::string& notification) {
  v1::SubmitTransferRequest request;
  request.set_peer(peer);
  request.set_op(v1::WRITE);
  request.set_timeout_ms(options.timeout_ms);
  if (!notification.empty()) request.set_notification(notification);
  auto* segment = request.add_segments()->mutable_items();
  segment->set_local_group(layout.group);
  segment->set_remote_group(layout.group);
  segment->add_local_indices(layout.local_order[i % layout.items]);
  segment->add_remote_indices(layout.remote_order[i % layout.items]);
  return request;
}

// `clients` threads submit one-page WRITEs (each with a notification, waiting for the
// end) for about `seconds`; a client of the target takes the notifications, and
// every transfer's must arrive.
absl::StatusOr<RateResult> RunRate(const BenchOptions& options, const std::string& initiator_address,
                                   const std::string& target_address, const std::string& peer,
                                   const Layout& layout, uint32_t clients, uint32_t per_call,
                                   double seconds, const std::string& prefix) {
  RateResult result;
  result.mode = per_call == 1 ? "single" : "batch";
  result.clients = clients;
  result.per_call = per_call;
  const std::string end_id = prefix + "end";

  NotificationWatch watch(target_address, prefix, end_id);

  auto one_page = [&](const std::string& id, uint64_t i) {
    v1::SubmitTransferRequest request = OnePageWrite(options, peer, layout, i, "rate");
    request.set_transfer_id(id);
    request.set_wait(true);
    return request;
  };

  absl::Mutex mu;
  std::vector<double> latencies;
  uint64_t completed = 0;
  absl::Status failure;
  const auto start = Clock::now();
  const auto stop_at = start + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(seconds));
  std::vector<std::thread> threads;
  for (uint32_t c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      AgentClient client(initiator_address, options.timeout_ms);
      std::vector<double> mine;
      uint64_t done = 0;
      absl::Status error;
      for (uint64_t call = 0; error.ok() && Clock::now() < stop_at; ++call) {
        const auto t0 = Clock::now();
        if (per_call == 1) {
          const uint64_t i = call * clients + c;
          auto state = client.Submit(one_page(fmt::format("{}{}.{}", prefix, c, call), i));
          if (!state.ok()) {
            error = state.status();
          } else if (state->phase() != v1::COMPLETED) {
            error = absl::InternalError(fmt::format("transfer '{}' ended {}: {}",
                                                    state->transfer_id(),
                                                    v1::TransferPhase_Name(state->phase()),
                                                    state->error_message()));
          } else {
            ++done;
          }
        } else {
          v1::SubmitTransfersRequest batch;
          batch.set_wait(true);
          for (uint32_t k = 0; k < per_call; ++k) {
            const uint64_t i = (call * clients + c) * per_call + k;
            *batch.add_transfers() = one_page(fmt::format("{}{}.{}.{}", prefix, c, call, k), i);
          }
          auto answer = client.SubmitBatch(batch);
          if (!answer.ok()) {
            error = answer.status();
          } else {
            for (const auto& r : answer->results()) {
              if (r.error_code() != 0 || r.state().phase() != v1::COMPLETED) {
                error = absl::InternalError(fmt::format(
                    "a batched transfer failed: {}",
                    r.error_code() != 0 ? r.error_message() : r.state().error_message()));
                break;
              }
              ++done;
            }
          }
        }
        mine.push_back(Micros(Clock::now() - t0));
      }
      absl::MutexLock lock(&mu);
      latencies.insert(latencies.end(), mine.begin(), mine.end());
      completed += done;
      if (!error.ok() && failure.ok()) failure = error;
    });
  }
  for (auto& t : threads) t.join();
  const double elapsed = Seconds(Clock::now() - start);

  // The closing transfer ends the notification stream once everything before it came.
  AgentClient closer(initiator_address, options.timeout_ms);
  auto closed = closer.Submit(one_page(end_id, 0));
  watch.Finish(true);
  result.notifications = watch.Seen().size();
  // Notifications of different transfers carry no order between them: those that
  // came after the closing one are still queued at the target.
  AgentClient target(target_address, options.timeout_ms);
  for (int round = 0; round < 50 && result.notifications < completed; ++round) {
    auto late = target.Poll(0);
    if (!late.ok()) break;
    uint64_t mine = 0;
    for (const auto& n : late->notifications()) {
      if (n.transfer_id().rfind(prefix, 0) == 0 && n.transfer_id() != end_id) ++mine;
    }
    result.notifications += mine;
    result.late_notifications += mine;
    if (result.notifications < completed) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!failure.ok()) return failure;
  if (!closed.ok()) return closed.status();
  result.transfers = completed;
  result.transfers_per_s = completed / elapsed;
  result.p50_us = Percentile(latencies, 50);
  result.p99_us = Percentile(latencies, 99);
  if (result.notifications != completed) {
    return absl::DataLossError(fmt::format(
        "{} {} transfers completed but the target's client saw {} notifications for them",
        result.mode, completed, result.notifications));
  }
  return result;
}

std::string RateJson(const RateResult& r) {
  return fmt::format(
      "{{\"kind\": \"rate\", \"op\": \"WRITE\", \"block_bytes\": 4096, \"mode\": \"{}\", "
      "\"clients\": {}, \"transfers_per_call\": {}, \"transfers\": {}, "
      "\"transfers_per_s\": {:.1f}, \"call_p50_us\": {:.1f}, \"call_p99_us\": {:.1f}, "
      "\"notifications\": {}, \"late_notifications\": {}}}",
      r.mode, r.clients, r.per_call, r.transfers, r.transfers_per_s, r.p50_us, r.p99_us,
      r.notifications, r.late_notifications);
}

std::string RateLine(const RateResult& r) {
  return fmt::format("rate  {:<6} clients {:>2} x {:>3} per call: {:>7} transfers, {:>8.0f} /s, "
                     "call p50 {:>6.0f} us, p99 {:>6.0f} us, notifications {}",
                     r.mode, r.clients, r.per_call, r.transfers, r.transfers_per_s, r.p50_us,
                     r.p99_us, r.notifications == r.transfers ? "all" : "MISSING");
}

// ---- output ----

std::string Opt(const std::optional<double>& v, const char* format = "{:.3f}") {
  return v ? fmt::format(fmt::runtime(format), *v) : "null";
}

std::optional<double> Ratio(double num, const std::optional<double>& den) {
  if (!den || *den <= 0) return std::nullopt;
  return num / *den;
}

std::string JsonLine(const CellResult& r) {
  return fmt::format(
      "{{\"kind\": \"cell\", \"op\": \"{}\", \"pattern\": \"{}\", \"block_bytes\": {}, \"batch\": {}, "
      "\"transfers\": {}, \"gbps\": {:.3f}, \"transfers_per_s\": {:.1f}, \"avg_us\": {:.1f}, "
      "\"p50_us\": {:.1f}, \"p99_us\": {:.1f}, \"notify_p50_us\": {}, \"notify_p99_us\": {}, "
      "\"perftest_gbps\": {}, \"memcpy_gbps\": {}, \"ratio_perftest\": {}, \"ratio_memcpy\": {}, "
      "\"gbps_inflight4\": {:.3f}, \"ratio_perftest_inflight4\": {}, \"ratio_memcpy_inflight4\": {}, "
      "\"data_path\": \"{}\", \"runs\": {}, \"verified\": {}{}}}",
      v1::TransferOp_Name(r.cell.op), r.cell.scattered ? "scattered" : "contiguous", r.cell.block,
      r.cell.batch, r.transfers, r.gbps, r.transfers_per_s, r.avg_us, r.p50_us, r.p99_us,
      Opt(r.notify_p50_us, "{:.1f}"), Opt(r.notify_p99_us, "{:.1f}"), Opt(r.perftest_gbps),
      Opt(r.memcpy_gbps), Opt(Ratio(r.gbps, r.perftest_gbps)), Opt(Ratio(r.gbps, r.memcpy_gbps)),
      r.gbps_inflight, Opt(Ratio(r.gbps_inflight, r.perftest_gbps)),
      Opt(Ratio(r.gbps_inflight, r.memcpy_gbps)), r.data_path, r.runs,
      r.verified ? "true" : "false", FastCellJson(r.fast, r.perftest_gbps, r.memcpy_gbps));
}

constexpr const char* kHeader =
    "{:<5} {:<10} {:>5} {:>5} {:>6} {:>7} {:>8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} "
    "{:>6} {:>6} {:>7} {:>6} {:>6} {} {:>3} {}";

std::string Cellf(const std::optional<double>& v, const char* format) {
  return v ? fmt::format(fmt::runtime(format), *v) : "-";
}

std::string TableLine(const CellResult& r) {
  return fmt::format(fmt::runtime(kHeader), v1::TransferOp_Name(r.cell.op),
                     r.cell.scattered ? "scattered" : "contig", SizeName(r.cell.block), r.cell.batch,
                     r.transfers, fmt::format("{:.2f}", r.gbps),
                     fmt::format("{:.0f}", r.transfers_per_s), fmt::format("{:.0f}", r.avg_us),
                     fmt::format("{:.0f}", r.p50_us), fmt::format("{:.0f}", r.p99_us),
                     Cellf(r.notify_p50_us, "{:.0f}"), Cellf(r.notify_p99_us, "{:.0f}"),
                     Cellf(r.perftest_gbps, "{:.2f}"), Cellf(r.memcpy_gbps, "{:.2f}"),
                     Cellf(Ratio(r.gbps, r.perftest_gbps), "{:.2f}"),
                     Cellf(Ratio(r.gbps, r.memcpy_gbps), "{:.2f}"),
                     fmt::format("{:.2f}", r.gbps_inflight),
                     Cellf(Ratio(r.gbps_inflight, r.perftest_gbps), "{:.2f}"),
                     Cellf(Ratio(r.gbps_inflight, r.memcpy_gbps), "{:.2f}"),
                     FastCellColumns(r.fast, r.perftest_gbps, r.memcpy_gbps),
                     r.verified ? "yes" : "NO", r.data_path);
}

// Has each agent allocate a sealed memfd of `bytes` (over the local door) and maps
// both here.
absl::Status MakePools(AgentClient& initiator, AgentClient& target, uint64_t bytes,
                       const std::string& label, Pools* pools) {
  pools->bytes = bytes;
  auto a = initiator.AllocateMemory(label + "i", bytes);
  if (!a.ok()) return a.status();
  auto b = target.AllocateMemory(label + "t", bytes);
  if (!b.ok()) return b.status();
  pools->initiator_handle = a->info.handle();
  pools->target_handle = b->info.handle();
  pools->initiator_mapping = std::move(a->mapping);
  pools->target_mapping = std::move(b->mapping);
  pools->initiator = static_cast<uint8_t*>(pools->initiator_mapping.data());
  pools->target = static_cast<uint8_t*>(pools->target_mapping.data());
  pools->shared = true;
  // Distinct contents on the two sides, so a copy that did not happen shows.
  auto* wi = reinterpret_cast<uint64_t*>(pools->initiator);
  auto* wt = reinterpret_cast<uint64_t*>(pools->target);
  for (uint64_t w = 0; w < bytes / 8; ++w) {
    wi[w] = w * 0x9E3779B97F4A7C15ull;
    wt[w] = ~w * 0xBF58476D1CE4E5B9ull;
  }
  return absl::OkStatus();
}

// VRAM: one device pool per agent, with distinct contents (as MakePools), filled
// through a bounded host buffer.
struct VramMemory {
  DeviceAllocation initiator, target;
};

absl::Status MakeVramPools(transport::CudaDriver* cuda, int device, uint64_t bytes,
                           const std::string& label, VramMemory* memory, Pools* pools) {
  ASSIGN_OR_RETURN(memory->initiator,
                   DeviceAllocation::Allocate(cuda, device, bytes, label + " initiator pool"));
  ASSIGN_OR_RETURN(memory->target,
                   DeviceAllocation::Allocate(cuda, device, bytes, label + " target pool"));
  pools->vram = true;
  pools->shared = true;
  pools->bytes = bytes;
  pools->initiator_device = &memory->initiator;
  pools->target_device = &memory->target;
  const uint64_t step = std::min<uint64_t>(bytes, 64ull << 20);
  std::vector<uint64_t> words(step / 8 + 1);
  for (int side = 0; side < 2; ++side) {
    const uint64_t dptr = side == 0 ? memory->initiator.dptr() : memory->target.dptr();
    for (uint64_t at = 0; at < bytes; at += step) {
      const uint64_t n = std::min(step, bytes - at);
      for (uint64_t w = 0; w < (n + 7) / 8; ++w) {
        const uint64_t g = at / 8 + w;
        words[w] = side == 0 ? g * 0x9E3779B97F4A7C15ull : ~g * 0xBF58476D1CE4E5B9ull;
      }
      RETURN_IF_ERROR(cuda->Copy(dptr + at, reinterpret_cast<uint64_t>(words.data()), n));
    }
  }
  return absl::OkStatus();
}

// The pool as items of `block` bytes, one region in group `group`, with the random
// item orders the scattered pattern walks.
Layout MakeLayout(uint64_t block, uint64_t pool_bytes, std::string group, std::mt19937_64& rng) {
  Layout layout;
  layout.block = block;
  layout.items = pool_bytes / block;
  layout.group = std::move(group);
  layout.region = layout.group + ".r";
  layout.local_order.resize(layout.items);
  std::iota(layout.local_order.begin(), layout.local_order.end(), 0);
  layout.remote_order = layout.local_order;
  std::shuffle(layout.local_order.begin(), layout.local_order.end(), rng);
  std::shuffle(layout.remote_order.begin(), layout.remote_order.end(), rng);
  return layout;
}

// The one KV region of `layout` (the whole pool as items of one block size); the
// caller names where its memory is.
v1::RegionSpec LayoutSpec(const Layout& layout, v1::MemoryKind memory) {
  v1::RegionSpec spec;
  spec.set_name(layout.region);
  spec.set_kind(v1::KV);
  spec.set_group(layout.group);
  spec.set_memory(memory);
  spec.set_length(layout.items * layout.block);
  spec.mutable_layout()->set_num_items(layout.items);
  spec.mutable_layout()->set_item_bytes(layout.block);
  return spec;
}

absl::Status RegisterVramLayout(AgentClient& agent, const DeviceAllocation& pool,
                                const Layout& layout) {
  v1::RegisterRegionsRequest request;
  auto* spec = request.add_regions();
  *spec = LayoutSpec(layout, v1::VRAM);
  spec->mutable_cuda_ipc()->set_ipc_handle(pool.ipc_handle());
  spec->mutable_cuda_ipc()->set_device(pool.device());
  spec->mutable_cuda_ipc()->set_offset(0);
  return agent.Register(request).status();
}

absl::Status RegisterLayout(AgentClient& agent, uint64_t memory_handle, const Layout& layout) {
  v1::RegisterRegionsRequest request;
  auto* spec = request.add_regions();
  *spec = LayoutSpec(layout, v1::DRAM);
  spec->mutable_shm()->set_memory_handle(memory_handle);
  spec->mutable_shm()->set_offset(0);
  return agent.Register(request).status();
}

}  // namespace

int RunBench(const BenchOptions& options) {
  // VRAM: this process plays the engine, so it needs the driver and the device before
  // any agent starts; the device pools outlive the agents (declared first).
  if (options.memory != "dram" && options.memory != "vram") {
    return Fail("arguments", absl::InvalidArgumentError(fmt::format(
                                 "--memory '{}' is unknown; use --memory dram or --memory vram",
                                 options.memory)));
  }
  const bool vram = options.memory == "vram";
  transport::CudaDriver* cuda = nullptr;
  if (vram) {
    auto driver = transport::CudaDriver::Load();
    if (!driver.ok()) {
      return Fail("--memory vram (on a machine without a GPU use --memory dram)", driver.status());
    }
    cuda = *driver;
    if (auto s = cuda->MakeCurrent(options.device); !s.ok()) {
      return Fail(fmt::format("--memory vram --device {}", options.device), s);
    }
  }
  VramMemory vram_memory;
  LocalAgents local;
  std::string initiator_address = options.initiator_address;
  std::string target_address = options.target_address;
  if (initiator_address.empty() != target_address.empty()) {
    return Fail("arguments", absl::InvalidArgumentError(
                                 "give both --initiator and --target, or neither to start two agents"));
  }
  const uint64_t pool_bytes = options.pool_mib << 20;
  if (options.pool_mib == 0) {
    return Fail("arguments", absl::InvalidArgumentError("--pool-mib must be at least 1"));
  }
  std::vector<uint64_t> blocks = options.quick
                                     ? std::vector<uint64_t>{4 << 10, 64 << 10, 1 << 20}
                                     : std::vector<uint64_t>{4 << 10, 64 << 10, 1 << 20, 4 << 20};
  std::vector<uint32_t> batches =
      options.quick ? std::vector<uint32_t>{1, 64} : std::vector<uint32_t>{1, 16, 64, 256};
  auto wanted = [&options](uint64_t block, uint32_t batch) {
    if (options.cells.empty()) return true;
    return std::find(options.cells.begin(), options.cells.end(), std::pair{block, batch}) !=
           options.cells.end();
  };
  if (options.fast_only) {
    blocks.clear();
  } else if (!options.cells.empty()) {
    blocks.clear();
    batches.clear();
    for (const auto& [block, batch] : options.cells) {
      if (std::find(blocks.begin(), blocks.end(), block) == blocks.end()) blocks.push_back(block);
      if (std::find(batches.begin(), batches.end(), batch) == batches.end()) batches.push_back(batch);
    }
  }

  if (initiator_address.empty()) {
    LocalAgentsOptions start;
    start.argv0 = options.argv0;
    start.kvagentd = options.kvagentd;
    start.label = "bench";
    start.first_name = "initiator";
    start.second_name = "target";
    start.extra_args = {"--log-level", "warn"};
    if (options.memory_regions > 16384) {
      // The memory phase's engine registers them all (the default per-owner limit is
      // 16,384).
      start.extra_args.push_back("--max-regions-per-owner");
      start.extra_args.push_back(std::to_string(options.memory_regions + 1024));
    }
    if (!options.shm_direct) {
      start.extra_args.push_back("--shm-direct");
      start.extra_args.push_back("off");
    }
    if (options.copy_lanes != 0) {
      start.extra_args.push_back("--copy-lanes");
      start.extra_args.push_back(std::to_string(options.copy_lanes));
    }
    absl::Status started = StartLocalAgents(start, &local);
    g_agent_logs = local.log_paths;
    if (!started.ok()) return Fail("starting the agents", started);
    initiator_address = local.first->address();
    target_address = local.second->address();
  }

  AgentClient initiator(initiator_address, options.timeout_ms), target(target_address, options.timeout_ms);
  for (auto* c : {&initiator, &target}) {
    if (auto s = c->WaitReady(10000); !s.ok()) return Fail("waiting for agent", s);
  }
  const std::string label = fmt::format("bench{}", getpid());
  Pools pools;
  if (auto s = vram ? MakeVramPools(cuda, options.device, pool_bytes, label, &vram_memory, &pools)
                    : MakePools(initiator, target, pool_bytes, label, &pools);
      !s.ok()) {
    return Fail("allocating the pools", s);
  }
  auto peer = initiator.Connect(target_address);
  if (!peer.ok()) return Fail("connecting initiator to target", peer.status());

  Perftest perftest(FindOnPath(options.perftest), options.quick);
  std::string ucx_tls = std::getenv("UCX_TLS") ? std::getenv("UCX_TLS") : "default";
  if (!options.json) {
    std::printf("kvagent bench: initiator %s -> target %s ('%s'), UCX transports %s "
                "(error mode %s), UCX_TLS=%s, pool %lu MiB per agent%s\n",
                initiator_address.c_str(), target_address.c_str(), peer->name().c_str(),
                peer->transports().c_str(), peer->error_mode().c_str(),
                ucx_tls.c_str(), static_cast<unsigned long>(options.pool_mib),
                options.quick ? ", quick" : "");
    std::printf("copy lanes (same-host host copies): %s\n",
                options.copy_lanes != 0        ? std::to_string(options.copy_lanes).c_str()
                : local.started()              ? "the agents' default (the cores they may use, at most 4)"
                                               : "the agents' own setting");
    if (!perftest.available()) {
      std::printf("ucx_perftest not found (%s): the perftest columns stay empty\n",
                  options.perftest.c_str());
    }
    if (vram) {
      std::printf("pools in VRAM (CUDA device %d, one IPC handle per agent); mc_GB/s = a "
                  "device-to-device cuMemcpyAsync of the same pages\n",
                  options.device);
    }
    if (!options.fast_only) {
    std::printf("GB/s = 1e9 bytes/s; latency in us, submit -> COMPLETED seen by the client; "
                "notify = submit -> the target's client sees the notification (WRITE); @4 = the same "
                "cell with 4 transfers in flight at once; f* = the same cell through the fast path ring "
                "(Submit + Reap, one at a time; @4: 4 in flight on the ring), ratios to the same "
                "baselines\n\n");
    std::printf("%s\n", fmt::format(fmt::runtime(kHeader), "op", "pattern", "block", "batch", "xfers",
                                    "GB/s", "xfer/s", "avg_us", "p50_us", "p99_us", "ntf_p50",
                                    "ntf_p99", "pt_GB/s", "mc_GB/s", "x_pt", "x_mc", "GB/s@4",
                                    "x_pt@4", "x_mc@4", FastCellHeader(), "ok", "path")
                            .c_str());
    }
  } else if (!perftest.available()) {
    std::fprintf(stderr, "bench: ucx_perftest not found (%s): perftest_gbps is null\n",
                 options.perftest.c_str());
  }
  std::fflush(stdout);

  // The fast column: a ring on its own session of the initiator (the local door only).
  std::unique_ptr<FastRing> fast;
  if (auto opened = FastRing::Open(initiator_address, options.timeout_ms, "kvagentctl-bench-fast",
                                   options.fast_spin_us);
      opened.ok()) {
    fast = *std::move(opened);
  } else {
    std::fprintf(stderr, "bench: no fast path column: %s\n",
                 std::string(opened.status().message()).c_str());
  }
  Bench bench(options, initiator, target_address, peer->name(), pools, perftest, fast.get());
  std::mt19937_64 rng(options.seed);
  size_t total = 0;
  for (uint64_t block : blocks) {
    for (uint32_t batch : batches) total += (batch <= pool_bytes / block && wanted(block, batch) ? 4 : 0);
  }
  size_t done = 0;
  bool all_verified = true;
  for (uint64_t block : blocks) {
    if (pool_bytes / block == 0) continue;
    Layout layout = MakeLayout(block, pool_bytes, fmt::format("{}.b{}", label, SizeName(block)), rng);
    // One block size at a time over the whole pool: the registry refuses
    // overlapping regions of one object, and every size gets the full pool.
    if (auto s = vram ? RegisterVramLayout(initiator, vram_memory.initiator, layout)
                      : RegisterLayout(initiator, pools.initiator_handle, layout);
        !s.ok()) {
      return Fail(fmt::format("registering {} on the initiator", layout.region), s);
    }
    if (auto s = vram ? RegisterVramLayout(target, vram_memory.target, layout)
                      : RegisterLayout(target, pools.target_handle, layout);
        !s.ok()) {
      return Fail(fmt::format("registering {} on the target", layout.region), s);
    }
    // Let both agents' peer monitors (every --peer-refresh-ms, 200 by default) see
    // the new regions and map them, so no refresh lands inside a timed transfer.
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    for (uint32_t batch : batches) {
      if (!wanted(block, batch)) continue;
      if (batch > layout.items) {
        std::fprintf(stderr, "bench: skipping %s x %u: the %lu MiB pool holds %lu blocks; raise "
                     "--pool-mib\n", SizeName(block).c_str(), batch,
                     static_cast<unsigned long>(options.pool_mib),
                     static_cast<unsigned long>(layout.items));
        continue;
      }
      for (v1::TransferOp op : {v1::WRITE, v1::READ}) {
        for (bool scattered : {false, true}) {
          Cell cell{op, scattered, block, batch};
          Progress(done, total, fmt::format("{} {} {} x {}", v1::TransferOp_Name(op),
                                            scattered ? "scattered" : "contiguous", SizeName(block),
                                            batch));
          auto result = bench.Run(layout, cell);
          if (!result.ok()) {
            return Fail(fmt::format("{} {} {} x {}", v1::TransferOp_Name(op),
                                    scattered ? "scattered" : "contiguous", SizeName(block), batch),
                        result.status());
          }
          ++done;
          if (isatty(STDERR_FILENO)) std::fprintf(stderr, "\r%80s\r", "");
          all_verified = all_verified && (result->verified || !pools.shared);
          const std::string line =
              options.json ? JsonLine(*result) : TableLine(*result);
          std::printf("%s\n", line.c_str());
          if (result->notifications_missing > 0) {
            std::fprintf(stderr, "bench: %lu of %lu notifications did not arrive\n",
                         static_cast<unsigned long>(result->notifications_missing),
                         static_cast<unsigned long>(result->transfers));
          }
          std::fflush(stdout);
        }
      }
    }
    (void)initiator.Deregister({layout.region});
    (void)target.Deregister({layout.region});
  }
  if (!options.cells.empty()) {
    // A targeted run: the grid cells asked for, none of the later phases.
    Progress(total, total, "done");
    if (local.started()) local.StopAndClean();
    return all_verified ? 0 : 1;
  }
  // One-page WRITEs from several clients at once: what the API sustains. Its pools
  // are shared memory, so a VRAM run skips it (and the agent-memory phase below).
  if (vram) {
    if (!options.json) {
      std::printf("\nrate and agent memory: not measured with --memory vram (run the bench "
                  "with --memory dram for them)\n");
    }
  } else {
    Layout layout = MakeLayout(4 << 10, pool_bytes, fmt::format("{}.rate", label), rng);
    if (auto s = RegisterLayout(initiator, pools.initiator_handle, layout); !s.ok()) {
      return Fail(fmt::format("registering {} on the initiator", layout.region), s);
    }
    if (auto s = RegisterLayout(target, pools.target_handle, layout); !s.ok()) {
      return Fail(fmt::format("registering {} on the target", layout.region), s);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    if (!options.json) std::printf("\n");
    struct Shape {
      uint32_t clients, per_call;
    };
    const std::vector<Shape> shapes = {{1, 1}, {8, 1}, {1, 64}, {4, 64}};
    FastPhaseOptions fast_phase;
    int n = 0;
    for (const Shape& shape : shapes) {
      if (options.fast_only) break;
      Progress(done, total, fmt::format("rate: {} clients x {} per call", shape.clients, shape.per_call));
      auto rate = RunRate(options, initiator_address, target_address, peer->name(), layout,
                          shape.clients, shape.per_call, options.quick ? 1.0 : 3.0,
                          fmt::format("{}.rate{}.", label, n++));
      if (isatty(STDERR_FILENO)) std::fprintf(stderr, "\r%80s\r", "");
      if (!rate.ok()) {
        return Fail(fmt::format("rate {} x {}", shape.clients, shape.per_call), rate.status());
      }
      std::printf("%s\n", (options.json ? RateJson(*rate) : RateLine(*rate)).c_str());
      std::fflush(stdout);
      if (shape.clients == 1) {
        (shape.per_call == 1 ? fast_phase.grpc_rate_single : fast_phase.grpc_rate_batch64) =
            rate->transfers_per_s;
      }
    }
    if (fast) {
      fast_phase.initiator_address = initiator_address;
      fast_phase.target_address = target_address;
      fast_phase.timeout_ms = options.timeout_ms;
      fast_phase.spin_us = options.fast_spin_us;
      fast_phase.quick = options.quick;
      fast_phase.json = options.json;
      fast_phase.one_page = [&](uint64_t i, bool notify) {
        return OnePageWrite(options, peer->name(), layout, i, notify ? "fast" : "");
      };
      fast_phase.pages = layout.items;
      if (local.started()) {
        fast_phase.initiator_pid = local.first->pid();
        fast_phase.target_pid = local.second->pid();
      }
      if (auto s = RunFastPhase(fast_phase, initiator, &fast); !s.ok()) {
        return Fail("fast path", s);
      }
    }
    (void)initiator.Deregister({layout.region});
    (void)target.Deregister({layout.region});
  }
  if (options.fast_only) {
    if (local.started()) local.StopAndClean();
    return 0;
  }
  // Agent memory beyond the pools with 1,000 regions and many transfers (issue 6's
  // bound); /proc is read, so only for agents started here.
  if (local.started() && !vram) {
    MemoryBenchOptions memory;
    memory.transfers = options.quick ? 10000 : 100000;
    if (options.memory_regions > memory.regions) {
      // The scale line (issue 13): many small regions, measured; issue 6's 64 MiB
      // target is for 1,000 regions, and none is set at this scale.
      memory.items_per_region = 1;
      memory.transfers /= 10;
      memory.limit_bytes = 0;
    }
    memory.regions = options.memory_regions;
    memory.progress = [&](uint64_t n, uint64_t of) {
      Progress(n, of, fmt::format("memory: {} of {} transfers", n, of));
    };
    auto measured = RunMemoryBench(memory, initiator, target, peer->name(), local.first->pid(),
                                   local.second->pid());
    if (isatty(STDERR_FILENO)) std::fprintf(stderr, "\r%80s\r", "");
    if (!measured.ok()) return Fail("memory", measured.status());
    std::printf("%s%s\n", options.json ? "" : "\n",
                (options.json ? MemoryBenchJson(*measured) : FormatMemoryBench(*measured)).c_str());
    std::fflush(stdout);
  } else if (!options.json && !vram) {
    std::printf("\nmemory: not measured (the agents run elsewhere; their /proc is not here)\n");
  }
  Progress(total, total, "done");
  if (local.started()) local.StopAndClean();
  if (!all_verified) {
    std::fprintf(stderr, "bench: some cells' destination bytes differ from their source\n");
    return 1;
  }
  return 0;
}

absl::StatusOr<std::vector<std::pair<uint64_t, uint32_t>>> ParseCells(std::string_view text) {
  std::vector<std::pair<uint64_t, uint32_t>> cells;
  for (absl::string_view piece : absl::StrSplit(absl::string_view(text.data(), text.size()), ',')) {
    const std::string_view entry(piece.data(), piece.size());
    auto bad = [&](std::string_view why) {
      return absl::InvalidArgumentError(fmt::format(
          "--cells entry '{}': {}; give BLOCK:BATCH pairs separated by commas, BLOCK in bytes "
          "or with K or M (64K:16,1M:16)",
          Printable(entry, 64), why));
    };
    const size_t colon = entry.find(':');
    if (colon == std::string_view::npos) return bad("no ':'");
    std::string_view block_text = entry.substr(0, colon);
    uint64_t unit = 1;
    if (!block_text.empty() && (block_text.back() == 'K' || block_text.back() == 'M')) {
      unit = block_text.back() == 'K' ? 1024 : 1024 * 1024;
      block_text.remove_suffix(1);
    }
    uint64_t block = 0;
    uint32_t batch = 0;
    if (!absl::SimpleAtoi(absl::string_view(block_text.data(), block_text.size()), &block) || block == 0 || block > (uint64_t{1} << 30) / unit) {
      return bad("the block size is not a number from 1 byte to 1 GiB");
    }
    if (!absl::SimpleAtoi(absl::string_view(piece.substr(colon + 1)), &batch) || batch == 0 || batch > 65536) {
      return bad("the batch is not a number from 1 to 65536");
    }
    cells.emplace_back(block * unit, batch);
  }
  return cells;
}

}  // namespace kvagent::cli

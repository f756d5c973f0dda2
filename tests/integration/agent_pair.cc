#include "tests/integration/agent_pair.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "base/format.h"
#include "base/status_macros.h"
#include "cli/child_process.h"
#include "client/fast_path.h"
#include "fmt/format.h"
#include "tests/unit/catch_main.h"

extern char** environ;

namespace kvagent::testing {
namespace {

template <typename T>
T Require(absl::StatusOr<T> value, const std::string& what) {
  if (!value.ok()) throw std::runtime_error(fmt::format("{}: {}", what, value.status().ToString()));
  return *std::move(value);
}

std::string MakeWorkDir() {
  static int counter = 0;
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = fmt::format("{}/pair.{}.{}", tmp ? tmp : "/tmp", getpid(), counter++);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

const char* SubmitPath() {
  const char* path = std::getenv("KVAGENT_TEST_SUBMIT");
  return path != nullptr && std::string(path) == "fast" ? "fast" : "grpc";
}

absl::StatusOr<v1::TransferState> SubmitThrough(cli::AgentClient& client,
                                                const v1::SubmitTransferRequest& request) {
  if (std::string(SubmitPath()) != "fast") return client.Submit(request);
  static absl::Mutex mu;
  static auto* rings = new std::map<std::string, std::unique_ptr<client::FastPath>>();
  static uint64_t next = 1;
  absl::MutexLock lock(&mu);
  auto session = client.Session();
  if (!session.ok()) return session.status();
  auto& fast = (*rings)[(*session)->token()];
  if (!fast) {
    auto opened = client::FastPath::Open(*session);
    if (!opened.ok()) return opened.status();
    fast = *std::move(opened);
  }
  const uint64_t mine = next++;
  std::vector<client::FastCompletion> done;
  absl::Status put = fast->SubmitOrReap(request, mine, &done, absl::Seconds(20));
  if (!put.ok()) return put;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  for (;;) {
    for (const auto& c : done) {
      if (c.user_data != mine) continue;
      if (c.code != absl::StatusCode::kOk && c.phase == v1::TRANSFER_PHASE_UNSPECIFIED) {
        return c.status();  // refused: never accepted
      }
      return client.Get(request.transfer_id());
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          fmt::format("the fast path's completion of '{}' did not come in 60 s",
                      request.transfer_id()));
    }
    done.clear();
    auto got = fast->Reap(&done, 64, absl::Milliseconds(100));
    if (!got.ok()) return got.status();
  }
}

absl::StatusOr<pid_t> SpawnKvagentctl(const std::vector<std::string>& args,
                                      const std::string& stdout_path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  std::string ctl = fmt::format("{}/kvagent/cli/kvagentctl", srcdir ? srcdir : ".");
  std::vector<std::string> all = {ctl};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, stdout_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, ctl.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::InternalError(fmt::format("posix_spawn {}: {}", ctl, std::strerror(rc)));
  }
  return pid;
}

absl::StatusOr<std::string> KvagentctlOutput(const std::vector<std::string>& args,
                                             const std::string& stdout_path) {
  ASSIGN_OR_RETURN(const pid_t pid, SpawnKvagentctl(args, stdout_path));
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) {
    return absl::InternalError(fmt::format("waitpid kvagentctl: {}", std::strerror(errno)));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(fmt::format(
        "kvagentctl {} ended with status {:#x} (its stderr is the test's)",
        args.empty() ? "" : args.back(), status));
  }
  std::ifstream in(stdout_path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

AgentPair::AgentPair(const AgentPairOptions& options) : work_dir_(MakeWorkDir()) {
  const std::string binary = Require(cli::FindKvagentd(""), "finding kvagentd");
  for (auto [name, process] : {std::pair{"prefill", &prefill_}, {"decode", &decode_}}) {
    cli::DaemonOptions d;
    d.binary = binary;
    d.name = name;
    d.work_dir = work_dir_;
    d.env = options.env;
    d.extra_args = options.extra_args;
    *process = Require(cli::DaemonProcess::Start(d), fmt::format("starting {}", name));
    ShowOnFailure(process->log_path(), fmt::format("agent '{}' log", name));
  }
  prefill_client_ = std::make_unique<cli::AgentClient>(prefill_.address());
  decode_client_ = std::make_unique<cli::AgentClient>(decode_.address());
  prefill_pool_ = Require(cli::CreateKvPool(*prefill_client_, "prefill", options.shape), "prefill pool");
  decode_pool_ = Require(cli::CreateKvPool(*decode_client_, "decode", options.shape), "decode pool");
  Require(prefill_client_->Connect(decode_.address()), "connecting prefill to decode");
  ResetContents();
}

void AgentPair::ResetContents() {
  for (uint32_t r = 0; r < prefill_pool_.regions(); ++r) {
    for (uint64_t p = 0; p < prefill_pool_.shape.pages; ++p) {
      cli::FillPage(prefill_pool_.Page(r, p), prefill_pool_.shape.page_bytes, 7, r, p);
    }
  }
  std::memset(decode_pool_.mapping.data(), 0xEE, decode_pool_.bytes());
}

bool AgentPair::PageEqual(uint64_t src, uint64_t dst) {
  for (uint32_t r = 0; r < prefill_pool_.regions(); ++r) {
    if (std::memcmp(prefill_pool_.Page(r, src), decode_pool_.Page(r, dst),
                    prefill_pool_.shape.page_bytes) != 0) {
      return false;
    }
  }
  return true;
}

bool AgentPair::PageUntouched(uint64_t dst) {
  for (uint32_t r = 0; r < decode_pool_.regions(); ++r) {
    const uint8_t* page = decode_pool_.Page(r, dst);
    for (uint64_t b = 0; b < decode_pool_.shape.page_bytes; ++b) {
      if (page[b] != 0xEE) return false;
    }
  }
  return true;
}

v1::SubmitTransferRequest KvWrite(const std::string& id, const std::vector<uint64_t>& local,
                                  const std::vector<uint64_t>& remote,
                                  const std::string& notification) {
  v1::SubmitTransferRequest request;
  request.set_transfer_id(id);
  request.set_peer("decode");
  request.set_op(v1::WRITE);
  request.set_notification(notification);
  auto* items = request.add_segments()->mutable_items();
  items->set_local_group("kv");
  items->set_remote_group("kv");
  for (auto i : local) items->add_local_indices(i);
  for (auto i : remote) items->add_remote_indices(i);
  return request;
}

v1::RegionSpec AuxRegion(const std::string& name, uint64_t handle, uint64_t offset,
                         uint64_t length) {
  v1::RegionSpec spec;
  spec.set_name(name);
  spec.set_kind(v1::AUX);
  spec.set_memory(v1::DRAM);
  spec.mutable_shm()->set_memory_handle(handle);
  spec.mutable_shm()->set_offset(offset);
  spec.set_length(length);
  return spec;
}

v1::SubmitTransferRequest BytesWrite(const std::string& id, const std::string& local,
                                     const std::string& remote, uint64_t length) {
  v1::SubmitTransferRequest write;
  write.set_transfer_id(id);
  write.set_peer("decode");
  write.set_op(v1::WRITE);
  write.set_wait(true);
  auto* segment = write.add_segments()->mutable_bytes();
  segment->set_local_region(local);
  segment->set_remote_region(remote);
  segment->set_length(length);
  return write;
}

absl::StatusOr<v1::PeerInfo> WaitPeerVersion(cli::AgentClient& client, uint64_t version,
                                             uint32_t limit_ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(limit_ms);
  while (true) {
    auto peers = client.Peers();
    if (!peers.ok()) return peers.status();
    if (peers->peers_size() != 1) {
      return absl::FailedPreconditionError(
          fmt::format("{} peers, not one: {}", peers->peers_size(), peers->DebugString()));
    }
    if (peers->peers(0).metadata_version() >= version) return peers->peers(0);
    if (std::chrono::steady_clock::now() >= until) {
      return absl::DeadlineExceededError(fmt::format(
          "the peer is not at metadata version {} after {} ms: {}", version, limit_ms,
          peers->peers(0).DebugString()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

absl::Status WaitTransferring(cli::AgentClient& client, const std::string& id,
                              uint32_t limit_ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(limit_ms);
  while (true) {
    auto state = client.Get(id);
    if (!state.ok()) return state.status();
    if (state->phase() == v1::TRANSFERRING) return absl::OkStatus();
    if (state->phase() != v1::PENDING || std::chrono::steady_clock::now() >= until) {
      return absl::FailedPreconditionError(
          fmt::format("transfer '{}' is not TRANSFERRING: {}", id, state->DebugString()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

v1::SubmitTransferRequest Placed(v1::SubmitTransferRequest request) {
  request.set_complete_when(v1::COMPLETE_WHEN_PLACED);
  return request;
}

v1::TransferState WaitForState(cli::AgentClient& client, const std::string& id,
                               const std::function<bool(const v1::TransferState&)>& ready,
                               const std::string& peer, uint32_t timeout_ms) {
  v1::TransferState last;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < until) {
    auto state = client.Get(id, peer);
    if (!state.ok()) {
      std::fprintf(stderr, "WaitForState '%s': %s\n", id.c_str(), state.status().ToString().c_str());
      break;
    }
    last = *std::move(state);
    if (ready(last)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return last;
}

std::vector<v1::Notification> PollNotifications(cli::AgentClient& client, size_t count,
                                                uint32_t timeout_ms) {
  std::vector<v1::Notification> out;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (out.size() < count && std::chrono::steady_clock::now() < until) {
    auto polled = client.Poll(0);
    if (!polled.ok()) {
      std::fprintf(stderr, "PollNotifications: %s\n", polled.status().ToString().c_str());
      break;
    }
    for (const auto& n : polled->notifications()) out.push_back(n);
    if (out.size() < count) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return out;
}

std::string SuspendAgent(pid_t pid) {
  const absl::Status stopped = cli::SuspendChild(pid);
  return stopped.ok() ? "" : stopped.ToString();
}

bool Alive(pid_t pid) {
  siginfo_t info;
  std::memset(&info, 0, sizeof info);
  if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0) return false;
  return info.si_pid == 0;
}

}  // namespace kvagent::testing

// AgentPair starts two real kvagentd processes ("prefill" and "decode") on loopback
// with small KV pools registered and prefill connected to decode. Shared by the
// integration tests.
#pragma once

#include <chrono>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"

namespace kvagent::testing {

struct AgentPairOptions {
  cli::KvPoolShape shape = [] {
    cli::KvPoolShape s;
    s.layers = 4;
    s.pages = 32;
    s.page_bytes = 4096;
    return s;
  }();
  std::map<std::string, std::string> env;
  std::vector<std::string> extra_args;
};

class AgentPair {
 public:
  explicit AgentPair(const AgentPairOptions& options = {});

  cli::AgentClient& prefill() { return *prefill_client_; }
  cli::AgentClient& decode() { return *decode_client_; }
  cli::KvPool& prefill_pool() { return prefill_pool_; }
  cli::KvPool& decode_pool() { return decode_pool_; }
  cli::DaemonProcess& prefill_process() { return prefill_; }
  cli::DaemonProcess& decode_process() { return decode_; }
  const std::string& work_dir() const { return work_dir_; }

  // Fills every prefill page with its pattern and every decode page with 0xEE.
  void ResetContents();
  // True when decode page `dst` of every region equals prefill page `src`.
  bool PageEqual(uint64_t src, uint64_t dst);
  // Decode page `dst` still holds 0xEE in every region.
  bool PageUntouched(uint64_t dst);

 private:
  std::string work_dir_;
  cli::DaemonProcess prefill_, decode_;
  std::unique_ptr<cli::AgentClient> prefill_client_, decode_client_;
  cli::KvPool prefill_pool_, decode_pool_;
};

// A WRITE of kv pages local[i] -> remote[i] in one segment.
v1::SubmitTransferRequest KvWrite(const std::string& id, const std::vector<uint64_t>& local,
                                  const std::vector<uint64_t>& remote,
                                  const std::string& notification = "");

// A host region `name` of `length` bytes at `offset` in AllocateMemory object `handle`
// (kind AUX, one item).
v1::RegionSpec AuxRegion(const std::string& name, uint64_t handle, uint64_t offset,
                         uint64_t length);

// A WRITE to decode of `length` bytes from our region `local` to its region `remote`,
// answered when it ends (wait).
v1::SubmitTransferRequest BytesWrite(const std::string& id, const std::string& local,
                                     const std::string& remote, uint64_t length);

// Waits until `client`'s one peer is seen at metadata version `version` or later (up to
// `limit_ms`); returns what it says of it, or why not (with the last view).
absl::StatusOr<v1::PeerInfo> WaitPeerVersion(cli::AgentClient& client, uint64_t version,
                                             uint32_t limit_ms);

// Submits `request` as the tests' submissions go: through gRPC's SubmitTransfer, or,
// when KVAGENT_TEST_SUBMIT=fast, through the local fast path of `client`'s session
// (one ring per session, opened on first use): then it answers once the entry
// completed, with the refusal as the error, else the transfer's state (GetTransfer).
// The same test cases thus check both submission paths.
absl::StatusOr<v1::TransferState> SubmitThrough(cli::AgentClient& client,
                                                const v1::SubmitTransferRequest& request);
// "fast" or "grpc": what SubmitThrough uses.
const char* SubmitPath();

// Starts `kvagentctl ARGS` ($TEST_SRCDIR/kvagent/cli/kvagentctl; the test needs it
// as data) as a child process, its stdout to `stdout_path` (created, truncated).
absl::StatusOr<pid_t> SpawnKvagentctl(const std::vector<std::string>& args,
                                      const std::string& stdout_path = "/dev/null");
// Runs `kvagentctl ARGS` to its end, its stdout to `stdout_path`; returns what it
// printed, or why not (it did not start, or did not exit 0: its status).
absl::StatusOr<std::string> KvagentctlOutput(const std::vector<std::string>& args,
                                             const std::string& stdout_path);

// `request` asking to complete when placed (complete_when, issue 15).
v1::SubmitTransferRequest Placed(v1::SubmitTransferRequest request);

// Polls GetTransfer of `id` (an incoming one from `peer` when set) every 5 ms until
// `ready` holds for its state or `timeout_ms` passed; returns the last state read (a
// failed GetTransfer is printed to stderr and ends it, returning the last good one).
v1::TransferState WaitForState(cli::AgentClient& client, const std::string& id,
                               const std::function<bool(const v1::TransferState&)>& ready,
                               const std::string& peer = "", uint32_t timeout_ms = 10000);

// Polls `client`'s notifications until `count` came or `timeout_ms` passed; returns
// those that came (fewer on a timeout; a failed poll is printed to stderr and ends it,
// so the caller's count check fails).
std::vector<v1::Notification> PollNotifications(cli::AgentClient& client, size_t count,
                                                uint32_t timeout_ms = 10000);

// Hangs agent process `pid`: SIGSTOP, then waits until every one of its threads is
// stopped (cli::SuspendChild). Returns "" once they are, else why not, so a test writes
// REQUIRE(SuspendAgent(pid) == "") and Catch shows the reason. kill() alone returns
// before the threads stop, and a peer that runs a moment longer can still acknowledge a
// transfer the test expects to hang (directory_test failed so in CI).
std::string SuspendAgent(pid_t pid);

// True while child process `pid` runs: a crashed child is a zombie until reaped, which
// kill(pid, 0) would still call alive. WNOWAIT leaves it for DaemonProcess to reap.
bool Alive(pid_t pid);

// Milliseconds from `start` (steady clock) to now: the fault tests' measured times.
inline int64_t MillisSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               start)
      .count();
}

// Polls every millisecond until the transfer is TRANSFERRING (its first batch is
// posted): OK then; FAILED_PRECONDITION with its state when it ended or is still
// PENDING after `limit_ms`.
absl::Status WaitTransferring(cli::AgentClient& client, const std::string& id,
                              uint32_t limit_ms = 5000);

}  // namespace kvagent::testing

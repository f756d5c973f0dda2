// Memory an engine owns and shares with its agent by descriptor (an unsealed memfd, or
// a file on a tmpfs), as the fault tests need it: memory that can shrink or lose pages
// under the agent. With the transfers those tests drive between two agents on one host
// (data moves shm-direct: the sender maps the receiver's memory). Used by truncate_test
// and shm_full_test.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "base/unique_fd.h"
#include "cli/agent_client.h"
#include "tests/integration/agent_pair.h"
#include "tests/limits/status_probe.h"

namespace kvagent::testing {

// One descriptor mapped here (MAP_SHARED) and shared with an agent's session.
struct EngineMemory {
  UniqueFd fd;
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
  uint64_t handle = 0;  // the agent's memory handle (RegionSpec shm.memory_handle)

  EngineMemory() = default;
  EngineMemory(const EngineMemory&) = delete;
  EngineMemory& operator=(const EngineMemory&) = delete;
  ~EngineMemory();
  // Shrinks the file to nothing: every page of it is lost to every mapping. This
  // process does not touch `data` after that.
  void Truncate();
  // Frees [offset, offset + length) of the file (FALLOC_FL_PUNCH_HOLE, size kept):
  // those pages leave every mapping, and touching them again needs new ones.
  void PunchHole(uint64_t offset, uint64_t length);
  // Bytes the file holds pages for (st_blocks), to see what is populated.
  uint64_t AllocatedBytes() const;
};

// Maps `fd` (already `bytes` long), writes a pattern from `fill` unless `fill` is
// negative (the pages then stay unallocated until someone touches them), and shares it.
std::unique_ptr<EngineMemory> ShareDescriptor(cli::AgentClient& agent, UniqueFd fd,
                                              const std::string& label, uint64_t bytes, int fill);
// A new unsealed memfd of `bytes`, filled and shared.
std::unique_ptr<EngineMemory> ShareEngineMemory(cli::AgentClient& agent, const std::string& label,
                                                uint64_t bytes, uint8_t fill);

// A request for `memory` whole as one one-item AUX region; RegisterRegion registers it.
v1::RegisterRegionsRequest WholeRegion(const std::string& name, const EngineMemory& memory);
void RegisterRegion(cli::AgentClient& agent, const std::string& name, const EngineMemory& memory);
// ShareEngineMemory (labelled `name`), then RegisterRegion as `name`.
std::unique_ptr<EngineMemory> SharedRegion(cli::AgentClient& agent, const std::string& name,
                                           uint64_t bytes, uint8_t fill);

// A WRITE of `local` to the peer "decode"'s `remote` in `pieces` byte segments (so, as
// many operations: several batches for a big transfer), the remote pieces in reverse
// order. ByteRead is the same READ (the peer's `remote` into our `local`).
v1::SubmitTransferRequest ByteWrite(const std::string& id, const std::string& local,
                                    const std::string& remote, uint64_t bytes, bool wait,
                                    uint32_t pieces = 1);
v1::SubmitTransferRequest ByteRead(const std::string& id, const std::string& local,
                                   const std::string& remote, uint64_t bytes, bool wait,
                                   uint32_t pieces = 1);

// The agent's pid (GetStatus), to tell an agent that lived from a restarted one.
uint32_t Pid(cli::AgentClient& agent);

// The sender has exactly one peer and moves bytes to it by `data_path` (its peers
// entry: "shm-direct", "ucx-am", ...).
void RequireDataPath(cli::AgentClient& sender, const std::string& data_path);

// A transfer that touched memory a caught fault broke: FAILED, DATA_LOSS, naming
// `names` (the region), the cause and the fix.
void RequireBrokenFailure(const v1::TransferState& state, const std::string& names);

// A later transfer touching broken memory: refused at submit, or failed naming it.
void RequireRefused(cli::AgentClient& agent, const v1::SubmitTransferRequest& request,
                    const std::string& names);

// Two agents on one host, GetStatus sampled on the sender while the case runs, and
// both pids, to tell a restarted agent from one that lived. By default data moves
// shm-direct; TcpFaultScene() makes a pair whose data moves as the agents' own active
// messages over tcp (`--ucx-error-mode peer`, no same-host mapping: data path ucx-am,
// as between hosts without RDMA).
struct FaultScene {
  AgentPair pair;
  StatusProbe sampler{{pair.prefill_process().address()}, 2};
  const uint32_t prefill_pid = Pid(pair.prefill());
  const uint32_t decode_pid = Pid(pair.decode());

  FaultScene() { RequireDataPath(pair.prefill(), "shm-direct"); }
  FaultScene(const AgentPairOptions& options, const std::string& data_path) : pair(options) {
    RequireDataPath(pair.prefill(), data_path);
  }
  // Both agents answer GetStatus, with the pids they started with.
  void RequireAlive();
};

}  // namespace kvagent::testing

// How the device copy path (agent/paths/device_copy.cc) moves one batch of same-host
// VRAM pages: the mechanism chosen at run time, in this order unless
// KVAGENT_DEVICE_COPY forces one: cuMemcpyBatchAsync (one driver call per batch, CUDA
// 12.8+ drivers), the gather kernel built by nvcc (gather_kernel.cu, one launch per
// batch), else one cuMemcpyAsync per page; and the batching of a batch's operations
// into copies (adjacent ones merged, long ones split, calls bounded). GetStatus,
// ListPeers and doctor report the choice (TransferEngine::device_copy_mode).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "agent/split_runs.h"

namespace kvagent::agent {

enum class DeviceCopyMechanism : uint8_t {
  kNone = 0,      // no CUDA driver: nothing to copy VRAM with
  kPerPage = 1,   // cuMemcpyAsync per operation
  kBatchApi = 2,  // cuMemcpyBatchAsync per batch
  kKernel = 3,    // the gather kernel, one launch per batch
};
// What the operator asked for (KVAGENT_DEVICE_COPY).
enum class DeviceCopyChoice : uint8_t { kAuto, kBatchApi, kKernel, kPerPage };

inline constexpr char kDeviceCopyEnv[] = "KVAGENT_DEVICE_COPY";
inline constexpr char kDeviceCopyFlag[] = "--device-copy";
// What to give instead of a value that is not one (the variable's and the flag's fix).
inline constexpr char kDeviceCopyChoices[] =
    "use auto (the best this host has), batch (cuMemcpyBatchAsync), kernel (the gather "
    "kernel) or per-page (cuMemcpyAsync per page)";
std::string_view DeviceCopyChoiceName(DeviceCopyChoice choice);  // "per-page"
// "auto", "batch", "kernel" or "per-page"; INVALID_ARGUMENT naming `entry` (the
// variable or flag), the value and the accepted ones.
absl::StatusOr<DeviceCopyChoice> ParseDeviceCopyChoice(std::string_view text,
                                                       std::string_view entry);
// KVAGENT_DEVICE_COPY of this process (auto when unset).
absl::StatusOr<DeviceCopyChoice> DeviceCopyChoiceFromEnv();

// One image of a fatbin: a cubin for one architecture or PTX a driver compiles.
struct FatbinEntry {
  bool ptx = false;
  int arch = 0;  // 90 for sm_90 / compute_90
};
// The entries of a fatbin as nvcc writes it (magic 0xBA55ED50, then one header per
// image); INVALID_ARGUMENT when the bytes are not one (bad magic, truncated, empty).
absl::StatusOr<std::vector<FatbinEntry>> ParseFatbin(const unsigned char* bytes, size_t size);
// The entry a driver loads for a GPU of compute capability `capability` (major * 10 +
// minor): a cubin of the same major version and a minor not above the GPU's, the
// newest such; else the newest PTX not above it; nullopt when neither.
std::optional<FatbinEntry> FatbinEntryFor(int capability, const std::vector<FatbinEntry>& entries);
std::string FatbinEntryName(const FatbinEntry& entry);  // "sm_90 cubin", "compute_80 PTX"

// What this host offers (the seam a test fills in; ProbeDeviceCopyAbilities reads
// the driver and the embedded kernel image).
struct DeviceCopyAbilities {
  bool driver = false;
  int driver_version = 0;       // 12080 for 12.8
  std::string batch_copy;       // CudaCopyEntryPoints::batch_copy: "" when absent
  bool kernel_launch = false;   // CudaCopyEntryPoints::kernel_launch
  int compute_capability = 0;   // device 0; 0 when unknown (no device)
  std::vector<FatbinEntry> kernel_images;  // of the embedded gather kernel
};
DeviceCopyAbilities ProbeDeviceCopyAbilities();

struct DeviceCopySelection {
  DeviceCopyMechanism mechanism = DeviceCopyMechanism::kNone;
  // The text GetStatus.device_copy, PeerInfo.device_copy and doctor show:
  // "cuMemcpyBatchAsync per batch", "gather kernel per batch (sm_90 cubin)",
  // "cuMemcpyAsync per page", "none (no CUDA driver)"; with the choice when it was
  // forced, and why a forced or better one is not used.
  std::string mode;
};
// `source` names where a forced choice came from in the mode; without a driver the
// mode still names a forced choice: "none (no CUDA driver; --device-copy=kernel ...)".
DeviceCopySelection SelectDeviceCopy(DeviceCopyChoice choice, const DeviceCopyAbilities& host,
                                     std::string_view source = kDeviceCopyEnv);

// The process's selection: made once (driver, kernel image, KVAGENT_DEVICE_COPY; a bad
// value chooses as auto and the mode names it and the accepted ones), and logged; the
// device copy path moves it to per page if the kernel then fails to load.
DeviceCopySelection CurrentDeviceCopy();
void KernelUnavailable(std::string_view reason);
// kvagentd's --device-copy: replaces KVAGENT_DEVICE_COPY, before anything copies.
void SetDeviceCopyChoice(DeviceCopyChoice choice);

// One copy of a batch: `bytes` from `src` to `dst`; `op` is the index in the batch of
// the operation it came from (the first one when merged), for error messages.
struct DeviceCopy {
  uint64_t dst = 0;
  uint64_t src = 0;
  uint64_t bytes = 0;
  uint32_t op = 0;
};
struct DeviceCopyLimits {
  uint64_t max_copy_bytes;     // longer copies are split (the kernel: block balance)
  size_t max_copies_per_call;  // one driver call or launch takes at most this many
};
// cuMemcpyBatchAsync: copies whole, 4096 per call (our bound, not the driver's).
inline constexpr DeviceCopyLimits kBatchApiLimits{UINT64_MAX, 4096};
// The kernel: a block per 128 KiB piece, at most 16384 descriptors (384 KiB) per launch.
inline constexpr DeviceCopyLimits kKernelLimits{128 << 10, 16384};

// `copies` (in batch order) as calls: a copy that continues the previous one on both
// sides merges into it, then copies over max_copy_bytes are cut into pieces of it;
// `call_ends[i]` is one past the last copy of call i. Zero-byte copies are dropped.
struct DeviceCopyPlan {
  std::vector<DeviceCopy> copies;
  std::vector<size_t> call_ends;
};
void PlanDeviceCopies(const std::vector<DeviceCopy>& copies, const DeviceCopyLimits& limits,
                      DeviceCopyPlan* plan);

// Device copy lanes (--copy-lanes, one CUDA stream each): a batch is split across
// lanes only when each lane gets at least this much (a stream's calls and its sync
// cost more than a smaller share saves).
inline constexpr uint64_t kMinDeviceLaneBytes = 1 << 20;
// The lanes' shares of `copies` (in batch order): SplitRuns (agent/split_runs.h), the
// host lanes' split, so a copy cut at a share's edge keeps its `op` in both halves.
inline void SplitDeviceCopies(const std::vector<DeviceCopy>& copies, uint32_t parts,
                              std::vector<std::vector<DeviceCopy>>* out) {
  SplitRuns(copies, parts, out);
}
// The device copy lanes' counters: per copier, and summed over the process
// (DeviceLaneTotals: GetStatus.copy_lanes.device_*).
struct DeviceLaneCounters {
  uint64_t batches = 0;
  uint64_t split_batches = 0;  // of which were split across more than one stream
  uint64_t bytes = 0;
};
DeviceLaneCounters DeviceLaneTotals();
void CountDeviceBatch(uint64_t bytes, bool split);  // adds to DeviceLaneTotals
// How many lanes a batch of `bytes` uses out of `lanes`: one per kMinDeviceLaneBytes,
// at least 1, at most `lanes`.
uint32_t DeviceLanesFor(uint64_t bytes, uint32_t lanes);

}  // namespace kvagent::agent

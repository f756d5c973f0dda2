// CopyLanes: host memcpy of one batch split across N lanes (the calling thread is
// lane 0, the others are threads of their own), so one transfer can use more than one
// core. Used by the direct host copy data path (agent/data_path.h) on the UCX worker
// thread; the batch is done when every lane is.
#pragma once

#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace kvagent::agent {

// One copy: `bytes` from `src` to `dst` (the ranges do not overlap).
struct CopyPiece {
  uint8_t* dst = nullptr;
  const uint8_t* src = nullptr;
  uint64_t bytes = 0;
};

// --copy-lanes: at most this many (more would only share the same cores).
inline constexpr uint32_t kMaxCopyLanes = 64;
// A lane gets at least this much of a batch: below it, waking a lane costs more than
// the copy it takes over (a thread wake-up is 5-50 us on a busy host; 256 KiB copy
// in 25-40 us here).
inline constexpr uint64_t kMinLaneBytes = 256 << 10;

// The default: the cores this process may run on (sched_getaffinity), at most 4.
uint32_t DefaultCopyLanes();
// OK, or INVALID_ARGUMENT naming --copy-lanes, the value, the bounds and the fix.
absl::Status ValidateCopyLanes(uint32_t lanes);

struct CopyLaneCounters {
  uint64_t batches = 0;        // Copy calls
  uint64_t split_batches = 0;  // of which were split across lanes
  uint64_t bytes = 0;
  // Lane shares the calling thread copied itself because their lane had not started
  // them when it finished its own.
  uint64_t stolen_parts = 0;
};

class CopyLanes {
 public:
  // `lanes` in [1, kMaxCopyLanes]; starts lanes - 1 threads ("copy-lane-N").
  explicit CopyLanes(uint32_t lanes);
  ~CopyLanes();
  CopyLanes(const CopyLanes&) = delete;
  CopyLanes& operator=(const CopyLanes&) = delete;

  uint32_t lanes() const { return lanes_; }
  // Copies every piece and returns when all are done. Splits the batch into as many
  // lanes as it has kMinLaneBytes (at most lanes()), each lane one run of consecutive
  // bytes (small pieces gathered, a large one cut). One caller at a time.
  void Copy(const std::vector<CopyPiece>& pieces);
  CopyLaneCounters counters() const;

  // The lanes' shares of `pieces`: `parts` runs of about equal bytes, in order.
  static std::vector<std::vector<CopyPiece>> Split(const std::vector<CopyPiece>& pieces,
                                                   uint32_t parts);

 private:
  void LaneLoop(uint32_t lane);
  static void CopyAll(const std::vector<CopyPiece>& pieces);

  const uint32_t lanes_;
  std::vector<std::thread> threads_;
  mutable absl::Mutex mu_;
  absl::CondVar work_cv_;
  absl::CondVar done_cv_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // one per split batch
  std::vector<std::vector<CopyPiece>> work_ ABSL_GUARDED_BY(mu_);  // by lane, this batch
  uint32_t pending_ ABSL_GUARDED_BY(mu_) = 0;  // lanes of this batch not yet done
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  CopyLaneCounters counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvagent::agent

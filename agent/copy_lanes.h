// CopyLanes: host memcpy of one batch split across N lanes (the calling thread is
// lane 0, the others are threads of their own), so one transfer can use more than one
// core. Used by the direct host copy data path (agent/data_path.h) on the UCX worker
// thread; the batch is done when every lane is.
#pragma once

#include <atomic>
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
// A lane is asked to help for each kMinLaneBytes of a batch beyond the first: below
// it, waking a lane costs more than the copy it could take over (a thread wake-up is
// 5-50 us on a busy host; 256 KiB copy in 25-40 us here).
inline constexpr uint64_t kMinLaneBytes = 256 << 10;
// A split batch is cut into chunks the lanes take one at a time (about kChunksPerLane
// per lane, none under kMinChunkBytes): a lane that wakes late takes what is left, and
// the caller, once every chunk is taken, waits at most for the chunks lanes are
// copying, never for a lane that has not started.
inline constexpr uint32_t kChunksPerLane = 8;
inline constexpr uint64_t kMinChunkBytes = 64 << 10;

// The default: the cores this process may run on (sched_getaffinity), at most 4.
uint32_t DefaultCopyLanes();
// OK, or INVALID_ARGUMENT naming --copy-lanes, the value, the bounds and the fix.
absl::Status ValidateCopyLanes(uint32_t lanes);

struct CopyLaneCounters {
  uint64_t batches = 0;        // Copy calls
  uint64_t split_batches = 0;  // of which were offered to other lanes (>= 2 x kMinLaneBytes)
  uint64_t bytes = 0;
  // Lanes asked to help with a split batch that had not started when the calling
  // thread had taken every chunk (their share was copied by the caller).
  uint64_t stolen_parts = 0;
  uint64_t lane_chunks = 0;  // chunks of split batches the other lanes copied
};

class CopyLanes {
 public:
  // `lanes` in [1, kMaxCopyLanes]; starts lanes - 1 threads ("copy-lane-N").
  explicit CopyLanes(uint32_t lanes);
  ~CopyLanes();
  CopyLanes(const CopyLanes&) = delete;
  CopyLanes& operator=(const CopyLanes&) = delete;

  uint32_t lanes() const { return lanes_; }
  // Copies every piece and returns when all are done. A batch of at least
  // 2 x kMinLaneBytes asks up to lanes() - 1 lanes to help (one per kMinLaneBytes
  // beyond the first) and is cut into chunks of consecutive bytes (small pieces
  // gathered, a large one cut) that the caller and the lanes take in order until none
  // is left. One caller at a time.
  void Copy(const std::vector<CopyPiece>& pieces);
  CopyLaneCounters counters() const;

  // `pieces` cut into `parts` runs of about equal bytes, in order (agent/split_runs.h).
  static std::vector<std::vector<CopyPiece>> Split(const std::vector<CopyPiece>& pieces,
                                                   uint32_t parts);

 private:
  void LaneLoop();
  // Takes chunks of the open batch until none is left; returns how many it copied.
  uint64_t TakeChunks();
  static void CopyAll(const std::vector<CopyPiece>& pieces);

  const uint32_t lanes_;
  std::vector<std::thread> threads_;
  // The open batch's chunks: written by the caller before it opens the batch, read by
  // the lanes that joined it; the caller changes them only after every lane that
  // joined has left (active_ == 0 after the batch closed).
  std::vector<std::vector<CopyPiece>> chunks_;
  std::atomic<uint32_t> next_chunk_{0};  // the next chunk to take
  std::atomic<uint32_t> active_{0};      // lanes (not the caller) inside TakeChunks
  mutable absl::Mutex mu_;
  absl::CondVar work_cv_;
  absl::CondVar done_cv_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // one per split batch
  uint32_t wanted_ ABSL_GUARDED_BY(mu_) = 0;      // lanes this batch may still take in
  bool open_ ABSL_GUARDED_BY(mu_) = false;        // lanes may join this batch
  bool caller_waiting_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // CopyLaneCounters' fields, counted without mu_: a batch too small to split (every
  // one-page transfer) takes no lock at all.
  std::atomic<uint64_t> batches_{0};
  std::atomic<uint64_t> split_batches_{0};
  std::atomic<uint64_t> bytes_{0};
  std::atomic<uint64_t> stolen_parts_{0};
  std::atomic<uint64_t> lane_chunks_{0};
};

}  // namespace kvagent::agent

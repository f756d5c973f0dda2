#include "agent/copy_lanes.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "agent/split_runs.h"
#include "base/cpu_list.h"
#include "fmt/format.h"

namespace kvagent::agent {

uint32_t DefaultCopyLanes() {
  const size_t cores = std::max<size_t>(1, AllowedCpus().size());
  return static_cast<uint32_t>(std::min<size_t>(cores, 4));
}

absl::Status ValidateCopyLanes(uint32_t lanes) {
  if (lanes >= 1 && lanes <= kMaxCopyLanes) return absl::OkStatus();
  return absl::InvalidArgumentError(fmt::format(
      "--copy-lanes {}: give 1 to {} (lanes that copy one batch of same-host memory side by "
      "side: threads for host memory, CUDA streams for VRAM); leave it out for the default, "
      "the cores this agent may use up to 4 (here {})",
      lanes, kMaxCopyLanes, DefaultCopyLanes()));
}

CopyLanes::CopyLanes(uint32_t lanes) : lanes_(std::clamp<uint32_t>(lanes, 1, kMaxCopyLanes)) {
  for (uint32_t lane = 1; lane < lanes_; ++lane) {
    threads_.emplace_back([this, lane] {
      const std::string name = fmt::format("copy-lane-{}", lane);
      pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
      LaneLoop();
    });
  }
}

CopyLanes::~CopyLanes() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    work_cv_.SignalAll();
  }
  for (auto& t : threads_) t.join();
}

void CopyLanes::CopyAll(const std::vector<CopyPiece>& pieces) {
  for (const auto& p : pieces) std::memcpy(p.dst, p.src, p.bytes);
}

std::vector<std::vector<CopyPiece>> CopyLanes::Split(const std::vector<CopyPiece>& pieces,
                                                     uint32_t parts) {
  std::vector<std::vector<CopyPiece>> out;
  SplitRuns(pieces, parts, &out);
  return out;
}

namespace {

// The caller waits this long for lanes still copying their last chunk before it
// sleeps: a chunk takes about 10 us (64 KiB) to a few hundred, and a futex sleep and
// wake-up costs 5-50 us on a busy host, more than the wait. It yields while it waits:
// on a host with more threads than cores the lane it waits for may need this core.
constexpr auto kFinishSpin = std::chrono::microseconds(30);

}  // namespace

void CopyLanes::Copy(const std::vector<CopyPiece>& pieces) {
  uint64_t total = 0;
  for (const auto& p : pieces) total += p.bytes;
  // One more lane per kMinLaneBytes beyond the first.
  const uint64_t share_count = total / kMinLaneBytes;
  const uint32_t helpers =
      share_count < 2 ? 0 : static_cast<uint32_t>(std::min<uint64_t>(lanes_ - 1, share_count - 1));
  if (helpers == 0) {
    CopyAll(pieces);
    batches_.fetch_add(1, std::memory_order_relaxed);
    bytes_.fetch_add(total, std::memory_order_relaxed);
    return;
  }
  const uint64_t chunk_count = std::clamp<uint64_t>(
      uint64_t{helpers + 1} * kChunksPerLane, 1, std::max<uint64_t>(1, total / kMinChunkBytes));
  // No lane is inside the last batch (active_ was 0 when it closed): the chunks are ours.
  SplitRuns(pieces, static_cast<uint32_t>(chunk_count), &chunks_);
  next_chunk_.store(0, std::memory_order_relaxed);
  {
    absl::MutexLock lock(&mu_);
    ++generation_;
    wanted_ = helpers;
    open_ = true;
    if (helpers + 1 == lanes_) {
      work_cv_.SignalAll();
    } else {
      for (uint32_t i = 0; i < helpers; ++i) work_cv_.Signal();
    }
  }
  // This thread takes chunks from the first on; a lane that wakes in time takes the
  // next free one. One that wakes after every chunk is taken finds the batch closed:
  // a split batch never waits for a lane to be scheduled (a busy host can take
  // milliseconds), only for a chunk a lane is copying.
  TakeChunks();
  uint32_t missing = 0;
  {
    absl::MutexLock lock(&mu_);
    open_ = false;
    missing = wanted_;
    wanted_ = 0;
  }
  if (active_.load(std::memory_order_acquire) != 0) {
    const auto spin_until = std::chrono::steady_clock::now() + kFinishSpin;
    while (active_.load(std::memory_order_acquire) != 0 &&
           std::chrono::steady_clock::now() < spin_until) {
      std::this_thread::yield();
    }
  }
  {
    absl::MutexLock lock(&mu_);
    if (active_.load(std::memory_order_acquire) != 0) {
      caller_waiting_ = true;
      while (active_.load(std::memory_order_acquire) != 0) done_cv_.Wait(&mu_);
      caller_waiting_ = false;
    }
  }
  batches_.fetch_add(1, std::memory_order_relaxed);
  split_batches_.fetch_add(1, std::memory_order_relaxed);
  bytes_.fetch_add(total, std::memory_order_relaxed);
  stolen_parts_.fetch_add(missing, std::memory_order_relaxed);
}

uint64_t CopyLanes::TakeChunks() {
  const size_t count = chunks_.size();
  uint64_t copied = 0;
  for (;;) {
    const size_t i = next_chunk_.fetch_add(1, std::memory_order_relaxed);
    if (i >= count) return copied;
    CopyAll(chunks_[i]);
    ++copied;
  }
}

void CopyLanes::LaneLoop() {
  uint64_t seen = 0;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      while (!stopping_ && !(open_ && wanted_ > 0 && generation_ != seen)) work_cv_.Wait(&mu_);
      if (stopping_) return;
      seen = generation_;
      --wanted_;
      // Under mu_: the caller, closing the batch under mu_, then sees this lane inside.
      active_.fetch_add(1, std::memory_order_relaxed);
    }
    const uint64_t copied = TakeChunks();
    lane_chunks_.fetch_add(copied, std::memory_order_relaxed);
    // Release: our copies are visible to the caller once it sees the count drop.
    const bool last = active_.fetch_sub(1, std::memory_order_acq_rel) == 1;
    absl::MutexLock lock(&mu_);
    if (last && caller_waiting_) done_cv_.Signal();
  }
}

CopyLaneCounters CopyLanes::counters() const {
  CopyLaneCounters out;
  out.batches = batches_.load(std::memory_order_relaxed);
  out.split_batches = split_batches_.load(std::memory_order_relaxed);
  out.bytes = bytes_.load(std::memory_order_relaxed);
  out.stolen_parts = stolen_parts_.load(std::memory_order_relaxed);
  out.lane_chunks = lane_chunks_.load(std::memory_order_relaxed);
  return out;
}

}  // namespace kvagent::agent

#include "agent/copy_lanes.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "agent/split_runs.h"
#include "fmt/format.h"

namespace kvagent::agent {

uint32_t DefaultCopyLanes() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cores = 1;
  if (sched_getaffinity(0, sizeof set, &set) == 0) cores = std::max(1, CPU_COUNT(&set));
  return static_cast<uint32_t>(std::min(cores, 4));
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
  work_.resize(lanes_);
  for (uint32_t lane = 1; lane < lanes_; ++lane) {
    threads_.emplace_back([this, lane] {
      const std::string name = fmt::format("copy-lane-{}", lane);
      pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
      LaneLoop(lane);
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

void CopyLanes::Copy(const std::vector<CopyPiece>& pieces) {
  uint64_t total = 0;
  for (const auto& p : pieces) total += p.bytes;
  const uint32_t parts =
      static_cast<uint32_t>(std::min<uint64_t>(lanes_, std::max<uint64_t>(1, total / kMinLaneBytes)));
  if (parts <= 1) {
    CopyAll(pieces);
    absl::MutexLock lock(&mu_);
    ++counters_.batches;
    counters_.bytes += total;
    return;
  }
  std::vector<std::vector<CopyPiece>> split = Split(pieces, parts);
  {
    absl::MutexLock lock(&mu_);
    pending_ = 0;
    for (uint32_t lane = 1; lane < lanes_; ++lane) {
      work_[lane] = lane < parts ? std::move(split[lane]) : std::vector<CopyPiece>{};
      if (!work_[lane].empty()) ++pending_;
    }
    ++generation_;
    work_cv_.SignalAll();
  }
  CopyAll(split[0]);  // lane 0 is this thread
  // Lanes that have not woken up yet (a busy host can take milliseconds to schedule
  // one, longer than the copy) lose their share to this thread instead of being waited
  // for: a split batch never takes much longer than one lane would.
  for (;;) {
    std::vector<CopyPiece> stolen;
    {
      absl::MutexLock lock(&mu_);
      for (uint32_t lane = 1; lane < lanes_ && stolen.empty(); ++lane) {
        if (!work_[lane].empty()) {
          stolen.swap(work_[lane]);
          --pending_;
          ++counters_.stolen_parts;
        }
      }
    }
    if (stolen.empty()) break;
    CopyAll(stolen);
  }
  absl::MutexLock lock(&mu_);
  while (pending_ > 0) done_cv_.Wait(&mu_);
  ++counters_.batches;
  ++counters_.split_batches;
  counters_.bytes += total;
}

void CopyLanes::LaneLoop(uint32_t lane) {
  uint64_t seen = 0;
  for (;;) {
    std::vector<CopyPiece> mine;
    {
      absl::MutexLock lock(&mu_);
      while (!stopping_ && generation_ == seen) work_cv_.Wait(&mu_);
      if (stopping_) return;
      seen = generation_;
      mine.swap(work_[lane]);
    }
    if (mine.empty()) continue;  // this batch needed fewer lanes
    CopyAll(mine);
    absl::MutexLock lock(&mu_);
    if (--pending_ == 0) done_cv_.Signal();
  }
}

CopyLaneCounters CopyLanes::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

}  // namespace kvagent::agent

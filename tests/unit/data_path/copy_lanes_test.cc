#include "agent/copy_lanes.h"

#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "base/unique_fd.h"
#include "catch2/catch.hpp"
#include "registry/fault_guard.h"
#include "registry/memory_object.h"
#include "registry/shm_mapping.h"

namespace kvagent::agent {
namespace {

uint64_t Sum(const std::vector<CopyPiece>& pieces) {
  uint64_t total = 0;
  for (const auto& p : pieces) total += p.bytes;
  return total;
}

// `count` pieces of `bytes` each, every other one of a big source and destination (so
// none merges with the next).
struct Scattered {
  std::vector<uint8_t> src, dst;
  std::vector<CopyPiece> pieces;
  Scattered(size_t count, uint64_t bytes) : src(2 * count * bytes), dst(2 * count * bytes, 0) {
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + i / 4096);
    for (size_t i = 0; i < count; ++i) {
      pieces.push_back(CopyPiece{dst.data() + 2 * i * bytes, src.data() + 2 * i * bytes, bytes});
    }
  }
  bool Copied() const {
    for (const auto& p : pieces) {
      if (std::memcmp(p.dst, p.src, p.bytes) != 0) return false;
    }
    return true;
  }
};

TEST_CASE("Split gives each lane one run of about equal bytes, cutting large pieces") {
  Scattered small(64, 64 << 10);  // 64 x 64 KiB, 4 lanes: 16 whole pieces each
  auto parts = CopyLanes::Split(small.pieces, 4);
  REQUIRE(parts.size() == 4);
  for (const auto& part : parts) {
    CHECK(part.size() == 16);
    CHECK(Sum(part) == 16 * (64 << 10));
  }
  CHECK(parts[1].front().src == small.pieces[16].src);  // in order, gathered per lane

  std::vector<uint8_t> src(10 << 20), dst(10 << 20);
  std::vector<CopyPiece> one{{dst.data(), src.data(), src.size()}};  // one 10 MiB run
  auto cut = CopyLanes::Split(one, 3);
  REQUIRE(cut.size() == 3);
  uint64_t offset = 0;
  for (const auto& part : cut) {
    REQUIRE(part.size() == 1);
    CHECK(part[0].src == src.data() + offset);  // consecutive, no gap, no overlap
    CHECK(part[0].dst == dst.data() + offset);
    offset += part[0].bytes;
  }
  CHECK(offset == src.size());
  CHECK(cut[0].front().bytes == cut[1].front().bytes);
}

TEST_CASE("every byte is copied whatever the lanes and shapes") {
  for (uint32_t lanes : {1u, 2u, 3u, 4u}) {
    CopyLanes copier(lanes);
    CHECK(copier.lanes() == lanes);
    for (auto [count, bytes] : {std::pair<size_t, uint64_t>{16, 64 << 10}, {64, 64 << 10},
                                {16, 1 << 20}, {3, 4096}, {1, 8 << 20}, {5, 777777}}) {
      Scattered s(count, bytes);
      copier.Copy(s.pieces);
      INFO("lanes " << lanes << ", " << count << " x " << bytes);
      CHECK(s.Copied());
    }
    const CopyLaneCounters c = copier.counters();
    CHECK(c.batches == 6);
    // 1 MiB and up is split when there are lanes to split across; 12 KiB never is.
    CHECK(c.split_batches == (lanes == 1 ? 0u : 5u));
  }
}

TEST_CASE("pieces of mixed sizes, empty ones among them, each copied whole and alone") {
  // Sizes below, at and past a page and a chunk, a run of small pieces that a chunk
  // gathers, a piece cut across chunks, and empty ones, in one batch. Bytes between the
  // pieces must stay untouched.
  const std::vector<uint64_t> sizes = {0,         1,       4095,    4096, 4097, 65536, 0,
                                       (1 << 20) + 3, 3000, 3000, 3000, 70000, 0,  200000};
  uint64_t span = 0;
  for (uint64_t bytes : sizes) span += bytes + 4096;  // a gap after each
  std::vector<uint8_t> src(span), dst(span, 0xEE);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 13 + i / 4096);
  std::vector<CopyPiece> pieces;
  uint64_t at = 0;
  for (uint64_t bytes : sizes) {
    pieces.push_back(CopyPiece{dst.data() + at, src.data() + at, bytes});
    at += bytes + 4096;
  }
  for (uint32_t lanes : {1u, 2u}) {
    std::fill(dst.begin(), dst.end(), 0xEE);
    CopyLanes copier(lanes);
    copier.Copy(pieces);
    INFO("lanes " << lanes);
    uint64_t offset = 0;
    for (uint64_t bytes : sizes) {
      CHECK(std::memcmp(dst.data() + offset, src.data() + offset, bytes) == 0);
      const std::vector<uint8_t> gap(4096, 0xEE);
      CHECK(std::memcmp(dst.data() + offset + bytes, gap.data(), gap.size()) == 0);
      offset += bytes + 4096;
    }
  }
}

TEST_CASE("back-to-back batches: each lane share is copied once, by its lane or the caller") {
  // Whether a lane wakes in time or the caller takes its share is up to the scheduler;
  // either way every byte lands, every batch ends, and the counts agree.
  CopyLanes copier(4);
  uint64_t bytes = 0;
  for (int round = 0; round < 200; ++round) {
    Scattered s(16, 64 << 10);  // 1 MiB: 4 shares of 256 KiB
    std::memset(s.dst.data(), 0, s.dst.size());
    copier.Copy(s.pieces);
    bytes += Sum(s.pieces);
    INFO("round " << round);
    REQUIRE(s.Copied());
  }
  const CopyLaneCounters c = copier.counters();
  CHECK(c.batches == 200);
  CHECK(c.split_batches == 200);
  CHECK(c.bytes == bytes);
  CHECK(c.stolen_parts <= 3 * c.split_batches);
}

// A lane thread held in a signal handler: it is not scheduled for the batch, as on a
// host whose cores are busy elsewhere.
std::atomic<bool> hostage_entered{false};
std::atomic<bool> hostage_release{false};
void HoldHostage(int) {
  hostage_entered.store(true);
  while (!hostage_release.load()) {
  }
}

// The id of this process's thread named `name`, or -1.
pid_t ThreadNamed(const std::string& name) {
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  pid_t found = -1;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string line;
    if (std::getline(comm, line) && line == name) found = static_cast<pid_t>(std::stol(e->d_name));
  }
  closedir(dir);
  return found;
}

TEST_CASE("a lane that is not scheduled is not waited for; once back, it takes chunks again") {
  CopyLanes copier(2);
  pid_t lane = -1;  // the lane names itself once it runs
  for (int i = 0; i < 5000 && lane < 0; ++i) {
    lane = ThreadNamed("copy-lane-1");
    if (lane < 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  REQUIRE(lane > 0);
  struct sigaction action = {};
  action.sa_handler = HoldHostage;
  REQUIRE(sigaction(SIGUSR2, &action, nullptr) == 0);
  REQUIRE(syscall(SYS_tgkill, getpid(), lane, SIGUSR2) == 0);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!hostage_entered.load() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!hostage_entered.load()) {
    // ThreadSanitizer defers signals to a thread blocked in a raw futex (absl's).
    hostage_release.store(true);
    WARN("skipped: the lane thread did not run its signal handler within 5 s (a sanitizer "
         "defers signals), so it cannot be held");
    return;
  }
  // Every chunk is taken and copied by this thread; the batch ends without the lane.
  Scattered s(64, 64 << 10);  // 4 MiB
  copier.Copy(s.pieces);
  CHECK(s.Copied());
  CopyLaneCounters c = copier.counters();
  CHECK(c.split_batches == 1);
  CHECK(c.stolen_parts == 1);
  CHECK(c.lane_chunks == 0);

  hostage_release.store(true);
  // Back, the lane joins a later batch (16 MiB: a few ms for it to be scheduled).
  Scattered big(16, 1 << 20);
  for (int round = 0; round < 500 && copier.counters().lane_chunks == 0; ++round) {
    std::memset(big.dst.data(), 0, big.dst.size());
    copier.Copy(big.pieces);
    REQUIRE(big.Copied());
  }
  c = copier.counters();
  CHECK(c.lane_chunks > 0);
  CHECK(c.bytes == c.split_batches * (16 << 20) - (12 << 20));
  signal(SIGUSR2, SIG_DFL);
}

TEST_CASE("--copy-lanes bounds: 1 to 64, the default from the cores we may use") {
  CHECK(ValidateCopyLanes(1).ok());
  CHECK(ValidateCopyLanes(kMaxCopyLanes).ok());
  for (uint32_t bad : {0u, kMaxCopyLanes + 1}) {
    absl::Status status = ValidateCopyLanes(bad);
    CHECK(status.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(status.message()), Catch::Contains("--copy-lanes"));
  }
  const uint32_t lanes = DefaultCopyLanes();
  CHECK(lanes >= 1);
  CHECK(lanes <= 4);
  CHECK(lanes <= static_cast<uint32_t>(sysconf(_SC_NPROCESSORS_ONLN)));
}

TEST_CASE("a lane that faults on memory that vanished finishes, and the mapping says broken") {
  constexpr uint64_t kBytes = 4 << 20;
  UniqueFd fd(memfd_create("kvagent-copy-lanes-test", MFD_CLOEXEC));
  REQUIRE(fd.valid());
  REQUIRE(ftruncate(fd.get(), kBytes) == 0);
  UniqueFd copy(dup(fd.get()));
  auto object = registry::MemoryObject::FromDescriptor(std::move(copy), "engine memfd");
  REQUIRE(object.ok());
  auto mapping = registry::ShmMapping::Map(*std::move(object), 0, kBytes, "k.L0");
  REQUIRE(mapping.ok());
  auto* peer = static_cast<uint8_t*>(mapping->data());
  std::vector<uint8_t> local(kBytes, 0x42);
  // The second half vanishes: the lane that writes it faults (lane 1 of 2).
  REQUIRE(ftruncate(fd.get(), kBytes / 2) == 0);
  CopyLanes copier(2);
  copier.Copy({CopyPiece{peer, local.data(), kBytes}});
  CHECK(mapping->broken());
  CHECK(registry::FaultGuard::faults_caught() >= 1);
  CHECK(peer[0] == 0x42);  // the first half landed
  CHECK(copier.counters().split_batches == 1);
}

}  // namespace
}  // namespace kvagent::agent

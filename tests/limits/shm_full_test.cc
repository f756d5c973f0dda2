// /dev/shm full after registration (issue 13): an engine's KV memory is a file on a
// tmpfs, shared with its agent by descriptor, and the tmpfs fills up (another tenant,
// a leak) after the region was registered. Here the tmpfs is a private 64 MiB one
// (a mount namespace of this test and the agents it starts; needs root, skips
// otherwise), filled to ENOSPC by another file.
//
// What really happens, and what the test holds the agents to:
// - Registration faults in the pages the region's file holds (registry/shm_mapping:
//   MADV_POPULATE_WRITE of the pages mincore finds), not its holes; the first transfer
//   into a sparse region takes their pages while the filesystem has room. A populated
//   region needs nothing more from the full filesystem: a transfer into it completes
//   byte-exact.
// - An engine that punches a hole in its region gives pages back; once the filesystem
//   is full again, the next touch of the hole has no page to get (tmpfs answers the
//   fault with SIGBUS, reads as well as writes). registry::FaultGuard catches it: the
//   transfer fails (DATA_LOSS) naming the region, the cause and the fix, the agents
//   live, and the memory is refused until re-registered, even once space is back.
//   Transfers on other memory stay byte-exact.
// Two real kvagentd on one host move bytes shm-direct (the sender maps the receiver's
// memory), so the sender catches the fault on either side.
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"
#include "tests/limits/engine_memory.h"
#include "tests/limits/status_probe.h"
#include "tests/unit/catch_main.h"

namespace kvagent::testing {
namespace {

constexpr uint64_t kRegion = 8u << 20;
constexpr uint64_t kHole = 1u << 20;

struct SmallTmpfs {
  std::string dir;
  std::string why_not;  // empty when mounted
};

// A 64 MiB tmpfs in a mount namespace of this process (the agents it starts inherit
// it; the host never sees it). Made once, before any thread exists: unshare(CLONE_NEWNS)
// refuses a process whose threads share its filesystem context.
const SmallTmpfs& MountSmallTmpfs() {
  static const SmallTmpfs mounted = [] {
    SmallTmpfs fs;
    const char* tmp = std::getenv("TEST_TMPDIR");
    fs.dir = fmt::format("{}/small-shm", tmp != nullptr ? tmp : "/tmp");
    mkdir(fs.dir.c_str(), 0700);
    if (unshare(CLONE_NEWNS) != 0) {
      fs.why_not = fmt::format(
          "cannot make a mount namespace for a private tmpfs (unshare(CLONE_NEWNS): {}); run "
          "the test as root (CAP_SYS_ADMIN)",
          std::strerror(errno));
    } else if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
      fs.why_not = fmt::format("cannot make / private in the test's mount namespace ({})",
                               std::strerror(errno));
    } else if (mount("tmpfs", fs.dir.c_str(), "tmpfs", 0, "size=64m,mode=0700") != 0) {
      fs.why_not = fmt::format("cannot mount a 64 MiB tmpfs at {} ({}); run the test as root",
                               fs.dir, std::strerror(errno));
    }
    return fs;
  }();
  return mounted;
}

uint64_t FreeBytes(const std::string& dir) {
  struct statvfs vfs {};
  REQUIRE(statvfs(dir.c_str(), &vfs) == 0);
  return static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

// Another tenant's file on the tmpfs, grown until the filesystem has no page left.
class Filler {
 public:
  explicit Filler(const std::string& path) : path_(path) {
    fd_ = UniqueFd(open(path.c_str(), O_CREAT | O_WRONLY | O_APPEND | O_CLOEXEC, 0600));
    REQUIRE(fd_.valid());
  }
  ~Filler() { Remove(); }

  // Writes 1 MiB, then 4 KiB, chunks until each is refused with ENOSPC; returns the
  // bytes this call wrote.
  uint64_t FillUp() {
    const std::vector<char> chunk(1u << 20, 'F');
    uint64_t written = 0;
    for (const size_t size : {chunk.size(), size_t{4096}}) {
      for (;;) {
        const ssize_t n = write(fd_.get(), chunk.data(), size);
        if (n > 0) {
          written += static_cast<uint64_t>(n);
          continue;
        }
        INFO(std::strerror(errno));
        REQUIRE(errno == ENOSPC);
        break;
      }
    }
    bytes_ += written;
    return written;
  }
  void Remove() {
    if (!fd_.valid()) return;
    fd_.reset();
    unlink(path_.c_str());
  }
  uint64_t bytes() const { return bytes_; }

 private:
  std::string path_;
  UniqueFd fd_;
  uint64_t bytes_ = 0;
};

// A file of `bytes` on the tmpfs, shared with `agent`; written with a pattern from
// `fill`, or left sparse (no page allocated) when `fill` is negative.
std::unique_ptr<EngineMemory> ShareTmpfsFile(cli::AgentClient& agent, const std::string& path,
                                             uint64_t bytes, int fill) {
  UniqueFd fd(open(path.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600));
  REQUIRE(fd.valid());
  REQUIRE(ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0);
  return ShareDescriptor(agent, std::move(fd), path.substr(path.rfind('/') + 1), bytes, fill);
}

void RequireCompleted(cli::AgentClient& agent, const v1::SubmitTransferRequest& request) {
  auto done = agent.Submit(request);
  INFO(done.status().ToString());
  REQUIRE(done.ok());
  INFO(done->DebugString());
  REQUIRE(done->phase() == v1::COMPLETED);
}

v1::TransferState RequireEnded(cli::AgentClient& agent, const v1::SubmitTransferRequest& request) {
  auto ended = agent.Submit(request);
  INFO(ended.status().ToString());
  REQUIRE(ended.ok());
  return *ended;
}

bool RegionBroken(cli::AgentClient& agent, const std::string& name) {
  auto regions = agent.Regions();
  REQUIRE(regions.ok());
  for (const auto& region : regions->regions()) {
    if (region.spec().name() == name) return region.broken();
  }
  FAIL("no region " << name);
  return false;
}

void Reregister(cli::AgentClient& agent, const std::string& name, const EngineMemory& memory) {
  auto gone = agent.Deregister({name});
  INFO(gone.status().ToString());
  REQUIRE(gone.ok());
  RegisterRegion(agent, name, memory);
}

// Waits until prefill holds decode's current metadata (a re-registration there).
void WaitPeerCurrent(AgentPair& pair) {
  auto status = pair.decode().Status();
  REQUIRE(status.ok());
  for (int i = 0; i < 2000; ++i) {
    auto peers = pair.prefill().Peers();
    REQUIRE(peers.ok());
    REQUIRE(peers->peers_size() == 1);
    if (peers->peers(0).metadata_version() >= status->metadata_version()) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  FAIL("prefill did not fetch decode's metadata version " << status->metadata_version());
}

TEST_CASE("tmpfs full after registration: populated regions move bytes; a hole fails its transfer") {
  const SmallTmpfs& fs = MountSmallTmpfs();
  if (!fs.why_not.empty()) KVAGENT_SKIP(fs.why_not);

  FaultScene scene;
  AgentPair& pair = scene.pair;
  StatusProbe decode_probe({pair.decode_process().address()}, 2);

  // The engines' memory: the sender's region written by its engine, the receiver's
  // left sparse (its engine has not touched it), and one memfd on each side (not on
  // the small tmpfs) for the transfers that must stay healthy.
  auto src = ShareTmpfsFile(pair.prefill(), fs.dir + "/src", kRegion, 11);
  auto dst = ShareTmpfsFile(pair.decode(), fs.dir + "/dst", kRegion, -1);
  auto src_spare = ShareEngineMemory(pair.prefill(), "src-spare", kRegion, 12);
  auto dst_spare = ShareEngineMemory(pair.decode(), "dst-spare", kRegion, 0);
  CHECK(dst->AllocatedBytes() == 0);
  RegisterRegion(pair.prefill(), "src", *src);
  RegisterRegion(pair.decode(), "dst", *dst);
  RegisterRegion(pair.prefill(), "src.spare", *src_spare);
  RegisterRegion(pair.decode(), "dst.spare", *dst_spare);
  // Registration faults in only the pages the receiver's file holds: none (a page is
  // charged to whoever touches it first, memcg_test).
  std::printf("receiver's sparse 8 MiB region: %.1f MiB allocated once registered\n",
              dst->AllocatedBytes() / 1048576.0);
  CHECK(dst->AllocatedBytes() == 0);

  // Holes are harmless while the filesystem has room: the first transfer into the
  // region takes their pages, and then the full filesystem cannot take them away.
  RequireCompleted(pair.prefill(), ByteWrite("into-sparse-with-room", "src", "dst", kRegion, true));
  CHECK(std::memcmp(src->data, dst->data, kRegion) == 0);
  CHECK(dst->AllocatedBytes() == kRegion);
  dst->PunchHole(6u << 20, kHole);
  RequireCompleted(pair.prefill(), ByteWrite("into-hole-with-room", "src", "dst", kRegion, true));
  CHECK(std::memcmp(src->data, dst->data, kRegion) == 0);

  Filler filler(fs.dir + "/filler");
  filler.FillUp();
  std::printf("tmpfs filled: %.1f MiB by another file, %llu bytes free\n",
              filler.bytes() / 1048576.0, static_cast<unsigned long long>(FreeBytes(fs.dir)));
  REQUIRE(FreeBytes(fs.dir) == 0);

  // (a) Into the populated region on the full filesystem: every byte arrives.
  RequireCompleted(pair.prefill(), ByteWrite("into-full", "src", "dst", kRegion, true));
  CHECK(std::memcmp(src->data, dst->data, kRegion) == 0);

  // A sparse region registered now, with no page to populate it: the agent accepts
  // it today (a failed MADV_POPULATE_WRITE is left to the transfer path), and the
  // first transfer into it fails naming it; refusing it at registration would do too.
  auto late = ShareTmpfsFile(pair.decode(), fs.dir + "/late", kRegion, -1);
  auto late_registered = pair.decode().Register(WholeRegion("late", *late));
  std::printf("sparse region registered on the full tmpfs: %s\n",
              late_registered.status().ToString().c_str());
  if (late_registered.ok()) {
    WaitPeerCurrent(pair);
    const v1::TransferState into_late =
        RequireEnded(pair.prefill(), ByteWrite("into-late", "src", "late", kRegion, true));
    std::printf("  the first transfer into it: %s\n", into_late.error_message().c_str());
    RequireBrokenFailure(into_late, "peer 'decode' region 'late'");
  } else {
    CHECK_THAT(std::string(late_registered.status().message()),
               Catch::Contains("late") && Catch::Contains("full"));
  }

  // (b) The receiver's engine punches a hole; the filesystem fills again, so the
  // hole's pages cannot come back. The sender (it maps the receiver's memory) faults.
  dst->PunchHole(4u << 20, kHole);
  const uint64_t refilled = filler.FillUp();
  std::printf("hole of %llu KiB punched in the receiver's region, taken again by the filler "
              "(%llu KiB)\n",
              static_cast<unsigned long long>(kHole >> 10),
              static_cast<unsigned long long>(refilled >> 10));
  const v1::TransferState into_hole =
      RequireEnded(pair.prefill(), ByteWrite("into-hole", "src", "dst", kRegion, true));
  std::printf("transfer into the hole: %s: %s\n", v1::TransferPhase_Name(into_hole.phase()).c_str(),
              into_hole.error_message().c_str());
  RequireBrokenFailure(into_hole, "peer 'decode' region 'dst'");
  CHECK_THAT(into_hole.error_message(), Catch::Contains("filesystem is full"));
  scene.RequireAlive();
  auto prefill_status = pair.prefill().Status();
  REQUIRE(prefill_status.ok());
  CHECK(prefill_status->memory_faults() >= 1);  // the sender caught it

  // The sender's engine punches a hole in its own region: the sender faults reading it.
  src->PunchHole(2u << 20, kHole);
  filler.FillUp();
  const v1::TransferState from_hole =
      RequireEnded(pair.prefill(), ByteWrite("from-hole", "src", "dst.spare", kRegion, true));
  RequireBrokenFailure(from_hole, "local region 'src'");
  CHECK(RegionBroken(pair.prefill(), "src"));
  CHECK(!RegionBroken(pair.prefill(), "src.spare"));
  scene.RequireAlive();

  // Other memory still moves every byte, on the full filesystem's agents.
  RequireCompleted(pair.prefill(), ByteWrite("spare", "src.spare", "dst.spare", kRegion, true));
  CHECK(std::memcmp(src_spare->data, dst_spare->data, kRegion) == 0);
  pair.ResetContents();
  RequireCompleted(pair.prefill(), [] {
    auto request = KvWrite("pool", {3, 4}, {7, 8});
    request.set_wait(true);
    return request;
  }());
  CHECK(pair.PageEqual(3, 7));
  CHECK(pair.PageEqual(4, 8));

  // Space back: the broken memory is still refused until its owner registers it again.
  filler.Remove();
  CHECK(FreeBytes(fs.dir) > 2 * kHole);
  RequireRefused(pair.prefill(), ByteWrite("from-hole-again", "src", "dst.spare", kRegion, true),
                 "src");
  RequireRefused(pair.prefill(), ByteWrite("into-hole-again", "src.spare", "dst", kRegion, true),
                 "dst");

  // Re-registered (the same files, their holes now backed again): bytes move again.
  Reregister(pair.prefill(), "src", *src);
  CHECK(!RegionBroken(pair.prefill(), "src"));
  Reregister(pair.decode(), "dst", *dst);
  WaitPeerCurrent(pair);
  RequireCompleted(pair.prefill(), ByteWrite("renewed", "src", "dst", kRegion, true));
  CHECK(std::memcmp(src->data, dst->data, kRegion) == 0);
  scene.RequireAlive();
  scene.sampler.Report("tmpfs full: prefill");
  decode_probe.Report("tmpfs full: decode");
}

}  // namespace
}  // namespace kvagent::testing

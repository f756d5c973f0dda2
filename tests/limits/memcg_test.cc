// An engine's sparse memory and the agent's memory cgroup. Pages of shared memory
// (memfd, tmpfs) are charged to the cgroup of the process that first touches them. An
// engine may share a memfd far larger than what it ever writes; if registering it made
// the agent fault in every page, the agent's cgroup (its systemd unit's MemoryMax, its
// container's limit) would pay for the engine's holes, and past the limit the kernel
// kills the agent, taking every engine's transfers with it.
//
// Here: the sending agent runs in a memory cgroup of its own, limited to 512 MiB; an
// engine shares a 2 GiB memfd of which it wrote 1 MiB and registers all of it. The
// agent must live, its cgroup must stay far under the limit, the engine's memfd must
// hold only the pages the engine wrote, and a WRITE of those pages must arrive.
// Needs root and a writable memory cgroup (v1 or v2); skips, saying why, without.
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "base/unique_fd.h"
#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"
#include "tests/limits/engine_memory.h"
#include "tests/unit/catch_main.h"

namespace kvagent::testing {
namespace {

std::string ReadLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

bool WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.flush();
  return static_cast<bool>(out);
}

// A memory cgroup made under this process's own, removed (once empty) on destruction.
class MemoryCgroup {
 public:
  // std::nullopt with `why` set when this host gives none to make.
  static std::optional<MemoryCgroup> Make(const std::string& name, uint64_t limit,
                                          std::string* why) {
    if (geteuid() != 0) {
      *why = "needs root to make a memory cgroup";
      return std::nullopt;
    }
    std::ifstream self("/proc/self/cgroup");
    std::string line, v1_path, v2_path;
    while (std::getline(self, line)) {
      // "ID:CONTROLLERS:PATH"
      const size_t a = line.find(':'), b = line.find(':', a + 1);
      if (a == std::string::npos || b == std::string::npos) continue;
      const std::string controllers = line.substr(a + 1, b - a - 1);
      const std::string path = line.substr(b + 1);
      std::stringstream list(controllers);
      for (std::string c; std::getline(list, c, ',');) {
        if (c == "memory") v1_path = path;
      }
      if (line.rfind("0::", 0) == 0) v2_path = path;
    }
    MemoryCgroup group;
    if (!v1_path.empty() && std::filesystem::exists("/sys/fs/cgroup/memory" + v1_path)) {
      group.dir_ = "/sys/fs/cgroup/memory" + v1_path + "/" + name;
      group.limit_file_ = "memory.limit_in_bytes";
      group.peak_file_ = "memory.max_usage_in_bytes";
    } else if (!v2_path.empty() &&
               ReadLine("/sys/fs/cgroup" + v2_path + "/cgroup.subtree_control")
                       .find("memory") != std::string::npos) {
      group.dir_ = "/sys/fs/cgroup" + v2_path + "/" + name;
      group.limit_file_ = "memory.max";
      group.peak_file_ = "memory.peak";
    } else {
      *why = "no memory cgroup controller this process can make children under";
      return std::nullopt;
    }
    std::error_code error;
    if (!std::filesystem::create_directory(group.dir_, error) || error) {
      *why = fmt::format("cannot make {}: {}", group.dir_, error.message());
      group.dir_.clear();
      return std::nullopt;
    }
    if (!WriteText(group.dir_ + "/" + group.limit_file_, std::to_string(limit))) {
      *why = fmt::format("cannot set {}/{}", group.dir_, group.limit_file_);
      return std::nullopt;
    }
    return group;
  }

  MemoryCgroup() = default;
  MemoryCgroup(MemoryCgroup&& other) noexcept { *this = std::move(other); }
  MemoryCgroup& operator=(MemoryCgroup&& other) noexcept {
    std::swap(dir_, other.dir_);
    std::swap(limit_file_, other.limit_file_);
    std::swap(peak_file_, other.peak_file_);
    return *this;
  }
  ~MemoryCgroup() {
    if (dir_.empty()) return;
    // Empty once the agent exited (the pair is destroyed before this).
    for (int i = 0; i < 50 && rmdir(dir_.c_str()) != 0; ++i) usleep(100 * 1000);
  }

  bool Add(pid_t pid) const { return WriteText(dir_ + "/cgroup.procs", std::to_string(pid)); }
  uint64_t Peak() const { return std::stoull("0" + ReadLine(dir_ + "/" + peak_file_)); }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_, limit_file_, peak_file_;
};

// Running (a killed agent stays a zombie until DaemonProcess reaps it).
bool Alive(pid_t pid) {
  std::ifstream status(fmt::format("/proc/{}/status", pid));
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("State:", 0) == 0) return line.find('Z') == std::string::npos;
  }
  return false;
}

TEST_CASE("an engine's sparse memory is not faulted in by the agent: its memory cgroup lives") {
  constexpr uint64_t kLimit = 512ull << 20;
  constexpr uint64_t kShared = 2ull << 30;
  constexpr uint64_t kWritten = 1ull << 20;
  // Created before the pair, so that it is removed after the agents exited.
  std::string why;
  auto group = MemoryCgroup::Make(fmt::format("kvagent-memcg-test-{}", getpid()), kLimit, &why);
  if (!group) KVAGENT_SKIP(why);
  FaultScene scene;
  AgentPair& pair = scene.pair;
  const pid_t agent = pair.prefill_process().pid();
  REQUIRE(group->Add(agent));
  std::printf("prefill (pid %d) runs in %s, limited to %llu MiB\n", static_cast<int>(agent),
              group->dir().c_str(), static_cast<unsigned long long>(kLimit >> 20));

  UniqueFd fd(memfd_create("sparse-pool", MFD_CLOEXEC));
  REQUIRE(fd.valid());
  REQUIRE(ftruncate(fd.get(), static_cast<off_t>(kShared)) == 0);
  auto pool = ShareDescriptor(pair.prefill(), std::move(fd), "sparse-pool", kShared, -1);
  for (uint64_t i = 0; i < kWritten; ++i) pool->data[i] = static_cast<uint8_t>(i * 31 + 5);
  const auto registered = pair.prefill().Register(WholeRegion("src.pool", *pool));
  INFO("registering 2 GiB of which 1 MiB was written: " << registered.status());
  REQUIRE(Alive(agent));
  REQUIRE(registered.ok());
  const uint64_t peak = group->Peak();
  const uint64_t held = pool->AllocatedBytes();
  std::printf("registered: the agent's cgroup peaked at %.1f MiB; the memfd holds %.1f MiB of "
              "pages (the engine wrote %.1f)\n",
              peak / 1048576.0, held / 1048576.0, kWritten / 1048576.0);
  CHECK(peak < kLimit / 2);
  CHECK(held < 2 * kWritten);

  // The pages the engine wrote move as before.
  auto dst = SharedRegion(pair.decode(), "dst.pool", kWritten, 0);
  auto state = pair.prefill().Submit(ByteWrite("sparse-write", "src.pool", "dst.pool", kWritten,
                                               /*wait=*/true));
  INFO("the WRITE: " << state.status() << (state.ok() ? state->DebugString() : ""));
  REQUIRE(state.ok());
  REQUIRE(state->phase() == v1::COMPLETED);
  CHECK(std::memcmp(pool->data, dst->data, kWritten) == 0);
  CHECK(Alive(agent));
  CHECK(Pid(pair.prefill()) == static_cast<uint32_t>(agent));
}

}  // namespace
}  // namespace kvagent::testing

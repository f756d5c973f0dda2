// kvagentctl's child processes and the /proc readers of the benches, on real
// processes: RunChild keeps the output and refuses a failing or hung child, SpawnChild
// passes the environment it is given, starts the child with no signal blocked and on
// the CPUs it is given, CPU ticks are read for this process and its threads (a name
// with spaces and parentheses included), and ucx_perftest's Final line is parsed.
#include <fcntl.h>
#include <sched.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "tests/unit/catch_main.h"
#include "base/cpu_list.h"
#include "cli/bench_perftest.h"
#include "cli/child_process.h"
#include "cli/process_cpu.h"

namespace kvagent::cli {
namespace {

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

TEST_CASE("FindOnPath finds sh on PATH and nothing for a missing name") {
  CHECK(FindOnPath("sh").rfind('/') != std::string::npos);
  CHECK(FindOnPath("no-such-binary-kvagent").empty());
  CHECK(FindOnPath("/no/such/path/x").empty());
  CHECK(FindOnPath("").empty());
}

TEST_CASE("RunChild returns the output, and refuses a failed or hung child") {
  const std::string sh = FindOnPath("sh");
  REQUIRE(!sh.empty());
  auto out = RunChild({sh, "-c", "echo out; echo err >&2"}, 10000);
  INFO(out.status().ToString());
  REQUIRE(out.ok());
  CHECK(*out == "out\nerr\n");

  auto failed = RunChild({sh, "-c", "echo why; exit 3"}, 10000);
  REQUIRE_FALSE(failed.ok());
  CHECK(failed.status().code() == absl::StatusCode::kInternal);
  CHECK(std::string(failed.status().message()).find("why") != std::string::npos);

  const auto start = std::chrono::steady_clock::now();
  auto hung = RunChild({sh, "-c", "sleep 30"}, 200);
  REQUIRE_FALSE(hung.ok());
  CHECK(hung.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));

  auto missing = SpawnChild({"/no/such/binary"}, -1);
  REQUIRE_FALSE(missing.ok());
  CHECK(std::string(missing.status().message()).find("/no/such/binary") != std::string::npos);
}

// Waits for child `pid`, which must exit 0, and returns the first two lines it wrote
// to `path`.
std::pair<std::string, std::string> ReapAndReadTwoLines(pid_t pid, const std::string& path) {
  const int status = ReapChild(pid, 20000);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  std::ifstream in(path);
  std::pair<std::string, std::string> lines;
  std::getline(in, lines.first);
  std::getline(in, lines.second);
  return lines;
}

TEST_CASE("SpawnChild adds the environment given and blocks no signal in the child") {
  const std::string sh = FindOnPath("sh");
  const std::string path = TempDir() + "/spawn_out.txt";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  REQUIRE(fd >= 0);
  // Blocked here; the child must see none blocked (SigBlk in its status).
  sigset_t term, old;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &term, &old);
  auto pid = SpawnChild({sh, "-c", "echo \"$KVAGENT_CHILD_TEST\"; grep SigBlk /proc/self/status"},
                        fd, {{"KVAGENT_CHILD_TEST", "given value"}});
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  ::close(fd);
  REQUIRE(pid.ok());
  const auto [value, blocked] = ReapAndReadTwoLines(*pid, path);
  CHECK(value == "given value");
  CHECK(blocked.find("0000000000000000") != std::string::npos);
}

TEST_CASE("SpawnChild with CPUs starts the child and its threads on them, and this thread keeps its own") {
  const std::string python = FindOnPath("python3");
  if (python.empty()) KVAGENT_SKIP("python3 is not on PATH (deploy/bootstrap.sh installs it)");
  const std::vector<int> allowed = AllowedCpus();
  REQUIRE(!allowed.empty());
  const std::vector<int> mine = ThreadCpus(pthread_self());
  REQUIRE(!mine.empty());
  // The last CPU this process may use: on a machine with more than one, a strict
  // subset of this thread's.
  const std::vector<int> last = {allowed.back()};
  const std::string path = TempDir() + "/spawn_cpus.txt";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  REQUIRE(fd >= 0);
  // The child's main thread, then a thread it starts (sched_getaffinity(0): the
  // calling thread's CPUs).
  auto pid = SpawnChild({python, "-c",
                         "import os, threading\n"
                         "print(sorted(os.sched_getaffinity(0)), flush=True)\n"
                         "t = threading.Thread(target=lambda: print(sorted(os.sched_getaffinity(0)), "
                         "flush=True))\n"
                         "t.start(); t.join()\n"},
                        fd, {}, last);
  ::close(fd);
  INFO(pid.status().ToString());
  REQUIRE(pid.ok());
  CHECK(ThreadCpus(pthread_self()) == mine);
  const auto [main_thread, started_thread] = ReapAndReadTwoLines(*pid, path);
  const std::string want = fmt::format("[{}]", last[0]);
  CHECK(main_thread == want);
  CHECK(started_thread == want);

  // A CPU this process may not use: refused before anything starts, naming it, and
  // this thread keeps its CPUs.
  auto refused = SpawnChild({python, "-c", "pass"}, -1, {}, {CPU_SETSIZE - 1});
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(refused.status().message()).find(std::to_string(CPU_SETSIZE - 1)) !=
        std::string::npos);
  CHECK(ThreadCpus(pthread_self()) == mine);
}

TEST_CASE("CPU ticks of this process and its threads; a name with spaces and parentheses") {
  // Spend some CPU so the reading is above zero.
  volatile uint64_t x = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  while (std::chrono::steady_clock::now() < until) x = x + 1;
  auto seconds = ProcessCpuSeconds(getpid());
  INFO(seconds.status().ToString());
  REQUIRE(seconds.ok());
  CHECK(*seconds > 0.0);
  const auto threads = ThreadCpuTicks(getpid());
  CHECK(threads.count(std::to_string(getpid())) == 1);

  const std::string stat = TempDir() + "/stat";
  std::ofstream(stat) << "42 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 120 34 0 0 20 0 1 0\n";
  auto ticks = ReadCpuTicks(stat);
  REQUIRE(ticks.ok());
  CHECK(ticks->name == "a (b) c");
  CHECK(ticks->state == 'S');
  CHECK(ticks->ticks == 154);

  std::ofstream(stat) << "42 (short) S 1 2\n";
  CHECK(ReadCpuTicks(stat).status().code() == absl::StatusCode::kInternal);
  CHECK(ReadCpuTicks(TempDir() + "/no-such-stat").status().code() == absl::StatusCode::kNotFound);
}

// The state letter of each thread of `pid`.
std::string ThreadStates(pid_t pid) {
  std::string states;
  for (const auto& [tid, thread] : ThreadCpuTicks(pid)) states += thread.state;
  return states;
}

TEST_CASE("SuspendChild returns once every thread of the child is stopped, spinning ones too") {
  // A child with four threads that spin (running, not asleep, when SIGSTOP comes; they
  // take turns on Python's lock, so some wait in futex at any moment). A program of
  // its own, not a fork of this test: the TSan stage runs this test, and TSan refuses
  // threads started in a forked child.
  const std::string python = FindOnPath("python3");
  if (python.empty()) KVAGENT_SKIP("python3 is not on PATH (deploy/bootstrap.sh installs it)");
  int ready[2];
  REQUIRE(pipe(ready) == 0);
  auto spawned = SpawnChild({python, "-c",
                             "import os, threading\n"
                             "def spin():\n"
                             "    while True: pass\n"
                             "for _ in range(4): threading.Thread(target=spin, daemon=True).start()\n"
                             "os.write(1, b'r')\n"
                             "threading.Event().wait()\n"},
                            ready[1]);
  close(ready[1]);
  INFO(spawned.status().ToString());
  REQUIRE(spawned.ok());
  const pid_t child = *spawned;
  char byte;
  REQUIRE(read(ready[0], &byte, 1) == 1);
  close(ready[0]);
  const absl::Status stopped = SuspendChild(child);
  INFO(stopped.ToString());
  CHECK(stopped.ok());
  const std::string states = ThreadStates(child);
  CHECK(states.size() == 5);
  CHECK(states.find_first_not_of("Tt") == std::string::npos);
  kill(child, SIGCONT);
  kill(child, SIGKILL);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);

  // A process that is gone: an error naming the call and the pid.
  const absl::Status gone = SuspendChild(child);
  CHECK(!gone.ok());
  CHECK(std::string(gone.message()).find(fmt::format("kill({}, SIGSTOP)", child)) !=
        std::string::npos);
}

TEST_CASE("ThreadWakeups counts a thread's sleeps by its name") {
  std::thread sleeper([] {
    pthread_setname_np(pthread_self(), "wakeup-test");
    for (int i = 0; i < 5; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    const auto counts = ThreadWakeups(getpid());
    const auto it = counts.find("wakeup-test");
    REQUIRE(it != counts.end());
    CHECK(it->second >= 5);  // each sleep was a voluntary switch
  });
  sleeper.join();
  CHECK(ThreadWakeups(getpid()).count("wakeup-test") == 0);  // ended threads are gone
  CHECK(ThreadWakeups(-1).empty());
}

TEST_CASE("ParsePerftestGbps reads the Final line's overall bandwidth") {
  auto gbps = ParsePerftestGbps(
      "+----+\nFinal:   1000   1.2   2.3   3.4   4000.0   2000.0   100   50\n");
  REQUIRE(gbps.ok());
  CHECK(*gbps == Approx(2000.0 * 1048576.0 / 1e9));
  auto none = ParsePerftestGbps("no such line\n");
  REQUIRE_FALSE(none.ok());
  CHECK(std::string(none.status().message()).find("no 'Final:' line") != std::string::npos);
}

}  // namespace
}  // namespace kvagent::cli

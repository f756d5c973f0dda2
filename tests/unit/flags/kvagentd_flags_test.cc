// kvagentd's command line through Abseil flags, on the real binary: --help prints the
// grouped text and exits 0; an unknown flag, a bad value of every kind of flag and a
// bad --flagfile are refused (exit 2) naming the flag or the file; an agent configured
// by a --flagfile alone comes up and reports those settings in GetStatus (--device-copy
// over KVAGENT_DEVICE_COPY among them).
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "cuda/driver.h"
#include "fmt/format.h"
#include "tests/unit/catch_main.h"

extern char** environ;

namespace kvagent {
namespace {

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// Sockets go in a short folder of /tmp: TEST_TMPDIR is longer than a Unix socket path
// may be. Removed, with what is left in it, when the test ends.
struct SocketDir {
  SocketDir() {
    char pattern[] = "/tmp/kvaflags-XXXXXX";
    REQUIRE(mkdtemp(pattern) != nullptr);
    path = pattern;
  }
  ~SocketDir() { std::filesystem::remove_all(path); }
  std::string path;
};

const std::string& Sockets() {
  static SocketDir dir;
  return dir.path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

// The CPUs this process may run on.
std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

// Cpus_allowed_list of /proc/PID/task/TID/status for each thread of `pid` named `comm`
// (or of the process's first thread, for an empty `comm`).
std::vector<std::string> ThreadCpus(pid_t pid, const std::string& comm) {
  std::vector<std::string> out;
  auto field = [](const std::string& status) {
    const std::string key = "Cpus_allowed_list:";
    const size_t at = status.find(key);
    if (at == std::string::npos) return std::string();
    size_t begin = status.find_first_not_of(" \t", at + key.size());
    return status.substr(begin, status.find('\n', begin) - begin);
  };
  if (comm.empty()) return {field(ReadFile(fmt::format("/proc/{}/status", pid)))};
  for (const auto& task : std::filesystem::directory_iterator(fmt::format("/proc/{}/task", pid))) {
    std::string name = ReadFile(task.path().string() + "/comm");
    if (!name.empty() && name.back() == '\n') name.pop_back();
    if (name == comm) out.push_back(field(ReadFile(task.path().string() + "/status")));
  }
  return out;
}

std::string Kvagentd() {
  auto path = cli::FindKvagentd("kvagentd_flags_test");
  REQUIRE(path.ok());
  return *path;
}

// Starts kvagentd with `args`, its stdout and stderr in TEMP/out.txt and TEMP/err.txt.
pid_t Spawn(const std::vector<std::string>& args) {
  std::vector<std::string> owned = {Kvagentd()};
  owned.insert(owned.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : owned) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const std::string out = TempDir() + "/out.txt", err = TempDir() + "/err.txt";
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  REQUIRE(rc == 0);
  return pid;
}

int WaitExit(pid_t pid) {
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

struct Run {
  int code;
  std::string out, err;
};

// Runs kvagentd to its exit (every case here ends before any door opens).
Run RunKvagentd(const std::vector<std::string>& args) {
  Run run;
  run.code = WaitExit(Spawn(args));
  run.out = ReadFile(TempDir() + "/out.txt");
  run.err = ReadFile(TempDir() + "/err.txt");
  return run;
}

// A kvagentd that must be refused before it starts: exit 2, stderr holding each of
// `expected`, and the pointer to --help.
void ExpectRefused(const std::vector<std::string>& args, const std::vector<std::string>& expected) {
  const std::string sock = Sockets() + "/refused.sock";
  std::vector<std::string> full = {"--name", "refused", "--local-socket", sock};
  full.insert(full.end(), args.begin(), args.end());
  const Run run = RunKvagentd(full);
  INFO("args: " << args.front() << (args.size() > 1 ? " " + args[1] : std::string()));
  INFO("stderr: " << run.err);
  CHECK(run.code == 2);
  for (const std::string& text : expected) CHECK(run.err.find(text) != std::string::npos);
  CHECK(run.err.find("kvagentd --help") != std::string::npos);
  CHECK(access(sock.c_str(), F_OK) != 0);  // refused before the door opened
}

TEST_CASE("kvagentd --help prints the grouped flags and exits 0", "[flags]") {
  for (const char* help : {"--help", "-h", "--helpfull", "--help=listen"}) {
    INFO(help);
    const Run run = RunKvagentd({help});
    CHECK(run.code == 0);
    CHECK(run.err.empty());
    for (const char* group : {"usage: kvagentd --name NAME", " Doors (", " Fleet directory (",
                              " Roles (", " Memory and data path:", " Limits (",
                              "  --flagfile PATH", "  --local-socket PATH", "  --max-regions N",
                              "  --device-copy MECHANISM"}) {
      CHECK(run.out.find(group) != std::string::npos);
    }
    // Not Abseil's own listing, file by file.
    CHECK(run.out.find("Flags from") == std::string::npos);
  }
}

TEST_CASE("kvagentd refuses an unknown flag or a stray argument, naming it", "[flags]") {
  ExpectRefused({"--no-such-flag=1"}, {"no-such-flag"});
  ExpectRefused({"--local_socket=/tmp/x"}, {"local_socket"});  // the names have dashes
  ExpectRefused({"stray"}, {"unexpected argument 'stray'"});
}

TEST_CASE("kvagentd refuses a bad value of every kind of flag, naming flag and value", "[flags]") {
  // on|off, auto|off, auto|peer|none, octal modes, counts: refused by Abseil's parse.
  ExpectRefused({"--fast-path=maybe"}, {"'fast-path'", "'maybe'", "use on or off"});
  ExpectRefused({"--metrics-listen-any", "yes"}, {"'metrics-listen-any'", "use on or off"});
  ExpectRefused({"--shm-direct=on"}, {"'shm-direct'", "'on'", "use auto or off"});
  ExpectRefused({"--ucx-error-mode=always"}, {"'ucx-error-mode'", "use auto, peer or none"});
  ExpectRefused({"--local-socket-mode=0999"}, {"'local-socket-mode'", "'0999'", "octal mode"});
  ExpectRefused({"--local-socket-mode=01777"}, {"'local-socket-mode'", "at most 0777"});
  ExpectRefused({"--max-sessions=-1"}, {"'max-sessions'", "'-1'", "non-negative integer"});
  ExpectRefused({"--staging-chunk-bytes=4M"}, {"'staging-chunk-bytes'", "non-negative integer"});
  ExpectRefused({"--transfer-timeout-ms"}, {"transfer-timeout-ms"});  // no value at all
  // Values checked once parsed: lists, levels, limits, ranges.
  ExpectRefused({"--engine-uids=no-such-user-here"},
                {"--engine-uids", "'no-such-user-here'", "numeric uids"});
  ExpectRefused({"--log-level=loud"}, {"--log-level", "'loud'", "trace, debug"});
  ExpectRefused({"--ucx-tcp-remote=nobody"},
                {"--ucx-tcp-remote", "'nobody'", "neither peers nor any", "fence UCX's ports"});
  ExpectRefused({"--ucx-held-replies=100"}, {"--ucx-held-replies", "100 is below 256"});
  ExpectRefused({"--ucx-peer-endpoints=8"}, {"--ucx-peer-endpoints", "8 is below 16"});
  ExpectRefused({"--ucx-tcp-host-ttl-ms=50"},
                {"--ucx-tcp-host-ttl-ms", "50 is below 100", "reconnect"});
  ExpectRefused({"--max-regions=lots"}, {"--max-regions", "'lots'", "non-negative integer"});
  ExpectRefused({"--max-metadata-bytes=1X"}, {"--max-metadata-bytes", "K, M, G or T"});
  ExpectRefused({"--grpc-max-threads=0"}, {"--grpc-max-threads", "at least 1"});
  ExpectRefused({"--grpc-memory-bytes=0"}, {"--grpc-memory-bytes", "positive integer"});
  ExpectRefused({"--copy-lanes=65"}, {"--copy-lanes 65", "give 1 to 64"});
  ExpectRefused({"--copy-lanes=0"}, {"--copy-lanes 0", "give 1 to 64"});
  ExpectRefused({"--staging-buffers=0"}, {"staging"});
  ExpectRefused({"--transfer-timeout-ms=600001"}, {"--transfer-timeout-ms", "from 1 to 600000"});
  ExpectRefused({"--ended-transfers-kept=0"}, {"--ended-transfers-kept", "from 1 to 1000000"});
  ExpectRefused({"--ended-transfers-kept=1000001"},
                {"--ended-transfers-kept", "1000001 is not from 1 to 1000000"});
  ExpectRefused({"--peer-metadata-share=0"}, {"--peer-metadata-share", "0 is not a percentage"});
  ExpectRefused({"--peer-metadata-share=101"}, {"--peer-metadata-share", "from 1 to 100"});
  ExpectRefused({"--am-message-bytes=0"}, {"--am-message-bytes 0", "524288"});
  ExpectRefused({"--device-copy=gpu"},
                {"'device-copy'", "'gpu'", "use auto (the best this host has), batch", "per-page"});
  ExpectRefused({"--device-copy"}, {"device-copy"});  // no value at all
  ExpectRefused({"--worker-cpus=one"},
                {"'worker-cpus'", "'one' is not a CPU number or range", "e.g. 3, 2,3 or 4-7"});
  ExpectRefused({"--worker-cpus=3-1"}, {"'worker-cpus'", "the range '3-1' runs backwards"});
  // A CPU this process may not use (the one after the last it may): refused once parsed,
  // naming the ones it may.
  const std::vector<int> allowed = AllowedCpus();
  REQUIRE(!allowed.empty());
  ExpectRefused({"--worker-cpus=" + std::to_string(allowed.back() + 1)},
                {fmt::format("--worker-cpus {0}: CPU {0} is not among those this process may use",
                             allowed.back() + 1),
                 "leave --worker-cpus out"});
}

TEST_CASE("kvagentd refuses a bad HOST:PORT as it opens that door, naming the flag", "[flags]") {
  // Addresses are the doors' to check (agent/agent.cc): exit 1, "cannot start".
  const std::string sock = Sockets() + "/door.sock";
  for (const auto& [flag, value, fix] :
       {std::tuple{"--metrics-listen", "garbage:x", "not HOST:PORT"},
        std::tuple{"--health-listen", "garbage", "use HOST:PORT"},
        std::tuple{"--listen", "127.0.0.1:0", "needs --tls-cert"}}) {
    const Run run = RunKvagentd({"--name", "door", "--local-socket", sock, flag, value});
    INFO(run.err);
    CHECK(run.code == 1);
    CHECK(run.err.find(fmt::format("cannot start: {} {}", flag, value)) != std::string::npos);
    CHECK(run.err.find(fix) != std::string::npos);
  }
}

TEST_CASE("kvagentd refuses a bad --flagfile, naming the file or the flag", "[flags]") {
  const std::string missing = TempDir() + "/missing.flags";
  ExpectRefused({"--flagfile=" + missing}, {missing});

  const std::string stray = TempDir() + "/stray.flags";
  WriteFile(stray, "--max-sessions=4\nmax-regions=5\n");
  ExpectRefused({"--flagfile", stray}, {stray, "max-regions=5"});

  const std::string bad_value = TempDir() + "/bad_value.flags";
  WriteFile(bad_value, "# a comment\n--fast-path=sometimes\n");
  ExpectRefused({"--flagfile=" + bad_value}, {"'fast-path'", "'sometimes'", "use on or off"});

  const std::string unknown = TempDir() + "/unknown.flags";
  WriteFile(unknown, "--max-sesions=4\n");
  ExpectRefused({"--flagfile=" + unknown}, {"max-sesions"});
}

TEST_CASE("kvagentd configured by a --flagfile alone reports its settings", "[flags]") {
  const std::string dir = TempDir();
  const std::string sock = Sockets() + "/flagfile.sock", port_file = dir + "/flagfile.port";
  const std::string flags = dir + "/kvagentd.flags";
  ::unlink(port_file.c_str());
  WriteFile(flags, "# kvagentd settings, one flag a line\n"
                   "--name=from-flagfile\n"
                   "--local-socket=" + sock + "\n"
                   "--port-file=" + port_file + "\n"
                   "--health-listen=127.0.0.1:0\n"
                   "--max-regions=1000\n"
                   "--max-metadata-bytes=2M\n"
                   "--copy-lanes=2\n"
                   "--device-copy=per-page\n"
                   "--worker-cpus=" + std::to_string(AllowedCpus().back()) + "\n"
                   "--log-level=warn\n");
  // --check-flags accepts the file and starts nothing.
  const Run check = RunKvagentd({"--flagfile=" + flags, "--check-flags"});
  CHECK(check.code == 0);
  CHECK(check.out.find("flags accepted; agent 'from-flagfile' not started") != std::string::npos);
  CHECK(access(sock.c_str(), F_OK) != 0);
  const Run refused = RunKvagentd({"--flagfile=" + flags, "--max-regions=x", "--check-flags"});
  CHECK(refused.code == 2);
  CHECK(refused.err.find("--max-regions") != std::string::npos);

  // A later flag overrides the file's; --device-copy overrides the variable.
  REQUIRE(setenv("KVAGENT_DEVICE_COPY", "kernel", 1) == 0);
  const pid_t pid = Spawn({"--flagfile=" + flags, "--max-regions=1500"});
  REQUIRE(unsetenv("KVAGENT_DEVICE_COPY") == 0);
  std::string port;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  while (port.empty() && std::chrono::steady_clock::now() < until) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) FAIL("kvagentd exited: " << ReadFile(dir + "/err.txt"));
    port = ReadFile(port_file);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(!port.empty());

  cli::AgentClient client("unix:" + sock);
  auto status = client.Status();
  REQUIRE(status.ok());
  CHECK(status->name() == "from-flagfile");
  CHECK(status->local_socket() == sock);
  CHECK(status->network_door() == "none");
  CHECK(status->health_address().rfind("127.0.0.1:", 0) == 0);
  CHECK(status->copy_lanes().lanes() == 2);
  // The UCX progress thread ("ucx-" and the name, cut to the kernel's 15 bytes) runs on
  // the CPU given, as the kernel says, and GetStatus says so; the process's first thread
  // keeps every CPU it had.
  const std::string last = std::to_string(AllowedCpus().back());
  CHECK(status->worker_cpus() == last);
  CHECK(ThreadCpus(pid, "ucx-from-flagfi") == std::vector<std::string>{last});
  if (AllowedCpus().size() > 1) CHECK(ThreadCpus(pid, "") != std::vector<std::string>{last});
  // The flag's choice, whether or not this host has a GPU to apply it to.
  CHECK(status->device_copy().find("--device-copy=per-page") != std::string::npos);
  CHECK(status->device_copy().find("KVAGENT_DEVICE_COPY") == std::string::npos);
  if (!cuda::CudaDriver::Load().ok()) {
    CHECK(status->device_copy() ==
          "none (no CUDA driver; --device-copy=per-page applies on a host with a GPU)");
  } else {
    CHECK(status->device_copy() == "cuMemcpyAsync per page (--device-copy=per-page)");
  }
  bool saw_regions = false, saw_metadata = false;
  for (const auto& limit : status->limits()) {
    if (limit.name() == "regions") {
      saw_regions = true;
      CHECK(limit.value() == 1500);
    }
    if (limit.name() == "metadata_bytes") {
      saw_metadata = true;
      CHECK(limit.value() == (2u << 20));
    }
  }
  CHECK(saw_regions);
  CHECK(saw_metadata);

  REQUIRE(kill(pid, SIGTERM) == 0);
  CHECK(WaitExit(pid) == 0);
}

}  // namespace
}  // namespace kvagent

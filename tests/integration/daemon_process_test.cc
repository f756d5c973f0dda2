// DaemonProcess (the harness of the bench, the demo and these tests) puts an agent's
// sockets in /tmp/kva-<hash of WORK_DIR>/ when WORK_DIR is too deep for a Unix socket
// path. Once the agent exited, killed or stopped, nothing of it may stay there: a
// killed agent leaves its sockets behind, and every run used to leave such a folder
// in /tmp (thousands after a day of test runs).
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "catch2/catch.hpp"
#include "cli/daemon_process.h"
#include "fmt/format.h"
#include "tests/unit/catch_main.h"

namespace kvagent::cli {
namespace {

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

std::string Dir(const std::string& path) { return path.substr(0, path.rfind('/')); }

// A work folder deeper than a Unix socket path allows (so the sockets go to /tmp).
std::string DeepWorkDir(const std::string& tag) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = fmt::format("{}/{}-{}", base && *base ? base : "/tmp", tag, ::getpid());
  REQUIRE(::mkdir(dir.c_str(), 0755) == 0);
  dir += "/" + std::string(100, 'w');
  REQUIRE(::mkdir(dir.c_str(), 0755) == 0);
  return dir;
}

DaemonProcess StartAgent(const std::string& name, const std::string& work_dir) {
  DaemonOptions options;
  auto binary = FindKvagentd("");
  REQUIRE(binary.ok());
  options.binary = *binary;
  options.name = name;
  options.work_dir = work_dir;
  auto process = DaemonProcess::Start(options);
  INFO(process.status().ToString());
  REQUIRE(process.ok());
  return *std::move(process);
}

TEST_CASE("a killed agent's sockets and their /tmp folder go once it is reaped") {
  const std::string work = DeepWorkDir("killed");
  DaemonProcess agent = StartAgent("decode", work);
  const std::string socket = agent.local_socket();
  REQUIRE(socket.rfind("/tmp/kva-", 0) == 0);
  REQUIRE(Exists(socket));
  REQUIRE(Exists(socket + ".session"));
  agent.Kill();  // SIGKILL: the agent unlinks nothing itself
  CHECK_FALSE(Exists(socket));
  CHECK_FALSE(Exists(socket + ".session"));
  CHECK_FALSE(Exists(socket + ".live"));
  CHECK_FALSE(Exists(Dir(socket)));
}

TEST_CASE("two agents share the folder: the first to go leaves the other's live sockets") {
  const std::string work = DeepWorkDir("shared");
  DaemonProcess prefill = StartAgent("prefill", work);
  DaemonProcess decode = StartAgent("decode", work);
  REQUIRE(Dir(prefill.local_socket()) == Dir(decode.local_socket()));
  decode.Kill();
  CHECK_FALSE(Exists(decode.local_socket()));
  CHECK(Exists(prefill.local_socket()));
  CHECK(Exists(prefill.local_socket() + ".session"));
  CHECK(Exists(Dir(prefill.local_socket())));
  // A restart under the same name takes the same path again, and works.
  DaemonProcess again = StartAgent("decode", work);
  CHECK(again.local_socket() == decode.local_socket());
  CHECK(Exists(again.local_socket()));
  auto stopped = again.Stop(5000);
  REQUIRE(stopped.ok());
  CHECK(*stopped == 0);
  CHECK(Exists(prefill.local_socket()));
  auto last = prefill.Stop(5000);
  REQUIRE(last.ok());
  CHECK(*last == 0);
  CHECK_FALSE(Exists(prefill.local_socket()));
  CHECK_FALSE(Exists(Dir(prefill.local_socket())));
}

TEST_CASE("a socket path given by the caller is left alone") {
  const std::string work = DeepWorkDir("given");
  const std::string socket = kvagent::testing::UniqueSocketName("/tmp/kvagent-given") + ".sock";
  DaemonOptions options;
  auto binary = FindKvagentd("");
  REQUIRE(binary.ok());
  options.binary = *binary;
  options.name = "given";
  options.work_dir = work;
  options.local_socket = socket;
  auto agent = DaemonProcess::Start(options);
  INFO(agent.status().ToString());
  REQUIRE(agent.ok());
  REQUIRE(Exists(socket));
  agent->Kill();
  // Not in a folder of the harness: the caller owns it (the agent's leftover stays).
  CHECK(Exists(socket));
  ::unlink(socket.c_str());
  ::unlink((socket + ".session").c_str());
  ::unlink((socket + ".live").c_str());
}

}  // namespace
}  // namespace kvagent::cli

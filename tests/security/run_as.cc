#include "tests/security/run_as.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>

#include "catch2/catch.hpp"
#include "fmt/format.h"

namespace kvagent::testing {

OpenDir::OpenDir() {
  char tmpl[] = "/tmp/kvsec.XXXXXX";
  const char* made = mkdtemp(tmpl);
  REQUIRE(made != nullptr);
  path_ = made;
  chmod(path_.c_str(), 0755);
}

OpenDir::~OpenDir() { std::filesystem::remove_all(path_); }

std::string CopyTool(const OpenDir& dir, const std::string& name) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const std::string source =
      fmt::format("{}/kvagent/tests/security/{}", srcdir ? srcdir : ".", name);
  const std::string tool = dir.path() + "/" + name;
  std::filesystem::copy_file(source, tool);
  chmod(tool.c_str(), 0755);
  return tool;
}

std::string CopyProbe(const OpenDir& dir) { return CopyTool(dir, "security_probe"); }

std::unique_ptr<cli::DaemonProcess> StartVictim(const OpenDir& dir,
                                                std::vector<std::string> extra_args) {
  cli::DaemonOptions options;
  auto binary = cli::FindKvagentd("");
  REQUIRE(binary.ok());
  options.binary = *binary;
  options.name = "victim";
  options.work_dir = dir.path();
  options.local_socket = dir.path() + "/victim.sock";
  options.extra_args = std::move(extra_args);
  auto agent = cli::DaemonProcess::Start(options);
  INFO(agent.status().ToString());
  REQUIRE(agent.ok());
  return std::make_unique<cli::DaemonProcess>(*std::move(agent));
}

Outcome RunAs(uid_t uid, gid_t gid, const std::string& probe, const std::string& address,
              const std::string& command, const std::string& arg) {
  const std::string line = fmt::format(
      "setpriv --reuid={} --regid={} --clear-groups -- {} {} {} '{}' 2>&1", uid, gid, probe,
      address, command, arg);
  FILE* pipe = popen(line.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string out;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
  pclose(pipe);
  INFO(line << "\n -> " << out);
  const size_t tab = out.find('\t');
  REQUIRE(tab != std::string::npos);
  std::string message = out.substr(tab + 1);
  if (!message.empty() && message.back() == '\n') message.pop_back();
  return Outcome{out.substr(0, tab), std::move(message)};
}

}  // namespace kvagent::testing

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

std::string CopyProbe(const OpenDir& dir) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const std::string source =
      fmt::format("{}/kvagent/tests/security/security_probe", srcdir ? srcdir : ".");
  const std::string probe = dir.path() + "/security_probe";
  std::filesystem::copy_file(source, probe);
  chmod(probe.c_str(), 0755);
  return probe;
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

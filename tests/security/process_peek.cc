#include "tests/security/process_peek.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "transport/ucx_tcp_guard.h"

namespace kvagent::testing {

std::vector<int> ListeningTcpPorts(pid_t pid) {
  std::set<unsigned long long> inodes;
  for (const auto& entry : std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid))) {
    std::error_code error;
    const std::string target = std::filesystem::read_symlink(entry.path(), error).string();
    unsigned long long inode = 0;
    if (!error && std::sscanf(target.c_str(), "socket:[%llu]", &inode) == 1) inodes.insert(inode);
  }
  std::ifstream table(fmt::format("/proc/{}/net/tcp", pid));
  std::stringstream text;
  text << table.rdbuf();
  std::vector<int> ports;
  for (const transport::internal::ProcTcpEntry& entry :
       transport::internal::ProcNetTcpEntries(text.str())) {
    if (entry.state != "0A" || inodes.count(entry.inode) == 0) continue;
    ports.push_back(std::stoi(entry.local.substr(entry.local.find(':') + 1), nullptr, 16));
  }
  return ports;
}

uint64_t StackBottom(pid_t pid) {
  std::ifstream maps(fmt::format("/proc/{}/maps", pid));
  for (std::string line; std::getline(maps, line);) {
    if (line.find("[stack]") != std::string::npos) return std::stoull(line, nullptr, 16);
  }
  return 0;
}

std::string PeekMemory(pid_t pid, uint64_t address, size_t bytes) {
  const int fd = open(fmt::format("/proc/{}/mem", pid).c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  std::string out(bytes, '\0');
  const ssize_t n = pread(fd, out.data(), bytes, static_cast<off_t>(address));
  close(fd);
  REQUIRE(n == static_cast<ssize_t>(bytes));
  return out;
}

}  // namespace kvagent::testing

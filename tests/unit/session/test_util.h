// Test helpers for the session socket tests: a short temporary directory (Unix socket
// paths are limited to 107 bytes and Bazel's TEST_TMPDIR is long), descriptor
// counting, memfds and mappings, waiting. Used by tests/unit/session/*_test.cc only.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "base/unique_fd.h"
#include "catch2/catch.hpp"

namespace kvagent::testing {

// mkdtemp("/tmp/kvs.XXXXXX"), removed with everything in it at the end.
class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/kvs.XXXXXX";
    REQUIRE(mkdtemp(pattern) != nullptr);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Descriptors open in this process now.
inline int CountOpenFds() {
  int count = 0;
  DIR* dir = opendir("/proc/self/fd");
  REQUIRE(dir != nullptr);
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count - 1;  // the directory's own descriptor
}

// Polls `condition` every millisecond until it holds or `timeout_ms` passes.
template <typename Condition>
bool WaitFor(Condition condition, int timeout_ms = 5000) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

inline UniqueFd MakeMemfd(size_t bytes, const char* name = "kvs-test") {
  UniqueFd fd(memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(fd.valid());
  REQUIRE(ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0);
  return fd;
}

// A MAP_SHARED read-write mapping, unmapped at the end.
class Mapping {
 public:
  Mapping(int fd, size_t bytes) : bytes_(bytes) {
    data_ = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    REQUIRE(data_ != MAP_FAILED);
  }
  ~Mapping() { munmap(data_, bytes_); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  unsigned char* bytes() const { return static_cast<unsigned char*>(data_); }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Sends raw bytes with `fds` as one datagram (no framing checks: for abuse tests).
inline ssize_t SendRaw(int fd, const std::string& bytes, const std::vector<int>& fds = {},
                       int flags = 0) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(fds.size() * sizeof(int)));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(cmsg), fds.data(), fds.size() * sizeof(int));
  }
  return sendmsg(fd, &msg, MSG_NOSIGNAL | flags);
}

}  // namespace kvagent::testing

// A stock UCT tcp interface (UCT's public API, no kvagent code in front of it) on
// loopback, for tests that send it raw frames: what the library itself does with each.
//
//   uct_frame_target
//
// Prints "port N ipv4" (or ipv6: UCX_TCP_AF_PRIO=inet6) once its interface listens (the one listening socket of this process),
// then progresses the interface until its stdin ends, and 100 ms after that, and exits
// 0. A frame the library aborts on ends it by a signal instead. No active-message
// handler is set: UCT's own stub takes every id below 32.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tests/security/stock_uct.h"
#include "uct/api/uct.h"

namespace {

int Fail(const std::string& what, ucs_status_t status) {
  std::printf("setup\t%s: %s\n", what.c_str(), ucs_status_string(status));
  std::fflush(stdout);
  return 2;
}

// The port of this process's one listening TCP socket (UCT's), 0 when there is not one;
// its address family in `*family`.
int ListeningPort(int* family) {
  int port = 0;
  int found = 0;
  DIR* fds = opendir("/proc/self/fd");
  if (fds == nullptr) return 0;
  while (dirent* entry = readdir(fds)) {
    const int fd = std::atoi(entry->d_name);
    if (fd <= 2) continue;
    int listening = 0;
    socklen_t length = sizeof listening;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &length) != 0 || !listening) {
      continue;
    }
    sockaddr_storage address{};
    socklen_t address_length = sizeof address;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &address_length) != 0) continue;
    if (address.ss_family == AF_INET) {
      port = ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port);
      ++found;
    } else if (address.ss_family == AF_INET6) {
      port = ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
      ++found;
    }
    *family = address.ss_family;
  }
  closedir(fds);
  return found == 1 ? port : 0;
}

}  // namespace

int main() {
  // What the library prints for a frame is not this tool's output.
  if (const char* level = std::getenv("UCX_LOG_LEVEL"); level == nullptr) {
    setenv("UCX_LOG_LEVEL", "fatal", 1);
    char self[] = "/proc/self/exe";
    char* argv[] = {self, nullptr};
    execv(self, argv);
    return 2;
  }
  kvagent::testing::StockUctTcp uct;
  std::string failed;
  const char* device = std::getenv("KVAGENT_TARGET_DEVICE");  // default: loopback
  if (ucs_status_t status =
          kvagent::testing::OpenStockUctTcp(device != nullptr ? device : "lo", &uct, &failed);
      status != UCS_OK) {
    return Fail(failed.c_str(), status);
  }
  int family = 0;
  const int port = ListeningPort(&family);
  if (port == 0) return Fail("no single listening socket after uct_iface_open", UCS_ERR_IO_ERROR);
  std::printf("port %d %s\n", port, family == AF_INET6 ? "ipv6" : "ipv4");
  std::fflush(stdout);
  // Progress until stdin ends (the caller is done sending), then 100 ms more.
  fcntl(0, F_SETFL, fcntl(0, F_GETFL) | O_NONBLOCK);
  bool ended = false;
  auto until = std::chrono::steady_clock::now() + std::chrono::hours(1);
  while (std::chrono::steady_clock::now() < until) {
    uct_worker_progress(uct.worker);
    if (!ended) {
      char byte;
      const ssize_t n = read(0, &byte, 1);
      if (n == 0) {
        ended = true;
        until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
      }
    }
    usleep(100);
  }
  kvagent::testing::CloseStockUctTcp(&uct);
  std::printf("alive\n");
  std::fflush(stdout);
  return 0;
}

#include "cli/local_agents.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "base/format.h"
#include "fmt/format.h"

namespace kvagent::cli {

absl::Status StartLocalAgents(const LocalAgentsOptions& options, LocalAgents* agents) {
  std::string binary = options.kvagentd;
  if (binary.empty()) {
    auto found = FindKvagentd(options.argv0);
    if (!found.ok()) {
      return absl::Status(found.status().code(),
                          fmt::format("finding kvagentd: {}", found.status().message()));
    }
    binary = *found;
  }
  if (const char* tmp = std::getenv("TEST_TMPDIR")) {
    agents->work_dir = fmt::format("{}/{}.{}", tmp, options.label, getpid());
    std::filesystem::create_directories(agents->work_dir);
  } else {
    std::string pattern = fmt::format("/tmp/kvagent-{}.XXXXXX", options.label);
    if (mkdtemp(pattern.data()) == nullptr) {
      return absl::FailedPreconditionError(
          fmt::format("cannot create a work folder {} for the agents; check /tmp", pattern));
    }
    agents->work_dir = pattern;
  }
  for (auto [name, slot] : {std::pair{&options.first_name, &agents->first},
                            {&options.second_name, &agents->second}}) {
    DaemonOptions d;
    d.binary = binary;
    d.name = *name;
    d.work_dir = agents->work_dir;
    d.extra_args = options.extra_args;
    d.cpus = options.cpus;
    if (slot == &agents->first) {
      d.extra_args.insert(d.extra_args.end(), options.first_args.begin(),
                          options.first_args.end());
    }
    auto started = DaemonProcess::Start(d);
    // DaemonProcess's errors name the agent already.
    if (!started.ok()) return started.status();
    *slot = *std::move(started);
    agents->log_paths.push_back((*slot)->log_path());
  }
  return absl::OkStatus();
}

void LocalAgents::StopAndClean() {
  if (first) (void)first->Stop();
  if (second) (void)second->Stop();
  std::error_code ignored;
  if (!work_dir.empty()) std::filesystem::remove_all(work_dir, ignored);
}

void PrintAgentLogs(const std::vector<std::string>& paths, size_t tail_bytes) {
  for (const auto& path : paths) {
    std::ifstream in(path);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (text.size() > tail_bytes) text = text.substr(text.size() - tail_bytes);
    std::fprintf(stderr, "---- %s (last lines)\n%s\n", path.c_str(), text.c_str());
  }
}

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t i = static_cast<size_t>(p / 100.0 * (values.size() - 1) + 0.5);
  return values[std::min(i, values.size() - 1)];
}

void Progress(size_t done, size_t total, const std::string& what) {
  if (!isatty(STDERR_FILENO)) return;
  const int width = 30;
  const int filled = total ? static_cast<int>(width * done / total) : width;
  std::fprintf(stderr, "\r[%s%s] %zu/%zu %-40s", std::string(filled, '#').c_str(),
               std::string(width - filled, ' ').c_str(), done, total, what.c_str());
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

absl::StatusOr<int> FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError(fmt::format("socket(): {}", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::InternalError(fmt::format("binding a free loopback port: {}", std::strerror(err)));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace kvagent::cli

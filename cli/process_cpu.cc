#include "cli/process_cpu.h"

#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <vector>

#include "fmt/format.h"

namespace kvagent::cli {

absl::StatusOr<CpuTicks> ReadCpuTicks(const std::string& stat_path) {
  std::ifstream in(stat_path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t open = text.find('('), close = text.rfind(')');
  if (text.empty() || open == std::string::npos || close == std::string::npos || close < open) {
    return absl::NotFoundError(fmt::format("{} is unreadable (the agent is gone?)", stat_path));
  }
  std::istringstream fields(text.substr(close + 1));
  std::vector<std::string> f;
  for (std::string s; fields >> s;) f.push_back(s);
  // f[0] is field 3 (state).
  if (f.size() < 13) return absl::InternalError(fmt::format("{}: too few fields", stat_path));
  return CpuTicks{text.substr(open + 1, close - open - 1), f[0][0],
                  std::stoull(f[11]) + std::stoull(f[12])};
}

std::map<std::string, CpuTicks> ThreadCpuTicks(pid_t pid) {
  std::map<std::string, CpuTicks> threads;
  std::error_code ec;
  for (const auto& entry :
       std::filesystem::directory_iterator(fmt::format("/proc/{}/task", pid), ec)) {
    auto t = ReadCpuTicks(entry.path().string() + "/stat");
    if (t.ok()) threads[entry.path().filename().string()] = *t;
  }
  return threads;
}

absl::StatusOr<double> ProcessCpuSeconds(pid_t pid) {
  auto ticks = ReadCpuTicks(fmt::format("/proc/{}/stat", pid));
  if (!ticks.ok()) return ticks.status();
  return static_cast<double>(ticks->ticks) / sysconf(_SC_CLK_TCK);
}

std::map<std::string, uint64_t> ThreadWakeups(pid_t pid) {
  std::map<std::string, uint64_t> out;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator(fmt::format("/proc/{}/task", pid), ec)) {
    std::ifstream status(task.path() / "status");
    std::string line, name;
    uint64_t switches = 0;
    while (std::getline(status, line)) {
      if (line.rfind("Name:", 0) == 0) {
        name = line.substr(5);
        name.erase(0, name.find_first_not_of(" \t"));
      } else if (line.rfind("voluntary_ctxt_switches:", 0) == 0) {
        switches = std::strtoull(line.c_str() + 24, nullptr, 10);
      }
    }
    if (!name.empty()) out[name] += switches;
  }
  return out;
}

double ThreadCpuSeconds() {
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0;
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

}  // namespace kvagent::cli

#include "base/cpu_list.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>

#include "fmt/format.h"

namespace kvagent {

absl::StatusOr<std::vector<int>> ParseCpuList(std::string_view text) {
  std::vector<int> cpus;
  if (text.empty()) return cpus;
  auto refuse = [](const std::string& why) {
    return absl::InvalidArgumentError(fmt::format(
        "{}; give CPU numbers and ranges as the kernel writes them, e.g. 3, 2,3 or 4-7 (this "
        "process may use {})",
        why, FormatCpuList(AllowedCpus())));
  };
  auto number = [](std::string_view digits, int* value) {
    if (digits.empty() || digits.size() > 5) return false;
    for (char c : digits) {
      if (c < '0' || c > '9') return false;
    }
    *value = std::atoi(std::string(digits).c_str());
    return true;
  };
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    const std::string_view item = text.substr(start, comma - start);
    const size_t dash = item.find('-');
    int low = 0, high = 0;
    bool ok = false;
    if (dash == std::string_view::npos) {
      ok = number(item, &low);
      high = low;
    } else {
      ok = number(item.substr(0, dash), &low) && number(item.substr(dash + 1), &high);
    }
    if (!ok) return refuse(fmt::format("'{}' is not a CPU number or range", item));
    if (low > high) return refuse(fmt::format("the range '{}' runs backwards (write low-high)", item));
    if (high >= CPU_SETSIZE) {
      return refuse(fmt::format("CPU {} is past the last one a CPU set can name ({})", high,
                                CPU_SETSIZE - 1));
    }
    for (int cpu = low; cpu <= high; ++cpu) cpus.push_back(cpu);
    start = comma + 1;
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  std::string text;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!text.empty()) text += ',';
    text += j == i ? fmt::format("{}", cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]);
    i = j + 1;
  }
  return text;
}

namespace {

std::vector<int> CpusIn(const cpu_set_t& set) {
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

}  // namespace

std::vector<int> AllowedCpus() { return ProcessCpus(0); }

std::vector<int> ProcessCpus(pid_t pid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(pid, sizeof set, &set) != 0) return {};
  return CpusIn(set);
}

std::vector<int> ThreadCpus(pthread_t thread) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (pthread_getaffinity_np(thread, sizeof set, &set) != 0) return {};
  return CpusIn(set);
}

int PinThread(pthread_t thread, const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : cpus) {
    if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &set);
  }
  return pthread_setaffinity_np(thread, sizeof set, &set);
}

absl::Status CheckCpusAllowed(const std::vector<int>& cpus, std::string_view flag) {
  const std::vector<int> allowed = AllowedCpus();
  std::vector<int> outside;
  for (int cpu : cpus) {
    if (!std::binary_search(allowed.begin(), allowed.end(), cpu)) outside.push_back(cpu);
  }
  if (outside.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(fmt::format(
      "{} {}: CPU {} {} not among those this process may use ({}, as taskset or the "
      "cgroup's cpuset set them); name CPUs from that list, or leave {} out to let the "
      "kernel place the thread",
      flag, FormatCpuList(cpus), FormatCpuList(outside), outside.size() == 1 ? "is" : "are",
      FormatCpuList(allowed), flag));
}

}  // namespace kvagent

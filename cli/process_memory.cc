#include "cli/process_memory.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string_view>

#include "fmt/format.h"

namespace kvagent::cli {
namespace {

// Reads a whole /proc file. `missing_ok`: ENOENT returns an empty string.
absl::StatusOr<std::string> ReadProcFile(pid_t pid, const std::string& path, bool missing_ok) {
  std::ifstream in(path);
  if (!in) {
    const int err = errno;
    if (err == ENOENT && missing_ok) return std::string();
    const std::string cause = std::strerror(err);
    if (err == EACCES || err == EPERM) {
      return absl::PermissionDeniedError(fmt::format(
          "reading the memory of pid {}: cannot open {}: {}; run as the same user as the "
          "process (or root), and check /proc's hidepid mount option",
          pid, path, cause));
    }
    return absl::NotFoundError(fmt::format(
        "reading the memory of pid {}: cannot open {}: {}; is the process still running, "
        "and in this pid namespace?",
        pid, path, cause));
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// "Key:   1234 kB" lines into bytes; other lines are ignored. (Plain std parsing:
// Debian's absl::string_view is not std::string_view.)
bool FindKb(const std::string& text, std::string_view key, uint64_t* bytes) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.size() <= key.size() || line.compare(0, key.size(), key) != 0 ||
        line[key.size()] != ':') {
      continue;
    }
    std::istringstream rest(line.substr(key.size() + 1));
    uint64_t kb = 0;
    if (!(rest >> kb)) return false;
    *bytes = kb * 1024;
    return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<ProcessMemory> ParseProcessMemory(pid_t pid, const std::string& status_text,
                                                 const std::string& rollup_text) {
  ProcessMemory m;
  m.pid = pid;
  const struct {
    std::string_view key;
    uint64_t* field;
  } status_fields[] = {{"VmRSS", &m.vm_rss},
                       {"RssAnon", &m.rss_anon},
                       {"RssFile", &m.rss_file},
                       {"RssShmem", &m.rss_shmem},
                       {"VmHWM", &m.vm_hwm}};
  for (const auto& f : status_fields) {
    if (!FindKb(status_text, f.key, f.field)) {
      return absl::InternalError(fmt::format(
          "reading the memory of pid {}: /proc/{}/status has no '{}:' line (a kernel before "
          "4.5, or a kernel thread); the memory check needs Linux 4.5 or later",
          pid, pid, f.key));
    }
  }
  if (!rollup_text.empty()) {
    // Pss_Anon/File/Shmem appeared in 5.8; Pss alone is older.
    m.has_rollup = FindKb(rollup_text, "Pss", &m.pss);
    FindKb(rollup_text, "Pss_Anon", &m.pss_anon);
    FindKb(rollup_text, "Pss_File", &m.pss_file);
    FindKb(rollup_text, "Pss_Shmem", &m.pss_shmem);
  }
  return m;
}

absl::StatusOr<ProcessMemory> ReadProcessMemory(pid_t pid) {
  if (pid <= 0) {
    return absl::InvalidArgumentError(fmt::format(
        "reading the memory of pid {}: not a process id; pass the agent's pid (GetStatus "
        "reports it)",
        pid));
  }
  const std::string dir = fmt::format("/proc/{}", pid);
  auto status = ReadProcFile(pid, dir + "/status", false);
  if (!status.ok()) return status.status();
  // smaps_rollup is absent before Linux 4.14; the status figures suffice then.
  auto rollup = ReadProcFile(pid, dir + "/smaps_rollup", true);
  if (!rollup.ok()) return rollup.status();
  return ParseProcessMemory(pid, *status, *rollup);
}

std::string FormatMiB(uint64_t bytes) {
  return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20));
}

std::string FormatDeltaMiB(uint64_t before, uint64_t after) {
  const double delta = (static_cast<double>(after) - static_cast<double>(before)) / (1 << 20);
  return fmt::format("{:+.1f} MiB", delta);
}

}  // namespace kvagent::cli

// StatusProbe samples GetStatus on one or more agents every few milliseconds, each on
// its own client, while a limits test pushes them: the agents must keep answering, and
// without stalls. Report() prints p50/p99/max and checks that every call answered,
// with a loose bound (the 50 ms target is the benchmark's to check, not a test's).
// RssAnon and CheckRssBack read the agent's own memory before and after a load.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kvagent::testing {

class StatusProbe {
 public:
  explicit StatusProbe(std::vector<std::string> addresses, uint32_t every_ms = 5);
  ~StatusProbe();
  StatusProbe(const StatusProbe&) = delete;
  StatusProbe& operator=(const StatusProbe&) = delete;

  void Stop();
  // Stops, prints "<what>: GetStatus p50 .. p99 .. max .. over N calls (F failed)" and
  // CHECKs: samples taken, none failed, p99 under `max_p99_ms` (by default 2.5 s:
  // catches stalls, not speed). Returns the p99 in microseconds.
  int64_t Report(const std::string& what, int64_t max_p99_ms = 2500);

 private:
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<int64_t> micros_;
  int failures_ = 0;
  std::thread thread_;
};

// The agent's RssAnon (cli/process_memory), in bytes.
uint64_t RssAnon(pid_t pid);

// After a load: waits up to `limit_ms` for the agent's RssAnon to come back under
// `before` + `bound` (the agent gives freed heap back every 2 s, agent/agent.h), prints
// "<what>: agent RssAnon <before> before, <peak> under the load, <after> after (<delta>)"
// and, in the normal build, CHECKs the bound. Sanitizer builds print only: ASan keeps
// freed memory in its quarantine (256 MiB) and does not give it back.
void CheckRssBack(const std::string& what, pid_t pid, uint64_t before, uint64_t peak,
                  uint64_t bound, uint32_t limit_ms = 10000);

}  // namespace kvagent::testing

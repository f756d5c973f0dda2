// StatusProbe samples GetStatus on one or more agents every few milliseconds, each on
// its own client, while a limits test pushes them: the agents must keep answering, and
// without stalls. Report() prints p50/p99/max and checks that every call answered,
// with a loose bound (the 50 ms target is the benchmark's to check, not a test's).
#pragma once

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
  // CHECKs: samples taken, none failed, p99 under 2.5 s (catches stalls, not speed).
  void Report(const std::string& what);

 private:
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<int64_t> micros_;
  int failures_ = 0;
  std::thread thread_;
};

}  // namespace kvagent::testing

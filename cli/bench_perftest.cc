#include "cli/bench_perftest.h"

#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <thread>
#include <vector>

#include "cli/child_process.h"
#include "cli/local_agents.h"
#include "fmt/format.h"

namespace kvagent::cli {

absl::StatusOr<double> ParsePerftestGbps(const std::string& output) {
  std::stringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("Final:", 0) != 0) continue;
    std::stringstream fields(line.substr(6));
    std::vector<double> values;
    double v;
    while (fields >> v) values.push_back(v);
    if (values.size() < 7) break;
    return values[5] * 1048576.0 / 1e9;
  }
  return absl::InternalError(fmt::format(
      "ucx_perftest printed no 'Final:' line with 8 numbers; its output ends: {}",
      output.substr(output.size() > 400 ? output.size() - 400 : 0)));
}

std::optional<double> Perftest::Gbps(const std::string& test, uint64_t size) {
  if (binary_.empty()) return std::nullopt;
  const auto key = std::make_pair(test, size);
  if (auto it = cache_.find(key); it != cache_.end()) return it->second;
  auto gbps = Measure(test, size);
  std::optional<double> result;
  if (gbps.ok()) {
    result = *gbps;
  } else {
    std::fprintf(stderr, "bench: ucx_perftest -t %s -s %lu: %s\n", test.c_str(),
                 static_cast<unsigned long>(size), std::string(gbps.status().message()).c_str());
  }
  cache_[key] = result;
  return result;
}

absl::StatusOr<double> Perftest::Measure(const std::string& test, uint64_t size) {
  // Enough iterations to move a few hundred MiB, at least 3 of even the largest.
  const uint64_t budget = quick_ ? (64ull << 20) : (512ull << 20);
  const uint64_t iterations = std::clamp<uint64_t>(budget / size, 3, 20000);
  const uint64_t warmup = std::max<uint64_t>(1, iterations / 10);
  absl::Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto port = FreePort();
    if (!port.ok()) return port.status();
    auto server = SpawnChild({binary_, "-p", std::to_string(*port)}, -1);
    if (!server.ok()) return server.status();
    // The server needs a moment to listen; a refused client exits at once, so
    // retry it until it connects.
    absl::StatusOr<std::string> out;
    for (int tries = 0; tries < 40; ++tries) {
      std::this_thread::sleep_for(std::chrono::milliseconds(tries == 0 ? 30 : 50));
      out = RunChild({binary_, "127.0.0.1", "-p", std::to_string(*port), "-t", test, "-s",
                       std::to_string(size), "-n", std::to_string(iterations), "-w",
                       std::to_string(warmup)},
                      120000);
      if (out.ok() || out.status().code() == absl::StatusCode::kDeadlineExceeded) break;
      if (waitpid(*server, nullptr, WNOHANG) == *server) break;  // server gone: new port
    }
    ReapChild(*server, 3000);
    if (out.ok()) return ParsePerftestGbps(*out);
    last = out.status();
  }
  return last;
}

}  // namespace kvagent::cli

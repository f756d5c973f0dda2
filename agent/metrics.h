// The Prometheus endpoint of kvagentd (--metrics-listen): a small HTTP/1.1 responder
// on its own listener, off the gRPC doors, that answers GET /metrics with the text
// exposition format (0.0.4). What it reports is what GetStatus reports (one source:
// FillAgentStatus) plus the ended-transfer counters and histograms (TransferMetrics),
// peers and regions by kind. Bounded: connections, request bytes, time per request.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "agent/agent_service.h"
#include "agent/staging.h"
#include "agent/transfer_metrics.h"

namespace kvagent::agent {

struct MetricsServerOptions {
  // HOST:PORT, or PORT alone for 127.0.0.1:PORT; port 0 picks one. A wildcard host
  // (0.0.0.0, [::]) needs `allow_any` (--metrics-listen-any).
  std::string listen;
  bool allow_any = false;
  uint32_t max_connections = 16;  // --metrics-max-connections
};

struct MetricsServerCounters {
  uint64_t requests = 0;            // answered 200
  uint64_t refused_connections = 0;  // past max_connections (503)
  uint64_t bad_requests = 0;        // not HTTP, or not GET (400, 405), or unknown path (404)
  uint64_t too_large = 0;           // request head over kMaxRequestBytes (431)
  uint64_t timeouts = 0;            // no whole request within kRequestTimeout
};

class MetricsServer {
 public:
  static constexpr size_t kMaxRequestBytes = 8 << 10;
  static constexpr int kRequestTimeoutMs = 2000;
  // Builds the body of GET /metrics (on the server's thread).
  using Render = std::function<std::string()>;

  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const MetricsServerOptions& options,
                                                               Render render);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  void Stop();  // idempotent
  const std::string& address() const { return address_; }  // HOST:PORT as bound
  MetricsServerCounters counters() const;

 private:
  struct Connection;
  MetricsServer() = default;
  void Loop();
  // Reads what came; true when the connection has a response to write.
  bool OnReadable(Connection& c);
  void Respond(Connection& c, int code, std::string_view reason, std::string body,
               std::string_view content_type = "text/plain; charset=utf-8");

  MetricsServerOptions options_;
  Render render_;
  std::string address_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: Stop
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> requests_{0}, refused_{0}, bad_{0}, too_large_{0}, timeouts_{0};
};

// What the text exposition reads.
struct MetricsSources {
  const ServiceDeps* deps = nullptr;
  const TransferMetrics* transfers = nullptr;
  const Stager* stager = nullptr;         // null: no staging counters
  const MetricsServer* server = nullptr;  // the endpoint's own counters; null: none
};

// The Prometheus text exposition (format 0.0.4) of everything in `sources`.
std::string RenderMetrics(const MetricsSources& sources);

// `value` escaped for a label value of the text format (backslash, quote, newline).
std::string EscapeLabelValue(std::string_view value);

}  // namespace kvagent::agent

// Scraping an agent's Prometheus endpoint (--metrics-listen) from a test: raw HTTP
// exchanges over loopback TCP, the body of GET /metrics, and sums of samples by name
// and labels. Shared by metrics_test and fleet_test.
#pragma once

#include <string>
#include <vector>

#include "cli/agent_client.h"

namespace kvagent::testing {

// Connects to HOST:PORT (IPv4, 5 s receive timeout); -1 on failure.
int Dial(const std::string& address);
// Everything `fd` sends until it closes (or times out).
std::string ReadAll(int fd);
// Sends `request` as is and returns the whole response ("" if none).
std::string Exchange(const std::string& address, const std::string& request);
// The HTTP status code of `response` (0 if none).
int StatusCode(const std::string& response);
// GET /metrics: the body; fails the test unless 200.
std::string Scrape(const std::string& address);
// The sum of the samples of `name` whose labels include every `k="v"` in `labels`
// (exact name: `name{` or `name `).
double Value(const std::string& body, const std::string& name,
             const std::vector<std::string>& labels = {});
// The agent's metrics endpoint as GetStatus reports it; fails the test if none.
std::string MetricsAddress(cli::AgentClient& client);

}  // namespace kvagent::testing

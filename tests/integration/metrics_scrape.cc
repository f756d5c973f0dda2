#include "tests/integration/metrics_scrape.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <sstream>

#include "catch2/catch.hpp"

namespace kvagent::testing {

int Dial(const std::string& address) {
  const size_t colon = address.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::atoi(address.substr(colon + 1).c_str())));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval timeout{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

std::string ReadAll(int fd) {
  std::string out;
  char buffer[65536];
  for (;;) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n <= 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

std::string Exchange(const std::string& address, const std::string& request) {
  const int fd = Dial(address);
  if (fd < 0) return "";
  (void)!write(fd, request.data(), request.size());
  std::string response = ReadAll(fd);
  close(fd);
  return response;
}

int StatusCode(const std::string& response) {
  return response.size() > 12 ? std::atoi(response.substr(9, 3).c_str()) : 0;
}

std::string Scrape(const std::string& address) {
  const std::string response = Exchange(address, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  INFO(response.substr(0, 200));
  REQUIRE(StatusCode(response) == 200);
  return response.substr(response.find("\r\n\r\n") + 4);
}

double Value(const std::string& body, const std::string& name,
             const std::vector<std::string>& labels) {
  std::istringstream lines(body);
  std::string line;
  double sum = 0;
  while (std::getline(lines, line)) {
    if (line.rfind(name + "{", 0) != 0 && line.rfind(name + " ", 0) != 0) continue;
    bool match = true;
    for (const auto& l : labels) match = match && line.find(l) != std::string::npos;
    if (match) sum += std::stod(line.substr(line.rfind(' ') + 1));
  }
  return sum;
}

std::string MetricsAddress(cli::AgentClient& client) {
  auto status = client.Status();
  REQUIRE(status.ok());
  REQUIRE(!status->metrics_address().empty());
  return status->metrics_address();
}


}  // namespace kvagent::testing

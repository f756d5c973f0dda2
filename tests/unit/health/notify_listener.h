// What systemd does with a service's notifications, played by a test: a datagram
// socket bound at a path (or an abstract name), and each message received with the
// time it came.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "catch2/catch.hpp"

namespace kvagent::testing {

class NotifyListener {
 public:
  struct Message {
    std::string text;
    std::chrono::steady_clock::time_point at;
  };

  // `name`: a path, or "@name" for the abstract namespace (as $NOTIFY_SOCKET).
  explicit NotifyListener(std::string name) : name_(std::move(name)) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    REQUIRE(name_.size() < sizeof(address.sun_path));
    std::memcpy(address.sun_path, name_.data(), name_.size());
    socklen_t length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name_.size());
    if (name_[0] == '@') {
      address.sun_path[0] = '\0';
    } else {
      ::unlink(name_.c_str());
      ++length;
    }
    INFO("bind " << name_ << ": " << std::strerror(errno));
    REQUIRE(::bind(fd_, reinterpret_cast<const sockaddr*>(&address), length) == 0);
  }
  ~NotifyListener() {
    ::close(fd_);
    if (name_[0] != '@') ::unlink(name_.c_str());
  }
  NotifyListener(const NotifyListener&) = delete;
  NotifyListener& operator=(const NotifyListener&) = delete;

  const std::string& name() const { return name_; }

  // Everything that arrives within `ms`, or until `stop` holds for the last message.
  template <typename Stop>
  std::vector<Message> Receive(int ms, Stop stop) {
    std::vector<Message> out;
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            until - std::chrono::steady_clock::now())
                            .count();
      if (left <= 0) return out;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char buffer[4096];
      const ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
      if (n < 0) continue;
      out.push_back(Message{std::string(buffer, static_cast<size_t>(n)),
                            std::chrono::steady_clock::now()});
      if (stop(out.back())) return out;
    }
  }
  std::vector<Message> Receive(int ms) {
    return Receive(ms, [](const Message&) { return false; });
  }
  // The first message within `ms` that contains `line`; empty text if none came.
  Message WaitFor(const std::string& line, int ms) {
    auto got = Receive(ms, [&](const Message& m) { return m.text.find(line) != std::string::npos; });
    if (!got.empty() && got.back().text.find(line) != std::string::npos) return got.back();
    return Message{};
  }

 private:
  std::string name_;
  int fd_ = -1;
};

}  // namespace kvagent::testing

#include "agent/systemd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "base/log.h"
#include "client/session_wire.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {

constexpr log::Logger kLog("systemd");

// $NOTIFY_SOCKET as a socket address: a path (client::MakeUnixAddress), or "@name" in
// the abstract namespace (a NUL first, no NUL at the end).
absl::StatusOr<client::UnixAddress> NotifyAddress(const std::string& socket) {
  if (socket.empty() || (socket[0] != '/' && socket[0] != '@')) {
    return absl::InvalidArgumentError(fmt::format(
        "NOTIFY_SOCKET='{}' is neither an absolute path nor @name (the abstract namespace)",
        socket));
  }
  if (socket[0] == '/') {
    absl::StatusOr<client::UnixAddress> path = client::MakeUnixAddress(socket);
    if (!path.ok()) {
      return absl::InvalidArgumentError(fmt::format("NOTIFY_SOCKET: {}", path.status().message()));
    }
    return path;
  }
  client::UnixAddress abstract;
  if (socket.size() > sizeof(abstract.address.sun_path)) {
    return absl::InvalidArgumentError(fmt::format(
        "NOTIFY_SOCKET '{}' is {} bytes, over the {} an abstract socket name holds", socket,
        socket.size(), sizeof(abstract.address.sun_path)));
  }
  abstract.address.sun_family = AF_UNIX;
  std::memcpy(abstract.address.sun_path + 1, socket.data() + 1, socket.size() - 1);
  abstract.length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + socket.size());
  return abstract;
}

}  // namespace

absl::Duration SystemdNotifier::WatchdogFromEnvironment(std::string* error) {
  const char* usec = std::getenv("WATCHDOG_USEC");
  if (usec == nullptr || *usec == '\0') return absl::ZeroDuration();
  if (const char* pid = std::getenv("WATCHDOG_PID"); pid != nullptr && *pid != '\0') {
    int64_t for_pid = 0;
    if (!absl::SimpleAtoi(pid, &for_pid) || for_pid <= 0) {
      *error = fmt::format("WATCHDOG_PID='{}' is not a process id", pid);
      return absl::ZeroDuration();
    }
    if (for_pid != getpid()) return absl::ZeroDuration();  // another process's
  }
  uint64_t micros = 0;
  if (!absl::SimpleAtoi(usec, &micros) || micros == 0) {
    *error = fmt::format("WATCHDOG_USEC='{}' is not a positive number of microseconds", usec);
    return absl::ZeroDuration();
  }
  return absl::Microseconds(static_cast<int64_t>(micros));
}

std::unique_ptr<SystemdNotifier> SystemdNotifier::FromEnvironment() {
  const char* socket = std::getenv("NOTIFY_SOCKET");
  if (socket == nullptr || *socket == '\0') return nullptr;
  std::string error;
  const absl::Duration watchdog = WatchdogFromEnvironment(&error);
  if (!error.empty()) {
    kLog.Warn("{}: no watchdog pings; set WatchdogSec= in the unit, or leave both variables "
              "to systemd",
              error);
  }
  auto notifier = Open(socket, watchdog);
  for (const char* name : {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"}) unsetenv(name);
  if (!notifier.ok()) {
    kLog.Warn("not notifying systemd: {}; the unit's Type=notify start will time out "
              "(use Type=exec, or let systemd set NOTIFY_SOCKET)",
              notifier.status().message());
    return nullptr;
  }
  return *std::move(notifier);
}

absl::StatusOr<std::unique_ptr<SystemdNotifier>> SystemdNotifier::Open(const std::string& socket,
                                                                      absl::Duration watchdog) {
  absl::StatusOr<client::UnixAddress> address = NotifyAddress(socket);
  if (!address.ok()) return address.status();
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        fmt::format("socket(AF_UNIX, SOCK_DGRAM): {}", std::strerror(errno)));
  }
  return std::unique_ptr<SystemdNotifier>(new SystemdNotifier(fd, socket, *address, watchdog));
}

SystemdNotifier::SystemdNotifier(int fd, std::string socket, const client::UnixAddress& address,
                                 absl::Duration watchdog)
    : fd_(fd), socket_(std::move(socket)), address_(address), watchdog_(watchdog) {}

SystemdNotifier::~SystemdNotifier() { ::close(fd_); }

absl::Status SystemdNotifier::Notify(std::string_view state) {
  ssize_t sent;
  do {
    // Sent to the address each time, not connected once: systemd re-creates its socket
    // when it re-executes itself (daemon-reexec).
    sent = ::sendto(fd_, state.data(), state.size(), MSG_NOSIGNAL,
                    reinterpret_cast<const sockaddr*>(&address_.address), address_.length);
  } while (sent < 0 && errno == EINTR);
  if (sent == static_cast<ssize_t>(state.size())) return absl::OkStatus();
  const std::string why = sent < 0 ? std::strerror(errno) : "a short send";
  absl::Status status = absl::UnavailableError(
      fmt::format("notifying systemd at {}: {}", socket_, why));
  absl::MutexLock lock(&mu_);
  if (!failure_logged_) {
    failure_logged_ = true;
    kLog.Warn("{} (logged once; the agent runs on)", status.message());
  }
  return status;
}

void SystemdNotifier::Health(bool live, const std::string& status) {
  std::string message;
  {
    absl::MutexLock lock(&mu_);
    if (status != last_status_) {
      last_status_ = status;
      std::string line = status;  // one line: STATUS= ends at the first newline
      for (char& c : line) {
        if (c == '\n') c = ' ';
      }
      message = "STATUS=" + line + "\n";
    }
  }
  if (live && watchdog_ > absl::ZeroDuration()) message += "WATCHDOG=1\n";
  if (!message.empty()) Notify(message).IgnoreError();
}

}  // namespace kvagent::agent

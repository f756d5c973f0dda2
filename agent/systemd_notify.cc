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
#include "fmt/format.h"

namespace kvagent::agent {
namespace {

constexpr log::Logger kLog("systemd");

// $NOTIFY_SOCKET as a socket address; false with `error` when it cannot be one.
bool NotifyAddress(const std::string& socket, sockaddr_un* address, socklen_t* length,
                   std::string* error) {
  std::memset(address, 0, sizeof(*address));
  address->sun_family = AF_UNIX;
  if (socket.empty() || (socket[0] != '/' && socket[0] != '@')) {
    *error = fmt::format("NOTIFY_SOCKET='{}' is neither an absolute path nor @name (the "
                         "abstract namespace)",
                         socket);
    return false;
  }
  if (socket.size() >= sizeof(address->sun_path)) {
    *error = fmt::format("NOTIFY_SOCKET is {} bytes long; a socket address holds at most {}",
                         socket.size(), sizeof(address->sun_path) - 1);
    return false;
  }
  std::memcpy(address->sun_path, socket.data(), socket.size());
  if (socket[0] == '@') address->sun_path[0] = '\0';
  *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + socket.size() +
                                   (socket[0] == '@' ? 0 : 1));
  return true;
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
  sockaddr_un address;
  socklen_t length = 0;
  std::string error;
  if (!NotifyAddress(socket, &address, &length, &error)) {
    return absl::InvalidArgumentError(error);
  }
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        fmt::format("socket(AF_UNIX, SOCK_DGRAM): {}", std::strerror(errno)));
  }
  return std::unique_ptr<SystemdNotifier>(
      new SystemdNotifier(fd, socket, address, length, watchdog));
}

SystemdNotifier::SystemdNotifier(int fd, std::string socket, const sockaddr_un& address,
                                 socklen_t length, absl::Duration watchdog)
    : fd_(fd), socket_(std::move(socket)), address_(address), length_(length),
      watchdog_(watchdog) {}

SystemdNotifier::~SystemdNotifier() { ::close(fd_); }

absl::Status SystemdNotifier::Notify(std::string_view state) {
  ssize_t sent;
  do {
    // Sent to the address each time, not connected once: systemd re-creates its socket
    // when it re-executes itself (daemon-reexec).
    sent = ::sendto(fd_, state.data(), state.size(), MSG_NOSIGNAL,
                    reinterpret_cast<const sockaddr*>(&address_), length_);
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

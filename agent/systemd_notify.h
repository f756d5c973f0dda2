// The agent's side of systemd's service notification protocol (sd_notify(3)), for a
// unit with Type=notify and WatchdogSec= (deploy/systemd/kvagentd.service): READY=1
// once every door serves, STOPPING=1 when shutdown begins, STATUS= lines for
// `systemctl status`, and WATCHDOG=1 while kvagent.liveness holds (HealthMonitor's
// rounds), so that systemd restarts an agent whose UCX worker stalled or whose receive
// queue stopped draining, as a Kubernetes liveness probe does on the health door.
//
// The protocol, as systemd documents it: each message is one datagram of "KEY=value"
// lines sent to the AF_UNIX socket named by $NOTIFY_SOCKET (a path, or "@name" in the
// abstract namespace). $WATCHDOG_USEC asks for a WATCHDOG=1 at least that often; when
// $WATCHDOG_PID is set, the request is for that process only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/session_wire.h"

namespace kvagent::agent {

class SystemdNotifier {
 public:
  // From this process's environment: nullptr without $NOTIFY_SOCKET (not started by
  // systemd with Type=notify), or when it names no usable address (logged as a warning
  // naming the variable, the cause and the fix). The variables are then unset, so
  // that a process this one starts does not notify in its name.
  static std::unique_ptr<SystemdNotifier> FromEnvironment();
  // `socket` as $NOTIFY_SOCKET spells it; `watchdog` zero for none. Refused, with the
  // reason, when `socket` is neither an absolute path nor "@name", or is too long.
  static absl::StatusOr<std::unique_ptr<SystemdNotifier>> Open(const std::string& socket,
                                                              absl::Duration watchdog);
  // The watchdog period asked for by $WATCHDOG_USEC and $WATCHDOG_PID (zero when none
  // was, or it was for another process); `error` gets why a value was ignored.
  static absl::Duration WatchdogFromEnvironment(std::string* error);

  ~SystemdNotifier();
  SystemdNotifier(const SystemdNotifier&) = delete;
  SystemdNotifier& operator=(const SystemdNotifier&) = delete;

  const std::string& socket() const { return socket_; }
  absl::Duration watchdog() const { return watchdog_; }

  // Sends `state` ("KEY=value" lines) as one datagram. Any thread. A failure is
  // returned, and logged the first time only: systemd going away does not stop the
  // agent.
  absl::Status Notify(std::string_view state);
  // One health verdict (HealthMonitor::SetWatchdog): a STATUS= line whenever `status`
  // changed since the last one sent, and WATCHDOG=1 when `live` and a watchdog was
  // asked for. Not live: no WATCHDOG=1, so that systemd restarts the agent once
  // WatchdogSec passes without one.
  void Health(bool live, const std::string& status);

 private:
  SystemdNotifier(int fd, std::string socket, const client::UnixAddress& address,
                  absl::Duration watchdog);

  const int fd_;
  const std::string socket_;
  const client::UnixAddress address_;
  const absl::Duration watchdog_;
  absl::Mutex mu_;
  std::string last_status_ ABSL_GUARDED_BY(mu_);
  bool failure_logged_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvagent::agent

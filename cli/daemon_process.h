// DaemonProcess starts a real kvagentd as a child process with its local door on a
// Unix socket (and, when asked, a network door on a port chosen by the kernel:
// --listen HOST:0 with mutual TLS, or --insecure-listen), optionally through a
// wrapper command (`ip netns exec NAME`), and stops it. Used by `kvagentctl
// demo`/`bench`/`bench-peers` and by the integration and fault tests; the one launcher
// of kvagentd (through SpawnChild, cli/child_process.h).
#pragma once

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agent/tls.h"

namespace kvagent::cli {

enum class NetworkDoor { kNone, kTls, kInsecure };

struct DaemonOptions {
  std::string binary;                       // path of kvagentd
  std::string name;
  std::string work_dir;                     // port file and log go here
  std::vector<std::string> extra_args;
  std::map<std::string, std::string> env;   // added to the inherited environment
  uint32_t start_timeout_ms = 15000;
  // The local door's socket; empty: WORK_DIR/NAME.sock, or, when that path is too long
  // for a Unix socket, /tmp/kva-<hash of WORK_DIR>/NAME.sock (the same on a restart).
  // Once the agent has exited (Stop, Kill), what it left there goes: its sockets that
  // nothing listens on any more (a killed agent does not unlink them), and the folder
  // when nothing else is in it.
  std::string local_socket;
  // A network door on LISTEN_HOST:0: kTls needs `tls` (this agent's certificate).
  NetworkDoor network = NetworkDoor::kNone;
  agent::TlsFiles tls;
  // An agent in another network namespace listens on 0.0.0.0 and is reached from
  // here at `connect_host`.
  std::string listen_host = "127.0.0.1";
  std::string connect_host;  // the host address() names; empty: listen_host
  // Runs `prefix... kvagentd ARGS` instead of kvagentd itself; prefix[0] is an absolute
  // path. It must exec kvagentd in place (as `ip netns exec NAME` does), so pid() and
  // the signals stay the daemon's.
  std::vector<std::string> command_prefix;
  // The CPUs the agent, every thread of it, may run on (as under `taskset -c`; its
  // --worker-cpus must be among them); empty: those of the thread that starts it.
  std::vector<int> cpus;
};

class DaemonProcess {
 public:
  static absl::StatusOr<DaemonProcess> Start(const DaemonOptions& options);
  DaemonProcess() = default;
  DaemonProcess(DaemonProcess&& other) noexcept;
  DaemonProcess& operator=(DaemonProcess&& other) noexcept;
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;
  ~DaemonProcess();  // SIGTERM, then SIGKILL after 3 s, if still running

  // The local door, "unix:PATH": clients and same-host peers use it.
  std::string address() const { return "unix:" + local_socket_; }
  const std::string& local_socket() const { return local_socket_; }
  // The network door, "HOST:PORT" (empty without one).
  std::string network_address() const;
  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }
  // SIGTERM, then waits up to `timeout_ms`; returns the exit code (or 128+signal).
  absl::StatusOr<int> Stop(uint32_t timeout_ms = 10000);
  void Kill();

 private:
  // After the agent exited: removes the /tmp/kva-* socket folder's leftovers of it.
  void CleanUpSocketDir();

  pid_t pid_ = -1;
  int port_ = 0;
  std::string local_socket_;
  std::string socket_dir_;  // the /tmp/kva-* folder the socket was put in; else empty
  std::string host_ = "127.0.0.1";
  std::string log_path_;
};

// Finds kvagentd: $KVAGENTD, next to `argv0` in Bazel runfiles, ../agent/kvagentd
// beside argv0, or $TEST_SRCDIR/kvagent/agent/kvagentd.
absl::StatusOr<std::string> FindKvagentd(const std::string& argv0);

}  // namespace kvagent::cli

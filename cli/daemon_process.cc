#include "cli/daemon_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "agent/unix_listener.h"
#include "base/format.h"
#include "cli/child_process.h"
#include "fmt/format.h"

namespace kvagent::cli {
namespace {

bool IsExecutable(const std::string& path) { return access(path.c_str(), X_OK) == 0; }

// WORK_DIR/NAME.sock when it fits a Unix socket path with ".session" appended, else
// a short directory under /tmp named after a hash of WORK_DIR (stable across restarts).
absl::StatusOr<std::string> DefaultSocketPath(const std::string& work_dir, const std::string& name) {
  std::string path = fmt::format("{}/{}.sock", work_dir, name);
  if (path.size() + 8 < 100) return path;
  const std::string dir =
      fmt::format("/tmp/kva-{:x}", std::hash<std::string>{}(work_dir) & 0xffffffffffull);
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::FailedPreconditionError(
        fmt::format("cannot create {} for agent sockets: {}", dir, std::strerror(errno)));
  }
  return fmt::format("{}/{}.sock", dir, name);
}

std::string Tail(const std::string& path, size_t bytes) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return text.size() > bytes ? text.substr(text.size() - bytes) : text;
}

}  // namespace

absl::StatusOr<std::string> FindKvagentd(const std::string& argv0) {
  if (const char* env = std::getenv("KVAGENTD"); env && *env) {
    if (IsExecutable(env)) return std::string(env);
    return absl::NotFoundError(fmt::format("$KVAGENTD={} is not an executable file", env));
  }
  std::vector<std::string> candidates;
  if (const char* srcdir = std::getenv("TEST_SRCDIR")) {
    candidates.push_back(fmt::format("{}/kvagent/agent/kvagentd", srcdir));
  }
  if (const char* runfiles = std::getenv("RUNFILES_DIR")) {
    candidates.push_back(fmt::format("{}/kvagent/agent/kvagentd", runfiles));
  }
  candidates.push_back(argv0 + ".runfiles/kvagent/agent/kvagentd");
  const std::string dir = argv0.substr(0, argv0.rfind('/') == std::string::npos ? 0 : argv0.rfind('/'));
  candidates.push_back((dir.empty() ? std::string(".") : dir) + "/../agent/kvagentd");
  candidates.push_back((dir.empty() ? std::string(".") : dir) + "/kvagentd");
  for (const auto& c : candidates) {
    if (IsExecutable(c)) return c;
  }
  return absl::NotFoundError(fmt::format(
      "kvagentd not found (looked at {}); build it with `bazel build //agent:kvagentd` and "
      "pass --kvagentd PATH or set KVAGENTD",
      fmt::join(candidates, ", ")));
}

absl::StatusOr<DaemonProcess> DaemonProcess::Start(const DaemonOptions& options) {
  if (!IsExecutable(options.binary)) {
    return absl::NotFoundError(fmt::format(
        "agent '{}': kvagentd '{}' is not an executable file; build it with `bazel build "
        "//agent:kvagentd` and pass its path (--kvagentd PATH or $KVAGENTD)",
        options.name, options.binary));
  }
  const std::string port_file = fmt::format("{}/{}.port", options.work_dir, options.name);
  const std::string log_path = fmt::format("{}/{}.log", options.work_dir, options.name);
  ::unlink(port_file.c_str());
  if (!options.command_prefix.empty() && !IsExecutable(options.command_prefix[0])) {
    return absl::NotFoundError(fmt::format(
        "agent '{}': wrapper command '{}' is not an executable file; give its absolute path",
        options.name, options.command_prefix[0]));
  }
  std::string local_socket = options.local_socket;
  std::string socket_dir;
  if (local_socket.empty()) {
    auto derived = DefaultSocketPath(options.work_dir, options.name);
    if (!derived.ok()) return derived.status();
    local_socket = *std::move(derived);
    if (absl::StartsWith(local_socket, "/tmp/kva-")) {
      socket_dir = local_socket.substr(0, local_socket.rfind('/'));
    }
  }
  std::vector<std::string> args = options.command_prefix;
  for (std::string a : {options.binary, std::string("--name"), options.name,
                        std::string("--local-socket"), local_socket,
                        std::string("--port-file"), port_file}) {
    args.push_back(std::move(a));
  }
  if (options.network == NetworkDoor::kTls) {
    if (options.tls.empty()) {
      return absl::InvalidArgumentError(fmt::format(
          "agent '{}': a TLS network door needs its certificate, key and CA", options.name));
    }
    for (std::string a : {std::string("--listen"), options.listen_host + ":0",
                          std::string("--tls-cert"), options.tls.cert, std::string("--tls-key"),
                          options.tls.key, std::string("--tls-ca"), options.tls.ca}) {
      args.push_back(std::move(a));
    }
  } else if (options.network == NetworkDoor::kInsecure) {
    args.push_back("--insecure-listen");
    args.push_back(options.listen_host + ":0");
  } else if (!options.tls.empty()) {
    // Reaching network peers needs the certificate even without a door of our own.
    for (std::string a : {std::string("--tls-cert"), options.tls.cert, std::string("--tls-key"),
                          options.tls.key, std::string("--tls-ca"), options.tls.ca}) {
      args.push_back(std::move(a));
    }
  }
  args.insert(args.end(), options.extra_args.begin(), options.extra_args.end());
  const int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) {
    return absl::FailedPreconditionError(
        fmt::format("cannot create {} for agent '{}'; check the work directory", log_path, options.name));
  }
  auto pid = SpawnChild(args, log_fd, options.env, options.cpus);
  if (!pid.ok()) {
    ::close(log_fd);
    return absl::Status(pid.status().code(),
                        fmt::format("agent '{}': {}", options.name, pid.status().message()));
  }
  ::close(log_fd);
  DaemonProcess process;
  process.pid_ = *pid;
  process.log_path_ = log_path;
  process.host_ = options.connect_host.empty() ? options.listen_host : options.connect_host;
  process.local_socket_ = local_socket;
  process.socket_dir_ = socket_dir;
  const bool want_port = options.network != NetworkDoor::kNone;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(options.start_timeout_ms);
  while (std::chrono::steady_clock::now() < until) {
    std::ifstream in(port_file);
    int port = 0;
    // The port file is written once every door serves (0: no network door).
    if (in >> port && (port > 0 || !want_port)) {
      process.port_ = port;
      return process;
    }
    int status = 0;
    if (waitpid(*pid, &status, WNOHANG) == *pid) {
      process.pid_ = -1;
      process.CleanUpSocketDir();
      return absl::UnavailableError(fmt::format("agent '{}' exited during start-up: {}",
                                                options.name, Tail(log_path, 2000)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  process.Kill();
  return absl::DeadlineExceededError(fmt::format(
      "agent '{}' wrote no port file within {} ms: {}", options.name, options.start_timeout_ms,
      Tail(log_path, 2000)));
}

DaemonProcess::DaemonProcess(DaemonProcess&& other) noexcept
    : pid_(other.pid_),
      port_(other.port_),
      local_socket_(std::move(other.local_socket_)),
      socket_dir_(std::move(other.socket_dir_)),
      host_(std::move(other.host_)),
      log_path_(std::move(other.log_path_)) {
  other.pid_ = -1;
  other.socket_dir_.clear();
}

DaemonProcess& DaemonProcess::operator=(DaemonProcess&& other) noexcept {
  if (this != &other) {
    Kill();
    pid_ = other.pid_;
    port_ = other.port_;
    local_socket_ = std::move(other.local_socket_);
    socket_dir_ = std::move(other.socket_dir_);
    host_ = std::move(other.host_);
    log_path_ = std::move(other.log_path_);
    other.pid_ = -1;
    other.socket_dir_.clear();
  }
  return *this;
}

// Graceful first, so the agent unlinks the shared memory it created.
DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) (void)Stop(3000);
}

std::string DaemonProcess::network_address() const {
  return port_ > 0 ? fmt::format("{}:{}", host_, port_) : std::string();
}

absl::StatusOr<int> DaemonProcess::Stop(uint32_t timeout_ms) {
  if (pid_ <= 0) return absl::FailedPreconditionError("agent process is not running");
  ::kill(pid_, SIGTERM);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < until) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      CleanUpSocketDir();
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      return 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  Kill();
  return absl::DeadlineExceededError(
      fmt::format("agent did not exit within {} ms of SIGTERM; killed it", timeout_ms));
}

void DaemonProcess::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  CleanUpSocketDir();
}

void DaemonProcess::CleanUpSocketDir() {
  if (socket_dir_.empty()) return;
  // The agent's doors beside its local socket (sessions, liveness); a restarted agent
  // of the same name that already listens keeps them.
  for (const char* suffix : {"", ".session", ".live"}) {
    // Only a socket nobody answers on goes; a live one or anything else is left (the
    // refusal is not this harness's to report).
    (void)agent::RemoveStaleUnixSocket(local_socket_ + suffix);
  }
  ::rmdir(socket_dir_.c_str());  // only when empty: the other agents' sockets stay
}

}  // namespace kvagent::cli

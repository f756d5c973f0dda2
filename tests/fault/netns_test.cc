// Two real kvagentd processes, each in a network namespace this test makes, joined by
// a veth "data link" that carries their gRPC polls and UCX (tcp only, no shared
// memory). The test cuts that link (`ip link set down`) under a large WRITE and brings
// it back, and tries netem delay + loss. It drives each agent over a second veth from
// this (root) namespace, which the cut does not touch. Needs root; skips otherwise.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "base/format.h"
#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/cert_authority.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"
#include "tests/security/process_peek.h"
#include "tests/unit/catch_main.h"

namespace kvagent::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kUnavailable = static_cast<int>(absl::StatusCode::kUnavailable);

// iproute2's binaries by absolute path: Bazel's strict test PATH lacks /usr/sbin.
std::string FindTool(const std::string& name) {
  for (const char* dir : {"/usr/sbin/", "/sbin/", "/usr/bin/", "/bin/"}) {
    const std::string path = dir + name;
    if (::access(path.c_str(), X_OK) == 0) return path;
  }
  return "";
}

struct CommandResult {
  int rc = -1;
  std::string output;  // stdout and stderr
};

// Runs argv (no shell) and captures its output.
CommandResult Run(const std::vector<std::string>& argv) {
  CommandResult result;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    result.output = fmt::format("pipe failed: {}", std::strerror(errno));
    return result;
  }
  std::vector<char*> args;
  std::vector<std::string> copy = argv;
  for (auto& a : copy) args.push_back(a.data());
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  char buffer[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buffer, sizeof(buffer))) > 0) result.output.append(buffer, n);
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  result.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  while (!result.output.empty() && result.output.back() == '\n') result.output.pop_back();
  return result;
}

// The network of one test: namespaces kvt<pid>a (prefill) and kvt<pid>b (decode),
// the data link kvt<pid>d (a, 10.77.0.1) <-> kvt<pid>e (b, 10.77.0.2), and a control
// link from this namespace into each (kvt<pid>ra/rb here, kvt<pid>ca/cb there) on a
// /30 picked from the pid, since this namespace is shared with parallel tests.
// Everything is removed on destruction (deleting a namespace deletes its veths and
// so their peers here).
class NetnsLab {
 public:
  // Returns null with `skip` set when this machine cannot make the namespaces.
  static std::unique_ptr<NetnsLab> Make(std::string* skip) {
    if (::geteuid() != 0) {
      *skip = "needs root to create network namespaces (ip netns add); run the test as root";
      return nullptr;
    }
    const std::string ip = FindTool("ip");
    if (ip.empty()) {
      *skip = "iproute2's `ip` is not installed (apt-get install iproute2)";
      return nullptr;
    }
    RemoveStale(ip);
    auto lab = std::unique_ptr<NetnsLab>(new NetnsLab(ip));
    if (auto error = lab->Build(); !error.empty()) {
      *skip = "cannot build the test network: " + error;
      return nullptr;
    }
    return lab;
  }

  NetnsLab(const NetnsLab&) = delete;
  NetnsLab& operator=(const NetnsLab&) = delete;

  ~NetnsLab() {
    for (const auto& ns : made_namespaces_) Run({ip_, "netns", "del", ns});
    for (const auto& link : made_root_links_) Run({ip_, "link", "del", link});
  }

  const std::string& ip() const { return ip_; }
  std::string ns(int side) const { return fmt::format("kvt{}{}", pid_, side == 0 ? 'a' : 'b'); }
  std::string data_dev(int side) const { return fmt::format("kvt{}{}", pid_, side == 0 ? 'd' : 'e'); }
  std::string data_ip(int side) const { return side == 0 ? "10.77.0.1" : "10.77.0.2"; }
  // This namespace's and the agent's end of side's control link.
  std::string control_ip(int side, bool agent_end) const {
    const uint32_t block = ((static_cast<uint32_t>(pid_) % 8192) * 2 + side) * 4;
    return fmt::format("10.201.{}.{}", block / 256, block % 256 + (agent_end ? 2 : 1));
  }

  // `ip -n NS ARGS...` in side's namespace; returns the failure text, empty on success.
  std::string IpIn(int side, std::vector<std::string> args) const {
    args.insert(args.begin(), {ip_, "-n", ns(side)});
    return Check(args);
  }
  CommandResult ExecIn(int side, std::vector<std::string> argv) const {
    argv.insert(argv.begin(), {ip_, "netns", "exec", ns(side)});
    return Run(argv);
  }

  // A third host, no agent's: namespace kvt<pid>m, linked to decode's namespace by
  // kvt<pid>s (here, 10.78.0.1) <-> kvt<pid>t (decode's, 10.78.0.2), routed to decode's
  // data address through it. Returns the failure text, empty on success.
  std::string stranger_ns() const { return fmt::format("kvt{}m", pid_); }
  std::string stranger_dev() const { return fmt::format("kvt{}s", pid_); }
  std::string AddStranger() {
    const std::string near = fmt::format("kvt{}t", pid_);
    if (auto e = Check({ip_, "netns", "add", stranger_ns()}); !e.empty()) return e;
    made_namespaces_.push_back(stranger_ns());
    if (auto e = Check({ip_, "link", "add", stranger_dev(), "type", "veth", "peer", "name", near});
        !e.empty()) {
      return e;
    }
    made_root_links_.push_back(stranger_dev());
    for (const auto& [dev, where, address] :
         {std::tuple{stranger_dev(), stranger_ns(), std::string("10.78.0.1/24")},
          std::tuple{near, ns(1), std::string("10.78.0.2/24")}}) {
      if (auto e = Check({ip_, "link", "set", dev, "netns", where}); !e.empty()) return e;
      if (auto e = Check({ip_, "-n", where, "addr", "add", address, "dev", dev}); !e.empty()) {
        return e;
      }
      if (auto e = Check({ip_, "-n", where, "link", "set", dev, "up"}); !e.empty()) return e;
    }
    return Check({ip_, "-n", stranger_ns(), "route", "add", data_ip(1) + "/32", "via", "10.78.0.2"});
  }
  CommandResult ExecInStranger(std::vector<std::string> argv) const {
    argv.insert(argv.begin(), {ip_, "netns", "exec", stranger_ns()});
    return Run(argv);
  }

 private:
  explicit NetnsLab(std::string ip) : ip_(std::move(ip)), pid_(::getpid()) {}

  static std::string Check(const std::vector<std::string>& argv) {
    CommandResult r = Run(argv);
    if (r.rc == 0) return "";
    std::ostringstream cmd;
    for (size_t i = 0; i < argv.size(); ++i) cmd << (i ? " " : "") << argv[i];
    return fmt::format("`{}` exited {}: {}", cmd.str(), r.rc, r.output);
  }

  std::string Build() {
    for (int side : {0, 1}) {
      if (auto e = Check({ip_, "netns", "add", ns(side)}); !e.empty()) return e;
      made_namespaces_.push_back(ns(side));
      if (auto e = IpIn(side, {"link", "set", "lo", "up"}); !e.empty()) return e;
    }
    // The data link, created here and moved into the namespaces.
    if (auto e = Check({ip_, "link", "add", data_dev(0), "type", "veth", "peer", "name", data_dev(1)});
        !e.empty()) {
      return e;
    }
    made_root_links_.push_back(data_dev(0));
    for (int side : {0, 1}) {
      if (auto e = Check({ip_, "link", "set", data_dev(side), "netns", ns(side)}); !e.empty()) return e;
      if (auto e = IpIn(side, {"addr", "add", data_ip(side) + "/24", "dev", data_dev(side)}); !e.empty()) {
        return e;
      }
      if (auto e = IpIn(side, {"link", "set", data_dev(side), "up"}); !e.empty()) return e;
    }
    // The control links: one end stays here.
    for (int side : {0, 1}) {
      const std::string here = fmt::format("kvt{}r{}", pid_, side == 0 ? 'a' : 'b');
      const std::string there = fmt::format("kvt{}c{}", pid_, side == 0 ? 'a' : 'b');
      if (auto e = Check({ip_, "link", "add", here, "type", "veth", "peer", "name", there}); !e.empty()) {
        return e;
      }
      made_root_links_.push_back(here);
      if (auto e = Check({ip_, "link", "set", there, "netns", ns(side)}); !e.empty()) return e;
      if (auto e = Check({ip_, "addr", "add", control_ip(side, false) + "/30", "dev", here}); !e.empty()) {
        return e;
      }
      if (auto e = Check({ip_, "link", "set", here, "up"}); !e.empty()) return e;
      if (auto e = IpIn(side, {"addr", "add", control_ip(side, true) + "/30", "dev", there}); !e.empty()) {
        return e;
      }
      if (auto e = IpIn(side, {"link", "set", there, "up"}); !e.empty()) return e;
    }
    return "";
  }

  // Namespaces and root-side links of earlier runs that crashed: their pid is gone
  // and the namespace is older than this process. A live pid is never touched.
  static void RemoveStale(const std::string& ip) {
    static const std::regex kName("^kvt([0-9]+)[a-z]{1,2}$");
    struct stat self;
    const bool have_start = ::stat(fmt::format("/proc/{}", ::getpid()).c_str(), &self) == 0;
    auto stale = [&](const std::string& name, const std::string& file) {
      std::smatch m;
      if (!std::regex_match(name, m, kName)) return false;
      const long pid = std::stol(m[1].str());
      if (pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) return false;
      struct stat st;
      if (!file.empty() && have_start && ::stat(file.c_str(), &st) == 0 &&
          st.st_mtime > self.st_mtime) {
        return false;
      }
      return true;
    };
    std::istringstream namespaces(Run({ip, "netns", "list"}).output);
    for (std::string line; std::getline(namespaces, line);) {
      const std::string name = line.substr(0, line.find(' '));
      if (stale(name, "/run/netns/" + name)) {
        std::printf("removing stale network namespace %s of a crashed run\n", name.c_str());
        Run({ip, "netns", "del", name});
      }
    }
    std::istringstream links(Run({ip, "-o", "link", "show"}).output);
    for (std::string line; std::getline(links, line);) {
      // "7: kvt123ra@kvt123ca: <...>"
      const size_t start = line.find(": ");
      if (start == std::string::npos) continue;
      std::string name = line.substr(start + 2);
      name = name.substr(0, name.find_first_of("@:"));
      if (stale(name, "")) Run({ip, "link", "del", name});
    }
  }

  std::string ip_;
  pid_t pid_;
  std::vector<std::string> made_namespaces_;
  std::vector<std::string> made_root_links_;
};

template <typename T>
T Require(absl::StatusOr<T> value, const std::string& what) {
  INFO(what << ": " << value.status().ToString());
  REQUIRE(value.ok());
  return *std::move(value);
}

// "prefill" in namespace a and "decode" in namespace b, each driven over its control
// link; prefill connected to decode at decode's data-link address, so the polls and
// the UCX endpoint both cross the data link.
struct NetnsPair {
  std::unique_ptr<NetnsLab> lab;
  std::string work_dir;
  cli::DaemonProcess prefill_process, decode_process;
  std::unique_ptr<cli::AgentClient> prefill, decode;
  cli::KvPool prefill_pool, decode_pool;
  std::string error_mode;

  bool PagesEqual(uint64_t src, uint64_t dst) const {
    for (uint32_t r = 0; r < prefill_pool.regions(); ++r) {
      if (std::memcmp(prefill_pool.Page(r, src), decode_pool.Page(r, dst),
                      prefill_pool.shape.page_bytes) != 0) {
        return false;
      }
    }
    return true;
  }
  std::string DecodePeerState() {
    auto peers = Require(prefill->Peers(), "listing prefill's peers");
    for (const auto& p : peers.peers()) {
      if (p.name() == "decode") return p.state();
    }
    return "absent";
  }
};

// The agents of a pair, started with their pools, not yet connected (StartPair
// connects them). Null with `skip` set when the network cannot be made here.
std::unique_ptr<NetnsPair> StartAgents(std::string* skip, const cli::KvPoolShape& shape,
                                       const std::string& error_mode,
                                       const std::function<std::string(NetnsLab&)>& precheck,
                                       const std::vector<std::string>& more_args) {
  auto pair = std::make_unique<NetnsPair>();
  pair->lab = NetnsLab::Make(skip);
  if (!pair->lab) return nullptr;
  NetnsLab& lab = *pair->lab;
  // What the case needs of the network beyond the namespaces, before any agent starts.
  if (precheck) {
    *skip = precheck(lab);
    if (!skip->empty()) return nullptr;
  }
  pair->error_mode = error_mode;
  const char* tmp = std::getenv("TEST_TMPDIR");
  static int counter = 0;
  pair->work_dir = fmt::format("{}/netns.{}.{}", tmp ? tmp : "/tmp", ::getpid(), counter++);
  std::filesystem::create_directories(pair->work_dir);
  const std::string binary = Require(cli::FindKvagentd(""), "finding kvagentd");
  // The agents meet over their network doors: mutual TLS with a throwaway cluster CA.
  auto ca = Require(cli::CertAuthority::Create(pair->work_dir, "cluster"), "making a CA");
  for (int side : {0, 1}) {
    cli::DaemonOptions d;
    d.binary = binary;
    d.name = side == 0 ? "prefill" : "decode";
    d.work_dir = pair->work_dir;
    const auto files = Require(ca.Issue(d.name), "issuing a certificate");
    d.network = cli::NetworkDoor::kTls;
    d.tls = agent::TlsFiles{files.cert, files.key, files.ca};
    d.command_prefix = {lab.ip(), "netns", "exec", lab.ns(side)};
    d.listen_host = "0.0.0.0";
    d.connect_host = lab.control_ip(side, true);
    // All data through UCX over tcp on the data link: no shared memory between the
    // namespaces (they share /dev/shm and the boot id, so the agents would see one host).
    d.extra_args = {"--shm-direct", "off", "--ucx-error-mode", error_mode};
    d.extra_args.insert(d.extra_args.end(), more_args.begin(), more_args.end());
    d.env = {{"UCX_TLS", "tcp,self"}, {"UCX_NET_DEVICES", lab.data_dev(side)}};
    (side == 0 ? pair->prefill_process : pair->decode_process) =
        Require(cli::DaemonProcess::Start(d), "starting " + d.name);
  }
  pair->prefill = std::make_unique<cli::AgentClient>(pair->prefill_process.address());
  pair->decode = std::make_unique<cli::AgentClient>(pair->decode_process.address());
  pair->prefill_pool = Require(cli::CreateKvPool(*pair->prefill, "prefill", shape), "prefill pool");
  pair->decode_pool = Require(cli::CreateKvPool(*pair->decode, "decode", shape), "decode pool");
  return pair;
}

// decode's network door at its data-link address (or `connect_ip`).
std::string DecodeAddress(const NetnsPair& pair, const std::string& connect_ip = "") {
  return fmt::format("{}:{}", connect_ip.empty() ? pair.lab->data_ip(1) : connect_ip,
                     pair.decode_process.port());
}

// Returns null with `skip` set when the network cannot be made here.
// `error_mode` is kvagentd's flag; `expected_mode` what the endpoint must get (auto
// picks peer: the agents reach each other over their mutual-TLS network doors, so
// each is another host to the other, although the namespaces share the boot id).
std::unique_ptr<NetnsPair> StartPair(std::string* skip, const cli::KvPoolShape& shape,
                                     const std::string& error_mode,
                                     const std::string& expected_mode,
                                     const std::function<std::string(NetnsLab&)>& precheck = {},
                                     const std::string& connect_ip = "",
                                     const std::vector<std::string>& more_args = {}) {
  auto pair = StartAgents(skip, shape, error_mode, precheck, more_args);
  if (!pair) return nullptr;
  NetnsLab& lab = *pair->lab;
  const std::string decode_data_address = DecodeAddress(*pair, connect_ip);
  auto peer = Require(pair->prefill->Connect(decode_data_address), "connecting prefill to decode");
  INFO(peer.DebugString());
  REQUIRE(peer.address() == decode_data_address);
  REQUIRE(peer.data_path() == "ucx-am");  // tcp: no native RMA
  REQUIRE_THAT(peer.transports(), Catch::Contains("tcp"));
  REQUIRE(peer.error_mode() == expected_mode);
  std::printf("netns pair (%s error mode): prefill in %s, decode in %s, data link %s, "
              "UCX transports %s\n",
              error_mode.c_str(), lab.ns(0).c_str(), lab.ns(1).c_str(), lab.data_dev(0).c_str(),
              peer.transports().c_str());
  for (uint32_t r = 0; r < pair->prefill_pool.regions(); ++r) {
    for (uint64_t p = 0; p < shape.pages; ++p) {
      cli::FillPage(pair->prefill_pool.Page(r, p), shape.page_bytes, 11, r, p);
    }
  }
  std::memset(pair->decode_pool.mapping.data(), 0xEE, pair->decode_pool.bytes());
  return pair;
}

// Polls the transfer every 10 ms until it ends (or `timeout` passes).
v1::TransferState WaitEnd(cli::AgentClient& client, const std::string& id,
                          std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto until = Clock::now() + timeout;
  v1::TransferState state;
  while (Clock::now() < until) {
    state = Require(client.Get(id), "getting " + id);
    if (state.phase() != v1::PENDING && state.phase() != v1::TRANSFERRING) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return state;
}

std::vector<uint64_t> Range(uint64_t from, uint64_t to) {
  std::vector<uint64_t> v;
  for (uint64_t i = from; i < to; ++i) v.push_back(i);
  return v;
}

// The decode pool (this process's mapping) after the failure, compared later.
std::vector<uint8_t> Snapshot(const cli::KvPool& pool) {
  const auto* p = static_cast<const uint8_t*>(pool.mapping.data());
  return std::vector<uint8_t>(p, p + pool.bytes());
}

// Pages of the decode pool that are no longer all 0xEE.
uint64_t TouchedPages(const cli::KvPool& pool) {
  uint64_t touched = 0;
  for (uint32_t r = 0; r < pool.regions(); ++r) {
    for (uint64_t p = 0; p < pool.shape.pages; ++p) {
      const uint8_t* page = pool.Page(r, p);
      for (uint64_t b = 0; b < pool.shape.page_bytes; ++b) {
        if (page[b] != 0xEE) {
          ++touched;
          break;
        }
      }
    }
  }
  return touched;
}

bool Unchanged(const std::vector<uint8_t>& before, const cli::KvPool& pool) {
  return std::memcmp(before.data(), pool.mapping.data(), before.size()) == 0;
}

// The engine posts at most 64 MiB per batch, then flushes before the next.
constexpr uint64_t kBatchBytes = 64ull << 20;

void LinkCutCase(const std::string& error_mode, const std::string& expected_mode) {
  // 128 MiB in one WRITE (two batches): over tcp on a veth it is still moving when cut.
  cli::KvPoolShape shape;
  shape.layers = 8;
  shape.pages = 128;
  shape.page_bytes = 64 << 10;
  std::string skip;
  auto pair = StartPair(&skip, shape, error_mode, expected_mode);
  if (!pair) KVAGENT_SKIP(skip);
  NetnsLab& lab = *pair->lab;
  const std::string label = fmt::format("link cut (--ucx-error-mode {})", error_mode);

  // A first transfer over the healthy link: the path works.
  {
    auto warm = pair->prefill->Submit(KvWrite("warm", {0}, {0}));
    INFO(warm.status().ToString());
    REQUIRE(warm.ok());
    auto done = Require(pair->prefill->WaitTransfer("warm", 20000), "waiting for warm");
    INFO(done.DebugString());
    REQUIRE(done.phase() == v1::COMPLETED);
    REQUIRE(pair->PagesEqual(0, 0));
    std::memset(pair->decode_pool.mapping.data(), 0xEE, pair->decode_pool.bytes());
  }

  const auto all = Range(0, shape.pages);
  // The cut must land mid-transfer. The ip command usually takes a few ms, but on a
  // loaded machine it took 183 ms, when the whole 128 MiB had moved: then the link
  // comes back and another transfer is cut (at most three).
  std::string big = "big";
  v1::TransferState failed;
  int64_t cut_ms = 0, fail_ms = 0;
  for (int attempt = 1;; ++attempt) {
    big = attempt == 1 ? "big" : fmt::format("big-{}", attempt);
    std::memset(pair->decode_pool.mapping.data(), 0xEE, pair->decode_pool.bytes());
    auto submitted = pair->prefill->Submit(KvWrite(big, all, all));
    INFO(submitted.status().ToString());
    REQUIRE(submitted.ok());
    // Once its first batch is posted (TRANSFERRING) and moving: no fixed sleep that a
    // fast machine could outrun.
    {
      absl::Status moving = WaitTransferring(*pair->prefill, big);
      INFO(moving.ToString());
      REQUIRE(moving.ok());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const auto cut = Clock::now();
    REQUIRE(lab.IpIn(0, {"link", "set", lab.data_dev(0), "down"}) == "");
    cut_ms = MillisSince(cut);
    failed = WaitEnd(*pair->prefill, big);
    fail_ms = MillisSince(cut);
    if (failed.phase() != v1::COMPLETED || attempt == 3) break;
    std::printf("%s: the cut came after the whole transfer had moved (the ip command took "
                "%lld ms); the link comes back and another transfer is cut\n",
                label.c_str(), static_cast<long long>(cut_ms));
    REQUIRE(lab.IpIn(0, {"link", "set", lab.data_dev(0), "up"}) == "");
    const auto up = Clock::now();
    while (pair->DecodePeerState() != "connected" && MillisSince(up) < 10000) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    REQUIRE(pair->DecodePeerState() == "connected");
  }
  const uint64_t landed_at_failure = TouchedPages(pair->decode_pool);
  INFO(failed.DebugString());
  std::printf("%s: data link down (the ip command took %lld ms) -> transfer failed in %lld ms; "
              "%llu of %llu bytes confirmed, %llu of %llu pages landed, drained %d: %s\n",
              label.c_str(), static_cast<long long>(cut_ms), static_cast<long long>(fail_ms),
              static_cast<unsigned long long>(failed.bytes_done()),
              static_cast<unsigned long long>(failed.bytes_total()),
              static_cast<unsigned long long>(landed_at_failure),
              static_cast<unsigned long long>(pair->decode_pool.regions() * shape.pages),
              failed.drained(), failed.error_message().c_str());
  REQUIRE(failed.phase() != v1::COMPLETED);  // three times: make the transfer bigger
  REQUIRE(failed.phase() == v1::FAILED);
  CHECK(failed.error_code() == kUnavailable);
  CHECK_THAT(failed.error_message(), Catch::Contains("'" + big + "'") &&
                                         Catch::Contains("peer 'decode'") &&
                                         Catch::Contains("stopped answering"));
  CHECK(fail_ms <= 2000);

  // A new submit while the link is down is refused at once.
  {
    const auto start = Clock::now();
    auto refused = pair->prefill->Submit(KvWrite("while-down", {1}, {1}));
    const int64_t ms = MillisSince(start);
    std::printf("%s: submit while the link is down refused in %lld ms\n", label.c_str(),
                static_cast<long long>(ms));
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kUnavailable);
    CHECK_THAT(std::string(refused.status().message()),
               Catch::Contains("peer 'decode'") && Catch::Contains("unreachable"));
    CHECK(ms < 500);  // at once: one round trip, no timeout (see peer_fault_test)
  }
  CHECK(pair->DecodePeerState() == "unreachable");

  // Nothing lands while the link is down.
  const std::vector<uint8_t> after_failure = Snapshot(pair->decode_pool);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  CHECK(Unchanged(after_failure, pair->decode_pool));

  // Link back: the peer answers again without restarting anyone.
  const auto up = Clock::now();
  REQUIRE(lab.IpIn(0, {"link", "set", lab.data_dev(0), "up"}) == "");
  std::string state;
  while (MillisSince(up) < 10000) {
    state = pair->DecodePeerState();
    if (state == "connected") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const int64_t recovered_ms = MillisSince(up);
  std::printf("%s: data link up -> peer connected again in %lld ms\n", label.c_str(),
              static_cast<long long>(recovered_ms));
  REQUIRE(state == "connected");

  // The batch posted before the cut was still in the socket: it may land now, which
  // is what `drained` false said. Once the transfer reports drained, nothing more
  // lands, and nothing past that one batch ever did (no batch was posted after the
  // failure).
  v1::TransferState later;
  const auto drain_wait = Clock::now();
  while (MillisSince(drain_wait) < 10000) {
    later = Require(pair->prefill->Get(big), "getting " + big);
    if (later.drained()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  INFO(later.DebugString());
  REQUIRE(later.drained());
  REQUIRE(later.phase() == v1::FAILED);
  const std::vector<uint8_t> at_drained = Snapshot(pair->decode_pool);
  const uint64_t landed_at_drained = TouchedPages(pair->decode_pool);
  std::printf("%s: the failed transfer reported drained %lld ms after the link came up; "
              "%llu pages had landed by then (%llu when the failure was reported)\n",
              label.c_str(), static_cast<long long>(MillisSince(up)),
              static_cast<unsigned long long>(landed_at_drained),
              static_cast<unsigned long long>(landed_at_failure));
  // At most the batches confirmed when it failed and the one still posted (the cut may
  // come after the first batch completed when the ip command is slow).
  CHECK(landed_at_drained * shape.page_bytes <= failed.bytes_done() + kBatchBytes);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  CHECK(Unchanged(at_drained, pair->decode_pool));
  for (uint32_t r = 0; r < pair->decode_pool.regions(); ++r) {
    for (uint64_t p = 0; p < shape.pages; ++p) {
      // Whatever landed is the source's bytes, never garbage.
      const uint8_t* page = pair->decode_pool.Page(r, p);
      if (page[0] != 0xEE || page[shape.page_bytes - 1] != 0xEE) {
        CHECK(std::memcmp(page, pair->prefill_pool.Page(r, p), shape.page_bytes) == 0);
      }
    }
  }

  // A new transfer moves real bytes.
  const auto start = Clock::now();
  std::memset(pair->decode_pool.mapping.data(), 0xEE, pair->decode_pool.bytes());
  const std::vector<uint64_t> src = {3, 7, 8, 100};
  const std::vector<uint64_t> dst = {1, 2, 3, 127};
  auto again = pair->prefill->Submit(KvWrite("after-up", src, dst, "link-back"));
  INFO(again.status().ToString());
  REQUIRE(again.ok());
  auto done = Require(pair->prefill->WaitTransfer("after-up", 20000), "waiting for after-up");
  INFO(done.DebugString());
  REQUIRE(done.phase() == v1::COMPLETED);
  std::printf("%s: new transfer after recovery completed in %lld ms\n", label.c_str(),
              static_cast<long long>(MillisSince(start)));
  for (size_t i = 0; i < src.size(); ++i) CHECK(pair->PagesEqual(src[i], dst[i]));
  CHECK(TouchedPages(pair->decode_pool) == src.size() * pair->decode_pool.regions());
}

// Without UCX error handling only the metadata poll notices the cut.
TEST_CASE("link cut mid-transfer between agents in network namespaces (no UCX error handling)") {
  LinkCutCase("none", "none");
}

// Two hosts get peer mode: what a real link cut between nodes meets.
TEST_CASE("link cut mid-transfer between agents in network namespaces (peer error mode)") {
  LinkCutCase("peer", "peer");
}

TEST_CASE("netem delay and loss on the data link: a transfer completes with the right bytes") {
  cli::KvPoolShape shape;
  shape.layers = 2;
  shape.pages = 64;
  shape.page_bytes = 16 << 10;
  const std::string tc = FindTool("tc");
  // netem needs the kernel's sch_netem module, often missing in containers and CI VMs.
  auto probe = [&tc](const NetnsLab& lab) -> std::string {
    if (tc.empty()) return "iproute2's `tc` is not installed (apt-get install iproute2)";
    CommandResult r = lab.ExecIn(
        0, {tc, "qdisc", "add", "dev", lab.data_dev(0), "root", "netem", "delay", "20ms"});
    if (r.rc == 0) return "";
    return "tc netem is not available here (`tc qdisc add dev " + lab.data_dev(0) +
           " root netem delay 20ms`: " + r.output +
           "); the kernel needs the sch_netem module (modprobe sch_netem)";
  };
  std::string skip;
  auto pair = StartPair(&skip, shape, "peer", "peer", probe);
  if (!pair) KVAGENT_SKIP(skip);
  NetnsLab& lab = *pair->lab;
  CommandResult loss = lab.ExecIn(0, {tc, "qdisc", "change", "dev", lab.data_dev(0), "root",
                                      "netem", "delay", "20ms", "loss", "1%"});
  INFO(loss.output);
  REQUIRE(loss.rc == 0);
  const auto all = Range(0, shape.pages);
  const auto start = Clock::now();
  auto submitted = pair->prefill->Submit(KvWrite("lossy", all, all, "lossy-done"));
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  auto done = Require(pair->prefill->WaitTransfer("lossy", 30000), "waiting for lossy");
  INFO(done.DebugString());
  REQUIRE(done.phase() == v1::COMPLETED);
  std::printf("netem delay 20ms loss 1%%: %llu bytes in %lld ms\n",
              static_cast<unsigned long long>(done.bytes_total()),
              static_cast<long long>(MillisSince(start)));
  for (uint64_t p : all) CHECK(pair->PagesEqual(p, p));
}

// UCT's tcp transport takes a connection from whoever reaches UCX's port and serves a
// put request by writing its payload wherever it names (tests/security/ucx_tcp_test).
// Second addresses on the data link (10.77.1.1 prefill's, 10.77.1.2 decode's), for
// gRPC apart from the addresses UCX connects from; the failure text, empty on success.
std::string AddSecondAddresses(NetnsLab& lab) {
  for (int side : {0, 1}) {
    const std::string error = lab.IpIn(
        side, {"addr", "add", side == 0 ? "10.77.1.1/24" : "10.77.1.2/24", "dev", lab.data_dev(side)});
    if (!error.empty()) return "cannot add second addresses: " + error;
  }
  return "";
}

// Prefill's UCX reaches decode from an address decode's guard was never told of: a
// third address on prefill's data interface, added after prefill announced its own,
// that the route to decode's data address takes as its source (what a NAT or a policy
// route on the peer's host does), while gRPC runs between the second addresses
// (10.77.1.x) and vouches for those. Decode's guard closes prefill's UCX connection at
// accept; prefill's new endpoint does not finish connecting, and ConnectPeer fails
// saying that the peer's guard may have refused this host's address and where that
// shows (the peer's log and its ucx_tcp_refused_connections, which rose); prefill lives
// on and stops cleanly.
TEST_CASE("a connect whose UCX connection the peer's guard refuses fails, naming the guard") {
  cli::KvPoolShape shape;
  shape.layers = 2;
  shape.pages = 4;
  shape.page_bytes = 16 << 10;
  std::string skip;
  auto pair = StartAgents(&skip, shape, "auto", AddSecondAddresses, {});
  if (!pair) KVAGENT_SKIP(skip);
  NetnsLab& lab = *pair->lab;
  // Decode routes its answers to that address over the link as well.
  for (const auto& [side, args] : std::vector<std::pair<int, std::vector<std::string>>>{
           {0, {"addr", "add", "10.77.2.1/24", "dev", lab.data_dev(0)}},
           {0, {"route", "replace", "10.77.0.0/24", "dev", lab.data_dev(0), "src", "10.77.2.1"}},
           {1, {"route", "add", "10.77.2.0/24", "dev", lab.data_dev(1)}}}) {
    const std::string error = lab.IpIn(side, args);
    INFO(error);
    REQUIRE(error.empty());
  }
  const uint64_t refused_before =
      Require(pair->decode->Status(), "decode's status").ucx_tcp_refused_connections();
  const auto start = Clock::now();
  auto connected = pair->prefill->Connect(DecodeAddress(*pair, "10.77.1.2"));
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  INFO(connected.status().ToString() << " after " << ms << " ms");
  REQUIRE_FALSE(connected.ok());
  CHECK(connected.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(connected.status().message()),
             Catch::Contains("peer 'decode': the new UCX endpoint did not finish connecting") &&
                 Catch::Contains("the peer's guard may have refused this host's address") &&
                 Catch::Contains("ucx_tcp_refused_connections"));
  const uint64_t refused =
      Require(pair->decode->Status(), "decode's status").ucx_tcp_refused_connections() -
      refused_before;
  CHECK(refused > 0);
  CHECK(pair->DecodePeerState() == "absent");
  // Prefill lives on: UCX 1.13 completed the failed endpoint's flush inside its own
  // failure handling, and the endpoint released there crashed prefill's worker a moment
  // after ConnectPeer answered (transport/ucx_worker.cc, CloseEndpoint). 200 ms on
  // (the crash came within the millisecond), it still answers, and stops cleanly.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK(Require(pair->prefill->Status(), "prefill's status, after").name() == "prefill");
  pair->prefill.reset();
  const absl::StatusOr<int> exit_code = pair->prefill_process.Stop();
  INFO(exit_code.status().ToString());
  REQUIRE(exit_code.ok());
  CHECK(*exit_code == 0);
  std::printf("prefill's UCX from an address decode was not told of: ConnectPeer failed after "
              "%lld ms; decode's guard refused %llu connection(s)\n",
              static_cast<long long>(ms), static_cast<unsigned long long>(refused));
}

// Over the data network, decode's guard keeps a connection only from an authenticated
// peer's host (transport/ucx_tcp_guard.h). Here the agents' gRPC runs between second
// addresses of the data link (10.77.1.x), while UCX connects from each interface's
// first (10.77.0.x): prefill's UCX gets in only as a data address it announced. Its
// transfers run, decode refuses nothing of it, a third host's stock UCT endpoint is
// closed before UCX reads it, and the same endpoint from prefill's host (which the
// guard lets in) lands, so the refusal is the guard's.
TEST_CASE("UCX's TCP port on the data network: a host no peer vouched for is refused, a "
          "peer's announced data address is not, and a peer that went is forgotten") {
  cli::KvPoolShape shape;
  shape.layers = 2;
  shape.pages = 16;
  shape.page_bytes = 16 << 10;
  std::string skip;
  auto network = [](NetnsLab& lab) {
    std::string error = lab.AddStranger();
    if (!error.empty()) return "cannot add a third host: " + error;
    return AddSecondAddresses(lab);
  };
  // A calling peer's addresses are forgotten 1 s after it stops watching (not 60).
  auto pair = StartPair(&skip, shape, "auto", "peer", network, "10.77.1.2",
                        {"--ucx-tcp-host-ttl-ms", "1000"});
  if (!pair) KVAGENT_SKIP(skip);
  NetnsLab& lab = *pair->lab;
  const uint64_t dropped_at_start =
      Require(pair->decode->Status(), "decode's status").dropped_peer_messages();
  const auto all = Range(0, shape.pages);
  auto submitted = pair->prefill->Submit(KvWrite("guarded", all, all, "guarded-done"));
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  auto done = Require(pair->prefill->WaitTransfer("guarded", 30000), "waiting for guarded");
  INFO(done.DebugString());
  REQUIRE(done.phase() == v1::COMPLETED);
  for (uint64_t p : all) CHECK(pair->PagesEqual(p, p));
  const v1::AgentStatus decode_status = Require(pair->decode->Status(), "decode's status");
  const uint64_t dropped_before = decode_status.dropped_peer_messages();
  CHECK(dropped_before == dropped_at_start);  // none of prefill's connections refused
  CHECK(decode_status.ucx_tcp_refused_connections() == 0);
  // Prefill vouched for its gRPC source (10.77.1.1) and announced both addresses of its
  // data interface (10.77.0.1 too).
  CHECK(decode_status.ucx_tcp_allowed_hosts() >= 2);

  // Decode's UCX port: its one TCP listener besides the gRPC door.
  const pid_t decode = pair->decode_process.pid();
  std::vector<int> ports;
  for (int port : ListeningTcpPorts(decode)) {
    if (port != pair->decode_process.port()) ports.push_back(port);
  }
  INFO("decode's other TCP listeners: " << ports.size());
  REQUIRE(ports.size() == 1);
  const std::string port = std::to_string(ports[0]);
  const uint64_t target = StackBottom(decode);
  REQUIRE(target != 0);
  const std::string address = fmt::format("{:#x}", target);
  const std::string before = PeekMemory(decode, target, 16);
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const std::string probe =
      fmt::format("{}/kvagent/tests/security/uct_put_probe", srcdir ? srcdir : ".");

  // The third host: refused, nothing lands, counted.
  CommandResult stranger =
      lab.ExecInStranger({probe, port, address, lab.data_ip(1), lab.stranger_dev()});
  INFO("from the third host: rc " << stranger.rc << ": " << stranger.output);
  CHECK(stranger.rc == 3);
  CHECK(stranger.output.rfind("refused\t", 0) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK(PeekMemory(decode, target, 16) == before);
  const v1::AgentStatus after_status = Require(pair->decode->Status(), "decode's status");
  const uint64_t dropped_after = after_status.dropped_peer_messages();
  CHECK(dropped_after > dropped_before);
  CHECK(after_status.ucx_tcp_refused_connections() == dropped_after - dropped_before);
  std::printf("a third host's UCT put to decode's UCX port %s: %s; dropped_peer_messages "
              "%llu -> %llu\n",
              port.c_str(), stranger.output.c_str(),
              static_cast<unsigned long long>(dropped_before),
              static_cast<unsigned long long>(dropped_after));

  // The same endpoint from prefill's host, an authenticated peer's: kept, and UCX then
  // writes where it is told (what a peer may still do, docs/SECURITY.md).
  CommandResult peer_host =
      lab.ExecIn(0, {probe, port, address, lab.data_ip(1), lab.data_dev(0)});
  INFO("from prefill's host: rc " << peer_host.rc << ": " << peer_host.output);
  CHECK(peer_host.rc == 0);
  std::string landed;
  for (int i = 0; i < 50; ++i) {
    landed = PeekMemory(decode, target, 16);
    if (landed != before) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(landed == std::string("WRITTEN-BY-UCT!\0", 16));
  // Decode still serves prefill.
  auto again = pair->prefill->Submit(KvWrite("after", all, all, "after-done"));
  REQUIRE(again.ok());
  CHECK(Require(pair->prefill->WaitTransfer("after", 30000), "waiting for after").phase() ==
        v1::COMPLETED);

  // Prefill lets decode go: its own list for decode (the address it dialled, decode's
  // announced ones) goes at once; decode forgets prefill's 1 s after its watch ended,
  // and the same put from prefill's host is refused from then on.
  CHECK(Require(pair->prefill->Status(), "prefill's status").ucx_tcp_allowed_hosts() >= 1);
  REQUIRE(pair->prefill->Disconnect("decode").ok());
  CHECK(Require(pair->prefill->Status(), "prefill's status").ucx_tcp_allowed_hosts() == 0);
  const auto disconnected = Clock::now();
  const auto forget_by = disconnected + std::chrono::seconds(15);
  uint64_t still_allowed = 0;
  do {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    still_allowed = Require(pair->decode->Status(), "decode's status").ucx_tcp_allowed_hosts();
  } while (still_allowed != 0 && Clock::now() < forget_by);
  CHECK(still_allowed == 0);
  std::printf("decode forgot prefill's hosts %lld ms after prefill disconnected "
              "(--ucx-tcp-host-ttl-ms 1000)\n",
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                         Clock::now() - disconnected)
                                         .count()));
  const uint64_t refused_before =
      Require(pair->decode->Status(), "decode's status").ucx_tcp_refused_connections();
  CommandResult gone_peer =
      lab.ExecIn(0, {probe, port, address, lab.data_ip(1), lab.data_dev(0)});
  INFO("from prefill's host after it went: rc " << gone_peer.rc << ": " << gone_peer.output);
  CHECK(gone_peer.rc == 3);
  CHECK(gone_peer.output.rfind("refused\t", 0) == 0);
  CHECK(Require(pair->decode->Status(), "decode's status").ucx_tcp_refused_connections() >
        refused_before);
}

}  // namespace
}  // namespace kvagent::testing

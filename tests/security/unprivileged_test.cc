// An unprivileged local user against an agent that runs as root (as the agent did in
// the attack this guards against: a root-only file copied out through the agent); and
// agents that run unprivileged themselves.
// The user is uid 65534 (nobody), allowed on the local door by --local-socket-group
// 65534; it runs tests/security/security_probe under setpriv. Needs root (skips
// otherwise) and runs outside Bazel's sandbox (files given to uid 65534 in /dev/shm).
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "base/format.h"
#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "fmt/format.h"
#include "tests/security/run_as.h"
#include "tests/unit/catch_main.h"

namespace kvagent::testing {
namespace {

using Catch::Matchers::Contains;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST_CASE("an unprivileged user gets no file it does not own, and no peer's rights") {
  if (geteuid() != 0) KVAGENT_SKIP("needs root: the test runs the attacker as uid 65534");
  if (access("/usr/bin/setpriv", X_OK) != 0) KVAGENT_SKIP("needs setpriv (util-linux)");
  OpenDir dir;
  const std::string probe = CopyProbe(dir);

  const std::string tag = std::to_string(getpid());
  const std::string root_file = "/dev/shm/kvsec-root-" + tag;
  const std::string own_file = "/dev/shm/kvsec-nobody-" + tag;
  const std::string link = "/dev/shm/kvsec-link-" + tag;
  const std::string link_to_root = "/dev/shm/kvsec-link-root-" + tag;
  {
    std::ofstream(root_file) << std::string(4096, 'S');
    std::ofstream(own_file) << std::string(4096, 'n');
  }
  // World-writable, but root's: the agent must still refuse it to another uid.
  chmod(root_file.c_str(), 0666);
  REQUIRE(chown(own_file.c_str(), 65534, 65534) == 0);
  REQUIRE(symlink("/etc/shadow", link.c_str()) == 0);
  REQUIRE(symlink(root_file.c_str(), link_to_root.c_str()) == 0);
  struct Cleanup {
    std::vector<std::string> paths;
    ~Cleanup() {
      for (const auto& p : paths) unlink(p.c_str());
    }
  } cleanup{{root_file, own_file, link, link_to_root}};

  auto agent = StartVictim(dir, {"--local-socket-group", "65534"});
  const std::string address = agent->address();

  Outcome who = RunAs(65534, 65534, probe, address, "status");
  CHECK(who.code == "OK");
  CHECK_THAT(who.message, Contains("uid:65534") && Contains("[engine]"));

  Outcome shadow = RunAs(65534, 65534, probe, address, "register-path", "/etc/shadow");
  CHECK(shadow.code == "PERMISSION_DENIED");
  CHECK_THAT(shadow.message, Contains("/dev/shm"));
  Outcome dots = RunAs(65534, 65534, probe, address, "register-path", "/dev/shm/../etc/shadow");
  CHECK(dots.code == "INVALID_ARGUMENT");
  CHECK_THAT(dots.message, Contains(".."));
  for (const std::string& path : {link, link_to_root}) {
    Outcome via_link = RunAs(65534, 65534, probe, address, "register-path", path);
    CHECK(via_link.code == "PERMISSION_DENIED");
    CHECK_THAT(via_link.message, Contains("symlink") || Contains("symbolic link"));
  }
  Outcome roots = RunAs(65534, 65534, probe, address, "register-path", root_file);
  CHECK(roots.code == "PERMISSION_DENIED");
  CHECK_THAT(roots.message, Contains("uid 0") && Contains("65534"));
  // The positive control: a file the user owns, on tmpfs under /dev/shm, registers.
  Outcome own = RunAs(65534, 65534, probe, address, "register-path", own_file);
  CHECK(own.code == "OK");

  // Not the agent's uid: not a peer, so no metadata (rkeys, secret) and no descriptors.
  Outcome metadata = RunAs(65534, 65534, probe, address, "metadata");
  CHECK(metadata.code == "PERMISSION_DENIED");
  CHECK_THAT(metadata.message, Contains("peer") && Contains("--peer-uids"));
  Outcome memory = RunAs(65534, 65534, probe, address, "peer-memory", "1");
  CHECK(memory.code == "PERMISSION_DENIED");
  CHECK_THAT(memory.message, Contains("--peer-uids"));

  // A uid outside the socket's group does not get in at all.
  Outcome outsider = RunAs(65533, 65533, probe, address, "status");
  CHECK(outsider.code == "PERMISSION_DENIED");
  CHECK_THAT(outsider.message, Contains("--local-socket-group"));

  CHECK(ReadFile(root_file) == std::string(4096, 'S'));
  cli::AgentClient root(address);
  auto status = root.Status();
  REQUIRE(status.ok());
  // The probe's own region left with its session; the refused peer calls are counted.
  CHECK(status->regions() == 0);
  CHECK(status->refused_calls() >= 2);
}

// A peer's name is bound to who proved it first. With another uid listed in
// --peer-uids (a second agent user on this host), a process of that uid names its
// session "prefill", an agent of the victim's own uid that fetched its metadata
// already: refused, so it gets neither prefill's secret (with which it could forge
// prefill's notifications, commits and cancels) nor its shares. Its own name works.
TEST_CASE("a process of another peer uid cannot take a peer name another agent holds") {
  if (geteuid() != 0) KVAGENT_SKIP("needs root: the test runs the other peer uid as 65534");
  if (access("/usr/bin/setpriv", X_OK) != 0) KVAGENT_SKIP("needs setpriv (util-linux)");
  OpenDir dir;
  const std::string probe = CopyProbe(dir);
  auto agent = StartVictim(
      dir, {"--local-socket-group", "65534", "--peer-uids", fmt::format("{},65534", geteuid())});
  const std::string address = agent->address();

  // "prefill" (the victim's own uid) fetches first; the same name again keeps its secret.
  Outcome prefill = RunAs(geteuid(), getegid(), probe, address, "metadata-as", "prefill");
  INFO(prefill.message);
  REQUIRE(prefill.code == "OK");
  REQUIRE_THAT(prefill.message, Contains("secret "));
  Outcome again = RunAs(geteuid(), getegid(), probe, address, "metadata-as", "prefill");
  CHECK(again.message == prefill.message);

  Outcome stolen = RunAs(65534, 65534, probe, address, "metadata-as", "prefill");
  INFO(stolen.message);
  CHECK(stolen.code == "PERMISSION_DENIED");
  CHECK_THAT(stolen.message, Contains("'prefill' belongs to a local session of this agent's uid") &&
                                 Contains("not to a local session of uid 65534") &&
                                 Contains("--name"));
  CHECK_THAT(stolen.message, !Contains(prefill.message.substr(prefill.message.find("secret "))));
  Outcome own = RunAs(65534, 65534, probe, address, "metadata-as", "nobody-agent");
  INFO(own.message);
  CHECK(own.code == "OK");
  Outcome unnamed = RunAs(65534, 65534, probe, address, "metadata-as", "");
  CHECK(unnamed.code == "INVALID_ARGUMENT");
}

// Least privilege: two agents running as an unprivileged uid (65534) serve engines
// and move pages between each other; doctor does not flag them. (Root, the test's
// client, may use their sockets as any local caller; here it is an engine, not a
// scheduler: that role defaults to the agents' own uid.)
// A folder of its own in `dir` that uid 65534 owns, and a copy of kvagentd it may run
// (the build's may lie where that uid cannot reach).
struct ForNobody {
  std::string home;
  std::string binary;
  // Agent `name` run as uid 65534 (setpriv), writing in `home`, its local door there.
  cli::DaemonOptions Agent(const std::string& name) const {
    cli::DaemonOptions options;
    options.binary = binary;
    options.name = name;
    options.work_dir = home;
    options.local_socket = fmt::format("{}/{}.sock", home, name);
    options.command_prefix = {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534",
                              "--clear-groups", "--"};
    return options;
  }
};
ForNobody PrepareForNobody(const OpenDir& dir) {
  ForNobody out;
  out.home = dir.path() + "/agents";
  std::filesystem::create_directories(out.home);
  REQUIRE(chown(out.home.c_str(), 65534, 65534) == 0);
  auto source = cli::FindKvagentd("");
  REQUIRE(source.ok());
  out.binary = dir.path() + "/kvagentd";
  std::filesystem::copy_file(*source, out.binary);
  chmod(out.binary.c_str(), 0755);
  return out;
}

// A 2-layer pool of 4 KiB pages on each agent: prefill's filled with pattern `seed`,
// decode's with 0xEE.
struct Pools {
  cli::KvPool src, dst;
};
Pools MakePools(cli::AgentClient& prefill, cli::AgentClient& decode, uint64_t pages,
                uint32_t seed) {
  cli::KvPoolShape shape;
  shape.layers = 2;
  shape.pages = pages;
  shape.page_bytes = 4096;
  auto src = cli::CreateKvPool(prefill, "prefill", shape);
  auto dst = cli::CreateKvPool(decode, "decode", shape);
  INFO(src.status().ToString() << " / " << dst.status().ToString());
  REQUIRE(src.ok());
  REQUIRE(dst.ok());
  for (uint32_t r = 0; r < src->regions(); ++r) {
    for (uint64_t p = 0; p < shape.pages; ++p) {
      cli::FillPage(src->Page(r, p), shape.page_bytes, seed, r, p);
    }
  }
  std::memset(dst->mapping.data(), 0xEE, dst->bytes());
  return Pools{*std::move(src), *std::move(dst)};
}

// WRITEs prefill's pages `moved` to decode's page + `shift` and checks the bytes there.
void WriteAndCompare(cli::AgentClient& prefill, Pools& pools, const std::string& id,
                     const std::vector<uint64_t>& moved, uint64_t shift) {
  v1::SubmitTransferRequest write;
  write.set_transfer_id(id);
  write.set_peer("decode");
  write.set_op(v1::WRITE);
  auto* items = write.add_segments()->mutable_items();
  items->set_local_group("kv");
  items->set_remote_group("kv");
  for (uint64_t p : moved) {
    items->add_local_indices(p);
    items->add_remote_indices(p + shift);
  }
  write.set_wait(true);
  write.set_timeout_ms(20000);
  auto done = prefill.Submit(write);
  INFO(done.status().ToString());
  REQUIRE(done.ok());
  INFO(done->error_message());
  REQUIRE(done->phase() == v1::COMPLETED);
  const uint64_t page_bytes = pools.src.shape.page_bytes;
  for (uint32_t r = 0; r < pools.src.regions(); ++r) {
    for (uint64_t p : moved) {
      CHECK(std::memcmp(pools.src.Page(r, p), pools.dst.Page(r, p + shift), page_bytes) == 0);
    }
  }
}

TEST_CASE("agents running as an unprivileged user serve and move pages") {
  if (geteuid() != 0) KVAGENT_SKIP("needs root: the test starts the agents as uid 65534");
  if (access("/usr/bin/setpriv", X_OK) != 0) KVAGENT_SKIP("needs setpriv (util-linux)");
  OpenDir dir;
  // Everything the agents write goes in a directory of their own.
  const ForNobody nobody = PrepareForNobody(dir);

  std::vector<cli::DaemonProcess> agents;
  for (const char* name : {"prefill", "decode"}) {
    auto started = cli::DaemonProcess::Start(nobody.Agent(name));
    INFO(started.status().ToString());
    REQUIRE(started.ok());
    agents.push_back(*std::move(started));
  }
  cli::AgentClient prefill(agents[0].address()), decode(agents[1].address());
  auto status = prefill.Status();
  REQUIRE(status.ok());
  std::vector<std::string> roles(status->caller_roles().begin(), status->caller_roles().end());
  CHECK(roles == std::vector<std::string>{"engine"});
  auto report = prefill.Doctor();
  REQUIRE(report.ok());
  bool checked = false;
  for (const auto& check : report->checks()) {
    if (check.name() != "privileges") continue;
    checked = true;
    CHECK(check.result() == v1::DoctorCheck::PASS);
    CHECK_THAT(check.detail(), Contains("uid 65534"));
  }
  CHECK(checked);

  Pools pools = MakePools(prefill, decode, 16, 5);
  // Same-host peers running as the same (unprivileged) user accept each other.
  auto peer = prefill.Connect(agents[1].address());
  INFO(peer.status().ToString());
  REQUIRE(peer.ok());
  CHECK(peer->data_path() == "shm-direct");
  WriteAndCompare(prefill, pools, "unprivileged", {2, 3, 9}, 4);
}

// An agent of another uid dials this host's network door of a root agent: it cannot
// read the door process's descriptors, so it cannot tell which process serves the door
// and says so; the same-host TCP check is left out for that peer (it could hold no
// pid for it), and the peer is still connected and moves pages over TCP. (The agents'
// logs go with their folder when the case ends: a failure shows them only through the
// check that reads prefill's.)
TEST_CASE("an agent that cannot see the process behind a door of this host warns and still "
          "connects") {
  if (geteuid() != 0) KVAGENT_SKIP("needs root: the dialling agent runs as uid 65534");
  if (access("/usr/bin/setpriv", X_OK) != 0) KVAGENT_SKIP("needs setpriv (util-linux)");
  OpenDir dir;
  const ForNobody nobody = PrepareForNobody(dir);

  // decode: root, a plain network door on 127.0.0.1, UCX TCP connections from uid 65534.
  cli::DaemonOptions root_options;
  root_options.binary = nobody.binary;
  root_options.name = "decode";
  root_options.work_dir = dir.path();
  root_options.network = cli::NetworkDoor::kInsecure;
  root_options.extra_args = {"--peer-uids", "65534"};
  auto decode_started = cli::DaemonProcess::Start(root_options);
  INFO(decode_started.status().ToString());
  REQUIRE(decode_started.ok());
  // prefill: uid 65534, dialling plain network doors (--insecure-listen).
  cli::DaemonOptions options = nobody.Agent("prefill");
  options.extra_args = {"--insecure-listen", "127.0.0.1:0"};
  auto prefill_started = cli::DaemonProcess::Start(options);
  INFO(prefill_started.status().ToString());
  REQUIRE(prefill_started.ok());
  cli::AgentClient prefill(prefill_started->address()), decode(decode_started->address());
  Pools pools = MakePools(prefill, decode, 8, 9);

  auto peer = prefill.Connect(decode_started->network_address());
  INFO(peer.status().ToString());
  REQUIRE(peer.ok());
  CHECK(peer->data_path() == "ucx-am");  // TCP: the agents' own messages carry the bytes
  CHECK_THAT(ReadFile(prefill_started->log_path()),
             Contains("a door of this host whose process this agent cannot see") &&
                 Contains("UCX's TCP connections to this host are not checked for this peer"));
  WriteAndCompare(prefill, pools, "unseen-door", {1, 6}, 1);
}

}  // namespace
}  // namespace kvagent::testing

// UCX's TCP port against a local user. UCT's tcp transport takes a connection from
// whoever reaches its port and serves a put request by copying the payload to the
// address it names (UCX 1.13): tests/security/uct_put_probe, a stock UCT endpoint, put
// 16 bytes into a root kvagentd's stack as uid 65534 before the agent guarded its
// accept() (transport/ucx_tcp_guard.h). Needs root (the attacker runs under setpriv,
// and the test reads the agent's memory through /proc) and runs outside Bazel's
// sandbox, as unprivileged_test.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "fmt/format.h"
#include "tests/security/process_peek.h"
#include "tests/security/run_as.h"
#include "tests/unit/catch_main.h"

namespace kvagent::testing {
namespace {

// A root agent with only its local door, the probe copied where setpriv's uids reach
// it, and the agent's UCX TCP port: without a network door its UCX uses loopback only,
// so its one TCP listener is UCT's tcp interface.
struct Victim {
  Victim()
      : probe(CopyTool(dir, "uct_put_probe")),
        process(StartVictim(dir, {})),
        client(process->address()) {
    const std::vector<int> ports = ListeningTcpPorts(process->pid());
    INFO("the agent's TCP listeners: " << ports.size());
    REQUIRE(ports.size() == 1);
    port = std::to_string(ports[0]);
  }
  // The agent's status (it answers: the agent is up).
  v1::AgentStatus Status() {
    auto status = client.Status();
    REQUIRE(status.ok());
    return *status;
  }
  std::string Log() const {
    std::ifstream log(process->log_path());
    return std::string((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  }
  // What its log says of its end: the line of UCX's assertion, or the last 2,000 bytes.
  std::string WhyEnded() const {
    const std::string log = Log();
    const size_t at = log.find("Assertion");
    if (at != std::string::npos) return log.substr(at, log.find('\n', at) - at);
    return log.substr(log.size() > 2000 ? log.size() - 2000 : 0);
  }
  OpenDir dir;
  std::string probe;
  std::unique_ptr<cli::DaemonProcess> process;
  cli::AgentClient client;
  std::string port;
};

// The sender runs as the agent's uid under setpriv.
#define KVAGENT_NEEDS_SETPRIV()                                                       \
  if (geteuid() != 0) KVAGENT_SKIP("needs root: the sender runs as the agent's uid "   \
                                   "under setpriv");                                  \
  if (access("/usr/bin/setpriv", X_OK) != 0) KVAGENT_SKIP("needs setpriv (util-linux)")

TEST_CASE("a local user cannot write a root agent's memory through UCX's TCP port; a peer uid "
          "still connects") {
  if (geteuid() != 0) KVAGENT_SKIP("needs root: the attacker runs as uid 65534 under setpriv");
  if (access("/usr/bin/setpriv", X_OK) != 0) KVAGENT_SKIP("needs setpriv (util-linux)");
  Victim victim;
  cli::DaemonProcess& agent = *victim.process;
  cli::AgentClient& client = victim.client;
  const std::string& probe = victim.probe;
  const std::string& port = victim.port;
  const uint64_t target = StackBottom(agent.pid());
  REQUIRE(target != 0);
  const std::string before = PeekMemory(agent.pid(), target, 16);
  const std::string address = fmt::format("{:#x}", target);
  auto first = client.Status();
  REQUIRE(first.ok());
  const uint64_t dropped_before = first->dropped_peer_messages();

  // uid 65534: the connection is closed before UCX reads from it; nothing lands.
  const Outcome stranger = RunAs(65534, 65534, probe, port, address);
  INFO("uid 65534: " << stranger.code << ": " << stranger.message);
  CHECK(stranger.code == "refused");
  usleep(200 * 1000);
  CHECK(PeekMemory(agent.pid(), target, 16) == before);
  auto status = client.Status();
  REQUIRE(status.ok());
  CHECK(status->dropped_peer_messages() > dropped_before);  // each refused connection
  CHECK(status->ucx_tcp_refused_connections() ==
        status->dropped_peer_messages() - dropped_before);
  std::printf("uid 65534 against UCX's TCP port %s: %s (%s); dropped_peer_messages %llu -> "
              "%llu\n",
              port.c_str(), stranger.code.c_str(), stranger.message.c_str(),
              static_cast<unsigned long long>(dropped_before),
              static_cast<unsigned long long>(status->dropped_peer_messages()));

  // The agent's own uid (a same-host peer's, by default) still connects: and what it
  // may do there is UCX's, which the same probe shows (the put lands), so the refusal
  // above is the guard's and not a probe that cannot reach the agent.
  const Outcome own = RunAs(0, 0, probe, port, address);
  INFO("uid 0: " << own.code << ": " << own.message);
  CHECK(own.code == "sent");
  std::string landed;
  for (int i = 0; i < 50; ++i) {
    landed = PeekMemory(agent.pid(), target, 16);
    if (landed != before) break;
    usleep(20 * 1000);
  }
  CHECK(landed == std::string("WRITTEN-BY-UCT!\0", 16));
  CHECK(client.Status().ok());  // and the agent still serves
}

// UCT 1.13's tcp transport aborts the process (a failed assertion) on a frame longer than
// its receive buffer, as on an unknown frame id or a put request of the wrong length:
// any process that connects could end the agent with five bytes. The stream check
// closes such a connection first.
TEST_CASE("a frame longer than UCT's receive buffer closes the connection, not the agent") {
  KVAGENT_NEEDS_SETPRIV();
  Victim victim;
  const v1::AgentStatus first = victim.Status();
  // One active message of 100,000 bytes (UCT's receive buffer is 64 KiB by default).
  setenv("KVAGENT_PROBE_AM", "1:1", 1);
  setenv("KVAGENT_PROBE_AM_BYTES", "100000", 1);
  const Outcome sent = RunAs(0, 0, victim.probe, victim.port, "0");
  unsetenv("KVAGENT_PROBE_AM");
  unsetenv("KVAGENT_PROBE_AM_BYTES");
  INFO("the long frame: " << sent.code << ": " << sent.message);
  CHECK(sent.code == "sent");
  uint64_t refused = 0;
  for (int i = 0; i < 100 && refused == 0; ++i) {
    usleep(20 * 1000);
    refused = victim.Status().ucx_tcp_refused_connections() - first.ucx_tcp_refused_connections();
  }
  CHECK(refused == 1);
  CHECK(victim.Log().find("at a frame of 100000 bytes (id 1), more than UCT's receive buffer takes") !=
        std::string::npos);
  // Short messages still reach UCX after it (the next connection is a new stream).
  setenv("KVAGENT_PROBE_AM", "27:10", 1);
  const Outcome after = RunAs(0, 0, victim.probe, victim.port, "0");
  unsetenv("KVAGENT_PROBE_AM");
  CHECK(after.code == "sent");
  victim.Status();  // still up
}

// UCT ids UCP registers no handler for (0, 5, 13, 27-31 in UCX 1.13) reached UCT's stub
// handler, which logged 19 lines with a backtrace for each message: 2,000 messages of
// 13 bytes made 38,000 lines of this agent's log. kvagentd's uct_iface_open stand-in
// gives every id a dropping handler first (ucx_hardening.h QuietUnusedUctIds): each is
// counted in dropped_peer_messages and only the first few and every 1,024th logged.
TEST_CASE("messages of UCT ids UCP has no handler for are dropped and counted, not logged "
          "one by one with a backtrace") {
  KVAGENT_NEEDS_SETPRIV();
  Victim victim;
  cli::DaemonProcess& agent = *victim.process;
  cli::AgentClient& client = victim.client;
  auto first = client.Status();
  REQUIRE(first.ok());
  constexpr int kEach = 300;
  const std::vector<int> ids = {0, 5, 13, 27, 31};
  for (int id : ids) {
    setenv("KVAGENT_PROBE_AM", fmt::format("{}:{}", id, kEach).c_str(), 1);
    const Outcome sent = RunAs(0, 0, victim.probe, victim.port, "0");
    INFO("id " << id << ": " << sent.code << ": " << sent.message);
    CHECK(sent.code == "sent");
  }
  unsetenv("KVAGENT_PROBE_AM");
  const uint64_t want = first->dropped_peer_messages() + kEach * ids.size();
  uint64_t dropped = 0;
  for (int i = 0; i < 100 && dropped < want; ++i) {
    auto status = client.Status();
    REQUIRE(status.ok());
    dropped = status->dropped_peer_messages();
    if (dropped < want) usleep(20 * 1000);
  }
  CHECK(dropped == want);
  std::ifstream log(agent.log_path());
  int stub_lines = 0, our_lines = 0, lines = 0;
  for (std::string line; std::getline(log, line); ++lines) {
    if (line.find("but no handler installed") != std::string::npos) ++stub_lines;
    if (line.find("dropped a message of UCT active message id") != std::string::npos) ++our_lines;
  }
  std::printf("%zu x %d messages of UCT ids without a UCP handler: dropped_peer_messages %llu -> "
              "%llu; the agent's log %d lines, %d of them about these\n",
              ids.size(), kEach, static_cast<unsigned long long>(first->dropped_peer_messages()),
              static_cast<unsigned long long>(dropped), lines, our_lines);
  CHECK(stub_lines == 0);
  CHECK(our_lines >= 4);
  CHECK(our_lines <= 8);  // the first 4, and every 1,024th of 1,500
  CHECK(client.Status().ok());
}

// What a peer's UCT delivers to UCP's handlers, UCP 1.13 trusts: an AM_SINGLE message
// (UCT id 23, kvagent's own protocol) shorter than the user header it names, an AM_MIDDLE
// (25) shorter than its offset and footer, tagged fragments (3, 4) shorter than their
// headers each ended the agent on an assertion (ucp_am.c, "total_length >=
// am_hdr->header_length + sizeof(*am_hdr)"; eager.c, "req->recv.remaining >= length").
// So did a rendezvous request (9) of a kind other than 0 or 1 (rndv.c,
// "ucp_rndv_rts_is_tag(rts_hdr)"), which needs an odd endpoint id to pass the id check.
// A stock UCT endpoint, connected as the agent's own uid, sends every UCT id below 32
// with bodies of each length here (13, 1, 7, 24, 64 and 4,096 bytes), of 'P' bytes and
// of 'Q' bytes (each 8-byte id in them odd): the agent drops what does not fit
// (transport/ucx_hardening.h) and is up after each id.
TEST_CASE("active messages of every UCT id and length from a peer do not end the agent") {
  KVAGENT_NEEDS_SETPRIV();
  Victim victim;
  const uint64_t dropped_before = victim.Status().dropped_peer_messages();
  setenv("KVAGENT_PROBE_AM_BYTES", "0,1,7,24,64,4096", 1);
  setenv("KVAGENT_PROBE_AM_FILL", "PQ", 1);
  for (int id = 0; id < 32; ++id) {
    setenv("KVAGENT_PROBE_AM", fmt::format("{}:3", id).c_str(), 1);
    const Outcome sent = RunAs(0, 0, victim.probe, victim.port, "0");
    auto status = victim.client.Status();
    if (!status.ok()) {
      INFO("the agent's log: " << victim.WhyEnded());
      INFO("UCT id " << id << ": the probe: " << sent.code << ": " << sent.message);
      FAIL("the agent ended: " << status.status().ToString());
    }
  }
  unsetenv("KVAGENT_PROBE_AM");
  unsetenv("KVAGENT_PROBE_AM_BYTES");
  unsetenv("KVAGENT_PROBE_AM_FILL");
  const uint64_t dropped = victim.Status().dropped_peer_messages() - dropped_before;
  std::printf("32 UCT ids x 6 lengths x 2 fills x 3 messages: the agent is up, "
              "dropped_peer_messages "
              "+%llu\n",
              static_cast<unsigned long long>(dropped));
  CHECK(dropped > 0);
}

// Sends three wireup messages of `hex` (a ucp_wireup_msg_t and its address) from a
// stock UCT endpoint connected as the agent's own uid, waits `settle_ms` (for what UCP
// does on a later progress), fails the test if the agent ended, and returns how many
// messages the agent counted as dropped.
uint64_t WireupDropped(Victim& victim, const char* hex, int settle_ms) {
  const uint64_t dropped_before = victim.Status().dropped_peer_messages();
  setenv("KVAGENT_PROBE_AM_HEX", hex, 1);
  setenv("KVAGENT_PROBE_AM", "1:3", 1);
  const Outcome sent = RunAs(0, 0, victim.probe, victim.port, "0");
  unsetenv("KVAGENT_PROBE_AM");
  unsetenv("KVAGENT_PROBE_AM_HEX");
  INFO("the probe: " << sent.code << ": " << sent.message);
  usleep(settle_ms * 1000);
  auto status = victim.client.Status();
  if (!status.ok()) {
    INFO("the agent's log: " << victim.WhyEnded());
    FAIL("the agent ended: " << status.status().ToString());
  }
  CHECK(sent.code == "sent");
  return status->dropped_peer_messages() - dropped_before;
}

// UCP's wireup messages carry the sender's worker address, and UCX 1.13 stops the
// process on an address of a version past the two it packs (address.c, "*addr_version ==
// UCP_OBJECT_VERSION_V2"), before it looks any endpoint up: a request naming no endpoint
// yet (id 0), from a stock UCT endpoint connected as the agent's own uid, ended the
// agent with one 37-byte message of UCT id 1. Now it is dropped and counted.
TEST_CASE("a wireup request whose address UCX 1.13 aborts on does not end the agent") {
  KVAGENT_NEEDS_SETPRIV();
  Victim victim;
  // ucp_wireup_msg_t: a request (1), error mode 0, connection 0, source endpoint 0x45,
  // destination 0 (none yet); then an address whose first byte gives version 3.
  CHECK(WireupDropped(victim,
                      "0100000045000000000000000000000000000000"
                      "0300000000000000000000000000000000",
                      0) == 3);
}

// A wireup request that names no endpoint yet (id 0) makes UCP create one for the
// sender, then find it lanes among the transports the sender's address lists. An
// address that lists none (its uuid, then UCX's end-of-devices byte) left UCX 1.13 an
// endpoint with no configuration, which it failed on its next progress and stopped the
// process on an assertion (ucp_ep.h, "ep->cfg_index != UCP_WORKER_CFG_INDEX_NULL").
// kvagentd's ucp_endpoint_stand_in removes such an endpoint at once; each request is
// counted.
TEST_CASE("a wireup request whose address lists no transport does not end the agent") {
  KVAGENT_NEEDS_SETPRIV();
  Victim victim;
  // A request (1), error mode 0, connection 7, source endpoint 0x45, destination 0;
  // then an address of version 1 with a worker uuid and no devices (0xff).
  CHECK(WireupDropped(victim,
                      "0100070045000000000000000000000000000000"
                      "201122334455667788ff",
                      300) == 3);
}

}  // namespace
}  // namespace kvagent::testing


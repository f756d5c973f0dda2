// A peer agent killed (SIGKILL), hung (SIGSTOP) or restarted under the same name
// while prefill holds an open transfer to it: the transfer must turn FAILED with
// UNAVAILABLE within 2 s (the bound PeerManager documents), new submits must fail at
// once, and after a restart transfers to the new process must move real bytes. In
// `peer` UCX error mode the endpoint's error callback alone must catch a SIGKILL.
#include <signal.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/format.h"
#include "catch2/catch.hpp"
#include "cli/daemon_process.h"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"
#include "tests/integration/metrics_scrape.h"

namespace kvagent::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kUnavailable = static_cast<int>(absl::StatusCode::kUnavailable);

// Chunk 0 of a chunked WRITE with a long deadline: the data moves, then the transfer
// stays TRANSFERRING waiting for its next chunk. Returns once the data is in place,
// so no batch is posted when the peer goes away.
void OpenTransfer(AgentPair& pair, const std::string& id) {
  auto chunk = KvWrite(id, {0, 1, 2}, {10, 11, 12});
  chunk.set_more_chunks(true);
  chunk.set_timeout_ms(60000);
  auto submitted = pair.prefill().Submit(chunk);
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  const auto until = Clock::now() + std::chrono::seconds(10);
  v1::TransferState state;
  do {
    auto got = pair.prefill().Get(id);
    REQUIRE(got.ok());
    state = *got;
    if (state.bytes_done() == state.bytes_total()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  } while (Clock::now() < until);
  REQUIRE(state.bytes_done() == state.bytes_total());
  REQUIRE(state.phase() == v1::TRANSFERRING);
}

// Polls the transfer every 10 ms until it ends (or 10 s pass).
v1::TransferState WaitEnd(cli::AgentClient& client, const std::string& id) {
  const auto until = Clock::now() + std::chrono::seconds(10);
  v1::TransferState state;
  while (Clock::now() < until) {
    auto got = client.Get(id);
    REQUIRE(got.ok());
    state = *got;
    if (state.phase() != v1::PENDING && state.phase() != v1::TRANSFERRING) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return state;
}

// Polls the ended transfer every 10 ms until it reports drained (or 5 s pass), from
// its state at the end; returns the last state.
v1::TransferState WaitDrained(cli::AgentClient& client, const std::string& id,
                              v1::TransferState state) {
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (!state.drained() && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    auto got = client.Get(id);
    REQUIRE(got.ok());
    state = *got;
  }
  return state;
}

// 16 regions x 128 pages x 64 KiB (128 MiB), `--ucx-error-mode peer` (tcp), no
// same-host mapping, polls 60 s apart and no metadata stream: within a test, only the
// UCX endpoint notices a peer's death.
AgentPairOptions EndpointOnlyLargePair() {
  AgentPairOptions options;
  options.shape.layers = 8;
  options.shape.pages = 128;
  options.shape.page_bytes = 64 << 10;
  options.extra_args = {"--ucx-error-mode", "peer", "--shm-direct", "off", "--peer-refresh-ms",
                        "60000", "--metadata-push", "off"};
  return options;
}

// The transfer failed for the lost peer: UNAVAILABLE, the peer named, drained.
void CheckFailedForPeer(const v1::TransferState& state, const std::string& id) {
  INFO(state.DebugString());
  REQUIRE(state.phase() == v1::FAILED);
  CHECK(state.error_code() == kUnavailable);
  CHECK_THAT(state.error_message(),
             Catch::Contains(id) && Catch::Contains("peer 'decode'") &&
                 Catch::Contains("stopped answering") && Catch::Contains("kvagentd runs"));
  CHECK(state.drained());
  // Everything had been moved; the transfer was waiting for its next chunk.
  CHECK(state.failed_segment() == -1);
}

// A new submit to the lost peer is refused at once with UNAVAILABLE.
void CheckSubmitFailsFast(AgentPair& pair, const std::string& label) {
  const auto start = Clock::now();
  auto refused = pair.prefill().Submit(KvWrite("after-" + label, {5}, {6}));
  const int64_t ms = MillisSince(start);
  std::printf("%s: submit to the lost peer refused in %lld ms\n", label.c_str(),
              static_cast<long long>(ms));
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("peer 'decode'") && Catch::Contains("unreachable"));
  // At once: refused on the peer's state, not after a timeout (those are 2 s and up).
  // One gRPC round trip, which takes 1-5 ms here and more under ASan on a loaded CI
  // machine: 500 ms leaves it room and still tells the two apart.
  CHECK(ms < 500);
}

// One more kvagentd named `name`, its files in the pair's work dir under `subdir`, its
// local door at `socket` (empty: the default there).
cli::DaemonProcess StartAnother(AgentPair& pair, const std::string& name,
                                const std::string& subdir, const std::string& socket = "",
                                cli::NetworkDoor network = cli::NetworkDoor::kNone) {
  cli::DaemonOptions d;
  auto binary = cli::FindKvagentd("");
  REQUIRE(binary.ok());
  d.binary = *binary;
  d.name = name;
  d.work_dir = pair.work_dir() + "/" + subdir;
  d.local_socket = socket;
  d.network = network;
  std::filesystem::create_directories(d.work_dir);
  auto started = cli::DaemonProcess::Start(d);
  INFO(started.status().ToString());
  REQUIRE(started.ok());
  return *std::move(started);
}

TEST_CASE("a killed peer fails the open transfer within 2 s, and new submits at once") {
  AgentPair pair;
  OpenTransfer(pair, "open-kill");

  const auto killed = Clock::now();
  REQUIRE(::kill(pair.decode_process().pid(), SIGKILL) == 0);
  const v1::TransferState state = WaitEnd(pair.prefill(), "open-kill");
  const int64_t ms = MillisSince(killed);
  std::printf("SIGKILL: peer death -> transfer failed in %lld ms\n", static_cast<long long>(ms));
  CheckFailedForPeer(state, "open-kill");
  CHECK(ms <= 2000);
  CheckSubmitFailsFast(pair, "SIGKILL");

  auto peers = pair.prefill().Peers();
  REQUIRE(peers.ok());
  REQUIRE(peers->peers_size() == 1);
  CHECK(peers->peers(0).state() == "unreachable");
  pair.decode_process().Kill();  // reaps it
}

TEST_CASE("a hung peer (SIGSTOP) fails the open transfer within 2 s, and new submits at once") {
  AgentPair pair;
  OpenTransfer(pair, "open-stop");

  const pid_t decode = pair.decode_process().pid();
  const auto stopped = Clock::now();
  REQUIRE(SuspendAgent(decode) == "");
  const v1::TransferState state = WaitEnd(pair.prefill(), "open-stop");
  const int64_t ms = MillisSince(stopped);
  std::printf("SIGSTOP: peer hang -> transfer failed in %lld ms\n", static_cast<long long>(ms));
  CheckFailedForPeer(state, "open-stop");
  // Seen by the liveness door: its connection is up, its pings go unanswered.
  CHECK_THAT(state.error_message(), Catch::Contains("liveness door"));
  CHECK(ms <= 2000);
  CheckSubmitFailsFast(pair, "SIGSTOP");

  ::kill(decode, SIGCONT);
  pair.decode_process().Kill();
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// `--ucx-error-mode peer` (UCX 1.13 then carries the endpoint over tcp, even on one
// host) with polls 60 s apart and no metadata stream (whose end would also see the
// death): within this test only the UCX endpoint's error callback can notice it. The failure must name that path.
TEST_CASE("peer error mode: a killed peer fails the open transfer through the UCX endpoint error") {
  AgentPairOptions options;
  options.extra_args = {"--ucx-error-mode", "peer", "--shm-direct", "off", "--peer-refresh-ms",
                        "60000", "--metadata-push", "off"};
  AgentPair pair(options);
  auto peers = pair.prefill().Peers();
  REQUIRE(peers.ok());
  REQUIRE(peers->peers_size() == 1);
  INFO(peers->peers(0).DebugString());
  REQUIRE(peers->peers(0).error_mode() == "peer");
  // tcp has no native RMA: the data moves as the agents' own active messages.
  REQUIRE(peers->peers(0).data_path() == "ucx-am");
  REQUIRE_THAT(peers->peers(0).transports(), Catch::Contains("tcp"));
  OpenTransfer(pair, "open-ep");

  const auto killed = Clock::now();
  REQUIRE(::kill(pair.decode_process().pid(), SIGKILL) == 0);
  const v1::TransferState state = WaitEnd(pair.prefill(), "open-ep");
  const int64_t ms = MillisSince(killed);
  std::printf("SIGKILL (peer error mode, polls 60 s apart): peer death -> UCX endpoint error -> "
              "transfer failed in %lld ms\n",
              static_cast<long long>(ms));
  CheckFailedForPeer(state, "open-ep");
  CHECK_THAT(state.error_message(), Catch::Contains("its UCX endpoint failed"));
  CHECK_THAT(state.error_message(), !Catch::Contains("GetMetadata"));
  CHECK(ms <= 2000);
  CheckSubmitFailsFast(pair, "SIGKILL (peer error mode)");
  // The prefill log names the endpoint path.
  CHECK_THAT(ReadFile(pair.prefill_process().log_path()),
             Catch::Contains("peer 'decode' endpoint failed"));
  pair.decode_process().Kill();
}

// The same with a 128 MiB WRITE still moving (posted puts and their flush pending):
// UCX fails them, and the transfer ends through that, not through a poll.
TEST_CASE("peer error mode: a killed peer fails a WRITE in flight through UCX, not the poll") {
  const AgentPairOptions options = EndpointOnlyLargePair();
  AgentPair pair(options);
  std::vector<uint64_t> all;
  for (uint64_t p = 0; p < options.shape.pages; ++p) all.push_back(p);
  auto submitted = pair.prefill().Submit(KvWrite("inflight-ep", all, all));
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  // Once its first batch is posted (TRANSFERRING) and moving: no fixed sleep that a
  // fast machine could outrun.
  {
    absl::Status moving = WaitTransferring(pair.prefill(), "inflight-ep");
    INFO(moving.ToString());
    REQUIRE(moving.ok());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const auto killed = Clock::now();
  REQUIRE(::kill(pair.decode_process().pid(), SIGKILL) == 0);
  const v1::TransferState state = WaitEnd(pair.prefill(), "inflight-ep");
  const int64_t ms = MillisSince(killed);
  INFO(state.DebugString());
  std::printf("SIGKILL (peer error mode, polls 60 s apart) under a 128 MiB WRITE: transfer "
              "failed in %lld ms, %llu of %llu bytes confirmed: %s\n",
              static_cast<long long>(ms), static_cast<unsigned long long>(state.bytes_done()),
              static_cast<unsigned long long>(state.bytes_total()), state.error_message().c_str());
  REQUIRE(state.phase() != v1::COMPLETED);  // else: make the transfer bigger
  REQUIRE(state.phase() == v1::FAILED);
  CHECK(state.error_code() == kUnavailable);
  CHECK_THAT(state.error_message(), Catch::Contains("inflight-ep") &&
                                        Catch::Contains("peer 'decode'") &&
                                        Catch::Contains("UCX") && !Catch::Contains("GetMetadata"));
  // The peer's loss, not only the batch's failed flush: UCX fails the flush before it
  // calls the endpoint's error handler, and the agent marks the peer lost first, so
  // the submit below (sent once this is seen) finds the peer unreachable.
  CHECK_THAT(state.error_message(), Catch::Contains("its UCX endpoint failed") &&
                                        Catch::Contains("stopped answering"));
  CHECK(ms <= 2000);
  // drained once the posted batch's flush has completed (with its error).
  const v1::TransferState later = WaitDrained(pair.prefill(), "inflight-ep", state);
  std::printf("SIGKILL under a WRITE (peer error mode): drained %d, %lld ms after the kill\n",
              later.drained(), static_cast<long long>(MillisSince(killed)));
  CHECK(later.drained());
  CheckSubmitFailsFast(pair, "SIGKILL under a WRITE (peer error mode)");
  pair.decode_process().Kill();
}

// The other way round for a READ over tcp (data as the agents' messages): the agent
// whose memory is being read dies mid-READ. The reader's transfer fails through the UCX
// endpoint (not a poll), names the peer, drains once no read request can still land,
// its pages outside the READ are untouched, and the reader keeps answering.
TEST_CASE("peer error mode: a READ whose data owner dies mid-read fails through UCX and drains") {
  const AgentPairOptions options = EndpointOnlyLargePair();
  AgentPair pair(options);
  auto connected = pair.decode().Connect(pair.prefill_process().address());
  INFO(connected.status().ToString());
  REQUIRE(connected.ok());
  REQUIRE(connected->data_path() == "ucx-am");
  std::vector<uint64_t> pages;
  for (uint64_t p = 0; p + 1 < options.shape.pages; ++p) pages.push_back(p);  // not the last
  auto read = KvWrite("read-owner-dies", pages, pages);
  read.set_op(v1::READ);
  read.set_peer("prefill");
  REQUIRE(pair.decode().Submit(read).ok());
  {
    absl::Status moving = WaitTransferring(pair.decode(), "read-owner-dies");
    INFO(moving.ToString());
    REQUIRE(moving.ok());
  }
  const auto killed = Clock::now();
  REQUIRE(::kill(pair.prefill_process().pid(), SIGKILL) == 0);
  const v1::TransferState state = WaitEnd(pair.decode(), "read-owner-dies");
  const int64_t ms = MillisSince(killed);
  INFO(state.DebugString());
  REQUIRE(state.phase() != v1::COMPLETED);  // else: make the transfer bigger
  REQUIRE(state.phase() == v1::FAILED);
  CHECK(state.error_code() == kUnavailable);
  CHECK_THAT(state.error_message(), Catch::Contains("peer 'prefill'") &&
                                        Catch::Contains("its UCX endpoint failed"));
  CHECK(ms <= 2000);
  const v1::TransferState later = WaitDrained(pair.decode(), "read-owner-dies", state);
  std::printf("data owner SIGKILLed under a 127-page READ over tcp (ucx-am): FAILED in %lld ms, "
              "%llu of %llu bytes, drained %d %lld ms after the kill\n",
              static_cast<long long>(ms), static_cast<unsigned long long>(state.bytes_done()),
              static_cast<unsigned long long>(state.bytes_total()), later.drained(),
              static_cast<long long>(MillisSince(killed)));
  CHECK(later.drained());
  // The page outside the READ kept decode's own bytes; decode still answers.
  CHECK(pair.PageUntouched(options.shape.pages - 1));
  auto status = pair.decode().Status();
  INFO(status.status().ToString());
  CHECK(status.ok());
  pair.prefill_process().Kill();
}

// The other side of a transfer in flight loses the agent that started it (SIGKILL)
// with the data still moving: the receiver of a WRITE (decode), or the agent whose
// memory a READ reads (prefill). It must stay up, keep answering, and end the incoming
// transfer (at the initiator's deadline plus the grace, no outcome coming).
void OtherSideSurvivesInitiatorDeath(const std::string& mode, v1::TransferOp op) {
  const bool read = op == v1::READ;
  INFO("--ucx-error-mode " << mode << ", " << v1::TransferOp_Name(op));
  AgentPairOptions options;
  options.shape.layers = 8;
  options.shape.pages = 128;
  options.shape.page_bytes = 64 << 10;
  options.extra_args = {"--ucx-error-mode", mode, "--shm-direct", "off"};
  AgentPair pair(options);
  if (read) {
    auto connected = pair.decode().Connect(pair.prefill_process().address());
    INFO(connected.status().ToString());
    REQUIRE(connected.ok());
  }
  cli::AgentClient& initiator = read ? pair.decode() : pair.prefill();
  cli::DaemonProcess& initiator_process = read ? pair.decode_process() : pair.prefill_process();
  cli::AgentClient& other = read ? pair.prefill() : pair.decode();
  cli::DaemonProcess& other_process = read ? pair.prefill_process() : pair.decode_process();
  const std::string initiator_name = read ? "decode" : "prefill";
  const std::string other_name = read ? "prefill" : "decode";

  std::vector<uint64_t> all;
  for (uint64_t p = 0; p < options.shape.pages; ++p) all.push_back(p);
  auto request = KvWrite(fmt::format("orphaned-{}-{}", read ? "read" : "write", mode), all, all);
  if (read) {
    request.set_op(v1::READ);
    request.set_peer("prefill");
  }
  request.set_timeout_ms(1500);
  auto submitted = initiator.Submit(request);
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  {
    absl::Status moving = WaitTransferring(initiator, request.transfer_id());
    INFO(moving.ToString());
    REQUIRE(moving.ok());
  }
  // The other side knows the transfer (its open arrived): the initiator is TRANSFERRING
  // once it posted its first operations, and its open may still be on the way (seen
  // once under ASan: the record never came, and nothing was there to end).
  {
    const auto until = Clock::now() + std::chrono::milliseconds(5000);
    while (!other.Get(request.transfer_id(), initiator_name).ok() && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    REQUIRE(other.Get(request.transfer_id(), initiator_name).ok());
  }
  auto before = initiator.Get(request.transfer_id());
  REQUIRE(before.ok());
  REQUIRE(before->phase() != v1::COMPLETED);  // else: make the transfer bigger
  REQUIRE(::kill(initiator_process.pid(), SIGKILL) == 0);
  const auto killed = Clock::now();
  // The other side answers, and its incoming record ends, for 5 s after the kill.
  v1::TransferState incoming;
  bool ended = false;
  while (MillisSince(killed) < 5000) {
    if (!Alive(other_process.pid())) {
      const std::string log = ReadFile(other_process.log_path());
      FAIL(other_name << " died " << MillisSince(killed) << " ms after " << initiator_name
                      << " was killed; the end of its log:\n"
                      << log.substr(log.size() > 3000 ? log.size() - 3000 : 0));
    }
    auto status = other.Status();
    INFO(status.status().ToString());
    REQUIRE(status.ok());
    auto got = other.Get(request.transfer_id(), initiator_name);
    if (got.ok()) {
      incoming = *got;
      ended = incoming.phase() != v1::PENDING && incoming.phase() != v1::TRANSFERRING;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::printf("%s SIGKILLed under a 128 MiB %s (error mode %s): %s alive and answering 5 s "
              "later; its incoming record: %s %s\n",
              initiator_name.c_str(), v1::TransferOp_Name(op).c_str(), mode.c_str(),
              other_name.c_str(), v1::TransferPhase_Name(incoming.phase()).c_str(),
              incoming.error_message().c_str());
  CHECK(ended);
  CHECK_THAT(incoming.error_message(),
             Catch::Contains(read ? "our pages were only read" : "hold no reliable data"));
  initiator_process.Kill();
}

// Same host, UCX without error handling: shared memory and cma, UCX's own RMA.
TEST_CASE("the receiver of a WRITE in flight survives its sender's death (UCX shared memory)") {
  OtherSideSurvivesInitiatorDeath("none", v1::WRITE);
}

// `peer` mode: tcp, where UCX 1.13 emulates a put with active messages and the
// receiving worker answers each with an acknowledgement; when the sender died while
// the receiver handled its puts, that answer failed and UCX aborted the receiving
// process (ucp_request.inl "Fatal: unexpected error: Endpoint timeout", from
// ucp_put_handler): 3 runs of 62 on a loaded machine before the agents moved data over
// tcp as their own eager active messages (Route::kAmWrite), which nothing answers at
// the UCX level.
TEST_CASE("the receiver of a WRITE in flight survives its sender's death (UCX tcp, peer mode)") {
  OtherSideSurvivesInitiatorDeath("peer", v1::WRITE);
}

// The mirror: the agent whose memory a READ reads, when the reader dies. Over UCX's
// emulated get its worker answered each get itself (ucp_get_req_handler, 1 abort in 30
// runs); over the agents' read requests it replies eagerly, and a reply to a dead
// peer fails like any send.
TEST_CASE("the agent read by a READ in flight survives its reader's death (UCX tcp, peer mode)") {
  OtherSideSurvivesInitiatorDeath("peer", v1::READ);
}

TEST_CASE("the agent read by a READ in flight survives its reader's death (UCX shared memory)") {
  OtherSideSurvivesInitiatorDeath("none", v1::READ);
}

bool PagesEqual(const cli::KvPool& src, uint64_t src_page, const cli::KvPool& dst,
                uint64_t dst_page) {
  for (uint32_t r = 0; r < src.regions(); ++r) {
    if (std::memcmp(src.Page(r, src_page), dst.Page(r, dst_page), src.shape.page_bytes) != 0) {
      return false;
    }
  }
  return true;
}

TEST_CASE("a peer restarted under the same name: the old transfer failed, new ones move bytes") {
  AgentPair pair;
  auto before = pair.prefill().Peers();
  REQUIRE(before.ok());
  REQUIRE(before->peers_size() == 1);
  const uint64_t old_incarnation = before->peers(0).incarnation();
  OpenTransfer(pair, "open-restart");

  pair.decode_process().Kill();

  // A new process under the same name, on a new port.
  cli::DaemonProcess decode2 = StartAnother(pair, "decode", "restarted");
  cli::AgentClient client2(decode2.address());
  auto status2 = client2.Status();
  REQUIRE(status2.ok());
  REQUIRE(status2->incarnation() != old_incarnation);
  auto pool = cli::CreateKvPool(client2, "decode", pair.decode_pool().shape);
  INFO(pool.status().ToString());
  REQUIRE(pool.ok());
  std::memset(pool->mapping.data(), 0xEE, pool->bytes());

  // ConnectPeer with the new address replaces the old entry of the same name.
  auto connected = pair.prefill().Connect(decode2.address());
  INFO(connected.status().ToString());
  REQUIRE(connected.ok());
  CHECK(connected->incarnation() == status2->incarnation());
  auto after = pair.prefill().Peers();
  REQUIRE(after.ok());
  REQUIRE(after->peers_size() == 1);
  CHECK(after->peers(0).name() == "decode");
  CHECK(after->peers(0).incarnation() == status2->incarnation());
  CHECK(after->peers(0).address() == decode2.address());
  CHECK(after->peers(0).state() == "connected");

  // The transfer open to the old process was failed, by its death or its restart.
  const v1::TransferState old_state = WaitEnd(pair.prefill(), "open-restart");
  INFO(old_state.DebugString());
  REQUIRE(old_state.phase() == v1::FAILED);
  CHECK(old_state.error_code() == kUnavailable);
  CHECK_THAT(old_state.error_message(),
             Catch::Contains("peer 'decode'") &&
                 (Catch::Contains("restarted") || Catch::Contains("stopped answering")));

  // New transfers to the same group reach the new process's memory.
  const std::vector<uint64_t> src = {3, 7, 8, 30};
  const std::vector<uint64_t> dst = {1, 2, 3, 31};
  auto submitted = pair.prefill().Submit(KvWrite("after-restart", src, dst, "restarted-ok"));
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  auto done = pair.prefill().WaitTransfer("after-restart", 20000);
  REQUIRE(done.ok());
  INFO(done->error_message());
  REQUIRE(done->phase() == v1::COMPLETED);
  for (size_t i = 0; i < src.size(); ++i) CHECK(PagesEqual(pair.prefill_pool(), src[i], *pool, dst[i]));
  CHECK(pool->Page(0, 0)[0] == 0xEE);
  CHECK(pool->Page(pool->regions() - 1, 30)[100] == 0xEE);
  auto stopped = decode2.Stop(10000);
  REQUIRE(stopped.ok());
  CHECK(*stopped == 0);
}

TEST_CASE("a same-host peer restarted on the same socket is picked up by the poll alone") {
  AgentPair pair;
  auto before = pair.prefill().Peers();
  REQUIRE(before.ok());
  REQUIRE(before->peers_size() == 1);
  const uint64_t old_incarnation = before->peers(0).incarnation();
  const std::string socket = pair.decode_process().local_socket();
  pair.decode_process().Kill();

  // The new process takes over the stale socket at the same path; nobody calls
  // ConnectPeer: the poll finds the agent there does not know its session, attaches
  // again and installs the new incarnation.
  cli::DaemonProcess decode2 = StartAnother(pair, "decode", "same-socket", socket);
  cli::AgentClient client2(decode2.address());
  auto pool = cli::CreateKvPool(client2, "decode", pair.decode_pool().shape);
  INFO(pool.status().ToString());
  REQUIRE(pool.ok());
  std::memset(pool->mapping.data(), 0xEE, pool->bytes());

  const auto start = Clock::now();
  uint64_t incarnation = old_incarnation;
  std::string state;
  while (Clock::now() - start < std::chrono::seconds(10)) {
    auto peers = pair.prefill().Peers();
    REQUIRE(peers.ok());
    REQUIRE(peers->peers_size() == 1);
    incarnation = peers->peers(0).incarnation();
    state = peers->peers(0).state();
    if (incarnation != old_incarnation && state == "connected") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::printf("same-socket restart: new incarnation connected after %lld ms\n",
              static_cast<long long>(MillisSince(start)));
  REQUIRE(incarnation != old_incarnation);
  REQUIRE(state == "connected");
  const std::vector<uint64_t> src = {4, 5};
  const std::vector<uint64_t> dst = {6, 9};
  auto submitted = pair.prefill().Submit(KvWrite("after-same-socket", src, dst));
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  auto done = pair.prefill().WaitTransfer("after-same-socket", 20000);
  REQUIRE(done.ok());
  INFO(done->error_message());
  REQUIRE(done->phase() == v1::COMPLETED);
  for (size_t i = 0; i < src.size(); ++i) CHECK(PagesEqual(pair.prefill_pool(), src[i], *pool, dst[i]));
}

// A peer that is up but slow to answer the first handshake (a loaded node: here it is
// stopped for 800 ms while ConnectPeer dials it) is connected once it answers, within
// the connect deadline. gRPC gives one connection attempt only its "min reconnect
// backoff" (it was 200 ms): the handshake timed out and ConnectPeer failed UNAVAILABLE.
TEST_CASE("a peer slow to answer its first handshake is connected once it answers") {
  AgentPairOptions options;
  options.extra_args = {"--insecure-listen", "127.0.0.1:0"};  // dials plain TCP peers
  AgentPair pair(options);
  // Its network door (plain TCP here): dialled by gRPC alone. (A unix: address first
  // attaches a session, which waits for the stopped agent by itself.)
  cli::DaemonProcess late = StartAnother(pair, "late", "late", "", cli::NetworkDoor::kInsecure);
  REQUIRE(::kill(late.pid(), SIGSTOP) == 0);
  const auto start = Clock::now();
  absl::StatusOr<v1::PeerInfo> connected = absl::UnknownError("not called");
  std::thread dial([&] { connected = pair.prefill().Connect(late.network_address()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  REQUIRE(::kill(late.pid(), SIGCONT) == 0);
  dial.join();
  std::printf("ConnectPeer to an agent stopped for its first 800 ms: %s after %lld ms\n",
              connected.status().ToString().c_str(), static_cast<long long>(MillisSince(start)));
  INFO(connected.status().ToString());
  REQUIRE(connected.ok());
  CHECK(connected->name() == "late");
  auto peers = pair.prefill().Peers();
  REQUIRE(peers.ok());
  bool found = false;
  for (const auto& p : peers->peers()) found |= p.name() == "late" && p.state() == "connected";
  CHECK(found);
}

// UCX 1.13 keeps an endpoint that has a connection from its peer until the worker is
// destroyed when it has no peer error handling, as same-host peers have none: each
// restart of a same-host peer left one endpoint behind in the agent it had connected
// to (held against --ucx-peer-endpoints: after 1,024 restarts no new peer could
// connect) and one in each agent that had connected to it, with that process's receive
// FIFO still mapped. An endpoint to a same-host process that ended is destroyed now.
// Seen through the agents' metrics: kvagent_ucx_endpoints counts every endpoint UCX
// holds. Ended transfers kept for queries keep their peer's endpoint (for their
// notices), so one is kept here: the last transfer's.
AgentPairOptions CountedEndpointsPair() {
  AgentPairOptions options;
  options.extra_args = {"--metrics-listen", "127.0.0.1:0", "--ended-transfers-kept", "1"};
  return options;
}

// Polls metric `name` at `metrics` every 20 ms until it equals `want` (up to 10 s: the
// worker looks for processes that ended once a second, and destroys an endpoint at the
// look after the one that saw its process ended); returns the last value.
double WaitMetric(const std::string& metrics, const std::string& name, double want) {
  const auto until = Clock::now() + std::chrono::seconds(10);
  double now = Value(Scrape(metrics), name);
  while (now != want && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    now = Value(Scrape(metrics), name);
  }
  return now;
}

// One WRITE from `client` (pool `src`) to pages of decode's pool `dst`, checked byte
// for byte.
void WriteChecked(cli::AgentClient& client, const cli::KvPool& src, const cli::KvPool& dst,
                  const std::string& id) {
  const std::vector<uint64_t> from = {1, 6};
  const std::vector<uint64_t> to = {20, 27};
  auto submitted = client.Submit(KvWrite(id, from, to));
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  auto done = client.WaitTransfer(id, 20000);
  REQUIRE(done.ok());
  INFO(done->error_message());
  REQUIRE(done->phase() == v1::COMPLETED);
  for (size_t i = 0; i < from.size(); ++i) CHECK(PagesEqual(src, from[i], dst, to[i]));
}

// Another kvagentd named `name` (files under `subdir`) with a pool shaped as the pair's,
// every byte of page P set to `fill` + P % 16.
struct AnotherAgent {
  cli::DaemonProcess process;
  std::unique_ptr<cli::AgentClient> client;
  cli::KvPool pool;
};
AnotherAgent StartWithPool(AgentPair& pair, const std::string& name, const std::string& subdir,
                           int fill) {
  AnotherAgent agent{StartAnother(pair, name, subdir), nullptr, {}};
  agent.client = std::make_unique<cli::AgentClient>(agent.process.address());
  auto pool = cli::CreateKvPool(*agent.client, name, pair.prefill_pool().shape);
  INFO(pool.status().ToString());
  REQUIRE(pool.ok());
  agent.pool = *std::move(pool);
  for (uint64_t page = 0; page < agent.pool.shape.pages; ++page) {
    for (uint32_t r = 0; r < agent.pool.regions(); ++r) {
      std::memset(agent.pool.Page(r, page), static_cast<int>(fill + page % 16),
                  agent.pool.shape.page_bytes);
    }
  }
  return agent;
}

TEST_CASE(
    "a same-host peer restarted again and again leaves no UCX endpoint behind in the "
    "agent it connects to") {
  AgentPair pair(CountedEndpointsPair());
  const std::string metrics = MetricsAddress(pair.decode());
  // Prefill's endpoint made decode's UCX make one for its request.
  REQUIRE(Value(Scrape(metrics), "kvagent_ucx_peer_endpoints") == 1);
  pair.prefill_process().Kill();
  for (int i = 0; i < 4; ++i) {
    INFO("restart " << i);
    AnotherAgent prefill = StartWithPool(pair, "prefill", fmt::format("p{}", i), 0x10 * i + 1);
    auto connected = prefill.client->Connect(pair.decode_process().address());
    INFO(connected.status().ToString());
    REQUIRE(connected.ok());
    WriteChecked(*prefill.client, prefill.pool, pair.decode_pool(), fmt::format("restart-{}", i));
    // The one decode made for this prefill; the previous process's went when it ended.
    CHECK(WaitMetric(metrics, "kvagent_ucx_peer_endpoints", 1) == 1);
    prefill.process.Kill();
    CHECK(WaitMetric(metrics, "kvagent_ucx_endpoints", 0) == 0);
  }
  const std::string body = Scrape(metrics);
  // The first prefill's and each restart's: without the release, 5 stay.
  CHECK(Value(body, "kvagent_ucx_endpoints_reclaimed_total") == 5);
  CHECK(Value(body, "kvagent_ucx_peer_endpoints_peak") <= 2);
  CHECK(Value(body, "kvagent_ucx_peer_endpoints_refused_total") == 0);
  // Decode still takes a new peer's connection and data.
  AnotherAgent prefill = StartWithPool(pair, "prefill", "last", 0x51);
  REQUIRE(prefill.client->Connect(pair.decode_process().address()).ok());
  WriteChecked(*prefill.client, prefill.pool, pair.decode_pool(), "after-restarts");
}

TEST_CASE(
    "an agent connecting to a same-host peer that restarts keeps no UCX endpoint to a "
    "process that ended") {
  AgentPair pair(CountedEndpointsPair());
  const std::string metrics = MetricsAddress(pair.prefill());
  REQUIRE(Value(Scrape(metrics), "kvagent_ucx_endpoints") == 1);  // to decode
  pair.decode_process().Kill();
  double reclaimed = 0;
  for (int i = 0; i < 3; ++i) {
    INFO("restart " << i);
    AnotherAgent decode = StartWithPool(pair, "decode", fmt::format("d{}", i), 0xE0);
    auto connected = pair.prefill().Connect(decode.process.address());
    INFO(connected.status().ToString());
    REQUIRE(connected.ok());
    WriteChecked(pair.prefill(), pair.prefill_pool(), decode.pool, fmt::format("to-restart-{}", i));
    // The new process's endpoint only: the one to the process before went once the
    // transfer record that kept it did (ended transfers kept: 1).
    CHECK(WaitMetric(metrics, "kvagent_ucx_endpoints", 1) == 1);
    const double now = Value(Scrape(metrics), "kvagent_ucx_endpoints_reclaimed_total");
    CHECK(now > reclaimed);
    reclaimed = now;
    decode.process.Kill();
  }
}

TEST_CASE(
    "an endpoint to a same-host peer disconnected while it runs stays until the process "
    "ends, then goes") {
  AgentPair pair(CountedEndpointsPair());
  const std::string metrics = MetricsAddress(pair.prefill());
  REQUIRE(Value(Scrape(metrics), "kvagent_ucx_endpoints") == 1);  // to decode
  auto disconnected = pair.prefill().Disconnect("decode");
  INFO(disconnected.status().ToString());
  REQUIRE(disconnected.ok());
  // UCX may still need it for what the running peer sends on its own endpoint.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  CHECK(Value(Scrape(metrics), "kvagent_ucx_endpoints") == 1);
  CHECK(Value(Scrape(metrics), "kvagent_ucx_endpoints_reclaimed_total") == 0);
  // Ended, not yet reaped: a zombie still has its /proc entry.
  REQUIRE(::kill(pair.decode_process().pid(), SIGKILL) == 0);
  CHECK(WaitMetric(metrics, "kvagent_ucx_endpoints", 0) == 0);
  CHECK(Value(Scrape(metrics), "kvagent_ucx_endpoints_reclaimed_total") == 1);
}

// While this agent's messages wait on a stopped same-host peer's full receive queue, arm
// says busy for as long as they wait. An endpoint to another same-host process that
// ended is released only once an arm said OK (ReclaimGate), which never came: every
// same-host reclaim of the agent waited on the stopped peer. A receive side found quiet
// now counts as OK.
TEST_CASE(
    "an agent whose messages wait on a stopped same-host peer still lets go of the "
    "endpoint to another that ended") {
  AgentPairOptions options = CountedEndpointsPair();
  options.shape.layers = 1;
  options.shape.pages = 600;
  options.shape.page_bytes = 4096;
  AgentPair pair(options);
  const std::string metrics = MetricsAddress(pair.prefill());
  REQUIRE(Value(Scrape(metrics), "kvagent_ucx_endpoints") == 1);  // to decode
  AnotherAgent other = StartWithPool(pair, "other", "other", 0xE1);
  auto connected = pair.prefill().Connect(other.process.address());
  INFO(connected.status().ToString());
  REQUIRE(connected.ok());
  auto to_other = KvWrite("to-other", {1}, {20});
  to_other.set_peer("other");
  REQUIRE(pair.prefill().Submit(to_other).ok());
  auto done = pair.prefill().WaitTransfer("to-other", 20000);
  REQUIRE(done.ok());
  INFO(done->error_message());
  REQUIRE(done->phase() == v1::COMPLETED);
  CHECK(Value(Scrape(metrics), "kvagent_ucx_endpoints") == 2);
  REQUIRE(pair.prefill().Disconnect("other").ok());
  const pid_t decode = pair.decode_process().pid();
  REQUIRE(SuspendAgent(decode) == "");
  // More DATA_READY messages than decode's receive queue holds (256 slots); their
  // records also push out the one that kept the endpoint to `other` (ended transfers
  // kept: 1).
  for (uint64_t page = 0; page < 600; ++page) {
    auto request = KvWrite(fmt::format("wait-{}", page), {page}, {page}, "n");
    request.set_timeout_ms(30000);
    REQUIRE(pair.prefill().Submit(request).ok());
  }
  std::this_thread::sleep_for(std::chrono::seconds(2));  // they wait in prefill's UCX
  other.process.Kill();
  CHECK(WaitMetric(metrics, "kvagent_ucx_endpoints", 1) == 1);  // decode's only
  CHECK(Value(Scrape(metrics), "kvagent_ucx_endpoints_reclaimed_total") == 1);
  const auto status = pair.prefill().Status();
  REQUIRE(status.ok());
  CHECK(status->health().find("UCX receive queue") == std::string::npos);
  ::kill(decode, SIGCONT);
}

}  // namespace
}  // namespace kvagent::testing

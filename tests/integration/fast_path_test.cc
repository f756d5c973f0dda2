// The local fast path (client/fast_path, agent/fast_path) between two real kvagentd
// processes: the same transfers, checks, errors, cancels, deadlines and peer deaths
// as gRPC submission, bytes compared in shared memory; then what a careless or
// hostile client does to its ring (garbage entries, impossible counters, a truncated
// file, a lost doorbell, a full ring, a client killed mid-flight). The agent stays up
// and an honest transfer is byte-exact after each.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "catch2/catch.hpp"
#include "cli/child_process.h"
#include "client/fast_path.h"
#include "client/fast_ring.h"
#include "client/local_session.h"
#include "client/session_wire.h"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"
#include "tests/integration/metrics_scrape.h"

namespace kvagent::testing {
namespace {

namespace fr = client::fastring;
using client::FastCompletion;
using client::FastPath;
using Catch::Matchers::Contains;

std::unique_ptr<FastPath> OpenFast(cli::AgentClient& client, client::FastPathOptions options = {}) {
  auto session = client.Session();
  REQUIRE(session.ok());
  auto fast = FastPath::Open(*session, options);
  INFO(fast.status().ToString());
  REQUIRE(fast.ok());
  return *std::move(fast);
}

// Reaps until `count` completions came or `timeout_ms` passed.
std::vector<FastCompletion> ReapN(FastPath& fast, size_t count, uint32_t timeout_ms = 20000) {
  std::vector<FastCompletion> out;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (out.size() < count && std::chrono::steady_clock::now() < until) {
    auto got = fast.Reap(&out, count - out.size(), absl::Milliseconds(100));
    INFO(got.status().ToString());
    REQUIRE(got.ok());
  }
  return out;
}

FastCompletion ReapOne(FastPath& fast, uint32_t timeout_ms = 20000) {
  auto got = ReapN(fast, 1, timeout_ms);
  REQUIRE(got.size() == 1);
  return got[0];
}

// For tests that SIGSTOP the decode agent: with the default 200 ms refresh a stopped
// peer is marked unreachable (its transfers failed) within 1.2 s, which a loaded
// machine can reach before the test's checks; 1 s polls put that at 6 s.
AgentPairOptions StoppablePeer(std::vector<std::string> extra = {}) {
  AgentPairOptions options;
  options.extra_args = std::move(extra);
  options.extra_args.push_back("--peer-refresh-ms");
  options.extra_args.push_back("1000");
  return options;
}

// Another client of `agent`: its sessions own nothing of the pairs' pools (with
// --scheduler-uids none, nor may they use what others own).
std::unique_ptr<cli::AgentClient> Stranger(cli::DaemonProcess& agent) {
  cli::AgentClientOptions options;
  options.client_name = "stranger";
  return std::make_unique<cli::AgentClient>(agent.address(), options);
}

// The fast path submits asynchronously: waits until the agent took `id`.
void WaitKnown(cli::AgentClient& client, const std::string& id) {
  for (int i = 0; i < 2000; ++i) {
    if (client.Get(id).ok()) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  FAIL("transfer " << id << " never appeared");
}

// A completion holds the transfer's final phase, error code and message, bytes and
// latency: those the agent's state of it (GetTransfer) holds.
void CheckCompletionIsState(cli::AgentClient& client, const std::string& id,
                            const FastCompletion& c) {
  auto state = client.Get(id);
  REQUIRE(state.ok());
  CHECK(c.phase == state->phase());
  CHECK(static_cast<int32_t>(c.code) == state->error_code());
  if (state->error_message().size() <= fr::kMaxMessage) {
    CHECK(c.message == state->error_message());
  } else {  // cut to fit the entry (it says where to read the rest)
    CHECK(c.message.size() <= fr::kMaxMessage);
    CHECK(c.message.substr(0, 40) == state->error_message().substr(0, 40));
  }
  CHECK(c.bytes_done == state->bytes_done());
  CHECK(c.latency_us == state->latency_us());
}

void HonestFastWrite(AgentPair& pair, FastPath& fast, const std::string& id, uint64_t src,
                     uint64_t dst) {
  REQUIRE(fast.Submit(KvWrite(id, {src}, {dst}), 999).ok());
  FastCompletion c = ReapOne(fast);
  INFO(c.message);
  CHECK(c.user_data == 999);
  CHECK(c.phase == v1::COMPLETED);
  CHECK(pair.PageEqual(src, dst));
}

TEST_CASE("fast path: a WRITE moves pages byte-exact and the peer is notified") {
  AgentPair pair;
  auto fast = OpenFast(pair.prefill());
  CHECK(fast->info().submission_slots() == fr::kDefaultEntries);
  // This agent takes watches: a client checks the bit before it sends one (an older
  // agent, without it, closes the whole ring on opcode 4).
  CHECK(fast->info().features() == fr::kFeatures);
  CHECK(fast->delivers_notifications());
  REQUIRE(fast->Submit(KvWrite("fast-1", {3, 4, 9}, {30, 1, 17}, "first-token:7"), 42).ok());
  FastCompletion c = ReapOne(*fast);
  INFO(c.message);
  CHECK(c.user_data == 42);
  CHECK(c.opcode == fr::kSubmit);
  CHECK(c.code == absl::StatusCode::kOk);
  CHECK(c.phase == v1::COMPLETED);
  CHECK(c.bytes_done == 3 * 8 * 4096);
  CHECK(c.latency_us > 0);
  CHECK(pair.PageEqual(3, 30));
  CHECK(pair.PageEqual(4, 1));
  CHECK(pair.PageEqual(9, 17));
  CHECK(pair.PageUntouched(2));
  CheckCompletionIsState(pair.prefill(), "fast-1", c);
  // The same transfer as gRPC sees it.
  auto state = pair.prefill().Get("fast-1");
  REQUIRE(state.ok());
  CHECK(state->phase() == v1::COMPLETED);
  CHECK(state->drained());
  // The receiver's notification, as for any transfer.
  std::vector<v1::Notification> notes;
  for (int i = 0; i < 200 && notes.empty(); ++i) {
    auto polled = pair.decode().Poll(0);
    REQUIRE(polled.ok());
    for (const auto& n : polled->notifications()) notes.push_back(n);
    if (notes.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].transfer_id() == "fast-1");
  CHECK(notes[0].payload() == "first-token:7");
  auto status = pair.prefill().Status();
  REQUIRE(status.ok());
  CHECK(status->fast_path_rings() == 1);
  CHECK(status->fast_path_entries() == 1);
  CHECK(status->fast_path_protocol_errors() == 0);
}

TEST_CASE("fast path: an agent run with --fast-path off refuses a ring, saying to use gRPC") {
  AgentPairOptions off;
  off.extra_args = {"--fast-path", "off"};
  AgentPair pair(off);
  auto session = pair.prefill().Session();
  REQUIRE(session.ok());
  auto refused = FastPath::Open(*session);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kUnimplemented);
  CHECK_THAT(std::string(refused.status().message()), Contains("submit through gRPC"));
  // The session and gRPC submission go on.
  REQUIRE(pair.prefill().Submit(KvWrite("grpc-instead", {1}, {2})).ok());
  auto done = pair.prefill().WaitTransfer("grpc-instead", 20000);
  REQUIRE(done.ok());
  CHECK(done->phase() == v1::COMPLETED);
  CHECK(pair.PageEqual(1, 2));
}

TEST_CASE("fast path: 64 transfers behind one doorbell, completions reaped in a batch") {
  AgentPair pair;
  auto fast = OpenFast(pair.prefill());
  for (uint64_t i = 0; i < 32; ++i) {
    REQUIRE(fast->Submit(KvWrite(fmt::format("b{}", i), {i}, {31 - i}), i, /*publish=*/false).ok());
  }
  for (uint64_t i = 32; i < 64; ++i) REQUIRE(fast->Ping(i, /*publish=*/false).ok());
  CHECK(fast->outstanding() == 64);
  fast->Publish();
  auto done = ReapN(*fast, 64);
  REQUIRE(done.size() == 64);
  std::vector<bool> seen(64);
  for (const auto& c : done) {
    REQUIRE(c.user_data < 64);
    seen[c.user_data] = true;
    INFO(c.message);
    CHECK(c.code == absl::StatusCode::kOk);
    if (c.user_data < 32) CHECK(c.phase == v1::COMPLETED);
    if (c.user_data >= 32) CHECK(c.opcode == fr::kPing);
  }
  CHECK(std::count(seen.begin(), seen.end(), true) == 64);
  for (uint64_t i = 0; i < 32; ++i) CHECK(pair.PageEqual(i, 31 - i));
  CHECK(fast->outstanding() == 0);
}

// Reap(min 8) on its own thread while 8 pings are published 20 ms apart: returns the
// 8, and how many times it slept.
struct CountedReap {
  absl::StatusOr<size_t> got = size_t{0};
  std::vector<FastCompletion> out;
  uint64_t sleeps = 0;
  absl::Status pinged;  // the first ping refused, if any
};
CountedReap ReapEightPingsSpaced(FastPath& fast, uint64_t first_user_data) {
  CountedReap r;
  const uint64_t sleeps_before = fast.sleeps();
  std::thread reaper([&] { r.got = fast.Reap(&r.out, 64, absl::Seconds(20), 8); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // asleep by now
  for (uint64_t i = 0; i < 8; ++i) {
    // Asserted by the caller, after the join (a throw here would leave the thread).
    if (absl::Status pinged = fast.Ping(first_user_data + i); !pinged.ok() && r.pinged.ok()) {
      r.pinged = pinged;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  reaper.join();
  r.sleeps = fast.sleeps() - sleeps_before;
  return r;
}

TEST_CASE("fast path: a Reap waiting for 8 completions sleeps once; the agent rings when the 8th comes") {
  for (const bool wake_count : {true, false}) {
    DYNAMIC_SECTION((wake_count ? "an agent with kFeatureWakeCount" : "--fast-path-features 3")) {
      AgentPairOptions options;
      if (!wake_count) options.extra_args = {"--fast-path-features", "3"};
      AgentPair pair(options);
      auto fast = OpenFast(pair.prefill());
      CHECK(((fast->info().features() & fr::kFeatureWakeCount) != 0) == wake_count);
      CountedReap r = ReapEightPingsSpaced(*fast, 100);
      REQUIRE(r.pinged.ok());
      INFO(r.got.status().ToString());
      REQUIRE(r.got.ok());
      CHECK(*r.got == 8);
      REQUIRE(r.out.size() == 8);
      for (uint64_t i = 0; i < 8; ++i) {
        CHECK(r.out[i].opcode == fr::kPing);
        CHECK(r.out[i].user_data == 100 + i);
      }
      INFO("slept " << r.sleeps << " times");
      if (wake_count) {
        // One sleep, one doorbell: the agent left the 7 before unrung.
        CHECK(r.sleeps == 1);
      } else {
        // The older agent rings at the first: the client takes it and sleeps again.
        CHECK(r.sleeps >= 2);
      }
      // Fewer than wanted come before the timeout: those are returned then.
      for (uint64_t i = 0; i < 3; ++i) REQUIRE(fast->Ping(200 + i).ok());
      std::vector<FastCompletion> out;
      const auto start = std::chrono::steady_clock::now();
      auto got = fast->Reap(&out, 64, absl::Milliseconds(300), 8);
      REQUIRE(got.ok());
      CHECK(*got == 3);
      CHECK(std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(250));
      // A min above max waits for max.
      for (uint64_t i = 0; i < 3; ++i) REQUIRE(fast->Ping(300 + i).ok());
      out.clear();
      got = fast->Reap(&out, 2, absl::Seconds(20), 8);
      REQUIRE(got.ok());
      CHECK(*got == 2);
      out.clear();
      got = fast->Reap(&out, 64, absl::Seconds(20), 1);
      REQUIRE(got.ok());
      CHECK(*got == 1);
      // The pair still moves bytes.
      HonestFastWrite(pair, *fast, "after-counted-reap", 3, 4);
      // More wanted than the completion ring holds: the agent takes the second half only
      // once the first is reaped, so the wait is for a ring's worth at a time (else it
      // would sleep to its timeout with 8 posted and 8 not taken).
      cli::AgentClient small_client(pair.prefill_process().address());
      client::FastPathOptions small;
      small.submission_slots = 32;
      small.completion_entries = 8;
      auto ring = OpenFast(small_client, small);
      for (uint64_t i = 0; i < 16; ++i) REQUIRE(ring->Ping(400 + i, /*publish=*/false).ok());
      ring->Publish();
      out.clear();
      const auto wide = std::chrono::steady_clock::now();
      got = ring->Reap(&out, 64, absl::Seconds(20), 16);
      REQUIRE(got.ok());
      CHECK(*got == 16);
      CHECK(std::chrono::steady_clock::now() - wide < std::chrono::seconds(10));
    }
  }
}

TEST_CASE("fast path: bad requests come back with gRPC's code and message; a second ring is refused") {
  AgentPair pair;
  auto fast = OpenFast(pair.prefill());
  auto bad_group = KvWrite("bad-1", {1}, {2});
  bad_group.mutable_segments(0)->mutable_items()->set_local_group("no-such-group");
  auto out_of_range = KvWrite("bad-2", {1000}, {2});
  auto no_peer = KvWrite("bad-3", {1}, {2});
  no_peer.set_peer("nobody");
  for (const auto& request : {bad_group, out_of_range, no_peer}) {
    REQUIRE(fast->Submit(request, 1).ok());
    FastCompletion c = ReapOne(*fast);
    auto grpc = pair.prefill().Submit(request);
    REQUIRE_FALSE(grpc.ok());
    INFO(request.transfer_id() << ": fast '" << c.message << "', gRPC '"
                               << grpc.status().message() << "'");
    CHECK(c.code == grpc.status().code());
    CHECK(c.message == std::string(grpc.status().message()));
    CHECK(c.phase == v1::TRANSFER_PHASE_UNSPECIFIED);
  }
  // A retry of the same request is answered with its state; a transfer id reused for
  // another request is refused, as through gRPC.
  HonestFastWrite(pair, *fast, "dup", 5, 6);
  REQUIRE(fast->Submit(KvWrite("dup", {5}, {6}), 2).ok());
  FastCompletion retry = ReapOne(*fast);
  CHECK(retry.phase == v1::COMPLETED);
  REQUIRE(fast->Submit(KvWrite("dup", {5}, {7}), 2).ok());
  FastCompletion dup = ReapOne(*fast);
  CHECK(dup.code == absl::StatusCode::kAlreadyExists);
  CHECK_THAT(dup.message, Contains("already submitted with different content"));
  CHECK(pair.PageUntouched(7));
  // One ring per session.
  auto session = pair.prefill().Session();
  REQUIRE(session.ok());
  auto second = FastPath::Open(*session);
  REQUIRE_FALSE(second.ok());
  CHECK(second.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(second.status().message()), Contains("one per session"));
  // Sizes out of range name the field.
  cli::AgentClient other(pair.prefill_process().address());
  auto other_session = other.Session();
  REQUIRE(other_session.ok());
  client::FastPathOptions odd;
  odd.submission_slots = 1000;
  auto refused = FastPath::Open(*other_session, odd);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.status().message()), Contains("submission_slots is 1000"));
  // A request too large for one entry is refused by the client, before the ring.
  client::FastPathOptions small;
  small.submission_slots = 8;
  auto tiny = OpenFast(other, small);
  auto big = KvWrite("big", {}, {});
  for (int i = 0; i < 2000; ++i) big.mutable_segments(0)->mutable_items()->add_local_indices(1);
  absl::Status too_big = tiny->Submit(big, 3);
  CHECK(too_big.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(too_big.message()), Contains("does not fit this fast path ring"));
  HonestFastWrite(pair, *fast, "after-bad", 7, 8);
}

TEST_CASE("fast path: a stranger session can neither move nor cancel another engine's pages") {
  AgentPair pair(StoppablePeer({"--scheduler-uids", "none"}));
  auto stranger = Stranger(pair.prefill_process());
  auto fast = OpenFast(*stranger);
  REQUIRE(fast->Submit(KvWrite("steal", {1}, {2}), 1).ok());
  FastCompletion c = ReapOne(*fast);
  CHECK(c.code == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(c.message, Contains("belongs to session:1"));
  CHECK(pair.PageUntouched(2));
  // The owner's transfer, in flight: the stranger's cancel does not find it.
  REQUIRE(SuspendAgent(pair.decode_process().pid()) == "");
  auto owner_fast = OpenFast(pair.prefill());
  REQUIRE(owner_fast->Submit(KvWrite("owned", {3}, {4}), 7).ok());
  REQUIRE(fast->Cancel("owned", 2).ok());
  FastCompletion cancel = ReapOne(*fast);
  CHECK(cancel.opcode == fr::kCancel);
  CHECK(cancel.code == absl::StatusCode::kNotFound);
  REQUIRE(kill(pair.decode_process().pid(), SIGCONT) == 0);
  FastCompletion owned = ReapOne(*owner_fast);
  INFO(owned.message);
  CHECK(owned.phase == v1::COMPLETED);
  CHECK(pair.PageEqual(3, 4));
}

TEST_CASE("fast path: a chunk completes when accepted, a cancel ends its transfer") {
  AgentPair pair;
  auto fast = OpenFast(pair.prefill());
  auto first = KvWrite("to-cancel", {1}, {2});
  first.set_more_chunks(true);  // more to come: the transfer cannot end before them
  REQUIRE(fast->Submit(first, 1).ok());
  FastCompletion accepted = ReapOne(*fast);
  INFO(accepted.message);
  CHECK(accepted.code == absl::StatusCode::kOk);
  CHECK((accepted.phase == v1::PENDING || accepted.phase == v1::TRANSFERRING));
  REQUIRE(fast->Cancel("to-cancel", 2).ok());
  FastCompletion cancel = ReapOne(*fast);
  CHECK(cancel.opcode == fr::kCancel);  // the transfer's state after the cancel
  CHECK(cancel.code == absl::StatusCode::kCancelled);
  CHECK(cancel.phase == v1::CANCELLED);
  // Its last chunk is refused now, as through gRPC.
  auto last = KvWrite("to-cancel", {3}, {4});
  last.set_chunk(1);
  REQUIRE(fast->Submit(last, 3).ok());
  FastCompletion refused = ReapOne(*fast);
  CHECK(refused.code == absl::StatusCode::kFailedPrecondition);
  // A cancel of an unknown transfer is NOT_FOUND.
  REQUIRE(fast->Cancel("never-submitted", 4).ok());
  CHECK(ReapOne(*fast).code == absl::StatusCode::kNotFound);
  // A chunked transfer whose last chunk comes completes on that chunk's entry.
  auto open = KvWrite("chunked", {5}, {6});
  open.set_more_chunks(true);
  auto close = KvWrite("chunked", {7}, {8});
  close.set_chunk(1);
  REQUIRE(fast->Submit(open, 5, /*publish=*/false).ok());
  REQUIRE(fast->Submit(close, 6).ok());
  auto both = ReapN(*fast, 2);
  REQUIRE(both.size() == 2);
  for (const auto& c : both) {
    INFO(c.user_data << ": " << c.message);
    CHECK(c.code == absl::StatusCode::kOk);
    if (c.user_data == 6) CHECK(c.phase == v1::COMPLETED);
  }
  CHECK(pair.PageEqual(5, 6));
  CHECK(pair.PageEqual(7, 8));
}

TEST_CASE("fast path: a deadline ends a transfer whose peer stopped answering") {
  AgentPair pair(StoppablePeer());
  auto fast = OpenFast(pair.prefill());
  REQUIRE(SuspendAgent(pair.decode_process().pid()) == "");
  auto timed = KvWrite("to-time-out", {3}, {4});
  timed.set_timeout_ms(300);
  const auto start = std::chrono::steady_clock::now();
  REQUIRE(fast->Submit(timed, 2).ok());
  FastCompletion c = ReapOne(*fast);
  const int64_t ms = MillisSince(start);
  REQUIRE(kill(pair.decode_process().pid(), SIGCONT) == 0);
  INFO(c.message << " after " << ms << " ms");
  CHECK(c.phase == v1::TIMED_OUT);
  CHECK(c.code == absl::StatusCode::kDeadlineExceeded);
  CHECK_FALSE(c.message.empty());
  CheckCompletionIsState(pair.prefill(), "to-time-out", c);
  CHECK(ms >= 250);
  HonestFastWrite(pair, *fast, "after-deadline", 10, 11);
}

TEST_CASE("fast path: a peer that dies fails the transfers in flight on the ring") {
  AgentPair pair(StoppablePeer());
  auto fast = OpenFast(pair.prefill());
  REQUIRE(SuspendAgent(pair.decode_process().pid()) == "");
  REQUIRE(fast->Submit(KvWrite("doomed", {1}, {2}), 1).ok());
  WaitKnown(pair.prefill(), "doomed");
  REQUIRE(WaitTransferring(pair.prefill(), "doomed").ok());
  REQUIRE(kill(pair.decode_process().pid(), SIGKILL) == 0);
  FastCompletion c = ReapOne(*fast, 30000);
  INFO(c.message);
  CHECK(c.phase == v1::FAILED);
  CHECK(c.code == absl::StatusCode::kUnavailable);
  CheckCompletionIsState(pair.prefill(), "doomed", c);
  auto status = pair.prefill().Status();
  CHECK(status.ok());
}

TEST_CASE("fast path: a full ring refuses more and takes the rest once completions are reaped") {
  AgentPair pair(StoppablePeer());
  client::FastPathOptions small;
  small.submission_slots = 8;
  small.completion_entries = 8;
  auto fast = OpenFast(pair.prefill(), small);
  REQUIRE(SuspendAgent(pair.decode_process().pid()) == "");
  int accepted = 0;
  absl::Status full;
  for (int i = 0; i < 40; ++i) {
    full = fast->Submit(KvWrite(fmt::format("f{}", i), {static_cast<uint64_t>(i % 32)},
                                {static_cast<uint64_t>(i % 32)}),
                        i);
    if (!full.ok()) break;
    ++accepted;
    // Let the agent take what it can: 8 entries (their completions reserved).
    if (i == 7) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  CHECK(full.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(full.message()), Contains("submission ring is full"));
  // 8 taken by the agent (one completion each), 8 waiting in the submission ring.
  CHECK(accepted == 16);
  REQUIRE(kill(pair.decode_process().pid(), SIGCONT) == 0);
  auto done = ReapN(*fast, accepted, 30000);
  REQUIRE(done.size() == static_cast<size_t>(accepted));
  for (const auto& c : done) {
    INFO(c.user_data << ": " << c.message);
    CHECK(c.phase == v1::COMPLETED);
  }
  for (uint64_t i = 0; i < 16; ++i) CHECK(pair.PageEqual(i, i));
}

// The agent takes a burst in batches (one wake of its UCX worker per batch) and posts
// completions behind one doorbell per client sleep: nothing may be lost or doubled on
// the way. 4,096 entries published at once through a completion ring of 256, reaped
// slowly so the agent stops at the completion ring's room and resumes as it drains.
TEST_CASE("fast path: a burst of 4096 entries completes exactly once, through a smaller completion ring") {
  AgentPair pair;
  client::FastPathOptions big;
  big.submission_slots = fr::kMaxEntries;
  big.completion_entries = 256;
  auto fast = OpenFast(pair.prefill(), big);
  constexpr uint64_t kBurst = fr::kMaxEntries;
  // A quarter each: WRITEs (page p -> (p + 5) % 32: a destination always gets the same
  // source), pings, refused submits (no op) and cancels of unknown ids. WRITEs to a
  // destination another WRITE of the burst still writes are refused by the agent's
  // destination check: a completion too.
  auto kind = [](uint64_t i) { return i % 4; };
  for (uint64_t i = 0; i < kBurst; ++i) {
    absl::Status put;
    const uint64_t page = (i / 4) % 32;
    switch (kind(i)) {
      case 0:
        put = fast->Submit(KvWrite(fmt::format("burst-{}", i), {page}, {(page + 5) % 32}), i,
                           /*publish=*/false);
        break;
      case 1:
        put = fast->Ping(i, /*publish=*/false);
        break;
      case 2: {
        v1::SubmitTransferRequest no_op = KvWrite(fmt::format("burst-{}", i), {page}, {page});
        no_op.set_op(v1::TRANSFER_OP_UNSPECIFIED);
        put = fast->Submit(no_op, i, /*publish=*/false);
        break;
      }
      default:
        put = fast->Cancel(fmt::format("no-such-{}", i), i, /*publish=*/false);
    }
    INFO(i << ": " << put.ToString());
    REQUIRE(put.ok());
  }
  fast->Publish();
  // Nothing reaped yet: the agent takes at most as many entries as it has completion
  // slots for.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto status = pair.prefill().Status();
  REQUIRE(status.ok());
  CHECK(status->fast_path_entries() <= 256);
  CHECK(status->fast_path_entries() > 0);

  std::vector<int> seen(kBurst);
  uint64_t completed = 0, overlapping = 0;
  std::vector<bool> written(32);
  uint64_t reaped = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (reaped < kBurst && std::chrono::steady_clock::now() < until) {
    std::vector<FastCompletion> got;
    // Small reaps at first: the agent refills the completion ring as it drains.
    auto n = fast->Reap(&got, reaped < 1024 ? 16 : 512, absl::Milliseconds(100));
    INFO(n.status().ToString());
    REQUIRE(n.ok());
    reaped += got.size();
    for (const FastCompletion& c : got) {
      REQUIRE(c.user_data < kBurst);
      ++seen[c.user_data];
      INFO(c.user_data << ": " << c.message);
      switch (kind(c.user_data)) {
        case 0:
          CHECK(c.opcode == fr::kSubmit);
          if (c.phase == v1::COMPLETED) {
            ++completed;
            written[(c.user_data / 4 % 32 + 5) % 32] = true;
          } else {
            CHECK(c.code == absl::StatusCode::kFailedPrecondition);
            CHECK_THAT(c.message, Contains("may not write the same destination at once"));
            ++overlapping;
          }
          break;
        case 1:
          CHECK(c.opcode == fr::kPing);
          CHECK(c.code == absl::StatusCode::kOk);
          break;
        case 2:
          CHECK(c.code == absl::StatusCode::kInvalidArgument);
          CHECK_THAT(c.message, Contains("op 0 is not set"));
          break;
        default:
          CHECK(c.opcode == fr::kCancel);
          CHECK(c.code == absl::StatusCode::kNotFound);
      }
    }
  }
  REQUIRE(reaped == kBurst);
  CHECK(std::count(seen.begin(), seen.end(), 1) == static_cast<long>(kBurst));
  CHECK(completed + overlapping == kBurst / 4);
  CHECK(completed > 0);
  // Nothing more comes: no completion was doubled.
  std::vector<FastCompletion> extra;
  auto more = fast->Reap(&extra, 16, absl::Milliseconds(300));
  REQUIRE(more.ok());
  CHECK(*more == 0);
  CHECK(fast->outstanding() == 0);
  status = pair.prefill().Status();
  REQUIRE(status.ok());
  CHECK(status->fast_path_entries() == kBurst);
  CHECK(status->fast_path_protocol_errors() == 0);
  for (uint64_t dst = 0; dst < 32; ++dst) {
    if (written[dst]) CHECK(pair.PageEqual((dst + 27) % 32, dst));
  }
}

// A client that speaks the ring protocol itself, to break it.
struct RawRing {
  v1::FastPathInfo info;
  std::vector<UniqueFd> fds;
  char* base = nullptr;
  fr::RingHeader* header = nullptr;

  explicit RawRing(cli::AgentClient& client, uint32_t slots = 8) {
    auto session = client.Session();
    REQUIRE(session.ok());
    v1::OpenFastPathRequest request;
    request.set_submission_slots(slots);
    auto opened = (*session)->OpenFastPath(request);
    REQUIRE(opened.ok());
    info = opened->first;
    fds = std::move(opened->second);
    void* p = mmap(nullptr, info.ring_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fds[0].get(), 0);
    REQUIRE(p != MAP_FAILED);
    base = static_cast<char*>(p);
    header = reinterpret_cast<fr::RingHeader*>(base);
  }
  ~RawRing() { munmap(base, info.ring_bytes()); }
  char* slot(uint32_t i) { return base + info.submission_offset() + uint64_t{i} * fr::kSlotBytes; }
  void Write(uint32_t at, fr::SubmissionHeader h, const std::string& payload) {
    std::memcpy(slot(at), &h, sizeof(h));
    std::memcpy(slot(at) + sizeof(h), payload.data(), payload.size());
  }
  // Writes one payload-less entry at slot 0 and publishes it.
  void PublishFirst(fr::SubmissionHeader h) {
    Write(0, h, "");
    Publish(1);
  }
  void Publish(uint32_t tail, bool doorbell = true) {
    header->sq_tail.value.store(tail, std::memory_order_release);
    if (doorbell) {
      const uint64_t one = 1;
      REQUIRE(::write(fds[1].get(), &one, sizeof(one)) == 8);
    }
  }
  // Waits for cq_tail to reach `count`; returns the completion `index`.
  fr::CompletionHeader WaitCompletion(uint32_t count, uint32_t index, std::string* message,
                                      uint32_t timeout_ms = 5000) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (header->cq_tail.value.load(std::memory_order_acquire) < count &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    REQUIRE(header->cq_tail.value.load(std::memory_order_acquire) >= count);
    fr::CompletionHeader c;
    const char* at = base + info.completion_offset() + uint64_t{index} * fr::kCompletionBytes;
    std::memcpy(&c, at, sizeof(c));
    message->assign(at + sizeof(c), std::min<uint32_t>(c.message_length, fr::kMaxMessage));
    return c;
  }
  bool Closed(uint32_t timeout_ms = 5000) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < until) {
      if (header->agent_flags.value.load() & fr::kClosed) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }
  std::string Reason() { return std::string(base + fr::kReasonOffset); }
};

// An entry header; `slots` 0 picks the right count.
fr::SubmissionHeader Header(uint16_t opcode, uint32_t length, uint64_t user_data,
                            int slots = -1) {
  fr::SubmissionHeader h{};
  h.opcode = opcode;
  h.length = length;
  h.slots = static_cast<uint16_t>(slots >= 0 ? static_cast<uint32_t>(slots) : fr::SlotsFor(length));
  h.user_data = user_data;
  return h;
}

TEST_CASE("fast path: garbage in an entry is refused on the ring; the ring goes on") {
  AgentPair pair;
  RawRing ring(pair.prefill());
  const std::string garbage = "\xff\xff\xff\xff this is not a protobuf";
  ring.Write(0, Header(fr::kSubmit, garbage.size(), 11), garbage);
  ring.Write(1, Header(fr::kPing, 0, 12), "");
  ring.Publish(2);
  std::string message;
  fr::CompletionHeader c = ring.WaitCompletion(2, 0, &message);
  CHECK(c.user_data == 11);
  CHECK(c.code == static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  CHECK_THAT(message, Contains("not a SubmitTransferRequest"));
  fr::CompletionHeader ping = ring.WaitCompletion(2, 1, &message);
  CHECK(ping.user_data == 12);
  CHECK(ping.code == 0);
  // The client cannot shrink the ring file under the agent (it is sealed).
  CHECK(ftruncate(ring.fds[0].get(), 4096) != 0);
  CHECK(errno == EPERM);
}

TEST_CASE("fast path: a client that breaks the ring protocol loses its ring, nothing else") {
  AgentPair pair;
  auto honest = OpenFast(pair.decode());  // another session on the other agent: unaffected
  struct Case {
    const char* what;
    std::function<void(RawRing&)> act;
    const char* reason;
  };
  std::vector<Case> cases = {
      {"an entry of 0 slots",
       [](RawRing& r) { r.PublishFirst(Header(fr::kPing, 0, 1, /*slots=*/0)); },
       "spans 0 slots"},
      {"an entry past the ring's end",
       [](RawRing& r) {
         r.Write(0, Header(fr::kPad, 0, 0, /*slots=*/7), "");
         r.Publish(7);
         for (int i = 0; i < 2000 && r.header->sq_head.value.load() != 7; ++i) {
           std::this_thread::sleep_for(std::chrono::milliseconds(1));
         }
         REQUIRE(r.header->sq_head.value.load() == 7);
         auto h = Header(fr::kSubmit, 300, 2);  // 2 slots from slot 7 of 8
         std::memcpy(r.slot(7), &h, sizeof(h));
         r.Publish(9);
       },
       "past the ring's end"},
      {"an unknown opcode",
       [](RawRing& r) { r.PublishFirst(Header(77, 0, 1)); },
       "opcode 77"},
      {"a tail far past the head",
       [](RawRing& r) { r.Publish(1000000); },
       "sq_tail is 1000000 slots past sq_head"},
      {"a payload longer than its slots",
       [](RawRing& r) { r.PublishFirst(Header(fr::kSubmit, 1000, 1, /*slots=*/1)); },
       "carries 1000 payload bytes in 1 slots"},
      {"completions reaped before they were posted",
       [](RawRing& r) {
         r.header->cq_head.value.store(5);
         r.PublishFirst(Header(fr::kPing, 0, 1));
       },
       "cq_head is past cq_tail"},
  };
  for (const auto& c : cases) {
    SECTION(c.what) {
      cli::AgentClient hostile(pair.prefill_process().address());
      RawRing ring(hostile);
      c.act(ring);
      REQUIRE(ring.Closed());
      INFO(ring.Reason());
      CHECK_THAT(ring.Reason(), Contains("broke the ring protocol"));
      CHECK_THAT(ring.Reason(), Contains(c.reason));
      auto status = pair.prefill().Status();
      REQUIRE(status.ok());
      CHECK(status->fast_path_protocol_errors() == 1);
      // Its session is still good for gRPC, and other rings are untouched.
      CHECK(hostile.Status().ok());
      auto fast = OpenFast(pair.prefill());
      HonestFastWrite(pair, *fast, "after-hostile", 12, 13);
      REQUIRE(honest->Ping(5).ok());
      CHECK(ReapOne(*honest).user_data == 5);
    }
  }
}

TEST_CASE("fast path: an entry published without its doorbell is still taken") {
  AgentPair pair;
  RawRing ring(pair.prefill());
  // Wait for the agent to sleep (it polls spin_us after the last entry).
  for (int i = 0; i < 1000 && (ring.header->agent_flags.value.load() & fr::kSleeping) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  REQUIRE((ring.header->agent_flags.value.load() & fr::kSleeping) != 0);
  ring.Write(0, Header(fr::kPing, 0, 21), "");  // and no doorbell
  const auto start = std::chrono::steady_clock::now();
  ring.Publish(1, /*doorbell=*/false);
  std::string message;
  fr::CompletionHeader c = ring.WaitCompletion(1, 0, &message, 2000);
  CHECK(c.user_data == 21);
  const int64_t ms = MillisSince(start);
  INFO("taken after " << ms << " ms without a doorbell");
  CHECK(ms < 1000);
}

// A client process that dies holding a session and a ring. It is this test binary again,
// started fresh (cli::SpawnChild) and told its role by environment, never a fork() of
// this process: a fork copies a process whose gRPC and sanitizer threads may hold locks
// the child then waits on forever (seen once under ASan in CI, a child that never
// finished its setup). The role runs in a hidden test case below, writes one byte to
// the pipe its environment names when its setup is done, and waits to be killed; a
// non-zero exit status names the step that failed.
constexpr char kChildRoleEnv[] = "KVAGENT_FAST_PATH_CHILD_ROLE";
constexpr char kChildSessionEnv[] = "KVAGENT_FAST_PATH_CHILD_SESSION";
constexpr char kChildCase[] = "fast path child role";
constexpr char kChildReadyFdEnv[] = "KVAGENT_FAST_PATH_CHILD_READY_FD";
constexpr int kChildSetupMs = 60000;
// The user data of a ring's notification watch.
constexpr uint64_t kWatchData = 77;

pid_t SpawnReady(const std::string& role, const std::string& session_path) {
  // The write end stays open across exec (no O_CLOEXEC), named to the child by number;
  // nothing else is spawned meanwhile, and this process closes its copy at once.
  int ready[2];
  REQUIRE(pipe(ready) == 0);
  REQUIRE(fcntl(ready[0], F_SETFD, FD_CLOEXEC) == 0);
  // The child's output goes to this test's log; it writes no JUnit XML over this run's.
  auto spawned = cli::SpawnChild({"/proc/self/exe", kChildCase}, STDOUT_FILENO,
                                 {{kChildRoleEnv, role},
                                  {kChildSessionEnv, session_path},
                                  {kChildReadyFdEnv, std::to_string(ready[1])},
                                  {"XML_OUTPUT_FILE", ""}});
  close(ready[1]);
  INFO(spawned.status().ToString());
  REQUIRE(spawned.ok());
  const pid_t child = *spawned;
  pollfd p{ready[0], POLLIN, 0};
  int polled;
  do {
    polled = poll(&p, 1, kChildSetupMs);
  } while (polled < 0 && errno == EINTR);
  char byte = 0;
  const ssize_t got = polled == 1 ? ::read(ready[0], &byte, 1) : 0;
  close(ready[0]);
  if (got == 1) return child;
  if (polled == 0) kill(child, SIGKILL);
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  if (polled == 0) {
    FAIL("the child (" << role << ") did not finish its setup in " << kChildSetupMs
                       << " ms; its output is above in this test's log");
  }
  FAIL("the child (" << role << ") failed its setup: "
                     << (WIFEXITED(wstatus) ? fmt::format("exit status {}", WEXITSTATUS(wstatus))
                                            : fmt::format("signal {}", WTERMSIG(wstatus))));
  return -1;
}

// Runs only in a process SpawnReady started (hidden: "[.]"). Exit statuses: 3 attach,
// 4 open the ring, 5 submit or watch, 6 reap, 7 the watch was refused, 8 no answer to
// the watch in 30 s, 9 no ready pipe, 10 unknown role.
TEST_CASE("fast path child role", "[.]") {
  const char* role_env = std::getenv(kChildRoleEnv);
  const char* session_env = std::getenv(kChildSessionEnv);
  if (role_env == nullptr || session_env == nullptr) return;  // run by hand: nothing to do
  const std::string role = role_env;
  auto session = client::LocalSession::Attach(session_env, role == "doomed-engine"
                                                               ? "doomed-engine"
                                                               : "decode-7");
  if (!session.ok()) _exit(3);
  auto fast = FastPath::Open(session->get());
  if (!fast.ok()) _exit(4);
  if (role == "doomed-engine") {
    // Eight transfers, then it waits to die.
    for (uint64_t i = 0; i < 8; ++i) {
      if (!(*fast)->Submit(KvWrite(fmt::format("orphan-{}", i), {i}, {i}), i).ok()) _exit(5);
    }
  } else if (role == "durable-watcher") {
    // Attached to the subscription; it never reaps a notification nor acknowledges one.
    if (!(*fast)->WatchNotifications({}, "kv-ready", kWatchData).ok()) _exit(5);
    std::vector<FastCompletion> answer;
    for (int i = 0; i < 3 && answer.empty(); ++i) {
      if (!(*fast)->Reap(&answer, 1, absl::Seconds(10)).ok()) _exit(6);
    }
    if (answer.empty()) _exit(8);
    if (answer[0].opcode != fr::kWatchNotifications || !answer[0].status().ok()) _exit(7);
  } else {
    _exit(10);
  }
  char byte = 1;
  const char* ready_fd = std::getenv(kChildReadyFdEnv);
  if (ready_fd == nullptr || ::write(std::atoi(ready_fd), &byte, 1) != 1) _exit(9);
  for (;;) pause();
}

TEST_CASE("fast path: a client killed mid-flight leaves no ring and no stuck transfer") {
  AgentPair pair(StoppablePeer());
  REQUIRE(SuspendAgent(pair.decode_process().pid()) == "");
  const std::string session_path = pair.prefill_process().address().substr(5) + ".session";
  // A session, a ring, eight transfers, then it waits to die.
  const pid_t child = SpawnReady("doomed-engine", session_path);
  // The agent took the entries before the child said so? Give it a moment, then kill.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  REQUIRE(kill(child, SIGKILL) == 0);
  int wstatus = 0;
  REQUIRE(waitpid(child, &wstatus, 0) == child);
  uint64_t rings = 1;
  for (int i = 0; i < 300 && rings != 0; ++i) {
    auto status = pair.prefill().Status();
    REQUIRE(status.ok());
    rings = status->fast_path_rings();
    if (rings != 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(rings == 0);
  REQUIRE(kill(pair.decode_process().pid(), SIGCONT) == 0);
  // Its transfers end (they were the dead session's; the agent finishes them).
  uint64_t active = 1;
  for (int i = 0; i < 2000 && active != 0; ++i) {
    auto list = pair.prefill().Transfers(/*active_only=*/true);
    REQUIRE(list.ok());
    active = list->transfers_size();
    if (active != 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(active == 0);
  auto fast = OpenFast(pair.prefill());
  HonestFastWrite(pair, *fast, "after-kill", 20, 21);
}


// ---- Notifications on the completion ring (kWatchNotifications) ----


// Opens a ring on `client`'s session that watches its notifications (of `ids`).
std::unique_ptr<FastPath> OpenWatching(cli::AgentClient& client,
                                       const std::vector<std::string>& ids = {},
                                       client::FastPathOptions options = {}) {
  auto fast = OpenFast(client, options);
  REQUIRE(fast->WatchNotifications(ids, kWatchData).ok());
  FastCompletion c = ReapOne(*fast);
  INFO(c.message);
  REQUIRE(c.opcode == fr::kWatchNotifications);
  REQUIRE(c.user_data == kWatchData);
  REQUIRE(c.code == absl::StatusCode::kOk);
  return fast;
}

// Reaps until `count` notification completions came or `timeout_ms` passed; other
// completions go to `others`.
std::vector<FastCompletion> ReapNotes(FastPath& fast, size_t count, uint32_t timeout_ms = 20000,
                                      std::vector<FastCompletion>* others = nullptr) {
  std::vector<FastCompletion> notes;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (notes.size() < count && std::chrono::steady_clock::now() < until) {
    std::vector<FastCompletion> got;
    auto n = fast.Reap(&got, 64, absl::Milliseconds(50));
    INFO(n.status().ToString());
    REQUIRE(n.ok());
    for (auto& c : got) {
      if (c.opcode == fr::kNotification) {
        INFO(c.message);
        REQUIRE(c.code == absl::StatusCode::kOk);
        REQUIRE(c.notification.has_value());
        CHECK(c.user_data == kWatchData);
        CHECK(c.phase == v1::TRANSFER_PHASE_UNSPECIFIED);
        CHECK(c.bytes_done == c.notification->bytes());
        notes.push_back(std::move(c));
      } else if (others != nullptr) {
        others->push_back(std::move(c));
      }
    }
  }
  return notes;
}

// A WRITE submitted through gRPC, waited for.
void GrpcWrite(AgentPair& pair, const std::string& id, uint64_t src, uint64_t dst,
               const std::string& payload) {
  REQUIRE(pair.prefill().Submit(KvWrite(id, {src}, {dst}, payload)).ok());
  auto done = pair.prefill().WaitTransfer(id, 20000);
  REQUIRE(done.ok());
  INFO(done->error_message());
  REQUIRE(done->phase() == v1::COMPLETED);
}

size_t PollCount(cli::AgentClient& client, std::vector<v1::Notification>* out = nullptr) {
  auto polled = client.Poll(0);
  REQUIRE(polled.ok());
  if (out != nullptr) {
    for (const auto& n : polled->notifications()) out->push_back(n);
  }
  return polled->notifications_size();
}

// Polls `client` until `count` notifications came or 10 s passed (a notification is
// pushed on the receiver a moment after the sender's transfer completed).
std::vector<v1::Notification> PollFor(cli::AgentClient& client, size_t count) {
  std::vector<v1::Notification> polled;
  for (int i = 0; i < 1000 && polled.size() < count; ++i) {
    if (PollCount(client, &polled) == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return polled;
}

// Waits until `agent`'s status has `done`, up to 10 s; returns the last one.
v1::AgentStatus WaitStatus(cli::AgentClient& agent,
                           const std::function<bool(const v1::AgentStatus&)>& done) {
  v1::AgentStatus last;
  for (int i = 0; i < 1000; ++i) {
    auto status = agent.Status();
    REQUIRE(status.ok());
    last = *std::move(status);
    if (done(last)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return last;
}

TEST_CASE("fast path: a watching ring gets the session's notifications, each taken once") {
  AgentPairOptions metrics;
  metrics.extra_args = {"--metrics-listen", "127.0.0.1:0"};
  AgentPair pair(metrics);
  auto watch = OpenWatching(pair.decode());
  auto fast = OpenFast(pair.prefill());
  REQUIRE(fast->Submit(KvWrite("note-1", {3, 4}, {30, 1}, "first-token:7"), 1).ok());
  FastCompletion done = ReapOne(*fast);
  INFO(done.message);
  REQUIRE(done.phase == v1::COMPLETED);
  auto notes = ReapNotes(*watch, 1);
  REQUIRE(notes.size() == 1);
  const v1::Notification& n = *notes[0].notification;
  CHECK(n.kind() == v1::DATA_READY);
  CHECK(n.transfer_id() == "note-1");
  CHECK(n.payload() == "first-token:7");
  CHECK(n.from_agent() == "prefill");
  CHECK(n.bytes() == 2 * 8 * 4096);
  CHECK(notes[0].bytes_done == 2 * 8 * 4096);
  CHECK(pair.PageEqual(3, 30));
  CHECK(pair.PageEqual(4, 1));
  // A gRPC submission's notification comes the same way.
  GrpcWrite(pair, "note-2", 5, 6, "second");
  notes = ReapNotes(*watch, 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].notification->transfer_id() == "note-2");
  CHECK(notes[0].notification->payload() == "second");
  CHECK(pair.PageEqual(5, 6));
  // Taken once: gRPC finds nothing; notifications are no entries of the ring.
  CHECK(PollCount(pair.decode()) == 0);
  CHECK(watch->outstanding() == 0);
  auto status = pair.decode().Status();
  REQUIRE(status.ok());
  CHECK(status->fast_path_notifications() == 2);
  CHECK(status->fast_path_notifications_too_large() == 0);
  const std::string scraped = Scrape(MetricsAddress(pair.decode()));
  CHECK(Value(scraped, "kvagent_fast_path_notifications_total") == 2);
  CHECK(Value(scraped, "kvagent_fast_path_notifications_too_large_total") == 0);
}

TEST_CASE("fast path: a ring watches only the notifications its session may take") {
  AgentPair pair(StoppablePeer({"--scheduler-uids", "none"}));
  auto stranger = Stranger(pair.decode_process());
  auto stranger_watch = OpenWatching(*stranger);
  auto owner_watch = OpenWatching(pair.decode());
  for (int i = 0; i < 3; ++i) {
    const std::string id = fmt::format("owned-{}", i);
    GrpcWrite(pair, id, i, 10 + i, "for the owner");
    auto notes = ReapNotes(*owner_watch, 1);
    REQUIRE(notes.size() == 1);
    CHECK(notes[0].notification->transfer_id() == id);
  }
  std::vector<FastCompletion> none;
  auto got = stranger_watch->Reap(&none, 16, absl::Milliseconds(300));
  REQUIRE(got.ok());
  CHECK(*got == 0);
}

TEST_CASE("fast path: large notifications span entries, and pads keep them whole at the ring's end") {
  AgentPair pair;
  {
    // 16 KiB of payload: one completion of 33 entries.
    cli::AgentClient big_client(pair.decode_process().address());
    auto watch = OpenWatching(big_client);
    std::string payload(16 << 10, '\0');
    for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 7 + 3);
    GrpcWrite(pair, "large", 1, 2, payload);
    auto notes = ReapNotes(*watch, 1);
    REQUIRE(notes.size() == 1);
    CHECK(notes[0].notification->transfer_id() == "large");
    CHECK(notes[0].notification->payload() == payload);
  }
  // The session ended: its watch is gone (the next ring must be the only taker).
  CHECK(WaitStatus(pair.decode(), [](const auto& s) { return s.fast_path_rings() == 0; })
            .fast_path_rings() == 0);
  cli::AgentClient small_client(pair.decode_process().address());
  client::FastPathOptions small;
  small.submission_slots = 16;
  small.completion_entries = 16;
  auto watch = OpenWatching(small_client, {}, small);
  // ~1.9 KB each: 4 entries. After the watch's answer (entry 0) they start at 1, 5, 9;
  // the fourth finds 3 entries left: a pad, then it starts over at 0, and so on.
  for (int i = 0; i < 10; ++i) {
    const std::string id = fmt::format("padded-{}", i);
    const std::string payload(1800, static_cast<char>('a' + i));
    GrpcWrite(pair, id, i, i + 1, payload);
    auto notes = ReapNotes(*watch, 1);
    REQUIRE(notes.size() == 1);
    CHECK(fr::SpanFor(notes[0].notification->ByteSizeLong()) == 4);
    CHECK(notes[0].notification->transfer_id() == id);
    CHECK(notes[0].notification->payload() == payload);
  }
  // Several at once, reaped only after they all came: in order, whole.
  for (int i = 0; i < 6; ++i) {
    GrpcWrite(pair, fmt::format("burst-{}", i), i, i + 2, std::string(1800, static_cast<char>('A' + i)));
  }
  auto notes = ReapNotes(*watch, 6);
  REQUIRE(notes.size() == 6);
  for (int i = 0; i < 6; ++i) {
    CHECK(notes[i].notification->transfer_id() == fmt::format("burst-{}", i));
    CHECK(notes[i].notification->payload() == std::string(1800, static_cast<char>('A' + i)));
  }
  // Larger than half this ring (8 entries): left to gRPC, counted.
  GrpcWrite(pair, "too-large", 3, 4, std::string(8000, 'x'));
  std::vector<FastCompletion> none;
  auto got = watch->Reap(&none, 16, absl::Milliseconds(300));
  REQUIRE(got.ok());
  CHECK(*got == 0);
  std::vector<v1::Notification> polled = PollFor(pair.decode(), 1);
  REQUIRE(polled.size() == 1);
  CHECK(polled[0].transfer_id() == "too-large");
  auto status = pair.decode().Status();
  REQUIRE(status.ok());
  CHECK(status->fast_path_notifications_too_large() >= 1);
  CHECK(status->fast_path_notifications() == 17);
}

TEST_CASE("fast path: a ring that does not reap keeps its notifications waiting, and its entries") {
  AgentPair pair;
  client::FastPathOptions small;
  small.submission_slots = 8;
  small.completion_entries = 8;
  auto watch = OpenWatching(pair.decode(), {}, small);
  // 8 fill the completion ring; 4 more wait in the queue.
  for (int i = 0; i < 12; ++i) GrpcWrite(pair, fmt::format("wait-{}", i), i, i, "w");
  const v1::AgentStatus status = WaitStatus(pair.decode(), [](const auto& s) {
    return s.fast_path_notifications() + s.notifications_queued() == 12;
  });
  CHECK(status.fast_path_notifications() == 8);
  CHECK(status.notifications_queued() == 4);
  // Entries cannot be taken (no room for their completions); the submission ring fills
  // and refuses more, as without notifications.
  int pinged = 0;
  absl::Status put;
  while ((put = watch->Ping(100 + pinged)).ok()) ++pinged;
  CHECK(pinged == 8);
  CHECK(put.code() == absl::StatusCode::kResourceExhausted);
  // Reaping makes room: everything arrives, each once, the notifications in order.
  std::vector<FastCompletion> pings;
  auto notes = ReapNotes(*watch, 12, 20000, &pings);
  while (pings.size() < 8) {
    auto more = ReapN(*watch, 8 - pings.size());
    REQUIRE_FALSE(more.empty());
    for (auto& c : more) pings.push_back(std::move(c));
  }
  REQUIRE(notes.size() == 12);
  for (int i = 0; i < 12; ++i) {
    CHECK(notes[i].notification->transfer_id() == fmt::format("wait-{}", i));
  }
  REQUIRE(pings.size() == 8);
  for (const auto& c : pings) CHECK(c.opcode == fr::kPing);
  CHECK(watch->outstanding() == 0);
  CHECK(PollCount(pair.decode()) == 0);
}

TEST_CASE("fast path: a watch filters by transfer id; a second watch, a bad subscription name and opcode 5 are refused") {
  AgentPair pair;
  auto watch = OpenWatching(pair.decode(), {"wanted"});
  GrpcWrite(pair, "unwanted", 1, 2, "no");
  GrpcWrite(pair, "wanted", 3, 4, "yes");
  auto notes = ReapNotes(*watch, 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].notification->transfer_id() == "wanted");
  std::vector<v1::Notification> polled = PollFor(pair.decode(), 1);
  REQUIRE(polled.size() == 1);
  CHECK(polled[0].transfer_id() == "unwanted");
  // One watch per ring.
  REQUIRE(watch->WatchNotifications({}, 5).ok());
  FastCompletion second = ReapOne(*watch);
  CHECK(second.user_data == 5);
  CHECK(second.code == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(second.message,
             Contains("this ring already watches notifications (entry user_data 77)"));
  // A subscription named against gRPC's rule is refused as gRPC refuses it.
  cli::AgentClient raw_client(pair.decode_process().address());
  RawRing ring(raw_client);
  v1::WatchNotificationsRequest request;
  request.set_subscription("bad name!");
  const std::string bytes = request.SerializeAsString();
  ring.Write(0, Header(fr::kWatchNotifications, bytes.size(), 9), bytes);
  ring.Publish(1);
  std::string message;
  fr::CompletionHeader c = ring.WaitCompletion(1, 0, &message);
  CHECK(c.user_data == 9);
  CHECK(c.span == 1);
  CHECK(c.code == static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  CHECK(message ==
        "watch-notifications entry 9: subscription 'bad name!' (9 bytes): name it with 1 to "
        "64 of A-Z a-z 0-9 . _ : -");
  // A completion's opcode in a submission breaks the protocol: the ring is closed.
  ring.Write(1, Header(fr::kNotification, 0, 10), "");
  ring.Publish(2);
  REQUIRE(ring.Closed());
  CHECK_THAT(ring.Reason(), Contains("opcode 5"));
}

TEST_CASE("fast path: notifications a ring never took go to gRPC once its session ends") {
  AgentPair pair;
  size_t on_ring = 0;
  {
    cli::AgentClient watcher(pair.decode_process().address());
    client::FastPathOptions small;
    small.submission_slots = 8;
    small.completion_entries = 8;
    auto watch = OpenWatching(watcher, {}, small);
    for (int i = 0; i < 12; ++i) GrpcWrite(pair, fmt::format("left-{}", i), i, i, "l");
    const v1::AgentStatus status = WaitStatus(pair.decode(), [](const auto& s) {
      return s.fast_path_notifications() + s.notifications_queued() == 12;
    });
    on_ring = status.fast_path_notifications();
    CHECK(on_ring == 8);
  }  // the session ends with 8 on its ring unreaped (gone with it) and 4 queued
  CHECK(WaitStatus(pair.decode(), [](const auto& s) { return s.fast_path_rings() == 0; })
            .fast_path_rings() == 0);
  std::vector<v1::Notification> polled = PollFor(pair.decode(), 12 - on_ring);
  REQUIRE(polled.size() == 12 - on_ring);
  CHECK(PollCount(pair.decode()) == 0);
  for (size_t i = 0; i < polled.size(); ++i) {
    CHECK(polled[i].transfer_id() == fmt::format("left-{}", on_ring + i));
  }
}

// ---- Durable subscriptions on the ring (kFeatureDurableNotifications) ----

// Reaps `count` notifications of a durable watch: each with its sequence, increasing.
std::vector<v1::Notification> ReapDurable(FastPath& fast, size_t count,
                                          std::vector<FastCompletion>* others = nullptr,
                                          uint32_t timeout_ms = 20000) {
  std::vector<v1::Notification> out;
  for (auto& c : ReapNotes(fast, count, timeout_ms, others)) out.push_back(*c.notification);
  for (size_t i = 1; i < out.size(); ++i) CHECK(out[i].sequence() > out[i - 1].sequence());
  return out;
}

// Puts one ack entry on the ring and reaps its completion.
FastCompletion AckOnRing(FastPath& fast, const std::string& subscription, uint64_t through,
                         const std::vector<uint64_t>& sequences, uint64_t user_data) {
  REQUIRE(fast.AckNotifications(subscription, through, sequences, user_data).ok());
  std::vector<FastCompletion> others;
  for (int i = 0; i < 200; ++i) {
    auto got = ReapN(fast, 1, 100);
    for (auto& c : got) {
      if (c.opcode == fr::kAckNotifications && c.user_data == user_data) return c;
    }
  }
  FAIL("no completion for ack entry " << user_data);
  return {};
}

std::unique_ptr<cli::AgentClient> Named(cli::DaemonProcess& agent, const std::string& name) {
  cli::AgentClientOptions options;
  options.client_name = name;
  return std::make_unique<cli::AgentClient>(agent.address(), options);
}

// A ring of `n` submission slots and `n` completion entries.
client::FastPathOptions RingOf(uint32_t n) {
  client::FastPathOptions options;
  options.submission_slots = n;
  options.completion_entries = n;
  return options;
}

// Opens a ring on `client`'s session attached to durable `subscription`.
std::unique_ptr<FastPath> OpenDurable(cli::AgentClient& client, const std::string& subscription,
                                      client::FastPathOptions options = {}) {
  auto fast = OpenFast(client, options);
  REQUIRE(fast->delivers_durable_notifications());
  REQUIRE(fast->WatchNotifications({}, subscription, kWatchData).ok());
  FastCompletion c = ReapOne(*fast);
  INFO(c.message);
  REQUIRE(c.opcode == fr::kWatchNotifications);
  REQUIRE(c.code == absl::StatusCode::kOk);
  return fast;
}

TEST_CASE("fast path: a durable watch survives its session's death: what was written and not acknowledged comes again, same sequences") {
  AgentPair pair;
  const std::string session_path = pair.decode_process().address().substr(5) + ".session";
  // A session named decode-7, a ring attached to the subscription; the child never reaps
  // a notification nor acknowledges one, and is killed.
  const pid_t child = SpawnReady("durable-watcher", session_path);
  for (int i = 0; i < 3; ++i) GrpcWrite(pair, fmt::format("durable-{}", i), i, i, "d");
  // Written on the child's ring (not reaped), held by the subscription.
  v1::AgentStatus status = WaitStatus(pair.decode(), [](const auto& s) {
    return s.fast_path_notifications() == 3 && s.notifications_in_flight() == 3;
  });
  CHECK(status.fast_path_notifications() == 3);
  CHECK(status.notifications_in_flight() == 3);
  CHECK(status.subscriptions() == 1);
  REQUIRE(kill(child, SIGKILL) == 0);
  int wstatus = 0;
  REQUIRE(waitpid(child, &wstatus, 0) == child);
  CHECK(WaitStatus(pair.decode(), [](const auto& s) { return s.fast_path_rings() == 0; })
            .fast_path_rings() == 0);
  // Still held: not taken once by a gRPC poll.
  CHECK(PollCount(pair.decode()) == 0);

  // Another uid-and-name gets another subscription of the same name: none of these.
  auto other = Named(pair.decode_process(), "decode-8");
  auto other_ring = OpenDurable(*other, "kv-ready");

  // The restarted engine (same uid, same client name) attaches again: the three the dead
  // ring held come first, in order, with the sequences they had (the agent's first: 1..3).
  auto again = Named(pair.decode_process(), "decode-7");
  auto fast = OpenDurable(*again, "kv-ready");
  std::vector<v1::Notification> notes = ReapDurable(*fast, 3);
  REQUIRE(notes.size() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(notes[i].transfer_id() == fmt::format("durable-{}", i));
    CHECK(notes[i].sequence() == static_cast<uint64_t>(i + 1));
    CHECK(pair.PageEqual(i, i));
  }
  std::vector<FastCompletion> none;
  auto got = other_ring->Reap(&none, 16, absl::Milliseconds(200));
  REQUIRE(got.ok());
  CHECK(*got == 0);
  // (Both subscriptions may take new ones, each once: the other one leaves first.)
  other_ring.reset();
  other.reset();
  CHECK(WaitStatus(pair.decode(), [](const auto& s) { return s.fast_path_rings() == 1; })
            .fast_path_rings() == 1);
  // A new one continues above them.
  GrpcWrite(pair, "durable-3", 3, 3, "d");
  notes = ReapDurable(*fast, 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].transfer_id() == "durable-3");
  CHECK(notes[0].sequence() == 4);

  // Acknowledged on the ring: through 2, then 3 and 4 by list; again: nothing left.
  FastCompletion ack = AckOnRing(*fast, "kv-ready", 2, {}, 500);
  INFO(ack.message);
  CHECK(ack.code == absl::StatusCode::kOk);
  CHECK(ack.bytes_done == 2);
  CHECK(WaitStatus(pair.decode(), [](const auto& s) { return s.notifications_in_flight() == 2; })
            .notifications_in_flight() == 2);
  ack = AckOnRing(*fast, "kv-ready", 0, {3, 4, 99}, 501);
  CHECK(ack.code == absl::StatusCode::kOk);
  CHECK(ack.bytes_done == 2);
  ack = AckOnRing(*fast, "kv-ready", 4, {}, 502);
  CHECK(ack.code == absl::StatusCode::kOk);
  CHECK(ack.bytes_done == 0);
  // A subscription this identity never made is not found, with gRPC's text.
  ack = AckOnRing(*fast, "never-made", 1, {}, 503);
  CHECK(ack.code == absl::StatusCode::kNotFound);
  CHECK_THAT(ack.message, Catch::StartsWith("ack-notifications entry 503: AckNotifications: no "
                                            "subscription 'never-made' for uid:"));
  status = WaitStatus(pair.decode(), [](const auto& s) { return s.fast_path_acks() == 3; });
  CHECK(status.fast_path_acks() == 3);
  CHECK(status.notifications_in_flight() == 0);
  CHECK(status.fast_path_protocol_errors() == 0);
  // The session ends with nothing unacknowledged: a third attachment gets nothing old.
  fast.reset();
  again.reset();
  CHECK(WaitStatus(pair.decode(), [](const auto& s) { return s.fast_path_rings() == 0; })
            .fast_path_rings() == 0);
  auto third = Named(pair.decode_process(), "decode-7");
  auto third_ring = OpenDurable(*third, "kv-ready");
  got = third_ring->Reap(&none, 16, absl::Milliseconds(200));
  REQUIRE(got.ok());
  CHECK(*got == 0);
}

TEST_CASE("fast path: a newer attachment of the subscription replaces an older ring's, which gets no more") {
  AgentPair pair;
  auto first_client = Named(pair.decode_process(), "decode-9");
  auto first = OpenDurable(*first_client, "shared");
  GrpcWrite(pair, "before", 1, 1, "b");
  std::vector<v1::Notification> notes = ReapDurable(*first, 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].transfer_id() == "before");
  // The same engine again (another session, same uid and name), the first still open:
  // the new ring gets the unacknowledged one again, then the new ones; the old nothing.
  auto second_client = Named(pair.decode_process(), "decode-9");
  auto second = OpenDurable(*second_client, "shared");
  GrpcWrite(pair, "after", 2, 2, "a");
  std::vector<v1::Notification> again = ReapDurable(*second, 2);
  REQUIRE(again.size() == 2);
  CHECK(again[0].transfer_id() == "before");
  CHECK(again[0].sequence() == notes[0].sequence());
  CHECK(again[1].transfer_id() == "after");
  std::vector<FastCompletion> none;
  auto got = first->Reap(&none, 16, absl::Milliseconds(200));
  REQUIRE(got.ok());
  CHECK(*got == 0);
  // Either ring may acknowledge (the identity's subscription, not the ring's).
  CHECK(AckOnRing(*first, "shared", again[1].sequence(), {}, 700).bytes_done == 2);
}

// What `kvagentctl status` prints for the decode agent.
std::string DecodeStatusText(AgentPair& pair) {
  absl::StatusOr<std::string> printed = KvagentctlOutput(
      {"--agent", pair.decode_process().address(), "status"}, pair.work_dir() + "/status.txt");
  INFO(printed.status().ToString());
  REQUIRE(printed.ok());
  return *std::move(printed);
}

// Sends 12 notifications (transfers "<prefix>-0" to "-11", pages i to i) to the decode
// agent, whose durable ring of 8 entries (RingOf(8), not reaped) writes 8 and keeps 4
// in its pending list; waits for that and returns the status.
v1::AgentStatus OverfillRingOf8(AgentPair& pair, const std::string& prefix) {
  for (int i = 0; i < 12; ++i) GrpcWrite(pair, fmt::format("{}-{}", prefix, i), i, i, "r");
  return WaitStatus(pair.decode(), [](const auto& s) {
    return s.fast_path_notifications() == 8 && s.notifications_in_flight() == 12;
  });
}

TEST_CASE("fast path: a ring replaced by a newer attachment drops what it had not written; the newer one gets all, in order, once") {
  AgentPair pair;
  auto first_client = Named(pair.decode_process(), "decode-11");
  auto first = OpenDurable(*first_client, "replace", RingOf(8));
  // 8 written on the first ring (not reaped), 4 in its pending list.
  v1::AgentStatus status = OverfillRingOf8(pair, "rep");
  REQUIRE(status.fast_path_notifications() == 8);
  REQUIRE(status.notifications_in_flight() == 12);
  // The same identity attaches again (another session, the first ring still open).
  auto second_client = Named(pair.decode_process(), "decode-11");
  auto second = OpenDurable(*second_client, "replace");
  std::vector<v1::Notification> notes = ReapDurable(*second, 12);
  REQUIRE(notes.size() == 12);
  for (int i = 0; i < 12; ++i) {
    CHECK(notes[i].transfer_id() == fmt::format("rep-{}", i));
    CHECK(notes[i].sequence() == static_cast<uint64_t>(i + 1));
  }
  // The first ring, reaped to the end: the 8 it wrote before, none of its pending 4.
  std::vector<v1::Notification> old = ReapDurable(*first, 12, nullptr, 1000);
  REQUIRE(old.size() == 8);
  for (int i = 0; i < 8; ++i) CHECK(old[i].transfer_id() == fmt::format("rep-{}", i));
  std::vector<FastCompletion> none;
  auto got = first->Reap(&none, 16, absl::Milliseconds(300));
  REQUIRE(got.ok());
  CHECK(*got == 0);
  REQUIRE(AckOnRing(*second, "replace", 12, {}, 800).bytes_done == 12);
  status = pair.decode().Status().value();
  CHECK(status.fast_path_notifications() == 20);
  CHECK(status.fast_path_acks() == 1);
  CHECK(status.fast_path_pending_dropped() == 0);
  CHECK(status.fast_path_protocol_errors() == 0);
  CHECK(status.notifications_in_flight() == 0);
  // `kvagentctl status` prints the ring's notification counters.
  CHECK_THAT(DecodeStatusText(pair),
             Contains("\n             notifications on rings: 20 posted, 0 too large for their "
                      "ring (left to gRPC), 1 acks, 0 dropped from a ring's pending list\n"));
}

TEST_CASE("fast path: a durable watch keeps what the ring has no room for, in order, and says so for one too large") {
  AgentPairOptions options;
  options.extra_args = {"--metrics-listen", "127.0.0.1:0"};
  AgentPair pair(options);
  auto engine = Named(pair.decode_process(), "decode-small");
  auto fast = OpenDurable(*engine, "small", RingOf(8));
  // 8 fill the completion ring; 4 more wait in the ring's pending list (the queue handed
  // them over: the subscription holds all 12).
  v1::AgentStatus status = OverfillRingOf8(pair, "room");
  CHECK(status.fast_path_notifications() == 8);
  CHECK(status.notifications_in_flight() == 12);
  CHECK(status.notifications_queued() == 0);
  std::vector<v1::Notification> notes = ReapDurable(*fast, 12);
  REQUIRE(notes.size() == 12);
  for (int i = 0; i < 12; ++i) CHECK(notes[i].transfer_id() == fmt::format("room-{}", i));
  // Acknowledged by list, one entry.
  std::vector<uint64_t> sequences;
  for (const auto& n : notes) sequences.push_back(n.sequence());
  FastCompletion ack = AckOnRing(*fast, "small", 0, sequences, 600);
  CHECK(ack.bytes_done == 12);
  // Larger than half this ring: in its place, a completion naming its sequence; it
  // stays held, for gRPC to take through the subscription.
  GrpcWrite(pair, "too-large", 3, 4, std::string(8000, 'x'));
  GrpcWrite(pair, "after-large", 5, 6, "a");
  std::vector<FastCompletion> got;
  while (got.size() < 2) {
    auto more = ReapN(*fast, 2 - got.size());
    REQUIRE_FALSE(more.empty());
    for (auto& c : more) got.push_back(std::move(c));
  }
  CHECK(got[0].opcode == fr::kNotification);
  CHECK(got[0].code == absl::StatusCode::kResourceExhausted);
  CHECK_FALSE(got[0].notification.has_value());
  CHECK_THAT(got[0].message, Contains("notification sequence 13 (transfer too-large"));
  CHECK_THAT(got[0].message, Contains("subscription 'small' holds it unacknowledged"));
  REQUIRE(got[1].notification.has_value());
  CHECK(got[1].notification->transfer_id() == "after-large");
  CHECK(got[1].notification->sequence() == 14);
  auto polled = engine->Poll(0, {}, "small");
  REQUIRE(polled.ok());
  REQUIRE(polled->notifications_size() == 2);
  CHECK(polled->notifications(0).transfer_id() == "too-large");
  CHECK(polled->notifications(0).payload() == std::string(8000, 'x'));
  CHECK(AckOnRing(*fast, "small", 14, {}, 601).bytes_done == 2);
  status = WaitStatus(pair.decode(), [](const auto& s) { return s.fast_path_acks() == 2; });
  CHECK(status.fast_path_acks() == 2);
  CHECK(status.fast_path_notifications_too_large() == 1);
  CHECK(status.fast_path_pending_dropped() == 0);
  CHECK(status.notifications_in_flight() == 0);
  const std::string scraped = Scrape(MetricsAddress(pair.decode()));
  CHECK(Value(scraped, "kvagent_fast_path_acks_total") == 2);
  CHECK(Value(scraped, "kvagent_fast_path_pending_dropped_total") == 0);
}

// Writes an entry of `opcode` whose payload is no protobuf at slot 0 of a fresh `ring`;
// checks that its completion refuses it (INVALID_ARGUMENT) and returns the message.
std::string RefusedGarbage(RawRing& ring, uint16_t opcode, uint64_t user_data) {
  const std::string garbage = "\xff\xff\xff\xff this is no protobuf";
  ring.Write(0, Header(opcode, garbage.size(), user_data), garbage);
  ring.Publish(1);
  std::string message;
  fr::CompletionHeader c = ring.WaitCompletion(1, 0, &message);
  CHECK(c.user_data == user_data);
  CHECK(c.opcode == opcode);
  CHECK(c.span == 1);
  CHECK(c.code == static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  return message;
}

TEST_CASE("fast path: a durable ring's pending list stays within in_flight_per_subscription when gRPC acknowledges what it has not written") {
  AgentPairOptions options;
  options.extra_args = {"--max-in-flight-per-subscription", "12"};
  AgentPair pair(options);
  auto engine = Named(pair.decode_process(), "decode-cap");
  auto fast = OpenDurable(*engine, "cap", RingOf(8));
  // 8 written (the ring is full, nothing reaped), 4 pending, 12 more queued at the cap.
  for (int i = 0; i < 24; ++i) GrpcWrite(pair, fmt::format("cap-{}", i), i % 32, i % 32, "c");
  v1::AgentStatus status = WaitStatus(pair.decode(), [](const auto& s) {
    return s.fast_path_notifications() == 8 && s.notifications_in_flight() == 12 &&
           s.notifications_queued() == 12;
  });
  REQUIRE(status.notifications_queued() == 12);
  // Acknowledged through gRPC before the ring wrote 9..12: the queue hands the ring 12
  // more, and its list keeps at most 12, dropping the oldest (acknowledged) ones.
  auto released = engine->Ack("cap", 12);
  REQUIRE(released.ok());
  CHECK(*released == 12);
  status = WaitStatus(pair.decode(), [](const auto& s) {
    return s.fast_path_pending_dropped() == 4 && s.notifications_in_flight() == 12;
  });
  CHECK(status.fast_path_pending_dropped() == 4);
  CHECK(status.notifications_in_flight() == 12);
  CHECK(status.notifications_queued() == 0);
  // The client reads what was written, then what is unacknowledged, in order.
  std::vector<v1::Notification> notes = ReapDurable(*fast, 20);
  REQUIRE(notes.size() == 20);
  for (int i = 0; i < 20; ++i) {
    const int n = i < 8 ? i : i + 4;
    CHECK(notes[i].transfer_id() == fmt::format("cap-{}", n));
    CHECK(notes[i].sequence() == static_cast<uint64_t>(n + 1));
  }
  CHECK(AckOnRing(*fast, "cap", 24, {}, 800).bytes_done == 12);
}

TEST_CASE("fast path: an ack entry that does not parse, or lists too many, is that entry's refusal") {
  AgentPair pair;
  RawRing ring(pair.decode());
  CHECK_THAT(RefusedGarbage(ring, fr::kAckNotifications, 21),
             Catch::StartsWith("ack-notifications entry 21: the payload is not an "
                               "AckNotificationsRequest"));
  CHECK_FALSE(ring.Closed(100));
  // Too many sequences listed: gRPC's bound, naming the entry.
  v1::AckNotificationsRequest many;
  many.set_subscription("s");
  for (uint64_t i = 0; i <= 65536; ++i) many.add_sequences(i + 1);
  const std::string bytes = many.SerializeAsString();
  RawRing large(pair.prefill(), 4096);
  large.Write(0, Header(fr::kAckNotifications, bytes.size(), 22), bytes);
  large.Publish(fr::SlotsFor(bytes.size()));
  std::string message;
  fr::CompletionHeader c = large.WaitCompletion(1, 0, &message);
  CHECK(c.user_data == 22);
  CHECK(c.code == static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  CHECK(message == "ack-notifications entry 22: 65537 sequences listed, at most 65536; "
                   "acknowledge a prefix with through_sequence");
}

TEST_CASE("fast path: a watch entry that does not parse is refused, naming it; the ring goes on and a later watch works") {
  AgentPair pair;
  cli::AgentClient raw_client(pair.decode_process().address());
  RawRing ring(raw_client);
  CHECK_THAT(RefusedGarbage(ring, fr::kWatchNotifications, 31),
             Catch::StartsWith("watch-notifications entry 31: the payload is not a "
                               "WatchNotificationsRequest"));
  REQUIRE_FALSE(ring.Closed(100));
  std::string message;
  fr::CompletionHeader c;
  // A valid watch after it is in place, and gets the next notification.
  const std::string watch = v1::WatchNotificationsRequest().SerializeAsString();
  ring.Write(1, Header(fr::kWatchNotifications, watch.size(), 32), watch);
  ring.Publish(2);
  c = ring.WaitCompletion(2, 1, &message);
  CHECK(c.user_data == 32);
  CHECK(c.code == 0);
  GrpcWrite(pair, "after-garbage", 1, 2, "g");
  c = ring.WaitCompletion(3, 2, &message);
  CHECK(c.opcode == fr::kNotification);
  CHECK(c.user_data == 32);
  v1::Notification n;
  const char* at = ring.base + ring.info.completion_offset() + 2 * fr::kCompletionBytes;
  REQUIRE(n.ParseFromArray(at + sizeof(fr::CompletionHeader), static_cast<int>(c.message_length)));
  CHECK(n.transfer_id() == "after-garbage");
  CHECK(PollCount(pair.decode()) == 0);
}

TEST_CASE("fast path: a watch filters on at most 4096 transfer ids, on the ring as through gRPC") {
  AgentPair pair;
  std::vector<std::string> ids;
  for (int i = 0; i <= 4096; ++i) ids.push_back(fmt::format("t{}", i));
  auto fast = OpenFast(pair.decode());
  REQUIRE(fast->WatchNotifications(ids, 41).ok());
  FastCompletion c = ReapOne(*fast);
  CHECK(c.user_data == 41);
  CHECK(c.code == absl::StatusCode::kInvalidArgument);
  CHECK(c.message ==
        "watch-notifications entry 41: 4097 transfer_ids to filter on, at most 4096; watch the "
        "transfers in flight only, or leave transfer_ids empty (every notification this caller "
        "may take) and filter on the notifications' transfer_id");
  auto polled = pair.decode().Poll(0, ids);
  CHECK(polled.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(polled.status().message()),
             Contains("PollNotifications: 4097 transfer_ids to filter on, at most 4096"));
  absl::Status watched =
      pair.decode().WatchNotifications(ids, 2000, [](const v1::Notification&) { return false; });
  CHECK(watched.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(watched.message()),
             Contains("WatchNotifications: 4097 transfer_ids to filter on, at most 4096"));
  // 4096 is fine (the ring's watch is in place, and filters).
  ids.pop_back();
  ids.back() = "wanted";
  REQUIRE(fast->WatchNotifications(ids, kWatchData).ok());
  CHECK(ReapOne(*fast).code == absl::StatusCode::kOk);
  GrpcWrite(pair, "unwanted", 3, 4, "u");
  GrpcWrite(pair, "wanted", 1, 2, "w");
  auto notes = ReapNotes(*fast, 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].notification->transfer_id() == "wanted");
}

// ---- close_fast_path: the ring closes, the session stays ----

TEST_CASE("fast path: a session closes its ring: its transfer runs to its end, later notifications go to gRPC, a new ring works") {
  AgentPair pair(StoppablePeer({"--metrics-listen", "127.0.0.1:0"}));
  // The decode session's watching ring holds one notification written and not reaped.
  auto watch = OpenWatching(pair.decode());
  GrpcWrite(pair, "before-close", 1, 1, "b");
  CHECK(WaitStatus(pair.decode(), [](const auto& s) { return s.fast_path_notifications() == 1; })
            .fast_path_notifications() == 1);
  absl::StatusOr<client::FastPathClose> closed = watch->Close();
  INFO(closed.status().ToString());
  REQUIRE(closed.ok());
  CHECK(closed->closed_by_agent);
  CHECK(closed->transfers_running == 0);
  // What the ring held before the close is the client's to read.
  REQUIRE(closed->left.size() == 1);
  CHECK(closed->left[0].opcode == fr::kNotification);
  REQUIRE(closed->left[0].notification.has_value());
  CHECK(closed->left[0].notification->transfer_id() == "before-close");
  CHECK_THAT(watch->closed_reason(), Contains("closed by the session's close_fast_path request"));
  CHECK(watch->Ping(1).code() == absl::StatusCode::kFailedPrecondition);
  v1::AgentStatus status =
      WaitStatus(pair.decode(), [](const auto& s) { return s.fast_path_rings() == 0; });
  CHECK(status.fast_path_rings() == 0);
  CHECK(status.fast_path_closed_by_request() == 1);
  CHECK(status.fast_path_protocol_errors() == 0);
  // A notification pushed after the close stays queued for gRPC (the session is up).
  GrpcWrite(pair, "after-close", 2, 2, "a");
  std::vector<v1::Notification> polled = PollFor(pair.decode(), 1);
  REQUIRE(polled.size() == 1);
  CHECK(polled[0].transfer_id() == "after-close");
  CHECK(pair.PageEqual(2, 2));
  // A second close finds no ring.
  absl::StatusOr<client::FastPathClose> again = watch->Close();
  CHECK(again.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(again.status().message()),
             Contains("has no fast path open") && Contains("open one with open_fast_path"));
  // The same session opens a new ring, which watches again.
  watch = OpenWatching(pair.decode());
  GrpcWrite(pair, "reopened", 3, 3, "r");
  auto notes = ReapNotes(*watch, 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].notification->transfer_id() == "reopened");

  // The prefill session's watching ring closes with a transfer in flight (its peer stopped).
  auto fast = OpenWatching(pair.prefill());
  REQUIRE(SuspendAgent(pair.decode_process().pid()) == "");
  REQUIRE(fast->Submit(KvWrite("in-flight", {5}, {6}), 1).ok());
  WaitKnown(pair.prefill(), "in-flight");
  REQUIRE(WaitTransferring(pair.prefill(), "in-flight").ok());
  closed = fast->Close();
  INFO(closed.status().ToString());
  REQUIRE(closed.ok());
  CHECK(closed->transfers_running == 1);
  CHECK(closed->left.empty());
  REQUIRE(kill(pair.decode_process().pid(), SIGCONT) == 0);
  // It runs to its end: the bytes arrive (its completion is dropped).
  auto done = pair.prefill().WaitTransfer("in-flight", 20000);
  REQUIRE(done.ok());
  INFO(done->error_message());
  CHECK(done->phase() == v1::COMPLETED);
  CHECK(pair.PageEqual(5, 6));
  status = WaitStatus(pair.prefill(), [](const auto& s) { return s.fast_path_rings() == 0; });
  CHECK(status.fast_path_rings() == 0);
  CHECK(status.fast_path_closed_by_request() == 1);
  CHECK(Value(Scrape(MetricsAddress(pair.prefill())), "kvagent_fast_path_closed_by_request_total") ==
        1);
  // A new ring on the same session transfers.
  fast = OpenFast(pair.prefill());
  HonestFastWrite(pair, *fast, "after-reopen", 7, 8);
}

TEST_CASE("fast path: close_fast_path without a ring is FAILED_PRECONDITION, naming the fix") {
  AgentPair pair;
  auto session = pair.prefill().Session();
  REQUIRE(session.ok());
  absl::StatusOr<v1::FastPathClosed> closed = (*session)->CloseFastPath();
  CHECK(closed.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(closed.status().message()),
             Contains("close_fast_path: session") && Contains("has no fast path open") &&
                 Contains("open one with open_fast_path"));
  // The session goes on.
  auto fast = OpenFast(pair.prefill());
  HonestFastWrite(pair, *fast, "still-up", 1, 2);
  CHECK(pair.prefill().Status()->fast_path_closed_by_request() == 0);
}

TEST_CASE("fast path: a ring destroyed without Close() is closed by its destructor; the session stays, later notifications go to gRPC") {
  AgentPair pair;
  auto watch = OpenWatching(pair.decode());
  CHECK(pair.decode().Status()->fast_path_rings() == 1);
  watch.reset();  // no Close()
  v1::AgentStatus status = WaitStatus(pair.decode(), [](const auto& s) {
    return s.fast_path_rings() == 0 && s.fast_path_closed_by_request() == 1;
  });
  CHECK(status.fast_path_rings() == 0);
  CHECK(status.fast_path_closed_by_request() == 1);
  CHECK(status.fast_path_protocol_errors() == 0);
  // `kvagentctl status` prints the count.
  CHECK_THAT(DecodeStatusText(pair),
             Contains("fast path    0 rings, ") &&
                 Contains(" entries taken, 0 rings closed for protocol errors, 1 closed by their "
                          "session's request\n"));
  // No watch swallows it: a gRPC poll of the same session takes it.
  GrpcWrite(pair, "after-destroy", 1, 1, "a");
  std::vector<v1::Notification> polled = PollFor(pair.decode(), 1);
  REQUIRE(polled.size() == 1);
  CHECK(polled[0].transfer_id() == "after-destroy");
  CHECK(pair.PageEqual(1, 1));
  // The session is the same one: it opens a new ring, which transfers; one Close()d
  // first is not closed again by its destructor.
  auto fast = OpenFast(pair.prefill());
  HonestFastWrite(pair, *fast, "after-destroy-ring", 2, 3);
  REQUIRE(fast->Close().ok());
  fast.reset();
  CHECK(pair.prefill().Status()->fast_path_closed_by_request() == 1);
  CHECK(pair.decode().Status()->fast_path_closed_by_request() == 1);
}

// Destroys `fast`; returns how long that took.
std::chrono::milliseconds DestroyTimed(std::unique_ptr<FastPath>& fast) {
  const auto start = std::chrono::steady_clock::now();
  fast.reset();
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               start);
}

TEST_CASE("fast path: a ring's destructor does not hang on an agent that is gone, stopped or shut down") {
  AgentPair pair(StoppablePeer());
  // The decode agent killed: the close finds the session gone.
  auto killed = OpenFast(pair.decode());
  pair.decode_process().Kill();
  // Hang guards only (a generous bound; the session's own timeout is 10 s).
  CHECK(DestroyTimed(killed) < std::chrono::milliseconds(5000));

  // The prefill agent stopped: the destructor waits about a second, not the session's
  // 10 s; the agent, resumed, reads the late close and closes the ring.
  auto stopped = OpenFast(pair.prefill());
  REQUIRE(SuspendAgent(pair.prefill_process().pid()) == "");
  const std::chrono::milliseconds waited = DestroyTimed(stopped);
  REQUIRE(kill(pair.prefill_process().pid(), SIGCONT) == 0);
  CHECK(waited < std::chrono::milliseconds(5000));
  v1::AgentStatus status =
      WaitStatus(pair.prefill(), [](const auto& s) { return s.fast_path_rings() == 0; });
  CHECK(status.fast_path_rings() == 0);
  CHECK(status.fast_path_closed_by_request() == 1);
  // The session survived the timed-out call: a new ring transfers (to itself: the decode
  // agent is gone).
  auto fast = OpenFast(pair.prefill());
  REQUIRE(fast->Ping(5).ok());
  FastCompletion pong = ReapOne(*fast);
  CHECK(pong.user_data == 5);
  CHECK(pong.code == absl::StatusCode::kOk);

  // The prefill agent shut down (SIGTERM): its sessions end, then the ring goes.
  REQUIRE(pair.prefill_process().Stop().ok());
  CHECK(DestroyTimed(fast) < std::chrono::milliseconds(5000));
}

// A session socket in front of `agent`'s that forwards every datagram, descriptors
// included, both ways, but hands the agent each close_fast_path request as a body it
// does not know (field 105), which it answers UNIMPLEMENTED: how an agent older than
// close_fast_path sees the request. Counts the requests it rewrote.
class OlderAgentDoor {
 public:
  OlderAgentDoor(const std::string& path, cli::DaemonProcess& agent) : path_(path) {
    auto address = client::MakeUnixAddress(path);
    REQUIRE(address.ok());
    unlink(path.c_str());
    REQUIRE(bind(listener_.get(), reinterpret_cast<const sockaddr*>(&address->address),
                 address->length) == 0);
    REQUIRE(listen(listener_.get(), 1) == 0);
    REQUIRE(stop_);
    thread_ = std::thread([this, agent_path = agent.local_socket() + ".session"] {
      Forward(agent_path);
    });
  }
  ~OlderAgentDoor() {
    const uint64_t one = 1;
    CHECK(write(stop_.get(), &one, sizeof(one)) == sizeof(one));
    thread_.join();
    unlink(path_.c_str());
  }
  int closes_rewritten() const { return closes_rewritten_.load(); }

 private:
  // Forwards one message from `from` to `to`; false when either side is gone.
  template <typename Message>
  bool Pass(int from, int to) {
    Message message;
    std::vector<UniqueFd> fds;
    if (!client::ReceiveMessage(from, &message, &fds, 0).ok()) return false;
    if constexpr (std::is_same_v<Message, v1::SessionRequest>) {
      if (message.has_close_fast_path()) {
        message.clear_close_fast_path();
        const std::string unknown_body("\xca\x06\x00", 3);
        if (!message.ParseFromString(message.SerializeAsString() + unknown_body)) return false;
        ++closes_rewritten_;
      }
    }
    std::vector<int> raw;
    for (const UniqueFd& fd : fds) raw.push_back(fd.get());
    return client::SendMessage(to, message, raw).ok();
  }

  void Forward(const std::string& agent_path) {
    pollfd accepting[2] = {{listener_.get(), POLLIN, 0}, {stop_.get(), POLLIN, 0}};
    if (poll(accepting, 2, -1) <= 0 || (accepting[0].revents & POLLIN) == 0) return;
    UniqueFd engine(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    UniqueFd agent(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    auto address = client::MakeUnixAddress(agent_path);
    if (!engine || !address.ok() ||
        connect(agent.get(), reinterpret_cast<const sockaddr*>(&address->address),
                address->length) != 0) {
      return;
    }
    for (;;) {
      pollfd fds[3] = {
          {engine.get(), POLLIN, 0}, {agent.get(), POLLIN, 0}, {stop_.get(), POLLIN, 0}};
      if (poll(fds, 3, -1) <= 0 || fds[2].revents != 0) return;
      if (fds[0].revents != 0 && !Pass<v1::SessionRequest>(engine.get(), agent.get())) return;
      if (fds[1].revents != 0 && !Pass<v1::SessionReply>(agent.get(), engine.get())) return;
    }
  }

  const std::string path_;
  UniqueFd listener_{socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0)};
  UniqueFd stop_{eventfd(0, EFD_CLOEXEC)};
  std::atomic<int> closes_rewritten_{0};
  std::thread thread_;
};

// Mappings of fast path ring files in this process.
int RingMappings() {
  std::ifstream maps("/proc/self/maps");
  int count = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/memfd:kvagent-fast-path") != std::string::npos) ++count;
  }
  return count;
}

TEST_CASE("fast path: Close() against an agent older than close_fast_path says so, unmaps and does not hang") {
  AgentPair pair;
  // Beside the agent's own socket (whose path fits a Unix address with ".session").
  const std::string door_path = pair.decode_process().local_socket() + ".older";
  OlderAgentDoor door(door_path, pair.decode_process());
  auto session = client::LocalSession::Attach(door_path, "older-door");
  INFO(session.status().ToString());
  REQUIRE(session.ok());
  const int mapped_before = RingMappings();
  auto opened = FastPath::Open(session->get());
  INFO(opened.status().ToString());
  REQUIRE(opened.ok());
  std::unique_ptr<FastPath> fast = *std::move(opened);
  CHECK(RingMappings() == mapped_before + 1);
  REQUIRE(fast->Ping(1).ok());
  CHECK(ReapOne(*fast).code == absl::StatusCode::kOk);
  CHECK(pair.decode().Status()->fast_path_rings() == 1);

  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<client::FastPathClose> closed = fast->Close();
  const auto took = std::chrono::steady_clock::now() - start;
  INFO(closed.status().ToString());
  REQUIRE(closed.ok());
  CHECK_FALSE(closed->closed_by_agent);  // the agent is older: it keeps the ring
  CHECK(closed->transfers_running == 0);
  CHECK(closed->left.empty());
  CHECK(took < std::chrono::seconds(5));  // a hang guard (the session's timeout is 10 s)
  CHECK(door.closes_rewritten() == 1);
  v1::AgentStatus status = *pair.decode().Status();
  CHECK(status.fast_path_rings() == 1);  // until the session ends, as before
  CHECK(status.fast_path_closed_by_request() == 0);
  // The destructor only unmaps: it does not ask again.
  CHECK(DestroyTimed(fast) < std::chrono::milliseconds(5000));
  CHECK(RingMappings() == mapped_before);
  CHECK(door.closes_rewritten() == 1);
  // The session's end closes the ring.
  session->reset();
  status = WaitStatus(pair.decode(), [](const auto& s) { return s.fast_path_rings() == 0; });
  CHECK(status.fast_path_rings() == 0);
  CHECK(status.fast_path_closed_by_request() == 0);
}

TEST_CASE("fast path: a durable ring closed by its session: what it held unacknowledged comes again to the next attachment") {
  AgentPair pair;
  auto engine = Named(pair.decode_process(), "decode-5");
  auto fast = OpenDurable(*engine, "kv-close", RingOf(8));
  for (int i = 0; i < 2; ++i) GrpcWrite(pair, fmt::format("held-{}", i), i, i, "h");
  CHECK(WaitStatus(pair.decode(), [](const auto& s) { return s.fast_path_notifications() == 2; })
            .fast_path_notifications() == 2);
  absl::StatusOr<client::FastPathClose> closed = fast->Close();
  INFO(closed.status().ToString());
  REQUIRE(closed.ok());
  REQUIRE(closed->left.size() == 2);  // read, not acknowledged
  CHECK(closed->left[0].notification->sequence() == 1);
  CHECK(closed->left[1].notification->sequence() == 2);
  // One more after the close: queued (a detached subscription takes no new ones), not
  // written on the closed ring; the two stay held by the subscription.
  GrpcWrite(pair, "held-2", 2, 2, "h");
  v1::AgentStatus status =
      WaitStatus(pair.decode(), [](const auto& s) { return s.notifications_queued() == 1; });
  CHECK(status.notifications_queued() == 1);
  CHECK(status.notifications_in_flight() == 2);
  CHECK(status.fast_path_notifications() == 2);
  CHECK(status.fast_path_rings() == 0);
  CHECK(status.subscriptions() == 1);
  // The same session attaches again: the two held come again, same sequences, then the
  // queued one.
  fast = OpenDurable(*engine, "kv-close", RingOf(8));
  std::vector<v1::Notification> notes = ReapDurable(*fast, 3);
  REQUIRE(notes.size() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(notes[i].transfer_id() == fmt::format("held-{}", i));
    CHECK(notes[i].sequence() == static_cast<uint64_t>(i + 1));
  }
}

TEST_CASE("fast path: against an agent without the feature bits the client writes nothing and says so") {
  for (const char* features : {"0", "1"}) {
    DYNAMIC_SECTION("--fast-path-features " << features) {
      AgentPairOptions options;
      options.extra_args = {"--fast-path-features", features};
      AgentPair pair(options);
      auto fast = OpenFast(pair.decode());
      CHECK(fast->info().features() == static_cast<uint32_t>(std::stoi(features)));
      CHECK_FALSE(fast->delivers_durable_notifications());
      absl::Status durable = fast->WatchNotifications({}, "sub", 1);
      CHECK(durable.code() == absl::StatusCode::kFailedPrecondition);
      CHECK_THAT(std::string(durable.message()),
                 Contains("WatchNotifications with subscription 'sub': this agent's fast path "
                          "has no durable subscriptions"));
      absl::Status ack = fast->AckNotifications("sub", 1, {}, 2);
      CHECK(ack.code() == absl::StatusCode::kFailedPrecondition);
      CHECK_THAT(std::string(ack.message()),
                 Contains("AckNotifications of subscription 'sub': this agent's fast path has "
                          "no durable subscriptions"));
      if (std::string(features) == "0") {
        CHECK_FALSE(fast->delivers_notifications());
        absl::Status watch = fast->WatchNotifications({}, 3);
        CHECK(watch.code() == absl::StatusCode::kFailedPrecondition);
        CHECK_THAT(std::string(watch.message()),
                   Contains("this agent's fast path does not deliver notifications"));
      }
      // Nothing was written: such an agent closes the ring on an entry it does not
      // take, and this one answers the ping, first.
      CHECK(fast->outstanding() == 0);
      REQUIRE(fast->Ping(4).ok());
      FastCompletion c = ReapOne(*fast);
      CHECK(c.opcode == fr::kPing);
      CHECK(c.user_data == 4);
      CHECK(fast->closed_reason().empty());
      // And it is such an agent: the entry a careless client writes closes the ring.
      cli::AgentClient raw_client(pair.decode_process().address());
      RawRing ring(raw_client);
      const std::string bytes = v1::AckNotificationsRequest().SerializeAsString();
      ring.Write(0, Header(fr::kAckNotifications, bytes.size(), 5), bytes);
      ring.Publish(1);
      REQUIRE(ring.Closed());
      CHECK_THAT(ring.Reason(), Contains("opcode 6"));
    }
  }
}

}  // namespace
}  // namespace kvagent::testing

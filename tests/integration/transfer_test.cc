// Two real kvagentd processes on loopback: WRITE, READ, chunked transfers, byte
// segments, notifications (poll and watch), cancel, deadlines. Every transfer's
// bytes are compared in shared memory.
#include <chrono>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "tests/integration/agent_pair.h"

namespace kvagent::testing {
namespace {

using v1::TransferPhase;

v1::TransferState WaitDone(cli::AgentClient& client, const std::string& id) {
  auto state = client.WaitTransfer(id, 20000);
  REQUIRE(state.ok());
  return *state;
}

TEST_CASE("WRITE pushes scattered pages of every layer and notifies after the data") {
  AgentPair pair;
  const std::vector<uint64_t> src = {3, 4, 9, 10, 11, 20};
  const std::vector<uint64_t> dst = {30, 1, 17, 18, 19, 5};
  auto submitted = SubmitThrough(pair.prefill(), KvWrite("req-write", src, dst, "first-token:42"));
  REQUIRE(submitted.ok());
  auto done = WaitDone(pair.prefill(), "req-write");
  INFO(done.error_message());
  REQUIRE(done.phase() == v1::COMPLETED);
  CHECK(done.drained());
  CHECK(done.items() == 6);
  CHECK(done.bytes_total() == 6 * 8 * 4096);  // 6 pages x 4 layers x K,V x 4 KiB
  CHECK(done.bytes_done() == done.bytes_total());
  // 4,9 -> 1,17 break; 10,11 -> 18,19 continue 9 -> 17: runs per region are
  // {3}, {4}, {9,10,11}, {20} = 4, times 8 regions.
  CHECK(done.runs() == 32);

  auto notes = PollNotifications(pair.decode(), 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].transfer_id() == "req-write");
  CHECK(notes[0].from_agent() == "prefill");
  CHECK(notes[0].payload() == "first-token:42");
  CHECK(notes[0].kind() == v1::DATA_READY);
  for (size_t i = 0; i < src.size(); ++i) CHECK(pair.PageEqual(src[i], dst[i]));
  for (uint64_t p : {0, 2, 6, 31}) CHECK(pair.PageUntouched(p));
}

TEST_CASE("READ pulls the peer's pages and tells the peer when done") {
  AgentPair pair;
  auto connected = pair.decode().Connect(pair.prefill_process().address());
  REQUIRE(connected.ok());
  CHECK(connected->name() == "prefill");
  v1::SubmitTransferRequest read;
  read.set_transfer_id("req-read");
  read.set_peer("prefill");
  read.set_op(v1::READ);
  read.set_notification("pulled");
  auto* items = read.add_segments()->mutable_items();
  items->set_local_group("kv");
  items->set_remote_group("kv");
  for (uint64_t i : {7, 8}) items->add_local_indices(i);   // decode pages
  for (uint64_t i : {2, 29}) items->add_remote_indices(i); // prefill pages
  REQUIRE(SubmitThrough(pair.decode(), read).ok());
  auto done = WaitDone(pair.decode(), "req-read");
  INFO(done.error_message());
  REQUIRE(done.phase() == v1::COMPLETED);
  CHECK(pair.PageEqual(2, 7));
  CHECK(pair.PageEqual(29, 8));
  auto notes = PollNotifications(pair.prefill(), 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].payload() == "pulled");
  CHECK(notes[0].from_agent() == "decode");
}

TEST_CASE("chunked transfer notifies once, after its last chunk") {
  AgentPair pair;
  auto chunk = [](uint32_t index, bool more, std::vector<uint64_t> src, std::vector<uint64_t> dst) {
    auto r = KvWrite("req-chunked", src, dst, more ? "" : "all-chunks");
    r.set_chunk(index);
    r.set_more_chunks(more);
    return r;
  };
  REQUIRE(SubmitThrough(pair.prefill(), chunk(0, true, {0, 1}, {10, 11})).ok());
  REQUIRE(SubmitThrough(pair.prefill(), chunk(1, true, {2}, {12})).ok());

  SECTION("a retried chunk is idempotent; a changed one is refused") {
    auto again = SubmitThrough(pair.prefill(), chunk(1, true, {2}, {12}));
    CHECK(again.ok());
    auto changed = SubmitThrough(pair.prefill(), chunk(1, true, {3}, {12}));
    REQUIRE_FALSE(changed.ok());
    CHECK(changed.status().code() == absl::StatusCode::kAlreadyExists);
    CHECK_THAT(std::string(changed.status().message()),
               Catch::Contains("req-chunked") && Catch::Contains("chunk 1") &&
                   Catch::Contains("different content"));
    auto skipped = SubmitThrough(pair.prefill(), chunk(3, false, {4}, {14}));
    REQUIRE_FALSE(skipped.ok());
    CHECK(skipped.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(skipped.status().message()), Catch::Contains("chunk 2 is next"));
  }

  // The first chunks' data moves while the transfer waits for the rest, but the
  // decode side hears nothing yet.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto early = pair.decode().Poll(0);
  REQUIRE(early.ok());
  CHECK(early->notifications_size() == 0);
  auto mid = pair.prefill().Get("req-chunked");
  REQUIRE(mid.ok());
  CHECK_FALSE(mid->last_chunk_received());
  CHECK(mid->phase() != v1::COMPLETED);

  REQUIRE(SubmitThrough(pair.prefill(), chunk(2, false, {3, 4}, {13, 14})).ok());
  auto done = WaitDone(pair.prefill(), "req-chunked");
  REQUIRE(done.phase() == v1::COMPLETED);
  CHECK(done.chunks() == 3);
  CHECK(done.items() == 5);
  auto notes = PollNotifications(pair.decode(), 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].payload() == "all-chunks");
  for (uint64_t i = 0; i < 5; ++i) CHECK(pair.PageEqual(i, 10 + i));
  // Exactly one notification, even after a resubmitted final chunk.
  REQUIRE(SubmitThrough(pair.prefill(), chunk(2, false, {3, 4}, {13, 14})).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto later = pair.decode().Poll(0);
  REQUIRE(later.ok());
  CHECK(later->notifications_size() == 0);
}

TEST_CASE("byte segments move AUX data next to KV pages in one transfer") {
  AgentPair pair;
  // An AUX region per side, inside fresh shared memory.
  auto make_aux = [](cli::AgentClient& agent, const std::string& name) {
    auto shm = agent.AllocateMemory(name, 4096);
    REQUIRE(shm.ok());
    v1::RegisterRegionsRequest request;
    auto* spec = request.add_regions();
    spec->set_name(name);
    spec->set_kind(v1::AUX);
    spec->set_group("aux");
    spec->set_length(4096);
    spec->mutable_shm()->set_memory_handle(shm->info.handle());
    REQUIRE(agent.Register(request).ok());
    auto mapped = absl::StatusOr<registry::ShmMapping>(std::move(shm->mapping));
    REQUIRE(mapped.ok());
    return *std::move(mapped);
  };
  auto src = make_aux(pair.prefill(), "meta-src");
  auto dst = make_aux(pair.decode(), "meta-dst");
  std::memcpy(static_cast<char*>(src.data()) + 100, "first token 1234", 16);
  std::memset(dst.data(), 0, 4096);

  auto request = KvWrite("req-aux", {5}, {6}, "kv+aux");
  auto* bytes = request.add_segments()->mutable_bytes();
  bytes->set_local_region("meta-src");
  bytes->set_local_offset(100);
  bytes->set_remote_region("meta-dst");
  bytes->set_remote_offset(2000);
  bytes->set_length(16);
  // meta-dst was registered after prefill connected: the submit must still find it.
  auto submitted = SubmitThrough(pair.prefill(), request);
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  auto done = WaitDone(pair.prefill(), "req-aux");
  INFO(done.error_message());
  REQUIRE(done.phase() == v1::COMPLETED);
  CHECK(std::memcmp(static_cast<char*>(dst.data()) + 2000, "first token 1234", 16) == 0);
  CHECK(static_cast<char*>(dst.data())[1999] == 0);
  CHECK(static_cast<char*>(dst.data())[2016] == 0);
  CHECK(pair.PageEqual(5, 6));
  REQUIRE(PollNotifications(pair.decode(), 1).size() == 1);
}

TEST_CASE("notifications stream to a watcher as they arrive") {
  AgentPair pair;
  std::vector<std::string> seen;
  std::thread watcher([&] {
    cli::AgentClient client(pair.decode_process().address());
    auto status = client.WatchNotifications({"w-1", "w-2"}, 20000, [&](const v1::Notification& n) {
      seen.push_back(n.transfer_id() + ":" + n.payload());
      return seen.size() < 2;
    });
    CHECK(status.ok());
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  REQUIRE(SubmitThrough(pair.prefill(), KvWrite("w-other", {0}, {0}, "not watched")).ok());
  REQUIRE(SubmitThrough(pair.prefill(), KvWrite("w-1", {1}, {1}, "a")).ok());
  REQUIRE(SubmitThrough(pair.prefill(), KvWrite("w-2", {2}, {2}, "b")).ok());
  watcher.join();
  REQUIRE(seen.size() == 2);
  std::sort(seen.begin(), seen.end());
  CHECK(seen[0] == "w-1:a");
  CHECK(seen[1] == "w-2:b");
  // The one nobody watched waits in the queue.
  auto rest = PollNotifications(pair.decode(), 1);
  REQUIRE(rest.size() == 1);
  CHECK(rest[0].transfer_id() == "w-other");
}

TEST_CASE("cancel stops a transfer, reports drained, and tells the peer") {
  AgentPair pair;
  auto first = KvWrite("req-cancel", {0}, {0});
  first.set_more_chunks(true);
  REQUIRE(SubmitThrough(pair.prefill(), first).ok());
  auto cancelled = pair.prefill().Cancel("req-cancel");
  REQUIRE(cancelled.ok());
  CHECK(cancelled->phase() == v1::CANCELLED);
  auto done = WaitDone(pair.prefill(), "req-cancel");
  CHECK(done.phase() == v1::CANCELLED);
  // drained comes when no posted operation can still write the peer.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!done.drained() && std::chrono::steady_clock::now() < until) {
    done = *pair.prefill().Get("req-cancel");
  }
  CHECK(done.drained());
  auto notes = PollNotifications(pair.decode(), 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].kind() == v1::CANCELLED_BY_PEER);
  auto more = KvWrite("req-cancel", {1}, {1});
  more.set_chunk(1);
  auto refused = SubmitThrough(pair.prefill(), more);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a transfer that misses its deadline times out with the reason") {
  AgentPair pair;
  auto open = KvWrite("req-late", {0}, {0});
  open.set_more_chunks(true);  // the last chunk never comes
  open.set_timeout_ms(300);
  REQUIRE(SubmitThrough(pair.prefill(), open).ok());
  auto done = WaitDone(pair.prefill(), "req-late");
  CHECK(done.phase() == v1::TIMED_OUT);
  CHECK(done.error_code() == static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  CHECK_THAT(done.error_message(),
             Catch::Contains("req-late") && Catch::Contains("300 ms") &&
                 Catch::Contains("last chunk never submitted"));
  // The decode side hears the outcome too, once: its pages hold no reliable data.
  auto notes = PollNotifications(pair.decode(), 1, 5000);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].kind() == v1::TRANSFER_TIMED_OUT);
  CHECK(notes[0].transfer_id() == "req-late");
  CHECK(notes[0].error_code() == static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  CHECK_THAT(notes[0].error_message(), Catch::Contains("300 ms"));
  auto incoming = pair.decode().Get("req-late");
  REQUIRE(incoming.ok());
  CHECK(incoming->direction() == v1::INCOMING);
  CHECK(incoming->phase() == v1::TIMED_OUT);
  CHECK(incoming->peer() == "prefill");
}

TEST_CASE("--ended-transfers-kept bounds the ended transfers each agent keeps for queries") {
  AgentPairOptions options;
  options.extra_args = {"--ended-transfers-kept", "3"};
  AgentPair pair(options);
  for (uint64_t i = 0; i < 6; ++i) {
    const std::string id = "kept-" + std::to_string(i);
    REQUIRE(SubmitThrough(pair.prefill(), KvWrite(id, {i}, {i}, "n")).ok());
    REQUIRE(WaitDone(pair.prefill(), id).phase() == v1::COMPLETED);
    CHECK(pair.PageEqual(i, i));
  }
  // The sender keeps the newest 3 ended transfers and names its bound for the others.
  for (uint64_t i = 3; i < 6; ++i) CHECK(pair.prefill().Get("kept-" + std::to_string(i)).ok());
  for (const std::string id : {"kept-0", "kept-2"}) {
    INFO(id);
    auto gone = pair.prefill().Get(id);
    REQUIRE(!gone.ok());
    CHECK(gone.status().code() == absl::StatusCode::kNotFound);
    CHECK_THAT(std::string(gone.status().message()),
               Catch::Contains(id) && Catch::Contains("kept for the last 3"));
  }
  auto outgoing = pair.prefill().Transfers(/*active_only=*/false);
  REQUIRE(outgoing.ok());
  CHECK(outgoing->transfers_size() == 3);
  // The receiver likewise, once the newest has ended there: its 3 newest, no more.
  std::set<std::string> incoming;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < until) {
    auto listed = pair.decode().Transfers(/*active_only=*/false, /*incoming=*/true);
    REQUIRE(listed.ok());
    incoming.clear();
    bool newest_ended = false;
    for (const auto& t : listed->transfers()) {
      incoming.insert(t.transfer_id());
      if (t.transfer_id() == "kept-5" && t.phase() == v1::COMPLETED) newest_ended = true;
    }
    if (newest_ended) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(incoming == std::set<std::string>{"kept-3", "kept-4", "kept-5"});
}

TEST_CASE("ended transfers past the newest 256 are kept compact and answer as whole ones") {
  // The engine keeps its newest 256 ended transfers whole and older ones, up to the
  // bound, as a serialized state (agent/ended_log.h): with 300 kept and 310 ended, the
  // oldest 10 are gone, the next 44 compact, the newest 256 whole.
  AgentPairOptions options;
  options.extra_args = {"--ended-transfers-kept", "300"};
  AgentPair pair(options);
  constexpr uint64_t kEnded = 310;
  constexpr uint64_t kPages = 8;  // pages written in turn (the pool has more)
  std::vector<v1::TransferState> ended;
  for (uint64_t i = 0; i < kEnded; ++i) {
    const std::string id = "many-" + std::to_string(i);
    REQUIRE(SubmitThrough(pair.prefill(), KvWrite(id, {i % kPages}, {i % kPages}, "n")).ok());
    ended.push_back(WaitDone(pair.prefill(), id));
    REQUIRE(ended.back().phase() == v1::COMPLETED);
  }
  for (uint64_t i = 0; i < kEnded; ++i) {
    const std::string id = "many-" + std::to_string(i);
    INFO(id);
    auto kept = pair.prefill().Get(id);
    if (i < kEnded - 300) {
      REQUIRE(!kept.ok());
      CHECK(kept.status().code() == absl::StatusCode::kNotFound);
      continue;
    }
    REQUIRE(kept.ok());
    CHECK(kept->transfer_id() == id);
    CHECK(kept->phase() == v1::COMPLETED);
    CHECK(kept->drained());
    CHECK(kept->bytes_total() == ended[i].bytes_total());
    CHECK(kept->bytes_done() == ended[i].bytes_total());
    CHECK(kept->owner() == ended[i].owner());
    CHECK(kept->submitted_unix_us() == ended[i].submitted_unix_us());
    CHECK(kept->timeline_size() >= ended[i].timeline_size());
  }
  auto listed = pair.prefill().Transfers(/*active_only=*/false);
  REQUIRE(listed.ok());
  REQUIRE(listed->transfers_size() == 300);
  CHECK(listed->transfers(0).transfer_id() == "many-10");  // oldest first
  CHECK(listed->transfers(299).transfer_id() == "many-309");
  // A compact one (many-20) and a whole one (many-300) answer alike: an identical retry
  // gets the state, a different chunk under the id is refused, a cancel gets the state.
  for (const uint64_t i : {uint64_t{20}, uint64_t{300}}) {
    const std::string id = "many-" + std::to_string(i);
    INFO(id);
    auto retry = SubmitThrough(pair.prefill(), KvWrite(id, {i % kPages}, {i % kPages}, "n"));
    REQUIRE(retry.ok());
    CHECK(retry->phase() == v1::COMPLETED);
    CHECK(retry->submitted_unix_us() == ended[i].submitted_unix_us());
    auto conflict = SubmitThrough(pair.prefill(), KvWrite(id, {0}, {1}, "other"));
    REQUIRE(!conflict.ok());
    CHECK(conflict.status().code() == absl::StatusCode::kAlreadyExists);
    CHECK_THAT(std::string(conflict.status().message()), Catch::Contains("different content"));
    auto cancelled = pair.prefill().Cancel(id);
    REQUIRE(cancelled.ok());
    CHECK(cancelled->phase() == v1::COMPLETED);
    auto watched = pair.prefill().WaitTransfer(id, 5000);
    REQUIRE(watched.ok());
    CHECK(watched->phase() == v1::COMPLETED);
  }
  // Nothing was written again: each page holds what its last transfer wrote.
  for (uint64_t p = 0; p < kPages; ++p) CHECK(pair.PageEqual(p, p));
}

TEST_CASE("wait answers with the final state; a batch submits each entry on its own") {
  AgentPair pair;
  pair.ResetContents();
  auto one = KvWrite("req-wait", {2, 7}, {12, 3}, "waited");
  one.set_wait(true);
  auto done = SubmitThrough(pair.prefill(), one);
  REQUIRE(done.ok());
  INFO(done->error_message());
  CHECK(done->phase() == v1::COMPLETED);
  CHECK(done->bytes_done() == done->bytes_total());
  // Answered at the end: the bytes are already in place.
  CHECK(pair.PageEqual(2, 12));
  CHECK(pair.PageEqual(7, 3));
  // The same chunk again (a client retrying after a lost answer): the transfer has
  // ended, so the wait is answered at once with the same final state.
  auto again = SubmitThrough(pair.prefill(), one);
  REQUIRE(again.ok());
  CHECK(again->phase() == v1::COMPLETED);
  CHECK(again->bytes_done() == done->bytes_done());
  CHECK(again->timeline_size() == done->timeline_size());
  // A retry may carry another deadline, or no wait: still the same chunk. Anything else
  // that differs is another request under a used id.
  auto later = one;
  later.set_wait(false);
  later.set_timeout_ms(one.timeout_ms() + 1234);
  auto same = SubmitThrough(pair.prefill(), later);
  REQUIRE(same.ok());
  CHECK(same->phase() == v1::COMPLETED);
  auto other = one;
  other.set_notification("waited, twice");
  auto clash = SubmitThrough(pair.prefill(), other);
  REQUIRE_FALSE(clash.ok());
  CHECK(clash.status().code() == absl::StatusCode::kAlreadyExists);
  CHECK_THAT(std::string(clash.status().message()), Catch::Contains("different content"));

  // A chunked transfer waits on its last chunk only.
  auto open = KvWrite("req-wait-chunks", {4}, {14});
  open.set_more_chunks(true);
  auto early = open;
  early.set_wait(true);
  auto refused = SubmitThrough(pair.prefill(), early);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("req-wait-chunks") && Catch::Contains("last chunk"));
  REQUIRE(SubmitThrough(pair.prefill(), open).ok());
  auto last = KvWrite("req-wait-chunks", {5}, {15});
  last.set_chunk(1);
  last.set_wait(true);
  auto closed = SubmitThrough(pair.prefill(), last);
  REQUIRE(closed.ok());
  CHECK(closed->phase() == v1::COMPLETED);
  CHECK(closed->chunks() == 2);
  CHECK(pair.PageEqual(5, 15));

  // One bad entry fails only itself.
  v1::SubmitTransfersRequest batch;
  batch.set_wait(true);
  *batch.add_transfers() = KvWrite("req-batch-a", {8}, {20}, "a");
  auto bad = KvWrite("req-batch-bad", {9}, {21});
  bad.mutable_segments(0)->mutable_items()->set_remote_group("no-such-group");
  *batch.add_transfers() = bad;
  *batch.add_transfers() = KvWrite("req-batch-c", {10}, {22}, "c");
  auto answer = pair.prefill().SubmitBatch(batch);
  REQUIRE(answer.ok());
  REQUIRE(answer->results_size() == 3);
  CHECK(answer->results(0).error_code() == 0);
  CHECK(answer->results(0).state().phase() == v1::COMPLETED);
  CHECK(answer->results(1).error_code() != 0);
  CHECK_THAT(answer->results(1).error_message(),
             Catch::Contains("req-batch-bad") && Catch::Contains("no-such-group"));
  CHECK_FALSE(answer->results(1).has_state());
  CHECK(answer->results(2).state().phase() == v1::COMPLETED);
  CHECK(pair.PageEqual(8, 20));
  CHECK(pair.PageEqual(10, 22));
  CHECK(pair.PageUntouched(21));
  auto notes = PollNotifications(pair.decode(), 4);
  std::set<std::string> ids;
  for (const auto& n : notes) ids.insert(n.transfer_id());
  CHECK(ids == std::set<std::string>{"req-wait", "req-wait-chunks", "req-batch-a", "req-batch-c"});
}

TEST_CASE("the demo's shapes work under UCX_TLS=tcp,self as between hosts") {
  AgentPairOptions options;
  options.env["UCX_TLS"] = "tcp,self";
  options.extra_args = {"--shm-direct", "off"};
  AgentPair pair(options);
  auto peers = pair.prefill().Peers();
  REQUIRE(peers.ok());
  REQUIRE(peers->peers_size() == 1);
  CHECK(peers->peers(0).transports() == "tcp");
  CHECK(peers->peers(0).data_path() == "ucx-am");  // no native RMA over tcp
  REQUIRE(SubmitThrough(pair.prefill(), KvWrite("req-tcp", {1, 2, 3}, {9, 4, 5}, "tcp")).ok());
  auto done = WaitDone(pair.prefill(), "req-tcp");
  REQUIRE(done.phase() == v1::COMPLETED);
  CHECK(pair.PageEqual(1, 9));
  CHECK(pair.PageEqual(2, 4));
  CHECK(pair.PageEqual(3, 5));
}

}  // namespace
}  // namespace kvagent::testing

// Bad input through the real gRPC API of two kvagentd processes: every refused
// request must come back with the right code and a message that names the entry and
// the cause, and must leave what was already registered or in flight untouched
// (regions still listed, metadata version unchanged, transfers still moving bytes).
#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "tests/integration/agent_pair.h"

namespace kvagent::testing {
namespace {

using Catch::Contains;

v1::TransferState WaitDone(cli::AgentClient& client, const std::string& id) {
  auto state = client.WaitTransfer(id, 20000);
  INFO(state.status().ToString());
  REQUIRE(state.ok());
  return *state;
}

// Notifications for `ids` until `count` arrived or 10 s passed.
std::vector<v1::Notification> PollUntil(cli::AgentClient& client, size_t count,
                                        const std::vector<std::string>& ids) {
  constexpr uint32_t timeout_ms = 10000;
  std::vector<v1::Notification> out;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (out.size() < count && std::chrono::steady_clock::now() < until) {
    auto polled = client.Poll(0, ids);
    REQUIRE(polled.ok());
    for (const auto& n : polled->notifications()) out.push_back(n);
    if (out.size() < count) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return out;
}

std::vector<std::string> RegionNames(cli::AgentClient& client) {
  auto regions = client.Regions();
  REQUIRE(regions.ok());
  std::vector<std::string> names;
  for (const auto& r : regions->regions()) names.push_back(r.spec().name());
  return names;
}

uint64_t MetadataVersion(cli::AgentClient& client) {
  auto regions = client.Regions();
  REQUIRE(regions.ok());
  return regions->version();
}

std::string Message(const absl::Status& status) { return std::string(status.message()); }

// A region over [offset, offset+length) of shm object `shm`. AUX without a layout
// is one item covering the region.
v1::RegionSpec ShmRegion(const std::string& name, const std::string& shm, uint64_t offset,
                         uint64_t length) {
  v1::RegionSpec spec;
  spec.set_name(name);
  spec.set_kind(v1::AUX);
  spec.set_length(length);
  spec.mutable_shm()->set_name(shm);
  spec.mutable_shm()->set_offset(offset);
  return spec;
}

// The same over memory the session allocated (handle from AllocateMemory).
v1::RegionSpec ShmRegion(const std::string& name, uint64_t memory_handle, uint64_t offset,
                         uint64_t length) {
  v1::RegionSpec spec;
  spec.set_name(name);
  spec.set_kind(v1::AUX);
  spec.set_length(length);
  spec.mutable_shm()->set_memory_handle(memory_handle);
  spec.mutable_shm()->set_offset(offset);
  return spec;
}

v1::RegisterRegionsRequest Batch(std::vector<v1::RegionSpec> specs, bool skip_empty = false) {
  v1::RegisterRegionsRequest request;
  for (auto& spec : specs) *request.add_regions() = std::move(spec);
  request.set_skip_empty(skip_empty);
  return request;
}

// Records both agents' regions and metadata versions and opens a chunked transfer
// (chunk 0 moves page 20 -> 20, the closing chunk 21 -> 21) before the bad input;
// Check() then proves the refused request lost nothing: the open transfer closes and
// completes, a new WRITE completes, and every byte compares equal.
class Baseline {
 public:
  explicit Baseline(AgentPair& pair) : pair_(pair) {
    prefill_regions_ = RegionNames(pair.prefill());
    decode_regions_ = RegionNames(pair.decode());
    prefill_version_ = MetadataVersion(pair.prefill());
    decode_version_ = MetadataVersion(pair.decode());
    auto open = KvWrite("in-flight", {20}, {20});
    open.set_more_chunks(true);
    auto opened = SubmitThrough(pair.prefill(), open);
    INFO(opened.status().ToString());
    REQUIRE(opened.ok());
  }

  void Check() {
    CHECK(RegionNames(pair_.prefill()) == prefill_regions_);
    CHECK(RegionNames(pair_.decode()) == decode_regions_);
    CHECK(MetadataVersion(pair_.prefill()) == prefill_version_);
    CHECK(MetadataVersion(pair_.decode()) == decode_version_);

    auto close = KvWrite("in-flight", {21}, {21}, "closed");
    close.set_chunk(1);
    auto closed = SubmitThrough(pair_.prefill(), close);
    INFO(closed.status().ToString());
    REQUIRE(closed.ok());
    auto in_flight = WaitDone(pair_.prefill(), "in-flight");
    INFO(in_flight.error_message());
    CHECK(in_flight.phase() == v1::COMPLETED);

    auto good = SubmitThrough(pair_.prefill(), KvWrite("good-after", {0, 1, 2}, {10, 11, 12}, "good"));
    INFO(good.status().ToString());
    REQUIRE(good.ok());
    auto done = WaitDone(pair_.prefill(), "good-after");
    INFO(done.error_message());
    CHECK(done.phase() == v1::COMPLETED);
    CHECK(pair_.PageEqual(20, 20));
    CHECK(pair_.PageEqual(21, 21));
    CHECK(pair_.PageEqual(0, 10));
    CHECK(pair_.PageEqual(1, 11));
    CHECK(pair_.PageEqual(2, 12));
  }

 private:
  AgentPair& pair_;
  std::vector<std::string> prefill_regions_, decode_regions_;
  uint64_t prefill_version_ = 0, decode_version_ = 0;
};

// A refused submit leaves no transfer behind, so the id may be reused.
void CheckNotRecorded(AgentPair& pair, const std::string& id) {
  auto state = pair.prefill().Get(id);
  CHECK(state.status().code() == absl::StatusCode::kNotFound);
}

// ---------------------------------------------------------------- transfers

TEST_CASE("an unknown local group is NOT_FOUND naming it and the known groups") {
  AgentPair pair;
  Baseline baseline(pair);
  auto request = KvWrite("bad-local-group", {3}, {3});
  request.mutable_segments(0)->mutable_items()->set_local_group("kv-typo");
  auto refused = SubmitThrough(pair.prefill(), request);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(Message(refused.status()),
             Contains("bad-local-group") && Contains("segment 0") &&
                 Contains("local group 'kv-typo'") && Contains("not registered") &&
                 Contains("known groups: 'kv'"));
  CHECK(pair.PageUntouched(3));
  CheckNotRecorded(pair, "bad-local-group");
  baseline.Check();
}

TEST_CASE("an unknown remote group is NOT_FOUND naming the peer, the group and the known groups") {
  AgentPair pair;
  Baseline baseline(pair);
  auto request = KvWrite("bad-remote-group", {3}, {3});
  request.mutable_segments(0)->mutable_items()->set_remote_group("kv-typo");
  auto refused = SubmitThrough(pair.prefill(), request);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(Message(refused.status()),
             Contains("bad-remote-group") && Contains("peer 'decode'") &&
                 Contains("no group 'kv-typo'") && Contains("known groups: 'kv'"));
  CHECK(pair.PageUntouched(3));
  CheckNotRecorded(pair, "bad-remote-group");
  baseline.Check();
}

TEST_CASE("an unknown region in a byte segment is NOT_FOUND and the whole transfer is refused") {
  AgentPair pair;
  Baseline baseline(pair);
  // A valid item segment first: it must not move either.
  auto request = KvWrite("bad-bytes", {3}, {3});
  auto* bytes = request.add_segments()->mutable_bytes();
  bytes->set_local_region("prefill.L0.K");
  bytes->set_remote_region("decode.L0.K");
  bytes->set_length(16);

  SECTION("local region") {
    bytes->set_local_region("no-such-local");
    auto refused = SubmitThrough(pair.prefill(), request);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kNotFound);
    CHECK_THAT(Message(refused.status()),
               Contains("bad-bytes") && Contains("segment 1") &&
                   Contains("local region 'no-such-local'") && Contains("not registered") &&
                   Contains("'prefill.L0.K'"));
  }
  SECTION("remote region") {
    bytes->set_remote_region("no-such-remote");
    auto refused = SubmitThrough(pair.prefill(), request);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kNotFound);
    CHECK_THAT(Message(refused.status()),
               Contains("bad-bytes") && Contains("segment 1") && Contains("peer 'decode'") &&
                   Contains("no region 'no-such-remote'") && Contains("'decode.L0.K'"));
  }
  CHECK(pair.PageUntouched(3));
  CheckNotRecorded(pair, "bad-bytes");
  baseline.Check();
}

TEST_CASE("an unknown peer is NOT_FOUND naming it and saying how to connect") {
  AgentPair pair;
  Baseline baseline(pair);
  auto request = KvWrite("bad-peer", {3}, {3});
  request.set_peer("decoder");
  auto refused = SubmitThrough(pair.prefill(), request);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(Message(refused.status()),
             Contains("bad-peer") && Contains("peer 'decoder'") && Contains("not connected") &&
                 Contains("[decode]") && Contains("ConnectPeer"));
  CHECK(pair.PageUntouched(3));
  CheckNotRecorded(pair, "bad-peer");
  baseline.Check();
}

TEST_CASE("an index out of range is INVALID_ARGUMENT with the index, region and num_items") {
  AgentPair pair;
  Baseline baseline(pair);
  SECTION("local side") {
    auto refused = SubmitThrough(pair.prefill(), KvWrite("bad-index", {3, 32}, {3, 4}));
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(refused.status()),
               Contains("bad-index") && Contains("local index 32") &&
                   Contains("position 1") && Contains("'prefill.L0.K'") &&
                   Contains("num_items 32"));
  }
  SECTION("remote side") {
    auto refused = SubmitThrough(pair.prefill(), KvWrite("bad-index", {3, 4}, {3, 1000}));
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(refused.status()),
               Contains("bad-index") && Contains("remote index 1000") &&
                   Contains("position 1") && Contains("peer 'decode'") &&
                   Contains("'decode.L0.K'") && Contains("num_items 32"));
  }
  // The valid first pair of the list did not move.
  CHECK(pair.PageUntouched(3));
  CHECK(pair.PageUntouched(4));
  CheckNotRecorded(pair, "bad-index");
  baseline.Check();
}

TEST_CASE("index lists of unequal length are INVALID_ARGUMENT with both lengths") {
  AgentPair pair;
  Baseline baseline(pair);
  auto refused = SubmitThrough(pair.prefill(), KvWrite("bad-lengths", {3, 4, 5}, {3, 4}));
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(refused.status()),
             Contains("bad-lengths") && Contains("segment 0") &&
                 Contains("3 local indices and 2 remote indices") && Contains("equal"));
  for (uint64_t p : {3, 4, 5}) CHECK(pair.PageUntouched(p));
  CheckNotRecorded(pair, "bad-lengths");
  baseline.Check();
}

TEST_CASE("paired regions with different item sizes are INVALID_ARGUMENT naming both") {
  AgentPair pair;
  // Group "kv2": one region per side, 4 items each, 4 KiB items on prefill and
  // 8 KiB items on decode.
  auto make = [](cli::AgentClient& agent, const std::string& name, uint64_t item_bytes) {
    auto shm = agent.AllocateMemory(name, 4 * item_bytes);
    REQUIRE(shm.ok());
    v1::RegionSpec spec = ShmRegion(name, shm->info.handle(), 0, 4 * item_bytes);
    spec.set_kind(v1::KV);
    spec.set_group("kv2");
    spec.mutable_layout()->set_num_items(4);
    spec.mutable_layout()->set_item_bytes(item_bytes);
    auto registered = agent.Register(Batch({spec}));
    INFO(registered.status().ToString());
    REQUIRE(registered.ok());
  };
  make(pair.prefill(), "small-items", 4096);
  make(pair.decode(), "large-items", 8192);
  Baseline baseline(pair);

  v1::SubmitTransferRequest request = KvWrite("bad-item-size", {0}, {0});
  request.mutable_segments(0)->mutable_items()->set_local_group("kv2");
  request.mutable_segments(0)->mutable_items()->set_remote_group("kv2");
  auto refused = SubmitThrough(pair.prefill(), request);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(refused.status()),
             Contains("bad-item-size") && Contains("'small-items'") &&
                 Contains("4096-byte items") && Contains("'large-items'") &&
                 Contains("8192-byte items"));
  CheckNotRecorded(pair, "bad-item-size");
  baseline.Check();
}

TEST_CASE("a transfer_id reused with different content is ALREADY_EXISTS; an exact retry is idempotent") {
  AgentPair pair;
  Baseline baseline(pair);
  REQUIRE(SubmitThrough(pair.prefill(), KvWrite("dup", {5}, {5}, "once")).ok());
  auto first = WaitDone(pair.prefill(), "dup");
  REQUIRE(first.phase() == v1::COMPLETED);

  auto changed = SubmitThrough(pair.prefill(), KvWrite("dup", {6}, {6}, "once"));
  REQUIRE_FALSE(changed.ok());
  CHECK(changed.status().code() == absl::StatusCode::kAlreadyExists);
  CHECK_THAT(Message(changed.status()),
             Contains("'dup'") && Contains("different content") && Contains("new transfer_id"));
  CHECK(pair.PageUntouched(6));

  auto retried = SubmitThrough(pair.prefill(), KvWrite("dup", {5}, {5}, "once"));
  INFO(retried.status().ToString());
  REQUIRE(retried.ok());
  CHECK(retried->phase() == v1::COMPLETED);
  CHECK(retried->submitted_unix_us() == first.submitted_unix_us());
  CHECK(retried->bytes_total() == first.bytes_total());
  CHECK(retried->bytes_done() == first.bytes_done());
  CHECK(retried->chunks() == 1);
  CHECK(pair.PageEqual(5, 5));

  // Exactly one notification for "dup", however often it was submitted.
  auto notes = PollUntil(pair.decode(), 1, {"dup"});
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].transfer_id() == "dup");
  CHECK(notes[0].payload() == "once");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto later = pair.decode().Poll(0, {"dup"});
  REQUIRE(later.ok());
  CHECK(later->notifications_size() == 0);
  baseline.Check();
}

TEST_CASE("an empty transfer_id, an unset op, a deadline past 10 minutes and an oversized notification are INVALID_ARGUMENT") {
  AgentPair pair;
  Baseline baseline(pair);
  SECTION("empty transfer_id") {
    auto refused = SubmitThrough(pair.prefill(), KvWrite("", {3}, {3}));
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(refused.status()),
               Contains("transfer_id") && Contains("0 bytes") && Contains("non-empty"));
  }
  SECTION("op unset") {
    auto request = KvWrite("no-op", {3}, {3});
    request.clear_op();
    auto refused = SubmitThrough(pair.prefill(), request);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(refused.status()),
               Contains("'no-op'") && Contains("op 0 is not set") && Contains("WRITE") &&
                   Contains("READ"));
    CheckNotRecorded(pair, "no-op");
  }
  SECTION("op out of range") {
    auto request = KvWrite("op-7", {3}, {3});
    request.set_op(static_cast<v1::TransferOp>(7));
    auto refused = SubmitThrough(pair.prefill(), request);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(refused.status()),
               Contains("'op-7'") && Contains("op 7 is not an operation") && Contains("WRITE"));
    CheckNotRecorded(pair, "op-7");
  }
  SECTION("a deadline past 10 minutes") {
    // A transfer holds its slots, ledger claims and pinned regions until it ends, and a
    // receiver holds an open transfer no longer than 10 minutes.
    auto request = KvWrite("forever", {3}, {3});
    request.set_timeout_ms(600001);
    auto refused = SubmitThrough(pair.prefill(), request);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(refused.status()), Contains("'forever'") &&
                                              Contains("timeout_ms 600001") &&
                                              Contains("limit of 600000"));
    CheckNotRecorded(pair, "forever");
    request = KvWrite("ten-minutes", {9}, {9});
    request.set_timeout_ms(600000);
    REQUIRE(SubmitThrough(pair.prefill(), request).ok());
    REQUIRE(WaitDone(pair.prefill(), "ten-minutes").phase() == v1::COMPLETED);
    CHECK(pair.PageEqual(9, 9));
  }
  SECTION("notification over 64 KiB") {
    auto refused =
        SubmitThrough(pair.prefill(), KvWrite("big-note", {3}, {3}, std::string((64 << 10) + 1, 'n')));
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(refused.status()),
               Contains("'big-note'") && Contains("notification is 65537 bytes") &&
                   Contains("65536"));
    CheckNotRecorded(pair, "big-note");
    // Exactly at the limit is fine, and arrives whole.
    const std::string at_limit(64 << 10, 'm');
    REQUIRE(SubmitThrough(pair.prefill(), KvWrite("big-note", {9}, {9}, at_limit)).ok());
    REQUIRE(WaitDone(pair.prefill(), "big-note").phase() == v1::COMPLETED);
    auto notes = PollUntil(pair.decode(), 1, {"big-note"});
    REQUIRE(notes.size() == 1);
    CHECK(notes[0].payload() == at_limit);
    CHECK(pair.PageEqual(9, 9));
  }
  CHECK(pair.PageUntouched(3));
  baseline.Check();
}

// ------------------------------------------------------------ registration

TEST_CASE("a shm name that does not exist is NOT_FOUND naming region and object") {
  AgentPair pair;
  Baseline baseline(pair);
  auto refused = pair.decode().Register(
      Batch({ShmRegion("ghost", "/kvagent-bad-input-no-such-object", 0, 4096)}));
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(Message(refused.status()),
             Contains("region 'ghost'") && Contains("'/kvagent-bad-input-no-such-object'") &&
                 Contains("does not exist"));
  baseline.Check();
}

TEST_CASE("a shm object smaller than offset+length is INVALID_ARGUMENT with both sizes") {
  AgentPair pair;
  auto shm = pair.decode().AllocateMemory("small", 4096);
  REQUIRE(shm.ok());
  Baseline baseline(pair);
  auto refused = pair.decode().Register(Batch({ShmRegion("too-far", shm->info.handle(), 1024, 4096)}));
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(refused.status()),
             Contains("region 'too-far'") &&
                 Contains("4096 bytes") && Contains("offset 1024 + length 4096 = 5120"));
  baseline.Check();
}

TEST_CASE("a batch with two bad entries names both and registers nothing") {
  AgentPair pair;
  auto shm = pair.decode().AllocateMemory("batch", 8192);
  REQUIRE(shm.ok());
  Baseline baseline(pair);
  v1::RegionSpec good = ShmRegion("batch-good", shm->info.handle(), 0, 4096);
  v1::RegionSpec too_long = ShmRegion("batch-too-long", shm->info.handle(), 4096, 8192);
  v1::RegionSpec no_layout = ShmRegion("batch-no-layout", shm->info.handle(), 4096, 4096);
  no_layout.set_kind(v1::KV);  // KV needs a layout
  auto refused = pair.decode().Register(Batch({good, too_long, no_layout}));
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  const std::string message = Message(refused.status());
  CHECK_THAT(message, Contains("2 of 3 regions rejected") && Contains("nothing was registered") &&
                          Contains("'batch-too-long' (entry 1)") &&
                          Contains("offset 4096 + length 8192") &&
                          Contains("'batch-no-layout' (entry 2)") && Contains("num_items 0"));
  CHECK_THAT(message, !Contains("batch-good"));
  baseline.Check();  // the good entry is not listed; the version did not move
  // Its name is still free.
  auto again = pair.decode().Register(Batch({good}));
  INFO(again.status().ToString());
  CHECK(again.ok());
}

TEST_CASE("a zero-length region is refused, or skipped with skip_empty") {
  AgentPair pair;
  auto shm = pair.decode().AllocateMemory("empty", 4096);
  REQUIRE(shm.ok());
  Baseline baseline(pair);
  const v1::RegionSpec empty = ShmRegion("empty-region", shm->info.handle(), 0, 0);
  SECTION("rejected") {
    auto refused = pair.decode().Register(Batch({empty}));
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(refused.status()), Contains("region 'empty-region'") &&
                                              Contains("length is 0") &&
                                              Contains("skip_empty"));
  }
  SECTION("skipped") {
    auto skipped = pair.decode().Register(Batch({empty}, /*skip_empty=*/true));
    INFO(skipped.status().ToString());
    REQUIRE(skipped.ok());
    REQUIRE(skipped->skipped_size() == 1);
    CHECK(skipped->skipped(0) == "empty-region");
    CHECK(skipped->regions_size() == 0);
  }
  baseline.Check();  // nothing registered, version unchanged in both cases
}

// -------------------------------------------------------- deregistered peer

TEST_CASE("a transfer to a group the peer has deregistered is NOT_FOUND naming the group") {
  AgentPair pair;
  REQUIRE(SubmitThrough(pair.prefill(), KvWrite("before", {1, 2}, {1, 2})).ok());
  REQUIRE(WaitDone(pair.prefill(), "before").phase() == v1::COMPLETED);
  const uint64_t before_version = MetadataVersion(pair.decode());

  auto deregistered = pair.decode().Deregister(pair.decode_pool().region_names);
  INFO(deregistered.status().ToString());
  REQUIRE(deregistered.ok());
  CHECK(deregistered->version() > before_version);
  CHECK(RegionNames(pair.decode()).empty());

  auto check_refused = [&](const std::string& id) {
    auto refused = SubmitThrough(pair.prefill(), KvWrite(id, {3}, {3}));
    INFO("id " << id << ": " << refused.status().ToString());
    if (refused.ok()) {
      // Accepted against stale metadata: report how it ended (or that it hangs).
      auto state = pair.prefill().WaitTransfer(id, 5000);
      INFO("accepted; then " << (state.ok() ? v1::TransferPhase_Name(state->phase()) + ": " +
                                                  state->error_message()
                                            : state.status().ToString()));
      CHECK(false);
      return;
    }
    CHECK(refused.status().code() == absl::StatusCode::kNotFound);
    CHECK_THAT(Message(refused.status()),
               Contains(id) && Contains("peer 'decode'") && Contains("no group 'kv'"));
    CheckNotRecorded(pair, id);
  };

  SECTION("submitted right after Deregister, before the peer poll") {
    check_refused("right-after");
  }
  SECTION("submitted once prefill has seen the new version") {
    bool seen = false;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!seen && std::chrono::steady_clock::now() < until) {
      auto peers = pair.prefill().Peers();
      REQUIRE(peers.ok());
      for (const auto& p : peers->peers()) {
        if (p.name() == "decode" && p.metadata_version() == deregistered->version()) seen = true;
      }
      if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    REQUIRE(seen);
    check_refused("after-refresh");
  }

  // The earlier transfer's pages are still in decode's memory.
  CHECK(pair.PageEqual(1, 1));
  CHECK(pair.PageEqual(2, 2));
  CHECK(pair.PageUntouched(3));

  // Registering the same regions again makes the group usable again.
  v1::RegisterRegionsRequest again;
  const auto& shape = pair.decode_pool().shape;
  const uint64_t region_bytes = shape.pages * shape.page_bytes;
  for (size_t i = 0; i < pair.decode_pool().region_names.size(); ++i) {
    v1::RegionSpec spec = ShmRegion(pair.decode_pool().region_names[i],
                                    pair.decode_pool().memory_handle, i * region_bytes,
                                    region_bytes);
    spec.set_kind(v1::KV);
    spec.set_group("kv");
    spec.mutable_layout()->set_num_items(shape.pages);
    spec.mutable_layout()->set_item_bytes(shape.page_bytes);
    *again.add_regions() = spec;
  }
  auto reregistered = pair.decode().Register(again);
  INFO(reregistered.status().ToString());
  REQUIRE(reregistered.ok());
  CHECK(RegionNames(pair.decode()) == pair.decode_pool().region_names);
  auto good = SubmitThrough(pair.prefill(), KvWrite("after", {7, 8}, {7, 8}));
  INFO(good.status().ToString());
  REQUIRE(good.ok());
  auto done = WaitDone(pair.prefill(), "after");
  INFO(done.error_message());
  CHECK(done.phase() == v1::COMPLETED);
  CHECK(pair.PageEqual(7, 7));
  CHECK(pair.PageEqual(8, 8));
  CHECK(pair.PageEqual(1, 1));
}

}  // namespace
}  // namespace kvagent::testing

namespace kvagent::testing {
namespace {

// Raw bytes to a method of the local door (with a session's token): what a client with
// a broken serializer, or an attacker, sends.
grpc::Status CallRaw(cli::AgentClient& client, const std::string& method, const std::string& body,
                     bool stream) {
  auto session = client.Session();
  REQUIRE(session.ok());
  auto channel = grpc::CreateChannel(client.address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  context.AddMetadata("kvagent-session", (*session)->token());
  grpc::Slice slice(body);
  grpc::ByteBuffer request(&slice, 1);
  if (stream) {
    grpc::CompletionQueue cq;
    auto call = stub.PrepareCall(&context, method, &cq);
    call->StartCall(reinterpret_cast<void*>(1));
    void* tag = nullptr;
    bool ok = false;
    REQUIRE(cq.Next(&tag, &ok));
    call->Write(request, grpc::WriteOptions().set_last_message(), reinterpret_cast<void*>(2));
    REQUIRE(cq.Next(&tag, &ok));
    grpc::ByteBuffer reply;
    call->Read(&reply, reinterpret_cast<void*>(3));
    REQUIRE(cq.Next(&tag, &ok));
    grpc::Status status;
    call->Finish(&status, reinterpret_cast<void*>(4));
    REQUIRE(cq.Next(&tag, &ok));
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    return status;
  }
  grpc::ByteBuffer reply;
  absl::Mutex mu;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &reply, [&](grpc::Status s) {
    absl::MutexLock lock(&mu);
    status = std::move(s);
    done = true;
  });
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(&done));
  return status;
}

TEST_CASE("an unparseable request is INVALID_ARGUMENT with the parser's reason") {
  AgentPair pair;
  Baseline baseline(pair);
  // Truncated (a length-delimited field whose bytes do not follow), a varint that
  // never ends, and a string field (transfer_id) that is not UTF-8.
  const std::string truncated("\x0a\x80", 2);
  const std::string endless("\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 12);
  const std::string not_utf8("\x0a\x02\xc3\x28", 4);
  for (const auto* body : {&truncated, &endless}) {
    grpc::Status submit =
        CallRaw(pair.prefill(), "/kvagent.v1.Agent/SubmitTransfer", *body, /*stream=*/false);
    CHECK(submit.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(submit.error_message(),
               Contains("SubmitTransfer") && Contains("does not parse") &&
                   Contains("malformed protobuf wire format at byte") &&
                   Contains("kvagent.v1.SubmitTransferRequest"));
  }
  grpc::Status utf8 =
      CallRaw(pair.prefill(), "/kvagent.v1.Agent/SubmitTransfer", not_utf8, /*stream=*/false);
  CHECK(utf8.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(utf8.error_message(), Contains("not UTF-8"));
  grpc::Status watch =
      CallRaw(pair.prefill(), "/kvagent.v1.Agent/WatchTransfer", truncated, /*stream=*/true);
  CHECK(watch.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(watch.error_message(), Contains("WatchTransfer") && Contains("does not parse"));
  // A well-formed request still works on the same agent.
  auto status = pair.prefill().Status();
  REQUIRE(status.ok());
  baseline.Check();
}

}  // namespace
}  // namespace kvagent::testing

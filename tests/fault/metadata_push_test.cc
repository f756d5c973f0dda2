// Pushed metadata and transport liveness between two real agents whose polls are a
// minute apart (--peer-refresh-ms 60000), so nothing here can come from a poll: a
// region registered on decode reaches prefill's view over the WatchMetadata stream,
// decode's DeregisterRegions returns once prefill acknowledged the new version over
// that stream, and a killed or hung decode is seen by prefill within 2 s (the stream
// ends: connection reset; or its liveness door stops answering). A peer without the stream
// (--metadata-push off answers UNIMPLEMENTED) is polled instead.
#include <signal.h>

#include <chrono>
#include <cstring>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>

#include "catch2/catch.hpp"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "fmt/format.h"
#include "tests/fault/peer_view.h"
#include "tests/integration/agent_pair.h"

namespace kvagent::testing {
namespace {

using Clock = std::chrono::steady_clock;

// One more layer of the pair's shape (a group's regions all have as many pages).
cli::KvPoolShape SmallShape() {
  cli::KvPoolShape s = AgentPairOptions{}.shape;
  s.layers = 1;
  return s;
}

TEST_CASE("pushed: a new region is in the peer's view at once, deregistration is acked over "
          "the stream") {
  AgentPair pair(LongPolls());
  REQUIRE(MillisUntil(pair.prefill(), "decode", 2000, [](const v1::PeerInfo& p) {
            return p.metadata_source() == "push";
          }) >= 0);
  // prefill watches decode. Its view says "push" once its stream is started; decode
  // counts the stream when the call reaches it, a moment later on a loaded machine.
  int64_t streams = -1;
  for (int i = 0; i < 500 && streams != 1; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    auto decode_status = pair.decode().Status();
    REQUIRE(decode_status.ok());
    streams = decode_status->metadata_streams();
  }
  CHECK(streams == 1);
  const uint32_t regions_before = PeerView(pair.prefill(), "decode").regions();

  auto extra = cli::CreateKvPool(pair.decode(), "extra", SmallShape());
  INFO(extra.status().ToString());
  REQUIRE(extra.ok());
  const int64_t seen_ms = MillisUntil(pair.prefill(), "decode", 2000, [&](const v1::PeerInfo& p) {
    return p.regions() == regions_before + extra->region_names.size();
  });
  std::printf("pushed: region registered on decode in prefill's view after %lld ms\n",
              static_cast<long long>(seen_ms));
  CHECK(seen_ms >= 0);
  CHECK(PeerView(pair.prefill(), "decode").deltas_applied() >= 1);

  // DeregisterRegions waits for every watcher to hold the new version; prefill
  // acknowledges it over the stream once installed, so the reply comes quickly, names
  // nobody, and prefill's view is already at that version when it does.
  const auto dereg_start = Clock::now();
  auto dereg = pair.decode().Deregister(extra->region_names);
  const int64_t dereg_ms = MillisSince(dereg_start);
  REQUIRE(dereg.ok());
  std::printf("pushed: deregistration acknowledged in %lld ms\n",
              static_cast<long long>(dereg_ms));
  CHECK(dereg->unconfirmed_peers_size() == 0);
  CHECK(dereg_ms < 1000);  // the wait is 2 s: an unacknowledged version would take it
  const v1::PeerInfo after = PeerView(pair.prefill(), "decode");
  CHECK(after.metadata_version() == dereg->version());
  CHECK(after.regions() == regions_before);

  // Transfers still move bytes over the pushed view.
  pair.ResetContents();
  auto write = pair.prefill().Submit(KvWrite("after-push", {0, 1}, {5, 6}));
  REQUIRE(write.ok());
  auto done = pair.prefill().WaitTransfer("after-push", 20000);
  REQUIRE(done.ok());
  CHECK(done->phase() == v1::COMPLETED);
  CHECK(pair.PageEqual(0, 5));
  CHECK(pair.PageEqual(1, 6));
}

TEST_CASE("pushed: a killed peer is unreachable within 2 s with polls a minute apart") {
  AgentPair pair(LongPolls());
  REQUIRE(MillisUntil(pair.prefill(), "decode", 2000, [](const v1::PeerInfo& p) {
            return p.metadata_source() == "push";
          }) >= 0);
  REQUIRE(::kill(pair.decode_process().pid(), SIGKILL) == 0);
  const int64_t ms = MillisUntil(pair.prefill(), "decode", 5000, [](const v1::PeerInfo& p) {
    return p.state() == "unreachable";
  });
  std::printf("pushed: SIGKILL seen after %lld ms\n", static_cast<long long>(ms));
  CHECK(ms >= 0);
  CHECK(ms <= 2000);
  pair.decode_process().Kill();
}

TEST_CASE("pushed: a hung peer (SIGSTOP) is unreachable within 2 s by its liveness door") {
  AgentPair pair(LongPolls());
  REQUIRE(MillisUntil(pair.prefill(), "decode", 2000, [](const v1::PeerInfo& p) {
            return p.metadata_source() == "push";
          }) >= 0);
  // Under load the hang could otherwise come before prefill's prober had any answer
  // from decode's door (CI failed this way at load 9: unseen for 5 s).
  RequireDoorAnswering(pair);
  const pid_t decode = pair.decode_process().pid();
  HangDecode(pair, "pushed");
  CHECK_THAT(PeerView(pair.prefill(), "decode").last_error(), Catch::Contains("liveness door"));
  ::kill(decode, SIGCONT);
  pair.decode_process().Kill();
}

TEST_CASE("a region registered a moment ago is found at submit, with no poll or push due") {
  // Polls a minute apart and no metadata stream: prefill's view of decode changes only
  // when a submit names what its view lacks (the agent looks again once, then plans).
  AgentPairOptions options = LongPolls();
  options.extra_args.push_back("--metadata-push");
  options.extra_args.push_back("off");
  AgentPair pair(options);
  const uint32_t regions_before = PeerView(pair.prefill(), "decode").regions();
  auto extra = cli::CreateKvPool(pair.decode(), "extra", SmallShape());
  INFO(extra.status().ToString());
  REQUIRE(extra.ok());
  CHECK(PeerView(pair.prefill(), "decode").regions() == regions_before);

  pair.ResetContents();
  v1::SubmitTransferRequest write;
  write.set_transfer_id("fresh");
  write.set_peer("decode");
  write.set_op(v1::WRITE);
  v1::ByteSegment* bytes = write.add_segments()->mutable_bytes();
  bytes->set_local_region(pair.prefill_pool().region_names[0]);
  bytes->set_remote_region(extra->region_names[0]);
  bytes->set_remote_offset(4096);
  bytes->set_length(4096);
  std::memset(extra->Page(0, 1), 0xEE, 4096);
  auto accepted = pair.prefill().Submit(write);
  INFO(accepted.status().ToString());
  REQUIRE(accepted.ok());
  auto done = pair.prefill().WaitTransfer("fresh", 20000);
  REQUIRE(done.ok());
  CHECK(done->phase() == v1::COMPLETED);
  CHECK(std::memcmp(pair.prefill_pool().Page(0, 0), extra->Page(0, 1), 4096) == 0);
  CHECK(PeerView(pair.prefill(), "decode").regions() ==
        regions_before + extra->region_names.size());

  // A name the peer lacks after the look too: refused, naming it and what it has.
  write.set_transfer_id("never");
  write.mutable_segments(0)->mutable_bytes()->set_remote_region("extra.L9.K");
  auto refused = pair.prefill().Submit(write);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("exports no region 'extra.L9.K'") &&
                 Catch::Contains(extra->region_names[0]));
  auto missing = pair.prefill().Get("never");
  CHECK_FALSE(missing.ok());
}

TEST_CASE("a peer without WatchMetadata (--metadata-push off) is polled, and changes arrive") {
  AgentPair pair;  // polls every 200 ms
  cli::DaemonProcess old = StartOldPeer(pair, {"--metadata-push", "off"});
  cli::AgentClient old_client(old.address());
  REQUIRE(MillisUntil(pair.prefill(), "oldpeer", 2000, [](const v1::PeerInfo& p) {
            return p.metadata_source() == "poll";
          }) >= 0);
  CHECK(PeerView(pair.prefill(), "decode").metadata_source() == "push");

  auto pool = cli::CreateKvPool(old_client, "old", SmallShape());
  INFO(pool.status().ToString());
  REQUIRE(pool.ok());
  const int64_t seen_ms = MillisUntil(pair.prefill(), "oldpeer", 3000, [&](const v1::PeerInfo& p) {
    return p.regions() == pool->region_names.size();
  });
  std::printf("polled: region registered on oldpeer in prefill's view after %lld ms\n",
              static_cast<long long>(seen_ms));
  CHECK(seen_ms >= 0);
  auto old_status = old_client.Status();
  REQUIRE(old_status.ok());
  CHECK(old_status->metadata_streams() == 0);
}

}  // namespace
}  // namespace kvagent::testing

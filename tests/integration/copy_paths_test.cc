// The same-host copy paths as an operator sees them, against two real kvagentd
// processes: GetStatus counts what the host copy lanes copied (and `kvagentctl status`
// prints it), and GetStatus, ListPeers and Doctor name the device copy mode.
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "cuda/driver.h"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"

namespace kvagent::testing {
namespace {

std::string Kvagentctl(const std::vector<std::string>& args, const std::string& path) {
  absl::StatusOr<std::string> out = KvagentctlOutput(args, path);
  INFO(out.status().ToString());
  REQUIRE(out.ok());
  return *std::move(out);
}

TEST_CASE("GetStatus counts the copy lanes' batches; status, peers and doctor name the modes") {
  AgentPairOptions options;
  options.shape.page_bytes = 64 << 10;  // a page of all 8 regions is 512 KiB: two lanes
  options.extra_args = {"--copy-lanes", "2"};
  AgentPair pair(options);
  // With a driver, the mechanism chosen at run time (agent/gpu/device_batch.h).
  auto mode_of = [](const std::string& status_mode) {
    if (!cuda::CudaDriver::Load().ok()) {
      CHECK(status_mode == "none (no CUDA driver)");
    } else {
      INFO(status_mode);
      CHECK((status_mode.rfind("cuMemcpyBatchAsync per batch", 0) == 0 ||
             status_mode.rfind("gather kernel per batch (", 0) == 0 ||
             status_mode.rfind("cuMemcpyAsync per page", 0) == 0));
    }
    return status_mode;
  };

  auto before = pair.prefill().Status();
  REQUIRE(before.ok());
  CHECK(before->copy_lanes().lanes() == 2);
  CHECK(before->copy_lanes().batches() == 0);
  CHECK(before->copy_lanes().bytes() == 0);
  const std::string mode = mode_of(before->device_copy());

  pair.ResetContents();
  const std::vector<uint64_t> src = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<uint64_t> dst = {20, 21, 22, 23, 24, 25, 26, 27};
  v1::SubmitTransferRequest write = KvWrite("lanes-write", src, dst);
  write.set_wait(true);
  auto done = pair.prefill().Submit(write);
  INFO(done.status().ToString());
  REQUIRE(done.ok());
  INFO(done->error_message());
  REQUIRE(done->phase() == v1::COMPLETED);
  for (size_t i = 0; i < src.size(); ++i) CHECK(pair.PageEqual(src[i], dst[i]));

  auto after = pair.prefill().Status();
  REQUIRE(after.ok());
  const uint64_t bytes = src.size() * pair.prefill_pool().regions() * (64 << 10);
  CHECK(done->bytes_total() == bytes);
  CHECK(after->copy_lanes().bytes() == bytes);
  CHECK(after->copy_lanes().batches() >= 1);
  CHECK(after->copy_lanes().split_batches() >= 1);  // 4 MiB: both lanes took part
  CHECK(after->copy_lanes().split_batches() <= after->copy_lanes().batches());
  // With 2 lanes, at most the one other share of a split batch is taken back.
  CHECK(after->copy_lanes().stolen_parts() <= after->copy_lanes().split_batches());
  // decode copied nothing: prefill's host copy path wrote into its memory.
  auto decode = pair.decode().Status();
  REQUIRE(decode.ok());
  CHECK(decode->copy_lanes().bytes() == 0);

  auto peers = pair.prefill().Peers();
  REQUIRE(peers.ok());
  REQUIRE(peers->peers_size() == 1);
  CHECK(peers->peers(0).data_path() == "shm-direct");
  CHECK(peers->peers(0).device_copy() == mode);

  auto report = pair.prefill().Doctor();
  REQUIRE(report.ok());
  bool found = false;
  for (const auto& c : report->checks()) {
    if (c.name() != "device-copy") continue;
    found = true;
    CHECK(c.result() == v1::DoctorCheck::PASS);
    CHECK(c.detail().rfind(mode + ": ", 0) == 0);
  }
  CHECK(found);

  const std::string address = pair.prefill_process().address();
  const std::string status =
      Kvagentctl({"--agent", address, "status"}, pair.work_dir() + "/status.txt");
  INFO(status);
  CHECK(status.find("copy lanes   2: ") != std::string::npos);
  CHECK(status.find(std::to_string(bytes) + " bytes; device copy " + mode) != std::string::npos);
  const std::string listed =
      Kvagentctl({"--agent", address, "peers"}, pair.work_dir() + "/peers.txt");
  INFO(listed);
  CHECK(listed.find("; device copy " + mode) != std::string::npos);

  // The other lane's chunks: none from a batch whose share it never started, at most
  // 2 lanes x 8 chunks (agent/copy_lanes.h kChunksPerLane) from one it did. Whether it
  // wakes in time for a given batch depends on the host's load: more batches until it
  // has copied some.
  v1::AgentStatus last = *after;
  for (int i = 0; i < 200 && last.copy_lanes().lane_chunks() == 0; ++i) {
    v1::SubmitTransferRequest more = KvWrite(fmt::format("lanes-more-{}", i), src, dst);
    more.set_wait(true);
    auto again = pair.prefill().Submit(more);
    REQUIRE(again.ok());
    REQUIRE(again->phase() == v1::COMPLETED);
    auto now = pair.prefill().Status();
    REQUIRE(now.ok());
    last = *std::move(now);
  }
  const v1::CopyLaneStatus& lanes = last.copy_lanes();
  CHECK(lanes.lane_chunks() > 0);
  CHECK(lanes.lane_chunks() <= (lanes.split_batches() - lanes.stolen_parts()) * 2 * 8);
  const std::string later =
      Kvagentctl({"--agent", address, "status"}, pair.work_dir() + "/status-later.txt");
  INFO(later);
  CHECK(later.find(fmt::format("({} split across lanes, {} chunks copied by the other lanes, {} "
                               "shares taken back by the worker thread), {} bytes",
                               lanes.split_batches(), lanes.lane_chunks(), lanes.stolen_parts(),
                               lanes.bytes())) != std::string::npos);
}

TEST_CASE("One copy lane copies every batch on the worker thread") {
  AgentPairOptions options;
  options.shape.page_bytes = 64 << 10;
  options.extra_args = {"--copy-lanes", "1"};
  AgentPair pair(options);
  pair.ResetContents();
  v1::SubmitTransferRequest write = KvWrite("one-lane", {0, 1, 2, 3}, {10, 11, 12, 13});
  write.set_wait(true);
  auto done = pair.prefill().Submit(write);
  REQUIRE(done.ok());
  REQUIRE(done->phase() == v1::COMPLETED);
  for (uint64_t i = 0; i < 4; ++i) CHECK(pair.PageEqual(i, 10 + i));
  auto status = pair.prefill().Status();
  REQUIRE(status.ok());
  CHECK(status->copy_lanes().lanes() == 1);
  CHECK(status->copy_lanes().batches() >= 1);
  CHECK(status->copy_lanes().split_batches() == 0);
  CHECK(status->copy_lanes().lane_chunks() == 0);
  CHECK(status->copy_lanes().bytes() == done->bytes_total());
}

}  // namespace
}  // namespace kvagent::testing

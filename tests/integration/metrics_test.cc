// The Prometheus endpoint (--metrics-listen) of real agents: scraped during and after
// real transfers, its numbers checked against what moved; and the endpoint's bounds
// (request size, garbage, connections, idle clients).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "tests/integration/agent_pair.h"
#include "tests/integration/metrics_scrape.h"

namespace kvagent::testing {

TEST_CASE("Metrics account for every transfer and byte that moved", "[metrics]") {
  AgentPairOptions options;
  options.extra_args = {"--metrics-listen", "127.0.0.1:0"};
  AgentPair pair(options);
  const std::string prefill = MetricsAddress(pair.prefill());
  const std::string decode = MetricsAddress(pair.decode());
  REQUIRE(prefill.rfind("127.0.0.1:", 0) == 0);

  std::string before = Scrape(prefill);
  CHECK(Value(before, "kvagent_transfers_total") == 0);
  CHECK(Value(before, "kvagent_health_serving") == 1);
  CHECK(Value(before, "kvagent_peer_up", {"peer=\"decode\"", "state=\"connected\""}) == 1);
  CHECK(Value(before, "kvagent_regions", {"kind=\"KV\"", "memory_path=\"host\""}) ==
        pair.prefill_pool().regions());
  CHECK(Value(before, "kvagent_registered_bytes", {"kind=\"KV\""}) ==
        static_cast<double>(pair.prefill_pool().bytes()));
  CHECK(Value(before, "kvagent_limit", {"limit=\"regions\""}) > 0);
  // The kvagentd under test serves malloc from jemalloc (glibc's in sanitizer builds,
  // which link none).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  CHECK(Value(before, "kvagent_info", {"heap_allocator=\"glibc malloc\""}) == 1);
#else
  CHECK(Value(before, "kvagent_info", {"heap_allocator=\"jemalloc 5."}) == 1);
#endif

  // Scraped all through the transfers: every scrape answers, and no counter goes back.
  std::atomic<bool> moving{true};
  std::atomic<int> scrapes{0}, regressions{0}, failures{0};
  std::thread scraper([&] {
    double last = 0;
    while (moving.load()) {
      const std::string response =
          Exchange(prefill, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
      if (StatusCode(response) != 200) {
        ++failures;
        continue;
      }
      const double bytes = Value(response, "kvagent_transfer_bytes_total");
      if (bytes < last) ++regressions;
      last = bytes;
      ++scrapes;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });

  constexpr int kWrites = 24, kReads = 6;
  uint64_t write_bytes = 0, read_bytes = 0, latency_us = 0;
  for (int i = 0; i < kWrites + kReads; ++i) {
    const bool read = i >= kWrites;
    const uint64_t page = static_cast<uint64_t>(i);
    auto request = KvWrite("m-" + std::to_string(i), {page}, {page});
    if (read) request.set_op(v1::READ);
    // Every third completes when placed (kvagent_transfers_completed_when_placed_total).
    if (i % 3 == 0) request.set_complete_when(v1::COMPLETE_WHEN_PLACED);
    REQUIRE(SubmitThrough(pair.prefill(), request).ok());
    auto state = pair.prefill().WaitTransfer(request.transfer_id(), 20000);
    REQUIRE(state.ok());
    REQUIRE(state->phase() == v1::COMPLETED);
    (read ? read_bytes : write_bytes) += state->bytes_done();
    latency_us += state->latency_us();
  }
  moving = false;
  scraper.join();
  CHECK(failures.load() == 0);
  CHECK(regressions.load() == 0);
  CHECK(scrapes.load() > 0);
  INFO("scrapes during the transfers: " << scrapes.load());

  // Refused before anything ran: a submit naming a group the peer lacks, a bad region.
  auto bad = KvWrite("m-bad", {0}, {0});
  bad.mutable_segments(0)->mutable_items()->set_remote_group("no-such-group");
  CHECK(!pair.prefill().Submit(bad).ok());
  v1::RegisterRegionsRequest empty_region;
  empty_region.add_regions()->set_name("zero");
  CHECK(!pair.prefill().Register(empty_region).ok());

  const std::string after = Scrape(prefill);
  const uint64_t page_bytes = pair.prefill_pool().shape.page_bytes * pair.prefill_pool().regions();
  CHECK(write_bytes == kWrites * page_bytes);
  CHECK(read_bytes == kReads * page_bytes);
  const std::vector<std::string> writes = {"op=\"WRITE\"", "peer=\"decode\"",
                                           "outcome=\"COMPLETED\"", "data_path=\"shm-direct\""};
  CHECK(Value(after, "kvagent_transfers_total", writes) == kWrites);
  CHECK(Value(after, "kvagent_transfer_bytes_total", writes) == static_cast<double>(write_bytes));
  CHECK(Value(after, "kvagent_transfers_total", {"op=\"READ\"", "outcome=\"COMPLETED\""}) == kReads);
  CHECK(Value(after, "kvagent_transfer_bytes_total", {"op=\"READ\""}) ==
        static_cast<double>(read_bytes));
  CHECK(Value(after, "kvagent_transfers_total") == kWrites + kReads);  // nothing else
  CHECK(Value(after, "kvagent_transfer_errors_total") == 0);
  CHECK(Value(after, "kvagent_transfers_completed_total") == kWrites + kReads);
  CHECK(Value(after, "kvagent_transfers_completed_when_placed_total") == (kWrites + kReads) / 3);
  CHECK(Value(after, "kvagent_transfers_placed_not_taken_total") == 0);
  CHECK(Value(after, "kvagent_transfers_active") == 0);
  CHECK(Value(after, "kvagent_transfer_latency_seconds_count", {"op=\"WRITE\""}) == kWrites);
  CHECK(Value(after, "kvagent_transfer_latency_seconds_bucket", {"op=\"WRITE\"", "le=\"+Inf\""}) ==
        kWrites);
  CHECK(Value(after, "kvagent_transfer_latency_seconds_sum") ==
        Approx(static_cast<double>(latency_us) / 1e6).epsilon(1e-6));
  CHECK(Value(after, "kvagent_refused_total", {"request=\"submit_transfer\""}) == 1);
  CHECK(Value(after, "kvagent_refused_total", {"request=\"register_regions\""}) == 1);
  CHECK(Value(after, "kvagent_metrics_requests_total", {"result=\"ok\""}) >= scrapes.load() + 2);

  // The receiver counts no outgoing transfer; its regions are its own.
  const std::string receiver = Scrape(decode);
  CHECK(Value(receiver, "kvagent_transfers_total") == 0);
  CHECK(Value(receiver, "kvagent_registered_bytes") ==
        static_cast<double>(pair.decode_pool().bytes()));
  // Prefill watches decode: decode's liveness door answers its pings (one every 600 ms
  // at least), each counted as GetStatus counts it, and nothing here is dropped.
  double answered = Value(receiver, "kvagent_liveness_answered_total");
  for (int i = 0; i < 100 && answered < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    answered = Value(Scrape(decode), "kvagent_liveness_answered_total");
  }
  CHECK(answered >= 1);
  auto status = pair.decode().Status();
  REQUIRE(status.ok());
  CHECK(static_cast<double>(status->liveness_answered()) >= answered);
  CHECK(Value(Scrape(decode), "kvagent_liveness_dropped_total") == 0);
  CHECK(Value(Scrape(decode), "kvagent_liveness_peers_lost_total") == 0);
  CHECK(Value(Scrape(decode), "kvagent_liveness_pings_refused_total") == 0);

  // One transfer is counted once: sent in two chunks, its first chunk retried while it
  // runs and again after it ended (both accepted as the same transfer).
  auto first = KvWrite("m-chunked", {30}, {30});
  first.set_more_chunks(true);
  auto second = KvWrite("m-chunked", {31}, {31});
  second.set_chunk(1);
  auto submitted = pair.prefill().Submit(first);
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  REQUIRE(pair.prefill().Submit(first).ok());
  REQUIRE(pair.prefill().Submit(second).ok());
  auto chunked = pair.prefill().WaitTransfer("m-chunked", 20000);
  REQUIRE(chunked.ok());
  REQUIRE(chunked->phase() == v1::COMPLETED);
  REQUIRE(pair.prefill().Submit(first).ok());
  const std::string last = Scrape(prefill);
  CHECK(Value(last, "kvagent_transfers_total") == kWrites + kReads + 1);
  CHECK(Value(last, "kvagent_transfer_bytes_total", writes) ==
        static_cast<double>(write_bytes + chunked->bytes_done()));
  CHECK(chunked->bytes_done() == 2 * page_bytes);
}

TEST_CASE("The metrics endpoint refuses what it must and survives many connections",
          "[metrics]") {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp ? tmp : "/tmp") + "/metrics-limits";
  std::filesystem::create_directories(dir);
  auto binary = cli::FindKvagentd("");
  REQUIRE(binary.ok());
  cli::DaemonOptions d;
  d.binary = *binary;
  d.work_dir = dir;

  SECTION("a wildcard address needs --metrics-listen-any") {
    d.name = "wild";
    d.extra_args = {"--metrics-listen", "0.0.0.0:0"};
    auto refused = cli::DaemonProcess::Start(d);
    REQUIRE(!refused.ok());
    CHECK(std::string(refused.status().message()).find("--metrics-listen-any") !=
          std::string::npos);
  }

  SECTION("bad requests, oversized heads, idle and surplus connections") {
    d.name = "bounded";
    d.extra_args = {"--metrics-listen", "0", "--metrics-max-connections", "4"};
    auto process = cli::DaemonProcess::Start(d);
    REQUIRE(process.ok());
    cli::AgentClient client(process->address());
    const std::string address = MetricsAddress(client);
    REQUIRE(address.rfind("127.0.0.1:", 0) == 0);  // a bare port means loopback

    CHECK(StatusCode(Exchange(address, "HELLO\r\n\r\n")) == 400);
    CHECK(StatusCode(Exchange(address, std::string(300, '\x01') + "\r\n\r\n")) == 400);
    CHECK(StatusCode(Exchange(address, "POST /metrics HTTP/1.1\r\n\r\n")) == 405);
    CHECK(StatusCode(Exchange(address, "GET /secrets HTTP/1.1\r\n\r\n")) == 404);
    CHECK(StatusCode(Exchange(address, "GET /metrics HTTP/1.1\r\nX: " + std::string(9000, 'a'))) ==
          431);

    // Four idle clients hold every slot: the fifth is refused at once, not queued.
    std::vector<int> idle;
    for (int i = 0; i < 4; ++i) idle.push_back(Dial(address));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CHECK(StatusCode(Exchange(address, "GET /metrics HTTP/1.1\r\n\r\n")) == 503);
    // An idle client is dropped after the request timeout (2 s), freeing its slot.
    const auto start = std::chrono::steady_clock::now();
    CHECK(ReadAll(idle[0]).empty());
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now() - start)
                            .count();
    CHECK(waited < 4000);
    for (int fd : idle) close(fd);

    // 400 connections from 16 threads: each is answered 200 or refused 503, never hung.
    std::atomic<int> ok{0}, busy{0}, other{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 16; ++t) {
      threads.emplace_back([&] {
        for (int i = 0; i < 25; ++i) {
          const int code = StatusCode(Exchange(address, "GET /metrics HTTP/1.1\r\n\r\n"));
          (code == 200 ? ok : code == 503 ? busy : other)++;
        }
      });
    }
    for (auto& t : threads) t.join();
    INFO("200: " << ok.load() << " 503: " << busy.load());
    CHECK(other.load() == 0);
    CHECK(ok.load() > 0);

    const std::string body = Scrape(address);
    CHECK(Value(body, "kvagent_metrics_requests_total", {"result=\"bad_request\""}) == 4);
    CHECK(Value(body, "kvagent_metrics_requests_total", {"result=\"too_large\""}) == 1);
    CHECK(Value(body, "kvagent_metrics_requests_total", {"result=\"timeout\""}) >= 1);
    CHECK(Value(body, "kvagent_metrics_requests_total", {"result=\"refused_connection\""}) ==
          1 + busy.load());
    CHECK(Value(body, "kvagent_metrics_requests_total", {"result=\"ok\""}) == ok.load() + 1);
    // The gRPC doors did not notice.
    CHECK(client.Status().ok());
  }
}

TEST_CASE("Host memory an agent maps is read once per page in the background, unless "
          "--warm-mappings on; not by default", "[metrics]") {
  for (const bool on : {true, false}) {
    CAPTURE(on);
    AgentPairOptions options;
    options.extra_args = {"--metrics-listen", "127.0.0.1:0"};
    if (on) options.extra_args.insert(options.extra_args.end(), {"--warm-mappings", "on"});
    AgentPair pair(options);
    const std::string prefill = MetricsAddress(pair.prefill());
    // Prefill maps its engine's pool (registered) and, for its same-host copy route,
    // decode's pool: both are read through once.
    const double pages =
        static_cast<double>(pair.prefill_pool().bytes() + pair.decode_pool().bytes()) / 4096;
    double warmed = 0, waiting = -1;
    for (int i = 0; i < 200; ++i) {
      const std::string body = Scrape(prefill);
      warmed = Value(body, "kvagent_mapping_pages_warmed_total");
      waiting = Value(body, "kvagent_mapping_pages_to_warm");
      if (!on || (warmed >= pages && waiting == 0)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    CHECK(waiting == 0);
    if (on) {
      CHECK(warmed >= pages);
    } else {
      CHECK(warmed == 0);
    }
    // Either way the bytes move and arrive (the warm thread only reads).
    pair.ResetContents();
    auto request = KvWrite(on ? "warm-on" : "warm-off", {3}, {5});
    REQUIRE(SubmitThrough(pair.prefill(), request).ok());
    auto state = pair.prefill().WaitTransfer(request.transfer_id(), 20000);
    REQUIRE(state.ok());
    CHECK(state->phase() == v1::COMPLETED);
    CHECK(pair.PageEqual(3, 5));
  }
}

}  // namespace kvagent::testing

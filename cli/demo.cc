#include "cli/demo.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "fmt/format.h"
#include "transport/base/format.h"

namespace kvagent::cli {
namespace {

using Clock = std::chrono::steady_clock;

int Fail(const std::string& what, const absl::Status& status, bool json) {
  std::fprintf(stderr, "demo: %s: %s\n", what.c_str(), std::string(status.message()).c_str());
  if (json) std::printf("{\"verified\": false, \"error\": \"%s\"}\n", what.c_str());
  return 1;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p / 100.0 * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

void Progress(uint32_t done, uint32_t total) {
  if (!isatty(STDERR_FILENO)) return;
  const int width = 30;
  const int filled = total ? static_cast<int>(width * done / total) : width;
  std::fprintf(stderr, "\r[%s%s] %u/%u requests", std::string(filled, '#').c_str(),
               std::string(width - filled, ' ').c_str(), done, total);
  if (done == total) std::fprintf(stderr, "\n");
}

struct Request {
  std::string id;
  std::vector<uint64_t> prefill_pages;
  std::vector<uint64_t> decode_pages;
  Clock::time_point submitted;
  std::optional<Clock::time_point> notified;
};

}  // namespace

int RunDemo(const DemoOptions& options) {
  const bool json = options.json;
  std::optional<DaemonProcess> prefill_daemon, decode_daemon;
  std::string prefill_address = options.prefill_address, decode_address = options.decode_address;
  std::string work_dir;
  if (prefill_address.empty() != decode_address.empty()) {
    return Fail("arguments", absl::InvalidArgumentError(
                                 "give both --prefill and --decode, or neither to start two agents"),
                json);
  }
  if (prefill_address.empty()) {
    std::string binary = options.kvagentd;
    if (binary.empty()) {
      auto found = FindKvagentd(options.argv0);
      if (!found.ok()) return Fail("finding kvagentd", found.status(), json);
      binary = *found;
    }
    char pattern[] = "/tmp/kvagent-demo.XXXXXX";
    if (const char* tmp = std::getenv("TEST_TMPDIR")) {
      work_dir = fmt::format("{}/demo.{}", tmp, getpid());
      std::filesystem::create_directories(work_dir);
    } else {
      work_dir = mkdtemp(pattern);
    }
    for (auto [name, slot] : {std::pair{"prefill", &prefill_daemon}, {"decode", &decode_daemon}}) {
      DaemonOptions d;
      d.binary = binary;
      d.name = name;
      d.work_dir = work_dir;
      if (!options.shm_direct) d.extra_args = {"--shm-direct", "off"};
      auto started = DaemonProcess::Start(d);
      if (!started.ok()) return Fail(fmt::format("starting agent '{}'", name), started.status(), json);
      *slot = *std::move(started);
    }
    prefill_address = prefill_daemon->address();
    decode_address = decode_daemon->address();
    if (!json) std::printf("started agents: prefill %s, decode %s (logs in %s)\n",
                           prefill_address.c_str(), decode_address.c_str(), work_dir.c_str());
  }

  AgentClient prefill(prefill_address), decode(decode_address);
  for (auto* c : {&prefill, &decode}) {
    if (auto s = c->WaitReady(10000); !s.ok()) return Fail("waiting for agent", s, json);
  }

  // Agents that run on may hold an earlier demo's regions: name this run's apart.
  const std::string run = options.prefill_address.empty() ? "" : fmt::format("demo{}.", getpid());
  KvPoolShape shape;  // Llama-3.1-8B: 32 layers x K,V; 16 tokens x 8 heads x 128 x bf16
  shape.group = run + "kv";
  shape.pages = std::max<uint64_t>(1, (options.pool_mib << 20) /
                                          (uint64_t{shape.layers} * shape.tensors_per_layer *
                                           shape.page_bytes));
  const uint32_t pages_per_request = static_cast<uint32_t>(
      std::min<uint64_t>(options.pages_per_request, shape.pages / std::max(1u, options.requests)));
  if (pages_per_request == 0) {
    return Fail("pool size", absl::InvalidArgumentError(fmt::format(
                                 "{} pages per region cannot hold {} requests; raise --pool-mib",
                                 shape.pages, options.requests)),
                json);
  }
  auto src = CreateKvPool(prefill, run + "prefill", shape);
  if (!src.ok()) return Fail("creating the prefill pool", src.status(), json);
  auto dst = CreateKvPool(decode, run + "decode", shape);
  if (!dst.ok()) return Fail("creating the decode pool", dst.status(), json);
  for (uint32_t r = 0; r < src->regions(); ++r) {
    for (uint64_t p = 0; p < shape.pages; ++p) FillPage(src->Page(r, p), shape.page_bytes, options.seed, r, p);
  }
  std::memset(dst->mapping.data(), 0xEE, dst->bytes());

  auto peer = prefill.Connect(decode_address);
  if (!peer.ok()) return Fail("connecting prefill to decode", peer.status(), json);

  // Each request gets prefill pages and scattered free decode pages, as engines'
  // allocators hand them out.
  std::mt19937_64 rng(options.seed);
  std::vector<uint64_t> src_free(shape.pages), dst_free(shape.pages);
  std::iota(src_free.begin(), src_free.end(), 0);
  std::iota(dst_free.begin(), dst_free.end(), 0);
  std::shuffle(dst_free.begin(), dst_free.end(), rng);
  std::vector<Request> requests(options.requests);
  for (uint32_t i = 0; i < options.requests; ++i) {
    Request& r = requests[i];
    r.id = fmt::format("{}demo-req-{}", run, i);
    for (uint32_t k = 0; k < pages_per_request; ++k) {
      r.prefill_pages.push_back(src_free[i * pages_per_request + k]);
      r.decode_pages.push_back(dst_free[i * pages_per_request + k]);
    }
  }

  // The decode side watches for its requests' notifications.
  absl::Mutex mu;
  std::map<std::string, Request*> by_id;
  for (auto& r : requests) by_id[r.id] = &r;
  uint32_t notified = 0;
  absl::Status watch_status;
  std::vector<std::string> ids;
  for (auto& r : requests) ids.push_back(r.id);
  std::thread watcher([&] {
    AgentClient watch_client(decode_address);
    watch_status = watch_client.WatchNotifications(ids, options.timeout_ms, [&](const v1::Notification& n) {
      absl::MutexLock lock(&mu);
      auto it = by_id.find(n.transfer_id());
      if (it != by_id.end() && !it->second->notified && n.kind() == v1::DATA_READY &&
          n.payload() == "ready:" + n.transfer_id()) {
        it->second->notified = Clock::now();
        ++notified;
        Progress(notified, options.requests);
      }
      return notified < options.requests;
    });
  });

  // Chunked prefill: every request's pages go in `chunks` pieces, interleaved
  // across requests the way a prefill engine finishes them.
  const uint32_t chunks = std::max(1u, std::min(options.chunks, pages_per_request));
  const auto start = Clock::now();
  absl::Status submit_status;
  for (uint32_t c = 0; c < chunks && submit_status.ok(); ++c) {
    for (auto& r : requests) {
      v1::SubmitTransferRequest s;
      s.set_transfer_id(r.id);
      s.set_peer("decode");
      s.set_op(v1::WRITE);
      s.set_chunk(c);
      s.set_more_chunks(c + 1 < chunks);
      s.set_timeout_ms(options.timeout_ms);
      if (c + 1 == chunks) s.set_notification("ready:" + r.id);
      auto* seg = s.add_segments()->mutable_items();
      seg->set_local_group(shape.group);
      seg->set_remote_group(shape.group);
      const uint32_t begin = c * pages_per_request / chunks, end = (c + 1) * pages_per_request / chunks;
      for (uint32_t k = begin; k < end; ++k) {
        seg->add_local_indices(r.prefill_pages[k]);
        seg->add_remote_indices(r.decode_pages[k]);
      }
      if (c == 0) r.submitted = Clock::now();
      auto state = prefill.Submit(s);
      if (!state.ok()) {
        submit_status = state.status();
        break;
      }
    }
  }
  if (!submit_status.ok()) {
    watcher.detach();
    return Fail("submitting", submit_status, json);
  }
  watcher.join();
  const auto end = Clock::now();
  if (notified < options.requests) {
    return Fail(fmt::format("waiting for notifications ({} of {} arrived)", notified, options.requests),
                watch_status.ok() ? absl::DeadlineExceededError("stream ended") : watch_status, json);
  }
  std::vector<double> latencies;
  for (auto& r : requests) {
    auto state = prefill.Get(r.id);
    if (!state.ok() || state->phase() != v1::COMPLETED) {
      return Fail(fmt::format("transfer {} did not complete", r.id),
                  state.ok() ? absl::InternalError(state->error_message()) : state.status(), json);
    }
    latencies.push_back(std::chrono::duration<double, std::micro>(*r.notified - r.submitted).count());
  }

  // Every byte: transferred pages equal their source, every other decode page is
  // untouched.
  uint64_t bad_pages = 0, checked_bytes = 0;
  std::vector<bool> written(shape.pages, false);
  for (auto& r : requests) {
    for (uint32_t region = 0; region < dst->regions(); ++region) {
      for (uint32_t k = 0; k < pages_per_request; ++k) {
        if (std::memcmp(dst->Page(region, r.decode_pages[k]), src->Page(region, r.prefill_pages[k]),
                        shape.page_bytes) != 0) {
          if (bad_pages++ < 5) {
            std::fprintf(stderr, "demo: %s region %s decode page %lu differs from prefill page %lu\n",
                         r.id.c_str(), dst->region_names[region].c_str(),
                         static_cast<unsigned long>(r.decode_pages[k]),
                         static_cast<unsigned long>(r.prefill_pages[k]));
          }
        }
        checked_bytes += shape.page_bytes;
      }
    }
    for (auto p : r.decode_pages) written[p] = true;
  }
  uint64_t stray = 0;
  for (uint32_t region = 0; region < dst->regions(); ++region) {
    for (uint64_t p = 0; p < shape.pages; ++p) {
      if (written[p]) continue;
      const uint8_t* page = dst->Page(region, p);
      for (uint64_t b = 0; b < shape.page_bytes; ++b) {
        if (page[b] != 0xEE) {
          ++stray;
          break;
        }
      }
    }
  }
  const bool verified = bad_pages == 0 && stray == 0;
  const uint64_t pages = uint64_t{options.requests} * pages_per_request;
  const uint64_t bytes = pages * src->regions() * shape.page_bytes;
  const double seconds = std::chrono::duration<double>(end - start).count();
  const double gbps = bytes / seconds / 1e9;
  const double p50 = Percentile(latencies, 50), p99 = Percentile(latencies, 99);
  std::string transports = peer->transports();

  if (!json) {
    std::printf("\nmodel      Llama-3.1-8B KV: %u layers x K,V, %lu KiB pages, %lu pages per region\n",
                shape.layers, static_cast<unsigned long>(shape.page_bytes >> 10),
                static_cast<unsigned long>(shape.pages));
    std::printf("data path  %s (UCX transports %s, error mode %s)\n\n", peer->data_path().c_str(),
                transports.c_str(), peer->error_mode().c_str());
    std::printf("%-10s %-8s %-8s %-12s %-10s %-12s %-12s %s\n", "requests", "pages", "chunks",
                "bytes", "GB/s", "p50 ms", "p99 ms", "verified");
    std::printf("%-10u %-8lu %-8u %-12lu %-10.2f %-12.3f %-12.3f %s\n", options.requests,
                static_cast<unsigned long>(pages), chunks, static_cast<unsigned long>(bytes), gbps,
                p50 / 1000, p99 / 1000, verified ? "yes" : "NO");
    if (!verified) {
      std::printf("%lu page copies differ, %lu untouched pages were written\n",
                  static_cast<unsigned long>(bad_pages), static_cast<unsigned long>(stray));
    }
  }
  std::printf(
      "{\"verified\": %s, \"requests\": %u, \"pages\": %lu, \"regions\": %u, \"bytes\": %lu, "
      "\"checked_bytes\": %lu, \"seconds\": %.6f, \"gbps\": %.3f, \"p50_us\": %.1f, \"p99_us\": "
      "%.1f, \"data_path\": \"%s\", \"transports\": \"%s\", \"error_mode\": \"%s\"}\n",
      verified ? "true" : "false", options.requests, static_cast<unsigned long>(pages),
      src->regions(), static_cast<unsigned long>(bytes), static_cast<unsigned long>(checked_bytes),
      seconds, gbps, p50, p99, peer->data_path().c_str(), transports.c_str(),
      peer->error_mode().c_str());
  std::fflush(stdout);
  if (!run.empty()) {
    // Leave the agents as we found them.
    (void)prefill.Deregister(src->region_names);
    (void)decode.Deregister(dst->region_names);
  }
  if (prefill_daemon) {
    (void)prefill_daemon->Stop();
    (void)decode_daemon->Stop();
    std::error_code ignored;
    std::filesystem::remove_all(work_dir, ignored);
  }
  return verified ? 0 : 1;
}

}  // namespace kvagent::cli

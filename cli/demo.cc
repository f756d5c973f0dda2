#include "cli/demo.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/mutex.h"
#include "base/format.h"
#include "base/status_macros.h"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "cli/local_agents.h"
#include "cli/model_shapes.h"
#include "cli/notification_waiter.h"
#include "client/fast_path.h"
#include "cuda/driver.h"
#include "fmt/format.h"

namespace kvagent::cli {
namespace {

using Clock = std::chrono::steady_clock;

// Agents this demo started; their logs are shown when it fails.
std::vector<std::string> g_agent_logs;

int Fail(const std::string& what, const absl::Status& status, bool json) {
  std::fprintf(stderr, "demo: %s: %s (%s)\n", what.c_str(), std::string(status.message()).c_str(),
               absl::StatusCodeToString(status.code()).c_str());
  PrintAgentLogs(g_agent_logs);
  if (json) std::printf("{\"verified\": false, \"error\": \"%s\"}\n", what.c_str());
  return 1;
}

// A request's metadata in the AUX region, kAuxRecordBytes at its slot's offset.
struct AuxRecord {
  uint32_t first_token;
  uint32_t prompt_tokens;
  uint32_t kv_pages;
  uint32_t decode_slot;
  char request_id[48];
};
static_assert(sizeof(AuxRecord) == kAuxRecordBytes);

// True when all `n` bytes at `p` are `value` (memcmp against a filled block is
// much faster than a byte loop over gigabytes of state).
bool AllBytesAre(const uint8_t* p, uint64_t n, uint8_t value) {
  std::array<uint8_t, 4096> block;
  block.fill(value);
  for (uint64_t done = 0; done < n; done += block.size()) {
    const uint64_t len = std::min<uint64_t>(block.size(), n - done);
    if (std::memcmp(p + done, block.data(), len) != 0) return false;
  }
  return true;
}

struct Request {
  std::string id;
  std::vector<uint64_t> prefill_pages;
  std::vector<uint64_t> decode_pages;
  uint64_t prefill_slot = 0, decode_slot = 0;  // hybrid: state slot and aux record
  Clock::time_point submitted;
  std::optional<Clock::time_point> notified;
};

// Submits the demo's chunks through the fast path (its completions checked as they
// come) or one SubmitTransfer call each.
class ChunkSubmitter {
 public:
  explicit ChunkSubmitter(AgentClient* client) : client_(client) {}

  absl::Status Open(const std::string& mode) {
    if (mode == "grpc" || (mode == "auto" && !client_->local())) return absl::OkStatus();
    if (!client_->local()) {
      return absl::InvalidArgumentError(
          "--submit fast needs the prefill agent's local door (a unix: address)");
    }
    auto session = client_->Session();
    if (!session.ok()) return session.status();
    auto fast = client::FastPath::Open(*session);
    if (!fast.ok()) return fast.status();
    fast_ = *std::move(fast);
    return absl::OkStatus();
  }
  const char* mode() const { return fast_ ? "fast" : "grpc"; }

  absl::Status Submit(const v1::SubmitTransferRequest& request) {
    if (!fast_) return client_->Submit(request).status();
    RETURN_IF_ERROR(fast_->SubmitOrReap(request, next_++, &reaped_, absl::Seconds(30)));
    return Check();
  }

  // Waits for every completion (each transfer's last chunk completes when it ends).
  absl::Status Finish(uint32_t timeout_ms) {
    if (!fast_) return absl::OkStatus();
    const absl::Time deadline = absl::Now() + absl::Milliseconds(timeout_ms);
    while (fast_->outstanding() != 0 && absl::Now() < deadline) {
      auto got = fast_->Reap(&reaped_, 1024, absl::Milliseconds(100));
      if (!got.ok()) return got.status();
      RETURN_IF_ERROR(Check());
    }
    if (fast_->outstanding() != 0) {
      return absl::DeadlineExceededError(fmt::format(
          "{} fast path completions did not come within {} ms", fast_->outstanding(), timeout_ms));
    }
    return Check();
  }

 private:
  absl::Status Check() {
    for (const client::FastCompletion& c : reaped_) {
      if (c.code != absl::StatusCode::kOk) return c.status();
    }
    reaped_.clear();
    return absl::OkStatus();
  }

  AgentClient* client_;
  std::unique_ptr<client::FastPath> fast_;
  std::vector<client::FastCompletion> reaped_;
  uint64_t next_ = 1;
};

}  // namespace

int RunDemo(const DemoOptions& options) {
  const bool json = options.json;
  // The pools outlive the agents started here: device memory is freed only after
  // the agents that imported it have stopped (declaration order is teardown order).
  std::optional<Pool> src, dst;
  LocalAgents local;
  std::string prefill_address = options.prefill_address, decode_address = options.decode_address;
  if (prefill_address.empty() != decode_address.empty()) {
    return Fail("arguments", absl::InvalidArgumentError(
                                 "give both --prefill and --decode, or neither to start two agents"),
                json);
  }
  // The model's shape first, so bad flags fail before any agent starts. Agents that
  // run on may hold an earlier demo's regions: name this run's apart.
  const std::string run = options.prefill_address.empty() ? "" : fmt::format("demo{}.", getpid());
  ModelOptions model_options;
  model_options.model = options.model;
  model_options.group_prefix = run;
  model_options.kv_pool_bytes = options.pool_mib << 20;
  model_options.ssm_layers = options.ssm_layers;
  model_options.state_slots = options.state_slots;
  auto model = MakeModelShape(model_options);
  if (!model.ok()) return Fail("model", model.status(), json);
  const uint64_t pool_pages = model->pages();
  const uint32_t pages_per_request = static_cast<uint32_t>(
      std::min<uint64_t>(options.pages_per_request, pool_pages / std::max(1u, options.requests)));
  if (pages_per_request == 0) {
    return Fail("pool size", absl::InvalidArgumentError(fmt::format(
                                 "{} pages per region cannot hold {} requests; raise --pool-mib",
                                 pool_pages, options.requests)),
                json);
  }
  const bool has_state = !model->state_groups.empty();
  if (has_state && options.requests > model->state_slots) {
    return Fail("state slots", absl::InvalidArgumentError(fmt::format(
                                   "{} requests need a state slot each, but --state-slots is "
                                   "{}; raise --state-slots or lower --requests",
                                   options.requests, model->state_slots)),
                json);
  }
  // VRAM: this process plays the engine, so it needs the driver and the device
  // before any agent starts.
  if (options.memory != "dram" && options.memory != "vram") {
    return Fail("arguments", absl::InvalidArgumentError(fmt::format(
                                 "--memory '{}' is unknown; use --memory dram or --memory vram",
                                 options.memory)),
                json);
  }
  const bool vram = options.memory == "vram";
  if (vram) {
    auto driver = cuda::CudaDriver::Load();
    if (!driver.ok()) {
      return Fail("--memory vram (on a machine without a GPU use --memory dram)", driver.status(),
                  json);
    }
    if (auto s = (*driver)->MakeCurrent(options.device); !s.ok()) {
      return Fail(fmt::format("--memory vram --device {}", options.device), s, json);
    }
  }
  if (prefill_address.empty()) {
    LocalAgentsOptions start;
    start.argv0 = options.argv0;
    start.kvagentd = options.kvagentd;
    start.label = "demo";
    start.first_name = "prefill";
    start.second_name = "decode";
    if (!options.shm_direct) start.extra_args = {"--shm-direct", "off"};
    absl::Status started = StartLocalAgents(start, &local);
    g_agent_logs = local.log_paths;
    if (!started.ok()) return Fail("starting the agents", started, json);
    prefill_address = local.first->address();
    decode_address = local.second->address();
    if (!json) std::printf("started agents: prefill %s, decode %s (logs in %s)\n",
                           prefill_address.c_str(), decode_address.c_str(), local.work_dir.c_str());
  }

  AgentClient prefill(prefill_address), decode(decode_address);
  for (auto* c : {&prefill, &decode}) {
    if (auto s = c->WaitReady(10000); !s.ok()) return Fail("waiting for agent", s, json);
  }

  // Agents that run on get this run's regions back on every way out (first thing
  // torn down, before agents started here stop and before the pools are freed).
  auto deregister = absl::MakeCleanup([&] {
    if (run.empty()) return;
    if (src) (void)prefill.Deregister(src->region_names);
    if (dst) (void)decode.Deregister(dst->region_names);
  });
  PoolMemory memory;
  memory.kind = vram ? v1::VRAM : v1::DRAM;
  memory.device = options.device;
  {
    auto created = CreatePool(prefill, run + "prefill", model->groups, memory);
    if (!created.ok()) return Fail("creating the prefill pool", created.status(), json);
    src = *std::move(created);
    created = CreatePool(decode, run + "decode", model->groups, memory);
    if (!created.ok()) return Fail("creating the decode pool", created.status(), json);
    dst = *std::move(created);
  }
  // Every item gets its own pattern; region numbers run across groups so no two
  // regions hold the same bytes.
  {
    uint32_t region_number = 0;
    for (size_t g = 0; g < src->groups.size(); ++g) {
      const PoolGroupShape& shape = src->groups[g].shape;
      for (uint32_t r = 0; r < shape.regions(); ++r, ++region_number) {
        for (uint64_t i = 0; i < shape.items; ++i) {
          FillPage(src->Item(g, r, i), shape.item_bytes, options.seed, region_number, i);
        }
      }
    }
  }
  std::memset(dst->data(), 0xEE, dst->bytes());

  auto peer = prefill.Connect(decode_address);
  if (!peer.ok()) return Fail("connecting prefill to decode", peer.status(), json);

  // Each request gets prefill pages and scattered free decode pages, as engines'
  // allocators hand them out; hybrid requests also get a prefill state slot (its
  // request number) and a scattered decode slot, whose aux record it fills.
  std::mt19937_64 rng(options.seed);
  std::vector<uint64_t> src_free(pool_pages), dst_free(pool_pages);
  std::iota(src_free.begin(), src_free.end(), 0);
  std::iota(dst_free.begin(), dst_free.end(), 0);
  std::shuffle(dst_free.begin(), dst_free.end(), rng);
  std::vector<uint64_t> dst_slots(model->state_slots);
  std::iota(dst_slots.begin(), dst_slots.end(), 0);
  std::shuffle(dst_slots.begin(), dst_slots.end(), rng);
  std::vector<Request> requests(options.requests);
  for (uint32_t i = 0; i < options.requests; ++i) {
    Request& r = requests[i];
    r.id = fmt::format("{}demo-req-{}", run, i);
    for (uint32_t k = 0; k < pages_per_request; ++k) {
      r.prefill_pages.push_back(src_free[i * pages_per_request + k]);
      r.decode_pages.push_back(dst_free[i * pages_per_request + k]);
    }
    if (has_state) {
      r.prefill_slot = i;
      r.decode_slot = dst_slots[i];
    }
    if (model->aux_group) {
      // What a prefill engine hands its decode peer besides the cache.
      AuxRecord record{};
      record.first_token = static_cast<uint32_t>(rng() % 128256);
      record.prompt_tokens = pages_per_request * 16 - static_cast<uint32_t>(rng() % 16);
      record.kv_pages = pages_per_request;
      record.decode_slot = static_cast<uint32_t>(r.decode_slot);
      std::snprintf(record.request_id, sizeof(record.request_id), "%s", r.id.c_str());
      std::memcpy(src->Region(*model->aux_group, 0) + r.prefill_slot * kAuxRecordBytes, &record,
                  sizeof(record));
    }
  }
  // VRAM: the patterns were built in host images; put them on the device (DRAM: the
  // mappings are the pools, nothing to copy).
  if (auto s = src->Upload(); !s.ok()) {
    return Fail("copying the prefill pattern to the GPU", s, json);
  }
  if (auto s = dst->Upload(); !s.ok()) return Fail("filling the decode pool on the GPU", s, json);

  // The decode side watches for its requests' notifications (a watcher left waiting
  // on an agent that runs on, after a failed submit, owns its state).
  NotificationWaiterOptions watch;
  watch.address = decode_address;
  watch.timeout_ms = options.timeout_ms;
  for (auto& r : requests) watch.ids.push_back(r.id);
  watch.keep = [](const v1::Notification& n) {
    return n.kind() == v1::DATA_READY && n.payload() == "ready:" + n.transfer_id();
  };
  watch.stop_after = options.requests;
  watch.on_kept = [total = options.requests](uint64_t kept) { Progress(kept, total, "requests"); };
  NotificationWaiter watcher(std::move(watch));

  // Chunked prefill: every request's pages go in `chunks` pieces, interleaved
  // across requests the way a prefill engine finishes them.
  const uint32_t chunks = std::max(1u, std::min(options.chunks, pages_per_request));
  const std::string kv_group = model->groups[model->kv_group].group;
  ChunkSubmitter submitter(&prefill);
  if (absl::Status opened = submitter.Open(options.submit); !opened.ok()) {
    return Fail("opening the fast path", opened, json);
  }
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
      seg->set_local_group(kv_group);
      seg->set_remote_group(kv_group);
      const uint32_t begin = c * pages_per_request / chunks, end = (c + 1) * pages_per_request / chunks;
      for (uint32_t k = begin; k < end; ++k) {
        seg->add_local_indices(r.prefill_pages[k]);
        seg->add_remote_indices(r.decode_pages[k]);
      }
      if (c + 1 == chunks) {
        // The request's state slot in every SSM layer (conv and ssm groups) and its
        // aux record ride in the last chunk, so the one notification covers them.
        for (size_t g : model->state_groups) {
          auto* state = s.add_segments()->mutable_items();
          state->set_local_group(src->groups[g].shape.group);
          state->set_remote_group(src->groups[g].shape.group);
          state->add_local_indices(r.prefill_slot);
          state->add_remote_indices(r.decode_slot);
        }
        if (model->aux_group) {
          auto* aux = s.add_segments()->mutable_bytes();
          aux->set_local_region(src->groups[*model->aux_group].region_names[0]);
          aux->set_local_offset(r.prefill_slot * kAuxRecordBytes);
          aux->set_remote_region(dst->groups[*model->aux_group].region_names[0]);
          aux->set_remote_offset(r.decode_slot * kAuxRecordBytes);
          aux->set_length(kAuxRecordBytes);
        }
      }
      if (c == 0) r.submitted = Clock::now();
      submit_status = submitter.Submit(s);
      if (!submit_status.ok()) break;
    }
  }
  if (submit_status.ok()) submit_status = submitter.Finish(options.timeout_ms);
  if (!submit_status.ok()) {
    // The watcher waits on the decode agent's stream: stopping an agent started here
    // ends it; on an agent that runs on it waits out its timeout on its own state.
    if (local.started()) {
      (void)local.second->Stop();
      watcher.Finish(absl::InfiniteDuration());
    } else {
      watcher.Finish(absl::ZeroDuration());
    }
    return Fail("submitting", submit_status, json);
  }
  watcher.Finish(absl::InfiniteDuration());
  const auto end = Clock::now();
  const uint64_t notified = watcher.kept();
  const absl::Status watch_status = watcher.status();
  const auto kept = watcher.Kept();
  for (auto& r : requests) {
    if (auto it = kept.find(r.id); it != kept.end()) r.notified = it->second;
  }
  if (notified < options.requests) {
    return Fail(fmt::format("waiting for notifications ({} of {} arrived)", notified, options.requests),
                watch_status.ok() ? absl::DeadlineExceededError("stream ended") : watch_status, json);
  }
  std::vector<double> latencies;
  for (auto& r : requests) {
    // Its final state (the notification comes after the sender recorded it; waiting
    // also covers an agent that was not started here).
    auto state = prefill.WaitTransfer(r.id, options.timeout_ms);
    if (!state.ok() || state->phase() != v1::COMPLETED) {
      return Fail(fmt::format("transfer {} did not complete", r.id),
                  state.ok() ? absl::Status(state->error_code() != 0
                                                ? static_cast<absl::StatusCode>(state->error_code())
                                                : absl::StatusCode::kInternal,
                                            fmt::format("it ended {}{}{}",
                                                        v1::TransferPhase_Name(state->phase()),
                                                        state->error_message().empty() ? "" : ": ",
                                                        state->error_message()))
                             : state.status(),
                  json);
    }
    latencies.push_back(Micros(*r.notified - r.submitted));
  }

  // Every byte: transferred pages, slots and records equal their source, every
  // other decode page, slot and aux byte is untouched. One check for both memories:
  // it reads the decode pool through the shared mapping (DRAM) or a fresh host copy
  // of the device bytes (VRAM); the prefill side's source is its host view.
  if (auto s = dst->Download(); !s.ok()) {
    return Fail("copying the decode pool back from the GPU", s, json);
  }
  const size_t kv = model->kv_group;
  const PoolGroupShape& kv_shape = src->groups[kv].shape;
  uint64_t bad_pages = 0, bad_slots = 0, bad_records = 0, checked_bytes = 0;
  std::vector<bool> written(pool_pages, false), slot_written(model->state_slots, false);
  for (auto& r : requests) {
    for (uint32_t region = 0; region < kv_shape.regions(); ++region) {
      for (uint32_t k = 0; k < pages_per_request; ++k) {
        if (std::memcmp(dst->Item(kv, region, r.decode_pages[k]),
                        src->Item(kv, region, r.prefill_pages[k]), kv_shape.item_bytes) != 0) {
          if (bad_pages++ < 5) {
            std::fprintf(stderr, "demo: %s region %s decode page %lu differs from prefill page %lu\n",
                         r.id.c_str(), dst->groups[kv].region_names[region].c_str(),
                         static_cast<unsigned long>(r.decode_pages[k]),
                         static_cast<unsigned long>(r.prefill_pages[k]));
          }
        }
        checked_bytes += kv_shape.item_bytes;
      }
    }
    for (auto p : r.decode_pages) written[p] = true;
    for (size_t g : model->state_groups) {
      const PoolGroupShape& shape = src->groups[g].shape;
      for (uint32_t region = 0; region < shape.regions(); ++region) {
        if (std::memcmp(dst->Item(g, region, r.decode_slot), src->Item(g, region, r.prefill_slot),
                        shape.item_bytes) != 0) {
          if (bad_slots++ < 5) {
            std::fprintf(stderr, "demo: %s region %s decode slot %lu differs from prefill slot %lu\n",
                         r.id.c_str(), dst->groups[g].region_names[region].c_str(),
                         static_cast<unsigned long>(r.decode_slot),
                         static_cast<unsigned long>(r.prefill_slot));
          }
        }
        checked_bytes += shape.item_bytes;
      }
    }
    if (has_state) slot_written[r.decode_slot] = true;
    if (model->aux_group) {
      const uint8_t* got = dst->Region(*model->aux_group, 0) + r.decode_slot * kAuxRecordBytes;
      const uint8_t* want = src->Region(*model->aux_group, 0) + r.prefill_slot * kAuxRecordBytes;
      AuxRecord record;
      std::memcpy(&record, got, sizeof(record));
      if (std::memcmp(got, want, kAuxRecordBytes) != 0 || record.decode_slot != r.decode_slot) {
        if (bad_records++ < 5) {
          std::fprintf(stderr, "demo: %s aux record at decode offset %lu differs from prefill's\n",
                       r.id.c_str(), static_cast<unsigned long>(r.decode_slot * kAuxRecordBytes));
        }
      }
      checked_bytes += kAuxRecordBytes;
    }
  }
  uint64_t stray = 0;
  for (uint32_t region = 0; region < kv_shape.regions(); ++region) {
    for (uint64_t p = 0; p < pool_pages; ++p) {
      if (!written[p] && !AllBytesAre(dst->Item(kv, region, p), kv_shape.item_bytes, 0xEE)) ++stray;
    }
  }
  for (size_t g : model->state_groups) {
    const PoolGroupShape& shape = dst->groups[g].shape;
    for (uint32_t region = 0; region < shape.regions(); ++region) {
      for (uint64_t slot = 0; slot < shape.items; ++slot) {
        if (!slot_written[slot] && !AllBytesAre(dst->Item(g, region, slot), shape.item_bytes, 0xEE)) {
          ++stray;
        }
      }
    }
  }
  if (model->aux_group) {
    const uint8_t* aux = dst->Region(*model->aux_group, 0);
    const uint64_t records = dst->groups[*model->aux_group].shape.item_bytes / kAuxRecordBytes;
    for (uint64_t slot = 0; slot < records; ++slot) {
      const bool ours = slot < slot_written.size() && slot_written[slot];
      if (!ours && !AllBytesAre(aux + slot * kAuxRecordBytes, kAuxRecordBytes, 0xEE)) ++stray;
    }
  }
  bool verified = bad_pages == 0 && bad_slots == 0 && bad_records == 0 && stray == 0;
  const uint64_t pages = uint64_t{options.requests} * pages_per_request;
  const uint64_t kv_bytes = pages * kv_shape.regions() * kv_shape.item_bytes;
  uint64_t state_bytes = 0, aux_bytes = 0;
  for (size_t g : model->state_groups) {
    state_bytes += uint64_t{options.requests} * src->groups[g].shape.regions() *
                   src->groups[g].shape.item_bytes;
  }
  if (model->aux_group) aux_bytes = uint64_t{options.requests} * kAuxRecordBytes;
  const uint64_t bytes = kv_bytes + state_bytes + aux_bytes;
  const double seconds = std::chrono::duration<double>(end - start).count();
  const double gbps = bytes / seconds / 1e9;
  const double p50 = Percentile(latencies, 50), p99 = Percentile(latencies, 99);
  std::string transports = peer->transports();

  if (!json) {
    std::printf("\nmodel      %s\n", model->description.c_str());
    std::printf("submitted  through %s\n", submitter.mode());
    std::printf("data path  %s (UCX transports %s, error mode %s, UCX round trip at connect "
                "%lu us)\n",
                peer->data_path().c_str(), transports.c_str(), peer->error_mode().c_str(),
                static_cast<unsigned long>(peer->ucx_round_trip_us()));
    std::printf("regions    %zu per agent in %s (memory path: prefill %s, decode %s)\n\n",
                src->region_names.size(),
                vram ? fmt::format("VRAM, CUDA device {}, one IPC handle per pool",
                                   options.device).c_str()
                     : "DRAM, one shared-memory object per pool",
                src->memory_path.c_str(), dst->memory_path.c_str());
    if (has_state || model->aux_group) {
      // Per group: what one request moves and what all of them moved.
      std::printf("%-8s %-6s %-8s %-12s %-14s %s\n", "group", "kind", "regions", "item bytes",
                  "items/request", "bytes");
      for (size_t g = 0; g < src->groups.size(); ++g) {
        const PoolGroupShape& shape = src->groups[g].shape;
        const bool is_kv = g == kv, is_aux = model->aux_group && g == *model->aux_group;
        const uint64_t group_bytes =
            is_kv ? kv_bytes
                  : is_aux ? aux_bytes
                           : uint64_t{options.requests} * shape.regions() * shape.item_bytes;
        std::printf("%-8s %-6s %-8u %-12lu %-14s %lu\n", shape.group.substr(run.size()).c_str(),
                    v1::RegionKind_Name(shape.kind).c_str(), shape.regions(),
                    static_cast<unsigned long>(is_aux ? kAuxRecordBytes : shape.item_bytes),
                    is_kv ? fmt::format("{} pages", pages_per_request).c_str()
                          : is_aux ? "1 record" : "1 slot",
                    static_cast<unsigned long>(group_bytes));
      }
      std::printf("\n");
    }
    std::printf("%-10s %-8s %-8s %-12s %-10s %-12s %-12s %s\n", "requests", "pages", "chunks",
                "bytes", "GB/s", "p50 ms", "p99 ms", "verified");
    std::printf("%-10u %-8lu %-8u %-12lu %-10.2f %-12.3f %-12.3f %s\n", options.requests,
                static_cast<unsigned long>(pages), chunks, static_cast<unsigned long>(bytes), gbps,
                p50 / 1000, p99 / 1000, verified ? "yes" : "NO");
    if (!verified) {
      std::printf("%lu page copies, %lu state slot copies and %lu aux records differ, %lu "
                  "untouched pages/slots/records were written\n",
                  static_cast<unsigned long>(bad_pages), static_cast<unsigned long>(bad_slots),
                  static_cast<unsigned long>(bad_records), static_cast<unsigned long>(stray));
    }
  }
  std::printf(
      "{\"verified\": %s, \"model\": \"%s\", \"memory\": \"%s\", \"requests\": %u, "
      "\"pages\": %lu, \"regions\": %zu, "
      "\"state_slots\": %u, \"bytes\": %lu, \"kv_bytes\": %lu, \"state_bytes\": %lu, "
      "\"aux_bytes\": %lu, \"checked_bytes\": %lu, \"seconds\": %.6f, \"gbps\": %.3f, "
      "\"p50_us\": %.1f, \"p99_us\": %.1f, \"data_path\": \"%s\", \"transports\": \"%s\", "
      "\"error_mode\": \"%s\", \"prefill_memory_path\": \"%s\", "
      "\"decode_memory_path\": \"%s\", \"submit\": \"%s\", \"ucx_round_trip_us\": %lu}\n",
      verified ? "true" : "false", model->model.c_str(), options.memory.c_str(), options.requests,
      static_cast<unsigned long>(pages), src->region_names.size(), model->state_slots,
      static_cast<unsigned long>(bytes), static_cast<unsigned long>(kv_bytes),
      static_cast<unsigned long>(state_bytes), static_cast<unsigned long>(aux_bytes),
      static_cast<unsigned long>(checked_bytes), seconds, gbps, p50, p99,
      peer->data_path().c_str(), transports.c_str(), peer->error_mode().c_str(),
      src->memory_path.c_str(), dst->memory_path.c_str(), submitter.mode(),
      static_cast<unsigned long>(peer->ucx_round_trip_us()));
  std::fflush(stdout);
  std::move(deregister).Invoke();
  if (local.started()) local.StopAndClean();
  // The agents have let go of the pools (deregistered or exited): free the device
  // memory now, as an engine would at shutdown.
  for (auto [side, pool] : {std::pair{"prefill", &src}, {"decode", &dst}}) {
    if (auto s = (*pool)->device.Free(); !s.ok()) {
      std::fprintf(stderr, "demo: freeing the %s pool's GPU memory: %s\n", side,
                   std::string(s.message()).c_str());
      verified = false;
    }
  }
  return verified ? 0 : 1;
}

}  // namespace kvagent::cli

#include "agent/staging.h"

#include <pthread.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <tuple>
#include <utility>

#include "agent/access.h"
#include "agent/status_util.h"
#include "base/format.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "fmt/format.h"
#include "registry/fault_guard.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("staging");
constexpr uint64_t kPageBytes = 4096;
constexpr uint64_t kMaxPoolBytes = 64ull << 30;

// The sender's name goes in with its length: names and transfer ids may hold '/', and
// peer "a/1/x" (incarnation 5, transfer "t") must not share a key with peer "a"
// (incarnation 1, transfer "x/5/t").
std::string ArrivalKey(const std::string& from, uint64_t incarnation, const std::string& id) {
  return fmt::format("{}:{}/{:x}/{}", from.size(), from, incarnation, id);
}
}  // namespace

absl::Status ValidateStagingOptions(const StagingPoolOptions& options) {
  if (options.chunk_bytes == 0) {
    return absl::InvalidArgumentError(
        "--staging-chunk-bytes 0: a bounce buffer needs at least 1 byte; use a size such as "
        "4194304 (4 MiB, the default)");
  }
  if (options.am_message_bytes == 0) {
    return absl::InvalidArgumentError(
        "--am-message-bytes 0: data sent as messages needs at least 1 byte per message; use "
        "a size such as 524288 (512 KiB, the default)");
  }
  if (options.buffers == 0) {
    return absl::InvalidArgumentError(
        "--staging-buffers 0: staging needs at least one bounce buffer; use 2 or more (8 is "
        "the default) so device copies overlap the network");
  }
  if (options.chunk_bytes > kMaxPoolBytes / options.buffers) {
    return absl::InvalidArgumentError(fmt::format(
        "--staging-buffers {} x --staging-chunk-bytes {} is over the {} bytes a staging pool "
        "may pin; use fewer or smaller buffers",
        options.buffers, options.chunk_bytes, kMaxPoolBytes));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// StagingPool

// One bounce buffer: its memory and, with a UCX context, its registration.
struct StagingBuffer {
  uint8_t* data = nullptr;
  transport::MemoryRegistration registration;
};

struct StagingPool::State {
  uint64_t chunk_bytes = 0;
  uint64_t allocated_bytes = 0;  // chunk_bytes rounded up to whole pages
  cuda::CudaDriver* cuda = nullptr;  // set when the buffers are pinned by CUDA
  const transport::UcxContext* context = nullptr;
  uint32_t max_written_off = 0;
  uint32_t buffers = 0;  // slots.size(), fixed at Create
  absl::Mutex mu;
  // By slot: the buffer a lease of that slot gets now.
  std::vector<StagingBuffer> slots ABSL_GUARDED_BY(mu);
  std::vector<uint32_t> free ABSL_GUARDED_BY(mu);
  std::deque<Waiter> waiters ABSL_GUARDED_BY(mu);
  // Buffers written off (WriteOff): still leased, by a send that may yet read them;
  // freed when that lease is released.
  std::vector<StagingBuffer> written_off ABSL_GUARDED_BY(mu);
  uint64_t written_off_total ABSL_GUARDED_BY(mu) = 0;
  uint64_t write_offs_refused ABSL_GUARDED_BY(mu) = 0;

  absl::StatusOr<StagingBuffer> Allocate(const std::string& entry) {
    StagingBuffer buffer;
    if (cuda != nullptr) {
      ASSIGN_OR_RETURN(void* pinned, cuda->HostAlloc(allocated_bytes, entry));
      buffer.data = static_cast<uint8_t*>(pinned);
    } else {
      buffer.data = static_cast<uint8_t*>(std::aligned_alloc(kPageBytes, allocated_bytes));
      if (buffer.data == nullptr) {
        return absl::ResourceExhaustedError(fmt::format(
            "{}: allocating {} bytes failed; use fewer or smaller staging buffers "
            "(--staging-buffers, --staging-chunk-bytes)",
            entry, allocated_bytes));
      }
    }
    if (context != nullptr) {
      auto registration = transport::MemoryRegistration::Map(
          *context, buffer.data, allocated_bytes, transport::MemoryType::kHost, entry);
      if (!registration.ok()) {
        Free(buffer);
        return registration.status();
      }
      buffer.registration = *std::move(registration);
    }
    return buffer;
  }
  void Free(StagingBuffer& buffer) {
    buffer.registration = transport::MemoryRegistration();  // unmap from UCX first
    if (buffer.data == nullptr) return;
    if (cuda != nullptr) {
      (void)cuda->HostFree(buffer.data);
    } else {
      std::free(buffer.data);
    }
    buffer.data = nullptr;
  }

  // Slot `index` is free again (its buffer, or a new one): to the oldest waiter (set
  // in *waiter and *next, to be run outside the lock), or to the free list.
  void FreeSlotLocked(uint32_t index, const std::shared_ptr<State>& self, Waiter* waiter,
                      Lease* next) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (waiters.empty()) {
      free.push_back(index);
      return;
    }
    *waiter = std::move(waiters.front());
    waiters.pop_front();
    next->state_ = self;
    next->index_ = index;
    next->data_ = slots[index].data;
    next->size_ = chunk_bytes;
  }

  ~State() {
    absl::MutexLock lock(&mu);
    for (StagingBuffer& b : slots) Free(b);
    for (StagingBuffer& b : written_off) Free(b);
  }
};

StagingPool::Lease::Lease(Lease&& other) noexcept
    : state_(std::move(other.state_)), index_(other.index_), data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
}

StagingPool::Lease& StagingPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    state_ = std::move(other.state_);
    index_ = other.index_;
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
  }
  return *this;
}

StagingPool::Lease::~Lease() { Release(); }

void StagingPool::Lease::Release() {
  if (data_ == nullptr) return;
  uint8_t* const data = data_;
  data_ = nullptr;
  std::shared_ptr<State> state = std::move(state_);
  Waiter waiter;
  Lease next;
  {
    absl::MutexLock lock(&state->mu);
    if (state->slots[index_].data != data) {
      // Written off while this lease held it: its slot has another buffer now, and
      // this one goes back to the system, not to the pool.
      for (auto it = state->written_off.begin(); it != state->written_off.end(); ++it) {
        if (it->data != data) continue;
        state->Free(*it);
        state->written_off.erase(it);
        break;
      }
      return;
    }
    state->FreeSlotLocked(index_, state, &waiter, &next);
  }
  // Hand the buffer straight to the oldest waiter, outside the lock.
  if (waiter) waiter(std::move(next));
}

absl::StatusOr<std::unique_ptr<StagingPool>> StagingPool::Create(
    const StagingPoolOptions& options, cuda::CudaDriver* cuda,
    const transport::UcxContext* context) {
  RETURN_IF_ERROR(ValidateStagingOptions(options));
  auto state = std::make_shared<State>();
  state->chunk_bytes = options.chunk_bytes;
  state->allocated_bytes = (options.chunk_bytes + kPageBytes - 1) / kPageBytes * kPageBytes;
  state->cuda = cuda;
  state->context = context;
  state->max_written_off = static_cast<uint32_t>(std::max<uint64_t>(
      options.buffers,
      std::min<uint64_t>(options.max_written_off_bytes / state->allocated_bytes, UINT32_MAX)));
  state->buffers = options.buffers;
  absl::MutexLock lock(&state->mu);
  for (uint32_t i = 0; i < options.buffers; ++i) {
    ASSIGN_OR_RETURN(StagingBuffer buffer,
                     state->Allocate(fmt::format("staging buffer {} of {}", i, options.buffers)));
    state->slots.push_back(std::move(buffer));
  }
  for (uint32_t i = options.buffers; i > 0; --i) state->free.push_back(i - 1);
  return std::unique_ptr<StagingPool>(new StagingPool(std::move(state)));
}

StagingPool::~StagingPool() = default;

StagingPool::Lease StagingPool::TryAcquire() {
  Lease lease;
  absl::MutexLock lock(&state_->mu);
  if (state_->free.empty()) return lease;
  lease.state_ = state_;
  lease.index_ = state_->free.back();
  state_->free.pop_back();
  lease.data_ = state_->slots[lease.index_].data;
  lease.size_ = state_->chunk_bytes;
  return lease;
}

void StagingPool::Acquire(Waiter waiter) {
  Lease lease;
  {
    absl::MutexLock lock(&state_->mu);
    if (state_->free.empty()) {
      state_->waiters.push_back(std::move(waiter));
      return;
    }
    lease.state_ = state_;
    lease.index_ = state_->free.back();
    state_->free.pop_back();
    lease.data_ = state_->slots[lease.index_].data;
    lease.size_ = state_->chunk_bytes;
  }
  waiter(std::move(lease));
}

bool StagingPool::WriteOff(const Lease& lease) {
  if (lease.data_ == nullptr || lease.state_ != state_) return false;
  State& state = *state_;
  Waiter waiter;
  Lease next;
  {
    absl::MutexLock lock(&state.mu);
    StagingBuffer& slot = state.slots[lease.index_];
    if (slot.data != lease.data_) return false;  // written off already
    if (state.written_off.size() >= state.max_written_off) {
      ++state.write_offs_refused;
      return false;
    }
    auto fresh = state.Allocate(fmt::format("staging buffer {} (replacing one written off)",
                                            lease.index_));
    if (!fresh.ok()) {
      ++state.write_offs_refused;
      kLog.Warn("{}", fresh.status().message());
      return false;
    }
    state.written_off.push_back(std::move(slot));
    slot = *std::move(fresh);
    ++state.written_off_total;
    // The slot is free again, with its new buffer: to the oldest waiter, or the pool.
    state.FreeSlotLocked(lease.index_, state_, &waiter, &next);
  }
  if (waiter) waiter(std::move(next));
  return true;
}

StagingPoolWriteOffs StagingPool::write_offs() const {
  absl::MutexLock lock(&state_->mu);
  return {state_->written_off_total, state_->written_off.size(), state_->write_offs_refused,
          state_->max_written_off};
}

uint64_t StagingPool::chunk_bytes() const { return state_->chunk_bytes; }
uint32_t StagingPool::buffers() const { return state_->buffers; }
uint32_t StagingPool::free_buffers() const {
  absl::MutexLock lock(&state_->mu);
  return static_cast<uint32_t>(state_->free.size());
}
size_t StagingPool::waiters() const {
  absl::MutexLock lock(&state_->mu);
  return state_->waiters.size();
}
bool StagingPool::pinned() const { return state_->cuda != nullptr; }

// ---------------------------------------------------------------------------
// Copiers

namespace {

class CudaCopier : public DeviceCopier {
 public:
  absl::Status Copy(uint64_t dst, uint64_t src, uint64_t bytes) override {
    if (stream_ == nullptr) {
      ASSIGN_OR_RETURN(cuda_, cuda::CudaDriver::Load());
      ASSIGN_OR_RETURN(stream_, cuda_->CreateStream(0));
    }
    pending_ = true;
    return cuda_->CopyAsync(dst, src, bytes, stream_);
  }
  absl::Status Sync() override {
    if (!pending_) return absl::OkStatus();
    pending_ = false;
    return cuda_->SynchronizeStream(stream_);
  }
  ~CudaCopier() override {
    if (stream_ != nullptr) (void)cuda_->DestroyStream(stream_);
  }

 private:
  cuda::CudaDriver* cuda_ = nullptr;
  CUstream_st* stream_ = nullptr;
  bool pending_ = false;
};

class HostCopier : public DeviceCopier {
 public:
  absl::Status Copy(uint64_t dst, uint64_t src, uint64_t bytes) override {
    std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
    return absl::OkStatus();
  }
  absl::Status Sync() override { return absl::OkStatus(); }
};

}  // namespace

std::unique_ptr<DeviceCopier> MakeCudaCopier() { return std::make_unique<CudaCopier>(); }
std::unique_ptr<DeviceCopier> MakeHostCopier() { return std::make_unique<HostCopier>(); }

// ---------------------------------------------------------------------------
// Stager: routing

absl::StatusOr<std::vector<StagedRoute>> Stager::Route(const std::string& transfer_id,
                                                       v1::TransferOp op,
                                                       const planning::TransferPlan& plan,
                                                       const PeerSnapshot& peer) {
  // Local regions by base, to find each op's region.
  std::vector<const registry::Region*> locals;
  for (const auto& r : plan.local_regions) locals.push_back(r.get());
  std::sort(locals.begin(), locals.end(),
            [](const auto* a, const auto* b) { return a->base_address < b->base_address; });
  auto local_staged = [&](uint64_t address) {
    auto it = std::upper_bound(locals.begin(), locals.end(), address,
                               [](uint64_t a, const auto* r) { return a < r->base_address; });
    if (it == locals.begin()) return false;
    const registry::Region* r = *(it - 1);
    return address < r->base_address + r->spec.length() && r->memory_path == "staged";
  };
  (void)transfer_id;
  std::vector<StagedRoute> routes(plan.ops.size(), StagedRoute::kNone);
  bool any = false;
  const auto& remote_regions = peer.catalog->regions();
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const planning::PlanOp& o = plan.ops[i];
    if (peer.direct != nullptr && peer.direct->base_by_slot[o.rkey_slot] != nullptr) continue;
    const registry::RemoteRegion& remote = remote_regions[o.rkey_slot];
    if (remote.staged) {
      // UCX cannot reach the peer's memory: it copies out (READ) or in (WRITE) itself.
      routes[i] = op == v1::READ ? StagedRoute::kRemoteRead : StagedRoute::kChunks;
      any = true;
    } else if (local_staged(o.local_address)) {
      routes[i] = StagedRoute::kBounce;
      any = true;
    }
  }
  if (!any) routes.clear();
  return routes;
}

// ---------------------------------------------------------------------------
// Stager: lifecycle

Stager::Stager(transport::UcxWorker* worker, const transport::UcxContext* context,
               registry::RegionRegistry* registry, StagerOptions options, Deliver deliver)
    : worker_(worker),
      context_(context),
      registry_(registry),
      options_(std::move(options)),
      deliver_(std::move(deliver)) {}

uint64_t Stager::NewRequestId() {
  // Random, not counted: ids in a row would let a peer we read from guess the ids of
  // our requests to another peer (the gap between two of its own) and answer them with
  // bytes of its choosing; the replies name the sending agent, which is not secret.
  for (;;) {
    const uint64_t id = uint64_t{request_ids_()} << 32 | request_ids_();
    if (id != 0 && reads_.find(id) == reads_.end()) return id;
  }
}

Stager::~Stager() { Stop(); }

void Stager::Start() {
  sweep_thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "stage-sweep");
    // Every 500 ms while staged chunks are being received or read replies are out:
  // sweep stale receive state, and write off the receive buffers of replies a reader
  // never took and of chunks a sender never finished sending.
    // Every 10 ms while READs of a peer's staged memory wait for replies: abandon those
    // whose transfer stopped, so a peer that never answers cannot hold a transfer (or a
    // bounce buffer) past its deadline. With neither, it sleeps until one starts.
    uint64_t last_sweep_us = MonotonicMicros();
    while (!stopping_.load()) {
      {
        absl::MutexLock lock(&sweep_mu_);
        // Checked under the lock that Stop signals under: a Stop between the loop's
        // check and this lock would otherwise signal nobody, and Wait() never return.
        if (stopping_.load()) break;
        if (reads_outstanding_.load() > 0) {
          sweep_cv_.WaitWithTimeout(&sweep_mu_, absl::Milliseconds(10));
        } else if (arrivals_held_.load() || lent_watched_.load() > 0) {
          sweep_cv_.WaitWithTimeout(&sweep_mu_, absl::Milliseconds(500));
        } else {
          sweep_cv_.Wait(&sweep_mu_);
          last_sweep_us = MonotonicMicros();  // the first sweep 500 ms after it started
        }
      }
      if (stopping_.load()) break;
      if (reads_outstanding_.load() > 0) worker_->Post([this] { CheckReads(); });
      const uint64_t now = MonotonicMicros();
      if ((arrivals_held_.load() || lent_watched_.load() > 0) &&
          now - last_sweep_us >= 500000) {
        last_sweep_us = now;
        worker_->Post([this] {
          Sweep();
          WriteOffStaleLent();
        });
      }
    }
  });
}

void Stager::NoteArrival() {
  if (arrivals_held_.exchange(true)) return;
  absl::MutexLock lock(&sweep_mu_);
  sweep_cv_.SignalAll();
}

void Stager::Stop() {
  if (stopping_.exchange(true)) return;
  {
    absl::MutexLock lock(&sweep_mu_);
    sweep_cv_.SignalAll();
  }
  if (sweep_thread_.joinable()) sweep_thread_.join();
}

absl::Status Stager::EnsurePool() {
  if (pool_ != nullptr) return absl::OkStatus();
  // Pinned when a GPU is there (fast DMA for the device copies), plain otherwise.
  cuda::CudaDriver* cuda = nullptr;
  if (auto driver = cuda::CudaDriver::Load(); driver.ok() && (*driver)->device_count() > 0) {
    cuda = *driver;
  }
  // Sending and receiving get a pool each: a receive never waits for a buffer held by
  // one of our sends, which may itself wait on the peer's receive (two agents pushing
  // to each other would otherwise deadlock).
  std::unique_ptr<StagingPool> pools[2];
  for (auto& pool : pools) {
    auto created = StagingPool::Create(options_.pool, cuda, context_);
    if (!created.ok()) {
      return absl::Status(created.status().code(),
                          fmt::format("agent '{}': creating the host staging pool ({} x {} "
                                      "bytes) failed: {}",
                                      options_.self_name, options_.pool.buffers,
                                      options_.pool.chunk_bytes, created.status().message()));
    }
    pool = *std::move(created);
  }
  pool_ = std::move(pools[0]);
  recv_pool_ = std::move(pools[1]);
  kLog.Info("staging pools: 2 x {} buffers of {} bytes ({})", pool_->buffers(),
            pool_->chunk_bytes(), pool_->pinned() ? "pinned by CUDA" : "host memory, no CUDA device");
  return absl::OkStatus();
}

DeviceCopier& Stager::CopierFor(bool device) {
  auto& copier = device ? cuda_copier_ : host_copier_;
  if (copier == nullptr) copier = device ? MakeCudaCopier() : MakeHostCopier();
  return *copier;
}

// ---------------------------------------------------------------------------
// Stager: sending side

struct Stager::Job {
  std::string transfer_id;
  v1::TransferOp op = v1::WRITE;
  StagedRoute route = StagedRoute::kNone;
  std::vector<planning::PlanOp> ops;
  std::vector<planning::StagingChunk> chunks;
  std::shared_ptr<const PeerSnapshot> peer;
  std::function<bool()> stopped;
  Done done;
  size_t next = 0;
  uint32_t in_flight = 0;
  bool waiting = false;  // a pool waiter is registered
  std::shared_ptr<StagingPool::Lease> spare;  // handed over by the pool waiter
  // The buffers its chunks took, for WriteOffTransfer (expired: given back).
  std::vector<std::weak_ptr<StagingPool::Lease>> leases;
  absl::Status status;
  int32_t failed_segment = -1;
  bool finished = false;
};

void Stager::Run(const std::string& transfer_id, v1::TransferOp op, StagedRoute route,
                 std::vector<planning::PlanOp> ops, std::shared_ptr<const PeerSnapshot> peer,
                 std::function<bool()> stopped, Done done) {
  auto job = std::make_shared<Job>();
  job->transfer_id = transfer_id;
  job->op = op;
  job->route = route;
  job->ops = std::move(ops);
  job->peer = std::move(peer);
  job->stopped = std::move(stopped);
  job->done = std::move(done);
  const int32_t first_segment = job->ops.empty() ? -1 : static_cast<int32_t>(job->ops[0].segment);
  if (absl::Status s = EnsurePool(); !s.ok()) {
    job->done(s, first_segment);
    return;
  }
  planning::StagingPlanOptions plan_options;
  // Over an eager-only endpoint (no native RMA, or no peer error handling: the
  // same-host default) the chunks travel as eager messages, which the peer's UCX
  // assembles whole: smaller ones bound what it holds for us.
  plan_options.chunk_bytes =
      job->peer->endpoint->EagerOnly() ? options_.pool.AmMessageBytes() : pool_->chunk_bytes();
  plan_options.buffers = pool_->buffers();
  plan_options.max_pieces = options_.max_pieces;
  // A chunk's header (or a read request, which names the same pieces) must fit one
  // active-message header: UCX 1.13 aborts the sender of a rendezvous whose header does
  // not fit its transport's buffer ("RTS is too big"). The pieces get what the rest of
  // the larger of the two leaves.
  if (const size_t max_header = worker_->max_am_header(); max_header > 0) {
    // Kept (worker thread): only the transfer and the secret change from job to job,
    // and their strings keep their storage.
    wire::StagedReadRequest& widest = header_probe_;
    if (widest.from_agent().empty()) {
      widest.set_from_agent(options_.self_name);
      widest.set_incarnation(UINT64_MAX);
      widest.set_request_id(UINT64_MAX);
      widest.set_eager_replies(true);
    }
    widest.set_transfer_id(job->transfer_id);
    widest.set_secret(job->peer->notify_secret);
    const size_t fixed = std::max(widest.ByteSizeLong(), size_t{64});
    plan_options.max_piece_bytes = max_header > fixed ? max_header - fixed : 1;
  }
  auto chunks = planning::PlanStaging(job->ops, plan_options);
  if (!chunks.ok()) {
    job->done(chunks.status(), first_segment);
    return;
  }
  job->chunks = *std::move(chunks);
  auto& jobs = jobs_[job->transfer_id];
  jobs.erase(std::remove_if(jobs.begin(), jobs.end(),
                            [](const std::weak_ptr<Job>& j) { return j.expired(); }),
             jobs.end());
  jobs.push_back(job);
  Advance(job);
}

uint32_t Stager::WriteOffTransfer(const std::string& transfer_id) {
  auto found = jobs_.find(transfer_id);
  if (found == jobs_.end()) return 0;
  uint32_t written_off = 0, refused = 0;
  for (const auto& weak : found->second) {
    std::shared_ptr<Job> job = weak.lock();
    if (job == nullptr || pool_ == nullptr) continue;
    for (const auto& held : job->leases) {
      std::shared_ptr<StagingPool::Lease> lease = held.lock();
      if (lease == nullptr || !*lease) continue;
      if (pool_->WriteOff(*lease)) {
        ++written_off;
      } else {
        ++refused;
      }
    }
    job->leases.clear();
  }
  jobs_.erase(found);
  buffers_written_off_.fetch_add(written_off);
  write_offs_refused_.fetch_add(refused);
  if (written_off + refused > 0) {
    const StagingPoolWriteOffs pool = pool_->write_offs();
    kLog.Warn("transfer '{}': {} staging buffers held by sends its peer never confirmed were "
              "written off and replaced{}; {} written off buffers are still held (at most {}), "
              "freed if their sends ever complete",
              Printable(transfer_id, 256), written_off,
              refused == 0 ? std::string()
                           : fmt::format(", {} not: the pool holds as many written off as it "
                                         "may, so staging may wait for them; restart this "
                                         "agent to get them back",
                                         refused),
              pool.held, pool.bound);
  }
  return written_off;
}

void Stager::Advance(const std::shared_ptr<Job>& job) {
  while (job->status.ok() && job->next < job->chunks.size() && !job->stopped()) {
    std::shared_ptr<StagingPool::Lease> lease = std::move(job->spare);
    if (lease == nullptr) {
      StagingPool::Lease free = pool_->TryAcquire();
      if (free) lease = std::make_shared<StagingPool::Lease>(std::move(free));
    }
    if (lease == nullptr) {
      // Every buffer is in flight (ours or other transfers'): wait for one.
      if (!job->waiting) {
        job->waiting = true;
        pool_->Acquire([this, job](StagingPool::Lease l) {
          auto handed = std::make_shared<StagingPool::Lease>(std::move(l));
          worker_->Post([this, job, handed] {
            job->waiting = false;
            job->spare = handed;
            Advance(job);
          });
        });
      }
      return;
    }
    // At most the pool's buffers are leased at once: the given-back ones go now and then.
    if (job->leases.size() >= 2 * size_t{pool_->buffers()} + 8) {
      job->leases.erase(std::remove_if(job->leases.begin(), job->leases.end(),
                                       [](const auto& held) { return held.expired(); }),
                        job->leases.end());
    }
    job->leases.push_back(lease);
    StartChunk(job, job->next++, std::move(lease));
  }
  if (job->in_flight == 0 && !job->waiting && !job->finished) {
    job->finished = true;
    job->spare.reset();
    job->leases.clear();
    if (auto found = jobs_.find(job->transfer_id); found != jobs_.end()) {
      auto& jobs = found->second;
      jobs.erase(std::remove_if(jobs.begin(), jobs.end(),
                                [&](const std::weak_ptr<Job>& j) {
                                  auto held = j.lock();
                                  return held == nullptr || held == job;
                                }),
                 jobs.end());
      if (jobs.empty()) jobs_.erase(found);
    }
    job->done(job->status, job->status.ok() ? -1 : job->failed_segment);
  }
}

void Stager::ChunkDone(const std::shared_ptr<Job>& job, absl::Status status, int32_t segment) {
  --job->in_flight;
  if (!status.ok() && job->status.ok()) {
    job->status = std::move(status);
    job->failed_segment = segment;
  }
  // Completions may run inline; posting keeps the stack flat over many chunks.
  worker_->Post([this, job] { Advance(job); });
}

void Stager::StartChunk(const std::shared_ptr<Job>& job, size_t index,
                        std::shared_ptr<StagingPool::Lease> lease) {
  if (job->route == StagedRoute::kRemoteRead) {
    StartRemoteRead(job, index, std::move(lease));
    return;
  }
  const planning::StagingChunk& chunk = job->chunks[index];
  const int32_t segment = static_cast<int32_t>(chunk.pieces.front().segment);
  uint8_t* buffer = lease->data();
  const PeerSnapshot& peer = *job->peer;
  transport::Endpoint& endpoint = *peer.endpoint;
  ++job->in_flight;
  auto fail = [&](absl::Status s) { ChunkDone(job, std::move(s), segment); };

  if (job->op == v1::WRITE) {
    // Our side into the bounce buffer (device to host, or memcpy for host memory).
    bool used_device = false, used_host = false;
    for (const auto& p : chunk.pieces) {
      const bool device = job->ops[p.op_index].local_device;
      (device ? used_device : used_host) = true;
      absl::Status s = CopierFor(device).Copy(reinterpret_cast<uint64_t>(buffer + p.buffer_offset),
                                              p.local_address, p.length);
      if (!s.ok()) return fail(s);
    }
    if (used_device) {
      if (absl::Status s = CopierFor(true).Sync(); !s.ok()) return fail(s);
    }
    (void)used_host;
    if (job->route == StagedRoute::kChunks) {
      wire::StagedChunkHeader header;
      header.set_from_agent(options_.self_name);
      header.set_secret(job->peer->notify_secret);
      header.set_transfer_id(job->transfer_id);
      header.set_incarnation(options_.incarnation);
      for (const auto& p : chunk.pieces) {
        wire::StagedPiece* piece = header.add_pieces();
        piece->set_remote_address(p.remote_address);
        piece->set_length(p.length);
      }
      // The buffer stays leased until the send completes: only then may it be reused.
      endpoint.SendAmNoCopy(Wire(AmId::kStagedChunk), header.SerializeAsString(), buffer, chunk.bytes,
                            [this, job, lease, segment](absl::Status s) {
                              ChunkDone(job, std::move(s), segment);
                            });
      return;
    }
    // The peer's memory is RMA-reachable: put from the bounce buffer, flush, release.
    for (const auto& p : chunk.pieces) {
      const auto& key = peer.keys->at(job->ops[p.op_index].rkey_slot);
      absl::Status s = endpoint.Put(buffer + p.buffer_offset, p.length, p.remote_address, key);
      if (!s.ok()) {
        // Puts already posted may still read the buffer: release it after a flush.
        endpoint.Flush([this, job, lease, s, segment](absl::Status) { ChunkDone(job, s, segment); });
        return;
      }
    }
    endpoint.Flush([this, job, lease, segment](absl::Status s) { ChunkDone(job, std::move(s), segment); });
    return;
  }

  // READ into our staged memory: get into the bounce buffer, then copy it into place.
  for (const auto& p : chunk.pieces) {
    const auto& key = peer.keys->at(job->ops[p.op_index].rkey_slot);
    absl::Status s = endpoint.Get(buffer + p.buffer_offset, p.length, p.remote_address, key);
    if (!s.ok()) {
      endpoint.Flush([this, job, lease, s, segment](absl::Status) { ChunkDone(job, s, segment); });
      return;
    }
  }
  endpoint.Flush([this, job, lease, index, segment](absl::Status s) {
    if (s.ok()) {
      const planning::StagingChunk& c = job->chunks[index];
      bool used_device = false;
      for (const auto& p : c.pieces) {
        const bool device = job->ops[p.op_index].local_device;
        used_device |= device;
        s = CopierFor(device).Copy(p.local_address,
                                   reinterpret_cast<uint64_t>(lease->data() + p.buffer_offset),
                                   p.length);
        if (!s.ok()) break;
      }
      if (s.ok() && used_device) s = CopierFor(true).Sync();
    }
    ChunkDone(job, std::move(s), segment);
  });
}

// ---------------------------------------------------------------------------
// Stager: receiving side

const std::vector<Stager::StagedRegion>& Stager::Regions() {
  const uint64_t version = registry_->version();
  if (version == regions_version_) return regions_;
  regions_version_ = version;
  regions_.clear();
  for (registry::RegionPtr& r : registry_->List()) {
    regions_.push_back(StagedRegion{r->base_address, r->spec.length(), std::move(r)});
  }
  std::sort(regions_.begin(), regions_.end(),
            [](const StagedRegion& a, const StagedRegion& b) { return a.base < b.base; });
  ranges_.clear();
  ranges_.reserve(regions_.size());
  for (const StagedRegion& r : regions_) {
    ranges_.push_back(planning::StagedRange{r.base, r.length, r.region->spec.name()});
  }
  return regions_;
}

void Stager::DropStaleRegions() {
  if (registry_->version() == regions_version_) return;
  regions_.clear();
  ranges_.clear();
  regions_version_ = UINT64_MAX;
}

const Stager::StagedRegion* Stager::LocalRegionOf(uint64_t address, uint64_t length) {
  const auto& regions = Regions();
  auto it = std::upper_bound(regions.begin(), regions.end(), address,
                             [](uint64_t x, const StagedRegion& r) { return x < r.base; });
  if (it == regions.begin()) return nullptr;
  const StagedRegion& r = *(it - 1);
  if (address - r.base >= r.length || length > r.length - (address - r.base)) return nullptr;
  return &r;
}

void Stager::CountUnparsed(AmId id) {
  if (id == AmId::kStagedChunk) chunks_rejected_.fetch_add(1);
  if (id == AmId::kStagedReadRequest) reads_refused_.fetch_add(1);
}

bool Stager::OnChunk(const wire::StagedChunkHeader& header, const transport::AmMessage& message) {
  if (!options_.verify_peer || !options_.verify_peer(header.from_agent(), header.secret())) {
    chunks_rejected_.fetch_add(1);
    if (options_.on_dropped) options_.on_dropped();
    LogRefusal(fmt::format("'{}' (UCX active message)", Printable(header.from_agent())),
               "a staged chunk",
               absl::PermissionDeniedError("it does not carry the secret this agent issued to "
                                           "the agent it names"));
    return false;
  }
  const std::string key = ArrivalKey(header.from_agent(), header.incarnation(), header.transfer_id());
  // Bounded: a peer that opens ever more transfers' chunks (rejected ones included)
  // cannot grow this table; a chunk past the bound is dropped (its transfer's
  // DATA_READY then fails for the missing bytes).
  // One sender has a share of it, so that one peer opening transfers without end
  // cannot keep every other peer's new transfers out.
  if (!arrivals_.contains(key)) {
    const uint32_t theirs = arrivals_by_sender_.of(header.from_agent());
    if (arrivals_.size() >= options_.max_arrivals || theirs >= options_.max_arrivals_per_peer) {
      chunks_rejected_.fetch_add(1);
      if (arrivals_full_logged_.exchange(true) == false) {
        kLog.Warn("dropping staged chunks of new transfers from '{}': {} transfers' chunks are "
                  "being received already, {} of them from it (bounds {} in all, {} per "
                  "sender); counted in chunks_rejected",
                  Printable(header.from_agent()), arrivals_.size(), theirs,
                  options_.max_arrivals, options_.max_arrivals_per_peer);
      }
      return false;
    }
  }
  arrivals_full_logged_ = false;
  Arrival& arrival = ArrivalFor(key, header.from_agent());
  arrival.touched_us = MonotonicMicros();
  NoteArrival();

  // Untrusted: every piece must lie inside one region of ours, and the pieces
  // must add up to the data that came.
  auto reject = [&](std::string why) {
    chunks_rejected_.fetch_add(1);
    // One line per transfer, not per chunk: a peer sending thousands of bad chunks
    // does not fill the log (chunks_rejected counts them all).
    if (arrival.failure.empty()) {
      kLog.Warn("dropped a staged chunk of transfer '{}' from agent '{}': {} (later chunks "
                "of it that fail are only counted)",
                Printable(header.transfer_id(), 256), Printable(header.from_agent()), why);
      arrival.failure = std::move(why);
    }
    MaybeDeliver(key);
    return false;
  };
  if (static_cast<uint32_t>(header.pieces_size()) > 65536) {
    return reject(fmt::format("{} pieces, over the limit of 65536", header.pieces_size()));
  }
  if (message.length > std::max(options_.max_chunk_message, options_.pool.chunk_bytes)) {
    return reject(fmt::format("{} bytes in one chunk, over the limit of {}; lower the sender's "
                              "--staging-chunk-bytes",
                              message.length, options_.max_chunk_message));
  }
  const auto& regions = Regions();
  std::vector<const StagedRegion*> targets;
  targets.reserve(header.pieces_size());
  uint64_t total = 0;
  for (const auto& p : header.pieces()) {
    const uint64_t a = p.remote_address(), n = p.length();
    auto it = std::upper_bound(regions.begin(), regions.end(), a,
                               [](uint64_t x, const StagedRegion& r) { return x < r.base; });
    const StagedRegion* r = it == regions.begin() ? nullptr : &*(it - 1);
    if (n == 0 || r == nullptr || a - r->base >= r->length || n > r->length - (a - r->base)) {
      return reject(fmt::format(
          "piece [{:#x}, +{}) is not inside one region of agent '{}' (regions "
          "deregistered meanwhile, or a bad peer); the transfer's notification will be dropped",
          a, n, options_.self_name));
    }
    targets.push_back(r);
    total += n;
  }
  if (total != message.length) {
    return reject(fmt::format("its pieces add up to {} bytes but {} bytes came", total,
                              message.length));
  }
  // A chunk sent by rendezvous waits for a receive buffer with its header kept:
  // bounded per sender and in all; one bigger than our buffers lands in heap memory,
  // bounded in all.
  const uint64_t length = message.length;
  const bool pooled = message.rendezvous && EnsurePool().ok();
  const bool heap = message.rendezvous && (!pooled || length > recv_pool_->chunk_bytes());
  if (message.rendezvous) {
    const uint64_t max_pieces = 8ull * options_.max_pieces;
    if (static_cast<uint64_t>(header.pieces_size()) > max_pieces) {
      return reject(fmt::format("{} pieces in one chunk sent by rendezvous, over the {} a "
                                "waiting chunk may hold; the sender runs an incompatible "
                                "version or is faulty",
                                header.pieces_size(), max_pieces));
    }
    if (options_.eager_only_from && options_.eager_only_from(header.from_agent())) {
      return reject(fmt::format(
          "it came by rendezvous, but this agent's endpoint to '{}' has no native RMA (tcp), "
          "where its chunks come eager; the sender runs an incompatible version, or another "
          "--ucx-error-mode than this agent (give both the same), or is faulty",
          Printable(header.from_agent())));
    }
    const uint32_t theirs = receiving_by_peer_.of(header.from_agent());
    if (theirs >= options_.max_receiving_per_peer || receiving_ >= options_.max_receiving) {
      return reject(fmt::format(
          "agent '{}' is receiving {} staged chunks already ({} of them from '{}'; limits {} "
          "in all, {} per sender): the sender sends faster than this agent copies in, or is "
          "faulty",
          options_.self_name, receiving_, theirs, Printable(header.from_agent()),
          options_.max_receiving, options_.max_receiving_per_peer));
    }
    if (heap && heap_receiving_ + length > options_.max_chunk_message) {
      return reject(fmt::format(
          "{} bytes in one chunk, over this agent's bounce buffers of {}, and {} bytes of "
          "such chunks are being received already (at most {}); give both agents the same "
          "--staging-chunk-bytes",
          length, pooled ? recv_pool_->chunk_bytes() : 0, heap_receiving_,
          options_.max_chunk_message));
    }
  }
  chunks_received_.fetch_add(1);
  if (!message.rendezvous) {
    absl::Status s = CopyIn(header, reinterpret_cast<const uint8_t*>(message.data.data()), targets);
    Credit(key, s.ok() ? total : 0, s.ok() ? "" : std::string(s.message()));
    return false;
  }

  // Rendezvous: fetch into a bounce buffer (the data waits on the sender until one is
  // free), then copy into place. The regions stay referenced until the copy is done.
  rendezvous_received_.fetch_add(1);
  ++receiving_;
  const std::string from = header.from_agent();
  receiving_by_peer_.Add(from);
  if (heap) heap_receiving_ += length;
  auto received = [this, from, heap, length] {
    --receiving_;
    if (heap) heap_receiving_ -= length;
    receiving_by_peer_.Remove(from);
  };
  ++arrival.in_flight;
  auto header_ptr = std::make_shared<wire::StagedChunkHeader>(std::move(header));
  std::vector<registry::RegionPtr> held;
  for (const auto* t : targets) held.push_back(t->region);
  auto copies = std::make_shared<std::vector<StagedRegion>>();
  for (const auto* t : targets) copies->push_back(*t);
  void* descriptor = message.descriptor;
  const uint64_t failures_at_arrival = RendezvousFailuresOf(from);
  auto receive = [this, key, header_ptr, copies, descriptor, length, total, received, from,
                  failures_at_arrival](std::shared_ptr<StagingPool::Lease> lease) {
    if (RendezvousFailuresOf(from) != failures_at_arrival) {
      // A rendezvous receive from this sender failed after this chunk arrived (it died
      // or hung up mid-transfer). UCX 1.13 lets go of the sender's endpoint then, and
      // receiving a descriptor that arrived over it asserts and aborts this process
      // (ucp_rndv_receive: "(*ep_p)->worker == worker"); releasing it looks the same
      // endpoint up. So it is neither received nor released: dropped here, left to
      // UCX (a few hundred bytes, bounded by max_receiving_per_peer per failure).
      lease.reset();
      received();
      auto it = arrivals_.find(key);
      if (it != arrivals_.end() && it->second.in_flight > 0) --it->second.in_flight;
      chunks_rejected_.fetch_add(1);
      Credit(key, 0,
             fmt::format("the sender's rendezvous data stopped arriving (an earlier chunk "
                         "of '{}' failed), so this chunk was dropped unread",
                         Printable(from)));
      return;
    }
    // A chunk bigger than our buffers (the sender's --staging-chunk-bytes is larger)
    // is received into heap memory, bounded by max_chunk_message above.
    std::shared_ptr<std::string> heap;
    uint8_t* target = nullptr;
    if (lease != nullptr && length <= lease->size()) {
      target = lease->data();
    } else {
      lease.reset();
      heap = std::make_shared<std::string>(length, '\0');
      target = reinterpret_cast<uint8_t*>(heap->data());
    }
    // A sender that dies mid-chunk may leave the receive unfinished for good: watched
    // (WriteOffStaleLent), so that other senders' chunks do not wait on its buffer.
    if (lease != nullptr) Lend(lease, from, header_ptr->transfer_id(), /*reply=*/false);
    worker_->ReceiveAmData(descriptor, target, length,
                           [this, key, header_ptr, copies, lease, heap, target, total,
                            received, from](absl::Status s) {
                             received();
                             if (!s.ok()) ++rendezvous_failures_[from];
                             if (s.ok()) {
                               std::vector<const StagedRegion*> targets;
                               for (const auto& r : *copies) targets.push_back(&r);
                               s = CopyIn(*header_ptr, target, targets);
                             }
                             auto it = arrivals_.find(key);
                             if (it != arrivals_.end() && it->second.in_flight > 0) --it->second.in_flight;
                             Credit(key, s.ok() ? total : 0, s.ok() ? "" : std::string(s.message()));
                           });
  };
  if (heap) {
    receive(nullptr);
    return true;
  }
  recv_pool_->Acquire([this, receive](StagingPool::Lease l) {
    auto lease = std::make_shared<StagingPool::Lease>(std::move(l));
    worker_->Post([receive, lease] { receive(lease); });
  });
  return true;
}

absl::Status Stager::CopyIn(const wire::StagedChunkHeader& header, const uint8_t* data,
                            const std::vector<const StagedRegion*>& targets) {
  uint64_t offset = 0;
  bool used_device = false;
  for (int i = 0; i < header.pieces_size(); ++i) {
    const auto& p = header.pieces(i);
    const bool device = targets[i]->region->spec.memory() == v1::VRAM;
    used_device |= device;
    absl::Status s = CopierFor(device).Copy(p.remote_address(),
                                            reinterpret_cast<uint64_t>(data + offset), p.length());
    if (!s.ok()) {
      return absl::Status(s.code(), fmt::format("copying a staged chunk into region '{}' failed: {}",
                                                targets[i]->region->spec.name(), s.message()));
    }
    offset += p.length();
  }
  if (used_device) {
    if (absl::Status s = CopierFor(true).Sync(); !s.ok()) {
      return absl::Status(s.code(),
                          fmt::format("copying a staged chunk to the device failed: {}", s.message()));
    }
  }
  // Host memory that vanished under the copy (FaultGuard caught the SIGBUS): the
  // bytes landed in throwaway pages, so the chunk is rejected and DATA_READY fails.
  for (const StagedRegion* target : targets) {
    if (target->region->mapping.broken()) {
      return absl::DataLossError(
          fmt::format("region '{}' is broken: {}; the staged bytes are not valid. Fix: {}",
                      target->region->spec.name(), registry::kLostMemoryCause,
                      registry::kLostMemoryFix));
    }
  }
  return absl::OkStatus();
}

void Stager::Credit(const std::string& key, uint64_t bytes, const std::string& failure) {
  auto it = arrivals_.find(key);
  if (it == arrivals_.end()) return;  // swept or cancelled meanwhile
  it->second.bytes += bytes;
  it->second.touched_us = MonotonicMicros();
  if (!failure.empty() && it->second.failure.empty()) {
    kLog.Warn("staged chunk of {} failed: {}", key, failure);
    it->second.failure = failure;
  }
  MaybeDeliver(key);
}

void Stager::MaybeDeliver(const std::string& key) {
  auto it = arrivals_.find(key);
  if (it == arrivals_.end() || !it->second.held.has_value()) return;
  Arrival& a = it->second;
  if (!a.failure.empty()) {
    v1::Notification n = *std::move(a.held);
    const std::string failure = a.failure;
    EraseArrival(it);
    deliver_(std::move(n), absl::DataLossError(fmt::format(
                               "a staged chunk of it was rejected by the receiving agent ({}); its "
                               "data is incomplete: submit it again",
                               failure)));
    return;
  }
  if (a.bytes < a.held->staged_bytes()) return;
  v1::Notification out = *std::move(a.held);
  EraseArrival(it);
  deliver_(std::move(out), absl::OkStatus());
}

void Stager::Forget(const v1::Notification& n) {
  auto it = arrivals_.find(ArrivalKey(n.from_agent(), n.sender_incarnation(), n.transfer_id()));
  if (it != arrivals_.end()) EraseArrival(it);
}

Stager::Arrival& Stager::ArrivalFor(const std::string& key, const std::string& from) {
  auto [it, added] = arrivals_.try_emplace(key);
  if (added) {
    it->second.from = from;
    arrivals_by_sender_.Add(from);
  }
  return it->second;
}

void Stager::EraseArrival(absl::flat_hash_map<std::string, Arrival>::iterator it) {
  if (it->second.held.has_value()) {
    --held_;
    held_by_sender_.Remove(it->second.from);
  }
  arrivals_by_sender_.Remove(it->second.from);
  arrivals_.erase(it);
}

void Stager::Hold(v1::Notification n) {
  const std::string key = ArrivalKey(n.from_agent(), n.sender_incarnation(), n.transfer_id());
  auto it = arrivals_.find(key);
  const bool again = it != arrivals_.end() && it->second.held.has_value();
  // Bounded in all, and one sender has a share: a peer announcing staged transfers whose
  // data it never sends (each held until the sweep) cannot refuse every other peer's.
  const uint32_t theirs = held_by_sender_.of(n.from_agent());
  if (!again && (held_ >= options_.max_held || theirs >= options_.max_held_per_peer)) {
    const std::string why = fmt::format(
        "{} notifications already wait for their staged data here, {} of them from '{}' "
        "(bounds {} in all, {} per sender); the receiving agent is falling behind: submit "
        "it again later",
        held_, theirs, Printable(n.from_agent()), options_.max_held, options_.max_held_per_peer);
    if (it != arrivals_.end()) EraseArrival(it);
    deliver_(std::move(n), absl::ResourceExhaustedError(why));
    return;
  }
  Arrival& a = ArrivalFor(key, n.from_agent());
  a.touched_us = MonotonicMicros();
  if (!again) {
    ++held_;
    held_by_sender_.Add(n.from_agent());
  }
  a.held = std::move(n);  // a repeated DATA_READY replaces the one held
  NoteArrival();
  MaybeDeliver(key);
}

void Stager::Sweep() {
  const uint64_t now = MonotonicMicros();
  const uint64_t limit = uint64_t{options_.hold_timeout_ms} * 1000;
  for (auto it = arrivals_.begin(); it != arrivals_.end();) {
    const Arrival& a = it->second;
    if (a.in_flight == 0 && now - a.touched_us > limit) {
      if (a.held.has_value()) {
        v1::Notification n = *a.held;
        const std::string why = fmt::format(
            "only {} of {} staged bytes arrived within {} ms; the sender stopped sending them",
            a.bytes, n.staged_bytes(), options_.hold_timeout_ms);
        EraseArrival(it++);
        deliver_(std::move(n), absl::DeadlineExceededError(why));
        continue;
      }
      EraseArrival(it++);
    } else {
      ++it;
    }
  }
  // Empty: the sweep thread sleeps until the next arrival (NoteArrival, this thread).
  arrivals_held_.store(!arrivals_.empty());
}

// ---------------------------------------------------------------------------
// Stager: READ of the peer's staged memory, initiator side
//
// Each chunk becomes one request (StagedReadRequest) that holds one of our sending
// buffers: rendezvous replies land in it, eager ones are copied straight from UCX's
// buffer. The destinations are ours, kept here by request id; the peer's replies name
// only the request and an offset, so a peer cannot make us write anywhere else.

void Stager::StartRemoteRead(const std::shared_ptr<Job>& job, size_t index,
                             std::shared_ptr<StagingPool::Lease> lease) {
  const planning::StagingChunk& chunk = job->chunks[index];
  ++job->in_flight;
  const uint64_t id = NewRequestId();
  auto request = std::make_shared<ReadRequest>();
  request->job = job;
  request->chunk = index;
  request->lease = std::move(lease);
  reads_[id] = request;
  if (reads_outstanding_.exchange(static_cast<uint32_t>(reads_.size())) == 0) {
    absl::MutexLock lock(&sweep_mu_);
    sweep_cv_.SignalAll();  // start checking for stopped transfers every 10 ms
  }
  wire::StagedReadRequest header;
  header.set_from_agent(options_.self_name);
  header.set_secret(job->peer->notify_secret);
  header.set_incarnation(options_.incarnation);
  header.set_transfer_id(job->transfer_id);
  header.set_request_id(id);
  if (job->peer->endpoint->EagerOnly()) header.set_eager_replies(true);
  for (const auto& p : chunk.pieces) {
    wire::StagedPiece* piece = header.add_pieces();
    piece->set_remote_address(p.remote_address);
    piece->set_length(p.length);
  }
  job->peer->endpoint->SendAmRequest(Wire(AmId::kStagedReadRequest), header.SerializeAsString(),
                                     [this, id](absl::Status s) {
                                       if (!s.ok()) EndRead(id, std::move(s));
                                     });
}

void Stager::EndRead(uint64_t request_id, absl::Status status) {
  auto it = reads_.find(request_id);
  if (it == reads_.end()) return;
  std::shared_ptr<ReadRequest> request = std::move(it->second);
  reads_.erase(it);
  reads_outstanding_.store(static_cast<uint32_t>(reads_.size()));
  // A rendezvous reply still being fetched keeps `request` (and so its buffer) until
  // it lands; it writes nothing more into place once `ended` is set.
  request->ended = true;
  std::shared_ptr<Job> job = std::move(request->job);
  const int32_t segment = static_cast<int32_t>(job->chunks[request->chunk].pieces.front().segment);
  if (request->receiving == 0) request->lease.reset();
  ChunkDone(job, std::move(status), segment);
}

void Stager::CheckReads() {
  absl::flat_hash_map<const Job*, bool> stopped;
  std::vector<uint64_t> abandon;
  for (const auto& [id, request] : reads_) {
    auto [it, inserted] = stopped.try_emplace(request->job.get(), false);
    if (inserted) it->second = request->job->stopped();
    if (it->second) abandon.push_back(id);
  }
  for (uint64_t id : abandon) {
    kLog.Debug("abandoned staged read request {:x}: its transfer stopped", id);
    EndRead(id, absl::OkStatus());
  }
}

absl::Status Stager::PlaceReply(const ReadRequest& request, uint64_t offset, const uint8_t* data,
                                uint64_t length) {
  const Job& job = *request.job;
  const planning::StagingChunk& chunk = job.chunks[request.chunk];
  std::vector<uint64_t> lengths;
  lengths.reserve(chunk.pieces.size());
  for (const auto& p : chunk.pieces) lengths.push_back(p.length);
  bool used_device = false;
  for (const planning::PieceSlice& slice : planning::SlicePieces(lengths, offset, length)) {
    const planning::StagingPiece& p = chunk.pieces[slice.piece];
    const uint64_t dst = p.local_address + slice.piece_offset;
    // Planned against our registry at submit; checked again, since a region may have
    // been deregistered while the reply was on its way.
    if (LocalRegionOf(dst, slice.length) == nullptr) {
      return absl::AbortedError(fmt::format(
          "transfer '{}': the destination [{:#x}, +{}) is no longer inside a region registered "
          "with agent '{}' (deregistered during the transfer); cancel transfers before "
          "deregistering their regions",
          job.transfer_id, dst, slice.length, options_.self_name));
    }
    const bool device = job.ops[p.op_index].local_device;
    used_device |= device;
    absl::Status s = CopierFor(device).Copy(dst, reinterpret_cast<uint64_t>(data + slice.range_offset),
                                            slice.length);
    if (!s.ok()) {
      return absl::Status(s.code(), fmt::format("transfer '{}': copying staged read data into "
                                                "place failed: {}",
                                                job.transfer_id, s.message()));
    }
  }
  if (used_device) {
    if (absl::Status s = CopierFor(true).Sync(); !s.ok()) {
      return absl::Status(s.code(), fmt::format("transfer '{}': copying staged read data to the "
                                                "device failed: {}",
                                                job.transfer_id, s.message()));
    }
  }
  return absl::OkStatus();
}

bool Stager::OnReadReply(const wire::StagedReadReply& header, const transport::AmMessage& message) {
  auto it = reads_.find(header.request_id());
  if (it == reads_.end()) {
    // Abandoned (its transfer stopped), already failed, or not ours: nothing is written.
    kLog.Debug("dropped a staged read reply for request {:x} from agent '{}': no such request "
               "is waiting",
               header.request_id(), header.from_agent());
    return false;
  }
  const uint64_t id = it->first;
  std::shared_ptr<ReadRequest> request = it->second;
  const Job& job = *request->job;
  const std::string& peer = job.peer->name;
  if (header.from_agent() != peer) {
    kLog.Warn("dropped a staged read reply for request {:x}: it came from agent '{}', the "
              "request went to '{}'",
              id, header.from_agent(), peer);
    return false;
  }
  if (!header.error().empty()) {
    auto code = static_cast<absl::StatusCode>(header.error_code());
    if (code == absl::StatusCode::kOk || header.error_code() < 0 || header.error_code() > 16) {
      code = absl::StatusCode::kFailedPrecondition;
    }
    EndRead(id, absl::Status(code, fmt::format("peer '{}' refused the staged read: {}", peer,
                                               header.error())));
    return false;
  }
  const uint64_t total = job.chunks[request->chunk].bytes;
  const uint64_t offset = header.offset(), length = message.length;
  bool overlaps = false;
  if (length > 0 && offset < total && length <= total - offset) {
    auto next = request->received.lower_bound(offset);
    if (next != request->received.end() && next->first < offset + length) overlaps = true;
    if (next != request->received.begin() && std::prev(next)->first + std::prev(next)->second > offset) {
      overlaps = true;
    }
  }
  if (length == 0 || offset >= total || length > total - offset || overlaps) {
    EndRead(id, absl::DataLossError(fmt::format(
                    "peer '{}' answered a staged read of {} bytes with bytes [{}, +{}), {}; the "
                    "peer runs an incompatible version or is faulty",
                    peer, total, offset, length,
                    overlaps ? "which it had already sent" : "outside the request")));
    return false;
  }
  request->received.emplace(offset, length);
  auto credit = [this, id, request, total, length](absl::Status placed) {
    if (!placed.ok()) {
      EndRead(id, std::move(placed));
      return;
    }
    request->bytes += length;
    if (request->bytes == total) EndRead(id, absl::OkStatus());
  };
  if (!message.rendezvous) {
    credit(PlaceReply(*request, offset, reinterpret_cast<const uint8_t*>(message.data.data()),
                      length));
    return false;
  }
  if (job.peer->endpoint->EagerOnly()) {
    // We asked for eager replies: fetching a rendezvous over tcp would make UCX answer
    // the peer by itself, and abort this process if that fails because the peer died;
    // over shared memory without peer error handling, a failed fetch lets UCX abort
    // this process on the peer's next rendezvous (Endpoint::EagerOnly).
    EndRead(id, absl::DataLossError(fmt::format(
                    "peer '{}' answered a staged read with a rendezvous, though eager replies "
                    "were asked (its endpoint has {}); the bytes were not fetched. The peer "
                    "runs an incompatible version or is faulty",
                    peer,
                    job.peer->endpoint->NativeRma() ? "no peer error handling"
                                                    : "no native RMA (tcp)")));
    return false;  // UCX drops the data unfetched
  }
  // Rendezvous: fetched into the request's buffer at its offset, then copied into place
  // unless the request ended meanwhile (abandoned: the bytes stay in our buffer).
  rendezvous_received_.fetch_add(1);
  ++request->receiving;
  uint8_t* landing = request->lease->data() + offset;
  worker_->ReceiveAmData(message.descriptor, landing, length,
                         [this, request, landing, offset, length, credit](absl::Status s) {
                           --request->receiving;
                           if (request->ended) {
                             if (request->receiving == 0) request->lease.reset();
                             return;
                           }
                           credit(s.ok() ? PlaceReply(*request, offset, landing, length) : s);
                         });
  return true;
}

// ---------------------------------------------------------------------------
// Stager: READ of our memory (staged, or over active messages), serving side
//
// The request is untrusted: every piece must lie inside one of OUR regions
// (CheckReadPieces) before a byte is read. The bytes go back in parts of one receive
// buffer each (device to host into it, then one reply without a copy); the receive
// pool, not the sending one, so two agents reading from each other never wait on
// buffers that their own reads hold.

void Stager::RefuseRead(const transport::ReplyEndpoint& reply_ep, uint64_t request_id,
                        const std::string& why, absl::StatusCode code, bool eager) {
  reads_refused_.fetch_add(1);
  wire::StagedReadReply header;
  header.set_from_agent(options_.self_name);
  header.set_request_id(request_id);
  header.set_error(why);
  header.set_error_code(static_cast<int32_t>(code));
  worker_->SendAmReply(reply_ep, Wire(AmId::kStagedReadReply), header.SerializeAsString(), nullptr, 0,
                       [](absl::Status s) {
                         if (!s.ok()) kLog.Warn("refusing a staged read: {}", s.message());
                       },
                       eager);
}

bool Stager::OnReadRequest(const wire::StagedReadRequest& header, const transport::AmMessage& message) {
  if (!options_.verify_peer || !options_.verify_peer(header.from_agent(), header.secret())) {
    // A stranger gets no answer at all.
    reads_refused_.fetch_add(1);
    if (options_.on_dropped) options_.on_dropped();
    LogRefusal(fmt::format("'{}' (UCX active message)", Printable(header.from_agent())),
               "a staged read request",
               absl::PermissionDeniedError("it does not carry the secret this agent issued to "
                                           "the agent it names"));
    return false;
  }
  if (!message.reply_ep) {
    reads_refused_.fetch_add(1);
    kLog.Warn("dropped staged read request {:x} of transfer '{}' from agent '{}': it came "
              "without a reply endpoint; the requesting agent runs an incompatible version",
              header.request_id(), header.transfer_id(), header.from_agent());
    return false;
  }
  // Eager replies when the asker asks, and whatever it asks when the endpoint we answer
  // on has no native RMA (tcp): a rendezvous there makes UCX answer by itself, and it
  // aborts this process when that answer fails because the asker died.
  const bool eager = header.eager_replies() || !worker_->ReplyEndpointNativeRma(message.reply_ep);
  auto refuse = [&](const absl::Status& why) {
    kLog.Warn("refused staged read request of transfer '{}' from agent '{}': {}",
              header.transfer_id(), header.from_agent(), why.message());
    RefuseRead(message.reply_ep, header.request_id(), std::string(why.message()), why.code(),
               eager);
    return false;
  };
  if (message.length > 0) {
    return refuse(absl::InvalidArgumentError(fmt::format(
        "staged read from agent '{}': the request carries {} bytes of data, a request has "
        "none; the requesting agent runs an incompatible version",
        options_.self_name, message.length)));
  }
  const auto& regions = Regions();  // and ranges_, index for index
  std::vector<planning::ReadPiece> pieces;
  pieces.reserve(std::min(header.pieces_size(), 65537));
  for (const auto& p : header.pieces()) {
    if (pieces.size() > 65536) break;  // CheckReadPieces refuses the count
    pieces.push_back(planning::ReadPiece{p.remote_address(), p.length()});
  }
  planning::ReadRequestLimits limits;
  limits.max_bytes = std::max(options_.max_chunk_message, options_.pool.chunk_bytes);
  auto checked = planning::CheckReadPieces(pieces, ranges_, limits, options_.self_name);
  if (!checked.ok()) return refuse(checked.status());
  if (absl::Status s = EnsurePool(); !s.ok()) return refuse(s);

  auto sources = std::make_shared<std::vector<StagedRegion>>();
  uint64_t total = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    sources->push_back(regions[(*checked)[i]]);  // holds the region until the copy is done
    total += pieces[i].length;
  }
  // Eager replies (an endpoint without native RMA) are assembled whole by the
  // reader's UCX: they go in parts of the smaller message size.
  const uint64_t part = eager
                            ? std::min(options_.pool.AmMessageBytes(), recv_pool_->chunk_bytes())
                            : recv_pool_->chunk_bytes();
  const uint64_t parts = (total + part - 1) / part;
  const uint32_t theirs = serving_by_peer_.of(header.from_agent());
  if (serving_ + parts > options_.max_serving || theirs + parts > options_.max_serving_per_peer) {
    return refuse(absl::ResourceExhaustedError(fmt::format(
        "agent '{}' already has {} staged read replies waiting for a bounce buffer, {} of them "
        "for '{}' (bounds {} in all, {} per reader); it is falling behind: retry later, or "
        "give it more --staging-buffers",
        options_.self_name, serving_, theirs, Printable(header.from_agent()),
        options_.max_serving, options_.max_serving_per_peer)));
  }
  auto asked = std::make_shared<wire::StagedReadRequest>(header);
  asked->set_eager_replies(eager);  // what ServePart sends with, decided above
  std::shared_ptr<const wire::StagedReadRequest> request = std::move(asked);
  transport::ReplyEndpoint reply_ep = message.reply_ep;
  for (uint64_t offset = 0; offset < total; offset += part) {
    const uint64_t length = std::min(part, total - offset);
    ++serving_;
    serving_by_peer_.Add(header.from_agent());
    recv_pool_->Acquire([this, request, sources, reply_ep, offset, length](StagingPool::Lease l) {
      auto lease = std::make_shared<StagingPool::Lease>(std::move(l));
      worker_->Post([this, request, sources, reply_ep, offset, length, lease] {
        ServePart(request, sources, reply_ep, offset, length, lease);
      });
    });
  }
  return false;
}

void Stager::PartServed(const std::string& reader) {
  --serving_;
  serving_by_peer_.Remove(reader);
}

void Stager::ServePart(std::shared_ptr<const wire::StagedReadRequest> request,
                       std::shared_ptr<const std::vector<StagedRegion>> sources,
                       const transport::ReplyEndpoint& reply_ep, uint64_t offset, uint64_t length,
                       std::shared_ptr<StagingPool::Lease> lease) {
  // The reader left before a buffer came (UCX destroyed the endpoint its request came
  // over): nothing is copied for a reply it cannot take, and the connection is logged
  // once, not once a part.
  if (worker_->ReplyEndpointGone(reply_ep)) {
    PartServed(request->from_agent());
    if (reply_ep.serial != gone_reader_logged_) {
      gone_reader_logged_ = reply_ep.serial;
      kLog.Warn(
          "staged read of transfer '{}' by agent '{}': its reader's UCX connection "
          "ended before a bounce buffer was free; the parts asked for over it are not "
          "copied or sent (kvagent_ucx_replies_to_gone_endpoints_total counts them)",
          request->transfer_id(), request->from_agent());
    }
    return;
  }
  std::vector<uint64_t> lengths;
  lengths.reserve(request->pieces_size());
  for (const auto& p : request->pieces()) lengths.push_back(p.length());
  bool used_device = false;
  absl::Status s;
  for (const planning::PieceSlice& slice : planning::SlicePieces(lengths, offset, length)) {
    const StagedRegion& source = (*sources)[slice.piece];
    const bool device = source.region->spec.memory() == v1::VRAM;
    used_device |= device;
    s = CopierFor(device).Copy(reinterpret_cast<uint64_t>(lease->data() + slice.range_offset),
                               request->pieces(slice.piece).remote_address() + slice.piece_offset,
                               slice.length);
    if (!s.ok()) {
      s = absl::Status(s.code(), fmt::format("agent '{}': copying region '{}' out for a staged "
                                             "read failed: {}",
                                             options_.self_name, source.region->spec.name(),
                                             s.message()));
      break;
    }
  }
  if (s.ok() && used_device) s = CopierFor(true).Sync();
  if (!s.ok()) {
    PartServed(request->from_agent());
    kLog.Warn("staged read of transfer '{}' from agent '{}': {}", request->transfer_id(),
              request->from_agent(), s.message());
    RefuseRead(reply_ep, request->request_id(), std::string(s.message()), s.code(),
               request->eager_replies());
    return;
  }
  wire::StagedReadReply header;
  header.set_from_agent(options_.self_name);
  header.set_request_id(request->request_id());
  header.set_offset(offset);
  // The buffer stays leased until the reply is sent: only then may it be reused. A
  // reader that died or hangs may never take it: watched (WriteOffStaleLent).
  Lend(lease, request->from_agent(), request->transfer_id(), /*reply=*/true);
  worker_->SendAmReply(reply_ep, Wire(AmId::kStagedReadReply), header.SerializeAsString(), lease->data(),
                       length, [this, lease, request](absl::Status sent) {
                         PartServed(request->from_agent());
                         if (sent.ok()) {
                           reads_served_.fetch_add(1);
                         } else {
                           kLog.Warn("staged read reply of transfer '{}' to agent '{}': {}",
                                     request->transfer_id(), request->from_agent(), sent.message());
                         }
                       },
                       request->eager_replies());
}

void Stager::Lend(std::shared_ptr<StagingPool::Lease> lease, const std::string& peer,
                  const std::string& transfer_id, bool reply) {
  while (!lent_.empty() && lent_.front().lease.expired()) lent_.pop_front();
  // At most the receive pool's buffers are lent at once: behind one still out, the
  // given-back ones go now and then (order kept), so the deque stays small.
  if (lent_.size() >= 64) {
    lent_.erase(std::remove_if(lent_.begin(), lent_.end(),
                               [](const LentBuffer& b) { return b.lease.expired(); }),
                lent_.end());
  }
  lent_.push_back({lease, MonotonicMicros(), peer, transfer_id, reply});
  if (lent_watched_.exchange(lent_.size()) == 0) {
    absl::MutexLock lock(&sweep_mu_);
    sweep_cv_.SignalAll();
  }
}

void Stager::WriteOffStaleLent() {
  const uint64_t now = MonotonicMicros();
  const uint64_t limit = uint64_t{options_.reply_timeout_ms} * 1000;
  // Oldest first: stop at the first buffer still lent and not yet past the limit.
  struct Key {
    std::string peer, transfer_id;
    bool reply;
    bool operator<(const Key& o) const {
      return std::tie(peer, transfer_id, reply) < std::tie(o.peer, o.transfer_id, o.reply);
    }
  };
  std::map<Key, uint32_t> written_off;
  uint32_t refused = 0;
  while (!lent_.empty()) {
    LentBuffer& front = lent_.front();
    std::shared_ptr<StagingPool::Lease> lease = front.lease.lock();
    if (lease != nullptr && *lease) {
      if (now - front.since_us < limit) break;
      if (recv_pool_ != nullptr && recv_pool_->WriteOff(*lease)) {
        ++written_off[{front.peer, front.transfer_id, front.reply}];
      } else {
        ++refused;
      }
    }
    lent_.pop_front();
  }
  lent_watched_.store(lent_.size());
  uint32_t total = 0;
  for (const auto& [key, n] : written_off) {
    total += n;
    kLog.Warn("staged {} of transfer '{}' {} agent '{}': {} receive buffers held by {} not "
              "done within {} ms written off and replaced (freed if they ever are)",
              key.reply ? "read" : "chunks", Printable(key.transfer_id, 256),
              key.reply ? "by" : "from", Printable(key.peer), n,
              key.reply ? "replies it did not take" : "receives it did not finish sending",
              options_.reply_timeout_ms);
  }
  if (refused > 0) {
    kLog.Warn("{} receive buffers lent to UCX for more than {} ms were not written off: the "
              "pool holds as many written off as it may ({}), so staged reads and chunks may "
              "wait for them; restart this agent to get them back",
              refused, options_.reply_timeout_ms,
              recv_pool_ != nullptr ? recv_pool_->write_offs().bound : 0);
  }
  buffers_written_off_.fetch_add(total);
  write_offs_refused_.fetch_add(refused);
}

}  // namespace kvagent::agent

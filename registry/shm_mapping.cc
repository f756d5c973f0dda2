#include "registry/shm_mapping.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "fmt/format.h"

namespace kvagent::registry {
namespace {

// "/x" is a POSIX shm name (shm_open).
bool IsShmName(const std::string& name) {
  return name.size() > 1 && name[0] == '/' && name.find('/', 1) == std::string::npos;
}

uint64_t AlignDown(uint64_t value, uint64_t alignment) { return value - value % alignment; }

}  // namespace

struct ShmMapping::Segment {
  void* base = nullptr;
  uint64_t length = 0;
  std::pair<uint64_t, uint64_t> key;  // (device, inode); {0, 0}: not shared
  GuardedRange guard;                 // [base, +length); released before munmap
  std::shared_ptr<const MemoryObject> object;  // keeps the descriptor open

  ~Segment();
};

namespace {

// The whole-object mappings alive, by (device, inode): what Map shares.
struct SegmentTable {
  absl::Mutex mu;
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, std::weak_ptr<ShmMapping::Segment>> live
      ABSL_GUARDED_BY(mu);
};
SegmentTable& Segments() {
  static auto* table = new SegmentTable();  // never destroyed: segments may outlive statics
  return *table;
}

std::atomic<size_t> segments_alive{0};
std::atomic<uint64_t> mapped_total{0};
std::atomic<uint64_t> mapped_refused{0};
std::atomic<uint64_t> mapped_bound{ShmMapping::kDefaultMappedBytesBound};
std::atomic<bool (*)(void*, uint64_t)> retire_hook{nullptr};  // ShmMapping::SetRetire

// Background first touch (ShmMapping::SetWarming).
struct WarmJob {
  std::weak_ptr<ShmMapping::Segment> segment;
  uint64_t first = 0, end = 0, page = 4096;  // offsets in the segment
};
struct Warmer {
  absl::Mutex mu;
  std::deque<WarmJob> jobs ABSL_GUARDED_BY(mu);
  bool started ABSL_GUARDED_BY(mu) = false;
  bool held ABSL_GUARDED_BY(mu) = false;  // HoldWarmingForTest
  std::atomic<uint64_t> touched{0}, queued{0}, skipped{0};
};
Warmer& TheWarmer() {
  static auto* warmer = new Warmer();  // never destroyed: its thread is detached
  return *warmer;
}
std::atomic<bool> warming_on{false};

// One byte read per page. The engine or a transfer may write these bytes meanwhile
// (other mappings, other processes): the value read is not used, so that is no race
// that matters, and ThreadSanitizer is told so.
__attribute__((no_sanitize("thread"), noinline)) uint8_t TouchPages(const uint8_t* at,
                                                                    uint64_t bytes,
                                                                    uint64_t page) {
  uint8_t sum = 0;
  for (uint64_t o = 0; o < bytes; o += page) {
    sum ^= *reinterpret_cast<const volatile uint8_t*>(at + o);
  }
  return sum;
}

// Calls fn(offset, bytes) for each run of consecutive pages of [start, start + length)
// (`page` bytes each) that the object already holds (mincore: in its page cache), or
// once for the whole range when mincore cannot tell. `resident` has room for every
// page of the range. Reading or populating a hole would allocate it, charged to this
// process's memory cgroup (see FaultIn).
template <typename Fn>
void ForEachResidentRun(const uint8_t* start, uint64_t length, uint64_t page,
                        std::vector<unsigned char>& resident, Fn fn) {
  if (mincore(const_cast<uint8_t*>(start), length, resident.data()) != 0) {
    fn(0, length);
    return;
  }
  const uint64_t pages = (length + page - 1) / page;
  for (uint64_t i = 0; i < pages;) {
    if ((resident[i] & 1) == 0) {
      ++i;
      continue;
    }
    uint64_t j = i + 1;
    while (j < pages && (resident[j] & 1) != 0) ++j;
    fn(i * page, std::min(j * page, length) - i * page);
    i = j;
  }
}

void WarmLoop() {
  pthread_setname_np(pthread_self(), "map-warm");
  // Lowest priority: the pages it touches first cost a transfer no more than before,
  // so it takes only CPU that nothing else wants.
  (void)setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), 19);
  Warmer& w = TheWarmer();
  constexpr uint64_t kStep = uint64_t{1} << 20;  // the segment is held one MiB at a time
  const uint64_t kSmallPage = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident(kStep / kSmallPage + 1);
  for (;;) {
    WarmJob job;
    {
      absl::MutexLock lock(&w.mu);
      w.mu.Await(absl::Condition(
          +[](Warmer* warmer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(warmer->mu) {
            return !warmer->jobs.empty() && !warmer->held;
          },
          &w));
      job = std::move(w.jobs.front());
      w.jobs.pop_front();
    }
    uint64_t at = job.first;
    while (at < job.end) {
      std::shared_ptr<ShmMapping::Segment> segment = job.segment.lock();
      if (segment == nullptr || segment->guard.broken()) break;
      const uint64_t n = std::min(kStep, job.end - at);
      const uint8_t* const start = static_cast<const uint8_t*>(segment->base) + at;
      // Pages the object holds only (see FaultIn): a read of a hole would allocate it,
      // charged to this process's memory cgroup. hugetlbfs pages are reserved already.
      if (job.page == kSmallPage) {
        ForEachResidentRun(start, n, job.page, resident, [&](uint64_t offset, uint64_t bytes) {
          (void)TouchPages(start + offset, bytes, job.page);
        });
      } else {
        (void)TouchPages(start, n, job.page);
      }
      const uint64_t pages = (n + job.page - 1) / job.page;
      w.touched.fetch_add(pages);
      w.queued.fetch_sub(pages);
      at += n;
    }
    if (at < job.end) {
      w.queued.fetch_sub((job.end - at + job.page - 1) / job.page);
      w.skipped.fetch_add(1);
    }
  }
}

void QueueWarm(const std::shared_ptr<ShmMapping::Segment>& segment, uint64_t first,
               uint64_t end, uint64_t page) {
  if (!warming_on.load(std::memory_order_relaxed) || end <= first) return;
  Warmer& w = TheWarmer();
  w.queued.fetch_add((end - first + page - 1) / page);
  absl::MutexLock lock(&w.mu);
  w.jobs.push_back(WarmJob{segment, first, end, page});
  if (!w.started) {
    w.started = true;
    std::thread(WarmLoop).detach();
  }
}

uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return AlignDown(value + alignment - 1, alignment);
}

}  // namespace

ShmMapping::Segment::~Segment() {
  if (base != nullptr) {
    segments_alive.fetch_sub(1);
    mapped_total.fetch_sub(length);
  }
  guard.Reset();  // first: nothing may touch the range once it is unmapped
  bool (*retire)(void*, uint64_t) = retire_hook.load();
  if (base != nullptr && (retire == nullptr || !retire(base, length))) munmap(base, length);
  if (key != std::pair<uint64_t, uint64_t>{0, 0}) {
    SegmentTable& table = Segments();
    absl::MutexLock lock(&table.mu);
    auto it = table.live.find(key);
    if (it != table.live.end() && it->second.expired()) table.live.erase(it);
  }
}

size_t ShmMapping::shared_mappings() { return segments_alive.load(); }
uint64_t ShmMapping::mapped_bytes() { return mapped_total.load(); }
uint64_t ShmMapping::mapped_refusals() { return mapped_refused.load(); }
void ShmMapping::SetMappedBytesBound(uint64_t bytes) { mapped_bound.store(bytes); }

void ShmMapping::SetWarming(bool on) { warming_on.store(on); }

void ShmMapping::SetRetire(bool (*retire)(void*, uint64_t)) { retire_hook.store(retire); }

void ShmMapping::HoldWarmingForTest(bool hold) {
  Warmer& w = TheWarmer();
  absl::MutexLock lock(&w.mu);
  w.held = hold;
}

ShmMapping::WarmingStats ShmMapping::warming() {
  Warmer& w = TheWarmer();
  return WarmingStats{w.touched.load(), w.queued.load(), w.skipped.load()};
}

bool ShmMapping::broken() const { return segment_ != nullptr && segment_->guard.broken(); }

absl::StatusOr<std::shared_ptr<ShmMapping::Segment>> ShmMapping::MapSegment(
    const std::shared_ptr<const MemoryObject>& object, uint64_t length, std::string_view entry) {
  // Counted before the mmap, given back when it fails or the segment goes.
  const uint64_t before = mapped_total.fetch_add(length);
  const uint64_t bound = mapped_bound.load();
  if (before + length > bound || before + length < before) {
    mapped_total.fetch_sub(length);
    mapped_refused.fetch_add(1);
    return absl::ResourceExhaustedError(fmt::format(
        "region '{}': memory '{}' is {} bytes and is mapped whole; with the {} bytes this "
        "agent maps already that passes --max-mapped-bytes ({} bytes); share memory objects "
        "no larger than the pool they hold (a sparse file of that size costs the engine "
        "nothing and the agent its address space), or raise the flag",
        entry, object->label(), length, before, bound));
  }
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, object->fd(), 0);
  if (base == MAP_FAILED) {
    mapped_total.fetch_sub(length);
    const int err = errno;
    if (err == EACCES || err == EPERM) {
      return absl::FailedPreconditionError(fmt::format(
          "region '{}': memory '{}' cannot be mapped read-write ({}); share memory opened "
          "O_RDWR and not sealed against writes",
          entry, object->label(), std::strerror(err)));
    }
    return absl::ResourceExhaustedError(fmt::format(
        "region '{}': mmap of {} bytes of memory '{}' failed ({}); check the address-space "
        "limit (ulimit -v), vm.max_map_count and, for hugetlbfs, free huge pages",
        entry, length, object->label(), std::strerror(err)));
  }
  auto guard = FaultGuard::Guard(base, length, object->page_alignment(), entry);
  if (!guard.ok()) {
    munmap(base, length);
    mapped_total.fetch_sub(length);
    return guard.status();
  }
  auto segment = std::make_shared<Segment>();
  segments_alive.fetch_add(1);
  segment->base = base;
  segment->length = length;
  segment->guard = *std::move(guard);
  segment->object = object;
  return segment;
}

absl::StatusOr<ShmMapping> ShmMapping::Map(std::shared_ptr<const MemoryObject> object,
                                           uint64_t offset, uint64_t length,
                                           std::string_view entry, Populate populate) {
  if (object == nullptr) {
    return absl::InvalidArgumentError(
        fmt::format("region '{}': no memory object to map; share the memory first", entry));
  }
  if (length == 0) {
    return absl::InvalidArgumentError(
        fmt::format("region '{}': length is 0; give the region's size in bytes", entry));
  }
  // The size now, not at open: an unsealed object may have shrunk since.
  ASSIGN_OR_RETURN(const uint64_t size, object->CurrentSize(entry));
  uint64_t end = 0;
  if (__builtin_add_overflow(offset, length, &end) || end > size) {
    return absl::InvalidArgumentError(
        fmt::format("region '{}': memory '{}' is {} bytes, smaller than offset {} + length {} = {} "
                    "bytes; grow the object or fix offset/length",
                    entry, object->label(), size, offset, length,
                    end < offset ? std::string("overflow") : std::to_string(end)));
  }

  // Share the object's mapping when one covers the range and is intact. Segments are
  // only ever released outside the table's lock (their destructor takes it).
  const std::pair<uint64_t, uint64_t> key{static_cast<uint64_t>(object->device()),
                                          static_cast<uint64_t>(object->inode())};
  std::shared_ptr<Segment> segment, unused;
  {
    SegmentTable& table = Segments();
    absl::MutexLock lock(&table.mu);
    auto it = table.live.find(key);
    if (it != table.live.end()) {
      segment = it->second.lock();
      if (segment != nullptr && (segment->guard.broken() || segment->length < end)) {
        unused = std::move(segment);  // grown or broken: a new mapping replaces it
        segment = nullptr;
      }
    }
    if (segment == nullptr) {
      // The whole object as it is now (huge-page aligned on hugetlbfs).
      ASSIGN_OR_RETURN(segment, MapSegment(object, AlignUp(size, object->page_alignment()), entry));
      segment->key = key;
      table.live[key] = segment;
    }
  }

  ShmMapping mapping;
  mapping.memory_ = std::move(object);
  mapping.segment_ = std::move(segment);
  mapping.data_ = static_cast<char*>(mapping.segment_->base) + offset;
  mapping.length_ = length;
  mapping.offset_ = offset;
  // Fault the range's pages in now, writable, as MAP_POPULATE did for a mapping of
  // the range alone (or the caller does, with kLater).
  if (populate == Populate::kNow) mapping.FaultIn();
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  QueueWarm(mapping.segment_, AlignDown(offset, page),
            std::min(AlignUp(end, page), mapping.segment_->length),
            std::max<uint64_t>(page, mapping.memory_->page_alignment()));
  return mapping;
}

void ShmMapping::FaultIn() const {
  if (segment_ == nullptr || length_ == 0) return;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t first = AlignDown(offset_, page);
  const uint64_t last = std::min(AlignUp(offset_ + length_, page), segment_->length);
  if (last <= first) return;
  char* const base = static_cast<char*>(segment_->base);
  // hugetlbfs pages come from the huge page pool, reserved when the object was mapped;
  // memory the agent allocated (AllocateMemory) is its own, bounded by
  // --max-allocated-bytes.
  if (memory_->kind() == "hugetlbfs" || memory_->allocated()) {
    (void)madvise(base + first, last - first, MADV_POPULATE_WRITE);
    return;
  }
  // Only pages the object already holds (mincore: in its page cache). A page is charged
  // to the memory cgroup of the process that first touches it: faulting in an engine's
  // holes here made the agent pay for memory the engine never used (2 GiB shared, 1 MiB
  // written: the agent's 512 MiB cgroup was killed, tests/limits:memcg_test). A hole
  // is left to the first transfer that writes there.
  constexpr uint64_t kWindowPages = 16384;  // 64 MiB of 4 KiB pages per mincore call
  // Sized to the range (a pool's regions are often a few pages each: 1,000 of them took
  // 16 MiB of short-lived vectors, which ASan's quarantine kept).
  std::vector<unsigned char> resident(std::min(kWindowPages, (last - first) / page));
  for (uint64_t window = first; window < last; window += kWindowPages * page) {
    const uint64_t end = std::min(last, window + kWindowPages * page);
    char* const at = base + window;
    ForEachResidentRun(reinterpret_cast<const uint8_t*>(at), end - window, page, resident,
                       [&](uint64_t offset, uint64_t bytes) {
                         (void)madvise(at + offset, bytes, MADV_POPULATE_WRITE);
                       });
  }
}

absl::StatusOr<ShmMapping> ShmMapping::OpenPath(const std::string& name, uint64_t offset,
                                                uint64_t length, std::string_view entry,
                                                const PathPolicy& policy, Populate populate) {
  if (length == 0) {
    return absl::InvalidArgumentError(
        fmt::format("region '{}': length is 0; give the region's size in bytes", entry));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const MemoryObject> object,
                   MemoryObject::OpenPath(name, policy, entry));
  return Map(std::move(object), offset, length, entry, populate);
}

absl::StatusOr<ShmMapping> ShmMapping::Create(const std::string& name, uint64_t bytes) {
  if (!IsShmName(name)) {
    return absl::InvalidArgumentError(fmt::format(
        "shm object '{}': not a POSIX shm name; use \"/name\" with no other '/'", name));
  }
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        fmt::format("shm object '{}': size is 0; ask for at least one byte", name));
  }
  UniqueFd fd(shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
  if (!fd.valid()) {
    int err = errno;
    if (err == EEXIST) {
      return absl::AlreadyExistsError(fmt::format(
          "shm object '{}': already exists; pick another name or remove /dev/shm{}", name,
          name));
    }
    return absl::InternalError(fmt::format(
        "shm object '{}': shm_open(O_CREAT) failed ({}); check that /dev/shm is mounted "
        "and writable",
        name, std::strerror(err)));
  }
  auto fail_unlink = [&](absl::Status status) {
    fd.reset();
    shm_unlink(name.c_str());
    return status;
  };
  auto no_room = [&](const char* cause) {
    struct statvfs vfs {};
    uint64_t free_bytes = 0;
    if (statvfs("/dev/shm", &vfs) == 0) {
      free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    }
    return absl::ResourceExhaustedError(fmt::format(
        "shm object '{}': cannot size it to {} bytes ({}); /dev/shm has {} bytes free; "
        "free space there or enlarge it (mount -o remount,size=... /dev/shm, or the "
        "container's shm size)",
        name, bytes, cause, free_bytes));
  };
  // tmpfs accepts a sparse ftruncate beyond its free space and SIGBUSes on first
  // touch; check the room first so the failure is a status, not a crash later.
  struct statvfs vfs {};
  if (statvfs("/dev/shm", &vfs) == 0 &&
      bytes > static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize) {
    return fail_unlink(no_room("not enough free space"));
  }
  if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return fail_unlink(no_room(std::strerror(errno)));
  }
  auto object = MemoryObject::FromDescriptor(std::move(fd), name);
  if (!object.ok()) return fail_unlink(object.status());
  // Not populated, and not shared (the name is unlinked with it): the creator touches
  // the pages it uses.
  auto segment = MapSegment(*object, AlignUp(bytes, (*object)->page_alignment()), name);
  if (!segment.ok()) return fail_unlink(segment.status());
  ShmMapping mapping;
  mapping.memory_ = *std::move(object);
  mapping.segment_ = *std::move(segment);
  mapping.data_ = mapping.segment_->base;
  mapping.length_ = bytes;
  mapping.name_ = name;
  mapping.owner_ = true;
  return mapping;
}

ShmMapping::ShmMapping(ShmMapping&& other) noexcept { *this = std::move(other); }

ShmMapping& ShmMapping::operator=(ShmMapping&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    memory_ = std::move(other.memory_);
    segment_ = std::move(other.segment_);
    data_ = std::exchange(other.data_, nullptr);
    length_ = std::exchange(other.length_, 0);
    offset_ = std::exchange(other.offset_, 0);
    owner_ = std::exchange(other.owner_, false);
    other.name_.clear();
    other.memory_.reset();
    other.segment_.reset();
  }
  return *this;
}

ShmMapping::~ShmMapping() { Reset(); }

void ShmMapping::Reset() {
  segment_.reset();  // unmapped (and unguarded) with its last user
  if (owner_) shm_unlink(name_.c_str());
  name_.clear();
  memory_.reset();
  data_ = nullptr;
  length_ = offset_ = 0;
  owner_ = false;
}

}  // namespace kvagent::registry

#include "agent/heap_trimmer.h"

#include <malloc.h>
#include <pthread.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#if KVAGENT_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

namespace kvagent::agent {
namespace {

#if KVAGENT_JEMALLOC
// "stats.arenas.<MALLCTL_ARENAS_ALL>...": every arena's figures summed.
#define KVAGENT_ALL_ARENAS "4096"
static_assert(MALLCTL_ARENAS_ALL == 4096, "KVAGENT_ALL_ARENAS names MALLCTL_ARENAS_ALL");

size_t JemallocSize(const char* name) {
  size_t value = 0, size = sizeof(value);
  return mallctl(name, &value, &size, nullptr, 0) == 0 ? value : 0;
}
#endif

// Process-wide, never destroyed: NoteHeapActivity may run on any thread at any time,
// also while an agent is being torn down.
struct Activity {
  std::atomic<bool> noted{false};  // activity since the trimmer last cleared it
  std::atomic<int> sleepers{0};    // trimmers waiting for activity (no timeout)
  absl::Mutex mu;
  absl::CondVar cv;
};

Activity& TheActivity() {
  static Activity* activity = new Activity;
  return *activity;
}

}  // namespace

void NoteHeapActivity() {
  Activity& a = TheActivity();
  // Busy agent: the flag is already set and its cache line is only read.
  if (a.noted.load(std::memory_order_relaxed)) return;
  a.noted.store(true);
  // Paired with the trimmer's increment of `sleepers` then load of `noted` (both
  // sequentially consistent): either it sees the flag, or this sees it sleeping.
  if (a.sleepers.load() > 0) {
    absl::MutexLock lock(&a.mu);
    a.cv.SignalAll();
  }
}

std::string HeapAllocatorName() {
#if KVAGENT_JEMALLOC
  const char* version = nullptr;
  size_t size = sizeof(version);
  if (mallctl("version", &version, &size, nullptr, 0) == 0 && version != nullptr) {
    return absl::StrCat("jemalloc ", version);
  }
  return "jemalloc";
#else
  return "glibc malloc";
#endif
}

size_t HeapUnusedBytes() {
#if KVAGENT_JEMALLOC
  // jemalloc's statistics are a snapshot taken when "epoch" is written.
  uint64_t epoch = 1;
  mallctl("epoch", nullptr, nullptr, &epoch, sizeof(epoch));
  const size_t pages = JemallocSize("stats.arenas." KVAGENT_ALL_ARENAS ".pdirty") +
                       JemallocSize("stats.arenas." KVAGENT_ALL_ARENAS ".pmuzzy");
  return pages * JemallocSize("arenas.page");
#else
  return mallinfo2().fordblks;
#endif
}

void TrimHeap() {
#if KVAGENT_JEMALLOC
  mallctl("arena." KVAGENT_ALL_ARENAS ".purge", nullptr, nullptr, nullptr, 0);
#else
  malloc_trim(0);
#endif
}

HeapTrimmer::HeapTrimmer(Options options) : options_(options) {
  thread_ = std::thread([this] { Loop(); });
}

HeapTrimmer::~HeapTrimmer() { Stop(); }

void HeapTrimmer::Stop() {
  {
    Activity& a = TheActivity();
    absl::MutexLock lock(&a.mu);
    stopping_.store(true);
    a.cv.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

bool HeapTrimmer::SleepUntilActivity() {
  Activity& a = TheActivity();
  absl::MutexLock lock(&a.mu);
  a.sleepers.fetch_add(1);
  while (!a.noted.load() && !stopping_.load()) a.cv.Wait(&a.mu);
  a.sleepers.fetch_sub(1);
  return !stopping_.load();
}

bool HeapTrimmer::SleepFor(absl::Duration d) {
  Activity& a = TheActivity();
  const absl::Time deadline = absl::Now() + d;
  absl::MutexLock lock(&a.mu);
  while (!stopping_.load() && !a.cv.WaitWithDeadline(&a.mu, deadline)) {
  }
  return !stopping_.load();
}

void HeapTrimmer::Look() {
  looks_.fetch_add(1);
  // Reading the unused amount is cheap next to a trim, which runs only when that
  // amount changed and is worth it.
  const size_t unused = HeapUnusedBytes();
  if (unused < options_.min_free_bytes || unused == trimmed_at_) return;
  TrimHeap();
  trims_.fetch_add(1);
  trimmed_at_ = HeapUnusedBytes();
}

void HeapTrimmer::Loop() {
  pthread_setname_np(pthread_self(), "heap-trim");
  Activity& a = TheActivity();
  while (SleepUntilActivity()) {
    absl::Duration wait = options_.delay;
    int left = options_.follow_ups + 1;
    absl::Time last_look = absl::Now();  // the busy period's start, for max_defer
    while (left > 0) {
      a.noted.store(false);  // what comes after this is seen at the next look
      if (!SleepFor(wait)) return;
      const bool busy = a.noted.load();
      if (busy && absl::Now() - last_look < options_.max_defer) {
        deferred_.fetch_add(1);  // still busy: look once a wait passes quietly
        wait = options_.delay;
        left = options_.follow_ups + 1;
        continue;
      }
      Look();
      last_look = absl::Now();
      if (busy) {
        wait = options_.delay;  // still busy: look again soon
        left = options_.follow_ups + 1;
      } else {
        wait *= 2;
        --left;
      }
    }
  }
}

}  // namespace kvagent::agent

#include "agent/heap_trimmer.h"

#include <malloc.h>
#include <pthread.h>

#include "absl/synchronization/mutex.h"

namespace kvagent::agent {
namespace {

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
  // mallinfo2 walks the arenas' bins: cheap next to malloc_trim, which runs only when
  // the free memory changed and is worth it.
  const size_t free_bytes = mallinfo2().fordblks;
  if (free_bytes < options_.min_free_bytes || free_bytes == trimmed_at_) return;
  malloc_trim(0);
  trims_.fetch_add(1);
  trimmed_at_ = mallinfo2().fordblks;
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

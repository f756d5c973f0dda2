// Gives the heap's free pages back to the kernel after activity, and sleeps while
// there is none: the agent's HeapTrimmer thread, woken by NoteHeapActivity from the
// places that start or end work (gRPC calls, streams, sessions, transfers that arrive,
// peers that go). The heap is jemalloc's (//third_party:malloc; its unused dirty pages
// are purged), or glibc's in sanitizer builds (malloc_trim).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>

#include "absl/time/time.h"

namespace kvagent::agent {

// Memory may have been freed, or soon will be: the trimmer looks a moment later. Any
// thread; while the trimmer is already awake this is one relaxed load.
void NoteHeapActivity();

// The heap allocator this process was built with, for logs and status: "jemalloc
// 5.3.0-0-g..." or "glibc malloc".
std::string HeapAllocatorName();
// Heap memory the allocator holds resident but unused, which a trim would give back
// (jemalloc: its arenas' dirty and muzzy pages; glibc: mallinfo2's fordblks).
size_t HeapUnusedBytes();
// Gives that memory back to the kernel now (jemalloc: purges every arena; glibc:
// malloc_trim). Holds the allocator's arena locks while it runs.
void TrimHeap();

// One per process (the heap is the process's): the Agent owns it.
class HeapTrimmer {
 public:
  struct Options {
    // The first look after activity; then `follow_ups` more, each after twice the
    // wait before (2, 4, 8, 16, 32 s: memory freed later, such as a transfer that times
    // out, is still given back), then sleep until the next activity. Activity while
    // awake starts the series again.
    absl::Duration delay = absl::Seconds(2);
    int follow_ups = 4;
    // A look waits for a wait with no activity in it: a trim holds each arena's lock
    // in turn while it madvises that arena's unused pages (glibc's malloc_trim took
    // 48-66 ms in an agent under the bench here), so a thread that allocates meanwhile
    // (the UCX worker, a gRPC handler) can stall. While the agent stays busy, looks are
    // put off, but never for longer than this, so memory freed under constant traffic
    // still goes back.
    absl::Duration max_defer = absl::Seconds(30);
    // A trim runs only when the heap holds at least this much unused
    // (HeapUnusedBytes, cheap), and the amount changed since the last trim (a trim
    // madvises every unused page).
    size_t min_free_bytes = size_t{4} << 20;
  };
  explicit HeapTrimmer(Options options);  // starts the thread, asleep
  HeapTrimmer() : HeapTrimmer(Options{}) {}
  ~HeapTrimmer();
  HeapTrimmer(const HeapTrimmer&) = delete;
  HeapTrimmer& operator=(const HeapTrimmer&) = delete;

  void Stop();  // idempotent

  uint64_t looks() const { return looks_.load(); }  // rounds that read HeapUnusedBytes
  uint64_t trims() const { return trims_.load(); }  // of which called TrimHeap
  uint64_t deferred() const { return deferred_.load(); }  // looks put off: still busy

 private:
  void Loop();
  // False when stopping.
  bool SleepUntilActivity();
  bool SleepFor(absl::Duration d);
  void Look();

  const Options options_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> looks_{0};
  std::atomic<uint64_t> trims_{0};
  std::atomic<uint64_t> deferred_{0};
  size_t trimmed_at_ = 0;  // free bytes after the last trim: nothing new while equal
  std::thread thread_;
};

}  // namespace kvagent::agent

#include "agent/heap_trimmer.h"

#include <malloc.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "catch2/catch.hpp"
#include "cli/process_cpu.h"
#include "cli/process_memory.h"
#include "tests/unit/catch_main.h"

namespace kvagent::agent {
namespace {

uint64_t RssAnonBytes() {
  auto memory = cli::ReadProcessMemory(getpid());
  REQUIRE(memory.ok());
  return memory->rss_anon;
}

bool ThreadNamed(const std::string& name) {
  for (const auto& [tid, thread] : cli::ThreadCpuTicks(getpid())) {
    if (thread.name == name) return true;
  }
  return false;
}

bool Eventually(const std::function<bool()>& condition, absl::Duration limit = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + limit;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return condition();
}

}  // namespace

TEST_CASE("The heap trimmer sleeps until activity, looks a few times, sleeps again",
          "[heap]") {
  HeapTrimmer::Options options;
  options.delay = absl::Milliseconds(40);
  options.follow_ups = 2;  // looks at +40, +120, +280 ms after the last activity
  HeapTrimmer trimmer(options);
  REQUIRE(Eventually([] { return ThreadNamed("heap-trim"); }));
  // No activity: no look, however long (the idle agent's trimmer never wakes).
  absl::SleepFor(absl::Milliseconds(500));
  CHECK(trimmer.looks() == 0);

  NoteHeapActivity();
  REQUIRE(Eventually([&] { return trimmer.looks() == 3; }));
  absl::SleepFor(absl::Milliseconds(700));  // more than twice the last wait
  CHECK(trimmer.looks() == 3);

  trimmer.Stop();
  trimmer.Stop();  // idempotent
  CHECK(!ThreadNamed("heap-trim"));
  const uint64_t looks = trimmer.looks();
  NoteHeapActivity();  // nobody to wake: harmless
  absl::SleepFor(absl::Milliseconds(100));
  CHECK(trimmer.looks() == looks);
}

TEST_CASE("A busy agent's trimmer waits for a quiet moment, but not longer than max_defer",
          "[heap]") {
  HeapTrimmer::Options options;
  options.delay = absl::Milliseconds(200);
  options.follow_ups = 1;
  options.max_defer = absl::Milliseconds(800);
  HeapTrimmer trimmer(options);
  // Activity every 2 ms for 2 s: without the quiet rule, a look each 200 ms (about 10).
  const absl::Time end = absl::Now() + absl::Seconds(2);
  NoteHeapActivity();
  while (absl::Now() < end) {
    NoteHeapActivity();
    absl::SleepFor(absl::Milliseconds(2));
  }
  const uint64_t busy_looks = trimmer.looks();
  INFO(busy_looks << " looks and " << trimmer.deferred() << " put off while busy");
  // At about 0.8 and 1.6 s (max_defer); a gap of 200 ms in this thread on a loaded
  // machine would add one.
  CHECK(busy_looks >= 1);
  CHECK(busy_looks <= 5);
  CHECK(trimmer.deferred() >= 4);
  // Quiet again: the next look comes one quiet wait later, then the series ends.
  REQUIRE(Eventually([&] { return trimmer.looks() > busy_looks; }));
  REQUIRE(Eventually([&] { return trimmer.looks() >= busy_looks + 2; }));
}

TEST_CASE("The agent's heap is jemalloc's, glibc's under the sanitizers", "[heap]") {
  const std::string name = HeapAllocatorName();
  INFO("HeapAllocatorName(): " << name);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The sanitizer configs link no jemalloc (--define=kvagent_malloc=system).
  CHECK(name == "glibc malloc");
#else
  // A build that silently fell back to glibc's malloc would lose its speed (see
  // docs/BENCHMARKS.md, "jemalloc"): the allocator the trimmer speaks to is the one
  // that serves malloc.
  REQUIRE(name.rfind("jemalloc 5.", 0) == 0);
  void* block = malloc(100);
  CHECK(malloc_usable_size(block) >= 100);
  free(block);
#endif
}

TEST_CASE("Heap freed before activity goes back to the kernel", "[heap]") {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The sanitizers replace malloc with their own allocator: glibc's heap, mallinfo2 and
  // malloc_trim see none of it. The normal build (jemalloc) runs this case.
  KVAGENT_SKIP("a sanitizer build: malloc is the sanitizer's, there is no heap of ours to trim");
#endif
  HeapTrimmer::Options options;
  options.delay = absl::Milliseconds(40);
  options.follow_ups = 2;
  HeapTrimmer trimmer(options);
  // Freed heap goes back to the kernel after activity. 64 MiB in 32 KiB blocks (from
  // the heap's arenas, not a mapping each), pinned by one block after them so that the
  // allocator's own trimming of the heap's top cannot return it.
  constexpr size_t kBlock = 32 << 10, kBlocks = 2048;
  std::vector<char*> blocks;
  for (size_t i = 0; i < kBlocks; ++i) {
    blocks.push_back(static_cast<char*>(malloc(kBlock)));
    std::memset(blocks.back(), 1, kBlock);
  }
  char* pin = static_cast<char*>(malloc(kBlock));
  std::memset(pin, 1, kBlock);
  const uint64_t held = RssAnonBytes();
  for (char* b : blocks) free(b);
  const uint64_t freed = RssAnonBytes();
  INFO("RssAnon " << (held >> 20) << " MiB held, " << (freed >> 20) << " MiB after free()");
  INFO("unused heap " << (HeapUnusedBytes() >> 20) << " MiB after free() ("
                      << HeapAllocatorName() << ")");
  REQUIRE(HeapUnusedBytes() >= options.min_free_bytes);
  const uint64_t trims = trimmer.trims();
  NoteHeapActivity();
  REQUIRE(Eventually([&] { return trimmer.trims() > trims; }));
  const uint64_t trimmed = RssAnonBytes();
  INFO("RssAnon " << (trimmed >> 20) << " MiB after the trim");
  // At least half of the 64 MiB freed went back (the allocator keeps some pages).
  CHECK(trimmed + (32u << 20) <= held);
  free(pin);
}

}  // namespace kvagent::agent

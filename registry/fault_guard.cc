#include "registry/fault_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "base/format.h"
#include "fmt/format.h"

namespace kvagent::registry {
namespace {

// One guarded range. The handler reads it with atomics only; a slot is in use while
// `begin` is non-zero (published last, with release, so a handler that sees it sees
// the rest).
struct Slot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<uintptr_t> page{0};
  std::atomic<bool> broken{false};
};

Slot g_slots[FaultGuard::kCapacity];
std::atomic<size_t> g_high{0};  // slots [0, g_high) may be in use
std::atomic<uint64_t> g_faults{0};
std::atomic<size_t> g_guarded{0};
// The handler we replaced (written under Registry::mu before ours is installed).
struct sigaction g_previous {};

// Registration state of normal threads.
struct Registry {
  std::mutex mu;
  std::vector<int32_t> free_slots;  // below g_high, unused
};
Registry& GetRegistry() {
  static Registry* registry = new Registry();
  return *registry;
}

// Runs whatever handled SIGBUS before us; with none, the default action, so a fault
// that is not ours still kills the process with a core.
void Chain(int sig, siginfo_t* info, void* context) {
  const struct sigaction previous = g_previous;
  if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr) {
    previous.sa_sigaction(sig, info, context);
    return;
  }
  if ((previous.sa_flags & SA_SIGINFO) == 0 && previous.sa_handler != SIG_DFL &&
      previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
    return;
  }
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  sigaction(sig, &fallback, nullptr);
  // A fault repeats when the instruction runs again; a signal someone sent does not.
  if (info == nullptr || info->si_code <= 0) raise(sig);
}

// Async-signal-safe: atomics and one mmap system call (not libc's mmap, which UCX's
// memory hooks intercept and which may take locks).
bool Absorb(uintptr_t address) {
  const size_t high = g_high.load(std::memory_order_acquire);
  for (size_t i = 0; i < high; ++i) {
    Slot& slot = g_slots[i];
    const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
    if (begin == 0 || address < begin) continue;
    const uintptr_t end = slot.end.load(std::memory_order_relaxed);
    if (address >= end) continue;
    const uintptr_t page = slot.page.load(std::memory_order_relaxed);
    const uintptr_t first = begin + (address - begin) / page * page;
    // Zero pages from the faulting page to the end of the range: the interrupted copy
    // runs on (reads zeros, writes into memory nobody reads) without faulting again.
    // Not charged as committed memory (the range may be a sparse object's whole
    // mapping, larger than RAM: charged, the heuristic overcommit check refuses it).
    // Where even that is charged (vm.overcommit_memory 2), a window of it: a fault past
    // the window comes back here and maps the next one.
    constexpr int kFlags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE;
    long mapped = syscall(SYS_mmap, first, end - first, PROT_READ | PROT_WRITE, kFlags, -1, 0);
    if (mapped == -1) {
      const uintptr_t window = end - first < (uintptr_t{64} << 20) ? end - first : uintptr_t{64} << 20;
      mapped = syscall(SYS_mmap, first, window, PROT_READ | PROT_WRITE, kFlags, -1, 0);
    }
    if (mapped == -1) return false;
    slot.broken.store(true, std::memory_order_release);
    g_faults.fetch_add(1, std::memory_order_acq_rel);
    return true;
  }
  return false;
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  // Only "no page behind this address" (a truncated file, a full tmpfs); never
  // hardware memory errors, misalignment, or a signal someone sent.
  const bool lost_page =
      info != nullptr && (info->si_code == BUS_ADRERR || info->si_code == BUS_OBJERR);
  if (!lost_page || !Absorb(reinterpret_cast<uintptr_t>(info->si_addr))) {
    Chain(sig, info, context);
  }
  errno = saved_errno;
}

bool IsOurs(const struct sigaction& action) {
  return (action.sa_flags & SA_SIGINFO) != 0 && action.sa_sigaction == &OnSigbus;
}

// Installs OnSigbus unless it is the handler now (another library, or a test
// framework, may have replaced it since; we then chain to that one). Under the
// registry's lock.
absl::Status InstallLocked() {
  struct sigaction current {};
  if (sigaction(SIGBUS, nullptr, &current) != 0) {
    return absl::InternalError(fmt::format("sigaction(SIGBUS) query failed (errno {})", errno));
  }
  if (IsOurs(current)) return absl::OkStatus();
  g_previous = current;
  struct sigaction ours {};
  ours.sa_sigaction = &OnSigbus;
  ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
  sigemptyset(&ours.sa_mask);
  if (sigaction(SIGBUS, &ours, nullptr) != 0) {
    return absl::InternalError(fmt::format("sigaction(SIGBUS) install failed (errno {})", errno));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GuardedRange> FaultGuard::Guard(void* begin, uint64_t length, uint64_t page,
                                               std::string_view entry) {
  const auto start = reinterpret_cast<uintptr_t>(begin);
  if (start == 0 || length == 0 || page == 0 || start % page != 0 || length % page != 0 ||
      start + length < start) {
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': cannot guard {} bytes at {:#x} with {}-byte pages (not one page-aligned "
        "mapping)",
        entry, length, start, page));
  }
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  if (absl::Status installed = InstallLocked(); !installed.ok()) {
    return absl::Status(installed.code(),
                        fmt::format("region '{}': cannot install the SIGBUS guard: {}", entry,
                                    installed.message()));
  }
  int32_t slot = -1;
  if (!registry.free_slots.empty()) {
    slot = registry.free_slots.back();
    registry.free_slots.pop_back();
  } else if (g_high.load(std::memory_order_relaxed) < kCapacity) {
    slot = static_cast<int32_t>(g_high.load(std::memory_order_relaxed));
  } else {
    return absl::ResourceExhaustedError(fmt::format(
        "region '{}': {} host mappings are guarded already, the limit of this agent "
        "(FaultGuard::kCapacity); register fewer, larger regions (several regions in one "
        "memory object still need one mapping each), or deregister unused ones",
        entry, kCapacity));
  }
  Slot& s = g_slots[slot];
  s.end.store(start + length, std::memory_order_relaxed);
  s.page.store(page, std::memory_order_relaxed);
  s.broken.store(false, std::memory_order_relaxed);
  s.begin.store(start, std::memory_order_release);
  if (static_cast<size_t>(slot) >= g_high.load(std::memory_order_relaxed)) {
    g_high.store(static_cast<size_t>(slot) + 1, std::memory_order_release);
  }
  g_guarded.fetch_add(1, std::memory_order_relaxed);
  return GuardedRange(slot);
}

uint64_t FaultGuard::faults_caught() { return g_faults.load(std::memory_order_acquire); }

size_t FaultGuard::guarded_ranges() { return g_guarded.load(std::memory_order_relaxed); }

GuardedRange::GuardedRange(GuardedRange&& other) noexcept
    : slot_(std::exchange(other.slot_, -1)) {}

GuardedRange& GuardedRange::operator=(GuardedRange&& other) noexcept {
  if (this != &other) {
    Reset();
    slot_ = std::exchange(other.slot_, -1);
  }
  return *this;
}

GuardedRange::~GuardedRange() { Reset(); }

bool GuardedRange::broken() const {
  return slot_ >= 0 && g_slots[slot_].broken.load(std::memory_order_acquire);
}

void GuardedRange::Reset() {
  if (slot_ < 0) return;
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  g_slots[slot_].begin.store(0, std::memory_order_release);
  registry.free_slots.push_back(slot_);
  g_guarded.fetch_sub(1, std::memory_order_relaxed);
  slot_ = -1;
}

}  // namespace kvagent::registry

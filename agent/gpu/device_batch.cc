#include "agent/gpu/device_batch.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "absl/synchronization/mutex.h"
#include "agent/gpu/gather_kernel.h"
#include "base/format.h"
#include "base/log.h"
#include "cuda/driver.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {

constexpr log::Logger kLog("device-copy");

constexpr uint32_t kFatbinMagic = 0xBA55ED50;
constexpr size_t kFatbinHeaderBytes = 16;  // magic, version, header size, images' size
constexpr size_t kEntryHeaderMin = 32;     // kind, version, header size, size, ..., arch
constexpr uint16_t kEntryPtx = 1;
constexpr uint16_t kEntryCubin = 2;

template <typename T>
T Read(const unsigned char* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

std::string Version(int version) {
  return fmt::format("{}.{}", version / 1000, (version % 1000) / 10);
}

// Why cuMemcpyBatchAsync cannot be used here; "" when it can.
std::string BatchApiMissing(const DeviceCopyAbilities& host) {
  if (!host.batch_copy.empty()) return "";
  return fmt::format("driver {} has no cuMemcpyBatchAsync (CUDA 12.8+)",
                     Version(host.driver_version));
}

// Why the gather kernel cannot be used here; "" when it can. `image` gets the entry.
std::string KernelMissing(const DeviceCopyAbilities& host, std::optional<FatbinEntry>* image) {
  if (!host.kernel_launch) return "the driver cannot load kernels (cuModuleLoadData)";
  if (host.compute_capability == 0) return "no CUDA device to run the gather kernel on";
  *image = FatbinEntryFor(host.compute_capability, host.kernel_images);
  if (!image->has_value()) {
    return fmt::format("the gather kernel has no image for sm_{} (built for {})",
                       host.compute_capability, [&] {
                         std::string names;
                         for (const auto& e : host.kernel_images) {
                           names += (names.empty() ? "" : ", ") + FatbinEntryName(e);
                         }
                         return names.empty() ? std::string("nothing") : names;
                       }());
  }
  return "";
}

struct ProcessState {
  absl::Mutex mu;
  std::optional<DeviceCopyChoice> flag ABSL_GUARDED_BY(mu);  // SetDeviceCopyChoice
  std::optional<DeviceCopySelection> selection ABSL_GUARDED_BY(mu);
};
ProcessState& State() {
  static auto* state = new ProcessState;  // never destroyed: read by any thread at exit
  return *state;
}

}  // namespace

std::string_view DeviceCopyChoiceName(DeviceCopyChoice choice) {
  switch (choice) {
    case DeviceCopyChoice::kAuto:
      return "auto";
    case DeviceCopyChoice::kBatchApi:
      return "batch";
    case DeviceCopyChoice::kKernel:
      return "kernel";
    case DeviceCopyChoice::kPerPage:
      return "per-page";
  }
  return "?";
}

absl::StatusOr<DeviceCopyChoice> ParseDeviceCopyChoice(std::string_view text,
                                                       std::string_view entry) {
  for (DeviceCopyChoice c : {DeviceCopyChoice::kAuto, DeviceCopyChoice::kBatchApi,
                             DeviceCopyChoice::kKernel, DeviceCopyChoice::kPerPage}) {
    if (text == DeviceCopyChoiceName(c)) return c;
  }
  return absl::InvalidArgumentError(fmt::format("{}='{}' is not a device copy mechanism; {}",
                                                entry, text.substr(0, 64), kDeviceCopyChoices));
}

absl::StatusOr<DeviceCopyChoice> DeviceCopyChoiceFromEnv() {
  const char* value = std::getenv(kDeviceCopyEnv);
  if (value == nullptr || value[0] == '\0') return DeviceCopyChoice::kAuto;
  return ParseDeviceCopyChoice(value, kDeviceCopyEnv);
}

absl::StatusOr<std::vector<FatbinEntry>> ParseFatbin(const unsigned char* bytes, size_t size) {
  if (size < kFatbinHeaderBytes || Read<uint32_t>(bytes) != kFatbinMagic) {
    return absl::InvalidArgumentError(fmt::format(
        "not a fatbin: {} bytes without the magic 0x{:08X}; rebuild it with nvcc --fatbin",
        size, kFatbinMagic));
  }
  const uint16_t header = Read<uint16_t>(bytes + 6);
  const uint64_t images = Read<uint64_t>(bytes + 8);
  if (header < kFatbinHeaderBytes || header > size || images > size - header) {
    return absl::InvalidArgumentError(fmt::format(
        "truncated fatbin: header {} + images {} bytes in {}; rebuild it", header, images, size));
  }
  std::vector<FatbinEntry> entries;
  const unsigned char* at = bytes + header;
  const unsigned char* end = at + images;
  while (at < end) {
    const size_t left = static_cast<size_t>(end - at);
    if (left < kEntryHeaderMin) break;  // nvcc pads the end
    const uint16_t kind = Read<uint16_t>(at);
    const uint32_t entry_header = Read<uint32_t>(at + 4);
    const uint64_t payload = Read<uint64_t>(at + 8);
    if (entry_header < kEntryHeaderMin || entry_header > left || payload > left - entry_header) {
      return absl::InvalidArgumentError(fmt::format(
          "fatbin image {} at byte {} overruns the fatbin (header {}, payload {}, {} left); "
          "rebuild it",
          entries.size(), at - bytes, entry_header, payload, left));
    }
    if (kind == kEntryPtx || kind == kEntryCubin) {
      entries.push_back(FatbinEntry{kind == kEntryPtx, static_cast<int>(Read<uint32_t>(at + 28))});
    }
    at += entry_header + payload;
  }
  if (entries.empty()) {
    return absl::InvalidArgumentError("fatbin holds no cubin or PTX image; rebuild it");
  }
  return entries;
}

std::optional<FatbinEntry> FatbinEntryFor(int capability,
                                          const std::vector<FatbinEntry>& entries) {
  std::optional<FatbinEntry> cubin;
  std::optional<FatbinEntry> ptx;
  for (const auto& e : entries) {
    if (e.arch > capability) continue;
    auto& best = e.ptx ? ptx : cubin;
    if (!e.ptx && e.arch / 10 != capability / 10) continue;  // cubins run within a major
    if (!best.has_value() || e.arch > best->arch) best = e;
  }
  return cubin.has_value() ? cubin : ptx;
}

std::string FatbinEntryName(const FatbinEntry& entry) {
  return entry.ptx ? fmt::format("compute_{} PTX", entry.arch)
                   : fmt::format("sm_{} cubin", entry.arch);
}

DeviceCopyAbilities ProbeDeviceCopyAbilities() {
  DeviceCopyAbilities host;
  auto driver = cuda::CudaDriver::Load();
  if (!driver.ok()) return host;
  host.driver = true;
  host.driver_version = (*driver)->driver_version();
  host.batch_copy = (*driver)->copy_entry_points().batch_copy;
  host.kernel_launch = (*driver)->copy_entry_points().kernel_launch;
  if (host.kernel_launch && (*driver)->device_count() > 0) {
    host.compute_capability = (*driver)->ComputeCapability(0).value_or(0);
  }
  // The embedded image is checked by tests/unit/data_path/device_batch_test; a bad one
  // leaves no images, so the kernel is not chosen.
  host.kernel_images = ParseFatbin(GatherKernelImage(), GatherKernelImageBytes())
                           .value_or(std::vector<FatbinEntry>{});
  return host;
}

DeviceCopySelection SelectDeviceCopy(DeviceCopyChoice choice, const DeviceCopyAbilities& host,
                                     std::string_view source) {
  const std::string forced =
      choice == DeviceCopyChoice::kAuto
          ? std::string()
          : fmt::format(" ({}={})", source, DeviceCopyChoiceName(choice));
  if (!host.driver) {
    if (forced.empty()) return {DeviceCopyMechanism::kNone, "none (no CUDA driver)"};
    return {DeviceCopyMechanism::kNone,
            fmt::format("none (no CUDA driver; {}={} applies on a host with a GPU)", source,
                        DeviceCopyChoiceName(choice))};
  }
  const std::string batch_missing = BatchApiMissing(host);
  std::optional<FatbinEntry> image;
  const std::string kernel_missing = KernelMissing(host, &image);
  auto batch = [&] {
    return DeviceCopySelection{DeviceCopyMechanism::kBatchApi,
                               "cuMemcpyBatchAsync per batch" + forced};
  };
  auto kernel = [&] {
    return DeviceCopySelection{
        DeviceCopyMechanism::kKernel,
        fmt::format("gather kernel per batch ({}){}", FatbinEntryName(*image), forced)};
  };
  auto per_page = [&](const std::string& why) {
    return DeviceCopySelection{DeviceCopyMechanism::kPerPage,
                               "cuMemcpyAsync per page" + (why.empty() ? forced : why)};
  };
  switch (choice) {
    case DeviceCopyChoice::kAuto:
      if (batch_missing.empty()) return batch();
      if (kernel_missing.empty()) return kernel();
      return per_page(fmt::format(" ({}; {})", batch_missing, kernel_missing));
    case DeviceCopyChoice::kBatchApi:
      if (batch_missing.empty()) return batch();
      return per_page(fmt::format(" ({}=batch, but the {})", source, batch_missing));
    case DeviceCopyChoice::kKernel:
      if (kernel_missing.empty()) return kernel();
      return per_page(fmt::format(" ({}=kernel, but {})", source, kernel_missing));
    case DeviceCopyChoice::kPerPage:
      return per_page("");
  }
  return per_page("");
}

DeviceCopySelection CurrentDeviceCopy() {
  ProcessState& state = State();
  absl::MutexLock lock(&state.mu);
  if (state.selection.has_value()) return *state.selection;
  if (state.flag.has_value()) {
    state.selection = SelectDeviceCopy(*state.flag, ProbeDeviceCopyAbilities(), kDeviceCopyFlag);
  } else {
    // A bad KVAGENT_DEVICE_COPY does not stop the agent (it serves host memory without
    // a GPU): the best mechanism is chosen, and the mode says what was wrong.
    auto choice = DeviceCopyChoiceFromEnv();
    state.selection = SelectDeviceCopy(choice.value_or(DeviceCopyChoice::kAuto),
                                       ProbeDeviceCopyAbilities());
    if (!choice.ok()) {
      state.selection->mode += fmt::format(" (ignored {})", choice.status().message());
    }
  }
  kLog.Info("device copies of VRAM pages: {}", state.selection->mode);
  return *state.selection;
}

void SetDeviceCopyChoice(DeviceCopyChoice choice) {
  ProcessState& state = State();
  absl::MutexLock lock(&state.mu);
  state.flag = choice;
  state.selection.reset();
}

void KernelUnavailable(std::string_view reason) {
  ProcessState& state = State();
  absl::MutexLock lock(&state.mu);
  state.selection = DeviceCopySelection{
      DeviceCopyMechanism::kPerPage,
      fmt::format("cuMemcpyAsync per page (the gather kernel failed to load: {})", reason)};
  kLog.Warn("device copies of VRAM pages: {}", state.selection->mode);
}

void PlanDeviceCopies(const std::vector<DeviceCopy>& copies, const DeviceCopyLimits& limits,
                      DeviceCopyPlan* plan) {
  plan->copies.clear();
  plan->call_ends.clear();
  // Merge first, so that runs split only where they exceed the limit.
  std::vector<DeviceCopy>& out = plan->copies;
  for (const DeviceCopy& c : copies) {
    if (c.bytes == 0) continue;
    if (!out.empty() && out.back().src + out.back().bytes == c.src &&
        out.back().dst + out.back().bytes == c.dst) {
      out.back().bytes += c.bytes;
    } else {
      out.push_back(c);
    }
  }
  const uint64_t piece = std::max<uint64_t>(limits.max_copy_bytes, 1);
  if (std::any_of(out.begin(), out.end(),
                  [piece](const DeviceCopy& c) { return c.bytes > piece; })) {
    std::vector<DeviceCopy> merged;
    merged.swap(out);
    for (const DeviceCopy& c : merged) {
      for (uint64_t at = 0; at < c.bytes; at += piece) {
        out.push_back(DeviceCopy{c.dst + at, c.src + at, std::min(piece, c.bytes - at), c.op});
      }
    }
  }
  const size_t per_call = std::max<size_t>(limits.max_copies_per_call, 1);
  for (size_t end = per_call; end < out.size(); end += per_call) plan->call_ends.push_back(end);
  if (!out.empty()) plan->call_ends.push_back(out.size());
}

namespace {
std::atomic<uint64_t> total_batches{0}, total_split_batches{0}, total_bytes{0};
}  // namespace

DeviceLaneCounters DeviceLaneTotals() {
  return DeviceLaneCounters{total_batches.load(std::memory_order_relaxed),
                            total_split_batches.load(std::memory_order_relaxed),
                            total_bytes.load(std::memory_order_relaxed)};
}

void CountDeviceBatch(uint64_t bytes, bool split) {
  total_batches.fetch_add(1, std::memory_order_relaxed);
  if (split) total_split_batches.fetch_add(1, std::memory_order_relaxed);
  total_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

uint32_t DeviceLanesFor(uint64_t bytes, uint32_t lanes) {
  const uint64_t wanted = std::max<uint64_t>(1, bytes / kMinDeviceLaneBytes);
  return static_cast<uint32_t>(std::min<uint64_t>(std::max<uint32_t>(lanes, 1), wanted));
}

}  // namespace kvagent::agent

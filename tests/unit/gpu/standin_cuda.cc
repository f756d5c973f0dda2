// A stand-in for libcuda.so.1 on machines without a GPU, loaded by tests through
// KVAGENT_CUDA_DRIVER: one "device" whose memory is host memory (each cuMemAlloc a
// memfd mapped shared, so another process can open it), legacy CUDA IPC handles (the
// exporter's pid and descriptor: cuIpcOpenMemHandle maps /proc/PID/fd/FD), pointer
// queries that know the device ranges, streams that queue their work and run it in
// order only when synchronized (so a copier that reads a result, or reuses a buffer,
// before it waits sees the difference), cuMemcpyBatchAsync and the gather kernel
// (cuLaunchKernel reads the GatherCopy descriptors from "device" memory when its
// stream runs it). CUDA VMM allocations are memfds too, mapped into reserved ranges and
// exported as descriptors (cuMemExportToShareableHandle, below). Device memory is mapped
// PROT_NONE where the process sees it (the stand-in copies through a second mapping),
// so a host access to it faults as on a GPU. Used by
// tests/unit/gpu:device_lanes_test and the stand-in runs of tests/gpu/vram_test;
// tests/gpu runs the same code on a real GPU.
//
// Test hooks (extern "C", found with dlsym): the copies each stream ran, and a source
// address range that makes queueing a copy from it fail with CUDA_ERROR_ILLEGAL_ADDRESS;
// and, by environment, VMM imports refused (KVAGENT_STANDIN_REFUSE_VMM_IMPORT, below).
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "agent/gpu/gather_kernel.h"

namespace {

// CUresult values (cuda.h), spelled out: this file is the driver, not its user.
constexpr int kSuccess = 0;
constexpr int kInvalidValue = 1;
constexpr int kNotSupported = 801;
constexpr int kIllegalAddress = 700;
constexpr int kNotFound = 500;
constexpr int kInvalidHandle = 400;
constexpr int kOutOfMemory = 2;

// A device range of this process: allocated here (fd open), opened from a legacy
// IPC handle, or a CUDA VMM allocation mapped into a reserved range.
// The range the process sees (its pointers) is mapped PROT_NONE, as device memory is
// to a CPU: a host access to it faults here as it would on a GPU. The stand-in copies
// through `alias`, a second read-write mapping of the same memory only it knows.
struct Range {
  uint64_t size = 0;
  int fd = -1;          // allocated here: the memfd a handle names
  bool opened = false;  // mapped from another process's handle, or by cuMemMap
  uint64_t alias = 0;
};
// CUDA VMM allocations (cuMemCreate, or imported from a descriptor), by handle.
struct Allocation {
  int fd = -1;
  uint64_t size = 0;
};
std::map<uint64_t, Allocation>* allocations = new std::map<uint64_t, Allocation>;
uint64_t next_allocation = 1;
constexpr uint64_t kGranularity = 2 << 20;
constexpr char kVmmName[] = "kvagent-standin-vmm";
// By base address. Guarded by `mu`.
std::map<uint64_t, Range>* ranges = new std::map<uint64_t, Range>;

// The 64 bytes of a handle this stand-in makes.
struct Handle {
  char magic[8];  // "kvstandi"
  int32_t pid;
  int32_t fd;
  uint64_t size;
  uint64_t offset;  // always 0 (a handle is taken at the allocation's base)
  char unused[32];
};
static_assert(sizeof(Handle) == 64, "CU_IPC_HANDLE_SIZE");
struct IpcHandleBytes {  // CUipcMemHandle, passed by value
  char reserved[64];
};
constexpr char kMagic[8] = {'k', 'v', 's', 't', 'a', 'n', 'd', 'i'};

// The range holding `address` (under mu), or ranges->end().
std::map<uint64_t, Range>::iterator Find(uint64_t address) {
  auto it = ranges->upper_bound(address);
  if (it == ranges->begin()) return ranges->end();
  --it;
  return address < it->first + it->second.size ? it : ranges->end();
}

// Where the stand-in reads or writes `bytes` at `address` (under mu): the alias of a
// device range, host memory as it is; null when a device access runs past its range.
void* Host(uint64_t address, uint64_t bytes) {
  auto it = Find(address);
  if (it == ranges->end()) return reinterpret_cast<void*>(address);
  if (address + bytes > it->first + it->second.size) return nullptr;
  return reinterpret_cast<void*>(it->second.alias + (address - it->first));
}

// Maps `size` bytes of `fd` at `offset` as device memory (under mu): PROT_NONE where the
// process sees it (at `fixed` when not 0), read-write at an alias. False on failure.
bool MapDevice(int fd, uint64_t size, off_t offset, uint64_t fixed, uint64_t* visible) {
  void* seen = mmap(reinterpret_cast<void*>(fixed), size, PROT_NONE,
                    MAP_SHARED | (fixed != 0 ? MAP_FIXED : 0), fd, offset);
  if (seen == MAP_FAILED) return false;
  void* alias = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, offset);
  if (alias == MAP_FAILED) {
    munmap(seen, size);
    return false;
  }
  *visible = reinterpret_cast<uint64_t>(seen);
  Range& r = (*ranges)[*visible];
  r.size = size;
  r.alias = reinterpret_cast<uint64_t>(alias);
  return true;
}

struct Work {
  bool kernel = false;
  uint64_t dst = 0, src = 0, bytes = 0;  // a copy; for a kernel: descriptors and count
};

struct Stream {
  int id = 0;
  std::vector<Work> queued;
};

std::mutex mu;
int next_stream_id = 1;
std::vector<Stream*> live_streams;
// What ran: stream id and bytes, one entry per copy (a kernel's descriptors each count).
std::vector<std::pair<int, uint64_t>> ran;
uint64_t fail_begin = 0, fail_end = 0;
int module_tag = 0, function_tag = 0;

bool Fails(uint64_t src, uint64_t bytes) {
  return fail_end > fail_begin && src < fail_end && src + bytes > fail_begin;
}

int Queue(void* stream, Work work) {
  if (stream == nullptr) return kInvalidValue;
  std::lock_guard<std::mutex> lock(mu);
  if (!work.kernel && Fails(work.src, work.bytes)) return kIllegalAddress;
  if (!work.kernel && (Host(work.src, work.bytes) == nullptr || Host(work.dst, work.bytes) == nullptr)) {
    return kIllegalAddress;
  }
  static_cast<Stream*>(stream)->queued.push_back(work);
  return kSuccess;
}

}  // namespace

extern "C" {

int cuGetErrorName(int error, const char** name) {
  switch (error) {
    case kSuccess: *name = "CUDA_SUCCESS"; return kSuccess;
    case kInvalidValue: *name = "CUDA_ERROR_INVALID_VALUE"; return kSuccess;
    case kIllegalAddress: *name = "CUDA_ERROR_ILLEGAL_ADDRESS"; return kSuccess;
    case kNotSupported: *name = "CUDA_ERROR_NOT_SUPPORTED"; return kSuccess;
    case kNotFound: *name = "CUDA_ERROR_NOT_FOUND"; return kSuccess;
    case kInvalidHandle: *name = "CUDA_ERROR_INVALID_HANDLE"; return kSuccess;
    case kOutOfMemory: *name = "CUDA_ERROR_OUT_OF_MEMORY"; return kSuccess;
  }
  return kInvalidValue;
}
int cuGetErrorString(int error, const char** text) {
  *text = error == kIllegalAddress ? "an illegal memory access (stand-in driver)"
                                   : "(stand-in driver)";
  return kSuccess;
}
int cuInit(unsigned) { return kSuccess; }
int cuDriverGetVersion(int* version) {
  *version = 12080;
  return kSuccess;
}
int cuDeviceGetCount(int* count) {
  *count = 1;
  return kSuccess;
}
int cuDeviceGet(int* device, int ordinal) {
  if (ordinal != 0) return kInvalidValue;
  *device = 0;
  return kSuccess;
}
int cuDeviceGetName(char* name, int length, int) {
  std::strncpy(name, "kvagent stand-in device", static_cast<size_t>(length));
  return kSuccess;
}
int cuDeviceTotalMem_v2(size_t* bytes, int) {
  *bytes = size_t{1} << 30;
  return kSuccess;
}
int cuDeviceGetPCIBusId(char* id, int length, int) {
  std::strncpy(id, "0000:00:00.0", static_cast<size_t>(length));
  return kSuccess;
}
int cuDeviceGetAttribute(int* value, int, int) {
  *value = 9;  // compute capability 9.0 for both attributes asked
  return kSuccess;
}
int cuDevicePrimaryCtxRetain(void** context, int) {
  static int tag = 0;
  *context = &tag;
  return kSuccess;
}
int cuDevicePrimaryCtxRelease_v2(int) { return kSuccess; }
int cuCtxSetCurrent(void*) { return kSuccess; }

int cuStreamCreate(void** stream, unsigned) {
  std::lock_guard<std::mutex> lock(mu);
  auto* s = new Stream;
  s->id = next_stream_id++;
  live_streams.push_back(s);
  *stream = s;
  return kSuccess;
}
int cuStreamDestroy_v2(void* stream) {
  std::lock_guard<std::mutex> lock(mu);
  auto* s = static_cast<Stream*>(stream);
  for (auto it = live_streams.begin(); it != live_streams.end(); ++it) {
    if (*it == s) {
      live_streams.erase(it);
      delete s;
      return kSuccess;
    }
  }
  return kInvalidValue;
}
int cuStreamSynchronize(void* stream) {
  if (stream == nullptr) return kInvalidValue;
  std::lock_guard<std::mutex> lock(mu);
  auto* s = static_cast<Stream*>(stream);
  int result = kSuccess;
  for (const Work& w : s->queued) {
    if (!w.kernel) {
      std::memcpy(Host(w.dst, w.bytes), Host(w.src, w.bytes), w.bytes);
      ran.emplace_back(s->id, w.bytes);
      continue;
    }
    // The kernel reads its descriptors from device memory, and copies device memory.
    const auto* d = static_cast<const kvagent::agent::GatherCopy*>(
        Host(w.src, w.bytes * sizeof(kvagent::agent::GatherCopy)));
    if (d == nullptr) {
      result = kIllegalAddress;
      continue;
    }
    for (uint64_t i = 0; i < w.bytes; ++i) {
      void* to = Host(d[i].dst, d[i].bytes);
      const void* from = Host(d[i].src, d[i].bytes);
      if (to == nullptr || from == nullptr) {
        result = kIllegalAddress;
        continue;
      }
      std::memcpy(to, from, d[i].bytes);
      ran.emplace_back(s->id, d[i].bytes);
    }
  }
  s->queued.clear();
  return result;
}

int cuMemcpy(uint64_t dst, uint64_t src, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu);
  void* to = Host(dst, bytes);
  const void* from = Host(src, bytes);
  if (to == nullptr || from == nullptr) return kIllegalAddress;
  std::memcpy(to, from, bytes);
  return kSuccess;
}
int cuMemcpyAsync(uint64_t dst, uint64_t src, size_t bytes, void* stream) {
  return Queue(stream, Work{false, dst, src, bytes});
}
// CUDA 12.8's form (names the failing copy).
int cuMemcpyBatchAsync(uint64_t* dsts, uint64_t* srcs, size_t* sizes, size_t count, void*,
                       size_t*, size_t, size_t* fail_index, void* stream) {
  for (size_t i = 0; i < count; ++i) {
    if (int r = Queue(stream, Work{false, dsts[i], srcs[i], sizes[i]}); r != kSuccess) {
      *fail_index = i;
      return r;
    }
  }
  return kSuccess;
}

int cuMemAlloc_v2(uint64_t* address, size_t bytes) {
  if (bytes == 0) return kInvalidValue;
  const uint64_t size = (bytes + 4095) / 4096 * 4096;
  const int fd = memfd_create("kvagent-standin-vram", MFD_CLOEXEC);
  if (fd < 0) return kOutOfMemory;
  std::lock_guard<std::mutex> lock(mu);
  if (ftruncate(fd, static_cast<off_t>(size)) != 0 || !MapDevice(fd, size, 0, 0, address)) {
    close(fd);
    return kOutOfMemory;
  }
  (*ranges)[*address].fd = fd;
  return kSuccess;
}
int cuMemFree_v2(uint64_t address) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = ranges->find(address);
  if (it == ranges->end() || it->second.opened) return kInvalidValue;
  munmap(reinterpret_cast<void*>(it->first), it->second.size);
  munmap(reinterpret_cast<void*>(it->second.alias), it->second.size);
  close(it->second.fd);
  ranges->erase(it);
  return kSuccess;
}
int cuIpcGetMemHandle(IpcHandleBytes* out, uint64_t address) {
  std::lock_guard<std::mutex> lock(mu);
  // As CUDA: the handle is of an allocation, taken at its base.
  auto it = ranges->find(address);
  if (it == ranges->end() || it->second.opened) return kInvalidValue;
  Handle h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.pid = getpid();
  h.fd = it->second.fd;
  h.size = it->second.size;
  h.offset = 0;
  std::memcpy(out->reserved, &h, sizeof h);
  return kSuccess;
}
int cuIpcOpenMemHandle_v2(uint64_t* address, IpcHandleBytes handle, unsigned) {
  Handle h;
  std::memcpy(&h, handle.reserved, sizeof h);
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0 || h.offset >= h.size) return kInvalidHandle;
  if (h.pid == getpid()) return kInvalidValue;  // as CUDA: not one's own handles
  const std::string path = "/proc/" + std::to_string(h.pid) + "/fd/" + std::to_string(h.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return kInvalidHandle;  // the exporter is gone
  std::lock_guard<std::mutex> lock(mu);
  uint64_t base = 0;
  const bool mapped = MapDevice(fd, h.size, 0, 0, &base);
  close(fd);
  if (!mapped) return kInvalidHandle;
  (*ranges)[base].opened = true;
  *address = base + h.offset;
  return kSuccess;
}
int cuIpcCloseMemHandle(uint64_t address) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = Find(address);
  if (it == ranges->end() || !it->second.opened) return kInvalidValue;
  munmap(reinterpret_cast<void*>(it->first), it->second.size);
  munmap(reinterpret_cast<void*>(it->second.alias), it->second.size);
  ranges->erase(it);
  return kSuccess;
}
int cuMemGetAddressRange_v2(uint64_t* base, size_t* size, uint64_t address) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = Find(address);
  if (it == ranges->end()) return kNotFound;
  if (base != nullptr) *base = it->first;
  if (size != nullptr) *size = it->second.size;
  return kSuccess;
}
// CU_POINTER_ATTRIBUTE_MEMORY_TYPE (2) only: CU_MEMORYTYPE_DEVICE (2) for device
// ranges; memory CUDA does not know is CUDA_ERROR_INVALID_VALUE, as the driver says.
int cuPointerGetAttribute(void* data, int attribute, uint64_t address) {
  if (attribute != 2) return kNotSupported;
  std::lock_guard<std::mutex> lock(mu);
  if (Find(address) == ranges->end()) return kInvalidValue;
  *static_cast<unsigned*>(data) = 2;
  return kSuccess;
}
int cuMemHostAlloc(void** address, size_t bytes, unsigned) {
  *address = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  return *address == nullptr ? kInvalidValue : kSuccess;
}
int cuMemFreeHost(void* address) {
  std::free(address);
  return kSuccess;
}

int cuModuleLoadData(void** module, const void* image) {
  if (image == nullptr) return kInvalidValue;
  *module = &module_tag;
  return kSuccess;
}
int cuModuleGetFunction(void** function, void* module, const char* name) {
  if (module != &module_tag || std::strcmp(name, kvagent::agent::kGatherKernelName) != 0) {
    return kNotFound;
  }
  *function = &function_tag;
  return kSuccess;
}
int cuModuleUnload(void*) { return kSuccess; }
// The gather kernel: params are (GatherCopy* descriptors, unsigned long long count);
// grid = count blocks, one per descriptor, as the copier launches it.
int cuLaunchKernel(void* function, unsigned grid, unsigned, unsigned, unsigned, unsigned,
                   unsigned, unsigned, void* stream, void** params, void**) {
  if (function != &function_tag || params == nullptr) return kInvalidValue;
  const uint64_t descriptors = *static_cast<uint64_t*>(params[0]);
  const auto count = *static_cast<unsigned long long*>(params[1]);
  if (count != grid) return kInvalidValue;
  return Queue(stream, Work{true, 0, descriptors, count});
}

// CUDA VMM: POSIX descriptors only.
// Host memory is always "pinned" here.
int cuMemHostRegister_v2(void*, size_t, unsigned) { return kSuccess; }
int cuMemHostUnregister(void*) { return kSuccess; }
// The first fields of CUmemAllocationProp (the rest the caller zeroes).
struct AllocationProp {
  int type;                  // CU_MEM_ALLOCATION_TYPE_PINNED = 1
  int requested_handle_types;  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
  int location_type;         // CU_MEM_LOCATION_TYPE_DEVICE = 1
  int location_id;
};
int cuMemGetAllocationGranularity(size_t* granularity, const void*, int) {
  *granularity = kGranularity;
  return kSuccess;
}
int cuMemCreate(uint64_t* handle, size_t size, const AllocationProp* prop, unsigned long long) {
  if (size == 0 || size % kGranularity != 0 || prop == nullptr || prop->location_id != 0) {
    return kInvalidValue;
  }
  const int fd = memfd_create(kVmmName, MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (fd >= 0) close(fd);
    return kOutOfMemory;
  }
  std::lock_guard<std::mutex> lock(mu);
  *handle = next_allocation++;
  (*allocations)[*handle] = Allocation{fd, size};
  return kSuccess;
}
// The shareable handle: not the memfd itself (the agent rightly refuses a tmpfs file
// as device memory) but an eventfd whose count names the exporter's pid and memfd
// (pid << 32 | fd), which the importer reads from /proc/self/fdinfo and opens through
// /proc/PID/fd. Unlike a real one it keeps the memory only while the exporter holds
// the allocation.
int cuMemExportToShareableHandle(void* out, uint64_t handle, int type, unsigned long long) {
  if (type != 1) return kNotSupported;
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations->find(handle);
  if (it == allocations->end()) return kInvalidValue;
  const uint64_t name = (static_cast<uint64_t>(getpid()) << 32) | static_cast<uint32_t>(it->second.fd);
  const int fd = eventfd(0, EFD_CLOEXEC);
  if (fd < 0) return kOutOfMemory;
  if (write(fd, &name, sizeof name) != sizeof name) {
    close(fd);
    return kOutOfMemory;
  }
  *static_cast<int*>(out) = fd;
  return kSuccess;
}
// Only descriptors this stand-in exported are shareable handles. Test hook: with
// KVAGENT_STANDIN_REFUSE_VMM_IMPORT=1 in its environment a process refuses every
// import as the driver does a handle it cannot use (CUDA_ERROR_NOT_SUPPORTED).
int cuMemImportFromShareableHandle(uint64_t* handle, void* os_handle, int type) {
  if (type != 1) return kNotSupported;
  if (const char* refuse = std::getenv("KVAGENT_STANDIN_REFUSE_VMM_IMPORT");
      refuse != nullptr && std::strcmp(refuse, "1") == 0) {
    return kNotSupported;
  }
  const int fd = static_cast<int>(reinterpret_cast<uintptr_t>(os_handle));
  char link[256] = {};
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = readlink(path.c_str(), link, sizeof link - 1);
  if (n <= 0 || std::string(link, static_cast<size_t>(n)) != "anon_inode:[eventfd]") {
    return kInvalidHandle;
  }
  uint64_t name = 0;
  {
    std::ifstream info("/proc/self/fdinfo/" + std::to_string(fd));
    std::string line;
    while (std::getline(info, line)) {
      if (line.rfind("eventfd-count:", 0) == 0) name = std::stoull(line.substr(14), nullptr, 16);
    }
  }
  const std::string memory = "/proc/" + std::to_string(name >> 32) + "/fd/" +
                             std::to_string(static_cast<uint32_t>(name));
  const int own = name == 0 ? -1 : open(memory.c_str(), O_RDWR | O_CLOEXEC);
  if (own < 0) return kInvalidHandle;
  char target[256] = {};
  const ssize_t m = readlink(("/proc/self/fd/" + std::to_string(own)).c_str(), target, sizeof target - 1);
  const off_t size = lseek(own, 0, SEEK_END);
  if (m <= 0 || std::string(target, static_cast<size_t>(m)).find(kVmmName) == std::string::npos ||
      size <= 0) {
    close(own);
    return kInvalidHandle;
  }
  std::lock_guard<std::mutex> lock(mu);
  *handle = next_allocation++;
  (*allocations)[*handle] = Allocation{own, static_cast<uint64_t>(size)};
  return kSuccess;
}
int cuMemGetAllocationPropertiesFromHandle(AllocationProp* prop, uint64_t handle) {
  std::lock_guard<std::mutex> lock(mu);
  if (allocations->count(handle) == 0) return kInvalidValue;
  *prop = AllocationProp{1, 1, 1, 0};
  return kSuccess;
}
int cuMemRelease(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations->find(handle);
  if (it == allocations->end()) return kInvalidValue;
  close(it->second.fd);
  allocations->erase(it);
  return kSuccess;
}
int cuMemAddressReserve(uint64_t* address, size_t size, size_t, uint64_t, unsigned long long) {
  void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return kOutOfMemory;
  *address = reinterpret_cast<uint64_t>(p);
  return kSuccess;
}
int cuMemAddressFree(uint64_t address, size_t size) {
  return munmap(reinterpret_cast<void*>(address), size) == 0 ? kSuccess : kInvalidValue;
}
int cuMemMap(uint64_t address, size_t size, size_t offset, uint64_t handle, unsigned long long) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations->find(handle);
  if (it == allocations->end()) return kInvalidHandle;
  if (offset + size > it->second.size) return kInvalidValue;
  uint64_t mapped = 0;
  if (!MapDevice(it->second.fd, size, static_cast<off_t>(offset), address, &mapped)) {
    return kOutOfMemory;
  }
  (*ranges)[mapped].opened = true;
  return kSuccess;
}
int cuMemSetAccess(uint64_t address, size_t, const void*, size_t count) {
  std::lock_guard<std::mutex> lock(mu);
  return count == 1 && ranges->count(address) == 1 ? kSuccess : kInvalidValue;
}
int cuMemUnmap(uint64_t address, size_t size) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = ranges->find(address);
  if (it == ranges->end() || it->second.fd >= 0) return kInvalidValue;
  // Back to a reservation (cuMemAddressFree releases it).
  mmap(reinterpret_cast<void*>(address), size, PROT_NONE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  munmap(reinterpret_cast<void*>(it->second.alias), it->second.size);
  ranges->erase(it);
  return kSuccess;
}

// Test hooks.
void kvagent_standin_fail_sources(uint64_t begin, uint64_t end) {
  std::lock_guard<std::mutex> lock(mu);
  fail_begin = begin;
  fail_end = end;
}
// Copies each stream ran since the last call: fills up to `max` (stream id, bytes)
// pairs, returns how many there were, and forgets them.
size_t kvagent_standin_take_ran(int* streams, uint64_t* bytes, size_t max) {
  std::lock_guard<std::mutex> lock(mu);
  const size_t n = ran.size();
  for (size_t i = 0; i < n && i < max; ++i) {
    streams[i] = ran[i].first;
    bytes[i] = ran[i].second;
  }
  ran.clear();
  return n;
}
// Work queued on streams and not yet run (a copier that forgot to wait leaves some).
size_t kvagent_standin_pending() {
  std::lock_guard<std::mutex> lock(mu);
  size_t n = 0;
  for (const Stream* s : live_streams) n += s->queued.size();
  return n;
}
size_t kvagent_standin_live_streams() {
  std::lock_guard<std::mutex> lock(mu);
  return live_streams.size();
}

}  // extern "C"

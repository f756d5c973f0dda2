// A stand-in for libcuda.so.1 on machines without a GPU, loaded by tests through
// KVAGENT_CUDA_DRIVER: one "device" whose memory is host memory, streams that queue
// their work and run it in order only when synchronized (so a copier that reads a
// result, or reuses a buffer, before it waits sees the difference), cuMemcpyBatchAsync
// and the gather kernel (cuLaunchKernel reads the GatherCopy descriptors from "device"
// memory when its stream runs it). Everything else a driver has answers
// CUDA_ERROR_NOT_SUPPORTED. Only the device copy path's code runs against it
// (tests/unit/gpu:device_lanes_test); tests/gpu runs the same code on a real GPU.
//
// Test hooks (extern "C", found with dlsym): the copies each stream ran, and a source
// address range that makes queueing a copy from it fail with CUDA_ERROR_ILLEGAL_ADDRESS.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "agent/gpu/gather_kernel.h"

namespace {

// CUresult values (cuda.h), spelled out: this file is the driver, not its user.
constexpr int kSuccess = 0;
constexpr int kInvalidValue = 1;
constexpr int kNotSupported = 801;
constexpr int kIllegalAddress = 700;
constexpr int kNotFound = 500;

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
  for (const Work& w : s->queued) {
    if (!w.kernel) {
      std::memcpy(reinterpret_cast<void*>(w.dst), reinterpret_cast<const void*>(w.src), w.bytes);
      ran.emplace_back(s->id, w.bytes);
      continue;
    }
    const auto* d = reinterpret_cast<const kvagent::agent::GatherCopy*>(w.src);
    for (uint64_t i = 0; i < w.bytes; ++i) {
      std::memcpy(reinterpret_cast<void*>(d[i].dst), reinterpret_cast<const void*>(d[i].src),
                  d[i].bytes);
      ran.emplace_back(s->id, d[i].bytes);
    }
  }
  s->queued.clear();
  return kSuccess;
}

int cuMemcpy(uint64_t dst, uint64_t src, size_t bytes) {
  std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
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
  void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (p == nullptr) return kInvalidValue;
  *address = reinterpret_cast<uint64_t>(p);
  return kSuccess;
}
int cuMemFree_v2(uint64_t address) {
  std::free(reinterpret_cast<void*>(address));
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

// Not used by the copy path: present because the loader requires them.
int cuIpcOpenMemHandle_v2(uint64_t*, const void*, unsigned) { return kNotSupported; }
int cuIpcCloseMemHandle(uint64_t) { return kNotSupported; }
int cuIpcGetMemHandle(void*, uint64_t) { return kNotSupported; }
int cuMemGetAddressRange_v2(uint64_t*, size_t*, uint64_t) { return kNotSupported; }
int cuMemHostRegister_v2(void*, size_t, unsigned) { return kNotSupported; }
int cuMemHostUnregister(void*) { return kNotSupported; }
int cuPointerGetAttribute(void*, int, uint64_t) { return kInvalidValue; }
int cuMemImportFromShareableHandle(void*, void*, int) { return kNotSupported; }
int cuMemGetAllocationPropertiesFromHandle(void*, uint64_t) { return kNotSupported; }
int cuMemGetAllocationGranularity(size_t*, const void*, int) { return kNotSupported; }
int cuMemAddressReserve(uint64_t*, size_t, size_t, uint64_t, unsigned long long) {
  return kNotSupported;
}
int cuMemMap(uint64_t, size_t, size_t, uint64_t, unsigned long long) { return kNotSupported; }
int cuMemSetAccess(uint64_t, size_t, const void*, size_t) { return kNotSupported; }
int cuMemUnmap(uint64_t, size_t) { return kNotSupported; }
int cuMemAddressFree(uint64_t, size_t) { return kNotSupported; }
int cuMemRelease(uint64_t) { return kNotSupported; }
int cuMemCreate(uint64_t*, size_t, const void*, unsigned long long) { return kNotSupported; }
int cuMemExportToShareableHandle(void*, uint64_t, int, unsigned long long) {
  return kNotSupported;
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

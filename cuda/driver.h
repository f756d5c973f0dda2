// CudaDriver is the CUDA driver API loaded at run time with dlopen("libcuda.so.1"), so
// kvagentd builds against the CUDA headers only and starts on machines without a GPU.
// Used by registry/ (CUDA IPC and CUDA VMM import of VRAM regions) and agent/staging
// (pinned bounce buffers, device copies).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/unique_fd.h"

struct CUctx_st;     // CUcontext, kept out of this header (cuda.h stays in the .cc)
struct CUstream_st;  // CUstream
struct CUmod_st;     // CUmodule
struct CUfunc_st;    // CUfunction

namespace kvagent::cuda {

struct CudaDeviceInfo {
  int ordinal = 0;
  std::string name;        // "NVIDIA H100 80GB HBM3"
  std::string pci_bus_id;  // "0000:18:00.0"
  uint64_t total_bytes = 0;
};

// A CUDA VMM allocation mapped into this process: a reserved virtual address range
// with the allocation mapped at its start, read-write for `device`. Release it with
// CudaDriver::ReleaseVmm (registry/cuda_vmm_mapping does, RAII).
struct CudaVmmRange {
  uint64_t address = 0;         // first byte in this process (UVA); 0 when none is reserved
  uint64_t reserved_bytes = 0;  // the address range: the bytes asked, rounded up to granularity
  uint64_t mapped_bytes = 0;    // mapped at `address`: reserved_bytes, or 0 when not mapped
  uint64_t granularity = 0;     // cuMemGetAllocationGranularity (minimum)
  uint64_t allocation = 0;    // CUmemGenericAllocationHandle, released with the range
  int device = 0;
};

// What CreateVmmExportable makes: the exporter's mapping and the POSIX descriptor to
// hand over (ShareDeviceMemory). Closing the descriptor does not free the memory.
struct CudaVmmExportable {
  UniqueFd fd;
  CudaVmmRange range;
};

// The optional driver entry points of batched device copies (agent/paths/device_batch
// chooses among them at run time); a driver without them still loads.
struct CudaCopyEntryPoints {
  // The exported name of cuMemcpyBatchAsync: "cuMemcpyBatchAsync_v2" (CUDA 13's form,
  // preferred) or "cuMemcpyBatchAsync" (CUDA 12.8's, which also names the failing
  // copy); "" when the driver has neither (older than 12.8).
  std::string batch_copy;
  // cuModuleLoadData, cuModuleGetFunction, cuModuleUnload, cuLaunchKernel and
  // cuDeviceGetAttribute all resolved: a kernel image can be loaded and launched.
  bool kernel_launch = false;
};

class CudaDriver {
 public:
  static constexpr const char* kLibraryName = "libcuda.so.1";
  // A path to dlopen instead of kLibraryName (tests, unusual installs).
  static constexpr const char* kLibraryEnv = "KVAGENT_CUDA_DRIVER";
  static constexpr size_t kIpcHandleBytes = 64;  // CU_IPC_HANDLE_SIZE

  // Loads the driver once per process (later calls return the first result):
  // FAILED_PRECONDITION naming the library when it is absent, a symbol when the
  // driver is too old, or cuInit's error. Never unloaded.
  static absl::StatusOr<CudaDriver*> Load();

  // Checks a CUDA IPC source without a driver: the handle is 64 bytes, the device
  // ordinal is >= 0 and, when device_count >= 0, below it. INVALID_ARGUMENT naming
  // `entry` ("region 'x': ...").
  static absl::Status ValidateIpcSource(const std::string& entry, size_t handle_bytes, int device,
                                        int device_count);

  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  const std::string& library() const { return library_; }
  int driver_version() const { return driver_version_; }  // 12040 for 12.4
  int device_count() const { return device_count_; }
  absl::StatusOr<std::vector<CudaDeviceInfo>> Devices() const;
  // INVALID_ARGUMENT when `ordinal` is not a device of this machine.
  absl::Status CheckDevice(int ordinal, std::string_view entry) const;

  // Retains the device's primary context (once per process; the engine's CUDA
  // runtime uses the same one) and makes it current on the calling thread.
  absl::Status MakeCurrent(int ordinal);

  // Opens a cudaIpcGetMemHandle handle of device `ordinal`; returns the base
  // device pointer of the exporter's allocation in this process (UVA).
  absl::StatusOr<uint64_t> OpenIpcHandle(std::string_view handle, int ordinal,
                                         std::string_view entry);
  absl::Status CloseIpcHandle(uint64_t dptr, int ordinal);
  // Bytes from `dptr` to the end of the device allocation that holds it.
  absl::StatusOr<uint64_t> AllocationSize(uint64_t dptr);

  // Copies between any two UVA addresses (device or host), synchronously. Runs in
  // the context current on this thread; device 0's when the thread has none.
  absl::Status Copy(uint64_t dst, uint64_t src, uint64_t bytes);
  // What an engine does to share VRAM (the GPU tests play the engine): allocate on
  // the current context's device and export a 64-byte IPC handle.
  absl::StatusOr<uint64_t> MemAlloc(uint64_t bytes);
  absl::Status MemFree(uint64_t dptr);
  absl::StatusOr<std::string> IpcGetHandle(uint64_t dptr);

  // Imports a CUDA VMM allocation an engine exported as a POSIX file descriptor
  // (cuMemExportToShareableHandle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) and maps
  // its first `bytes` (rounded up to the allocation granularity) read-write for
  // `device` in a fresh address range. `fd` stays the caller's. Errors name `entry`
  // ("region 'x': ..."), the call, the driver's text and the fix: INVALID_ARGUMENT for
  // a device ordinal out of range, a descriptor that is not such a handle, an
  // allocation on another device or smaller than `bytes`; RESOURCE_EXHAUSTED when the
  // address range cannot be reserved; FAILED_PRECONDITION otherwise. Nothing stays
  // imported or reserved on failure.
  absl::StatusOr<CudaVmmRange> ImportVmm(int fd, int device, uint64_t bytes,
                                         std::string_view entry);
  // Unmaps the range, frees its addresses and releases its allocation handle (the
  // memory itself lives on while the exporter or another importer holds it). Tries
  // all three; returns the first failure.
  absl::Status ReleaseVmm(const CudaVmmRange& range);
  // What an engine does to share VRAM by VMM (the GPU tests play the engine):
  // cuMemCreate of `bytes` (rounded up to granularity) on `device`, exportable as a
  // POSIX descriptor, mapped read-write here. Free with ReleaseVmm(result.range).
  absl::StatusOr<CudaVmmExportable> CreateVmmExportable(int device, uint64_t bytes);
  // The asynchronous form on a stream, for host staging.
  absl::Status CopyAsync(uint64_t dst, uint64_t src, uint64_t bytes, CUstream_st* stream);
  absl::StatusOr<CUstream_st*> CreateStream(int ordinal);  // non-blocking stream
  absl::Status SynchronizeStream(CUstream_st* stream);
  absl::Status DestroyStream(CUstream_st* stream);
  // Page-locks host memory for fast device copies (counts against RLIMIT_MEMLOCK).
  absl::Status HostRegister(void* address, uint64_t bytes, std::string_view entry);
  absl::Status HostUnregister(void* address);
  // Allocates page-locked host memory (staging bounce buffers); FAILED_PRECONDITION
  // naming `entry` and the memlock fixes. Free with HostFree.
  absl::StatusOr<void*> HostAlloc(uint64_t bytes, std::string_view entry);
  absl::Status HostFree(void* address);
  // True when `address` is device memory (CU_POINTER_ATTRIBUTE_MEMORY_TYPE).
  absl::StatusOr<bool> IsDevicePointer(uint64_t address);

  // Which optional copy entry points `lookup` (dlsym on the driver; a test passes a
  // table) resolves, by their exported names.
  static CudaCopyEntryPoints FindCopyEntryPoints(
      const std::function<void*(const char*)>& lookup);
  const CudaCopyEntryPoints& copy_entry_points() const { return copy_entry_points_; }
  // Device `ordinal`'s compute capability as major * 10 + minor (90 for an H100/H200).
  absl::StatusOr<int> ComputeCapability(int ordinal) const;
  // One cuMemcpyBatchAsync of `count` copies (dsts[i] <- srcs[i], sizes[i] bytes, in
  // any order among themselves, in stream order as a whole; sources read in stream
  // order). FAILED_PRECONDITION when the driver lacks it. On failure `*failed_index`
  // is the copy the driver named, or `count` when it names none (CUDA 13's form).
  absl::Status CopyBatchAsync(uint64_t* dsts, uint64_t* srcs, uint64_t* sizes, size_t count,
                              CUstream_st* stream, size_t* failed_index);
  // A kernel module from a cubin, PTX or fatbin image (cuModuleLoadData), in the
  // context current on this thread; its functions launch on that context's streams.
  absl::StatusOr<CUmod_st*> LoadModule(const void* image);
  absl::StatusOr<CUfunc_st*> ModuleFunction(CUmod_st* module, const char* name);
  absl::Status UnloadModule(CUmod_st* module);
  // cuLaunchKernel with a 1-D grid and block, no dynamic shared memory.
  absl::Status LaunchKernel(CUfunc_st* function, unsigned grid, unsigned block,
                            CUstream_st* stream, void** params);

  // "CUDA_ERROR_X: <driver's text>" for a CUresult.
  std::string ErrorText(int result) const;

 private:
  struct Api;  // resolved entry points, defined in the .cc
  CudaDriver() = default;
  static absl::StatusOr<CudaDriver*> LoadFrom(const std::string& library);
  absl::Status EnsureContext();
  absl::Status Check(int result, std::string_view call) const;

  std::string library_;
  const Api* api_ = nullptr;
  int driver_version_ = 0;
  int device_count_ = 0;
  CudaCopyEntryPoints copy_entry_points_;
  absl::Mutex mu_;
  absl::flat_hash_map<int, CUctx_st*> contexts_ ABSL_GUARDED_BY(mu_);  // retained primaries
  // One process may open a handle once: several regions of one engine allocation
  // (and a peer's regions of one allocation) share the opened pointer, counted.
  struct OpenedIpc {
    uint64_t dptr = 0;
    int references = 0;
  };
  absl::Mutex ipc_mu_;
  absl::flat_hash_map<std::string, OpenedIpc> opened_ ABSL_GUARDED_BY(ipc_mu_);
  absl::flat_hash_map<uint64_t, std::string> opened_by_pointer_ ABSL_GUARDED_BY(ipc_mu_);
};

}  // namespace kvagent::cuda

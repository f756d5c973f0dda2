#include "cuda/driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>

#include "absl/status/status.h"
#include "base/format.h"
#include "base/status_macros.h"
#include "cuda.h"
#include "fmt/format.h"

namespace kvagent::cuda {

// The driver entry points, resolved by their ABI names: cuda.h #defines many API
// names to versioned symbols (cuIpcOpenMemHandle -> cuIpcOpenMemHandle_v2), and
// dlsym needs the exported name. decltype of the macro'd name gives the matching
// signature. The per-thread-default-stream (_ptds/_ptsz) variants are not used.
struct CudaDriver::Api {
  decltype(&::cuGetErrorName) get_error_name = nullptr;
  decltype(&::cuGetErrorString) get_error_string = nullptr;
  decltype(&::cuInit) init = nullptr;
  decltype(&::cuDriverGetVersion) driver_get_version = nullptr;
  decltype(&::cuDeviceGetCount) device_get_count = nullptr;
  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDeviceGetName) device_get_name = nullptr;
  decltype(&::cuDeviceTotalMem) device_total_mem = nullptr;
  decltype(&::cuDeviceGetPCIBusId) device_get_pci_bus_id = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) primary_ctx_retain = nullptr;
  decltype(&::cuDevicePrimaryCtxRelease) primary_ctx_release = nullptr;
  decltype(&::cuCtxSetCurrent) ctx_set_current = nullptr;
  decltype(&::cuIpcOpenMemHandle) ipc_open_mem_handle = nullptr;
  decltype(&::cuIpcCloseMemHandle) ipc_close_mem_handle = nullptr;
  decltype(&::cuMemGetAddressRange) mem_get_address_range = nullptr;
  decltype(&::cuMemcpy) mem_copy = nullptr;
  decltype(&::cuMemcpyAsync) mem_copy_async = nullptr;
  decltype(&::cuStreamCreate) stream_create = nullptr;
  decltype(&::cuStreamSynchronize) stream_synchronize = nullptr;
  decltype(&::cuStreamDestroy) stream_destroy = nullptr;
  decltype(&::cuMemHostRegister) mem_host_register = nullptr;
  decltype(&::cuMemHostUnregister) mem_host_unregister = nullptr;
  decltype(&::cuPointerGetAttribute) pointer_get_attribute = nullptr;
  decltype(&::cuMemAlloc) mem_alloc = nullptr;
  decltype(&::cuMemFree) mem_free = nullptr;
  decltype(&::cuIpcGetMemHandle) ipc_get_mem_handle = nullptr;
  decltype(&::cuMemHostAlloc) mem_host_alloc = nullptr;
  decltype(&::cuMemFreeHost) mem_free_host = nullptr;
  // CUDA VMM (since CUDA 10.2): importing engines' allocations, and creating
  // exportable ones where this process plays the engine (GPU tests).
  decltype(&::cuMemImportFromShareableHandle) mem_import_from_shareable_handle = nullptr;
  decltype(&::cuMemGetAllocationPropertiesFromHandle) mem_get_allocation_properties = nullptr;
  decltype(&::cuMemGetAllocationGranularity) mem_get_allocation_granularity = nullptr;
  decltype(&::cuMemAddressReserve) mem_address_reserve = nullptr;
  decltype(&::cuMemMap) mem_map = nullptr;
  decltype(&::cuMemSetAccess) mem_set_access = nullptr;
  decltype(&::cuMemUnmap) mem_unmap = nullptr;
  decltype(&::cuMemAddressFree) mem_address_free = nullptr;
  decltype(&::cuMemRelease) mem_release = nullptr;
  decltype(&::cuMemCreate) mem_create = nullptr;
  decltype(&::cuMemExportToShareableHandle) mem_export_to_shareable_handle = nullptr;
  // Optional (CudaCopyEntryPoints): batched copies and kernel launches. The two
  // cuMemcpyBatchAsync forms are spelled out: which one cuda.h's name maps to depends
  // on the headers' version, the driver may export either.
  using BatchCopy = CUresult (*)(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes,
                                 size_t count, CUmemcpyAttributes* attrs, size_t* attrs_idxs,
                                 size_t num_attrs, CUstream stream);
  using BatchCopyWithFailIndex = CUresult (*)(CUdeviceptr* dsts, CUdeviceptr* srcs,
                                              size_t* sizes, size_t count,
                                              CUmemcpyAttributes* attrs, size_t* attrs_idxs,
                                              size_t num_attrs, size_t* fail_idx,
                                              CUstream stream);
  BatchCopy batch_copy = nullptr;                               // cuMemcpyBatchAsync_v2
  BatchCopyWithFailIndex batch_copy_with_fail_index = nullptr;  // cuMemcpyBatchAsync
  decltype(&::cuModuleLoadData) module_load_data = nullptr;
  decltype(&::cuModuleGetFunction) module_get_function = nullptr;
  decltype(&::cuModuleUnload) module_unload = nullptr;
  decltype(&::cuLaunchKernel) launch_kernel = nullptr;
  decltype(&::cuDeviceGetAttribute) device_get_attribute = nullptr;
};

namespace {
constexpr char kBatchCopySymbol[] = "cuMemcpyBatchAsync_v2";
constexpr char kBatchCopyWithFailIndexSymbol[] = "cuMemcpyBatchAsync";
constexpr const char* kKernelLaunchSymbols[] = {"cuModuleLoadData", "cuModuleGetFunction",
                                                "cuModuleUnload", "cuLaunchKernel",
                                                "cuDeviceGetAttribute"};
static_assert(sizeof(CUdeviceptr) == sizeof(uint64_t) && sizeof(size_t) == sizeof(uint64_t));
}  // namespace

namespace {

static_assert(CudaDriver::kIpcHandleBytes == CU_IPC_HANDLE_SIZE);
static_assert(sizeof(CUipcMemHandle) == CU_IPC_HANDLE_SIZE);

// The primary context current on this thread, -1 when MakeCurrent was not called here.
thread_local int tls_current_device = -1;

std::string VersionText(int version) {
  return fmt::format("{}.{}", version / 1000, (version % 1000) / 10);
}

}  // namespace

absl::StatusOr<CudaDriver*> CudaDriver::Load() {
  static std::once_flag once;
  static absl::StatusOr<CudaDriver*>* loaded = nullptr;
  std::call_once(once, [] {
    const char* override_path = std::getenv(kLibraryEnv);
    const std::string library =
        override_path != nullptr && override_path[0] != '\0' ? override_path : kLibraryName;
    loaded = new absl::StatusOr<CudaDriver*>(LoadFrom(library));
  });
  return *loaded;
}

absl::StatusOr<CudaDriver*> CudaDriver::LoadFrom(const std::string& library) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    return absl::FailedPreconditionError(fmt::format(
        "CUDA driver not available: dlopen({}) failed: {}; this machine has no NVIDIA "
        "driver{}. Install the NVIDIA driver to register VRAM, or register host memory "
        "(shm) instead",
        library, error != nullptr ? error : "unknown error",
        library == kLibraryName ? "" : fmt::format(" at {} (set by {})", library, kLibraryEnv)));
  }
  // From here on the library stays loaded for the life of the process, as do Api and
  // the driver once loading succeeds; a failed load frees them (LeakSanitizer found
  // the Api leaked when a symbol was missing).
  auto api = std::make_unique<Api>();
  int version = 0;
  if (auto get_version = reinterpret_cast<decltype(api->driver_get_version)>(
          dlsym(handle, "cuDriverGetVersion"));
      get_version != nullptr) {
    get_version(&version);  // needs no cuInit
  }
  std::string missing;
  auto resolve = [&](auto* slot, const char* symbol) {
    *slot = reinterpret_cast<std::remove_pointer_t<decltype(slot)>>(dlsym(handle, symbol));
    if (*slot == nullptr) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", symbol);
  };
  resolve(&api->get_error_name, "cuGetErrorName");
  resolve(&api->get_error_string, "cuGetErrorString");
  resolve(&api->init, "cuInit");
  resolve(&api->driver_get_version, "cuDriverGetVersion");
  resolve(&api->device_get_count, "cuDeviceGetCount");
  resolve(&api->device_get, "cuDeviceGet");
  resolve(&api->device_get_name, "cuDeviceGetName");
  resolve(&api->device_total_mem, "cuDeviceTotalMem_v2");
  resolve(&api->device_get_pci_bus_id, "cuDeviceGetPCIBusId");
  resolve(&api->primary_ctx_retain, "cuDevicePrimaryCtxRetain");
  resolve(&api->primary_ctx_release, "cuDevicePrimaryCtxRelease_v2");
  resolve(&api->ctx_set_current, "cuCtxSetCurrent");
  resolve(&api->ipc_open_mem_handle, "cuIpcOpenMemHandle_v2");
  resolve(&api->ipc_close_mem_handle, "cuIpcCloseMemHandle");
  resolve(&api->mem_get_address_range, "cuMemGetAddressRange_v2");
  resolve(&api->mem_copy, "cuMemcpy");
  resolve(&api->mem_copy_async, "cuMemcpyAsync");
  resolve(&api->stream_create, "cuStreamCreate");
  resolve(&api->stream_synchronize, "cuStreamSynchronize");
  resolve(&api->stream_destroy, "cuStreamDestroy_v2");
  resolve(&api->mem_host_register, "cuMemHostRegister_v2");
  resolve(&api->mem_host_unregister, "cuMemHostUnregister");
  resolve(&api->pointer_get_attribute, "cuPointerGetAttribute");
  resolve(&api->mem_alloc, "cuMemAlloc_v2");
  resolve(&api->mem_free, "cuMemFree_v2");
  resolve(&api->ipc_get_mem_handle, "cuIpcGetMemHandle");
  resolve(&api->mem_host_alloc, "cuMemHostAlloc");
  resolve(&api->mem_free_host, "cuMemFreeHost");
  // Required like the rest: every driver kvagent supports (11.0+) has them.
  resolve(&api->mem_import_from_shareable_handle, "cuMemImportFromShareableHandle");
  resolve(&api->mem_get_allocation_properties, "cuMemGetAllocationPropertiesFromHandle");
  resolve(&api->mem_get_allocation_granularity, "cuMemGetAllocationGranularity");
  resolve(&api->mem_address_reserve, "cuMemAddressReserve");
  resolve(&api->mem_map, "cuMemMap");
  resolve(&api->mem_set_access, "cuMemSetAccess");
  resolve(&api->mem_unmap, "cuMemUnmap");
  resolve(&api->mem_address_free, "cuMemAddressFree");
  resolve(&api->mem_release, "cuMemRelease");
  resolve(&api->mem_create, "cuMemCreate");
  resolve(&api->mem_export_to_shareable_handle, "cuMemExportToShareableHandle");
  const CudaCopyEntryPoints copy_entry_points =
      FindCopyEntryPoints([handle](const char* symbol) { return dlsym(handle, symbol); });
  if (copy_entry_points.batch_copy == kBatchCopySymbol) {
    resolve(&api->batch_copy, kBatchCopySymbol);
  } else if (!copy_entry_points.batch_copy.empty()) {
    resolve(&api->batch_copy_with_fail_index, kBatchCopyWithFailIndexSymbol);
  }
  if (copy_entry_points.kernel_launch) {
    resolve(&api->module_load_data, "cuModuleLoadData");
    resolve(&api->module_get_function, "cuModuleGetFunction");
    resolve(&api->module_unload, "cuModuleUnload");
    resolve(&api->launch_kernel, "cuLaunchKernel");
    resolve(&api->device_get_attribute, "cuDeviceGetAttribute");
  }
  if (!missing.empty()) {
    return absl::FailedPreconditionError(fmt::format(
        "CUDA driver {} (driver API version {}) lacks {}; upgrade the NVIDIA driver (kvagent "
        "needs a CUDA 11.0 or newer driver)",
        library, version == 0 ? std::string("unknown") : VersionText(version), missing));
  }

  std::unique_ptr<CudaDriver> driver(new CudaDriver);
  driver->library_ = library;
  driver->api_ = api.get();
  driver->driver_version_ = version;
  driver->copy_entry_points_ = copy_entry_points;
  if (CUresult r = api->init(0); r != CUDA_SUCCESS) {
    return absl::FailedPreconditionError(fmt::format(
        "CUDA driver {} (version {}) failed to initialize: cuInit: {}; check that the GPUs "
        "are visible to this process (nvidia-smi; in a container: the NVIDIA runtime and "
        "/dev/nvidia* devices; CUDA_VISIBLE_DEVICES)",
        library, VersionText(version), driver->ErrorText(r)));
  }
  if (CUresult r = api->device_get_count(&driver->device_count_); r != CUDA_SUCCESS) {
    return absl::FailedPreconditionError(
        fmt::format("CUDA driver {}: cuDeviceGetCount: {}; check nvidia-smi", library,
                    driver->ErrorText(r)));
  }
  api.release();  // owned by the driver for the life of the process
  return driver.release();
}

CudaCopyEntryPoints CudaDriver::FindCopyEntryPoints(
    const std::function<void*(const char*)>& lookup) {
  CudaCopyEntryPoints found;
  if (lookup(kBatchCopySymbol) != nullptr) {
    found.batch_copy = kBatchCopySymbol;
  } else if (lookup(kBatchCopyWithFailIndexSymbol) != nullptr) {
    found.batch_copy = kBatchCopyWithFailIndexSymbol;
  }
  found.kernel_launch = true;
  for (const char* symbol : kKernelLaunchSymbols) {
    if (lookup(symbol) == nullptr) found.kernel_launch = false;
  }
  return found;
}

absl::Status CudaDriver::ValidateIpcSource(const std::string& entry, size_t handle_bytes,
                                           int device, int device_count) {
  if (handle_bytes != kIpcHandleBytes) {
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': cuda_ipc.ipc_handle is {} bytes; a CUDA IPC memory handle is {} bytes "
        "(cudaIpcGetMemHandle); pass the handle's bytes unchanged",
        entry, handle_bytes, kIpcHandleBytes));
  }
  if (device < 0) {
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': device ordinal {} is negative; set cuda_ipc.device to the CUDA device "
        "ordinal that owns the allocation (as this agent numbers devices)",
        entry, device));
  }
  if (device_count >= 0 && device >= device_count) {
    return absl::InvalidArgumentError(
        device_count == 0
            ? fmt::format("region '{}': device ordinal {} is out of range; this machine has no "
                          "CUDA devices (check nvidia-smi and CUDA_VISIBLE_DEVICES)",
                          entry, device)
            : fmt::format("region '{}': device ordinal {} is out of range; this machine has {} "
                          "CUDA devices (0..{}); CUDA_VISIBLE_DEVICES may number them "
                          "differently in the engine and in the agent",
                          entry, device, device_count, device_count - 1));
  }
  return absl::OkStatus();
}

std::string CudaDriver::ErrorText(int result) const {
  const char* name = nullptr;
  const char* text = nullptr;
  const auto r = static_cast<CUresult>(result);
  if (api_ == nullptr || api_->get_error_name(r, &name) != CUDA_SUCCESS || name == nullptr) {
    return fmt::format("CUresult {}", result);
  }
  if (api_->get_error_string(r, &text) != CUDA_SUCCESS || text == nullptr) return name;
  return fmt::format("{}: {}", name, text);
}

absl::Status CudaDriver::Check(int result, std::string_view call) const {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  return absl::InternalError(fmt::format("{} failed: {}", call, ErrorText(result)));
}

absl::StatusOr<std::vector<CudaDeviceInfo>> CudaDriver::Devices() const {
  std::vector<CudaDeviceInfo> devices;
  for (int ordinal = 0; ordinal < device_count_; ++ordinal) {
    CUdevice device = 0;
    RETURN_IF_ERROR(Check(api_->device_get(&device, ordinal), "cuDeviceGet"));
    char name[256] = {};
    char bus_id[32] = {};
    size_t bytes = 0;
    RETURN_IF_ERROR(Check(api_->device_get_name(name, sizeof(name) - 1, device), "cuDeviceGetName"));
    RETURN_IF_ERROR(Check(api_->device_get_pci_bus_id(bus_id, sizeof(bus_id) - 1, device),
                          "cuDeviceGetPCIBusId"));
    RETURN_IF_ERROR(Check(api_->device_total_mem(&bytes, device), "cuDeviceTotalMem"));
    devices.push_back(CudaDeviceInfo{ordinal, name, bus_id, bytes});
  }
  return devices;
}

absl::Status CudaDriver::CheckDevice(int ordinal, std::string_view entry) const {
  return ValidateIpcSource(std::string(entry), kIpcHandleBytes, ordinal, device_count_);
}

absl::Status CudaDriver::MakeCurrent(int ordinal) {
  if (ordinal < 0 || ordinal >= device_count_) {
    return absl::InvalidArgumentError(fmt::format(
        "CUDA device ordinal {} is out of range; this process sees {} CUDA devices", ordinal,
        device_count_));
  }
  CUcontext context = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = contexts_.find(ordinal);
    if (it != contexts_.end()) {
      context = it->second;
    } else {
      CUdevice device = 0;
      RETURN_IF_ERROR(Check(api_->device_get(&device, ordinal), "cuDeviceGet"));
      RETURN_IF_ERROR(
          Check(api_->primary_ctx_retain(&context, device), "cuDevicePrimaryCtxRetain"));
      if (CUresult r = api_->ctx_set_current(context); r != CUDA_SUCCESS) {
        api_->primary_ctx_release(device);
        return Check(r, "cuCtxSetCurrent");
      }
      contexts_.emplace(ordinal, context);  // kept for the life of the process
      tls_current_device = ordinal;
      return absl::OkStatus();
    }
  }
  RETURN_IF_ERROR(Check(api_->ctx_set_current(context), "cuCtxSetCurrent"));
  tls_current_device = ordinal;
  return absl::OkStatus();
}

absl::Status CudaDriver::EnsureContext() {
  if (tls_current_device >= 0) return absl::OkStatus();
  if (device_count_ == 0) {
    return absl::FailedPreconditionError(
        "no CUDA device is visible to this process; check nvidia-smi and CUDA_VISIBLE_DEVICES");
  }
  return MakeCurrent(0);  // UVA: any context can address every device's memory
}

absl::StatusOr<uint64_t> CudaDriver::OpenIpcHandle(std::string_view handle, int ordinal,
                                                   std::string_view entry) {
  RETURN_IF_ERROR(ValidateIpcSource(std::string(entry), handle.size(), ordinal, device_count_));
  if (absl::Status s = MakeCurrent(ordinal); !s.ok()) {
    return absl::FailedPreconditionError(fmt::format(
        "region '{}': cannot use CUDA device {}: {}; check that the GPU is healthy "
        "(nvidia-smi) and not in exclusive-process compute mode",
        entry, ordinal, s.message()));
  }
  const std::string key = std::string(handle) + static_cast<char>(ordinal);
  absl::MutexLock lock(&ipc_mu_);
  if (auto it = opened_.find(key); it != opened_.end()) {
    ++it->second.references;
    return it->second.dptr;
  }
  CUipcMemHandle ipc{};
  std::memcpy(ipc.reserved, handle.data(), kIpcHandleBytes);
  CUdeviceptr dptr = 0;
  const CUresult r = api_->ipc_open_mem_handle(&dptr, ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_HANDLE) {
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': cuIpcOpenMemHandle on device {}: {}; pass the unchanged bytes of "
        "cudaIpcGetMemHandle for a live allocation, exported by another process on this "
        "host (a process cannot open its own handles)",
        entry, ordinal, ErrorText(r)));
  }
  if (r != CUDA_SUCCESS) {
    return absl::FailedPreconditionError(fmt::format(
        "region '{}': cuIpcOpenMemHandle on device {}: {}; the exporting process must be "
        "alive on this host and still hold the allocation, and the agent must see the same "
        "GPUs (same host IPC namespace, /dev/nvidia* devices)",
        entry, ordinal, ErrorText(r)));
  }
  opened_[key] = OpenedIpc{static_cast<uint64_t>(dptr), 1};
  opened_by_pointer_[static_cast<uint64_t>(dptr)] = key;
  return static_cast<uint64_t>(dptr);
}

absl::Status CudaDriver::CloseIpcHandle(uint64_t dptr, int ordinal) {
  {
    absl::MutexLock lock(&ipc_mu_);
    auto by_pointer = opened_by_pointer_.find(dptr);
    if (by_pointer != opened_by_pointer_.end()) {
      auto it = opened_.find(by_pointer->second);
      if (it != opened_.end() && --it->second.references > 0) return absl::OkStatus();
      opened_.erase(by_pointer->second);
      opened_by_pointer_.erase(by_pointer);
    }
  }
  RETURN_IF_ERROR(MakeCurrent(ordinal));
  return Check(api_->ipc_close_mem_handle(static_cast<CUdeviceptr>(dptr)), "cuIpcCloseMemHandle");
}

absl::StatusOr<uint64_t> CudaDriver::AllocationSize(uint64_t dptr) {
  RETURN_IF_ERROR(EnsureContext());
  CUdeviceptr base = 0;
  size_t size = 0;
  RETURN_IF_ERROR(Check(api_->mem_get_address_range(&base, &size, static_cast<CUdeviceptr>(dptr)),
                        "cuMemGetAddressRange"));
  return static_cast<uint64_t>(base + size - dptr);
}

absl::StatusOr<uint64_t> CudaDriver::MemAlloc(uint64_t bytes) {
  RETURN_IF_ERROR(EnsureContext());
  CUdeviceptr dptr = 0;
  RETURN_IF_ERROR(Check(api_->mem_alloc(&dptr, bytes), "cuMemAlloc"));
  return static_cast<uint64_t>(dptr);
}

absl::Status CudaDriver::MemFree(uint64_t dptr) {
  RETURN_IF_ERROR(EnsureContext());
  return Check(api_->mem_free(static_cast<CUdeviceptr>(dptr)), "cuMemFree");
}

absl::StatusOr<std::string> CudaDriver::IpcGetHandle(uint64_t dptr) {
  RETURN_IF_ERROR(EnsureContext());
  CUipcMemHandle handle;
  RETURN_IF_ERROR(Check(api_->ipc_get_mem_handle(&handle, static_cast<CUdeviceptr>(dptr)),
                        "cuIpcGetMemHandle"));
  return std::string(handle.reserved, sizeof(handle.reserved));
}

namespace {

// The descriptor that grants `device` read-write access to a mapped range.
CUmemAccessDesc ReadWriteFor(int device) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

// A granularity multiple of at least `bytes`; false on overflow.
bool RoundUp(uint64_t bytes, uint64_t granularity, uint64_t* rounded) {
  uint64_t sum = 0;
  if (granularity == 0 || __builtin_add_overflow(bytes, granularity - 1, &sum)) return false;
  *rounded = sum / granularity * granularity;
  return true;
}

}  // namespace

absl::StatusOr<CudaVmmRange> CudaDriver::ImportVmm(int fd, int device, uint64_t bytes,
                                                   std::string_view entry) {
  constexpr char kExportFix[] =
      "pass the descriptor of cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_"
      "DESCRIPTOR) for a live cuMemCreate allocation whose requestedHandleTypes include "
      "it, unchanged (host memory goes through share instead)";
  if (fd < 0) {
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': CUDA VMM descriptor {} is not valid; {}", entry, fd, kExportFix));
  }
  if (bytes == 0) {
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': the shared CUDA VMM allocation has 0 bytes; share it with its size",
        entry));
  }
  if (device < 0 || device >= device_count_) {
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': device ordinal {} of the shared CUDA VMM allocation is out of range; "
        "this machine has {} CUDA devices{}; share it with the ordinal as this agent numbers "
        "devices (CUDA_VISIBLE_DEVICES may differ between the engine and the agent)",
        entry, device, device_count_,
        device_count_ > 0 ? fmt::format(" (0..{})", device_count_ - 1) : std::string()));
  }
  if (absl::Status s = MakeCurrent(device); !s.ok()) {
    return absl::FailedPreconditionError(fmt::format(
        "region '{}': cannot use CUDA device {}: {}; check that the GPU is healthy "
        "(nvidia-smi) and not in exclusive-process compute mode",
        entry, device, s.message()));
  }
  CudaVmmRange range;
  range.device = device;
  CUmemGenericAllocationHandle allocation = 0;
  const CUresult imported = api_->mem_import_from_shareable_handle(
      &allocation, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (imported == CUDA_ERROR_INVALID_VALUE || imported == CUDA_ERROR_INVALID_HANDLE) {
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': cuMemImportFromShareableHandle on device {}: {}; the descriptor is not "
        "a CUDA VMM shareable handle; {}",
        entry, device, ErrorText(imported), kExportFix));
  }
  if (imported != CUDA_SUCCESS) {
    return absl::FailedPreconditionError(fmt::format(
        "region '{}': cuMemImportFromShareableHandle on device {}: {}; the driver and GPU "
        "must support CUDA VMM POSIX handles (CUDA 10.2+, "
        "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED), and the agent must "
        "see the engine's GPUs (same host, /dev/nvidia* devices)",
        entry, device, ErrorText(imported)));
  }
  range.allocation = static_cast<uint64_t>(allocation);
  // From here on every failure undoes what was done so far.
  auto undo = [&](absl::Status status) {
    (void)ReleaseVmm(range);
    return status;
  };
  CUmemAllocationProp prop{};
  if (CUresult r = api_->mem_get_allocation_properties(&prop, allocation); r != CUDA_SUCCESS) {
    return undo(absl::FailedPreconditionError(fmt::format(
        "region '{}': cuMemGetAllocationPropertiesFromHandle: {}; report this with the driver "
        "version ({})",
        entry, ErrorText(r), VersionText(driver_version_))));
  }
  if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != device) {
    return undo(absl::InvalidArgumentError(
        prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE
            ? fmt::format("region '{}': the shared CUDA VMM allocation is not device memory "
                          "(location type {}); share host memory through share, and device "
                          "memory allocated with CU_MEM_LOCATION_TYPE_DEVICE here",
                          entry, static_cast<int>(prop.location.type))
            : fmt::format("region '{}': the shared CUDA VMM allocation is on device {}, not "
                          "device {} as shared; share it with device {} (the ordinal as this "
                          "agent numbers devices)",
                          entry, prop.location.id, device, prop.location.id)));
  }
  size_t granularity = 0;
  if (CUresult r = api_->mem_get_allocation_granularity(&granularity, &prop,
                                                       CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      r != CUDA_SUCCESS || granularity == 0) {
    return undo(absl::FailedPreconditionError(fmt::format(
        "region '{}': cuMemGetAllocationGranularity on device {}: {}; report this with the "
        "driver version ({})",
        entry, device, r != CUDA_SUCCESS ? ErrorText(r) : std::string("granularity 0"),
        VersionText(driver_version_))));
  }
  range.granularity = granularity;
  uint64_t mapped_bytes = 0;
  if (!RoundUp(bytes, granularity, &mapped_bytes)) {
    return undo(absl::InvalidArgumentError(fmt::format(
        "region '{}': {} bytes shared, which overflows when rounded up to the granularity "
        "{}; share the allocation's real size",
        entry, bytes, granularity)));
  }
  CUdeviceptr address = 0;
  if (CUresult r = api_->mem_address_reserve(&address, mapped_bytes, 0, 0, 0); r != CUDA_SUCCESS) {
    return undo(absl::Status(
        r == CUDA_ERROR_OUT_OF_MEMORY ? absl::StatusCode::kResourceExhausted
                                      : absl::StatusCode::kFailedPrecondition,
        fmt::format("region '{}': cuMemAddressReserve of {} bytes: {}; free address space in "
                    "the agent (deregister unused VRAM regions) or share a smaller allocation",
                    entry, mapped_bytes, ErrorText(r))));
  }
  range.address = static_cast<uint64_t>(address);
  range.reserved_bytes = mapped_bytes;
  if (CUresult r = api_->mem_map(address, mapped_bytes, 0, allocation, 0); r != CUDA_SUCCESS) {
    return undo(absl::Status(
        r == CUDA_ERROR_INVALID_VALUE ? absl::StatusCode::kInvalidArgument
                                      : absl::StatusCode::kFailedPrecondition,
        fmt::format("region '{}': cuMemMap of {} bytes ({} shared, rounded up to the "
                    "granularity {}) on device {}: {}; {}",
                    entry, mapped_bytes, bytes, granularity, device, ErrorText(r),
                    r == CUDA_ERROR_INVALID_VALUE
                        ? "the allocation is smaller than that: share it with its real size "
                          "(the size given to cuMemCreate)"
                        : "check the GPU (nvidia-smi) and the driver version")));
  }
  range.mapped_bytes = mapped_bytes;
  const CUmemAccessDesc access = ReadWriteFor(device);
  if (CUresult r = api_->mem_set_access(address, mapped_bytes, &access, 1); r != CUDA_SUCCESS) {
    return undo(absl::FailedPreconditionError(fmt::format(
        "region '{}': cuMemSetAccess (read-write for device {}) on {} bytes: {}; check the "
        "GPU (nvidia-smi) and that the allocation was not made read-only for other processes",
        entry, device, mapped_bytes, ErrorText(r))));
  }
  return range;
}

absl::Status CudaDriver::ReleaseVmm(const CudaVmmRange& range) {
  absl::Status first = MakeCurrent(range.device);
  auto keep = [&first](absl::Status s) {
    if (first.ok()) first = std::move(s);
  };
  const auto address = static_cast<CUdeviceptr>(range.address);
  if (range.address != 0 && range.mapped_bytes != 0) {
    keep(Check(api_->mem_unmap(address, range.mapped_bytes), "cuMemUnmap"));
  }
  if (range.address != 0 && range.reserved_bytes != 0) {
    keep(Check(api_->mem_address_free(address, range.reserved_bytes), "cuMemAddressFree"));
  }
  if (range.allocation != 0) {
    keep(Check(api_->mem_release(static_cast<CUmemGenericAllocationHandle>(range.allocation)),
               "cuMemRelease"));
  }
  return first;
}

absl::StatusOr<CudaVmmExportable> CudaDriver::CreateVmmExportable(int device, uint64_t bytes) {
  const std::string entry = fmt::format("VMM allocation of {} bytes on device {}", bytes, device);
  if (bytes == 0) {
    return absl::InvalidArgumentError(entry + ": 0 bytes; ask for at least one byte");
  }
  if (absl::Status s = MakeCurrent(device); !s.ok()) {
    return absl::FailedPreconditionError(
        fmt::format("{}: {}; pick a device this process sees", entry, s.message()));
  }
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t granularity = 0;
  if (CUresult r = api_->mem_get_allocation_granularity(&granularity, &prop,
                                                       CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      r != CUDA_SUCCESS || granularity == 0) {
    return absl::FailedPreconditionError(fmt::format(
        "{}: cuMemGetAllocationGranularity: {}; use a GPU and driver with CUDA VMM (CUDA "
        "10.2+)",
        entry, r != CUDA_SUCCESS ? ErrorText(r) : std::string("granularity 0")));
  }
  CudaVmmExportable out;
  out.range.device = device;
  out.range.granularity = granularity;
  uint64_t size = 0;
  if (!RoundUp(bytes, granularity, &size)) {
    return absl::InvalidArgumentError(entry + ": too large; ask for less");
  }
  // Every failure: what failed, the driver's text, and the fix.
  auto failed = [&](const char* call, CUresult r) {
    return absl::Status(r == CUDA_ERROR_OUT_OF_MEMORY ? absl::StatusCode::kResourceExhausted
                                                      : absl::StatusCode::kFailedPrecondition,
                        fmt::format("{}: {}: {}; {}", entry, call, ErrorText(r),
                                    r == CUDA_ERROR_OUT_OF_MEMORY
                                        ? "ask for less or free device memory"
                                        : "use a GPU and driver with CUDA VMM POSIX handles "
                                          "(nvidia-smi; CUDA 10.2+)"));
  };
  CUmemGenericAllocationHandle allocation = 0;
  if (CUresult r = api_->mem_create(&allocation, size, &prop, 0); r != CUDA_SUCCESS) {
    return failed("cuMemCreate", r);
  }
  out.range.allocation = static_cast<uint64_t>(allocation);
  auto undo = [&](absl::Status status) {
    (void)ReleaseVmm(out.range);
    return status;
  };
  int fd = -1;
  if (CUresult r = api_->mem_export_to_shareable_handle(
          &fd, allocation, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      r != CUDA_SUCCESS) {
    return undo(failed("cuMemExportToShareableHandle", r));
  }
  out.fd.reset(fd);
  CUdeviceptr address = 0;
  if (CUresult r = api_->mem_address_reserve(&address, size, 0, 0, 0); r != CUDA_SUCCESS) {
    return undo(failed("cuMemAddressReserve", r));
  }
  out.range.address = static_cast<uint64_t>(address);
  out.range.reserved_bytes = size;
  if (CUresult r = api_->mem_map(address, size, 0, allocation, 0); r != CUDA_SUCCESS) {
    return undo(failed("cuMemMap", r));
  }
  out.range.mapped_bytes = size;
  const CUmemAccessDesc access = ReadWriteFor(device);
  if (CUresult r = api_->mem_set_access(address, size, &access, 1); r != CUDA_SUCCESS) {
    return undo(failed("cuMemSetAccess", r));
  }
  return out;
}

absl::Status CudaDriver::Copy(uint64_t dst, uint64_t src, uint64_t bytes) {
  RETURN_IF_ERROR(EnsureContext());
  return Check(api_->mem_copy(static_cast<CUdeviceptr>(dst), static_cast<CUdeviceptr>(src), bytes),
               "cuMemcpy");
}

absl::Status CudaDriver::CopyAsync(uint64_t dst, uint64_t src, uint64_t bytes,
                                   CUstream_st* stream) {
  RETURN_IF_ERROR(EnsureContext());
  return Check(api_->mem_copy_async(static_cast<CUdeviceptr>(dst), static_cast<CUdeviceptr>(src),
                                  bytes, stream),
               "cuMemcpyAsync");
}

absl::StatusOr<CUstream_st*> CudaDriver::CreateStream(int ordinal) {
  RETURN_IF_ERROR(MakeCurrent(ordinal));
  CUstream stream = nullptr;
  RETURN_IF_ERROR(Check(api_->stream_create(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate"));
  return stream;
}

absl::Status CudaDriver::SynchronizeStream(CUstream_st* stream) {
  return Check(api_->stream_synchronize(stream), "cuStreamSynchronize");
}

absl::Status CudaDriver::DestroyStream(CUstream_st* stream) {
  return Check(api_->stream_destroy(stream), "cuStreamDestroy");
}

absl::Status CudaDriver::HostRegister(void* address, uint64_t bytes, std::string_view entry) {
  RETURN_IF_ERROR(EnsureContext());
  const CUresult r = api_->mem_host_register(address, bytes, CU_MEMHOSTREGISTER_PORTABLE);
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  return absl::FailedPreconditionError(fmt::format(
      "region '{}': cuMemHostRegister of {} bytes: {}; raise RLIMIT_MEMLOCK (`ulimit -l "
      "unlimited`, systemd LimitMEMLOCK=infinity) or use smaller staging buffers",
      entry, bytes, ErrorText(r)));
}

absl::StatusOr<void*> CudaDriver::HostAlloc(uint64_t bytes, std::string_view entry) {
  RETURN_IF_ERROR(EnsureContext());
  void* address = nullptr;
  // Portable: the pinned pages serve copies on any device's context.
  const CUresult r = api_->mem_host_alloc(&address, bytes, CU_MEMHOSTALLOC_PORTABLE);
  if (r == CUDA_SUCCESS) return address;
  return absl::FailedPreconditionError(fmt::format(
      "{}: cuMemHostAlloc of {} pinned bytes: {}; raise RLIMIT_MEMLOCK (`ulimit -l "
      "unlimited`, systemd LimitMEMLOCK=infinity) or use fewer or smaller staging buffers "
      "(--staging-buffers, --staging-chunk-bytes)",
      entry, bytes, ErrorText(r)));
}

absl::Status CudaDriver::HostFree(void* address) {
  return Check(api_->mem_free_host(address), "cuMemFreeHost");
}

absl::Status CudaDriver::HostUnregister(void* address) {
  return Check(api_->mem_host_unregister(address), "cuMemHostUnregister");
}

absl::StatusOr<int> CudaDriver::ComputeCapability(int ordinal) const {
  if (api_->device_get_attribute == nullptr) {
    return absl::FailedPreconditionError("the CUDA driver lacks cuDeviceGetAttribute");
  }
  CUdevice device = 0;
  RETURN_IF_ERROR(Check(api_->device_get(&device, ordinal), "cuDeviceGet"));
  int major = 0;
  int minor = 0;
  RETURN_IF_ERROR(Check(api_->device_get_attribute(
                            &major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
                        "cuDeviceGetAttribute"));
  RETURN_IF_ERROR(Check(api_->device_get_attribute(
                            &minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device),
                        "cuDeviceGetAttribute"));
  return major * 10 + minor;
}

absl::Status CudaDriver::CopyBatchAsync(uint64_t* dsts, uint64_t* srcs, uint64_t* sizes,
                                        size_t count, CUstream_st* stream,
                                        size_t* failed_index) {
  *failed_index = count;
  if (api_->batch_copy == nullptr && api_->batch_copy_with_fail_index == nullptr) {
    return absl::FailedPreconditionError(fmt::format(
        "CUDA driver {} lacks cuMemcpyBatchAsync; it needs a CUDA 12.8 or newer driver",
        VersionText(driver_version_)));
  }
  RETURN_IF_ERROR(EnsureContext());
  // One attribute for every copy: sources are read in stream order (they may be
  // written by work queued before), no location hints (device memory has one).
  CUmemcpyAttributes attributes{};
  attributes.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  size_t first_copy = 0;
  auto* d = reinterpret_cast<CUdeviceptr*>(dsts);
  auto* s = reinterpret_cast<CUdeviceptr*>(srcs);
  auto* n = reinterpret_cast<size_t*>(sizes);
  if (api_->batch_copy != nullptr) {
    return Check(api_->batch_copy(d, s, n, count, &attributes, &first_copy, 1, stream),
                 kBatchCopySymbol);
  }
  size_t fail = SIZE_MAX;
  const CUresult r = api_->batch_copy_with_fail_index(d, s, n, count, &attributes,
                                                      &first_copy, 1, &fail, stream);
  if (r != CUDA_SUCCESS && fail < count) *failed_index = fail;
  return Check(r, kBatchCopyWithFailIndexSymbol);
}

absl::StatusOr<CUmod_st*> CudaDriver::LoadModule(const void* image) {
  if (api_->module_load_data == nullptr) {
    return absl::FailedPreconditionError("the CUDA driver lacks cuModuleLoadData");
  }
  RETURN_IF_ERROR(EnsureContext());
  CUmodule module = nullptr;
  RETURN_IF_ERROR(Check(api_->module_load_data(&module, image), "cuModuleLoadData"));
  return module;
}

absl::StatusOr<CUfunc_st*> CudaDriver::ModuleFunction(CUmod_st* module, const char* name) {
  CUfunction function = nullptr;
  RETURN_IF_ERROR(Check(api_->module_get_function(&function, module, name),
                        fmt::format("cuModuleGetFunction({})", name)));
  return function;
}

absl::Status CudaDriver::UnloadModule(CUmod_st* module) {
  return Check(api_->module_unload(module), "cuModuleUnload");
}

absl::Status CudaDriver::LaunchKernel(CUfunc_st* function, unsigned grid, unsigned block,
                                      CUstream_st* stream, void** params) {
  return Check(api_->launch_kernel(function, grid, 1, 1, block, 1, 1, 0, stream, params, nullptr),
               "cuLaunchKernel");
}

absl::StatusOr<bool> CudaDriver::IsDevicePointer(uint64_t address) {
  unsigned int type = 0;
  const CUresult r = api_->pointer_get_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                                 static_cast<CUdeviceptr>(address));
  if (r == CUDA_ERROR_INVALID_VALUE) return false;  // memory CUDA does not know: host
  RETURN_IF_ERROR(Check(r, "cuPointerGetAttribute"));
  return type == CU_MEMORYTYPE_DEVICE;
}

}  // namespace kvagent::cuda

#include "transport/ucx_context.h"

#include <sys/resource.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "base/log.h"
#include "fmt/format.h"
#include "transport/ucx_hardening.h"
#include "ucs/memory/memory_type.h"

namespace kvagent::transport {
namespace {

constexpr log::Logger kLog("transport");

const char* UcsStatusName(ucs_status_t status) {
  switch (status) {
    case UCS_OK: return "UCS_OK";
    case UCS_INPROGRESS: return "UCS_INPROGRESS";
    case UCS_ERR_NO_MESSAGE: return "UCS_ERR_NO_MESSAGE";
    case UCS_ERR_NO_RESOURCE: return "UCS_ERR_NO_RESOURCE";
    case UCS_ERR_IO_ERROR: return "UCS_ERR_IO_ERROR";
    case UCS_ERR_NO_MEMORY: return "UCS_ERR_NO_MEMORY";
    case UCS_ERR_INVALID_PARAM: return "UCS_ERR_INVALID_PARAM";
    case UCS_ERR_UNREACHABLE: return "UCS_ERR_UNREACHABLE";
    case UCS_ERR_INVALID_ADDR: return "UCS_ERR_INVALID_ADDR";
    case UCS_ERR_NOT_IMPLEMENTED: return "UCS_ERR_NOT_IMPLEMENTED";
    case UCS_ERR_MESSAGE_TRUNCATED: return "UCS_ERR_MESSAGE_TRUNCATED";
    case UCS_ERR_NO_PROGRESS: return "UCS_ERR_NO_PROGRESS";
    case UCS_ERR_BUFFER_TOO_SMALL: return "UCS_ERR_BUFFER_TOO_SMALL";
    case UCS_ERR_NO_ELEM: return "UCS_ERR_NO_ELEM";
    case UCS_ERR_SOME_CONNECTS_FAILED: return "UCS_ERR_SOME_CONNECTS_FAILED";
    case UCS_ERR_NO_DEVICE: return "UCS_ERR_NO_DEVICE";
    case UCS_ERR_BUSY: return "UCS_ERR_BUSY";
    case UCS_ERR_CANCELED: return "UCS_ERR_CANCELED";
    case UCS_ERR_SHMEM_SEGMENT: return "UCS_ERR_SHMEM_SEGMENT";
    case UCS_ERR_ALREADY_EXISTS: return "UCS_ERR_ALREADY_EXISTS";
    case UCS_ERR_OUT_OF_RANGE: return "UCS_ERR_OUT_OF_RANGE";
    case UCS_ERR_TIMED_OUT: return "UCS_ERR_TIMED_OUT";
    case UCS_ERR_EXCEEDS_LIMIT: return "UCS_ERR_EXCEEDS_LIMIT";
    case UCS_ERR_UNSUPPORTED: return "UCS_ERR_UNSUPPORTED";
    case UCS_ERR_REJECTED: return "UCS_ERR_REJECTED";
    case UCS_ERR_NOT_CONNECTED: return "UCS_ERR_NOT_CONNECTED";
    case UCS_ERR_CONNECTION_RESET: return "UCS_ERR_CONNECTION_RESET";
    case UCS_ERR_ENDPOINT_TIMEOUT: return "UCS_ERR_ENDPOINT_TIMEOUT";
    default: return nullptr;
  }
}

// Runs a UCX print function into a string (UCX only prints to FILE*).
template <typename PrintFn>
std::string CapturePrint(PrintFn print) {
  char* buffer = nullptr;
  size_t size = 0;
  FILE* stream = open_memstream(&buffer, &size);
  if (stream == nullptr) return {};
  print(stream);
  std::fclose(stream);
  std::string text(buffer, size);
  std::free(buffer);
  return text;
}

// ucp_context_print_info lists one line per usable resource:
//   "#      resource 1  :  md 1  dev 1  flags -- tcp/eth0"
// The transport name is the text between "-- " and "/".
std::vector<std::string> ParseContextTransports(const std::string& info) {
  std::vector<std::string> names;
  size_t line_start = 0;
  while (line_start < info.size()) {
    size_t line_end = info.find('\n', line_start);
    if (line_end == std::string::npos) line_end = info.size();
    std::string_view line(info.data() + line_start, line_end - line_start);
    line_start = line_end + 1;
    if (line.find("resource") == std::string_view::npos) continue;
    size_t dashes = line.find("-- ");
    if (dashes == std::string_view::npos) continue;
    std::string_view rest = line.substr(dashes + 3);
    std::string name(rest.substr(0, rest.find('/')));
    if (!name.empty() && std::find(names.begin(), names.end(), name) == names.end()) {
      names.push_back(std::move(name));
    }
  }
  return names;
}

std::string ListOrNone(const std::vector<std::string>& items) {
  return items.empty() ? "none" : absl::StrJoin(items, ",");
}

ucs_memory_type_t ToUcs(MemoryType type) {
  return type == MemoryType::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
}

// UCX 1.13 run with UCX_POSIX_USE_PROC_LINK=n and a UCX_POSIX_DIR other than /dev/shm
// puts the directory in its posix interface's address, after the segment id's 8 bytes,
// and stops the process on an assertion when it packs a worker address whose interface
// address passes 63 bytes (a 144-character directory: "value 153, max_value 63").
// Refused before UCX starts, with the limit.
absl::Status CheckPosixDirectory() {
  const char* link = std::getenv("UCX_POSIX_USE_PROC_LINK");
  const char* directory = std::getenv("UCX_POSIX_DIR");
  if (link == nullptr || directory == nullptr) return absl::OkStatus();
  std::string off(link);
  std::transform(off.begin(), off.end(), off.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (off != "n" && off != "no" && off != "off" && off != "0" && off != "false") {
    return absl::OkStatus();
  }
  constexpr size_t kMaxInterfaceAddress = 63, kSegmentId = 8;
  const size_t length = std::strlen(directory);
  if (std::string_view(directory) == "/dev/shm" ||
      kSegmentId + length + 1 <= kMaxInterfaceAddress) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(fmt::format(
      "UCX context: UCX_POSIX_DIR is {} characters ({}); with UCX_POSIX_USE_PROC_LINK={} "
      "UCX 1.13 puts it in its posix interface's address, which holds 63 bytes (the "
      "segment id's 8, the path and its end), and stops the agent on an assertion when it "
      "packs the address; use a directory of at most {} characters, or leave "
      "UCX_POSIX_USE_PROC_LINK at its default (y)",
      length, directory, link, kMaxInterfaceAddress - kSegmentId - 1));
}

std::string MemlockText() {
  struct rlimit limit {};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return "RLIMIT_MEMLOCK unknown";
  if (limit.rlim_cur == RLIM_INFINITY) return "RLIMIT_MEMLOCK unlimited";
  return fmt::format("RLIMIT_MEMLOCK {} bytes", static_cast<uint64_t>(limit.rlim_cur));
}

}  // namespace

std::string UcsStatusText(ucs_status_t status) {
  const char* name = UcsStatusName(status);
  return fmt::format("ucx status {}: {}",
                     name != nullptr ? std::string(name) : std::to_string(static_cast<int>(status)),
                     ucs_status_string(status));
}

std::string_view MemoryTypeName(MemoryType type) {
  return type == MemoryType::kCuda ? "cuda" : "host";
}

absl::StatusOr<std::unique_ptr<UcxContext>> UcxContext::Create() {
  ucp_config_t* config = nullptr;
  // UCX 1.13's tcp transport crashed the receiving worker (SIGSEGV in its socket
  // progress, address -8) on put-zcopy requests in about 1 of 10 two-agent runs
  // under load here; without it puts go as active messages, which also measured
  // faster (0.36 vs 0.25 GB/s). An explicit UCX_TCP_PUT_ENABLE still wins.
  setenv("UCX_TCP_PUT_ENABLE", "n", /*overwrite=*/0);
  if (absl::Status posix = CheckPosixDirectory(); !posix.ok()) return posix;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) {
    return absl::FailedPreconditionError(fmt::format(
        "UCX context: reading the UCX configuration failed ({}); check the UCX_* "
        "environment variables (ucx_info -c lists the valid ones)",
        UcsStatusText(status)));
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  // A hardened process takes a peer's tagged messages to discard them (its workers
  // keep a receive for any tag posted): without the feature UCX 1.13 still keeps a
  // tagged rendezvous in the worker's unexpected queue, for as long as its sender
  // likes, and hands eager ones to UCT's stub handler.
  const bool takes_tags = UcxHardenedForPeers();
  if (takes_tags) params.features |= UCP_FEATURE_TAG;
  params.mt_workers_shared = 1;
  ucp_context_h handle = nullptr;
  status = ucp_init(&params, config, &handle);
  ucp_config_release(config);
  // ucp_init's cma probe wrote to this process; from here on a hardened process's UCX
  // reaches only the same-host processes a local door proved (SameHostTargetAdmitted).
  if (takes_tags) ArmSameHostGuard();
  if (status != UCS_OK) {
    return absl::FailedPreconditionError(fmt::format(
        "UCX context: ucp_init failed ({}); check UCX_TLS/UCX_NET_DEVICES name transports "
        "and devices this host has (ucx_info -d lists them)",
        UcsStatusText(status)));
  }
  std::unique_ptr<UcxContext> context(new UcxContext(handle));
  context->takes_tags_ = takes_tags;
  UcxCapabilities& caps = context->capabilities_;
  caps.version = ucp_get_version_string();

  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  status = ucp_context_query(handle, &attr);
  if (status != UCS_OK) {
    return absl::InternalError(fmt::format(
        "UCX context: ucp_context_query failed ({}); the UCX library is inconsistent, "
        "reinstall it",
        UcsStatusText(status)));
  }
  for (int type = UCS_MEMORY_TYPE_HOST; type < UCS_MEMORY_TYPE_LAST; ++type) {
    if (attr.memory_types & (uint64_t{1} << type)) {
      caps.memory_types.emplace_back(ucs_memory_type_names[type]);
    }
  }
  caps.cuda_memory = (attr.memory_types & (uint64_t{1} << UCS_MEMORY_TYPE_CUDA)) != 0;
  caps.transports = ParseContextTransports(
      CapturePrint([handle](FILE* stream) { ucp_context_print_info(handle, stream); }));
  kLog.Info("UCX {}: transports {}, memory types {}", caps.version,
            ListOrNone(caps.transports), ListOrNone(caps.memory_types));
  return context;
}

std::atomic<int64_t>& RequestsInFlight() {
  static std::atomic<int64_t> requests{0};
  return requests;
}

UcxContext::~UcxContext() {
  if (context_ == nullptr) return;
  if (const int64_t left = RequestsInFlight().load(); left > 0) {
    kLog.Warn("UCX context: {} requests with peers never completed (the peers died or "
              "stopped answering); its cleanup is left to the process's exit, where UCX 1.13 "
              "would abort on the memory they hold",
              left);
    return;
  }
  ucp_cleanup(context_);
}

absl::StatusOr<MemoryRegistration> MemoryRegistration::Map(const UcxContext& context,
                                                           void* address, uint64_t length,
                                                           MemoryType type,
                                                           std::string_view entry,
                                                           PeerAccess access) {
  if (address == nullptr || length == 0) {
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': cannot register address {} length {}: the range is {}; pass the "
        "start and a non-zero length of memory this process has mapped",
        entry, address, length, address == nullptr ? "null" : "empty"));
  }
  const UcxCapabilities& caps = context.capabilities();
  if (type == MemoryType::kCuda && !caps.cuda_memory) {
    return absl::FailedPreconditionError(fmt::format(
        "region '{}': declared cuda memory but UCX {} supports memory types [{}] with "
        "transports [{}], so it cannot register GPU memory; fix: run a CUDA-enabled UCX build "
        "(with cuda_copy/cuda_ipc modules), point UCX_MODULE_DIR at its module directory, "
        "and make sure UCX_TLS includes cuda_copy,cuda_ipc (or is unset)",
        entry, caps.version, ListOrNone(caps.memory_types), ListOrNone(caps.transports)));
  }

  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = address;
  params.length = length;
  params.memory_type = ToUcs(type);
  MemoryRegistration registration;
  ucs_status_t status = ucp_mem_map(context.get(), &params, &registration.memh_);
  if (status == UCS_ERR_NO_MEMORY || status == UCS_ERR_EXCEEDS_LIMIT) {
    return absl::FailedPreconditionError(fmt::format(
        "region '{}': ucp_mem_map of {} bytes at {} failed ({}) with {}; the locked-memory "
        "limit is likely too low: raise it (`ulimit -l unlimited`, or LimitMEMLOCK=infinity in "
        "the systemd unit)",
        entry, length, address, UcsStatusText(status), MemlockText()));
  }
  if (status != UCS_OK) {
    return absl::InternalError(fmt::format(
        "region '{}': ucp_mem_map of {} bytes at {} as {} memory failed ({}); check that the "
        "range is mapped in this process and of the declared type",
        entry, length, address, MemoryTypeName(type), UcsStatusText(status)));
  }
  // From here on `registration` owns the mapping and unmaps it on every error path.
  registration.context_ = context.get();
  registration.address_ = address;
  registration.length_ = length;
  registration.type_ = type;

  ucp_mem_attr_t attr{};
  attr.field_mask =
      UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH | UCP_MEM_ATTR_FIELD_MEM_TYPE;
  status = ucp_mem_query(registration.memh_, &attr);
  if (status != UCS_OK) {
    return absl::InternalError(fmt::format(
        "region '{}': ucp_mem_query after mapping failed ({}); the UCX library is "
        "inconsistent, reinstall it",
        entry, UcsStatusText(status)));
  }
  if (attr.mem_type != ToUcs(type)) {
    const char* seen = attr.mem_type < UCS_MEMORY_TYPE_LAST ? ucs_memory_type_names[attr.mem_type]
                                                            : "unknown";
    return absl::FailedPreconditionError(fmt::format(
        "region '{}': declared {} memory but UCX sees {} memory at {}; declare the type the "
        "memory really is (host for shm/DRAM, cuda for an opened CUDA IPC handle)",
        entry, MemoryTypeName(type), seen, address));
  }

  void* rkey_buffer = nullptr;
  size_t rkey_size = 0;
  status = ucp_rkey_pack(context.get(), registration.memh_, &rkey_buffer, &rkey_size);
  if (status != UCS_OK) {
    return absl::InternalError(fmt::format(
        "region '{}': ucp_rkey_pack failed ({}); no transport can expose this memory to "
        "peers, check UCX_TLS",
        entry, UcsStatusText(status)));
  }
  registration.packed_rkey_.assign(static_cast<const char*>(rkey_buffer), rkey_size);
  ucp_rkey_buffer_release(rkey_buffer);
  if (access == PeerAccess::kPeers) {
    AllowPeerRange(address, length, ToUcs(type));
    registration.access_ = access;
  }
  return registration;
}

MemoryRegistration::MemoryRegistration(MemoryRegistration&& other) noexcept {
  *this = std::move(other);
}

MemoryRegistration& MemoryRegistration::operator=(MemoryRegistration&& other) noexcept {
  if (this != &other) {
    Reset();
    context_ = std::exchange(other.context_, nullptr);
    memh_ = std::exchange(other.memh_, nullptr);
    address_ = std::exchange(other.address_, nullptr);
    length_ = std::exchange(other.length_, 0);
    type_ = other.type_;
    access_ = std::exchange(other.access_, PeerAccess::kLocal);
    packed_rkey_ = std::move(other.packed_rkey_);
    other.packed_rkey_.clear();
  }
  return *this;
}

MemoryRegistration::~MemoryRegistration() { Reset(); }

void MemoryRegistration::Reset() {
  // Out of peers' reach before UCX lets go of the memory.
  if (access_ == PeerAccess::kPeers) ForbidPeerRange(address_, length_);
  access_ = PeerAccess::kLocal;
  if (memh_ != nullptr) {
    ucs_status_t status = ucp_mem_unmap(context_, memh_);
    if (status != UCS_OK) {
      kLog.Warn("ucp_mem_unmap of {} bytes at {} failed ({})", length_, address_,
                UcsStatusText(status));
    }
  }
  context_ = nullptr;
  memh_ = nullptr;
  address_ = nullptr;
  length_ = 0;
  packed_rkey_.clear();
}

}  // namespace kvagent::transport

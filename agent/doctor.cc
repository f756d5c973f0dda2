#include "agent/doctor.h"

#include <dirent.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/cpu_list.h"
#include "base/file_text.h"
#include "base/format.h"
#include "base/log.h"
#include "cuda/driver.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {

constexpr log::Logger kLog("doctor");
using Check = v1::DoctorCheck;

Check Make(std::string name, Check::Result result, std::string detail, std::string fix = "") {
  Check check;
  check.set_name(std::move(name));
  check.set_result(result);
  check.set_detail(std::move(detail));
  if (result != Check::PASS) check.set_fix(std::move(fix));
  return check;
}

std::string Bytes(uint64_t bytes) {
  if (bytes >= (1ull << 30)) return fmt::format("{:.1f} GiB", bytes / double(1ull << 30));
  if (bytes >= (1ull << 20)) return fmt::format("{:.1f} MiB", bytes / double(1ull << 20));
  if (bytes >= (1ull << 10)) return fmt::format("{:.1f} KiB", bytes / double(1ull << 10));
  return fmt::format("{} B", bytes);
}

std::string List(const std::vector<std::string>& items) {
  return fmt::format("[{}]", absl::StrJoin(items, ","));
}

std::string DriverVersion(int version) {
  return fmt::format("{}.{} ({})", version / 1000, (version % 1000) / 10, version);
}

std::string Limit(uint64_t bytes) {
  return bytes == MemlockFacts::kUnlimited ? "unlimited" : Bytes(bytes);
}

bool IsRdmaTransport(const std::string& name) {
  return absl::StartsWith(name, "rc_") || absl::StartsWith(name, "ud_") ||
         absl::StartsWith(name, "dc_");
}

std::string DeviceText(const RdmaDevice& device) {
  return fmt::format("{} [{}]", device.name,
                     device.port_states.empty() ? "no ports" : absl::StrJoin(device.port_states, ", "));
}

constexpr const char* kCudaLibrary = cuda::CudaDriver::kLibraryName;

}  // namespace

// ---------------------------------------------------------------- checks

v1::DoctorCheck CheckUcx(const transport::UcxCapabilities& ucx) {
  const std::string detail = fmt::format("UCX {}; transports {}; memory types {}", ucx.version,
                                         List(ucx.transports), List(ucx.memory_types));
  if (ucx.transports.empty()) {
    return Make("ucx", Check::FAIL, detail + ": no transport to move data with",
                "check UCX_TLS and UCX_NET_DEVICES against what `ucx_info -d` lists, or unset them");
  }
  return Make("ucx", Check::PASS, detail);
}

v1::DoctorCheck CheckUcxHardening(const std::vector<std::string>& refused, bool tcp_guarded,
                                  bool remote_checked, size_t allowed_hosts) {
  if (refused.empty()) {
    return Make("ucx-hardening", Check::WARN,
                "UCX is not hardened in this agent (started with KVAGENT_UCX_UNHARDENED=1): "
                "any authenticated peer can read and write all of its memory through UCX's "
                "software RMA, and hold tagged messages in its worker",
                "run kvagentd with the UCX it was built for (its start-up error says what "
                "differs) and without KVAGENT_UCX_UNHARDENED");
  }
  const std::string dropped = fmt::format(
      "peers' UCX messages of {} are dropped; tagged messages are discarded", List(refused));
  if (!tcp_guarded) {
    return Make("ucx-hardening", Check::WARN,
                dropped + "; but UCX's TCP port takes a connection from any local process, "
                          "and UCT's put request on it writes anywhere in this process",
                "run kvagentd itself: it links the accept() guard "
                "(transport/ucx_tcp_guard.h) that keeps local connections to peer uids");
  }
  const std::string local = dropped + "; UCX's TCP port keeps a local connection only from a peer uid";
  if (!remote_checked) {
    return Make("ucx-hardening", Check::WARN,
                local + ", but one from any other host (--ucx-tcp-remote any): whoever reaches "
                        "the port over the data network can write anywhere in this process",
                "fence UCX's TCP ports to the fleet (UCX_TCP_PORT_RANGE and a firewall), or "
                "run without --ucx-tcp-remote any");
  }
  return Make("ucx-hardening", Check::PASS,
              fmt::format("{}, and one from another host only from an authenticated peer's "
                          "address ({} known now)",
                          local, allowed_hosts));
}

v1::DoctorCheck CheckUcxCuda(const transport::UcxCapabilities& ucx, const CudaFacts& cuda,
                             std::string_view ucx_tls) {
  if (ucx.cuda_memory) {
    return Make("ucx-cuda", Check::PASS,
                fmt::format("UCX {} registers CUDA memory (memory types {})", ucx.version,
                            List(ucx.memory_types)));
  }
  std::string detail;
  if (!cuda.devices.empty()) {
    detail = fmt::format(
        "GPU present but UCX lacks CUDA: VRAM moves through host staging (where enabled; "
        "otherwise VRAM registration fails); UCX {} memory types {}, {} CUDA device(s)",
        ucx.version, List(ucx.memory_types), cuda.devices.size());
  } else {
    detail = fmt::format(
        "UCX {} has no CUDA memory type (memory types {}): VRAM regions will use host "
        "staging or fail",
        ucx.version, List(ucx.memory_types));
  }
  if (!ucx_tls.empty() && ucx_tls.find("cuda") == std::string_view::npos) {
    detail += fmt::format("; UCX_TLS={} leaves out the cuda transports", ucx_tls);
  }
  return Make("ucx-cuda", Check::WARN, std::move(detail),
              "run a CUDA-enabled UCX build (cuda_copy/cuda_ipc modules), point UCX_MODULE_DIR at "
              "its module directory, and set UCX_TLS to include cuda_copy,cuda_ipc (e.g. "
              "UCX_TLS=tcp,sm,self,cuda_copy,cuda_ipc) or leave it unset; DRAM regions are "
              "unaffected");
}

v1::DoctorCheck CheckDeviceCopy(std::string_view mode, const CudaFacts& cuda) {
  if (!cuda.loaded) {
    return Make("device-copy", Check::PASS,
                fmt::format("{}: VRAM is not copied between agents on this host (host memory "
                            "is: memcpy across the copy lanes)",
                            mode));
  }
  return Make("device-copy", Check::PASS,
              fmt::format("{}: how VRAM pages of same-host peers mapped here (CUDA IPC) are "
                          "copied, on one stream with one sync per batch",
                          mode));
}

v1::DoctorCheck CheckCudaDriver(const CudaFacts& cuda) {
  if (!cuda.loaded) {
    return Make("cuda-driver", Check::WARN,
                fmt::format("{} not loadable: {}; VRAM regions cannot be registered", kCudaLibrary,
                            cuda.error.empty() ? "unknown reason" : cuda.error),
                fmt::format("install the NVIDIA driver (it provides {}; in a container use the "
                            "NVIDIA container runtime, e.g. docker --gpus all); DRAM regions work "
                            "without it",
                            kCudaLibrary));
  }
  if (cuda.devices.empty()) {
    return Make("cuda-driver", Check::WARN,
                fmt::format("{} loaded, driver {}, but it sees no CUDA devices{}{}", kCudaLibrary,
                            DriverVersion(cuda.driver_version), cuda.error.empty() ? "" : ": ",
                            cuda.error),
                "check `nvidia-smi`, CUDA_VISIBLE_DEVICES and the container's GPU access "
                "(docker --gpus all / the nvidia.com/gpu resource)");
  }
  std::vector<std::string> devices;
  for (const auto& d : cuda.devices) {
    devices.push_back(fmt::format("{} {} [{}] {}", d.ordinal, d.name, d.pci_bus_id,
                                  Bytes(d.total_bytes)));
  }
  return Make("cuda-driver", Check::PASS,
              fmt::format("{} driver {}; {} device(s): {}", kCudaLibrary,
                          DriverVersion(cuda.driver_version), cuda.devices.size(),
                          absl::StrJoin(devices, "; ")));
}

v1::DoctorCheck CheckMemlock(const MemlockFacts& memlock) {
  if (!memlock.known) {
    return Make("memlock", Check::WARN, "getrlimit(RLIMIT_MEMLOCK) failed; the limit is unknown",
                "check `ulimit -l` in the agent's environment; set it to unlimited");
  }
  const std::string limits =
      fmt::format("RLIMIT_MEMLOCK soft {}, hard {}", Limit(memlock.soft), Limit(memlock.hard));
  if (memlock.soft == MemlockFacts::kUnlimited || memlock.soft >= kMinMemlockBytes) {
    return Make("memlock", Check::PASS, limits);
  }
  std::string fix =
      "raise it before starting kvagentd: `ulimit -l unlimited`, LimitMEMLOCK=infinity in the "
      "systemd unit, or docker --ulimit memlock=-1";
  if (memlock.hard == MemlockFacts::kUnlimited || memlock.hard >= kMinMemlockBytes) {
    fix += fmt::format(" (the hard limit, {}, already allows it)", Limit(memlock.hard));
  }
  return Make("memlock", Check::WARN,
              fmt::format("{}, under {}: RDMA registration and pinned host staging lock memory "
                          "and fail past the limit",
                          limits, Bytes(kMinMemlockBytes)),
              std::move(fix));
}

v1::DoctorCheck CheckDevShm(const ShmFacts& shm) {
  const std::string grow = fmt::format(
      "grow it: `mount -o remount,size=16G {}`, docker --shm-size=16g, or in Kubernetes an "
      "emptyDir with medium: Memory mounted at {}",
      shm.path, shm.path);
  if (!shm.exists) {
    return Make("dev-shm", Check::FAIL,
                fmt::format("{} missing: {}; shared-memory regions and AllocateSharedMemory "
                            "cannot work",
                            shm.path, shm.error),
                fmt::format("mount a tmpfs there (`mount -t tmpfs -o size=16G tmpfs {}`); in a "
                            "container it is mounted by default unless the runtime removed it",
                            shm.path));
  }
  const std::string sizes =
      fmt::format("{}: size {}, free {}", shm.path, Bytes(shm.size_bytes), Bytes(shm.free_bytes));
  if (!shm.writable) {
    return Make("dev-shm", Check::FAIL,
                fmt::format("{}, not writable: {}; the agent cannot create shared memory",
                            sizes, shm.error),
                fmt::format("mount {} read-write and let the agent's user write it (mode 1777)",
                            shm.path));
  }
  if (shm.free_bytes < kMinShmFreeBytes) {
    return Make("dev-shm", Check::WARN,
                fmt::format("{}, under {} free: KV pools in shared memory will not fit", sizes,
                            Bytes(kMinShmFreeBytes)),
                grow);
  }
  return Make("dev-shm", Check::PASS, sizes);
}

v1::DoctorCheck CheckHugepages(const HugepageFacts& hugepages) {
  if (!hugepages.known) {
    return Make("hugepages", Check::WARN,
                "HugePages_Total/Free/Hugepagesize not found in /proc/meminfo",
                "optional: check that /proc is mounted; huge pages only speed up pools that "
                "use them");
  }
  const std::string counts =
      fmt::format("HugePages_Total {}, HugePages_Free {}, Hugepagesize {}", hugepages.total,
                  hugepages.free, Bytes(hugepages.page_bytes));
  if (hugepages.total == 0) {
    return Make("hugepages", Check::WARN,
                counts + "; optional: hugetlbfs pools reduce TLB misses",
                "optional: reserve huge pages (sysctl vm.nr_hugepages=N) and back engine pools "
                "with files on a hugetlbfs mount");
  }
  return Make("hugepages", Check::PASS,
              fmt::format("{} ({} free in huge pages)", counts,
                          Bytes(hugepages.free * hugepages.page_bytes)));
}

v1::DoctorCheck CheckFirstTouch(const FirstTouchFacts& facts) {
  if (!facts.measured) {
    return Make("first-touch", Check::WARN,
                fmt::format("not measured ({})", facts.error),
                "optional: a page's first access through the agent's mapping of a pool is "
                "a page fault, paid once per page; check that memfd_create and mmap work "
                "for the agent's user");
  }
  const double gib_s = facts.first_us * (1 << 18) / 1e6;  // 4 KiB pages per GiB
  const std::string figures = fmt::format(
      "first write to a page through a new mapping: {:.2f} us per 4 KiB page, {:.2f} us "
      "once mapped ({} pages probed); a freshly registered pool pays it once per page and "
      "mapping on its first transfers ({:.1f} s per GiB)",
      facts.first_us, facts.mapped_us, facts.pages, gib_s);
  if (facts.first_us < kFirstTouchWarnUs) return Make("first-touch", Check::PASS, figures);
  return Make("first-touch", Check::WARN,
              figures + std::string("; copying a mapped page takes ~0.2 us, so until every "
                                    "page has been touched once, transfers run at a "
                                    "fraction of their speed (costs this high usually "
                                    "come from a virtual machine's paging)"),
              "start kvagentd with --warm-mappings on (it reads every page it maps in the "
              "background; kvagent_mapping_pages_to_warm reaches 0 when done), or "
              "warm each pool after registering it with transfers covering every page "
              "(docs/OPERATIONS.md, \"A slow transfer\"); the agent keeps a mapping for as "
              "long as a region of that memory is registered");
}

v1::DoctorCheck CheckPtraceScope(std::optional<int> scope) {
  constexpr const char* kNeed =
      "UCX's cma transport between unrelated processes needs ptrace permission (only the "
      "same-host UCX data path, --shm-direct off, uses it)";
  if (!scope.has_value()) {
    return Make("ptrace-scope", Check::PASS,
                "Yama not enforced (no /proc/sys/kernel/yama/ptrace_scope)");
  }
  switch (*scope) {
    case 0:
      return Make("ptrace-scope", Check::PASS,
                  "kernel.yama.ptrace_scope 0: same-user processes may attach (cma works)");
    case 1:
      return Make("ptrace-scope", Check::WARN,
                  fmt::format("kernel.yama.ptrace_scope 1 (restricted): {}", kNeed),
                  "sysctl kernel.yama.ptrace_scope=0, or run the agents as the same user with "
                  "CAP_SYS_PTRACE");
    case 2:
      return Make("ptrace-scope", Check::WARN,
                  fmt::format("kernel.yama.ptrace_scope 2 (admin only): {}", kNeed),
                  "sysctl kernel.yama.ptrace_scope=0, or give the agents CAP_SYS_PTRACE");
    case 3:
      return Make("ptrace-scope", Check::WARN,
                  fmt::format("kernel.yama.ptrace_scope 3 (no attach): {}; UCX same-host "
                              "traffic uses posix/sysv or tcp",
                              kNeed),
                  "scope 3 cannot be lowered until reboot; keep the default --shm-direct auto, "
                  "which does not need ptrace");
    default:
      return Make("ptrace-scope", Check::WARN,
                  fmt::format("kernel.yama.ptrace_scope {} is not a known value", *scope),
                  "set kernel.yama.ptrace_scope to 0 or 1 (sysctl)");
  }
}

v1::DoctorCheck CheckRdma(const std::vector<RdmaDevice>& devices,
                          const transport::UcxCapabilities& ucx) {
  if (devices.empty()) {
    return Make("rdma", Check::PASS, "no RDMA devices: cross-host traffic uses TCP");
  }
  std::vector<std::string> names;
  bool any_active = false;
  for (const auto& d : devices) {
    names.push_back(DeviceText(d));
    for (const auto& state : d.port_states) any_active |= absl::StrContains(state, "ACTIVE");
  }
  std::vector<std::string> rdma_transports;
  for (const auto& t : ucx.transports) {
    if (IsRdmaTransport(t)) rdma_transports.push_back(t);
  }
  const std::string found = fmt::format("RDMA devices {}", absl::StrJoin(names, ", "));
  if (!any_active) {
    return Make("rdma", Check::WARN,
                found + ": no port is ACTIVE, so cross-host traffic uses TCP",
                "check the links and the subnet manager (`ibstat`, `ibv_devinfo`)");
  }
  if (rdma_transports.empty()) {
    return Make("rdma", Check::WARN,
                fmt::format("{} but UCX offers no RDMA transport (transports {}): cross-host "
                            "traffic uses TCP",
                            found, List(ucx.transports)),
                "use a UCX build with verbs/mlx5 support (`ucx_info -d` lists rc_verbs or "
                "rc_mlx5) and let UCX_TLS include rc (or leave it unset)");
  }
  return Make("rdma", Check::PASS,
              fmt::format("{}; UCX RDMA transports {}", found, List(rdma_transports)));
}

namespace {

// A connected same-host peer with regions that are not mapped here (PeerInfo
// direct_fallbacks, vmm_import_failures): what they cost and what to check.
v1::DoctorCheck CheckDirectFallbacks(const v1::PeerInfo& p, const std::string& name,
                                     const std::string& path) {
  // PeerInfo lists the first 16 regions and counts them all.
  const int listed = p.direct_fallbacks_size();
  const uint64_t regions =
      std::max<uint64_t>(p.direct_fallback_regions(), static_cast<uint64_t>(listed));
  std::vector<std::string> found;
  if (regions > 0) {
    found.push_back(fmt::format(
        "{} of its regions are not mapped here (shm-direct) and move through host staging "
        "(VRAM) or UCX (host memory) instead",
        regions));
  }
  if (p.vmm_import_failures() > 0) {
    found.push_back(fmt::format("{} of its CUDA VMM allocations could not be imported",
                                p.vmm_import_failures()));
  }
  if (listed > 0) found.push_back(fmt::format("first: {}", p.direct_fallbacks(0)));
  std::string detail = fmt::format("'{}' at {} connected; {}: {}", p.name(), p.address(), path,
                                   absl::StrJoin(found, "; "));
  std::string fix =
      "each such page costs a copy through pinned host buffers (VRAM: host staging, two "
      "copies and a chunk message instead of one device-to-device copy) or a UCX transfer "
      "(host memory: cma, far slower than memcpy); `kvagentctl peers` lists every region and "
      "why. Check: ";
  if (p.vmm_import_failures() > 0) {
    fix +=
        "the exporting engine creates its CUDA VMM allocations with the POSIX file descriptor "
        "handle type (cuMemCreate with requestedHandleTypes "
        "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; one without it cannot be imported "
        "elsewhere), both agents load the same NVIDIA driver (doctor's cuda-driver on each), ";
  }
  fix += fmt::format(
      "both agents run as the same uid (or this agent's uid is in the --peer-uids of '{}') "
      "and see the same /dev/shm, and both run with --shm-direct auto (the default; off "
      "sends every region through UCX or host staging)",
      p.name());
  return Make(name, Check::WARN, std::move(detail), std::move(fix));
}

}  // namespace

std::vector<v1::DoctorCheck> CheckPeers(const std::vector<v1::PeerInfo>& peers) {
  std::vector<v1::DoctorCheck> checks;
  if (peers.empty()) {
    checks.push_back(Make("peers", Check::PASS, "no peers connected"));
    return checks;
  }
  for (const auto& p : peers) {
    const std::string name = "peer:" + p.name();
    const std::string path =
        fmt::format("data path {}, UCX transports {}, error mode {}, {} regions, {}", p.data_path(),
                    p.transports().empty() ? "none" : p.transports(), p.error_mode(), p.regions(),
                    p.same_host() ? "same host" : "other host");
    if (p.state() == "connected") {
      if (p.direct_fallbacks_size() > 0 || p.direct_fallback_regions() > 0 ||
          p.vmm_import_failures() > 0) {
        checks.push_back(CheckDirectFallbacks(p, name, path));
      } else if (p.data_path() == "ucx" && p.transports() == "tcp") {
        // A peer that does not take the agents' own data messages (an older kvagent):
        // UCX 1.13 emulates RMA over tcp, and a side that dies mid-transfer can make it
        // abort the other (ARCHITECTURE.md, "Losing a peer").
        checks.push_back(Make(
            name, Check::WARN,
            fmt::format("'{}' at {} connected; {}: over tcp the data moves as UCX's emulated "
                        "RMA, since the peer does not take this agent's data messages; if it "
                        "dies mid-transfer, UCX 1.13 can abort this agent",
                        p.name(), p.address(), path),
            "upgrade the peer's kvagent (its data path then reads ucx-am), or give both hosts "
            "an RDMA transport"));
      } else if (p.data_path() == "shm-direct+ucx") {
        checks.push_back(Make(
            name, Check::WARN,
            fmt::format("'{}' at {} connected; {}: some of its regions could not be mapped "
                        "here and move through UCX",
                        p.name(), p.address(), path),
            "let this agent open the peer's shared-memory objects (same /dev/shm, permissions); "
            "the peer's log names the regions"));
      } else {
        checks.push_back(Make(name, Check::PASS,
                              fmt::format("'{}' at {} connected; {}", p.name(), p.address(), path)));
      }
    } else if (p.state() == "unreachable") {
      checks.push_back(Make(
          name, Check::FAIL,
          fmt::format("'{}' at {} unreachable, last seen {} ms ago: {}", p.name(), p.address(),
                      p.last_seen_ms_ago(), p.last_error().empty() ? "no error recorded" : p.last_error()),
          fmt::format("check the peer agent is running (kvagentctl --agent {} status) and this "
                      "host reaches {}; transfers to it fail with UNAVAILABLE until it answers",
                      p.address(), p.address())));
    } else {
      checks.push_back(Make(
          name, Check::WARN,
          fmt::format("'{}' at {} in state '{}': {}", p.name(), p.address(), p.state(),
                      p.last_error()),
          fmt::format("reconnect it: kvagentctl connect {}", p.address())));
    }
  }
  return checks;
}

// ---------------------------------------------------------------- live facts

CudaFacts ProbeCuda() {
  CudaFacts facts;
  // Load() runs cuInit once per process (slow on GPU hosts) and then returns that result.
  auto driver = cuda::CudaDriver::Load();
  if (!driver.ok()) {
    // CudaDriver's messages read "<cause>; <what to do>": the check has its own fix
    // field, so the detail keeps the cause.
    const std::string message(driver.status().message());
    facts.error = message.substr(0, message.find("; "));
    return facts;
  }
  facts.loaded = true;
  facts.driver_version = (*driver)->driver_version();
  auto devices = (*driver)->Devices();
  if (!devices.ok()) {
    facts.error = std::string(devices.status().message());
    return facts;
  }
  for (const auto& d : *devices) {
    facts.devices.push_back(CudaDeviceFacts{d.ordinal, d.name, d.pci_bus_id, d.total_bytes});
  }
  return facts;
}

MemlockFacts ReadMemlock() {
  MemlockFacts facts;
  struct rlimit limit {};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) {
    facts.known = false;
    return facts;
  }
  auto bytes = [](rlim_t v) {
    return v == RLIM_INFINITY ? MemlockFacts::kUnlimited : static_cast<uint64_t>(v);
  };
  facts.soft = bytes(limit.rlim_cur);
  facts.hard = bytes(limit.rlim_max);
  return facts;
}

ShmFacts InspectShm(const std::string& path) {
  ShmFacts facts;
  facts.path = path;
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    facts.error = std::strerror(errno);
    return facts;
  }
  if (!S_ISDIR(st.st_mode)) {
    facts.error = "not a directory";
    return facts;
  }
  facts.exists = true;
  struct statvfs vfs {};
  if (statvfs(path.c_str(), &vfs) == 0) {
    facts.size_bytes = uint64_t{vfs.f_blocks} * vfs.f_frsize;
    facts.free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  }
  // Creating a file is the only test that covers read-only mounts, modes and quotas.
  std::string probe = path + "/.kvagent-doctor-XXXXXX";
  int fd = mkstemp(probe.data());
  if (fd < 0) {
    facts.error = fmt::format("creating a file there failed: {}", std::strerror(errno));
    return facts;
  }
  close(fd);
  unlink(probe.c_str());
  facts.writable = true;
  return facts;
}

HugepageFacts ParseMeminfo(std::string_view meminfo) {
  HugepageFacts facts;
  bool total = false, free = false, size = false;
  for (absl::string_view line : absl::StrSplit(absl::string_view(meminfo.data(), meminfo.size()), '\n')) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(line, absl::MaxSplits(':', 1));
    absl::string_view value = absl::StripAsciiWhitespace(kv.second);
    uint64_t number = 0;
    const bool kb = absl::ConsumeSuffix(&value, " kB");
    if (!absl::SimpleAtoi(value, &number)) continue;
    if (kv.first == "HugePages_Total") {
      facts.total = number;
      total = true;
    } else if (kv.first == "HugePages_Free") {
      facts.free = number;
      free = true;
    } else if (kv.first == "Hugepagesize") {
      facts.page_bytes = kb ? number * 1024 : number;
      size = true;
    }
  }
  facts.known = total && free && size;
  return facts;
}

FirstTouchFacts ProbeFirstTouch(uint32_t pages) {
  FirstTouchFacts facts;
  facts.pages = pages;
  const size_t bytes = size_t{pages} * 4096;
  const int fd = memfd_create("kvagent-doctor-first-touch", MFD_CLOEXEC);
  if (fd < 0) {
    facts.error = fmt::format("memfd_create: {}", std::strerror(errno));
    return facts;
  }
  auto map = [&]() -> void* {
    void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (at == MAP_FAILED) facts.error = fmt::format("mmap: {}", std::strerror(errno));
    return at;
  };
  void* first = MAP_FAILED;
  void* second = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    facts.error = fmt::format("ftruncate: {}", std::strerror(errno));
  } else if ((first = map()) != MAP_FAILED) {
    std::memset(first, 1, bytes);  // the pages exist, as an engine's pool's do
    if ((second = map()) != MAP_FAILED) {
      volatile uint8_t* page = static_cast<volatile uint8_t*>(second);
      double us[2];
      for (double& pass : us) {
        const auto start = std::chrono::steady_clock::now();
        for (size_t i = 0; i < pages; ++i) page[i * 4096] = 2;
        pass = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() -
                                                         start)
                   .count() /
               std::max<uint32_t>(1, pages);
      }
      facts.first_us = us[0];
      facts.mapped_us = us[1];
      facts.measured = true;
    }
  }
  if (second != MAP_FAILED) munmap(second, bytes);
  if (first != MAP_FAILED) munmap(first, bytes);
  close(fd);
  return facts;
}

namespace {

// Two CPUs this thread may run on (the second on another CPU when it may use more than
// one), for ProbeWakeup's two threads.
std::pair<int, int> TwoCpus(bool* distinct) {
  const std::vector<int> allowed = AllowedCpus();
  const int first = allowed.empty() ? -1 : allowed[0];
  const int second = allowed.size() > 1 ? allowed[1] : -1;
  *distinct = second >= 0;
  return {first, second >= 0 ? second : first};
}

void PinTo(int cpu) {
  if (cpu >= 0) PinThread(pthread_self(), {cpu});  // best effort
}

}  // namespace

WakeupFacts ProbeWakeup(uint32_t rounds, uint32_t pause_us) {
  using Clock = std::chrono::steady_clock;
  WakeupFacts facts;
  const int fd = eventfd(0, EFD_CLOEXEC);
  if (fd < 0) {
    facts.error = fmt::format("eventfd: {}", std::strerror(errno));
    return facts;
  }
  // The sleeper and the waker on two different CPUs where the process may use two:
  // a wake-up on the waker's own CPU costs little anywhere; one that must reach another
  // CPU (an engine's thread and the agent's, each busy on its own) is the one measured.
  bool distinct = false;
  const auto [waker_cpu, sleeper_cpu] = TwoCpus(&distinct);
  std::vector<Clock::time_point> written(rounds), woke(rounds);
  std::atomic<uint32_t> done{0};
  std::string helper_error, write_error;  // each written by one thread
  std::thread helper([&, sleeper_cpu = sleeper_cpu] {
    PinTo(sleeper_cpu);
    for (uint32_t i = 0; i < rounds; ++i) {
      pollfd p{fd, POLLIN, 0};
      const int ready = poll(&p, 1, 1000);
      uint64_t value = 0;
      if (ready != 1 || read(fd, &value, sizeof(value)) != sizeof(value)) {
        helper_error = ready == 0 ? "a sleeping thread was not woken within 1 s"
                                  : fmt::format("poll/read of the eventfd: {}",
                                                std::strerror(errno));
        return;
      }
      woke[i] = Clock::now();
      done.store(i + 1, std::memory_order_release);
    }
  });
  std::thread waker([&, waker_cpu = waker_cpu] {
    PinTo(waker_cpu);
    for (uint32_t i = 0; i < rounds; ++i) {
      std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
      if (done.load(std::memory_order_acquire) != i) break;  // the helper gave up
      written[i] = Clock::now();
      const uint64_t one = 1;
      if (write(fd, &one, sizeof(one)) != sizeof(one)) {
        write_error = fmt::format("write to the eventfd: {}", std::strerror(errno));
        break;
      }
      // The next pause starts once the helper ran (or gave up: at most its 1 s).
      const auto deadline = Clock::now() + std::chrono::milliseconds(1100);
      while (done.load(std::memory_order_acquire) == i && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  });
  waker.join();
  if (done.load(std::memory_order_acquire) != rounds) {
    // Unblock a helper still waiting (it reads this and ends, or has ended).
    const uint64_t one = 1;
    for (uint32_t i = 0; i < rounds; ++i) (void)!write(fd, &one, sizeof(one));
  }
  helper.join();
  close(fd);
  const uint32_t n = done.load(std::memory_order_acquire);
  if (n != rounds || rounds == 0) {
    facts.error = rounds == 0              ? "no rounds asked"
                  : !write_error.empty()   ? write_error
                  : !helper_error.empty()  ? helper_error
                                           : "the probe ended early";
    return facts;
  }
  std::vector<double> us(rounds);
  for (uint32_t i = 0; i < rounds; ++i) {
    us[i] = std::max(0.0, std::chrono::duration<double, std::micro>(woke[i] - written[i]).count());
  }
  std::sort(us.begin(), us.end());
  auto at = [&](double q) {
    return us[std::min<size_t>(us.size() - 1, static_cast<size_t>(q * (us.size() - 1) + 0.5))];
  };
  facts.rounds = rounds;
  facts.other_cpu = distinct;
  facts.p50_us = at(0.5);
  facts.p90_us = at(0.9);
  facts.max_us = us.back();
  facts.measured = true;
  return facts;
}

std::optional<int> ReadPtraceScope(const std::string& path) {
  auto text = ReadFileText(path);
  if (!text.has_value()) return std::nullopt;
  int scope = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &scope)) return -1;
  return scope;
}

v1::DoctorCheck CheckWakeup(const WakeupFacts& facts) {
  if (!facts.measured) {
    return Make("wake-up", Check::WARN, fmt::format("not measured ({})", facts.error),
                "optional: check that eventfd and threads work for the agent's user");
  }
  const std::string figures = fmt::format(
      "a thread asleep on an eventfd runs {:.0f} us after a thread on {} wakes it (p50; "
      "p90 {:.0f}, max {:.0f}; {} rounds)",
      facts.p50_us, facts.other_cpu ? "another CPU" : "its CPU (the only one allowed)",
      facts.p90_us, facts.max_us, facts.rounds);
  if (facts.p50_us < kWakeupWarnUs) return Make("wake-up", Check::PASS, figures);
  return Make("wake-up", Check::WARN,
              figures + "; a small transfer pays two to four of these whenever its client "
                        "or an agent has gone to sleep (the client on its completion, the "
                        "receiving agent for the acknowledgement), so they, not the copy, "
                        "set its latency (costs this high usually come from a virtual "
                        "machine's halted idle vCPUs, or from more busy threads than cores)",
              "complete_when PLACED takes the receiver's acknowledgement off the sender's "
              "path; keep the agent's progress thread on a CPU of its own, away from "
              "the engines' threads (kvagentd --worker-cpus), so that neither waits for "
              "the other to yield the core; where cores are spare, poll longer before "
              "sleeping (kvagentd --fast-path-spin-us, an engine's FastPathOptions.spin_us); "
              "on a virtual "
              "machine, an idle driver that polls before halting (cpuidle-haltpoll) or "
              "dedicated vCPUs (docs/OPERATIONS.md, \"A slow transfer\")");
}

namespace {

// The names in `dir` (not the dot files), sorted; none when it cannot be read.
std::vector<std::string> SortedEntries(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') names.emplace_back(e->d_name);
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// The numbered entries of a DAMON sysfs directory ("0", "1", ...), in order; the
// kernel lays a count file (nr_kdamonds, nr_contexts, nr_schemes) beside them.
std::vector<std::string> NumberedEntries(const std::string& dir) {
  std::vector<std::string> out;
  for (auto& name : SortedEntries(dir)) {
    if (std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      out.push_back(std::move(name));
    }
  }
  std::sort(out.begin(), out.end(), [](const std::string& a, const std::string& b) {
    return a.size() != b.size() ? a.size() < b.size() : a < b;
  });
  return out;
}

// A sysfs file's first word ("" when it cannot be read).
std::string ReadWord(const std::string& path) {
  auto text = ReadFileText(path);
  if (!text.has_value()) return "";
  absl::string_view s = absl::StripAsciiWhitespace(*text);
  return std::string(s.substr(0, s.find_first_of(" \t\n")));
}

}  // namespace

DamonFacts ReadDamon(const std::string& admin_dir) {
  DamonFacts facts;
  struct stat st {};
  facts.present = stat(admin_dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  const std::string kdamonds = admin_dir + "/kdamonds";
  for (const auto& k : NumberedEntries(kdamonds)) {
    const std::string dir = kdamonds + "/" + k;
    if (ReadWord(dir + "/state") != "on") continue;
    DamonKdamond kdamond;
    kdamond.name = "kdamonds/" + k;
    for (const auto& c : NumberedEntries(dir + "/contexts")) {
      const std::string context = dir + "/contexts/" + c;
      const std::string ops = ReadWord(context + "/operations");
      kdamond.operations.push_back(ops.empty() ? "unknown" : ops);
      for (const auto& scheme : NumberedEntries(context + "/schemes")) {
        const std::string action = ReadWord(context + "/schemes/" + scheme + "/action");
        if (!action.empty()) kdamond.actions.push_back(action);
      }
    }
    facts.running.push_back(std::move(kdamond));
  }
  return facts;
}

v1::DoctorCheck CheckDamon(const DamonFacts& facts) {
  if (facts.running.empty()) {
    return Make("damon", Check::PASS,
                facts.present ? "no DAMON kdamond running" : "DAMON not in this kernel's sysfs");
  }
  std::vector<std::string> parts;
  bool physical = false;
  for (const auto& k : facts.running) {
    physical = physical || std::find(k.operations.begin(), k.operations.end(), "paddr") !=
                               k.operations.end();
    parts.push_back(fmt::format("{} on {}, schemes: {}", k.name,
                                k.operations.empty() ? "no context" : absl::StrJoin(k.operations, "+"),
                                k.actions.empty() ? "none" : absl::StrJoin(k.actions, ", ")));
  }
  const std::string running = absl::StrJoin(parts, "; ");
  if (!physical) {
    return Make("damon", Check::PASS,
                fmt::format("DAMON runs on named processes only ({}); host pools are not "
                            "sampled unless the engines are among them",
                            running));
  }
  return Make("damon", Check::WARN,
              fmt::format("DAMON samples physical memory ({}): host pools' pages are sampled "
                          "too, and memory a pool has not touched for seconds can be slower "
                          "to touch again (measured on a PVM guest: up to ~1.3 us more per "
                          "4 KiB page after 20 s idle) or be acted on by its schemes; cold "
                          "transfers and benchmark figures pay it",
                          running),
              "on a node that serves, stop it (write off to the kdamond's state file) or "
              "keep its regions off the pools' memory; `kvagentctl bench` shows what it "
              "costs here");
}

std::vector<RdmaDevice> ListRdmaDevices(const std::string& sysfs_dir) {
  std::vector<RdmaDevice> devices;
  for (const auto& name : SortedEntries(sysfs_dir)) {
    RdmaDevice device;
    device.name = name;
    const std::string ports = sysfs_dir + "/" + name + "/ports";
    for (const auto& port : SortedEntries(ports)) {
      // The file reads "4: ACTIVE"; keep the word.
      auto state = ReadFileText(ports + "/" + port + "/state");
      std::string word = "UNKNOWN";
      if (state.has_value()) {
        absl::string_view s = absl::StripAsciiWhitespace(*state);
        const size_t colon = s.find(':');
        word = std::string(absl::StripAsciiWhitespace(colon == s.npos ? s : s.substr(colon + 1)));
      }
      device.port_states.push_back(fmt::format("port {} {}", port, word));
    }
    devices.push_back(std::move(device));
  }
  return devices;
}

v1::DoctorCheck CheckPrivileges(uid_t euid, bool has_ipc_lock) {
  if (euid == 0) {
    return Make("privileges", Check::WARN,
                "kvagentd runs as root: every engine's memory and every peer's input meet a "
                "process that can do anything on this host",
                "run it as its own unprivileged user with only CAP_IPC_LOCK (systemd: "
                "User=kvagent, AmbientCapabilities=CAP_IPC_LOCK, LimitMEMLOCK=infinity; "
                "Kubernetes: runAsUser and capabilities.add [IPC_LOCK], not privileged)");
  }
  return Make("privileges", Check::PASS,
              fmt::format("runs as uid {}{}", euid,
                          has_ipc_lock ? " with CAP_IPC_LOCK"
                                       : " without CAP_IPC_LOCK (pinning is bound by "
                                         "RLIMIT_MEMLOCK)"));
}


// ---------------------------------------------------------------- report

v1::DoctorReport RunDoctor(const DoctorInputs& inputs) {
  v1::DoctorReport report;
  report.set_agent(inputs.agent);
  const transport::UcxCapabilities& ucx = *inputs.ucx;
  const CudaFacts cuda = ProbeCuda();
  const char* tls = std::getenv("UCX_TLS");
  *report.add_checks() = CheckUcx(ucx);
  *report.add_checks() = CheckUcxHardening(inputs.ucx_refused, inputs.ucx_tcp_guarded,
                                               inputs.ucx_tcp_remote_checked,
                                               inputs.ucx_tcp_allowed_hosts);
  *report.add_checks() = CheckUcxCuda(ucx, cuda, tls != nullptr ? tls : "");
  *report.add_checks() = CheckCudaDriver(cuda);
  if (!inputs.device_copy.empty()) {
    *report.add_checks() = CheckDeviceCopy(inputs.device_copy, cuda);
  }
  *report.add_checks() = CheckMemlock(ReadMemlock());
  *report.add_checks() = CheckDevShm(InspectShm(inputs.shm_path));
  *report.add_checks() =
      CheckHugepages(ParseMeminfo(ReadFileText(inputs.meminfo_path).value_or("")));
  *report.add_checks() = CheckFirstTouch(ProbeFirstTouch());
  *report.add_checks() = CheckWakeup(ProbeWakeup());
  *report.add_checks() = CheckDamon(ReadDamon(inputs.damon_dir));
  *report.add_checks() = CheckPtraceScope(ReadPtraceScope(inputs.ptrace_scope_path));
  *report.add_checks() = CheckRdma(ListRdmaDevices(inputs.rdma_dir), ucx);
  *report.add_checks() = CheckPrivileges(inputs.euid, inputs.has_ipc_lock);
  for (auto& check : CheckPeers(inputs.peers)) *report.add_checks() = std::move(check);
  return report;
}

std::vector<std::string> SummaryLines(const v1::DoctorReport& report) {
  std::vector<std::string> lines;
  for (const auto& c : report.checks()) {
    lines.push_back(fmt::format("{} {} {}", c.name(),
                                v1::DoctorCheck::Result_Name(c.result()), c.detail()));
  }
  return lines;
}

void LogDoctorReport(const v1::DoctorReport& report) {
  const std::vector<std::string> lines = SummaryLines(report);
  for (int i = 0; i < report.checks_size(); ++i) {
    const auto& c = report.checks(i);
    switch (c.result()) {
      case Check::PASS:
        kLog.Info("{}", lines[i]);
        break;
      case Check::FAIL:
        kLog.Error("{}; fix: {}", lines[i], c.fix());
        break;
      default:
        kLog.Warn("{}; fix: {}", lines[i], c.fix());
        break;
    }
  }
}

bool HasFailure(const v1::DoctorReport& report) {
  return std::any_of(report.checks().begin(), report.checks().end(),
                     [](const v1::DoctorCheck& c) { return c.result() == Check::FAIL; });
}

}  // namespace kvagent::agent

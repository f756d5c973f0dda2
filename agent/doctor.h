// Doctor: the agent's check of what moving KV pages needs from this host (UCX, the
// CUDA driver, locked memory, /dev/shm, hugepages, the first-touch cost of a new
// mapping, ptrace scope, RDMA) and from its peers. Used by AgentService::Doctor, the
// agent's start-up log and `kvagentctl doctor`.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "proto/kvagent.pb.h"
#include "registry/region_registry.h"
#include "transport/ucx_context.h"
#include "transport/ucx_hardening.h"
#include "transport/ucx_tcp_guard.h"

namespace kvagent::agent {

// Each check is a pure function of the facts it judges, so a test can hand it any
// machine's facts; the Probe*/Read* functions below gather the live ones.

struct CudaDeviceFacts {
  int ordinal = 0;
  std::string name;
  std::string pci_bus_id;
  uint64_t total_bytes = 0;
};

struct CudaFacts {
  bool loaded = false;     // cuda::CudaDriver::Load() succeeded (dlopen + cuInit)
  std::string error;       // why not, or why the devices are unknown
  int driver_version = 0;  // 12040 = 12.4
  std::vector<CudaDeviceFacts> devices;
};

// RLIMIT_MEMLOCK in bytes; kUnlimited stands for RLIM_INFINITY.
struct MemlockFacts {
  static constexpr uint64_t kUnlimited = UINT64_MAX;
  bool known = true;
  uint64_t soft = 0;
  uint64_t hard = 0;
};

struct ShmFacts {
  std::string path = "/dev/shm";
  bool exists = false;
  bool writable = false;
  uint64_t size_bytes = 0;
  uint64_t free_bytes = 0;
  std::string error;  // why it is missing or not writable
};

struct HugepageFacts {
  bool known = false;  // /proc/meminfo was readable and had the fields
  uint64_t total = 0;
  uint64_t free = 0;
  uint64_t page_bytes = 0;
};

// What a page's first access through a new mapping costs here (ProbeFirstTouch): the
// agent maps every pool anew when it is registered (and a peer's, for a same-host copy
// route), and each page pays this once per mapping, on the first transfer that touches it.
struct FirstTouchFacts {
  bool measured = false;
  std::string error;         // why not
  uint32_t pages = 0;        // 4 KiB pages probed
  double first_us = 0;       // per page: one byte written through a new mapping of them
  double mapped_us = 0;      // per page: the same again, now mapped
};

// How long a thread asleep on an eventfd takes to run once another thread writes it
// (ProbeWakeup). Whenever a side of a transfer has gone to sleep (the client on its
// completion doorbell, an agent's UCX thread on its event fd), the transfer pays one.
struct WakeupFacts {
  bool measured = false;
  std::string error;  // why not
  uint32_t rounds = 0;
  bool other_cpu = false;  // woken from another CPU (false: only one CPU is allowed)
  double p50_us = 0;
  double p90_us = 0;
  double max_us = 0;
};

// DAMON's kdamonds (/sys/kernel/mm/damon/admin): a kernel thread that samples pages'
// accessed bits and may act on the pages it finds idle (its schemes: pageout, lru_prio,
// ...). One entry per kdamond whose state is "on".
struct DamonKdamond {
  std::string name;                     // "kdamonds/0"
  std::vector<std::string> operations;  // per context: "paddr", "vaddr", "fvaddr"
  std::vector<std::string> actions;     // its schemes' actions: "pageout", "stat", ...
};
struct DamonFacts {
  bool present = false;  // the admin directory exists (DAMON_SYSFS)
  std::vector<DamonKdamond> running;
};

struct RdmaDevice {
  std::string name;                      // "mlx5_0"
  std::vector<std::string> port_states;  // "1: ACTIVE", one per port
};

constexpr uint64_t kMinMemlockBytes = 64ull << 20;
constexpr uint64_t kMinShmFreeBytes = 1ull << 30;

v1::DoctorCheck CheckUcx(const transport::UcxCapabilities& ucx);
// "ucx-hardening": PASS naming the UCX protocols whose messages from peers are dropped
// (`refused`: transport::UcxRefusedProtocols); WARN when there are none (kvagentd
// started with KVAGENT_UCX_UNHARDENED=1): any authenticated peer can then read and
// write the agent's memory through UCX's software RMA. `tcp_guarded`
// (transport::UcxTcpGuarded): local connections to UCX's TCP port are kept only from
// peer uids; WARN when not, since UCT's put request writes anywhere in the process.
// `remote_checked` (transport::UcxTcpRemoteChecked): connections from other hosts are
// kept only from authenticated peers' addresses (`allowed_hosts` of them now); WARN
// when every host's are (--ucx-tcp-remote any).
v1::DoctorCheck CheckUcxHardening(const std::vector<std::string>& refused, bool tcp_guarded,
                                  bool remote_checked, size_t allowed_hosts);
// `ucx_tls` is the UCX_TLS environment variable (empty when unset): a CUDA-enabled
// UCX loses its CUDA memory type when UCX_TLS leaves out the cuda transports.
v1::DoctorCheck CheckUcxCuda(const transport::UcxCapabilities& ucx, const CudaFacts& cuda,
                             std::string_view ucx_tls);
v1::DoctorCheck CheckCudaDriver(const CudaFacts& cuda);
// "device-copy": how same-host VRAM pages are copied here (`mode`, from the device
// copy path: DeviceCopyMode in agent/data_path.h), and what that costs. PASS: it
// reports, it does not judge (a driver problem is cuda-driver's).
v1::DoctorCheck CheckDeviceCopy(std::string_view mode, const CudaFacts& cuda);
v1::DoctorCheck CheckMemlock(const MemlockFacts& memlock);
v1::DoctorCheck CheckDevShm(const ShmFacts& shm);
v1::DoctorCheck CheckHugepages(const HugepageFacts& hugepages);
// "first-touch": WARN from kFirstTouchWarnUs per page (a freshly registered pool's first
// transfers then run at a fraction of their speed), with what it costs per GiB and the
// remedy; PASS below it, with the figures.
constexpr double kFirstTouchWarnUs = 2.0;
v1::DoctorCheck CheckFirstTouch(const FirstTouchFacts& facts);
// "wake-up": WARN from kWakeupWarnUs (p50): a one-page transfer crosses two to four
// wake-ups whenever its client or an agent has gone to sleep, so they set the floor of
// small transfers' latency; PASS below it, with the figures.
constexpr double kWakeupWarnUs = 30.0;
v1::DoctorCheck CheckWakeup(const WakeupFacts& facts);
// "damon": WARN when a kdamond runs on physical memory (paddr): it samples every
// page's accessed bit, host pools' pages included, and its schemes act on those it finds
// idle, so memory a pool has not touched for seconds can be slower to touch again (on a
// PVM guest measured here, up to ~1.3 µs more per 4 KiB page after 20 s idle:
// docs/BENCHMARKS.md, "Scattered pieces, again") or paged out. PASS when none runs, or
// only on named processes (vaddr), with what runs.
v1::DoctorCheck CheckDamon(const DamonFacts& facts);
// `scope` is the content of /proc/sys/kernel/yama/ptrace_scope; nullopt when Yama is
// not there.
v1::DoctorCheck CheckPtraceScope(std::optional<int> scope);
v1::DoctorCheck CheckRdma(const std::vector<RdmaDevice>& devices,
                          const transport::UcxCapabilities& ucx);
// "privileges": WARN when the agent runs as root (euid 0). It needs no more than
// CAP_IPC_LOCK (to pin memory) as its own user; as root, a flaw in it is a flaw in root.
v1::DoctorCheck CheckPrivileges(uid_t euid, bool has_ipc_lock);
// One check per peer ("peer:<name>"), or one "peers" check when there are none. A
// connected same-host peer with regions not mapped here (direct_fallbacks, VMM import
// failures) is a WARN naming the count and the first reason, with what to check.
std::vector<v1::DoctorCheck> CheckPeers(const std::vector<v1::PeerInfo>& peers);

// Live facts. Each reads one thing and never fails: what it cannot read it says in
// the facts (error / known = false).
CudaFacts ProbeCuda();  // CudaDriver loads once per process; later calls reuse it
MemlockFacts ReadMemlock();
ShmFacts InspectShm(const std::string& path);
HugepageFacts ParseMeminfo(std::string_view meminfo);
// Writes `pages` pages of a memfd through one mapping (allocating them), maps them
// again, and times one byte written per page through the new mapping, then again.
// About pages x 2 page faults (256 pages: ~1-10 ms).
FirstTouchFacts ProbeFirstTouch(uint32_t pages = 256);
// `rounds` times: a thread sleeps in a blocking read of an eventfd, another, pinned to
// a different CPU where two are allowed, waits `pause_us` (so that the sleeper, and an
// idle CPU, are asleep), notes the time and writes the eventfd; the sleeper notes when it
// runs. About rounds x pause_us (32 x 500 µs: ~20 ms). A sleeper not woken within a
// second ends the probe (not measured).
WakeupFacts ProbeWakeup(uint32_t rounds = 32, uint32_t pause_us = 500);
std::optional<int> ReadPtraceScope(const std::string& path);
std::vector<RdmaDevice> ListRdmaDevices(const std::string& sysfs_dir);
// `admin_dir`: /sys/kernel/mm/damon/admin (tests point it elsewhere).
DamonFacts ReadDamon(const std::string& admin_dir);

struct DoctorInputs {
  std::string agent;
  const transport::UcxCapabilities* ucx = nullptr;  // required
  // The UCX protocols this process refuses to peers (empty: not hardened).
  std::vector<std::string> ucx_refused = transport::UcxRefusedProtocols();
  // Whether UCX's TCP port keeps local connections only from peer uids.
  bool ucx_tcp_guarded = transport::UcxTcpGuarded();
  // Whether it keeps other hosts' connections only from authenticated peers' addresses
  // (--ucx-tcp-remote peers), and how many hosts those are now.
  bool ucx_tcp_remote_checked = transport::UcxTcpRemoteChecked();
  size_t ucx_tcp_allowed_hosts = transport::UcxTcpAllowedHosts();
  std::vector<v1::PeerInfo> peers;
  // The device copy path's mode (TransferEngine::device_copy_mode); "" leaves the
  // device-copy check out.
  std::string device_copy;
  // Where the host facts come from (tests point these elsewhere).
  std::string shm_path = "/dev/shm";
  std::string meminfo_path = "/proc/meminfo";
  std::string ptrace_scope_path = "/proc/sys/kernel/yama/ptrace_scope";
  std::string rdma_dir = "/sys/class/infiniband";
  std::string damon_dir = "/sys/kernel/mm/damon/admin";
  // The process's effective uid and CAP_IPC_LOCK (tests set them).
  uid_t euid = geteuid();
  bool has_ipc_lock = registry::HasIpcLockCapability();
};

// Gathers the live facts and runs every check, in a fixed order.
v1::DoctorReport RunDoctor(const DoctorInputs& inputs);

// "<name> <RESULT> <detail>", one per check; logged by the "doctor" logger they read
// "INFO  doctor: ucx PASS UCX 1.13.1; ...".
std::vector<std::string> SummaryLines(const v1::DoctorReport& report);
// Logs SummaryLines at INFO/WARN/ERROR by result, with the fix on WARN and FAIL; the
// ucx-cuda line is the WARN that says a GPU is present but UCX lacks CUDA.
void LogDoctorReport(const v1::DoctorReport& report);
bool HasFailure(const v1::DoctorReport& report);

}  // namespace kvagent::agent

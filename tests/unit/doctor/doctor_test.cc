// Each Doctor check's PASS/WARN/FAIL decision and its message, from hand-made facts;
// the fact readers against files written under TEST_TMPDIR; RunDoctor's order.
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "agent/doctor.h"
#include "catch2/catch.hpp"

namespace kvagent::agent {
namespace {

using Result = v1::DoctorCheck;

transport::UcxCapabilities HostUcx() {
  transport::UcxCapabilities ucx;
  ucx.version = "1.13.1";
  ucx.transports = {"self", "tcp", "sysv", "posix", "cma"};
  ucx.memory_types = {"host"};
  return ucx;
}

transport::UcxCapabilities CudaUcx() {
  transport::UcxCapabilities ucx = HostUcx();
  ucx.transports.push_back("cuda_copy");
  ucx.transports.push_back("cuda_ipc");
  ucx.memory_types = {"host", "cuda", "cuda-managed"};
  ucx.cuda_memory = true;
  return ucx;
}

CudaFacts OneGpu() {
  CudaFacts cuda;
  cuda.loaded = true;
  cuda.driver_version = 12040;
  cuda.devices.push_back({0, "NVIDIA H100 80GB HBM3", "0000:18:00.0", 85ull << 30});
  return cuda;
}

CudaFacts NoDriver() {
  CudaFacts cuda;
  cuda.error = "libcuda.so.1: cannot open shared object file: No such file or directory";
  return cuda;
}

bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string TempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name + "." +
                    std::to_string(getpid());
  std::string cmd = "rm -rf '" + dir + "'";
  REQUIRE(std::system(cmd.c_str()) == 0);
  REQUIRE(mkdir(dir.c_str(), 0755) == 0);
  return dir;
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  REQUIRE(out.good());
}

TEST_CASE("ucx lists version, transports and memory types") {
  auto check = CheckUcx(HostUcx());
  CHECK(check.name() == "ucx");
  CHECK(check.result() == Result::PASS);
  CHECK(check.detail() ==
        "UCX 1.13.1; transports [self,tcp,sysv,posix,cma]; memory types [host]");
  CHECK(check.fix().empty());

  transport::UcxCapabilities none = HostUcx();
  none.transports.clear();
  auto failed = CheckUcx(none);
  CHECK(failed.result() == Result::FAIL);
  CHECK(Has(failed.fix(), "UCX_TLS"));
}

TEST_CASE("ucx-hardening names the protocols refused to peers, and warns when there are none") {
  auto hardened = CheckUcxHardening({"put (software RMA)", "stream data"}, true, true, 3);
  CHECK(hardened.name() == "ucx-hardening");
  CHECK(hardened.result() == Result::PASS);
  CHECK(hardened.detail() == "peers' UCX messages of [put (software RMA),stream data] are "
                             "dropped; tagged messages are discarded; UCX's TCP port keeps a "
                             "local connection only from a peer uid, and one from another "
                             "host only from an authenticated peer's address (3 known now)");
  // Other hosts let in whoever they are (--ucx-tcp-remote any).
  auto any_host = CheckUcxHardening({"put (software RMA)"}, true, false, 0);
  CHECK(any_host.result() == Result::WARN);
  CHECK(Has(any_host.detail(), "--ucx-tcp-remote any"));
  CHECK(Has(any_host.fix(), "UCX_TCP_PORT_RANGE"));
  // The guard checks other hosts unless told otherwise.
  CHECK(DoctorInputs{}.ucx_tcp_remote_checked);
  // Hardened, but without the accept() guard (a binary other than kvagentd).
  auto unguarded = CheckUcxHardening({"put (software RMA)"}, false, true, 0);
  CHECK(unguarded.result() == Result::WARN);
  CHECK(Has(unguarded.detail(), "writes anywhere in this process"));
  CHECK(Has(unguarded.fix(), "run kvagentd"));
  // This test process links no accept() guard.
  CHECK_FALSE(DoctorInputs{}.ucx_tcp_guarded);
  auto open = CheckUcxHardening({}, false, true, 0);
  CHECK(open.result() == Result::WARN);
  CHECK(Has(open.detail(), "KVAGENT_UCX_UNHARDENED=1"));
  CHECK(Has(open.detail(), "read and write all of its memory"));
  CHECK(Has(open.fix(), "without KVAGENT_UCX_UNHARDENED"));
  // This test process never hardened UCX: what an agent started unhardened would say.
  CHECK(DoctorInputs{}.ucx_refused.empty());
}

TEST_CASE("ucx-cuda warns without CUDA memory, says so plainly when a GPU is present") {
  auto no_gpu = CheckUcxCuda(HostUcx(), NoDriver(), "");
  CHECK(no_gpu.name() == "ucx-cuda");
  CHECK(no_gpu.result() == Result::WARN);
  CHECK(Has(no_gpu.detail(), "no CUDA memory type"));
  CHECK(Has(no_gpu.detail(), "VRAM regions will use host staging or fail"));
  CHECK(Has(no_gpu.fix(), "CUDA-enabled UCX"));
  CHECK(Has(no_gpu.fix(), "UCX_MODULE_DIR"));
  CHECK(Has(no_gpu.fix(), "UCX_TLS"));
  CHECK(Has(no_gpu.fix(), "cuda_copy,cuda_ipc"));

  auto gpu = CheckUcxCuda(HostUcx(), OneGpu(), "");
  CHECK(gpu.result() == Result::WARN);
  CHECK(Has(gpu.detail(), "GPU present but UCX lacks CUDA: VRAM moves through host staging"));
  CHECK(Has(gpu.detail(), "1 CUDA device(s)"));

  // A UCX_TLS without cuda transports is named as the likely cause.
  auto tls = CheckUcxCuda(HostUcx(), OneGpu(), "tcp,self");
  CHECK(Has(tls.detail(), "UCX_TLS=tcp,self leaves out the cuda transports"));
  auto tls_cuda = CheckUcxCuda(HostUcx(), OneGpu(), "tcp,cuda_copy");
  CHECK_FALSE(Has(tls_cuda.detail(), "leaves out"));

  auto pass = CheckUcxCuda(CudaUcx(), OneGpu(), "");
  CHECK(pass.result() == Result::PASS);
  CHECK(Has(pass.detail(), "host,cuda,cuda-managed"));
  CHECK(pass.fix().empty());
}

TEST_CASE("cuda-driver: absent, no devices, devices") {
  auto absent = CheckCudaDriver(NoDriver());
  CHECK(absent.name() == "cuda-driver");
  CHECK(absent.result() == Result::WARN);
  CHECK(absent.detail() ==
        "libcuda.so.1 not loadable: libcuda.so.1: cannot open shared object file: No such "
        "file or directory; VRAM regions cannot be registered");
  CHECK(Has(absent.fix(), "install the NVIDIA driver"));

  CudaFacts empty = OneGpu();
  empty.devices.clear();
  auto none = CheckCudaDriver(empty);
  CHECK(none.result() == Result::WARN);
  CHECK(Has(none.detail(), "driver 12.4 (12040)"));
  CHECK(Has(none.detail(), "sees no CUDA devices"));
  CHECK(Has(none.fix(), "CUDA_VISIBLE_DEVICES"));

  auto pass = CheckCudaDriver(OneGpu());
  CHECK(pass.result() == Result::PASS);
  CHECK(pass.detail() ==
        "libcuda.so.1 driver 12.4 (12040); 1 device(s): 0 NVIDIA H100 80GB HBM3 "
        "[0000:18:00.0] 85.0 GiB");
}

TEST_CASE("device-copy names the mode it is given and what it means here") {
  auto none = CheckDeviceCopy("none (no CUDA driver)", NoDriver());
  CHECK(none.name() == "device-copy");
  CHECK(none.result() == Result::PASS);
  CHECK(none.detail().rfind("none (no CUDA driver): VRAM is not copied between agents", 0) == 0);
  CHECK(none.fix().empty());
  auto gpu = CheckDeviceCopy("cuMemcpyAsync per page", OneGpu());
  CHECK(gpu.result() == Result::PASS);
  CHECK(gpu.detail().rfind("cuMemcpyAsync per page: how VRAM pages of same-host peers", 0) == 0);
}

TEST_CASE("privileges warn when the agent runs as root, with the unprivileged setup") {
  auto root = CheckPrivileges(0, true);
  CHECK(root.name() == "privileges");
  CHECK(root.result() == Result::WARN);
  CHECK(Has(root.detail(), "runs as root"));
  CHECK(Has(root.fix(), "CAP_IPC_LOCK"));
  CHECK(Has(root.fix(), "User=kvagent"));
  CHECK(Has(root.fix(), "not privileged"));

  auto user = CheckPrivileges(998, true);
  CHECK(user.result() == Result::PASS);
  CHECK(user.detail() == "runs as uid 998 with CAP_IPC_LOCK");
  auto bare = CheckPrivileges(998, false);
  CHECK(bare.result() == Result::PASS);
  CHECK(Has(bare.detail(), "without CAP_IPC_LOCK"));
}

TEST_CASE("memlock passes unlimited or >= 64 MiB, warns below with the ways to raise it") {
  MemlockFacts unlimited{true, MemlockFacts::kUnlimited, MemlockFacts::kUnlimited};
  auto pass = CheckMemlock(unlimited);
  CHECK(pass.result() == Result::PASS);
  CHECK(pass.detail() == "RLIMIT_MEMLOCK soft unlimited, hard unlimited");

  CHECK(CheckMemlock({true, 64ull << 20, 64ull << 20}).result() == Result::PASS);

  auto low = CheckMemlock({true, 8ull << 20, 8ull << 20});
  CHECK(low.result() == Result::WARN);
  CHECK(Has(low.detail(), "soft 8.0 MiB, hard 8.0 MiB, under 64.0 MiB"));
  CHECK(Has(low.detail(), "RDMA"));
  CHECK(Has(low.detail(), "pinned host staging"));
  CHECK(Has(low.fix(), "ulimit -l unlimited"));
  CHECK(Has(low.fix(), "LimitMEMLOCK=infinity"));
  CHECK_FALSE(Has(low.fix(), "hard limit"));

  auto raisable = CheckMemlock({true, 8ull << 20, MemlockFacts::kUnlimited});
  CHECK(raisable.result() == Result::WARN);
  CHECK(Has(raisable.fix(), "the hard limit, unlimited, already allows it"));

  MemlockFacts unknown;
  unknown.known = false;
  CHECK(CheckMemlock(unknown).result() == Result::WARN);
}

TEST_CASE("dev-shm fails when missing or read-only, warns under 1 GiB free") {
  ShmFacts missing;
  missing.error = "No such file or directory";
  auto gone = CheckDevShm(missing);
  CHECK(gone.result() == Result::FAIL);
  CHECK(Has(gone.detail(), "/dev/shm missing: No such file or directory"));
  CHECK(Has(gone.fix(), "mount -t tmpfs"));

  ShmFacts readonly;
  readonly.exists = true;
  readonly.size_bytes = 4ull << 30;
  readonly.free_bytes = 4ull << 30;
  readonly.error = "creating a file there failed: Read-only file system";
  auto ro = CheckDevShm(readonly);
  CHECK(ro.result() == Result::FAIL);
  CHECK(Has(ro.detail(), "not writable: creating a file there failed: Read-only file system"));

  ShmFacts small = readonly;
  small.writable = true;
  small.size_bytes = 64ull << 20;
  small.free_bytes = 60ull << 20;
  auto warn = CheckDevShm(small);
  CHECK(warn.result() == Result::WARN);
  CHECK(warn.detail() ==
        "/dev/shm: size 64.0 MiB, free 60.0 MiB, under 1.0 GiB free: KV pools in shared "
        "memory will not fit");
  CHECK(Has(warn.fix(), "mount -o remount,size="));
  CHECK(Has(warn.fix(), "--shm-size"));
  CHECK(Has(warn.fix(), "emptyDir with medium: Memory"));

  ShmFacts big = small;
  big.free_bytes = 1ull << 30;
  CHECK(CheckDevShm(big).result() == Result::PASS);
}

TEST_CASE("hugepages: parsed from meminfo, warns with an optional note when none") {
  const std::string meminfo =
      "MemTotal:       131072000 kB\n"
      "HugePages_Total:     512\n"
      "HugePages_Free:      500\n"
      "HugePages_Rsvd:        0\n"
      "Hugepagesize:       2048 kB\n";
  auto facts = ParseMeminfo(meminfo);
  CHECK(facts.known);
  CHECK(facts.total == 512);
  CHECK(facts.free == 500);
  CHECK(facts.page_bytes == 2048 * 1024);
  auto pass = CheckHugepages(facts);
  CHECK(pass.result() == Result::PASS);
  CHECK(pass.detail() ==
        "HugePages_Total 512, HugePages_Free 500, Hugepagesize 2.0 MiB (1000.0 MiB free in "
        "huge pages)");

  auto none = CheckHugepages(ParseMeminfo("HugePages_Total: 0\nHugePages_Free: 0\n"
                                          "Hugepagesize: 1048576 kB\n"));
  CHECK(none.result() == Result::WARN);
  CHECK(Has(none.detail(), "Hugepagesize 1.0 GiB"));
  CHECK(Has(none.detail(), "optional: hugetlbfs pools reduce TLB misses"));
  CHECK(Has(none.fix(), "vm.nr_hugepages"));

  CHECK_FALSE(ParseMeminfo("MemTotal: 1 kB\n").known);
  CHECK(CheckHugepages(ParseMeminfo("")).result() == Result::WARN);
}

TEST_CASE("first-touch: the probe measures; slow first access warns with the cost per GiB and the remedy") {
  const FirstTouchFacts live = ProbeFirstTouch(64);
  REQUIRE(live.measured);  // memfd_create and mmap work in the test's sandbox
  CHECK(live.error.empty());
  CHECK(live.pages == 64);
  CHECK(live.first_us > 0);
  CHECK(live.mapped_us > 0);
  // Once mapped a write is a store; the first one is a page fault.
  CHECK(live.mapped_us < live.first_us);

  FirstTouchFacts fast;
  fast.measured = true;
  fast.pages = 256;
  fast.first_us = 0.6;
  fast.mapped_us = 0.02;
  const auto pass = CheckFirstTouch(fast);
  CHECK(pass.result() == Result::PASS);
  CHECK(pass.detail() ==
        "first write to a page through a new mapping: 0.60 us per 4 KiB page, 0.02 us once "
        "mapped (256 pages probed); a freshly registered pool pays it once per page and "
        "mapping on its first transfers (0.2 s per GiB)");
  CHECK(pass.fix().empty());

  FirstTouchFacts slow = fast;
  slow.first_us = 8.0;  // measured on this project's VMs: 5-18
  const auto warn = CheckFirstTouch(slow);
  CHECK(warn.result() == Result::WARN);
  CHECK(Has(warn.detail(), "8.00 us per 4 KiB page"));
  CHECK(Has(warn.detail(), "(2.1 s per GiB)"));
  CHECK(Has(warn.detail(), "a virtual machine's paging"));
  CHECK(Has(warn.fix(), "--warm-mappings on"));
  CHECK(Has(warn.fix(), "warm each pool after registering it"));
  CHECK(Has(warn.fix(), "A slow transfer"));

  FirstTouchFacts failed;
  failed.error = "memfd_create: Operation not permitted";
  const auto unknown = CheckFirstTouch(failed);
  CHECK(unknown.result() == Result::WARN);
  CHECK(unknown.detail() == "not measured (memfd_create: Operation not permitted)");
  CHECK_FALSE(unknown.fix().empty());
}

TEST_CASE("wake-up: the probe measures a sleeper woken from another CPU; slow wake-ups warn with the remedies") {
  const WakeupFacts live = ProbeWakeup(8, 200);
  REQUIRE(live.measured);  // eventfd and threads work in the test's sandbox
  CHECK(live.error.empty());
  CHECK(live.rounds == 8);
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  REQUIRE(sched_getaffinity(0, sizeof(allowed), &allowed) == 0);
  CHECK(live.other_cpu == (CPU_COUNT(&allowed) > 1));
  CHECK(live.p50_us > 0);
  CHECK(live.p50_us <= live.p90_us);
  CHECK(live.p90_us <= live.max_us);
  CHECK(live.max_us < 1e6);  // a sleeper not woken within 1 s ends the probe instead

  WakeupFacts fast;
  fast.measured = true;
  fast.rounds = 32;
  fast.other_cpu = true;
  fast.p50_us = 6, fast.p90_us = 18, fast.max_us = 27;
  const auto pass = CheckWakeup(fast);
  CHECK(pass.result() == Result::PASS);
  CHECK(pass.detail() ==
        "a thread asleep on an eventfd runs 6 us after a thread on another CPU wakes it (p50; "
        "p90 18, max 27; 32 rounds)");
  CHECK(pass.fix().empty());

  WakeupFacts slow = fast;
  slow.p50_us = 91, slow.p90_us = 108, slow.max_us = 160;  // this project's VMs
  slow.other_cpu = false;
  const auto warn = CheckWakeup(slow);
  CHECK(warn.result() == Result::WARN);
  CHECK(Has(warn.detail(), "runs 91 us after a thread on its CPU (the only one allowed)"));
  CHECK(Has(warn.detail(), "not the copy, set its latency"));
  CHECK(Has(warn.fix(), "complete_when PLACED"));
  CHECK(Has(warn.fix(), "--fast-path-spin-us"));
  CHECK(Has(warn.fix(), "cpuidle-haltpoll"));
  CHECK(Has(warn.fix(), "A slow transfer"));
  // The threshold itself warns.
  slow.p50_us = kWakeupWarnUs;
  CHECK(CheckWakeup(slow).result() == Result::WARN);

  WakeupFacts failed;
  failed.error = "eventfd: Too many open files";
  const auto unknown = CheckWakeup(failed);
  CHECK(unknown.result() == Result::WARN);
  CHECK(unknown.detail() == "not measured (eventfd: Too many open files)");
  CHECK_FALSE(unknown.fix().empty());
  CHECK(ProbeWakeup(0, 1).error == "no rounds asked");
}

TEST_CASE("ptrace-scope: absent and 0 pass, 1-3 warn with what to do") {
  auto absent = CheckPtraceScope(std::nullopt);
  CHECK(absent.result() == Result::PASS);
  CHECK(Has(absent.detail(), "Yama not enforced"));
  CHECK(CheckPtraceScope(0).result() == Result::PASS);

  auto one = CheckPtraceScope(1);
  CHECK(one.result() == Result::WARN);
  CHECK(Has(one.detail(), "cma"));
  CHECK(Has(one.detail(), "ptrace permission"));
  CHECK(Has(one.fix(), "kernel.yama.ptrace_scope=0"));
  CHECK(Has(one.fix(), "CAP_SYS_PTRACE"));

  CHECK(CheckPtraceScope(2).result() == Result::WARN);
  CHECK(Has(CheckPtraceScope(2).detail(), "admin only"));
  auto three = CheckPtraceScope(3);
  CHECK(three.result() == Result::WARN);
  CHECK(Has(three.fix(), "cannot be lowered until reboot"));
  CHECK(Has(CheckPtraceScope(7).detail(), "not a known value"));

  const std::string dir = TempDir("ptrace");
  WriteFile(dir + "/scope", "1\n");
  CHECK(ReadPtraceScope(dir + "/scope") == 1);
  WriteFile(dir + "/junk", "x\n");
  CHECK(ReadPtraceScope(dir + "/junk") == -1);
  CHECK_FALSE(ReadPtraceScope(dir + "/absent").has_value());
}

TEST_CASE("damon: a kdamond on physical memory is a warning, one on named processes is not") {
  auto absent = CheckDamon(ReadDamon(TempDir("no-damon") + "/admin"));
  CHECK(absent.result() == Result::PASS);
  CHECK(absent.detail() == "DAMON not in this kernel's sysfs");

  // The admin tree as the kernel lays it out: kdamond 0 on physical memory with a
  // pageout scheme (as on this project's build VM), 1 stopped, 2 on one process.
  const std::string dir = TempDir("damon") + "/admin";
  for (const char* path :
       {"", "/kdamonds", "/kdamonds/0", "/kdamonds/0/contexts", "/kdamonds/0/contexts/0",
        "/kdamonds/0/contexts/0/schemes", "/kdamonds/0/contexts/0/schemes/0",
        "/kdamonds/0/contexts/0/schemes/1", "/kdamonds/1", "/kdamonds/1/contexts",
        "/kdamonds/1/contexts/0", "/kdamonds/2", "/kdamonds/2/contexts",
        "/kdamonds/2/contexts/0"}) {
    REQUIRE(mkdir((dir + path).c_str(), 0755) == 0);
  }
  auto none = CheckDamon(ReadDamon(dir));
  CHECK(none.result() == Result::PASS);
  CHECK(none.detail() == "no DAMON kdamond running");

  // Count files beside the numbered directories, as the kernel has them.
  WriteFile(dir + "/kdamonds/nr_kdamonds", "3\n");
  WriteFile(dir + "/kdamonds/0/contexts/nr_contexts", "1\n");
  WriteFile(dir + "/kdamonds/0/contexts/0/schemes/nr_schemes", "2\n");
  WriteFile(dir + "/kdamonds/0/state", "on\n");
  WriteFile(dir + "/kdamonds/0/contexts/0/operations", "paddr\n");
  WriteFile(dir + "/kdamonds/0/contexts/0/schemes/0/action", "pageout\n");
  WriteFile(dir + "/kdamonds/0/contexts/0/schemes/1/action", "stat\n");
  WriteFile(dir + "/kdamonds/1/state", "off\n");
  WriteFile(dir + "/kdamonds/1/contexts/0/operations", "paddr\n");
  WriteFile(dir + "/kdamonds/2/state", "on\n");
  WriteFile(dir + "/kdamonds/2/contexts/0/operations", "vaddr\n");
  const DamonFacts facts = ReadDamon(dir);
  CHECK(facts.present);
  REQUIRE(facts.running.size() == 2);  // 1 is off
  CHECK(facts.running[0].name == "kdamonds/0");
  CHECK(facts.running[0].operations == std::vector<std::string>{"paddr"});
  CHECK(facts.running[0].actions == std::vector<std::string>{"pageout", "stat"});
  CHECK(facts.running[1].operations == std::vector<std::string>{"vaddr"});
  CHECK(facts.running[1].actions.empty());

  auto physical = CheckDamon(facts);
  CHECK(physical.result() == Result::WARN);
  CHECK(Has(physical.detail(), "kdamonds/0 on paddr, schemes: pageout, stat; kdamonds/2 on "
                               "vaddr, schemes: none"));
  CHECK(Has(physical.detail(), "slower to touch again"));
  CHECK(Has(physical.fix(), "write off to the kdamond's state file"));

  // Only the one on named processes: reported, not a warning.
  DamonFacts processes = facts;
  processes.running.erase(processes.running.begin());
  auto named = CheckDamon(processes);
  CHECK(named.result() == Result::PASS);
  CHECK(Has(named.detail(), "DAMON runs on named processes only (kdamonds/2 on vaddr"));
}

TEST_CASE("rdma: none is TCP, devices need an active port and a UCX RDMA transport") {
  auto none = CheckRdma({}, HostUcx());
  CHECK(none.result() == Result::PASS);
  CHECK(none.detail() == "no RDMA devices: cross-host traffic uses TCP");

  // A sysfs tree as the kernel lays it out.
  const std::string dir = TempDir("infiniband");
  for (const char* path : {"/mlx5_0", "/mlx5_0/ports", "/mlx5_0/ports/1", "/mlx5_1",
                           "/mlx5_1/ports", "/mlx5_1/ports/1"}) {
    REQUIRE(mkdir((dir + path).c_str(), 0755) == 0);
  }
  WriteFile(dir + "/mlx5_0/ports/1/state", "4: ACTIVE\n");
  WriteFile(dir + "/mlx5_1/ports/1/state", "1: DOWN\n");
  auto devices = ListRdmaDevices(dir);
  REQUIRE(devices.size() == 2);
  CHECK(devices[0].name == "mlx5_0");
  CHECK(devices[0].port_states == std::vector<std::string>{"port 1 ACTIVE"});
  CHECK(devices[1].port_states == std::vector<std::string>{"port 1 DOWN"});
  CHECK(ListRdmaDevices(dir + "/absent").empty());

  auto no_tl = CheckRdma(devices, HostUcx());
  CHECK(no_tl.result() == Result::WARN);
  CHECK(Has(no_tl.detail(), "mlx5_0 [port 1 ACTIVE], mlx5_1 [port 1 DOWN]"));
  CHECK(Has(no_tl.detail(), "UCX offers no RDMA transport"));
  CHECK(Has(no_tl.fix(), "rc_mlx5"));

  transport::UcxCapabilities ib = HostUcx();
  ib.transports.push_back("rc_mlx5");
  ib.transports.push_back("dc_mlx5");
  auto pass = CheckRdma(devices, ib);
  CHECK(pass.result() == Result::PASS);
  CHECK(Has(pass.detail(), "UCX RDMA transports [rc_mlx5,dc_mlx5]"));

  auto down = CheckRdma({devices[1]}, ib);
  CHECK(down.result() == Result::WARN);
  CHECK(Has(down.detail(), "no port is ACTIVE"));
}

TEST_CASE("peers: connected passes, unreachable fails with its error, none passes") {
  auto none = CheckPeers({});
  REQUIRE(none.size() == 1);
  CHECK(none[0].name() == "peers");
  CHECK(none[0].result() == Result::PASS);

  v1::PeerInfo up;
  up.set_name("decode");
  up.set_address("10.0.0.2:7000");
  up.set_state("connected");
  up.set_data_path("ucx");
  up.set_transports("rc_mlx5");
  up.set_error_mode("peer");
  up.set_regions(64);
  v1::PeerInfo down = up;
  down.set_name("decode2");
  down.set_address("10.0.0.3:7000");
  down.set_state("unreachable");
  down.set_last_error("failed to connect to all addresses");
  down.set_last_seen_ms_ago(2500);
  v1::PeerInfo partial = up;
  partial.set_name("local");
  partial.set_same_host(true);
  partial.set_data_path("shm-direct+ucx");

  // Over tcp: the agents' own messages (ucx-am) pass; UCX's emulated RMA (a peer of an
  // older version) is a WARN naming the abort and the fix.
  v1::PeerInfo over_tcp = up;
  over_tcp.set_name("far");
  over_tcp.set_transports("tcp");
  over_tcp.set_data_path("ucx-am");
  v1::PeerInfo old_tcp = over_tcp;
  old_tcp.set_name("old");
  old_tcp.set_data_path("ucx");
  auto tcp = CheckPeers({over_tcp, old_tcp});
  REQUIRE(tcp.size() == 2);
  CHECK(tcp[0].result() == Result::PASS);
  CHECK(tcp[1].result() == Result::WARN);
  CHECK(Has(tcp[1].detail(), "emulated RMA"));
  CHECK(Has(tcp[1].detail(), "can abort this agent"));
  CHECK(Has(tcp[1].fix(), "upgrade the peer"));

  auto checks = CheckPeers({up, down, partial});
  REQUIRE(checks.size() == 3);
  CHECK(checks[0].name() == "peer:decode");
  CHECK(checks[0].result() == Result::PASS);
  CHECK(checks[0].detail() ==
        "'decode' at 10.0.0.2:7000 connected; data path ucx, UCX transports rc_mlx5, error mode "
        "peer, 64 regions, other host");
  CHECK(checks[1].name() == "peer:decode2");
  CHECK(checks[1].result() == Result::FAIL);
  CHECK(checks[1].detail() ==
        "'decode2' at 10.0.0.3:7000 unreachable, last seen 2500 ms ago: failed to connect to "
        "all addresses");
  CHECK(Has(checks[1].fix(), "kvagentctl --agent 10.0.0.3:7000 status"));
  CHECK(checks[2].result() == Result::WARN);
  CHECK(Has(checks[2].detail(), "could not be mapped"));
}

TEST_CASE("peers: a same-host peer's regions not mapped here are a WARN with the count, the "
          "first reason and what to check") {
  v1::PeerInfo vmm;
  vmm.set_name("decode");
  vmm.set_address("unix:/run/kvagent/decode.sock");
  vmm.set_state("connected");
  vmm.set_same_host(true);
  vmm.set_data_path("ucx");  // nothing of it could be mapped
  vmm.set_error_mode("none");
  vmm.set_regions(10);
  vmm.add_direct_fallbacks(
      "region 'd.kv0': cannot import its CUDA VMM memory 1 here (cuMemImportFromShareableHandle "
      "failed); moves through host staging");
  vmm.add_direct_fallbacks("region 'd.kv1': the same");
  vmm.set_vmm_import_failures(1);
  // Host memory that did not map: no VMM advice.
  v1::PeerInfo shm = vmm;
  shm.set_name("shm");
  shm.set_data_path("shm-direct+ucx");
  shm.clear_direct_fallbacks();
  shm.set_vmm_import_failures(0);
  shm.add_direct_fallbacks("region 's.kv3': cannot map its memory here (Permission denied); "
                           "moves through UCX");
  // Only the count of failed imports (no region listed): still a WARN.
  v1::PeerInfo count_only = vmm;
  count_only.set_name("counted");
  count_only.clear_direct_fallbacks();
  // More than PeerInfo lists: the count says how many.
  v1::PeerInfo many = shm;
  many.set_name("many");
  for (int i = 0; i < 15; ++i) many.add_direct_fallbacks("region 'x': why");
  many.set_direct_fallback_regions(40);

  auto checks = CheckPeers({vmm, shm, count_only, many});
  REQUIRE(checks.size() == 4);
  for (const auto& c : checks) CHECK(c.result() == Result::WARN);
  CHECK(checks[0].name() == "peer:decode");
  CHECK(checks[0].detail() ==
        "'decode' at unix:/run/kvagent/decode.sock connected; data path ucx, UCX transports "
        "none, error mode none, 10 regions, same host: 2 of its regions are not mapped here "
        "(shm-direct) and move through host staging (VRAM) or UCX (host memory) instead; 1 of "
        "its CUDA VMM allocations could not be imported; first: region 'd.kv0': cannot import "
        "its CUDA VMM memory 1 here (cuMemImportFromShareableHandle failed); moves through host "
        "staging");
  for (const char* part : {"host staging", "UCX", "kvagentctl peers",
                           "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", "same NVIDIA driver",
                           "same uid", "--peer-uids of 'decode'", "--shm-direct"}) {
    CHECK(Has(checks[0].fix(), part));
  }
  CHECK(Has(checks[1].detail(), "1 of its regions are not mapped here"));
  CHECK(Has(checks[1].detail(), "first: region 's.kv3': cannot map its memory here"));
  CHECK_FALSE(Has(checks[1].detail(), "CUDA VMM"));
  CHECK_FALSE(Has(checks[1].fix(), "CUDA VMM"));
  CHECK(Has(checks[1].fix(), "same uid"));
  CHECK(Has(checks[2].detail(), "same host: 1 of its CUDA VMM allocations could not be imported"));
  CHECK_FALSE(Has(checks[2].detail(), "of its regions"));
  CHECK_FALSE(Has(checks[2].detail(), "first:"));
  CHECK(Has(checks[3].detail(), "same host: 40 of its regions are not mapped here"));
}

TEST_CASE("InspectShm creates a file to prove the directory writable") {
  const std::string dir = TempDir("shm");
  auto facts = InspectShm(dir);
  CHECK(facts.exists);
  CHECK(facts.writable);
  CHECK(facts.size_bytes > 0);
  CHECK(facts.free_bytes <= facts.size_bytes);
  CHECK(CheckDevShm(facts).detail().rfind(dir + ": size ", 0) == 0);

  auto missing = InspectShm(dir + "/absent");
  CHECK_FALSE(missing.exists);
  CHECK(missing.error == "No such file or directory");
  CHECK(CheckDevShm(missing).result() == Result::FAIL);

  WriteFile(dir + "/file", "x");
  auto file = InspectShm(dir + "/file");
  CHECK_FALSE(file.exists);
  CHECK(file.error == "not a directory");
}

TEST_CASE("RunDoctor runs every check in order and the report reads back as lines") {
  const std::string dir = TempDir("run");
  WriteFile(dir + "/meminfo", "HugePages_Total: 4\nHugePages_Free: 4\nHugepagesize: 2048 kB\n");
  WriteFile(dir + "/ptrace_scope", "1\n");
  transport::UcxCapabilities ucx = HostUcx();
  DoctorInputs inputs;
  inputs.agent = "prefill";
  inputs.ucx = &ucx;
  inputs.shm_path = dir;
  inputs.meminfo_path = dir + "/meminfo";
  inputs.ptrace_scope_path = dir + "/ptrace_scope";
  inputs.rdma_dir = dir + "/no-infiniband";
  inputs.damon_dir = dir + "/no-damon";
  v1::PeerInfo peer;
  peer.set_name("decode");
  peer.set_state("unreachable");
  inputs.peers = {peer};
  inputs.device_copy = "cuMemcpyAsync per page";
  inputs.ucx_refused = {"put (software RMA)"};
  inputs.ucx_tcp_guarded = true;

  auto report = RunDoctor(inputs);
  CHECK(report.agent() == "prefill");
  std::vector<std::string> names;
  for (const auto& c : report.checks()) names.push_back(c.name());
  CHECK(names == std::vector<std::string>{"ucx", "ucx-hardening", "ucx-cuda", "cuda-driver",
                                          "device-copy", "memlock", "dev-shm", "hugepages",
                                          "first-touch", "wake-up", "damon", "ptrace-scope",
                                          "rdma", "privileges", "peer:decode"});
  CHECK(report.checks(1).result() == Result::PASS);  // hardened, as given
  CHECK(report.checks(7).result() == Result::PASS);  // from the meminfo written above
  CHECK(report.checks(8).detail().rfind("first write to a page through a new mapping", 0) == 0);
  CHECK(report.checks(9).detail().rfind("a thread asleep on an eventfd runs ", 0) == 0);
  CHECK(report.checks(10).detail() == "DAMON not in this kernel's sysfs");
  CHECK(report.checks(11).result() == Result::WARN);  // scope 1
  CHECK(report.checks(12).result() == Result::PASS);  // no devices
  CHECK(report.checks(13).result() == (geteuid() == 0 ? Result::WARN : Result::PASS));
  CHECK(HasFailure(report));                         // the unreachable peer

  auto lines = SummaryLines(report);
  REQUIRE(lines.size() == 15);
  CHECK(lines[0] == "ucx PASS UCX 1.13.1; transports [self,tcp,sysv,posix,cma]; memory types [host]");
  CHECK(lines[4].rfind("device-copy PASS cuMemcpyAsync per page", 0) == 0);
  CHECK(lines[9].rfind("wake-up ", 0) == 0);
  CHECK(lines[11].rfind("ptrace-scope WARN kernel.yama.ptrace_scope 1", 0) == 0);

  inputs.peers.clear();
  CHECK_FALSE(HasFailure(RunDoctor(inputs)));
  inputs.device_copy.clear();  // not given: no device-copy check
  CHECK(RunDoctor(inputs).checks_size() == 14);  // 13 host checks and "peers"
}

}  // namespace
}  // namespace kvagent::agent

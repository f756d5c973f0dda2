// Doctor against two real kvagentd processes: the UCX, CUDA and peer checks say what
// this machine and the connected peer really are, a peer that dies turns its check
// into FAIL, and the agent logged the same checks at start-up.
#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "catch2/catch.hpp"
#include "cuda/driver.h"
#include "grpcpp/grpcpp.h"
#include "tests/integration/agent_pair.h"
#include "transport/ucx_context.h"

namespace kvagent::testing {
namespace {

using Result = v1::DoctorCheck;

v1::DoctorReport Doctor(cli::AgentClient& client) {
  auto report = client.Doctor();
  INFO(report.status().ToString());
  REQUIRE(report.ok());
  return *std::move(report);
}

const v1::DoctorCheck& Find(const v1::DoctorReport& report, const std::string& name) {
  for (const auto& c : report.checks()) {
    if (c.name() == name) return c;
  }
  FAIL("no doctor check named " << name << " in " << report.ShortDebugString());
  throw;  // not reached
}

bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST_CASE("Doctor reports this host's UCX and CUDA and the connected peer") {
  AgentPair pair;
  // What the agent should find, learnt independently in this process.
  auto local_ucx = transport::UcxContext::Create();
  REQUIRE(local_ucx.ok());
  const bool ucx_cuda = (*local_ucx)->capabilities().cuda_memory;
  const bool driver = cuda::CudaDriver::Load().ok();

  const v1::DoctorReport report = Doctor(pair.prefill());
  INFO(report.ShortDebugString());
  CHECK(report.agent() == "prefill");

  const auto& ucx = Find(report, "ucx");
  CHECK(ucx.result() == Result::PASS);
  CHECK(Has(ucx.detail(), "UCX 1."));
  CHECK(Has(ucx.detail(), "tcp"));
  const std::string types = ucx.detail().substr(ucx.detail().find("memory types ["));
  CHECK(Has(types, "host"));

  // A real agent hardens UCX before any context (transport/ucx_hardening.h).
  const auto& hardening = Find(report, "ucx-hardening");
  CHECK(hardening.result() == Result::PASS);
  CHECK(Has(hardening.detail(), "put (software RMA)"));
  // And guards the accept() of UCX's TCP port (transport/ucx_tcp_guard.h).
  CHECK(Has(hardening.detail(), "UCX's TCP port keeps a local connection only from a peer uid"));

  const auto& ucx_cuda_check = Find(report, "ucx-cuda");
  if (!ucx_cuda) {
    // Debian's UCX: no CUDA memory type.
    CHECK_FALSE(Has(types, "cuda"));
    CHECK(ucx_cuda_check.result() == Result::WARN);
    CHECK(Has(ucx_cuda_check.detail(), "VRAM"));
    CHECK(Has(ucx_cuda_check.fix(), "UCX_TLS"));
    CHECK(Has(ucx_cuda_check.fix(), "cuda_copy,cuda_ipc"));
  } else {
    CHECK(Has(types, "cuda"));
    CHECK(ucx_cuda_check.result() == Result::PASS);
  }

  const auto& cuda = Find(report, "cuda-driver");
  if (!driver) {
    CHECK((cuda.result() == Result::WARN || cuda.result() == Result::FAIL));
    CHECK(Has(cuda.detail(), "libcuda.so.1 not loadable"));
    CHECK(Has(cuda.fix(), "NVIDIA driver"));
  } else {
    CHECK_FALSE(Has(cuda.detail(), "not loadable"));
  }

  const auto& peer = Find(report, "peer:decode");
  CHECK(peer.result() == Result::PASS);
  CHECK(Has(peer.detail(), pair.decode_process().address()));
  CHECK(Has(peer.detail(), "data path shm-direct"));  // same host, the default path
  CHECK(peer.fix().empty());

  for (const char* name :
       {"memlock", "dev-shm", "hugepages", "first-touch", "wake-up", "damon", "ptrace-scope",
        "rdma"}) {
    const auto& c = Find(report, name);
    CHECK(c.result() != Result::RESULT_UNSPECIFIED);
    CHECK_FALSE(c.detail().empty());
    CHECK(c.fix().empty() == (c.result() == Result::PASS));
  }
  // decode has no peers of its own.
  const v1::DoctorReport decode = Doctor(pair.decode());
  CHECK(Find(decode, "peers").result() == Result::PASS);

  // The start-up log carries the same checks, one line each.
  const std::string log = ReadAll(pair.prefill_process().log_path());
  CHECK(Has(log, "doctor: ucx PASS UCX 1."));
  CHECK(Has(log, "doctor: ucx-cuda "));
  CHECK(Has(log, "doctor: cuda-driver "));
  CHECK(Has(log, "doctor: peers PASS no peers connected"));
}

TEST_CASE("Doctor fails the check of a peer that died, with its error and a fix") {
  AgentPair pair;
  const std::string decode_address = pair.decode_process().address();
  REQUIRE(pair.decode_process().Stop().ok());
  // The monitor polls every 200 ms; give it a few polls to mark the peer.
  v1::DoctorReport report;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  do {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    report = Doctor(pair.prefill());
  } while (Find(report, "peer:decode").result() != Result::FAIL &&
           std::chrono::steady_clock::now() < until);
  INFO(report.ShortDebugString());
  const auto& peer = Find(report, "peer:decode");
  CHECK(peer.result() == Result::FAIL);
  CHECK(Has(peer.detail(), "unreachable"));
  CHECK(Has(peer.detail(), decode_address));
  CHECK(Has(peer.fix(), "check the peer agent is running"));
}

}  // namespace
}  // namespace kvagent::testing

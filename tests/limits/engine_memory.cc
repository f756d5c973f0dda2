#include "tests/limits/engine_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <utility>

#include "catch2/catch.hpp"

namespace kvagent::testing {

EngineMemory::~EngineMemory() {
  if (data != nullptr) munmap(data, bytes);
}

void EngineMemory::Truncate() { REQUIRE(ftruncate(fd.get(), 0) == 0); }

void EngineMemory::PunchHole(uint64_t offset, uint64_t length) {
  REQUIRE(fallocate(fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                    static_cast<off_t>(offset), static_cast<off_t>(length)) == 0);
}

uint64_t EngineMemory::AllocatedBytes() const {
  struct stat st {};
  REQUIRE(fstat(fd.get(), &st) == 0);
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

std::unique_ptr<EngineMemory> ShareDescriptor(cli::AgentClient& agent, UniqueFd fd,
                                              const std::string& label, uint64_t bytes, int fill) {
  auto memory = std::make_unique<EngineMemory>();
  memory->fd = std::move(fd);
  REQUIRE(memory->fd.valid());
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memory->fd.get(), 0);
  REQUIRE(data != MAP_FAILED);
  memory->data = static_cast<uint8_t*>(data);
  memory->bytes = bytes;
  if (fill >= 0) {
    for (uint64_t i = 0; i < bytes; ++i) memory->data[i] = static_cast<uint8_t>(fill + i * 7);
  }
  auto shared = agent.ShareMemory(memory->fd.get(), label);
  INFO(shared.status().ToString());
  REQUIRE(shared.ok());
  memory->handle = shared->handle();
  return memory;
}

std::unique_ptr<EngineMemory> ShareEngineMemory(cli::AgentClient& agent, const std::string& label,
                                                uint64_t bytes, uint8_t fill) {
  UniqueFd fd(memfd_create(label.c_str(), MFD_CLOEXEC));
  REQUIRE(fd.valid());
  REQUIRE(ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0);
  return ShareDescriptor(agent, std::move(fd), label, bytes, fill);
}

v1::RegisterRegionsRequest WholeRegion(const std::string& name, const EngineMemory& memory) {
  v1::RegisterRegionsRequest request;
  auto* spec = request.add_regions();
  spec->set_name(name);
  spec->set_kind(v1::AUX);
  spec->set_memory(v1::DRAM);
  spec->set_length(memory.bytes);
  spec->mutable_layout()->set_num_items(1);
  spec->mutable_layout()->set_item_bytes(memory.bytes);
  spec->mutable_shm()->set_memory_handle(memory.handle);
  return request;
}

void RegisterRegion(cli::AgentClient& agent, const std::string& name, const EngineMemory& memory) {
  auto registered = agent.Register(WholeRegion(name, memory));
  INFO(registered.status().ToString());
  REQUIRE(registered.ok());
}

std::unique_ptr<EngineMemory> SharedRegion(cli::AgentClient& agent, const std::string& name,
                                           uint64_t bytes, uint8_t fill) {
  auto memory = ShareEngineMemory(agent, name, bytes, fill);
  RegisterRegion(agent, name, *memory);
  return memory;
}

namespace {

v1::SubmitTransferRequest ByteTransfer(v1::TransferOp op, const std::string& id,
                                       const std::string& local, const std::string& remote,
                                       uint64_t bytes, bool wait, uint32_t pieces) {
  v1::SubmitTransferRequest request;
  request.set_transfer_id(id);
  request.set_peer("decode");
  request.set_op(op);
  request.set_wait(wait);
  request.set_timeout_ms(20000);
  const uint64_t piece = bytes / pieces;
  for (uint32_t i = 0; i < pieces; ++i) {
    auto* segment = request.add_segments()->mutable_bytes();
    segment->set_local_region(local);
    segment->set_local_offset(i * piece);
    segment->set_remote_region(remote);
    segment->set_remote_offset((pieces - 1 - i) * piece);
    segment->set_length(piece);
  }
  return request;
}

}  // namespace

v1::SubmitTransferRequest ByteWrite(const std::string& id, const std::string& local,
                                    const std::string& remote, uint64_t bytes, bool wait,
                                    uint32_t pieces) {
  return ByteTransfer(v1::WRITE, id, local, remote, bytes, wait, pieces);
}

v1::SubmitTransferRequest ByteRead(const std::string& id, const std::string& local,
                                   const std::string& remote, uint64_t bytes, bool wait,
                                   uint32_t pieces) {
  return ByteTransfer(v1::READ, id, local, remote, bytes, wait, pieces);
}

uint32_t Pid(cli::AgentClient& agent) {
  auto status = agent.Status();
  INFO(status.status().ToString());
  REQUIRE(status.ok());
  return status->pid();
}

void RequireDataPath(cli::AgentClient& sender, const std::string& data_path) {
  auto peers = sender.Peers();
  REQUIRE(peers.ok());
  REQUIRE(peers->peers_size() == 1);
  // Otherwise the bytes would move another way and the case would test something else.
  REQUIRE(peers->peers(0).data_path() == data_path);
}

void RequireBrokenFailure(const v1::TransferState& state, const std::string& names) {
  INFO(state.DebugString());
  REQUIRE(state.phase() == v1::FAILED);
  CHECK(state.error_code() == static_cast<int32_t>(absl::StatusCode::kDataLoss));
  CHECK_THAT(state.error_message(), Catch::Contains(names));
  CHECK_THAT(state.error_message(), Catch::Contains("broken"));
  CHECK_THAT(state.error_message(), Catch::Contains("truncated"));
  CHECK_THAT(state.error_message(), Catch::Contains("re-register"));
}

void RequireRefused(cli::AgentClient& agent, const v1::SubmitTransferRequest& request,
                    const std::string& names) {
  auto again = agent.Submit(request);
  if (again.ok()) {
    INFO(again->DebugString());
    REQUIRE(again->phase() == v1::FAILED);
    CHECK_THAT(again->error_message(), Catch::Contains(names));
    CHECK_THAT(again->error_message(), Catch::Contains("broken"));
  } else {
    INFO(again.status().ToString());
    CHECK(again.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(again.status().message()), Catch::Contains(names));
    CHECK_THAT(std::string(again.status().message()), Catch::Contains("broken"));
  }
}

void FaultScene::RequireAlive() {
  CHECK(Pid(pair.prefill()) == prefill_pid);
  CHECK(Pid(pair.decode()) == decode_pid);
}

}  // namespace kvagent::testing

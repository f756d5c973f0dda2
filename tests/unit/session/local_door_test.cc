// The local door's device memory (CUDA VMM descriptors) over a real session socket:
// LocalSession::ShareDeviceMemory -> SessionServer -> LocalDoor, the session's
// handles, the refusals that need no driver (host memory, sizes, descriptor counts,
// roles), freeing, and registration through the door's handles on a machine without
// a CUDA driver. A pipe stands in for the NVIDIA descriptor: the door does not judge
// it, the driver does at import; its read end shows when the agent closed its copy.
#include "agent/local_door.h"

#include <dlfcn.h>
#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "agent/access.h"
#include "agent/session_server.h"
#include "catch2/catch.hpp"
#include "client/local_session.h"
#include "client/session_wire.h"
#include "registry/region_registry.h"
#include "tests/unit/registry/test_util.h"
#include "tests/unit/session/session_fixture.h"
#include "tests/unit/session/test_util.h"

namespace kvagent::agent {
namespace {

using absl::StatusCode;
using client::LocalSession;
using kvagent::testing::TempDir;
using kvagent::testing::WaitFor;
using session_test::Message;

bool DriverInstalled() {
  void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return false;
  dlclose(handle);
  return true;
}

// A LocalDoor behind a real session socket.
struct Door {
  explicit Door(AccessPolicy policy = {})
      : door(Options(std::move(policy)), /*registry=*/nullptr, &counters, nullptr) {
    SessionServerOptions options;
    options.path = dir / "a.session";
    auto started = SessionServer::Start(options, &door);
    REQUIRE(started.ok());
    server = std::move(started).value();
  }
  static LocalDoorOptions Options(AccessPolicy policy) {
    LocalDoorOptions options;
    options.policy = std::move(policy);
    options.agent_name = "door-test";
    return options;
  }
  std::unique_ptr<LocalSession> Attach(const std::string& name = "engine-a") {
    auto session = LocalSession::Attach(server->path(), name, 5000);
    INFO(session.status().ToString());
    REQUIRE(session.ok());
    return std::move(session).value();
  }

  TempDir dir;
  SecurityCounters counters;
  LocalDoor door;
  std::unique_ptr<SessionServer> server;
};

// A pipe: `device` stands for the engine's exported descriptor (the write end);
// Closed() turns true once every copy of it is closed (the read end sees EOF).
struct FakeDescriptor {
  FakeDescriptor() {
    int ends[2];
    REQUIRE(pipe2(ends, O_CLOEXEC) == 0);
    read_end.reset(ends[0]);
    device.reset(ends[1]);
  }
  bool Closed() const {
    pollfd p{read_end.get(), POLLIN, 0};
    return poll(&p, 1, 0) == 1 && (p.revents & POLLHUP) != 0;
  }
  UniqueFd read_end;
  UniqueFd device;
};

TEST_CASE("ShareDeviceMemory: an engine's descriptor becomes a cuda-vmm handle of its session") {
  Door door;
  auto session = door.Attach();
  const uint64_t id = session->welcome().session_id();
  FakeDescriptor fake;
  auto info = session->ShareDeviceMemory(fake.device.get(), 0, 2 << 20, "kv-vram");
  INFO(info.status().ToString());
  REQUIRE(info.ok());
  CHECK(info->handle() > 0);
  CHECK(info->kind() == "cuda-vmm");
  CHECK(info->bytes() == (2u << 20));
  CHECK(info->label() == "kv-vram");
  CHECK_FALSE(info->sealed());
  fake.device.reset();  // the caller's copy: the agent keeps its own
  CHECK_FALSE(fake.Closed());

  {
    auto object = door.door.ResolveDeviceHandle(id, info->handle());
    REQUIRE(object.ok());
    CHECK((*object)->bytes() == (2u << 20));
    CHECK((*object)->device() == 0);
    CHECK((*object)->label() == "kv-vram");
  }
  // A device handle is not host memory, and the reverse; unknown ones and other
  // sessions' are not found.
  auto as_host = door.door.ResolveHandle(id, info->handle());
  CHECK(as_host.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(as_host.status()), Catch::Contains("is device memory (share_device)"));
  CHECK_THAT(Message(as_host.status()), Catch::Contains("cuda_vmm.memory_handle"));
  UniqueFd memfd = kvagent::testing::MakeMemfd(4096);
  auto host = session->ShareMemory(memfd.get(), "host");
  REQUIRE(host.ok());
  CHECK(host->handle() != info->handle());
  auto as_device = door.door.ResolveDeviceHandle(id, host->handle());
  CHECK(as_device.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(as_device.status()), Catch::Contains("is host memory"));
  CHECK(door.door.ResolveDeviceHandle(id, 999).status().code() == StatusCode::kNotFound);
  auto other = door.Attach("engine-b");
  CHECK(door.door.ResolveDeviceHandle(other->welcome().session_id(), info->handle())
            .status()
            .code() == StatusCode::kNotFound);

  // Freed like host memory: the agent's descriptor closes.
  REQUIRE(session->FreeMemory(info->handle()).ok());
  CHECK(WaitFor([&] { return fake.Closed(); }));
  CHECK(door.door.ResolveDeviceHandle(id, info->handle()).status().code() ==
        StatusCode::kNotFound);
  auto again = session->FreeMemory(info->handle());
  CHECK(again.code() == StatusCode::kNotFound);
  CHECK_THAT(Message(again), Catch::Contains("share_device"));
}

TEST_CASE("A session's end closes its device memory descriptors") {
  Door door;
  FakeDescriptor fake;
  {
    auto session = door.Attach();
    REQUIRE(session->ShareDeviceMemory(fake.device.get(), 1, 4096, "kv").ok());
    fake.device.reset();
    CHECK_FALSE(fake.Closed());
  }
  CHECK(WaitFor([&] { return fake.Closed(); }));
}

TEST_CASE("ShareDeviceMemory refusals that need no driver") {
  SECTION("host memory: use share") {
    Door door;
    auto session = door.Attach();
    UniqueFd memfd = kvagent::testing::MakeMemfd(4096);
    auto info = session->ShareDeviceMemory(memfd.get(), 0, 4096, "host");
    REQUIRE_FALSE(info.ok());
    CHECK(info.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(info.status()),
               Catch::StartsWith("device memory 'host': the descriptor is a file of host memory "
                                 "on tmpfs"));
    CHECK_THAT(Message(info.status()), Catch::Contains("use share for host memory"));
    // The session goes on.
    FakeDescriptor fake;
    CHECK(session->ShareDeviceMemory(fake.device.get(), 0, 4096, "vram").ok());
  }
  SECTION("zero bytes, a negative device") {
    Door door;
    auto session = door.Attach();
    FakeDescriptor fake;
    auto zero = session->ShareDeviceMemory(fake.device.get(), 0, 0, "kv");
    CHECK(zero.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(zero.status()), Catch::StartsWith("device memory 'kv': 0 bytes declared"));
    auto negative = session->ShareDeviceMemory(fake.device.get(), -3, 4096, "kv");
    CHECK(negative.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(negative.status()), Catch::Contains("device ordinal -3 is negative"));
    fake.device.reset();
    CHECK(fake.Closed());  // refused: nothing kept
  }
  SECTION("two descriptors, none") {
    Door door;
    UniqueFd raw = session_test::RawConnect(door.server->path());
    REQUIRE(client::SendMessage(raw.get(), session_test::Hello(1), {}, 5000).ok());
    REQUIRE(session_test::ReadOne(raw.get()).has_welcome());
    FakeDescriptor a, b;
    v1::SessionRequest request;
    request.set_seq(2);
    request.mutable_share_device()->set_label("kv");
    request.mutable_share_device()->set_bytes(4096);
    REQUIRE(client::SendMessage(raw.get(), request, {a.device.get(), b.device.get()}, 5000).ok());
    v1::SessionReply two = session_test::ReadOne(raw.get());
    CHECK(two.error_code() == static_cast<int>(StatusCode::kInvalidArgument));
    CHECK_THAT(two.error_message(),
               Catch::StartsWith("share_device 'kv': 2 descriptors came with the request; "
                                 "attach exactly one"));
    request.set_seq(3);
    REQUIRE(client::SendMessage(raw.get(), request, {}, 5000).ok());
    v1::SessionReply none = session_test::ReadOne(raw.get());
    CHECK(none.error_code() == static_cast<int>(StatusCode::kInvalidArgument));
    CHECK_THAT(none.error_message(), Catch::Contains("0 descriptors came with the request"));
    a.device.reset();
    b.device.reset();
    CHECK(WaitFor([&] { return a.Closed() && b.Closed(); }));
  }
  SECTION("not an engine") {
    AccessPolicy policy;
    policy.any_engine_uid = false;
    policy.engine_uids = {geteuid() + 1};
    policy.scheduler_uids = {geteuid()};
    Door door(policy);
    auto session = door.Attach("scheduler");
    FakeDescriptor fake;
    auto info = session->ShareDeviceMemory(fake.device.get(), 0, 4096, "kv");
    REQUIRE_FALSE(info.ok());
    CHECK(info.status().code() == StatusCode::kPermissionDenied);
    CHECK_THAT(Message(info.status()), Catch::StartsWith("share_device 'kv': session:"));
    CHECK_THAT(Message(info.status()), Catch::Contains("is not an engine here"));
    CHECK_THAT(Message(info.status()), Catch::Contains("--engine-uids"));
    CHECK(door.counters.refused_calls.load() == 1);
  }
}

using registry::testing::VmmSpec;

TEST_CASE("Registering cuda_vmm regions through the door's handles") {
  Door door;
  auto session = door.Attach();
  const uint64_t id = session->welcome().session_id();
  FakeDescriptor fake;
  auto info = session->ShareDeviceMemory(fake.device.get(), 0, 1 << 20, "kv-vram");
  REQUIRE(info.ok());
  fake.device.reset();
  registry::RegionRegistry registry(&registry::testing::Context());
  registry::RegisterContext context;
  context.owner = "engine";
  context.resolve_device_handle = [&door, id](uint64_t handle) {
    return door.door.ResolveDeviceHandle(id, handle);
  };

  auto result = registry.Register({VmmSpec("vmm.k", info->handle(), 0, 65536)}, false, context);
  REQUIRE_FALSE(result.ok());
  const std::string message = Message(result.status());
  CHECK_THAT(message, Catch::StartsWith("region 'vmm.k' (entry 0): "));
  if (!DriverInstalled()) {
    CHECK(result.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(message, Catch::Contains("CUDA driver not available: dlopen(libcuda.so.1) failed"));
  } else {
    WARN("libcuda.so.1 is installed here; a pipe must be refused by the driver instead");
    CHECK_THAT(message, Catch::Contains("cuMemImportFromShareableHandle"));
  }
  CHECK(registry.List().empty());
  CHECK(registry.version() == 0);

  // An unknown handle, a host memory handle.
  auto unknown = registry.Register({VmmSpec("vmm.x", 77, 0, 4096)}, false, context);
  CHECK(unknown.status().code() == StatusCode::kNotFound);
  CHECK_THAT(Message(unknown.status()),
             Catch::StartsWith("region 'vmm.x' (entry 0): device memory handle 77 is not one of "
                               "this session's"));
  UniqueFd memfd = kvagent::testing::MakeMemfd(65536);
  auto host = session->ShareMemory(memfd.get(), "host");
  REQUIRE(host.ok());
  auto wrong_kind = registry.Register({VmmSpec("vmm.h", host->handle(), 0, 4096)}, false, context);
  CHECK(wrong_kind.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(wrong_kind.status()), Catch::Contains("is host memory"));

  // The failed registration kept nothing: freeing the handle closes the descriptor.
  REQUIRE(session->FreeMemory(info->handle()).ok());
  CHECK(WaitFor([&] { return fake.Closed(); }));
}

}  // namespace
}  // namespace kvagent::agent

// Test helpers for registry tests: unique shm objects created through ShmMapping,
// unique /dev/shm paths removed at scope exit, a RegisterContext for a test owner
// and RegionSpec builders. Used by tests/unit/registry/*_test.cc and tests/unit/cuda.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "proto/kvagent.pb.h"
#include "registry/memory_object.h"
#include "registry/region_registry.h"
#include "registry/shm_mapping.h"
#include "transport/ucx_context.h"

namespace kvagent::registry::testing {

// One UCX context per test binary, as an agent has.
inline const transport::UcxContext& Context() {
  static std::unique_ptr<transport::UcxContext> context = [] {
    auto created = transport::UcxContext::Create();
    REQUIRE(created.ok());
    return std::move(created).value();
  }();
  return *context;
}

// "kvagent-test-<pid>-<random>-<n>-<suffix>": not the pid alone, since Bazel's sandbox
// gives every test the same pid (a PID namespace) while /dev/shm is shared, so tests
// running side by side collided.
inline std::string UniqueName(const std::string& suffix = "") {
  static std::atomic<int> counter{0};
  static const uint64_t run = (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  return fmt::format("kvagent-test-{}-{:x}-{}{}{}", getpid(), run, counter++,
                     suffix.empty() ? "" : "-", suffix);
}

// A fresh POSIX shm object ("/kvagent-test-...", i.e. /dev/shm/kvagent-test-...),
// owned by the test's uid, unlinked when the returned mapping goes away.
inline ShmMapping MakeShm(uint64_t bytes) {
  auto shm = ShmMapping::Create("/" + UniqueName(), bytes);
  REQUIRE(shm.ok());
  return std::move(shm).value();
}

// Removes a path the test made (file, FIFO, link or empty directory) at scope exit.
class ScopedPath {
 public:
  explicit ScopedPath(std::string path) : path_(std::move(path)) {}
  ScopedPath(const ScopedPath&) = delete;
  ScopedPath& operator=(const ScopedPath&) = delete;
  ~ScopedPath() {
    struct stat st {};
    if (lstat(path_.c_str(), &st) != 0) return;
    if (S_ISDIR(st.st_mode)) {
      rmdir(path_.c_str());
    } else {
      unlink(path_.c_str());
    }
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A registrant: `owner`, by-name registration under the default directories only for
// files the test's uid owns, and memory handles that are the ids of `objects`.
inline RegisterContext Registrant(const std::string& owner = "test-owner",
                                  std::vector<std::shared_ptr<const MemoryObject>> objects = {}) {
  RegisterContext context;
  context.owner = owner;
  context.path_policy.required_uid = geteuid();
  context.resolve_handle =
      [objects = std::move(objects)](
          uint64_t handle) -> absl::StatusOr<std::shared_ptr<const MemoryObject>> {
    for (const auto& object : objects) {
      if (object->id() == handle) return object;
    }
    return absl::NotFoundError(fmt::format(
        "memory handle {} is not one of this session's; share the memory first", handle));
  };
  return context;
}

inline v1::RegionSpec Spec(const std::string& name, const std::string& shm, uint64_t offset,
                           uint64_t length, uint64_t num_items, uint64_t item_bytes,
                           const std::string& group = "", uint64_t stride = 0) {
  v1::RegionSpec spec;
  spec.set_name(name);
  spec.set_kind(v1::KV);
  spec.set_group(group);
  spec.set_memory(v1::DRAM);
  spec.set_length(length);
  spec.mutable_layout()->set_num_items(num_items);
  spec.mutable_layout()->set_item_bytes(item_bytes);
  spec.mutable_layout()->set_item_stride(stride);
  spec.mutable_shm()->set_name(shm);
  spec.mutable_shm()->set_offset(offset);
  return spec;
}

// The same region by memory handle (a session's shared memory) instead of a name.
inline v1::RegionSpec HandleSpec(const std::string& name, uint64_t handle, uint64_t offset,
                                 uint64_t length, uint64_t num_items, uint64_t item_bytes,
                                 const std::string& group = "") {
  v1::RegionSpec spec = Spec(name, "", offset, length, num_items, item_bytes, group);
  spec.mutable_shm()->clear_name();
  spec.mutable_shm()->set_memory_handle(handle);
  return spec;
}

// A VRAM region of 4 items by CUDA VMM descriptor: a session's device memory handle
// and an offset into what it shared.
inline v1::RegionSpec VmmSpec(const std::string& name, uint64_t handle, uint64_t offset,
                              uint64_t length) {
  v1::RegionSpec spec;
  spec.set_name(name);
  spec.set_kind(v1::KV);
  spec.set_memory(v1::VRAM);
  spec.set_length(length);
  spec.mutable_layout()->set_num_items(4);
  spec.mutable_layout()->set_item_bytes(length / 4);
  spec.mutable_cuda_vmm()->set_memory_handle(handle);
  spec.mutable_cuda_vmm()->set_offset(offset);
  return spec;
}

}  // namespace kvagent::registry::testing

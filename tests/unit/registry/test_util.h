// Test helpers for registry tests: unique shm objects created through ShmMapping and
// RegionSpec builders. Used by tests/unit/registry/*_test.cc only.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <string>

#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "proto/kvagent.pb.h"
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

// A fresh POSIX shm object, unlinked when the returned mapping goes away.
inline ShmMapping MakeShm(uint64_t bytes) {
  static std::atomic<int> counter{0};
  // Not the pid alone: Bazel's sandbox gives every test the same pid (a PID
  // namespace) while /dev/shm is shared, so tests running side by side collided.
  static const uint64_t run = (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  std::string name = fmt::format("/kvagent-test-{}-{:x}-{}", getpid(), run, counter++);
  auto shm = ShmMapping::Create(name, bytes);
  REQUIRE(shm.ok());
  return std::move(shm).value();
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

}  // namespace kvagent::registry::testing

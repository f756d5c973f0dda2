// StagingPool bounds: never more than N buffers out; a waiter gets the next one
// released, in order; buffers are page-aligned and hold their bytes.
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "agent/staging.h"
#include "catch2/catch.hpp"
#include "transport/ucx_context.h"

namespace kvagent::agent {
namespace {

TEST_CASE("the pool hands out at most N buffers and a waiter gets a released one") {
  StagingPoolOptions options;
  options.chunk_bytes = 10000;
  options.buffers = 2;
  auto pool = StagingPool::Create(options, nullptr, nullptr);
  REQUIRE(pool.ok());
  StagingPool& p = **pool;
  CHECK_FALSE(p.pinned());
  auto a = p.TryAcquire();
  auto b = p.TryAcquire();
  REQUIRE(a);
  REQUIRE(b);
  CHECK(a.data() != b.data());
  CHECK(a.size() == 10000);
  CHECK(reinterpret_cast<uintptr_t>(a.data()) % 4096 == 0);
  std::memset(a.data(), 0x5A, a.size());
  std::memset(b.data(), 0xA5, b.size());
  CHECK_FALSE(p.TryAcquire());  // bounded: a third is never allocated
  CHECK(p.free_buffers() == 0);

  std::vector<int> order;
  StagingPool::Lease first_got, second_got;
  p.Acquire([&](StagingPool::Lease l) {
    order.push_back(1);
    first_got = std::move(l);
  });
  p.Acquire([&](StagingPool::Lease l) {
    order.push_back(2);
    second_got = std::move(l);
  });
  CHECK(order.empty());
  CHECK(p.waiters() == 2);
  uint8_t* a_data = a.data();
  a = StagingPool::Lease();  // release: goes straight to the first waiter
  REQUIRE(order == std::vector<int>{1});
  CHECK(first_got.data() == a_data);
  CHECK(first_got.data()[9999] == 0x5A);  // the same memory, not a new allocation
  CHECK(p.free_buffers() == 0);
  { StagingPool::Lease drop = std::move(b); }
  REQUIRE(order == std::vector<int>{1, 2});
  CHECK(p.waiters() == 0);
  first_got = StagingPool::Lease();
  second_got = StagingPool::Lease();
  CHECK(p.free_buffers() == 2);
}

TEST_CASE("a waiter on another thread gets a buffer released here") {
  StagingPoolOptions options;
  options.chunk_bytes = 4096;
  options.buffers = 1;
  auto pool = StagingPool::Create(options, nullptr, nullptr);
  REQUIRE(pool.ok());
  auto held = (*pool)->TryAcquire();
  REQUIRE(held);
  absl::Notification got;
  std::thread waiter([&] {
    (*pool)->Acquire([&](StagingPool::Lease l) {
      CHECK(l.size() == 4096);
      got.Notify();
    });
  });
  waiter.join();
  CHECK_FALSE(got.HasBeenNotified());
  held = StagingPool::Lease();
  CHECK(got.WaitForNotificationWithTimeout(absl::Seconds(5)));
  CHECK((*pool)->free_buffers() == 1);
}

TEST_CASE("a written-off buffer stays with its lease; its slot gets a new one, within a bound") {
  // With UCX registration, as the Stager's pools are: the replacement is mapped too.
  auto context = transport::UcxContext::Create();
  REQUIRE(context.ok());
  StagingPoolOptions options;
  options.chunk_bytes = 8192;
  options.buffers = 2;
  options.max_written_off_bytes = 16384;  // two buffers' worth
  auto pool = StagingPool::Create(options, nullptr, context->get());
  REQUIRE(pool.ok());
  StagingPool& p = **pool;
  auto stuck_a = p.TryAcquire();
  auto stuck_b = p.TryAcquire();
  REQUIRE(stuck_a);
  REQUIRE(stuck_b);
  std::memset(stuck_a.data(), 0x11, stuck_a.size());
  std::memset(stuck_b.data(), 0x22, stuck_b.size());

  // A waiter for a buffer (another transfer's chunk) gets the replacement at once.
  StagingPool::Lease waited;
  p.Acquire([&](StagingPool::Lease l) { waited = std::move(l); });
  CHECK(p.waiters() == 1);
  REQUIRE(p.WriteOff(stuck_a));
  REQUIRE(waited);
  CHECK(p.waiters() == 0);
  CHECK(waited.data() != stuck_a.data());
  CHECK(waited.data() != stuck_b.data());
  CHECK(waited.size() == 8192);
  // The written-off buffer is untouched and still the lease's (a send may still read it).
  std::memset(waited.data(), 0x33, waited.size());
  CHECK(stuck_a.data()[0] == 0x11);
  CHECK(stuck_a.data()[8191] == 0x11);
  CHECK_FALSE(p.WriteOff(stuck_a));  // once is enough
  CHECK(p.write_offs().total == 1);
  CHECK(p.write_offs().held == 1);

  // The bound: max_written_off_bytes' worth held written off.
  REQUIRE(p.WriteOff(stuck_b));
  CHECK(p.free_buffers() == 1);  // stuck_b's slot, with its new buffer
  auto fresh = p.TryAcquire();
  REQUIRE(fresh);
  CHECK(fresh.data() != stuck_b.data());
  CHECK(stuck_b.data()[4096] == 0x22);
  CHECK_FALSE(p.WriteOff(fresh));  // two held already
  CHECK(p.write_offs().refused == 1);
  CHECK(p.write_offs().held == 2);

  // A written-off buffer released at last goes back to the system, not to the pool:
  // the pool still hands out exactly its two slots.
  stuck_a = StagingPool::Lease();
  CHECK(p.write_offs().held == 1);
  CHECK(p.free_buffers() == 0);
  CHECK_FALSE(p.TryAcquire());
  waited = StagingPool::Lease();
  fresh = StagingPool::Lease();
  CHECK(p.free_buffers() == 2);
  stuck_b = StagingPool::Lease();
  CHECK(p.write_offs().held == 0);
  CHECK(p.write_offs().total == 2);
  CHECK(p.free_buffers() == 2);
  // And a buffer written off can be written off again later, within the bound.
  auto again = p.TryAcquire();
  REQUIRE(again);
  CHECK(p.WriteOff(again));
  CHECK_FALSE(p.WriteOff(StagingPool::Lease()));  // empty: nothing to write off

  // Never fewer than the pool's own buffers, however small the byte bound.
  options.max_written_off_bytes = 0;
  auto small = StagingPool::Create(options, nullptr, nullptr);
  REQUIRE(small.ok());
  auto x = (*small)->TryAcquire();
  auto y = (*small)->TryAcquire();
  CHECK((*small)->WriteOff(x));
  CHECK((*small)->WriteOff(y));
  auto z = (*small)->TryAcquire();
  CHECK_FALSE((*small)->WriteOff(z));
}

TEST_CASE("buffers registered with UCX stay usable and a bad size is refused with the flag") {
  auto context = transport::UcxContext::Create();
  REQUIRE(context.ok());
  StagingPoolOptions options;
  options.chunk_bytes = 64 << 10;
  options.buffers = 3;
  auto pool = StagingPool::Create(options, nullptr, context->get());
  REQUIRE(pool.ok());
  CHECK((*pool)->buffers() == 3);

  options.chunk_bytes = 0;
  auto zero = StagingPool::Create(options, nullptr, nullptr);
  REQUIRE(zero.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(zero.status().message()).find("--staging-chunk-bytes 0") != std::string::npos);
  options.chunk_bytes = 4096;
  options.buffers = 0;
  auto none = StagingPool::Create(options, nullptr, nullptr);
  REQUIRE(none.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(none.status().message()).find("--staging-buffers 0") != std::string::npos);
  options.buffers = 2;
  options.am_message_bytes = 0;
  auto no_message = StagingPool::Create(options, nullptr, nullptr);
  REQUIRE(no_message.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(no_message.status().message()).find("--am-message-bytes 0") !=
        std::string::npos);
}

TEST_CASE("the message size on an endpoint without native RMA is at most a bounce buffer") {
  StagingPoolOptions options;
  CHECK(options.AmMessageBytes() == 512u << 10);
  options.chunk_bytes = 256 << 10;  // smaller buffers: the messages follow them
  CHECK(options.AmMessageBytes() == 256u << 10);
  options.am_message_bytes = 64 << 10;
  CHECK(options.AmMessageBytes() == 64u << 10);
  CHECK(ValidateStagingOptions(options).ok());
}

}  // namespace
}  // namespace kvagent::agent

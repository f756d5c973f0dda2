#include "agent/kept_messages.h"

#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "proto/kvagent.pb.h"

namespace kvagent::agent {
namespace {

TEST_CASE("a message handed back is the next one taken, with its strings' storage") {
  KeptMessages<v1::Notification> kept;
  CHECK(kept.kept() == 0);
  const v1::Notification* first = nullptr;
  {
    auto lease = kept.Take();
    first = lease.get();
    lease->set_transfer_id(std::string(200, 't'));
  }
  CHECK(kept.kept() == 1);
  // Taken without a lease (the engine's late open): the same message, cleared by its
  // user, keeps the capacity of its string.
  std::unique_ptr<v1::Notification> again = kept.TakeMessage();
  CHECK(again.get() == first);
  CHECK(kept.kept() == 0);
  again->Clear();
  CHECK(again->transfer_id().empty());
  CHECK(again->mutable_transfer_id()->capacity() >= 200);
  kept.GiveBack(std::move(again));
  CHECK(kept.kept() == 1);
  kept.GiveBack(nullptr);  // nothing to keep
  CHECK(kept.kept() == 1);
  auto lease = kept.Take();
  CHECK(lease.get() == first);
}

TEST_CASE("at most a few are kept, none over the size bound") {
  KeptMessages<v1::Notification, 1024> kept;
  std::vector<std::unique_ptr<v1::Notification>> taken;
  for (int i = 0; i < 6; ++i) taken.push_back(kept.TakeMessage());
  for (auto& m : taken) kept.GiveBack(std::move(m));
  CHECK(kept.kept() == 4);
  for (int i = 0; i < 4; ++i) taken[static_cast<size_t>(i)] = kept.TakeMessage();
  CHECK(kept.kept() == 0);
  auto large = std::make_unique<v1::Notification>();
  large->set_payload(std::string(2048, 'p'));  // over 1 KiB serialized: let go
  kept.GiveBack(std::move(large));
  CHECK(kept.kept() == 0);
  auto small = std::make_unique<v1::Notification>();
  small->set_payload(std::string(100, 'p'));
  kept.GiveBack(std::move(small));
  CHECK(kept.kept() == 1);
}

}  // namespace
}  // namespace kvagent::agent

#include "planning/destination_ledger.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "tests/unit/planning/catalog_util.h"
#include "tests/unit/registry/test_util.h"

namespace kvagent::planning {
namespace {

using registry::RegionRegistry;
using registry::RemoteCatalog;
using registry::ShmMapping;
using registry::testing::Context;
using registry::testing::MakeShm;
using registry::testing::Registrant;
using registry::testing::Spec;
using testing::DecodeCatalog;

std::string Refused(const absl::Status& status,
                    absl::StatusCode code = absl::StatusCode::kFailedPrecondition) {
  REQUIRE_FALSE(status.ok());
  CHECK(status.code() == code);
  return std::string(status.message());
}

TEST_CASE("A range another transfer is writing is refused, naming that transfer") {
  DestinationLedger ledger;
  REQUIRE(ledger.Claim("req-a", "peer:decode", {{"k.L0", 0, 1024}, {"v.L0", 0, 1024}}).ok());
  CHECK(ledger.claimed_ranges() == 2);
  std::string m = Refused(ledger.Claim("req-b", "peer:decode", {{"k.L0", 512, 2048}}));
  CHECK_THAT(m, Catch::StartsWith("transfer 'req-b': bytes [512, 2048) of region 'k.L0' "
                                  "(destination 'peer:decode') overlap bytes [0, 1024) that "
                                  "transfer 'req-a' is still writing"));
  CHECK_THAT(m, Catch::Contains("wait until transfer 'req-a' has ended (or cancel it)"));
  // The range before, the one after, a range inside it.
  Refused(ledger.Claim("req-b", "peer:decode", {{"v.L0", 1023, 1024}}));
  Refused(ledger.Claim("req-b", "peer:decode", {{"v.L0", 0, 1}}));
  Refused(ledger.Claim("req-b", "peer:decode", {{"v.L0", 100, 200}}));
  Refused(ledger.Claim("req-b", "peer:decode", {{"v.L0", 0, 4096}}));
  CHECK(ledger.claimed_ranges() == 2);
}

TEST_CASE("Adjacent ranges, other regions and other destinations are independent") {
  DestinationLedger ledger;
  REQUIRE(ledger.Claim("a", "peer:decode", {{"k", 1000, 2000}}).ok());
  CHECK(ledger.Claim("b", "peer:decode", {{"k", 0, 1000}, {"k", 2000, 3000}}).ok());
  CHECK(ledger.Claim("c", "peer:decode", {{"v", 1000, 2000}}).ok());
  CHECK(ledger.Claim("d", "peer:other", {{"k", 1000, 2000}}).ok());
  CHECK(ledger.Claim("e", "local", {{"k", 1000, 2000}}).ok());
  CHECK(ledger.claimed_ranges() == 6);
  // Empty ranges claim nothing; a reversed one is a caller error.
  CHECK(ledger.Claim("f", "peer:decode", {{"k", 1500, 1500}}).ok());
  CHECK(ledger.claimed_ranges() == 6);
  Refused(ledger.Claim("f", "peer:decode", {{"k", 10, 5}}), absl::StatusCode::kInvalidArgument);
}

TEST_CASE("A later chunk writing what an earlier chunk of the same transfer wrote is refused") {
  DestinationLedger ledger;
  REQUIRE(ledger.Claim("req", "peer:decode", {{"k", 0, 256}}).ok());
  REQUIRE(ledger.Claim("req", "peer:decode", {{"k", 256, 512}}).ok());  // next pages: fine
  std::string m = Refused(ledger.Claim("req", "peer:decode", {{"k", 128, 384}}));
  CHECK_THAT(m, Catch::StartsWith("transfer 'req': bytes [128, 384) of region 'k'"));
  CHECK_THAT(m, Catch::Contains("that an earlier chunk of this transfer writes"));
  // Within one claim too.
  m = Refused(ledger.Claim("other", "peer:decode", {{"v", 0, 100}, {"v", 50, 60}}));
  CHECK_THAT(m, Catch::Contains("bytes [50, 60) of region 'v'"));
  CHECK_THAT(m, Catch::Contains("overlap bytes [0, 100) that this chunk also writes"));
  CHECK(ledger.claimed_ranges() == 2);
}

TEST_CASE("A refused claim claims nothing; Release frees a transfer's ranges") {
  DestinationLedger ledger;
  REQUIRE(ledger.Claim("a", "peer:decode", {{"k", 0, 100}}).ok());
  // The first range is free, the second is not: neither is claimed.
  Refused(ledger.Claim("b", "peer:decode", {{"aux", 0, 10}, {"k", 50, 60}}));
  CHECK(ledger.claimed_ranges() == 1);
  REQUIRE(ledger.Claim("c", "peer:decode", {{"aux", 0, 10}}).ok());
  ledger.Release("a");
  CHECK(ledger.claimed_ranges() == 1);
  CHECK(ledger.Claim("b", "peer:decode", {{"k", 50, 60}}).ok());
  ledger.Release("b");
  ledger.Release("c");
  ledger.Release("never-claimed");
  CHECK(ledger.claimed_ranges() == 0);
  CHECK(ledger.Claim("a", "peer:decode", {{"k", 0, 100}, {"aux", 0, 10}}).ok());
}

TEST_CASE("Many ranges claim and release without a search per range") {
  DestinationLedger ledger;
  std::vector<DestinationRange> even, odd;
  for (uint64_t page = 0; page < 100000; ++page) {
    (page % 2 == 0 ? even : odd).push_back({"k", page * 16, page * 16 + 16});
  }
  REQUIRE(ledger.Claim("even", "peer:decode", even).ok());
  REQUIRE(ledger.Claim("odd", "peer:decode", odd).ok());
  CHECK(ledger.claimed_ranges() == 100000);
  std::string m = Refused(ledger.Claim("late", "peer:decode", {{"k", 16 * 77777 + 8, 16 * 77778}}));
  CHECK_THAT(m, Catch::Contains("transfer 'odd' is still writing"));
  ledger.Release("even");
  CHECK(ledger.claimed_ranges() == 50000);
  ledger.Release("odd");
  CHECK(ledger.claimed_ranges() == 0);
}

TEST_CASE("Concurrent claims and releases keep every range with one writer") {
  DestinationLedger ledger;
  std::atomic<int> holders{0};
  std::atomic<int> wins{0};
  std::atomic<bool> broken{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        const std::string id = fmt::format("t{}-{}", t, i);
        // Its own pages, always free, plus one page every thread wants.
        if (!ledger.Claim(id, "peer:decode", {{"k", uint64_t(t) * 4096, uint64_t(t + 1) * 4096}})
                 .ok()) {
          broken = true;
        }
        if (ledger.Claim(id, "peer:decode", {{"shared", 0, 256}}).ok()) {
          if (holders.fetch_add(1) != 0) broken = true;
          ++wins;
          holders.fetch_sub(1);
        }
        ledger.Release(id);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  CHECK_FALSE(broken);
  CHECK(wins > 0);
  CHECK(ledger.claimed_ranges() == 0);
}

TEST_CASE("The ledger keeps its own copies of the names a claim views") {
  DestinationLedger ledger;
  std::string key = "peer:decode#1";
  std::string region = "k.L0-with-a-name-longer-than-inline";
  REQUIRE(ledger.Claim("a", key, {{region, 0, 100}}).ok());
  // The caller's strings change (as a catalog's storage may once the claim returned).
  key.assign("peer:elsewhere#2");
  region.assign("something-else-entirely-and-long");
  std::string m = Refused(ledger.Claim("b", "peer:decode#1",
                                       {{"k.L0-with-a-name-longer-than-inline", 50, 60}}));
  CHECK_THAT(m, Catch::Contains("transfer 'a' is still writing"));
  CHECK(ledger.Claim("b", key, {{region, 50, 60}}).ok());  // another destination
}

// Against a model that keeps every claimed range in a list: a long random mix of
// claims (several chunks per transfer, ranges that overlap or touch, keys of restarted
// peers, ~300 regions: more than the ledger keeps empty, so it drops them in sweeps)
// and releases, with transfer ids used again. Each claim is accepted or refused as
// the model says, the claimed count matches, and the entries the ledger keeps stay
// within the regions holding a range plus kKeptEmptyRegions.
TEST_CASE("Claims and releases through kept and reused entries answer as a list of ranges") {
  struct Held {
    std::string transfer, key, region;
    uint64_t begin, end;
  };
  std::vector<Held> model;
  DestinationLedger ledger;
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&state](uint64_t n) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state % n;
  };
  std::vector<std::string> regions;
  for (int r = 0; r < 300; ++r) regions.push_back(fmt::format("layer-{}-kv-cache-region", r));
  size_t accepted = 0, refused = 0, sweeps_possible = 0;
  for (int step = 0; step < 20000; ++step) {
    const std::string transfer = fmt::format("transfer-with-a-long-id-{}", next(40));
    if (next(10) < 4) {
      ledger.Release(transfer);
      model.erase(std::remove_if(model.begin(), model.end(),
                                 [&](const Held& h) { return h.transfer == transfer; }),
                  model.end());
    } else {
      const std::string key = fmt::format("peer:decode#{}", 1 + next(6));
      // Mostly a few hot regions, sometimes any of the 300.
      std::vector<std::string> names;
      std::vector<DestinationRange> ranges;
      const size_t n = 1 + next(3);
      for (size_t i = 0; i < n; ++i) names.push_back(regions[next(4) == 0 ? next(300) : next(8)]);
      for (size_t i = 0; i < n; ++i) {
        const uint64_t begin = next(64) * 16;
        ranges.push_back({names[i], begin, begin + 16 * (1 + next(3))});
      }
      bool ok = true;
      for (size_t i = 0; i < n && ok; ++i) {
        for (size_t j = 0; j < i && ok; ++j) {
          if (names[i] == names[j] && ranges[i].begin < ranges[j].end &&
              ranges[j].begin < ranges[i].end) {
            ok = false;
          }
        }
        for (const Held& h : model) {
          if (h.key == key && h.region == names[i] && ranges[i].begin < h.end &&
              h.begin < ranges[i].end) {
            ok = false;
          }
        }
      }
      const absl::Status claimed = ledger.Claim(transfer, key, ranges);
      INFO("step " << step << ": " << claimed.ToString());
      REQUIRE(claimed.ok() == ok);
      if (ok) {
        ++accepted;
        for (size_t i = 0; i < n; ++i) {
          model.push_back({transfer, key, names[i], ranges[i].begin, ranges[i].end});
        }
      } else {
        ++refused;
        CHECK(claimed.code() == absl::StatusCode::kFailedPrecondition);
      }
    }
    REQUIRE(ledger.claimed_ranges() == model.size());
    std::vector<std::pair<std::string, std::string>> live;
    for (const Held& h : model) live.emplace_back(h.key, h.region);
    std::sort(live.begin(), live.end());
    live.erase(std::unique(live.begin(), live.end()), live.end());
    REQUIRE(ledger.region_entries() >= live.size());
    REQUIRE(ledger.region_entries() <= live.size() + DestinationLedger::kKeptEmptyRegions);
    if (ledger.region_entries() > DestinationLedger::kKeptEmptyRegions) ++sweeps_possible;
  }
  INFO(accepted << " accepted, " << refused << " refused");
  CHECK(accepted > 5000);
  CHECK(refused > 1000);
  CHECK(sweeps_possible > 0);  // more entries than are kept empty were made: sweeps ran
  for (int t = 0; t < 40; ++t) ledger.Release(fmt::format("transfer-with-a-long-id-{}", t));
  CHECK(ledger.claimed_ranges() == 0);
  CHECK(ledger.region_entries() <= DestinationLedger::kKeptEmptyRegions);
}

std::vector<std::string> Text(const DestinationRangeList& ranges) {
  std::vector<std::string> text;
  for (const DestinationRange& r : ranges) {
    text.push_back(fmt::format("{} [{}, {})", r.region, r.begin, r.end));
  }
  return text;
}

// A plan's destinations, by region name: the peer's regions for WRITE, ours for READ.
TEST_CASE("DestinationRanges names a plan's destination regions and merges runs") {
  ShmMapping local_shm = MakeShm(16384);
  ShmMapping remote_shm = MakeShm(16384);
  RegionRegistry local{&Context()};
  RegionRegistry remote_registry{&Context()};
  REQUIRE(local
              .Register({Spec("lk", local_shm.name(), 0, 4096, 16, 256, "kv"),
                         Spec("lv", local_shm.name(), 4096, 4096, 16, 256, "kv"),
                         Spec("laux", local_shm.name(), 8192, 100, 1, 100)},
                        false, Registrant())
              .ok());
  REQUIRE(remote_registry
              .Register({Spec("rk", remote_shm.name(), 0, 4096, 16, 256, "kv"),
                         Spec("rv", remote_shm.name(), 4096, 4096, 16, 256, "kv"),
                         Spec("raux", remote_shm.name(), 8192, 100, 1, 100)},
                        false, Registrant())
              .ok());
  auto remote = DecodeCatalog(remote_registry);

  google::protobuf::RepeatedPtrField<v1::Segment> segments;
  v1::ItemSegment* items = segments.Add()->mutable_items();
  items->set_local_group("kv");
  items->set_remote_group("kv");
  for (uint64_t i : {0, 1, 2, 9}) items->add_local_indices(i);
  for (uint64_t i : {5, 3, 4, 7}) items->add_remote_indices(i);  // 3, 4, 5 contiguous
  v1::ByteSegment* bytes = segments.Add()->mutable_bytes();
  bytes->set_local_region("laux");
  bytes->set_local_offset(10);
  bytes->set_remote_region("raux");
  bytes->set_remote_offset(20);
  bytes->set_length(30);

  auto plan = PlanTransfer(local, *remote, segments, 0, v1::WRITE);
  REQUIRE(plan.ok());
  // By rkey slot (rk, rv, raux), by offset within one; pages 3-5 become one range.
  CHECK(Text(DestinationRanges(*plan, v1::WRITE, *remote)) ==
        std::vector<std::string>{"rk [768, 1536)", "rk [1792, 2048)", "rv [768, 1536)",
                                 "rv [1792, 2048)", "raux [20, 50)"});
  CHECK(DestinationKey(v1::WRITE, "decode") == "peer:decode");

  plan = PlanTransfer(local, *remote, segments, 0, v1::READ);
  REQUIRE(plan.ok());
  // Local regions come in address order, which mmap chose: compare sorted.
  std::vector<std::string> text = Text(DestinationRanges(*plan, v1::READ, *remote));
  std::sort(text.begin(), text.end());
  CHECK(text == std::vector<std::string>{"laux [10, 40)", "lk [0, 768)", "lk [2304, 2560)",
                                         "lv [0, 768)", "lv [2304, 2560)"});
  CHECK(DestinationKey(v1::READ, "decode") == "local");

  // A second chunk that writes page 7 again: each plan alone is fine, the ledger is not.
  DestinationLedger ledger;
  plan = PlanTransfer(local, *remote, segments, 0, v1::WRITE);
  REQUIRE(plan.ok());
  REQUIRE(ledger.Claim("req", "peer:decode", DestinationRanges(*plan, v1::WRITE, *remote)).ok());
  google::protobuf::RepeatedPtrField<v1::Segment> chunk;
  v1::ItemSegment* again = chunk.Add()->mutable_items();
  again->set_local_group("kv");
  again->set_remote_group("kv");
  again->add_local_indices(11);
  again->add_remote_indices(7);
  auto second = PlanTransfer(local, *remote, chunk, 2, v1::WRITE);
  REQUIRE(second.ok());
  std::string m =
      Refused(ledger.Claim("req", "peer:decode", DestinationRanges(*second, v1::WRITE, *remote)));
  CHECK_THAT(m, Catch::Contains("bytes [1792, 2048) of region 'rk'"));
  CHECK_THAT(m, Catch::Contains("an earlier chunk of this transfer"));
}

TEST_CASE("DestinationRanges keeps regions apart past the few it numbers without a map") {
  // 12 destination regions (more than DestinationRanges numbers inline), each written
  // twice, the second time after all the others: every region's two runs must still
  // meet as one range, whichever way its number was found.
  constexpr int kRegions = 12;
  ShmMapping local_shm = MakeShm(kRegions * 100);
  ShmMapping remote_shm = MakeShm(kRegions * 100);
  RegionRegistry local{&Context()};
  RegionRegistry remote_registry{&Context()};
  std::vector<v1::RegionSpec> local_specs;
  std::vector<v1::RegionSpec> remote_specs;
  for (int i = 0; i < kRegions; ++i) {
    local_specs.push_back(Spec(fmt::format("l{:02}", i), local_shm.name(), i * 100, 100, 1, 100));
    remote_specs.push_back(Spec(fmt::format("r{:02}", i), remote_shm.name(), i * 100, 100, 1, 100));
  }
  REQUIRE(local.Register(local_specs, false, Registrant()).ok());
  REQUIRE(remote_registry.Register(remote_specs, false, Registrant()).ok());
  auto remote = DecodeCatalog(remote_registry);
  google::protobuf::RepeatedPtrField<v1::Segment> segments;
  for (int half = 0; half < 2; ++half) {
    for (int i = 0; i < kRegions; ++i) {
      v1::ByteSegment* bytes = segments.Add()->mutable_bytes();
      bytes->set_local_region(fmt::format("l{:02}", i));
      bytes->set_local_offset(half * 10);
      bytes->set_remote_region(fmt::format("r{:02}", i));
      bytes->set_remote_offset(half * 10);
      bytes->set_length(10);
    }
  }
  std::vector<std::string> expect_remote;
  std::vector<std::string> expect_local;
  for (int i = 0; i < kRegions; ++i) {
    expect_remote.push_back(fmt::format("r{:02} [0, 20)", i));
    expect_local.push_back(fmt::format("l{:02} [0, 20)", i));
  }
  for (const v1::TransferOp op : {v1::WRITE, v1::READ}) {
    auto plan = PlanTransfer(local, *remote, segments, 0, op);
    REQUIRE(plan.ok());
    std::vector<std::string> text = Text(DestinationRanges(*plan, op, *remote));
    std::sort(text.begin(), text.end());
    CHECK(text == (op == v1::WRITE ? expect_remote : expect_local));
  }
  CHECK(DestinationKey(v1::WRITE, "decode", 0xab12) == "peer:decode#ab12");
  CHECK(DestinationKey(v1::READ, "decode", 0xab12) == "local");
  // The hex digits at the ends of the range (no leading zeros, lower case).
  CHECK(DestinationKey(v1::WRITE, "decode", 0) == "peer:decode#0");
  CHECK(DestinationKey(v1::WRITE, "d", 0xf) == "peer:d#f");
  CHECK(DestinationKey(v1::WRITE, "d", 0x10) == "peer:d#10");
  CHECK(DestinationKey(v1::WRITE, "d", UINT64_MAX) == "peer:d#ffffffffffffffff");
  CHECK(DestinationKey(v1::WRITE, "d", 0x0123456789abcdefULL) == "peer:d#123456789abcdef");
}

TEST_CASE("DestinationRanges sorts thousands of scattered pages per region") {
  // 8192 pages of 16 bytes, and 2048 of 1 byte (offsets that fit one radix digit).
  const auto [kItems, kBytes] = GENERATE(table<uint64_t, uint64_t>({{8192, 16}, {2048, 1}}));
  ShmMapping local_shm = MakeShm(2 * kItems * kBytes);
  ShmMapping remote_shm = MakeShm(2 * kItems * kBytes);
  RegionRegistry local{&Context()};
  RegionRegistry remote_registry{&Context()};
  for (auto [registry, shm] : {std::pair{&local, &local_shm}, {&remote_registry, &remote_shm}}) {
    REQUIRE(registry
                ->Register({Spec("k", shm->name(), 0, kItems * kBytes, kItems, kBytes, "kv"),
                            Spec("v", shm->name(), kItems * kBytes, kItems * kBytes, kItems, kBytes,
                                 "kv")},
                           false, Registrant())
                .ok());
  }
  auto remote = DecodeCatalog(remote_registry);
  // Every other page (so no two touch), in a scrambled order, from pages 0.. locally.
  std::vector<uint64_t> pages;
  for (uint64_t i = 0; i < kItems / 2; ++i) pages.push_back(2 * ((i * 1237) % (kItems / 2)));
  google::protobuf::RepeatedPtrField<v1::Segment> segments;
  v1::ItemSegment* items = segments.Add()->mutable_items();
  items->set_local_group("kv");
  items->set_remote_group("kv");
  for (uint64_t i = 0; i < pages.size(); ++i) {
    items->add_local_indices(i);
    items->add_remote_indices(pages[i]);
  }
  auto plan = PlanTransfer(local, *remote, segments, 0, v1::WRITE);
  REQUIRE(plan.ok());
  const DestinationRangeList ranges = DestinationRanges(*plan, v1::WRITE, *remote);
  REQUIRE(ranges.size() == kItems);  // kItems / 2 in each of k and v
  bool ordered = true;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const uint64_t page = 2 * (i % (kItems / 2));
    ordered = ordered && ranges[i].region == (i < kItems / 2 ? "k" : "v") &&
              ranges[i].begin == page * kBytes && ranges[i].end == page * kBytes + kBytes;
  }
  CHECK(ordered);
  // READ: the local side is written, pages 0..kItems/2-1, contiguous: one range each.
  plan = PlanTransfer(local, *remote, segments, 0, v1::READ);
  REQUIRE(plan.ok());
  std::vector<std::string> text = Text(DestinationRanges(*plan, v1::READ, *remote));
  std::sort(text.begin(), text.end());
  const std::string half = fmt::format("[0, {})", kItems / 2 * kBytes);
  CHECK(text == std::vector<std::string>{"k " + half, "v " + half});
}

}  // namespace
}  // namespace kvagent::planning

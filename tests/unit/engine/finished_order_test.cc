// FinishedOrder against a stand-in for the engine's table: what is kept is bounded by
// `keep` plus the records that cannot go yet, and a record that could not go when its
// turn came goes on a later pass once it can.
#include "agent/finished_order.h"

#include <set>
#include <string>

#include "catch2/catch.hpp"

namespace kvagent::agent {
namespace {

// The engine's side: records by id, some pinned (a batch still posted, a watcher).
struct Table {
  std::set<std::string> records, pinned;
  int offers = 0;
  bool TryErase(const std::string& id) {
    ++offers;
    if (pinned.count(id) > 0) return false;
    records.erase(id);
    return true;
  }
};

void End(Table& table, FinishedOrder& order, const std::string& id, size_t keep) {
  table.records.insert(id);
  order.Add(id);
  order.Prune(keep, [&](const std::string& each) { return table.TryErase(each); });
}

TEST_CASE("the last `keep` ended transfers are kept and older ones go, oldest first") {
  Table table;
  FinishedOrder order;
  for (int i = 0; i < 10; ++i) End(table, order, "t" + std::to_string(i), 3);
  CHECK(table.records == std::set<std::string>{"t7", "t8", "t9"});
  CHECK(order.size() == 3);
  CHECK(table.offers == 7);  // one offer per record over the bound
}

TEST_CASE("a record that cannot go at its turn stays and goes on a later pass, instead of "
          "staying for good") {
  Table table;
  FinishedOrder order;
  End(table, order, "draining", 2);
  table.pinned.insert("draining");  // its last batch is still posted
  for (int i = 0; i < 5; ++i) End(table, order, "t" + std::to_string(i), 2);
  // Kept: `keep` records, the one still draining among them (it counts against the
  // bound, so the table never holds more than max(keep, pinned + 1)).
  CHECK(table.records == std::set<std::string>{"draining", "t4"});
  CHECK(order.size() == 2);

  table.pinned.clear();  // its batch completed: it may go now
  End(table, order, "t5", 2);
  End(table, order, "t6", 2);
  CHECK(table.records.count("draining") == 0);
  CHECK(table.records == std::set<std::string>{"t5", "t6"});
  CHECK(order.size() == 2);
}

TEST_CASE("many pinned records: each pass offers only as many as are over the bound, and "
          "all go once released") {
  Table table;
  FinishedOrder order;
  for (int i = 0; i < 100; ++i) {
    const std::string id = "p" + std::to_string(i);
    End(table, order, id, 4);
    table.pinned.insert(id);
  }
  CHECK(table.records.size() == 100);  // none could go
  table.offers = 0;
  End(table, order, "fresh", 4);  // not pinned
  // One pass: the 97 over the bound offered once each, the 100 pinned to the back.
  CHECK(table.offers == 97);
  CHECK(table.records.size() == 101);
  table.pinned.clear();
  for (int i = 0; i < 4; ++i) End(table, order, "n" + std::to_string(i), 4);
  CHECK(table.records == std::set<std::string>{"n0", "n1", "n2", "n3"});
  CHECK(order.size() == 4);
}

TEST_CASE("an id whose record is gone already is dropped from the order") {
  Table table;
  FinishedOrder order;
  order.Add("gone");  // e.g. dropped by other means
  End(table, order, "a", 1);
  CHECK(order.size() == 1);
  CHECK(table.records == std::set<std::string>{"a"});
}

}  // namespace
}  // namespace kvagent::agent

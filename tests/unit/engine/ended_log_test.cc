// EndedLog, the compact form of older ended transfers: each entry comes back as it went
// in (state and extra bytes), the oldest goes first once it is full and is reported as
// it goes, a key added again replaces its older entry, and a log of capacity 0 keeps
// nothing.
#include "agent/ended_log.h"

#include <algorithm>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "catch2/catch.hpp"

namespace kvagent::agent {
namespace {

v1::TransferState StateOf(const std::string& id, int i) {
  v1::TransferState s;
  s.set_transfer_id(id);
  s.set_owner("uid:" + std::to_string(1000 + i));
  s.set_phase(i % 2 == 0 ? v1::COMPLETED : v1::FAILED);
  s.set_error_message(std::string(static_cast<size_t>(i % 300), 'e'));  // many sizes
  s.set_bytes_total(4096ull * static_cast<uint64_t>(i));
  for (int stage = 0; stage < i % 8; ++stage) {
    auto* event = s.add_timeline();
    event->set_at_us(static_cast<uint64_t>(stage * 10 + i));
  }
  return s;
}

// Extra bytes of many lengths, NULs among them.
std::string ExtraOf(int i) {
  std::string extra;
  for (int b = 0; b < (i % 5) * 7; ++b) extra.push_back(static_cast<char>((i * 31 + b) % 256));
  return extra;
}

std::string Id(int i) { return "t-" + std::to_string(i); }

// The keys in order, checking that each visited entry is what Find returns.
std::vector<std::string> Keys(const EndedLog& log) {
  std::vector<std::string> keys;
  log.ForEach([&](absl::string_view key, const v1::TransferState& state, absl::string_view extra) {
    CHECK(state.transfer_id() == key);
    v1::TransferState found;
    std::string found_extra;
    CHECK(log.Find(key, &found, &found_extra));
    CHECK(found.SerializeAsString() == state.SerializeAsString());
    CHECK(found_extra == extra);
    keys.emplace_back(key);
  });
  return keys;
}

TEST_CASE("ended log: entries come back as they went in, the oldest goes first") {
  EndedLog log(5);
  std::vector<std::string> let_go;
  for (int i = 0; i < 12; ++i) {
    CHECK(log.Add(Id(i), StateOf(Id(i), i), ExtraOf(i),
                  [&](absl::string_view key, absl::string_view) { let_go.emplace_back(key); }));
  }
  CHECK(log.size() == 5);
  CHECK(Keys(log) == std::vector<std::string>{"t-7", "t-8", "t-9", "t-10", "t-11"});
  CHECK(let_go == std::vector<std::string>{"t-0", "t-1", "t-2", "t-3", "t-4", "t-5", "t-6"});
  for (int i = 0; i < 12; ++i) {
    INFO(Id(i));
    v1::TransferState state;
    std::string extra = "left over";  // replaced, not appended to
    if (i < 7) {
      CHECK_FALSE(log.Contains(Id(i)));
      CHECK_FALSE(log.Find(Id(i), &state, &extra));
      continue;
    }
    REQUIRE(log.Contains(Id(i)));
    REQUIRE(log.Find(Id(i), &state, &extra));
    CHECK(state.SerializeAsString() == StateOf(Id(i), i).SerializeAsString());
    CHECK(extra == ExtraOf(i));
  }
}

TEST_CASE("ended log: a key added again replaces its older entry") {
  EndedLog log(3);
  std::vector<std::string> let_go;
  auto note = [&](absl::string_view key, absl::string_view extra) {
    let_go.emplace_back(key);
    CHECK(extra == (let_go.size() == 3 ? ExtraOf(3) : ""));  // what went with it
  };
  log.Add("a", StateOf("a", 1), "", note);
  log.Add("b", StateOf("b", 2), "", note);
  log.Add("a", StateOf("a", 3), ExtraOf(3), note);
  CHECK(let_go == std::vector<std::string>{"a"});  // the older "a"
  CHECK(Keys(log) == std::vector<std::string>{"b", "a"});
  v1::TransferState state;
  std::string extra;
  REQUIRE(log.Find("a", &state, &extra));
  CHECK(state.SerializeAsString() == StateOf("a", 3).SerializeAsString());
  CHECK(extra == ExtraOf(3));
  // The replaced entry's slot counts until the ring passes it: the next add fills the
  // ring, and the one after lets "b" go, then the newer "a".
  log.Add("c", StateOf("c", 4), "", note);
  CHECK(Keys(log) == std::vector<std::string>{"b", "a", "c"});
  log.Add("d", StateOf("d", 5), "", note);
  CHECK(Keys(log) == std::vector<std::string>{"a", "c", "d"});
  CHECK_FALSE(log.Contains("b"));
  log.Add("e", StateOf("e", 6), "", note);
  CHECK(Keys(log) == std::vector<std::string>{"c", "d", "e"});
  CHECK_FALSE(log.Contains("a"));
  CHECK(let_go == std::vector<std::string>{"a", "b", "a"});
}

TEST_CASE("ended log: capacity 0 keeps nothing") {
  EndedLog log(0);
  bool let_go = false;
  CHECK_FALSE(log.Add("a", StateOf("a", 1), ExtraOf(1),
                      [&](absl::string_view, absl::string_view) { let_go = true; }));
  CHECK_FALSE(let_go);
  CHECK(log.size() == 0);
  CHECK_FALSE(log.Contains("a"));
  CHECK(Keys(log).empty());
}

TEST_CASE("ended log: a long run through a small ring finds every kept key, no other") {
  constexpr int kCapacity = 64;
  EndedLog log(kCapacity);
  for (int i = 0; i < 5000; ++i) {
    log.Add(Id(i), StateOf(Id(i), i), ExtraOf(i));
    if (i % 97 != 0) continue;
    for (int j = std::max(0, i - 2 * kCapacity); j <= i; ++j) {
      INFO(i << " " << j);
      REQUIRE(log.Contains(Id(j)) == (j > i - kCapacity));
    }
    v1::TransferState state;
    std::string extra;
    REQUIRE(log.Find(Id(i - i % 2), &state, &extra));
    CHECK(extra == ExtraOf(i - i % 2));
  }
}

TEST_CASE("ended log: a random mix of adds, replacements and lookups matches a plain model") {
  // The index (linear probing, backward-shift deletion) against a deque of live keys:
  // few distinct keys, so replacements and probe chains that wrap around are common.
  const size_t capacity = GENERATE(1u, 2u, 7u, 64u);
  INFO("capacity " << capacity);
  EndedLog log(capacity);
  std::deque<std::pair<std::string, int>> model;  // oldest first; replaced ones removed
  size_t slots_used = 0;  // the log's count: replaced entries hold their slot
  std::mt19937_64 rng(12345);  // the same mix every run
  auto next = [&rng](uint64_t n) { return rng() % n; };
  std::deque<bool> slot_live;  // per entry in the log's order: live, or replaced
  std::deque<std::string> slot_key;
  for (int step = 0; step < 20000; ++step) {
    const std::string key = "k" + std::to_string(next(3 * capacity + 3));
    if (next(4) != 0) {
      // The model: a replaced key's entry dies in place; the ring passes dead ones too.
      for (size_t e = 0; e < slot_key.size(); ++e) {
        if (slot_live[e] && slot_key[e] == key) slot_live[e] = false;
      }
      if (slot_key.size() == capacity) {
        slot_key.pop_front();
        slot_live.pop_front();
      }
      slot_key.push_back(key);
      slot_live.push_back(true);
      log.Add(key, StateOf(key, step), ExtraOf(step));
      model.clear();
      for (size_t e = 0; e < slot_key.size(); ++e) {
        if (slot_live[e]) model.emplace_back(slot_key[e], 0);
      }
      slots_used = slot_key.size();
    }
    CHECK(log.size() == slots_used);
    const bool want = std::any_of(model.begin(), model.end(),
                                  [&](const auto& m) { return m.first == key; });
    REQUIRE(log.Contains(key) == want);
    if (step % 101 == 0) {
      std::vector<std::string> keys;
      for (const auto& m : model) keys.push_back(m.first);
      REQUIRE(Keys(log) == keys);
    }
  }
}

}  // namespace
}  // namespace kvagent::agent

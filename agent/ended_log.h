// EndedLog: ended transfers kept for queries in compact form, oldest let go first. Each
// is one string (its key, its serialized TransferState and a few bytes its keeper needs,
// such as an outgoing transfer's chunk digests or an incoming one's owners) in a ring of
// slots whose strings keep their storage, found by key through an index that holds only
// slot numbers, beside an array of the keys' hashes: both small enough to stay in cache
// (12 bytes an entry), so adding an entry and letting the oldest go read no key and no
// cold line but the slot written. Used by the transfer engine and the receiving side, which keep their
// newest ended records whole and move older ones here: 10,000 ended transfers then cost
// a few hundred bytes each in one string, not a 1-2 KiB record of many heap blocks
// each, and a transfer ending writes one slot instead of resetting a cold record's
// every line (issue 15; docs/BENCHMARKS.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "proto/kvagent.pb.h"

namespace kvagent::agent {

class EndedLog {
 public:
  // Keeps at most `capacity` entries; 0 keeps none (Add does nothing).
  explicit EndedLog(size_t capacity);
  EndedLog(const EndedLog&) = delete;
  EndedLog& operator=(const EndedLog&) = delete;

  size_t capacity() const { return slots_.size(); }
  // Entries kept, counting the slots of replaced ones until the ring passes them.
  size_t size() const { return count_; }

  // Keeps `state` and `extra` under `key`, as the newest entry; when full, the oldest
  // goes first. A key already here is replaced (its older entry goes).
  // `on_let_go(key, extra)` is called for each entry that goes, before its slot is
  // reused. Returns false when
  // nothing is kept (capacity 0). Allocates nothing once every slot held an entry at
  // least as long.
  template <typename OnLetGo>
  bool Add(absl::string_view key, const v1::TransferState& state, absl::string_view extra,
           OnLetGo on_let_go) {
    if (slots_.empty()) return false;
    const uint64_t hash = HashOf(key);  // once: the lookup below and the slot's
    if (const uint32_t older = Lookup(key, hash); older != kNone) {
      on_let_go(key, ExtraOf(slots_[older]));
      EraseSlot(older);
    }
    const size_t i = NextSlot();
    if (slots_[i].live) {
      on_let_go(KeyOf(slots_[i]), ExtraOf(slots_[i]));
      EraseSlot(i);
    }
    Fill(i, key, hash, state, extra);
    return true;
  }
  bool Add(absl::string_view key, const v1::TransferState& state, absl::string_view extra = {}) {
    return Add(key, state, extra, [](absl::string_view, absl::string_view) {});
  }
  bool Contains(absl::string_view key) const { return Lookup(key, HashOf(key)) != kNone; }
  // The entry under `key`, parsed into `state` and, when not null, its extra bytes
  // into `extra` (replacing what they held); false when there is none.
  bool Find(absl::string_view key, v1::TransferState* state, std::string* extra = nullptr) const;
  // Calls `visit(key, state, extra)` for each entry, oldest first, with its state parsed
  // into one reused message (copy what is kept).
  template <typename Visit>
  void ForEach(Visit visit) const {
    v1::TransferState state;
    for (size_t i = 0; i < count_; ++i) {
      const Slot& slot = slots_[(head_ + i) % slots_.size()];
      if (!slot.live || !Parse(slot, &state)) continue;
      visit(KeyOf(slot), state, ExtraOf(slot));
    }
  }

 private:
  struct Slot {
    std::string bytes;  // key, then state, then extra
    uint32_t key_bytes = 0;
    uint32_t state_bytes = 0;
    bool live = false;  // false: empty, or its entry was replaced by a newer one
  };
  static absl::string_view KeyOf(const Slot& slot) {
    return absl::string_view(slot.bytes.data(), slot.key_bytes);
  }
  static absl::string_view ExtraOf(const Slot& slot) {
    const size_t at = size_t{slot.key_bytes} + slot.state_bytes;
    return absl::string_view(slot.bytes.data() + at, slot.bytes.size() - at);
  }
  static bool Parse(const Slot& slot, v1::TransferState* state);
  static constexpr uint32_t kNone = UINT32_MAX;
  static uint64_t HashOf(absl::string_view key);
  // The slot holding `key` (whose HashOf is `hash`), or kNone.
  uint32_t Lookup(absl::string_view key, uint64_t hash) const;
  // index_'s position of slot `i` (which is in it).
  size_t PositionOf(uint32_t i) const;
  // The slot the next entry goes into: past the newest, or the oldest's when full
  // (then the oldest is the one after it).
  size_t NextSlot();
  void Fill(size_t i, absl::string_view key, uint64_t hash, const v1::TransferState& state,
            absl::string_view extra);
  void EraseSlot(size_t i);

  std::vector<Slot> slots_;
  size_t head_ = 0;   // the oldest entry's slot
  size_t count_ = 0;  // entries, in the slots from head_ on (wrapping)
  // Open addressing with linear probing, at most half full: slot number + 1 (0: empty)
  // at the position its key's hash starts from, or the next free one after it. A key
  // is compared only when its hash matches (hashes_); a slot leaves by backward-shift
  // deletion, so there are no tombstones and probes stay short.
  std::vector<uint32_t> index_;
  size_t mask_ = 0;
  std::vector<uint64_t> hashes_;  // per slot, its key's
};

}  // namespace kvagent::agent

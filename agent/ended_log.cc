#include "agent/ended_log.h"

#include <cstring>

#include "absl/hash/hash.h"

namespace kvagent::agent {

EndedLog::EndedLog(size_t capacity) : slots_(capacity), hashes_(capacity) {
  if (capacity == 0) return;
  size_t positions = 4;
  while (positions < 2 * capacity) positions *= 2;
  index_.assign(positions, 0);
  mask_ = positions - 1;
}

uint64_t EndedLog::HashOf(absl::string_view key) { return absl::Hash<absl::string_view>{}(key); }

uint32_t EndedLog::Lookup(absl::string_view key, uint64_t hash) const {
  if (index_.empty()) return kNone;
  for (size_t p = hash & mask_; index_[p] != 0; p = (p + 1) & mask_) {
    const uint32_t i = index_[p] - 1;
    if (hashes_[i] == hash && KeyOf(slots_[i]) == key) return i;
  }
  return kNone;
}

size_t EndedLog::PositionOf(uint32_t i) const {
  size_t p = hashes_[i] & mask_;
  while (index_[p] != i + 1) p = (p + 1) & mask_;  // it is there: the loop ends
  return p;
}

void EndedLog::EraseSlot(size_t i) {
  Slot& slot = slots_[i];
  if (!slot.live) return;
  slot.live = false;
  // Backward-shift deletion: each entry after the hole that may move into it (its
  // home is not between the hole and it, cyclically) does, leaving a hole where it was.
  size_t hole = PositionOf(static_cast<uint32_t>(i));
  index_[hole] = 0;
  for (size_t p = (hole + 1) & mask_; index_[p] != 0; p = (p + 1) & mask_) {
    const size_t home = hashes_[index_[p] - 1] & mask_;
    const bool stays = hole <= p ? (hole < home && home <= p) : (hole < home || home <= p);
    if (stays) continue;
    index_[hole] = index_[p];
    index_[p] = 0;
    hole = p;
  }
}

size_t EndedLog::NextSlot() {
  if (count_ < slots_.size()) return (head_ + count_++) % slots_.size();
  const size_t oldest = head_;
  head_ = (head_ + 1) % slots_.size();
  return oldest;
}

void EndedLog::Fill(size_t i, absl::string_view key, uint64_t hash,
                    const v1::TransferState& state, absl::string_view extra) {
  Slot& slot = slots_[i];
  const size_t state_bytes = state.ByteSizeLong();
  // resize keeps the capacity the slot's earlier entries grew; every byte is written.
  slot.bytes.resize(key.size() + state_bytes + extra.size());
  char* out = slot.bytes.data();
  std::memcpy(out, key.data(), key.size());
  state.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(out + key.size()));
  if (!extra.empty()) std::memcpy(out + key.size() + state_bytes, extra.data(), extra.size());
  slot.key_bytes = static_cast<uint32_t>(key.size());
  slot.state_bytes = static_cast<uint32_t>(state_bytes);
  slot.live = true;
  hashes_[i] = hash;
  size_t p = hashes_[i] & mask_;
  while (index_[p] != 0) p = (p + 1) & mask_;  // at most half full: there is room
  index_[p] = static_cast<uint32_t>(i) + 1;
}

bool EndedLog::Parse(const Slot& slot, v1::TransferState* state) {
  // Fails only if the bytes were not this process's own serialization.
  return state->ParseFromArray(slot.bytes.data() + slot.key_bytes,
                               static_cast<int>(slot.state_bytes));
}

bool EndedLog::Find(absl::string_view key, v1::TransferState* state, std::string* extra) const {
  const uint32_t i = Lookup(key, HashOf(key));
  if (i == kNone) return false;
  const Slot& slot = slots_[i];
  if (!Parse(slot, state)) return false;
  if (extra != nullptr) extra->assign(ExtraOf(slot).data(), ExtraOf(slot).size());
  return true;
}

}  // namespace kvagent::agent

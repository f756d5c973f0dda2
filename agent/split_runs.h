// The one way a batch is shared among copy lanes, host threads (agent/copy_lanes) and
// CUDA streams (agent/gpu/device_batch_copier) alike: `parts` runs of about equal
// bytes, in order, lane k taking bytes [k * share, (k + 1) * share) of the batch, the
// last lane what rounding leaves. A piece that crosses a run's edge is cut there (both
// halves keep everything else the piece carries, e.g. a device copy's op); zero-byte
// pieces are dropped. `Piece` has `dst`, `src` (pointers or addresses) and `bytes`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvagent::agent {

template <typename Piece>
void SplitRuns(const std::vector<Piece>& pieces, uint32_t parts,
               std::vector<std::vector<Piece>>* out) {
  parts = std::max<uint32_t>(parts, 1);
  out->resize(parts);
  for (auto& run : *out) run.clear();
  uint64_t total = 0;
  for (const Piece& p : pieces) total += p.bytes;
  const uint64_t share = (total + parts - 1) / parts;
  uint32_t lane = 0;
  uint64_t room = share;
  for (const Piece& piece : pieces) {
    Piece rest = piece;
    while (rest.bytes > 0) {
      if (room == 0 && lane + 1 < parts) {
        ++lane;
        room = share;
      }
      const uint64_t take = lane + 1 < parts ? std::min<uint64_t>(rest.bytes, room) : rest.bytes;
      Piece cut = rest;
      cut.bytes = take;
      (*out)[lane].push_back(cut);
      rest.dst += take;
      rest.src += take;
      rest.bytes -= take;
      room -= std::min(room, take);
    }
  }
}

}  // namespace kvagent::agent

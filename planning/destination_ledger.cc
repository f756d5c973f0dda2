#include "planning/destination_ledger.h"

#include <algorithm>
#include <iterator>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/string_view.h"
#include "base/text.h"
#include "fmt/format.h"

namespace kvagent::planning {

using registry::Region;
using registry::RegionPtr;
using registry::RemoteCatalog;

namespace {

using Range = std::pair<uint64_t, uint64_t>;  // [begin, end)

// Debian's Abseil has its own string_view (not std's): what its maps look strings up by.
absl::string_view Lookup(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Sorts by begin: an LSD radix sort on 11-bit digits of the begin offsets (as many
// digits as the largest offset needs), since a plan of scattered pages gives a region
// up to millions of ranges; std::sort for small slices.
void SortByBegin(Range* first, Range* last) {
  const size_t n = static_cast<size_t>(last - first);
  if (n < 1024) {
    std::sort(first, last);
    return;
  }
  uint64_t max = 0;
  for (auto it = first; it != last; ++it) max = std::max(max, it->first);
  constexpr int kBits = 11;
  constexpr size_t kBuckets = size_t{1} << kBits;
  std::vector<Range> buffer(n);
  Range* from = first;
  Range* to = buffer.data();
  bool in_buffer = false;
  for (int shift = 0; shift < 64 && (max >> shift) != 0; shift += kBits) {
    size_t counts[kBuckets + 1] = {};
    for (size_t i = 0; i < n; ++i) ++counts[((from[i].first >> shift) & (kBuckets - 1)) + 1];
    for (size_t b = 1; b <= kBuckets; ++b) counts[b] += counts[b - 1];
    for (size_t i = 0; i < n; ++i)
      to[counts[(from[i].first >> shift) & (kBuckets - 1)]++] = from[i];
    std::swap(from, to);
    in_buffer = !in_buffer;
  }
  if (in_buffer) std::copy(buffer.begin(), buffer.end(), first);
}

}  // namespace

DestinationRangeList DestinationRanges(const TransferPlan& plan, v1::TransferOp op,
                                       const RemoteCatalog& remote) {
  const bool read = op == v1::READ;
  // Regions are numbered: WRITE by rkey slot (the catalog's order), READ by base
  // address among the plan's pinned local regions; `known` stands for an op outside
  // every region, which PlanTransfer never makes (claimed by address, so it still
  // conflicts with itself).
  absl::InlinedVector<const Region*, 4> locals;
  if (read) {
    for (const RegionPtr& region : plan.local_regions) locals.push_back(region.get());
    std::sort(locals.begin(), locals.end(),
              [](const Region* a, const Region* b) { return a->base_address < b->base_address; });
  }
  const size_t known = read ? locals.size() : remote.regions().size();
  auto region_of = [&](const PlanOp& o, uint64_t address) -> std::pair<size_t, uint64_t> {
    if (!read) {
      if (o.rkey_slot < known) return {o.rkey_slot, remote.regions()[o.rkey_slot].base_address};
      return {known, 0};
    }
    auto inside = [&](const Region* r) {
      return (r->spec.memory() == v1::VRAM) == o.local_device && address >= r->base_address &&
             address - r->base_address < r->spec.length();
    };
    auto it = std::upper_bound(locals.begin(), locals.end(), address,
                               [](uint64_t a, const Region* r) { return a < r->base_address; });
    if (it == locals.begin() || !inside(*std::prev(it))) {
      it = std::find_if(locals.begin(), locals.end(), inside);  // a host/device address clash
      if (it == locals.end()) return {known, 0};
      ++it;
    }
    const size_t index = static_cast<size_t>(std::prev(it) - locals.begin());
    return {index, locals[index]->base_address};
  };

  // 1. Each op's region, numbered densely in order of first use (ops come region-major,
  //    so the last lookup is nearly always the answer). A plan of a few ops (the usual
  //    one-page transfer) keeps these in inline storage and finds a region among the
  //    first few seen without a map: it allocates only its result.
  constexpr size_t kInline = 8;
  absl::InlinedVector<size_t, kInline> dense_regions;  // dense id -> region index
  absl::flat_hash_map<size_t, uint32_t> dense_ids;     // used past kInline regions
  absl::InlinedVector<uint32_t, kInline> ids(plan.ops.size());
  absl::InlinedVector<uint64_t, kInline> offsets(plan.ops.size());
  size_t last_region = SIZE_MAX;
  uint32_t last_id = 0;
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& o = plan.ops[i];
    const uint64_t address = read ? o.local_address : o.remote_address;
    const auto [region, base] = region_of(o, address);
    if (region != last_region) {
      const uint32_t next_id = static_cast<uint32_t>(dense_regions.size());
      uint32_t id = UINT32_MAX;
      if (dense_ids.empty()) {
        for (uint32_t d = 0; d < dense_regions.size() && id == UINT32_MAX; ++d) {
          if (dense_regions[d] == region) id = d;
        }
        if (id == UINT32_MAX && dense_regions.size() == kInline) {
          // A new region past kInline: from here on a map, given the ones seen so far.
          for (uint32_t d = 0; d < dense_regions.size(); ++d) dense_ids.emplace(dense_regions[d], d);
        }
      }
      if (id == UINT32_MAX && !dense_ids.empty()) {
        id = dense_ids.try_emplace(region, next_id).first->second;
      }
      if (id == UINT32_MAX) id = next_id;
      if (id == next_id) dense_regions.push_back(region);
      last_region = region;
      last_id = id;
    }
    ids[i] = last_id;
    offsets[i] = address - base;
  }
  // 2. Ranges grouped by region (a counting sort), then by offset within each.
  absl::InlinedVector<size_t, kInline + 1> starts(dense_regions.size() + 1, 0);
  for (uint32_t id : ids) ++starts[id + 1];
  for (size_t d = 1; d < starts.size(); ++d) starts[d] += starts[d - 1];
  absl::InlinedVector<std::pair<uint64_t, uint64_t>, kInline> ranges(plan.ops.size());
  {
    absl::InlinedVector<size_t, kInline> next(starts.begin(), starts.end() - 1);
    for (size_t i = 0; i < plan.ops.size(); ++i) {
      ranges[next[ids[i]]++] = {offsets[i], offsets[i] + plan.ops[i].length};
    }
  }
  absl::InlinedVector<size_t, kInline> order(dense_regions.size());
  for (size_t d = 0; d < order.size(); ++d) order[d] = d;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return dense_regions[a] < dense_regions[b]; });
  // 3. Touching ranges merge.
  DestinationRangeList out;
  for (size_t d : order) {
    const size_t region = dense_regions[d];
    const std::string_view name =
        region < known
            ? std::string_view(read ? locals[region]->spec.name() : remote.regions()[region].name)
            : std::string_view(read ? "local@address" : "remote@address");
    auto first = ranges.begin() + static_cast<std::ptrdiff_t>(starts[d]);
    auto last = ranges.begin() + static_cast<std::ptrdiff_t>(starts[d + 1]);
    if (!std::is_sorted(first, last)) SortByBegin(first, last);
    const size_t begin_out = out.size();
    for (auto it = first; it != last; ++it) {
      if (it->first == it->second) continue;
      if (out.size() > begin_out && it->first <= out.back().end) {
        out.back().end = std::max(out.back().end, it->second);
        continue;
      }
      out.push_back(DestinationRange{name, it->first, it->second});
    }
  }
  return out;
}

std::string DestinationKey(v1::TransferOp op, const std::string& peer) {
  return op == v1::READ ? std::string("local") : "peer:" + peer;
}

void DestinationKeyInto(v1::TransferOp op, const std::string& peer, uint64_t incarnation,
                        std::string* key) {
  if (op == v1::READ) {
    key->assign("local");
    return;
  }
  key->clear();
  key->reserve(5 + peer.size() + 1 + 16);
  key->append("peer:").append(peer).push_back('#');
  // Lower-case hex without leading zeros ("{:x}"), written by hand: fmt's formatting
  // through a back inserter cost several times this on every submit.
  char digits[16];
  size_t n = 0;
  do {
    digits[n++] = "0123456789abcdef"[incarnation & 0xf];
    incarnation >>= 4;
  } while (incarnation != 0);
  while (n > 0) key->push_back(digits[--n]);
}

std::string DestinationKey(v1::TransferOp op, const std::string& peer, uint64_t incarnation) {
  std::string key;
  DestinationKeyInto(op, peer, incarnation, &key);
  return key;
}

absl::Status DestinationLedger::Claim(const std::string& transfer_id, std::string_view key,
                                      absl::Span<const DestinationRange> ranges) {
  absl::InlinedVector<const DestinationRange*, 4> sorted;
  sorted.reserve(ranges.size());
  for (const DestinationRange& range : ranges) {
    if (range.end < range.begin) {
      return absl::InvalidArgumentError(
          fmt::format("transfer '{}': range [{}, {}) of region '{}' ends before it begins; give "
                      "[begin, end) with begin <= end",
                      Printable(transfer_id), range.begin, range.end, Printable(range.region)));
    }
    if (range.end > range.begin) sorted.push_back(&range);
  }
  std::sort(sorted.begin(), sorted.end(), [](const DestinationRange* a, const DestinationRange* b) {
    return std::tie(a->region, a->begin) < std::tie(b->region, b->begin);
  });

  absl::MutexLock lock(&mu_);
  auto self_it = holders_.find(transfer_id);
  const Holder* self = self_it != holders_.end() ? &self_it->second : nullptr;
  auto key_it = keys_.find(Lookup(key));
  Regions* regions = key_it != keys_.end() ? &key_it->second : nullptr;

  auto refuse = [&](const DestinationRange& range, uint64_t other_begin, uint64_t other_end,
                    const Holder* other) {
    const std::string where = fmt::format(
        "transfer '{}': bytes [{}, {}) of region '{}' (destination '{}') overlap "
        "bytes [{}, {})",
        Printable(transfer_id), range.begin, range.end, Printable(range.region), Printable(key),
        other_begin, other_end);
    if (other == nullptr) {
      return absl::FailedPreconditionError(fmt::format(
          "{} that this chunk also writes; a transfer writes each destination byte once: name "
          "each page once",
          where));
    }
    if (other == self) {
      return absl::FailedPreconditionError(fmt::format(
          "{} that an earlier chunk of this transfer writes; a transfer writes each "
          "destination byte once: drop the repeated pages from this chunk, or move them to a "
          "later transfer that starts after this one ends",
          where));
    }
    return absl::FailedPreconditionError(fmt::format(
        "{} that transfer '{}' is still writing; two transfers may not write the same "
        "destination at once: wait until transfer '{}' has ended (or cancel it), then submit "
        "again",
        where, Printable(*other->transfer_id), Printable(*other->transfer_id)));
  };

  const Intervals* intervals = nullptr;
  const DestinationRange* widest = nullptr;  // of this claim, in the current region
  for (size_t i = 0; i < sorted.size(); ++i) {
    const DestinationRange& range = *sorted[i];
    if (i == 0 || range.region != sorted[i - 1]->region) {
      widest = nullptr;
      intervals = nullptr;
      if (regions != nullptr) {
        if (auto it = regions->find(Lookup(range.region)); it != regions->end()) {
          intervals = &it->second;
        }
      }
    }
    if (widest != nullptr && range.begin < widest->end) {
      return refuse(range, widest->begin, widest->end, nullptr);
    }
    if (widest == nullptr || range.end > widest->end) widest = &range;
    if (intervals == nullptr) continue;
    // Claimed ranges do not overlap each other, so only the last one starting at or
    // before `begin` and the first one starting after it can meet [begin, end).
    auto next = intervals->upper_bound(range.begin);
    if (next != intervals->begin()) {
      auto prev = std::prev(next);
      if (prev->second.end > range.begin) {
        return refuse(range, prev->first, prev->second.end, prev->second.holder);
      }
    }
    if (next != intervals->end() && next->first < range.end) {
      return refuse(range, next->first, next->second.end, next->second.holder);
    }
  }
  if (sorted.empty()) return absl::OkStatus();

  // Entries are found before any is made, and made from spare nodes where there are
  // some (a released transfer's holder, released ranges' map nodes).
  auto holder_it = self_it;
  if (holder_it == holders_.end()) {
    if (!spare_holders_.empty()) {
      Holders::node_type node = std::move(spare_holders_.back());
      spare_holders_.pop_back();
      node.key().assign(transfer_id);
      node.mapped().held.clear();
      holder_it = holders_.insert(std::move(node)).position;
    } else {
      holder_it = holders_.try_emplace(transfer_id).first;
    }
  }
  Holder& holder = holder_it->second;
  holder.transfer_id = &holder_it->first;
  if (key_it == keys_.end()) key_it = keys_.emplace(std::string(key), Regions()).first;
  Regions& key_regions = key_it->second;
  Held* held = nullptr;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const DestinationRange& range = *sorted[i];
    if (i == 0 || range.region != sorted[i - 1]->region) {
      auto region_it = key_regions.find(Lookup(range.region));
      if (region_it == key_regions.end()) {
        region_it = key_regions.emplace(std::string(range.region), Intervals()).first;
        ++regions_;
      } else if (region_it->second.empty()) {
        --empty_regions_;  // a kept one, used again
      }
      Intervals* target = &region_it->second;
      held = nullptr;
      for (Held& h : holder.held) {
        if (h.intervals == target) held = &h;
      }
      if (held == nullptr) {
        // Made in place: moving a temporary in copied its empty inline `begins`, which
        // GCC 12 warned about (maybe-uninitialized).
        held = &holder.held.emplace_back();
        held->intervals = target;
      }
    }
    if (!spare_ranges_.empty()) {
      Intervals::node_type node = std::move(spare_ranges_.back());
      spare_ranges_.pop_back();
      node.key() = range.begin;
      node.mapped() = Claimed{range.end, &holder};
      held->intervals->insert(std::move(node));
    } else {
      held->intervals->emplace(range.begin, Claimed{range.end, &holder});
    }
    held->begins.push_back(range.begin);
    ++claimed_;
  }
  return absl::OkStatus();
}

void DestinationLedger::Release(const std::string& transfer_id) {
  absl::MutexLock lock(&mu_);
  auto it = holders_.find(transfer_id);
  if (it == holders_.end()) return;
  for (Held& held : it->second.held) {
    for (uint64_t begin : held.begins) {
      Intervals::node_type node = held.intervals->extract(begin);
      if (node.empty()) continue;
      --claimed_;
      if (spare_ranges_.size() < kSpare) spare_ranges_.push_back(std::move(node));
    }
    if (!held.intervals->empty()) continue;
    // No transfer holds anything there: the region's entry is kept for the next claim
    // while fewer than kKeptEmptyRegions are; past that, every other empty one goes
    // (those of destinations no longer written, such as a restarted peer's old
    // incarnation), and this one is kept.
    if (empty_regions_ == kKeptEmptyRegions) DropEmptyRegionsLocked(held.intervals);
    ++empty_regions_;
  }
  if (spare_holders_.size() < kSpare) {
    spare_holders_.push_back(holders_.extract(it));
  } else {
    holders_.erase(it);
  }
}

void DestinationLedger::DropEmptyRegionsLocked(const Intervals* keep) {
  // Only regions no transfer holds are empty: no Held points at what goes here.
  for (auto key = keys_.begin(); key != keys_.end();) {
    Regions& regions = key->second;
    for (auto region = regions.begin(); region != regions.end();) {
      if (region->second.empty() && &region->second != keep) {
        regions.erase(region++);
        --regions_;
        --empty_regions_;
      } else {
        ++region;
      }
    }
    if (regions.empty()) {
      keys_.erase(key++);
    } else {
      ++key;
    }
  }
}

size_t DestinationLedger::claimed_ranges() const {
  absl::MutexLock lock(&mu_);
  return claimed_;
}

size_t DestinationLedger::region_entries() const {
  absl::MutexLock lock(&mu_);
  return regions_;
}

}  // namespace kvagent::planning

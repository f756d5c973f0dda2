#include "planning/staging_plan.h"

#include <algorithm>
#include <limits>

#include "fmt/format.h"

namespace kvagent::planning {

namespace {

uint64_t VarintBytes(uint64_t value) {
  uint64_t bytes = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++bytes;
  }
  return bytes;
}

}  // namespace

uint64_t EncodedPieceBytes(uint64_t remote_address, uint64_t length) {
  // proto3 leaves out a field that is 0.
  const uint64_t inner = (remote_address != 0 ? 1 + VarintBytes(remote_address) : 0) +
                         (length != 0 ? 1 + VarintBytes(length) : 0);
  return 1 + VarintBytes(inner) + inner;  // the repeated field's tag (fields 4, 5) and length
}

absl::StatusOr<std::vector<StagingChunk>> PlanStaging(const std::vector<PlanOp>& ops,
                                                       const StagingPlanOptions& options) {
  if (options.chunk_bytes == 0 || options.buffers == 0 || options.max_pieces == 0) {
    return absl::InvalidArgumentError(fmt::format(
        "staging: chunk bytes {}, buffers {}, pieces per chunk {}: each must be at least 1; "
        "set --staging-chunk-bytes and --staging-buffers to positive values (defaults 4 MiB "
        "and 8)",
        options.chunk_bytes, options.buffers, options.max_pieces));
  }
  if (options.max_piece_bytes != 0 && options.max_piece_bytes < kMaxEncodedPieceBytes) {
    return absl::InvalidArgumentError(fmt::format(
        "staging: {} bytes for the pieces of a chunk header, under the {} one piece may take; "
        "the transport's active-message header is too small for staged chunks",
        options.max_piece_bytes, kMaxEncodedPieceBytes));
  }
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  for (size_t i = 0; i < ops.size(); ++i) {
    const PlanOp& o = ops[i];
    if (o.length == 0) {
      return absl::InvalidArgumentError(fmt::format(
          "staging: operation {} (segment {}) has length 0; the planner never emits empty "
          "operations, so this is a caller bug: drop empty operations before staging",
          i, o.segment));
    }
    if (o.local_address > kMax - o.length || o.remote_address > kMax - o.length) {
      return absl::InvalidArgumentError(fmt::format(
          "staging: operation {} (segment {}) of {} bytes at local {:#x} / remote {:#x} wraps "
          "the address space; check the region layout",
          i, o.segment, o.length, o.local_address, o.remote_address));
    }
  }

  std::vector<StagingChunk> chunks;
  StagingChunk current;
  auto close = [&] {
    if (!current.pieces.empty()) chunks.push_back(std::move(current));
    current = StagingChunk{};
  };
  for (size_t i = 0; i < ops.size(); ++i) {
    const PlanOp& o = ops[i];
    uint64_t done = 0;
    while (done < o.length) {
      if (current.bytes == options.chunk_bytes || current.pieces.size() == options.max_pieces) {
        close();
      }
      uint64_t take = std::min(o.length - done, options.chunk_bytes - current.bytes);
      uint64_t encoded = EncodedPieceBytes(o.remote_address + done, take);
      if (options.max_piece_bytes != 0 && current.piece_bytes + encoded > options.max_piece_bytes) {
        close();  // not empty: one piece alone always fits
        take = std::min(o.length - done, options.chunk_bytes);
        encoded = EncodedPieceBytes(o.remote_address + done, take);
      }
      StagingPiece piece;
      piece.op_index = static_cast<uint32_t>(i);
      piece.local_address = o.local_address + done;
      piece.remote_address = o.remote_address + done;
      piece.length = take;
      piece.buffer_offset = current.bytes;
      piece.segment = o.segment;
      current.pieces.push_back(piece);
      current.bytes += take;
      current.piece_bytes += encoded;
      done += take;
    }
  }
  close();
  return chunks;
}

absl::StatusOr<std::vector<size_t>> CheckReadPieces(const std::vector<ReadPiece>& pieces,
                                                    const std::vector<StagedRange>& sorted,
                                                    const ReadRequestLimits& limits,
                                                    const std::string& agent) {
  if (pieces.empty()) {
    return absl::InvalidArgumentError(fmt::format(
        "staged read from agent '{}': the request has no pieces; the requesting agent runs an "
        "incompatible version",
        agent));
  }
  if (pieces.size() > limits.max_pieces) {
    return absl::InvalidArgumentError(fmt::format(
        "staged read from agent '{}': {} pieces in one request, over the limit of {}; the "
        "requesting agent must split it (lower its --staging-chunk-bytes)",
        agent, pieces.size(), limits.max_pieces));
  }
  std::vector<size_t> ranges;
  ranges.reserve(pieces.size());
  uint64_t total = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const uint64_t a = pieces[i].address, n = pieces[i].length;
    auto it = std::upper_bound(sorted.begin(), sorted.end(), a,
                               [](uint64_t x, const StagedRange& r) { return x < r.base; });
    const StagedRange* r = it == sorted.begin() ? nullptr : &*(it - 1);
    if (n == 0 || r == nullptr || a - r->base >= r->length || n > r->length - (a - r->base)) {
      return absl::OutOfRangeError(fmt::format(
          "staged read from agent '{}': piece {} [{:#x}, +{}) is not inside one region "
          "of '{}'{}; the requester's view of its regions is stale (it must refetch them) or "
          "the requester is faulty",
          agent, i, a, n, agent,
          r == nullptr ? "" : fmt::format(" (nearest below: '{}' [{:#x}, +{}))", r->name, r->base,
                                          r->length)));
    }
    total += n;
    if (total > limits.max_bytes) {
      return absl::InvalidArgumentError(fmt::format(
          "staged read from agent '{}': the request asks for more than {} bytes at once; the "
          "requesting agent must split it (lower its --staging-chunk-bytes)",
          agent, limits.max_bytes));
    }
    ranges.push_back(static_cast<size_t>(r - sorted.data()));
  }
  return ranges;
}

std::vector<PieceSlice> SlicePieces(const std::vector<uint64_t>& piece_lengths, uint64_t offset,
                                    uint64_t length) {
  std::vector<PieceSlice> slices;
  if (length == 0) return slices;
  const uint64_t end = offset + length < offset ? std::numeric_limits<uint64_t>::max()
                                                : offset + length;
  uint64_t start = 0;
  for (size_t i = 0; i < piece_lengths.size() && start < end; ++i) {
    const uint64_t piece_end = start + piece_lengths[i];
    const uint64_t from = std::max(start, offset), to = std::min(piece_end, end);
    if (from < to) slices.push_back(PieceSlice{i, from - start, from - offset, to - from});
    start = piece_end;
  }
  return slices;
}

}  // namespace kvagent::planning

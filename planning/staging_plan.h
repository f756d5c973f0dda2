// Staging chunk planner: packs the operations of a batch that moves VRAM through
// host bounce buffers into chunks that each fit one buffer (small operations
// packed together, large ones split). Pure logic; used by agent/staging.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planning/transfer_plan.h"

namespace kvagent::planning {

// One contiguous piece of one operation, placed at `buffer_offset` in a bounce buffer.
struct StagingPiece {
  uint32_t op_index = 0;       // index into the planned operations
  uint64_t local_address = 0;  // the operation's local address + its offset in the op
  uint64_t remote_address = 0;
  uint64_t length = 0;
  uint64_t buffer_offset = 0;
  uint32_t segment = 0;
};

// What fits one bounce buffer; pieces in operation order, packed from offset 0.
struct StagingChunk {
  std::vector<StagingPiece> pieces;
  uint64_t bytes = 0;
  uint64_t piece_bytes = 0;  // the pieces as a header carries them (EncodedPieceBytes)
};

// The bytes one piece takes in a chunk header or read request (a repeated StagedPiece
// of proto/wire.proto: its field tag, its length, and the two varint fields), at most
// kMaxEncodedPieceBytes.
uint64_t EncodedPieceBytes(uint64_t remote_address, uint64_t length);
inline constexpr uint64_t kMaxEncodedPieceBytes = 24;

struct StagingPlanOptions {
  uint64_t chunk_bytes = 4ull << 20;  // one bounce buffer
  uint32_t buffers = 8;               // bounce buffers in the pool (checked, not used)
  // Pieces per chunk, so a chunk's header stays small (the receiver bounds it too).
  uint32_t max_pieces = 1024;
  // When not 0: the pieces of one chunk take at most this many bytes in its header
  // (EncodedPieceBytes), at least kMaxEncodedPieceBytes. The header of an active
  // message must fit one transport buffer (UcxWorker::max_am_header).
  uint64_t max_piece_bytes = 0;
};

// INVALID_ARGUMENT for chunk_bytes, buffers or max_pieces of 0, max_piece_bytes under
// kMaxEncodedPieceBytes (but not 0), a zero-length operation (naming its index and
// segment) or an address range that wraps.
// Every byte of every operation lands in exactly one piece, in order.
absl::StatusOr<std::vector<StagingChunk>> PlanStaging(const std::vector<PlanOp>& ops,
                                                       const StagingPlanOptions& options);

// --- READ of a peer's staged memory (agent/staging serves and receives it) ---

// One piece of a staged read, as it travels: an address in the serving agent's
// memory and a length. Pieces are laid end to end in the reply bytes.
struct ReadPiece {
  uint64_t address = 0;
  uint64_t length = 0;
};

// A registered range of the serving agent (one of its regions), sorted by base and not
// overlapping.
struct StagedRange {
  uint64_t base = 0;
  uint64_t length = 0;
  std::string name;
};

struct ReadRequestLimits {
  uint32_t max_pieces = 65536;
  uint64_t max_bytes = 64ull << 20;
};

// Checks an untrusted read request before any byte is read: at least one piece, at
// most `max_pieces`, at most `max_bytes` in all, every piece non-empty and inside ONE
// of `sorted` (so a peer can never make us read outside our registered regions).
// Returns, per piece, the index of its range; INVALID_ARGUMENT or OUT_OF_RANGE naming
// the piece, `agent` (the serving agent) and the fix otherwise.
absl::StatusOr<std::vector<size_t>> CheckReadPieces(const std::vector<ReadPiece>& pieces,
                                                    const std::vector<StagedRange>& sorted,
                                                    const ReadRequestLimits& limits,
                                                    const std::string& agent);

// Part of one piece that falls in a byte range of pieces laid end to end.
struct PieceSlice {
  size_t piece = 0;
  uint64_t piece_offset = 0;  // from the start of the piece
  uint64_t range_offset = 0;  // from the start of the range
  uint64_t length = 0;
};

// Slices of the pieces (given by their lengths, end to end) that cover
// [offset, offset + length), in order. Empty when the range is empty or lies beyond
// the pieces; bytes beyond the last piece are not covered.
std::vector<PieceSlice> SlicePieces(const std::vector<uint64_t>& piece_lengths, uint64_t offset,
                                    uint64_t length);

}  // namespace kvagent::planning

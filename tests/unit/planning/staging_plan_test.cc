#include "planning/staging_plan.h"

#include <algorithm>
#include <map>
#include <random>
#include <string>

#include "catch2/catch.hpp"
#include "proto/wire.pb.h"

namespace kvagent::planning {
namespace {

PlanOp Op(uint64_t local, uint64_t remote, uint64_t length, uint32_t segment = 0) {
  PlanOp o;
  o.local_address = local;
  o.remote_address = remote;
  o.length = length;
  o.segment = segment;
  return o;
}

StagingPlanOptions Buffers(uint64_t chunk_bytes, uint32_t max_pieces = 1024) {
  StagingPlanOptions options;
  options.chunk_bytes = chunk_bytes;
  options.buffers = 2;
  options.max_pieces = max_pieces;
  return options;
}

// Every chunk fits, pieces are packed from 0 without gaps, and each op byte is
// covered exactly once with matching local/remote addresses, in order.
void CheckCoverage(const std::vector<PlanOp>& ops, const std::vector<StagingChunk>& chunks,
                   const StagingPlanOptions& options) {
  std::vector<std::vector<uint8_t>> covered(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) covered[i].assign(ops[i].length, 0);
  uint32_t last_op = 0;
  uint64_t last_end = 0;
  for (const StagingChunk& chunk : chunks) {
    REQUIRE(chunk.bytes <= options.chunk_bytes);
    REQUIRE(!chunk.pieces.empty());
    REQUIRE(chunk.pieces.size() <= options.max_pieces);
    if (options.max_piece_bytes != 0) REQUIRE(chunk.piece_bytes <= options.max_piece_bytes);
    uint64_t offset = 0;
    for (const StagingPiece& p : chunk.pieces) {
      REQUIRE(p.buffer_offset == offset);
      REQUIRE(p.length > 0);
      offset += p.length;
      REQUIRE(p.op_index < ops.size());
      const PlanOp& o = ops[p.op_index];
      const uint64_t within = p.local_address - o.local_address;
      REQUIRE(p.remote_address - o.remote_address == within);
      REQUIRE(within + p.length <= o.length);
      REQUIRE(p.segment == o.segment);
      // Order preserved: op by op, and inside an op by increasing offset.
      REQUIRE((p.op_index > last_op || (p.op_index == last_op && within == last_end)));
      if (p.op_index > last_op) REQUIRE(within == 0);
      last_op = p.op_index;
      last_end = within + p.length;
      for (uint64_t b = within; b < within + p.length; ++b) ++covered[p.op_index][b];
    }
    REQUIRE(offset == chunk.bytes);
  }
  // One assertion per op (not per byte) keeps the randomized run fast.
  for (size_t i = 0; i < ops.size(); ++i) {
    uint64_t wrong = 0, first_wrong = 0;
    for (uint64_t b = 0; b < ops[i].length; ++b) {
      if (covered[i][b] != 1 && wrong++ == 0) first_wrong = b;
    }
    INFO("op " << i << ": " << wrong << " bytes not covered exactly once, first at " << first_wrong);
    REQUIRE(wrong == 0);
  }
}

TEST_CASE("small operations are packed into one buffer in order") {
  std::vector<PlanOp> ops = {Op(0x1000, 0x9000, 100), Op(0x2000, 0xa000, 200, 1),
                             Op(0x3000, 0xb000, 300, 2)};
  auto chunks = PlanStaging(ops, Buffers(1024));
  REQUIRE(chunks.ok());
  REQUIRE(chunks->size() == 1);
  const auto& pieces = (*chunks)[0].pieces;
  REQUIRE(pieces.size() == 3);
  CHECK(pieces[0].buffer_offset == 0);
  CHECK(pieces[1].buffer_offset == 100);
  CHECK(pieces[2].buffer_offset == 300);
  CHECK(pieces[2].remote_address == 0xb000);
  CHECK((*chunks)[0].bytes == 600);
  CheckCoverage(ops, *chunks, Buffers(1024));
}

TEST_CASE("an operation larger than a buffer is split across chunks") {
  std::vector<PlanOp> ops = {Op(0x10000, 0x80000, 2500)};
  auto chunks = PlanStaging(ops, Buffers(1000));
  REQUIRE(chunks.ok());
  REQUIRE(chunks->size() == 3);
  CHECK((*chunks)[0].pieces[0].local_address == 0x10000);
  CHECK((*chunks)[1].pieces[0].local_address == 0x10000 + 1000);
  CHECK((*chunks)[1].pieces[0].remote_address == 0x80000 + 1000);
  CHECK((*chunks)[2].bytes == 500);
  CheckCoverage(ops, *chunks, Buffers(1000));
}

TEST_CASE("a split operation shares its last chunk with the next operations") {
  std::vector<PlanOp> ops = {Op(0, 0x100000, 1500), Op(0x5000, 0x200000, 300)};
  auto chunks = PlanStaging(ops, Buffers(1000));
  REQUIRE(chunks.ok());
  REQUIRE(chunks->size() == 2);
  REQUIRE((*chunks)[1].pieces.size() == 2);
  CHECK((*chunks)[1].pieces[1].buffer_offset == 500);
  CheckCoverage(ops, *chunks, Buffers(1000));
}

TEST_CASE("operations that exactly fill buffers leave no empty chunk") {
  std::vector<PlanOp> ops = {Op(0, 0x100000, 512), Op(0x1000, 0x200000, 512),
                             Op(0x2000, 0x300000, 1024)};
  auto chunks = PlanStaging(ops, Buffers(1024));
  REQUIRE(chunks.ok());
  REQUIRE(chunks->size() == 2);
  CHECK((*chunks)[0].bytes == 1024);
  CHECK((*chunks)[1].bytes == 1024);
  CHECK((*chunks)[1].pieces.size() == 1);
  CheckCoverage(ops, *chunks, Buffers(1024));
}

TEST_CASE("the pieces per chunk are bounded") {
  std::vector<PlanOp> ops;
  for (uint64_t i = 0; i < 10; ++i) ops.push_back(Op(i * 64, i * 128, 8));
  auto chunks = PlanStaging(ops, Buffers(1 << 20, 4));
  REQUIRE(chunks.ok());
  REQUIRE(chunks->size() == 3);
  CheckCoverage(ops, *chunks, Buffers(1 << 20, 4));
}

TEST_CASE("a piece's header bytes are what protobuf encodes") {
  for (uint64_t address : {uint64_t{0}, uint64_t{1}, uint64_t{127}, uint64_t{128},
                           uint64_t{0x7f12345678ab}, ~uint64_t{0}}) {
    for (uint64_t length : {uint64_t{0}, uint64_t{1}, uint64_t{4096}, uint64_t{4} << 20,
                            ~uint64_t{0}}) {
      wire::StagedChunkHeader header;
      auto* piece = header.add_pieces();
      piece->set_remote_address(address);
      piece->set_length(length);
      INFO(address << " " << length);
      CHECK(EncodedPieceBytes(address, length) == header.ByteSizeLong());
      CHECK(EncodedPieceBytes(address, length) <= kMaxEncodedPieceBytes);
      wire::StagedReadRequest read;
      *read.add_pieces() = *piece;
      CHECK(EncodedPieceBytes(address, length) == read.ByteSizeLong());
    }
  }
}

// UCX aborts a sender whose active-message header does not fit its transport's buffer
// (about 8 KiB): a chunk of many small scattered pages stops where its pieces reach the
// header budget, and never exceeds it.
TEST_CASE("the pieces of one chunk fit a header byte budget") {
  std::vector<PlanOp> ops;
  for (uint64_t i = 0; i < 2000; ++i) {
    ops.push_back(Op(0x7f0000000000 + i * 8192, 0x7e0000000000 + (1999 - i) * 8192, 256));
  }
  StagingPlanOptions options = Buffers(4 << 20);
  options.max_piece_bytes = 8000;
  auto chunks = PlanStaging(ops, options);
  REQUIRE(chunks.ok());
  CheckCoverage(ops, *chunks, options);
  const uint64_t each = EncodedPieceBytes(0x7e0000000000, 256);  // 12 here
  REQUIRE(chunks->size() == (2000 + 8000 / each - 1) / (8000 / each));
  for (const StagingChunk& chunk : *chunks) {
    uint64_t bytes = 0;
    for (const StagingPiece& p : chunk.pieces) bytes += EncodedPieceBytes(p.remote_address, p.length);
    CHECK(bytes == chunk.piece_bytes);
    CHECK(bytes <= 8000);
  }
  options.max_piece_bytes = kMaxEncodedPieceBytes - 1;
  auto refused = PlanStaging(ops, options);
  REQUIRE(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(refused.status().message()).find("header") != std::string::npos);
}

TEST_CASE("no operations plan no chunks") {
  auto chunks = PlanStaging({}, Buffers(1024));
  REQUIRE(chunks.ok());
  CHECK(chunks->empty());
}

TEST_CASE("a zero-length operation is rejected naming it") {
  auto chunks = PlanStaging({Op(0, 0, 10), Op(0x100, 0x100, 0, 7)}, Buffers(1024));
  REQUIRE(chunks.status().code() == absl::StatusCode::kInvalidArgument);
  const std::string message(chunks.status().message());
  CHECK(message.find("operation 1 (segment 7) has length 0") != std::string::npos);
}

TEST_CASE("a buffer size or count of 0 is rejected with the flags to fix it") {
  StagingPlanOptions zero_size = Buffers(0);
  auto a = PlanStaging({Op(0, 0, 10)}, zero_size);
  REQUIRE(a.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(a.status().message()).find("--staging-chunk-bytes") != std::string::npos);
  StagingPlanOptions zero_count = Buffers(1024);
  zero_count.buffers = 0;
  auto b = PlanStaging({Op(0, 0, 10)}, zero_count);
  REQUIRE(b.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(b.status().message()).find("buffers 0") != std::string::npos);
}

TEST_CASE("a range that wraps the address space is rejected") {
  auto chunks = PlanStaging({Op(~uint64_t{0} - 4, 0, 10)}, Buffers(1024));
  REQUIRE(chunks.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(chunks.status().message()).find("wraps") != std::string::npos);
}

TEST_CASE("randomized batches are covered byte by byte") {
  std::mt19937_64 rng(12345);
  for (int round = 0; round < 200; ++round) {
    const uint64_t chunk_bytes = 1 + rng() % 4096;
    const uint32_t max_pieces = 1 + static_cast<uint32_t>(rng() % 16);
    std::vector<PlanOp> ops;
    const int count = static_cast<int>(rng() % 20);
    uint64_t local = 0, remote = 1 << 30;
    for (int i = 0; i < count; ++i) {
      const uint64_t length = 1 + rng() % 9000;
      ops.push_back(Op(local, remote, length, static_cast<uint32_t>(i / 3)));
      local += length + rng() % 100;
      remote += length + rng() % 100;
    }
    StagingPlanOptions options = Buffers(chunk_bytes, max_pieces);
    if (round % 2 == 1) options.max_piece_bytes = kMaxEncodedPieceBytes + rng() % 64;
    auto chunks = PlanStaging(ops, options);
    REQUIRE(chunks.ok());
    CheckCoverage(ops, *chunks, options);
  }
}

}  // namespace
}  // namespace kvagent::planning

// --- READ of a peer's staged memory: the serving agent's checks of untrusted pieces ---
namespace kvagent::planning {
namespace {

const std::vector<StagedRange> kRanges = {{0x10000, 0x1000, "a.L0.K"}, {0x20000, 0x2000, "a.L0.V"}};

TEST_CASE("CheckReadPieces accepts pieces inside one region each and names their ranges") {
  auto checked = CheckReadPieces({{0x10000, 0x1000}, {0x21000, 0x800}, {0x20fff, 1}}, kRanges,
                                 ReadRequestLimits{}, "prefill");
  REQUIRE(checked.ok());
  CHECK(*checked == std::vector<size_t>{0, 1, 1});
}

TEST_CASE("CheckReadPieces refuses a piece outside our regions, naming it and the fix") {
  struct Case {
    ReadPiece piece;
    const char* why;
  };
  for (const Case& c : {Case{{0x0fff0, 0x20}, "starts below the first region"},
                        Case{{0x10ff0, 0x20}, "runs past the end of a region"},
                        Case{{0x11000, 0x10}, "in the gap between regions"},
                        Case{{0x10000, 0x1800}, "longer than its region"},
                        Case{{0x21000, ~0ull}, "length that wraps"},
                        Case{{0x30000, 1}, "above every region"},
                        Case{{0x10000, 0}, "empty"}}) {
    INFO(c.why);
    auto checked = CheckReadPieces({{0x10000, 0x10}, c.piece}, kRanges, ReadRequestLimits{}, "prefill");
    REQUIRE_FALSE(checked.ok());
    CHECK(checked.status().code() == absl::StatusCode::kOutOfRange);
    const std::string message(checked.status().message());
    CHECK_THAT(message, Catch::Contains("piece 1"));
    CHECK_THAT(message, Catch::Contains("not inside one region of 'prefill'"));
    CHECK_THAT(message, Catch::Contains("refetch"));
  }
  // No regions at all (everything deregistered).
  auto none = CheckReadPieces({{0x10000, 1}}, {}, ReadRequestLimits{}, "prefill");
  REQUIRE_FALSE(none.ok());
  CHECK_THAT(std::string(none.status().message()), Catch::Contains("piece 0 [0x10000, +1)"));
}

TEST_CASE("CheckReadPieces bounds the piece count and the bytes of one request") {
  ReadRequestLimits limits;
  limits.max_pieces = 2;
  limits.max_bytes = 0x1000;
  auto many = CheckReadPieces({{0x10000, 1}, {0x10001, 1}, {0x10002, 1}}, kRanges, limits, "p");
  REQUIRE_FALSE(many.ok());
  CHECK(many.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(many.status().message()), Catch::Contains("3 pieces"));
  auto big = CheckReadPieces({{0x10000, 0x1000}, {0x20000, 1}}, kRanges, limits, "p");
  REQUIRE_FALSE(big.ok());
  CHECK_THAT(std::string(big.status().message()), Catch::Contains("more than 4096 bytes"));
  auto empty = CheckReadPieces({}, kRanges, limits, "p");
  REQUIRE_FALSE(empty.ok());
  CHECK_THAT(std::string(empty.status().message()), Catch::Contains("no pieces"));
}

TEST_CASE("SlicePieces maps a byte range of pieces laid end to end onto the pieces") {
  const std::vector<uint64_t> lengths = {10, 5, 20};
  auto all = SlicePieces(lengths, 0, 35);
  REQUIRE(all.size() == 3);
  CHECK(all[1].piece == 1);
  CHECK(all[1].piece_offset == 0);
  CHECK(all[1].range_offset == 10);
  CHECK(all[1].length == 5);
  auto middle = SlicePieces(lengths, 8, 10);  // 2 of piece 0, 5 of piece 1, 3 of piece 2
  REQUIRE(middle.size() == 3);
  CHECK(middle[0].piece_offset == 8);
  CHECK(middle[0].length == 2);
  CHECK(middle[1].range_offset == 2);
  CHECK(middle[2].piece == 2);
  CHECK(middle[2].piece_offset == 0);
  CHECK(middle[2].range_offset == 7);
  CHECK(middle[2].length == 3);
  CHECK(SlicePieces(lengths, 35, 4).empty());
  CHECK(SlicePieces(lengths, 3, 0).empty());
  auto tail = SlicePieces(lengths, 30, ~0ull);  // clipped at the last piece, no wrap
  REQUIRE(tail.size() == 1);
  CHECK(tail[0].length == 5);
  // Every split of the whole range covers each byte exactly once.
  for (uint64_t part = 1; part <= 35; ++part) {
    std::vector<int> covered(35, 0);
    for (uint64_t off = 0; off < 35; off += part) {
      for (const auto& s : SlicePieces(lengths, off, part)) {
        uint64_t start = 0;
        for (size_t i = 0; i < s.piece; ++i) start += lengths[i];
        for (uint64_t b = 0; b < s.length; ++b) ++covered[start + s.piece_offset + b];
        CHECK(s.range_offset + off == start + s.piece_offset);
      }
    }
    CHECK(std::count(covered.begin(), covered.end(), 1) == 35);
  }
}

}  // namespace
}  // namespace kvagent::planning

// Deterministic input mutations for the fuzz targets: byte-level edits of the wire
// format and structured edits of the parsed protobuf message (boundary values, empty
// and oversized strings, added/removed repeated entries). Used by the gcc replay tests
// and, in the libFuzzer build, by LLVMFuzzerCustomMutator (fuzz/libfuzzer_mutator.cc).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "google/protobuf/message.h"

namespace kvagent::fuzz {

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  // One to four edits of `input`; `pool` (other corpus entries) feeds splices.
  // `prototype` is the message type the target parses (structured edits keep the
  // result parseable more often than byte edits do).
  std::string Mutate(const std::string& input, const std::vector<std::string>& pool,
                     const google::protobuf::Message& prototype);
  // One structured edit of `message`; false when it has nothing to edit.
  bool MutateMessage(google::protobuf::Message* message);
  std::string MutateBytes(const std::string& input, const std::vector<std::string>& pool);

  uint64_t Next(uint64_t bound) { return bound == 0 ? 0 : rng_() % bound; }

 private:
  uint64_t InterestingUint64();
  std::string InterestingString(const google::protobuf::Message& root);

  std::mt19937_64 rng_;
};

}  // namespace kvagent::fuzz

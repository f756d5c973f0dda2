// libFuzzer build only: a custom mutator that alternates libFuzzer's byte mutations
// with structured edits of the parsed message (fuzz/mutator.h), so that the fuzzer
// reaches the validation past the protobuf parser (boundary sizes, duplicate names,
// matching group references) within a one-minute CI run.
#include <cstring>
#include <memory>
#include <string>

#include "fuzz/fuzz_target.h"
#include "fuzz/mutator.h"
#include "google/protobuf/stubs/logging.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

// Inputs with invalid UTF-8 in string fields are expected; protobuf would log each.
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  kvagent::fuzz::Mutator mutator(seed);
  if (mutator.Next(2) == 0) return LLVMFuzzerMutate(data, size, max_size);
  std::unique_ptr<google::protobuf::Message> message(kvagent::fuzz::InputPrototype().New());
  if (!message->ParseFromArray(data, static_cast<int>(size))) {
    return LLVMFuzzerMutate(data, size, max_size);
  }
  for (uint64_t edits = 1 + mutator.Next(3); edits > 0; --edits) mutator.MutateMessage(message.get());
  const std::string out = message->SerializeAsString();
  if (out.size() > max_size) return LLVMFuzzerMutate(data, size, max_size);
  std::memcpy(data, out.data(), out.size());
  return out.size();
}

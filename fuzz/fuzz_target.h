// What each fuzz target in fuzz/ defines, so that one replay driver (the gcc cc_test),
// the standalone driver and the libFuzzer custom mutator can run any of them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "google/protobuf/message.h"

namespace kvagent::fuzz {

// The message type the target parses its input into (for structured mutations).
const google::protobuf::Message& InputPrototype();
// The corpus folder name: fuzz/seeds/<name>/ and fuzz/regressions/<name>/.
const char* TargetName();

}  // namespace kvagent::fuzz

// libFuzzer's entry point: never crashes, leaks or hangs on any input, else a bug.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

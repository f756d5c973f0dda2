// The Catch2 main every kvagent test links (//tests/unit:catch_main), plus the skip
// convention: a test that cannot run here (no GPU, no CUDA driver) calls KVAGENT_SKIP
// with its reason and is reported as skipped in JUnit XML, never as passed.
#pragma once

#include <string>

namespace kvagent {
namespace testing {

// Marks the running TEST_CASE as skipped and prints "SKIPPED: <reason>". The caller
// returns right after (KVAGENT_SKIP does). A skipped case with a failed assertion
// still counts as failed.
void Skip(const std::string& reason);

}  // namespace testing
}  // namespace kvagent

#define KVAGENT_SKIP(reason)                 \
  do {                                       \
    ::kvagent::testing::Skip(reason);        \
    return;                                  \
  } while (0)

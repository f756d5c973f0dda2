// The Catch2 main every kvagent test links (//tests/unit:catch_main), plus the skip
// convention: a test that cannot run here (no GPU, no CUDA driver) calls KVAGENT_SKIP
// with its reason and is reported as skipped in JUnit XML, never as passed; and the
// names of sockets a test puts outside $TEST_TMPDIR (UniqueSocketName), and the
// logs a failed case prints (ShowOnFailure).
#pragma once

#include <string>

namespace kvagent {
namespace testing {

// Marks the running TEST_CASE as skipped and prints "SKIPPED: <reason>". The caller
// returns right after (KVAGENT_SKIP does). A skipped case with a failed assertion
// still counts as failed.
void Skip(const std::string& reason);

// "<prefix>.<pid>.<random hex>": a socket name of this test process outside
// $TEST_TMPDIR (which is longer than a Unix socket address holds), a path under /tmp
// or an "@name" in the abstract namespace. The pid alone is not unique: Bazel's
// sandbox gives each test its own PID namespace, so two runs of one test at once
// (--runs_per_test) had the same pid and took each other's socket.
std::string UniqueSocketName(const std::string& prefix);

// Has the running TEST_CASE, should it fail, print the last `lines` lines of the file
// at `path` (an agent's log) under `label` once it ended: a failure in CI then shows
// what the agents said, not only the assertion. The file must outlive the case (a
// folder the case removes takes it along). Forgotten when the next case starts.
void ShowOnFailure(const std::string& path, const std::string& label, int lines = 60);

}  // namespace testing
}  // namespace kvagent

#define KVAGENT_SKIP(reason)                 \
  do {                                       \
    ::kvagent::testing::Skip(reason);        \
    return;                                  \
  } while (0)

// What the engine compares to tell a retried submit from a different one under the same
// transfer id and chunk: a 64-bit hash over every field of a SubmitTransferRequest but
// timeout_ms and wait (a retry may carry another deadline, or wait where the first try
// did not). Read field by field, nothing serialized or copied: ~5x cheaper than hashing
// the request's serialization (BENCHMARKS.md). Unknown fields are not read (they change
// nothing the engine does). Seeded per process (absl::Hash): compare digests only within
// one agent's life. tests/unit/engine:request_digest_test walks the message's
// descriptor, so a field added to the request (or to a message in it) without a line
// here fails that test.
#pragma once

#include <cstdint>

#include "proto/kvagent.pb.h"

namespace kvagent::agent {

uint64_t RequestDigest(const v1::SubmitTransferRequest& request);

}  // namespace kvagent::agent

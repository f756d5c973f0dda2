// PeerSecrets issues each authenticated peer identity a random secret (handed out
// in its GetMetadata reply) and checks it on every UCX message that names that
// identity as sender. UCX active messages carry no authentication of their own:
// without this, any process that learned our worker address could forge a
// notification or a staged chunk. Used by the Peer service and the AM handlers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace kvagent::agent {

class PeerSecrets {
 public:
  static constexpr size_t kSecretBytes = 16;
  static constexpr size_t kMaxIdentities = 65536;

  // The secret for `identity`, the same on every call while this agent runs (empty
  // when kMaxIdentities identities hold one already).
  std::string Issue(const std::string& identity);
  // True when `secret` is the one issued to `identity` (constant-time compare).
  bool Verify(std::string_view identity, std::string_view secret) const;
  size_t size() const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> secrets_ ABSL_GUARDED_BY(mu_);
};

// kSecretBytes random bytes from the kernel (getrandom).
std::string RandomBytes(size_t n);

}  // namespace kvagent::agent

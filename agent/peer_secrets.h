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
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace kvagent::agent {

class PeerSecrets {
 public:
  static constexpr size_t kSecretBytes = 16;
  static constexpr size_t kMaxIdentities = 65536;

  // The secret for `identity`, the same on every call while this agent runs (empty
  // when kMaxIdentities identities hold one already).
  std::string Issue(const std::string& identity);
  // Who proved a peer name: a local session of another uid than this agent's (listed
  // in --peer-uids), one of this agent's own uid (trusted: it could read our memory),
  // the network door's certificate (the CA vouches for the name), the insecure door
  // (anyone, by the operator's choice).
  enum class Holder { kOtherUid, kOwnUid, kCertificate, kInsecure };
  // Binds `identity` to who first proved it. A local session of another uid may use
  // a name only while no one else holds it (else PERMISSION_DENIED naming both): a
  // process of another peer uid cannot name itself an agent that fetched our metadata
  // and so get that agent's secret. A certificate naming it takes it over from such a
  // uid, and its secret is issued anew. `uid` names a local holder in messages.
  absl::Status Claim(const std::string& identity, Holder holder, uint32_t uid);
  // True when `secret` is the one issued to `identity` (constant-time compare).
  bool Verify(std::string_view identity, std::string_view secret) const;
  size_t size() const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> secrets_ ABSL_GUARDED_BY(mu_);
  struct Bound {
    Holder holder;
    uint32_t uid;
  };
  absl::flat_hash_map<std::string, Bound> holders_ ABSL_GUARDED_BY(mu_);
};

// kSecretBytes random bytes from the kernel (getrandom).
std::string RandomBytes(size_t n);

}  // namespace kvagent::agent

#include "agent/peer_secrets.h"

#include <sys/random.h>

#include <cstdlib>

#include "base/text.h"
#include "fmt/format.h"

namespace kvagent::agent {

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t done = 0;
  while (done < n) {
    ssize_t got = getrandom(out.data() + done, n - done, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      std::abort();  // no entropy source: nothing secret can be made
    }
    done += static_cast<size_t>(got);
  }
  return out;
}

std::string PeerSecrets::Issue(const std::string& identity) {
  absl::MutexLock lock(&mu_);
  auto it = secrets_.find(std::string(identity));
  if (it != secrets_.end()) return it->second;
  if (secrets_.size() >= kMaxIdentities) return "";
  std::string secret = RandomBytes(kSecretBytes);
  secrets_.emplace(identity, secret);
  return secret;
}

namespace {
std::string HolderText(PeerSecrets::Holder holder, uint32_t uid) {
  switch (holder) {
    case PeerSecrets::Holder::kOtherUid: return fmt::format("a local session of uid {}", uid);
    case PeerSecrets::Holder::kOwnUid: return fmt::format("a local session of this agent's uid {}", uid);
    case PeerSecrets::Holder::kCertificate: return "a certificate naming it";
    case PeerSecrets::Holder::kInsecure: return "the insecure door";
  }
  return "?";
}
}  // namespace

absl::Status PeerSecrets::Claim(const std::string& identity, Holder holder, uint32_t uid) {
  absl::MutexLock lock(&mu_);
  auto it = holders_.find(identity);
  if (it == holders_.end()) {
    if (holders_.size() >= kMaxIdentities) {
      return absl::ResourceExhaustedError(fmt::format(
          "this agent has bound {} peer names already, its most; peer '{}' is not served",
          holders_.size(), Printable(identity)));
    }
    holders_.emplace(identity, Bound{holder, uid});
    return absl::OkStatus();
  }
  Bound& bound = it->second;
  if (bound.holder == holder && bound.uid == uid) return absl::OkStatus();
  switch (holder) {
    case Holder::kOwnUid:
    case Holder::kInsecure:
      return absl::OkStatus();  // trusted as it is; the name stays with its holder
    case Holder::kCertificate:
      if (bound.holder == Holder::kOtherUid) {
        // The CA vouches for the name: it leaves the uid that claimed it, with a new
        // secret (what that uid was given no longer verifies).
        bound = Bound{holder, uid};
        secrets_.erase(identity);
      }
      return absl::OkStatus();
    case Holder::kOtherUid:
      break;
  }
  return absl::PermissionDeniedError(fmt::format(
      "the peer name '{}' belongs to {} here, not to {}; every agent needs a name of its own "
      "(--name)",
      Printable(identity), HolderText(bound.holder, bound.uid), HolderText(holder, uid)));
}

bool PeerSecrets::Verify(std::string_view identity, std::string_view secret) const {
  std::string expected;
  {
    absl::MutexLock lock(&mu_);
    auto it = secrets_.find(std::string(identity));
    if (it == secrets_.end()) return false;
    expected = it->second;
  }
  if (secret.size() != expected.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    diff |= static_cast<unsigned char>(expected[i] ^ secret[i]);
  }
  return diff == 0;
}

size_t PeerSecrets::size() const {
  absl::MutexLock lock(&mu_);
  return secrets_.size();
}

}  // namespace kvagent::agent

#include "agent/peer_secrets.h"

#include <sys/random.h>

#include <cstdlib>

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

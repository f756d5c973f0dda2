// CertAuthority: a throwaway certificate authority (EC P-256, SHA-256, libcrypto only,
// no `openssl` tool) that issues agent certificates for mutual TLS. Used by
// `kvagentctl demo --tls` and by the TLS tests; not a tool for a real cluster CA.
#pragma once

#include <openssl/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvagent::cli {

// What an agent is given: its --tls-cert, --tls-key and --tls-ca.
struct TlsFilePaths {
  std::string cert;
  std::string key;
  std::string ca;
};

struct IssueOptions {
  // Added to the subjectAltName after DNS:<common name>.
  std::vector<std::string> dns_names;
  std::vector<std::string> ip_addresses;  // "127.0.0.1", "::1"
  // Validity, in seconds from now. A negative not_after_s (with an earlier
  // not_before_s) makes an expired certificate, for tests.
  int64_t not_before_s = -60;
  int64_t not_after_s = 24 * 3600;
};

class CertAuthority {
 public:
  // A new CA named `name` (its common name): writes DIR/NAME-ca.pem and DIR/NAME-ca.key
  // (mode 0600), replacing any there; creates DIR when missing. Valid for a year.
  static absl::StatusOr<CertAuthority> Create(const std::string& dir, const std::string& name);

  // Writes DIR/CN.pem and DIR/CN.key (0600): a leaf for both TLS server and client use
  // (extendedKeyUsage serverAuth, clientAuth) with subjectAltName DNS:CN plus the
  // options' names. `common_name` is also a file name: letters, digits, '.', '_', '-'.
  absl::StatusOr<TlsFilePaths> Issue(const std::string& common_name,
                                     const IssueOptions& options = {}) const;

  const std::string& ca_path() const { return ca_path_; }
  const std::string& ca_key_path() const { return ca_key_path_; }

 private:
  struct X509Free {
    void operator()(X509* x) const;
  };
  struct PkeyFree {
    void operator()(EVP_PKEY* k) const;
  };

  CertAuthority() = default;

  std::string dir_;
  std::string ca_path_;
  std::string ca_key_path_;
  std::unique_ptr<X509, X509Free> cert_;
  std::unique_ptr<EVP_PKEY, PkeyFree> key_;
};

}  // namespace kvagent::cli

// Owning pointers for OpenSSL objects and the text of OpenSSL's last error. Shared by
// agent/tls (checking certificates) and cli/cert_authority (issuing throwaway ones).
#pragma once

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <memory>
#include <string>

namespace kvagent::agent {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;

// The reason of the oldest error on OpenSSL's queue (then cleared), or a note that
// there is none.
inline std::string TakeOpenSslError() {
  unsigned long first = ERR_get_error();
  ERR_clear_error();
  if (first == 0) return "no OpenSSL error recorded";
  if (const char* reason = ERR_reason_error_string(first); reason != nullptr) return reason;
  char buf[256];
  ERR_error_string_n(first, buf, sizeof buf);
  return buf;
}

}  // namespace kvagent::agent

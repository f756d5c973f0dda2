#include "cli/cert_authority.h"

#include <fcntl.h>
#include <openssl/asn1.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/status/status.h"
#include "agent/openssl_util.h"
#include "fmt/format.h"

namespace kvagent::cli {

void CertAuthority::X509Free::operator()(X509* x) const { X509_free(x); }
void CertAuthority::PkeyFree::operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }

namespace {

using agent::BioPtr;
using agent::PkeyPtr;
using agent::TakeOpenSslError;
using agent::X509Ptr;

constexpr int64_t kCaValiditySeconds = 365 * 24 * 3600;
constexpr size_t kMaxNameLength = 253;  // a DNS name's limit

struct GeneralNamesFree {
  void operator()(GENERAL_NAMES* g) const { GENERAL_NAMES_free(g); }
};


absl::Status OpenSslFailure(std::string_view what) {
  return absl::InternalError(fmt::format(
      "cert_authority: {} failed (OpenSSL: {}); fix: check that libcrypto 3 is installed "
      "intact (this throwaway CA needs nothing else)",
      what, TakeOpenSslError()));
}

// Names become file names and DNS names: keep them to what both accept.
absl::Status CheckName(std::string_view what, std::string_view name, bool allow_wildcard) {
  bool ok = !name.empty() && name.size() <= kMaxNameLength && name.front() != '.' &&
            name.front() != '-';
  for (char c : name) {
    bool plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                 c == '.' || c == '-' || c == '_';
    ok = ok && (plain || (allow_wildcard && c == '*'));
  }
  if (ok) return absl::OkStatus();
  std::string shown(name.substr(0, 64));
  for (char& c : shown) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return absl::InvalidArgumentError(fmt::format(
      "cert_authority: {} \"{}\" is not usable: 1 to {} characters of letters, digits, "
      "'.', '_', '-', not starting with '.' or '-'; fix: pick such a name",
      what, shown, kMaxNameLength));
}

// Writes a whole file through a temporary name, so a reader never sees half of it.
absl::Status WriteFile(const std::string& path, const std::string& data, mode_t mode) {
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) {
    int err = errno;
    return absl::FailedPreconditionError(
        fmt::format("cert_authority: cannot create {}: {}; fix: pass a writable directory",
                    tmp, std::strerror(err)));
  }
  absl::Status status;
  if (::fchmod(fd, mode) != 0) {
    status = absl::FailedPreconditionError(fmt::format(
        "cert_authority: cannot set mode {:o} on {}: {}; fix: pass a directory you own", mode,
        tmp, std::strerror(errno)));
  }
  size_t done = 0;
  while (status.ok() && done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      status = absl::FailedPreconditionError(fmt::format(
          "cert_authority: cannot write {}: {}; fix: free space in the directory, or pass "
          "another",
          tmp, std::strerror(errno)));
    } else {
      done += static_cast<size_t>(n);
    }
  }
  if (::close(fd) != 0 && status.ok()) {
    status = absl::FailedPreconditionError(fmt::format(
        "cert_authority: cannot write {}: {}; fix: free space in the directory, or pass "
        "another",
        tmp, std::strerror(errno)));
  }
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = absl::FailedPreconditionError(
        fmt::format("cert_authority: cannot rename {} to {}: {}; fix: pass a writable directory",
                    tmp, path, std::strerror(errno)));
  }
  if (!status.ok()) ::unlink(tmp.c_str());
  return status;
}

absl::StatusOr<std::string> ToPem(X509* cert) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr || PEM_write_bio_X509(bio.get(), cert) != 1) {
    return OpenSslFailure("writing a certificate as PEM");
  }
  char* data = nullptr;
  long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

absl::StatusOr<std::string> ToPem(EVP_PKEY* key) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr ||
      PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return OpenSslFailure("writing a private key as PEM");
  }
  char* data = nullptr;
  long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

absl::StatusOr<PkeyPtr> NewP256Key() {
  PkeyPtr key(EVP_EC_gen("P-256"));
  if (key == nullptr) return OpenSslFailure("generating an EC P-256 key");
  return key;
}

absl::Status AddExtension(X509* cert, X509V3_CTX* ctx, int nid, const char* value) {
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, ctx, nid, value);
  if (ext == nullptr) {
    return OpenSslFailure(fmt::format("building extension {}={}", OBJ_nid2sn(nid), value));
  }
  int added = X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
  if (added != 1) return OpenSslFailure(fmt::format("adding extension {}", OBJ_nid2sn(nid)));
  return absl::OkStatus();
}

// A certificate for `key` named CN=common_name, valid [now+not_before_s, now+not_after_s],
// not yet signed or extended. Issuer: `issuer`, or itself when null.
absl::StatusOr<X509Ptr> NewCertificate(const std::string& common_name, EVP_PKEY* key,
                                       X509* issuer, int64_t not_before_s,
                                       int64_t not_after_s) {
  X509Ptr cert(X509_new());
  if (cert == nullptr || X509_set_version(cert.get(), X509_VERSION_3) != 1) {
    return OpenSslFailure("creating a certificate");
  }
  // A random positive 127-bit serial: no two certificates of a CA share one.
  std::unique_ptr<BIGNUM, decltype(&BN_free)> serial(BN_new(), BN_free);
  if (serial == nullptr || BN_rand(serial.get(), 127, BN_RAND_TOP_ANY, BN_RAND_BOTTOM_ANY) != 1 ||
      BN_to_ASN1_INTEGER(serial.get(), X509_get_serialNumber(cert.get())) == nullptr) {
    return OpenSslFailure("choosing a serial number");
  }
  if (X509_gmtime_adj(X509_getm_notBefore(cert.get()), static_cast<long>(not_before_s)) ==
          nullptr ||
      X509_gmtime_adj(X509_getm_notAfter(cert.get()), static_cast<long>(not_after_s)) ==
          nullptr) {
    return OpenSslFailure("setting the validity dates");
  }
  X509_NAME* subject = X509_get_subject_name(cert.get());
  if (X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_UTF8,
                                 reinterpret_cast<const unsigned char*>(common_name.c_str()),
                                 -1, -1, 0) != 1 ||
      X509_set_issuer_name(cert.get(), issuer != nullptr ? X509_get_subject_name(issuer)
                                                         : subject) != 1 ||
      X509_set_pubkey(cert.get(), key) != 1) {
    return OpenSslFailure("setting the subject, issuer and public key");
  }
  return cert;
}

absl::Status AddSubjectAltNames(X509* cert, const std::vector<std::string>& dns_names,
                                const std::vector<std::string>& ip_addresses) {
  std::unique_ptr<GENERAL_NAMES, GeneralNamesFree> names(sk_GENERAL_NAME_new_null());
  if (names == nullptr) return OpenSslFailure("allocating subjectAltName");
  for (const std::string& dns : dns_names) {
    GENERAL_NAME* gen = GENERAL_NAME_new();
    ASN1_IA5STRING* ia5 = ASN1_IA5STRING_new();
    if (gen == nullptr || ia5 == nullptr ||
        ASN1_STRING_set(ia5, dns.data(), static_cast<int>(dns.size())) != 1) {
      GENERAL_NAME_free(gen);
      ASN1_IA5STRING_free(ia5);
      return OpenSslFailure("building a DNS subjectAltName");
    }
    GENERAL_NAME_set0_value(gen, GEN_DNS, ia5);
    sk_GENERAL_NAME_push(names.get(), gen);
  }
  for (const std::string& ip : ip_addresses) {
    ASN1_OCTET_STRING* octets = a2i_IPADDRESS(ip.c_str());
    if (octets == nullptr) {
      ERR_clear_error();
      std::string shown(ip.substr(0, 64));
      return absl::InvalidArgumentError(fmt::format(
          "cert_authority: \"{}\" is not an IPv4 or IPv6 address; fix: pass addresses such "
          "as 127.0.0.1 or ::1 in ip_addresses, host names in dns_names",
          shown));
    }
    GENERAL_NAME* gen = GENERAL_NAME_new();
    if (gen == nullptr) {
      ASN1_OCTET_STRING_free(octets);
      return OpenSslFailure("building an IP subjectAltName");
    }
    GENERAL_NAME_set0_value(gen, GEN_IPADD, octets);
    sk_GENERAL_NAME_push(names.get(), gen);
  }
  if (X509_add1_ext_i2d(cert, NID_subject_alt_name, names.get(), 0, X509V3_ADD_DEFAULT) != 1) {
    return OpenSslFailure("adding subjectAltName");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CertAuthority> CertAuthority::Create(const std::string& dir,
                                                    const std::string& name) {
  if (absl::Status s = CheckName("CA name", name, false); !s.ok()) return s;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        fmt::format("cert_authority: cannot create directory {}: {}; fix: pass a writable "
                    "directory",
                    dir, ec.message()));
  }
  absl::StatusOr<PkeyPtr> key = NewP256Key();
  if (!key.ok()) return key.status();
  absl::StatusOr<X509Ptr> cert =
      NewCertificate(name, key->get(), nullptr, -60, kCaValiditySeconds);
  if (!cert.ok()) return cert.status();
  X509V3_CTX ctx;
  X509V3_set_ctx(&ctx, cert->get(), cert->get(), nullptr, nullptr, 0);
  for (auto [nid, value] : {std::pair{NID_basic_constraints, "critical,CA:TRUE,pathlen:0"},
                            std::pair{NID_key_usage, "critical,keyCertSign,cRLSign"},
                            std::pair{NID_subject_key_identifier, "hash"}}) {
    if (absl::Status s = AddExtension(cert->get(), &ctx, nid, value); !s.ok()) return s;
  }
  if (X509_sign(cert->get(), key->get(), EVP_sha256()) == 0) {
    return OpenSslFailure("self-signing the CA certificate");
  }

  CertAuthority ca;
  ca.dir_ = dir;
  ca.ca_path_ = (std::filesystem::path(dir) / (name + "-ca.pem")).string();
  ca.ca_key_path_ = (std::filesystem::path(dir) / (name + "-ca.key")).string();
  absl::StatusOr<std::string> key_pem = ToPem(key->get());
  if (!key_pem.ok()) return key_pem.status();
  absl::StatusOr<std::string> cert_pem = ToPem(cert->get());
  if (!cert_pem.ok()) return cert_pem.status();
  if (absl::Status s = WriteFile(ca.ca_key_path_, *key_pem, 0600); !s.ok()) return s;
  if (absl::Status s = WriteFile(ca.ca_path_, *cert_pem, 0644); !s.ok()) return s;
  ca.cert_.reset(cert->release());
  ca.key_.reset(key->release());
  return ca;
}

absl::StatusOr<TlsFilePaths> CertAuthority::Issue(const std::string& common_name,
                                                  const IssueOptions& options) const {
  if (absl::Status s = CheckName("common name", common_name, false); !s.ok()) return s;
  std::vector<std::string> dns_names = {common_name};
  for (const std::string& dns : options.dns_names) {
    if (absl::Status s = CheckName("DNS name", dns, true); !s.ok()) return s;
    bool seen = false;
    for (const std::string& known : dns_names) seen = seen || known == dns;
    if (!seen) dns_names.push_back(dns);
  }
  if (options.not_after_s <= options.not_before_s) {
    return absl::InvalidArgumentError(fmt::format(
        "cert_authority: certificate {} would be valid from now{:+d}s to now{:+d}s, an empty "
        "span; fix: make not_after_s greater than not_before_s",
        common_name, options.not_before_s, options.not_after_s));
  }
  absl::StatusOr<PkeyPtr> key = NewP256Key();
  if (!key.ok()) return key.status();
  absl::StatusOr<X509Ptr> cert = NewCertificate(common_name, key->get(), cert_.get(),
                                                options.not_before_s, options.not_after_s);
  if (!cert.ok()) return cert.status();
  X509V3_CTX ctx;
  X509V3_set_ctx(&ctx, cert_.get(), cert->get(), nullptr, nullptr, 0);
  for (auto [nid, value] : {std::pair{NID_basic_constraints, "critical,CA:FALSE"},
                            std::pair{NID_key_usage, "critical,digitalSignature,keyAgreement"},
                            std::pair{NID_ext_key_usage, "serverAuth,clientAuth"},
                            std::pair{NID_subject_key_identifier, "hash"},
                            std::pair{NID_authority_key_identifier, "keyid:always"}}) {
    if (absl::Status s = AddExtension(cert->get(), &ctx, nid, value); !s.ok()) return s;
  }
  if (absl::Status s = AddSubjectAltNames(cert->get(), dns_names, options.ip_addresses);
      !s.ok()) {
    return s;
  }
  if (X509_sign(cert->get(), key_.get(), EVP_sha256()) == 0) {
    return OpenSslFailure("signing the certificate with the CA key");
  }

  TlsFilePaths paths;
  paths.cert = (std::filesystem::path(dir_) / (common_name + ".pem")).string();
  paths.key = (std::filesystem::path(dir_) / (common_name + ".key")).string();
  paths.ca = ca_path_;
  if (paths.cert == ca_path_ || paths.key == ca_key_path_) {
    return absl::InvalidArgumentError(fmt::format(
        "cert_authority: a certificate named {} would overwrite the CA's own files {}; fix: "
        "pick another common name",
        common_name, ca_path_));
  }
  absl::StatusOr<std::string> key_pem = ToPem(key->get());
  if (!key_pem.ok()) return key_pem.status();
  absl::StatusOr<std::string> cert_pem = ToPem(cert->get());
  if (!cert_pem.ok()) return cert_pem.status();
  if (absl::Status s = WriteFile(paths.key, *key_pem, 0600); !s.ok()) return s;
  if (absl::Status s = WriteFile(paths.cert, *cert_pem, 0644); !s.ok()) return s;
  return paths;
}

}  // namespace kvagent::cli

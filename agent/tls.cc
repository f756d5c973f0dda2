#include "agent/tls.h"

#include <fcntl.h>
#include <openssl/asn1.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <string>
#include <tuple>
#include <utility>

#include "fmt/chrono.h"
#include "agent/openssl_util.h"
#include "fmt/format.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace kvagent::agent {
namespace {

// A PEM certificate, key or CA bundle is a few KiB; anything far larger is the wrong file.
constexpr size_t kMaxPemFileBytes = 1 << 20;

// One command that issues a certificate from the cluster CA (OpenSSL 3.0's `req -CA`).
constexpr std::string_view kIssueCommand =
    "openssl req -x509 -CA CA.pem -CAkey CA.key -newkey ec -pkeyopt "
    "ec_paramgen_curve:P-256 -nodes -keyout NAME.key -out NAME.pem -days 365 -subj /CN=NAME "
    "-addext basicConstraints=critical,CA:FALSE -addext subjectAltName=DNS:NAME "
    "-addext extendedKeyUsage=serverAuth,clientAuth";

struct StoreFree {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct StoreCtxFree {
  void operator()(X509_STORE_CTX* c) const { X509_STORE_CTX_free(c); }
};
struct StackFree {
  // The stack borrows its certificates.
  void operator()(STACK_OF(X509) * s) const { sk_X509_free(s); }
};

std::string Prefix(std::string_view who) {
  return who.empty() ? std::string() : fmt::format("{}: ", who);
}

// The first queued OpenSSL error as text (the queue is emptied): the root cause.

std::string FixFor(std::string_view flag) {
  if (flag == "--tls-key") {
    return "pass the unencrypted PEM private key written together with --tls-cert";
  }
  if (flag == "--tls-ca") {
    return "pass the cluster CA's PEM certificate (the same file on every agent)";
  }
  return fmt::format("pass the PEM certificate the cluster CA issued to this agent, e.g. {}",
                     kIssueCommand);
}

// Reads a file a --tls-* flag names, bounded, with an error naming flag, path, cause, fix.
absl::StatusOr<std::string> ReadFlagFile(std::string_view flag, const std::string& path,
                                         std::string_view who) {
  if (path.empty()) {
    return absl::InvalidArgumentError(fmt::format(
        "{}{} is not set: mutual TLS needs --tls-cert, --tls-key and --tls-ca together; fix: "
        "{}",
        Prefix(who), flag, FixFor(flag)));
  }
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    return absl::InvalidArgumentError(fmt::format("{}{} {}: cannot open: {}; fix: {}",
                                                  Prefix(who), flag, path,
                                                  std::strerror(err), FixFor(flag)));
  }
  std::string data;
  struct stat st {};
  absl::Status status;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    status = absl::InvalidArgumentError(
        fmt::format("{}{} {}: not a regular file; fix: {}", Prefix(who), flag, path,
                    FixFor(flag)));
  } else if (static_cast<size_t>(st.st_size) > kMaxPemFileBytes) {
    status = absl::InvalidArgumentError(fmt::format(
        "{}{} {}: {} bytes, more than the {} a PEM file of this kind can need; fix: {}",
        Prefix(who), flag, path, st.st_size, kMaxPemFileBytes, FixFor(flag)));
  } else {
    data.resize(static_cast<size_t>(st.st_size));
    size_t done = 0;
    while (done < data.size()) {
      ssize_t n = ::read(fd, data.data() + done, data.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        int err = n < 0 ? errno : EIO;
        status = absl::InvalidArgumentError(fmt::format("{}{} {}: cannot read: {}; fix: {}",
                                                        Prefix(who), flag, path,
                                                        std::strerror(err), FixFor(flag)));
        break;
      }
      done += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  if (!status.ok()) return status;
  return data;
}

// Every certificate in a PEM file, in order; an error when there is none or one is bad.
absl::StatusOr<std::vector<X509Ptr>> ParseCertificates(std::string_view flag,
                                                       const std::string& path,
                                                       const std::string& pem,
                                                       std::string_view who) {
  ERR_clear_error();
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  std::vector<X509Ptr> certs;
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    certs.emplace_back(x);
  }
  unsigned long last = ERR_peek_last_error();
  bool clean_end = ERR_GET_LIB(last) == ERR_LIB_PEM && ERR_GET_REASON(last) == PEM_R_NO_START_LINE;
  if (certs.empty() || !clean_end) {
    std::string cause = TakeOpenSslError();
    return absl::InvalidArgumentError(fmt::format(
        "{}{} {}: {} (OpenSSL: {}); fix: {}", Prefix(who), flag, path,
        certs.empty() ? "no readable PEM certificate in it"
                      : "a PEM certificate in it is damaged",
        cause, FixFor(flag)));
  }
  ERR_clear_error();
  return certs;
}

// Fails on a passphrase prompt instead of reading the terminal.
int NoPassphrase(char*, int, int, void*) { return 0; }

std::string NameOf(const X509_NAME* name) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  X509_NAME_print_ex(bio.get(), name, 0, XN_FLAG_RFC2253);
  char* data = nullptr;
  long n = BIO_get_mem_data(bio.get(), &data);
  std::string out(data, n > 0 ? static_cast<size_t>(n) : 0);
  return out.empty() ? "(empty name)" : out;
}

std::string Describe(X509* cert) {
  return fmt::format("subject {}, issuer {}", NameOf(X509_get_subject_name(cert)),
                     NameOf(X509_get_issuer_name(cert)));
}

std::string TimeText(const ASN1_TIME* t) {
  std::tm tm{};
  if (ASN1_TIME_to_tm(t, &tm) != 1) return "(unreadable time)";
  return fmt::format("{:%Y-%m-%d %H:%M:%S} UTC", tm);
}

}  // namespace

bool TlsFiles::empty() const { return cert.empty() && key.empty() && ca.empty(); }

absl::Status CheckTlsFiles(const TlsFiles& files, std::string_view who) {
  const std::string prefix = Prefix(who);
  absl::StatusOr<std::string> cert_pem = ReadFlagFile("--tls-cert", files.cert, who);
  if (!cert_pem.ok()) return cert_pem.status();
  absl::StatusOr<std::string> key_pem = ReadFlagFile("--tls-key", files.key, who);
  if (!key_pem.ok()) return key_pem.status();
  absl::StatusOr<std::string> ca_pem = ReadFlagFile("--tls-ca", files.ca, who);
  if (!ca_pem.ok()) return ca_pem.status();

  auto certs = ParseCertificates("--tls-cert", files.cert, *cert_pem, who);
  if (!certs.ok()) return certs.status();
  auto cas = ParseCertificates("--tls-ca", files.ca, *ca_pem, who);
  if (!cas.ok()) return cas.status();
  X509* leaf = certs->front().get();

  ERR_clear_error();
  BioPtr key_bio(BIO_new_mem_buf(key_pem->data(), static_cast<int>(key_pem->size())));
  PkeyPtr key(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, NoPassphrase, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(fmt::format(
        "{}--tls-key {}: not an unencrypted PEM private key (OpenSSL: {}); fix: {}", prefix,
        files.key, TakeOpenSslError(), FixFor("--tls-key")));
  }
  if (X509_check_private_key(leaf, key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(fmt::format(
        "{}--tls-key {} is not the key of --tls-cert {} ({}); fix: pass the key written "
        "together with that certificate, or issue a new pair from the cluster CA: {}",
        prefix, files.key, files.cert, Describe(leaf), kIssueCommand));
  }

  const ASN1_TIME* not_before = X509_get0_notBefore(leaf);
  const ASN1_TIME* not_after = X509_get0_notAfter(leaf);
  int before_cmp = X509_cmp_current_time(not_before);
  int after_cmp = X509_cmp_current_time(not_after);
  if (before_cmp == 0 || after_cmp == 0) {
    ERR_clear_error();
    return absl::InvalidArgumentError(fmt::format(
        "{}--tls-cert {}: its validity dates cannot be read ({}); fix: issue a new "
        "certificate from the cluster CA: {}",
        prefix, files.cert, Describe(leaf), kIssueCommand));
  }
  if (before_cmp > 0) {
    return absl::FailedPreconditionError(fmt::format(
        "{}--tls-cert {}: not valid yet: valid from {} to {} ({}); fix: check this host's "
        "clock, or issue a certificate valid from now: {}",
        prefix, files.cert, TimeText(not_before), TimeText(not_after), Describe(leaf),
        kIssueCommand));
  }
  if (after_cmp < 0) {
    return absl::FailedPreconditionError(fmt::format(
        "{}--tls-cert {}: expired: valid from {} to {} ({}); fix: issue a new certificate "
        "from the cluster CA: {}",
        prefix, files.cert, TimeText(not_before), TimeText(not_after), Describe(leaf),
        kIssueCommand));
  }

  // The handshake verifies the same way: the CA file's certificates are the only anchors,
  // the rest of --tls-cert may supply intermediates.
  std::unique_ptr<X509_STORE, StoreFree> store(X509_STORE_new());
  for (const X509Ptr& ca : *cas) {
    if (X509_STORE_add_cert(store.get(), ca.get()) != 1) {
      return absl::InvalidArgumentError(
          fmt::format("{}--tls-ca {}: cannot use {} as a trust anchor (OpenSSL: {}); fix: {}",
                      prefix, files.ca, Describe(ca.get()), TakeOpenSslError(),
                      FixFor("--tls-ca")));
    }
  }
  std::unique_ptr<STACK_OF(X509), StackFree> untrusted(sk_X509_new_null());
  for (size_t i = 1; i < certs->size(); ++i) sk_X509_push(untrusted.get(), (*certs)[i].get());
  std::unique_ptr<X509_STORE_CTX, StoreCtxFree> ctx(X509_STORE_CTX_new());
  if (ctx == nullptr || store == nullptr || untrusted == nullptr ||
      X509_STORE_CTX_init(ctx.get(), store.get(), leaf, untrusted.get()) != 1) {
    return absl::ResourceExhaustedError(fmt::format(
        "{}cannot set up certificate verification (OpenSSL: {}); fix: check the host's "
        "memory",
        prefix, TakeOpenSslError()));
  }
  if (X509_verify_cert(ctx.get()) != 1) {
    int err = X509_STORE_CTX_get_error(ctx.get());
    X509* at = X509_STORE_CTX_get_current_cert(ctx.get());
    std::string where = at != nullptr ? Describe(at) : Describe(leaf);
    ERR_clear_error();
    if (err == X509_V_ERR_CERT_HAS_EXPIRED || err == X509_V_ERR_CERT_NOT_YET_VALID) {
      // The leaf passed above, so this is the CA or an intermediate.
      return absl::FailedPreconditionError(fmt::format(
          "{}--tls-cert {} chains to --tls-ca {}, but a certificate on the way is not "
          "valid now: {} ({}); fix: renew the cluster CA (or intermediate) and reissue",
          prefix, files.cert, files.ca, X509_verify_cert_error_string(err), where));
    }
    return absl::InvalidArgumentError(fmt::format(
        "{}--tls-cert {} ({}) does not chain to --tls-ca {} ({}): {}; fix: issue the "
        "certificate from the cluster CA ({}), or pass the CA that issued it as --tls-ca",
        prefix, files.cert, Describe(leaf), files.ca,
        NameOf(X509_get_subject_name(cas->front().get())), X509_verify_cert_error_string(err),
        kIssueCommand));
  }
  return absl::OkStatus();
}

namespace {
// The three files' contents, each read with the checks ReadFlagFile makes.
struct TlsPem {
  std::string cert, key, ca;
};
absl::StatusOr<TlsPem> ReadTlsFiles(const TlsFiles& files) {
  TlsPem pem;
  for (auto [flag, path, out] : {std::tuple{"--tls-cert", &files.cert, &pem.cert},
                                 {"--tls-key", &files.key, &pem.key},
                                 {"--tls-ca", &files.ca, &pem.ca}}) {
    absl::StatusOr<std::string> text = ReadFlagFile(flag, *path, "");
    if (!text.ok()) return text.status();
    *out = *std::move(text);
  }
  return pem;
}
}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files) {
  absl::StatusOr<TlsPem> pem = ReadTlsFiles(files);
  if (!pem.ok()) return pem.status();
  // OpenSSL verifies the client's chain (validity dates included) against the CA alone
  // during the handshake; a client without a certificate is refused there too.
  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = std::move(pem->ca);
  options.pem_key_cert_pairs.push_back({std::move(pem->key), std::move(pem->cert)});
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& files) {
  absl::StatusOr<TlsPem> pem = ReadTlsFiles(files);
  if (!pem.ok()) return pem.status();
  namespace gx = grpc::experimental;
  auto provider = std::make_shared<gx::StaticDataCertificateProvider>(
      pem->ca, std::vector<gx::IdentityKeyCertPair>{{std::move(pem->key), std::move(pem->cert)}});
  gx::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(std::move(provider));
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  // The chain is verified by OpenSSL in the handshake against the CA alone.
  options.set_verify_server_certs(true);
  // No host name checks: without a verifier gRPC installs HostNameCertificateVerifier
  // (the server's SANs must cover the dialed host), and check_call_host compares each
  // call's :authority with the certificate. The no-op verifier only skips the host
  // check; the chain check above stays (tests/unit/tls proves both).
  options.set_certificate_verifier(std::make_shared<gx::NoOpCertificateVerifier>());
  options.set_check_call_host(false);
  std::shared_ptr<grpc::ChannelCredentials> credentials = gx::TlsCredentials(options);
  if (credentials == nullptr) {
    return absl::InternalError(
        "gRPC refused the TLS channel options (TlsCredentials returned null); fix: this "
        "is a kvagent bug, report it with the gRPC version");
  }
  return credentials;
}

std::vector<std::string> PeerIdentities(const grpc::AuthContext& context) {
  std::vector<std::string> names;
  if (!context.IsPeerAuthenticated()) return names;
  auto add = [&names](const grpc::string_ref& value) {
    std::string name(value.data(), value.size());
    if (name.empty()) return;
    for (const std::string& known : names) {
      if (known == name) return;
    }
    names.push_back(std::move(name));
  };
  for (const grpc::string_ref& v : context.FindPropertyValues(GRPC_PEER_DNS_PROPERTY_NAME)) {
    add(v);
  }
  for (const grpc::string_ref& v : context.FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) {
    add(v);
  }
  return names;
}

bool IdentityMatches(const grpc::AuthContext& context, std::string_view name) {
  if (name.empty()) return false;
  for (const std::string& identity : PeerIdentities(context)) {
    if (identity == name) return true;
  }
  return false;
}

}  // namespace kvagent::agent

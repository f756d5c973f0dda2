#include "agent/etcd_client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "agent/openssl_util.h"
#include "base/format.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "base/unique_fd.h"
#include "fmt/format.h"
#include "google/protobuf/util/json_util.h"
#include "proto/directory.pb.h"

namespace kvagent::agent {
namespace {

constexpr size_t kMaxHeaderBytes = 64 << 10;
constexpr int kTickMs = 200;

int64_t NowMs() {
  return absl::ToUnixMillis(absl::Now());
}

absl::StatusOr<UniqueFd> ConnectTo(const EtcdEndpoint& endpoint, absl::Duration timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(endpoint.port);
  if (int rc = getaddrinfo(endpoint.host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(
        fmt::format("{}: cannot resolve '{}': {}", endpoint.text, endpoint.host, gai_strerror(rc)));
  }
  std::string last = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    UniqueFd fd(socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (!fd) continue;
    if (connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last = std::strerror(errno);
      continue;
    }
    pollfd p{fd.get(), POLLOUT, 0};
    if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) != 1) {
      last = fmt::format("no answer within {} ms", absl::ToInt64Milliseconds(timeout));
      continue;
    }
    int error = 0;
    socklen_t len = sizeof(error);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &len);
    if (error != 0) {
      last = std::strerror(error);
      continue;
    }
    freeaddrinfo(found);
    return fd;
  }
  freeaddrinfo(found);
  return absl::UnavailableError(fmt::format("{}: {}", endpoint.text, last));
}

}  // namespace

struct SslFree {
  void operator()(SSL* ssl) const { SSL_free(ssl); }
};

// A non-blocking socket, with a TLS client session over it when `ssl` is set. Read and
// Write move what they can now: > 0 bytes, 0 at the end of the stream, or -1 with
// `wait_for` set to the poll events to wait for (0 when the connection failed, with
// `error` saying why).
class EtcdConnection {
 public:
  EtcdConnection(UniqueFd fd, std::unique_ptr<SSL, SslFree> ssl)
      : fd_(std::move(fd)), ssl_(std::move(ssl)) {}

  int fd() const { return fd_.get(); }

  ssize_t Read(char* buf, size_t size, short* wait_for, std::string* error) {
    if (ssl_ == nullptr) {
      const ssize_t n = read(fd_.get(), buf, size);
      return n >= 0 ? n : Blocked(POLLIN, wait_for, error);
    }
    const int n = SSL_read(ssl_.get(), buf, static_cast<int>(std::min<size_t>(size, INT32_MAX)));
    return n > 0 ? n : TlsBlocked(n, wait_for, error);
  }

  ssize_t Write(const char* data, size_t size, short* wait_for, std::string* error) {
    if (ssl_ == nullptr) {
      const ssize_t n = send(fd_.get(), data, size, MSG_NOSIGNAL);
      return n >= 0 ? n : Blocked(POLLOUT, wait_for, error);
    }
    const int n = SSL_write(ssl_.get(), data, static_cast<int>(std::min<size_t>(size, INT32_MAX)));
    return n > 0 ? n : TlsBlocked(n, wait_for, error);
  }

  // The TLS handshake, within `timeout`; UNAVAILABLE naming the endpoint, the cause
  // and the fix.
  absl::Status Handshake(const EtcdEndpoint& endpoint, absl::Duration timeout) {
    const int64_t until = NowMs() + absl::ToInt64Milliseconds(timeout);
    while (true) {
      const int rc = SSL_connect(ssl_.get());
      if (rc == 1) return absl::OkStatus();
      short wait_for = 0;
      std::string error;
      const ssize_t blocked = TlsBlocked(rc, &wait_for, &error);
      if (blocked == 0) error = "etcd closed the connection during the handshake";
      if (blocked == -1 && wait_for != 0) {
        const int64_t left = until - NowMs();
        pollfd p{fd_.get(), wait_for, 0};
        if (left > 0 && poll(&p, 1, static_cast<int>(left)) >= 0) continue;
        error = fmt::format("no handshake within {} ms", absl::ToInt64Milliseconds(timeout));
      }
      const long verify = SSL_get_verify_result(ssl_.get());
      if (verify != X509_V_OK) {
        return absl::UnavailableError(fmt::format(
            "{}: TLS: etcd's certificate was not accepted ({}); give --directory-ca the CA "
            "that signed it, and check that it names '{}' in its subjectAltName",
            endpoint.text, X509_verify_cert_error_string(verify), endpoint.host));
      }
      return absl::UnavailableError(fmt::format(
          "{}: TLS handshake failed ({}); check that etcd serves TLS on this port (https:// "
          "in its --listen-client-urls; plain HTTP needs etcd://) and, if it asks for client "
          "certificates (--client-cert-auth), give --directory-cert and --directory-key",
          endpoint.text, error));
    }
  }

 private:
  static ssize_t Blocked(short events, short* wait_for, std::string* error) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      *wait_for = events;
    } else {
      *wait_for = 0;
      *error = std::strerror(errno);
    }
    return -1;
  }

  ssize_t TlsBlocked(int rc, short* wait_for, std::string* error) {
    const int kind = SSL_get_error(ssl_.get(), rc);
    *wait_for = 0;
    switch (kind) {
      case SSL_ERROR_WANT_READ:
        *wait_for = POLLIN;
        return -1;
      case SSL_ERROR_WANT_WRITE:
        *wait_for = POLLOUT;
        return -1;
      case SSL_ERROR_ZERO_RETURN:
        return 0;
      case SSL_ERROR_SYSCALL:
        if (errno == 0) return 0;  // the peer closed without close_notify
        *error = std::strerror(errno);
        ERR_clear_error();
        return -1;
      default:
        *error = TakeOpenSslError();
        // Under TLS 1.3 a server that refuses the client's certificate (or its lack)
        // says so with an alert after the client's handshake has completed.
        if (absl::StrContains(*error, "alert")) {
          *error += ": etcd refused this TLS session; if it asks for client certificates "
                    "(--client-cert-auth), give --directory-cert and --directory-key issued "
                    "by its --trusted-ca-file";
        }
        return -1;
    }
  }

  UniqueFd fd_;
  std::unique_ptr<SSL, SslFree> ssl_;
};

namespace {

// Reads from a connection with a deadline (unary) or a stop flag (streams).
class Reader {
 public:
  Reader(EtcdConnection& conn, int64_t deadline_ms, const std::atomic<bool>* stop)
      : conn_(conn), deadline_ms_(deadline_ms), stop_(stop) {}

  // Appends what arrives to buf_; false at EOF. Errors: timeout, stop, socket error.
  absl::StatusOr<bool> Fill() {
    char chunk[16384];
    while (true) {
      if (stop_ != nullptr && stop_->load()) return absl::CancelledError("stopped");
      short wait_for = 0;
      std::string error;
      const ssize_t n = conn_.Read(chunk, sizeof(chunk), &wait_for, &error);
      if (n > 0) {
        buf_.append(chunk, static_cast<size_t>(n));
        return true;
      }
      if (n == 0) return false;
      if (wait_for == 0) return absl::UnavailableError(fmt::format("reading: {}", error));
      int wait = kTickMs;
      if (deadline_ms_ > 0) {
        const int64_t left = deadline_ms_ - NowMs();
        if (left <= 0) return absl::DeadlineExceededError("no complete answer in time");
        wait = static_cast<int>(std::min<int64_t>(left, kTickMs));
      }
      pollfd p{conn_.fd(), wait_for, 0};
      (void)poll(&p, 1, wait);
    }
  }

  std::string& buf() { return buf_; }

 private:
  EtcdConnection& conn_;
  int64_t deadline_ms_;
  const std::atomic<bool>* stop_;
  std::string buf_;
};

absl::Status WriteAll(EtcdConnection& conn, std::string_view data, absl::Duration timeout) {
  const int64_t until = NowMs() + absl::ToInt64Milliseconds(timeout);
  while (!data.empty()) {
    short wait_for = 0;
    std::string error;
    const ssize_t n = conn.Write(data.data(), data.size(), &wait_for, &error);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (wait_for == 0) {
      return absl::UnavailableError(
          fmt::format("writing: {}", n == 0 ? "the connection closed" : error));
    }
    pollfd p{conn.fd(), wait_for, 0};
    const int64_t left = until - NowMs();
    if (left <= 0 || poll(&p, 1, static_cast<int>(left)) == 0) {
      return absl::DeadlineExceededError("the request could not be sent in time");
    }
  }
  return absl::OkStatus();
}

struct Head {
  int status = 0;
  bool chunked = false;
  int64_t length = -1;
};

// Reads the status line and headers; leaves what follows in the reader's buffer.
absl::StatusOr<Head> ReadHead(Reader& reader) {
  size_t end;
  while ((end = reader.buf().find("\r\n\r\n")) == std::string::npos) {
    if (reader.buf().size() > kMaxHeaderBytes) {
      return absl::InvalidArgumentError("the answer's headers exceed 64 KiB");
    }
    ASSIGN_OR_RETURN(bool more, reader.Fill());
    if (!more && reader.buf().empty()) {
      return absl::UnavailableError(
          "the connection closed with no answer (an etcd serving TLS does that to plain "
          "HTTP: if so, use etcds://)");
    }
    if (!more) return absl::UnavailableError("the connection closed before the headers ended");
  }
  Head head;
  std::vector<std::string> lines = absl::StrSplit(reader.buf().substr(0, end), "\r\n");
  reader.buf().erase(0, end + 4);
  std::vector<std::string> first = absl::StrSplit(lines[0], absl::MaxSplits(' ', 2));
  if (first.size() < 2 || !absl::StartsWith(first[0], "HTTP/1.") ||
      !absl::SimpleAtoi(first[1], &head.status)) {
    return absl::InvalidArgumentError(
        fmt::format("not an HTTP answer: '{}'", Printable(lines[0], 80)));
  }
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == std::string::npos) continue;
    const std::string name = absl::AsciiStrToLower(lines[i].substr(0, colon));
    const std::string value(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)));
    if (name == "transfer-encoding" && absl::AsciiStrToLower(value) == "chunked") head.chunked = true;
    if (name == "content-length" && !absl::SimpleAtoi(value, &head.length)) {
      return absl::InvalidArgumentError("a bad Content-Length");
    }
  }
  return head;
}

// Calls `data` with each piece of the body as it arrives (chunked or not) until the
// body ends (OK), `data` returns false (OK) or the reader fails.
absl::Status ReadBody(Reader& reader, const Head& head,
                      const std::function<bool(std::string_view)>& data) {
  if (!head.chunked) {
    uint64_t seen = 0;
    while (true) {
      if (!reader.buf().empty()) {
        seen += reader.buf().size();
        if (!data(reader.buf())) return absl::OkStatus();
        reader.buf().clear();
      }
      if (head.length >= 0 && seen >= static_cast<uint64_t>(head.length)) return absl::OkStatus();
      ASSIGN_OR_RETURN(bool more, reader.Fill());
      if (!more) {
        if (head.length < 0) return absl::OkStatus();
        return absl::UnavailableError("the connection closed inside the answer");
      }
    }
  }
  while (true) {
    size_t eol;
    while ((eol = reader.buf().find("\r\n")) == std::string::npos) {
      if (reader.buf().size() > 64) return absl::InvalidArgumentError("a bad chunk header");
      ASSIGN_OR_RETURN(bool more, reader.Fill());
      if (!more) return absl::UnavailableError("the stream closed");
    }
    uint64_t size = 0;
    const std::string hex = reader.buf().substr(0, reader.buf().find_first_of(";\r"));
    if (hex.empty() || hex.size() > 15 || !absl::SimpleHexAtoi(hex, &size)) {
      return absl::InvalidArgumentError("a bad chunk size");
    }
    if (size > EtcdClient::kMaxStreamMessageBytes) {
      return absl::ResourceExhaustedError(fmt::format("a chunk of {} bytes is over the bound", size));
    }
    reader.buf().erase(0, eol + 2);
    if (size == 0) return absl::OkStatus();
    while (reader.buf().size() < size + 2) {
      ASSIGN_OR_RETURN(bool more, reader.Fill());
      if (!more) return absl::UnavailableError("the stream closed inside a chunk");
    }
    if (!data(std::string_view(reader.buf()).substr(0, size))) return absl::OkStatus();
    reader.buf().erase(0, size + 2);
  }
}

std::string Request(const EtcdEndpoint& endpoint, std::string_view path, const std::string& body) {
  return fmt::format(
      "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n"
      "Content-Length: {}\r\nConnection: close\r\n\r\n{}",
      path, endpoint.text, body.size(), body);
}

absl::Status GatewayError(int http_status, std::string_view body) {
  directory::EtcdGatewayError error;
  std::string message;
  if (ParseEtcdJson(body, &error).ok() && (!error.message().empty() || !error.error().empty())) {
    message = !error.message().empty() ? error.message() : error.error();
  } else {
    message = Printable(body, 200);
  }
  const auto code = error.code() > 0 && error.code() < 17 ? static_cast<absl::StatusCode>(error.code())
                                                          : absl::StatusCode::kUnavailable;
  // Go's TLS server answers plain HTTP with this text.
  const std::string hint = absl::StrContains(message, "HTTPS server")
                               ? "; this etcd serves TLS: use etcds:// (with --directory-ca)"
                               : "";
  return absl::Status(code, fmt::format("etcd answered HTTP {}: {}{}", http_status,
                                        Printable(message, 300), hint));
}

}  // namespace

absl::StatusOr<std::vector<EtcdEndpoint>> ParseEtcdUrl(std::string_view url) {
  auto bad = [&](std::string_view why) {
    return absl::InvalidArgumentError(fmt::format(
        "--directory '{}': {}; give etcd://HOST:PORT[,HOST:PORT...] (etcd's client URLs, "
        "e.g. etcd://127.0.0.1:2379), or etcds://... where etcd serves TLS",
        Printable(url, 200), why));
  };
  const absl::string_view whole(url.data(), url.size());
  const bool tls = absl::StartsWith(whole, "etcds://");
  if (!tls && !absl::StartsWith(whole, "etcd://")) {
    return bad("it does not start with etcd:// or etcds://");
  }
  const absl::string_view kScheme = tls ? "etcds://" : "etcd://";
  std::vector<EtcdEndpoint> out;
  for (absl::string_view part : absl::StrSplit(
           absl::string_view(url.data() + kScheme.size(), url.size() - kScheme.size()), ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (absl::EndsWith(part, "/")) part.remove_suffix(1);
    const size_t colon = part.rfind(':');
    if (part.empty() || colon == absl::string_view::npos || colon == 0) {
      return bad(fmt::format("'{}' is not HOST:PORT", Printable(std::string(part), 100)));
    }
    EtcdEndpoint e;
    e.host = std::string(part.substr(0, colon));
    if (e.host.size() > 2 && e.host.front() == '[' && e.host.back() == ']') {
      e.host = e.host.substr(1, e.host.size() - 2);
    }
    uint32_t port = 0;
    if (!absl::SimpleAtoi(part.substr(colon + 1), &port) || port == 0 || port > 65535) {
      return bad(fmt::format("'{}' has no valid port", Printable(std::string(part), 100)));
    }
    e.port = static_cast<uint16_t>(port);
    e.text = std::string(part);
    e.tls = tls;
    out.push_back(std::move(e));
  }
  if (out.size() > 16) return bad("more than 16 endpoints");
  return out;
}

std::string EtcdJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

absl::Status ParseEtcdJson(std::string_view json, google::protobuf::Message* message) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), message, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(fmt::format("etcd's answer is not the JSON expected ({}): {}",
                                                  status.message().as_string(), Printable(json, 200)));
  }
  return absl::OkStatus();
}

void SslCtxFree::operator()(SSL_CTX* ctx) const { SSL_CTX_free(ctx); }

absl::StatusOr<EtcdTlsContext> MakeEtcdTlsContext(const EtcdTlsFiles& files) {
  auto unreadable = [](std::string_view flag, const std::string& path) -> absl::Status {
    if (access(path.c_str(), R_OK) == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(fmt::format(
        "{} '{}': cannot read it ({}); give a PEM file the agent's user can read", flag,
        Printable(path, 200), std::strerror(errno)));
  };
  if (files.cert_file.empty() != files.key_file.empty()) {
    return absl::InvalidArgumentError(fmt::format(
        "{} is given without {}: a client certificate for etcd needs both, give "
        "--directory-cert and --directory-key together (or neither when etcd does not ask "
        "for client certificates)",
        files.cert_file.empty() ? "--directory-key" : "--directory-cert",
        files.cert_file.empty() ? "--directory-cert" : "--directory-key"));
  }
  EtcdTlsContext ctx(SSL_CTX_new(TLS_client_method()), SslCtxFree());
  if (ctx == nullptr) {
    return absl::InternalError(fmt::format("TLS for etcd: {}", TakeOpenSslError()));
  }
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  // etcd (Go) may close after its answer without close_notify; Connection: close
  // already bounds every answer, so that is an end of stream, not an error.
  SSL_CTX_set_options(ctx.get(), SSL_OP_IGNORE_UNEXPECTED_EOF);
  if (files.ca_file.empty()) {
    if (SSL_CTX_set_default_verify_paths(ctx.get()) != 1) {
      return absl::InvalidArgumentError(fmt::format(
          "etcds://: the system's trust store cannot be loaded ({}); give --directory-ca",
          TakeOpenSslError()));
    }
  } else {
    RETURN_IF_ERROR(unreadable("--directory-ca", files.ca_file));
    if (SSL_CTX_load_verify_locations(ctx.get(), files.ca_file.c_str(), nullptr) != 1) {
      return absl::InvalidArgumentError(fmt::format(
          "--directory-ca '{}': not a PEM CA certificate ({}); give the CA that signed "
          "etcd's certificate, as PEM",
          Printable(files.ca_file, 200), TakeOpenSslError()));
    }
  }
  if (!files.cert_file.empty()) {
    RETURN_IF_ERROR(unreadable("--directory-cert", files.cert_file));
    RETURN_IF_ERROR(unreadable("--directory-key", files.key_file));
    if (SSL_CTX_use_certificate_chain_file(ctx.get(), files.cert_file.c_str()) != 1) {
      return absl::InvalidArgumentError(fmt::format(
          "--directory-cert '{}': not a PEM certificate ({}); give the client certificate "
          "etcd's CA issued for this agent",
          Printable(files.cert_file, 200), TakeOpenSslError()));
    }
    if (SSL_CTX_use_PrivateKey_file(ctx.get(), files.key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(ctx.get()) != 1) {
      return absl::InvalidArgumentError(fmt::format(
          "--directory-key '{}': not the PEM private key of --directory-cert '{}' ({}); give "
          "the key that belongs to that certificate",
          Printable(files.key_file, 200), Printable(files.cert_file, 200), TakeOpenSslError()));
    }
  }
  return ctx;
}

EtcdClient::EtcdClient(std::vector<EtcdEndpoint> endpoints, absl::Duration timeout,
                       EtcdTlsContext tls)
    : endpoints_(std::move(endpoints)), timeout_(timeout), tls_(std::move(tls)) {}

std::string EtcdClient::EndpointsText() const {
  std::vector<std::string> texts;
  for (const auto& e : endpoints_) texts.push_back(e.text);
  return absl::StrJoin(texts, ",");
}

std::string EtcdClient::CurrentEndpoint() const {
  absl::MutexLock lock(&mu_);
  return endpoints_.empty() ? "" : endpoints_[current_].text;
}

absl::Status EtcdClient::OnSomeEndpoint(
    const std::function<absl::Status(EtcdConnection&, const EtcdEndpoint&)>& exchange) {
  size_t start;
  {
    absl::MutexLock lock(&mu_);
    start = current_;
  }
  std::vector<std::string> failures;
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    const size_t index = (start + i) % endpoints_.size();
    const EtcdEndpoint& endpoint = endpoints_[index];
    auto conn = Connect(endpoint);
    if (!conn.ok()) {
      failures.push_back(std::string(conn.status().message()));
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      current_ = index;
    }
    absl::Status done = exchange(**conn, endpoint);
    // A member that accepted the connection but could not answer (no leader, cut off
    // from the cluster) is worth skipping too; an answer with an error is final.
    if (absl::IsUnavailable(done) || absl::IsDeadlineExceeded(done)) {
      failures.push_back(fmt::format("{}: {}", endpoint.text, done.message()));
      continue;
    }
    return done;
  }
  return absl::UnavailableError(fmt::format("no etcd endpoint answered ({})",
                                            absl::StrJoin(failures, "; ")));
}

absl::StatusOr<std::unique_ptr<EtcdConnection>> EtcdClient::Connect(const EtcdEndpoint& endpoint) {
  ASSIGN_OR_RETURN(UniqueFd fd, ConnectTo(endpoint, timeout_));
  if (!endpoint.tls) return std::make_unique<EtcdConnection>(std::move(fd), nullptr);
  if (tls_ == nullptr) {
    return absl::FailedPreconditionError(
        fmt::format("{}: etcds:// without a TLS context (a bug: report it)", endpoint.text));
  }
  std::unique_ptr<SSL, SslFree> ssl(SSL_new(tls_.get()));
  if (ssl == nullptr || SSL_set_fd(ssl.get(), fd.get()) != 1) {
    return absl::InternalError(fmt::format("{}: TLS: {}", endpoint.text, TakeOpenSslError()));
  }
  unsigned char ip[16];
  const bool is_ip = inet_pton(AF_INET, endpoint.host.c_str(), ip) == 1 ||
                     inet_pton(AF_INET6, endpoint.host.c_str(), ip) == 1;
  const int named = is_ip ? X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl.get()),
                                                          endpoint.host.c_str())
                          : SSL_set1_host(ssl.get(), endpoint.host.c_str());
  if (named != 1 ||
      (!is_ip && SSL_set_tlsext_host_name(ssl.get(), endpoint.host.c_str()) != 1)) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: TLS: cannot check certificates against host '{}' ({})", endpoint.text,
        Printable(endpoint.host, 100), TakeOpenSslError()));
  }
  auto conn = std::make_unique<EtcdConnection>(std::move(fd), std::move(ssl));
  RETURN_IF_ERROR(conn->Handshake(endpoint, timeout_));
  return conn;
}

absl::Status EtcdClient::Call(std::string_view path, const google::protobuf::Message& request,
                              google::protobuf::Message* response) {
  const std::string body = EtcdJson(request);
  return OnSomeEndpoint([&](EtcdConnection& conn, const EtcdEndpoint& endpoint) -> absl::Status {
    RETURN_IF_ERROR(WriteAll(conn, Request(endpoint, path, body), timeout_));
    Reader reader(conn, NowMs() + absl::ToInt64Milliseconds(timeout_), nullptr);
    ASSIGN_OR_RETURN(Head head, ReadHead(reader));
    std::string answer;
    absl::Status read = ReadBody(reader, head, [&](std::string_view piece) {
      answer.append(piece);
      return answer.size() <= kMaxBodyBytes;
    });
    RETURN_IF_ERROR(read);
    if (answer.size() > kMaxBodyBytes) {
      return absl::ResourceExhaustedError(fmt::format("etcd's answer to {} exceeds {} bytes", path,
                                                      kMaxBodyBytes));
    }
    if (head.status != 200) return GatewayError(head.status, answer);
    return ParseEtcdJson(answer, response);
  });
}

absl::Status EtcdClient::Stream(std::string_view path, const google::protobuf::Message& request,
                                const std::function<bool(std::string_view)>& on_message,
                                const std::atomic<bool>& stop) {
  const std::string body = EtcdJson(request);
  return OnSomeEndpoint([&](EtcdConnection& conn, const EtcdEndpoint& endpoint) -> absl::Status {
    RETURN_IF_ERROR(WriteAll(conn, Request(endpoint, path, body), timeout_));
    Reader reader(conn, NowMs() + absl::ToInt64Milliseconds(timeout_), &stop);
    ASSIGN_OR_RETURN(Head head, ReadHead(reader));
    if (head.status != 200) {
      std::string answer;
      (void)ReadBody(reader, head, [&](std::string_view piece) {
        answer.append(piece);
        return answer.size() <= kMaxBodyBytes;
      });
      return GatewayError(head.status, answer);
    }
    // From here on the stream may stay quiet for as long as nothing changes.
    Reader streaming(conn, 0, &stop);
    streaming.buf() = std::move(reader.buf());
    std::string pending;  // the gateway ends each message with a newline
    bool go_on = true;
    absl::Status read = ReadBody(streaming, head, [&](std::string_view piece) {
      pending.append(piece);
      size_t eol;
      while (go_on && (eol = pending.find('\n')) != std::string::npos) {
        std::string_view message = std::string_view(pending).substr(0, eol);
        if (!absl::StripAsciiWhitespace(absl::string_view(message.data(), message.size())).empty()) {
          go_on = on_message(message);
        }
        pending.erase(0, eol + 1);
      }
      return go_on && pending.size() <= kMaxStreamMessageBytes;
    });
    if (absl::IsCancelled(read) || !go_on) return absl::OkStatus();
    RETURN_IF_ERROR(read);
    if (pending.size() > kMaxStreamMessageBytes) {
      return absl::ResourceExhaustedError("a streamed etcd message exceeds 4 MiB");
    }
    return absl::UnavailableError(fmt::format("{}: the stream ended", endpoint.text));
  });
}

}  // namespace kvagent::agent

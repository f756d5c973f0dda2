// EtcdClient speaks etcd v3's JSON gateway (POST /v3/<service>/<method> with the
// grpc-gateway JSON of etcd's messages) over plain HTTP/1.1 on loopback or the cluster
// network: unary calls (range, put, lease grant/keepalive/revoke) and the watch stream.
// Why the gateway and not etcd's gRPC: its .proto files are not in Debian, and the
// JSON mapping is etcd's documented, stable wire; the shapes used are in
// proto/directory.proto. Every answer is bounded (kMaxBodyBytes, kMaxStreamMessageBytes).
// Endpoints are tried in order, starting from the last one that answered, so losing
// one member of a cluster costs one connect timeout.
//
// TLS (`etcds://`): each connection is a TLS 1.2+ client over the same non-blocking
// socket; etcd's certificate must chain to the CA file given (or the system's trust
// store) and name the endpoint's host (DNS name or IP address in its subjectAltName);
// a client certificate is presented when given, for an etcd with --client-cert-auth.
#pragma once

#include <openssl/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "google/protobuf/message.h"

namespace kvagent::agent {

struct EtcdEndpoint {
  std::string host;
  uint16_t port = 0;
  std::string text;  // "host:port"
  bool tls = false;  // etcds://
};

// Parses "etcd://HOST:PORT[,HOST:PORT...]" or "etcds://..." (TLS; IPv6 hosts in
// brackets); names the flag and the expected form when it is wrong.
absl::StatusOr<std::vector<EtcdEndpoint>> ParseEtcdUrl(std::string_view url);

// The files of `--directory-ca`, `--directory-cert` and `--directory-key`.
struct EtcdTlsFiles {
  std::string ca_file;    // PEM CA(s) that signed etcd's certificate; empty: the system's
  std::string cert_file;  // PEM client certificate (chain), with key_file, or neither
  std::string key_file;
  bool any() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};

struct SslCtxFree {
  void operator()(SSL_CTX* ctx) const;
};
using EtcdTlsContext = std::shared_ptr<SSL_CTX>;

// A TLS client context from `files`: every file is loaded and checked now (the key
// must match the certificate), so a bad one stops the agent at start, naming the
// flag, the file, the cause and the fix.
absl::StatusOr<EtcdTlsContext> MakeEtcdTlsContext(const EtcdTlsFiles& files);

// One connection to an endpoint: a socket, with TLS over it for etcds://.
class EtcdConnection;

class EtcdClient {
 public:
  static constexpr uint64_t kMaxBodyBytes = 16ull << 20;
  static constexpr uint64_t kMaxStreamMessageBytes = 4ull << 20;

  // `tls` is required when the endpoints are etcds:// and ignored otherwise.
  EtcdClient(std::vector<EtcdEndpoint> endpoints, absl::Duration timeout,
             EtcdTlsContext tls = nullptr);

  // POSTs `request` as JSON to `path` and parses the 200 answer into `response`
  // (unknown fields ignored). UNAVAILABLE naming every endpoint tried when none
  // answered; the gateway's own error (code and message) otherwise.
  absl::Status Call(std::string_view path, const google::protobuf::Message& request,
                    google::protobuf::Message* response);
  // Opens a streamed POST and calls `on_message` with each JSON message as it arrives,
  // until it returns false, the stream ends (UNAVAILABLE), or `stop` turns true
  // (checked at least every 200 ms; returns OK).
  absl::Status Stream(std::string_view path, const google::protobuf::Message& request,
                      const std::function<bool(std::string_view)>& on_message,
                      const std::atomic<bool>& stop);

  // "host:port,host:port".
  std::string EndpointsText() const;
  // The endpoint that answered last.
  std::string CurrentEndpoint() const;

 private:
  struct Answer {
    int status = 0;
    std::string body;
  };
  // Runs `exchange` on a connection (TLS set up when the endpoint is etcds://) to each
  // endpoint in turn (from the current one) until one connects.
  absl::Status OnSomeEndpoint(
      const std::function<absl::Status(EtcdConnection&, const EtcdEndpoint&)>& exchange);

  // A connected socket, with TLS set up and checked for etcds://.
  absl::StatusOr<std::unique_ptr<EtcdConnection>> Connect(const EtcdEndpoint& endpoint);

  std::vector<EtcdEndpoint> endpoints_;
  absl::Duration timeout_;
  EtcdTlsContext tls_;
  mutable absl::Mutex mu_;
  size_t current_ ABSL_GUARDED_BY(mu_) = 0;
};

// JSON of `message` as the gateway wants it (proto field names, bytes as base64).
std::string EtcdJson(const google::protobuf::Message& message);
// Parses the gateway's JSON into `message`, ignoring fields it does not know.
absl::Status ParseEtcdJson(std::string_view json, google::protobuf::Message* message);

}  // namespace kvagent::agent

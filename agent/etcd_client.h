// EtcdClient speaks etcd v3's JSON gateway (POST /v3/<service>/<method> with the
// grpc-gateway JSON of etcd's messages) over plain HTTP/1.1 on loopback or the cluster
// network: unary calls (range, put, lease grant/keepalive/revoke) and the watch stream.
// Why the gateway and not etcd's gRPC: its .proto files are not in Debian, and the
// JSON mapping is etcd's documented, stable wire; the shapes used are in
// proto/directory.proto. Every answer is bounded (kMaxBodyBytes, kMaxStreamMessageBytes).
// Endpoints are tried in order, starting from the last one that answered, so losing
// one member of a cluster costs one connect timeout.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
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
};

// Parses "etcd://HOST:PORT[,HOST:PORT...]" (IPv6 hosts in brackets); names the flag
// and the expected form when it is wrong.
absl::StatusOr<std::vector<EtcdEndpoint>> ParseEtcdUrl(std::string_view url);

class EtcdClient {
 public:
  static constexpr uint64_t kMaxBodyBytes = 16ull << 20;
  static constexpr uint64_t kMaxStreamMessageBytes = 4ull << 20;

  EtcdClient(std::vector<EtcdEndpoint> endpoints, absl::Duration timeout);

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
  // Runs `exchange` on a connection to each endpoint in turn (from the current one)
  // until one connects.
  absl::Status OnSomeEndpoint(const std::function<absl::Status(int fd, const EtcdEndpoint&)>& exchange);

  std::vector<EtcdEndpoint> endpoints_;
  absl::Duration timeout_;
  mutable absl::Mutex mu_;
  size_t current_ ABSL_GUARDED_BY(mu_) = 0;
};

// JSON of `message` as the gateway wants it (proto field names, bytes as base64).
std::string EtcdJson(const google::protobuf::Message& message);
// Parses the gateway's JSON into `message`, ignoring fields it does not know.
absl::Status ParseEtcdJson(std::string_view json, google::protobuf::Message* message);

}  // namespace kvagent::agent

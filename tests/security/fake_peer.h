// What the security tests' fake peer agents share: a Peer service played by the test
// process on 127.0.0.1 (plain TCP; the agents dial it with --insecure-listen), and the
// answer an honest agent gives to GetMetadata.
#pragma once

#include <memory>

#include "catch2/catch.hpp"
#include "grpcpp/grpcpp.h"
#include "proto/kvagent.grpc.pb.h"

namespace kvagent::testing {

// Starts `service` on 127.0.0.1, port chosen by the kernel, into `*port`.
inline std::unique_ptr<grpc::Server> StartFakePeer(grpc::Service* service, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  REQUIRE(server != nullptr);
  REQUIRE(*port > 0);
  return server;
}

// GetMetadata's answer from a peer whose metadata is `view`: the unchanged form (name,
// incarnation, version, pid) when the caller holds that version, else the whole catalog.
inline void AnswerMetadata(const v1::AgentMetadata& view, const v1::GetMetadataRequest& request,
                           v1::AgentMetadata* reply) {
  if (request.known_version() == view.version() &&
      request.known_incarnation() == view.incarnation()) {
    reply->set_name(view.name());
    reply->set_incarnation(view.incarnation());
    reply->set_version(view.version());
    reply->set_pid(view.pid());
  } else {
    *reply = view;
  }
}

}  // namespace kvagent::testing

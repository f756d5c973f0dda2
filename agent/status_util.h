// The one place where absl::Status becomes grpc::Status (and back), plus small time
// helpers shared by the agent's components.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace kvagent::agent {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);
uint64_t UnixMicros();
uint64_t MonotonicMicros();

}  // namespace kvagent::agent

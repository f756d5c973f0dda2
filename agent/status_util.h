// The one place where absl::Status becomes grpc::Status (and back). The clocks the
// agent's components use here as agent::UnixMicros live in base/clock.h.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "base/clock.h"
#include "grpcpp/support/status.h"

namespace kvagent::agent {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);
using ::kvagent::MonotonicMicros;
using ::kvagent::UnixMicros;

}  // namespace kvagent::agent

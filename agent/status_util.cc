#include "agent/status_util.h"

#include <string>

#include "agent/limits.h"
#include "base/format.h"
#include "base/log.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("status");
}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering.
  // A text over gRPC's trailer limit would reach the client as gRPC's own, misleading
  // RESOURCE_EXHAUSTED: the client gets the bounded text, the log the whole one.
  if (status.message().size() > kMaxErrorBytes) {
    kLog.Warn("error text of {} bytes cut to {} for the client; whole: {}",
              status.message().size(), kMaxErrorBytes, status.message());
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      BoundedErrorText(std::string_view(status.message().data(), status.message().size())));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

}  // namespace kvagent::agent

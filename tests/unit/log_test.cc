#include "base/log.h"

#include "base/status_macros.h"
#include "catch2/catch.hpp"

namespace kvagent {
namespace {

absl::StatusOr<int> Half(int v) {
  if (v % 2) return absl::InvalidArgumentError("odd");
  return v / 2;
}

absl::Status Quarter(int v, int* out) {
  ASSIGN_OR_RETURN(int h, Half(v));
  ASSIGN_OR_RETURN(*out, Half(h));
  return absl::OkStatus();
}

TEST_CASE("log levels parse and reject unknown names") {
  REQUIRE(log::ParseLevel("debug").value() == log::Level::kDebug);
  auto bad = log::ParseLevel("loud");
  REQUIRE_FALSE(bad.ok());
  REQUIRE(std::string(bad.status().message()).find("trace, debug") != std::string::npos);
}

TEST_CASE("status macros return the first error") {
  int out = 0;
  REQUIRE(Quarter(8, &out).ok());
  REQUIRE(out == 2);
  REQUIRE(Quarter(6, &out).code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvagent

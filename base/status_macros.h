// Status helpers shared by every layer: Debian's Abseil 20220623 has neither
// RETURN_IF_ERROR nor ASSIGN_OR_RETURN, so they are defined once here.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVAGENT_CONCAT_INNER_(a, b) a##b
#define KVAGENT_CONCAT_(a, b) KVAGENT_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                              \
  do {                                                     \
    ::absl::Status kvagent_status_ = (expr);               \
    if (!kvagent_status_.ok()) return kvagent_status_;     \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, Foo());` declares x from an OK StatusOr, or returns
// its status.
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  ASSIGN_OR_RETURN_IMPL_(KVAGENT_CONCAT_(kvagent_statusor_, __LINE__), lhs, rexpr)

#define ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                           \
  if (!statusor.ok()) return statusor.status();      \
  lhs = std::move(statusor).value()

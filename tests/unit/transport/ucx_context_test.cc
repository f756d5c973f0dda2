#include "transport/ucx_context.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "catch2/catch.hpp"

namespace kvagent::transport {
namespace {

bool Contains(const std::vector<std::string>& items, const std::string& item) {
  return std::find(items.begin(), items.end(), item) != items.end();
}

TEST_CASE("capabilities come from the running UCX") {
  auto context = UcxContext::Create();
  REQUIRE(context.ok());
  const UcxCapabilities& caps = (*context)->capabilities();
  INFO("version " << caps.version);
  CHECK(caps.version.rfind("1.", 0) == 0);
  CHECK(caps.version == ucp_get_version_string());
  CHECK(Contains(caps.memory_types, "host"));
  // Debian's UCX has no CUDA support; this machine has no GPU.
  CHECK_FALSE(Contains(caps.memory_types, "cuda"));
  CHECK_FALSE(caps.cuda_memory);
  CHECK(Contains(caps.transports, "tcp"));
  CHECK(Contains(caps.transports, "self"));
  // Names are deduplicated (tcp has one resource per network device).
  std::vector<std::string> sorted = caps.transports;
  std::sort(sorted.begin(), sorted.end());
  CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());
}

TEST_CASE("host memory maps and packs an rkey; registrations move") {
  auto context = UcxContext::Create();
  REQUIRE(context.ok());
  std::vector<char> buffer(1 << 20, 'x');
  auto mapped = MemoryRegistration::Map(**context, buffer.data(), buffer.size(),
                                        MemoryType::kHost, "kv.layer0");
  REQUIRE(mapped.ok());
  MemoryRegistration registration = std::move(*mapped);
  CHECK(registration.address() == buffer.data());
  CHECK(registration.length() == buffer.size());
  CHECK(registration.type() == MemoryType::kHost);
  CHECK(registration.handle() != nullptr);
  CHECK_FALSE(registration.packed_rkey().empty());

  std::string rkey = registration.packed_rkey();
  MemoryRegistration moved(std::move(registration));
  CHECK(registration.handle() == nullptr);
  CHECK(registration.packed_rkey().empty());
  CHECK(moved.handle() != nullptr);
  CHECK(moved.packed_rkey() == rkey);

  MemoryRegistration assigned;
  assigned = std::move(moved);
  CHECK(moved.handle() == nullptr);
  CHECK(assigned.address() == buffer.data());
  CHECK(assigned.packed_rkey() == rkey);
  // Assigning over a live registration unmaps the old one (no leak, no crash).
  std::vector<char> other(4096);
  auto second = MemoryRegistration::Map(**context, other.data(), other.size(),
                                        MemoryType::kHost, "aux");
  REQUIRE(second.ok());
  assigned = std::move(*second);
  CHECK(assigned.address() == other.data());
}

TEST_CASE("declaring cuda memory without CUDA-enabled UCX fails with the fix") {
  auto context = UcxContext::Create();
  REQUIRE(context.ok());
  std::vector<char> buffer(4096);
  auto mapped = MemoryRegistration::Map(**context, buffer.data(), buffer.size(),
                                        MemoryType::kCuda, "kv.gpu0.layer3");
  REQUIRE_FALSE(mapped.ok());
  const std::string message(mapped.status().message());
  INFO(message);
  CHECK(mapped.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(message.find("kv.gpu0.layer3") != std::string::npos);
  CHECK(message.find("cuda") != std::string::npos);
  CHECK(message.find((*context)->capabilities().version) != std::string::npos);
  CHECK(message.find("UCX_TLS") != std::string::npos);
  CHECK(message.find("UCX_MODULE_DIR") != std::string::npos);
  CHECK(message.find("host") != std::string::npos);  // what UCX does support
}

TEST_CASE("null or empty ranges are rejected naming the entry") {
  auto context = UcxContext::Create();
  REQUIRE(context.ok());
  char byte = 0;
  auto empty = MemoryRegistration::Map(**context, &byte, 0, MemoryType::kHost, "aux.empty");
  REQUIRE_FALSE(empty.ok());
  CHECK(empty.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(empty.status().message().find("aux.empty") != std::string::npos);

  auto null = MemoryRegistration::Map(**context, nullptr, 4096, MemoryType::kHost, "aux.null");
  REQUIRE_FALSE(null.ok());
  CHECK(null.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(null.status().message().find("aux.null") != std::string::npos);
}

// UCX 1.13 stops the process on an assertion when a posix directory named by
// UCX_POSIX_DIR (with UCX_POSIX_USE_PROC_LINK=n) does not fit its 63-byte interface
// address; the context refuses it first, with the limit. Within it, or with the link
// on, UCX starts.
TEST_CASE("a UCX_POSIX_DIR too long for UCX's interface address is refused before UCX starts") {
  const std::string longest(54, 'd'), too_long(55, 'd');
  ::setenv("UCX_POSIX_USE_PROC_LINK", "n", 1);
  ::setenv("UCX_POSIX_DIR", ("/" + too_long.substr(1)).c_str(), 1);
  auto refused = UcxContext::Create();
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("UCX_POSIX_DIR is 55 characters") &&
                 Catch::Contains("use a directory of at most 54 characters"));
  ::setenv("UCX_POSIX_DIR", ("/" + longest.substr(1)).c_str(), 1);
  auto fits = UcxContext::Create();
  INFO(fits.status().ToString());
  CHECK(fits.ok());
  ::setenv("UCX_POSIX_DIR", ("/" + too_long.substr(1)).c_str(), 1);
  ::setenv("UCX_POSIX_USE_PROC_LINK", "y", 1);  // the directory is not in the address
  auto linked = UcxContext::Create();
  INFO(linked.status().ToString());
  CHECK(linked.ok());
  ::unsetenv("UCX_POSIX_DIR");
  ::unsetenv("UCX_POSIX_USE_PROC_LINK");
}

TEST_CASE("status and type names") {
  CHECK(MemoryTypeName(MemoryType::kHost) == "host");
  CHECK(MemoryTypeName(MemoryType::kCuda) == "cuda");
  const std::string text = UcsStatusText(UCS_ERR_NO_MEMORY);
  CHECK(text.find("UCS_ERR_NO_MEMORY") != std::string::npos);
  CHECK(text.find(ucs_status_string(UCS_ERR_NO_MEMORY)) != std::string::npos);
}

}  // namespace
}  // namespace kvagent::transport

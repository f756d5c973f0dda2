// Which network interface of this host holds an address (getifaddrs), for the agent's
// choice of UCX's data interface and the UCX TCP guard's "is this peer on this host".
#pragma once

#include <optional>
#include <string>

namespace kvagent {

// The name of the first interface holding `address` (family AF_INET: 4 bytes of an
// in_addr; AF_INET6: 16 bytes of an in6_addr); "" when none does; nullopt when the
// interfaces cannot be listed.
std::optional<std::string> InterfaceHolding(int family, const void* address);

}  // namespace kvagent

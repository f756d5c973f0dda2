// Which network interface of this host holds an address (getifaddrs), for the agent's
// choice of UCX's data interface and the UCX TCP guard's "is this peer on this host".
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace kvagent {

// The name of the first interface holding `address` (family AF_INET: 4 bytes of an
// in_addr; AF_INET6: 16 bytes of an in6_addr); "" when none does; nullopt when the
// interfaces cannot be listed.
std::optional<std::string> InterfaceHolding(int family, const void* address);

// The IP addresses (text, IPv6 without brackets) of the interfaces named in `devices`, a
// UCX_NET_DEVICES value ("eth0,eth1"; a ":port" suffix is cut; an RDMA device name
// matches no interface). Empty or "all": every interface but loopback. Loopback
// addresses are left out (a same-host peer is checked by uid, not address).
std::vector<std::string> AddressesOfDevices(const std::string& devices);

}  // namespace kvagent

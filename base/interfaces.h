// Which network interface of this host holds an address (getifaddrs), for the agent's
// choice of UCX's data interface and the UCX TCP guard's "is this peer on this host";
// the addresses its data interfaces hold; and the host part of an address dialled.
#pragma once

#include <sys/socket.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvagent {

// The address bytes of `a`: its in_addr (AF_INET) or in6_addr (AF_INET6); null for
// another family.
const void* InAddressOf(const sockaddr* a);

// The name of the first interface holding `address` (family AF_INET: 4 bytes of an
// in_addr; AF_INET6: 16 bytes of an in6_addr); "" when none does; nullopt when the
// interfaces cannot be listed.
std::optional<std::string> InterfaceHolding(int family, const void* address);

// The IP addresses (text, IPv6 without brackets) of the interfaces named in `devices`, a
// UCX_NET_DEVICES value ("eth0,eth1"; a ":port" suffix is cut; an RDMA device name
// matches no interface). Empty or "all": every interface but loopback. Loopback
// addresses are left out (a same-host peer is checked by uid, not address).
std::vector<std::string> AddressesOfDevices(const std::string& devices);

// The host of an address as dialled ("10.0.0.7:5000", "[fd00::7]:5000",
// "dns:///node-3:5000", "ipv4:10.0.0.7:5000"): the gRPC scheme, the port after the last
// ':' and IPv6 brackets cut. Without a ':' after the scheme, the rest whole (less its
// brackets), and *had_port (when given) false.
std::string HostOfDialled(std::string_view address, bool* had_port = nullptr);

}  // namespace kvagent

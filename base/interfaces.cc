#include "base/interfaces.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <sstream>

namespace kvagent {

const void* InAddressOf(const sockaddr* a) {
  if (a->sa_family == AF_INET) return &reinterpret_cast<const sockaddr_in*>(a)->sin_addr;
  if (a->sa_family == AF_INET6) return &reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr;
  return nullptr;
}

std::optional<std::string> InterfaceHolding(int family, const void* address) {
  struct ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return std::nullopt;
  std::string found;
  for (struct ifaddrs* i = list; i != nullptr && found.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != family) continue;
    const void* held = InAddressOf(i->ifa_addr);
    if (held != nullptr && std::memcmp(held, address, family == AF_INET ? 4 : 16) == 0) {
      found = i->ifa_name;
    }
  }
  freeifaddrs(list);
  return found;
}

std::vector<std::string> AddressesOfDevices(const std::string& devices) {
  std::vector<std::string> names;
  std::istringstream list(devices);
  for (std::string name; std::getline(list, name, ',');) {
    name = name.substr(0, name.find(':'));
    if (!name.empty()) names.push_back(name);
  }
  const bool all = names.empty() || std::find(names.begin(), names.end(), "all") != names.end();
  std::vector<std::string> out;
  struct ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) return out;
  for (struct ifaddrs* i = interfaces; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || (i->ifa_flags & IFF_LOOPBACK) != 0) continue;
    const int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (!all && std::find(names.begin(), names.end(), i->ifa_name) == names.end()) continue;
    const void* held = InAddressOf(i->ifa_addr);
    char text[INET6_ADDRSTRLEN] = {};
    if (inet_ntop(family, held, text, sizeof text) == nullptr) continue;
    if (std::find(out.begin(), out.end(), text) == out.end()) out.push_back(text);
  }
  freeifaddrs(interfaces);
  return out;
}

std::string HostOfDialled(std::string_view address, bool* had_port) {
  for (const std::string_view scheme : {"dns:///", "dns:", "ipv4:", "ipv6:"}) {
    if (address.substr(0, scheme.size()) == scheme) address.remove_prefix(scheme.size());
  }
  const size_t colon = address.rfind(':');
  if (had_port != nullptr) *had_port = colon != std::string_view::npos;
  std::string_view host = colon == std::string_view::npos ? address : address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return std::string(host);
}

}  // namespace kvagent

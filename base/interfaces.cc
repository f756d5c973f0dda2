#include "base/interfaces.h"

#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>

namespace kvagent {

std::optional<std::string> InterfaceHolding(int family, const void* address) {
  struct ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return std::nullopt;
  std::string found;
  for (struct ifaddrs* i = list; i != nullptr && found.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != family) continue;
    const void* held =
        family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr)
            : static_cast<const void*>(
                  &reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr);
    if (std::memcmp(held, address, family == AF_INET ? 4 : 16) == 0) found = i->ifa_name;
  }
  freeifaddrs(list);
  return found;
}

}  // namespace kvagent

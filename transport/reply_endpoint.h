// The endpoint an active message came with, kept to answer on after its handler.
#pragma once

#include <cstdint>

namespace kvagent::transport {

// The endpoint an active message came with, to answer on: UCP's endpoint and its serial
// (EndpointSerial in ucx_hardening.h; 0 in a process without the endpoint stand-ins).
// UCP may destroy the endpoint once the handler returned and put the next endpoint it
// makes at the same address; UcxWorker::SendAmReply and ReplyEndpointNativeRma
// (ucx_worker.h) first check that the address still holds the endpoint of this serial,
// so an answer kept past the handler (an acknowledgement, a staged read's parts) never
// goes to a destroyed endpoint or to the peer of the one that took its place.
struct ReplyEndpoint {
  void* ep = nullptr;
  uint64_t serial = 0;
  explicit operator bool() const { return ep != nullptr; }
  bool operator==(const ReplyEndpoint& other) const {
    return ep == other.ep && serial == other.serial;
  }
};

}  // namespace kvagent::transport

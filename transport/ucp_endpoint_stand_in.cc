// UCP's own endpoint functions in front of libucp's, for kvagentd: they follow each
// endpoint UCP creates, sets up lanes for, matches and destroys, so that a peer's
// wireup message UCX 1.13 would stop the process on is refused instead (ucx_hardening.h,
// NoteEndpointCreated and ReplyNames): a request whose address lists no transport this
// agent reaches, one that would give an endpoint lanes of another configuration, and a
// reply whose sender contradicts its endpoint's peer; and so that the endpoints UCP
// makes for peers' requests and checks stay within a cap (PeerEndpointAdmitted), and so
// that an endpoint to a same-host process that ended is destroyed when it is closed
// (ReclaimedOnDisconnect), where UCP would keep it until the worker ends. These
// functions are UCP's internal ones (exported by libucp and called through its PLT, as `objdump -R
// libucp.so` lists), of UCX 1.13's signatures (HardenUcxForPeers refuses another UCX;
// unhardened, the stand-ins only pass the calls on). kvagentd links this object and
// exports the symbols (-Wl,--export-dynamic-symbol in BUILD), so libucp's calls bind
// to it; the next definitions in the lookup order (libucp's) do the work.
#include <dlfcn.h>
#include <ucp/api/ucp.h>

#include <cstring>

#include "transport/ucx_hardening.h"

extern "C" {
ucs_status_t ucp_ep_create_base(ucp_worker_h worker, unsigned ep_init_flags,
                                const char* peer_name, const char* message, ucp_ep_h* ep_p);
ucs_status_t ucp_wireup_init_lanes(ucp_ep_h ep, unsigned ep_init_flags,
                                   const void* local_tl_bitmap, const void* remote_address,
                                   unsigned* addr_indices);
ucs_status_t ucp_worker_get_ep_config(ucp_worker_h worker, const void* key,
                                      unsigned ep_init_flags, uint8_t* cfg_index_p);
void ucp_ep_set_failed_schedule(ucp_ep_h ep, uint8_t lane, ucs_status_t status);
void ucp_ep_destroy_base(ucp_ep_h ep);
ucp_ep_h ucp_ep_match_retrieve(ucp_worker_h worker, uint64_t dest_uuid, uint16_t conn_sn,
                               int conn_queue_type);
void ucp_ep_match_remove_ep(ucp_worker_h worker, ucp_ep_h ep);
void ucp_ep_disconnected(ucp_ep_h ep, int force);
// Called, not stood in for: what UCP does to an endpoint of its own that found no lanes.
void ucp_ep_delete(ucp_ep_h ep);
}

namespace {

template <typename Fn>
Fn Next(Fn, const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
}

// The names UCX 1.13's wireup gives the endpoints it creates for a peer's request and
// for its answer to a peer's endpoint check.
constexpr char kForRequest[] = "remote-request";
constexpr char kForCheckReply[] = "wireup ep_check reply";
// UCS_CONN_MATCH_QUEUE_UNEXP: the endpoints UCP made for requests, not yet the user's.
constexpr int kUnexpectedQueue = 1;

kvagent::transport::MadeFor MadeForMessage(const char* message) {
  using kvagent::transport::MadeFor;
  if (message == nullptr) return MadeFor::kAgent;
  if (std::strcmp(message, kForRequest) == 0) return MadeFor::kRequest;
  if (std::strcmp(message, kForCheckReply) == 0) return MadeFor::kCheckReply;
  return MadeFor::kAgent;
}

using RemoveFn = void (*)(ucp_worker_h, ucp_ep_h);
RemoveFn NextRemove() {
  static const auto next = Next(&ucp_ep_match_remove_ep, "ucp_ep_match_remove_ep");
  return next;
}

// UCP's own removal from its matching table, not the stand-in's (which is for replies).
void RemoveFromMatching(ucp_worker_h worker, ucp_ep_h ep) {
  if (const RemoveFn next = NextRemove(); next != nullptr) next(worker, ep);
}

}  // namespace

namespace hardening = kvagent::transport;

extern "C" ucs_status_t ucp_ep_create_base(ucp_worker_h worker, unsigned ep_init_flags,
                                           const char* peer_name, const char* message,
                                           ucp_ep_h* ep_p) {
  static const auto next = Next(&ucp_ep_create_base, "ucp_ep_create_base");
  if (next == nullptr) return UCS_ERR_UNSUPPORTED;
  const hardening::MadeFor made_for = MadeForMessage(message);
  // Past the worker's cap of endpoints made for peers, UCP answers nothing.
  if (!hardening::PeerEndpointAdmitted(worker, made_for)) return UCS_ERR_EXCEEDS_LIMIT;
  const ucs_status_t status = next(worker, ep_init_flags, peer_name, message, ep_p);
  if (status == UCS_OK) hardening::NoteEndpointCreated(worker, *ep_p, made_for);
  return status;
}

extern "C" ucs_status_t ucp_wireup_init_lanes(ucp_ep_h ep, unsigned ep_init_flags,
                                              const void* local_tl_bitmap,
                                              const void* remote_address,
                                              unsigned* addr_indices) {
  static const auto next = Next(&ucp_wireup_init_lanes, "ucp_wireup_init_lanes");
  if (next == nullptr) return UCS_ERR_UNSUPPORTED;
  hardening::LanesSetUp lanes(ep);
  return next(ep, ep_init_flags, local_tl_bitmap, remote_address, addr_indices);
}

extern "C" ucs_status_t ucp_worker_get_ep_config(ucp_worker_h worker, const void* key,
                                                 unsigned ep_init_flags, uint8_t* cfg_index_p) {
  static const auto next = Next(&ucp_worker_get_ep_config, "ucp_worker_get_ep_config");
  if (next == nullptr) return UCS_ERR_UNSUPPORTED;
  const ucs_status_t status = next(worker, key, ep_init_flags, cfg_index_p);
  if (status == UCS_OK && !hardening::ConfigurationFound(*cfg_index_p)) {
    return UCS_ERR_UNREACHABLE;
  }
  return status;
}

extern "C" void ucp_ep_set_failed_schedule(ucp_ep_h ep, uint8_t lane, ucs_status_t status) {
  static const auto next = Next(&ucp_ep_set_failed_schedule, "ucp_ep_set_failed_schedule");
  const void* worker = nullptr;
  switch (hardening::EndpointFailing(ep, &worker)) {
    case hardening::EndpointFailure::kKeep:
      return;
    case hardening::EndpointFailure::kRemove:
      RemoveFromMatching(static_cast<ucp_worker_h>(const_cast<void*>(worker)), ep);
      ucp_ep_delete(ep);
      return;
    case hardening::EndpointFailure::kFail:
      break;
  }
  if (next != nullptr) next(ep, lane, status);
}

extern "C" void ucp_ep_destroy_base(ucp_ep_h ep) {
  static const auto next = Next(&ucp_ep_destroy_base, "ucp_ep_destroy_base");
  hardening::ForgetEndpoint(ep);
  if (next != nullptr) next(ep);
}

extern "C" ucp_ep_h ucp_ep_match_retrieve(ucp_worker_h worker, uint64_t dest_uuid,
                                          uint16_t conn_sn, int conn_queue_type) {
  static const auto next = Next(&ucp_ep_match_retrieve, "ucp_ep_match_retrieve");
  if (next == nullptr) return nullptr;
  ucp_ep_h ep = next(worker, dest_uuid, conn_sn, conn_queue_type);
  hardening::EndpointMatched(ep);
  // The agent's ucp_ep_create takes over an endpoint UCP made for a peer's request.
  if (conn_queue_type == kUnexpectedQueue) hardening::EndpointAdopted(ep);
  return ep;
}

extern "C" void ucp_ep_match_remove_ep(ucp_worker_h worker, ucp_ep_h ep) {
  hardening::ReplyNames(ep);
  RemoveFromMatching(worker, ep);
}

// The end of an endpoint's close (and of UCP's own destruction of one: force set). UCP
// keeps an endpoint with a connection from its peer unless forced; one the worker marked
// because its same-host process ended (ReclaimEndpoint) is destroyed instead, its lanes
// flushed by the close as for an endpoint without that connection.
extern "C" void ucp_ep_disconnected(ucp_ep_h ep, int force) {
  static const auto next = Next(&ucp_ep_disconnected, "ucp_ep_disconnected");
  if (next == nullptr) return;
  if (force == 0 && hardening::ReclaimedOnDisconnect(ep)) force = 1;
  next(ep, force);
}

// What the data path knows of one peer: a PeerSnapshot, one consistent view of its
// catalog, UCX endpoint, unpacked rkeys and (same host) its memory mapped here, all of
// one metadata version. PeerManager (agent/peer_manager.h) builds and replaces them;
// the transfer engine, the data paths and staging only read them, so they include
// this header and not the peer manager's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "registry/cuda_ipc_mapping.h"
#include "registry/cuda_vmm_mapping.h"
#include "registry/remote_catalog.h"
#include "registry/shm_mapping.h"
#include "transport/ucx_worker.h"

namespace kvagent::agent {

// Deletes on the worker thread: UCX endpoints and rkeys may be touched only there.
template <typename T>
std::shared_ptr<T> OwnedByWorker(transport::UcxWorker* worker, std::unique_ptr<T> object) {
  return std::shared_ptr<T>(object.release(), [worker](T* p) {
    if (worker->OnWorkerThread()) {
      delete p;
    } else {
      worker->Post([p] { delete p; });
    }
  });
}

// Unpacked rkeys of one metadata version, indexed by RemoteRegion::rkey_slot.
// A key is shared by the tables of consecutive versions of one endpoint (a delta
// keeps the keys of the regions it did not change); tables die on the worker thread,
// so the keys do too.
struct RkeyTable {
  std::shared_ptr<transport::Endpoint> endpoint;  // outlives the keys
  std::vector<std::shared_ptr<const transport::RemoteKey>> keys;  // null: no rkey (staged)

  const transport::RemoteKey& at(uint32_t slot) const {
    static const transport::RemoteKey kNone;
    return keys[slot] != nullptr ? *keys[slot] : kNone;
  }
};

// The peer's memory mapped into this process (same-host peers), indexed by rkey
// slot: host memory by mapping the descriptor the peer passed over its session
// socket, VRAM regions by opening the peer's CUDA IPC handle or importing its CUDA VMM
// allocation (one import per allocation, shared by its regions and by the next
// views of the same peer process). A null base means that region goes through UCX or
// host staging.
struct DirectMappings {
  std::vector<uint8_t*> base_by_slot;
  std::vector<std::shared_ptr<registry::ShmMapping>> mappings;
  std::vector<std::string> memory_keys;  // identity of each shm mapping, for reuse
  std::vector<std::shared_ptr<registry::CudaIpcMapping>> cuda_mappings;
  std::vector<std::string> handles;  // identity of each cuda mapping, for reuse
  std::vector<std::shared_ptr<const registry::CudaVmmMapping>> vmm_mappings;
  std::vector<std::string> vmm_keys;  // identity of each VMM import, for reuse
  // Regions that could not be mapped here, "region 'NAME': why" (the first
  // kMaxFallbacks), how many there were in all, and how many CUDA VMM imports failed
  // building this view.
  static constexpr size_t kMaxFallbacks = 16;
  std::vector<std::string> fallbacks;
  uint64_t fallback_regions = 0;
  uint64_t vmm_import_failures = 0;
  bool complete = false;  // every region is mapped
  size_t mapped = 0;
};

// One consistent view of a peer: catalog, endpoint and keys of the same version.
struct PeerSnapshot {
  std::string name;
  std::string address;
  uint64_t incarnation = 0;
  std::string worker_address;
  bool same_host = false;
  transport::ErrorMode error_mode = transport::ErrorMode::kNone;
  std::string transports;
  std::shared_ptr<const registry::RemoteCatalog> catalog;
  std::shared_ptr<transport::Endpoint> endpoint;  // worker thread only
  std::shared_ptr<RkeyTable> keys;                // worker thread only
  std::shared_ptr<const DirectMappings> direct;   // null unless same-host shm-direct
  // Same host, shm-direct: DirectMappings::fallbacks, fallback_regions and
  // vmm_import_failures of the mapping attempt (kept when nothing could be mapped, so
  // direct is null).
  std::vector<std::string> direct_fallbacks;
  uint64_t direct_fallback_regions = 0;
  uint64_t vmm_import_failures = 0;
  // The secret the peer issued us (AgentMetadata.notify_secret): every UCX message we
  // send it carries it.
  std::string notify_secret;
  // AgentMetadata.wire_features: the active messages beyond 1-5 the peer takes
  // (agent/am_ids.h kWire*).
  uint32_t wire_features = 0;
  // The data moves as this agent's own eager active messages (Route::kAmWrite and
  // kAmRead) instead of UCX RMA: the endpoint has no native RMA (Endpoint::NativeRma,
  // tcp) and the peer takes such messages (kWireAmData). Set with the endpoint.
  bool am_data = false;
  // The endpoint's opening ping (EndpointPings): µs from sending it to the peer's pong,
  // which proves the peer's UCX reaches this agent back. Kept with a reused endpoint;
  // 0 when the peer takes no pings (its wire_features lack kWirePing).
  uint64_t round_trip_us = 0;
  // The same view with only what a finished transfer's outcome and commit notices need
  // (name, incarnation, endpoint, secret, wire features): no catalog, no keys, no
  // mapped memory. Made once per view; an ended record keeps this one, so 10,000 ended
  // records of a peer whose catalog changed between them (a copy per version, 40-50 MB
  // at 100,000 regions) hold neither those catalogs nor the peer's memory, and no
  // record copies a view.
  std::shared_ptr<const PeerSnapshot> endpoint_only;

  // The data path to this peer, as PeerInfo.data_path and the transfer metrics name
  // it: "ucx", "ucx-am" (am_data), "shm-direct" (every region mapped) or
  // "shm-direct+ucx".
  const char* data_path() const {
    if (direct == nullptr) return am_data ? "ucx-am" : "ucx";
    return direct->complete ? "shm-direct" : "shm-direct+ucx";
  }
};

// `view` without its catalog, keys and mapped memory (PeerSnapshot::endpoint_only).
inline std::shared_ptr<const PeerSnapshot> EndpointOnly(const PeerSnapshot& view) {
  auto out = std::make_shared<PeerSnapshot>();
  out->name = view.name;
  out->address = view.address;
  out->incarnation = view.incarnation;
  out->same_host = view.same_host;
  out->error_mode = view.error_mode;
  out->transports = view.transports;
  out->endpoint = view.endpoint;
  out->notify_secret = view.notify_secret;
  out->wire_features = view.wire_features;
  out->am_data = view.am_data;
  return out;
}

}  // namespace kvagent::agent

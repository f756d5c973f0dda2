#include "tests/integration/stock_ucx_peer.h"

#include <sys/shm.h>

#include <chrono>
#include <cstdlib>
#include <cstring>

#include "catch2/catch.hpp"

namespace kvagent::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kCloseMs = 5000;

}  // namespace

StockUcxPeer::StockUcxPeer(const std::string& address, bool peer_errors,
                           const std::string& rndv_thresh) {
  // Set around this context's configuration only, so agents started later do not
  // inherit it.
  if (!rndv_thresh.empty()) ::setenv("UCX_RNDV_THRESH", rndv_thresh.c_str(), 1);
  ucp_config_t* config = nullptr;
  const ucs_status_t read = ucp_config_read(nullptr, nullptr, &config);
  if (!rndv_thresh.empty()) ::unsetenv("UCX_RNDV_THRESH");
  REQUIRE(read == UCS_OK);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features =
      UCP_FEATURE_RMA | UCP_FEATURE_AMO64 | UCP_FEATURE_TAG | UCP_FEATURE_STREAM | UCP_FEATURE_AM;
  const ucs_status_t init = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  REQUIRE(init == UCS_OK);
  ucp_worker_params_t worker{};
  worker.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker.thread_mode = UCS_THREAD_MODE_SINGLE;
  REQUIRE(ucp_worker_create(context_, &worker, &worker_) == UCS_OK);
  address_ = address;
  peer_errors_ = peer_errors;
  ep_ = AnotherEndpoint();
  more_.clear();
}

ucp_ep_h StockUcxPeer::AnotherEndpoint() {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(address_.data());
  ep.err_mode = peer_errors_ ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  ep.err_handler.cb = [](void* self, ucp_ep_h, ucs_status_t) {
    static_cast<StockUcxPeer*>(self)->failed_ = true;
  };
  ep.err_handler.arg = this;
  ucp_ep_h made = nullptr;
  REQUIRE(ucp_ep_create(worker_, &ep, &made) == UCS_OK);
  more_.push_back(made);
  return made;
}

StockUcxPeer::~StockUcxPeer() {
  Forget();
  for (ucp_rkey_h rkey : rkeys_) ucp_rkey_destroy(rkey);
  more_.push_back(ep_);
  for (ucp_ep_h ep : more_) {
    ucp_request_param_t close{};
    close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    close.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t closing = ucp_ep_close_nbx(ep, &close);
    if (UCS_PTR_IS_PTR(closing)) {
      const auto until = Clock::now() + std::chrono::milliseconds(kCloseMs);
      while (ucp_request_check_status(closing) == UCS_INPROGRESS && Clock::now() < until) {
        ucp_worker_progress(worker_);
      }
      ucp_request_free(closing);
    }
  }
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
}

std::string StockUcxPeer::Address() const {
  ucp_address_t* address = nullptr;
  size_t length = 0;
  REQUIRE(ucp_worker_get_address(worker_, &address, &length) == UCS_OK);
  std::string out(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(worker_, address);
  return out;
}

ucp_rkey_h StockUcxPeer::Unpack(const std::string& packed) {
  ucp_rkey_h rkey = nullptr;
  REQUIRE(ucp_ep_rkey_unpack(ep_, packed.data(), &rkey) == UCS_OK);
  rkeys_.push_back(rkey);
  return rkey;
}

size_t StockUcxPeer::Track(ucs_status_ptr_t request) {
  tracked_.push_back(request);
  return tracked_.size() - 1;
}

void StockUcxPeer::Progress(uint32_t ms) {
  const auto until = Clock::now() + std::chrono::milliseconds(ms);
  while (Clock::now() < until) {
    ucp_worker_progress(worker_);
    bool all = true;
    for (size_t i = 0; i < tracked_.size() && all; ++i) all = Status(i) != UCS_INPROGRESS;
    if (all) return;
  }
}

ucs_status_t StockUcxPeer::Status(size_t i) const {
  ucs_status_ptr_t request = tracked_[i];
  return UCS_PTR_IS_PTR(request) ? ucp_request_check_status(request) : UCS_PTR_STATUS(request);
}

void StockUcxPeer::Forget() {
  for (ucs_status_ptr_t request : tracked_) {
    if (UCS_PTR_IS_PTR(request)) ucp_request_free(request);
  }
  tracked_.clear();
}

UcxSysvSegment::UcxSysvSegment() {
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA;
  REQUIRE(ucp_init(&params, nullptr, &context_) == UCS_OK);
  ucp_mem_map_params_t map{};
  map.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                   UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  map.length = 1 << 20;
  map.flags = UCP_MEM_MAP_ALLOCATE;
  REQUIRE(ucp_mem_map(context_, &map, &memory_) == UCS_OK);
  void* packed = nullptr;
  size_t packed_size = 0;
  REQUIRE(ucp_rkey_pack(context_, memory_, &packed, &packed_size) == UCS_OK);
  key_.assign(static_cast<const char*>(packed), packed_size);
  ucp_rkey_buffer_release(packed);
  // The domain map, the memory type, then a size byte and the bytes of each entry.
  uint64_t domains = 0;
  std::memcpy(&domains, key_.data(), sizeof(domains));
  for (size_t at = sizeof(domains) + 1; domains != 0 && at < key_.size();
       domains &= domains - 1) {
    const auto size = static_cast<uint8_t>(key_[at]);
    if (size == sizeof(int32_t) + sizeof(uint64_t)) segment_at_ = at + 1;
    at += 1 + size;
  }
  INFO("UCX's key of memory it allocated: " << key_.size() << " bytes");
  REQUIRE(segment_at_ != 0);
  std::memcpy(&segment_, key_.data() + segment_at_, sizeof(segment_));
  REQUIRE(Attached() == 1);
}

UcxSysvSegment::~UcxSysvSegment() {
  if (memory_ != nullptr) ucp_mem_unmap(context_, memory_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

std::string UcxSysvSegment::KeyNamingSegmentZero() const {
  std::string key = key_;
  std::memset(key.data() + segment_at_, 0, sizeof(segment_));
  return key;
}

uint64_t UcxSysvSegment::Attached() const {
  shmid_ds status{};
  REQUIRE(::shmctl(segment_, IPC_STAT, &status) == 0);
  return status.shm_nattch;
}

}  // namespace kvagent::testing

#include "transport/ucx_worker.h"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "base/clock.h"
#include "base/cpu_list.h"
#include "base/log.h"
#include "fmt/format.h"
#include "transport/ucx_hardening.h"
#include "uct/api/uct.h"

namespace kvagent::transport {

// Shared by an endpoint, its operations in flight (which may complete after the
// endpoint is gone) and UCX's error handler, whose argument it is: it lives until the
// endpoint's close has been handed to UCX and has finished. Worker thread only.
struct EndpointHealth : std::enable_shared_from_this<EndpointHealth> {
  UcxWorker* worker = nullptr;
  const std::string* worker_name = nullptr;  // the worker's (outlives its operations)
  std::function<void(absl::Status)> on_error;
  bool failed = false;    // UCX failed the endpoint: no operation is started on it
  bool reported = false;  // on_error ran or is posted
  bool closed = false;    // we closed it: its failures are no one's news
};

namespace {

constexpr log::Logger kLog("transport");

// UCX trusts the bytes of a remote address and reads as far as its encoded lengths
// say; padding our copy with zeros keeps a truncated address from reading past it.
constexpr size_t kAddressPadding = 4096;
constexpr size_t kMaxAddressBytes = 64 * 1024;
// A packed remote key is read the same way, by its own layout: a 64-bit map of memory
// domains and a memory type byte, then for each domain in the map a size byte and that
// many bytes, which the domain's component reads as its own key (as many bytes as it
// expects). A key from a peer is walked first (every entry inside its length), then
// UCX reads a copy followed by zeros, so a short entry cannot take it past the copy.
constexpr size_t kRkeyPadding = 256;
constexpr size_t kMaxRkeyBytes = 64 * 1024;

// Why `packed` is not a whole UCX 1.13 packed remote key; empty if it is.
std::string RkeyLayoutError(std::string_view packed) {
  constexpr size_t kFixed = sizeof(uint64_t) + 1;  // the domain map, the memory type
  if (packed.size() < kFixed) {
    return fmt::format("{} bytes, under the {} of its domain map and memory type",
                       packed.size(), kFixed);
  }
  uint64_t map = 0;
  std::memcpy(&map, packed.data(), sizeof(map));
  if (static_cast<uint8_t>(packed[8]) >= UCS_MEMORY_TYPE_LAST) {
    return fmt::format("memory type {} is not one UCX knows", static_cast<uint8_t>(packed[8]));
  }
  size_t at = kFixed;
  int entry = 0;
  for (; map != 0; map &= map - 1, ++entry) {
    if (at >= packed.size()) {
      return fmt::format("its map names {} memory domains, but it ends after {}",
                         entry + __builtin_popcountll(map), entry);
    }
    const size_t size = static_cast<uint8_t>(packed[at]);
    if (packed.size() - at - 1 < size) {
      return fmt::format("entry {} of {} bytes runs past its end ({} bytes)", entry, size,
                         packed.size());
    }
    at += 1 + size;
  }
  return {};
}

// UCX 1.13 addresses start with a header byte whose low nibble is the format
// version (0 = v1, 1 = v2); other values trip an assertion inside UCX.
constexpr uint8_t kMaxAddressVersion = 1;

constexpr auto kShutdownBudget = std::chrono::seconds(2);
// How long a worker being destroyed lets UCX send what it still holds for endpoints a
// peer's wireup made (Shutdown).
constexpr auto kShutdownFlushBudget = std::chrono::milliseconds(500);

// Statuses UCX completes an endpoint's requests with when it failed the endpoint for
// the peer's loss (UCP_ERR_HANDLING_MODE_PEER), as its error handler reports it.
// Not UCS_ERR_CANCELED: that is our own close.
bool PeerLost(ucs_status_t status) {
  switch (status) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
      return true;
    default:
      return false;
  }
}

absl::Status UcxError(ucs_status_t status, std::string message) {
  message += fmt::format(" ({})", UcsStatusText(status));
  switch (status) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_CANCELED:
    case UCS_ERR_IO_ERROR:
      return absl::UnavailableError(message);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

std::string CaptureEpInfo(ucp_ep_h ep) {
  char* buffer = nullptr;
  size_t size = 0;
  FILE* stream = open_memstream(&buffer, &size);
  if (stream == nullptr) return {};
  ucp_ep_print_info(ep, stream);
  std::fclose(stream);
  std::string text(buffer, size);
  std::free(buffer);
  return text;
}

// The lane lines of ucp_ep_print_info, each from "lane[" to its end, like
//   "#   lane[0]:  3:sysv/memory.0 md[2]  -> md[2]/sysv/sysdev[255] am am_bw#0"
std::vector<std::string_view> LaneLines(const std::string& info) {
  std::vector<std::string_view> lines;
  size_t pos = 0;
  while ((pos = info.find("lane[", pos)) != std::string::npos) {
    size_t line_end = info.find('\n', pos);
    if (line_end == std::string::npos) line_end = info.size();
    lines.emplace_back(info.data() + pos, line_end - pos);
    pos = line_end;
  }
  return lines;
}

// The transports of the lanes: the name between "<resource index>:" and "/".
std::vector<std::string> ParseLaneTransports(const std::string& info) {
  std::vector<std::string> names;
  for (std::string_view line : LaneLines(info)) {
    size_t colon = line.find("]:");
    if (colon == std::string_view::npos) continue;
    std::string_view rest = line.substr(colon + 2);
    size_t i = rest.find_first_not_of(' ');
    if (i == std::string_view::npos) continue;
    rest.remove_prefix(i);
    size_t index_end = rest.find(':');
    size_t slash = rest.find('/');
    if (index_end == std::string_view::npos || slash == std::string_view::npos ||
        slash < index_end) {
      continue;
    }
    std::string name(rest.substr(index_end + 1, slash - index_end - 1));
    if (!name.empty() && std::find(names.begin(), names.end(), name) == names.end()) {
      names.push_back(std::move(name));
    }
  }
  return names;
}

// True when a lane carries an RMA role ("rma#N" or "rma_bw#N"): UCX moves puts and
// gets natively. Without one (tcp in UCX 1.13) it emulates them with active messages
// that the remote worker answers itself.
bool ParseHasRmaLane(const std::string& info) {
  for (std::string_view line : LaneLines(info)) {
    if (line.find(" rma#") != std::string_view::npos ||
        line.find(" rma_bw#") != std::string_view::npos) {
      return true;
    }
  }
  return false;
}

// Receive state of one rendezvous active message, owned until its data arrives.
struct RndvReceive {
  AmHandler* handler;
  uint16_t id;
  std::string header;
  std::string data;
};

void FinishRndv(RndvReceive* receive, ucs_status_t status) {
  if (!*receive->handler) {
    // Silenced while the data was on its way (shutdown): nobody takes it any more.
  } else if (status == UCS_OK) {
    (*receive->handler)(receive->header, receive->data);
  } else {
    kLog.Warn("active message {}: receiving {} bytes of rendezvous data failed ({}); the "
              "message is dropped",
              receive->id, receive->data.size(), UcsStatusText(status));
  }
  delete receive;
}

// Heap state of a Flush or SendAm, owned until the send callback.
struct SendOp {
  Completion done;
  std::string payload;  // header followed by data, for SendAm
  // What the operation was, for its error message (formatted only on failure: a
  // transfer sends several messages, and text for each would cost more than the send).
  enum class Kind { kFlush, kSend, kReply } kind = Kind::kSend;
  const std::string* worker = nullptr;  // the worker's name (outlives its operations)
  uint16_t id = 0;
  uint64_t header_bytes = 0;
  uint64_t data_bytes = 0;
  // The endpoint's, for operations on a kPeer endpoint: a failure that says the peer
  // was lost is reported (on_error) before `done` runs.
  std::shared_ptr<EndpointHealth> health;
};

std::string Describe(const SendOp& op) {
  switch (op.kind) {
    case SendOp::Kind::kFlush:
      return fmt::format("UCX worker '{}': flushing an endpoint failed; operations posted "
                         "before it may not have reached the peer",
                         *op.worker);
    case SendOp::Kind::kReply:
      return fmt::format("UCX worker '{}': replying with active message {} ({} + {} bytes) "
                         "failed; the requesting peer is gone or unreachable",
                         *op.worker, op.id, op.header_bytes, op.data_bytes);
    case SendOp::Kind::kSend:
      break;
  }
  return fmt::format("UCX worker '{}': sending active message {} ({} + {} bytes) failed",
                     *op.worker, op.id, op.header_bytes, op.data_bytes);
}

// Marks the endpoint failed and reports it, once, unless we closed it. `defer`: inside
// a call of ours (the caller may hold locks on_error takes), so on_error is posted.
void ReportPeerLost(const std::shared_ptr<EndpointHealth>& health, ucs_status_t status,
                    bool defer) {
  if (health->closed) return;
  health->failed = true;
  if (health->reported) return;
  health->reported = true;
  kLog.Warn("UCX worker '{}': endpoint failed ({})", *health->worker_name,
            UcsStatusText(status));
  if (!health->on_error) return;
  absl::Status error = absl::UnavailableError(fmt::format(
      "UCX worker '{}': the peer of this endpoint failed ({}); the peer process died or the "
      "network between us broke; reconnect once the peer is back",
      *health->worker_name, UcsStatusText(status)));
  if (defer) {
    health->worker->Post([health, error = std::move(error)] { health->on_error(error); });
  } else {
    health->on_error(std::move(error));
  }
}

// `inside_call`: completed at once, inside the call that started it (else from
// progress, where UCX calls the endpoint's error handler too).
void FinishSend(SendOp* op, ucs_status_t status, bool inside_call) {
  std::unique_ptr<SendOp> owned(op);
  if (owned->health != nullptr && PeerLost(status)) {
    ReportPeerLost(owned->health, status, inside_call);
  }
  if (!owned->done) return;
  if (status == UCS_OK) {
    owned->done(absl::OkStatus());
  } else {
    owned->done(UcxError(status, Describe(*owned)));
  }
}

void SendCallback(void* request, ucs_status_t status, void* user_data) {
  RequestsInFlight().fetch_sub(1, std::memory_order_relaxed);
  ucp_request_free(request);
  FinishSend(static_cast<SendOp*>(user_data), status, /*inside_call=*/false);
}

// Starts a send-like operation; `start` gets the request params. Runs `op->done`
// inline on immediate completion or failure.
template <typename StartFn>
void StartSend(std::unique_ptr<SendOp> op, StartFn start) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = SendCallback;
  param.user_data = op.get();
  ucs_status_ptr_t request = start(op.get(), param);
  if (UCS_PTR_IS_PTR(request)) {
    op.release();  // SendCallback owns it now
    RequestsInFlight().fetch_add(1, std::memory_order_relaxed);
    return;
  }
  FinishSend(op.release(), UCS_PTR_STATUS(request), /*inside_call=*/true);
}

// Plain bytes as a UCX generic datatype: UCX packs them into its own send buffers
// (bcopy), never zero-copy. The state is the buffer's start and length.
struct CopiedBytes {
  const uint8_t* data;
  size_t length;
};
void* CopiedBytesStartPack(void*, const void* buffer, size_t count) {
  return new CopiedBytes{static_cast<const uint8_t*>(buffer), count};
}
void* CopiedBytesStartUnpack(void*, void*, size_t) { return nullptr; }  // sends only
size_t CopiedBytesSize(void* state) { return static_cast<CopiedBytes*>(state)->length; }
size_t CopiedBytesPack(void* state, size_t offset, void* dest, size_t max_length) {
  const auto* bytes = static_cast<CopiedBytes*>(state);
  const size_t n = std::min(max_length, bytes->length - offset);
  std::memcpy(dest, bytes->data + offset, n);
  return n;
}
ucs_status_t CopiedBytesUnpack(void*, size_t, const void*, size_t) { return UCS_ERR_UNSUPPORTED; }
void CopiedBytesFinish(void* state) { delete static_cast<CopiedBytes*>(state); }

// The datatype, made once per process (contiguous bytes if UCX refuses it).
ucp_datatype_t CopiedBytesType() {
  static const ucp_datatype_t type = [] {
    ucp_generic_dt_ops_t ops{};
    ops.start_pack = CopiedBytesStartPack;
    ops.start_unpack = CopiedBytesStartUnpack;
    ops.packed_size = CopiedBytesSize;
    ops.pack = CopiedBytesPack;
    ops.unpack = CopiedBytesUnpack;
    ops.finish = CopiedBytesFinish;
    ucp_datatype_t made = 0;
    if (ucp_dt_create_generic(&ops, nullptr, &made) != UCS_OK) {
      kLog.Warn("UCX refused a generic datatype: eager messages may go zero-copy");
      return ucp_dt_make_contig(1);
    }
    return made;
  }();
  return type;
}

// Eager, for Endpoint::EagerOnly endpoints and eager replies: no rendezvous (the
// receiver gets the whole message in its handler and never sends UCX protocol messages
// back for it). `copied` (an endpoint without native RMA, and replies): no zero-copy
// fragments either (UCX 1.13's tcp transport fails an assertion, uct_iface.h
// "comp->count > 0", when the peer dies with zero-copy sends in flight: seen in
// peer_fault_test); the generic datatype that ensures it also rules out UCX's inline
// short sends, so endpoints that do not need it keep contiguous bytes (shared memory
// has no zero-copy active messages anyway). `length`: bytes of data (0: none).
void ForceEager(ucp_request_param_t& param, uint64_t length, bool copied) {
  param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
  param.flags |= UCP_AM_SEND_FLAG_EAGER;
  if (copied && length > 0) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = CopiedBytesType();
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// UcxWorker

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const UcxContext& context,
                                                             std::string name,
                                                             uint32_t spin_us,
                                                             const std::vector<int>& cpus) {
  std::unique_ptr<UcxWorker> worker(new UcxWorker());
  worker->name_ = std::move(name);
  worker->spin_us_ = spin_us;
  const std::string& label = worker->name_;

  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Only the progress thread touches the worker once it runs; creation here
  // happens-before the thread starts.
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  CollectSharedMemoryInterfaces();
  ucs_status_t status = ucp_worker_create(context.get(), &params, &worker->worker_);
  if (status != UCS_OK) {
    worker->worker_ = nullptr;
    return UcxError(status, fmt::format("UCX worker '{}': ucp_worker_create failed; check "
                                        "UCX_TLS/UCX_NET_DEVICES (ucx_info -d)",
                                        label));
  }
  // Its shared-memory receive queues stay in the arm, used or not, so that one a sender
  // left stopped is reported (ReceiveStall). Only where kvagentd's uct_iface_open stand-in
  // noted them.
  std::string unarmed;
  worker->shm_interfaces_ = KeepSharedMemoryInterfacesArmed(worker->worker_, &unarmed);
  if (!unarmed.empty()) {
    kLog.Warn(
        "UCX worker '{}': its shared-memory interfaces are left out of UCX's arm while "
        "no endpoint uses them ({}): a same-host peer that dies mid-message then stops "
        "its receive queue unreported",
        label, unarmed);
  }
  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  status = ucp_worker_get_address(worker->worker_, &address, &address_length);
  if (status != UCS_OK) {
    return UcxError(status, fmt::format("UCX worker '{}': ucp_worker_get_address failed; "
                                        "no usable transport, check UCX_TLS",
                                        label));
  }
  worker->address_.assign(reinterpret_cast<const char*>(address), address_length);
  ucp_worker_release_address(worker->worker_, address);
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  if (ucp_worker_query(worker->worker_, &attr) == UCS_OK) worker->max_am_header_ = attr.max_am_header;

  if (absl::Status guarded = worker->GuardEveryAmId(); !guarded.ok()) return guarded;

  status = ucp_worker_get_efd(worker->worker_, &worker->worker_fd_);
  if (status != UCS_OK) {
    return UcxError(status, fmt::format("UCX worker '{}': ucp_worker_get_efd failed; the "
                                        "context lacks UCP_FEATURE_WAKEUP support",
                                        label));
  }
  worker->event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  worker->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (worker->event_fd_ < 0 || worker->epoll_fd_ < 0) {
    return absl::ResourceExhaustedError(fmt::format(
        "UCX worker '{}': creating its eventfd/epoll failed: {}; raise the open-file limit "
        "(ulimit -n)",
        label, std::strerror(errno)));
  }
  for (int fd : {worker->worker_fd_, worker->event_fd_}) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    if (epoll_ctl(worker->epoll_fd_, EPOLL_CTL_ADD, fd, &event) != 0) {
      return absl::InternalError(fmt::format("UCX worker '{}': epoll_ctl failed: {}", label,
                                             std::strerror(errno)));
    }
  }
  worker->takes_tags_ = context.takes_tags();
  worker->TendTagSink();  // before the thread: this thread still owns the worker
  // A hardened context's worker serves peers' software RMA: it holds back the unmapping
  // of memory its queued get replies may read (left in Shutdown).
  worker->serves_peers_ = context.takes_tags();
  if (worker->serves_peers_) JoinRetireFlushes(worker.get(), &UcxWorker::WakeForRetire);
  worker->thread_ = std::thread([w = worker.get()] { w->Loop(); });
  worker->thread_id_ = worker->thread_.get_id();
  if (!cpus.empty()) {
    if (const int rc = PinThread(worker->thread_.native_handle(), cpus); rc != 0) {
      return absl::InvalidArgumentError(fmt::format(
          "UCX worker '{}': the kernel refused to keep its thread on CPUs {}: {}; name CPUs "
          "this process may use (taskset -p, the cgroup's cpuset)",
          label, FormatCpuList(cpus), std::strerror(rc)));
    }
  }
  return worker;
}

std::vector<int> UcxWorker::cpus() const {
  // const_cast: std::thread::native_handle is not const; reading the affinity changes
  // nothing.
  return ThreadCpus(const_cast<std::thread&>(thread_).native_handle());
}

UcxWorker::~UcxWorker() {
  if (thread_.joinable()) {
    stopping_.store(true);
    Wake();
    thread_.join();
  } else if (worker_ != nullptr) {
    ucp_worker_destroy(worker_);  // Create failed before the thread started
  }
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (event_fd_ >= 0) close(event_fd_);
}

void UcxWorker::Post(std::function<void()> fn) {
  if (!Enqueue(std::move(fn))) {
    kLog.Warn("UCX worker '{}': a closure was posted after its thread stopped; dropped", name_);
  }
}

bool UcxWorker::TryPost(std::function<void()> fn) { return Enqueue(std::move(fn)); }

void UcxWorker::RunSync(std::function<void()> fn) {
  if (OnWorkerThread()) {
    fn();  // waiting on ourselves would never finish
    return;
  }
  absl::Notification done;
  if (!Enqueue([&fn, &done] {
        fn();
        done.Notify();
      })) {
    kLog.Warn("UCX worker '{}': RunSync after its thread stopped; not run", name_);
    return;
  }
  done.WaitForNotification();
}

bool UcxWorker::OnWorkerThread() const { return std::this_thread::get_id() == thread_id_; }

bool UcxWorker::Enqueue(std::function<void()> fn) {
  {
    absl::MutexLock lock(&mu_);
    if (exited_) return false;
    queue_.push_back(std::move(fn));
  }
  // The worker posting to itself (a completion scheduling the next step) needs no
  // wake-up: its loop looks at the queue again before it sleeps (posted_here_).
  if (OnWorkerThread()) {
    posted_here_ = true;
    return true;
  }
  Wake();
  return true;
}

void UcxWorker::Wake() {
  uint64_t one = 1;
  // EAGAIN means the counter is already non-zero: the thread will wake anyway.
  while (write(event_fd_, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

void UcxWorker::PostAfter(std::chrono::milliseconds delay, std::function<void()> fn) {
  if (!OnWorkerThread()) {
    Post([this, due = std::chrono::steady_clock::now() + delay, fn = std::move(fn)]() mutable {
      // Rounded up: never before `due`.
      PostAfter(std::chrono::ceil<std::chrono::milliseconds>(
                    std::max(due - std::chrono::steady_clock::now(),
                             std::chrono::steady_clock::duration::zero())),
                std::move(fn));
    });
    return;
  }
  timers_.emplace(std::make_pair(std::chrono::steady_clock::now() + delay, timers_set_++),
                  std::move(fn));
}

bool UcxWorker::RunTimers(std::chrono::steady_clock::time_point now, bool all) {
  bool ran = false;
  // One at a time: a timer may set another (PostAfter), even one due now.
  while (!timers_.empty() && (all || timers_.begin()->first.first <= now)) {
    auto fn = std::move(timers_.begin()->second);
    timers_.erase(timers_.begin());
    fn();
    ran = true;
  }
  return ran;
}

int UcxWorker::MsToNextTimer(std::chrono::steady_clock::time_point now) const {
  if (timers_.empty()) return -1;
  const auto due = timers_.begin()->first.first;
  if (due <= now) return 0;
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(due - now).count();
  return static_cast<int>(std::min<int64_t>((us + 999) / 1000, 1000));
}

bool UcxWorker::DrainQueue() {
  posted_here_ = false;
  std::vector<std::function<void()>> batch;
  {
    absl::MutexLock lock(&mu_);
    if (queue_.empty()) return false;
    batch.swap(queue_);
  }
  for (auto& fn : batch) fn();
  batch.clear();
  // The storage goes back for the next closures (no allocation per burst).
  absl::MutexLock lock(&mu_);
  if (queue_.empty() && queue_.capacity() < batch.capacity()) queue_.swap(batch);
  return true;
}

void UcxWorker::SetAmHandler(uint16_t id, AmHandler handler, uint64_t max_data_bytes) {
  InstallAmSlot(id, std::move(handler), nullptr, max_data_bytes);
}

void UcxWorker::SetAmDataHandler(uint16_t id, AmDataHandler handler) {
  InstallAmSlot(id, nullptr, std::move(handler), 0);
}

void UcxWorker::InstallAmSlot(uint16_t id, AmHandler handler, AmDataHandler data_handler,
                              uint64_t max_data_bytes) {
  if (!OnWorkerThread() && thread_.joinable()) {
    RunSync([this, id, &handler, &data_handler, max_data_bytes] {
      InstallAmSlot(id, std::move(handler), std::move(data_handler), max_data_bytes);
    });
    return;
  }
  auto& slot = am_handlers_[id];
  if (slot != nullptr) {
    // In-flight rendezvous receives keep the slot.
    slot->handler = std::move(handler);
    slot->data_handler = std::move(data_handler);
    slot->max_data_bytes = max_data_bytes;
    return;
  }
  slot = std::make_unique<AmSlot>(
      AmSlot{this, id, std::move(handler), std::move(data_handler), max_data_bytes});
  ucp_am_handler_param_t param{};
  param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                     UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  param.id = id;
  param.flags = UCP_AM_FLAG_WHOLE_MSG;
  param.cb = AmCallback;
  param.arg = slot.get();
  ucs_status_t status = ucp_worker_set_am_recv_handler(worker_, &param);
  if (status != UCS_OK) {
    // Only an invalid parameter can fail here: a programming error, not the environment.
    kLog.Error("UCX worker '{}': registering active message {} failed ({})", name_, id,
               UcsStatusText(status));
  }
}

namespace {
// The worker whose thread runs this code: UnknownAmCallback's, whose argument is only
// the id (a table of 65,536 {worker, id} pairs would cost a MiB per worker).
thread_local UcxWorker* tl_progressing = nullptr;
}  // namespace

absl::Status UcxWorker::GuardEveryAmId() {
  ucp_am_handler_param_t param{};
  param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                     UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  param.flags = UCP_AM_FLAG_WHOLE_MSG;
  param.cb = UnknownAmCallback;
  for (uint32_t id = 0; id <= UINT16_MAX; ++id) {
    param.id = id;
    param.arg = reinterpret_cast<void*>(static_cast<uintptr_t>(id));
    if (ucs_status_t status = ucp_worker_set_am_recv_handler(worker_, &param); status != UCS_OK) {
      return UcxError(status, fmt::format("UCX worker '{}': registering the drop handler of "
                                          "active message {} failed; this UCX does not take "
                                          "a handler for every id",
                                          name_, id));
    }
  }
  return absl::OkStatus();
}

ucs_status_t UcxWorker::UnknownAmCallback(void* arg, const void*, size_t header_length, void*,
                                          size_t length, const ucp_am_recv_param_t* param) {
  UcxWorker* worker = tl_progressing;
  if (worker == nullptr) return UCS_OK;
  const auto id = static_cast<uint16_t>(reinterpret_cast<uintptr_t>(arg));
  const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  const uint64_t count = worker->unknown_messages_.fetch_add(1) + 1;
  // The first few and then every 1,024th: a flood does not flood the log.
  if (log::Sampled(count)) {
    kLog.Warn("UCX worker '{}': dropped an active message of id {} ({} header bytes, {} data "
              "bytes{}), which this agent does not take ({} such so far): the sender runs "
              "another protocol version or is faulty",
              worker->name_, id, header_length, length,
              rendezvous ? " by rendezvous, not fetched" : "", count);
  }
  return UCS_OK;  // dropped; a rendezvous body is never fetched
}

void UcxWorker::CountTagged() {
  const uint64_t tagged = tagged_messages_.fetch_add(1) + 1;
  const uint64_t count = unknown_messages_.fetch_add(1) + 1;
  if (log::Sampled(tagged)) {
    kLog.Warn("UCX worker '{}': discarded a tagged message ({} tagged, {} unknown messages so "
              "far): this agent does not use UCX's tag API, so the sender runs something "
              "other than kvagent or is hostile",
              name_, tagged, count);
  }
}

void UcxWorker::TendTagSink() {
  if (!takes_tags_ || tag_sink_failed_) return;
  // Without a callback: UCX may complete a receive inside ucp_tag_recv_nbx (a message
  // already waiting), and a callback freeing it there would leave the pointer returned
  // dangling. Up to a batch per round; the rest on the next.
  for (int round = 0; round < 64; ++round) {
    if (tag_sink_ != nullptr) {
      ucp_tag_recv_info_t info{};
      if (ucp_tag_recv_request_test(tag_sink_, &info) == UCS_INPROGRESS) return;
      ucp_request_free(tag_sink_);
      tag_sink_ = nullptr;
      CountTagged();
      continue;
    }
    if (stopping_.load()) return;
    ucp_tag_recv_info_t info{};  // filled on immediate completion (not used further)
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO;
    param.recv_info.tag_info = &info;
    // Any tag (mask 0), into 0 bytes: UCX truncates what it matches, and answers a
    // rendezvous without fetching its data.
    ucs_status_ptr_t request =
        ucp_tag_recv_nbx(worker_, &tag_sink_byte_, 0, /*tag=*/0, /*tag_mask=*/0, &param);
    if (UCS_PTR_IS_PTR(request)) {
      tag_sink_ = request;
      continue;  // it may have completed already
    }
    const ucs_status_t status = UCS_PTR_STATUS(request);
    if (status != UCS_OK && status != UCS_ERR_MESSAGE_TRUNCATED) {
      tag_sink_failed_ = true;
      kLog.Error("UCX worker '{}': posting the receive that discards tagged messages failed "
                 "({}); a peer's tagged messages now wait in UCX's unexpected queue",
                 name_, UcsStatusText(status));
      return;
    }
    CountTagged();
  }
}

void UcxWorker::WakeForRetire(const void* worker) {
  const_cast<UcxWorker*>(static_cast<const UcxWorker*>(worker))->Wake();
}

void UcxWorker::TendRetireFlush() {
  if (!serves_peers_) return;
  if (retire_flush_ != nullptr) {
    if (ucp_request_check_status(retire_flush_) == UCS_INPROGRESS) {
      const uint64_t now = MonotonicMicros();
      if (!retire_flush_warned_ && now - flushing_since_us_ > 10000000) {
        retire_flush_warned_ = true;
        const RetiredMappings retired = RetiredMappingsNow();
        kLog.Warn("UCX worker '{}': its flush for released memory has not completed in 10 s, "
                  "so {} ranges ({} bytes of address space, zero pages) stay mapped: a peer "
                  "has stopped taking what this worker sends it, a software get reply "
                  "perhaps. They are unmapped once it reads on or its endpoint fails",
                  name_, retired.held, retired.held_bytes);
      }
      // UCX 1.13 can leave a worker flush begun behind a long queue of replies in flight
      // after the queue drained (seen when a peer that stopped reading 100,000 replies
      // read on): one begun a second ago gives way to a new one.
      if (now - retire_flush_began_us_ < 1000000) return;
      ucp_request_free(retire_flush_);  // UCX releases it when it ends
      retire_flush_ = nullptr;
      BeginRetireFlush(now);
      return;
    }
    ucp_request_free(retire_flush_);
    retire_flush_ = nullptr;
    RetireFlushCompleted(this, retire_flush_for_);
    flushing_since_us_ = 0;
  }
  if (RetireSequence() == retire_flush_for_ || stopping_.load()) return;
  BeginRetireFlush(MonotonicMicros());
}

void UcxWorker::BeginRetireFlush(uint64_t now_us) {
  // Every operation this worker has, a get reply UCX still sends included, completes
  // (or fails with its endpoint) before this flush does.
  retire_flush_for_ = RetireSequence();
  retire_flush_began_us_ = now_us;
  if (flushing_since_us_ == 0) {
    flushing_since_us_ = now_us;
    retire_flush_warned_ = false;
  }
  ucp_request_param_t param{};
  ucs_status_ptr_t request = ucp_worker_flush_nbx(worker_, &param);
  if (UCS_PTR_IS_PTR(request)) {
    retire_flush_ = request;
    return;
  }
  if (UCS_PTR_STATUS(request) != UCS_OK) {
    kLog.Warn("UCX worker '{}': its flush returned {}; taken as done", name_,
              UcsStatusText(UCS_PTR_STATUS(request)));
  }
  RetireFlushCompleted(this, retire_flush_for_);
  flushing_since_us_ = 0;
}

void UcxWorker::SilenceAmHandlers() {
  RunSync([this] {
    for (auto& [id, slot] : am_handlers_) {
      slot->handler = nullptr;
      slot->data_handler = nullptr;
    }
  });
}

ucs_status_t UcxWorker::AmCallback(void* arg, const void* header, size_t header_length,
                                   void* data, size_t length,
                                   const ucp_am_recv_param_t* param) {
  auto* slot = static_cast<AmSlot*>(arg);
  slot->worker->am_received_[slot->id < kAmCounters ? slot->id : 0].fetch_add(
      1, std::memory_order_relaxed);
  if (!slot->handler && !slot->data_handler) {
    slot->worker->silenced_messages_.fetch_add(1);
    return UCS_OK;  // silenced: a rendezvous body is never fetched
  }
  std::string_view header_view(header_length > 0 ? static_cast<const char*>(header) : "",
                               header_length);
  if (slot->data_handler) {
    AmMessage message;
    message.header = header_view;
    message.length = length;
    message.rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0) {
      message.reply_ep = ReplyEndpoint{param->reply_ep, EndpointSerial(param->reply_ep)};
    }
    if (message.rendezvous) {
      message.descriptor = data;
    } else {
      message.data = std::string_view(length > 0 ? static_cast<const char*>(data) : "", length);
    }
    const bool kept = slot->data_handler(message);
    return message.rendezvous && kept ? UCS_INPROGRESS : UCS_OK;
  }
  if (length > slot->max_data_bytes) {
    kLog.Warn("active message {}: dropped {} bytes of data, over this handler's limit of {}",
              slot->id, length, slot->max_data_bytes);
    return UCS_OK;  // a rendezvous body is never fetched
  }
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
    slot->handler(header_view, std::string_view(static_cast<const char*>(data), length));
    return UCS_OK;
  }
  // Rendezvous: the header is only valid now; the data is fetched into our buffer.
  auto* receive = new RndvReceive{&slot->handler, slot->id, std::string(header_view),
                                  std::string(length, '\0')};
  ucp_request_param_t recv_param{};
  recv_param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  recv_param.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user_data) {
    RequestsInFlight().fetch_sub(1, std::memory_order_relaxed);
    ucp_request_free(request);
    FinishRndv(static_cast<RndvReceive*>(user_data), status);
  };
  recv_param.user_data = receive;
  ucs_status_ptr_t request = ucp_am_recv_data_nbx(slot->worker->worker_, data,
                                                  receive->data.data(), length, &recv_param);
  if (UCS_PTR_IS_PTR(request)) {
    RequestsInFlight().fetch_add(1, std::memory_order_relaxed);
    return UCS_INPROGRESS;
  }
  FinishRndv(receive, UCS_PTR_STATUS(request));
  return UCS_OK;
}

void UcxWorker::ReceiveAmData(void* descriptor, void* buffer, uint64_t length,
                              std::function<void(absl::Status)> done) {
  auto* state = new std::function<void(absl::Status)>(std::move(done));
  auto finish = [](std::function<void(absl::Status)>* state, ucs_status_t status,
                   uint64_t length) {
    std::unique_ptr<std::function<void(absl::Status)>> owned(state);
    (*owned)(status == UCS_OK
                 ? absl::OkStatus()
                 : UcxError(status, fmt::format("receiving {} bytes of rendezvous data failed; "
                                                "the sender's data did not arrive",
                                                length)));
  };
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.recv_am = [](void* request, ucs_status_t status, size_t received, void* user_data) {
    RequestsInFlight().fetch_sub(1, std::memory_order_relaxed);
    ucp_request_free(request);
    auto* state = static_cast<std::function<void(absl::Status)>*>(user_data);
    std::unique_ptr<std::function<void(absl::Status)>> owned(state);
    (*owned)(status == UCS_OK
                 ? absl::OkStatus()
                 : UcxError(status, fmt::format("receiving {} bytes of rendezvous data failed; "
                                                "the sender's data did not arrive",
                                                received)));
  };
  param.user_data = state;
  ucs_status_ptr_t request = ucp_am_recv_data_nbx(worker_, descriptor, buffer, length, &param);
  if (UCS_PTR_IS_PTR(request)) {
    RequestsInFlight().fetch_add(1, std::memory_order_relaxed);
    return;
  }
  finish(state, UCS_PTR_STATUS(request), length);
}

void UcxWorker::ReleaseAmData(void* descriptor) { ucp_am_data_release(worker_, descriptor); }

absl::Status UcxWorker::CheckAmHeader(uint16_t id, size_t bytes) const {
  if (max_am_header_ == 0 || bytes <= max_am_header_) return absl::OkStatus();
  return absl::InvalidArgumentError(fmt::format(
      "active message {}: its header of {} bytes is over the {} bytes this worker's UCX sends "
      "in one (ucp_worker_query max_am_header); not sent (UCX 1.13 aborts the process on "
      "such a header); keep what the header carries bounded",
      id, bytes, max_am_header_));
}

void UcxWorker::SendAmReply(const ReplyEndpoint& reply_ep, uint16_t id, std::string_view header,
                            const void* data, uint64_t length,
                            std::function<void(absl::Status)> done, bool eager) {
  if (absl::Status fits = CheckAmHeader(id, header.size()); !fits.ok()) {
    kLog.Warn("{}: {}", name_, fits.message());
    if (done) done(std::move(fits));
    return;
  }
  if (!EndpointStillIs(reply_ep.ep, reply_ep.serial)) {
    // Counted (RepliesToGoneEndpoints); the requester is gone: nothing to warn about.
    NoteReplyToGoneEndpoint();
    if (done) {
      done(absl::UnavailableError(
          fmt::format("{}: active message {} not sent: UCX destroyed the endpoint its request came "
                      "over (the requester's connection ended) before the answer was ready",
                      name_, id)));
    }
    return;
  }
  auto op = std::make_unique<SendOp>();
  op->done = std::move(done);
  op->kind = SendOp::Kind::kReply;
  op->worker = &name_;
  op->id = id;
  op->header_bytes = header.size();
  op->data_bytes = length;
  CountSent(id);
  op->payload.assign(header.data(), header.size());
  auto* ep = static_cast<ucp_ep_h>(reply_ep.ep);
  StartSend(std::move(op), [ep, id, data, length, eager](SendOp* send, ucp_request_param_t& param) {
    if (eager) ForceEager(param, length, /*copied=*/true);
    return ucp_am_send_nbx(ep, id, send->payload.empty() ? nullptr : send->payload.data(),
                           send->payload.size(), data, length, &param);
  });
}

bool UcxWorker::ReplyEndpointNativeRma(const ReplyEndpoint& reply_ep) const {
  if (!EndpointStillIs(reply_ep.ep, reply_ep.serial)) return false;
  return ParseHasRmaLane(CaptureEpInfo(static_cast<ucp_ep_h>(reply_ep.ep)));
}

bool UcxWorker::ReplyEndpointGone(const ReplyEndpoint& reply_ep) const {
  if (EndpointStillIs(reply_ep.ep, reply_ep.serial)) return false;
  NoteReplyToGoneEndpoint();
  return true;
}

unsigned UcxWorker::Progress() {
  ++inside_ucx_;
  const unsigned count = ucp_worker_progress(worker_);
  --inside_ucx_;
  CloseDeferred();
  return count;
}

void UcxWorker::CloseEndpoint(ucp_ep_h ep, std::shared_ptr<EndpointHealth> health) {
  if (inside_ucx_ > 0) {
    // Inside one of UCX's callbacks (a completion, an error handler): UCX may still be
    // working on this very endpoint when the callback returns. UCX 1.13 completes a
    // failed endpoint's flush from inside ucp_ep_set_failed, between the discards of
    // its lanes; closing the endpoint there freed it under that loop, and the next
    // lane's discard crashed the process. So the close waits until UCX has returned.
    deferred_closes_.push_back({ep, std::move(health)});
    return;
  }
  // An endpoint to a same-host process: closed once that process ended, and then
  // destroyed; UCX 1.13 would keep it until the worker ends, the peer's or not. One whose
  // process already ended waits too, for the reclaim's next looks (ReclaimGate). One UCX
  // failed is closed by force now, which destroys it.
  if (!stopping_.load()) {
    const PeerProcess process = EndpointPeerProcess(ep);
    if (process != PeerProcess::kNone && !health->failed) {
      if (same_host_held_.size() >= kMaxHeldCloses) {
        // The oldest is closed now: UCX keeps it until the worker ends, as it did.
        if (!held_full_warned_) {
          held_full_warned_ = true;
          kLog.Warn(
              "UCX worker '{}': {} endpoints closed while their same-host peer still "
              "ran wait for it to end; the oldest are closed now and UCX keeps them "
              "until this agent restarts. A peer reconnected that often: look at why",
              name_, same_host_held_.size());
        }
        DeferredClose oldest = std::move(same_host_held_.front());
        same_host_held_.erase(same_host_held_.begin());
        CloseNow(oldest.ep, std::move(oldest.health));
      }
      same_host_held_.push_back({ep, std::move(health)});
      return;
    }
    if (process == PeerProcess::kEnded) ReclaimEndpoint(ep);
  }
  CloseNow(ep, std::move(health));
}

void UcxWorker::CloseNow(ucp_ep_h ep, std::shared_ptr<EndpointHealth> health) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // Read now, not when the close was asked for: UCX may have failed it since.
  param.flags = health->failed ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ++inside_ucx_;  // a force close completes the endpoint's requests in this call
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
  --inside_ucx_;
  if (UCS_PTR_IS_PTR(request)) {
    pending_requests_.push_back({request, std::move(health)});
  } else if (UCS_PTR_STATUS(request) != UCS_OK) {
    kLog.Debug("UCX worker '{}': endpoint close returned {}", name_,
               UcsStatusText(UCS_PTR_STATUS(request)));
  }
  CloseDeferred();
}

void UcxWorker::CloseDeferred() {
  if (inside_ucx_ > 0) return;
  while (!deferred_closes_.empty()) {
    DeferredClose next = std::move(deferred_closes_.front());
    deferred_closes_.erase(deferred_closes_.begin());
    CloseEndpoint(next.ep, std::move(next.health));
  }
}

void UcxWorker::TendSameHostEndpoints() {
  if (!serves_peers_) return;
  const auto now = std::chrono::steady_clock::now();
  if (now < next_same_host_look_) return;
  next_same_host_look_ = now + std::chrono::seconds(1);
  reclaim_gate_.StartLook();
  const auto ready = [this](const void* ep) {
    return reclaim_gate_.Ready({ep, EndpointSerial(ep)});
  };
  for (size_t i = 0; i < same_host_held_.size();) {
    if (EndpointPeerProcess(same_host_held_[i].ep) == PeerProcess::kRunning ||
        !ready(same_host_held_[i].ep)) {
      ++i;
      continue;
    }
    DeferredClose close = std::move(same_host_held_[i]);
    same_host_held_.erase(same_host_held_.begin() + static_cast<std::ptrdiff_t>(i));
    ReclaimEndpoint(close.ep);
    CloseNow(close.ep, std::move(close.health));
  }
  std::vector<const void*> made = PeerMadeOfEndedProcesses(worker_);
  made.erase(std::remove_if(made.begin(), made.end(), [&](const void* ep) { return !ready(ep); }),
             made.end());
  reclaim_gate_.EndLook();
  for (const void* each : made) {
    // UCP made it for the peer's request and never handed it to this agent; its peer
    // ended, so nothing uses it. Its close flushes what it still sends, then UCP
    // destroys it. A close that waits (sends queued to a FIFO nobody reads) is left to
    // UCX, which frees its request when it ends: not polled for.
    ucp_ep_h ep = static_cast<ucp_ep_h>(const_cast<void*>(each));
    ReclaimEndpoint(ep);
    ucp_request_param_t param{};
    ++inside_ucx_;
    ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
    --inside_ucx_;
    if (UCS_PTR_IS_PTR(request)) {
      ucp_request_free(request);
    } else if (UCS_PTR_STATUS(request) != UCS_OK) {
      kLog.Warn(
          "UCX worker '{}': closing the endpoint made for a same-host peer that ended "
          "returned {}; it stays until this agent restarts",
          name_, UcsStatusText(UCS_PTR_STATUS(request)));
    }
  }
  if (!made.empty()) {
    kLog.Info(
        "UCX worker '{}': released {} endpoint(s) UCX made for same-host peers whose "
        "process ended ({} released so far, this agent's own included)",
        name_, made.size(), EndpointsReclaimed());
  }
  CloseDeferred();
}

void UcxWorker::ReapRequests() {
  auto it = pending_requests_.begin();
  while (it != pending_requests_.end()) {
    ucs_status_t status = ucp_request_check_status(it->request);
    if (status == UCS_INPROGRESS) {
      ++it;
      continue;
    }
    if (status != UCS_OK) {
      kLog.Debug("UCX worker '{}': endpoint close finished with {}", name_,
                 UcsStatusText(status));
    }
    ucp_request_free(it->request);
    it = pending_requests_.erase(it);
  }
}

void UcxWorker::SetPoller(WorkerPoller* poller) {
  RunSync([this, poller] {
    if (poller_fd_ >= 0) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, poller_fd_, nullptr);
    poller_ = poller;
    poller_fd_ = -1;
    if (poller == nullptr) return;
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = poller->fd();
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, poller->fd(), &event) == 0) {
      poller_fd_ = poller->fd();
    } else {
      // Still polled every loop and at its sleep timeout; only its doorbell is lost.
      kLog.Error("UCX worker '{}': epoll_ctl for the poller's descriptor failed: {}; it is "
                 "looked at every {} ms instead",
                 name_, std::strerror(errno), poller->SleepTimeoutMs());
    }
  });
}

void UcxWorker::Loop() {
  std::string thread_name = name_.substr(0, 15);  // the kernel's limit
  pthread_setname_np(pthread_self(), thread_name.c_str());
  tl_progressing = this;
  epoll_event events[3];
  const auto spin = std::chrono::microseconds(spin_us_);
  auto last_work = std::chrono::steady_clock::now();
  auto last_polled = last_work;  // when the poller last took something
  while (!stopping_.load()) {
    // The poller first: what it submits is posted here and runs in this same loop.
    bool polled = poller_ != nullptr && poller_->Poll();
    bool worked = DrainQueue();
    if (!timers_.empty()) worked |= RunTimers(std::chrono::steady_clock::now());
    bool progressed = false;
    while (Progress() != 0) worked = progressed = true;
    TendTagSink();
    TendRetireFlush();
    // Every 1,024th round, and before each sleep (below): no clock read per round.
    if ((++rounds_ & 1023) == 0) TendSameHostEndpoints();
    ReapRequests();
    if (spin_us_ != 0 || poller_ != nullptr) {
      const auto now = std::chrono::steady_clock::now();
      if (worked) last_work = now;
      if (polled) last_polled = now;
      // Poll a while before sleeping: after UCX work for spin_us_, after the poller's
      // for its own spin (a reply to what it sent often comes within it).
      if (spin_us_ != 0 && now - last_work < spin) continue;
      if (poller_ != nullptr && now - last_polled < std::chrono::microseconds(poller_->spin_us())) {
        continue;
      }
    }
    TendSameHostEndpoints();  // before arming, so the arm sees what its closes start
    ucs_status_t status = ucp_worker_arm(worker_);
    // Arm keeps reporting a message progress never takes (ReceiveStall): sleep 1 ms
    // below instead of looping at once (spinning on it took a whole core).
    const bool stalled = NoteReceiveStall(progressed, status == UCS_ERR_BUSY);
    // What ReclaimGate needs to know: no slot of a receive queue left claimed. Arm said
    // OK, or only sends wait (to a peer that reads nothing: maybe the very process that
    // ended, whose endpoint must go for them to end).
    if (status == UCS_OK || receive_stall_.only_sends_wait()) reclaim_gate_.ArmedOk();
    if (status == UCS_ERR_BUSY && !stalled) continue;  // events arrived since the last progress
    if (status != UCS_OK && !stalled) {
      kLog.Error("UCX worker '{}': ucp_worker_arm failed ({}); polling", name_,
                 UcsStatusText(status));
    }
    WorkerPoller* poller = poller_;
    if (poller != nullptr && !poller->PrepareSleep()) {
      poller->Woke(/*rang=*/false);  // its work came meanwhile: take it now
      continue;
    }
    if (posted_here_) {  // this thread posted a closure since its last look: no sleep
      if (poller != nullptr) poller->Woke(/*rang=*/false);
      continue;
    }
    // Pending closes and a failed arm are polled; otherwise sleep until woken, or for a
    // second at most: a same-host sender that dies between taking this worker's wake-up
    // request and sending the signal leaves it asleep with messages waiting (UCX's
    // shared-memory FIFO: the first sender after arm owns the wake-up), and every later
    // sender sees none requested. The look a second later takes them, or finds the slot
    // it left unfinished (ReceiveStall). One wake-up a second when idle.
    // A flush in flight is polled too: UCX sends what waits before it as the socket
    // takes it, and does not always wake this thread for that.
    const bool flushing = retire_flush_ != nullptr;
    int timeout_ms = stalled                                                      ? 1
                     : (status != UCS_OK || !pending_requests_.empty() || flushing) ? 10
                                                                                    : 1000;
    if (poller != nullptr) {
      const int limit = poller->SleepTimeoutMs();
      if (limit >= 0 && (timeout_ms < 0 || limit < timeout_ms)) timeout_ms = limit;
    }
    if (!timers_.empty()) {
      const int next = MsToNextTimer(std::chrono::steady_clock::now());
      if (next >= 0 && next < timeout_ms) timeout_ms = next;
    }
    int count = epoll_wait(epoll_fd_, events, 3, timeout_ms);
    bool rang = false;
    for (int i = 0; i < count; ++i) {
      if (events[i].data.fd == event_fd_) {
        uint64_t value;
        while (read(event_fd_, &value, sizeof(value)) < 0 && errno == EINTR) {
        }
      }
      rang = rang || (poller_fd_ >= 0 && events[i].data.fd == poller_fd_);
    }
    if (poller != nullptr) poller->Woke(rang);
  }
  Shutdown();
}

bool UcxWorker::NoteReceiveStall(bool progressed, bool arm_busy) {
  // The clock only while a streak may run (arm busy, nothing taken): not on every loop.
  const uint64_t now_us = arm_busy && !progressed ? MonotonicMicros() : 0;
  if (receive_stall_.Observe(progressed, arm_busy, now_us, [this] { return ReceiveQueueBusy(); })) {
    if (receive_stall_.stalled()) {
      receive_stalled_since_us_.store(receive_stall_.receive_busy_since_us());
      kLog.Error(
          "UCX worker '{}': its receive queue has not drained for {} ms: UCX reports a "
          "message waiting that progress never takes. A same-host peer most likely "
          "died (or was stopped) while writing into this worker's shared-memory "
          "receive queue (posix/sysv), which every same-host peer shares: nothing "
          "arrives over UCX until this agent restarts (a stopped peer that resumes "
          "unblocks it). Health says NOT_SERVING meanwhile",
          name_, (now_us - receive_stall_.receive_busy_since_us()) / 1000);
    } else {
      receive_stalled_since_us_.store(0);
      kLog.Warn("UCX worker '{}': its receive queue drains again", name_);
    }
    if (receive_stall_listener_) receive_stall_listener_();
  }
  if (!receive_stall_.stuck()) {
    send_wait_logged_ = false;
  } else if (receive_stall_.only_sends_wait() && !send_wait_logged_) {
    send_wait_logged_ = true;
    kLog.Warn(
        "UCX worker '{}': sends have waited in UCX for {} ms with nothing else to do: a "
        "same-host peer reads nothing (stopped, or its agent stuck) and its receive "
        "queue is full. This agent's own receive queue drains; it looks every "
        "millisecond until they go (transfers to that peer end at their deadline, or "
        "when its liveness door stops answering)",
        name_, (now_us - receive_stall_.busy_since_us()) / 1000);
  }
  return receive_stall_.stuck() && arm_busy;
}

bool UcxWorker::ReceiveQueueBusy() {
  if (shm_interfaces_.empty()) return true;  // none to ask: arm's word stands
  for (void* iface : shm_interfaces_) {
    if (uct_iface_event_arm(static_cast<uct_iface_h>(iface), UCT_EVENT_RECV) == UCS_ERR_BUSY) {
      return true;
    }
  }
  return false;
}

void UcxWorker::SetReceiveStallListener(std::function<void()> listener) {
  RunSync([this, &listener] { receive_stall_listener_ = std::move(listener); });
}

void UcxWorker::Shutdown() {
  DrainQueue();
  // Every timer runs now (stopping() is true): what waits on one ends.
  RunTimers(std::chrono::steady_clock::now(), /*all=*/true);
  // The receive for any tag: canceled (none is posted again, stopping_ is set), and
  // freed (UCX releases it once the cancel completes it).
  if (tag_sink_ != nullptr) {
    ucp_request_cancel(worker_, tag_sink_);
    ucp_request_free(tag_sink_);
    tag_sink_ = nullptr;
  }
  // Endpoints their owners left open: close them so the worker can be destroyed.
  for (Endpoint* endpoint : endpoints_) endpoint->Close();
  endpoints_.clear();
  // Closes held while a same-host peer ran: now (UCX keeps what has a connection from
  // its peer until the worker is destroyed below).
  for (DeferredClose& held : same_host_held_) CloseNow(held.ep, std::move(held.health));
  same_host_held_.clear();
  const auto deadline = std::chrono::steady_clock::now() + kShutdownBudget;
  for (;;) {
    DrainQueue();
    while (Progress() != 0) {
    }
    RunTimers(std::chrono::steady_clock::now(), /*all=*/true);  // set by what just ran
    ReapRequests();
    bool idle;
    {
      absl::MutexLock lock(&mu_);
      idle = queue_.empty() && pending_requests_.empty() && deferred_closes_.empty();
      if (idle || std::chrono::steady_clock::now() >= deadline) exited_ = true;
    }
    if (idle) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      DrainQueue();  // closures accepted before exited_ was set
      RunTimers(std::chrono::steady_clock::now(), /*all=*/true);
      kLog.Warn("UCX worker '{}': {} endpoint close(s) did not finish within {} s; the "
                "peer is unresponsive, releasing anyway",
                name_, pending_requests_.size(), kShutdownBudget.count());
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (const PendingClose& close : pending_requests_) ucp_request_free(close.request);
  pending_requests_.clear();
  if (retire_flush_ != nullptr) ucp_request_free(retire_flush_);
  retire_flush_ = nullptr;
  // The endpoints UCX made for peers' wireup requests are not ours to close, and the
  // reply to a request can still wait in one (its connection back to the peer not yet
  // up): UCX 1.13 asserts on a waiting reply when it destroys the worker
  // (ucp_request_send_state_ff, "got REP message"; seen when a peer connected just
  // before this worker went). A worker flush sends what waits, while the peer takes it.
  FlushBeforeDestroy();
  ForgetPutsOf(worker_);
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
  // Its endpoints and whatever they still had to send are gone with it.
  if (serves_peers_) LeaveRetireFlushes(this);
}

void UcxWorker::FlushBeforeDestroy() {
  ucp_request_param_t param{};
  ucs_status_ptr_t flush = ucp_worker_flush_nbx(worker_, &param);
  if (!UCS_PTR_IS_PTR(flush)) return;  // nothing waited (or it failed at once)
  const auto until = std::chrono::steady_clock::now() + kShutdownFlushBudget;
  while (ucp_request_check_status(flush) == UCS_INPROGRESS &&
         std::chrono::steady_clock::now() < until) {
    if (ucp_worker_progress(worker_) == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  if (ucp_request_check_status(flush) == UCS_INPROGRESS) {
    kLog.Warn("UCX worker '{}': what it held for peers' endpoints was not sent within {} ms; "
              "destroying it anyway",
              name_, kShutdownFlushBudget.count());
  }
  ucp_request_free(flush);
}

// ---------------------------------------------------------------------------
// RemoteKey

RemoteKey& RemoteKey::operator=(RemoteKey&& other) noexcept {
  if (this != &other) {
    if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
    rkey_ = std::exchange(other.rkey_, nullptr);
  }
  return *this;
}

RemoteKey::~RemoteKey() {
  if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
}

std::string_view ErrorModeName(ErrorMode mode) {
  return mode == ErrorMode::kPeer ? "peer" : "none";
}

// ---------------------------------------------------------------------------
// Endpoint

absl::StatusOr<std::unique_ptr<Endpoint>> Endpoint::Connect(
    UcxWorker& worker, std::string_view remote_address, ErrorMode mode,
    std::function<void(absl::Status)> on_error) {
  if (!worker.OnWorkerThread()) {
    return absl::FailedPreconditionError(fmt::format(
        "UCX worker '{}': Endpoint::Connect called off the worker thread; call it from a "
        "closure given to Post/RunSync",
        worker.name_));
  }
  if (remote_address.empty() || remote_address.size() > kMaxAddressBytes ||
      (static_cast<uint8_t>(remote_address[0]) & 0x0f) > kMaxAddressVersion) {
    return absl::InvalidArgumentError(fmt::format(
        "UCX worker '{}': peer worker address ({} bytes) is not a UCX {} worker address; "
        "pass the bytes the peer's ucp_worker_get_address returned (GetMetadata)",
        worker.name_, remote_address.size(), ucp_get_version_string()));
  }
  std::string padded(remote_address);
  padded.resize(remote_address.size() + kAddressPadding, '\0');

  std::unique_ptr<Endpoint> endpoint(new Endpoint(worker, mode));
  endpoint->health_ = std::make_shared<EndpointHealth>();
  endpoint->health_->worker = &worker;
  endpoint->health_->worker_name = &worker.name_;
  endpoint->health_->on_error = std::move(on_error);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.address = reinterpret_cast<const ucp_address_t*>(padded.data());
  if (mode == ErrorMode::kPeer) {
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.err_handler.cb = ErrorCallback;
    params.err_handler.arg = endpoint->health_.get();
  } else {
    params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  }
  TakeSameHostRefusal();  // none left from an earlier call on this thread
  ucs_status_t status = ucp_ep_create(worker.get(), &params, &endpoint->ep_);
  // A reach refused while UCX set the endpoint up names something that is not the
  // peer's: the peer is refused, even should UCX have gone on without that lane.
  if (std::string refused = TakeSameHostRefusal(); !refused.empty()) {
    if (status == UCS_OK) {
      endpoint->health_->failed = true;  // closed at once, by force
    } else {
      endpoint->ep_ = nullptr;
    }
    return absl::PermissionDeniedError(fmt::format(
        "UCX worker '{}': connecting to the peer's worker address was refused: {}; a "
        "same-host peer must give its own worker's address (GetMetadata), and be "
        "connected through its local door (unix:PATH) to share memory (over its network "
        "door, use --ucx-error-mode peer)",
        worker.name_, refused));
  }
  if (status != UCS_OK) {
    endpoint->ep_ = nullptr;
    return UcxError(status,
                    fmt::format("UCX worker '{}': connecting to peer worker address ({} bytes, "
                                "error mode {}) failed; check the peer is running and shares "
                                "a transport with us (UCX_TLS on both sides)",
                                worker.name_, remote_address.size(), ErrorModeName(mode)));
  }
  endpoint->native_rma_ = ParseHasRmaLane(CaptureEpInfo(endpoint->ep_));
  worker.endpoints_.insert(endpoint.get());
  return endpoint;
}

Endpoint::~Endpoint() {
  if (ep_ == nullptr) return;  // the worker already closed it at its shutdown
  worker_.endpoints_.erase(this);
  Close();
}

void Endpoint::Close() {
  health_->closed = true;
  ucp_ep_h ep = ep_;
  ep_ = nullptr;
  worker_.CloseEndpoint(ep, health_);
}

void Endpoint::ErrorCallback(void* arg, ucp_ep_h, ucs_status_t status) {
  // Called from progress; an operation UCX failed with the endpoint may have reported
  // it already. The argument is the endpoint's health, not the endpoint: UCX may call
  // this after the endpoint object is gone, while its close waits (CloseEndpoint).
  auto* health = static_cast<EndpointHealth*>(arg);
  ReportPeerLost(health->shared_from_this(), status, /*defer=*/false);
}

absl::Status Endpoint::Unusable(std::string_view op) const {
  return absl::UnavailableError(fmt::format(
      "UCX worker '{}': {} on an endpoint that is {}; reconnect to the peer", worker_.name_,
      op, ep_ == nullptr ? "closed (worker shut down)" : "failed (peer died)"));
}

std::string Endpoint::ReadLanes() {
  if (ep_ == nullptr) return "";
  const std::string info = CaptureEpInfo(ep_);
  native_rma_ = ParseHasRmaLane(info);
  return absl::StrJoin(ParseLaneTransports(info), ",");
}

absl::StatusOr<RemoteKey> Endpoint::UnpackRkey(std::string_view packed) const {
  if (ep_ == nullptr || health_->failed) return Unusable("unpacking a remote key");
  if (packed.empty()) {
    return absl::InvalidArgumentError(fmt::format(
        "UCX worker '{}': the peer's packed remote key is empty; the peer must send the "
        "ucp_rkey_pack bytes of its region (GetMetadata)",
        worker_.name_));
  }
  if (packed.size() > kMaxRkeyBytes) {
    return absl::InvalidArgumentError(fmt::format(
        "UCX worker '{}': the peer's packed remote key is {} bytes, over {}; the peer must "
        "send the ucp_rkey_pack bytes of its region (GetMetadata)",
        worker_.name_, packed.size(), kMaxRkeyBytes));
  }
  if (const std::string why = RkeyLayoutError(packed); !why.empty()) {
    return absl::InvalidArgumentError(fmt::format(
        "UCX worker '{}': the peer's packed remote key is not one: {}; the peer must send "
        "the ucp_rkey_pack bytes of its region (GetMetadata)",
        worker_.name_, why));
  }
  // Kept zero past the key between calls (worker thread): each call copies its key in
  // and zeroes it after.
  thread_local std::vector<char> padded(kMaxRkeyBytes + kRkeyPadding, '\0');
  std::memcpy(padded.data(), packed.data(), packed.size());
  ucp_rkey_h rkey = nullptr;
  TakeRkeyRefusal();  // one left by a key UCX unpacked for itself (a peer's rendezvous)
  ucs_status_t status = ucp_ep_rkey_unpack(ep_, padded.data(), &rkey);
  std::memset(padded.data(), 0, packed.size());
  if (status != UCS_OK) {
    return UcxError(status, fmt::format("UCX worker '{}': unpacking a {}-byte remote key "
                                        "failed; the key is corrupt or from a UCX with "
                                        "transports we lack",
                                        worker_.name_, packed.size()));
  }
  // An entry refused by UnpackRkeyEntry (kvagentd) left the key without its domain.
  if (std::string refused = TakeRkeyRefusal(); !refused.empty()) {
    ucp_rkey_destroy(rkey);
    return absl::InvalidArgumentError(fmt::format(
        "UCX worker '{}': the peer's {}-byte remote key was refused: {}; the peer must send "
        "the ucp_rkey_pack bytes of its region (GetMetadata)",
        worker_.name_, packed.size(), refused));
  }
  return RemoteKey(rkey);
}

absl::Status Endpoint::Put(const void* local, uint64_t length, uint64_t remote_address,
                           const RemoteKey& rkey) {
  if (ep_ == nullptr || health_->failed) return Unusable("put");
  ucp_request_param_t param{};
  ucs_status_ptr_t request = ucp_put_nbx(ep_, local, length, remote_address, rkey.get(), &param);
  if (UCS_PTR_IS_ERR(request)) {
    if (mode_ == ErrorMode::kPeer && PeerLost(UCS_PTR_STATUS(request))) {
      ReportPeerLost(health_, UCS_PTR_STATUS(request), /*defer=*/true);
    }
    return UcxError(UCS_PTR_STATUS(request),
                    fmt::format("UCX worker '{}': put of {} bytes to remote 0x{:x} failed",
                                worker_.name_, length, remote_address));
  }
  if (request != nullptr) ucp_request_free(request);  // Flush observes completion
  return absl::OkStatus();
}

absl::Status Endpoint::Get(void* local, uint64_t length, uint64_t remote_address,
                           const RemoteKey& rkey) {
  if (ep_ == nullptr || health_->failed) return Unusable("get");
  ucp_request_param_t param{};
  ucs_status_ptr_t request = ucp_get_nbx(ep_, local, length, remote_address, rkey.get(), &param);
  if (UCS_PTR_IS_ERR(request)) {
    if (mode_ == ErrorMode::kPeer && PeerLost(UCS_PTR_STATUS(request))) {
      ReportPeerLost(health_, UCS_PTR_STATUS(request), /*defer=*/true);
    }
    return UcxError(UCS_PTR_STATUS(request),
                    fmt::format("UCX worker '{}': get of {} bytes from remote 0x{:x} failed",
                                worker_.name_, length, remote_address));
  }
  if (request != nullptr) ucp_request_free(request);  // Flush observes completion
  return absl::OkStatus();
}

void Endpoint::Flush(Completion done) {
  if (ep_ == nullptr || health_->failed) {
    done(Unusable("flush"));
    return;
  }
  auto op = std::make_unique<SendOp>();
  op->done = std::move(done);
  op->kind = SendOp::Kind::kFlush;
  op->worker = &worker_.name_;
  if (mode_ == ErrorMode::kPeer) op->health = health_;
  StartSend(std::move(op), [this](SendOp*, const ucp_request_param_t& param) {
    return ucp_ep_flush_nbx(ep_, &param);
  });
}

void Endpoint::SendAm(uint16_t id, std::string_view header, std::string_view data,
                      Completion done, bool want_reply) {
  if (ep_ == nullptr || health_->failed) {
    if (done) done(Unusable("sending an active message"));
    return;
  }
  if (absl::Status fits = worker_.CheckAmHeader(id, header.size()); !fits.ok()) {
    kLog.Warn("{}: {}", worker_.name_, fits.message());
    if (done) done(std::move(fits));
    return;
  }
  auto op = std::make_unique<SendOp>();
  op->done = std::move(done);
  op->worker = &worker_.name_;
  op->id = id;
  if (mode_ == ErrorMode::kPeer) op->health = health_;
  op->header_bytes = header.size();
  op->data_bytes = data.size();
  worker_.CountSent(id);
  op->payload.reserve(header.size() + data.size());
  op->payload.append(header).append(data);
  const size_t header_size = header.size();
  StartSend(std::move(op), [this, id, header_size, want_reply](SendOp* send,
                                                                ucp_request_param_t& param) {
    if (want_reply) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
      param.flags |= UCP_AM_SEND_FLAG_REPLY;
    }
    if (EagerOnly()) ForceEager(param, send->payload.size() - header_size, !native_rma_);
    const char* bytes = send->payload.data();
    return ucp_am_send_nbx(ep_, id, header_size > 0 ? bytes : nullptr, header_size,
                           bytes + header_size, send->payload.size() - header_size, &param);
  });
}

void Endpoint::SendAmNoCopy(uint16_t id, std::string_view header, const void* data,
                            uint64_t length, Completion done) {
  if (ep_ == nullptr || health_->failed) {
    if (done) done(Unusable("sending an active message"));
    return;
  }
  if (absl::Status fits = worker_.CheckAmHeader(id, header.size()); !fits.ok()) {
    kLog.Warn("{}: {}", worker_.name_, fits.message());
    if (done) done(std::move(fits));
    return;
  }
  auto op = std::make_unique<SendOp>();
  op->done = std::move(done);
  op->worker = &worker_.name_;
  op->id = id;
  if (mode_ == ErrorMode::kPeer) op->health = health_;
  op->header_bytes = header.size();
  op->data_bytes = length;
  worker_.CountSent(id);
  op->payload.assign(header.data(), header.size());  // the header only; data is referenced
  StartSend(std::move(op), [this, id, data, length](SendOp* send, ucp_request_param_t& param) {
    if (EagerOnly()) ForceEager(param, length, !native_rma_);
    return ucp_am_send_nbx(ep_, id, send->payload.empty() ? nullptr : send->payload.data(),
                           send->payload.size(), data, length, &param);
  });
}

void Endpoint::SendAmRequest(uint16_t id, std::string_view header, Completion done) {
  SendAm(id, header, {}, std::move(done), /*want_reply=*/true);
}

}  // namespace kvagent::transport

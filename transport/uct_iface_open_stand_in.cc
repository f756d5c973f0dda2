// uct_iface_open() in front of libuct's, for kvagentd: every UCT interface UCP opens
// gets a dropping handler on each active message id first (QuietUnusedUctIds,
// ucx_hardening.h), and UCP then installs its own over the ids it uses, so a peer's
// message of an id UCP never registers is counted instead of reaching UCT's stub
// handler (19 log lines and a backtrace each); its sends, pending queue and endpoint
// teardown count the replies held for requesters that do not read (WatchHeldReplies);
// its reachability probe takes a peer's address entry missing a part it reads as
// unreachable (GuardReachability); its worker's puts in flight are counted, against
// which peers' put completions are checked (WatchPutsOf); a posix interface checks its
// peers' FIFO addresses (WatchPosixInterface); and a posix or sysv interface is noted so
// that its worker keeps it in UCP's arm (NoteSharedMemoryInterface). kvagentd links this object and
// exports the symbol (-Wl,--export-dynamic-symbol=uct_iface_open in BUILD), so libucp's
// call binds to it; the next definition in the lookup order (libuct's) does the work.
#include <dlfcn.h>
#include <uct/api/uct.h>

#include <cstring>

#include "transport/ucx_hardening.h"

namespace {

using OpenFn = ucs_status_t (*)(uct_md_h, uct_worker_h, const uct_iface_params_t*,
                                const uct_iface_config_t*, uct_iface_h*);

OpenFn NextOpen() {
  static const OpenFn next = reinterpret_cast<OpenFn>(dlsym(RTLD_NEXT, "uct_iface_open"));
  return next;
}

}  // namespace

extern "C" ucs_status_t uct_iface_open(uct_md_h md, uct_worker_h worker,
                                       const uct_iface_params_t* params,
                                       const uct_iface_config_t* config, uct_iface_h* iface) {
  const OpenFn next = NextOpen();
  if (next == nullptr) return UCS_ERR_UNSUPPORTED;
  const ucs_status_t status = next(md, worker, params, config, iface);
  if (status == UCS_OK) {
    kvagent::transport::QuietUnusedUctIds(*iface);
    kvagent::transport::WatchHeldReplies(*iface);
    kvagent::transport::GuardReachability(*iface);
    if ((params->field_mask & UCT_IFACE_PARAM_FIELD_ERR_HANDLER_ARG) != 0) {
      // UCP gives each interface its worker as the error handler's argument.
      kvagent::transport::WatchPutsOf(*iface, params->err_handler_arg);
    }
    const char* tl = (params->field_mask & UCT_IFACE_PARAM_FIELD_OPEN_MODE) != 0 &&
                             (params->open_mode & UCT_IFACE_OPEN_MODE_DEVICE) != 0
                         ? params->mode.device.tl_name
                         : nullptr;
    const bool posix = tl != nullptr && std::strcmp(tl, "posix") == 0;
    if (posix) kvagent::transport::WatchPosixInterface(*iface);
    constexpr uint64_t kUcpFields =
        UCT_IFACE_PARAM_FIELD_ERR_HANDLER_ARG | UCT_IFACE_PARAM_FIELD_ASYNC_EVENT_ARG;
    if ((posix || (tl != nullptr && std::strcmp(tl, "sysv") == 0)) &&
        (params->field_mask & kUcpFields) == kUcpFields) {
      kvagent::transport::NoteSharedMemoryInterface(*iface, params->err_handler_arg,
                                                    params->async_event_arg,
                                                    reinterpret_cast<void* const*>(iface));
    }
  }
  return status;
}

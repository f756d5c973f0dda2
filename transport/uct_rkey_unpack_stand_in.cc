// uct_rkey_unpack() in front of libuct's, for kvagentd: every entry of a remote key UCP
// unpacks (a peer's region key, a peer's rendezvous key) goes through UnpackRkeyEntry
// (ucx_hardening.h), which refuses entries naming a shared memory segment to attach and
// keeps UCX 1.13 from crashing on an entry it fails to unpack. kvagentd links this object
// and exports the symbol (-Wl,--export-dynamic-symbol=uct_rkey_unpack in BUILD), so
// libucp's call binds to it; the next definition in the lookup order (libuct's) does the
// work.
#include <dlfcn.h>
#include <uct/api/uct.h>

#include "transport/ucx_hardening.h"

extern "C" ucs_status_t uct_rkey_unpack(uct_component_h component, const void* rkey_buffer,
                                        uct_rkey_bundle_t* rkey_ob) {
  static const auto next = reinterpret_cast<kvagent::transport::RkeyUnpackFn>(
      dlsym(RTLD_NEXT, "uct_rkey_unpack"));
  if (next == nullptr) return UCS_ERR_UNSUPPORTED;
  return kvagent::transport::UnpackRkeyEntry(component, rkey_buffer, rkey_ob, next);
}

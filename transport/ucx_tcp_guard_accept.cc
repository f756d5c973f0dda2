// accept() in front of libc's, for kvagentd: UCX's libucs takes connections to its TCP
// transport with accept(), and each goes through UcxTcpAdmit first (ucx_tcp_guard.h).
// A binary (kvagentd) links this object and exports the symbol
// (-Wl,--export-dynamic-symbol=accept in BUILD), so libucs's call binds to it; the
// next accept() in the lookup order (libc's, or a sanitizer's) does the work.
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "transport/ucx_tcp_guard.h"

namespace {

using AcceptFn = int (*)(int, sockaddr*, socklen_t*);

AcceptFn NextAccept() {
  static const AcceptFn next = reinterpret_cast<AcceptFn>(dlsym(RTLD_NEXT, "accept"));
  return next;
}

[[maybe_unused]] const bool kNoted = [] {
  kvagent::transport::NoteUcxTcpAcceptStandIn();
  return true;
}();

}  // namespace

extern "C" int accept(int fd, sockaddr* address, socklen_t* length) {
  const AcceptFn next = NextAccept();
  if (next == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  const socklen_t room = length != nullptr ? *length : 0;
  for (;;) {
    const int got = next(fd, address, length);
    if (got < 0 || kvagent::transport::UcxTcpAdmit(got)) return got;
    close(got);  // refused before anyone read from it
    if (length != nullptr) *length = room;
    // Take the next one queued; a blocking listener would wait for it, so say none.
    const int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || (flags & O_NONBLOCK) == 0) {
      errno = EAGAIN;
      return -1;
    }
  }
}

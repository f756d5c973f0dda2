// accept(), recv(), send() and close() in front of libc's, for kvagentd: UCX's libucs
// takes connections to its TCP transport with accept(), and each goes through
// UcxTcpAdmit first (ucx_tcp_guard.h); it reads them with recv(), and what a kept
// connection brings is checked before UCT parses it (UcxTcpRecv); what it sends first
// on a connection it dialled names the connection a peer's request must name
// (UcxTcpSend); close() ends the watch of a descriptor. A binary (kvagentd) links this
// object and exports the symbols (-Wl,--export-dynamic-symbol in BUILD), so libucs's
// calls bind to them; the next definition in the lookup order (libc's, or a
// sanitizer's) does the work.
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "transport/ucx_tcp_guard.h"

namespace {

using AcceptFn = int (*)(int, sockaddr*, socklen_t*);
using CloseFn = int (*)(int);

AcceptFn NextAccept() {
  static const AcceptFn next = reinterpret_cast<AcceptFn>(dlsym(RTLD_NEXT, "accept"));
  return next;
}

kvagent::transport::RecvFn NextRecv() {
  static const auto next =
      reinterpret_cast<kvagent::transport::RecvFn>(dlsym(RTLD_NEXT, "recv"));
  return next;
}

kvagent::transport::SendFn NextSend() {
  static const auto next =
      reinterpret_cast<kvagent::transport::SendFn>(dlsym(RTLD_NEXT, "send"));
  return next;
}

CloseFn NextClose() {
  static const CloseFn next = reinterpret_cast<CloseFn>(dlsym(RTLD_NEXT, "close"));
  return next;
}

[[maybe_unused]] const bool kNoted = [] {
  kvagent::transport::NoteUcxTcpAcceptStandIn();
  kvagent::transport::NoteUcxTcpRecvStandIn();
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

extern "C" ssize_t recv(int fd, void* buffer, size_t length, int flags) {
  const kvagent::transport::RecvFn next = NextRecv();
  if (next == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  return kvagent::transport::UcxTcpRecv(fd, buffer, length, flags, next);
}

extern "C" ssize_t send(int fd, const void* buffer, size_t length, int flags) {
  const kvagent::transport::SendFn next = NextSend();
  if (next == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  return kvagent::transport::UcxTcpSend(fd, buffer, length, flags, next);
}

extern "C" int close(int fd) {
  kvagent::transport::ForgetUcxTcpStream(fd);
  const CloseFn next = NextClose();
  if (next == nullptr) return static_cast<int>(syscall(SYS_close, fd));
  return next(fd);
}

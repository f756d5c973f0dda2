"""The local session socket (proto "Local session protocol"): one SessionRequest or
SessionReply per SOCK_SEQPACKET datagram, descriptors as SCM_RIGHTS. Attaching says
hello; the agent identifies this process by SO_PEERCRED and answers with the token
every gRPC call carries. The session lasts while the socket is open: closing it (or
the process dying) ends it, and the agent frees what it held for it.
"""
import os
import socket
import threading
import time

from . import errors
from ._proto import kvagent_pb2 as pb

MAX_MESSAGE_BYTES = 64 * 1024
MAX_FDS = 64
PROTOCOL = 1


def session_path(local_socket):
    """The session socket of an agent's --local-socket PATH: PATH.session."""
    return local_socket + ".session"


class Session:
    """One session; calls are serialized (one request in flight, as the protocol says)."""

    def __init__(self, path, client_name, timeout=10.0):
        self.path = path
        self.timeout = timeout
        self._lock = threading.Lock()
        self._seq = 1
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except FileNotFoundError:
            self._sock.close()
            local = path[:-len(".session")] if path.endswith(".session") else "PATH"
            raise errors.error(
                14, f"{path}: no agent listens there (is kvagentd running with --local-socket "
                f"{local}?); start it, or pass the agent's --local-socket path", entry=path,
                fix="start kvagentd or pass its --local-socket path") from None
        except PermissionError:
            self._sock.close()
            raise errors.error(
                7, f"{path}: not accessible to uid {os.getuid()}; the operator grants access "
                "with --local-socket-group and adds this user to that group", entry=path) from None
        except OSError as e:
            self._sock.close()
            raise errors.error(14, f"{path}: cannot connect to the agent's session socket: {e}; "
                               "check the path and that kvagentd runs", entry=path) from None
        request = pb.SessionRequest()
        request.hello.client_name = client_name
        request.hello.protocol = PROTOCOL
        reply, _ = self.call(request, what=f"attaching to {path} as '{client_name}'")
        if not reply.HasField("welcome"):
            raise errors.error(13, f"the agent at {path} answered hello without a welcome; use a "
                               "client that matches the agent's version")
        self.welcome = reply.welcome

    @property
    def token(self):
        return self.welcome.token

    def close(self):
        self._sock.close()

    def fileno(self):
        return self._sock.fileno()

    def call(self, request, fds=(), what=None, timeout=None):
        """Sends `request` with `fds` and returns (reply, [descriptors received]).
        `timeout` (seconds; default the session's) bounds the whole call, the wait for
        another thread's call included (DeadlineExceeded)."""
        what = what or request.WhichOneof("body")
        if timeout is None:
            with self._lock:
                return self._call_locked(request, fds, what)
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            raise errors.error(4, f"another call on the session with the agent at {self.path} "
                               f"held it for {timeout} s", where=what)
        try:
            saved = self._sock.gettimeout()
            try:
                self._sock.settimeout(max(0.001, deadline - time.monotonic()))
            except OSError as e:  # closed
                raise errors.error(14, f"the session with the agent at {self.path} ended ({e}); "
                                   "connect again", where=what) from None
            try:
                return self._call_locked(request, fds, what)
            finally:
                try:
                    self._sock.settimeout(saved)
                except OSError:
                    pass
        finally:
            self._lock.release()

    def _call_locked(self, request, fds, what):
        seq = self._seq
        self._seq += 1
        request.seq = seq
        data = request.SerializeToString()
        try:
            if fds:
                socket.send_fds(self._sock, [data], list(fds))
            else:
                self._sock.send(data)
        except OSError as e:
            raise errors.error(14, f"the session with the agent at {self.path} ended ({e}); "
                               "connect again", where=what) from None
        while True:
            try:
                data, got, flags, _ = socket.recv_fds(self._sock, MAX_MESSAGE_BYTES, MAX_FDS)
            except socket.timeout:
                raise errors.error(4, f"no reply from the agent at {self.path} in time; it "
                                   "may be overloaded or hung", where=what) from None
            if not data:
                raise errors.error(14, f"the agent at {self.path} closed the session; "
                                   "connect again", where=what)
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                for fd in got:
                    os.close(fd)
                raise errors.error(13, f"a reply from the agent at {self.path} was truncated; "
                                   "use a client that matches the agent", where=what)
            reply = pb.SessionReply.FromString(data)
            if reply.seq != 0 and reply.seq < seq:  # late reply to a call that timed out
                for fd in got:
                    os.close(fd)
                continue
            if reply.error_code != 0:
                for fd in got:
                    os.close(fd)
                raise errors.error(reply.error_code,
                                   reply.error_message or "the agent gave no reason",
                                   where=what)
            return reply, got

    def allocate(self, label, nbytes):
        """AllocateMemory: (MemoryHandleInfo, descriptor of a sealed memfd)."""
        request = pb.SessionRequest()
        request.allocate.label = label
        request.allocate.bytes = nbytes
        reply, fds = self.call(request, what=f"allocating {nbytes} bytes '{label}'")
        if not reply.HasField("memory") or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise errors.error(13, f"the agent answered allocate '{label}' without memory info "
                               "and one descriptor; use a client that matches the agent")
        return reply.memory, fds[0]

    def share(self, fd, label):
        """ShareMemory: hands the agent a descriptor of host memory; `fd` stays ours."""
        request = pb.SessionRequest()
        request.share.label = label
        reply, fds = self.call(request, fds=[fd], what=f"sharing memory '{label}'")
        for extra in fds:
            os.close(extra)
        return reply.memory

    def share_device(self, fd, device, nbytes, label):
        """ShareDeviceMemory: a CUDA VMM allocation's POSIX descriptor."""
        request = pb.SessionRequest()
        request.share_device.label = label
        request.share_device.device = device
        request.share_device.bytes = nbytes
        reply, fds = self.call(request, fds=[fd], what=f"sharing device memory '{label}'")
        for extra in fds:
            os.close(extra)
        return reply.memory

    def free(self, handle):
        request = pb.SessionRequest()
        request.free.handle = handle
        self.call(request, what=f"freeing memory handle {handle}")

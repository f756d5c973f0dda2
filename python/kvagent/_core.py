"""What the sync Client and the asyncio AsyncClient share: the session, the buffers,
the groups this client registered, and the requests built from engine terms. The two
clients differ only in how they call the agent (grpc vs grpc.aio)."""
import contextlib
import itertools
import os

import grpc

from . import errors, memory
from ._proto import kvagent_pb2 as pb
from .session import Session, session_path

TOKEN_KEY = "kvagent-session"
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1),
                   ("grpc.max_receive_message_length", 64 << 20)]
DEFAULT_SOCKET = "/run/kvagent/kvagent.sock"
TERMINAL = {pb.COMPLETED, pb.FAILED, pb.CANCELLED, pb.TIMED_OUT}
OPS = {"write": pb.WRITE, "read": pb.READ}
# complete_when: when the sending agent reports COMPLETED (SubmitTransferRequest.complete_when).
COMPLETION_POINTS = {"acknowledged": pb.COMPLETE_WHEN_ACKNOWLEDGED,
                     "placed": pb.COMPLETE_WHEN_PLACED}


class InvalidCompletionPoint(errors.InvalidArgument, ValueError):
    """A complete_when that is neither "acknowledged" nor "placed" (nor their pb values),
    found before anything was sent: an InvalidArgument, and a ValueError."""


def completion_point(value, entry="complete_when"):
    """The pb CompletionPoint of `value`: "acknowledged" or "placed", or a pb value
    (kvagent.pb.COMPLETE_WHEN_ACKNOWLEDGED / COMPLETE_WHEN_PLACED, or their names).
    Anything else raises InvalidCompletionPoint (a ValueError) naming the value."""
    if isinstance(value, str):
        if value in COMPLETION_POINTS:
            return COMPLETION_POINTS[value]
        if value in pb.CompletionPoint.keys():
            return pb.CompletionPoint.Value(value)
    elif (isinstance(value, int) and not isinstance(value, bool)
          and value in COMPLETION_POINTS.values()):
        return int(value)
    entry = f"{entry} {value!r}"
    fix = ("use complete_when='acknowledged' (the default: COMPLETED once the peer "
           "acknowledged the data) or 'placed' (COMPLETED as soon as every byte is in place), "
           "or kvagent.pb.COMPLETE_WHEN_ACKNOWLEDGED / COMPLETE_WHEN_PLACED")
    raise InvalidCompletionPoint(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"{entry}: is not a completion point; {fix}", entry=entry, fix=fix)


class Group:
    """A group this client registered: its kind and regions (names, in group order)."""

    def __init__(self, name, kind, layouts, names):
        self.name = name
        self.kind = kind
        self.layouts = layouts
        self.regions = names

    @property
    def num_items(self):
        return min(l.num_items for l in self.layouts)

    def __repr__(self):
        return (f"Group({self.name!r}, {pb.RegionKind.Name(self.kind)}, {len(self.regions)} "
                f"regions, {self.num_items} items)")


def indices(values, what):
    """A list of non-negative ints from ints, a list or a 1-D int tensor/array."""
    try:
        out = [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
    except (TypeError, ValueError):
        raise errors.invalid(what, f"{values!r} is not a list of integers",
                             "pass page or slot ids as a list of ints (or a 1-D int tensor)")
    if any(v < 0 for v in out):
        raise errors.invalid(what, f"negative id in {out}", "ids are item indices, 0 or more")
    return out


class Base:
    def __init__(self, local_socket, name, timeout):
        local_socket = local_socket or os.environ.get("KVAGENT_SOCKET", DEFAULT_SOCKET)
        if local_socket.startswith("unix:"):
            local_socket = local_socket[len("unix:"):]
        self.local_socket = local_socket
        self.address = "unix:" + local_socket  # what a same-host peer passes to connect_peer
        self.name = name or f"py{os.getpid()}"
        self.timeout = timeout
        self.session = Session(session_path(local_socket), self.name, timeout)
        self.metadata = ((TOKEN_KEY, self.session.token),)
        self.buffers = []
        self.groups = {}
        self._ids = itertools.count()

    @property
    def agent_name(self):
        return self.session.welcome.agent

    # ---- memory ------------------------------------------------------------------
    def allocate(self, nbytes, label=None):
        """A sealed memfd the agent allocates (AllocateMemory), mapped here."""
        label = label or f"{self.name}.buf{next(self._ids)}"
        info, fd = self.session.allocate(label, nbytes)
        buf = memory.SharedBuffer(info, fd, owned_by_agent=True)
        self.buffers.append(buf)
        return buf

    def memfd(self, nbytes, label=None):
        """This process's own memfd (os.memfd_create), shared with the agent by
        descriptor (ShareMemory), mapped here."""
        label = label or f"{self.name}.memfd{next(self._ids)}"
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            info = self.session.share(fd, label)
        except BaseException:
            os.close(fd)
            raise
        buf = memory.SharedBuffer(info, fd, owned_by_agent=False)
        self.buffers.append(buf)
        return buf

    def share_memory(self, fd, label=None):
        """Shares a descriptor of host memory this process already has (memfd, shm,
        hugetlbfs); maps it here too. The descriptor is duplicated: yours stays yours."""
        label = label or f"{self.name}.shared{next(self._ids)}"
        info = self.session.share(fd, label)
        buf = memory.SharedBuffer(info, os.dup(fd), owned_by_agent=False)
        self.buffers.append(buf)
        return buf

    def empty(self, shape, dtype, label=None):
        """A tensor in a new agent-allocated buffer of its size (uninitialized)."""
        import torch
        nbytes = torch.empty((), dtype=dtype).element_size()
        for d in shape:
            nbytes *= int(d)
        return self.allocate(max(nbytes, 1), label).empty(shape, dtype)

    def _source(self, name, tensor, layout):
        if layout.device.startswith("cuda"):
            return memory.cuda_ipc_source(name, tensor, layout)
        for buf in self.buffers:
            if buf.contains(layout.address, layout.length):
                return ("shm", buf.handle, layout.address - buf.address)
        raise errors.invalid(
            name, f"its {layout.length} bytes at 0x{layout.address:x} are not in shared memory "
            "of this client (ordinary process memory cannot be mapped by the agent)",
            "create the tensor in memory from this client: client.empty(shape, dtype), "
            "client.allocate(n).empty(...), client.memfd(n) or client.share_memory(fd)")

    # ---- registration requests ---------------------------------------------------
    def _region_request(self, group, kind, named_tensors):
        """RegisterRegionsRequest for (role, tensor) pairs, items along dim 0."""
        if group in self.groups:
            raise errors.invalid(f"group '{group}'", "is already registered by this client",
                                 "give the new group another name")
        request = pb.RegisterRegionsRequest()
        layouts, names = [], []
        for role, tensor in named_tensors:
            name = f"{self.name}.{group}.{role}"
            layout = memory.tensor_layout(f"tensor '{role}' of group '{group}'", tensor)
            layout.source = self._source(f"tensor '{role}' of group '{group}'", tensor, layout)
            if kind == pb.KV and layouts and layout.dtype != layouts[0].dtype:
                raise errors.invalid(
                    f"tensor '{role}' of group '{group}'",
                    f"has dtype {layout.dtype}, the group's first tensor {layouts[0].dtype}",
                    "give every layer's K and V tensor the cache's one dtype")
            spec = request.regions.add(name=name, kind=kind, group=group, role=role)
            layout.fill(spec)
            layouts.append(layout)
            names.append(name)
        if not layouts:
            raise errors.invalid(f"group '{group}'", "has no tensors", "pass at least one tensor")
        return request, Group(group, kind, layouts, names)

    def _kv_request(self, k, v, group):
        if isinstance(k, dict):  # {layer name: tensor}: vLLM's kv_caches
            pairs = list(k.items())
            if v is None and all(_is_stacked_kv(t) for _, t in pairs):
                named = [(f"{n}.{kv}", t[i]) for n, t in pairs for i, kv in enumerate("KV")]
            else:
                named = [(n, t) for n, t in pairs]
            return self._region_request(group, pb.KV, named)
        k = list(k)
        if v is None:  # MLA: one latent tensor per layer
            named = [(f"L{i}", t) for i, t in enumerate(k)]
        else:
            v = list(v)
            if len(v) != len(k):
                raise errors.invalid(f"group '{group}'", f"{len(k)} K tensors but {len(v)} V",
                                     "pass one K and one V tensor per layer")
            named = [(f"L{i}.{kv}", t) for i, pair in enumerate(zip(k, v))
                     for kv, t in zip("KV", pair)]
        return self._region_request(group, pb.KV, named)

    def _state_request(self, tensors, group, slot_dim):
        if not isinstance(tensors, dict):
            tensors = {"state": tensors} if not isinstance(tensors, (list, tuple)) else {
                f"T{i}": t for i, t in enumerate(tensors)}
        named = []
        for label, tensor in tensors.items():
            for prefix, t in _split_leading(tensor, slot_dim, label):
                named.append((prefix, t))
        return self._region_request(group, pb.STATE, named)

    def _aux_request(self, tensor, group):
        return self._region_request(group, pb.AUX, [("aux", tensor)])

    @contextlib.contextmanager
    def _watching_notifications(self, request_ids, subscription, timeout):
        """A WatchNotifications stream (sync or aio), cancelled on exit; its timeout
        ends it quietly, other errors are KvAgentError."""
        request = pb.WatchNotificationsRequest(transfer_ids=[str(i) for i in request_ids],
                                               subscription=subscription)
        stream = self.stub.WatchNotifications(request, metadata=self.metadata, timeout=timeout)
        try:
            yield stream
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise errors.from_rpc(e, "WatchNotifications") from None
        finally:
            stream.cancel()

    # ---- transfer requests -------------------------------------------------------
    def _segments(self, request, op, kind, ids, remote_groups, what):
        if ids is None:
            return
        src, dst = ids
        src, dst = indices(src, f"{what} source ids"), indices(dst, f"{what} destination ids")
        if len(src) != len(dst):
            raise errors.invalid(f"{what} ids", f"{len(src)} source ids but {len(dst)} "
                                 "destination ids", "pair every source id with one destination id")
        groups = [g for g in self.groups.values() if g.kind == kind]
        if not groups:
            raise errors.invalid(what, f"this client registered no {pb.RegionKind.Name(kind)} "
                                 "group", f"register one first (register_"
                                 f"{ {pb.KV: 'kv_cache', pb.STATE: 'state', pb.AUX: 'aux'}[kind]})")
        local, remote = (src, dst) if op == pb.WRITE else (dst, src)
        for g in groups:
            items = request.segments.add().items
            items.local_group = g.name
            items.remote_group = (remote_groups or {}).get(g.name, g.name)
            items.local_indices.extend(local)
            items.remote_indices.extend(remote)

    def _transfer_request(self, peer, request_id, pages=None, slots=None, aux=None,
                          segments=(), notification=b"", op="write", timeout_ms=0,
                          remote_groups=None, chunk=0, more_chunks=False,
                          complete_when="acknowledged"):
        if isinstance(op, str):
            if op not in OPS:
                raise errors.invalid(f"op '{op}'", "is not a transfer op", "use 'write' or 'read'")
            op = OPS[op]
        point = completion_point(complete_when, f"transfer '{request_id}': complete_when")
        request = pb.SubmitTransferRequest(
            transfer_id=str(request_id), peer=getattr(peer, "name", peer), op=op,
            chunk=chunk, more_chunks=more_chunks, timeout_ms=timeout_ms, complete_when=point,
            notification=notification.encode() if isinstance(notification, str) else notification)
        self._segments(request, op, pb.KV, pages, remote_groups, "pages")
        self._segments(request, op, pb.STATE, slots, remote_groups, "state slots")
        self._segments(request, op, pb.AUX, aux, remote_groups, "aux")
        for s in segments:
            request.segments.add().CopyFrom(s)
        return request


class TransferBase:
    """What the sync Transfer and the awaitable AsyncTransfer share."""

    def __init__(self, client, transfer_id, state):
        self.client = client
        self.id = transfer_id
        self.last_state = state

    @contextlib.contextmanager
    def _watching(self, timeout):
        """A WatchTransfer stream of this transfer's states (sync or aio per client),
        cancelled on exit, its errors as KvAgentError."""
        stream = self.client.stub.WatchTransfer(pb.GetTransferRequest(transfer_id=self.id),
                                                metadata=self.client.metadata, timeout=timeout)
        try:
            yield stream
        except grpc.RpcError as e:
            raise errors.from_rpc(e, f"waiting for transfer '{self.id}'") from None
        finally:
            stream.cancel()

    def _settle(self, state):
        """The COMPLETED state, or TransferFailed with the agent's code and message."""
        self.last_state = state
        if state.phase != pb.COMPLETED:
            raise errors.TransferFailed(state)
        return state


def _is_stacked_kv(t):
    return len(getattr(t, "shape", ())) >= 2 and t.shape[0] == 2


def _split_leading(tensor, slot_dim, label):
    """[(role, view)] with slots along dim 0: one view per index of the dims before
    slot_dim (SGLang's Mamba pool: [layers, slots, ...] with slot_dim=1)."""
    if slot_dim == 0:
        return [(label, tensor)]
    if slot_dim < 0 or slot_dim >= len(tensor.shape):
        raise errors.invalid(f"state tensor '{label}'", f"slot_dim {slot_dim} is not a dimension "
                             f"of shape {list(tensor.shape)}", "give the dimension of the slots")
    out = []
    for i in range(tensor.shape[0]):
        out += _split_leading(tensor[i], slot_dim - 1, f"{label}.L{i}")
    return out


def byte_segment(local_region, local_offset, remote_region, remote_offset, length):
    """A raw byte-range Segment (AUX bytes by region name), for segments=[...]."""
    return pb.Segment(bytes=pb.ByteSegment(
        local_region=local_region, local_offset=local_offset, remote_region=remote_region,
        remote_offset=remote_offset, length=length))


def items_segment(local_group, remote_group, local_indices, remote_indices):
    """A raw item Segment between two named groups, for segments=[...]."""
    return pb.Segment(items=pb.ItemSegment(
        local_group=local_group, remote_group=remote_group,
        local_indices=indices(local_indices, "local indices"),
        remote_indices=indices(remote_indices, "remote indices")))

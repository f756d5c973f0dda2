"""SGLang's disaggregation backend roles on kvagent, in the shapes of
sglang/srt/disaggregation/base/conn.py (SGLang 0.4.7 - 0.5.x; see docs/ARCHITECTURE.md,
"Connectors", for what remains to wire inside SGLang):

- KvAgentManager(args: KVArgs, disaggregation_mode, server_args, is_mla_backend): one per
  worker; registers the worker's KV pages (kv_data_ptrs/lens/item_lens), aux buffers and
  state (state_data_ptrs/lens/item_lens: Mamba conv/SSM, one list per state type) with
  the local agent, each pointer inside memory the worker's kvagent.Client shared.
- KvAgentSender (prefill): init(num_kv_indices, aux_index), send(kv_indices,
  state_indices) as chunks arrive, poll() through Bootstrapping, WaitingForInput,
  Transferring, Success or Failed, failure_exception().
- KvAgentReceiver (decode): init(kv_indices, aux_index, state_indices) (send_metadata in
  newer SGLang), poll(), failure_exception().
- BootstrapServer (bootstrap.py) pairs them by bootstrap room.

One request is one agent transfer whose id is the bootstrap room: each send() is a
chunk (WRITE, prefill pages into the decode pages at the same positions of the
receiver's list); the last one also carries the state slots and aux records and the
notification, so decode sees Success only when KV, state and aux are all in place.

Chunks and notifications go through the worker session's fast path ring when it opens
one (KvAgentConfig.fast_path "auto", the default; "on": the ring or an error; "off":
gRPC), reaped inside poll(); the manager's `route` says which it took.

KvAgentConfig.complete_when ("acknowledged", the default, or "placed"; checked when the
manager is built, before it registers anything: anything else raises a ValueError naming
the setting, the value and both choices) is when the sender's poll() says Success; every
room's transfer is submitted with it (`mgr.complete_when` says which). With
"acknowledged", Success means decode's agent took the room's notification, so the
receiver's poll() will say Success. With "placed", Success means the pages, state slots
and aux records are in decode's memory, and nothing more: the sender does not wait for
decode's agent to answer, so decode's engine may not have its notification yet, and may
never get it (its agent refused it, its notification queue full: the receiver's poll()
says Failed; or decode's agent was lost). Safe when prefill only needs its pages back
(the bytes have left them) and anything that needs decode to hold the request waits for
the receiver's Success, not the sender's; the sender's `transfer.state()` (GetTransfer)
says later whether decode's agent took it (peer_acknowledged, peer_note).
"""
import json

from .. import errors
from .._core import items_segment
from .._proto import kvagent_pb2 as pb
from ..client import connect
from ..fast_route import Route
from ..memory import Raw
from . import completion_setting
from .bootstrap import ask


class KVPoll:
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class KVArgs:
    """The fields of SGLang's KVArgs this backend reads."""

    def __init__(self, **fields):
        self.engine_rank = 0
        self.kv_data_ptrs, self.kv_data_lens, self.kv_item_lens = [], [], []
        self.aux_data_ptrs, self.aux_data_lens, self.aux_item_lens = [], [], []
        self.state_data_ptrs, self.state_data_lens, self.state_item_lens = [], [], []
        self.state_types = []
        self.__dict__.update(fields)


class KvAgentConfig:
    """What SGLang's server_args carries for this backend: the local agent's socket (or
    an attached kvagent.Client, whose memory holds the pools), the bootstrap server, the
    route: fast_path "auto" | "on" | "off", fast_path_slots (0: the agent's default), and
    complete_when "acknowledged" | "placed" (see the module's docstring; checked by
    KvAgentManager)."""

    def __init__(self, bootstrap, client=None, local_socket=None, name=None, fast_path="auto",
                 fast_path_slots=0, complete_when="acknowledged"):
        self.bootstrap = bootstrap
        self.client = client
        self.local_socket = local_socket
        self.name = name
        self.fast_path = fast_path
        self.fast_path_slots = fast_path_slots
        self.complete_when = complete_when


def _raw_regions(prefix, ptrs, lens, item_lens):
    if not (len(ptrs) == len(lens) == len(item_lens)):
        raise errors.invalid(f"KVArgs {prefix}", f"{len(ptrs)} pointers, {len(lens)} lengths and "
                             f"{len(item_lens)} item lengths", "give one of each per buffer")
    return [(f"{prefix}{i}", Raw(p, n, item)) for i, (p, n, item) in enumerate(zip(ptrs, lens,
                                                                                  item_lens))]


class KvAgentManager:
    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        self.args = args
        self.mode = str(getattr(disaggregation_mode, "value", disaggregation_mode)).lower()
        self.config = server_args
        self.is_mla = is_mla_backend
        # Checked first, so a bad value stops the manager before it connects or registers.
        self.complete_when = completion_setting(getattr(server_args, "complete_when", None),
                                                "KvAgentConfig.complete_when")
        self._own_client = server_args.client is None
        self.client = server_args.client or connect(server_args.local_socket,
                                                    name=server_args.name)
        self.bootstrap = server_args.bootstrap
        # One group per kind, named after the worker's engine rank (group names are
        # agent-wide; the receiver tells the sender its names). Regions are named by
        # position, so both sides pair them when their engines list buffers in the same
        # order (SGLang's do).
        rank = f"{self.mode[0]}{args.engine_rank}"
        self.groups = {}  # logical name ("kv", "aux", "state.mamba") -> group on the agent
        self._register("kv", f"kv.{rank}", pb.KV, _raw_regions(
            "T", args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens))
        self.aux_group = None
        if args.aux_data_ptrs:
            self.aux_group = self._register("aux", f"aux.{rank}", pb.AUX, _raw_regions(
                "A", args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens))
        self.state_groups = []
        for t, ptrs in enumerate(args.state_data_ptrs):
            kind = args.state_types[t] if t < len(args.state_types) else f"state{t}"
            name = f"state.{getattr(kind, 'value', kind)}"
            self.state_groups.append(self._register(name, f"{name}.{rank}", pb.STATE, _raw_regions(
                "S", ptrs, args.state_data_lens[t], args.state_item_lens[t])))
        self._peers = {}
        self._notes = {}
        self.route = Route(self.client, getattr(server_args, "fast_path", "auto"),
                           int(getattr(server_args, "fast_path_slots", 0) or 0),
                           owner=f"SGLang {self.mode} manager '{self.client.name}'")
        if self.mode == "prefill":
            self.register_to_bootstrap()

    def _register(self, logical, group, kind, named):
        request, built = self.client._region_request(group, kind, named)
        self.client.register_regions(request)
        self.client.groups[group] = built
        self.groups[logical] = group
        return group

    def remote_groups(self, info):
        """Our group -> the receiver's group of the same logical name."""
        return {group: info["groups"][logical] for logical, group in self.groups.items()}

    def register_to_bootstrap(self):
        ask(self.bootstrap, "register_prefill", rank=self.args.engine_rank,
            info={"agent": self.client.address, "agent_name": self.client.agent_name})

    def peer(self, address):
        """The decode agent at `address`, connected once."""
        if address not in self._peers:
            self._peers[address] = self.client.connect_peer(address).name
        return self._peers[address]

    def notification(self, room):
        """Decode: the notification of `room` if it has come (reaps the ring, or polls
        the agent)."""
        for n in self.route.notifications():
            self._notes[n.request_id] = n
        return self._notes.pop(str(room), None)

    def close(self):
        """Closes the ring, and the client when the manager opened it (which ends the
        session: the agent closes the ring's side with it)."""
        self.route.close()
        if self._own_client:
            self.client.close()
            self._own_client = False

    def state_segments(self, src, dst, remote_groups):
        """Item segments for state slots: one list for every state group, or one list
        per group (SGLang passes per-type lists for models with several)."""
        src, dst = list(src or []), list(dst or [])
        if not src:
            return []
        per_group = isinstance(src[0], (list, tuple))
        out = []
        for i, g in enumerate(self.state_groups):
            s, d = (src[i], dst[i]) if per_group else (src, dst)
            out.append(items_segment(g, remote_groups[g], s, d))
        return out


class KvAgentSender:
    def __init__(self, mgr, bootstrap_addr=None, bootstrap_room=0, dest_tp_ranks=None,
                 pp_rank=0, **_):
        self.mgr = mgr
        self.room = bootstrap_room
        self.bootstrap = bootstrap_addr or mgr.bootstrap
        self.dst = None
        self.sent = 0
        self.num_kv_indices = None
        self.aux_index = None
        self.chunks = None
        self.transfer = None
        self.sent_chunk = None  # the last chunk's future, until the last chunk
        self.error = None

    def init(self, num_kv_indices, aux_index=None):
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = aux_index

    def _paired(self):
        if self.dst is None:
            info = ask(self.bootstrap, "get_room", room=self.room)["info"]
            if info is not None:
                self.mgr.peer(info["agent"])
                self.dst = info
        return self.dst is not None

    def poll(self):
        if self.error is not None:
            return KVPoll.Failed
        if self.transfer is not None:
            try:
                if not self.transfer.done():
                    return KVPoll.Transferring
                self.transfer.result(timeout=1)
                return KVPoll.Success
            except errors.KvAgentError as e:
                self.error = e
                return KVPoll.Failed
        try:
            if self.chunks is not None:
                self.chunks.check()  # a chunk the ring refused (gRPC refuses in send())
            if not self._paired():
                return KVPoll.Bootstrapping
        except errors.KvAgentError as e:
            self.error = e
            return KVPoll.Failed
        return KVPoll.WaitingForInput if self.sent == 0 else KVPoll.Transferring

    def send(self, kv_indices, state_indices=None, token_position_offset=0):
        """Pushes these pages to the receiver's pages at the same positions of its
        list; the call that completes num_kv_indices also sends state, aux and the
        notification."""
        try:
            if not self._paired():
                raise errors.error(9, f"room {self.room}: send() before the decode side's "
                                   "metadata reached the bootstrap; poll() until WaitingForInput")
            src = [int(i) for i in (kv_indices.tolist() if hasattr(kv_indices, "tolist")
                                    else kv_indices)]
            dst = self.dst["kv_indices"][self.sent:self.sent + len(src)]
            self.sent += len(src)
            if self.chunks is None:
                self.chunks = self.mgr.route.open_transfer(
                    self.mgr.peer(self.dst["agent"]), str(self.room),
                    remote_groups=self.mgr.remote_groups(self.dst),
                    complete_when=self.mgr.complete_when)
            pages = (src, dst) if src else None
            if self.sent < self.num_kv_indices:
                if pages:
                    self.sent_chunk = self.chunks.send(pages=pages)
                return
            aux = None
            if self.mgr.aux_group and self.aux_index is not None and self.dst["aux_index"] is not None:
                aux = ([self.aux_index], [self.dst["aux_index"]])
            segments = self.mgr.state_segments(state_indices, self.dst.get("state_indices"),
                                               self.mgr.remote_groups(self.dst))
            self.transfer = self.chunks.finish(
                pages=pages, aux=aux, segments=segments,
                notification=json.dumps({"room": self.room}).encode())
        except errors.KvAgentError as e:
            self.error = e

    def failure_exception(self):
        raise self.error or errors.error(2, f"room {self.room}: the transfer failed")

    def abort(self):
        """Cancels the room's transfer (also one whose last chunk was not sent); poll()
        says Failed from then on, failure_exception() why (as SGLang's backends do)."""
        target = self.transfer or self.sent_chunk
        self.error = self.error or errors.error(1, f"room {self.room}: aborted by the engine "
                                                "(KvAgentSender.abort)")
        if target is not None:
            try:
                target.cancel()
            except errors.KvAgentError as e:  # it had ended, or the agent refused: say why
                self.error = e


class KvAgentReceiver:
    def __init__(self, mgr, bootstrap_addr=None, bootstrap_room=None, **_):
        self.mgr = mgr
        self.room = bootstrap_room
        self.bootstrap = bootstrap_addr or mgr.bootstrap
        self.posted = False
        self.error = None
        self.done = False

    def init(self, kv_indices, aux_index=None, state_indices=None):
        """Leaves this worker's agent and destination pages, aux index and state slots
        at the bootstrap for the room's sender."""
        to_list = lambda v: v.tolist() if hasattr(v, "tolist") else v
        ask(self.bootstrap, "put_room", room=self.room, info={
            "agent": self.mgr.client.address, "groups": self.mgr.groups, "kv_indices": [int(i) for i in to_list(kv_indices)],
            "aux_index": aux_index, "state_indices": to_list(state_indices)})
        self.posted = True

    send_metadata = init  # SGLang's newer name for the same step

    def poll(self):
        if self.error is not None:
            return KVPoll.Failed
        if self.done:
            return KVPoll.Success
        if not self.posted:
            return KVPoll.Bootstrapping
        note = self.mgr.notification(self.room)
        if note is None:
            return KVPoll.WaitingForInput
        try:
            note.check()
        except errors.KvAgentError as e:
            self.error = e
            return KVPoll.Failed
        self.done = True
        ask(self.bootstrap, "drop_room", room=self.room)
        return KVPoll.Success

    def failure_exception(self):
        raise self.error or errors.error(2, f"room {self.room}: the transfer failed")

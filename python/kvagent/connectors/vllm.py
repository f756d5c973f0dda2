"""vLLM's KV-connector roles on kvagent, in the shape of KVConnectorBase_V1
(vllm/distributed/kv_transfer/kv_connector/v1/base.py, vLLM 0.9 - 0.10) and its NIXL
connector's flow: the decode side pulls (READ) the prefill side's blocks, and the
prefill side holds them until the read is done. See docs/ARCHITECTURE.md, "Connectors",
for what remains to wire inside vLLM.

Scheduler side (role "scheduler"): get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta, request_finished (prefill: blocks held, kv_transfer_params name
this agent and the blocks). Worker side (role "worker"): register_kv_caches,
bind_connector_metadata, start_load_kv, wait_for_layer_load, save_kv_layer,
wait_for_save, get_finished, get_block_ids_with_load_errors, clear_connector_metadata.

Configuration: vllm_config.kv_transfer_config.kv_connector_extra_config["kvagent_socket"]
(the local agent's --local-socket; its "unix:" address is what kv_transfer_params give
the decode side on this host), "kvagent_group" (default "kv"; group names are
agent-wide, so instances sharing an agent need their own) and, for a worker, optionally a kvagent.Client whose
memory holds the caches ("kvagent_client"; CPU tensors must live in it), "fast_path"
("auto", the default: READs and notifications through the session's fast path ring when
it opens one, else gRPC; "on": the ring or an error; "off": gRPC) and "fast_path_slots"
(the ring's size; 0: the agent's default). A worker's `route` says which it took (kind
"fast_path" or "grpc"; logged once on kvagent.connectors).

"complete_when" ("acknowledged", the default, or "placed"; the constructor's
complete_when overrides it) is when a decode worker's READ counts as done; it is checked
when the connector is built (either role: anything else raises a ValueError naming the
setting, the value and both choices) and sent with every READ (`.complete_when` says
which). "placed" is safe for this pull: the READ's COMPLETED means the prefill blocks are
in this worker's own memory, so get_finished reports the request loaded and decode goes
on; the prefill side still gets its notification (its blocks were read: free them) from
the commit the decode agent sends at once, without waiting for the prefill agent's
answer. Decode does not need that answer: when the prefill agent refuses the
notification (its queue full: its owners get no notification of that READ at all, so
the prefill worker releases the blocks at abort_request_timeout_s, below) or is lost
before it takes it, a placed READ has still completed, its bytes in place (the READ's state()
says so later: peer_acknowledged, peer_note), where "acknowledged" fails the load and
decode computes the request again. "acknowledged" costs one more round trip between the
agents per READ.

"abort_request_timeout_s" (default 120, as vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT; a
positive number of seconds, checked when the connector is built, either role: anything
else raises InvalidAbortTimeout, a ValueError naming the setting, the value and the fix)
bounds how long a prefill request's blocks stay held. The scheduler records when each
held request expires (request_finished) and the next metadata carries it to the workers
as seconds left (reqs_to_send), so scheduler and workers need no common clock. A worker's
get_finished reports a held request finished sending once, on the first of:
- the agent's outcome notification of the decode side's READ: DATA_READY (read), or
  TRANSFER_FAILED, CANCELLED_BY_PEER, TRANSFER_TIMED_OUT (the read ended otherwise and
  nothing of it touches the blocks any more; a warning names the request, the kind and
  the agent's message);
- its expiry: no notification came in time (the decode instance died before reading,
  prefill's agent refused the notification, its queue full, or lost it); a warning names
  the request and how long it was held.
A notification for a request already reported (after its expiry, or a second one) is
ignored (debug log); one that comes before the worker has the request's hold (the
metadata still on its way) is kept until the hold comes, up to the timeout. Only
requests the scheduler held are ever reported, so vLLM never hears of one twice.
"""
import collections
import heapq
import logging
import math
import time

import grpc

from .. import errors
from ..client import connect
from ..fast_route import Route
from . import completion_setting

SCHEDULER, WORKER = "scheduler", "worker"
ABORT_REQUEST_TIMEOUT_S = 120.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default
SETTING = "kv_connector_extra_config['abort_request_timeout_s']"
_DONE_KEPT = 65536  # request ids reported finished sending, kept to name a late notification

log = logging.getLogger("kvagent.connectors")


class InvalidAbortTimeout(errors.InvalidArgument, ValueError):
    """An abort_request_timeout_s that is not a positive number of seconds, found when
    the connector is built: an InvalidArgument, and a ValueError."""


def abort_timeout_setting(value):
    """abort_request_timeout_s as seconds (float): ABORT_REQUEST_TIMEOUT_S when unset
    (None), else a finite number above 0 (not a bool, not a string)."""
    if value is None:
        return ABORT_REQUEST_TIMEOUT_S
    if (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0):
        return float(value)
    entry = f"{SETTING} {value!r}"
    fix = (f"give a number of seconds above 0 (default {ABORT_REQUEST_TIMEOUT_S:g}): how long "
           "a prefill request's blocks stay held when no notification that the decode side "
           "read them comes")
    raise InvalidAbortTimeout(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{entry}: is not a positive number of seconds; {fix}",
                              entry=entry, fix=fix)


class ReqMeta:
    def __init__(self, local_block_ids, remote_block_ids, remote_agent, remote_request_id,
                 remote_group):
        self.remote_group = remote_group
        self.local_block_ids = list(local_block_ids)
        self.remote_block_ids = list(remote_block_ids)
        self.remote_agent = remote_agent
        self.remote_request_id = remote_request_id


class SendMeta:
    """A prefill request whose blocks the scheduler holds: released by the workers
    expires_in_s after they take this metadata unless a notification ends it sooner
    (timeout_s: the whole hold, for the log)."""

    def __init__(self, expires_in_s, timeout_s):
        self.expires_in_s = expires_in_s
        self.timeout_s = timeout_s


class KvAgentConnectorMetadata:
    """What the scheduler hands the workers each step: requests to pull (reqs_to_recv)
    and prefill requests newly held (reqs_to_send)."""

    def __init__(self):
        self.reqs_to_recv = {}
        self.reqs_to_send = {}


def _extra(vllm_config):
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return dict(getattr(transfer, "kv_connector_extra_config", None) or {})


def _block_ids(blocks):
    """vLLM's KVCacheBlocks (one KV cache group) or a plain list of block ids."""
    if hasattr(blocks, "get_unhashed_block_ids"):
        return list(blocks.get_unhashed_block_ids())
    if hasattr(blocks, "get_block_ids"):
        ids = blocks.get_block_ids()
        return list(ids[0] if ids and isinstance(ids[0], (list, tuple)) else ids)
    return list(blocks)


class KvAgentConnector:
    def __init__(self, vllm_config, role, fast_path=None, complete_when=None):
        """fast_path ("auto", "on", "off") and complete_when ("acknowledged", "placed")
        override kv_connector_extra_config's."""
        self.role = str(getattr(role, "name", role)).lower()
        extra = _extra(vllm_config)
        # Checked first, so a bad value stops the connector before it connects.
        if complete_when is not None:
            self.complete_when = completion_setting(complete_when, "complete_when")
        else:
            self.complete_when = completion_setting(
                extra.get("complete_when"), "kv_connector_extra_config['complete_when']")
        self.abort_timeout = abort_timeout_setting(extra.get("abort_request_timeout_s"))
        socket = extra.get("kvagent_socket")
        self.agent_address = extra.get("kvagent_address") or (f"unix:{socket}" if socket else None)
        # Group names are agent-wide: instances (or TP ranks) sharing an agent each set
        # their own kvagent_group; kv_transfer_params carry it to the other side.
        self.group = extra.get("kvagent_group", "kv")
        self.owner = f"vLLM {self.role} connector (group '{self.group}')"  # for logs
        self.client = None
        self.route = None  # worker: how it reaches the agent (fast_route.Route)
        self._own_client = False
        if self.role == WORKER:
            self.client = extra.get("kvagent_client")
            if self.client is None:
                self.client = connect(socket, name=extra.get("kvagent_name"))
                self._own_client = True
            self.agent_address = self.agent_address or self.client.address
            self.owner = f"vLLM worker connector '{self.client.name}' (group '{self.group}')"
            self.route = Route(
                self.client, fast_path if fast_path is not None else extra.get("fast_path"),
                int(extra.get("fast_path_slots") or 0), owner=self.owner)
        # scheduler side
        self._recv = {}       # request id -> (params, local block ids), until the next meta
        self._send = {}       # request id -> monotonic expiry of its hold, until the next meta
        # worker side
        self._metadata = None
        self._loading = {}    # request id -> (Transfer (READ), local block ids)
        self._report = set()  # failed at submit, reported by the next get_finished
        self._load_errors = {}
        self._failed_blocks = set()
        self._peers = {}
        self._held = {}       # prefill request id -> (monotonic since, expires) of its hold
        self._expiry = []     # heap of (expires, request id); ended holds left to pop
        self._early = {}      # request id -> (arrival, Notification) before its hold came
        self._done = collections.OrderedDict()  # request ids reported, the last _DONE_KEPT

    # ---- scheduler side ------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        """Decode: every prompt token not computed here comes from the prefill side,
        asynchronously. Prefill: none."""
        params = getattr(request, "kv_transfer_params", None) or {}
        if params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids) - num_computed_tokens
            return max(count, 0), count > 0
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = getattr(request, "kv_transfer_params", None) or {}
        if params.get("do_remote_prefill") and num_external_tokens > 0:
            self._recv[request.request_id] = (dict(params), _block_ids(blocks))
            params["do_remote_prefill"] = False  # once

    def build_connector_meta(self, scheduler_output=None):
        meta = KvAgentConnectorMetadata()
        for rid, (params, local) in self._recv.items():
            remote = list(params["remote_block_ids"])
            meta.reqs_to_recv[rid] = ReqMeta(local[-len(remote):] if remote else [], remote,
                                             params["remote_agent"],
                                             params.get("remote_request_id", rid),
                                             params.get("remote_group", self.group))
        self._recv.clear()
        now = time.monotonic()
        for rid, expires in self._send.items():
            meta.reqs_to_send[rid] = SendMeta(expires - now, self.abort_timeout)
        self._send.clear()
        return meta

    def request_finished(self, request, block_ids):
        """Prefill: hold the blocks (True) until the decode side's read of them ends, at
        most abort_request_timeout_s (the expiry goes to the workers with the next
        metadata), and give it where to read: this agent, the blocks and the request id."""
        params = getattr(request, "kv_transfer_params", None) or {}
        if not params.get("do_remote_decode"):
            return False, None
        if self.agent_address is None:
            raise errors.invalid("kv_connector_extra_config", "names no kvagent_socket",
                                 "set kvagent_socket to the local agent's --local-socket")
        self._send[request.request_id] = time.monotonic() + self.abort_timeout
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_block_ids": list(block_ids), "remote_agent": self.agent_address,
                      "remote_request_id": request.request_id, "remote_group": self.group}

    # ---- worker side -----------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        """{layer name: tensor}: [2, blocks, ...] per layer (K and V) or [blocks, ...]
        (MLA); blocks along the first block dimension, layouts read from the tensors."""
        return self.client.register_kv_cache(dict(kv_caches), group=self.group)

    def bind_connector_metadata(self, metadata):
        """Takes this step's metadata: its requests to pull (start_load_kv) and the
        prefill requests now held, each with its expiry."""
        self._metadata = metadata
        now = time.monotonic()
        for rid, send in getattr(metadata, "reqs_to_send", {}).items():
            if rid in self._held or rid in self._done:
                log.debug("%s: prefill request '%s' is held already, or was released: this "
                          "hold of it is ignored", self.owner, rid)
                continue
            expires = now + send.expires_in_s
            self._held[rid] = (expires - send.timeout_s, expires)
            heapq.heappush(self._expiry, (expires, rid))

    def clear_connector_metadata(self):
        self._metadata = None

    def start_load_kv(self, forward_context=None, **kwargs):
        """Pulls every request of this step's metadata: one READ per request (the
        prefill agent's blocks into this worker's), named by the prefill request id,
        completing when complete_when says."""
        for rid, req in (self._metadata.reqs_to_recv.items() if self._metadata else []):
            try:
                if req.remote_agent not in self._peers:
                    self._peers[req.remote_agent] = self.client.connect_peer(req.remote_agent).name
                self._loading[rid] = (self.route.transfer(
                    self._peers[req.remote_agent], req.remote_request_id,
                    pages=(req.remote_block_ids, req.local_block_ids), op="read",
                    remote_groups={self.group: req.remote_group},
                    complete_when=self.complete_when),
                    req.local_block_ids)
            except errors.KvAgentError as e:
                self._fail(rid, e, req.local_block_ids)

    def wait_for_layer_load(self, layer_name):
        """Whole requests are pulled in one READ: nothing to wait for per layer (vLLM
        waits in get_finished for asynchronous loads)."""

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None, **kwargs):
        """Pull model: the prefill side saves nothing; its blocks are read in place."""

    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids=()):
        """(finished sending, finished receiving): held prefill requests whose blocks the
        decode side no longer reads (the agent's outcome notification of the READ, ok or
        not) or whose hold expired, each reported once; and decode requests whose READ
        ended (a failure is in load_errors and get_block_ids_with_load_errors)."""
        sending = self._finished_sending()
        receiving = set()
        for rid, (transfer, blocks) in list(self._loading.items()):
            if not transfer.done():
                continue
            del self._loading[rid]
            receiving.add(rid)
            try:
                transfer.result(timeout=1)
            except errors.KvAgentError as e:
                self._fail(rid, e, blocks)
        receiving |= self._report
        self._report = set()
        return sending or None, receiving or None

    def _finished_sending(self):
        now = time.monotonic()
        sending = set()
        for rid in [r for r in self._early if r in self._held]:  # their holds came since
            self._end_hold(self._early.pop(rid)[1], sending)
        for n in self.route.notifications():
            rid = n.request_id
            if rid in self._held:
                self._end_hold(n, sending)
            elif rid in self._done:
                log.debug("%s: prefill request '%s': %s came after its blocks were released "
                          "(its hold expired, or another notification ended it); ignored",
                          self.owner, rid, n.kind)
            else:
                log.debug("%s: %s for request '%s', which this worker holds no blocks for "
                          "(yet): kept up to %g s for its hold", self.owner, n.kind, rid,
                          self.abort_timeout)
                self._early.pop(rid, None)  # a newer one goes to the end, by arrival
                self._early[rid] = (now, n)
        while self._expiry and self._expiry[0][0] <= now:
            expires, rid = heapq.heappop(self._expiry)
            if self._held.get(rid, (0, None))[1] != expires:
                continue  # ended by its notification
            since, _ = self._held.pop(rid)
            self._released(rid, sending)
            log.warning("%s: prefill request '%s': no notification that the decode side read "
                        "its blocks came; releasing them after %.1f s held (%s is %g s; raise "
                        "it if decode reads take longer)", self.owner, rid, now - since,
                        SETTING, self.abort_timeout)
        while self._early:  # in arrival order: drop those kept longer than the timeout
            rid, (arrival, n) = next(iter(self._early.items()))
            if now - arrival < self.abort_timeout:
                break
            del self._early[rid]
            log.debug("%s: %s for request '%s' dropped: no hold of it came within %g s",
                      self.owner, n.kind, rid, self.abort_timeout)
        return sending

    def _end_hold(self, n, sending):
        """The outcome notification `n` ends its request's hold: reported finished sending."""
        rid = n.request_id
        self._held.pop(rid)
        self._released(rid, sending)
        if not n.ok:
            log.warning("%s: prefill request '%s': the decode side's read ended %s (agent "
                        "'%s': %s); releasing its blocks", self.owner, rid, n.kind,
                        n.from_agent, n.message.error_message or "no message")

    def _released(self, rid, sending):
        sending.add(rid)
        self._done[rid] = None
        if len(self._done) > _DONE_KEPT:
            self._done.popitem(last=False)

    def _fail(self, rid, error, blocks):
        self._load_errors[rid] = error
        self._failed_blocks.update(blocks)
        self._report.add(rid)

    def get_block_ids_with_load_errors(self):
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    @property
    def load_errors(self):
        """request id -> KvAgentError of loads that failed (the agent's message intact)."""
        return self._load_errors

    def close(self):
        """Closes the worker's ring, and its client when the connector opened it (which
        ends the session: the agent closes the ring's side with it)."""
        if self.route is not None:
            self.route.close()
        if self._own_client:
            self.client.close()
            self._own_client = False

    shutdown = close  # KVConnectorBase_V1's name in newer vLLM

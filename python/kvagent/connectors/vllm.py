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
notification (its queue full: its owners get TRANSFER_FAILED instead) or is lost before
it takes it, a placed READ has still completed, its bytes in place (the READ's state()
says so later: peer_acknowledged, peer_note), where "acknowledged" fails the load and
decode computes the request again. "acknowledged" costs one more round trip between the
agents per READ.
"""
from .. import errors
from ..client import connect
from ..fast_route import Route
from . import completion_setting

SCHEDULER, WORKER = "scheduler", "worker"


class ReqMeta:
    def __init__(self, local_block_ids, remote_block_ids, remote_agent, remote_request_id,
                 remote_group):
        self.remote_group = remote_group
        self.local_block_ids = list(local_block_ids)
        self.remote_block_ids = list(remote_block_ids)
        self.remote_agent = remote_agent
        self.remote_request_id = remote_request_id


class KvAgentConnectorMetadata:
    """What the scheduler hands the workers each step: requests to pull."""

    def __init__(self):
        self.reqs_to_recv = {}


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
        socket = extra.get("kvagent_socket")
        self.agent_address = extra.get("kvagent_address") or (f"unix:{socket}" if socket else None)
        # Group names are agent-wide: instances (or TP ranks) sharing an agent each set
        # their own kvagent_group; kv_transfer_params carry it to the other side.
        self.group = extra.get("kvagent_group", "kv")
        self.client = None
        self.route = None  # worker: how it reaches the agent (fast_route.Route)
        self._own_client = False
        if self.role == WORKER:
            self.client = extra.get("kvagent_client")
            if self.client is None:
                self.client = connect(socket, name=extra.get("kvagent_name"))
                self._own_client = True
            self.agent_address = self.agent_address or self.client.address
            self.route = Route(
                self.client, fast_path if fast_path is not None else extra.get("fast_path"),
                int(extra.get("fast_path_slots") or 0),
                owner=f"vLLM worker connector '{self.client.name}' (group '{self.group}')")
        # scheduler side
        self._recv = {}       # request id -> (params, local block ids), until the next meta
        # worker side
        self._metadata = None
        self._loading = {}    # request id -> (Transfer (READ), local block ids)
        self._report = set()  # failed at submit, reported by the next get_finished
        self._load_errors = {}
        self._failed_blocks = set()
        self._peers = {}

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
        return meta

    def request_finished(self, request, block_ids):
        """Prefill: hold the blocks (True) until the decode side has read them, and give
        it where to read: this agent, the blocks and the request id."""
        params = getattr(request, "kv_transfer_params", None) or {}
        if not params.get("do_remote_decode"):
            return False, None
        if self.agent_address is None:
            raise errors.invalid("kv_connector_extra_config", "names no kvagent_socket",
                                 "set kvagent_socket to the local agent's --local-socket")
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_block_ids": list(block_ids), "remote_agent": self.agent_address,
                      "remote_request_id": request.request_id, "remote_group": self.group}

    # ---- worker side -----------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        """{layer name: tensor}: [2, blocks, ...] per layer (K and V) or [blocks, ...]
        (MLA); blocks along the first block dimension, layouts read from the tensors."""
        return self.client.register_kv_cache(dict(kv_caches), group=self.group)

    def bind_connector_metadata(self, metadata):
        self._metadata = metadata

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
        """(finished sending, finished receiving): prefill requests whose blocks the
        decode side has read (the agent's notification of the READ), and decode requests
        whose READ ended (a failure is in load_errors and get_block_ids_with_load_errors)."""
        sending = {n.request_id for n in self.route.notifications() if n.ok}
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

"""The blocking client: kvagent.connect() returns one. Every call has a deadline, carries
the session token, and raises a KvAgentError (errors.py) with the agent's text intact.
"""
import time

import grpc

from . import errors
from ._core import CHANNEL_OPTIONS, TERMINAL, Base, TransferBase, completion_point
from ._proto import kvagent_pb2 as pb
from ._proto import kvagent_pb2_grpc as pb_grpc


class Client(Base):
    """A session with the local agent, and its gRPC stub."""

    def __init__(self, local_socket=None, name=None, timeout=10.0):
        super().__init__(local_socket, name, timeout)
        self._channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.AgentStub(self._channel)

    def close(self):
        """Ends the session: the agent deregisters this client's regions and frees its
        memory. Views of its buffers stay readable here until dropped."""
        self._channel.close()
        self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def call(self, method, request, where, timeout=None):
        """One unary Agent call by method name, errors as KvAgentError."""
        try:
            return getattr(self.stub, method)(request, metadata=self.metadata,
                                              timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc(e, where) from None

    # ---- registration -------------------------------------------------------------
    def register_regions(self, request):
        """RegisterRegions as is (a RegisterRegionsRequest): the low-level door."""
        return self.call("RegisterRegions", request, "RegisterRegions")

    def _register(self, built):
        request, group = built
        self.register_regions(request)
        self.groups[group.name] = group
        return group

    def register_kv_cache(self, k_caches, v_caches=None, group="kv"):
        """Registers a whole KV cache in one batch: one tensor per layer per K/V, pages
        along dimension 0 (SGLang's and vLLM's pools); MLA: k_caches only, one per layer.
        A dict {layer name: tensor} (vLLM's kv_caches) works too; a [2, pages, ...]
        tensor is split into K and V. Regions get roles "L<i>.K"/"L<i>.V" (or the
        dict's names), so the peer pairs them whatever order it registered them in."""
        return self._register(self._kv_request(k_caches, v_caches, group))

    def register_state(self, tensors, group="state", slot_dim=0):
        """Registers Mamba conv/SSM (or other per-request) state: a tensor, a list, or a
        dict {name: tensor}; slots along `slot_dim` (SGLang's [layers, slots, ...] is
        slot_dim=1: one region per layer)."""
        return self._register(self._state_request(tensors, group, slot_dim))

    def register_aux(self, tensor, group="aux"):
        """Registers per-request aux records (first token, lengths...): items along dim 0."""
        return self._register(self._aux_request(tensor, group))

    def deregister(self, group):
        """Deregisters one of this client's groups."""
        g = self.groups.pop(group)
        return self.call("DeregisterRegions", pb.DeregisterRegionsRequest(names=g.regions),
                         f"deregistering group '{group}'")

    # ---- peers, status ------------------------------------------------------------
    def connect_peer(self, address):
        """ConnectPeer: "unix:PATH" (a peer on this host) or "HOST:PORT"."""
        address = getattr(address, "address", address)
        return self.call("ConnectPeer", pb.ConnectPeerRequest(address=address),
                         f"connecting peer {address}")

    def status(self):
        return self.call("GetStatus", pb.GetStatusRequest(), "GetStatus")

    def regions(self):
        return self.call("ListRegions", pb.ListRegionsRequest(), "ListRegions").regions

    # ---- transfers ------------------------------------------------------------------
    def transfer(self, peer, request_id, pages=None, slots=None, aux=None, segments=(),
                 notification=b"", op="write", timeout_ms=0, remote_groups=None,
                 wait=False, complete_when="acknowledged"):
        """Submits one transfer in engine terms and returns its Transfer future.
        pages=(src_page_ids, dst_page_ids) covers every KV group this client registered,
        slots=(src_slots, dst_slots) every STATE group, aux=(src_ids, dst_ids) every AUX
        group (source and destination in data-flow order for WRITE and READ alike).
        `notification` reaches the peer's owner after every byte is in place. Refusals
        (bad ids, unknown peer, ...) raise at once with the agent's message. With
        wait=True the call returns once the transfer ended (one round trip instead of
        submit + watch: the future is already done). complete_when="placed" (or
        kvagent.pb.COMPLETE_WHEN_PLACED) has it COMPLETED as soon as every byte is in
        place, without waiting for the peer's acknowledgement, which the state records
        later (state().peer_acknowledged, or peer_note); "acknowledged" is the default.
        Another value raises ValueError (an InvalidArgument) before anything is sent."""
        request = self._transfer_request(peer, request_id, pages, slots, aux, segments,
                                         notification, op, timeout_ms, remote_groups,
                                         complete_when=complete_when)
        request.wait = wait  # one round trip: the answer is the final state
        state = self.call("SubmitTransfer", request, f"transfer '{request.transfer_id}'",
                          timeout=self.timeout + (timeout_ms / 1000 or 60) if wait else None)
        return Transfer(self, request.transfer_id, state)

    def open_transfer(self, peer, request_id, op="write", timeout_ms=0, remote_groups=None,
                      complete_when="acknowledged"):
        """A chunked transfer: send() each chunk's pages as they are ready, finish() with
        the last (state slots, aux, notification); finish() returns the Transfer.
        complete_when (as in transfer(), checked here) goes on chunk 0, the transfer's."""
        return ChunkedTransfer(self, peer, request_id, op, timeout_ms, remote_groups,
                               complete_when)

    # ---- notifications --------------------------------------------------------------
    def notifications(self, request_ids=(), subscription="", timeout=None):
        """Iterates notifications for this client's regions as they arrive (each with
        .ack()). With `subscription` they are held by the agent until acknowledged and
        redelivered to a restarted client of the same name. Stops after `timeout` s."""
        with self._watching_notifications(request_ids, subscription, timeout) as stream:
            for n in stream:
                yield Notification(self, n, subscription)

    def poll_notifications(self, max_count=0, request_ids=(), subscription=""):
        request = pb.PollNotificationsRequest(max=max_count, subscription=subscription,
                                              transfer_ids=[str(i) for i in request_ids])
        reply = self.call("PollNotifications", request, "PollNotifications")
        return [Notification(self, n, subscription) for n in reply.notifications]

    def wait_notification(self, request_id, timeout=30.0, subscription=""):
        """The notification of `request_id`, acknowledged; raises TransferFailed-like
        errors for CANCELLED_BY_PEER, TRANSFER_FAILED and TRANSFER_TIMED_OUT."""
        for n in self.notifications([request_id], subscription, timeout):
            n.ack()
            n.check()
            return n
        raise errors.error(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"request '{request_id}': no notification within {timeout} s; check "
                           "the sender's transfer (Transfer.result())", where="wait_notification")

    def ack(self, subscription, through=0, sequences=()):
        return self.call("AckNotifications", pb.AckNotificationsRequest(
            subscription=subscription, through_sequence=through, sequences=list(sequences)),
            f"acknowledging subscription '{subscription}'").released


class Transfer(TransferBase):
    """The future of one transfer: done(), state(), result(timeout), cancel(). States are
    the agent's TransferState messages (complete_when, and with COMPLETE_WHEN_PLACED
    peer_acknowledged / peer_note, which may change after COMPLETED: read state())."""

    def state(self):
        self.last_state = self.client.call("GetTransfer",
                                           pb.GetTransferRequest(transfer_id=self.id),
                                           f"transfer '{self.id}'")
        return self.last_state

    def done(self):
        return self.last_state.phase in TERMINAL or self.state().phase in TERMINAL

    def result(self, timeout=60.0):
        """Waits until the transfer ends; returns its COMPLETED state or raises
        TransferFailed (the agent's error code, message and failed segment)."""
        state = self.last_state
        if state.phase in TERMINAL:
            return self._settle(state)
        with self._watching(timeout) as stream:
            state = next((s for s in stream if s.phase in TERMINAL), state)
        return self._settle(state)

    def cancel(self):
        self.last_state = self.client.call("CancelTransfer",
                                           pb.CancelTransferRequest(transfer_id=self.id),
                                           f"cancelling transfer '{self.id}'")
        return self.last_state


class ChunkedTransfer:
    """A transfer whose segments arrive in chunks (SGLang sends page ids as prefill
    produces them): send() opens it and adds chunks, finish() closes it. complete_when
    is the transfer's: chunk 0 carries it, later chunks leave it unset (the agent keeps
    chunk 0's)."""

    def __init__(self, client, peer, request_id, op, timeout_ms, remote_groups,
                 complete_when="acknowledged"):
        self.client = client
        self.args = dict(peer=peer, request_id=request_id, op=op, timeout_ms=timeout_ms,
                         remote_groups=remote_groups)
        # Checked now, before any chunk is sent.
        self.complete_when = completion_point(complete_when,
                                              f"transfer '{request_id}': complete_when")
        self.chunk = 0

    def _chunk_completion(self):
        """What this chunk's request carries: chunk 0 the transfer's completion point,
        later chunks none (COMPLETE_WHEN_ACKNOWLEDGED, the unset value)."""
        return self.complete_when if self.chunk == 0 else pb.COMPLETE_WHEN_ACKNOWLEDGED

    def _submit(self, more, **kw):
        request = self.client._transfer_request(**self.args, **kw, chunk=self.chunk,
                                                more_chunks=more,
                                                complete_when=self._chunk_completion())
        state = self.client.call("SubmitTransfer", request,
                                 f"transfer '{request.transfer_id}' chunk {self.chunk}")
        self.chunk += 1
        return Transfer(self.client, request.transfer_id, state)

    def send(self, pages=None, slots=None, aux=None, segments=()):
        return self._submit(True, pages=pages, slots=slots, aux=aux, segments=segments)

    def finish(self, pages=None, slots=None, aux=None, segments=(), notification=b""):
        return self._submit(False, pages=pages, slots=slots, aux=aux, segments=segments,
                            notification=notification)

    def check(self):
        """Raises a refusal of a chunk sent so far: none here, gRPC raised it in send()
        (the fast path's RingChunkedTransfer learns of it later)."""


class Notification:
    """One notification: request_id, kind ("DATA_READY", ...), payload, from_agent."""

    def __init__(self, client, message, subscription):
        self.client = client
        self.message = message
        self.subscription = subscription
        self.request_id = message.transfer_id
        self.kind = pb.NotificationKind.Name(message.kind)
        self.payload = message.payload
        self.from_agent = message.from_agent
        self.sequence = message.sequence

    @property
    def ok(self):
        return self.kind == "DATA_READY"

    def check(self):
        """Raises for every outcome but DATA_READY, with the sender's error."""
        if not self.ok:
            code = self.message.error_code or (1 if self.kind == "CANCELLED_BY_PEER" else 2)
            raise errors.error(code, self.message.error_message or f"the transfer ended {self.kind}",
                               where=f"request '{self.request_id}' from '{self.from_agent}'")
        return self

    def ack(self):
        """Releases it from the subscription (no-op without one: it was taken once)."""
        if self.subscription and self.sequence:
            return self.client.ack(self.subscription, sequences=[self.sequence])
        return 0

    def __repr__(self):
        return f"Notification({self.request_id!r}, {self.kind}, {len(self.payload)} bytes)"


def connect(local_socket=None, name=None, timeout=10.0):
    """A Client of the agent on this host: `local_socket` is its --local-socket (default
    $KVAGENT_SOCKET or /run/kvagent/kvagent.sock; "unix:" prefix allowed)."""
    return Client(local_socket, name, timeout)

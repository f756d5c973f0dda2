"""The asyncio client (grpc.aio): the same API as kvagent.Client with coroutines, a
Transfer that is awaitable, and notifications as an async iterator.

    agent = await kvagent.aio.connect(path)
    transfer = await agent.transfer("decode", "req-1", pages=(src, dst))
    state = await transfer            # COMPLETED, or raises TransferFailed
    async for n in agent.notifications(["req-1"]): await n.ack(); break

Session calls (allocate, memfd, share_memory) are short local socket exchanges and
stay synchronous.
"""
import grpc

from . import errors
from ._core import CHANNEL_OPTIONS, TERMINAL, Base, TransferBase
from ._proto import kvagent_pb2 as pb
from ._proto import kvagent_pb2_grpc as pb_grpc
from .client import Notification


class AsyncClient(Base):
    def __init__(self, local_socket=None, name=None, timeout=10.0):
        super().__init__(local_socket, name, timeout)
        self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.AgentStub(self._channel)

    async def close(self):
        await self._channel.close()
        self.session.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def call(self, method, request, where, timeout=None):
        try:
            return await getattr(self.stub, method)(request, metadata=self.metadata,
                                                    timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc(e, where) from None

    async def _register(self, built):
        request, group = built
        await self.call("RegisterRegions", request, "RegisterRegions")
        self.groups[group.name] = group
        return group

    async def register_regions(self, request):
        return await self.call("RegisterRegions", request, "RegisterRegions")

    async def register_kv_cache(self, k_caches, v_caches=None, group="kv"):
        return await self._register(self._kv_request(k_caches, v_caches, group))

    async def register_state(self, tensors, group="state", slot_dim=0):
        return await self._register(self._state_request(tensors, group, slot_dim))

    async def register_aux(self, tensor, group="aux"):
        return await self._register(self._aux_request(tensor, group))

    async def connect_peer(self, address):
        address = getattr(address, "address", address)
        return await self.call("ConnectPeer", pb.ConnectPeerRequest(address=address),
                               f"connecting peer {address}")

    async def status(self):
        return await self.call("GetStatus", pb.GetStatusRequest(), "GetStatus")

    async def transfer(self, peer, request_id, pages=None, slots=None, aux=None, segments=(),
                       notification=b"", op="write", timeout_ms=0, remote_groups=None,
                       wait=False, complete_when="acknowledged"):
        """kvagent.Client.transfer's coroutine (complete_when="placed" too); the
        AsyncTransfer is awaitable."""
        request = self._transfer_request(peer, request_id, pages, slots, aux, segments,
                                         notification, op, timeout_ms, remote_groups,
                                         complete_when=complete_when)
        request.wait = wait  # one round trip: the answer is the final state
        state = await self.call("SubmitTransfer", request, f"transfer '{request.transfer_id}'",
                          timeout=self.timeout + (timeout_ms / 1000 or 60) if wait else None)
        return AsyncTransfer(self, request.transfer_id, state)

    async def notifications(self, request_ids=(), subscription="", timeout=None):
        with self._watching_notifications(request_ids, subscription, timeout) as stream:
            async for n in stream:
                yield AsyncNotification(self, n, subscription)

    async def ack(self, subscription, through=0, sequences=()):
        reply = await self.call("AckNotifications", pb.AckNotificationsRequest(
            subscription=subscription, through_sequence=through, sequences=list(sequences)),
            f"acknowledging subscription '{subscription}'")
        return reply.released


class AsyncTransfer(TransferBase):
    """Awaitable: `await transfer` is `await transfer.result()`."""

    async def state(self):
        self.last_state = await self.client.call(
            "GetTransfer", pb.GetTransferRequest(transfer_id=self.id), f"transfer '{self.id}'")
        return self.last_state

    async def result(self, timeout=60.0):
        state = self.last_state
        if state.phase in TERMINAL:
            return self._settle(state)
        with self._watching(timeout) as stream:
            async for state in stream:
                if state.phase in TERMINAL:
                    break
        return self._settle(state)

    def __await__(self):
        return self.result().__await__()

    async def cancel(self):
        self.last_state = await self.client.call(
            "CancelTransfer", pb.CancelTransferRequest(transfer_id=self.id),
            f"cancelling transfer '{self.id}'")
        return self.last_state


class AsyncNotification(Notification):
    async def ack(self):
        if self.subscription and self.sequence:
            return await self.client.ack(self.subscription, sequences=[self.sequence])
        return 0


async def connect(local_socket=None, name=None, timeout=10.0):
    """An AsyncClient of the agent on this host (see kvagent.connect)."""
    return AsyncClient(local_socket, name, timeout)

"""The SGLang-shaped connector (kvagent.connectors.sglang) driven through the calls
SGLang's prefill and decode schedulers make (manager per worker, sender on prefill,
receiver on decode, bootstrap pairing them by room), with real torch pools in memory
the agents map, two real agents, bytes compared; a hybrid model's Mamba state rides in
the same transfer. Each scenario runs on both routes: the sessions' fast path rings
(the default) and gRPC (fast_path "off"). complete_when "placed" (issue 15): the sender
says Success once every byte is in decode's memory, decode is told once, and decode's
acknowledgement is recorded after; a bad value stops the manager."""
import time

import torch

import kvagent
from client_test import fill
from harness import (PairTestCase, agent_status, count_calls, main, placed_and_acknowledged,
                     record_notifications, ring_use, transfer_rpcs, wait_status)
from kvagent._proto import kvagent_pb2 as pb
from kvagent.connectors.bootstrap import BootstrapServer
from kvagent.connectors.sglang import (KVArgs, KVPoll, KvAgentConfig, KvAgentManager,
                                       KvAgentReceiver, KvAgentSender)

LAYERS, PAGES, SLOTS = 2, 16, 4


def nbytes(t):
    return t.numel() * t.element_size()


class Worker:
    """One SGLang worker's pools (as its memory pool classes shape them) and manager."""

    def __init__(self, socket, name, mode, bootstrap, fast_path="auto",
                 complete_when="acknowledged", manager=True):
        """manager=False: the pools and self.args only (no KvAgentManager)."""
        self.client = kvagent.connect(socket, name=name)
        c = self.client
        self.k = [c.empty((PAGES, 16, 2, 32), torch.bfloat16) for _ in range(LAYERS)]
        self.v = [c.empty((PAGES, 16, 2, 32), torch.bfloat16) for _ in range(LAYERS)]
        self.conv = c.empty((LAYERS, SLOTS, 48, 3), torch.bfloat16)   # [layers, slots, ...]
        self.ssm = c.empty((LAYERS, SLOTS, 2, 8, 16), torch.float32)
        self.aux = c.empty((SLOTS, 16), torch.int32)                   # output ids etc.
        for t in self.k + self.v + [self.conv, self.ssm, self.aux]:
            t.zero_()
        kv = self.k + self.v  # SGLang lists every layer's K, then every layer's V
        state = [self.conv[l] for l in range(LAYERS)] + [self.ssm[l] for l in range(LAYERS)]
        args = KVArgs(
            engine_rank=0,
            kv_data_ptrs=[t.data_ptr() for t in kv],
            kv_data_lens=[nbytes(t) for t in kv],
            kv_item_lens=[nbytes(t[0]) for t in kv],
            aux_data_ptrs=[self.aux.data_ptr()], aux_data_lens=[nbytes(self.aux)],
            aux_item_lens=[nbytes(self.aux[0])],
            state_types=["mamba"],
            state_data_ptrs=[[t.data_ptr() for t in state]],
            state_data_lens=[[nbytes(t) for t in state]],
            state_item_lens=[[nbytes(t[0]) for t in state]])
        self.args = args
        if manager:
            self.mgr = KvAgentManager(args, mode, KvAgentConfig(
                bootstrap, client=c, fast_path=fast_path, complete_when=complete_when))

    def tensors(self):
        return self.k + self.v


def poll_until(obj, wanted, seconds=10):
    deadline = time.monotonic() + seconds
    while True:
        state = obj.poll()
        if state in wanted or time.monotonic() > deadline:
            return state
        time.sleep(0.002)


class Scenarios:
    """SGLang's call sequences; each class runs them on one route."""

    fast_path = "auto"  # KvAgentConfig's knob
    route = "fast_path"  # the route the managers must have taken

    def setUp(self):
        self.boot = BootstrapServer()
        self.addCleanup(self.boot.close)

    def workers(self, tag, complete_when="acknowledged"):
        pre = Worker(self.pair.prefill.socket, f"{tag}-p", "prefill", self.boot.address,
                     self.fast_path, complete_when)
        dec = Worker(self.pair.decode.socket, f"{tag}-d", "decode", self.boot.address,
                     self.fast_path, complete_when)
        for w in (pre, dec):
            self.addCleanup(w.client.close)
            self.addCleanup(w.mgr.close)
            self.assertEqual(w.mgr.route.kind, self.route, w.mgr.route.describe())
        return pre, dec

    def sender_to(self, pre, dec, room, dst_pages):
        """A sender of len(dst_pages) pages for `room` whose receiver posted its pages
        (aux 0, state slot 0), polled until WaitingForInput."""
        sender = KvAgentSender(pre.mgr, self.boot.address, room)
        sender.init(len(dst_pages), aux_index=0)
        KvAgentReceiver(dec.mgr, self.boot.address, room).init(dst_pages, aux_index=0,
                                                               state_indices=[0])
        self.assertEqual(poll_until(sender, {KVPoll.WaitingForInput}), KVPoll.WaitingForInput)
        return sender

    def test_chunked_prefill_with_mamba_state_and_aux(self):
        pre, dec = self.workers("sg")
        fill(pre.tensors() + [pre.conv, pre.ssm], 11)
        pre.aux[1] = torch.arange(16, dtype=torch.int32)
        room = 4242
        sender = KvAgentSender(pre.mgr, self.boot.address, room, dest_tp_ranks=[0], pp_rank=0)
        self.assertEqual(sender.poll(), KVPoll.Bootstrapping)
        sender.init(num_kv_indices=5, aux_index=1)
        receiver = KvAgentReceiver(dec.mgr, self.boot.address, room)
        self.assertEqual(receiver.poll(), KVPoll.Bootstrapping)
        dst_pages = [9, 3, 12, 4, 15]
        receiver.init(torch.tensor(dst_pages, dtype=torch.int32), aux_index=2, state_indices=[3])
        self.assertEqual(receiver.poll(), KVPoll.WaitingForInput)
        self.assertEqual(poll_until(sender, {KVPoll.WaitingForInput}), KVPoll.WaitingForInput)
        # Chunked prefill: pages as they fill, then the last chunk with the state slot.
        sender.send(torch.tensor([0, 1], dtype=torch.int32))
        self.assertEqual(sender.poll(), KVPoll.Transferring)
        self.assertEqual(receiver.poll(), KVPoll.WaitingForInput)  # not before the last chunk
        sender.send(torch.tensor([2, 5, 7], dtype=torch.int32), state_indices=[1])
        self.assertEqual(poll_until(sender, {KVPoll.Success, KVPoll.Failed}), KVPoll.Success)
        self.assertEqual(poll_until(receiver, {KVPoll.Success, KVPoll.Failed}), KVPoll.Success)
        for s, d in zip(pre.tensors(), dec.tensors()):
            self.assertTrue(torch.equal(s[[0, 1, 2, 5, 7]], d[dst_pages]))
        self.assertTrue(torch.equal(pre.conv[:, 1], dec.conv[:, 3]))
        self.assertTrue(torch.equal(pre.ssm[:, 1], dec.ssm[:, 3]))
        self.assertTrue(torch.equal(pre.aux[1], dec.aux[2]))
        self.assertTrue(bool((dec.ssm[:, [0, 1, 2]] == 0).all()))
        # The default: Success once decode's agent acknowledged the room.
        self.assertEqual(pre.mgr.complete_when, "acknowledged")
        state = sender.transfer.state()
        self.assertEqual((pb.TransferPhase.Name(state.phase),
                          pb.CompletionPoint.Name(state.complete_when)),
                         ("COMPLETED", "COMPLETE_WHEN_ACKNOWLEDGED"))

    def test_placed_push_completes_and_decode_is_told_once(self):
        # complete_when "placed": the sender says Success as soon as pages, state and aux
        # are in decode's memory; the receiver still gets its room's DATA_READY, once (the
        # commit goes with it), and decode's acknowledgement is recorded after.
        pre, dec = self.workers("sgplaced", complete_when="placed")
        self.assertEqual(pre.mgr.complete_when, "placed")
        before = agent_status(self.pair.prefill)
        told = record_notifications(dec.mgr.route)
        fill(pre.tensors() + [pre.conv, pre.ssm], 16)
        pre.aux[1] = torch.arange(16, dtype=torch.int32) + 100
        # Room 81: two chunks, the last with a state slot and aux; room 82: one chunk.
        rooms = {81: ([0, 4, 6], [5, 9, 2], 2, 1, 1, 3), 82: ([7], [11], 3, 2, 0, 0)}
        pairs = {}
        for room, (src, dst, s_slot, d_slot, s_aux, d_aux) in rooms.items():
            sender = KvAgentSender(pre.mgr, self.boot.address, room)
            sender.init(len(src), aux_index=s_aux)
            receiver = KvAgentReceiver(dec.mgr, self.boot.address, room)
            receiver.init(dst, aux_index=d_aux, state_indices=[d_slot])
            self.assertEqual(poll_until(sender, {KVPoll.WaitingForInput}), KVPoll.WaitingForInput)
            pairs[room] = (sender, receiver)
        pairs[81][0].send([0])
        pairs[81][0].send([4, 6], state_indices=[2])
        pairs[82][0].send([7], state_indices=[3])
        for room, (sender, receiver) in pairs.items():
            self.assertEqual(poll_until(sender, {KVPoll.Success, KVPoll.Failed}), KVPoll.Success,
                             f"room {room}: {sender.error}")
            self.assertEqual(poll_until(receiver, {KVPoll.Success, KVPoll.Failed}),
                             KVPoll.Success, f"room {room}: {receiver.error}")
        for room, (src, dst, s_slot, d_slot, s_aux, d_aux) in rooms.items():
            for s, d in zip(pre.tensors(), dec.tensors()):
                self.assertTrue(torch.equal(s[src], d[dst]), f"room {room}'s pages")
            self.assertTrue(torch.equal(pre.conv[:, s_slot], dec.conv[:, d_slot]))
            self.assertTrue(torch.equal(pre.ssm[:, s_slot], dec.ssm[:, d_slot]))
            self.assertTrue(torch.equal(pre.aux[s_aux], dec.aux[d_aux]))
        time.sleep(0.3)  # a second notification of either room would have come by now
        dec.mgr.notification(0)
        self.assertEqual(sorted((n.request_id, n.kind) for n in told),
                         [("81", "DATA_READY"), ("82", "DATA_READY")],
                         "decode's notifications of the placed rooms")
        for room, chunks in ((81, 2), (82, 1)):
            transfer = pairs[room][0].transfer
            state = placed_and_acknowledged(self, transfer.state, transfer.id)
            self.assertEqual((pb.TransferPhase.Name(state.phase), pb.TransferOp.Name(state.op),
                              pb.CompletionPoint.Name(state.complete_when), state.peer_note,
                              state.chunks),
                             ("COMPLETED", "WRITE", "COMPLETE_WHEN_PLACED", "", chunks))
        status = agent_status(self.pair.prefill)
        self.assertEqual((status.completed_when_placed - before.completed_when_placed,
                          status.placed_not_taken - before.placed_not_taken), (2, 0),
                         "prefill agent's (completed_when_placed, placed_not_taken) rise")

    def test_a_bad_complete_when_refuses_to_build_the_manager(self):
        w = Worker(self.pair.prefill.socket, "sgcw-p", "prefill", self.boot.address,
                   manager=False)
        self.addCleanup(w.client.close)
        for value in ("soon", "PLACED", "", 2, -1, True):
            with self.subTest(value=value):
                with self.assertRaises(ValueError) as caught:
                    KvAgentManager(w.args, "prefill", KvAgentConfig(
                        self.boot.address, client=w.client, fast_path=self.fast_path,
                        complete_when=value))
                self.assertIsInstance(caught.exception, kvagent.InvalidArgument)
                text = str(caught.exception)
                self.assertIn(f"KvAgentConfig.complete_when {value!r}", text)
                self.assertIn("'acknowledged'", text)
                self.assertIn("'placed'", text)
        # Refused before anything was registered: a good manager with the same client
        # and pools builds (the pb value is taken).
        self.assertEqual(w.client.groups, {})
        mgr = KvAgentManager(w.args, "prefill", KvAgentConfig(
            self.boot.address, client=w.client, fast_path=self.fast_path,
            complete_when=pb.COMPLETE_WHEN_PLACED))
        self.addCleanup(mgr.close)
        self.assertEqual((mgr.complete_when, mgr.route.kind), ("placed", self.route),
                         mgr.route.describe())

    def test_many_rooms_interleaved(self):
        pre, dec = self.workers("rooms")
        fill(pre.tensors(), 12)
        pairs = []
        for room in range(3):
            s = KvAgentSender(pre.mgr, self.boot.address, room)
            s.init(2, aux_index=room)
            r = KvAgentReceiver(dec.mgr, self.boot.address, room)
            r.init([room * 2, room * 2 + 1], aux_index=room, state_indices=[room])
            pairs.append((s, r))
        for room, (s, _) in reversed(list(enumerate(pairs))):
            self.assertEqual(poll_until(s, {KVPoll.WaitingForInput}), KVPoll.WaitingForInput)
            s.send([10 + room, 13], state_indices=[room])
        for s, r in pairs:
            self.assertEqual(poll_until(s, {KVPoll.Success, KVPoll.Failed}), KVPoll.Success)
            self.assertEqual(poll_until(r, {KVPoll.Success, KVPoll.Failed}), KVPoll.Success)
        for room in range(3):
            for s, d in zip(pre.tensors(), dec.tensors()):
                self.assertTrue(torch.equal(s[[10 + room, 13]], d[[room * 2, room * 2 + 1]]))

    def assert_refused_page(self, sender, page):
        """poll() says Failed, failure_exception() the agent's refusal of `page` (gRPC
        refuses in send(); the ring's refusal comes with a later poll's reap)."""
        self.assertEqual(poll_until(sender, {KVPoll.Success, KVPoll.Failed}), KVPoll.Failed)
        with self.assertRaises(kvagent.InvalidArgument) as caught:
            sender.failure_exception()
        self.assertIn(f"remote index {page} at position 0 is out of range",
                      caught.exception.message)

    def test_bad_destination_fails_with_the_agents_message(self):
        pre, dec = self.workers("sgbad")
        sender = self.sender_to(pre, dec, 7, [PAGES + 3])
        sender.send([0], state_indices=[0])
        self.assert_refused_page(sender, PAGES + 3)

    def test_a_refused_chunk_fails_the_sender_before_the_last(self):
        pre, dec = self.workers("sgchunk")
        sender = self.sender_to(pre, dec, 9, [PAGES + 5, 1])
        sender.send([0])  # the first of two chunks: its destination page does not exist
        self.assert_refused_page(sender, PAGES + 5)
        self.assertIsNone(sender.transfer)  # failed before the last chunk

    def test_abort_between_chunks_cancels_the_transfer(self):
        pre, dec = self.workers("sgabort")
        sender = self.sender_to(pre, dec, 11, [1, 2])
        sender.send([0])
        sender.abort()
        self.assertEqual(sender.poll(), KVPoll.Failed)
        with self.assertRaises(kvagent.KvAgentError) as caught:
            sender.failure_exception()
        self.assertIn("room 11: aborted by the engine", caught.exception.message)
        state = pre.client.call("GetTransfer", kvagent.pb.GetTransferRequest(transfer_id="11"),
                                "test")
        self.assertEqual(kvagent.pb.TransferPhase.Name(state.phase), "CANCELLED")


class SglangConnectorTest(Scenarios, PairTestCase):
    """On the fast path rings (fast_path "auto" against agents that serve them)."""

    def test_chunks_and_the_notification_go_through_the_rings(self):
        used = ring_use(self.pair)
        pre, dec = self.workers("sgring")
        self.assertTrue(pre.mgr.route.watching and dec.mgr.route.watching)
        pre_calls, dec_calls = count_calls(pre.client), count_calls(dec.client)
        fill(pre.tensors() + [pre.conv, pre.ssm], 14)
        sender = KvAgentSender(pre.mgr, self.boot.address, 77)
        sender.init(3, aux_index=0)
        receiver = KvAgentReceiver(dec.mgr, self.boot.address, 77)
        receiver.init([8, 6, 7], aux_index=1, state_indices=[2])
        self.assertEqual(poll_until(sender, {KVPoll.WaitingForInput}), KVPoll.WaitingForInput)
        sender.send([1])
        sender.send([2, 3], state_indices=[0])
        self.assertEqual(poll_until(sender, {KVPoll.Success, KVPoll.Failed}), KVPoll.Success)
        self.assertEqual(poll_until(receiver, {KVPoll.Success, KVPoll.Failed}), KVPoll.Success)
        for s, d in zip(pre.tensors(), dec.tensors()):
            self.assertTrue(torch.equal(s[[1, 2, 3]], d[[8, 6, 7]]))
        self.assertTrue(torch.equal(pre.ssm[:, 0], dec.ssm[:, 2]))
        # Prefill's ring took its watch and the two chunks; decode's its watch, and it got
        # the room's notification. No gRPC submit, transfer or notification poll.
        self.assertEqual(used(), {"prefill": (3, 0), "decode": (1, 1)})
        self.assertEqual(transfer_rpcs(pre_calls, dec_calls), {})

    def test_close_with_a_callers_client_keeps_its_session(self):
        # The decode manager was given its worker's client: close() closes the ring on
        # the agent (close_fast_path), the session stays, and the room's notification
        # after the close is the client's to poll through gRPC, not lost on a dead ring.
        pre, dec = self.workers("sgkeep")
        self.assertTrue(dec.mgr.route.watching)
        before = agent_status(self.pair.decode)
        sender = self.sender_to(pre, dec, 79, [4])
        dec.mgr.close()
        self.assertEqual(dec.mgr.route.kind, "grpc")
        status = wait_status(self.pair.decode, lambda s: s.fast_path_rings == 0)
        self.assertEqual(status.fast_path_rings, 0)
        self.assertEqual(status.fast_path_closed_by_request, before.fast_path_closed_by_request + 1)
        fill(pre.tensors() + [pre.conv, pre.ssm], 15)
        sender.send([1], state_indices=[0])
        self.assertEqual(poll_until(sender, {KVPoll.Success, KVPoll.Failed}), KVPoll.Success)
        notes, deadline = [], time.monotonic() + 10
        while not notes and time.monotonic() < deadline:
            notes += dec.client.poll_notifications()  # the session is still up
            time.sleep(0.01)
        self.assertEqual([n.ok for n in notes], [True])
        for s, d in zip(pre.tensors(), dec.tensors()):
            self.assertTrue(torch.equal(s[1], d[4]))

    def test_cancel_and_a_refused_chunk_on_the_ring(self):
        # The route's chunked transfer: a chunk is taken, cancel() goes through the ring
        # (after that chunk's entry) and answers CANCELLED; the next chunk's refusal
        # comes back with the agent's message and type.
        pre, dec = self.workers("sgcancel")
        peer = pre.mgr.peer(dec.client.address)
        calls = count_calls(pre.client)
        chunks = pre.mgr.route.open_transfer(peer, "sgcancel-1",
                                             remote_groups=pre.mgr.remote_groups(
                                                 {"groups": dec.mgr.groups}))
        first = chunks.send(pages=([0], [0]))
        self.assertEqual(first.result(timeout=5).phase, kvagent.pb.PENDING)
        state = first.cancel()
        self.assertEqual((state.phase, state.error_message), (kvagent.pb.CANCELLED,
                                                             "transfer 'sgcancel-1' was cancelled"))
        last = chunks.finish(pages=([1], [1]))
        with self.assertRaises(kvagent.FailedPrecondition) as caught:
            last.result(timeout=5)
        self.assertIn("transfer 'sgcancel-1' is already CANCELLED", caught.exception.message)
        self.assertIn("chunk 1 cannot be added; submit a new transfer_id", caught.exception.message)
        self.assertEqual(sum(calls.values()), 0, calls)  # all of it on the ring


class SglangConnectorGrpcTest(Scenarios, PairTestCase):
    """fast_path "off": gRPC, as before the ring."""

    fast_path = "off"
    route = "grpc"


if __name__ == "__main__":
    main()

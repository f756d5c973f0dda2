"""complete_when from Python (issue 15) against two real agents: a one-page WRITE with
complete_when="placed" through gRPC, asyncio and the fast path ring completes, its
bytes are right, decode gets exactly one DATA_READY, the state says
COMPLETE_WHEN_PLACED and peer_acknowledged turns true after COMPLETED (the timeline's
ACKNOWLEDGED follows ENDED; with the default it comes before); a bad value raises
ValueError with nothing sent; a later chunk naming another completion point is refused
by the agent and the transfer then completes with its right last chunk."""
import asyncio
import time

import torch

import kvagent
import kvagent.aio
from client_test import connected_kv, fill, kv_cache
from harness import (PairTestCase, agent_status, count_calls, main, placed_and_acknowledged,
                     stages)
from kvagent._proto import kvagent_pb2 as pb
from kvagent.fast_path import FastPath
from kvagent.fast_route import Route

PLACED, ACKNOWLEDGED = pb.COMPLETE_WHEN_PLACED, pb.COMPLETE_WHEN_ACKNOWLEDGED


class CompleteWhenTest(PairTestCase):
    def wait_peer_acknowledged(self, transfer, seconds=5.0):
        return placed_and_acknowledged(self, transfer.state, transfer.id, seconds)

    def check_placed(self, state):
        """A placed transfer's whole state once its peer acknowledged."""
        self.assertEqual(state.phase, pb.COMPLETED)
        self.assertEqual(pb.CompletionPoint.Name(state.complete_when), "COMPLETE_WHEN_PLACED")
        self.assertEqual(state.peer_note, "")
        order = stages(state)
        self.assertIn("STAGE_ENDED", order)
        self.assertIn("STAGE_ACKNOWLEDGED", order)
        self.assertLess(order.index("STAGE_ENDED"), order.index("STAGE_ACKNOWLEDGED"),
                        f"COMPLETED when placed must end before the peer's ack: {order}")

    def data_ready(self, take, transfer_id, payload, settle=0.3):
        """Notifications from take() until `transfer_id`'s came, and `settle` s more:
        exactly one, DATA_READY with `payload`."""
        got, deadline, end = [], time.monotonic() + 10, None
        while time.monotonic() < (end or deadline):
            got += [n for n in take() if n.request_id == transfer_id]
            if got and end is None:
                end = time.monotonic() + settle
            time.sleep(0.01)
        self.assertEqual([(n.kind, n.payload) for n in got], [("DATA_READY", payload)],
                         f"decode's notifications of '{transfer_id}'")

    def placed_counted(self, before, count=1):
        status = agent_status(self.pair.prefill)
        self.assertEqual(status.completed_when_placed - before.completed_when_placed, count)
        return status

    # ---- gRPC --------------------------------------------------------------------
    def test_placed_one_page_write_through_grpc(self):
        pre, dec, src, dst = connected_kv(self, "cw-grpc", 41)
        before = agent_status(self.pair.prefill)
        transfer = pre.transfer("decode", "placed-grpc", pages=([3], [7]), notification=b"p",
                                complete_when="placed")
        state = transfer.result(timeout=10)
        self.assertEqual((state.phase, state.items), (pb.COMPLETED, 1))
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[3], d[7]))
        self.check_placed(self.wait_peer_acknowledged(transfer))
        self.data_ready(dec.poll_notifications, "placed-grpc", b"p")
        self.placed_counted(before)
        # The pb value is taken too, and the default still waits for the peer's ack.
        by_value = pre.transfer("decode", "placed-pb", pages=([4], [8]), complete_when=PLACED,
                                wait=True)
        self.assertEqual(by_value.last_state.phase, pb.COMPLETED)
        self.check_placed(self.wait_peer_acknowledged(by_value))
        acked = pre.transfer("decode", "acked-grpc", pages=([5], [9]), wait=True).state()
        self.assertEqual((acked.phase, acked.complete_when, acked.peer_acknowledged),
                         (pb.COMPLETED, ACKNOWLEDGED, False))
        order = stages(acked)
        self.assertLess(order.index("STAGE_ACKNOWLEDGED"), order.index("STAGE_ENDED"), order)
        self.placed_counted(before, 2)
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[[4, 5]], d[[8, 9]]))

    def test_placed_through_asyncio(self):
        dec = kvagent.connect(self.pair.decode.socket, name="cw-aio-dec")
        self.addCleanup(dec.close)
        dk, dv = kv_cache(dec)
        for t in dk + dv:
            t.zero_()
        dec.register_kv_cache(dk, dv)

        async def scenario():
            pre = await kvagent.aio.connect(self.pair.prefill.socket, name="cw-aio-pre")
            try:
                sk, sv = kv_cache(pre)
                fill(sk + sv, 43)
                await pre.register_kv_cache(sk, sv)
                await pre.connect_peer(dec.address)
                transfer = await pre.transfer("decode", "placed-aio", pages=([2], [6]),
                                              notification=b"a", complete_when="placed")
                state = await transfer
                self.assertEqual(state.phase, pb.COMPLETED)
                for s, d in zip(sk + sv, dk + dv):
                    self.assertTrue(torch.equal(s[2], d[6]))
                for _ in range(500):
                    whole = await transfer.state()
                    if whole.peer_acknowledged:
                        break
                    await asyncio.sleep(0.01)
                return whole
            finally:
                await pre.close()

        whole = asyncio.run(asyncio.wait_for(scenario(), 30))
        self.assertTrue(whole.peer_acknowledged, f"peer_acknowledged still false 5 s after "
                        f"COMPLETED (peer_note {whole.peer_note!r}, timeline {stages(whole)})")
        self.check_placed(whole)
        self.data_ready(dec.poll_notifications, "placed-aio", b"a")

    # ---- the fast path ring ------------------------------------------------------
    def test_placed_one_page_write_through_the_ring(self):
        pre, dec, src, dst = connected_kv(self, "cw-ring", 47)
        calls = count_calls(pre)
        before = agent_status(self.pair.prefill)
        ring = FastPath(pre, submission_slots=8)
        self.addCleanup(ring.close)
        watch = FastPath(dec, submission_slots=8)  # decode's notifications on its ring
        self.addCleanup(watch.close)
        watch.watch_notifications(user_data=9)
        self.assertEqual([(c.user_data, c.code) for c in watch.reap(timeout=5)], [(9, 0)])
        ring.transfer(1, "decode", "placed-ring", pages=([6], [2]), notification=b"r",
                      complete_when="placed")
        got = ring.reap(timeout=10)
        self.assertEqual([(c.user_data, c.code, c.phase) for c in got], [(1, 0, "COMPLETED")],
                         got and got[0].message)
        self.assertEqual(calls["SubmitTransfer"], 0)  # it went by the ring
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[6], d[2]))
        self.check_placed(self.wait_peer_acknowledged(kvagent.Transfer(pre, "placed-ring",
                                                                       pb.TransferState())))

        def take():
            return [kvagent.Notification(dec, c.notification, "")
                    for c in watch.reap(timeout=0) if c.notification is not None]
        self.data_ready(take, "placed-ring", b"r")
        self.placed_counted(before)

    def test_chunked_placed_through_the_route(self):
        pre, dec, src, dst = connected_kv(self, "cw-route", 53)
        calls = count_calls(pre)
        route = Route(pre, mode="on", owner="cw-route")
        self.addCleanup(route.close)
        chunks = route.open_transfer("decode", "placed-route", complete_when="placed")
        chunks.send(pages=([0, 1], [10, 11]))
        transfer = chunks.finish(pages=([2], [12]), notification=b"c")  # chunk 1: unset
        state = transfer.result(timeout=10)
        self.assertEqual(state.phase, pb.COMPLETED)
        self.assertEqual((calls["SubmitTransfer"], route.grpc_fallbacks), (0, 0))
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[0:3], d[10:13]))
        whole = self.wait_peer_acknowledged(transfer)  # RingTransfer.state(): GetTransfer
        self.check_placed(whole)
        self.assertEqual(whole.chunks, 2)
        self.data_ready(dec.poll_notifications, "placed-route", b"c")

    # ---- refusals ----------------------------------------------------------------
    def test_a_bad_value_raises_value_error_before_anything_is_sent(self):
        pre, dec, src, dst = connected_kv(self, "cw-bad", 59)
        calls = count_calls(pre)
        route = Route(pre, mode="on", owner="cw-bad")  # the session's one ring
        self.addCleanup(route.close)
        ring = route.ring
        entry_points = {
            "Client.transfer": lambda v: pre.transfer("decode", "bad-1", pages=([0], [0]),
                                                      complete_when=v),
            "Client.open_transfer": lambda v: pre.open_transfer("decode", "bad-2",
                                                                complete_when=v),
            "FastPath.transfer": lambda v: ring.transfer(3, "decode", "bad-3",
                                                         pages=([0], [0]), complete_when=v),
            "Route.transfer": lambda v: route.transfer("decode", "bad-4", pages=([0], [0]),
                                                       complete_when=v),
            "Route.open_transfer": lambda v: route.open_transfer("decode", "bad-5",
                                                                 complete_when=v),
        }
        for name, submit in entry_points.items():
            for value in ("soon", "PLACED", 2, -1, True, None):
                with self.subTest(entry_point=name, value=value):
                    with self.assertRaises(ValueError) as e:
                        submit(value)
                    self.assertIsInstance(e.exception, kvagent.InvalidArgument)
                    text = str(e.exception)
                    self.assertIn(f"complete_when {value!r}", text)
                    self.assertIn("'acknowledged'", text)
                    self.assertIn("'placed'", text)

        async def aio_submit():
            apre = await kvagent.aio.connect(self.pair.prefill.socket, name="cw-bad-aio")
            try:
                await apre.transfer("decode", "bad-6", pages=([0], [0]), complete_when="later")
            finally:
                await apre.close()
        with self.assertRaises(ValueError) as e:
            asyncio.run(aio_submit())
        self.assertIn("complete_when 'later'", str(e.exception))
        # Nothing was sent: no SubmitTransfer, nothing on the ring, no transfer known.
        self.assertEqual(calls["SubmitTransfer"], 0)
        self.assertTrue(route.watching)
        self.assertEqual(ring._tail, 1)  # only the route's notification watch
        for i in range(1, 7):
            with self.assertRaises(kvagent.NotFound):
                pre.call("GetTransfer", pb.GetTransferRequest(transfer_id=f"bad-{i}"), "check")

    def test_a_later_chunk_with_another_value_is_refused_grpc(self):
        pre, dec, src, dst = connected_kv(self, "cw-chunk", 61)
        chunks = pre.open_transfer("decode", "mixed-grpc")  # chunk 0: acknowledged
        chunks.send(pages=([0], [20]))
        bad = pre._transfer_request("decode", "mixed-grpc", pages=([1], [21]), chunk=1,
                                    complete_when="placed")
        self.assertEqual(bad.complete_when, PLACED)
        with self.assertRaises(kvagent.InvalidArgument) as e:
            pre.call("SubmitTransfer", bad, "chunk 1 with complete_when placed")
        self.assertIn("chunk 1: complete_when COMPLETE_WHEN_PLACED differs from chunk 0's "
                      "(COMPLETE_WHEN_ACKNOWLEDGED)", e.exception.message)
        # The transfer is still open: its right last chunk completes it.
        state = chunks.finish(pages=([1], [21]), notification=b"m").result(timeout=10)
        self.assertEqual((state.phase, state.chunks, state.complete_when),
                         (pb.COMPLETED, 2, ACKNOWLEDGED))
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[0:2], d[20:22]))
        self.data_ready(dec.poll_notifications, "mixed-grpc", b"m", settle=0.1)
        # Repeating chunk 0's value on a later chunk is accepted.
        repeat = pre.open_transfer("decode", "repeat-grpc", complete_when="placed")
        repeat.send(pages=([2], [22]))
        again = pre._transfer_request("decode", "repeat-grpc", pages=([3], [23]), chunk=1,
                                      complete_when="placed", notification=b"r")
        pre.call("SubmitTransfer", again, "chunk 1 repeating complete_when placed")
        self.check_placed(self.wait_peer_acknowledged(kvagent.Transfer(pre, "repeat-grpc",
                                                                       pb.TransferState())))
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[2:4], d[22:24]))

    def test_a_later_chunk_with_another_value_is_refused_on_the_ring(self):
        pre, dec, src, dst = connected_kv(self, "cw-ringchunk", 67)
        ring = FastPath(pre, submission_slots=8)
        self.addCleanup(ring.close)

        def entry(user_data, request):
            ring.submit(request, user_data)
            got = ring.reap(timeout=10)
            self.assertEqual([c.user_data for c in got], [user_data])
            return got[0]

        first = entry(1, pre._transfer_request("decode", "mixed-ring", pages=([4], [24]),
                                               more_chunks=True))
        self.assertEqual(first.code, 0, first.message)
        bad = entry(2, pre._transfer_request("decode", "mixed-ring", pages=([5], [25]),
                                             chunk=1, complete_when="placed"))
        self.assertEqual(bad.error().code.name, "INVALID_ARGUMENT")
        self.assertIn("differs from chunk 0's", bad.message)
        last = entry(3, pre._transfer_request("decode", "mixed-ring", pages=([5], [25]),
                                              chunk=1, notification=b"x"))
        self.assertEqual((last.code, last.phase), (0, "COMPLETED"), last.message)
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[4:6], d[24:26]))
        self.data_ready(dec.poll_notifications, "mixed-ring", b"x", settle=0.1)


if __name__ == "__main__":
    main()

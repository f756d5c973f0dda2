"""The fast path from Python (kvagent.fast_path) against two real agents: many
transfers behind the ring's doorbells, completions reaped in batches, bytes compared;
a refusal and a ping come back on the completion ring with the agent's message;
notifications come on a watching ring, whole across entries and pads, taken once, or
through a durable subscription with sequences, acknowledged on the ring."""
import gc
import threading
import time

import torch

import kvagent
from client_test import connected_kv
from harness import PairTestCase, agent_status, main, wait_status
from kvagent.fast_path import (ACK_NOTIFICATIONS, CQ_TAIL, FEATURE_WAKE_COUNT, NOTIFICATION,
                               PING, SQ_TAIL, WATCH_NOTIFICATIONS, FastPath)
from kvagent.session import Session
from kvagent._proto import kvagent_pb2 as pb


def poll_for(client, count, seconds=10.0):
    """client.poll_notifications() until `count` came or `seconds` passed."""
    out, deadline = [], time.monotonic() + seconds
    while len(out) < count and time.monotonic() < deadline:
        out += client.poll_notifications()
        time.sleep(0.01)
    return out


class FastPathTest(PairTestCase):
    def test_transfers_through_the_ring(self):
        pre, dec, src, dst = connected_kv(self, "fast", 31)
        ring = FastPath(pre, submission_slots=8)  # small: entries wrap with pads
        self.addCleanup(ring.close)
        done = {}

        def put(entry):
            while True:  # a full ring says so; reaping makes room
                try:
                    return entry()
                except kvagent.ResourceExhausted:
                    done.update((c.user_data, c) for c in ring.reap(timeout=5))

        for i in range(24):
            put(lambda: ring.transfer(i, "decode", f"fast-{i}", pages=([i], [31 - i])))
        put(lambda: ring.ping(100))
        put(lambda: ring.transfer(101, "decode", "fast-bad", pages=([0], [99])))
        while len(done) < 26:
            got = ring.reap(timeout=5)
            self.assertTrue(got, f"no completion in 5 s; have {sorted(done)}")
            done.update((c.user_data, c) for c in got)
        for i in range(24):
            self.assertEqual((done[i].code, done[i].phase), (0, "COMPLETED"), done[i].message)
            for s, d in zip(src, dst):
                self.assertTrue(torch.equal(s[i], d[31 - i]))
        self.assertTrue(done[100].ok)
        bad = done[101].error()
        self.assertEqual(bad.code.name, "INVALID_ARGUMENT")
        self.assertIn("remote index 99 at position 0 is out of range", bad.message)

    def test_reap_waits_for_a_count(self):
        pre, dec, src, dst = connected_kv(self, "count", 4)
        ring = FastPath(pre, submission_slots=16)
        self.addCleanup(ring.close)
        self.assertTrue(ring.info.features & FEATURE_WAKE_COUNT)

        def pings(first):
            for i in range(8):
                ring.ping(first + i)
                time.sleep(0.02)

        pinger = threading.Thread(target=pings, args=(10,))
        start = time.monotonic()
        pinger.start()
        got = ring.reap(max_count=64, timeout=20, min_count=8)
        took = time.monotonic() - start
        pinger.join()
        self.assertEqual([(c.user_data, c.opcode, c.code) for c in got],
                         [(10 + i, PING, 0) for i in range(8)])
        self.assertGreaterEqual(took, 0.12)  # the 8th came ~140 ms after the first
        # Fewer than wanted before the timeout: what came, when it passes.
        for i in range(3):
            ring.ping(30 + i)
        start = time.monotonic()
        got = ring.reap(max_count=64, timeout=0.3, min_count=8)
        self.assertEqual([c.user_data for c in got], [30, 31, 32])
        self.assertGreaterEqual(time.monotonic() - start, 0.25)
        # And the ring still moves bytes.
        ring.transfer(40, "decode", "count-after", pages=([1], [2]))
        got = ring.reap(timeout=10)
        self.assertEqual([(c.user_data, c.phase) for c in got], [(40, "COMPLETED")],
                         got and got[0].message)
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[1], d[2]))
        # More wanted than an 8-entry completion ring holds: all 16 come, a ring's worth
        # at a time (the agent takes the second 8 once the first are reaped). A new ring
        # of the same session, the first one closed.
        ring.close()
        small = FastPath(pre, submission_slots=32, completion_entries=8)
        self.addCleanup(small.close)
        for i in range(16):
            small.ping(50 + i)
        start = time.monotonic()
        got = small.reap(max_count=64, timeout=20, min_count=16)
        self.assertEqual([c.user_data for c in got], list(range(50, 66)))
        self.assertLess(time.monotonic() - start, 10)

    def test_notifications_on_a_watching_ring(self):
        pre, dec, src, dst = connected_kv(self, "notes", 5)
        ring = FastPath(dec, submission_slots=8, completion_entries=8)
        self.addCleanup(ring.close)
        ring.watch_notifications(user_data=7)
        answer = ring.reap(timeout=5)
        self.assertEqual([(c.user_data, c.opcode, c.code) for c in answer],
                         [(7, WATCH_NOTIFICATIONS, 0)], answer and answer[0].message)
        # 1 to 4 entries each on an 8-entry ring: some start over at entry 0 after a pad.
        for i in range(10):
            payload = bytes([65 + i]) * (i * 190)
            t = pre.transfer("decode", f"note-{i}", pages=([i], [i]), notification=payload,
                             wait=True)
            got = ring.reap(timeout=5)
            self.assertEqual(len(got), 1, f"notification {i}: {got}")
            c = got[0]
            self.assertEqual((c.opcode, c.user_data, c.code, c.phase), (NOTIFICATION, 7, 0, ""),
                             c.message)
            n = c.notification
            self.assertEqual((n.transfer_id, n.payload, n.kind), (t.id, payload, pb.DATA_READY))
            self.assertEqual(c.bytes_done, n.bytes)
            for s, d in zip(src, dst):
                self.assertTrue(torch.equal(s[i], d[i]))
        self.assertEqual(dec.poll_notifications(), [])  # taken once: on the ring

    def test_an_older_agent_is_not_asked_to_watch(self):
        # An agent older than notifications on the ring lacks the feature bit and would
        # close the whole ring on the watch entry: the client refuses, writing nothing.
        pre, dec, src, dst = connected_kv(self, "older", 2)
        ring = FastPath(dec, submission_slots=8)
        self.addCleanup(ring.close)
        self.assertTrue(ring.delivers_notifications())  # this agent announces the bit
        ring.info.ClearField("features")
        self.assertFalse(ring.delivers_notifications())
        with self.assertRaises(kvagent.FailedPrecondition) as e:
            ring.watch_notifications(user_data=7)
        self.assertIn("this agent's fast path does not deliver notifications", e.exception.message)
        self.assertIn("take them with gRPC WatchNotifications", e.exception.message)
        self.assertEqual((ring._tail, ring._words[SQ_TAIL]), (0, 0))  # nothing written
        ring.ping(8)  # the ring is still open and answers
        self.assertEqual([(c.user_data, c.opcode, c.code) for c in ring.reap(timeout=5)],
                         [(8, PING, 0)])

    def test_a_durable_subscription_on_the_ring(self):
        pre, dec, src, dst = connected_kv(self, "durable", 9)
        ring = FastPath(dec, submission_slots=8)
        self.addCleanup(ring.close)
        self.assertTrue(ring.delivers_durable_notifications())
        ring.watch_notifications(user_data=7, subscription="py-sub")
        answer = ring.reap(timeout=5)
        self.assertEqual([(c.user_data, c.opcode, c.code) for c in answer],
                         [(7, WATCH_NOTIFICATIONS, 0)], answer and answer[0].message)
        ids = [pre.transfer("decode", f"durable-{i}", pages=([i], [i]), notification=b"n",
                            wait=True).id for i in range(3)]
        got = []
        while len(got) < 3:
            more = ring.reap(timeout=5)
            self.assertTrue(more, f"no notification in 5 s; have {len(got)}")
            got += more
        self.assertEqual([(c.opcode, c.user_data, c.code) for c in got], [(NOTIFICATION, 7, 0)] * 3)
        self.assertEqual([c.notification.transfer_id for c in got], ids)
        sequences = [c.notification.sequence for c in got]
        self.assertEqual(sorted(set(sequences)), sequences)  # increasing
        self.assertTrue(sequences[0] > 0)
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[:3], d[:3]))

        def ack(user_data, subscription="py-sub", **kwargs):
            ring.ack_notifications(subscription, user_data=user_data, **kwargs)
            (c,) = ring.reap(timeout=5)
            self.assertEqual((c.user_data, c.opcode), (user_data, ACK_NOTIFICATIONS))
            return c

        c = ack(8, through=sequences[1])
        self.assertEqual((c.code, c.bytes_done), (0, 2), c.message)
        c = ack(9, sequences=[sequences[2]])
        self.assertEqual((c.code, c.bytes_done), (0, 1), c.message)
        c = ack(10, subscription="never-made", through=1)
        self.assertEqual(c.error().code.name, "NOT_FOUND")
        self.assertIn("ack-notifications entry 10: AckNotifications: no subscription 'never-made'",
                      c.message)
        self.assertEqual(dec.poll_notifications(), [])

    def test_an_older_agent_is_not_asked_for_durable_subscriptions(self):
        pre, dec, src, dst = connected_kv(self, "older-durable", 3)
        ring = FastPath(dec, submission_slots=8)
        self.addCleanup(ring.close)
        ring.info.features &= ~2  # as an agent with notifications but no durable ones
        self.assertTrue(ring.delivers_notifications())
        self.assertFalse(ring.delivers_durable_notifications())
        for call in (lambda: ring.watch_notifications(user_data=7, subscription="s"),
                     lambda: ring.ack_notifications("s", through=1, user_data=8)):
            with self.assertRaises(kvagent.FailedPrecondition) as e:
                call()
            self.assertIn("this agent's fast path has no durable subscriptions",
                          e.exception.message)
        self.assertEqual((ring._tail, ring._words[SQ_TAIL]), (0, 0))  # nothing written
        ring.watch_notifications((), 9)  # the existing call, positional, still works
        self.assertEqual([(c.user_data, c.opcode, c.code) for c in ring.reap(timeout=5)],
                         [(9, WATCH_NOTIFICATIONS, 0)])

    def test_close_keeps_the_session_and_hands_back_what_the_ring_held(self):
        pre, dec, src, dst = connected_kv(self, "close", 4)
        # Earlier tests' rings go with their sessions, a moment after.
        before = wait_status(self.pair.decode, lambda s: s.fast_path_rings == 0)
        self.assertEqual(before.fast_path_rings, 0)
        ring = FastPath(dec, submission_slots=8)
        self.addCleanup(ring.close)
        ring.watch_notifications(user_data=7)
        self.assertEqual([(c.opcode, c.code) for c in ring.reap(timeout=5)],
                         [(WATCH_NOTIFICATIONS, 0)])
        t = pre.transfer("decode", "close-0", pages=([0], [0]), notification=b"held", wait=True)
        wait_status(self.pair.decode, lambda s: s.fast_path_notifications
                    > before.fast_path_notifications)
        left = ring.close()  # written on the ring, not reaped: handed back, not lost
        self.assertEqual([(c.opcode, c.notification.transfer_id, c.notification.payload)
                          for c in left], [(NOTIFICATION, t.id, b"held")])
        self.assertEqual(ring.transfers_running, 0)
        self.assertEqual(ring.close(), [])  # once
        status = agent_status(self.pair.decode)  # closed when the answer came
        self.assertEqual(status.fast_path_rings, 0)  # while dec's session stays up
        self.assertEqual(status.fast_path_closed_by_request,
                         before.fast_path_closed_by_request + 1)
        # The session stays: a later notification waits for gRPC, and a new ring opens.
        t = pre.transfer("decode", "close-1", pages=([1], [1]), notification=b"later", wait=True)
        polled = poll_for(dec, 1)
        self.assertEqual([(n.request_id, n.payload) for n in polled], [(t.id, b"later")])
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[:2], d[:2]))
        again = FastPath(dec, submission_slots=8)
        self.addCleanup(again.close)
        again.ping(3)
        self.assertEqual([(c.user_data, c.opcode, c.code) for c in again.reap(timeout=5)],
                         [(3, PING, 0)])

    def test_a_with_block_closes_the_ring_on_the_agent(self):
        pre, dec, src, dst = connected_kv(self, "with", 6)
        before = wait_status(self.pair.decode, lambda s: s.fast_path_rings == 0)
        self.assertEqual(before.fast_path_rings, 0)
        with FastPath(dec, submission_slots=8) as ring:
            ring.ping(4)
            self.assertEqual([(c.user_data, c.opcode, c.code) for c in ring.reap(timeout=5)],
                             [(4, PING, 0)])
            self.assertEqual(agent_status(self.pair.decode).fast_path_rings, 1)
        status = agent_status(self.pair.decode)  # closed as the block ended, session kept
        self.assertEqual(status.fast_path_rings, 0)
        self.assertEqual(status.fast_path_closed_by_request,
                         before.fast_path_closed_by_request + 1)
        self.assertEqual(ring.close(), [])  # already closed

    def test_a_ring_dropped_without_close_is_closed_at_garbage_collection(self):
        pre, dec, src, dst = connected_kv(self, "dropped", 7)
        before = wait_status(self.pair.decode, lambda s: s.fast_path_rings == 0)
        self.assertEqual(before.fast_path_rings, 0)
        ring = FastPath(dec, submission_slots=8)
        # The finalizer holds the session weakly: it keeps no session alive by itself.
        _, _, args, _ = ring._finalizer.peek()
        self.assertFalse([a for a in args if isinstance(a, (Session, kvagent.Client))])
        ring.ping(5)  # its completion stays on the ring, not reaped
        deadline = time.monotonic() + 5
        while ring._words[CQ_TAIL] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        self.assertEqual(ring._words[CQ_TAIL], 1)
        self.assertEqual(agent_status(self.pair.decode).fast_path_rings, 1)
        with self.assertLogs("kvagent.fast_path", "WARNING") as logs:
            del ring
            gc.collect()
        self.assertEqual(len(logs.output), 1, logs.output)
        self.assertIn("was dropped without close(); the agent closed its ring, dropping 1 "
                      "completion-ring entries not reaped; 0 of its transfers still run",
                      logs.output[0])
        self.assertIn("call close() or use `with FastPath(...)`", logs.output[0])
        status = agent_status(self.pair.decode)  # closed when the answer came
        self.assertEqual(status.fast_path_rings, 0)  # while dec's session stays up
        self.assertEqual(status.fast_path_closed_by_request,
                         before.fast_path_closed_by_request + 1)
        again = FastPath(dec, submission_slots=8)  # the session may open a new ring
        again.ping(6)
        self.assertEqual([(c.user_data, c.opcode, c.code) for c in again.reap(timeout=5)],
                         [(6, PING, 0)])
        # After close() the finalizer does nothing: no second close_fast_path, no warning.
        self.assertEqual(again.close(), [])
        self.assertFalse(again._finalizer.alive)
        closed = agent_status(self.pair.decode).fast_path_closed_by_request
        self.assertEqual(closed, before.fast_path_closed_by_request + 2)
        with self.assertNoLogs("kvagent.fast_path", "DEBUG"):
            del again
            gc.collect()
        self.assertEqual(agent_status(self.pair.decode).fast_path_closed_by_request, closed)
        # Dropped with its client closed (the session's end closed the ring): nothing sent.
        third = FastPath(dec, submission_slots=8)
        dec.close()
        with self.assertNoLogs("kvagent.fast_path", "WARNING"):
            del third
            gc.collect()
        self.assertEqual(agent_status(self.pair.decode).fast_path_closed_by_request, closed)

    def test_close_against_an_agent_without_close_fast_path_only_unmaps(self):
        pre, dec, src, dst = connected_kv(self, "close-older", 5)
        # How an older agent sees close_fast_path: a body it does not know. This agent's
        # answer to such a body is what an older one gives.
        unknown = pb.SessionRequest.FromString(b"\xca\x06\x00")  # field 105, empty
        with self.assertRaises(kvagent.KvAgentError) as e:
            dec.session.call(unknown)
        self.assertEqual(e.exception.code.name, "UNIMPLEMENTED")
        before = wait_status(self.pair.decode, lambda s: s.fast_path_rings == 0)
        self.assertEqual(before.fast_path_rings, 0)
        ring = FastPath(dec, submission_slots=8)
        real = dec.session.call

        def older(request, fds=(), what=None):
            if request.HasField("close_fast_path"):
                request = pb.SessionRequest.FromString(b"\xca\x06\x00")
            return real(request, fds, what)

        dec.session.call = older
        self.addCleanup(setattr, dec.session, "call", real)
        self.assertEqual(ring.close(), [])
        status = agent_status(self.pair.decode)  # the agent keeps the ring with the session
        self.assertEqual(status.fast_path_rings, 1)
        self.assertEqual(status.fast_path_closed_by_request, before.fast_path_closed_by_request)


if __name__ == "__main__":
    main()

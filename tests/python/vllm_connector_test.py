"""The vLLM-shaped connector (kvagent.connectors.vllm) driven through the calls vLLM's
v1 scheduler and model runner make on a prefill instance and a decode instance (the
NIXL connector's pull flow), with vLLM-layout torch caches ([2, blocks, block_size,
heads, head_dim] per layer) and two real agents, bytes compared. Each scenario runs on
both routes: the sessions' fast path rings (the default) and gRPC (fast_path "off", and
"auto" against agents started with --fast-path off). complete_when "placed" (issue 15):
READs complete once the blocks are in decode's memory, prefill is told once, and the
prefill agent's acknowledgement is recorded after, a READ whose notification the prefill
agent refuses still completes (an acknowledged one fails); a bad value stops the
connector. Prefill's held blocks are released once (get_finished's finished sending) when
the decode side's READ ends in any outcome (DATA_READY, or TRANSFER_FAILED,
CANCELLED_BY_PEER, TRANSFER_TIMED_OUT, logged), or when abort_request_timeout_s passes
with no notification (nobody reads, or prefill's agent refuses it); a late notification
reports nothing again; a bad timeout stops the connector."""
import logging
import math
import os
import time
from types import SimpleNamespace

import torch

import kvagent
from client_test import fill
from harness import (ENGINES_ONLY, PairTestCase, agent_status, count_calls, main,
                     placed_and_acknowledged, record_notifications, ring_use, transfer_rpcs,
                     wait_status)
from kvagent._proto import kvagent_pb2 as pb
from kvagent.connectors.vllm import InvalidAbortTimeout, KvAgentConnector
from kvagent.fast_path import SQ_TAIL

LAYERS, BLOCKS, BLOCK = 3, 24, 16


def config(socket, **extra):
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config={"kvagent_socket": socket, **extra}))


class Instance:
    """One vLLM instance: its scheduler-side and worker-side connectors and caches."""

    def __init__(self, socket, name, group, abort=None, **route):
        """abort: both roles' abort_request_timeout_s (unset: the default); route: the
        worker's other settings."""
        self.client = kvagent.connect(socket, name=name)
        self.caches = {f"model.layers.{i}.self_attn.attn":
                       self.client.empty((2, BLOCKS, BLOCK, 2, 32), torch.float16)
                       for i in range(LAYERS)}
        for t in self.caches.values():
            t.zero_()
        both = {} if abort is None else {"abort_request_timeout_s": abort}
        self.scheduler = KvAgentConnector(config(socket, kvagent_group=group, **both),
                                          "scheduler")
        self.worker = KvAgentConnector(config(socket, kvagent_group=group,
                                              kvagent_client=self.client, **both, **route),
                                       "WORKER")
        self.worker.register_kv_caches(self.caches)

    def step(self, meta):
        """One model-runner step as vLLM's GPU model runner drives the connector."""
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(SimpleNamespace())
        for layer, cache in self.caches.items():
            self.worker.wait_for_layer_load(layer)
            self.worker.save_kv_layer(layer, cache, None)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()


def until_finished(worker, rid, sending, seconds=10):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done = worker.get_finished(set())[0 if sending else 1] or set()
        if rid in done:
            return True
        time.sleep(0.002)
    return False


def finished(worker, rids, sending, seconds=10):
    """The subset of `rids` get_finished reports within `seconds`."""
    rids, seen = set(rids), set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not rids <= seen:
        seen |= worker.get_finished(set())[0 if sending else 1] or set()
        time.sleep(0.002)
    return seen & rids


def hold(p, blocks):
    """Prefill's scheduler finishes each request of {request id: block ids} for remote
    decode (blocks held) and the next step hands the workers the holds; returns each
    request's kv_transfer_params (what the decode side pulls with)."""
    params = {}
    for rid, ids in blocks.items():
        held, params[rid] = p.scheduler.request_finished(SimpleNamespace(
            request_id=rid, prompt_token_ids=[1] * BLOCK,
            kv_transfer_params={"do_remote_decode": True}), list(ids))
        assert held, rid
    p.step(p.scheduler.build_connector_meta(None))
    return params


def sending_over(worker, seconds, until=(), then=0.3):
    """[(monotonic time, request id)] of every finished sending get_finished reports
    while it is called for `seconds`, or, once every request of `until` was reported,
    for `then` seconds more (a second report of one would come by then)."""
    got, deadline, until = [], time.monotonic() + seconds, set(until)
    while time.monotonic() < deadline:
        got += [(time.monotonic(), r) for r in worker.get_finished(set())[0] or ()]
        if until and until <= {r for _, r in got}:
            deadline, until = min(deadline, time.monotonic() + then), set()
        time.sleep(0.002)
    return got


def pull_params(pair, group, rid, blocks):
    """kv_transfer_params as prefill's request_finished gives them (decode pulls)."""
    return {"do_remote_prefill": True, "remote_block_ids": list(blocks),
            "remote_agent": pair.prefill.address, "remote_request_id": rid,
            "remote_group": group}


class Scenarios:
    """The connector's call sequences; each class runs them on one route."""

    fast_path = "auto"  # the connectors' knob
    route = "fast_path"  # the route the workers must have taken

    def instances(self, tag, **route):
        # Different group names on the two sides: kv_transfer_params carry prefill's.
        route.setdefault("fast_path", self.fast_path)
        p = Instance(self.pair.prefill.socket, f"{tag}-p", f"{tag}-prefill-kv", **route)
        d = Instance(self.pair.decode.socket, f"{tag}-d", "kv", **route)
        for i in (p, d):
            self.addCleanup(i.client.close)
            self.addCleanup(i.worker.close)
            self.assertEqual(i.worker.route.kind, self.route, i.worker.route.describe())
        return p, d

    def pull(self, p, d, tag, blocks):
        """One decode step pulling a one-block request per (prefill, decode) block pair:
        every READ ended without error, bytes compared. Returns the request ids."""
        rids = [f"{tag}-{i}" for i in range(len(blocks))]
        params = hold(p, {f"p-{rid}": [src] for rid, (src, _) in zip(rids, blocks)})
        for rid, (src, dst) in zip(rids, blocks):
            dreq = SimpleNamespace(request_id=rid, prompt_token_ids=[1] * BLOCK,
                                   kv_transfer_params=params[f"p-{rid}"])
            d.scheduler.update_state_after_alloc(dreq, [dst], BLOCK)
        d.step(d.scheduler.build_connector_meta(None))  # every READ in one step
        self.assertEqual(finished(d.worker, rids, sending=False), set(rids))
        self.assertEqual(d.worker.load_errors, {})
        src, dst = [b[0] for b in blocks], [b[1] for b in blocks]
        for name in p.caches:
            self.assertTrue(torch.equal(p.caches[name][:, src], d.caches[name][:, dst]))
        return rids

    def test_decode_pulls_prefill_blocks(self):
        p, d = self.instances("vl")
        prompt = list(range(40))  # 3 blocks, the last one partial
        # Prefill instance: a request that will be decoded elsewhere.
        preq = SimpleNamespace(request_id="cmpl-7", prompt_token_ids=prompt,
                               kv_transfer_params={"do_remote_decode": True})
        self.assertEqual(p.scheduler.get_num_new_matched_tokens(preq, 0), (0, False))
        p_blocks = [5, 2, 17]
        p.scheduler.update_state_after_alloc(preq, SimpleNamespace(
            get_block_ids=lambda: ([5, 2, 17],)), 0)
        p.step(p.scheduler.build_connector_meta(None))
        fill(list(p.caches.values()), 21)  # the forward pass writes the blocks
        held, params = p.scheduler.request_finished(preq, p_blocks)
        self.assertTrue(held)
        self.assertEqual(params["remote_block_ids"], p_blocks)
        p.step(p.scheduler.build_connector_meta(None))  # the workers get the hold
        # Decode instance: the same request arrives with the prefill side's params.
        dreq = SimpleNamespace(request_id="cmpl-7-d", prompt_token_ids=prompt,
                               kv_transfer_params=params)
        self.assertEqual(d.scheduler.get_num_new_matched_tokens(dreq, 0), (40, True))
        d_blocks = [20, 0, 9]
        d.scheduler.update_state_after_alloc(dreq, SimpleNamespace(
            get_unhashed_block_ids=lambda: d_blocks), 40)
        self.assertEqual(d.scheduler.get_num_new_matched_tokens(dreq, 0), (0, False))  # once
        meta = d.scheduler.build_connector_meta(None)
        self.assertEqual(list(meta.reqs_to_recv), ["cmpl-7-d"])
        d.step(meta)
        self.assertTrue(until_finished(d.worker, "cmpl-7-d", sending=False))
        self.assertEqual(d.worker.load_errors, {})
        for name in p.caches:
            self.assertTrue(torch.equal(p.caches[name][:, p_blocks], d.caches[name][:, d_blocks]))
            others = [b for b in range(BLOCKS) if b not in d_blocks]
            self.assertTrue(bool((d.caches[name][:, others] == 0).all()))
        # The prefill side learns its blocks were read and may free them.
        self.assertTrue(until_finished(p.worker, "cmpl-7", sending=True))
        # The default: the READ completed once prefill's agent acknowledged it.
        self.assertEqual(d.worker.complete_when, "acknowledged")
        state = kvagent.Transfer(d.client, "cmpl-7", pb.TransferState()).state()
        self.assertEqual((pb.TransferPhase.Name(state.phase),
                          pb.CompletionPoint.Name(state.complete_when)),
                         ("COMPLETED", "COMPLETE_WHEN_ACKNOWLEDGED"))

    def test_placed_pulls_complete_and_prefill_is_told_once(self):
        # complete_when "placed": each READ completes as soon as the prefill blocks are in
        # decode's memory (get_finished reports it loaded), the prefill side is told once
        # (the commit goes with DATA_READY), and prefill's acknowledgement is recorded after.
        p, d = self.instances("vlplaced", complete_when="placed")
        self.assertEqual((d.worker.complete_when, p.worker.complete_when), ("placed", "placed"))
        before = agent_status(self.pair.decode)
        told = record_notifications(p.worker.route)
        fill(list(p.caches.values()), 27)
        ids = [f"p-{rid}" for rid in self.pull(p, d, "vlplaced", [(0, 5), (1, 6), (2, 7)])]
        self.assertEqual(finished(p.worker, ids, sending=True), set(ids))
        time.sleep(0.3)  # a second notification of any of them would have come by now
        p.worker.get_finished(set())
        self.assertEqual(sorted((n.request_id, n.kind) for n in told if n.request_id in ids),
                         [(i, "DATA_READY") for i in sorted(ids)],
                         "prefill's notifications of the placed READs")
        for transfer_id in ids:
            state = placed_and_acknowledged(
                self, lambda: d.client.call("GetTransfer", pb.GetTransferRequest(
                    transfer_id=transfer_id), "peer_acknowledged"), transfer_id)
            self.assertEqual((pb.TransferPhase.Name(state.phase), pb.TransferOp.Name(state.op),
                              pb.CompletionPoint.Name(state.complete_when), state.peer_note),
                             ("COMPLETED", "READ", "COMPLETE_WHEN_PLACED", ""))
        status = agent_status(self.pair.decode)
        self.assertEqual((status.completed_when_placed - before.completed_when_placed,
                          status.placed_not_taken - before.placed_not_taken), (3, 0),
                         "decode agent's (completed_when_placed, placed_not_taken) rise")

    def test_failed_load_is_reported_with_the_agents_message(self):
        p, d = self.instances("vlbad")
        params = {"do_remote_prefill": True, "remote_block_ids": [BLOCKS + 1],
                  "remote_agent": self.pair.prefill.address, "remote_request_id": "x-1",
                  "remote_group": "vlbad-prefill-kv"}
        dreq = SimpleNamespace(request_id="bad-1", prompt_token_ids=[1] * 10,
                               kv_transfer_params=params)
        d.scheduler.update_state_after_alloc(dreq, [4], 10)
        d.step(d.scheduler.build_connector_meta(None))
        self.assertTrue(until_finished(d.worker, "bad-1", sending=False))
        self.assertEqual(d.worker.get_block_ids_with_load_errors(), {4})
        error = d.worker.load_errors["bad-1"]
        self.assertIsInstance(error, kvagent.InvalidArgument)
        self.assertIn(f"remote index {BLOCKS + 1}", error.message)

    def test_a_read_that_ends_badly_releases_the_prefill_blocks(self):
        # Decode's READ of held prefill blocks opens (chunk 0 moves), then ends otherwise:
        # cancelled, past its deadline with its last chunk never sent, or failed (the
        # decode instance goes, its regions with it). Prefill's agent hands the outcome;
        # get_finished reports the request once, not before, with a warning.
        p, d = self.instances("vlend")
        gone = Instance(self.pair.decode.socket, "vlend-gone", "vlend-gone-kv")
        self.addCleanup(gone.client.close)
        self.addCleanup(gone.worker.close)
        told = record_notifications(p.worker.route)
        fill(list(p.caches.values()), 29)

        def cancel(first):
            first.cancel()

        def never_finish(first):
            pass

        def leave(first):
            gone.worker.close()
            gone.client.close()  # the session ends: its regions go, the READ fails
        cases = [("cancelled", d, 0, cancel, "CANCELLED_BY_PEER", "was cancelled"),
                 ("timed-out", d, 1000, never_finish, "TRANSFER_TIMED_OUT",
                  "passed its deadline of 1000 ms"),
                 ("failed", gone, 0, leave, "TRANSFER_FAILED", "was deregistered")]
        for i, (what, reader, timeout_ms, end, kind, text) in enumerate(cases):
            with self.subTest(what):
                rid = f"p-vlend-{what}"
                params = hold(p, {rid: [2 * i, 2 * i + 1]})[rid]
                peer = reader.client.connect_peer(params["remote_agent"]).name
                read = reader.client.open_transfer(
                    peer, params["remote_request_id"], op="read", timeout_ms=timeout_ms,
                    remote_groups={reader.worker.group: params["remote_group"]})
                first = read.send(pages=(params["remote_block_ids"][:1], [10 + i]))
                deadline = time.monotonic() + 5
                while first.state().bytes_done == 0 and time.monotonic() < deadline:
                    time.sleep(0.005)
                self.assertGreater(first.state().bytes_done, 0, f"{rid}: chunk 0 never moved")
                self.assertEqual([r for _, r in sending_over(p.worker, 0.2) if r == rid], [],
                                 f"{rid} reported before its READ ended")
                with self.assertLogs("kvagent.connectors", logging.WARNING) as logs:
                    end(first)
                    self.assertEqual(finished(p.worker, [rid], sending=True), {rid},
                                     f"{rid} not reported after its READ ended {kind}")
                self.assertEqual([r for _, r in sending_over(p.worker, 0.3) if r == rid], [],
                                 f"{rid} reported a second time")
                self.assertEqual([n.kind for n in told if n.request_id == rid], [kind])
                warning = [m for m in logs.output if rid in m]
                self.assertEqual(len(warning), 1, logs.output)
                self.assertIn(kind, warning[0])
                self.assertIn(text, warning[0])

    def test_an_unread_hold_expires_once(self):
        # abort_request_timeout_s 1 and nobody reads: the request is reported finished
        # sending 1 s after request_finished (not before), once, with a warning; the
        # decode side's READ that comes after brings a DATA_READY that reports nothing.
        p, d = self.instances("vlexp", abort=1)
        told = record_notifications(p.worker.route)
        fill(list(p.caches.values()), 30)
        rid = "p-vlexp-1"
        before = time.monotonic()  # request_finished's expiry is at least 1 s after this
        params = hold(p, {rid: [6, 7]})[rid]
        with self.assertLogs("kvagent.connectors", logging.WARNING) as logs:
            got = sending_over(p.worker, 3, until=[rid])
        self.assertEqual([r for _, r in got], [rid], "finished sending in 3 s")
        at = got[0][0] - before
        self.assertGreaterEqual(at, 1.0, f"{rid} reported {at:.3f} s after request_finished")
        self.assertLess(at, 2.0, f"{rid} reported {at:.3f} s after request_finished")
        self.assertEqual(len(logs.output), 1, logs.output)
        self.assertIn(f"prefill request '{rid}'", logs.output[0])
        self.assertRegex(logs.output[0], r"after 1\.\d s held")
        self.assertIn("abort_request_timeout_s", logs.output[0])
        # A late read: its DATA_READY reaches prefill's worker, which ignores it.
        dreq = SimpleNamespace(request_id="vlexp-d", prompt_token_ids=[1] * 2 * BLOCK,
                               kv_transfer_params=params)
        d.scheduler.update_state_after_alloc(dreq, [1, 2], 2 * BLOCK)
        with self.assertLogs("kvagent.connectors", logging.DEBUG) as logs:
            d.step(d.scheduler.build_connector_meta(None))
            self.assertEqual(finished(d.worker, ["vlexp-d"], sending=False), {"vlexp-d"})
            deadline = time.monotonic() + 5
            late = []
            while not any(n.request_id == rid for n in told) and time.monotonic() < deadline:
                late += [r for _, r in sending_over(p.worker, 0.05)]
            late += [r for _, r in sending_over(p.worker, 0.2)]
        self.assertEqual(d.worker.load_errors, {})
        self.assertEqual([n.kind for n in told if n.request_id == rid], ["DATA_READY"])
        self.assertEqual(late, [], "a notification after the expiry reported it again")
        self.assertTrue(any(rid in m and "ignored" in m for m in logs.output), logs.output)


class VllmConnectorTest(Scenarios, PairTestCase):
    """On the fast path rings (fast_path "auto" against agents that serve them)."""

    def test_reads_and_notifications_go_through_the_rings(self):
        used = ring_use(self.pair)
        p, d = self.instances("vlring")
        self.assertTrue(p.worker.route.watching and d.worker.route.watching)
        p_calls, d_calls = count_calls(p.client), count_calls(d.client)
        fill(list(p.caches.values()), 23)
        rids = self.pull(p, d, "vlring", [(0, 10), (1, 11), (2, 12)])
        self.assertEqual(finished(p.worker, [f"p-{r}" for r in rids], sending=True),
                         {f"p-{r}" for r in rids})
        # Decode's ring took its watch and the three READs; prefill's its watch, and it
        # got the three notifications. No gRPC submit, transfer or notification poll.
        self.assertEqual(used(), {"prefill": (1, 3), "decode": (4, 0)})
        self.assertEqual(transfer_rpcs(p_calls, d_calls), {})

    def test_a_full_ring_loses_nothing(self):
        # An 8-slot ring and 12 READs in one step: a full ring is reaped and tried again,
        # then that READ goes through gRPC; every READ ends, bytes in place.
        used = ring_use(self.pair)
        p, d = self.instances("vlfull", fast_path_slots=8)
        fill(list(p.caches.values()), 24)
        self.pull(p, d, "vlfull", [(i, 23 - i) for i in range(12)])
        ring = used()["decode"][0] - 1  # its watch
        fallbacks = d.worker.route.grpc_fallbacks
        self.assertEqual(ring + fallbacks, 12, f"{ring} READs on the ring, {fallbacks} by gRPC")
        print(f"full ring: {ring} READs on the ring, {fallbacks} by gRPC")

    def test_a_ring_the_agent_closed_gives_way_to_grpc(self):
        # A ring broken on the client's side (an impossible sq_tail) is closed by the
        # agent; the worker says so and its READs and notifications go through gRPC.
        p, d = self.instances("vlbroken")
        errors_before = agent_status(self.pair.decode).fast_path_protocol_errors
        ring = d.worker.route.ring
        ring._words[SQ_TAIL] = (ring._tail + (1 << 20)) & 0xFFFFFFFF
        os.write(ring.submit_fd, (1).to_bytes(8, "little"))
        wait_status(self.pair.decode, lambda s: s.fast_path_protocol_errors > errors_before)
        fill(list(p.caches.values()), 25)
        rids = self.pull(p, d, "vlbroken", [(3, 4), (5, 6)])
        self.assertEqual(d.worker.route.kind, "grpc")
        self.assertIn("the fast path ring closed", d.worker.route.describe())
        self.assertEqual(finished(p.worker, [f"p-{r}" for r in rids], sending=True),
                         {f"p-{r}" for r in rids})

    def test_close_closes_the_ring(self):
        worker = KvAgentConnector(config(self.pair.decode.socket, kvagent_group="vlclose",
                                         kvagent_name="vlclose"), "worker")
        self.assertEqual(worker.route.kind, "fast_path")
        rings = wait_status(self.pair.decode, lambda s: s.fast_path_rings >= 1).fast_path_rings
        worker.close()
        self.assertEqual(worker.route.kind, "grpc")
        self.assertEqual(wait_status(self.pair.decode,
                                     lambda s: s.fast_path_rings < rings).fast_path_rings,
                         rings - 1)

    def test_close_with_a_callers_client_keeps_its_session(self):
        # The prefill worker was given its instance's client: close() closes the ring on
        # the agent (close_fast_path), the session stays, and the notification of a READ
        # after the close is the client's to poll through gRPC, not lost on a dead ring.
        p, d = self.instances("vlkeep")
        self.assertTrue(p.worker.route.watching)
        before = agent_status(self.pair.prefill)
        p.worker.close()
        self.assertEqual(p.worker.route.kind, "grpc")
        status = wait_status(self.pair.prefill, lambda s: s.fast_path_rings == 0)
        self.assertEqual(status.fast_path_rings, 0)
        self.assertEqual(status.fast_path_closed_by_request, before.fast_path_closed_by_request + 1)
        fill(list(p.caches.values()), 26)
        (rid,) = self.pull(p, d, "vlkeep", [(7, 8)])
        notes, deadline = [], time.monotonic() + 10
        while not notes and time.monotonic() < deadline:
            notes += p.client.poll_notifications()  # the session is still up
            time.sleep(0.01)
        self.assertEqual([n.request_id for n in notes], [f"p-{rid}"])

    def test_a_bad_complete_when_refuses_to_build_the_connector(self):
        socket = self.pair.decode.socket
        client = self.clients("vlcw")[1]
        for value in ("soon", "PLACED", "", 2, -1, True):
            for role in ("scheduler", "worker"):
                with self.subTest(value=value, role=role):
                    with self.assertRaises(ValueError) as caught:
                        KvAgentConnector(config(socket, kvagent_group="vlcw",
                                                kvagent_client=client, complete_when=value), role)
                    self.assertIsInstance(caught.exception, kvagent.InvalidArgument)
                    text = str(caught.exception)
                    self.assertIn(f"kv_connector_extra_config['complete_when'] {value!r}", text)
                    self.assertIn("'acknowledged'", text)
                    self.assertIn("'placed'", text)
        with self.assertRaises(ValueError) as caught:  # the constructor's override
            KvAgentConnector(config(socket, kvagent_group="vlcw", kvagent_client=client,
                                    complete_when="placed"), "worker", complete_when="later")
        self.assertIn("complete_when 'later'", str(caught.exception))
        # None of them opened the session's ring (one per session): a good one still can.
        # The pb value and name are taken; unset is the default.
        worker = KvAgentConnector(config(socket, kvagent_group="vlcw", kvagent_client=client,
                                         complete_when=pb.COMPLETE_WHEN_PLACED), "worker")
        self.addCleanup(worker.close)
        self.assertEqual((worker.route.kind, worker.complete_when), ("fast_path", "placed"),
                         worker.route.describe())
        self.assertEqual(KvAgentConnector(config(socket, complete_when="COMPLETE_WHEN_PLACED"),
                                          "scheduler").complete_when, "placed")
        self.assertEqual(KvAgentConnector(config(socket), "scheduler").complete_when,
                         "acknowledged")

    def test_a_bad_abort_timeout_refuses_to_build_the_connector(self):
        socket = self.pair.decode.socket
        client = self.clients("vlabort")[1]
        for value in (0, -1, -0.5, "30", "", True, math.nan, math.inf, [5]):
            for role in ("scheduler", "worker"):
                with self.subTest(value=value, role=role):
                    with self.assertRaises(ValueError) as caught:
                        KvAgentConnector(config(socket, kvagent_group="vlabort",
                                                kvagent_client=client,
                                                abort_request_timeout_s=value), role)
                    self.assertIsInstance(caught.exception, InvalidAbortTimeout)
                    self.assertIsInstance(caught.exception, kvagent.InvalidArgument)
                    text = str(caught.exception)
                    self.assertIn(f"kv_connector_extra_config['abort_request_timeout_s'] "
                                  f"{value!r}", text)
                    self.assertIn("a number of seconds above 0", text)
        # None of them opened the session's ring (one per session): a good one still can.
        worker = KvAgentConnector(config(socket, kvagent_group="vlabort", kvagent_client=client,
                                         abort_request_timeout_s=0.25), "worker")
        self.addCleanup(worker.close)
        self.assertEqual((worker.route.kind, worker.abort_timeout), ("fast_path", 0.25))
        self.assertEqual(KvAgentConnector(config(socket, abort_request_timeout_s=30),
                                          "scheduler").abort_timeout, 30.0)
        self.assertEqual(KvAgentConnector(config(socket), "scheduler").abort_timeout, 120.0)

    def test_a_notification_before_its_hold_waits_for_it(self):
        # The decode side reads before prefill's workers have the request's hold (the
        # metadata still on its way): the DATA_READY is kept, and the request reported
        # once the hold comes, not before, once. A DATA_READY for a request never held is
        # not reported at all (vLLM frees only what its scheduler held).
        p, d = self.instances("vlearly")
        fill(list(p.caches.values()), 32)
        held, params = p.scheduler.request_finished(SimpleNamespace(
            request_id="p-early-1", prompt_token_ids=[1] * BLOCK,
            kv_transfer_params={"do_remote_decode": True}), [4])
        self.assertTrue(held)
        stray = pull_params(self.pair, "vlearly-prefill-kv", "p-stray-1", [5])
        for rid, dst, kv in (("early-1", 3, params), ("stray-1", 6, stray)):
            dreq = SimpleNamespace(request_id=rid, prompt_token_ids=[1] * BLOCK,
                                   kv_transfer_params=kv)
            d.scheduler.update_state_after_alloc(dreq, [dst], BLOCK)
        told = record_notifications(p.worker.route)
        d.step(d.scheduler.build_connector_meta(None))
        self.assertEqual(finished(d.worker, ["early-1", "stray-1"], sending=False),
                         {"early-1", "stray-1"})
        self.assertEqual(d.worker.load_errors, {})
        deadline = time.monotonic() + 5
        before = []
        while len(told) < 2 and time.monotonic() < deadline:
            before += [r for _, r in sending_over(p.worker, 0.05)]
        before += [r for _, r in sending_over(p.worker, 0.2)]
        self.assertEqual(sorted((n.request_id, n.kind) for n in told),
                         [("p-early-1", "DATA_READY"), ("p-stray-1", "DATA_READY")])
        self.assertEqual(before, [], "reported before its hold came")
        p.step(p.scheduler.build_connector_meta(None))  # the hold comes
        self.assertEqual([r for _, r in sending_over(p.worker, 3, until=["p-early-1"])],
                         ["p-early-1"])

    def test_a_bad_fast_path_knob_names_the_fix(self):
        with self.assertRaises(kvagent.InvalidArgument) as caught:
            KvAgentConnector(config(self.pair.decode.socket, kvagent_group="vlknob",
                                    kvagent_client=self.clients("vlknob")[1]), "worker",
                             fast_path="fast")
        self.assertIn("fast_path is 'fast'", caught.exception.message)
        self.assertIn("use 'auto'", caught.exception.message)


class VllmConnectorGrpcTest(Scenarios, PairTestCase):
    """fast_path "off": gRPC, as before the ring."""

    fast_path = "off"
    route = "grpc"


class VllmConnectorPrefillRefusesTest(PairTestCase):
    """The prefill agent refuses the notification of a READ (its queue holds one at most,
    and the prefill worker does not take it): a placed READ has still completed on
    decode, bytes in place, its state says the prefill agent did not take it; an
    acknowledged one fails that load, naming the limit. gRPC, so the notifications wait
    in the agent's queue."""

    agent_args = ENGINES_ONLY + ("--max-queued-notifications", "1")

    def load(self, p, d, rid, src, dst):
        """One decode step pulling prefill block `src` into decode block `dst`; the
        request ends (loaded or failed) within 10 s."""
        dreq = SimpleNamespace(request_id=rid, prompt_token_ids=[1] * BLOCK,
                               kv_transfer_params=pull_params(self.pair, "vlref-prefill-kv",
                                                              f"p-{rid}", [src]))
        d.scheduler.update_state_after_alloc(dreq, [dst], BLOCK)
        d.step(d.scheduler.build_connector_meta(None))
        self.assertEqual(finished(d.worker, [rid], sending=False), {rid})

    def test_a_placed_read_completes_when_prefill_refuses_its_notification(self):
        p = Instance(self.pair.prefill.socket, "vlref-p", "vlref-prefill-kv", fast_path="off")
        placed = Instance(self.pair.decode.socket, "vlref-d", "kv", fast_path="off",
                          complete_when="placed")
        acked = Instance(self.pair.decode.socket, "vlref-d2", "kv2", fast_path="off")
        for i in (p, placed, acked):
            self.addCleanup(i.client.close)
            self.addCleanup(i.worker.close)
        fill(list(p.caches.values()), 28)
        before = agent_status(self.pair.decode)
        # The first READ's notification fills the prefill agent's queue (nobody takes it).
        self.load(p, placed, "ref-1", 1, 2)
        self.load(p, placed, "ref-2", 3, 4)
        self.assertEqual(placed.worker.load_errors, {})
        for name in p.caches:
            self.assertTrue(torch.equal(p.caches[name][:, [1, 3]], placed.caches[name][:, [2, 4]]))
        deadline = time.monotonic() + 5
        while True:
            state = placed.client.call("GetTransfer", pb.GetTransferRequest(transfer_id="p-ref-2"),
                                       "peer_note")
            if state.peer_note or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        self.assertEqual((pb.TransferPhase.Name(state.phase),
                          pb.CompletionPoint.Name(state.complete_when), state.peer_acknowledged),
                         ("COMPLETED", "COMPLETE_WHEN_PLACED", False))
        self.assertIn("refused the notification", state.peer_note)
        status = wait_status(self.pair.decode,
                             lambda s: s.placed_not_taken > before.placed_not_taken)
        self.assertEqual((status.completed_when_placed - before.completed_when_placed,
                          status.placed_not_taken - before.placed_not_taken), (2, 1))
        # The same refusal fails an acknowledged READ: decode loads that request again.
        self.load(p, acked, "ref-3", 5, 6)
        self.assertEqual(acked.worker.get_block_ids_with_load_errors(), {6})
        self.assertIn("queued_notifications", acked.worker.load_errors["ref-3"].message)

    def test_a_hold_whose_notification_prefill_refuses_expires(self):
        # Two held requests, both read (acknowledged) while prefill's worker takes
        # nothing: the first READ's DATA_READY fills prefill's queue, the second is
        # refused (that load fails on decode). Prefill reports the first from its
        # notification, the second once its 1 s hold expires, not before, once.
        p = Instance(self.pair.prefill.socket, "vlexq-p", "vlexq-prefill-kv", abort=1,
                     fast_path="off")
        d = Instance(self.pair.decode.socket, "vlexq-d", "kv", fast_path="off")
        for i in (p, d):
            self.addCleanup(i.client.close)
            self.addCleanup(i.worker.close)
        told = record_notifications(p.worker.route)
        fill(list(p.caches.values()), 31)
        before = time.monotonic()
        params = hold(p, {"p-exq-1": [8], "p-exq-2": [9]})
        for rid, dst in (("exq-1", 10), ("exq-2", 11)):
            dreq = SimpleNamespace(request_id=rid, prompt_token_ids=[1] * BLOCK,
                                   kv_transfer_params=params[f"p-{rid}"])
            d.scheduler.update_state_after_alloc(dreq, [dst], BLOCK)
            d.step(d.scheduler.build_connector_meta(None))
            self.assertEqual(finished(d.worker, [rid], sending=False), {rid})
        self.assertNotIn("exq-1", d.worker.load_errors)
        self.assertIn("queued_notifications", d.worker.load_errors["exq-2"].message)
        with self.assertLogs("kvagent.connectors", logging.WARNING) as logs:
            got = sending_over(p.worker, 3, until=["p-exq-1", "p-exq-2"])
        self.assertEqual(sorted(r for _, r in got), ["p-exq-1", "p-exq-2"], got)
        at = dict((r, t - before) for t, r in got)
        self.assertGreaterEqual(at["p-exq-2"], 1.0, f"p-exq-2 reported {at['p-exq-2']:.3f} s "
                                "after request_finished")
        self.assertLess(at["p-exq-2"], 2.0)
        self.assertEqual([(n.request_id, n.kind) for n in told],
                         [("p-exq-1", "DATA_READY")], "prefill's notifications")
        self.assertEqual(len(logs.output), 1, logs.output)
        self.assertIn("prefill request 'p-exq-2'", logs.output[0])


class VllmConnectorAgentWithoutRingTest(Scenarios, PairTestCase):
    """fast_path "auto" against agents started with --fast-path off: gRPC, and why."""

    agent_args = ENGINES_ONLY + ("--fast-path", "off")
    route = "grpc"

    def test_auto_says_why_and_on_refuses(self):
        client = self.clients("vlnoring")[1]
        worker = KvAgentConnector(config(self.pair.decode.socket, kvagent_group="vlnoring",
                                         kvagent_client=client), "worker")
        self.assertIn("this agent serves no fast path", worker.route.describe())
        with self.assertRaises(kvagent.KvAgentError) as caught:
            KvAgentConnector(config(self.pair.decode.socket, kvagent_group="vlnoring2",
                                    kvagent_client=client, fast_path="on"), "worker")
        self.assertEqual(caught.exception.code.name, "UNIMPLEMENTED")
        self.assertIn("this agent serves no fast path", caught.exception.message)


if __name__ == "__main__":
    main()

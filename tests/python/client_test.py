"""kvagent's blocking Python client against two real agents: torch KV caches (MHA and
MLA), Mamba state with its slot dimension, aux records, chunks, READ, an engine's own
memfd and numpy arrays, subscriptions; every byte compared."""
import os
import tempfile
import time
import unittest

import numpy as np
import torch

import kvagent
import kvagent.daemon
from harness import PairTestCase, main

LAYERS, PAGES, PAGE = 4, 32, (16, 2, 64)  # 16 tokens x 2 KV heads x 64, bf16: 4 KiB/page


def fill(tensors, seed):
    for i, t in enumerate(tensors):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def kv_cache(client, layers=LAYERS, pages=PAGES, page=PAGE, dtype=torch.bfloat16):
    """One agent-allocated buffer holding every layer's K and V tensor."""
    nbytes = 2 * layers * pages * int(np.prod(page)) * torch.empty((), dtype=dtype).element_size()
    pool = client.allocate(nbytes + 2 * layers * 4096)
    k = [pool.empty((pages, *page), dtype) for _ in range(layers)]
    v = [pool.empty((pages, *page), dtype) for _ in range(layers)]
    return k, v


def connected_kv(case, prefix, seed):
    """Clients for `case`'s pair, a KV cache on each (prefill's filled from `seed`,
    decode's zeroed), registered, prefill connected to decode: (pre, dec, src, dst),
    src and dst every layer's K then V tensors."""
    pre, dec = case.clients(prefix)
    (sk, sv), (dk, dv) = kv_cache(pre), kv_cache(dec)
    fill(sk + sv, seed)
    for t in dk + dv:
        t.zero_()
    pre.register_kv_cache(sk, sv)
    dec.register_kv_cache(dk, dv)
    pre.connect_peer(dec.address)
    return pre, dec, sk + sv, dk + dv


def mamba_state(client, layers=3, slots=6):
    """SGLang's Mamba pool shapes: conv [layers, slots, dim, d_conv-1] bf16, ssm
    [layers, slots, heads, head_dim, d_state] fp32 (scaled-down Mamba2)."""
    conv = client.empty((layers, slots, 96, 3), torch.bfloat16)
    ssm = client.empty((layers, slots, 4, 16, 8), torch.float32)
    return {"conv": conv, "ssm": ssm}


class ClientTest(PairTestCase):
    def test_kv_cache_prefill_to_decode_byte_exact(self):
        pre, dec = self.clients("kv")
        src_k, src_v = kv_cache(pre)
        dst_k, dst_v = kv_cache(dec)
        fill(src_k + src_v, 1)
        for t in dst_k + dst_v:
            t.fill_(0)
        group = pre.register_kv_cache(src_k, src_v)
        self.assertEqual(group.regions[:2], ["kv-pre.kv.L0.K", "kv-pre.kv.L0.V"])
        # Strides and item sizes come from the tensors: one page of one layer.
        self.assertEqual(group.layouts[0].item_bytes, 16 * 2 * 64 * 2)
        # The decode side registers V before K: roles pair them anyway.
        dec.register_kv_cache({f"L{i}.{kv}": t for i in range(LAYERS)
                               for kv, t in (("V", dst_v[i]), ("K", dst_k[i]))})
        dec.deregister("kv")
        dec.register_kv_cache(dst_k, dst_v)
        peer = pre.connect_peer(dec.address)
        self.assertEqual(peer.name, "decode")
        src_pages, dst_pages = [3, 4, 9, 10], [20, 21, 5, 0]
        state = pre.transfer(peer, "req-1", pages=(src_pages, dst_pages),
                             notification=b"first-token=42").result(timeout=10)
        self.assertEqual(state.items, 4)
        note = dec.wait_notification("req-1", timeout=10)
        self.assertEqual((note.kind, note.payload, note.from_agent),
                         ("DATA_READY", b"first-token=42", "prefill"))
        for s, d in zip(src_k + src_v, dst_k + dst_v):
            self.assertTrue(torch.equal(s[src_pages], d[dst_pages]))
            untouched = [p for p in range(PAGES) if p not in dst_pages]
            self.assertTrue(bool((d[untouched] == 0).all()))

    def test_hybrid_mla_mamba_state_and_aux_in_one_transfer(self):
        pre, dec = self.clients("hybrid")
        caches, states, aux = {}, {}, {}
        for side, c in (("pre", pre), ("dec", dec)):
            # MLA: one latent tensor per layer (576 = 512 + 64 rope), no V.
            caches[side] = [c.empty((PAGES, 16, 576), torch.bfloat16) for _ in range(2)]
            states[side] = mamba_state(c)
            aux[side] = c.empty((8, 64), torch.uint8)
            c.register_kv_cache(caches[side], group="kv")
            c.register_state(states[side], group="mamba", slot_dim=1)
            c.register_aux(aux[side], group="aux")
        fill(caches["pre"] + list(states["pre"].values()), 2)
        aux["pre"].copy_(torch.arange(512, dtype=torch.int64).view(8, 64).to(torch.uint8))
        for t in caches["dec"] + list(states["dec"].values()) + [aux["dec"]]:
            t.zero_()
        self.assertEqual(len(dec.groups["mamba"].regions), 6)  # 3 layers x conv, ssm
        pre.connect_peer(dec.address)
        pre.transfer("decode", "hyb-1", pages=([1, 2, 3], [4, 5, 6]), slots=([2], [5]),
                     aux=([2], [7]), notification="done").result(timeout=10)
        dec.wait_notification("hyb-1", timeout=10)
        for s, d in zip(caches["pre"], caches["dec"]):
            self.assertTrue(torch.equal(s[[1, 2, 3]], d[[4, 5, 6]]))
        for name in ("conv", "ssm"):
            s, d = states["pre"][name], states["dec"][name]
            self.assertTrue(torch.equal(s[:, 2], d[:, 5]))
            self.assertTrue(bool((d[:, [0, 1, 2, 3, 4]] == 0).all()))
        self.assertTrue(torch.equal(aux["pre"][2], aux["dec"][7]))

    def test_chunks_as_prefill_produces_them(self):
        pre, dec, src, dst = connected_kv(self, "chunks", 3)
        tx = pre.open_transfer("decode", "chunked")
        tx.send(pages=([0, 1], [10, 11]))
        tx.send(pages=([2], [12]))
        transfer = tx.finish(pages=([3], [13]), notification=b"n")
        self.assertEqual(transfer.result(timeout=10).chunks, 3)
        dec.wait_notification("chunked", timeout=10)
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[0:4], d[10:14]))

    def test_wait_answers_with_the_final_state(self):
        pre, dec, src, dst = connected_kv(self, "wait", 6)
        transfer = pre.transfer("decode", "waited", pages=([7], [8]), wait=True)
        self.assertEqual(transfer.last_state.phase, kvagent.pb.COMPLETED)  # no watch needed
        self.assertTrue(transfer.done())
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[7], d[8]))

    def test_read_pulls_from_the_peer(self):
        pre, dec, src, dst = connected_kv(self, "read", 4)
        dec.connect_peer(self.pair.prefill.address)
        # vLLM's flow: decode pulls; pages are (source on the peer, destination here).
        dec.transfer("prefill", "pull-1", pages=([5, 6], [1, 2]), op="read").result(timeout=10)
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[[5, 6]], d[[1, 2]]))

    def test_engine_memfd_numpy_and_share_memory(self):
        pre, dec = self.clients("memfd")
        # The engine's own memfd (os.memfd_create), viewed with numpy.
        buf = pre.memfd(PAGES * 4096 * 2)
        src = [buf.numpy((PAGES, 1024), np.float32, 0),
               buf.numpy((PAGES, 1024), np.float32, PAGES * 4096)]
        rng = np.random.default_rng(7)
        for a in src:
            a[:] = rng.standard_normal(a.shape, dtype=np.float32)
        # A descriptor the engine already had, shared as is.
        fd = os.memfd_create("engine-pool")
        os.ftruncate(fd, PAGES * 4096 * 2)
        shared = dec.share_memory(fd)
        os.close(fd)
        dst = [shared.tensor((PAGES, 1024), torch.float32, 0),
               shared.tensor((PAGES, 1024), torch.float32, PAGES * 4096)]
        pre.register_kv_cache([src[0]], [src[1]])
        dec.register_kv_cache([dst[0]], [dst[1]])
        pre.connect_peer(dec.address)
        pre.transfer("decode", "memfd-1", pages=([0, 31], [31, 0])).result(timeout=10)
        for s, d in zip(src, dst):
            self.assertTrue(np.array_equal(s[[0, 31]], d[[31, 0]].numpy()))

    def test_subscription_holds_until_ack(self):
        pre, dec, _, _ = connected_kv(self, "sub", 0)
        pre.transfer("decode", "sub-1", pages=([1], [1]), notification=b"x").result(timeout=10)
        # Delivered at the sender's commit, which follows the acknowledgement that
        # completed the transfer: a poll right after result() may come first.
        first = []
        deadline = time.monotonic() + 10
        while not first and time.monotonic() < deadline:
            first = dec.poll_notifications(subscription="decode-worker")
            if not first:
                time.sleep(0.01)
        self.assertEqual([n.request_id for n in first], ["sub-1"])
        again = dec.poll_notifications(subscription="decode-worker")
        self.assertEqual([n.sequence for n in again], [first[0].sequence])  # not acked yet
        self.assertEqual(again[0].ack(), 1)
        self.assertEqual(dec.poll_notifications(subscription="decode-worker"), [])

    @unittest.skipUnless(torch.cuda.is_available(),
                         "no CUDA device here (torch.cuda.is_available() is False): CUDA "
                         "tensors are registered by their CUDA IPC handle, which needs a GPU")
    def test_cuda_kv_cache_by_ipc_handle(self):
        pre, dec = self.clients("cuda")
        src = [torch.randn((PAGES, 1024), device="cuda") for _ in range(2)]
        dst = [torch.zeros((PAGES, 1024), device="cuda") for _ in range(2)]
        pre.register_kv_cache([src[0]], [src[1]])
        dec.register_kv_cache([dst[0]], [dst[1]])
        pre.connect_peer(dec.address)
        pre.transfer("decode", "cuda-1", pages=([1, 2], [3, 4])).result(timeout=30)
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(s[[1, 2]].cpu(), d[[3, 4]].cpu()))


class SocketFolderTest(unittest.TestCase):
    """kvagent.daemon puts the sockets of an agent whose work folder is too deep in
    /tmp/kva-<hash>/; once the agent exited, even killed, nothing of it stays there."""

    def test_killed_and_stopped_agents_leave_no_socket_folder(self):
        base = tempfile.mkdtemp(prefix="kva-deep.", dir=os.environ.get("TEST_TMPDIR"))
        work = os.path.join(base, "w" * 100)
        os.mkdir(work)
        pair = kvagent.daemon.AgentPair(work_dir=work)
        folder = os.path.dirname(pair.decode.socket)
        self.assertTrue(folder.startswith(os.path.join(tempfile.gettempdir(), "kva-")), folder)
        self.assertEqual(folder, os.path.dirname(pair.prefill.socket))
        pair.decode.process.kill()  # SIGKILL: the agent unlinks nothing itself
        pair.decode.stop()
        self.assertFalse(os.path.exists(pair.decode.socket))
        self.assertFalse(os.path.exists(pair.decode.socket + ".session"))
        self.assertTrue(os.path.exists(pair.prefill.socket))  # alive: kept
        pair.prefill.stop()
        self.assertFalse(os.path.exists(folder))


if __name__ == "__main__":
    main()

"""Bad input from Python: refused with the agent's message intact (code, entry, cause,
fix), or, where only this client can see the problem (a tensor's memory, layout or
dtype), refused before anything is sent, with an error of the same shape."""
import unittest

import grpc
import torch

import kvagent
from client_test import kv_cache
from harness import PairTestCase, main


class BadInputTest(PairTestCase):
    def assertRefused(self, error_type, call, *needles):
        with self.assertRaises(error_type) as caught:
            call()
        e = caught.exception
        for n in needles:
            self.assertIn(n, e.message)
        self.assertTrue(e.entry, f"no entry in {e.message!r}")
        self.assertTrue(e.fix, f"no fix in {e.message!r}")
        return e

    def test_tensor_not_in_shared_memory(self):
        pre, _ = self.clients("noshm")
        private = [torch.zeros((8, 1024)) for _ in range(2)]
        e = self.assertRefused(kvagent.InvalidArgument,
                               lambda: pre.register_kv_cache([private[0]], [private[1]]),
                               "not in shared memory", "client.empty")
        self.assertEqual(e.entry, "tensor 'L0.K' of group 'kv'")
        self.assertEqual(e.code, grpc.StatusCode.INVALID_ARGUMENT)

    def test_non_contiguous_tensor(self):
        pre, _ = self.clients("noncontig")
        t = pre.empty((8, 64, 16), torch.float16).transpose(1, 2)  # pages still dim 0
        self.assertRefused(kvagent.InvalidArgument, lambda: pre.register_kv_cache([t]),
                           "not contiguous after dimension 0", "strides in bytes [2048, 2, 32]")
        # A page stride is fine: every other page of a pool is a region of 4 items.
        every_other = pre.empty((8, 1024), torch.float16)[::2]
        group = pre.register_kv_cache([every_other])
        self.assertEqual((group.layouts[0].item_stride, group.layouts[0].item_bytes), (4096, 2048))

    def test_wrong_dtype(self):
        pre, dec = self.clients("dtype")
        k = pre.empty((8, 512), torch.bfloat16)
        v = pre.empty((8, 512), torch.float32)
        self.assertRefused(kvagent.InvalidArgument, lambda: pre.register_kv_cache([k], [v]),
                           "has dtype float32, the group's first tensor bfloat16")
        # Decode registered fp32 pages where prefill has bf16: the agent refuses the
        # transfer; its message comes through as it wrote it.
        pre.register_kv_cache([k], [pre.empty((8, 512), torch.bfloat16)])
        dec.register_kv_cache([dec.empty((8, 512), torch.float32) for _ in range(1)],
                              [dec.empty((8, 512), torch.float32)])
        pre.connect_peer(dec.address)
        e = self.assertRefused(kvagent.InvalidArgument,
                               lambda: pre.transfer("decode", "dtype-1", pages=([0], [0])),
                               "dtype-pre.kv.L0.K", "dtype-dec.kv.L0.K", "1024", "2048")
        self.assertEqual(e.where, "transfer 'dtype-1'")

    def test_page_id_out_of_range(self):
        pre, dec = self.clients("range")
        pre.register_kv_cache(*kv_cache(pre))
        dec.register_kv_cache(*kv_cache(dec))
        pre.connect_peer(dec.address)
        e = self.assertRefused(
            kvagent.InvalidArgument, lambda: pre.transfer("decode", "r-1", pages=([1], [32])),
            "remote index 32 at position 0 is out of range for peer 'decode' region "
            "'range-dec.kv.L0.K' (num_items 32); use indices below num_items")
        self.assertEqual(e.fix, "use indices below num_items")
        self.assertTrue(e.entry.endswith("segment 0"), e.entry)
        self.assertRefused(kvagent.InvalidArgument,
                           lambda: pre.transfer("decode", "r-2", pages=([40], [1])),
                           "local index 40")
        self.assertRefused(kvagent.InvalidArgument,
                           lambda: pre.transfer("decode", "r-3", pages=([1, 2], [1])),
                           "2 source ids but 1 destination ids")

    def test_wrong_session(self):
        pre, dec = self.clients("owner")
        pre.register_kv_cache(*kv_cache(pre))
        dec.register_kv_cache(*kv_cache(dec))
        other = kvagent.connect(self.pair.prefill.socket, name="owner-other")
        self.addCleanup(other.close)
        # Another session's memory handle means nothing in this one.
        buffer = pre.allocate(1 << 20)
        request = kvagent.pb.RegisterRegionsRequest()
        spec = request.regions.add(name="owner-other.stolen", kind=kvagent.pb.KV, group="x",
                                   length=4096)
        spec.layout.num_items, spec.layout.item_bytes = 1, 4096
        spec.shm.memory_handle = buffer.handle
        e = self.assertRefused(kvagent.KvAgentError, lambda: other.register_regions(request),
                               "owner-other.stolen")
        self.assertIn(e.code, (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
                               grpc.StatusCode.INVALID_ARGUMENT))
        # Another session's group cannot be moved by it (engines only, no scheduler).
        other.connect_peer(dec.address)
        seg = kvagent.items_segment("kv", "kv", [1], [1])
        self.assertRefused(kvagent.PermissionDenied,
                           lambda: other.transfer("decode", "steal-1", segments=[seg]),
                           "local region 'owner-pre.kv.L0.K' belongs to session:",
                           "a client moves only the regions it registered")

    def test_unknown_peer(self):
        pre, _ = self.clients("nopeer")
        pre.register_kv_cache(*kv_cache(pre))
        self.assertRefused(kvagent.KvAgentError,
                           lambda: pre.transfer("nobody", "p-1", pages=([1], [1])), "nobody")


if __name__ == "__main__":
    main()

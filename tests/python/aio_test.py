"""The asyncio client (kvagent.aio) against two real agents: awaitable transfers,
notifications as an async iterator with acknowledgement, errors as exceptions."""
import asyncio

import torch

import kvagent
import kvagent.aio
from client_test import fill, kv_cache, mamba_state
from harness import PairTestCase, main


class AioTest(PairTestCase):
    def run_async(self, coroutine):
        return asyncio.run(asyncio.wait_for(coroutine, 30))

    def test_awaitable_transfers_and_async_notifications(self):
        async def scenario():
            pre = await kvagent.aio.connect(self.pair.prefill.socket, name="aio-pre")
            dec = await kvagent.aio.connect(self.pair.decode.socket, name="aio-dec")
            try:
                (sk, sv), (dk, dv) = kv_cache(pre), kv_cache(dec)
                src_state, dst_state = mamba_state(pre), mamba_state(dec)
                fill(sk + sv + list(src_state.values()), 5)
                await pre.register_kv_cache(sk, sv)
                await pre.register_state(src_state, group="mamba", slot_dim=1)
                await dec.register_kv_cache(dk, dv)
                await dec.register_state(dst_state, group="mamba", slot_dim=1)
                await pre.connect_peer(dec.address)
                # Several requests in flight at once, awaited together.
                transfers = [await pre.transfer("decode", f"aio-{i}", pages=([i], [10 + i]),
                                                slots=([i], [i + 1]), notification=str(i))
                             for i in range(3)]
                states = await asyncio.gather(*transfers)
                self.assertEqual([s.transfer_id for s in states], ["aio-0", "aio-1", "aio-2"])
                seen = {}
                async for n in dec.notifications(subscription="aio-decode", timeout=10):
                    seen[n.request_id] = n.payload
                    self.assertEqual(await n.ack(), 1)
                    if len(seen) == 3:
                        break
                self.assertEqual(seen, {f"aio-{i}": str(i).encode() for i in range(3)})
                for i in range(3):
                    for s, d in zip(sk + sv, dk + dv):
                        self.assertTrue(torch.equal(s[i], d[10 + i]))
                    for name in ("conv", "ssm"):
                        self.assertTrue(torch.equal(src_state[name][:, i],
                                                    dst_state[name][:, i + 1]))
                with self.assertRaises(kvagent.InvalidArgument) as caught:
                    await pre.transfer("decode", "aio-bad", pages=([0], [99]))
                self.assertIn("remote index 99", caught.exception.message)
            finally:
                await pre.close()
                await dec.close()

        self.run_async(scenario())


if __name__ == "__main__":
    main()

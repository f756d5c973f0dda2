"""The vLLM-shaped connector (kvagent.connectors.vllm) driven through the calls vLLM's
v1 scheduler and model runner make on a prefill instance and a decode instance (the
NIXL connector's pull flow), with vLLM-layout torch caches ([2, blocks, block_size,
heads, head_dim] per layer) and two real agents, bytes compared."""
import time
from types import SimpleNamespace

import torch

import kvagent
from client_test import fill
from harness import PairTestCase, main
from kvagent.connectors.vllm import KvAgentConnector

LAYERS, BLOCKS, BLOCK = 3, 24, 16


def config(socket, **extra):
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config={"kvagent_socket": socket, **extra}))


class Instance:
    """One vLLM instance: its scheduler-side and worker-side connectors and caches."""

    def __init__(self, socket, name, group):
        self.client = kvagent.connect(socket, name=name)
        self.caches = {f"model.layers.{i}.self_attn.attn":
                       self.client.empty((2, BLOCKS, BLOCK, 2, 32), torch.float16)
                       for i in range(LAYERS)}
        for t in self.caches.values():
            t.zero_()
        self.scheduler = KvAgentConnector(config(socket, kvagent_group=group), "scheduler")
        self.worker = KvAgentConnector(config(socket, kvagent_group=group,
                                              kvagent_client=self.client), "WORKER")
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


class VllmConnectorTest(PairTestCase):
    def instances(self, tag):
        # Different group names on the two sides: kv_transfer_params carry prefill's.
        p = Instance(self.pair.prefill.socket, f"{tag}-p", f"{tag}-prefill-kv")
        d = Instance(self.pair.decode.socket, f"{tag}-d", "kv")
        self.addCleanup(p.client.close)
        self.addCleanup(d.client.close)
        return p, d

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
        hold, params = p.scheduler.request_finished(preq, p_blocks)
        self.assertTrue(hold)
        self.assertEqual(params["remote_block_ids"], p_blocks)
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


if __name__ == "__main__":
    main()

"""An engine's memory as SGLang lays it out, in memory the agent maps: one K and one V
tensor per attention layer [pages, 16, kv_heads, head_dim], Mamba state pools
[mamba_layers, slots, ...] (conv bf16, SSM fp32), and aux records [slots, 8] int64.
Shared by prefill.py (writes a request's pages and state) and decode.py (checks them)."""
import argparse
import json

import torch

import kvagent
from models import PAGE_TOKENS, make_model, pages_for


def start(role, doc, argv, extra=lambda parser: None):
    """What both engine processes do first: parse --socket, --bootstrap, --requests and
    --model, attach to the agent as "<role>-engine", lay out and register the cache.
    Returns (args, prompts {request id: tokens}, client, cache)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--socket", required=True, help="the agent's --local-socket")
    parser.add_argument("--bootstrap", required=True, help="decode's plan, written by decode")
    parser.add_argument("--requests", required=True, help="JSON {request id: token ids}")
    parser.add_argument("--model", default="llama", choices=["llama", "hybrid"])
    extra(parser)
    args = parser.parse_args(argv)
    with open(args.requests) as f:
        prompts = json.load(f)
    client = kvagent.connect(args.socket, name=f"{role}-engine")
    cache = EngineCache(client, make_model(args.model))
    cache.register()
    return args, prompts, client, cache


class EngineCache:
    def __init__(self, client, model, pages=64, slots=8):
        self.client, self.model = client, model
        self.k = [client.empty((pages, *model.page_shape()), torch.bfloat16)
                  for _ in range(model.attention_layers)]
        self.v = [client.empty((pages, *model.page_shape()), torch.bfloat16)
                  for _ in range(model.attention_layers)]
        self.state = {}
        if model.mamba_layers:
            self.state = {
                "conv": client.empty((model.mamba_layers, slots, *model.conv_shape()),
                                     torch.bfloat16),
                "ssm": client.empty((model.mamba_layers, slots, *model.ssm_shape()),
                                    torch.float32),
            }
        self.aux = client.empty((slots, 8), torch.int64)
        for t in self.k + self.v + list(self.state.values()) + [self.aux]:
            t.zero_()

    def register(self):
        """One call per kind; layouts come from the tensors."""
        self.client.register_kv_cache(self.k, self.v, group="kv")
        if self.state:
            self.client.register_state(self.state, group="mamba", slot_dim=1)
        self.client.register_aux(self.aux, group="aux")

    def fill(self, index, tokens, pages, slot, aux_index):
        """Runs prefill for `tokens` and writes its KV into `pages`, its Mamba state into
        `slot` and its aux record into `aux_index` (what a prefill engine does)."""
        ks, vs, convs, ssms, first = self.model.prefill(tokens)
        for layer in range(self.model.attention_layers):
            for cache, values in ((self.k[layer], ks[layer]), (self.v[layer], vs[layer])):
                cache[pages] = 0
                for i, page in enumerate(pages):
                    chunk = values[i * PAGE_TOKENS:(i + 1) * PAGE_TOKENS]
                    cache[page, :chunk.shape[0]] = chunk
        for layer in range(self.model.mamba_layers):
            self.state["conv"][layer, slot] = convs[layer]
            self.state["ssm"][layer, slot] = ssms[layer]
        self.aux[aux_index] = torch.tensor([first, len(tokens), index, 0, 0, 0, 0, 0])
        return first

    def matches(self, other, pages, other_pages, slot, other_slot, aux_index, other_aux):
        """Every byte of the request in this cache equals the one in `other`'s."""
        same = all(torch.equal(a[pages], b[other_pages])
                   for a, b in zip(self.k + self.v, other.k + other.v))
        for name, t in self.state.items():
            same = same and torch.equal(t[:, slot], other.state[name][:, other_slot])
        return same and torch.equal(self.aux[aux_index], other.aux[other_aux])

    def request_bytes(self, tokens):
        page = self.k[0][0].numel() * 2 if self.k else 0
        state = sum(t[:, 0].numel() * t.element_size() for t in self.state.values())
        return 2 * len(self.k) * pages_for(tokens) * page + state + 64

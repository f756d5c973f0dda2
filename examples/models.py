"""Two tiny models with real shapes (../shared/WORKLOADS.md, scaled down) whose prefill
produces deterministic KV pages and Mamba2 state: the prefill process computes them,
the decode process computes them again to check what arrived, byte for byte.

- TinyLlama: Llama-shaped attention (grouped KV heads x head_dim, bf16, 16-token pages).
- TinyHybrid: a Nemotron-H/Jamba-style stack: attention layers with KV pages and
  Mamba2 layers whose per-request state is a conv state [conv_dim, d_conv - 1] (bf16)
  and an SSM state [heads, head_dim, d_state] (fp32), one slot per request.
Weights come from a seeded generator, so both processes build the same model.
"""
import torch

PAGE_TOKENS = 16


class TinyLlama:
    def __init__(self, layers="AAAA", kv_heads=2, head_dim=64, hidden=128, vocab=512,
                 d_inner=256, d_state=16, ssm_head_dim=32, d_conv=4, seed=0):
        torch.set_num_threads(1)  # the same arithmetic order in both processes
        g = torch.Generator().manual_seed(seed)
        rand = lambda *shape: torch.randn(*shape, generator=g) / shape[0] ** 0.5
        self.layers = layers
        self.kv_heads, self.head_dim, self.hidden = kv_heads, head_dim, hidden
        self.d_inner, self.d_state, self.d_conv = d_inner, d_state, d_conv
        self.ssm_heads, self.ssm_head_dim = d_inner // ssm_head_dim, ssm_head_dim
        self.conv_dim = d_inner + 2 * d_state
        self.embed = torch.randn(vocab, hidden, generator=g)
        self.weights = []
        for kind in layers:
            if kind == "A":
                self.weights.append((rand(hidden, kv_heads * head_dim),
                                     rand(hidden, kv_heads * head_dim), rand(hidden, hidden)))
            else:
                self.weights.append((rand(hidden, self.conv_dim), rand(d_inner, hidden)))

    @property
    def attention_layers(self):
        return self.layers.count("A")

    @property
    def mamba_layers(self):
        return self.layers.count("M")

    def page_shape(self):
        return (PAGE_TOKENS, self.kv_heads, self.head_dim)

    def conv_shape(self):
        return (self.conv_dim, self.d_conv - 1)

    def ssm_shape(self):
        return (self.ssm_heads, self.ssm_head_dim, self.d_state)

    def prefill(self, tokens):
        """K and V per attention layer [tokens, kv_heads, head_dim] (bf16), conv and SSM
        state per Mamba layer, and the first generated token."""
        x = self.embed[torch.tensor(tokens)]
        ks, vs, convs, ssms = [], [], [], []
        for kind, w in zip(self.layers, self.weights):
            if kind == "A":
                wk, wv, wo = w
                ks.append((x @ wk).view(len(tokens), self.kv_heads, self.head_dim).bfloat16())
                vs.append((x @ wv).view(len(tokens), self.kv_heads, self.head_dim).bfloat16())
                x = x + torch.tanh(x @ wo)
            else:
                w_in, w_out = w
                xbc = x @ w_in  # [T, d_inner + 2 d_state]
                tail = xbc[-(self.d_conv - 1):]
                if tail.shape[0] < self.d_conv - 1:  # short prompt: zero-padded on the left
                    pad = torch.zeros(self.d_conv - 1 - tail.shape[0], self.conv_dim)
                    tail = torch.cat([pad, tail])
                convs.append(tail.t().contiguous().bfloat16())
                xs = xbc[:, :self.d_inner].view(-1, self.ssm_heads, self.ssm_head_dim)
                bs = xbc[:, self.d_inner:self.d_inner + self.d_state]
                h = torch.zeros(self.ssm_shape())
                for t in range(len(tokens)):
                    h = 0.9 * h + torch.einsum("hp,n->hpn", xs[t], bs[t])
                ssms.append(h)
                x = x + torch.tanh(xbc[:, :self.d_inner] @ w_out)
        first_token = int((x[-1] @ self.embed.t()).argmax())
        return ks, vs, convs, ssms, first_token


def make_model(name):
    if name == "llama":
        return TinyLlama(layers="AAAA")
    if name == "hybrid":
        return TinyHybrid()
    raise ValueError(f"model '{name}': unknown; use llama or hybrid")


def TinyHybrid():
    """Mamba2 layers with an attention layer every third (as Nemotron-H interleaves)."""
    return TinyLlama(layers="MMAMMA")


def pages_for(tokens):
    return (len(tokens) + PAGE_TOKENS - 1) // PAGE_TOKENS


def requests(count=3, seed=1):
    """Deterministic prompts of different lengths (a partial last page included)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [37, 64, 5, 100, 16][:count]
    return {f"req-{i}": torch.randint(0, 512, (n,), generator=g).tolist()
            for i, n in enumerate(lengths)}

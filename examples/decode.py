"""The decode process: attaches to its agent, lays out its own KV cache (and Mamba
state) in memory the agent maps, picks scattered destination pages, a state slot and an
aux index per request and publishes them with its agent's address (the bootstrap a
router would carry), then waits for each request's notification and checks every byte
against its own run of the same model. Prints one JSON line; exits 1 on a mismatch.

usage: decode.py --socket PATH --bootstrap FILE --requests FILE [--model llama|hybrid]
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine import EngineCache, start  # noqa: E402
from models import pages_for  # noqa: E402


def main(argv=None):
    args, prompts, agent, cache = start("decode", __doc__, argv)
    free_pages = list(reversed(range(len(cache.k[0]) if cache.k else 0)))  # scattered
    plan = {}
    for index, (rid, tokens) in enumerate(prompts.items()):
        plan[rid] = {"pages": [free_pages.pop(0) for _ in range(pages_for(tokens))],
                     "slot": len(prompts) - index, "aux": index + 1}
    tmp = args.bootstrap + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"agent": agent.address, "requests": plan}, f)
    os.rename(tmp, args.bootstrap)

    expected = EngineCache(PrivateMemory(), cache.model)  # the same model run here
    checked, nbytes, failures = 0, 0, []
    pending = set(prompts)
    for note in agent.notifications(timeout=60):
        note.check()
        pending.discard(note.request_id)
        rid = note.request_id
        index, dst = list(prompts).index(rid), plan[rid]
        first = expected.fill(index, prompts[rid], dst["pages"], dst["slot"], dst["aux"])
        if json.loads(note.payload)["first_token"] != first or not expected.matches(
                cache, dst["pages"], dst["pages"], dst["slot"], dst["slot"], dst["aux"],
                dst["aux"]):
            failures.append(rid)
        checked += 1
        nbytes += expected.request_bytes(prompts[rid])
        if not pending:
            break
    ok = checked == len(prompts) and not failures
    print(json.dumps({"role": "decode", "model": args.model, "verified": ok,
                      "requests": checked, "bytes": nbytes, "mismatched": failures}), flush=True)
    agent.close()
    sys.exit(0 if ok else 1)


class PrivateMemory:
    """Stands in for a client where the decode side recomputes the expected cache in
    its own (unregistered) memory."""

    def empty(self, shape, dtype):
        import torch
        return torch.empty(shape, dtype=dtype)


if __name__ == "__main__":
    main()

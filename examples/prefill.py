"""The prefill process: attaches to its agent, lays out its KV cache (and Mamba state)
in memory the agent maps, waits for the decode side's bootstrap (its agent and the
destination pages, slot and aux index of each request), then for each request runs the
model, writes the pages and pushes them, state and aux in one transfer with a
notification. Prints one JSON line.

usage: prefill.py --socket PATH --bootstrap FILE --requests FILE [--model llama|hybrid]
                  [--corrupt]
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine import start  # noqa: E402
from models import pages_for  # noqa: E402


def wait_for(path, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"prefill: no bootstrap at {path} after {timeout} s (did decode start?)")
        time.sleep(0.01)
    with open(path) as f:
        return json.load(f)


def main(argv=None):
    args, prompts, agent, cache = start("prefill", __doc__, argv, lambda parser: parser.add_argument(
        "--corrupt", action="store_true",
        help="flip one byte of the first request after prefill (tests decode's check)"))
    boot = wait_for(args.bootstrap)
    peer = agent.connect_peer(boot["agent"])
    free_pages, transfers = list(range(len(cache.k[0]) if cache.k else 0)), []
    for index, (rid, tokens) in enumerate(prompts.items()):
        dst = boot["requests"][rid]
        pages = [free_pages.pop(0) for _ in range(pages_for(tokens))]
        first = cache.fill(index, tokens, pages, slot=index, aux_index=index)
        if args.corrupt and index == 0:
            target = cache.state["ssm"][0, index] if cache.state else cache.v[-1][pages[-1]]
            target.view(-1)[0] += 1
        transfers.append(agent.transfer(
            peer, rid, pages=(pages, dst["pages"]) if cache.k else None,
            slots=([index], [dst["slot"]]) if cache.state else None,
            aux=([index], [dst["aux"]]), notification=json.dumps({"first_token": first})))
    states = [t.result(timeout=30) for t in transfers]
    print(json.dumps({"role": "prefill", "model": args.model, "requests": len(states),
                      "bytes": sum(s.bytes_total for s in states)}), flush=True)
    agent.close()


if __name__ == "__main__":
    main()

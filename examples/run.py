"""One command: starts two agents (or uses yours), then a decode process and a prefill
process that move a few requests' deterministic KV (and, for the hybrid model, Mamba2
state) through them; decode checks every byte. Exits non-zero on any failure.

    bazel run //examples:run -- --model hybrid
    PYTHONPATH=python /usr/bin/python3 examples/run.py --model llama   (after python/gen_stubs.py)

--prefill-socket/--decode-socket: agents you started (their --local-socket).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from models import requests  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=["llama", "hybrid"])
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--prefill-socket")
    parser.add_argument("--decode-socket")
    parser.add_argument("--corrupt", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="kvagent-example.", dir=os.environ.get("TEST_TMPDIR"))
    pair = None
    if not (args.prefill_socket and args.decode_socket):
        from kvagent.daemon import AgentPair
        pair = AgentPair(work_dir=work)
        args.prefill_socket, args.decode_socket = pair.prefill.socket, pair.decode.socket
    try:
        prompts = os.path.join(work, "requests.json")
        with open(prompts, "w") as f:
            json.dump(requests(args.requests), f)
        common = ["--bootstrap", os.path.join(work, "bootstrap.json"), "--requests", prompts,
                  "--model", args.model]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        decode = subprocess.Popen([sys.executable, os.path.join(HERE, "decode.py"), "--socket",
                                   args.decode_socket, *common], env=env, stdout=subprocess.PIPE)
        prefill = subprocess.Popen([sys.executable, os.path.join(HERE, "prefill.py"), "--socket",
                                    args.prefill_socket, *common,
                                    *(["--corrupt"] if args.corrupt else [])], env=env,
                                   stdout=subprocess.PIPE)
        out_prefill, _ = prefill.communicate(timeout=120)
        out_decode, _ = decode.communicate(timeout=120)
        sys.stdout.write(out_prefill.decode() + out_decode.decode())
        ok = prefill.returncode == 0 and decode.returncode == 0
        print(f"example {args.model}: {'verified' if ok else 'FAILED'}", flush=True)
        return 0 if ok else 1
    finally:
        if pair:
            pair.stop()


if __name__ == "__main__":
    sys.exit(main())

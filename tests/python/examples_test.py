"""Runs examples/run.py as a user would (one command: two agents, a decode and a prefill
process) for the Llama-shaped and the hybrid model, and once with a corrupted byte to
show the decode side's check fails when the data is wrong."""
import os
import subprocess
import sys
import unittest

from harness import main


def run_example(*args):
    root = os.path.join(os.environ.get("TEST_SRCDIR", ""), "kvagent")
    if not os.path.isdir(os.path.join(root, "examples")):
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, os.path.join(root, "examples", "run.py"), *args],
                          env=env, capture_output=True, text=True, timeout=120)


class ExamplesTest(unittest.TestCase):
    def check(self, model):
        done = run_example("--model", model)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn(f"example {model}: verified", done.stdout)
        self.assertIn('"verified": true, "requests": 3', done.stdout)

    def test_llama(self):
        self.check("llama")

    def test_hybrid(self):
        self.check("hybrid")

    def test_corruption_is_caught(self):
        done = run_example("--model", "hybrid", "--corrupt")
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn('"mismatched": ["req-0"]', done.stdout)


if __name__ == "__main__":
    main()

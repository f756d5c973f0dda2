"""The documented install works offline: `python3 -m pip install --no-build-isolation
--no-deps --target DIR ./python` from a copy of the checkout's python/ and proto/
generates the stubs with Debian's protoc and installs a package that, imported from DIR
alone, attaches to a real agent."""
import os
import shutil
import subprocess
import sys
import unittest

from harness import PairTestCase, main


def checkout_root():
    runfiles = os.path.join(os.environ.get("TEST_SRCDIR", ""), "kvagent")
    if os.path.exists(os.path.join(runfiles, "python", "setup.py")):
        return runfiles
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


class InstallTest(PairTestCase):
    def test_pip_install_then_attach(self):
        tmp = os.environ.get("TEST_TMPDIR") or __import__("tempfile").mkdtemp()
        src = os.path.join(tmp, "src")
        root = checkout_root()
        shutil.copytree(os.path.join(root, "python"), os.path.join(src, "python"),
                        ignore=shutil.ignore_patterns("kvagent_pb2*.py", "__pycache__", "build",
                                                      "*.egg-info", "BUILD.bazel"))
        os.makedirs(os.path.join(src, "proto"))
        shutil.copy(os.path.join(root, "proto", "kvagent.proto"), os.path.join(src, "proto"))
        site = os.path.join(tmp, "site")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", HOME=tmp)
        done = subprocess.run(["/usr/bin/python3", "-m", "pip", "install", "--quiet",
                               "--no-build-isolation", "--no-deps", "--target", site,
                               os.path.join(src, "python")],
                              env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertTrue(os.path.exists(os.path.join(site, "kvagent", "_proto", "kvagent_pb2_grpc.py")))
        probe = ("import kvagent, sys; c = kvagent.connect(sys.argv[1], name='installed'); "
                 "print(kvagent.__file__); print(c.status().name)")
        done = subprocess.run(["/usr/bin/python3", "-c", probe, self.pair.prefill.socket],
                              env=dict(env, PYTHONPATH=site), capture_output=True, text=True,
                              timeout=60)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        where, agent = done.stdout.split()
        self.assertTrue(where.startswith(site), where)
        self.assertEqual(agent, "prefill")


if __name__ == "__main__":
    main()

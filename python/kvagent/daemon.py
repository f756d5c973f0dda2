"""Starts real kvagentd processes on this host for tests, examples and demos (the
Python twin of cli/daemon_process): local door only, a work folder for the socket, port
file and log, SIGTERM on stop."""
import hashlib
import os
import shutil
import signal
import socket as socketlib
import subprocess
import tempfile
import time

from . import errors

SOCKET_PATH_MAX = 107 - len(".session")


def find_kvagentd():
    """$KVAGENTD, the Bazel runfiles' //agent:kvagentd (a test's or a py_binary's),
    bazel-bin/agent/kvagentd of this checkout, or kvagentd on PATH."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.environ.get("KVAGENTD", "")]
    for var in ("TEST_SRCDIR", "RUNFILES_DIR"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "kvagent", "agent", "kvagentd"))
    # In runfiles (bazel run / py_binary): <runfiles>/kvagent/python/kvagent/daemon.py.
    candidates.append(os.path.join(here, "..", "..", "agent", "kvagentd"))
    candidates.append(os.path.join(here, "..", "..", "bazel-bin", "agent", "kvagentd"))
    candidates.append(shutil.which("kvagentd") or "")
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return os.path.abspath(c)
    raise errors.error(5, "kvagentd not found (looked at $KVAGENTD, runfiles, bazel-bin/agent, "
                       "PATH); build it with `bazel build //agent:kvagentd` or set KVAGENTD",
                       entry="kvagentd")


class Agent:
    """One kvagentd child process; `socket` is its --local-socket."""

    def __init__(self, name, work_dir, extra_args=(), binary=None, start_timeout=15.0):
        self.name = name
        binary = binary or find_kvagentd()
        self.socket = os.path.join(work_dir, f"{name}.sock")
        self.socket_dir = None  # a folder made for the socket, cleaned up by stop()
        if len(self.socket) > SOCKET_PATH_MAX:  # Unix socket paths are short
            short = os.path.join(tempfile.gettempdir(),
                                 "kva-" + hashlib.sha1(work_dir.encode()).hexdigest()[:10])
            os.makedirs(short, exist_ok=True)
            self.socket = os.path.join(short, f"{name}.sock")
            self.socket_dir = short
        port_file = os.path.join(work_dir, f"{name}.port")
        self.log_path = os.path.join(work_dir, f"{name}.log")
        if os.path.exists(port_file):
            os.unlink(port_file)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [binary, "--name", name, "--local-socket", self.socket, "--port-file", port_file,
                 *extra_args], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            try:
                with open(port_file) as f:
                    if f.read().strip():
                        return
            except FileNotFoundError:
                pass
            if self.process.poll() is not None:
                raise errors.error(14, f"agent '{name}' exited during start-up: {self.log_tail()}")
            time.sleep(0.01)
        self.stop()
        raise errors.error(4, f"agent '{name}' wrote no port file in {start_timeout} s: "
                           f"{self.log_tail()}")

    @property
    def address(self):
        return "unix:" + self.socket

    def log_tail(self, nbytes=2000):
        with open(self.log_path, "rb") as f:
            return f.read()[-nbytes:].decode(errors="replace")

    def stop(self, timeout=5.0):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._clean_up_socket_dir()
        return self.process.returncode

    def _clean_up_socket_dir(self):
        """Once the agent exited: its sockets in the folder made for them that nothing
        listens on (a killed agent leaves them), then the folder if it is empty (the
        other agents' sockets stay)."""
        if self.socket_dir is None:
            return
        for path in (self.socket, self.socket + ".session", self.socket + ".live"):
            probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                os.unlink(path)  # nothing listens: stale
            except OSError:
                pass  # gone already, or a live socket of another type
            finally:
                probe.close()
        try:
            os.rmdir(self.socket_dir)
        except OSError:
            pass


class AgentPair:
    """Two agents, "prefill" and "decode", in a fresh work folder ($TEST_TMPDIR when
    set); a context manager that stops both."""

    def __init__(self, extra_args=(), work_dir=None):
        self.work_dir = work_dir or tempfile.mkdtemp(prefix="kvagent-pair.",
                                                     dir=os.environ.get("TEST_TMPDIR"))
        self.prefill = Agent("prefill", self.work_dir, extra_args)
        try:
            self.decode = Agent("decode", self.work_dir, extra_args)
        except BaseException:
            self.prefill.stop()
            raise

    def stop(self):
        self.prefill.stop()
        self.decode.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

#!/usr/bin/env python3
"""What an idle kvagentd costs, for builds compared side by side (issue 17 part 6).

Starts every build given with --agent at the same moment (so they share the machine's
load), each alone or as a hub with --peers real peers connected to it (kvagentctl
connect, over the peers' local sockets), lets them settle, then reads /proc over
--seconds: the hub's utime + stime (clock ticks) and each thread's voluntary context
switches (its wakeups), grouped by thread name, and its nanoseconds on a CPU
(/proc/PID/task/*/schedstat: 10 ms ticks cannot tell 0.03 % from 0.05 % in a
minute). Prints one table per run and the load average; exits non-zero when an
agent does not start or a peer does not connect.

  tools/idle_wakeups.py --agent before=/tmp/kvagentd.head --agent after=bazel-bin/agent/kvagentd \\
      --seconds 60 --runs 3 [--network-door] [--peers 2 --kvagentctl bazel-bin/cli/kvagentctl]
"""
import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time

TICK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)


def threads(pid):
    """{tid: (name, voluntary context switches, ns on a CPU)} of every thread of `pid`."""
    out = {}
    task = f"/proc/{pid}/task"
    for tid in os.listdir(task):
        try:
            with open(f"{task}/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"{task}/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        out[tid] = (name, int(line.split()[1]), ns)
        except FileNotFoundError:
            pass  # the thread ended while read
    return out


def wait_for(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    sys.exit(f"idle_wakeups: {what} within {seconds} s; see the agents' logs under the work folder")


class Agent:
    def __init__(self, binary, name, folder, insecure):
        self.socket = os.path.join(folder, f"{name}.sock")
        self.log = open(os.path.join(folder, f"{name}.log"), "w")
        # A network door as deployed agents have (plain TCP on loopback here).
        doors = ["--insecure-listen", "127.0.0.1:0"] if insecure else []
        self.process = subprocess.Popen(
            [binary, "--name", name, "--local-socket", self.socket] + doors,
            stdout=self.log, stderr=subprocess.STDOUT)

    def ready(self):
        if self.process.poll() is not None:
            sys.exit(f"idle_wakeups: {self.log.name}: kvagentd exited with {self.process.returncode}")
        return os.path.exists(self.socket + ".session")

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def one_run(args, run, folder):
    hubs, everyone = {}, []
    try:
        for label, binary in args.agent:
            sub = os.path.join(folder, f"run{run}-{label}")
            os.makedirs(sub)
            hubs[label] = Agent(binary, "hub", sub, args.network_door)
            peers = [Agent(binary, f"peer{i}", sub, args.network_door) for i in range(args.peers)]
            everyone += [hubs[label]] + peers
            hubs[label].peers = peers
        for a in everyone:
            wait_for(a.ready, 30, f"{a.log.name}: the agent did not open its local door")
        for label, hub in hubs.items():
            for p in hub.peers:
                done = subprocess.run(
                    [args.kvagentctl, "--agent", "unix:" + hub.socket, "connect", "unix:" + p.socket],
                    capture_output=True, text=True, timeout=30)
                if done.returncode != 0:
                    sys.exit(f"idle_wakeups: {label}: connect {p.socket}: {done.stderr.strip()}")
        time.sleep(args.settle)
        load_before = os.getloadavg()[0]
        first = {l: (cpu_ticks(h.process.pid), threads(h.process.pid)) for l, h in hubs.items()}
        time.sleep(args.seconds)
        last = {l: (cpu_ticks(h.process.pid), threads(h.process.pid)) for l, h in hubs.items()}
        load_after = os.getloadavg()[0]
    finally:
        for a in everyone:
            a.stop()
    door = ", network door" if args.network_door else ""
    print(f"run {run}: {args.seconds} s, {args.peers} peer(s){door}, "
          f"load {load_before:.2f} / {load_after:.2f}")
    for label in hubs:
        ticks = last[label][0] - first[label][0]
        per_name, ns = collections.Counter(), 0
        for tid, (name, switches, on_cpu) in last[label][1].items():
            if tid in first[label][1]:
                per_name[name] += switches - first[label][1][tid][1]
                ns += on_cpu - first[label][1][tid][2]
        total = sum(per_name.values())
        cpu = 100.0 * ticks / TICK / args.seconds
        # schedstat: nanoseconds on a CPU, summed over the threads alive throughout.
        print(f"  {label:>8}: {cpu:.3f} % of a core ({ticks} ticks), "
              f"{100.0 * ns / 1e9 / args.seconds:.4f} % (schedstat), "
              f"{total / args.seconds:.2f} wakeups/s")
        for name, n in per_name.most_common():
            if n:
                print(f"            {name:<18} {n / args.seconds:6.2f}/s")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agent", action="append", required=True, metavar="LABEL=PATH",
                        help="a kvagentd build to measure (repeat to compare)")
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds after start (and connect) before measuring")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--peers", type=int, default=0, help="real peers connected to each hub")
    parser.add_argument("--network-door", action="store_true",
                        help="give every agent a network door (--insecure-listen 127.0.0.1:0)")
    parser.add_argument("--kvagentctl", default="bazel-bin/cli/kvagentctl")
    args = parser.parse_args()
    pairs = []
    for spec in args.agent:
        label, sep, path = spec.partition("=")
        if not sep or not os.access(path, os.X_OK):
            sys.exit(f"idle_wakeups: --agent {spec}: want LABEL=PATH of an executable kvagentd")
        pairs.append((label, os.path.abspath(path)))
    args.agent = pairs
    if args.peers and not os.access(args.kvagentctl, os.X_OK):
        sys.exit(f"idle_wakeups: --kvagentctl {args.kvagentctl}: not an executable (build //cli:kvagentctl)")
    folder = tempfile.mkdtemp(prefix="kvagent-idle-")
    try:
        for run in range(1, args.runs + 1):
            one_run(args, run, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

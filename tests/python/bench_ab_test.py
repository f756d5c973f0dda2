"""tools/bench_ab.py: the verdict rule on figures given here, and real interleaved runs
of `kvagentctl bench` (two real kvagentd per run) for two builds, one of which fails."""
import contextlib
import io
import json
import os
import shutil
import stat
import tempfile
import unittest

import bench_ab
from harness import main

SRC = os.path.join(os.environ.get("TEST_SRCDIR", ""), "kvagent")
KVAGENTD = os.path.join(SRC, "agent", "kvagentd")
KVAGENTCTL = os.path.join(SRC, "cli", "kvagentctl")


def cell(op, gbps, p50, verified=True):
    return {"kind": "cell", "op": op, "pattern": "contiguous", "block_bytes": 65536,
            "batch": 16, "gbps": gbps, "p50_us": p50, "verified": verified}


def run_main(args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = bench_ab.main(args)
        except SystemExit as e:  # argparse's refusals
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


class VerdictTest(unittest.TestCase):
    def test_only_rounds_that_do_not_overlap_are_a_verdict(self):
        self.assertEqual(bench_ab.verdict([5.0, 6.0, 5.5], [3.0, 4.9, 4.0], True), "slower")
        self.assertEqual(bench_ab.verdict([5.0, 6.0, 5.5], [6.1, 9.0, 7.0], True), "faster")
        self.assertEqual(bench_ab.verdict([5.0, 6.0, 5.5], [4.0, 5.5, 4.5], True), "~")
        # Latency: lower is better.
        self.assertEqual(bench_ab.verdict([100.0, 120.0, 110.0], [121.0, 130.0, 125.0], False),
                         "slower")
        self.assertEqual(bench_ab.verdict([100.0, 120.0, 110.0], [90.0, 99.0, 95.0], False),
                         "faster")
        # Two rounds each do not overlap by chance a third of the time: no verdict.
        self.assertEqual(bench_ab.verdict([5.0, 6.0], [1.0, 2.0], True), "?")
        self.assertAlmostEqual(bench_ab.chance(2, 2), 1 / 3)
        self.assertAlmostEqual(bench_ab.chance(3, 3), 0.1)
        self.assertAlmostEqual(bench_ab.chance(5, 5), 2 / 252)

    def test_figures_are_compared_per_cell_and_metric(self):
        runs = [("old", [cell("WRITE", 2.0, 300.0)]), ("new", [cell("WRITE", 1.0, 600.0)]),
                ("new", [cell("WRITE", 1.1, 650.0)]), ("old", [cell("WRITE", 2.2, 310.0)]),
                ("old", [cell("WRITE", 2.1, 305.0)]), ("new", [cell("WRITE", 1.2, 620.0)])]
        table, order = bench_ab.collect(runs)
        self.assertEqual(order, ["cell WRITE contiguous 64K x 16"])
        rows = bench_ab.compare(table, order, ["old", "new"])
        by_metric = {m: (v, vd) for _, m, v, vd in rows}
        self.assertEqual(by_metric["gbps"][0], {"old": [2.0, 2.2, 2.1], "new": [1.0, 1.1, 1.2]})
        self.assertEqual(by_metric["gbps"][1], {"new": "slower"})
        self.assertEqual(by_metric["p50_us"][1], {"new": "slower"})
        out = io.StringIO()
        counts = bench_ab.report(rows, ["old", "new"], out)
        self.assertEqual(counts["new"]["slower"], 2)
        self.assertIn("new against old: 2 figures slower in every round", out.getvalue())
        self.assertIn("0.52", out.getvalue())  # new / old GB/s: 1.1 / 2.1
        self.assertIn("about 0.2 of these 2 verdicts by chance (10.0 % per figure)",
                      out.getvalue())

    def test_a_figure_only_one_build_prints_is_shown_without_a_verdict(self):
        # An older agent prints no ring-notification line (its ring delivers none); a newer
        # build adds a line the other lacks: either way the report goes on.
        def lat(path, p50):
            return {"kind": "fast_latency", "path": path, "n": 500, "p50_us": p50,
                    "p99_us": p50 * 2, "p999_us": p50 * 3, "agent_p50_us": None}

        runs = []
        for r in range(3):
            runs.append(("old", [lat("fast", 90.0 + r), lat("fast_grpc_notification", 300.0)]))
            runs.append(("new", [lat("fast", 91.0 + r), lat("fast_ring_notification", 170.0),
                                 lat("fast_grpc_notification", 310.0 + r)]))
        table, order = bench_ab.collect(runs)
        rows = bench_ab.compare(table, ["fast_latency fast_ring_notification"] + [
            o for o in order if o != "fast_latency fast_ring_notification"], ["old", "new"])
        # The base build lacks the ring line: nothing to compare it with.
        self.assertNotIn("fast_latency fast_ring_notification", [r[0] for r in rows])
        out = io.StringIO()
        bench_ab.report(rows, ["old", "new"], out)
        # The other way round, the base has it and the other build does not: '-'.
        rows = bench_ab.compare(table, order, ["new", "old"])
        ring = [r for r in rows if r[0] == "fast_latency fast_ring_notification"]
        self.assertEqual([(m, vd) for _, m, _, vd in ring], [("p50_us", {}), ("p99_us", {})])
        out = io.StringIO()
        counts = bench_ab.report(rows, ["new", "old"], out)
        line = [l for l in out.getvalue().splitlines()
                if l.startswith("fast_latency fast_ring_notification  p50_us")][0]
        self.assertEqual(line.split()[-3:], ["-", "-", "-"], line)  # old: median, ratio, verdict
        # fast overlaps (p50, p99); fast_grpc_notification does not (300 against 310-312).
        self.assertEqual(counts["old"], {"slower": 0, "faster": 2, "~": 2, "?": 0})

    def test_a_cell_with_unverified_bytes_names_build_round_and_cell(self):
        with self.assertRaises(bench_ab.RunFailed) as e:
            bench_ab.check_run([cell("READ", 1.0, 1.0, verified=False)], "new", 2)
        self.assertIn("build 'new', round 2: cell READ contiguous 64K x 16: verified is false",
                      str(e.exception))
        with self.assertRaises(bench_ab.RunFailed):
            bench_ab.check_run([], "new", 1)


class RealRunsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="bench-ab-", dir=os.environ.get("TEST_TMPDIR"))
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def script(self, name, body):
        path = os.path.join(self.tmp, name)
        with open(path, "w") as f:
            f.write("#!/bin/sh\n" + body + "\n")
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
        return path

    def test_two_builds_interleaved_one_cell(self):
        # The same binary under two names (a wrapper), so the run is real but the
        # figures' difference is only the machine's noise.
        other = self.script("kvagentd-b", f'exec "{KVAGENTD}" "$@"')
        out_json = os.path.join(self.tmp, "ab.json")
        rc, out, err = run_main(["--agent", f"a={KVAGENTD}", "--agent", f"b={other}",
                                 "--rounds", "2", "--kvagentctl", KVAGENTCTL,
                                 "--json-out", out_json, "--",
                                 "--cells", "4K:1", "--pool-mib", "16"])
        self.assertEqual(rc, 0, out + err)
        with open(out_json) as f:
            data = json.load(f)
        # Round 1: a then b; round 2: b then a.
        self.assertEqual([r["build"] for r in data["runs"]], ["a", "b", "b", "a"])
        rows = {(r["figure"], r["metric"]): r for r in data["rows"]}
        row = rows[("cell WRITE contiguous 4K x 1", "gbps")]
        self.assertEqual(len(row["values"]["a"]), 2)
        self.assertEqual(len(row["values"]["b"]), 2)
        self.assertTrue(all(v > 0 for v in row["values"]["a"] + row["values"]["b"]))
        # Two rounds: no verdict (chance alone gives one a third of the time).
        self.assertEqual(row["verdicts"]["b"], "?")
        self.assertIn(("cell READ scattered 4K x 1", "fast_p50_us"), rows)
        self.assertIn("b against a:", out)
        self.assertIn("load average", out)

    def test_a_build_that_fails_is_named(self):
        broken = self.script("kvagentd-broken", "echo 'cannot start' >&2; exit 1")
        rc, out, err = run_main(["--agent", f"good={KVAGENTD}", "--agent", f"broken={broken}",
                                 "--rounds", "1", "--kvagentctl", KVAGENTCTL, "--",
                                 "--cells", "4K:1", "--pool-mib", "16"])
        self.assertEqual(rc, 1, out + err)
        self.assertIn("build 'broken', round 1: kvagentctl bench exited with", err)

    def test_bad_arguments_are_refused_with_the_fix(self):
        rc, _, err = run_main(["--agent", "only-a-path", "--agent", f"b={KVAGENTD}"])
        self.assertEqual(rc, 2)
        self.assertIn("give NAME=PATH", err)
        rc, _, err = run_main(["--agent", f"a={KVAGENTD}"])
        self.assertEqual(rc, 2)
        self.assertIn("at least two --agent", err)
        rc, _, err = run_main(["--agent", f"a={KVAGENTD}", "--agent", "b=/nonexistent/kvagentd"])
        self.assertEqual(rc, 2)
        self.assertIn("is not an executable file", err)
        rc, _, err = run_main(["--agent", f"a={KVAGENTD}", "--agent", f"b={KVAGENTD}",
                               "--kvagentctl", KVAGENTCTL, "--", "--json"])
        self.assertEqual(rc, 2)
        self.assertIn("do not pass --json", err)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Two or more kvagentd builds under `kvagentctl bench`, interleaved, compared per figure.

On a shared machine two runs of one build differ by up to 2-3x, so one run of each build
says little. This runs `kvagentctl bench --json --kvagentd PATH [BENCH ARGS]` for every
build in every round, rotating which build goes first, and reads the JSON lines back.
For each figure the bench prints (each cell's GB/s and p50, the fast path's, issue 14's
paired ratios, the rate and fast path phases), it prints every build's median, its range over the rounds and
the ratio to the first build (the baseline). A figure is called slower or faster only
when the rounds do not overlap: every round of the build is worse (or better) than
every round of the baseline. Otherwise it is "~": within the spread the rounds
themselves show. Two equal builds still get such a verdict by chance, with probability
2 / C(2n, n) per figure for n rounds each (33 % at 2 rounds, 10 % at 3, 0.8 % at 5), so
fewer than 3 rounds give no verdict ("?") and the report prints how many chance
verdicts to expect. The load average before each run is printed with it.

  tools/bench_ab.py --agent before=/tmp/kvagentd.old --agent after=bazel-bin/agent/kvagentd \\
      --rounds 3 [--kvagentctl bazel-bin/cli/kvagentctl] [--json-out FILE] -- --quick

Everything after `--` goes to `kvagentctl bench` (e.g. `--cells 64K:16,4M:64`,
`--fast-only`, `--quick`, `--pool-mib 256`). Exits 1 when a run fails or a cell's
bytes are not verified (the build and round named), 2 on bad arguments, and, with
--fail-on-slower, 3 when some figure of a build is slower than the baseline's in every
round.
"""
import argparse
import json
import os
import math
import statistics
import subprocess
import sys

# kind -> (fields that name the figure, [(metric, True when higher is better), ...]).
FIGURES = {
    "cell": (("op", "pattern", "block_bytes", "batch"),
             [("gbps", True), ("gbps_inflight4", True), ("p50_us", False), ("p99_us", False),
              ("fast_gbps", True), ("fast_gbps_inflight4", True), ("fast_p50_us", False),
              ("fast_p99_us", False)]),
    # Issue 14's targets, measured in paired rounds within each run (the ratio of medians).
    "target": (("target", "op", "block_bytes", "batch"), [("ratio", True)]),
    "rate": (("mode", "clients", "transfers_per_call"),
             [("transfers_per_s", True), ("call_p50_us", False)]),
    "fast_latency": (("path",),
                     [("p50_us", False), ("p99_us", False), ("agent_p50_us", False)]),
    "fast_rate": (("clients",),
                  [("transfers_per_s", True), ("initiator_cpu_us_per_transfer", False),
                   ("target_cpu_us_per_transfer", False), ("client_cpu_us_per_transfer", False),
                   ("notification_taker_cpu_us_per_transfer", False),
                   ("total_cpu_us_per_transfer", False), ("client_sleeps_per_transfer", False),
                   ("initiator_wakeups_per_transfer", False), ("target_wakeups_per_transfer", False)]),
    "fast_rate_placed": (("clients",),
                         [("transfers_per_s", True), ("initiator_cpu_us_per_transfer", False),
                          ("target_cpu_us_per_transfer", False),
                          ("client_cpu_us_per_transfer", False),
                          ("notification_taker_cpu_us_per_transfer", False),
                          ("total_cpu_us_per_transfer", False),
                          ("client_sleeps_per_transfer", False),
                          ("initiator_wakeups_per_transfer", False),
                          ("target_wakeups_per_transfer", False)]),
    "memory": ((), [("transfers_per_second", True)]),
}


class RunFailed(Exception):
    pass


def size_name(n):
    for unit, name in ((1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{name}"
    return str(n)


def figure_key(record):
    """('cell WRITE contiguous 64K x 16', [(metric, higher_better), ...]) or None for a
    record this tool does not compare."""
    kind = record.get("kind")
    if kind not in FIGURES:
        return None
    fields, metrics = FIGURES[kind]
    parts = [kind]
    for f in fields:
        value = record.get(f)
        if f == "block_bytes" and isinstance(value, int):
            value = size_name(value)
        if f == "batch":
            value = f"x {value}"
        parts.append(str(value))
    return " ".join(parts), metrics


def parse_run(text):
    """The JSON records of one bench run's stdout (other lines are skipped)."""
    records = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def check_run(records, build, round_no):
    """RunFailed naming the build, the round and the cell whose bytes were not verified."""
    if not records:
        raise RunFailed(f"build '{build}', round {round_no}: the bench printed no JSON record")
    for r in records:
        if r.get("kind") != "cell":
            continue
        for key in ("verified", "fast_verified"):
            if r.get(key) is False:
                name, _ = figure_key(r)
                raise RunFailed(f"build '{build}', round {round_no}: {name}: {key} is false "
                                "(destination bytes differ from the source)")


def collect(runs):
    """{figure name: {metric: {build: [values in round order]}}} plus each figure's
    metric list, in the order figures first appear."""
    table = {}
    order = []
    for build, records in runs:
        for r in records:
            found = figure_key(r)
            if found is None:
                continue
            name, metrics = found
            if name not in table:
                table[name] = {"metrics": metrics, "values": {}}
                order.append(name)
            for metric, _ in metrics:
                value = r.get(metric)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    table[name]["values"].setdefault(metric, {}).setdefault(build, []).append(
                        float(value))
    return table, order


MIN_ROUNDS = 3


def chance(n_base, n_other):
    """The probability that the rounds of two equal builds do not overlap (either way):
    every ordering of the n_base + n_other values is equally likely."""
    return 2 / math.comb(n_base + n_other, n_base)


def verdict(base, other, higher_better):
    """'slower' / 'faster' when the rounds do not overlap, '~' when they do, '?' with
    fewer than MIN_ROUNDS on either side (2 and 2 do not overlap by chance a third of
    the time)."""
    if len(base) < MIN_ROUNDS or len(other) < MIN_ROUNDS:
        return "?"
    if higher_better:
        if max(other) < min(base):
            return "slower"
        if min(other) > max(base):
            return "faster"
    else:
        if min(other) > max(base):
            return "slower"
        if max(other) < min(base):
            return "faster"
    return "~"


def compare(table, order, builds):
    """Rows (figure, metric, {build: values}, {build: verdict vs the first build})."""
    rows = []
    base = builds[0]
    for name in order:
        entry = table[name]
        for metric, higher_better in entry["metrics"]:
            values = entry["values"].get(metric)
            if not values or base not in values:
                continue
            verdicts = {}
            for b in builds[1:]:
                if b in values:
                    verdicts[b] = verdict(values[base], values[b], higher_better)
            rows.append((name, metric, values, verdicts))
    return rows


def fmt_value(v):
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def describe(values):
    med = statistics.median(values)
    if len(values) == 1:
        return fmt_value(med)
    return f"{fmt_value(med)} ({fmt_value(min(values))}-{fmt_value(max(values))})"


def report(rows, builds, out):
    base = builds[0]
    header = ["figure", "metric"] + [f"{b} median (range)" for b in builds]
    header += [f"{b} / {base}" for b in builds[1:]] + [f"{b}" for b in builds[1:]]
    lines = [header]
    counts = {b: {"slower": 0, "faster": 0, "~": 0, "?": 0} for b in builds[1:]}
    for name, metric, values, verdicts in rows:
        line = [name, metric]
        for b in builds:
            line.append(describe(values[b]) if b in values else "-")
        for b in builds[1:]:
            if b in values and statistics.median(values[base]) > 0:
                line.append(f"{statistics.median(values[b]) / statistics.median(values[base]):.2f}")
            else:
                line.append("-")
        for b in builds[1:]:
            v = verdicts.get(b, "-")
            line.append(v)
            if v in counts[b]:
                counts[b][v] += 1
        lines.append(line)
    widths = [max(len(l[i]) for l in lines) for i in range(len(header))]
    for l in lines:
        out.write("  ".join(c.ljust(w) for c, w in zip(l, widths)).rstrip() + "\n")
    for b in builds[1:]:
        c = counts[b]
        judged = [chance(len(v[base]), len(v[b])) for _, _, v, vd in rows
                  if vd.get(b) in ("slower", "faster", "~")]
        out.write(f"{b} against {base}: {c['slower']} figures slower in every round, "
                  f"{c['faster']} faster in every round, {c['~']} within the rounds' spread"
                  + (f", {c['?']} with too few rounds to tell (fewer than {MIN_ROUNDS})"
                     if c["?"] else "") + "\n")
        if judged:
            out.write(f"  two equal builds would get about {sum(judged):.1f} of these "
                      f"{len(judged)} verdicts by chance ({100 * max(judged):.1f} % per "
                      "figure): a verdict means something only beyond that\n")
    return counts


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def run_bench(kvagentctl, kvagentd, bench_args, build, round_no, log):
    cmd = [kvagentctl, "bench", "--json", "--kvagentd", kvagentd] + bench_args
    load = loadavg()
    log.write(f"round {round_no}, build '{build}' ({kvagentd}), load average {load}: "
              f"{' '.join(cmd[1:])}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RunFailed(f"build '{build}', round {round_no}: kvagentctl bench exited with "
                        f"{proc.returncode}:\n{tail}")
    records = parse_run(proc.stdout)
    check_run(records, build, round_no)
    return records, load


def parse_agents(specs, parser):
    builds = []
    seen = set()
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            parser.error(f"--agent '{spec}': give NAME=PATH, e.g. before=/tmp/kvagentd.old")
        if name in seen:
            parser.error(f"--agent '{spec}': the name '{name}' is given twice; name each build "
                         "once")
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            parser.error(f"--agent '{spec}': '{path}' is not an executable file; build it "
                         "(bazel build //agent:kvagentd) or copy the binary there")
        seen.add(name)
        builds.append((name, path))
    if len(builds) < 2:
        parser.error("give at least two --agent NAME=PATH builds to compare (the first is "
                     "the baseline)")
    return builds


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agent", action="append", default=[], metavar="NAME=PATH",
                        help="a kvagentd build; the first is the baseline")
    parser.add_argument("--kvagentctl", default="bazel-bin/cli/kvagentctl",
                        help="the kvagentctl that runs every bench (one client for all builds)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of each build, interleaved (default 3; 3 or more to judge)")
    parser.add_argument("--json-out", metavar="FILE",
                        help="write every run's records and the comparison as JSON")
    parser.add_argument("--fail-on-slower", action="store_true",
                        help="exit 3 when a figure of a build is slower in every round")
    args = parser.parse_args(argv)
    builds = parse_agents(args.agent, parser)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more ({MIN_ROUNDS} or more to judge)")
    if not (os.path.isfile(args.kvagentctl) and os.access(args.kvagentctl, os.X_OK)):
        parser.error(f"--kvagentctl '{args.kvagentctl}' is not an executable file; build it "
                     "(bazel build //cli:kvagentctl) or pass its path")
    if "--json" in bench_args or "--kvagentd" in bench_args:
        parser.error("do not pass --json or --kvagentd after --: this tool sets them per build")

    runs = []
    loads = []
    names = [name for name, _ in builds]
    try:
        for r in range(1, args.rounds + 1):
            k = (r - 1) % len(builds)
            for name, path in builds[k:] + builds[:k]:
                records, load = run_bench(args.kvagentctl, path, bench_args, name, r, sys.stdout)
                runs.append((name, records))
                loads.append({"round": r, "build": name, "loadavg_1m": load})
    except RunFailed as e:
        print(f"bench_ab: {e}", file=sys.stderr)
        return 1

    table, order = collect(runs)
    rows = compare(table, order, names)
    print(f"\n{args.rounds} round(s) of {', '.join(names)} (baseline: {names[0]}); load average "
          f"before each run: {', '.join(l['build'] + ' ' + l['loadavg_1m'] for l in loads)}")
    counts = report(rows, names, sys.stdout)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"builds": dict(builds), "bench_args": bench_args, "loads": loads,
                       "runs": [{"build": b, "records": rec} for b, rec in runs],
                       "rows": [{"figure": n, "metric": m, "values": v, "verdicts": vd}
                                for n, m, v, vd in rows]}, f, indent=1)
    if args.fail_on_slower and any(c["slower"] for c in counts.values()):
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Counts kvagent's test results from the JUnit XML each test wrote in this run.

Unit: one Catch2 TEST_CASE (tests/unit/catch_main.cc writes one <testcase> per case to
$XML_OUTPUT_FILE); a non-Catch2 test counts as the one <testcase> Bazel writes for it.
  failed  = a <testcase> holding <failure> or <error>
  skipped = a <testcase> holding <skipped> (KVAGENT_SKIP; GPU tests on a GPU-less host)
  passed  = every other <testcase>
Which test.xml files belong to this run, and each target's own status, come from
Bazel's build event file (--build_event_json_file), so a stale test.xml left by an
earlier run is never counted. Safety nets, each adding one failure:
  - a non-manual test target (bazel query) with no result: did not build, or never ran;
  - a result whose test.xml is missing or unreadable;
  - a target Bazel did not pass (timeout, crash after its XML) whose XML shows no failure;
  - `bazel test` exiting non-zero while nothing above counted a failure.
Extra runs count the same way, each case once per run it ran in:
  --run NAME EVENTS EXIT "PATTERN..."  another `bazel test` (e.g. the ASan/UBSan and
      TSan runs of .ci/run); its expected targets are the non-manual tests of the
      space-separated PATTERNs ("-//x:y" excludes), its results read "[NAME] //label".
  --junit NAME FILE  a JUnit XML written by a non-Bazel run (fuzz/run.sh: one case per
      fuzzer); a missing or unreadable FILE counts as one failure.
Prints failures and skips, then, LAST, one line: "N passed, N failed[, N skipped]".
Exits 1 when anything failed.
"""
import argparse
import json
import os
import subprocess
import sys
import urllib.parse
import xml.etree.ElementTree as ET

QUERY = 'tests(//...) except attr(tags, "\\bmanual\\b", tests(//...))'
PASSING_STATUSES = {"PASSED", "FLAKY"}


def pattern_query(patterns):
    """Non-manual tests of Bazel target patterns ("-//x/..." subtracts), as a query."""
    universe = ""
    for p in patterns:
        if p.startswith("-"):
            universe += f" - {p[1:]}"
        else:
            universe += f" + {p}" if universe else p
    return f'tests({universe}) except attr(tags, "\\bmanual\\b", tests({universe}))'


def workspace_query(root):
    """QUERY over this checkout's own top-level packages. `//...` would also walk the
    convenience link named after the checkout (bazel-<dir>, which .bazelignore cannot
    list for every clone) into external repositories, where /usr's symlink loops make
    the whole query fail."""
    parts = []
    if any(os.path.exists(os.path.join(root, b)) for b in ("BUILD", "BUILD.bazel")):
        parts.append("//:all")
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if (name.startswith(".") or name.startswith("bazel-") or os.path.islink(path)
                or not os.path.isdir(path)):
            continue
        if any(b in files for _, _, files in os.walk(path) for b in ("BUILD", "BUILD.bazel")):
            parts.append(f"//{name}/...")
    universe = " + ".join(parts) or "//..."
    return f'tests({universe}) except attr(tags, "\\bmanual\\b", tests({universe}))'


def expected_targets(root, query=None):
    """Non-manual test targets, i.e. what `bazel test //...` (or the query) must run."""
    if query is None:
        query = workspace_query(root)
    try:
        proc = subprocess.run(
            ["bazel", "query", "--keep_going", "--output=label", query],
            cwd=root, capture_output=True, text=True, check=False)
    except OSError as err:
        return set(), f"bazel query could not start ({err}); is bazel-bootstrap installed?"
    labels = {l.strip() for l in proc.stdout.splitlines() if l.strip().startswith("//")}
    note = None
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        errors = [l for l in lines if "ERROR" in l]
        # Bazel's convenience link named after the checkout (bazel-<dir>, which
        # .bazelignore cannot list for every clone) leads //... into external
        # repositories' example BUILD files; those errors are not ours.
        ours = [l for l in errors if "package 'bazel-" not in l and "Skipping '//...'" not in l]
        if ours or not errors:
            tail = " | ".join((ours or lines)[-3:])
            note = f"bazel query exited {proc.returncode} (a BUILD file does not load?): {tail}"
    return labels, note


def read_events(path):
    """label -> {(run, shard): (attempt, status, xml_path)}, latest attempt wins."""
    results = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            rid = event.get("id", {}).get("testResult")
            body = event.get("testResult")
            if rid is None or body is None:
                continue
            label = rid.get("label", "")
            key = (rid.get("run", 1), rid.get("shard", 1))
            attempt = rid.get("attempt", 1)
            xml_path = None
            for out in body.get("testActionOutput", []):
                if out.get("name") == "test.xml" and out.get("uri", "").startswith("file://"):
                    xml_path = urllib.parse.unquote(out["uri"][len("file://"):])
            status = body.get("status", "NO_STATUS")
            prev = results.setdefault(label, {}).get(key)
            if prev is None or attempt >= prev[0]:
                results[label][key] = (attempt, status, xml_path)
    return results


def testlogs_results(root, labels):
    """Without an event file: bazel-testlogs/<pkg>/<name>/test.xml, status unknown."""
    results = {}
    for label in labels:
        pkg, name = label[2:].split(":", 1)
        path = os.path.join(root, "bazel-testlogs", pkg, name, "test.xml")
        if os.path.exists(path):
            results[label] = {(1, 1): (1, None, path)}
    return results


def count_xml(path):
    """(passed, [failed case names + first line], [(skipped case, reason)]) or raises."""
    tree = ET.parse(path)
    passed, failed, skipped = 0, [], []
    for case in tree.getroot().iter("testcase"):
        name = case.get("name", "?")
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            detail = (bad.get("message") or "").strip()
            text = (bad.text or "").strip().splitlines()
            if text:
                detail = text[0] if not detail or detail == "test case failed" else detail
            failed.append(f"{name}: {detail}" if detail else name)
        elif case.find("skipped") is not None:
            skipped.append((name, case.find("skipped").get("message", "")))
        else:
            passed += 1
    return passed, failed, skipped


def count_run(expected, results, prefix, counts):
    """Adds one run's results to counts = {"passed": n, "failures": [], "skips": []}."""
    for label in sorted(expected | set(results)):
        shards = results.get(label)
        name = f"{prefix}{label}"
        if not shards:
            counts["failures"].append(f"{name}: no test result (did not build, or never ran)")
            continue
        for (run, shard), (_, status, xml_path) in sorted(shards.items()):
            where = name if len(shards) == 1 else f"{name} (run {run}, shard {shard})"
            if not xml_path or not os.path.exists(xml_path):
                counts["failures"].append(f"{where}: no test.xml (status {status})")
                continue
            try:
                passed, failed, skipped = count_xml(xml_path)
            except (ET.ParseError, OSError) as err:
                counts["failures"].append(f"{where}: unreadable {xml_path}: {err}")
                continue
            counts["passed"] += passed
            counts["failures"] += [f"{where}: {f}" for f in failed]
            counts["skips"] += [f"{where}: {s} ({r})" for s, r in skipped]
            if status is not None and status not in PASSING_STATUSES and not failed:
                counts["failures"].append(f"{where}: Bazel status {status} though its XML shows "
                                          "no failed case (crash or timeout after the cases ran?)")
            if passed + len(failed) + len(skipped) == 0:
                print(f"NOTE: {where} ran no test cases", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", help="Bazel --build_event_json_file of the test run")
    parser.add_argument("--bazel-exit", type=int, default=0,
                        help="exit status of the `bazel test` (or quickstart) run")
    parser.add_argument("--run", nargs=4, action="append", default=[],
                        metavar=("NAME", "EVENTS", "EXIT", "PATTERNS"),
                        help="another bazel test run: name, event file, exit status, and its "
                             "target patterns as one space-separated argument")
    parser.add_argument("--junit", nargs=2, action="append", default=[], metavar=("NAME", "FILE"),
                        help="JUnit XML of a non-Bazel run (fuzz/run.sh --junit)")
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), help="repository root")
    args = parser.parse_args()

    # The `bazel test //...` run: always, unless only other runs were given (.ci/run
    # with its test stage off).
    main_run = bool(args.events) or not (args.run or args.junit)
    expected, query_note = expected_targets(args.root) if main_run else (set(), None)
    if not main_run:
        results = {}
    elif args.events and os.path.exists(args.events):
        results = read_events(args.events)
    else:
        if args.events:
            print(f"NOTE: no build event file at {args.events}; the test run did not start",
                  flush=True)
            results = {}
        else:
            results = testlogs_results(args.root, expected)

    counts = {"passed": 0, "failures": [], "skips": []}
    count_run(expected, results, "", counts)
    notes = [query_note] if query_note else []
    if args.bazel_exit != 0 and not counts["failures"]:
        counts["failures"].append(
            f"bazel test exited {args.bazel_exit} but no test failed: a build or loading error "
            "outside any test target (see the log above)")

    for name, events, exit_status, pattern_text in args.run:
        patterns = pattern_text.split()
        before = len(counts["failures"])
        run_expected, note = expected_targets(args.root, pattern_query(patterns))
        if note:
            notes.append(f"[{name}] {note}")
        run_results = read_events(events) if os.path.exists(events) else {}
        if not os.path.exists(events):
            print(f"NOTE: [{name}] no build event file at {events}; the run did not start",
                  flush=True)
        count_run(run_expected, run_results, f"[{name}] ", counts)
        if exit_status != "0" and len(counts["failures"]) == before:
            counts["failures"].append(
                f"[{name}] bazel test exited {exit_status} but no test failed: a build or "
                "loading error outside any test target (see the log above)")

    for name, path in args.junit:
        try:
            passed, failed, skipped = count_xml(path)
        except (ET.ParseError, OSError) as err:
            counts["failures"].append(f"[{name}] no readable result file {path}: {err}")
            continue
        counts["passed"] += passed
        counts["failures"] += [f"[{name}] {f}" for f in failed]
        counts["skips"] += [f"[{name}] {s} ({r})" for s, r in skipped]
        if passed + len(failed) + len(skipped) == 0:
            counts["failures"].append(f"[{name}] {path} holds no test case")

    for note in notes:
        print(f"NOTE: {note}")
    for s in counts["skips"]:
        print(f"SKIPPED {s}")
    for f in counts["failures"]:
        print(f"FAILED  {f}")
    line = f"{counts['passed']} passed, {len(counts['failures'])} failed"
    if counts["skips"]:
        line += f", {len(counts['skips'])} skipped"
    print(line, flush=True)
    return 1 if counts["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

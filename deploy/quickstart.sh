#!/usr/bin/env bash
# One command from a fresh Debian 12 checkout to a running demo or a full test run:
#   ./deploy/quickstart.sh demo [demo flags...]   two agents move KV pages, bytes checked
#   ./deploy/quickstart.sh test [bazel flags...]  every test, then a pass/fail count
# Each verb first runs deploy/bootstrap.sh (quiet when everything is installed).
set -euo pipefail

usage() {
  cat >&2 <<'USAGE'
usage: deploy/quickstart.sh demo [ARGS...]   build and run the two-agent demo
                                             (ARGS go to `kvagentctl demo`)
       deploy/quickstart.sh test [ARGS...]   build and run every test (ARGS go to
                                             `bazel test`), then print a summary
USAGE
}

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if (($# < 1)); then
  usage
  exit 2
fi
verb="$1"
shift

case "$verb" in
  demo)
    ./deploy/bootstrap.sh
    bazel build //cli:kvagentctl //agent:kvagentd
    exec bazel run //cli:kvagentctl -- demo "$@"
    ;;
  test)
    ./deploy/bootstrap.sh
    # The build event file tells the counter which test.xml files this run produced
    # (cached results included) and each target's status. .ci/run passes its own path.
    events="${KVAGENT_TEST_EVENTS:-}"
    own_events=0
    if [[ -z "$events" ]]; then
      events="$(mktemp "${TMPDIR:-/tmp}/kvagent-test-events.XXXXXX")"
      own_events=1
    fi
    rc=0
    # Bazel's convenience link to its execroot is named after this folder
    # (bazel-<folder>); .bazelignore can list only fixed names (bazel-main,
    # bazel-kvagent), so in a clone named otherwise a second run's //... walked into
    # it and failed to load Bazel's own packages. The link is remade by the build.
    link="bazel-$(basename "$PWD")"
    if [[ -L "$link" ]]; then rm -f "$link"; fi
    bazel test //... --keep_going --test_output=errors \
      --build_event_json_file="$events" "$@" || rc=$?
    echo
    echo "== test summary (from each test's JUnit XML) =="
    summary_rc=0
    python3 .ci/count_tests.py --events "$events" --bazel-exit "$rc" || summary_rc=$?
    if ((own_events)); then rm -f "$events"; fi
    if ((rc != 0)); then exit "$rc"; fi
    exit "$summary_rc"
    ;;
  -h|--help|help)
    usage
    exit 0
    ;;
  *)
    echo "quickstart.sh: unknown verb '$verb'" >&2
    usage
    exit 2
    ;;
esac

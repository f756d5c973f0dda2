#!/usr/bin/env bash
# `kvagentctl demo --kvagentd PATH` with a PATH that is not an executable: the demo
# must stop before starting anything, with NOT_FOUND naming the path and the fix.
set -euo pipefail
ctl="$TEST_SRCDIR/kvagent/cli/kvagentctl"
missing="$TEST_TMPDIR/no-such-kvagentd"
if "$ctl" demo --kvagentd "$missing" >"$TEST_TMPDIR/out" 2>"$TEST_TMPDIR/err"; then
  echo "demo succeeded with a missing kvagentd"; exit 1
fi
cat "$TEST_TMPDIR/err"
for want in "$missing" "not an executable file" "bazel build //agent:kvagentd" "NOT_FOUND"; do
  grep -qF -- "$want" "$TEST_TMPDIR/err" || { echo "stderr lacks: $want"; exit 1; }
done

#!/usr/bin/env bash
# Runs `kvagentctl demo --json` end to end (two real kvagentd processes) and checks
# that its last line reports every byte verified. UCX_TLS from the test's env
# selects the transports (shared memory by default, tcp,self as between hosts).
set -euo pipefail
ctl="$TEST_SRCDIR/kvagent/cli/kvagentctl"
out="$TEST_TMPDIR/demo.out"
# shellcheck disable=SC2086 # DEMO_ARGS is a list of flags
"$ctl" demo --json --pool-mib 128 --requests 6 --pages 8 --chunks 3 ${DEMO_ARGS:-} >"$out" 2>"$TEST_TMPDIR/demo.err" || {
  echo "demo exited with $?"; cat "$TEST_TMPDIR/demo.err" "$out"; exit 1; }
last=$(tail -n 1 "$out")
echo "UCX_TLS=${UCX_TLS:-default}: $last"
case "$last" in
  *'"verified": true'*) ;;
  *) echo "demo did not verify its bytes"; cat "$TEST_TMPDIR/demo.err"; exit 1 ;;
esac
case "$last" in
  *'"pages": 48'*) ;;
  *) echo "expected 48 pages moved (6 requests x 8 pages)"; exit 1 ;;
esac
if [[ -n "${EXPECT_DATA_PATH:-}" && "$last" != *"\"data_path\": \"$EXPECT_DATA_PATH\""* ]]; then
  echo "expected data path $EXPECT_DATA_PATH"; exit 1
fi
if [[ -n "${EXPECT_TRANSPORTS:-}" && "$last" != *"\"transports\": \"$EXPECT_TRANSPORTS\""* ]]; then
  echo "expected transports $EXPECT_TRANSPORTS"; exit 1
fi

#!/usr/bin/env bash
# Runs `kvagentctl demo --json` end to end (two real kvagentd processes) and checks
# that its last line reports every byte verified. UCX_TLS from the test's env
# selects the transports (shared memory by default, tcp,self as between hosts);
# DEMO_ARGS adds flags (e.g. --model hybrid), EXPECT_* name what the line must say.
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
expect_pages="${EXPECT_PAGES:-48}"
if [[ "$last" != *"\"pages\": $expect_pages,"* ]]; then
  echo "expected $expect_pages pages moved (6 requests x 8 pages)"; exit 1
fi
if [[ -n "${EXPECT_MODEL:-}" && "$last" != *"\"model\": \"$EXPECT_MODEL\""* ]]; then
  echo "expected model $EXPECT_MODEL"; exit 1
fi
# Byte counts the line must report, e.g. "state_bytes": 6 requests x 8 SSM layers x
# (conv 32256 + ssm 2621440) = 127377408 and "aux_bytes": 6 x 64 = 384.
for key in STATE_BYTES AUX_BYTES; do
  want="EXPECT_$key"
  if [[ -n "${!want:-}" ]]; then
    name=$(echo "$key" | tr '[:upper:]' '[:lower:]')
    if [[ "$last" != *"\"$name\": ${!want},"* ]]; then
      echo "expected \"$name\": ${!want}"; exit 1
    fi
  fi
done
if [[ -n "${EXPECT_DATA_PATH:-}" && "$last" != *"\"data_path\": \"$EXPECT_DATA_PATH\""* ]]; then
  echo "expected data path $EXPECT_DATA_PATH"; exit 1
fi
if [[ -n "${EXPECT_TRANSPORTS:-}" && "$last" != *"\"transports\": \"$EXPECT_TRANSPORTS\""* ]]; then
  echo "expected transports $EXPECT_TRANSPORTS"; exit 1
fi
# The demo submits through the local fast path unless told otherwise.
expect_submit="${EXPECT_SUBMIT:-fast}"
if [[ "$last" != *"\"submit\": \"$expect_submit\""* ]]; then
  echo "expected submission through $expect_submit"; exit 1
fi

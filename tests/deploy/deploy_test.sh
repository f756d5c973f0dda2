#!/bin/bash
# deploy/: the systemd unit passes `systemd-analyze verify` (with ExecStart pointed at
# the kvagentd just built, and every flag it passes known to that kvagentd), its flag
# file is accepted by that kvagentd, and the Kubernetes manifests hold what kvagentd
# needs (tests/deploy/check_manifests.py).
set -euo pipefail
root="${TEST_SRCDIR}/kvagent"
kvagentd="$root/agent/kvagentd"
tmp="${TEST_TMPDIR:-/tmp}"
"$kvagentd" --help >"$tmp/help.txt"

unit="$root/deploy/systemd/kvagentd.service"
# The unit's flags exist (continuation lines of ExecStart included).
for flag in $(sed -n '/^ExecStart=/,/[^\\]$/p' "$unit" | grep -o -- '--[a-z-]*' | sort -u); do
  grep -qE "^\s+$flag\b" "$tmp/help.txt" || { echo "FAIL: $flag (the unit's ExecStart) is not in kvagentd --help"; exit 1; }
done
# The unit's flag file: kvagentd accepts it as shipped, and every flag its comments
# offer parses (--only_check_args: names and values, not user names or addresses).
flagfile="$root/deploy/systemd/kvagentd.flags"
grep -q -- "--flagfile /etc/kvagent/kvagentd.flags" "$unit"
"$kvagentd" --flagfile="$flagfile" --check-flags >/dev/null
sed 's/^#--/--/' "$flagfile" >"$tmp/every.flags"
[ "$(grep -c '^--' "$tmp/every.flags")" -gt "$(grep -c '^--' "$flagfile")" ]
"$kvagentd" --flagfile="$tmp/every.flags" --only_check_args
grep -q '^AmbientCapabilities=CAP_IPC_LOCK$' "$unit"
grep -q '^LimitMEMLOCK=infinity$' "$unit"
grep -q '^RuntimeDirectory=kvagent$' "$unit"
grep -q '^User=kvagent$' "$unit"
grep -q '^ReadWritePaths=/dev/shm$' "$unit"
if command -v systemd-analyze >/dev/null; then
  sed "s#/usr/bin/kvagentd#$kvagentd#" "$unit" >"$tmp/kvagentd.service"
  # verify prints problems and exits non-zero on errors.
  if ! out=$(systemd-analyze verify "$tmp/kvagentd.service" 2>&1) || [ -n "$out" ]; then
    echo "FAIL: systemd-analyze verify deploy/systemd/kvagentd.service:"; echo "$out"; exit 1
  fi
  echo "systemd-analyze verify: clean"
else
  echo "SKIPPED systemd-analyze verify: systemd-analyze is not installed (apt-get install systemd)"
fi

/usr/bin/python3 "$root/tests/deploy/check_manifests.py" "$root/deploy/kubernetes" "$tmp/help.txt"

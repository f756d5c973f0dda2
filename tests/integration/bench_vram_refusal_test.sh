#!/usr/bin/env bash
# `kvagentctl bench --memory vram` on a machine without a GPU (or without the CUDA
# driver) must fail at once, before any agent starts: exit code non-zero, a message
# naming --memory vram and the CUDA driver, and no kvagentd left running.
set -euo pipefail
ctl="$TEST_SRCDIR/kvagent/cli/kvagentctl"
if ls /dev/nvidia0 >/dev/null 2>&1; then
  echo "SKIPPED: this host has a GPU (/dev/nvidia0); tests/gpu/run.sh runs the VRAM bench there"
  exit 0
fi
err="$TEST_TMPDIR/bench_vram.err"
start=$(date +%s%N)
# Its own session, so anything it started would still be found after it exits.
rc=0
setsid "$ctl" bench --memory vram --quick --pool-mib 16 --kvagentd "$TEST_SRCDIR/kvagent/agent/kvagentd" \
  >"$TEST_TMPDIR/bench_vram.out" 2>"$err" &
sid=$!
wait "$sid" || rc=$?
ms=$(( ($(date +%s%N) - start) / 1000000 ))
cat "$err"
bad=0
if [[ $rc -eq 0 ]]; then echo "FAIL: bench --memory vram exited 0 on a host without a GPU"; bad=1; fi
if ! grep -q -- "--memory vram" "$err"; then echo "FAIL: the message does not name --memory vram"; bad=1; fi
if ! grep -q "libcuda.so.1\|CUDA" "$err"; then echo "FAIL: the message does not name the CUDA driver"; bad=1; fi
if [[ $ms -gt 5000 ]]; then echo "FAIL: took $ms ms; it must fail before starting agents"; bad=1; fi
left=$(ps -o pid=,comm= -s "$sid" || true)
if [[ -n "$left" ]]; then echo "FAIL: processes left running: $left"; bad=1; fi
echo "exit $rc after $ms ms"
exit $bad

#!/usr/bin/env bash
# Runs `kvagentctl bench --quick --json` with a small pool (two real kvagentd) and
# checks that every cell printed one JSON line with gbps > 0 and verified bytes.
# Figures are not judged here (speed targets live in docs/BENCHMARKS.md).
set -euo pipefail
ctl="$TEST_SRCDIR/kvagent/cli/kvagentctl"
out="$TEST_TMPDIR/bench.out"
err="$TEST_TMPDIR/bench.err"
start=$(date +%s)
"$ctl" bench --quick --json --pool-mib 64 >"$out" 2>"$err" || {
  echo "bench exited with $?"; cat "$err" "$out"; exit 1; }
echo "bench took $(( $(date +%s) - start )) s"
cat "$out"
# 3 block sizes x 2 batches x WRITE/READ x contiguous/scattered.
lines=$(grep -c '^{"kind": "cell"' "$out" || true)
if [[ "$lines" != 24 ]]; then
  echo "expected 24 JSON lines, got $lines"; cat "$err"; exit 1
fi
bad=0
while IFS= read -r line; do
  gbps=$(sed -n 's/.*"gbps": \([0-9.eE+-]*\),.*/\1/p' <<<"$line")
  if [[ -z "$gbps" ]] || ! awk -v g="$gbps" 'BEGIN { exit !(g > 0) }'; then
    echo "no gbps > 0 in: $line"; bad=1
  fi
  if [[ "$line" != *'"verified": true'* ]]; then
    echo "bytes not verified in: $line"; bad=1
  fi
  for key in op pattern block_bytes batch transfers transfers_per_s avg_us p50_us p99_us \
             notify_p50_us notify_p99_us perftest_gbps memcpy_gbps ratio_perftest \
             ratio_memcpy gbps_inflight4 ratio_perftest_inflight4 ratio_memcpy_inflight4 \
             data_path; do
    if [[ "$line" != *"\"$key\": "* ]]; then echo "key $key missing in: $line"; bad=1; fi
  done
  # Contiguous indices coalesce into one operation; a scattered batch cannot.
  batch=$(sed -n 's/.*"batch": \([0-9]*\),.*/\1/p' <<<"$line")
  runs=$(sed -n 's/.*"runs": \([0-9]*\),.*/\1/p' <<<"$line")
  if [[ "$line" == *'"pattern": "contiguous"'* && "$runs" != 1 ]]; then
    echo "contiguous cell did not coalesce into 1 operation: $line"; bad=1
  fi
  if [[ "$line" == *'"pattern": "scattered"'* && "$runs" != "$batch" ]]; then
    echo "scattered cell should stay $batch operations: $line"; bad=1
  fi
  if [[ "$line" == *'"op": "WRITE"'* && "$line" == *'"notify_p50_us": null'* ]]; then
    echo "WRITE cell without notification latency: $line"; bad=1
  fi
done < <(grep '^{"kind": "cell"' "$out")
# The rate phase: 4 client shapes, each with transfers done and every notification seen.
rates=$(grep -c '^{"kind": "rate"' "$out" || true)
if [[ "$rates" != 4 ]]; then
  echo "expected 4 rate lines, got $rates"; cat "$err"; exit 1
fi
while IFS= read -r line; do
  n=$(sed -n 's/.*"transfers": \([0-9]*\),.*/\1/p' <<<"$line")
  seen=$(sed -n 's/.*"notifications": \([0-9]*\),.*/\1/p' <<<"$line")
  if [[ -z "$n" || "$n" == 0 || "$n" != "$seen" ]]; then
    echo "rate line without transfers, or notifications != transfers: $line"; bad=1
  fi
done < <(grep '^{"kind": "rate"' "$out")
# The memory check: one line with both agents' figures after its transfers.
memory=$(grep -c '^{"kind": "memory"' "$out" || true)
if [[ "$memory" != 1 ]]; then
  echo "expected 1 memory line, got $memory"; cat "$err"; exit 1
fi
exit "$bad"

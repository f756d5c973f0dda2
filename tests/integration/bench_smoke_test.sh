#!/usr/bin/env bash
# Runs `kvagentctl bench --quick --json` with a small pool (two real kvagentd) and
# checks that every cell printed one JSON line with gbps > 0 and verified bytes, for the
# gRPC column and the fast path's, that issue 14's cells carry their paired rounds'
# ratios and the sweep ends with the targets block, and that the fast path phase
# (latency, rate, idle CPU, issue 15's targets) printed its lines, each for both
# completion points (complete_when: acknowledged, the default, and PLACED), with the
# agents kept on one CPU (--agent-cpus: every thread; --worker-cpus: the progress
# thread) and reported there.
# Figures are not judged here (speed targets live in docs/BENCHMARKS.md).
set -euo pipefail
ctl="$TEST_SRCDIR/kvagent/cli/kvagentctl"
out="$TEST_TMPDIR/bench.out"
err="$TEST_TMPDIR/bench.err"
start=$(date +%s)
# Both agents on this process's last CPU, every thread of theirs (--agent-cpus) and so
# their UCX progress threads (--worker-cpus): every phase runs with them there, and the
# fast path phase reports where they ran.
last_cpu=$(python3 -c 'import os; print(max(os.sched_getaffinity(0)))')
# A CPU list the bench cannot apply is refused before any agent starts (usage, exit 2),
# naming the flag and the CPUs there are.
for bad_list in "99999" "1-0" "x" ""; do
  rc=0
  "$ctl" bench --quick --agent-cpus "$bad_list" >"$out" 2>"$err" || rc=$?
  if [[ "$rc" != 2 ]] || ! grep -q -- "--agent-cpus" "$err"; then
    echo "--agent-cpus '$bad_list': expected exit 2 naming the flag, got $rc:"; cat "$err"; exit 1
  fi
done
# So is a completion count per wake-up outside 1..64, naming the flag and the range.
for bad_batch in 0 65 x; do
  rc=0
  "$ctl" bench --quick --fast-reap-batch "$bad_batch" >"$out" 2>"$err" || rc=$?
  if [[ "$rc" != 2 ]] || ! grep -q -- "--fast-reap-batch" "$err"; then
    echo "--fast-reap-batch '$bad_batch': expected exit 2 naming the flag, got $rc:"; cat "$err"; exit 1
  fi
done
rc=0
"$ctl" bench --quick --agent-cpus "$last_cpu" --initiator unix:/nonexistent --target unix:/nonexistent \
  >"$out" 2>"$err" || rc=$?
if [[ "$rc" != 2 ]] || ! grep -q "taskset" "$err"; then
  echo "--agent-cpus with --initiator: expected exit 2 saying to use taskset, got $rc:"; cat "$err"; exit 1
fi
"$ctl" bench --quick --json --pool-mib 64 --agent-cpus "$last_cpu" --worker-cpus "$last_cpu" \
  >"$out" 2>"$err" || {
  echo "bench exited with $?"; cat "$err" "$out"; exit 1; }
echo "bench took $(( $(date +%s) - start )) s"
cat "$out"
# 3 block sizes x 2 batches x WRITE/READ x contiguous/scattered.
lines=$(grep -c '^{"kind": "cell"' "$out" || true)
if [[ "$lines" != 24 ]]; then
  echo "expected 24 JSON lines, got $lines"; cat "$err"; exit 1
fi
# Each layout's pages warmed in the agents' mappings before it is timed: the 3 block
# sizes and the rate phase's 4 KiB layout, each 64 MiB = 16,384 pages of a pool.
warm=$(grep -c '^{"kind": "warmup", "block_bytes": [0-9]*, "pages_per_pool": 16384, "transfers": [1-9]' "$out" || true)
if [[ "$warm" != 4 ]]; then
  echo "expected 4 warmup lines (16,384 pages each), got $warm"; exit 1
fi
bad=0
# A positive, finite number (fmt writes inf and nan as letters: no match).
positive() { [[ "$1" =~ ^[0-9.eE+-]+$ ]] && awk -v g="$1" 'BEGIN { exit !(g > 0 && g < 1e300) }'; }
while IFS= read -r line; do
  gbps=$(sed -n 's/.*"gbps": \([0-9.eE+-]*\),.*/\1/p' <<<"$line")
  if [[ -z "$gbps" ]] || ! awk -v g="$gbps" 'BEGIN { exit !(g > 0) }'; then
    echo "no gbps > 0 in: $line"; bad=1
  fi
  if [[ "$line" != *'"verified": true'* ]]; then
    echo "bytes not verified in: $line"; bad=1
  fi
  # The fast column: the same cell through the fast path ring.
  fast=$(sed -n 's/.*"fast_gbps": \([0-9.eE+-]*\),.*/\1/p' <<<"$line")
  if [[ -z "$fast" ]] || ! awk -v g="$fast" 'BEGIN { exit !(g > 0) }'; then
    echo "no fast_gbps > 0 in: $line"; bad=1
  fi
  if [[ "$line" != *'"fast_verified": true'* ]]; then
    echo "fast path bytes not verified in: $line"; bad=1
  fi
  for key in op pattern block_bytes batch transfers transfers_per_s avg_us p50_us p99_us \
             notify_p50_us notify_p99_us perftest_gbps memcpy_gbps ratio_perftest \
             ratio_memcpy gbps_inflight4 ratio_perftest_inflight4 ratio_memcpy_inflight4 \
             data_path fast_gbps fast_p50_us fast_p99_us ratio_perftest_fast ratio_memcpy_fast \
             fast_gbps_inflight4 ratio_perftest_fast_inflight4 ratio_memcpy_fast_inflight4; do
    if [[ "$line" != *"\"$key\": "* ]]; then echo "key $key missing in: $line"; bad=1; fi
  done
  # Issue 14's cells (from 64K x 16 up; here 64K x 64 and 1M x 64) carry their paired
  # rounds' ratios, the others null.
  block=$(sed -n 's/.*"block_bytes": \([0-9]*\),.*/\1/p' <<<"$line")
  batch=$(sed -n 's/.*"batch": \([0-9]*\),.*/\1/p' <<<"$line")
  rounds=$(sed -n 's/.*"paired_rounds": \([0-9]*\),.*/\1/p' <<<"$line")
  if (( block >= 65536 && batch >= 16 )); then
    if [[ -z "$rounds" ]] || (( rounds < 5 )); then
      echo "an issue 14 cell without 5+ paired rounds: $line"; bad=1
    fi
    for key in paired_memcpy_p50_us paired_contiguous_p50_us paired_scattered_p50_us \
               paired_fast_over_memcpy paired_fast_over_memcpy_q1 paired_fast_over_memcpy_q3 \
               paired_scattered_over_contiguous paired_scattered_over_contiguous_q1 \
               paired_scattered_over_contiguous_q3 paired_memcpy_scattered_p50_us \
               paired_memcpy_scattered_over_contiguous \
               paired_memcpy_scattered_over_contiguous_q1 \
               paired_memcpy_scattered_over_contiguous_q3; do
      v=$(sed -n "s/.*\"$key\": \([^,}]*\).*/\1/p" <<<"$line")
      if ! positive "$v"; then echo "$key is not a positive finite number in: $line"; bad=1; fi
    done
    # Each round also timed the contiguous transfer completing when placed (these
    # agents have complete_when), and the contiguous transfers' timelines were read:
    # where their time went.
    placed=$(sed -n 's/.*"paired_placed_rounds": \([0-9]*\),.*/\1/p' <<<"$line")
    if [[ "$placed" != "$rounds" ]]; then
      echo "paired_placed_rounds '$placed' is not the $rounds rounds in: $line"; bad=1
    fi
    for key in paired_placed_p50_us paired_placed_over_memcpy; do
      v=$(sed -n "s/.*\"$key\": \([^,}]*\).*/\1/p" <<<"$line")
      if ! positive "$v"; then echo "$key is not a positive finite number in: $line"; bad=1; fi
    done
    # The contiguous and the scattered transfers' timelines were read: where their
    # time went.
    for kind in "" scattered_; do
      timelines=$(sed -n "s/.*\"paired_${kind}timelines\": \([0-9]*\),.*/\1/p" <<<"$line")
      if [[ -z "$timelines" ]] || (( timelines < 1 || timelines > rounds )); then
        echo "paired_${kind}timelines '$timelines' not within 1..$rounds in: $line"; bad=1
      fi
      for key in agent_p50_us copy_p50_us receiver_p50_us; do
        v=$(sed -n "s/.*\"paired_$kind$key\": \([^,}]*\).*/\1/p" <<<"$line")
        if ! positive "$v"; then
          echo "paired_$kind$key is not a positive finite number in: $line"; bad=1
        fi
      done
      for key in before_copy_p50_us ring_p50_us; do
        v=$(sed -n "s/.*\"paired_$kind$key\": \([^,}]*\).*/\1/p" <<<"$line")
        if [[ ! "$v" =~ ^[0-9.]+$ ]]; then echo "paired_$kind$key is not a number in: $line"; bad=1; fi
      done
    done
  elif [[ "$rounds" != 0 || "$line" != *'"paired_fast_over_memcpy": null'* ]]; then
    echo "a cell outside issue 14's targets with paired figures: $line"; bad=1
  fi
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
# The sweep's targets block (issue 14): per target, one line per paired cell (64K x 64
# and 1M x 64, WRITE and READ: 4) with a positive finite ratio and its quartiles, and a
# summary with the cells met and the load average.
for target in fast_over_memcpy scattered_over_contiguous fast_placed_over_memcpy; do
  summary=$(grep "^{\"kind\": \"targets\", \"issue\": 14, \"target\": \"$target\"" "$out" || true)
  if [[ "$summary" != *'"cells": 4, "met": '[0-4]','* || "$summary" != *'"loadavg_1m": '[0-9]* ]]; then
    echo "no targets summary for $target over 4 cells with a load average: '$summary'"; bad=1
  fi
  n=0
  while IFS= read -r line; do
    n=$((n + 1))
    for key in ratio q1 q3; do
      v=$(sed -n "s/.*\"$key\": \([^,}]*\).*/\1/p" <<<"$line")
      if ! positive "$v"; then echo "$key is not a positive finite number in: $line"; bad=1; fi
    done
    if [[ "$line" != *'"met": true'* && "$line" != *'"met": false'* ]]; then
      echo "no verdict in: $line"; bad=1
    fi
    # The scattered target shows the memcpy's own scattered/contiguous beside it.
    v=$(sed -n 's/.*"memcpy_ratio": \([^,}]*\).*/\1/p' <<<"$line")
    if [[ "$target" == scattered_over_contiguous ]]; then
      if ! positive "$v"; then echo "memcpy_ratio is not a positive finite number in: $line"; bad=1; fi
    elif [[ "$v" != null ]]; then
      echo "memcpy_ratio should be null for $target in: $line"; bad=1
    fi
  done < <(grep "^{\"kind\": \"target\", \"issue\": 14, \"target\": \"$target\"" "$out")
  if [[ "$n" != 4 ]]; then echo "expected 4 $target target lines, got $n"; bad=1; fi
done
# The rate phase: 4 client shapes through gRPC, then the fast path phase's 1 and 2
# clients; each with transfers done and every notification seen.
rates=$(grep -c '^{"kind": "rate"' "$out" || true)
if [[ "$rates" != 4 ]]; then
  echo "expected 4 rate lines, got $rates"; cat "$err"; exit 1
fi
# The fast rate lines: 1 and 2 clients completing when acknowledged (kind fast_rate)
# and when placed (kind fast_rate_placed), each naming its completion point.
fast_rates=$(grep -c '^{"kind": "fast_rate", "complete_when": "acknowledged"' "$out" || true)
if [[ "$fast_rates" != 2 ]]; then
  echo "expected 2 fast_rate lines completing when acknowledged, got $fast_rates"; bad=1
fi
placed_rates=$(grep -c '^{"kind": "fast_rate_placed", "complete_when": "placed"' "$out" || true)
if [[ "$placed_rates" != 2 ]]; then
  echo "expected 2 fast_rate_placed lines (complete_when PLACED), got $placed_rates"; bad=1
fi
while IFS= read -r line; do
  n=$(sed -n 's/.*"transfers": \([0-9]*\),.*/\1/p' <<<"$line")
  seen=$(sed -n 's/.*"notifications": \([0-9]*\),.*/\1/p' <<<"$line")
  if [[ -z "$n" || "$n" == 0 || "$n" != "$seen" ]]; then
    echo "rate line without transfers, or notifications != transfers: $line"; bad=1
  fi
done < <(grep -E '^\{"kind": "(rate|fast_rate|fast_rate_placed)"' "$out")
# Placed: the bench counted every notification at the target before it printed the line
# (it fails itself, exit != 0 above, when one is missing), the initiator's
# AgentStatus says each of these transfers completed when placed, and the target took
# every notification (placed_not_taken 0). The acknowledged lines complete none placed.
while IFS= read -r line; do
  n=$(sed -n 's/.*"transfers": \([0-9]*\),.*/\1/p' <<<"$line")
  placed=$(sed -n 's/.*"completed_when_placed": \([0-9]*\),.*/\1/p' <<<"$line")
  not_taken=$(sed -n 's/.*"placed_not_taken": \([0-9]*\),.*/\1/p' <<<"$line")
  if [[ -z "$placed" || -z "$not_taken" || "$not_taken" != 0 ]]; then
    echo "fast rate line without completed_when_placed, or with notifications not taken: $line"
    bad=1
  elif [[ "$line" == *'"complete_when": "placed"'* ]] && (( placed < n )); then
    echo "placed rate line: $placed of $n transfers completed when placed: $line"; bad=1
  elif [[ "$line" == *'"complete_when": "acknowledged"'* && "$placed" != 0 ]]; then
    echo "acknowledged rate line with transfers completed when placed: $line"; bad=1
  fi
done < <(grep -E '^\{"kind": "(fast_rate|fast_rate_placed)"' "$out")
# Where each fast rate transfer's CPU went: both agents (started here) and the bench's
# own client and notification taker, positive, and their sum with the rate it bounds.
while IFS= read -r line; do
  for f in initiator_cpu_us_per_transfer target_cpu_us_per_transfer client_cpu_us_per_transfer \
           notification_taker_cpu_us_per_transfer total_cpu_us_per_transfer \
           cpu_bound_transfers_per_s; do
    v=$(sed -n "s/.*\"$f\": \([0-9.]*\)[,}].*/\1/p" <<<"$line")
    if [[ -z "$v" ]] || ! awk -v v="$v" 'BEGIN { exit !(v > 0) }'; then
      echo "fast rate line without a positive $f: $line"; bad=1
    fi
  done
  sum=$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(abs(r["initiator_cpu_us_per_transfer"] + r["target_cpu_us_per_transfer"] + r["client_cpu_us_per_transfer"] + r["notification_taker_cpu_us_per_transfer"] - r["total_cpu_us_per_transfer"]) < 0.5)' "$line")
  if [[ "$sum" != True ]]; then
    echo "fast rate line: total_cpu_us_per_transfer is not the sum of its four parts: $line"; bad=1
  fi
done < <(grep -E '^\{"kind": "(fast_rate|fast_rate_placed)"' "$out")
# The clients wait for 16 completions per wake-up, and this build's agent rings their
# doorbell once the 16 have come: about one sleep per 16 transfers (an agent that rang
# at the first completion gave 0.23-0.37 here).
while IFS= read -r line; do
  if ! python3 -c 'import json,sys; r=json.loads(sys.argv[1]); sys.exit(0 if r["reap_batch"] == 16 and r["client_sleeps_per_transfer"] <= 0.12 else 1)' "$line"; then
    echo "fast rate line without reap_batch 16, or with more than 0.12 client sleeps per transfer: $line"; bad=1
  fi
done < <(grep -E '^\{"kind": "(fast_rate|fast_rate_placed)"' "$out")
# Each agent's sleeps per transfer (its threads' voluntary context switches over the
# run): present for agents started here, and below one: the rings, the notice batches
# and the counted completion doorbell put many transfers behind each wake-up (here the
# agents sleep 0.000-0.04 times per transfer), so one or more would mean a wake-up per
# transfer came back.
while IFS= read -r line; do
  if ! python3 -c 'import json,sys; r=json.loads(sys.argv[1]); v=[r["initiator_wakeups_per_transfer"], r["target_wakeups_per_transfer"]]; sys.exit(0 if all(isinstance(x, float) and 0 <= x < 1 for x in v) else 1)' "$line"; then
    echo "fast rate line without both agents' wake-ups per transfer, or with one or more per transfer: $line"; bad=1
  fi
done < <(grep -E '^\{"kind": "(fast_rate|fast_rate_placed)"' "$out")
# The rate targets set that CPU beside what 200,000 /s would allow on this host.
while IFS= read -r line; do
  if ! python3 -c 'import json,os,sys; r=json.loads(sys.argv[1]); c=r["total_cpu_us_per_transfer"]; b=r["cpu_us_per_transfer_for_target"]; sys.exit(0 if c > 0 and abs(b - os.cpu_count() * 5.0) < 0.05 else 1)' "$line"; then
    echo "fast_targets line without the CPU per transfer, or a budget other than 5 us per CPU: $line"; bad=1
  fi
done < <(grep -E '^\{"kind": "fast_targets".*"measured": true' "$out")
# This build's target delivers notifications on the ring: the fast rate part drains
# them there (the pool owner's session), not by gRPC.
ring_drains=$(grep -cE '^\{"kind": "(fast_rate|fast_rate_placed)".*"drain": "ring"' "$out" || true)
if [[ "$ring_drains" != 4 ]]; then
  echo "expected 4 fast rate lines drained on the target's ring, got $ring_drains"; bad=1
fi
# The fast path phase's latency: gRPC, fast (with and without notification, and until
# the target's ring, or a gRPC stream of it, holds the notification) and ring pings (back to back, and after an
# idle pause), with the load average; and both agents' idle CPU with a ring open.
for path in grpc fast fast_ring_notification fast_grpc_notification fast_no_notification \
            fast_placed fast_placed_ring_notification fast_placed_no_notification fast_ping \
            fast_ping_idle; do
  line=$(grep "^{\"kind\": \"fast_latency\", \"path\": \"$path\"" "$out" || true)
  p50=$(sed -n 's/.*"p50_us": \([0-9.eE+-]*\),.*/\1/p' <<<"$line")
  if [[ -z "$p50" ]] || ! awk -v g="$p50" 'BEGIN { exit !(g > 0) }'; then
    echo "no fast_latency line for $path with p50_us > 0: '$line'"; bad=1
  fi
  if [[ "$line" != *'"loadavg_1m": '[0-9]* ]]; then echo "no load average in: '$line'"; bad=1; fi
done
# A lone notified transfer's active messages and stages, for each completion point;
# placed: the peer's acknowledgements recorded after COMPLETED in the sample, no notes.
for point in acknowledged placed; do
  line=$(grep "^{\"kind\": \"fast_lone_transfer\", \"complete_when\": \"$point\"" "$out" || true)
  if [[ "$line" != *'"active_messages_per_transfer": '[0-9]* ]]; then
    echo "no fast_lone_transfer line for $point: '$line'"; bad=1
  fi
done
lone=$(grep '^{"kind": "fast_lone_transfer", "complete_when": "placed"' "$out" || true)
sampled=$(sed -n 's/.*"sampled": \([0-9]*\),.*/\1/p' <<<"$lone")
acked=$(sed -n 's/.*"peer_acknowledged": \([0-9]*\),.*/\1/p' <<<"$lone")
if [[ -z "$sampled" || "$sampled" == 0 || -z "$acked" || "$acked" == 0 || \
      "$lone" != *'"peer_notes": 0}'* ]]; then
  echo "placed lone transfers: none sampled, none acknowledged by the peer, or a peer note: '$lone'"
  bad=1
fi
# Issue 15's targets: one line per completion point, with the figures and verdicts.
for point in acknowledged placed; do
  line=$(grep "^{\"kind\": \"fast_targets\", \"issue\": 15, \"complete_when\": \"$point\", \"measured\": true" "$out" || true)
  for key in p50_us p99_us transfers_per_s transfers_per_s_2_clients; do
    v=$(sed -n "s/.*\"$key\": \([^,}]*\).*/\1/p" <<<"$line")
    if ! positive "$v"; then echo "$key is not a positive finite number in: '$line'"; bad=1; fi
  done
  for key in p50_met p99_met rate_met; do
    if [[ "$line" != *"\"$key\": true"* && "$line" != *"\"$key\": false"* ]]; then
      echo "no $key verdict in: '$line'"; bad=1
    fi
  done
  if [[ "$line" != *'"loadavg_1m": '[0-9]* ]]; then echo "no load average in: '$line'"; bad=1; fi
done
# Where the agents' progress threads may run, as the agents report it (GetStatus), and
# their processes, as the kernel reports it.
cpus_line=$(grep '^{"kind": "fast_cpus"' "$out" || true)
if [[ "$cpus_line" != *"\"initiator_worker_cpus\": \"$last_cpu\", \"target_worker_cpus\": \"$last_cpu\""* ]]; then
  echo "fast_cpus line does not show both progress threads on CPU $last_cpu: '$cpus_line'"; bad=1
fi
if [[ "$cpus_line" != *"\"initiator_cpus\": \"$last_cpu\", \"target_cpus\": \"$last_cpu\""* ]]; then
  echo "fast_cpus line does not show both agents' processes on CPU $last_cpu: '$cpus_line'"; bad=1
fi
idle=$(grep -c '^{"kind": "fast_idle".*"cpu_percent_ring_open": [0-9]' "$out" || true)
if [[ "$idle" != 2 ]]; then
  echo "expected 2 fast_idle lines (initiator, target), got $idle"; bad=1
fi
# The memory check: one line with both agents' figures after its transfers.
memory=$(grep -c '^{"kind": "memory"' "$out" || true)
if [[ "$memory" != 1 ]]; then
  echo "expected 1 memory line, got $memory"; cat "$err"; exit 1
fi
exit "$bad"

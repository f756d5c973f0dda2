#!/usr/bin/env bash
# `kvagentctl bench --memory vram` against the stand-in CUDA driver (two real kvagentd,
# pools in "VRAM" by CUDA IPC handle): direct (device copy) and through host staging
# (--shm-direct off). Every cell must print its JSON line with gbps > 0 and its bytes
# verified, on the gRPC and the fast path columns, so a GPU session's bench run is
# known to work before the GPU is lent. Figures are the stand-in's, not judged.
set -euo pipefail
ctl="$TEST_SRCDIR/kvagent/cli/kvagentctl"
if [[ "$KVAGENT_CUDA_DRIVER" != /* ]]; then export KVAGENT_CUDA_DRIVER="$PWD/$KVAGENT_CUDA_DRIVER"; fi
fail=0
for args in "" "--shm-direct off"; do
  out="$TEST_TMPDIR/bench${args// /}.out"
  # shellcheck disable=SC2086 # $args is a list of flags
  "$ctl" bench --memory vram --json --cells 64K:16,1M:16 --pool-mib 64 $args >"$out" 2>"$TEST_TMPDIR/err" || {
    echo "bench --memory vram $args exited with $?"; cat "$TEST_TMPDIR/err" "$out"; exit 1; }
  cells=$(grep -c '^{"kind": "cell"' "$out" || true)
  echo "bench --memory vram $args: $cells cells"
  [[ "$cells" == 8 ]] || { echo "FAIL: expected 8 cells"; cat "$out"; fail=1; }
  while IFS= read -r line; do
    for key in verified fast_verified; do
      [[ "$line" == *"\"$key\": true"* ]] || { echo "FAIL: $key not true in: $line"; fail=1; }
    done
    for key in gbps fast_gbps; do
      value=$(sed -n "s/.*\"$key\": \\([0-9.eE+-]*\\),.*/\\1/p" <<<"$line")
      awk -v g="${value:-0}" 'BEGIN { exit !(g > 0) }' || { echo "FAIL: $key not > 0 in: $line"; fail=1; }
    done
    want="shm-direct"; [[ -n "$args" ]] && want="ucx"
    [[ "$line" == *"\"data_path\": \"$want\""* ]] || { echo "FAIL: data_path not $want in: $line"; fail=1; }
  done < <(grep '^{"kind": "cell"' "$out")
done
exit $fail

#!/usr/bin/env bash
# `kvagentctl demo --memory vram --json`. Where the NVIDIA driver is installed it must
# verify every byte. Where it is not (CI, laptops), failing is the expected behaviour,
# so this test checks that failure rather than skipping: exit non-zero at once,
# before any agent starts, with CudaDriver::Load's message naming libcuda.so.1.
set -uo pipefail
ctl="$TEST_SRCDIR/kvagent/cli/kvagentctl"
out="$TEST_TMPDIR/vram.out"
err="$TEST_TMPDIR/vram.err"

# demo_vram_standin_test names the stand-in driver by its runfiles path.
if [[ -n "${KVAGENT_CUDA_DRIVER:-}" && "$KVAGENT_CUDA_DRIVER" != /* ]]; then
  export KVAGENT_CUDA_DRIVER="$PWD/$KVAGENT_CUDA_DRIVER"
fi
driver=""
for lib in "${KVAGENT_CUDA_DRIVER:-}" /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1 \
    /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/wsl/lib/libcuda.so.1; do
  if [[ -n "$lib" && -e "$lib" ]]; then driver="$lib"; break; fi
done

"$ctl" demo --json --memory vram --pool-mib 64 --requests 4 --pages 8 >"$out" 2>"$err"
rc=$?
echo "exit $rc; stdout:"; cat "$out"; echo "stderr:"; cat "$err"
last=$(tail -n 1 "$out")

if [[ -n "$driver" ]]; then
  echo "CUDA driver at $driver: the VRAM demo must verify"
  [[ $rc -eq 0 && "$last" == *'"verified": true'* && "$last" == *'"memory": "vram"'* ]] || {
    echo "FAIL: expected a verified VRAM demo"; exit 1; }
  exit 0
fi

echo "no NVIDIA driver here: the VRAM demo must fail fast and say why"
fail=0
[[ $rc -ne 0 ]] || { echo "FAIL: exit status 0 without a driver"; fail=1; }
grep -q 'libcuda\.so\.1' "$err" || { echo "FAIL: stderr does not name libcuda.so.1"; fail=1; }
grep -q 'FAILED_PRECONDITION' "$err" || { echo "FAIL: stderr does not say FAILED_PRECONDITION"; fail=1; }
grep -q -- '--memory dram' "$err" || { echo "FAIL: stderr does not point at --memory dram"; fail=1; }
[[ "$last" == '{"verified": false,'* ]] || { echo "FAIL: last line is not the JSON failure"; fail=1; }
# Agents would have been started in $TEST_TMPDIR/demo.<pid> with their logs.
if compgen -G "$TEST_TMPDIR/demo.[0-9]*" >/dev/null; then
  echo "FAIL: agents were started before the driver was checked:"; ls -R "$TEST_TMPDIR"; fail=1
fi
if grep -q -- '----' "$err"; then echo "FAIL: agent logs were printed, so agents ran"; fail=1; fi
exit $fail

#!/usr/bin/env bash
# Builds and runs the GPU tests on a machine with an NVIDIA GPU and driver:
#   tests/gpu/run.sh            build with Bazel here, then run
#   tests/gpu/run.sh --bundle DIR   run a bundle made by make_bundle.sh (a GPU host
#                                   without Debian's packages: the bundle carries
#                                   its own loader and libraries): the *_test
#                                   binaries, then `kvagentctl demo` with VRAM pools
#                                   (llama, hybrid), the Llama VRAM demo once per
#                                   device copy mechanism (KVAGENT_DEVICE_COPY=batch,
#                                   kernel, per-page), the DRAM demo as a baseline,
#                                   `kvagentctl bench --memory vram --quick` (direct
#                                   and with --shm-direct off), and
#                                   one expected failure (VRAM with --shm-direct off);
#                                   exits with the number of failed tests and demos
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ "${1:-}" == "--bundle" ]]; then
  bundle=$(cd "$2" && pwd)
  export KVAGENTD="$bundle/bin/kvagentd.sh"
  export UCX_MODULE_DIR="$bundle/lib/ucx"
  export TEST_TMPDIR="${TEST_TMPDIR:-$(mktemp -d)}"
  # The bundle's libraries first; the host's directories after, for libcuda only.
  libpath="$bundle/lib:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:/usr/lib/x86_64-linux-gnu:/usr/lib64:/lib/x86_64-linux-gnu"
  sed -i "s|--library-path \"\$here/lib\"|--library-path \"$libpath\"|" "$bundle/bin/kvagentd.sh"
  run() { "$bundle/lib/ld-linux-x86-64.so.2" --library-path "$libpath" "$@"; }
  failures=0
  for t in "$bundle"/bin/*_test; do
    echo "== $(basename "$t")"
    run "$t" || failures=$((failures + 1))
  done
  # The demo with this process as the engine: pools in VRAM by CUDA IPC handle, every
  # byte verified through host copies; then the shared-memory demo as this host's
  # baseline. Each one must succeed.
  ctl="$bundle/bin/kvagentctl"
  for args in "--memory vram" "--memory vram --model hybrid" ""; do
    echo "== kvagentctl demo $args"
    # shellcheck disable=SC2086 # $args is a list of flags
    run "$ctl" demo $args || { echo "FAILED: kvagentctl demo $args"; failures=$((failures + 1)); }
  done
  # The Llama VRAM demo by each device copy mechanism (the agents inherit the variable;
  # a mechanism this driver lacks goes per page, and `peers`/doctor say why).
  # device_copy_test above printed one large cuMemcpy's GB/s to compare with.
  for mechanism in batch kernel per-page; do
    echo "== KVAGENT_DEVICE_COPY=$mechanism kvagentctl demo --memory vram"
    KVAGENT_DEVICE_COPY=$mechanism run "$ctl" demo --memory vram ||
      { echo "FAILED: demo --memory vram, $mechanism"; failures=$((failures + 1)); }
  done
  # The bench with VRAM pools: direct (CUDA IPC), then through host staging (WRITE as
  # staged chunks, READ as staged read requests). Every cell's bytes are verified.
  for args in "" "--shm-direct off"; do
    echo "== kvagentctl bench --memory vram --quick --pool-mib 256 $args"
    # shellcheck disable=SC2086 # $args is a list of flags
    run "$ctl" bench --memory vram --quick --pool-mib 256 --kvagentd "$KVAGENTD" $args ||
      { echo "FAILED: kvagentctl bench --memory vram $args"; failures=$((failures + 1)); }
  done
  # Expected to fail: with the direct copy off, VRAM must go through UCX, and this
  # UCX has no CUDA support; the agent must refuse with FAILED_PRECONDITION naming
  # VRAM and UCX. Its output is shown; its exit status is not counted.
  echo "== kvagentctl demo --memory vram --shm-direct off (expected to FAIL: VRAM through a UCX without CUDA; not counted)"
  expected_rc=0
  run "$ctl" demo --memory vram --shm-direct off 2>&1 || expected_rc=$?
  if [[ $expected_rc -eq 0 ]]; then
    echo "note: it succeeded (this UCX moves CUDA memory?); not counted either way"
  else
    echo "note: exit $expected_rc, the expected failure; not counted as a failure of run.sh"
  fi
  echo "== $failures failure(s) among the tests and the expected-good demos"
  exit $failures
fi

if ! ls /dev/nvidia0 >/dev/null 2>&1; then
  echo "tests/gpu/run.sh: no /dev/nvidia0 here; the GPU tests need an NVIDIA GPU and driver" >&2
  exit 2
fi
rc=0
bazel test --test_output=all --cache_test_results=no //tests/gpu:all || rc=$?
# The Llama VRAM demo by each device copy mechanism (device_copy_test printed one
# large cuMemcpy's GB/s on this GPU to compare with).
bazel build //cli:kvagentctl //agent:kvagentd
for mechanism in batch kernel per-page; do
  echo "== KVAGENT_DEVICE_COPY=$mechanism kvagentctl demo --memory vram"
  KVAGENT_DEVICE_COPY=$mechanism KVAGENTD=bazel-bin/agent/kvagentd \
    bazel-bin/cli/kvagentctl demo --memory vram || rc=1
done
# The bench with VRAM pools, direct and through host staging; bytes verified per cell.
bazel build //cli:kvagentctl //agent:kvagentd
for args in "" "--shm-direct off"; do
  echo "== kvagentctl bench --memory vram --quick --pool-mib 256 $args"
  # shellcheck disable=SC2086 # $args is a list of flags
  bazel-bin/cli/kvagentctl bench --memory vram --quick --pool-mib 256 \
    --kvagentd bazel-bin/agent/kvagentd $args || rc=1
done
exit $rc

#!/usr/bin/env bash
# Builds and runs the GPU tests on a machine with an NVIDIA GPU and driver:
#   tests/gpu/run.sh            build with Bazel here, then run
#   tests/gpu/run.sh --bundle DIR   run a bundle made by make_bundle.sh (a GPU host
#                                   without Debian's packages: the bundle carries
#                                   its own loader and libraries)
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
  status=0
  for t in "$bundle"/bin/*_test; do
    echo "== $(basename "$t")"
    "$bundle/lib/ld-linux-x86-64.so.2" --library-path "$libpath" "$t" || status=1
  done
  exit $status
fi

if ! ls /dev/nvidia0 >/dev/null 2>&1; then
  echo "tests/gpu/run.sh: no /dev/nvidia0 here; the GPU tests need an NVIDIA GPU and driver" >&2
  exit 2
fi
bazel test --test_output=all --cache_test_results=no //tests/gpu:all

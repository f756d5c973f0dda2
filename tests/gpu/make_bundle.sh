#!/usr/bin/env bash
# Packs kvagentd, kvagentctl (for `demo --memory vram`; it finds kvagentd through
# $KVAGENTD, which run.sh points at the wrapper) and the GPU tests with every shared
# library they load (glibc and its loader included) and UCX's modules into DIR, so
# they run on a GPU host that has an NVIDIA driver but not Debian 12's packages.
# Run tests/gpu/run.sh --bundle DIR there.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: make_bundle.sh DIR}
bazel build //agent:kvagentd //cli:kvagentctl //tests/gpu:vram_test //tests/gpu:vram_fault_test \
  //tests/gpu:device_copy_test >/dev/null
bin=$(bazel info bazel-bin 2>/dev/null)
rm -rf "$out" && mkdir -p "$out/bin" "$out/lib/ucx"
cp "$bin/agent/kvagentd" "$out/bin/"
cp "$bin/cli/kvagentctl" "$out/bin/"
cp "$bin/tests/gpu/vram_test" "$bin/tests/gpu/vram_fault_test" "$bin/tests/gpu/device_copy_test" "$out/bin/"
for exe in "$out"/bin/*; do
  ldd "$exe" | awk '/=>/ {print $3} /ld-linux/ {print $1}' | while read -r lib; do
    [[ -f "$lib" ]] && cp -nL "$lib" "$out/lib/" || true
  done
done
# The host's libcuda is loaded into our glibc: give it our libdl/libpthread/librt
# too, so no library of the host's older or newer glibc gets mixed in.
for lib in libdl.so.2 libpthread.so.0 librt.so.1 libm.so.6; do
  cp -nL "/lib/x86_64-linux-gnu/$lib" "$out/lib/"
done
cp -nL /usr/lib/x86_64-linux-gnu/ucx/*.so.0 "$out/lib/ucx/" 2>/dev/null || true
for mod in "$out"/lib/ucx/*.so.0; do
  ldd "$mod" | awk '/=>/ {print $3}' | while read -r lib; do
    [[ -f "$lib" ]] && cp -nL "$lib" "$out/lib/" || true
  done
done
# kvagentd is started by the tests as a child: wrap it so it uses the bundled loader.
cat > "$out/bin/kvagentd.sh" <<'WRAP'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")/..
exec "$here/lib/ld-linux-x86-64.so.2" --library-path "$here/lib" "$here/bin/kvagentd" "$@"
WRAP
chmod +x "$out/bin/kvagentd.sh"
du -sh "$out"

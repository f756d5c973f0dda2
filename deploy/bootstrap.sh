#!/usr/bin/env bash
# Installs, from Debian 12's own archive, exactly what kvagent's build, tests, demo and
# benchmark need. Idempotent: when every package is already installed it prints nothing
# and never touches apt. Run as root, or as a user with sudo.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

# Why each package is here:
#   bazel-bootstrap                  the build (Bazel 4.2.3, offline)
#   g++ pkg-config                   compiler and library lookup
#   protobuf-compiler libprotobuf-dev          proto/kvagent.proto -> C++ messages
#   protobuf-compiler-grpc libgrpc++-dev libgrpc-dev   gRPC stubs and runtime
#   libre2-dev libc-ares-dev libssl-dev zlib1g-dev     what third_party/system.BUILD links for gRPC
#   libabsl-dev libfmt-dev           Status/StatusOr, Mutex, fmt-style logging
#   libjemalloc-dev                  the agent's heap allocator (//third_party:malloc)
#   libucx-dev ucx-utils             the transport; ucx_info / ucx_perftest for doctor and bench
#   catch2                           unit and integration tests
#   libbenchmark-dev                 the benchmark
#   python3                          .ci/count_tests.py (counts JUnit XML test results)
#   clang libclang-rt-14-dev         fuzz/run.sh: clang builds the libFuzzer targets (libFuzzer,
#                                    ASan/UBSan runtimes are in libclang-rt-14-dev)
#   iproute2                         `ip netns`/veth/`tc` for tests/fault/netns_test (link cuts between agents)
#   etcd-server                      tests/integration/directory_test runs real etcd members (the
#                                    --directory fleet directory); the agent itself needs no package
#   python3-yaml                     tests/deploy:deploy_test parses deploy/kubernetes
#   python3-grpcio python3-protobuf  the Python client (python/kvagent) and its py_tests, run by
#   python3-numpy python3-torch      /usr/bin/python3; torch (CPU) for tensor views and the examples
#                                    (--no-install-recommends below keeps torch's GUI recommends out)
PACKAGES=(
  bazel-bootstrap
  g++
  pkg-config
  protobuf-compiler
  libprotobuf-dev
  protobuf-compiler-grpc
  libgrpc++-dev
  libgrpc-dev
  libre2-dev
  libc-ares-dev
  libssl-dev
  zlib1g-dev
  libabsl-dev
  libfmt-dev
  libjemalloc-dev
  libucx-dev
  ucx-utils
  catch2
  libbenchmark-dev
  python3
  clang
  libclang-rt-14-dev
  iproute2
  etcd-server
  python3-yaml
  python3-grpcio
  python3-protobuf
  python3-numpy
  python3-torch
)

log() { echo "bootstrap: $*" >&2; }

missing=()
for pkg in "${PACKAGES[@]}"; do
  status="$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)"
  if [[ "$status" != "installed" ]]; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]} > 0)); then
  log "missing packages: ${missing[*]}"
  SUDO=()
  if [[ "$(id -u)" -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
      SUDO=(sudo -E)
    else
      log "ERROR: not root and sudo is not installed, so cannot install: ${missing[*]}." \
          "Fix: run this script as root, or install them yourself: apt-get install ${missing[*]}"
      exit 1
    fi
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    log "ERROR: apt-get not found; kvagent targets Debian 12. Install by hand: ${missing[*]}"
    exit 1
  fi
  log "running apt-get update"
  if ! "${SUDO[@]}" apt-get update -qq; then
    # Lists already on disk may still hold the packages; the check below names any that
    # they do not.
    log "WARN: apt-get update failed (no network or a bad mirror in /etc/apt/sources.list?);" \
        "trying with the package lists already on this machine."
  fi
  # Name each package the archive cannot supply, rather than apt's generic refusal.
  unavailable=()
  for pkg in "${missing[@]}"; do
    candidate="$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ {print $2}')"
    if [[ -z "$candidate" || "$candidate" == "(none)" ]]; then
      unavailable+=("$pkg")
    fi
  done
  if ((${#unavailable[@]} > 0)); then
    log "ERROR: no installable version of: ${unavailable[*]}." \
        "Fix: enable Debian 12 (bookworm) 'main' in /etc/apt/sources.list (and" \
        "bookworm-updates), run apt-get update, then rerun this script."
    exit 1
  fi
  log "installing: ${missing[*]}"
  if ! "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"; then
    log "ERROR: apt-get install failed for: ${missing[*]} (see apt's message above)."
    exit 1
  fi
  log "done"
fi

# VRAM support compiles against CUDA headers only (the driver is loaded at run time).
if [[ ! -f /usr/local/cuda/include/cuda.h ]]; then
  log "WARN: /usr/local/cuda/include/cuda.h not found: the build compiles the VRAM (CUDA IPC)" \
      "code against the CUDA toolkit's headers at /usr/local/cuda (headers only; no GPU or" \
      "driver needed) and will fail without them. Debian's repositories do not carry them:" \
      "install NVIDIA's CUDA toolkit, or point /usr/local/cuda at a copy of its include/ folder."
fi
# The device copy path's gather kernel (agent/gpu/gather_kernel.cu) is compiled by the
# toolkit's nvcc during the build (offline; it needs gcc, not a GPU).
if [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  log "WARN: /usr/local/cuda/bin/nvcc not found: the build compiles the gather kernel with" \
      "it (//agent/gpu:gather_kernel_image_cc) and will fail without it; install NVIDIA's CUDA" \
      "toolkit (12.8 or newer, for sm_100/sm_120) at /usr/local/cuda."
fi

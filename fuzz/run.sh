#!/usr/bin/env bash
# Builds kvagent's libFuzzer targets with clang (--config=fuzz: libFuzzer + ASan +
# UBSan, in its own Bazel output base) and runs each for a bounded time on its seeds
# (fuzz/seeds/<target>/*.textpb, encoded with protoc), its past failures
# (fuzz/regressions/<target>/) and a corpus kept between runs, --jobs of them at once
# (default: the cores, KVAGENT_FUZZ_JOBS; each fuzzer uses one).
#
#   fuzz/run.sh [--seconds N] [--jobs N] [--targets "metadata register plan fast_ring inbox liveness ucx_stream"]
#               [--junit FILE] [-- BAZEL_BUILD_FLAGS...]
#
# A fuzzer that crashes, leaks, trips a sanitizer or breaks a FUZZ_CHECK fails; its
# input is saved under the work folder and named in the output, with how to turn it
# into a regression. --junit writes one <testcase> per fuzzer (.ci/count_tests.py
# counts them). Exits non-zero when any fuzzer failed or did not build.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

seconds="${KVAGENT_FUZZ_SECONDS:-60}"
jobs="${KVAGENT_FUZZ_JOBS:-$(nproc)}"
targets="metadata register plan fast_ring inbox liveness ucx_stream"
junit=""
bazel_flags=()
while (($# > 0)); do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --targets) targets="$2"; shift 2 ;;
    --junit) junit="$2"; shift 2 ;;
    --) shift; bazel_flags=("$@"); break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "fuzz/run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || ((seconds == 0)); then
  echo "fuzz/run.sh: --seconds '$seconds' is not a positive number of seconds" >&2
  exit 2
fi
if ! [[ "$jobs" =~ ^[0-9]+$ ]] || ((jobs == 0)); then
  echo "fuzz/run.sh: --jobs '$jobs' is not a positive number of fuzzers to run at once" >&2
  exit 2
fi

cache="${XDG_CACHE_HOME:-$HOME/.cache}"
output_base="${KVAGENT_FUZZ_OUTPUT_BASE:-$cache/kvagent-bazel-fuzz}"
work="${KVAGENT_FUZZ_WORKDIR:-$cache/kvagent-fuzz}"
mkdir -p "$work"

declare -A result detail seconds_taken
for t in $targets; do result[$t]=""; done

write_junit() {
  [[ -z "$junit" ]] && return
  local failures=0 t
  for t in $targets; do [[ "${result[$t]}" == pass ]] || failures=$((failures + 1)); done
  {
    echo '<?xml version="1.0" encoding="UTF-8"?>'
    echo "<testsuites><testsuite name=\"fuzz\" tests=\"$(wc -w <<<"$targets")\" failures=\"$failures\">"
    for t in $targets; do
      local msg
      msg="$(sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g' -e 's/"/\&quot;/g' <<<"${detail[$t]:-}")"
      echo "<testcase name=\"fuzz ${t}_fuzzer ${seconds}s\" classname=\"fuzz\" time=\"${seconds_taken[$t]:-0}\">"
      [[ "${result[$t]}" == pass ]] || echo "<failure message=\"$msg\"/>"
      echo "</testcase>"
    done
    echo "</testsuite></testsuites>"
  } >"$junit"
}

# clang and libFuzzer come from Debian (deploy/bootstrap.sh installs them).
if ! command -v clang++ >/dev/null 2>&1; then
  for t in $targets; do result[$t]=fail; detail[$t]="clang++ not found; run deploy/bootstrap.sh"; done
  echo "fuzz/run.sh: clang++ not found; run deploy/bootstrap.sh (installs clang, libclang-rt-14-dev)" >&2
  write_junit
  exit 1
fi

labels=()
for t in $targets; do labels+=("//fuzz:${t}_fuzzer"); done
echo "== fuzz: building ${labels[*]} with --config=fuzz (output base $output_base)"
build_start=$SECONDS
if ! bazel --output_base="$output_base" build --config=fuzz "${bazel_flags[@]}" "${labels[@]}"; then
  for t in $targets; do
    result[$t]=fail
    detail[$t]="the libFuzzer build (bazel build --config=fuzz) failed; see the log above"
  done
  write_junit
  exit 1
fi
echo "== fuzz: built in $((SECONDS - build_start)) s"
bin="$(bazel --output_base="$output_base" info --config=fuzz bazel-bin 2>/dev/null)"

# UCX's memory hooks work under ASan (measured; only TSan needs UCX_MEM_EVENTS=no).
export UCX_LOG_LEVEL="${UCX_LOG_LEVEL:-error}"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

# Each target's input message and the .proto that defines it (for protoc --encode).
declare -A message_of=([metadata]=kvagent.v1.AgentMetadata
                       [register]=kvagent.v1.RegisterRegionsRequest
                       [plan]=kvagent.v1.SubmitTransferRequest
                       [fast_ring]=kvagent.fuzz.FastRingInput
                       [inbox]=kvagent.wire.NoticeBatch
                       [liveness]=kvagent.fuzz.LivenessInput
                       [ucx_stream]=kvagent.fuzz.UcxStreamInput)
declare -A proto_of=([fast_ring]=fuzz/fast_ring_input.proto [inbox]=proto/wire.proto
                     [liveness]=fuzz/liveness_input.proto
                     [ucx_stream]=fuzz/ucx_stream_input.proto)
rc=0
declare -A pid_of start_of

# Starts target $1 in the background on its seeds, regressions and corpus.
start_target() {
  local t="$1" dir="$work/$1" seed
  rm -rf "$dir/seeds" "$dir/artifacts"
  mkdir -p "$dir/corpus" "$dir/seeds" "$dir/artifacts"
  for seed in fuzz/seeds/"$t"/*.textpb; do
    if ! protoc --proto_path=. --encode="${message_of[$t]}" "${proto_of[$t]:-proto/kvagent.proto}" \
        <"$seed" >"$dir/seeds/$(basename "$seed" .textpb).bin"; then
      echo "fuzz/run.sh: seed $seed is not a valid ${message_of[$t]} text proto; fix it" >&2
    fi
  done
  echo "== fuzz: ${t}_fuzzer for ${seconds} s (corpus $dir/corpus)"
  start_of[$t]=$SECONDS
  "$bin/fuzz/${t}_fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -max_len=4096 -print_final_stats=1 -artifact_prefix="$dir/artifacts/" \
      "$dir/corpus" "$dir/seeds" "fuzz/regressions/$t" >"$dir/log" 2>&1 &
  pid_of[$t]=$!
}

# Waits for target $1 and reports it.
finish_target() {
  local t="$1" dir="$work/$1" pid="${pid_of[$1]}" status artifacts reason
  wait "$pid"
  status=$?
  seconds_taken[$t]=$((SECONDS - start_of[$t]))
  # The register and plan targets create /kvagent-fuzz-<pid>-* shm objects, unlinked
  # at a normal exit; a crash leaves them.
  rm -f /dev/shm/kvagent-fuzz-"$pid"-*
  echo "== fuzz: ${t}_fuzzer ended after ${seconds_taken[$t]} s"
  grep -E "^#[0-9]+ +DONE|^stat::number_of_executed_units|^stat::peak_rss_mb" "$dir/log" | tail -3
  artifacts=("$dir"/artifacts/*)
  if ((status == 0)) && [[ ! -e "${artifacts[0]}" ]]; then
    result[$t]=pass
    echo "== fuzz: ${t}_fuzzer PASSED"
  else
    result[$t]=fail
    rc=1
    reason="$(grep -m1 -E "ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error|FUZZ_CHECK failed" "$dir/log")"
    detail[$t]="exit $status: ${reason:-see $dir/log}; input ${artifacts[*]}"
    echo "== fuzz: ${t}_fuzzer FAILED (exit $status); last 40 lines of $dir/log:"
    tail -40 "$dir/log"
    echo "== fuzz: failing input(s): ${artifacts[*]}. Reproduce with '$bin/fuzz/${t}_fuzzer FILE'" \
         "(or the gcc build: bazel run //fuzz:${t}_fuzzer -- FILE); after the fix, copy it to" \
         "fuzz/regressions/$t/ so that //fuzz:${t}_fuzzer_replay keeps checking it."
  fi
}

# libFuzzer runs on one core: --jobs targets at a time, each still for --seconds.
running=()
for t in $targets; do
  start_target "$t"
  running+=("$t")
  if ((${#running[@]} >= jobs)); then
    finish_target "${running[0]}"
    running=("${running[@]:1}")
  fi
done
for t in "${running[@]}"; do finish_target "$t"; done
write_junit
exit "$rc"

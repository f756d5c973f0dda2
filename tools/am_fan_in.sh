#!/bin/bash
# Many senders into one receiver over tcp (data path ucx-am), and what the receiver holds
# meanwhile: starts one "decode" kvagentd and N "prefill" ones on this host, all with
# `--ucx-error-mode peer --shm-direct off` (so UCX serves the endpoints over tcp and the
# data moves as the agents' own eager messages), runs N `kvagentctl demo`s at once (one
# per sender, each verifying every byte), and samples decode's RssAnon every ~2 ms.
# Prints RssAnon before, the highest seen, and each demo's GB/s.
#
#   tools/am_fan_in.sh KVAGENTD KVAGENTCTL N [extra kvagentd flags, e.g. --am-message-bytes 4194304]
#
# Environment: POOL_MIB (each demo's KV pool, default 128), WORK (default a new
# directory under /tmp). The receiving UCX assembles each eager message whole, so the
# highest RssAnon grows with N times the message size (docs/BENCHMARKS.md, "Many
# senders over tcp").
set -u
if [ $# -lt 3 ]; then
  sed -n '2,15p' "$0"
  exit 2
fi
KVAGENTD=$1 CTL=$2 N=$3
shift 3
POOL_MIB=${POOL_MIB:-128}
WORK=${WORK:-$(mktemp -d /tmp/am_fan_in.XXXXXX)}
mkdir -p "$WORK"
export UCX_TLS=tcp,self
common=(--ucx-error-mode peer --shm-direct off "$@")

"$KVAGENTD" --name decode --local-socket "$WORK/d.sock" "${common[@]}" >"$WORK/decode.log" 2>&1 &
decode=$!
senders=()
for i in $(seq 1 "$N"); do
  "$KVAGENTD" --name "p$i" --local-socket "$WORK/p$i.sock" "${common[@]}" >"$WORK/p$i.log" 2>&1 &
  senders+=($!)
done
cleanup() { kill "$decode" "${senders[@]}" 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT
for _ in $(seq 1 200); do
  ready=1
  for s in "$WORK/d.sock" $(seq -f "$WORK/p%g.sock" 1 "$N"); do [ -S "$s" ] || ready=0; done
  [ $ready = 1 ] && break
  sleep 0.05
done
[ $ready = 1 ] || { echo "agents did not start; see $WORK/*.log"; exit 1; }
sleep 2  # the agents' start-up checks settle first (9 agents on 2 cores)
rss() { awk '/^RssAnon/{print $2}' "/proc/$decode/status"; }
before=$(rss)
(
  max=0
  while [ ! -f "$WORK/stop" ] && kill -0 "$decode" 2>/dev/null; do
    v=$(rss)
    [ "${v:-0}" -gt "$max" ] && max=$v && echo "$max" >"$WORK/max"
    sleep 0.002
  done
) &
sampler=$!
demos=()
for i in $(seq 1 "$N"); do
  "$CTL" demo --prefill "unix:$WORK/p$i.sock" --decode "unix:$WORK/d.sock" --pool-mib "$POOL_MIB" \
    --submit grpc >"$WORK/demo$i.out" 2>&1 &
  demos+=($!)
done
failed=0
for p in "${demos[@]}"; do wait "$p" || failed=$((failed + 1)); done
touch "$WORK/stop"
wait "$sampler"
rates=$(for i in $(seq 1 "$N"); do grep -o '"gbps": [0-9.]*' "$WORK/demo$i.out" | awk '{print $2}'; done | tr '\n' ' ')
echo "senders $N flags [$*]: decode RssAnon before ${before} kB, highest $(cat "$WORK/max" 2>/dev/null || echo "$before") kB; demos failed $failed; GB/s each: $rates"
[ $failed = 0 ]

#!/usr/bin/env bash
# roles-bench.sh: CPU per decision of deciding nodes whose usage records go
# to a node of their own (CONTRACT.md §13), with usage on and off.
#
# Three processes: L embeds the NATS server and runs only the ledger and
# the shadow evaluator; d1 and d2 join it (--nats-url) and only decide.
# `limitmesh bench` drives load through L's server; the deciding nodes'
# CPU time (from /proc) over the run is divided by its decisions. With
# "off", d1 and d2 run --usage=false. Usage:
#
#   scripts/roles-bench.sh on|off [bench flags...]
#
# It prints the bench's JSON line and "deciders_cpu_us_per_decision".
set -euo pipefail
mode=${1:?on or off}; shift
bin=${LIMITMESH_BIN:-/tmp/limitmesh-roles-bench}
cd "$(dirname "$0")/.."
[ -x "$bin" ] || go build -o "$bin" ./cmd/limitmesh
dir=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
port=$((4300 + RANDOM % 500))
url=nats://127.0.0.1:$port
"$bin" serve --node-id L --roles ledger,shadow --data "$dir/L" --nats-listen 127.0.0.1:$port \
  --http 127.0.0.1:0 --log-level warn >"$dir/L.log" 2>&1 &
pids+=($!)
for i in $(seq 1 50); do
  "$bin" policy list --nats-url "$url" >/dev/null 2>&1 && break
  sleep 0.2
done
usage=true
[ "$mode" = off ] && usage=false
dpids=()
for d in d1 d2; do
  "$bin" serve --node-id $d --roles decide --usage=$usage --nats-url "$url" --data "$dir/$d" \
    --http 127.0.0.1:0 --log-level warn >"$dir/$d.log" 2>&1 &
  pids+=($!); dpids+=($!)
done
sleep 3
cpu() { local t=0; for p in "${dpids[@]}"; do t=$((t + $(awk '{print $14+$15}' /proc/$p/stat))); done; echo $t; }
c0=$(cpu)
out=$("$bin" bench --nats-url "$url" --json --quiet "$@" | tail -1)
c1=$(cpu)
hz=$(getconf CLK_TCK)
decisions=$(echo "$out" | sed -E 's/.*"decisions":([0-9]+).*/\1/')
echo "$out"
awk -v c=$((c1 - c0)) -v hz="$hz" -v n="$decisions" -v m="$mode" \
  'BEGIN { printf "usage %s: deciders_cpu_us_per_decision %.2f (%d decisions)\n", m, c * 1e6 / hz / n, n }'

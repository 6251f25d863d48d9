#!/usr/bin/env bash
# Quickstart: a local ductile cluster (etcd, one daemon, two agents with 2 CPU slots each) trains
# a small GPT on 4 CPU workers, loses an agent (SIGKILL) and keeps training at 2, gets the agent
# back and grows to 4 again on `dctl scale`. Step, loss, throughput and each generation are shown
# live (and on the dashboard whose URL it prints); a summary and the loss chart (`dctl plot`)
# follow. Everything it starts is stopped when it ends (on a terminal: after Enter); its files
# are in a temporary directory it prints.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup.sh
# shellcheck disable=SC1091
source "${DUCTILE_CACHE:-$HOME/.cache/ductile}/env.sh"
cargo build --workspace --bins --quiet
bin="${CARGO_TARGET_DIR:-$root/target}/debug"

work=$(mktemp -d /tmp/ductile-quickstart.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

etcd_port=$(free_port); peer_port=$(free_port); api_port=$(free_port)
etcd_url="http://127.0.0.1:$etcd_port"
say "starting etcd on $etcd_url (logs in $work)"
etcd --name qs --data-dir "$work/etcd" --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
  --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "qs=http://127.0.0.1:$peer_port" --heartbeat-interval 10 --election-timeout 100 >"$work/etcd.log" 2>&1 &
pids+=($!)
until curl -sf "$etcd_url/health" >/dev/null; do sleep 0.1; done

head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/read-token"
export DCTL_ENDPOINT="http://127.0.0.1:$api_port" DCTL_TOKEN="$(cat "$work/token")"
say "starting ductiled on $DCTL_ENDPOINT"
"$bin/ductiled" --etcd "$etcd_url" --listen "127.0.0.1:$api_port" --token-file "$work/token" --read-token-file "$work/read-token" --insecure-http --election-ttl 3 >"$work/daemon.log" 2>&1 &
pids+=($!)
for i in $(seq 1 300); do curl -sf "$DCTL_ENDPOINT/readyz" >/dev/null && break; sleep 0.1; done
curl -sf "$DCTL_ENDPOINT/readyz" >/dev/null || { echo "quickstart: ductiled did not become ready within 30 s; its log ($work/daemon.log):" >&2; tail -20 "$work/daemon.log" >&2; exit 1; }
dashboard="$DCTL_ENDPOINT/#token=$(cat "$work/read-token")"
say "the dashboard (live curves, generations, members, nodes; read-only token): $dashboard"

declare -A agent_pid
start_agent() {
  "$bin/ductile-agent" --etcd "$etcd_url" --node "$1" --cpu-slots 2 --lease-ttl 2 --gpus off --advertise-host 127.0.0.1 --restart-backoff-ms 1000 \
    --allowed-paths "$work" --log-dir "$work/logs-$1" --work-root "$work/work-$1" >>"$work/$1.log" 2>&1 &
  pids+=($!)
  agent_pid["$1"]=$!
}
say "starting two agents (node-a, node-b), 2 CPU slots each"
start_agent node-a
start_agent node-b
sleep 0.5
"$bin/dctl" nodes

say "generating a synthetic token dataset (a seeded Markov source)"
"$bin/ductile-worker" synth-data --kind tokens --out "file://$work/tokens.bin" --seed 7 --size 200000
cat >"$work/demo.toml" <<JOB
name = "demo"
min = 1
max = 4
desired = 4
[training]
strategy = "data-parallel"
model = "gpt"
model_config = { d_model = 64, n_layer = 2, n_head = 4, ctx = 32 }
dataset = "file://$work/tokens.bin"
global_batch = 32
max_steps = 2500
optimizer = "adamw"
lr = 3e-3
seed = 7
JOB
say "submitting job demo: a GPT on 4 CPU workers (min 1, max 4, desired 4)"
"$bin/dctl" submit "$work/demo.toml"
# a live line: step, loss, throughput, world; each new generation on a line of its own
cat >"$work/show.py" <<'PY'
import json, sys
v = json.load(sys.stdin)
last = int(sys.argv[1])
if v["generation"] != last and v["generation"] > 0:
    print("\r\033[K-- generation %d: world %d (%s)" % (v["generation"], v["world_size"], v["message"]), flush=True)
loss = "-" if v["loss"] is None else "%.3f" % v["loss"]
sps = "-" if v["samples_per_sec"] is None else "%.0f" % v["samples_per_sec"]
print("\r\033[K   %-9s step %5d  loss %6s  samples/s %6s  world %d" % (v["state"], v["step"], loss, sps, v["world_size"]), end="", flush=True)
sys.exit(v["generation"] % 256)
PY
(
  last=0
  while sleep 0.5; do
    # the helper's exit status carries the generation it showed (inside `if`, set -e allows it)
    if "$bin/dctl" status demo --json 2>/dev/null | python3 "$work/show.py" "$last"; then last=0; else last=$?; fi
  done
) &
follower=$!
pids+=($follower)

# wait_until EXPR WHAT: poll `dctl status demo --json` (as v) until the Python expression holds
wait_until() {
  for _ in $(seq 1 1200); do
    if "$bin/dctl" status demo --json | python3 -c "import json,sys; v=json.load(sys.stdin); sys.exit(0 if ($1) else 1)"; then return 0; fi
    sleep 0.1
  done
  echo "job demo: $2 did not happen" >&2; return 1
}
wait_world() { wait_until "v['world_size']==$1 and all(m['pid'] for m in v['members'])" "world size $1"; }
wait_step() { wait_until "v['step']>=$1" "step $1"; }
wait_world 4
wait_step 400
echo

say "SIGKILL node-a's agent (its workers die with it): the survivors keep training at 2"
kill -9 "${agent_pid[node-a]}"
wait_world 2
s=$("$bin/dctl" status demo --json | python3 -c "import json,sys; print(json.load(sys.stdin)['step'])")
wait_step $((s + 300))
echo

say "the operator shrinks the desired size to what is alive: dctl scale demo 2"
"$bin/dctl" scale demo 2
say "node-a comes back"
start_agent node-a
sleep 1
"$bin/dctl" nodes
say "and the job grows again: dctl scale demo 4 (the newcomers receive the state from a survivor)"
"$bin/dctl" scale demo 4 --wait --timeout 120
wait_until "v['state']=='Succeeded'" "success"
sleep 0.6
kill "$follower" 2>/dev/null || true
echo

say "summary"
"$bin/dctl" status demo
echo
"$bin/dctl" events demo
echo
"$bin/dctl" status demo --json | python3 -c "import json,sys; v=json.load(sys.stdin); r=v['last_reformation']; print(f\"last re-formation: generation {r['generation']} ({r['reason']}) took {r['seconds']:.3f} s from trigger to every worker joined\"); print(f\"final: step {v['step']}, loss {v['loss']:.3f}, weights sha256 {v.get('final_weights_sha256')}\")"
say "the chart: dctl plot demo --out $work/loss.svg (and samples/s as PNG), and here: dctl plot demo --term"
"$bin/dctl" plot demo --out "$work/loss.svg"
"$bin/dctl" plot demo --out "$work/throughput.png" --metric throughput
"$bin/dctl" plot demo --term
say "done; logs and charts in $work"
echo "dashboard: $dashboard"
if [ -t 0 ]; then
  # the cluster (and its dashboard) stays up until Enter, 10 minutes at most
  read -r -t 600 -p "press Enter to stop the cluster " _ || true
fi

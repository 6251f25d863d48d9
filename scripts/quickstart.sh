#!/usr/bin/env bash
# Quickstart: a local ductile cluster (etcd, one daemon, two agents with 2 CPU slots each) runs a
# 4-worker job, loses an agent (SIGKILL), re-forms without it, gets the agent back, and grows
# again on `dctl scale`. Every generation is printed as it is published. Everything it starts
# is stopped when it ends; its files are in a temporary directory it prints.
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
export DCTL_ENDPOINT="http://127.0.0.1:$api_port" DCTL_TOKEN="$(cat "$work/token")"
say "starting ductiled on $DCTL_ENDPOINT"
"$bin/ductiled" --etcd "$etcd_url" --listen "127.0.0.1:$api_port" --token-file "$work/token" --election-ttl 3 >"$work/daemon.log" 2>&1 &
pids+=($!)
until curl -sf "$DCTL_ENDPOINT/healthz" >/dev/null; do sleep 0.1; done

declare -A agent_pid
start_agent() {
  "$bin/ductile-agent" --etcd "$etcd_url" --node "$1" --cpu-slots 2 --lease-ttl 2 --gpus off --restart-backoff-ms 1000 >>"$work/$1.log" 2>&1 &
  pids+=($!)
  agent_pid["$1"]=$!
}
say "starting two agents (node-a, node-b), 2 CPU slots each"
start_agent node-a
start_agent node-b
sleep 0.5
"$bin/dctl" nodes

cat >"$work/demo.toml" <<'JOB'
name = "demo"
min = 1
max = 4
desired = 4
JOB
say "submitting job demo (min 1, max 4, desired 4); generations appear below as they are published"
"$bin/dctl" submit "$work/demo.toml"
"$bin/dctl" events demo --follow &
follower=$!
pids+=($follower)

wait_world() {
  for _ in $(seq 1 200); do
    if "$bin/dctl" status demo --json | python3 -c "import json,sys; v=json.load(sys.stdin); sys.exit(0 if v['world_size']==$1 and all(m['pid'] for m in v['members']) else 1)"; then return 0; fi
    sleep 0.1
  done
  echo "job did not reach world size $1" >&2; return 1
}
wait_world 4
sleep 0.5
"$bin/dctl" status demo

say "SIGKILL node-a's agent (its workers die with it): the job re-forms without it"
kill -9 "${agent_pid[node-a]}"
wait_world 2
sleep 0.5
"$bin/dctl" status demo

say "the operator shrinks the desired size to what is alive: dctl scale demo 2"
"$bin/dctl" scale demo 2
say "node-a comes back"
start_agent node-a
sleep 1
"$bin/dctl" nodes
say "and the job grows again: dctl scale demo 4"
"$bin/dctl" scale demo 4
wait_world 4
sleep 0.5
kill "$follower" 2>/dev/null || true

say "summary"
"$bin/dctl" status demo
echo
"$bin/dctl" events demo
echo
"$bin/dctl" status demo --json | python3 -c "import json,sys; v=json.load(sys.stdin); r=v['last_reformation']; print(f\"last re-formation: generation {r['generation']} ({r['reason']}) took {r['seconds']:.3f} s from trigger to every worker joined\")"
say "done; logs in $work"

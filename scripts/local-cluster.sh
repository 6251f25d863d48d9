#!/usr/bin/env bash
# A local ductile cluster for your own first jobs (the README's walk-throughs): etcd, one
# ductiled and two agents with 2 CPU slots each, on loopback ports of its choosing. It stays up
# until Ctrl-C (or `kill` of this script), then stops everything it started. Its state, logs and
# an env file for dctl are in $DUCTILE_LOCAL (default ~/.cache/ductile/local, emptied at start):
#
#   bash scripts/local-cluster.sh            # terminal 1: stays up
#   source ~/.cache/ductile/local/env        # terminal 2: dctl talks to it
#
# The agents allow, as a job's command, ductile-worker (built-in jobs) and the Python of the
# venvs scripts/setup.sh made (torch, transformers; TensorFlow), and files under this
# repository's examples/, $DUCTILE_LOCAL, $DUCTILE_CACHE (the test models) and
# $DUCTILE_LOCAL_PATHS (comma-separated: your own scripts).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup.sh --tests
# shellcheck disable=SC1091
source "${DUCTILE_CACHE:-$HOME/.cache/ductile}/env.sh"
echo "== building ductile (a cold build takes a while; later ones are quick)"
cargo build --workspace --bins --quiet
bin="${CARGO_TARGET_DIR:-$root/target}/debug"

local_dir="${DUCTILE_LOCAL:-$DUCTILE_CACHE/local}"
rm -rf "$local_dir"
mkdir -p "$local_dir"
chmod 700 "$local_dir"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 1
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 0' INT TERM
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

etcd_port=$(free_port); peer_port=$(free_port); api_port=$(free_port)
etcd_url="http://127.0.0.1:$etcd_port"
echo "== etcd on $etcd_url"
etcd --name local --data-dir "$local_dir/etcd" --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
  --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "local=http://127.0.0.1:$peer_port" >"$local_dir/etcd.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do curl -sf "$etcd_url/health" >/dev/null && break; sleep 0.1; done
curl -sf "$etcd_url/health" >/dev/null || { echo "local-cluster: etcd did not start within 10 s; its log: $local_dir/etcd.log" >&2; exit 1; }

head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$local_dir/token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$local_dir/read-token"
chmod 600 "$local_dir/token" "$local_dir/read-token"
endpoint="http://127.0.0.1:$api_port"
echo "== ductiled on $endpoint"
"$bin/ductiled" --etcd "$etcd_url" --listen "127.0.0.1:$api_port" --token-file "$local_dir/token" \
  --read-token-file "$local_dir/read-token" --insecure-http >"$local_dir/daemon.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do curl -sf "$endpoint/readyz" >/dev/null && break; sleep 0.1; done
curl -sf "$endpoint/readyz" >/dev/null || { echo "local-cluster: ductiled did not become ready within 30 s; its log: $local_dir/daemon.log" >&2; tail -20 "$local_dir/daemon.log" >&2; exit 1; }

commands="ductile-worker"
for p in "${DUCTILE_TORCH_PYTHON:-}" "${DUCTILE_TF_PYTHON:-}"; do
  [ -n "$p" ] && commands="${commands:+$commands,}$p"
done
paths="$root/examples,$local_dir,$DUCTILE_CACHE${DUCTILE_LOCAL_PATHS:+,$DUCTILE_LOCAL_PATHS}"
for node in node-a node-b; do
  mkdir -p "$local_dir/work-$node"
  chmod 711 "$local_dir/work-$node"
  "$bin/ductile-agent" --etcd "$etcd_url" --node "$node" --cpu-slots 2 --gpus off --advertise-host 127.0.0.1 \
    --work-root "$local_dir/work-$node" --log-dir "$local_dir/logs-$node" \
    ${commands:+--allowed-commands "$commands"} --allowed-paths "$paths" >"$local_dir/$node.log" 2>&1 &
  pids+=($!)
done
cat >"$local_dir/env" <<ENV
export DCTL_ENDPOINT="$endpoint"
export DCTL_TOKEN_FILE="$local_dir/token"
export PATH="$bin:\$PATH"
export DUCTILE_LOCAL="$local_dir"
ENV
for _ in $(seq 1 100); do
  [ "$(DCTL_ENDPOINT=$endpoint DCTL_TOKEN_FILE=$local_dir/token "$bin/dctl" nodes --json 2>/dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))' 2>/dev/null)" = 2 ] && break
  sleep 0.1
done
DCTL_ENDPOINT=$endpoint DCTL_TOKEN_FILE=$local_dir/token "$bin/dctl" nodes
echo
echo "== the cluster is up: in another terminal,   source $local_dir/env"
echo "   the dashboard (read-only token): $endpoint/#token=$(cat "$local_dir/read-token")"
echo "   logs: $local_dir/{etcd,daemon,node-a,node-b}.log; Ctrl-C stops everything"
while true; do
  for p in "${pids[@]}"; do
    kill -0 "$p" 2>/dev/null || { echo "local-cluster: process $p ended; see the logs in $local_dir" >&2; exit 1; }
  done
  sleep 2
done

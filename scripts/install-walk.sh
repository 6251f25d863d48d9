#!/usr/bin/env bash
# The operator's walk that scripts/install-check.sh runs inside a fresh Debian 12 root (as root,
# one host standing for the fleet: etcd member e1, daemons d1 and d2, nodes n1 and n2). Each step
# is what docs/deploying.md says; processes start from the installed units'
# ExecStart lines under the units' users and capabilities (systemd is not PID 1 here).
#   bash install-walk.sh PACKAGE.deb
set -euo pipefail
deb=$1
walk=$(dirname "$(readlink -f "$0")")
say() { printf '\n== %s\n' "$*"; }
fail() { printf '\nFAILED: %s\n' "$*"; for f in "$walk"/*.log; do echo "--- $f"; tail -n 15 "$f"; done; exit 1; }
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done' EXIT
# no service starts inside a chroot
printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
chmod 755 /usr/sbin/policy-rc.d

say "1. install the package and etcd (apt-get install ./$(basename "$deb") etcd-server etcd-client)"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$deb" etcd-server etcd-client >/dev/null
id ductile && id ductile-worker
stat -c '%A %U:%G %n' /var/lib/ductile /var/lib/ductile/work /var/lib/ductile/logs /etc/ductile /etc/ductile/jobs
readelf -d /usr/bin/ductile-worker 2>/dev/null | grep -E 'R(UN)?PATH' || true
[ -f /usr/share/doc/ductile-cpu/copyright ] || fail "no LICENSE in the package"

port() { local p; while :; do p=$((20000 + RANDOM % 10000)); (echo >"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }; done; }
EP=$(port); PP=$(port); API=$(port); API2=$(port)

say "2. bootstrap: ductile-admin init (CA, certificates per host, etcd users, tokens, configs)"
ductile-admin init --out /root/cluster --etcd e1=127.0.0.1 --daemons d1=127.0.0.1 --nodes n1=127.0.0.1,n2=127.0.0.1 \
  --etcd-port "$EP" --etcd-peer-port "$PP" --api-port "$API"
for h in e1 d1 n1; do
  [ ! -e "/root/cluster/hosts/$h/etc/ductile/ca-key.pem" ] || fail "a host bundle holds the CA's key"
  grep -rl "PRIVATE KEY" "/root/cluster/hosts/$h" | xargs -r grep -l "ductile cluster CA" && fail "a host bundle holds the CA's key"
  ductile-admin apply "/root/cluster/hosts/$h"
done
stat -c '%a %U:%G %n' /etc/ductile/etcd/agent-key.pem /etc/ductile/etcd/worker-key.pem /etc/ductile/token /etc/ductile/etcd-server/etcd-key.pem
# this node's libtorch (the operator's own; docs/deploying.md, "what each node needs")
sed -i 's|^# libtorch = .*|libtorch = "/opt/libtorch"|; s|^cpu_slots = .*|cpu_slots = 2|; s|^gpus = .*|gpus = "off"|' /etc/ductile/agent.toml
# this walk runs on a build machine, not a cloud instance: its agents ask no metadata service
sed -i 's|^spot_notice = .*|spot_notice = "off"|' /etc/ductile/agent.toml
grep -q '^spot_notice = "off"' /etc/ductile/agent.toml || fail "spot_notice is not off for the walk"

say "3. etcd with the bundle's settings (/etc/default/etcd), then its users and auth"
(set -a; . /etc/default/etcd; set +a; exec setpriv --reuid etcd --regid etcd --init-groups /usr/bin/etcd) >"$walk/etcd.log" 2>&1 &
pids+=($!)
ductile-admin etcd-auth /root/cluster --etcd-wait 30
# the unit's ExecStart under its User= (and, for the agent, its AmbientCapabilities=)
exec_of() { grep '^ExecStart=' "/lib/systemd/system/$1.service" | cut -d= -f2-; }
# (arrays, not functions: a background function is a subshell, and $! would name the subshell,
# not the service that a kill must reach)
as_daemon=(setpriv --reuid ductile --regid ductile --init-groups --)
as_agent=(setpriv --reuid ductile --regid ductile --init-groups --inh-caps +setuid,+setgid,+kill,+chown --ambient-caps +setuid,+setgid,+kill,+chown --)
read -r -a daemon_cmd <<<"$(exec_of ductile-daemon)"
read -r -a agent_cmd <<<"$(exec_of ductile-agent)"

say "4. the checks (as the services' users)"
"${as_daemon[@]}" "${daemon_cmd[@]}" --check --check-host 127.0.0.1,localhost || fail "ductiled --check"
# the certificate names d1 and 127.0.0.1, not this host's name: the check says so
if out=$("${as_daemon[@]}" "${daemon_cmd[@]}" --check --check-host "$(hostname)"); then fail "a certificate for another host passed the check"; fi
echo "$out" | grep "does not name" || fail "the check did not name the certificate's mismatch"
"${as_agent[@]}" "${agent_cmd[@]}" --check || fail "ductile-agent --check"
# a node without libtorch: the check names it
sed 's|^libtorch = .*|# libtorch|' /etc/ductile/agent.toml >/tmp/nolib.toml && chmod 644 /tmp/nolib.toml
if out=$("${as_agent[@]}" /usr/bin/ductile-agent --config /tmp/nolib.toml --check); then fail "a node without libtorch passed"; fi
echo "$out" | grep "FAIL libtorch" || fail "the check did not name the missing libtorch"

say "5. two ductiled replicas and two agents"
"${as_daemon[@]}" "${daemon_cmd[@]}" --id d1 >"$walk/d1.log" 2>&1 &
pids+=($!); d1=$!
"${as_daemon[@]}" "${daemon_cmd[@]}" --id d2 --listen "0.0.0.0:$API2" >"$walk/d2.log" 2>&1 &
pids+=($!); d2=$!
"${as_agent[@]}" "${agent_cmd[@]}" >"$walk/n1.log" 2>&1 &
pids+=($!); n1=$!
"${as_agent[@]}" "${agent_cmd[@]}" --node n2 --log-dir /var/lib/ductile/logs-n2 >"$walk/n2.log" 2>&1 &
pids+=($!); n2=$!
set -a; . /root/cluster/admin/dctl.env; set +a
for _ in $(seq 1 60); do dctl nodes 2>/dev/null | grep -q n2 && dctl nodes | grep -q n1 && break; sleep 1; done
dctl nodes || fail "dctl over TLS"

say "6. a job: a GPT on 4 workers, checkpointed"
LD_LIBRARY_PATH=/opt/libtorch/lib setpriv --reuid ductile-worker --regid ductile-worker --init-groups \
  /usr/bin/ductile-worker synth-data --kind tokens --out file:///var/lib/ductile/jobs/tokens.bin --seed 7 --size 100000
cat >/root/walk.toml <<'JOB'
name = "walk"
min = 1
max = 4
desired = 4
[training]
strategy = "data-parallel"
model = "gpt"
model_config = { d_model = 32, n_layer = 2, n_head = 4, ctx = 16 }
dataset = "file:///var/lib/ductile/jobs/tokens.bin"
global_batch = 16
max_steps = 6000
optimizer = "adamw"
lr = 3e-3
seed = 7
[checkpoint]
url = "file:///var/lib/ductile/jobs/walk-ckpt"
interval = 200
JOB
dctl submit /root/walk.toml
wait_until() { # SECONDS WHAT GREP-PATTERN-ON-STATUS-JSON
  for _ in $(seq 1 "$1"); do dctl status walk --json 2>/dev/null | tr -d ' \n' | grep -qE "$3" && return 0; sleep 1; done
  dctl status walk || true; fail "$2 within $1 s"
}
wait_until 120 "the job at world 4" '"world_size":4'
wait_until 120 "step 300" '"step":([3-9][0-9]{2}|[1-9][0-9]{3,})'
dctl status walk

say "7. kill the leading ductiled and agent n2 (SIGKILL)"
leader=$(grep -l "became leader" "$walk/d1.log" "$walk/d2.log" | head -1)
case $leader in
  *d1.log) kill -9 "$d1"; export DCTL_ENDPOINT="https://127.0.0.1:$API2" ;;
  *) kill -9 "$d2" ;;
esac
echo "killed the leader ($(basename "$leader" .log))"
kill -9 "$n2"
wait_until 120 "the job re-formed at world 2 without n2" '"world_size":2'
dctl events walk | tail -5
wait_until 600 "the job succeeded" '"state":"Succeeded"'
dctl status walk
# (the job's files are its own user's, mode 600: a daemon on this host reads its file://
# checkpoints only where the operator lets its user; with S3 it reads them with its credentials)
dctl checkpoints walk | tail -3 || echo "(dctl checkpoints: the daemon's user cannot read this job's file:// checkpoints)"
say "the walk passed: installed, bootstrapped, checked, ran over TLS, survived the leader's and a node's loss"

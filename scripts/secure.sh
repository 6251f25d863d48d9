#!/usr/bin/env bash
# Secure a ductile cluster: certificates for TLS, then etcd's users, roles and auth.
#
#   scripts/secure.sh certs DIR [HOST ...]
#       A CA (DIR/ca.pem); server certificates for HOSTs (and localhost, 127.0.0.1) for etcd
#       (DIR/etcd.pem, DIR/etcd-key.pem) and for ductiled's API (DIR/api.pem, DIR/api-key.pem);
#       a node certificate for the workers' TLS mesh (DIR/mesh.pem, DIR/mesh-key.pem: server and
#       client; one per node in a real fleet, naming its advertise_host);
#       client certificates for etcd's clients: the daemon, the agents and the workers
#       (DIR/{daemon,agent,worker}.pem and -key.pem; CNs ductile-daemon, ductile-agent,
#       ductile-worker). Use your own PKI instead where you have one.
#
#   scripts/secure.sh etcd-auth ENDPOINT DIR [PREFIX]
#       With etcdctl, over TLS with DIR's CA and the daemon's client certificate: users root,
#       ductile-daemon (role root: the leader makes and removes each job's user) and
#       ductile-agent (role ductile-agent: read and write PREFIX, default /ductile/v1), passwords
#       written to DIR/{root,daemon,agent}.password (mode 600), then `auth enable`. No role is
#       made for ductile-worker: a worker connects as its job's user, which the leader makes.
#       Run it once, on a fresh etcd.
set -euo pipefail

die() { echo "secure: $*" >&2; exit 1; }

certs() {
  local dir=$1; shift
  command -v openssl >/dev/null || die "openssl is not installed (apt-get install openssl)"
  mkdir -p "$dir"
  local san="DNS:localhost,IP:127.0.0.1"
  for h in "$@"; do
    if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san+=",IP:$h"; else san+=",DNS:$h"; fi
  done
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -subj "/CN=ductile etcd CA" -keyout "$dir/ca-key.pem" -out "$dir/ca.pem" 2>/dev/null
  issue() { # name CN extendedKeyUsage [SAN]
    local ext="$dir/$1.ext"
    printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=%s\n' "$3" >"$ext"
    [ -n "${4:-}" ] && printf 'subjectAltName=%s\n' "$4" >>"$ext"
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$2" \
      -keyout "$dir/$1-key.pem" -out "$dir/$1.csr" 2>/dev/null
    openssl x509 -req -in "$dir/$1.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" \
      -CAcreateserial -days 825 -extfile "$ext" -out "$dir/$1.pem" 2>/dev/null
    rm -f "$dir/$1.csr" "$ext"
  }
  issue etcd etcd serverAuth,clientAuth "$san"
  issue api ductiled serverAuth "$san"
  issue mesh ductile-mesh serverAuth,clientAuth "$san"
  issue daemon ductile-daemon clientAuth
  issue agent ductile-agent clientAuth
  issue worker ductile-worker clientAuth
  chmod 600 "$dir"/*-key.pem
  echo "secure: certificates in $dir (CA ca.pem; servers etcd.pem and api.pem for $san)"
}

auth() {
  local endpoint=$1 dir=$2 prefix=${3:-/ductile/v1}
  command -v etcdctl >/dev/null || die "etcdctl is not installed (apt-get install etcd-client)"
  ctl() {
    ETCDCTL_API=3 etcdctl --endpoints "$endpoint" --cacert "$dir/ca.pem" \
      --cert "$dir/daemon.pem" --key "$dir/daemon-key.pem" --dial-timeout 5s "$@" >/dev/null
  }
  umask 077
  for u in root daemon agent; do
    [ -s "$dir/$u.password" ] || head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/$u.password"
  done
  ctl user add root --new-user-password "$(cat "$dir/root.password")"
  ctl user grant-role root root
  ctl user add ductile-daemon --new-user-password "$(cat "$dir/daemon.password")"
  ctl user grant-role ductile-daemon root
  ctl role add ductile-agent
  ctl role grant-permission ductile-agent readwrite --prefix=true "$prefix/"
  ctl user add ductile-agent --new-user-password "$(cat "$dir/agent.password")"
  ctl user grant-role ductile-agent ductile-agent
  ctl auth enable
  echo "secure: auth enabled on $endpoint (users root, ductile-daemon, ductile-agent; passwords in $dir)"
}

case "${1:-}" in
  certs) shift; [ $# -ge 1 ] || die "usage: $0 certs DIR [HOST ...]"; certs "$@" ;;
  etcd-auth) shift; [ $# -ge 2 ] || die "usage: $0 etcd-auth ENDPOINT DIR [PREFIX]"; auth "$@" ;;
  *) die "usage: $0 certs DIR [HOST ...] | etcd-auth ENDPOINT DIR [PREFIX]" ;;
esac

#!/usr/bin/env bash
# The operator's install, walked in a fresh Debian 12 root as docs/deploying.md
# writes it: install the package, bootstrap the cluster with ductile-admin, start etcd, two
# ductiled replicas and two agents from the shipped units' ExecStart lines (systemd is not PID 1
# in a chroot: the lines run under the units' users and capabilities), check both, submit a job
# with dctl over TLS, kill the leader ductiled and an agent, and see the job go on and succeed.
#
#   sudo bash scripts/install-check.sh [PACKAGE.deb]
#       default: dist/ductile-cpu_*.deb (bash scripts/package.sh makes it)
# env: FRESH_BASE (default /var/tmp/fresh-bookworm: the minimal Debian root that
#      ../shared/fresh-machine-check.sh makes with debootstrap, made here too if missing),
#      LIBTORCH (the operator's libtorch 2.11.0, copied into the root as /opt/libtorch;
#      default: the one scripts/setup.sh keeps), FRESH_KEEP=1 keeps the root afterwards.
# Needs root (debootstrap, chroot, mount). About 5 minutes.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { printf '[install-check] %s\n' "$*" >&2; }
deb=${1:-$(ls "$root"/dist/ductile-cpu_*_amd64.deb 2>/dev/null | tail -1)}
[ -f "$deb" ] || { log "no package: run 'bash scripts/package.sh' first, or name one"; exit 2; }
libtorch=${LIBTORCH:-${DUCTILE_CACHE:-$HOME/.cache/ductile}/libtorch-2.11.0}
[ -f "$libtorch/lib/libtorch_cpu.so" ] || { log "no libtorch at $libtorch (run scripts/setup.sh, or set LIBTORCH)"; exit 2; }
base=${FRESH_BASE:-/var/tmp/fresh-bookworm}
if [ ! -x "$base/bin/bash" ]; then
  command -v debootstrap >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list)
  log "making a minimal Debian 12 root at $base (once)"
  rm -rf "$base.tmp"
  debootstrap --variant=minbase bookworm "$base.tmp" "$mirror" >/dev/null
  mv "$base.tmp" "$base"
fi
run=$(mktemp -d /var/tmp/install-check.XXXXXX)
mounts=()
cleanup() {
  # everything the walk started inside the root
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$run" ] && kill -9 "${p#/proc/}" 2>/dev/null || true
  done
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[$i]}" 2>/dev/null || true; done
  if [ "${FRESH_KEEP:-0}" = 1 ]; then log "kept $run"; else rm -rf --one-file-system "$run"; fi
}
trap cleanup EXIT
log "copying the fresh root to $run"
cp -a "$base/." "$run/"
cp -a /etc/apt/sources.list.d/. "$run/etc/apt/sources.list.d/" 2>/dev/null || true
if [ -f /etc/apt/sources.list ]; then cp /etc/apt/sources.list "$run/etc/apt/"; fi
cp /etc/resolv.conf "$run/etc/resolv.conf"
mkdir -p "$run/etc/ssl"
cp -aL /etc/ssl/certs "$run/etc/ssl/"
bind() { mkdir -p "$run$2"; mount --bind "$1" "$run$2"; mounts+=("$run$2"); }
bind /proc /proc
bind /sys /sys
bind /dev /dev
bind /dev/pts /dev/pts
mkdir -p "$run/opt" "$run/root/walk"
cp "$deb" "$run/root/walk/"
cp -a "$libtorch" "$run/opt/libtorch"
cp "$root/scripts/install-walk.sh" "$run/root/walk/walk.sh"
log "walking the install in the fresh root (log: $run/root/walk/walk.log)"
set +e
chroot "$run" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  /bin/bash /root/walk/walk.sh "/root/walk/$(basename "$deb")" >"$run/root/walk/walk.log" 2>&1
rc=$?
set -e
tail -n 40 "$run/root/walk/walk.log"
if [ $rc -eq 0 ]; then log "passed: installed, bootstrapped, ran and survived in a fresh Debian 12 root"; else log "FAILED (exit $rc)"; FRESH_KEEP=1; fi
exit $rc

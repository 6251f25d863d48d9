#!/usr/bin/env bash
# The release package: one command builds a Debian package and a tarball of ductile.
#
#   bash scripts/package.sh [cpu|cuda|all]      (default cpu; output in dist/)
#
# Each variant holds the four binaries (ductiled, ductile-agent, ductile-worker, dctl), the
# bootstrap (ductile-admin), the systemd units, commented default configs, the Grafana dashboard,
# the `ductile` Python module and the LICENSE:
#   dist/ductile-cpu_VERSION_amd64.deb   dist/ductile-cpu-VERSION-linux-x86_64.tar.gz
#   dist/ductile-cuda_VERSION_amd64.deb  dist/ductile-cuda-VERSION-linux-x86_64.tar.gz
# The cuda variant's worker drives GPUs (NCCL loaded at run time from the node's torch); the
# cpu variant's worker trains on CPUs only. Neither carries libtorch (about 0.5 GB for CPUs,
# 3 GB with CUDA) nor any path of this machine: the agent gives its workers the node's libtorch
# 2.11.0 (agent.toml: `libtorch = DIR` or `torch_python = PYTHON`), and a binary run by hand
# finds one at /usr/lib/ductile/libtorch/lib (a link the operator makes) or on LD_LIBRARY_PATH.
#
# Why dpkg-deb and a staged tree, not cargo-deb: the package holds more than cargo's binaries
# (a Python module, a script, units, a Grafana dashboard, maintainer scripts that make users),
# two variants of one crate's features, and a tarball of the same tree; dpkg-deb is on every
# Debian machine, and cargo-deb would be one more tool to install for what 100 lines of shell do.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
log() { printf '[package] %s\n' "$*" >&2; }
variants=${1:-cpu}
case "$variants" in
  cpu | cuda) ;;
  all) variants="cpu cuda" ;;
  *) echo "usage: $0 [cpu|cuda|all]" >&2; exit 2 ;;
esac
bash scripts/setup.sh
# shellcheck disable=SC1091
source "${DUCTILE_CACHE:-$HOME/.cache/ductile}/env.sh"
version=$(awk -F'"' '/^\[workspace.package\]/ {p = 1} p && /^version/ {print $2; exit}' Cargo.toml)
target=${CARGO_TARGET_DIR:-$root/target}
dist=$root/dist
mkdir -p "$dist"
# the binaries' rpath names the package's own libtorch link, never this machine's libtorch
export DUCTILE_RPATH='$ORIGIN/../lib/ductile/libtorch/lib'

for v in $variants; do
  features=()
  [ "$v" = cuda ] && features=(--features ductile-worker/cuda,ductile-comm/cuda)
  log "building the $v release binaries (cargo build --release: a cold build takes about 20 minutes on 2 cores)"
  cargo build --release --locked --bins -p ductile-daemon -p ductile-agent -p ductile-dctl -p ductile-worker "${features[@]}"
  name=ductile-$v
  stage=$(mktemp -d)
  chmod 0755 "$stage" # the package's root directory: its mode is /'s in the archive
  trap 'rm -rf "$stage"' EXIT
  install -d "$stage/usr/bin" "$stage/lib/systemd/system" "$stage/etc/ductile" \
    "$stage/usr/share/ductile/grafana" "$stage/usr/lib/ductile/python" "$stage/usr/lib/ductile/libtorch" \
    "$stage/usr/share/doc/$name"
  for b in ductiled ductile-agent dctl ductile-worker; do
    strip -o "$stage/usr/bin/$b" "$target/release/$b"
    chmod 0755 "$stage/usr/bin/$b"
  done
  # nothing of this machine in what ships
  if readelf -d "$stage/usr/bin/ductile-worker" | grep -E 'R(UN)?PATH' | grep -q "$HOME"; then
    log "ductile-worker's RUNPATH names this machine's home: $(readelf -d "$stage/usr/bin/ductile-worker" | grep -E 'R(UN)?PATH')"
    exit 1
  fi
  install -m 0755 scripts/ductile-admin "$stage/usr/bin/ductile-admin"
  for u in ductile-agent ductile-daemon; do
    sed 's|/usr/local/bin/|/usr/bin/|g' "systemd/$u.service" >"$stage/lib/systemd/system/$u.service"
    chmod 0644 "$stage/lib/systemd/system/$u.service"
  done
  install -m 0644 systemd/agent.toml systemd/daemon.toml "$stage/etc/ductile/"
  # ductile-admin's templates: the same files, untouched by the operator's edits of /etc
  install -d "$stage/usr/share/ductile/examples"
  install -m 0644 systemd/agent.toml systemd/daemon.toml "$stage/usr/share/ductile/examples/"
  install -m 0644 systemd/grafana/ductile.json systemd/grafana/prometheus.yml "$stage/usr/share/ductile/grafana/"
  cp -r python/ductile python/pyproject.toml python/README.md "$stage/usr/lib/ductile/python/"
  find "$stage/usr/lib/ductile/python" -name '__pycache__' -prune -exec rm -rf {} +
  cat >"$stage/usr/lib/ductile/libtorch/README" <<'EOF'
ductile-worker links libtorch 2.11.0 and looks for it here (lib/ under this directory) when run
by hand. The agent gives its workers the libtorch its configuration names (agent.toml:
`libtorch = "DIR"` or `torch_python = "PYTHON"`), whatever is here. To use this place, link a
libtorch directory or a torch package's directory here:
    ln -s /opt/venv/lib/python3.11/site-packages/torch/lib /usr/lib/ductile/libtorch/lib
EOF
  install -m 0644 LICENSE "$stage/usr/share/doc/$name/copyright"
  install -m 0644 README.md "$stage/usr/share/doc/$name/README.md"
  install -d "$stage/usr/share/doc/$name/docs"
  install -m 0644 docs/*.md "$stage/usr/share/doc/$name/docs/"
  install -m 0755 scripts/package/postinst "$stage/usr/lib/ductile/postinst"
  # the Debian package
  install -d "$stage/DEBIAN"
  other=$([ "$v" = cpu ] && echo cuda || echo cpu)
  what=$([ "$v" = cpu ] && echo "CPU build: workers train on CPUs" || echo "CUDA build: workers train on NVIDIA GPUs with NCCL (from the node's torch)")
  cat >"$stage/DEBIAN/control" <<EOF
Package: $name
Version: $version
Architecture: amd64
Maintainer: ductile developers <ductile@example.invalid>
Depends: libc6 (>= 2.36), libgcc-s1, libstdc++6, passwd, openssl
Recommends: etcd-client
Suggests: etcd-server
Conflicts: ductile-$other
Provides: ductile
Section: net
Priority: optional
Installed-Size: $(du -sk "$stage" | cut -f1)
Description: fault-tolerant, elastic distributed training ($what)
 ductile runs training jobs that keep going through node failures, spot
 preemptions and resizes: an agent per node (ductile-agent), a replicated
 control plane on etcd (ductiled), the workers (ductile-worker), the
 client (dctl) and the cluster bootstrap (ductile-admin). Needs libtorch
 2.11.0 on worker nodes (a libtorch directory or a Python torch package).
EOF
  printf '/etc/ductile/agent.toml\n/etc/ductile/daemon.toml\n' >"$stage/DEBIAN/conffiles"
  cat >"$stage/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
  /usr/lib/ductile/postinst
fi
EOF
  cat >"$stage/DEBIAN/postrm" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = purge ]; then
  rm -rf /var/lib/ductile
  # the cluster's keys and tokens are the operator's: kept
fi
if [ -d /run/systemd/system ]; then systemctl daemon-reload >/dev/null 2>&1 || true; fi
EOF
  chmod 0755 "$stage/DEBIAN/postinst" "$stage/DEBIAN/postrm"
  deb="$dist/${name}_${version}_amd64.deb"
  dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
  # the tarball: the same tree, with an installer that does what the package's postinst does
  rm -rf "$stage/DEBIAN"
  tdir=$(mktemp -d)
  chmod 0755 "$tdir"
  mv "$stage" "$tdir/$name-$version"
  stage="$tdir/$name-$version"
  cp LICENSE "$stage/LICENSE"
  cat >"$stage/install.sh" <<'EOF'
#!/bin/sh
# Installs this tree under / (or DESTDIR) and makes ductile's users and directories, as the
# Debian package does. Existing configs in /etc/ductile are kept.
set -e
here=$(cd "$(dirname "$0")" && pwd)
dest=${DESTDIR:-}
for d in usr lib; do cp -a "$here/$d/." "$dest/$d/"; done
mkdir -p "$dest/etc/ductile"
for f in agent.toml daemon.toml; do
  [ -e "$dest/etc/ductile/$f" ] || cp "$here/etc/ductile/$f" "$dest/etc/ductile/$f"
done
[ -n "$dest" ] || /usr/lib/ductile/postinst
echo "ductile installed; next: ductile-admin init (see /usr/share/doc/ductile-*/docs/deploying.md)"
EOF
  chmod 0755 "$stage/install.sh"
  tgz="$dist/$name-$version-linux-x86_64.tar.gz"
  tar czf "$tgz" --owner=0 --group=0 -C "$tdir" "$name-$version"
  rm -rf "$tdir"
  trap - EXIT
  log "$deb ($(du -h "$deb" | cut -f1)), $tgz ($(du -h "$tgz" | cut -f1))"
done

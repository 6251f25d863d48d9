#!/usr/bin/env bash
# Installs what ductile's build, tests and quickstart need, idempotently, into a cache outside
# the clone (DUCTILE_CACHE, default ~/.cache/ductile):
#   - Debian packages: etcd-server (3.4), protobuf-compiler (etcd-client's build needs protoc),
#     systemd (systemd-analyze, for checking the units), python3 venv/pip, build tools;
#   - an S3-compatible server for tests: moto's server in a venv;
#   - libtorch 2.11.0 (CPU libraries and headers of the PyPI torch wheel).
# Then writes $DUCTILE_CACHE/env.sh, which the other scripts source.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${DUCTILE_CACHE:-$HOME/.cache/ductile}
mkdir -p "$cache"
log() { printf '[setup] %s\n' "$*" >&2; }

sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi

need_apt=()
command -v etcd >/dev/null || need_apt+=(etcd-server)
command -v protoc >/dev/null || need_apt+=(protobuf-compiler)
command -v systemd-analyze >/dev/null || need_apt+=(systemd)
command -v cc >/dev/null || need_apt+=(build-essential)
command -v curl >/dev/null || need_apt+=(curl)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
command -v etcd >/dev/null || { log "etcd is still missing after apt-get"; exit 1; }

# moto's S3 server in a venv
moto="$cache/moto-venv/bin/moto_server"
if [ ! -x "$moto" ] || ! "$cache/moto-venv/bin/python" -c 'import moto, flask, flask_cors' 2>/dev/null; then
  log "installing moto[s3] into $cache/moto-venv"
  rm -rf "$cache/moto-venv"
  python3 -m venv "$cache/moto-venv"
  "$cache/moto-venv/bin/pip" install -q --disable-pip-version-check 'moto[s3]==5.*' flask flask-cors
fi
# Python's safetensors and numpy, for the test that reads ductile's shards from Python
if ! "$cache/moto-venv/bin/python" -c 'import safetensors.numpy, numpy' 2>/dev/null; then
  log "installing safetensors and numpy into $cache/moto-venv"
  "$cache/moto-venv/bin/pip" install -q --disable-pip-version-check 'safetensors==0.*' 'numpy<3'
fi

bash "$here/install-libtorch.sh"

cat > "$cache/env.sh" <<ENV
# written by scripts/setup.sh
export DUCTILE_CACHE="$cache"
export DUCTILE_MOTO_SERVER="$moto"
export DUCTILE_PYTHON="$cache/moto-venv/bin/python"
export DUCTILE_ETCD_BIN="$(command -v etcd)"
export LIBTORCH="$cache/libtorch-2.11.0"
ENV
log "ready: source $cache/env.sh"

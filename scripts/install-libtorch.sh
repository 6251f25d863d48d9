#!/usr/bin/env bash
# libtorch 2.11.0 for CPU builds, from the PyPI torch wheel (tch 0.24 pairs with exactly 2.11.0).
# Keeps include/, libtorch_cpu.so, libc10.so and libgomp.so.1; the wheel's libtorch.so needs
# libtorch_cuda.so and all of CUDA, so a small libtorch.so linking only torch_cpu and c10 is
# built instead. libtorch_cpu.so itself needs libcudart.so.13 and libcupti.so.13, taken from the
# nvidia-cuda-runtime and nvidia-cuda-cupti wheels at the versions torch's cuda-toolkit pins.
# Idempotent; about 10 s and 0.5 GB.
set -euo pipefail
cache=${DUCTILE_CACHE:-$HOME/.cache/ductile}
dest="$cache/libtorch-2.11.0"
if [ -f "$dest/.complete" ]; then exit 0; fi
log() { printf '[libtorch] %s\n' "$*" >&2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
log "downloading torch==2.11.0, nvidia-cuda-runtime==13.0.96, nvidia-cuda-cupti==13.0.85"
"${DUCTILE_PY:-python3}" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$tmp" \
  torch==2.11.0 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85
rm -rf "$dest.partial"
mkdir -p "$dest.partial/lib"
"${DUCTILE_PY:-python3}" - "$tmp" "$dest.partial" <<'PY'
import glob, os, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
torch = glob.glob(os.path.join(tmp, "torch-2.11.0-*.whl"))[0]
keep_libs = {"libtorch_cpu.so", "libc10.so", "libgomp.so.1"}
with zipfile.ZipFile(torch) as z:
    for n in z.namelist():
        if n.startswith("torch/include/") and not n.endswith("/"):
            z.extract(n, tmp)
            out = os.path.join(dest, n[len("torch/"):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            os.replace(os.path.join(tmp, n), out)
        elif n.startswith("torch/lib/") and os.path.basename(n) in keep_libs:
            with z.open(n) as src, open(os.path.join(dest, "lib", os.path.basename(n)), "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
for w in glob.glob(os.path.join(tmp, "nvidia_cuda_*.whl")):
    with zipfile.ZipFile(w) as z:
        for n in z.namelist():
            if os.path.basename(n) in ("libcudart.so.13", "libcupti.so.13"):
                with z.open(n) as src, open(os.path.join(dest, "lib", os.path.basename(n)), "wb") as dst:
                    dst.write(src.read())
PY
# the small libtorch.so: just torch_cpu + c10, found next to it
cc -shared -o "$dest.partial/lib/libtorch.so" -Wl,--no-as-needed -L"$dest.partial/lib" -ltorch_cpu -lc10 -Wl,-rpath,'$ORIGIN'
# every dependency must resolve from the cache
if LD_LIBRARY_PATH="$dest.partial/lib" ldd "$dest.partial/lib/libtorch.so" | grep -q "not found"; then
  LD_LIBRARY_PATH="$dest.partial/lib" ldd "$dest.partial/lib/libtorch.so" | grep "not found" >&2
  log "unresolved libraries in the libtorch cache"
  exit 1
fi
touch "$dest.partial/.complete"
rm -rf "$dest"
mv "$dest.partial" "$dest"
log "libtorch 2.11.0 (CPU) at $dest"

#!/usr/bin/env bash
# The test command: installs what is missing (scripts/setup.sh), builds, and runs every test
# against a real etcd and a real S3-compatible server.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup.sh --tests
# shellcheck disable=SC1091
source "${DUCTILE_CACHE:-$HOME/.cache/ductile}/env.sh"
cargo build --workspace --bins --locked
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set -o pipefail
cargo test --workspace --locked --no-fail-fast -- --test-threads="${DUCTILE_TEST_THREADS:-3}" --skip training_ --skip pipeline_ 2>&1 | tee "$log"
# the training tests each run several tch workers: one at a time, so the 2-core machine is not
# oversubscribed under the control-plane tests' liveness bounds
cargo test -p ductile-tests --test training --test pipeline --test checkpoints --test chaos --test dashboard --test data --test torchrun --test torchft --test tf --test horovod --locked --no-fail-fast -- --test-threads=1 2>&1 | tee -a "$log"
# the GPU path (cargo feature cuda: NCCL loaded at run time, CUDA workers, GPU benchmarks) must
# build here and fail clearly without a GPU; scripts/gpu-check.sh runs it on a GPU machine
cargo test -p ductile-comm -p ductile-worker --features ductile-comm/cuda,ductile-worker/cuda --locked --lib 2>&1 | tee -a "$log"
cargo build -p ductile-bench --features cuda --locked --bins
bash -n scripts/gpu-check.sh
# one closing line for the whole run (cargo's last line is a crate's doc-tests)
awk '/^test result:/ {p += $4; f += $6} END {printf "tests: %d passed, %d failed\n", p, f}' "$log"

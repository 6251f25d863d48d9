#!/usr/bin/env bash
# The test command: installs what is missing (scripts/setup.sh), builds, and runs every test
# against a real etcd and a real S3-compatible server.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup.sh
# shellcheck disable=SC1091
source "${DUCTILE_CACHE:-$HOME/.cache/ductile}/env.sh"
cargo build --workspace --bins --locked
cargo test --workspace --locked -- --test-threads="${DUCTILE_TEST_THREADS:-3}"

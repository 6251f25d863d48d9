#!/usr/bin/env bash
# The rolling-upgrade check: builds the previous release's binaries and runs
# tests/tests/upgrade.rs's rolling upgrade against them (old daemons and agents run a training
# job; the daemons, then the agents, are replaced by this build's one at a time; the job must
# finish with every step and sample once).
#
#   bash scripts/upgrade-check.sh [REV] [--write-fixture]
#
# REV: the previous release (a tag or commit; default: the release named in
# tests/fixtures/records-previous.json). --write-fixture: also write what the old cluster kept in
# etcd to that fixture, which CI's record-format tests read.
#
# The old release builds in a git worktree under /var/tmp with a target dir of its own, seeded
# from this tree's (so only ductile's own crates build again: a minute or two, not a cold build).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
fixture=tests/fixtures/records-previous.json
rev="" write=0
for a in "$@"; do
    case "$a" in
        --write-fixture) write=1 ;;
        -*) echo "upgrade-check: unknown flag $a" >&2; exit 2 ;;
        *) rev=$a ;;
    esac
done
if [ -z "$rev" ]; then
    rev=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["release"])' "$fixture")
fi
commit=$(git rev-parse --verify "$rev^{commit}") || { echo "upgrade-check: $rev is not a commit here" >&2; exit 2; }
cache=${DUCTILE_CACHE:-$HOME/.cache/ductile}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/target}
prev_target=$cache/target-prev
wt=/var/tmp/ductile-prev-$commit
[ -f "$cache/env.sh" ] && . "$cache/env.sh"

echo "upgrade-check: the previous release is $rev ($commit)"
if [ ! -d "$wt" ]; then
    git worktree add -f --detach "$wt" "$commit" >/dev/null
fi
if [ ! -d "$prev_target/debug" ] && [ -d "$CARGO_TARGET_DIR/debug" ]; then
    echo "upgrade-check: seeding $prev_target from $CARGO_TARGET_DIR (dependencies build once)"
    mkdir -p "$prev_target" && cp -a "$CARGO_TARGET_DIR/debug" "$prev_target/"
fi
echo "upgrade-check: building $rev's binaries in $prev_target"
(cd "$wt" && CARGO_TARGET_DIR=$prev_target cargo build --workspace --bins --locked 2>&1 | tail -2)
echo "upgrade-check: building this tree's binaries"
cargo build --workspace --bins --locked 2>&1 | tail -2
export DUCTILE_PREV_BIN_DIR=$prev_target/debug DUCTILE_PREV_RELEASE=$commit
if [ "$write" = 1 ]; then
    mkdir -p "$(dirname "$fixture")"
    export DUCTILE_RECORDS_OUT=$root/$fixture
fi
echo "upgrade-check: the rolling upgrade ($rev → this tree)"
cargo test -p ductile-tests --test upgrade --locked -- --include-ignored --test-threads=1 2>&1 | tail -25

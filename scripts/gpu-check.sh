#!/usr/bin/env bash
# The GPU check: one command for a machine with an NVIDIA GPU and a CUDA PyTorch (for its
# libtorch), running ductile's binaries built on a CPU machine with the GPU features.
#
#   bash scripts/gpu-check.sh pack     # on the CPU machine: build with --features cuda, strip,
#                                      # and pack the binaries and etcd into gpu-bin/ductile-gpu.tar.gz
#   bash scripts/gpu-check.sh          # on the GPU machine (unpacks gpu-bin/ if needed), runs:
#     1. ductile-bench nccl: the conformance suite on CUDA tensors (every collective, the host
#        face, groups, every dtype, against their references; NCCL and the TCP backend's pinned
#        staging; exchanges between two ranks need two GPUs: the suite runs them on TCP in CI)
#        and NCCL's figures;
#     2. a GPT job on cuda:0 with NCCL (world 1) whose worker is SIGKILLed: it recovers (a new
#        process re-initialises NCCL and restores the last checkpoint) and finishes; then a
#        DiLoCo job and a pipeline job with comm = "auto", which must pick NCCL and finish;
#     3. three workers sharing the GPU over TCP (deterministic): one is killed, the job shrinks,
#        grows back, checkpoints, and ends bitwise equal to an uninterrupted run;
#     4. ductile-bench gpu-step: the elastic CUDA step against a bare tch loop, checkpoint stall;
#     5. a checkpoint restored across device kinds and sizes (GPU -> 2 CPU workers -> GPU);
#     6. Hugging Face Llama and GPT-2 fixtures on cuda:0 (NCCL; TP 2 and two pipeline stages
#        over TCP), bitwise equal across layouts through kills, exported;
#     7. figures: SmolLM2-135M's architecture training on cuda:0 in fp32 and bf16 (tokens/s,
#        MFU), unsharded and fully sharded (sharding = "full" at world 1: every unit gathered and
#        its gradients reduce-scattered over NCCL), against PyTorch eager where the machine has
#        transformers. GPU_CHECK_STEPS="6 7" runs only those.
#     8. a PyTorch DDP script as a runtime = "torchrun" job on cuda:0 with NCCL: the script
#        SIGKILLed, the world restarts from its checkpoint, the job succeeds.
#   9. a TorchFT script (examples/torchft/train_ddp.py --device cuda, torchft 0.2.0 carried as
#      wheels) as a runtime = "torchft" job of two replica groups sharing cuda:0 (gloo between
#      them): one group's program SIGKILLed is restarted alone, heals and rejoins; equal weights.
#  10. full sharding on NCCL at world 1 (sharding = "full": each unit all-gathered before its
#      forward and backward, its gradients folded in order): a deterministic GPT job, its worker
#      SIGKILLed, ends bitwise equal to the unsharded run on the same GPU.
#   It exits non-zero on any failure.
#
# Environment: TORCH_LIB (default: the torch/lib of `python3 -c 'import torch'`), DUCTILE_BIN_DIR
# (default gpu-bin/), ETCD (default: etcd next to the binaries, else on PATH), DUCTILE_PROFILE
# for pack (default release).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
log() { printf '\n[gpu-check] %s\n' "$*"; }
fail() { printf '\n[gpu-check] FAILED: %s\n' "$*" >&2; exit 1; }
# GPU_CHECK_STEPS="2 6" runs only those steps (5 needs 3's checkpoint), to rerun what failed
steps=" ${GPU_CHECK_STEPS:-1 2 3 4 5 6 7 8 9 10} "
want() { [[ "$steps" == *" $1 "* ]]; }

if [ "${1:-}" = pack ]; then
  bash scripts/setup.sh
  # shellcheck disable=SC1091
  source "${DUCTILE_CACHE:-$HOME/.cache/ductile}/env.sh"
  profile=${DUCTILE_PROFILE:-release}
  # the release package's rpath (scripts/package.sh): the same build serves both, and the GPU
  # machine's loader takes LD_LIBRARY_PATH anyway
  export DUCTILE_RPATH='$ORIGIN/../lib/ductile/libtorch/lib'
  target=${CARGO_TARGET_DIR:-$root/target}
  cargo build --profile "$profile" --locked --bins -p ductile-daemon -p ductile-agent -p ductile-dctl \
    -p ductile-worker -p ductile-bench \
    --features ductile-worker/cuda,ductile-bench/cuda,ductile-comm/cuda
  dir=$target/$([ "$profile" = dev ] && echo debug || echo "$profile")
  rm -rf gpu-bin && mkdir -p gpu-bin/stage
  for b in ductiled ductile-agent dctl ductile-worker ductile-bench; do
    strip -o "gpu-bin/stage/$b" "$dir/$b"
  done
  cp "$(command -v etcd)" gpu-bin/stage/etcd
  # step 6's models: the transformers Llama and GPT-2 fixtures (setup.sh --tests makes them), and
  # the sha256 of the Llama's weights as final_weights_sha256 computes it (names sorted, f32 LE)
  if [ -n "${DUCTILE_HF_FIXTURES:-}" ] && [ -n "${DUCTILE_TORCH_PYTHON:-}" ]; then
    cp -r "$DUCTILE_HF_FIXTURES/llama" gpu-bin/stage/hf-llama
    cp -r "$DUCTILE_HF_FIXTURES/gpt2" gpu-bin/stage/hf-gpt2
    "$DUCTILE_TORCH_PYTHON" -c '
import glob, hashlib, sys
from safetensors.numpy import load_file
t = {}
for f in sorted(glob.glob(sys.argv[1] + "/model*.safetensors")):
    t.update(load_file(f))
h = hashlib.sha256()
for n in sorted(t):
    h.update(t[n].astype("<f4").tobytes())
print(h.hexdigest())' gpu-bin/stage/hf-llama >gpu-bin/stage/hf-llama.sha256
  else
    echo "no Hugging Face fixture (run scripts/setup.sh --tests): step 6 will be skipped" >&2
  fi
  # step 7's model: SmolLM2-135M's config.json and tokenizer.json (its architecture, trained
  # from random weights: the weights stay here)
  if [ -n "${DUCTILE_SMOLLM2:-}" ]; then
    mkdir -p gpu-bin/stage/hf-smollm2
    cp "$DUCTILE_SMOLLM2/config.json" "$DUCTILE_SMOLLM2/tokenizer.json" gpu-bin/stage/hf-smollm2/
  fi
  # step 9's torchft 0.2.0 and what it imports, as wheels for the GPU machine's Python (3.12;
  # it reaches no registry): installed there with --no-index into a directory of their own
  if [ -n "${DUCTILE_TORCH_PYTHON:-}" ]; then
    "$DUCTILE_TORCH_PYTHON" -m pip download -q -d gpu-bin/stage/torchft-wheels --only-binary=:all: \
      --python-version "${GPU_PYTHON_VERSION:-3.12}" --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform any torchft==0.2.0 --no-deps \
      && "$DUCTILE_TORCH_PYTHON" -m pip download -q -d gpu-bin/stage/torchft-wheels --only-binary=:all: \
      --python-version "${GPU_PYTHON_VERSION:-3.12}" --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform any "opentelemetry-exporter-otlp-proto-http>=1.39.0" \
      "opentelemetry-sdk>=1.39.0" "opentelemetry-api>=1.39.0" \
      || echo "torchft's wheels could not be downloaded: step 9 will be skipped" >&2
  fi
  tar czf gpu-bin/ductile-gpu.tar.gz -C gpu-bin/stage .
  rm -rf gpu-bin/stage
  ls -la gpu-bin
  exit 0
fi

bin=${DUCTILE_BIN_DIR:-$root/gpu-bin}
if [ ! -x "$bin/ductile-worker" ] && [ -f "$bin/ductile-gpu.tar.gz" ]; then
  tar xzf "$bin/ductile-gpu.tar.gz" -C "$bin"
fi
[ -x "$bin/ductile-worker" ] || fail "no binaries in $bin: run 'bash scripts/gpu-check.sh pack' on the build machine"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader \
  || fail "nvidia-smi is not here: this is not a GPU machine"
torch_lib=${TORCH_LIB:-$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')}
[ -f "$torch_lib/libtorch_cuda.so" ] || fail "no libtorch_cuda.so in $torch_lib (set TORCH_LIB)"
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$bin:$PATH"
etcd_bin=${ETCD:-$( [ -x "$bin/etcd" ] && echo "$bin/etcd" || command -v etcd )}
[ -x "$etcd_bin" ] || fail "no etcd binary (carry one in gpu-bin/ or set ETCD)"
export DUCTILE_BIN_DIR="$bin" DUCTILE_ETCD_BIN="$etcd_bin"

work=$(mktemp -d /tmp/ductile-gpu-check.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  pkill -9 -f "$bin/ductile-worker" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
echo "work dir: $work"
py() { python3 -c "$@"; }
free_port() { py 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# wait_for SECONDS WHAT PYTHON-EXPR-ON-v: polls `dctl status JOB --json` (in $job) until true
wait_for() {
  local limit=$1 what=$2 expr=$3 t0=$SECONDS
  while [ $((SECONDS - t0)) -lt "$limit" ]; do
    if dctl status "$job" --json 2>/dev/null | py "import json,sys; v=json.load(sys.stdin); sys.exit(0 if ($expr) else 1)"; then
      return 0
    fi
    sleep 0.5
  done
  dctl status "$job" 2>&1 | tail -20 || true
  tail -30 "$work"/agent-*.log || true
  fail "$what: not within ${limit}s"
}
field() { dctl status "$job" --json | py "import json,sys; v=json.load(sys.stdin); print($1)"; }

if want 1; then
log "1. NCCL: the conformance suite on CUDA tensors (world 1: what needs two ranks runs on TCP in CI) and figures (ductile-bench nccl)"
ductile-bench nccl | tee "$work/nccl.txt"
grep -q "conformance suite on CUDA tensors (world 1" "$work/nccl.txt" || fail "the NCCL conformance suite did not pass"
grep -q "pinned host staging), self-test: ok" "$work/nccl.txt" || fail "the TCP staging self-test did not pass"

fi

etcd_port=$(free_port); peer_port=$(free_port); api_port=$(free_port)
etcd_url="http://127.0.0.1:$etcd_port"
"$etcd_bin" --name gc --data-dir "$work/etcd" --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
  --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "gc=http://127.0.0.1:$peer_port" >"$work/etcd.log" 2>&1 &
pids+=($!)
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token"
export DCTL_ENDPOINT="http://127.0.0.1:$api_port" DCTL_TOKEN="$(cat "$work/token")"
sleep 1
tf_port=$(free_port)
ductiled --etcd "$etcd_url" --listen "127.0.0.1:$api_port" --token-file "$work/token" --insecure-http --election-ttl 3 \
  --torchft-listen "127.0.0.1:$tf_port" >"$work/daemon.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do dctl nodes >/dev/null 2>&1 && break; sleep 0.2; done
declare -A agent_pid
start_agent() { # NAME EXTRA...
  local name=$1; shift
  ductile-agent --etcd "$etcd_url" --node "$name" --lease-ttl 3 --advertise-host 127.0.0.1 \
    --restart-backoff-ms 2000 --allowed-paths "$work,$bin" "$@" >>"$work/agent-$name.log" 2>&1 &
  pids+=($!)
  agent_pid[$name]=$!
}
ductile-worker synth-data --kind tokens --out "file://$work/tokens.bin" --seed 7 --size 400000 >/dev/null

if want 2; then
log "2. a GPT on cuda:0 with NCCL (world 1): SIGKILL its worker, recover, finish"
start_agent gpu-a --gpus 0
sleep 1
dctl nodes
job=nccl1
cat >"$work/$job.toml" <<JOB
name = "$job"
min = 1
max = 1
desired = 1
restart_budget = 3
[training]
model = "gpt"
model_config = { d_model = 256, n_layer = 4, n_head = 8, ctx = 64 }
dataset = "file://$work/tokens.bin"
global_batch = 32
max_steps = 300
lr = 1e-3
seed = 7
comm = "nccl"
[checkpoint]
url = "file://$work/ckpt-$job"
interval = 25
keep = 2
JOB
dctl submit "$work/$job.toml"
wait_for 180 "job $job past step 60 on the GPU" "v['step'] >= 60 and v['state'] == 'Running'"
grep -q "NCCL" "$work/agent-gpu-a.log" || true
g_before=$(field "v['generation']")
victim=$(field "v['members'][0]['pid']")
loss_before=$(field "v.get('loss')")
echo "step $(field "v['step']"), loss $loss_before, generation $g_before: SIGKILL worker $victim"
t_kill=$(date +%s.%N)
kill -9 "$victim"
# world 1 at min 1: no smaller world exists, so the agent restarts the worker in the same
# generation (restart_budget) and the new process re-initialises NCCL and restores the checkpoint
wait_for 180 "job $job training again with a new worker" "v['state'] in ('Running', 'Succeeded') and v['members'] and v['members'][0].get('pid') not in (None, $victim)"
t_back=$(date +%s.%N)
newpid=$(field "v['members'][0]['pid'] if v['members'] else 0")
wait_for 300 "job $job succeeded" "v['state'] == 'Succeeded'"
dctl events "$job" | tail -5
grep -E "joined generation|worker started|restarting failed worker|worker failed" "$work/agent-gpu-a.log" | tail -4
echo "nccl1: back in $(py "print(round($t_back - $t_kill, 2))") s (kill to a new worker reported; restart backoff 2 s included), final loss $(field "v.get('loss')"), final sha256 $(field "v.get('final_weights_sha256')")"
rejoin=$(grep "pid=$newpid " "$work/agent-gpu-a.log" | grep "joined generation" | head -1)
echo "restarted worker: $rejoin"
case "$rejoin" in *"at step 0 ("*|"") fail "the restarted worker did not resume from the checkpoint";; esac

log "2b. comm = \"auto\" on NCCL (world 1): a DiLoCo job and a pipeline job train to the end"
# JOB EXTRA-TRAINING-LINES: a GPT job on gpu-a's one GPU slot with comm = "auto"
auto_job() {
  cat >"$work/$1.toml" <<JOB
name = "$1"
min = 1
max = 1
desired = 1
restart_budget = 2
[training]
model = "gpt"
model_config = { d_model = 128, n_layer = 4, n_head = 4, ctx = 32 }
dataset = "file://$work/tokens.bin"
global_batch = 16
max_steps = 80
lr = 1e-3
seed = 5
comm = "auto"
$2
JOB
  dctl submit "$work/$1.toml"
}
for spec in "diloco1|sync = \"diloco\"
[training.diloco]
inner_steps = 10" "pipe1|strategy = \"pipeline\""; do
  job=${spec%%|*}
  auto_job "$job" "${spec#*|}"
  wait_for 300 "job $job succeeded" "v['state'] == 'Succeeded'"
  backend=$(dctl events "$job" --json | tail -1 | py "import json,sys; print(json.loads(sys.stdin.read()).get('backend'))")
  echo "$job: backend $backend, final loss $(field "v.get('loss')"), final sha256 $(field "v.get('final_weights_sha256')")"
  [ "$backend" = nccl ] || fail "auto chose $backend for $job on a GPU of its own"
done
kill -TERM "${agent_pid[gpu-a]}"; sleep 3
fi

# a deterministic GPT job: NAME MIN MAX STEPS CHECKPOINT-DIR INTERVAL KEEP [EXTRA-TRAINING-LINES]
det_job() {
  cat >"$work/$1.toml" <<JOB
name = "$1"
min = $2
max = $3
desired = $3
restart_budget = 5
[training]
model = "gpt"
model_config = { d_model = 128, n_layer = 2, n_head = 4, ctx = 32 }
dataset = "file://$work/tokens.bin"
global_batch = 24
max_steps = $4
lr = 1e-3
seed = 11
deterministic = true
logical_shards = 6
${8:-}
[checkpoint]
url = "file://$work/$5"
interval = $6
keep = $7
JOB
  dctl submit "$work/$1.toml"
}
if want 3; then
log "3. three workers sharing the GPU over TCP (deterministic): kill, shrink, grow back, checkpoint; bitwise equal to an uninterrupted run"
start_agent gpu-b --gpus 0 --gpu-slots-per-device 3
sleep 1
dctl nodes
job=ref
det_job ref 1 3 200 ckpt-ref 40 2
wait_for 300 "reference job succeeded" "v['state'] == 'Succeeded'"
ref_sha=$(field "v.get('final_weights_sha256')")
echo "uninterrupted deterministic run: final weights sha256 $ref_sha"
job=elastic
det_job elastic 1 3 200 ckpt-elastic 40 2
wait_for 120 "elastic job at world 3 past step 30" "v['world_size'] == 3 and v['step'] >= 30"
backend=$(dctl events elastic --json | tail -1 | py "import json,sys; print(json.loads(sys.stdin.read()).get('backend'))")
echo "backend chosen for 3 slots sharing one GPU: $backend"
[ "$backend" = tcp ] || fail "auto chose $backend for slots sharing a GPU"
victim=$(field "v['members'][1]['pid']")
echo "SIGKILL worker $victim (rank 1) at step $(field "v['step']")"
kill -9 "$victim"
wait_for 60 "elastic job shrank to 2" "v['world_size'] == 2"
wait_for 120 "elastic job grew back to 3" "v['world_size'] == 3 and v['step'] > 0"
wait_for 400 "elastic job succeeded" "v['state'] == 'Succeeded'"
el_sha=$(field "v.get('final_weights_sha256')")
dctl events elastic | tail -6
dctl checkpoints elastic | tail -3
echo "elastic run (killed, shrank, grew back): final weights sha256 $el_sha"
[ -n "$ref_sha" ] && [ "$ref_sha" = "$el_sha" ] || fail "weights differ: $ref_sha vs $el_sha"
echo "bitwise equal: yes"
kill -TERM "${agent_pid[gpu-b]}"; sleep 3
fi

if want 4; then
log "4. figures: ductile-bench gpu-step"
ductile-bench gpu-step | tee "$work/gpu-step.txt"
fi

if want 5; then
want 3 || fail "step 5 restores step 3's checkpoint: run 3 with it"
log "5. another device kind and size: the GPU job's checkpoint restores on 2 CPU workers, and theirs back on the GPU"
start_agent cpu-c --gpus off --cpu-slots 2
start_agent gpu-d --gpus 0
sleep 1
# gpu-d offers one GPU slot and cpu-c two CPU slots: a job of 2 lands on the CPUs, of 1 anywhere
dctl drain gpu-d >/dev/null
job=oncpu
det_job oncpu 2 2 220 ckpt-elastic 20 5
wait_for 240 "the CPU job restored the GPU checkpoint and finished" "v['state'] == 'Succeeded'"
grep -E "restored|from checkpoint|checkpoint step 200" "$work/agent-cpu-c.log" | grep -v "^$" | head -3
grep -q "at step 200 " "$work/agent-cpu-c.log" || fail "the CPU workers did not start from the GPU job's step 200"
dctl drain gpu-d --undo >/dev/null
dctl drain cpu-c >/dev/null
job=ongpu
det_job ongpu 1 1 240 ckpt-elastic 20 5
wait_for 240 "the GPU job restored the CPU checkpoint and finished" "v['state'] == 'Succeeded'"
grep -q "at step 220 " "$work/agent-gpu-d.log" || fail "the GPU worker did not start from the CPU job's step 220"
echo "cross-device restore: GPU step 200 -> 2 CPU workers -> step 220 -> 1 GPU worker -> step 240: ok"
kill -TERM "${agent_pid[cpu-c]}" "${agent_pid[gpu-d]}"; sleep 3
fi

if want 6; then
log "6. Hugging Face models (the transformers fixtures: a Llama with GQA, Llama 3.1 RoPE and 16 weight files; a GPT-2 with Conv1D weights in the Hub's legacy names) on cuda:0: loaded by plan, NCCL world 1 with a kill, tensor parallel 2 over TCP on two slots of the GPU with a kill; bitwise equal across layouts; exported"
py "
import json
words = 'elastic training keeps going when a node dies Madrid Spain capital the of is step sample'.split()
with open('$work/hf.jsonl', 'w') as f:
    for i in range(600):
        f.write(json.dumps({'text': ' '.join(words[(i * 7 + k * k * 3 + k) % len(words)] for k in range(12)) + f' {i}.'}) + '\\n')
"
# NAME MIN DESIRED STEPS LR EXTRA-TRAINING-LINES: a deterministic job on the fixture $model
hf_job() {
  cat >"$work/$1.toml" <<JOB
name = "$1"
min = $2
max = $3
desired = $3
restart_budget = 5
[training]
model = "hf"
model_path = "file://$model"
init = "pretrained"
dataset = "file://$work/$fx.tok"
global_batch = 32
lr = $5
seed = 7
max_steps = $4
model_config = { ctx = 16$model_extra }
deterministic = true
logical_shards = 4
tensor_slices = 2
$6
[checkpoint]
url = "file://$work/ckpt-$1"
interval = 10
keep = 2
JOB
  dctl submit "$work/$1.toml"
}
for fx in llama gpt2; do
model="$bin/hf-$fx"
[ -f "$model/config.json" ] || fail "no $model: pack where scripts/setup.sh --tests made the Hugging Face fixtures"
# GPT-2's config.json asks for dropout, which ductile trains without when the job says so
model_extra=$([ "$fx" = gpt2 ] && echo ', dropout = "off"' || true)
echo "--- $fx"
ductile-worker tokenize --tokenizer "file://$model" --input "$work/hf.jsonl" --out "file://$work/$fx.tok"
start_agent "hf-a-$fx" --gpus 0
sleep 1
if [ -f "$model.sha256" ]; then
  job=${fx}frozen
  hf_job "$job" 1 1 3 1e-30 'comm = "nccl"'
  wait_for 180 "job $job succeeded" "v['state'] == 'Succeeded'"
  frozen_sha=$(field "v.get('final_weights_sha256')")
  echo "loaded by plan on cuda:0, 3 steps at lr 1e-30: sha256 $frozen_sha, the directory's $(cat "$model.sha256")"
  [ "$frozen_sha" = "$(cat "$model.sha256")" ] || fail "the weights loaded on the GPU are not the directory's"
fi
job=${fx}nccl
hf_job "$job" 1 1 80 3e-3 'comm = "nccl"'
wait_for 180 "job $job past step 20 on the GPU" "v['step'] >= 20 and v['state'] == 'Running'"
victim=$(field "v['members'][0]['pid']")
echo "SIGKILL worker $victim at step $(field "v['step']"), loss $(field "v.get('loss')")"
kill -9 "$victim"
wait_for 300 "job $job succeeded" "v['state'] == 'Succeeded'"
backend=$(dctl events "$job" --json | tail -1 | py "import json,sys; print(json.loads(sys.stdin.read()).get('backend'))")
nccl_sha=$(field "v.get('final_weights_sha256')")
echo "$job: backend $backend, final loss $(field "v.get('loss')"), final sha256 $nccl_sha"
[ "$backend" = nccl ] || fail "$job ran on $backend"
dctl export "$job" --out "file://$work/$fx-export"
ls -la "$work/$fx-export"
if python3 -c 'import safetensors' 2>/dev/null; then
  export_sha=$(python3 -c '
import glob, hashlib, sys
from safetensors.torch import load_file
t = {}
for f in sorted(glob.glob(sys.argv[1] + "/model*.safetensors")):
    t.update(load_file(f))
h = hashlib.sha256()
for n in sorted(t):
    h.update(t[n].float().contiguous().numpy().astype("<f4").tobytes())
print(h.hexdigest())' "$work/$fx-export")
  echo "export: sha256 $export_sha"
  [ "$export_sha" = "$nccl_sha" ] || fail "the export is not the trained weights"
else
  echo "export: python3 here has no safetensors module: weights not compared"
fi
kill -TERM "${agent_pid[hf-a-$fx]}"; sleep 3
start_agent "hf-b-$fx" --gpus 0 --gpu-slots-per-device 2
sleep 1
job=${fx}tp
hf_job "$job" 2 2 80 3e-3 'strategy = "hybrid"
tensor_parallel = 2
pipeline_parallel = 1'
wait_for 180 "job $job at world 2 past step 20" "v['world_size'] == 2 and v['step'] >= 20"
echo "$job: layout $(field "v.get('layout')"), backend $(dctl events "$job" --json | tail -1 | py "import json,sys; print(json.loads(sys.stdin.read()).get('backend'))")"
victim=$(field "v['members'][1]['pid']")
echo "SIGKILL worker $victim (tensor rank 1) at step $(field "v['step']")"
kill -9 "$victim"
wait_for 300 "job $job succeeded" "v['state'] == 'Succeeded'"
tp_sha=$(field "v.get('final_weights_sha256')")
dctl events "$job" | tail -4
echo "$job (dp1xtp2 over TCP, killed): final loss $(field "v.get('loss')"), sha256 $tp_sha; ${fx}nccl (world 1, NCCL, killed): $nccl_sha"
[ "$tp_sha" = "$nccl_sha" ] || fail "the $fx weights differ between tensor parallel 2 and world 1 on the GPU"
job=${fx}pp
hf_job "$job" 2 2 80 3e-3 'strategy = "pipeline"
pipeline_parallel = 2'
wait_for 300 "job $job succeeded" "v['state'] == 'Succeeded'"
pp_sha=$(field "v.get('final_weights_sha256')")
echo "$job (dp1xpp2 over TCP$([ "$fx" = gpt2 ] && echo ', the tied embedding on both stages')): final loss $(field "v.get('loss')"), sha256 $pp_sha"
[ "$pp_sha" = "$nccl_sha" ] || fail "the $fx weights differ between two pipeline stages and world 1 on the GPU"
echo "$fx: bitwise equal across layouts on cuda:0: yes"
kill -TERM "${agent_pid[hf-b-$fx]}"; sleep 3
done
fi
if want 7; then
log "7. figures: SmolLM2-135M's architecture (random weights) training on cuda:0, fp32 and bf16, tokens/s and MFU (6·N·tokens/s over the H100's dense peak: 67 TFLOP/s fp32, 989 bf16), against PyTorch eager (transformers + AdamW) where this machine has transformers"
model="$bin/hf-smollm2"
[ -f "$model/config.json" ] || fail "no $model: pack where scripts/setup.sh --tests made SmolLM2"
batch=${GPU_HF_BATCH:-8}
ctx=${GPU_HF_CTX:-1024}
py "
import json
words = 'elastic training keeps going when a node dies Madrid Spain capital the of is step sample'.split()
with open('$work/smol.jsonl', 'w') as f:
    for i in range(20000):
        f.write(json.dumps({'text': ' '.join(words[(i * 7 + k * k * 3 + k) % len(words)] for k in range(24)) + f' {i}.'}) + '\\n')
"
ductile-worker tokenize --tokenizer "file://$model" --input "$work/smol.jsonl" --out "file://$work/smol.tok"
params=$(py "
import json; c = json.load(open('$model/config.json'))
d, l, v, f = c['hidden_size'], c['num_hidden_layers'], c['vocab_size'], c['intermediate_size']
h, kv = c['num_attention_heads'], c['num_key_value_heads']; hd = d // h
print(v * d + l * (d * hd * (2 * h + 2 * kv) + 3 * d * f + 2 * d) + d)")
echo "SmolLM2-135M: $params parameters, batch $batch x $ctx"
start_agent gpu-h --gpus 0
sleep 1
# (each precision unsharded, then fully sharded at world 1: the gathers and reduce-scatters on NCCL)
for run in fp32:none bf16:none fp32:full bf16:full; do
  prec=${run%:*} sharding=${run#*:}
  job=smol$prec$([ "$sharding" = full ] && echo full || true)
  cat >"$work/$job.toml" <<JOB
name = "$job"
min = 1
max = 1
desired = 1
[training]
model = "hf"
model_path = "file://$model"
init = "random"
dataset = "file://$work/smol.tok"
global_batch = $batch
lr = 1e-4
seed = 1
max_steps = 100000
comm = "nccl"
precision = "$prec"
sharding = "$sharding"
model_config = { ctx = $ctx }
JOB
  # a sharded job's state lives on its ranks: it needs a checkpoint location (none is taken
  # during the 20 s measured: the interval is past the run)
  if [ "$sharding" != none ]; then
    printf '[checkpoint]\nurl = "file://%s/ckpt-%s"\ninterval = 1000000\n' "$work" "$job" >>"$work/$job.toml"
  fi
  dctl submit "$work/$job.toml"
  wait_for 240 "job $job past step 10" "v['step'] >= 10"
  s0=$(field "v['step']"); t0=$(date +%s.%N)
  sleep 20
  s1=$(field "v['step']"); t1=$(date +%s.%N)
  py "
tok = ($s1 - $s0) * $batch * $ctx / ($t1 - $t0)
peak = {'fp32': 67e12, 'bf16': 989e12}['$prec']
print(f'ductile $prec, sharding $sharding: {tok:.0f} tokens/s ({$s1 - $s0} steps in {$t1 - $t0:.1f} s), MFU {6 * $params * tok / peak * 100:.1f}%')"
  dctl stop "$job" >/dev/null
  wait_for 60 "job $job stopped" "v['state'] in ('Stopped', 'Succeeded', 'Failed')"
done
kill -TERM "${agent_pid[gpu-h]}"; sleep 2
if python3 -c 'import transformers' 2>/dev/null; then
  for prec in fp32 bf16; do
    python3 - "$model" "$batch" "$ctx" "$prec" "$params" <<'PY'
import contextlib, sys, time, torch
from transformers import AutoConfig, AutoModelForCausalLM
d, batch, ctx, prec, params = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
cfg = AutoConfig.from_pretrained(d)
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().cuda().train()
opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
x = torch.randint(0, cfg.vocab_size, (batch, ctx + 1), device="cuda")
cast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if prec == "bf16" else contextlib.nullcontext
def step():
    with cast():
        logits = m(input_ids=x[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
for _ in range(5):
    step()
torch.cuda.synchronize()
t0 = time.perf_counter()
n = 30
for _ in range(n):
    step()
torch.cuda.synchronize()
tok = batch * ctx * n / (time.perf_counter() - t0)
peak = {"fp32": 67e12, "bf16": 989e12}[prec]
print(f"PyTorch eager {prec}: {tok:.0f} tokens/s, MFU {6 * params * tok / peak * 100:.1f}%")
PY
  done
else
  echo "PyTorch eager: this machine's python3 has no transformers module (not compared)"
fi
fi
if want 8; then
log "8. a PyTorch DDP script (examples/torchrun/ddp_train.py, NCCL on cuda:LOCAL_RANK) as a runtime = \"torchrun\" job: SIGKILL the script, the world restarts from its checkpoint, the job succeeds"
pyexe=$(command -v python3)
start_agent gpu-t --gpus 0 --allowed-commands "$pyexe" --allowed-paths "$work,$root/examples"
sleep 1
job=torchrun1
mkdir -p "$work/trckpt"
cat >"$work/$job.toml" <<JOB
name = "$job"
runtime = "torchrun"
command = ["$pyexe", "$root/examples/torchrun/ddp_train.py", "--backend", "nccl", "--steps", "400", "--step-sleep", "0.01", "--ckpt-dir", "$work/trckpt", "--step-log", "$work/tr-steps.log", "--sha-out", "$work/tr.sha", "--env-out", "$work/tr-env.json"]
min = 1
max = 1
desired = 1
restart_budget = 2
[program]
grace_s = 5
JOB
dctl submit "$work/$job.toml"
wait_for 180 "the script past step 100 on the GPU" "sum(1 for _ in open('$work/tr-steps.log')) >= 100 if __import__('os').path.exists('$work/tr-steps.log') else False"
victim=$(field "v['members'][0].get('program_pid')")
[ -n "$victim" ] && [ "$victim" != None ] || fail "no program_pid in the job's status"
t_kill=$(date +%s.%N)
kill -9 "$victim"
wait_for 120 "a step by the restarted script" "any(l.split()[1] != '$victim' and float(l.split()[0]) > $t_kill for l in open('$work/tr-steps.log'))"
back=$(py "print(min(float(l.split()[0]) for l in open('$work/tr-steps.log') if l.split()[1] != '$victim' and float(l.split()[0]) > $t_kill) - $t_kill)")
wait_for 300 "job $job succeeded" "v['state'] == 'Succeeded'"
echo "torchrun1: SIGKILL of the script (pid $victim): next step of the restarted world after $(py "print(round($back, 3))") s; $(grep -c . "$work/tr-steps.log") steps logged; final sha256 $(cat "$work/tr.sha")"
py "import json; e = json.load(open('$work/tr-env.json')); assert 'CUDA_VISIBLE_DEVICES' in e and 'LOCAL_RANK' in e, e" || fail "the script's environment lacks CUDA_VISIBLE_DEVICES or LOCAL_RANK"
dctl events "$job" | tail -3
kill -TERM "${agent_pid[gpu-t]}"; sleep 2
fi
if want 9; then
if [ ! -d "$bin/torchft-wheels" ]; then
  log "9. skipped: no torchft wheels were packed"
else
log "9. a TorchFT script as a runtime = \"torchft\" job: two replica groups on cuda:0, one group's program SIGKILLed and restarted alone, healed, equal weights"
# (a wheel is a zip: without pip, unpacking it into the directory installs it as --target does)
python3 -m pip install -q --no-index --no-deps --target "$work/pydeps" "$bin"/torchft-wheels/*.whl 2>/dev/null \
  || for w in "$bin"/torchft-wheels/*.whl; do python3 -m zipfile -e "$w" "$work/pydeps" || fail "cannot unpack $w"; done
PYTHONPATH="$work/pydeps" python3 -c "import torchft" || fail "the carried torchft does not import"
pyexe=$(command -v python3)
old_pythonpath=${PYTHONPATH:-}
export PYTHONPATH="$work/pydeps${PYTHONPATH:+:$PYTHONPATH}"
for a in gpu-f1 gpu-f2; do
  start_agent "$a" --gpus 0 --allowed-commands "$pyexe" --allowed-paths "$work,$root/examples"
done
export PYTHONPATH="$old_pythonpath"
sleep 1
job=torchft1
cat >"$work/$job.toml" <<JOB
name = "$job"
runtime = "torchft"
command = ["$pyexe", "$root/examples/torchft/train_ddp.py", "--device", "cuda", "--steps", "500", "--step-sleep", "0.01", "--min-replicas", "1", "--log", "$work/ft.log", "--sha-out", "$work/ft-g{group}.sha"]
min = 1
max = 2
desired = 2
restart_budget = 2
[program]
grace_s = 5
JOB
dctl submit "$work/$job.toml"
commits() { py "import os; print(open('$work/ft.log').read() if os.path.exists('$work/ft.log') else '')"; }
ftq() { commits | py "import sys; L=[dict(kv.split('=',1) for kv in l.split()[1:]) | {'t': float(l.split()[0])} for l in sys.stdin if l.strip()]; print($1)"; }
t0=$SECONDS
until [ "$(ftq "sum(1 for c in L if c['participants']=='2' and int(c['step'])>=50)")" -ge 2 ] 2>/dev/null; do
  [ $((SECONDS - t0)) -lt 240 ] || { tail -30 "$work"/agent-gpu-f*.log; fail "two groups committing together on the GPU: not within 240 s"; }
  sleep 0.5
done
victim=$(field "[m for m in v['members'] if m.get('replica_group') == 1][0].get('program_pid')")
other=$(field "[m for m in v['members'] if m.get('replica_group') == 0][0].get('program_pid')")
t_kill=$(date +%s.%N)
kill -9 "$victim"
t0=$SECONDS
until [ "$(ftq "sum(1 for c in L if c['group']=='1' and c['pid']!='$victim' and c['t']>$t_kill and c['healed']=='1')")" -ge 1 ] 2>/dev/null; do
  [ $((SECONDS - t0)) -lt 120 ] || { tail -30 "$work"/agent-gpu-f*.log; fail "group 1 back and healed: not within 120 s"; }
  sleep 0.2
done
back=$(ftq "round(min(c['t'] for c in L if c['group']=='1' and c['pid']!='$victim' and c['t']>$t_kill) - $t_kill, 3)")
surv=$(ftq "round(min([c['t'] for c in L if c['group']=='0' and c['t']>$t_kill and c['participants']=='1'] or [0]) - $t_kill, 3)")
wait_for 300 "job $job succeeded" "v['state'] == 'Succeeded'"
[ "$(ftq "sorted(set(c['pid'] for c in L if c['group']=='0'))")" = "['$other']" ] || fail "group 0 was restarted: $(ftq "sorted(set(c['pid'] for c in L if c['group']=='0'))")"
cmp -s "$work/ft-g0.sha" "$work/ft-g1.sha" || fail "the groups' weights differ: $(cat "$work"/ft-g*.sha)"
echo "torchft1: group 1's program (pid $victim) SIGKILLed on cuda:0: group 0 (pid $other, never restarted) committed alone ${surv} s later; group 1 restarted by ductile, first commit healed ${back} s after the kill; both groups ended with sha256 $(cat "$work/ft-g0.sha")"
dctl events "$job" | tail -4
for a in gpu-f1 gpu-f2; do kill -TERM "${agent_pid[$a]}"; done; sleep 2
fi
fi
if want 10; then
log "10. full sharding on NCCL at world 1: a deterministic GPT, unsharded and fully sharded (its worker SIGKILLed), bitwise equal"
start_agent gpu-s --gpus 0
sleep 1
job=unsharded1
det_job "$job" 1 1 150 ckpt-$job 25 2 'comm = "nccl"'
wait_for 300 "job $job succeeded" "v['state'] == 'Succeeded'"
plain_sha=$(field "v.get('final_weights_sha256')")
job=full1
det_job "$job" 1 1 150 ckpt-$job 25 2 'comm = "nccl"
sharding = "full"'
wait_for 180 "job $job past step 40 on the GPU" "v['step'] >= 40 and v['state'] == 'Running'"
victim=$(field "v['members'][0]['pid']")
echo "SIGKILL worker $victim at step $(field "v['step']")"
kill -9 "$victim"
wait_for 300 "job $job succeeded" "v['state'] == 'Succeeded'"
full_sha=$(field "v.get('final_weights_sha256')")
backend=$(dctl events "$job" --json | tail -1 | py "import json,sys; print(json.loads(sys.stdin.read()).get('backend'))")
told=$(grep -h "all-gathered over a shard group of 1 before its forward" "$work/agent-gpu-s.log" | tail -1)
echo "the sharded step on the GPU: ${told:-not logged}"
[ -n "$told" ] || fail "full1 did not run the gather/reduce-scatter path"
[ "$backend" = nccl ] || fail "full1 ran on $backend"
echo "unsharded1: sha256 $plain_sha; full1 (sharding = \"full\" at world 1 on NCCL, killed): sha256 $full_sha"
[ -n "$plain_sha" ] && [ "$plain_sha" = "$full_sha" ] || fail "the fully sharded weights differ from the unsharded run's on the GPU"
echo "full sharding at world 1 on NCCL: bitwise equal to the unsharded run: yes"
kill -TERM "${agent_pid[gpu-s]}"; sleep 2
fi
log "all GPU checks passed"

//! ductile-bench: benchmarks run by hand; each prints its figures.
//!
//! `ductile-bench control-plane`: simulated agents and jobs with progress traffic on a real
//! etcd and the daemon's leader loop in process (see [`control_plane`]).
//! `pipeline-recovery`, `bubble`, `pipeline-step`: the pipeline's re-plan recovery, schedule
//! bubble and steady-state step time (see [`pipeline`]).

mod control_plane;
mod counting;

use clap::{Parser, Subcommand};
use ductile_cluster::records::*;

#[derive(Parser)]
#[command(name = "ductile-bench")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The time every rank takes to plan a fully sharded job's re-cut at a resize by one
    /// (`dctl scale`), for a model of many tensors, and the share of the state that moves.
    ReshardPlan {
        #[arg(long, value_delimiter = ',', default_value = "8,64,256")]
        worlds: Vec<u32>,
        /// Tensors of the model (SmolLM2-135M's layers' shapes, repeated): 272 is its count.
        #[arg(long, default_value_t = 272)]
        tensors: usize,
        /// Timed plans per cell (the median is printed).
        #[arg(long, default_value_t = 5)]
        iters: usize,
        #[arg(long)]
        json: bool,
    },
    /// The dashboard against a job with a long history: the stored series' size, the page's
    /// weight, and headless Chromium's time to the first render.
    Dashboard {
        /// Steps of history.
        #[arg(long, default_value_t = 100_000)]
        steps: u64,
        /// Steps between two progress reports (rank 0 reports about once a second).
        #[arg(long, default_value_t = 1)]
        report_every: u64,
        /// Generations over the history (each a marker).
        #[arg(long, default_value_t = 20)]
        generations: u64,
        /// Ranks (each point carries every rank's step time).
        #[arg(long, default_value_t = 8)]
        ranks: u32,
        #[arg(long)]
        json: bool,
    },
    /// Re-formation latency and etcd requests per re-formation with many agents.
    ControlPlane {
        /// Simulated agents (one slot and one lease each).
        #[arg(long, default_value_t = 1000)]
        agents: usize,
        /// Lease TTL of every simulated agent, in seconds.
        #[arg(long, default_value_t = 6)]
        ttl: i64,
        /// Rounds (one lost agent each).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Jobs spread over the agents' slots.
        #[arg(long, default_value_t = 100)]
        jobs: usize,
        /// Progress reports per job per second (rank 0's, as the workers write them).
        #[arg(long, default_value_t = 1.0)]
        progress_hz: f64,
        /// Simulated agents that watch what agents watch (sampled: each one's events count).
        #[arg(long, default_value_t = 100)]
        watchers: usize,
        /// Use this etcd instead of starting one.
        #[arg(long)]
        etcd: Option<String>,
        /// Print one JSON object per round as well.
        #[arg(long)]
        json: bool,
    },
    /// Bus bandwidth of the TCP backend's all-reduce (ring and ordered modes) and of the sharded
    /// step's all-gather and reduce-scatter, one process per rank, with the machine's
    /// loopback-TCP and memcpy ceilings.
    Allreduce {
        #[arg(long, value_delimiter = ',', default_value = "2,4")]
        worlds: Vec<u32>,
        #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
        sizes_mib: Vec<u64>,
        /// Timed iterations per cell (after one warm-up).
        #[arg(long, default_value_t = 7)]
        iters: usize,
        /// One JSON object per cell instead of the table.
        #[arg(long)]
        json: bool,
        /// Run the mesh over TLS (a job's `mesh_tls`), with certificates made for the run.
        #[arg(long)]
        mesh_tls: bool,
        /// Also PyTorch's gloo all-reduce at the same worlds and sizes (the set-up's torch venv,
        /// DUCTILE_TORCH_PYTHON), in the same sitting.
        #[arg(long)]
        gloo: bool,
    },
    /// What the mesh's authenticated hello costs per connection, and a mesh's formation time.
    MeshHello {
        #[arg(long, default_value_t = 200)]
        rounds: usize,
        #[arg(long, default_value_t = 4)]
        world: u32,
    },
    /// A PyTorch DDP script (examples/torchrun/ddp_train.py, gloo) at 4 CPU workers: SIGKILL
    /// a worker, time to the restarted world's next step, under torchrun itself and under
    /// ductile's runtime = "torchrun"; and ductile's dctl scale to the first step at the new size.
    TorchrunRecovery {
        #[arg(long, default_value_t = 8)]
        rounds: usize,
        /// Measure ductile only.
        #[arg(long)]
        skip_torchrun: bool,
    },
    /// Hugging Face's Trainer (examples/transformers/trainer_lm.py, gloo) at 2 CPU workers:
    /// SIGKILL a worker, time to the restarted world's next step, under torchrun itself and
    /// under ductile's runtime = "torchrun" with the transformers integration.
    TrainerRecovery {
        #[arg(long, default_value_t = 4)]
        rounds: usize,
    },
    /// A Keras model.fit under MultiWorkerMirroredStrategy (examples/tensorflow/keras_fit.py)
    /// at 2 CPU workers: SIGKILL a worker, time to the restarted world's next step, restarted
    /// by hand (at once, fresh TF_CONFIG) and under ductile's runtime = "tf".
    TfRecovery {
        #[arg(long, default_value_t = 4)]
        rounds: usize,
        /// The ductile job's min (2: the world waits for a failed slot's restart instead of
        /// re-forming without it first).
        #[arg(long, default_value_t = 1)]
        min: u32,
    },
    /// TorchFT replica groups (examples/torchft/train_ddp.py, torchft 0.2.0, gloo) against
    /// TorchFT's own torchft_lighthouse and against ductiled's lighthouse, side by side: a group
    /// SIGKILLed and relaunched, time to the survivors' next commit and to the relaunched
    /// group's first (healed) commit; then the lighthouse (ductile: its leader) SIGKILLed.
    TorchftRecovery {
        #[arg(long, default_value_t = 6)]
        rounds: usize,
        /// The script's collective and manager timeout (`--timeout-s`), for both lighthouses.
        #[arg(long, default_value_t = 5.0)]
        timeout_s: f64,
    },
    /// Recovery time of elastic training: worker kills and node losses, 4 CPU workers.
    Recovery {
        #[arg(long, default_value_t = 10)]
        rounds: usize,
        #[arg(long, default_value_t = 4)]
        node_rounds: usize,
        /// Rounds that SIGSTOP a worker (alive but stuck) instead of killing it.
        #[arg(long, default_value_t = 3)]
        stop_rounds: usize,
    },
    /// `ductile-worker tokenize` against Python tokenizers' batch encoding of the same JSONL
    /// (the Python sources of the test venv, cut into ~4 KiB documents): tokens/s, peak memory.
    Tokenize {
        /// A directory with tokenizer.json (default: set-up's SmolLM2-135M).
        #[arg(long)]
        model: Option<std::path::PathBuf>,
        #[arg(long, default_value_t = 32)]
        mib: u64,
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// Steady step time reading a sharded corpus from local files, then from the S3 test
    /// server, with each rank's data wait.
    DataStep {
        #[arg(long, default_value_t = 4_000_000)]
        tokens: u64,
        #[arg(long, default_value_t = 262_144)]
        shard_tokens: u64,
        #[arg(long, default_value_t = 2)]
        world: u32,
        /// Rank reports (one per 2 s) measured.
        #[arg(long, default_value_t = 8)]
        reports: usize,
        /// Runs in this order: file, s3, or file+s3 (files, the S3 server running idle).
        #[arg(long, value_delimiter = ',', default_value = "file,s3,file,s3")]
        stores: Vec<String>,
    },
    /// Step time of the elastic loop against a bare tch loop with the same all-reduce.
    DpStep {
        #[arg(long, default_value_t = 300)]
        steps: u64,
    },
    /// Tokens/s training a Hugging Face model directory (default: set-up's SmolLM2-135M) at
    /// world 1 and data-parallel 2 against PyTorch eager (transformers + AdamW) with 1 and 2
    /// threads, same batch and context.
    HfStep {
        #[arg(long)]
        model: Option<std::path::PathBuf>,
        #[arg(long, default_value_t = 4)]
        batch: u32,
        #[arg(long, default_value_t = 128)]
        ctx: u32,
        /// Progress reports (steps) measured.
        #[arg(long, default_value_t = 8)]
        reports: usize,
        /// `precision` of both sides: fp32, or bf16 (PyTorch: autocast to bfloat16).
        #[arg(long, default_value = "fp32")]
        precision: String,
        /// `activation_checkpointing` of both sides: none, or full (PyTorch: transformers'
        /// gradient checkpointing).
        #[arg(long, default_value = "none")]
        activation_checkpointing: String,
    },
    /// Data parallel (`--world`, default 2) against PyTorch DDP (gloo) on a Hugging Face model
    /// (default: the set-up's SmolLM2-135M), fp32, in alternating rounds: tokens/s and peak
    /// resident memory per rank, with the median of the paired ratios; `--baseline-bin-dir`
    /// adds another build's binaries (a before/after in the same sitting); `--sharding
    /// optimizer` runs ductile's ZeRO-1 against DDP with PyTorch's ZeroRedundancyOptimizer,
    /// `--sharding full` ductile's full sharding against PyTorch FSDP2.
    /// SmolLM2-360M's architecture (random init: the set-up's SmolLM2-135M gives the config to
    /// widen and the tokenizer) fully sharded at world 4 (four replicas do not fit this
    /// machine): peak resident memory per rank, then a SIGKILL, a `dctl scale 3` and a
    /// `dctl scale 4`, each with the time to the next first step.
    FsdpElastic {
        #[arg(long)]
        model: Option<std::path::PathBuf>,
        #[arg(long, default_value_t = 64)]
        ctx: u32,
        /// `360m` (SmolLM2-360M's architecture, the default) or `135m` (the set-up's model's
        /// own architecture: a quarter of the memory, for runs beside others).
        #[arg(long, default_value = "360m")]
        architecture: String,
        /// Whether the job keeps buddy copies (`training.buddy_copies`, ductile's default): the
        /// SIGKILL's shard from its copy, or with `false` from the last commit.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        buddy_copies: bool,
    },
    DdpStep {
        #[arg(long)]
        model: Option<std::path::PathBuf>,
        #[arg(long, default_value_t = 2)]
        world: u32,
        /// `none`; `optimizer`: ductile's ZeRO-1 against DDP with PyTorch's
        /// ZeroRedundancyOptimizer; `full`: ductile's full sharding against FSDP2;
        /// `full-kept`: both with the gathered parameters kept for the backward
        /// (`reshard_after_forward` false); `full` and `full-kept` without ductile's buddy
        /// copies (FSDP2 keeps none), `full-buddy` with them (ductile's default).
        #[arg(long, default_value = "none")]
        sharding: String,
        #[arg(long, default_value_t = 4)]
        batch: u32,
        #[arg(long, default_value_t = 128)]
        ctx: u32,
        /// Progress reports (steps) measured per round.
        #[arg(long, default_value_t = 4)]
        reports: usize,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long)]
        baseline_bin_dir: Option<std::path::PathBuf>,
        /// Both sides checkpoint every N steps (ductile to a file:// URL, PyTorch with
        /// torch.distributed.checkpoint), so the peak memory holds a save; 0: none.
        #[arg(long, default_value_t = 0)]
        checkpoint_every: u32,
    },
    /// Bytes each rank reads loading a Hugging Face model directory by plan at tensor_parallel 2
    /// and pipeline_parallel 2, against the bytes it holds.
    HfLoad {
        #[arg(long)]
        model: Option<std::path::PathBuf>,
    },
    /// (internal) one rank of `dp-step`'s bare loop.
    #[command(hide = true)]
    DpBareRank {
        etcd: String,
        data: String,
        rank: u32,
        steps: u64,
    },
    /// Checkpoint save stall, upload and restore throughput against plain object_store calls.
    Checkpoint {
        /// State size, MiB (f32 tensors of 4096 × 4096).
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        #[arg(long, value_delimiter = ',', default_value = "s3,file")]
        stores: Vec<String>,
        #[arg(long, default_value_t = 3)]
        iters: usize,
    },
    /// NCCL on this machine's GPU: first init, re-init, abort, abort + re-init (ductile's
    /// re-formation), all-reduce time and bus bandwidth; self-tests every collective on CUDA
    /// tensors (NCCL and the TCP backend's pinned staging). Says what it skipped without a GPU.
    Nccl {
        #[arg(long, default_value_t = 10)]
        iters: usize,
        #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
        sizes_mib: Vec<u64>,
    },
    /// CUDA step time of the elastic loop against a bare tch CUDA loop, and the checkpoint
    /// stall and staging bandwidth against one pinned device→host copy.
    GpuStep {
        #[arg(long, default_value_t = 200)]
        steps: u64,
    },
    /// The chaos soak's long profile: a local cluster trains a deterministic job with
    /// checkpoints while a seeded schedule of faults hits it (store 503s in a cold start and on
    /// the commits, a rollback whose supersede meets 503s among them); then an async job (member
    /// 0 killed or cut short mid-decision) and a streaming DiLoCo job (a member gone between
    /// exchanges); then every sample, commit, restore and bit is checked (see
    /// `ductile_tests::chaos`). Exits 1 on a violation.
    Chaos {
        #[arg(long, default_value_t = 200)]
        faults: usize,
        /// The schedule's seed (default: from the clock; printed first, to replay a run).
        #[arg(long)]
        seed: Option<u64>,
        /// Training steps (default: enough to outlast the faults).
        #[arg(long)]
        steps: Option<u64>,
        /// Faults in each of the async and streaming DiLoCo phases (default: a tenth of
        /// --faults, at least 3; 0 skips them).
        #[arg(long)]
        side_faults: Option<usize>,
        /// Run only the uninterrupted reference, this many times (the soak's default 20,000
        /// steps unless --steps), each on a fresh quiet cluster, and compare their final
        /// weights: the determinism check of the soak's reference pair.
        #[arg(long)]
        reference_runs: Option<usize>,
        /// With --reference-runs: SIGKILL a worker of each run once it passes this step (rank
        /// 0 in even runs, rank 1 in odd ones), to compare a re-formed run's bits.
        #[arg(long)]
        kill_at: Option<u64>,
    },
    /// DiLoCo and async against allreduce (3 CPU workers, a GPT): bytes sent per trained sample, the
    /// final weights' loss on a fixed set of 256 samples at equal samples, and samples per
    /// second healthy and with one worker slowed.
    Diloco {
        /// Training steps of 32 samples per run.
        #[arg(long, default_value_t = 1500)]
        steps: u64,
        /// DiLoCo's inner steps per round (H).
        #[arg(long, default_value_t = 50)]
        inner_steps: u32,
        /// The async mode's staleness bound.
        #[arg(long, default_value_t = 2)]
        staleness: u32,
        /// Only these modes (allreduce, diloco, diloco-int8, diloco-f4 (streaming, 4
        /// fragments), async; comma-separated).
        #[arg(long, value_delimiter = ',')]
        modes: Vec<String>,
        /// How much slower the slowed worker computes.
        #[arg(long, default_value_t = 3.0)]
        slow: f64,
        /// Print one JSON object per run as well.
        #[arg(long)]
        json: bool,
    },
    /// A live re-cut of row-sharded state over loopback (4 ranks in this process → 3, as a
    /// fully sharded job's survivors re-cut after a loss): the time and the process's peak
    /// resident growth over the old and new state, with the moves in rounds of `--chunk-mib`
    /// per pair of ranks against all in one round, in the same sitting; and loopback's time to
    /// move a quarter of the state (one rank's share) as one buffer, for scale.
    ReshardTransfer {
        /// The state's size in MiB (f32, 8 tensors of 1024 columns).
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        #[arg(long, default_value_t = 64)]
        chunk_mib: u64,
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Also print the bytes moved against the minimum as JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// A fully sharded job's new process making its seed (SmolLM2-360M's architecture): whole
    /// and then cut to its rows, as before, against made in its rows unit by unit, in the same
    /// sitting: each one's peak resident growth and time.
    SeedRows {
        /// The shard group's size (the rows kept: the last place's).
        #[arg(long, default_value_t = 4)]
        world: u32,
        /// Decoder layers (SmolLM2-360M has 32).
        #[arg(long, default_value_t = 32)]
        layers: i64,
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// One make in this process ("whole" or "rows"), printed as JSON (what the command
        /// runs in a process of its own per make).
        #[arg(long, hide = true)]
        arm: Option<String>,
    },
    /// Pipeline re-plan recovery: SIGKILL one of 4 workers of a pipeline job → first step in
    /// the new layout, with detection, planning, communicator formation and layer movement
    /// timed apart.
    PipelineRecovery {
        #[arg(long, default_value_t = 10)]
        rounds: usize,
        /// The GPT's width (4 blocks): 64 is the jobs' default, larger moves more bytes.
        #[arg(long, default_value_t = 64)]
        d_model: u32,
        /// Run the job as `strategy = "hybrid"` with this tensor_parallel (and one stage):
        /// the kill then re-plans tensor groups instead of stages.
        #[arg(long, default_value_t = 1)]
        tensor_parallel: u32,
    },
    /// Full sharding under tensor groups (2D FSDP + TP): a GPT at world 4 as dp2 × tp2,
    /// unsharded against fully sharded over each tensor place's 2 replicas, in alternating
    /// rounds: state bytes and peak resident memory per rank, samples/s, medians and the
    /// median of the paired ratios.
    FsdpTp {
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long, default_value_t = 256)]
        d_model: u32,
        #[arg(long, default_value_t = 8)]
        n_layer: u32,
        /// Progress reports (steps) measured per round.
        #[arg(long, default_value_t = 4)]
        reports: usize,
        /// Agents (nodes) the 4 ranks are spread over: 1, 2 (two ranks a node) or 4 (one a
        /// node: by the workers' rule each node then has a core to spare, so the fully
        /// sharded step's gathers and reductions run on a communication thread).
        #[arg(long, default_value_t = 2)]
        nodes: u32,
    },
    /// The pipeline schedules' measured idle fraction per stage against (p−1)/(m+p−1), with a
    /// calibrated sleep per layer over the TCP backend's point-to-point sends.
    Bubble {
        #[arg(long, value_delimiter = ',', default_value = "2,3,4")]
        stages: Vec<u32>,
        #[arg(long, value_delimiter = ',', default_value = "4,8,16")]
        micro_batches: Vec<u32>,
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "gpipe,1f1b,interleaved-1f1b"
        )]
        schedules: Vec<ductile_strategies::pipeline::Schedule>,
        /// Layers of the sleep model (split evenly over the stages by the planner's balance).
        #[arg(long, default_value_t = 12)]
        layers: u32,
        /// Timed steps per cell (after one warm-up).
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// The GPT block each layer's sleep is calibrated on.
        #[arg(long, default_value_t = 256)]
        d_model: i64,
        #[arg(long, default_value_t = 64)]
        ctx: i64,
    },
    /// Steady-state step time of a GPT at world 4: data parallel, 2 stages (also clipped by
    /// global norm), 4 stages.
    PipelineStep {
        #[arg(long, default_value_t = 8)]
        micro_batches: u32,
    },
    /// Step time of tensor parallelism against data parallelism for one GPT, batch and world
    /// (ranks are threads of this process with a TCP mesh on loopback).
    TpStep {
        #[arg(long, default_value_t = 2)]
        world: u32,
        #[arg(long, default_value_t = 256)]
        d_model: i64,
        #[arg(long, default_value_t = 4)]
        n_layer: i64,
        #[arg(long, default_value_t = 8)]
        n_head: i64,
        #[arg(long, default_value_t = 64)]
        ctx: i64,
        #[arg(long, default_value_t = 16)]
        batch: i64,
        /// Timed steps per mode (after one warm-up).
        #[arg(long, default_value_t = 10)]
        steps: usize,
        #[arg(long)]
        json: bool,
    },
    /// A checkpoint written by tensor groups restored into other layouts: bytes each rank reads
    /// from the store against the state it holds.
    RestoreLayouts {
        #[arg(long, default_value_t = 256)]
        d_model: u32,
    },
    /// (internal) one rank of `allreduce`.
    #[command(hide = true)]
    AllreduceRank {
        etcd: String,
        world: u32,
        rank: u32,
        #[arg(long, value_delimiter = ',')]
        sizes_mib: Vec<u64>,
        #[arg(long)]
        iters: usize,
    },
}

/// `NAME: median X s (min, max) over N round(s), F without recovery` (or that none recovered).
fn recovery_summary(name: &str, xs: &[f64], failed: usize) -> String {
    let mut v = xs.to_vec();
    if v.is_empty() {
        return format!("{name}: no recovery in {failed} round(s)");
    }
    let max = v.iter().cloned().fold(0.0, f64::max);
    let min = v.iter().cloned().fold(f64::MAX, f64::min);
    format!(
        "{name}: median {:.2} s (min {min:.2}, max {max:.2}) over {} round(s), {failed} without recovery",
        median(&mut v),
        xs.len()
    )
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

mod allreduce;
mod checkpoint;
mod dashboard;
mod data;
mod diloco;
mod gpu;
mod hf;
mod pipeline;
mod programs;
mod reshard;
mod tensor;
mod torchft;
mod torchrun;
mod training;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    ductile_cluster::service::init_logging(ductile_cluster::service::LogFormat::Plain);
    match Cli::parse().cmd {
        Cmd::ControlPlane {
            agents,
            ttl,
            rounds,
            jobs,
            progress_hz,
            watchers,
            etcd,
            json,
        } => {
            control_plane::run(control_plane::Args {
                agents,
                jobs,
                progress_hz,
                watchers,
                ttl,
                rounds,
                etcd,
                json,
            })
            .await
        }
        Cmd::MeshHello { rounds, world } => allreduce::hello(rounds, world).await,
        Cmd::Allreduce {
            worlds,
            sizes_mib,
            iters,
            json,
            mesh_tls,
            gloo,
        } => allreduce::run(&worlds, &sizes_mib, iters, json, mesh_tls, gloo).await,
        Cmd::Recovery {
            rounds,
            node_rounds,
            stop_rounds,
        } => training::recovery(rounds, node_rounds, stop_rounds).await,
        Cmd::DpStep { steps } => training::dp_step(steps).await,
        Cmd::ReshardPlan {
            worlds,
            tensors,
            iters,
            json,
        } => reshard::run(&worlds, tensors, iters, json),
        Cmd::TorchrunRecovery {
            rounds,
            skip_torchrun,
        } => torchrun::recovery(rounds, skip_torchrun).await,
        Cmd::TrainerRecovery { rounds } => programs::trainer(rounds).await,
        Cmd::TfRecovery { rounds, min } => programs::tf(rounds, min).await,
        Cmd::TorchftRecovery { rounds, timeout_s } => torchft::recovery(rounds, timeout_s).await,
        Cmd::Tokenize { model, mib, runs } => data::tokenize(&smollm2_or(model)?, mib, runs),
        Cmd::DataStep {
            tokens,
            shard_tokens,
            world,
            reports,
            stores,
        } => data::step(tokens, shard_tokens, world, reports, &stores).await,
        Cmd::HfStep {
            model,
            batch,
            ctx,
            reports,
            precision,
            activation_checkpointing,
        } => {
            hf::hf_step(
                &smollm2_or(model)?,
                batch,
                ctx,
                reports,
                &precision,
                &activation_checkpointing,
            )
            .await
        }
        Cmd::HfLoad { model } => hf::hf_load(&smollm2_or(model)?).await,
        Cmd::FsdpElastic {
            model,
            ctx,
            architecture,
            buddy_copies,
        } => hf::fsdp_elastic(&smollm2_or(model)?, ctx, &architecture, buddy_copies).await,
        Cmd::DdpStep {
            model,
            world,
            sharding,
            batch,
            ctx,
            reports,
            rounds,
            baseline_bin_dir,
            checkpoint_every,
        } => {
            hf::ddp_step(
                &smollm2_or(model)?,
                world,
                batch,
                ctx,
                reports,
                rounds,
                baseline_bin_dir.as_deref(),
                &sharding,
                checkpoint_every,
            )
            .await
        }
        Cmd::RestoreLayouts { d_model } => tensor::restore_layouts(d_model).await,
        Cmd::ReshardTransfer {
            mib,
            chunk_mib,
            runs,
            json,
        } => tensor::reshard_transfer(mib, chunk_mib, runs, json).await,
        Cmd::SeedRows {
            world,
            layers,
            runs,
            arm,
        } => tensor::seed_rows(world, layers, runs, arm),
        Cmd::TpStep {
            world,
            d_model,
            n_layer,
            n_head,
            ctx,
            batch,
            steps,
            json,
        } => {
            tensor::tp_step(tensor::Args {
                world,
                d_model,
                n_layer,
                n_head,
                ctx,
                batch,
                steps,
                json,
            })
            .await
        }
        Cmd::Chaos {
            steps,
            reference_runs: Some(runs),
            kill_at,
            ..
        } => {
            let steps = steps.unwrap_or(20_000);
            let out = std::thread::spawn(move || {
                let mut hashes = Vec::new();
                for run in 0..runs {
                    let t0 = std::time::Instant::now();
                    let kill = kill_at.map(|s| (s, run as u32 % 2));
                    let (sha, generations) = ductile_tests::chaos::reference_killed(steps, kill);
                    let sha = sha.unwrap_or_else(|| "(no hash)".into());
                    println!(
                        "reference run {run}: {} in {:.0} s; generations: {}",
                        &sha[..sha.len().min(16)],
                        t0.elapsed().as_secs_f64(),
                        generations.join(", ")
                    );
                    hashes.push(sha);
                }
                hashes
            })
            .join()
            .map_err(|_| anyhow::anyhow!("a reference run panicked"))?;
            let mut distinct = out.clone();
            distinct.sort();
            distinct.dedup();
            println!(
                "{runs} reference runs of {steps} steps: {} distinct final weights",
                distinct.len()
            );
            if distinct.len() > 1 {
                std::process::exit(1);
            }
            Ok(())
        }
        Cmd::Chaos {
            faults,
            seed,
            steps,
            side_faults,
            reference_runs: None,
            kill_at,
        } => {
            anyhow::ensure!(kill_at.is_none(), "--kill-at goes with --reference-runs");
            let cfg = ductile_tests::chaos::Config {
                seed: seed.unwrap_or_else(now_ms),
                faults,
                steps: steps.unwrap_or(faults as u64 * 1_000 + 2_000),
                side_faults: side_faults.unwrap_or((faults / 10).max(3)),
            };
            // the soak drives its own runtime: off this one's threads
            let report = std::thread::spawn(move || ductile_tests::chaos::run(&cfg))
                .join()
                .map_err(|_| anyhow::anyhow!("the chaos soak panicked"))?;
            print!("{}", report.summary());
            if !report.violations.is_empty() {
                std::process::exit(1);
            }
            Ok(())
        }
        Cmd::PipelineRecovery {
            rounds,
            d_model,
            tensor_parallel,
        } => pipeline::recovery(rounds, d_model, tensor_parallel).await,
        Cmd::FsdpTp {
            rounds,
            d_model,
            n_layer,
            reports,
            nodes,
        } => pipeline::fsdp_tp(rounds, d_model, n_layer, reports, nodes).await,
        Cmd::Bubble {
            stages,
            micro_batches,
            schedules,
            layers,
            steps,
            d_model,
            ctx,
        } => {
            pipeline::bubble(
                &stages,
                &micro_batches,
                &schedules,
                layers,
                steps,
                (d_model, ctx),
            )
            .await
        }
        Cmd::PipelineStep { micro_batches } => pipeline::step(micro_batches).await,
        Cmd::Nccl { iters, sizes_mib } => gpu::nccl(iters, &sizes_mib).await,
        Cmd::GpuStep { steps } => training::gpu_step(steps).await,
        Cmd::Dashboard {
            steps,
            report_every,
            generations,
            ranks,
            json,
        } => {
            dashboard::run(dashboard::Args {
                steps,
                report_every,
                generations,
                ranks,
                json,
            })
            .await
        }
        Cmd::Diloco {
            steps,
            inner_steps,
            staleness,
            modes,
            slow,
            json,
        } => diloco::run(diloco::Args {
            steps,
            inner_steps,
            staleness,
            modes,
            slow,
            json,
        }),
        Cmd::Checkpoint { mib, stores, iters } => checkpoint::run(mib, &stores, iters).await,
        Cmd::DpBareRank {
            etcd,
            data,
            rank,
            steps,
        } => training::dp_bare_rank(&etcd, &data, rank, steps).await,
        Cmd::AllreduceRank {
            etcd,
            world,
            rank,
            sizes_mib,
            iters,
        } => allreduce::rank(&etcd, world, rank, &sizes_mib, iters).await,
    }
}

/// `--model`, else the SmolLM2-135M directory scripts/setup.sh converts.
fn smollm2_or(model: Option<std::path::PathBuf>) -> anyhow::Result<std::path::PathBuf> {
    match model {
        Some(m) => Ok(std::fs::canonicalize(&m)
            .map_err(|e| anyhow::anyhow!("--model {}: {e}", m.display()))?),
        None => std::env::var("DUCTILE_SMOLLM2")
            .map(std::path::PathBuf::from)
            .map_err(|_| anyhow::anyhow!("give --model DIR, or run scripts/setup.sh and source its env.sh (DUCTILE_SMOLLM2)")),
    }
}

//! Pipeline benchmarks.
//!
//! `ductile-bench pipeline-recovery`: a 4-worker pipeline job; SIGKILL one worker and time
//! the first completed step in the new layout, split into phases from the records the leader
//! and the workers leave in etcd (the generation's `published_at_ms` and `plan_us`, each
//! rank's join record: `seen_at_ms`, `formed_at_ms`, `joined_at_ms`, `received_bytes`).
//!
//! `ductile-bench bubble`: the schedules' idle fraction per stage, measured on threads that
//! run the product's schedules ([`stage_ops`]) over the TCP backend's point-to-point sends,
//! against the formula. Compute is a sleep per layer, calibrated on the GPT block the jobs
//! train (2 cores cannot run 4 stages side by side without the stages stealing each other's
//! core, which would measure the scheduler of the OS rather than the pipeline's).
//!
//! `ductile-bench pipeline-step`: steady-state step time of the same GPT at world 4 run data
//! parallel, as dp2×pp2 and as pp4.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use ductile_cluster::records::now_ms;
use ductile_comm::{Communicator, ReduceOp, TcpComm};
use ductile_strategies::pipeline::{
    balance, bubble_fraction, needs, sends, stage_ops, Op, Schedule,
};
use ductile_tests::*;
use ductile_worker::train::pipe::{Mailbox, Outbox};
use tch::{Device, Kind, Tensor};

use crate::median;
use crate::training::{first_step, generation, throughput};

/// The GPT the pipeline benchmarks train: 4 blocks, so 6 units (embeddings, blocks, head).
const GPT4: &str = "[training.model_config]\nn_layer = 4\n";

fn pipeline_job(data: &str, pp: &str, d_model: u32) -> String {
    format!(
        "{}max_steps = 1000000\nstrategy = \"pipeline\"\npipeline_parallel = {pp}\n{GPT4}d_model = {d_model}\n",
        training_toml("bench", 1, 4, 4, "gpt", data, "restart_budget = 1000")
    )
}

/// `ductile-bench fsdp-tp` (see its help): rows of (state bytes, peak MiB, samples/s) per
/// rank's largest, for "none" and "full", one cluster per run, its 4 slots on `nodes` agents.
pub async fn fsdp_tp(
    rounds: usize,
    d_model: u32,
    n_layer: u32,
    reports: usize,
    nodes: u32,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        matches!(nodes, 1 | 2 | 4),
        "--nodes {nodes}: the 4 ranks spread evenly over 1, 2 or 4 agents"
    );
    let levels = ["none", "full"];
    let mut rows: Vec<Vec<[f64; 3]>> = vec![Vec::new(); levels.len()];
    for round in 0..rounds {
        for (i, level) in levels.iter().enumerate() {
            let c = Cluster::start(Spec::default().agents(nodes as usize, 4 / nodes));
            let data = synth(c.dir.path(), "tokens", 200_000);
            c.submit(&format!(
                "{}max_steps = 1000000\nstrategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1\nsharding = \"{level}\"\n[training.model_config]\nn_layer = {n_layer}\nd_model = {d_model}\n[checkpoint]\nurl = \"file://{}/ck\"\ninterval = 1000000\n",
                training_toml("bench", 2, 4, 4, "gpt", &data, "restart_budget = 10"),
                c.dir.path().display()
            ));
            let v = c.wait_world("bench", 4, Duration::from_secs(120));
            let mut sps = throughput(&c, 3, reports, Duration::from_secs(900)).await;
            anyhow::ensure!(!sps.is_empty(), "no throughput reported:\n{}", c.logs());
            let state = c
                .joins("bench", v.generation, 4)
                .await
                .iter()
                .map(|j| j.state_bytes as f64)
                .fold(0.0, f64::max);
            let peak = crate::hf::peaks_mib(&c).into_iter().fold(0.0, f64::max);
            let row = [state, peak, median(&mut sps)];
            println!(
                "fsdp-tp round {round}: {} sharding {level}: state {:.1} MiB, peak {:.0} MiB per rank, {:.2} samples/s",
                v.layout.map(|l| l.to_string()).unwrap_or_default(),
                row[0] / (1 << 20) as f64,
                row[1],
                row[2]
            );
            rows[i].push(row);
        }
    }
    let med = |r: &[[f64; 3]], k: usize| median(&mut r.iter().map(|x| x[k]).collect::<Vec<_>>());
    for (level, r) in levels.iter().zip(&rows) {
        println!(
            "fsdp-tp, GPT d_model {d_model} n_layer {n_layer}, world 4 (dp2 × tp2) on {nodes} nodes, median of {rounds}: sharding {level}: state {:.1} MiB, peak {:.0} MiB per rank, {:.2} samples/s",
            med(r, 0) / (1 << 20) as f64,
            med(r, 1),
            med(r, 2)
        );
    }
    let ratio = |k: usize| {
        median(
            &mut rows[1]
                .iter()
                .zip(&rows[0])
                .map(|(a, b)| a[k] / b[k])
                .collect::<Vec<_>>(),
        )
    };
    println!(
        "fsdp-tp: full / none, median of paired ratios: state {:.3}, peak memory {:.3}, samples/s {:.3}",
        ratio(0),
        ratio(1),
        ratio(2)
    );
    Ok(())
}

pub async fn recovery(rounds: usize, d_model: u32, tp: u32) -> anyhow::Result<()> {
    let c = Cluster::start(Spec {
        restart_backoff_ms: 3000,
        lease_ttl: 2,
        ..Spec::default().agents(2, 2)
    });
    let data = synth(c.dir.path(), "tokens", 200_000);
    if tp > 1 {
        c.submit(&format!(
            "{}max_steps = 1000000\nstrategy = \"hybrid\"\ntensor_parallel = {tp}\npipeline_parallel = 1\n{GPT4}d_model = {d_model}\n",
            training_toml("bench", 1, 4, 4, "gpt", &data, "restart_budget = 1000")
        ));
    } else {
        c.submit(&pipeline_job(&data, "\"auto\"", d_model));
    }
    let cols = ["total", "detect", "plan", "form", "move", "first step"];
    let mut phases: Vec<Vec<f64>> = vec![Vec::new(); cols.len()];
    println!(
        "{:<6} {:<24} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>10}",
        "round", "layout", "total s", "detect", "plan ms", "form", "move", "first step", "moved"
    );
    for round in 0..rounds {
        let v = c.wait_world("bench", 4, Duration::from_secs(90));
        let g = v.generation;
        first_step(&c, g).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let victim = v.members[round % 4].pid.unwrap();
        let t0 = now_ms();
        unsafe { libc::kill(victim as i32, libc::SIGKILL) };
        let t_first = first_step(&c, g + 1).await;
        let before = generation(&c, g).await?;
        let gen = generation(&c, g + 1).await?;
        let js = c.joins("bench", gen.number, gen.world_size).await;
        let formed = js.iter().map(|j| j.formed_at_ms).max().unwrap_or(0);
        let joined = js.iter().map(|j| j.joined_at_ms).max().unwrap_or(0);
        let moved: u64 = js.iter().map(|j| j.received_bytes).sum();
        let plan = gen.plan_us as f64 / 1e6;
        let s = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1000.0;
        let row = [
            s(t0, t_first),
            s(t0, gen.published_at_ms) - plan,
            plan,
            s(gen.published_at_ms, formed),
            s(formed, joined),
            s(joined, t_first),
        ];
        println!(
            "{round:<6} {:<24} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>10.3} {:>8.1} KiB",
            format!("{} → {}", before.layout, gen.layout),
            row[0],
            row[1],
            row[2] * 1000.0,
            row[3],
            row[4],
            row[5],
            moved as f64 / 1024.0
        );
        for (i, x) in row.iter().enumerate() {
            phases[i].push(*x);
        }
    }
    let med: Vec<String> = cols
        .iter()
        .zip(&phases)
        .map(|(n, v)| match *n {
            "plan" => format!("plan {:.3} ms", median(&mut v.clone()) * 1000.0),
            _ => format!("{n} {:.3} s", median(&mut v.clone())),
        })
        .collect();
    println!(
        "\nre-plan recovery, 4 CPU workers, GPT n_layer 4 d_model {d_model}, {}: worker SIGKILL → first step in the new layout, median over {rounds}: {}",
        if tp > 1 { format!("hybrid tensor_parallel {tp}") } else { "pipeline_parallel auto".into() },
        med.join(", ")
    );
    Ok(())
}

/// Per-layer forward and backward seconds of one GPT block (`d_model`, 4 heads, `ctx`) for
/// `mb` samples, on one thread; and the shape of the activation a stage sends.
fn calibrate(data: &str, mb: i64, d_model: i64, ctx_len: i64) -> (f64, f64, Vec<i64>) {
    let spec: ductile_cluster::records::TrainingSpec = serde_json::from_value(
        serde_json::json!({"model": "gpt", "dataset": data, "global_batch": 32, "lr": 3e-3, "seed": 7,
            "model_config": {"n_layer": 1, "d_model": d_model, "ctx": ctx_len}}),
    )
    .unwrap();
    use ductile_worker::{data::*, model::*};
    tch::set_num_threads(1);
    let rt = tokio::runtime::Handle::current();
    let ds = Dataset::open(&spec.dataset, spec.model, ctx(&spec), &rt).unwrap();
    let model = Model::new(&spec, &ds, Device::Cpu).unwrap();
    let shape = model.boundary_shape(1, mb);
    let (mut f, mut b) = (Vec::new(), Vec::new());
    for i in 0..25 {
        let x = Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let t0 = Instant::now();
        let y = model
            .forward(1, 2, &x, &mut Tape::default())
            .expect("a whole model does not communicate");
        let tf = t0.elapsed().as_secs_f64();
        let g = y.ones_like();
        let t1 = Instant::now();
        (y * g).sum(Kind::Float).backward();
        let tb = t1.elapsed().as_secs_f64();
        if i >= 5 {
            f.push(tf);
            b.push(tb);
        }
    }
    (median(&mut f), median(&mut b), shape)
}

struct Cell {
    idle: Vec<f64>,
    makespan: f64,
}

/// One step of stage `stage`: the schedule's ops with `layers` sleeps of `tf` (forward) or
/// `tb` (backward) each, activations and gradients through `comm` (sends from a thread, as
/// the worker's outbox does). Returns the busy seconds and the end time.
#[allow(clippy::too_many_arguments)]
fn run_stage(
    comm: &Arc<TcpComm>,
    schedule: Schedule,
    p: u32,
    m: u32,
    stage: u32,
    layers: u32,
    (tf, tb): (f64, f64),
    shape: &[i64],
    start: &Barrier,
) -> anyhow::Result<(f64, Instant, Instant)> {
    let outbox = Outbox::new(comm.clone() as Arc<dyn Communicator>);
    let act = Tensor::zeros(shape, (Kind::Float, Device::Cpu));
    let v = schedule.chunks_per_stage();
    let work = |secs: f64| -> f64 {
        let t = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(secs * layers as f64 / v as f64));
        t.elapsed().as_secs_f64()
    };
    // the worker's mailbox: each neighbour's messages in its order, early ones kept aside
    let mut mail = Mailbox::new(schedule, p, m, stage, |s| s);
    let ops = stage_ops(schedule, p, m, stage);
    start.wait();
    let t0 = Instant::now();
    let mut busy = 0.0;
    for op in ops {
        if let Some((from, want)) = needs(op, stage, p, v) {
            let _ = mail.recv(comm.as_ref(), from, want, &|_| shape.to_vec())?;
        }
        busy += work(match op {
            Op::Fwd(..) => tf,
            Op::Bwd(..) => tb,
        });
        if let Some((to, _)) = sends(op, stage, p, v) {
            outbox.send(act.copy(), to);
        }
    }
    outbox.finish()?;
    Ok((busy, t0, Instant::now()))
}

#[allow(clippy::too_many_arguments)]
fn measure(
    comms: &[Arc<TcpComm>],
    schedule: Schedule,
    m: u32,
    layers: &[u32],
    t: (f64, f64),
    shape: &[i64],
    steps: usize,
) -> anyhow::Result<Cell> {
    let p = comms.len() as u32;
    let mut idle = vec![Vec::new(); p as usize];
    let mut spans = Vec::new();
    for step in 0..steps + 1 {
        let start = Arc::new(Barrier::new(p as usize));
        let handles: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(s, c)| {
                let (c, start, schedule, shape) =
                    (c.clone(), start.clone(), schedule, shape.to_vec());
                let l = layers[s];
                std::thread::spawn(move || {
                    let r = run_stage(&c, schedule, p, m, s as u32, l, t, &shape, &start);
                    // the step ends for everyone together (as the commit all-reduce makes it)
                    let mut one = c.zeros(&[1], Kind::Float);
                    c.all_reduce(&mut one, ReduceOp::Sum)?;
                    r
                })
            })
            .collect();
        let rs: Vec<(f64, Instant, Instant)> = handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("a stage panicked"))?)
            .collect::<anyhow::Result<_>>()?;
        let t0 = rs.iter().map(|r| r.1).min().unwrap();
        let span = rs
            .iter()
            .map(|r| r.2.duration_since(t0).as_secs_f64())
            .fold(0.0, f64::max);
        if step == 0 {
            continue; // warm-up: connections, first buffers
        }
        spans.push(span);
        for (s, r) in rs.iter().enumerate() {
            idle[s].push(1.0 - r.0 / span);
        }
    }
    Ok(Cell {
        idle: idle.into_iter().map(|mut v| median(&mut v)).collect(),
        makespan: median(&mut spans),
    })
}

pub async fn bubble(
    ps: &[u32],
    ms: &[u32],
    schedules: &[Schedule],
    layers: u32,
    steps: usize,
    (d_model, ctx): (i64, i64),
) -> anyhow::Result<()> {
    let dir = TempDir::new("bubble");
    let etcd = Etcd::start(dir.path());
    let data = synth(dir.path(), "tokens", 20_000);
    println!(
        "bubble: a {layers}-layer model (each layer one calibrated GPT block: d_model {d_model}, ctx {ctx}), global batch 32 per replica, sleeps for compute, TCP point to point between stage threads; {steps} steps per cell (median)"
    );
    println!(
        "{:<16} {:>3} {:>3} {:>9} {:>9} {:>8} {:>13} {:>10} {:>11}",
        "sched", "p", "m", "formula", "measured", "diff pp", "worst stage", "step ms", "fwd/bwd ms"
    );
    let mut worst: f64 = 0.0;
    for (generation, &p) in (1..).zip(ps) {
        let forming: Vec<_> = (0..p)
            .map(|r| {
                let e = etcd.endpoint.clone();
                tokio::spawn(async move {
                    crate::allreduce::form_loopback(&e, "/bench-bubble", generation, p, r).await
                })
            })
            .collect();
        let mut comms = Vec::new();
        for f in forming {
            comms.push(Arc::new(f.await??));
        }
        // equal layers per stage where p divides them, as the planner balances them
        let b = balance(&vec![1; layers as usize], p as usize);
        let per: Vec<u32> = b.windows(2).map(|w| w[1] - w[0]).collect();
        for &m in ms {
            let mb = (32 / m).max(1) as i64;
            let d = data.clone();
            let (tf, tb, shape) =
                tokio::task::spawn_blocking(move || calibrate(&d, mb, d_model, ctx)).await?;
            for &sched in schedules {
                if sched.chunks_per_stage() > 1 && m % p != 0 {
                    println!(
                        "{sched:<6} {p:>3} {m:>3}   skipped: interleaving needs m a multiple of p"
                    );
                    continue;
                }
                let comms = comms.clone();
                let (per2, shape2) = (per.clone(), shape.clone());
                let cell = tokio::task::spawn_blocking(move || {
                    measure(&comms, sched, m, &per2, (tf, tb), &shape2, steps)
                })
                .await??;
                let formula = bubble_fraction(sched, p, m);
                let mean = cell.idle.iter().sum::<f64>() / p as f64;
                let far = cell
                    .idle
                    .iter()
                    .map(|x| (x - formula).abs())
                    .fold(0.0, f64::max);
                worst = worst.max(far);
                println!(
                    "{:<16} {p:>3} {m:>3} {:>8.1}% {:>8.1}% {:>+8.2} {:>12.2}pp {:>10.1} {:>5.2}/{:.2}",
                    sched,
                    formula * 100.0,
                    mean * 100.0,
                    (mean - formula) * 100.0,
                    far * 100.0,
                    cell.makespan * 1000.0,
                    tf * 1000.0,
                    tb * 1000.0
                );
            }
        }
    }
    println!(
        "\nbubble: the measured idle fraction of every stage is within {:.2} percentage points of the formula ((p−1)/(m+p−1); interleaved (p−1)/(v·m+p−1), i.e. Megatron's (p−1)/(v·m) of the ideal step)",
        worst * 100.0
    );
    Ok(())
}

/// Milliseconds per step of job "bench" (median over its reports past step 40).
async fn step_ms(spec: &str) -> anyhow::Result<(f64, String)> {
    let c = Cluster::start(Spec::default().agents(2, 2));
    let data = synth(c.dir.path(), "tokens", 200_000);
    c.submit(&spec.replace("DATA", &data));
    let v = c.wait_world("bench", 4, Duration::from_secs(60));
    let sps = throughput(&c, 40, 12, Duration::from_secs(600)).await;
    anyhow::ensure!(
        !sps.is_empty(),
        "the job reported no throughput:\n{}",
        c.logs()
    );
    let layout = v
        .layout
        .map(|l| l.to_string())
        .unwrap_or_else(|| "dp4".into());
    Ok((32.0 / median(&mut sps.clone()) * 1000.0, layout))
}

pub async fn step(micro_batches: u32) -> anyhow::Result<()> {
    let dp = format!(
        "{}max_steps = 1000000\n{GPT4}",
        training_toml("bench", 1, 4, 4, "gpt", "DATA", "")
    );
    let mut rows = vec![("data parallel".to_string(), dp)];
    for pp in [2, 4] {
        rows.push((
            format!("{pp} stages, 1f1b"),
            format!(
                "{}max_steps = 1000000\nstrategy = \"pipeline\"\npipeline_parallel = {pp}\npipeline_micro_batches = {micro_batches}\n{GPT4}",
                training_toml("bench", 1, 4, 4, "gpt", "DATA", "")
            ),
        ));
    }
    // clipping by global norm: the norm's row summed over the world each step
    rows.push((
        "2 stages, clipped".to_string(),
        format!(
            "{}max_steps = 1000000\nstrategy = \"pipeline\"\npipeline_parallel = 2\npipeline_micro_batches = {micro_batches}\nmax_grad_norm = 1.0\n{GPT4}",
            training_toml("bench", 1, 4, 4, "gpt", "DATA", "")
        ),
    ));
    rows.push((
        "2 stages, interleaved".to_string(),
        format!(
            "{}max_steps = 1000000\nstrategy = \"pipeline\"\npipeline_parallel = 2\npipeline_micro_batches = {micro_batches}\nschedule = \"interleaved-1f1b\"\n{GPT4}",
            training_toml("bench", 1, 4, 4, "gpt", "DATA", "")
        ),
    ));
    let mut base = None;
    for (name, spec) in rows {
        let (ms, layout) = step_ms(&spec).await?;
        let b = *base.get_or_insert(ms);
        println!(
            "pipeline-step, GPT n_layer 4 (d_model 64), global batch 32, 4 CPU workers, {name:<20} ({layout}): {ms:.2} ms/step, {:.2}× data parallel",
            ms / b
        );
    }
    Ok(())
}

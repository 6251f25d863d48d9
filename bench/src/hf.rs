//! Hugging Face models: training throughput against PyTorch eager (`hf-step`), and the bytes
//! each rank reads when it loads a model directory by plan (`hf-load`).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use ductile_tests::*;

use ductile_cluster::records::now_ms;

use crate::median;
use crate::training::throughput;

/// PyTorch eager on the same model, batch and threads: transformers' model, torch.optim.AdamW,
/// `steps` steps after `warm` unmeasured ones; prints tokens/s.
const EAGER: &str = r#"
import sys, time, torch
from transformers import AutoModelForCausalLM
import contextlib
d, threads, batch, ctx, steps, warm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
precision, recompute = sys.argv[7], sys.argv[8]
torch.set_num_threads(threads)
torch.manual_seed(0)
m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
m.train()
if recompute == "full":
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
cast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
v = m.config.vocab_size
x = torch.randint(0, v, (batch, ctx + 1))
def step():
    with cast():
        logits = m(input_ids=x[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, v), x[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
for _ in range(warm):
    step()
t0 = time.perf_counter()
for _ in range(steps):
    step()
print(batch * ctx * steps / (time.perf_counter() - t0))
"#;

/// PyTorch DDP (gloo, one thread per rank) on the same model, global batch and context at
/// world `argv[2]`: transformers' model, torch.optim.AdamW, each rank its share of the batch;
/// prints per rank one JSON line: tokens/s of the whole world and its peak resident memory.
const DDP: &str = r#"
import json, os, resource, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

def rank(r, d, world, batch, ctx, steps, warm, port, zero, every, ckdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=r, world_size=world)
    torch.manual_seed(r)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
    m.train()
    if zero >= 2:
        # FSDP2: fully_shard per decoder layer, then the root (torchtitan's wrapping); 3:
        # reshard_after_forward=False (the gathered layers kept for the backward)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=(zero == 2))
        fully_shard(m, mesh=mesh, reshard_after_forward=(zero == 2))
        ddp = m
        opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    elif zero == 1:
        # ZeRO-1: each rank holds its partition of the AdamW state
        ddp = torch.nn.parallel.DistributedDataParallel(m)
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-5)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    v = m.config.vocab_size
    x = torch.randint(0, v, (batch // world, ctx + 1))
    n = [0]
    def step():
        logits = ddp(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, v), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        n[0] += 1
        if every and n[0] % every == 0:
            # torch.distributed.checkpoint: each rank writes its own shard of the model and
            # the optimizer state (FSDP2: its DTensor shards), in this step
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict
            msd, osd = get_state_dict(m, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(ckdir, str(n[0])))
    for _ in range(warm):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rank": r, "tokens_per_s": batch * ctx * steps / dt, "peak_mib": peak}), flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    d, world, batch, ctx, steps, warm, port, zero, every = sys.argv[1], *map(int, sys.argv[2:10])
    ckdir = sys.argv[10]
    mp.spawn(rank, args=(d, world, batch, ctx, steps, warm, port, zero, every, ckdir), nprocs=world)
"#;

/// PyTorch DDP at `world` (`zero` 1: its optimizer a `ZeroRedundancyOptimizer`; 2: FSDP2,
/// `fully_shard` per decoder layer, instead of DDP; 3: FSDP2 with `reshard_after_forward`
/// false); a checkpoint every `every` steps with torch.distributed.checkpoint (0: none):
/// (tokens/s, each rank's peak resident memory in MiB).
fn ddp(
    model: &Path,
    world: u32,
    batch: u32,
    ctx: u32,
    steps: u32,
    zero: u32,
    every: u32,
) -> anyhow::Result<(f64, Vec<f64>)> {
    let dir = TempDir::new("ddp");
    let script = dir.path().join("ddp_step.py");
    std::fs::write(&script, DDP)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let o = Command::new(python()?)
        .arg(&script)
        .arg(model)
        .args([world, batch, ctx, steps, 2, port as u32, zero, every].map(|n| n.to_string()))
        .arg(dir.path().join("dcp"))
        .env("HF_HUB_OFFLINE", "1")
        .output()?;
    anyhow::ensure!(
        o.status.success(),
        "ddp: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    // (the ranks' lines may interleave: read a stream of JSON values)
    let rows: Vec<serde_json::Value> = serde_json::Deserializer::from_slice(&o.stdout)
        .into_iter::<serde_json::Value>()
        .filter_map(Result::ok)
        .collect();
    anyhow::ensure!(rows.len() == world as usize, "ddp printed {rows:?}");
    let tps = rows
        .iter()
        .filter_map(|r| r["tokens_per_s"].as_f64())
        .fold(f64::MAX, f64::min);
    Ok((
        tps,
        rows.iter().filter_map(|r| r["peak_mib"].as_f64()).collect(),
    ))
}

fn python() -> anyhow::Result<String> {
    std::env::var("DUCTILE_TORCH_PYTHON").map_err(|_| {
        anyhow::anyhow!(
            "DUCTILE_TORCH_PYTHON is not set: run scripts/setup.sh and source its env.sh"
        )
    })
}

fn eager(
    model: &Path,
    threads: u32,
    batch: u32,
    ctx: u32,
    steps: u32,
    modes: [&str; 2],
) -> anyhow::Result<f64> {
    let o = Command::new(python()?)
        .args(["-c", EAGER])
        .arg(model)
        .args([threads, batch, ctx, steps, 2].map(|n| n.to_string()))
        .args(modes)
        .env("HF_HUB_OFFLINE", "1")
        .output()?;
    anyhow::ensure!(
        o.status.success(),
        "eager: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let s = String::from_utf8_lossy(&o.stdout);
    s.trim()
        .lines()
        .last()
        .and_then(|l| l.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("eager printed {s:?}"))
}

/// Peaks in MiB as a list: "2859 MiB, 2909 MiB".
fn mib_list(peaks: &[f64]) -> String {
    peaks
        .iter()
        .map(|p| format!("{p:.0} MiB"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The peak resident memory so far (Linux: VmHWM), in MiB, of each member of job `bench`.
pub(crate) fn peaks_mib(c: &Cluster) -> Vec<f64> {
    c.status("bench")
        .members
        .iter()
        .filter_map(|m| m.pid)
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok())
        .filter_map(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map(|kb| kb as f64 / 1024.0)
        .collect()
}

/// A token stream for `model` (its tokenizer): `n` lines of varied text.
fn stream(dir: &Path, model: &Path, n: usize) -> anyhow::Result<String> {
    let jsonl = dir.join("bench.jsonl");
    let text: Vec<String> = (0..n)
        .map(|i| serde_json::json!({"text": format!("Line {i} of the benchmark corpus: elastic training keeps going when node {} dies, and resumes at step {}.", i % 17, i * 3)}).to_string())
        .collect();
    std::fs::write(&jsonl, text.join("\n"))?;
    let out = format!("file://{}/bench.tok", dir.display());
    tokenize(model, &jsonl, &out);
    Ok(out)
}

fn hf_job(world: u32, model: &Path, data: &str, batch: u32, ctx: u32, extra: &str) -> String {
    format!(
        "name = \"bench\"\nmin = 1\nmax = {world}\ndesired = {world}\nrestart_budget = 1000\n[training]\nmodel = \"hf\"\nmodel_path = \"file://{}\"\ndataset = \"{data}\"\nglobal_batch = {batch}\nlr = 1e-5\nseed = 1\nmax_steps = 1000000\nmodel_config = {{ ctx = {ctx} }}\n{extra}\n",
        model.display()
    )
}

/// Tokens/s training `model` with ductile at world 1 and data-parallel 2 (one torch thread per
/// CPU slot) against PyTorch eager with 1 and 2 threads, same batch and context, both in
/// `precision` and with `recompute` (`activation_checkpointing`).
pub async fn hf_step(
    model: &Path,
    batch: u32,
    ctx: u32,
    reports: usize,
    precision: &str,
    recompute: &str,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        ["fp32", "bf16"].contains(&precision) && ["none", "full"].contains(&recompute),
        "--precision is fp32 or bf16, --activation-checkpointing none or full"
    );
    let extra = format!("precision = \"{precision}\"\nactivation_checkpointing = \"{recompute}\"");
    let dir = TempDir::new("hfstep");
    let data = stream(dir.path(), model, 4000)?;
    let mut ours = Vec::new();
    let mut our_peaks = Vec::new();
    for world in [1u32, 2] {
        let c = Cluster::start(Spec::default().agents(1, world));
        c.submit(&hf_job(world, model, &data, batch, ctx, &extra));
        c.wait_world("bench", world, Duration::from_secs(120));
        let mut sps = throughput(&c, 3, reports, Duration::from_secs(900)).await;
        anyhow::ensure!(!sps.is_empty(), "no throughput reported:\n{}", c.logs());
        ours.push(median(&mut sps) * ctx as f64);
        // the workers' peak resident memory so far (Linux: VmHWM)
        let peaks = peaks_mib(&c);
        println!(
            "hf-step: world {world}, {precision}, activation checkpointing {recompute}: workers' peak resident memory {}",
            mib_list(&peaks)
        );
        our_peaks = peaks;
    }
    let modes = [precision, recompute];
    let theirs = [
        eager(model, 1, batch, ctx, reports as u32, modes)?,
        eager(model, 2, batch, ctx, reports as u32, modes)?,
    ];
    // data parallel 2 against PyTorch DDP (fp32, no recompute: DDP's own configuration)
    if precision == "fp32" && recompute == "none" {
        let (tps, peaks) = ddp(model, 2, batch, ctx, reports as u32, 0, 0)?;
        println!(
            "hf-step, data-parallel 2 against PyTorch DDP (gloo, 1 thread per rank), batch {batch} x {ctx}: ductile {:.1} tokens/s, DDP {tps:.1} tokens/s, ratio {:.3}; peak resident memory per rank ductile {}, DDP {} (ratio {:.3})",
            ours[1],
            ours[1] / tps,
            mib_list(&our_peaks),
            mib_list(&peaks),
            our_peaks.iter().cloned().fold(0.0, f64::max) / peaks.iter().cloned().fold(0.0, f64::max).max(1.0)
        );
    }
    for (i, (o, t)) in ours.iter().zip(theirs).enumerate() {
        println!(
            "hf-step, {} (batch {batch} x {ctx}, {precision}, activation checkpointing {recompute}), {}: ductile {o:.1} tokens/s, PyTorch eager ({} thread{}) {t:.1} tokens/s, ratio {:.3}",
            model.display(),
            if i == 0 { "world 1" } else { "data-parallel 2" },
            i + 1,
            if i == 0 { "" } else { "s" },
            o / t
        );
    }
    Ok(())
}

/// Data parallel at `world` against PyTorch DDP (gloo, one thread per rank) on `model`, fp32,
/// the same global batch and context, in `rounds` alternating rounds (ductile, the baseline
/// build's ductile when `baseline` names its binaries' directory, DDP): tokens/s and each
/// rank's peak resident memory per round, then the medians and the pairwise ratios' medians.
/// With `sharding = "optimizer"` ductile shards its optimizer state (ZeRO-1) and DDP's
/// optimizer is a `ZeroRedundancyOptimizer`; with `"full"` ductile shards everything (ZeRO-3)
/// and the peer is PyTorch FSDP2 (`fully_shard` per decoder layer); `"full-kept"` both keep
/// the gathered parameters for the backward (`reshard_after_forward = false` / `False`).
/// ductile's `full` and `full-kept` keep no buddy copies, as FSDP2 keeps none; `full-buddy`
/// keeps them (ductile's default), to measure what they cost against the same peer.
/// `every` > 0: both sides checkpoint every `every` steps (ductile to a `file://` URL,
/// PyTorch with torch.distributed.checkpoint to a directory), so the peaks hold a save.
#[allow(clippy::too_many_arguments)]
pub async fn ddp_step(
    model: &Path,
    world: u32,
    batch: u32,
    ctx: u32,
    reports: usize,
    rounds: usize,
    baseline: Option<&Path>,
    sharding: &str,
    every: u32,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        ["none", "optimizer", "full", "full-kept", "full-buddy"].contains(&sharding),
        "--sharding is none, optimizer, full, full-kept or full-buddy"
    );
    anyhow::ensure!(
        world >= 1 && batch >= world,
        "--world must be at least 1 and at most --batch"
    );
    // (the peer's mode, its name, and ductile's job keys)
    let (zero, peer, level) = match sharding {
        "optimizer" => (
            1,
            "PyTorch DDP + ZeroRedundancyOptimizer",
            "sharding = \"optimizer\"",
        ),
        "full" => (
            2,
            "PyTorch FSDP2 (fully_shard per decoder layer)",
            "sharding = \"full\"\nbuddy_copies = false",
        ),
        "full-kept" => (
            3,
            "PyTorch FSDP2 (fully_shard per decoder layer, reshard_after_forward=False)",
            "sharding = \"full\"\nreshard_after_forward = false\nbuddy_copies = false",
        ),
        "full-buddy" => (
            2,
            "PyTorch FSDP2 (fully_shard per decoder layer)",
            "sharding = \"full\"\nbuddy_copies = true",
        ),
        _ => (0, "PyTorch DDP", ""),
    };
    let dir = TempDir::new("ddpstep");
    let data = stream(dir.path(), model, 4000)?;
    let ours_dir = std::env::var_os("DUCTILE_BIN_DIR");
    let mut runs: Vec<(&str, Option<std::ffi::OsString>)> = vec![("ductile", ours_dir.clone())];
    if let Some(b) = baseline {
        runs.push(("baseline", Some(b.as_os_str().to_owned())));
    }
    let mut rows: Vec<Vec<(f64, f64)>> = vec![Vec::new(); runs.len() + 1];
    for round in 0..rounds {
        for (i, (name, bins)) in runs.iter().enumerate() {
            match bins {
                Some(d) => std::env::set_var("DUCTILE_BIN_DIR", d),
                None => std::env::remove_var("DUCTILE_BIN_DIR"),
            }
            let c = Cluster::start(Spec::default().agents(1, world));
            let extra = if zero > 0 || every > 0 {
                // a sharded job keeps a checkpoint (never due here without --checkpoint-every)
                format!(
                    "{level}\n[checkpoint]\nurl = \"file://{}/ck-{round}-{i}\"\ninterval = {}",
                    dir.path().display(),
                    if every > 0 { every } else { 1_000_000 }
                )
            } else {
                String::new()
            };
            c.submit(&hf_job(world, model, &data, batch, ctx, &extra));
            c.wait_world("bench", world, Duration::from_secs(120));
            let mut sps = throughput(&c, 3, reports, Duration::from_secs(900)).await;
            anyhow::ensure!(!sps.is_empty(), "no throughput reported:\n{}", c.logs());
            let tps = median(&mut sps) * ctx as f64;
            let peak = peaks_mib(&c).into_iter().fold(0.0, f64::max);
            println!(
                "ddp-step round {round}: {name} {tps:.1} tokens/s, peak {peak:.0} MiB per rank"
            );
            rows[i].push((tps, peak));
        }
        let (tps, peaks) = ddp(model, world, batch, ctx, reports as u32, zero, every)?;
        let peak = peaks.iter().cloned().fold(0.0, f64::max);
        println!("ddp-step round {round}: {peer} {tps:.1} tokens/s, peak {peak:.0} MiB per rank");
        rows[runs.len()].push((tps, peak));
    }
    match ours_dir {
        Some(d) => std::env::set_var("DUCTILE_BIN_DIR", d),
        None => std::env::remove_var("DUCTILE_BIN_DIR"),
    }
    let med = |v: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| {
        median(&mut v.iter().map(f).collect::<Vec<_>>())
    };
    let ratio = |a: &[(f64, f64)], b: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| {
        median(
            &mut a
                .iter()
                .zip(b)
                .map(|(x, y)| f(x) / f(y))
                .collect::<Vec<_>>(),
        )
    };
    let names: Vec<&str> = runs.iter().map(|r| r.0).chain([peer]).collect();
    let saves = match every {
        0 => String::new(),
        n => format!(", a checkpoint every {n} steps"),
    };
    for (n, r) in names.iter().zip(&rows) {
        println!(
            "ddp-step, {} (batch {batch} x {ctx}, fp32, world {world}, sharding {sharding}{saves}), median of {rounds}: {n} {:.1} tokens/s, peak {:.0} MiB per rank",
            model.display(),
            med(r, |x| x.0),
            med(r, |x| x.1)
        );
    }
    let ddp_rows = &rows[runs.len()];
    for (i, n) in names.iter().enumerate().take(runs.len()) {
        println!(
            "ddp-step: {n} / {peer}, median of paired ratios: tokens/s {:.3}, peak memory {:.3}",
            ratio(&rows[i], ddp_rows, |x| x.0),
            ratio(&rows[i], ddp_rows, |x| x.1)
        );
    }
    if runs.len() > 1 {
        println!(
            "ddp-step: ductile / baseline, median of paired ratios: tokens/s {:.3}, peak memory {:.3}",
            ratio(&rows[0], &rows[1], |x| x.0),
            ratio(&rows[0], &rows[1], |x| x.1)
        );
    }
    Ok(())
}

/// The bytes each rank read loading `model` by plan at tensor_parallel 2, pipeline_parallel 2
/// and tensor_parallel 3, against the bytes it holds, from the workers' own report (a layout the
/// model cannot take is said so and skipped).
pub async fn hf_load(model: &Path) -> anyhow::Result<()> {
    let dir = TempDir::new("hfload");
    let data = stream(dir.path(), model, 400)?;
    let hybrid = |tp: u32| {
        format!(
            "strategy = \"hybrid\"\ntensor_parallel = {tp}\npipeline_parallel = 1\nmax_steps = 1"
        )
    };
    for (name, world, extra) in [
        ("tp2", 2, hybrid(2)),
        (
            "pp2",
            2,
            "strategy = \"pipeline\"\npipeline_parallel = 2\nmax_steps = 1".to_string(),
        ),
        ("tp3", 3, hybrid(3)),
    ] {
        let c = Cluster::start(Spec::default().agents(1, world));
        let spec = hf_job(world, model, &data, 6, 32, &extra).replace("max_steps = 1000000\n", "");
        let path = dir.path().join(format!("{name}.toml"));
        std::fs::write(&path, spec)?;
        let (ok, _, err) = c.dctl(&["submit", path.to_str().unwrap()]);
        if !ok {
            println!("hf-load {name}: the model cannot take it ({})", err.trim());
            continue;
        }
        let done = c.wait_done("bench", Duration::from_secs(600));
        anyhow::ensure!(done.step == 1, "the job did not finish its step");
        let logs = c.logs();
        let lines: Vec<&str> = logs
            .lines()
            .filter(|l| l.contains("loaded its share of"))
            .collect();
        anyhow::ensure!(!lines.is_empty(), "no rank reported its load:\n{logs}");
        for l in lines {
            let num = |key: &str| -> Option<f64> {
                let at = l.find(key)? + key.len();
                l[at..]
                    .split(|ch: char| !ch.is_ascii_digit())
                    .next()?
                    .parse()
                    .ok()
            };
            let (read, held) = (num("read ").unwrap_or(0.0), num("holds ").unwrap_or(0.0));
            let rank = num("rank ").unwrap_or(-1.0);
            println!(
                "hf-load {name}: rank {rank} read {read} bytes, holds {held}, ratio {:.3}",
                read / held.max(1.0)
            );
        }
    }
    Ok(())
}

/// SmolLM2-360M's architecture (362 M parameters: 5.8 GB of fp32 weights, gradients and AdamW
/// state per replica, random init, the 135M's tokenizer) trained fully sharded at world 4 on
/// this machine, where four replicas do not fit: each rank's peak resident memory, then a
/// SIGKILL of one rank (its shard has no replica: every rank reads its rows of the last commit)
/// → the first step after, a `dctl scale 3` (the rows re-cut live: the leaver hands its rows
/// over) → the first step at 3, and a `dctl scale 4` → the first step at 4.
///
/// `architecture = "135m"` keeps the set-up model's own architecture (a quarter of the
/// memory); `buddy_copies = false` turns the job's buddy copies off, so the SIGKILL's shard
/// comes from the last commit as it did before them.
pub async fn fsdp_elastic(
    tokenizer_from: &Path,
    ctx: u32,
    architecture: &str,
    buddy_copies: bool,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        ["360m", "135m"].contains(&architecture),
        "--architecture is 360m or 135m"
    );
    let dir = TempDir::new("fsdp360");
    let model = dir
        .path()
        .join(format!("smollm2-{architecture}-architecture"));
    std::fs::create_dir_all(&model)?;
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        tokenizer_from.join("config.json"),
    )?)?;
    let wider = [
        ("hidden_size", 960),
        ("intermediate_size", 2560),
        ("num_hidden_layers", 32),
        ("num_attention_heads", 15),
        ("num_key_value_heads", 5),
    ];
    for (k, v) in wider.into_iter().filter(|_| architecture == "360m") {
        cfg[k] = v.into();
    }
    std::fs::write(model.join("config.json"), cfg.to_string())?;
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizer_from.join(f), model.join(f))?;
    }
    let data = stream(dir.path(), &model, 2000)?;
    // (the killed worker's slot restarts it after 30 s: the world trains at 3 meanwhile)
    let c = Cluster::start(Spec {
        restart_backoff_ms: 30_000,
        ..Spec::default().agents(2, 2)
    });
    let extra = format!(
        "init = \"random\"\nsharding = \"full\"\nbuddy_copies = {buddy_copies}\n[checkpoint]\nurl = \"file://{}/ck\"\ninterval = 3\nkeep = 1",
        dir.path().display()
    );
    c.submit(&hf_job(4, &model, &data, 4, ctx, &extra));
    let long = Duration::from_secs(1200);
    c.wait_world("bench", 4, long);
    // the start and the first step alone, before the first checkpoint stages its copy
    c.wait_step("bench", 1, long);
    println!(
        "fsdp-elastic: after the first step (before any checkpoint), peak resident memory {}",
        mib_list(&peaks_mib(&c))
    );
    // past the first commit (step 3)
    let v = c.wait_step("bench", 4, long);
    let last = c.history("bench").last().map(|g| g.number).unwrap_or(1);
    let state: Vec<u64> = c
        .joins("bench", last, 4)
        .await
        .iter()
        .map(|j| j.state_bytes)
        .collect();
    let peaks = peaks_mib(&c);
    println!(
        "fsdp-elastic: SmolLM2-{architecture} architecture, world 4, sharding full, buddy copies {buddy_copies}, batch 4 x {ctx}: {} per rank ({:.2} GB of parameters and AdamW state each), peak resident memory {}",
        v.layout.map(|l| l.to_string()).unwrap_or_default(),
        state.iter().cloned().max().unwrap_or(0) as f64 / 1e9,
        mib_list(&peaks)
    );
    // the steady step, for scale: the changes below each take at least one
    let s = c.wait_step("bench", v.step + 2, long);
    if let Some(sps) = s.samples_per_sec {
        println!(
            "fsdp-elastic: a step at world 4 takes {:.1} s (global batch 4 at {sps:.2} samples/s)",
            4.0 / sps
        );
    }
    // a SIGKILL: the lost rows come from rank 3's buddy copy (rank 1's host memory, on the
    // other node), or with buddy_copies = false from the last commit
    let g = c.history("bench").last().unwrap().number;
    let reached = c.status("bench").step;
    let t0 = now_ms();
    unsafe { libc::kill(v.members[3].pid.unwrap() as i32, libc::SIGKILL) };
    let next = crate::training::generation(&c, g + 1).await?;
    let t1 = first_step_within(&c, g + 1, long).await?;
    let resumed = c
        .joins("bench", g + 1, next.world_size)
        .await
        .iter()
        .map(|j| j.step)
        .min()
        .unwrap_or(0);
    println!(
        "fsdp-elastic: SIGKILL of rank 3 at step {reached} or later → first step of generation {} (world {}, state from {:?}, resumed at step {resumed}: {} steps lost) after {:.1} s; {}",
        g + 1,
        next.world_size,
        next.state_source,
        reached.saturating_sub(resumed),
        (t1 - t0) as f64 / 1000.0,
        next.detail
    );
    // the slot's worker comes back: a join, its rows from the peers
    let v = c.wait_world("bench", 4, long);
    let t1 = first_step_within(&c, v.generation, long).await?;
    let joined = crate::training::generation(&c, v.generation).await?;
    println!(
        "fsdp-elastic: the restarted worker joins → first step at world 4 (generation {}, state from {:?}) {:.1} s after the generation was published",
        v.generation,
        joined.state_source,
        t1.saturating_sub(joined.published_at_ms) as f64 / 1000.0
    );
    c.wait_step("bench", c.status("bench").step + 2, long);
    for world in [3u32, 4] {
        let before = c.history("bench").last().unwrap().number;
        let t0 = now_ms();
        c.dctl_ok(&["scale", "bench", &world.to_string()]);
        let v = c.wait_world("bench", world, long);
        let h = c.history("bench");
        let g = h
            .iter()
            .filter(|g| g.number > before)
            .find(|g| g.world_size == world && !g.members.iter().any(|m| m.spare))
            .map(|g| g.number)
            .unwrap_or(v.generation);
        let t1 = first_step_within(&c, g, long).await?;
        let moved: Vec<String> = c
            .joins("bench", g, world)
            .await
            .iter()
            .map(|j| format!("{:.2}", j.received_bytes as f64 / 1e9))
            .collect();
        let sources: Vec<String> = h
            .iter()
            .filter(|x| x.number > before)
            .map(|x| format!("{:?}", x.state_source))
            .collect();
        println!(
            "fsdp-elastic: dctl scale {world} → first step at world {world} (generation {g}) after {:.1} s; state from {}; GB received per rank {}",
            (t1 - t0) as f64 / 1000.0,
            sources.join(" then "),
            moved.join(", ")
        );
        c.wait_step("bench", c.status("bench").step + 1, long);
    }
    // what each change moved and how long the move itself took (the workers' own lines)
    for l in c.agent_logs().lines().filter(|l| {
        l.contains("job=bench")
            && ((l.contains("tensor slices and shards in place") && !l.contains(" bytes=0 "))
                || l.contains("restored checkpoint step"))
    }) {
        // (the agent's time of the line; the worker's own line after its last level)
        let at = l.split_whitespace().next().unwrap_or("");
        let what = l.rsplit_once(" INFO ").map(|(_, r)| r).unwrap_or(l);
        let what = what.split(" job=bench").next().unwrap_or(what);
        println!("fsdp-elastic: move at {at}: {what}");
    }
    let peaks = peaks_mib(&c);
    println!(
        "fsdp-elastic: peak resident memory per rank over the run {}",
        mib_list(&peaks)
    );
    Ok(())
}

/// The first step of generation `g` of the bench job (its time, ms), waited for up to `limit`.
async fn first_step_within(c: &Cluster, g: u64, limit: Duration) -> anyhow::Result<u64> {
    tokio::time::timeout(limit, crate::training::first_step(c, g))
        .await
        .map_err(|_| anyhow::anyhow!("generation {g} took no step within {limit:?}"))
}

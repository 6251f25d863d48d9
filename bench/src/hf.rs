//! Hugging Face models: training throughput against PyTorch eager (`hf-step`), and the bytes
//! each rank reads when it loads a model directory by plan (`hf-load`).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use ductile_tests::*;

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
    for world in [1u32, 2] {
        let c = Cluster::start(Spec::default().agents(1, world));
        c.submit(&hf_job(world, model, &data, batch, ctx, &extra));
        c.wait_world("bench", world, Duration::from_secs(120));
        let mut sps = throughput(&c, 3, reports, Duration::from_secs(900)).await;
        anyhow::ensure!(!sps.is_empty(), "no throughput reported:\n{}", c.logs());
        ours.push(median(&mut sps) * ctx as f64);
        // the workers' peak resident memory so far (Linux: VmHWM)
        let peaks: Vec<String> = c
            .status("bench")
            .members
            .iter()
            .filter_map(|m| m.pid)
            .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok())
            .filter_map(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmHWM:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            })
            .map(|kb| format!("{:.0} MiB", kb as f64 / 1024.0))
            .collect();
        println!(
            "hf-step: world {world}, {precision}, activation checkpointing {recompute}: workers' peak resident memory {}",
            peaks.join(", ")
        );
    }
    let modes = [precision, recompute];
    let theirs = [
        eager(model, 1, batch, ctx, reports as u32, modes)?,
        eager(model, 2, batch, ctx, reports as u32, modes)?,
    ];
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

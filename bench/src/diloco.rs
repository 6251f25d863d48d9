//! `ductile-bench diloco`: the same GPT job (3 CPU workers, the real daemon, agents and
//! workers) trained with `sync = "allreduce"`, DiLoCo (f32 pseudo-gradients), DiLoCo with int8
//! ones and `async` (bounded staleness), healthy and with one worker slowed
//! (`DUCTILE_SLOWDOWN`): bytes the workers sent each other per trained sample, the final
//! weights' loss on a fixed set of 256 samples at equal samples, and applied samples per
//! second (the run's samples over its wall time).

use std::time::{Duration, Instant};

use ductile_tests::*;

pub struct Args {
    pub steps: u64,
    pub inner_steps: u32,
    pub staleness: u32,
    /// The modes to run (default: all four).
    pub modes: Vec<String>,
    pub slow: f64,
    pub json: bool,
}

struct Run {
    mode: &'static str,
    slowed: bool,
    seconds: f64,
    samples_per_sec: f64,
    bytes_per_sample: f64,
    eval_loss: f64,
    /// Async: updates dropped for staleness, and the staleness of those applied (mean, max).
    dropped: Option<u64>,
    staleness: Option<(f64, u64)>,
}

fn one(a: &Args, mode: &'static str, sync: &str, slowed: bool) -> anyhow::Result<Run> {
    let c = Cluster::start(Spec::default().agents(1, 3));
    let data = synth(c.dir.path(), "tokens", 200_000);
    let env = if slowed {
        format!(
            "allow_fault_injection = true\nenv = {{ DUCTILE_SLOWDOWN = \"0:{}\" }}",
            a.slow
        )
    } else {
        String::new()
    };
    c.submit(&format!(
        "{}max_steps = {}\noptimizer = \"adamw\"\n{sync}",
        training_toml("bench", 3, 3, 3, "gpt", &data, &env),
        a.steps
    ));
    c.wait_world("bench", 3, Duration::from_secs(60));
    let t0 = Instant::now();
    let mut bytes = None;
    let v = c.wait_for(Duration::from_secs(3600), "the bench job to finish", || {
        let v = c.status("bench");
        if v.bytes_per_sample.is_some() {
            bytes = v.bytes_per_sample;
        }
        Some(v).filter(|v| v.state == ductile_cluster::records::JobState::Succeeded)
    });
    let seconds = t0.elapsed().as_secs_f64();
    let samples = a.steps as f64 * 32.0;
    Ok(Run {
        mode,
        slowed,
        seconds,
        samples_per_sec: samples / seconds,
        bytes_per_sample: v.bytes_per_sample.or(bytes).unwrap_or(f64::NAN),
        eval_loss: v
            .eval_loss
            .ok_or_else(|| anyhow::anyhow!("{mode}: no eval loss in {v:?}"))?,
        dropped: v.dropped_updates,
        staleness: v.staleness_mean.zip(v.staleness_max),
    })
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let h = a.inner_steps;
    let all_modes: [(&'static str, String); 5] = [
        ("allreduce", String::new()),
        (
            "diloco",
            format!("sync = \"diloco\"\n[training.diloco]\ninner_steps = {h}\n"),
        ),
        (
            "diloco-int8",
            format!(
                "sync = \"diloco\"\n[training.diloco]\ninner_steps = {h}\nquantize = \"int8\"\n"
            ),
        ),
        (
            "diloco-f4",
            format!("sync = \"diloco\"\n[training.diloco]\ninner_steps = {h}\nfragments = 4\n"),
        ),
        (
            "async",
            format!(
                "sync = \"async\"\n[training.async]\nstaleness = {}\n",
                a.staleness
            ),
        ),
    ];
    let modes: Vec<(&'static str, String)> = all_modes
        .into_iter()
        .filter(|(m, _)| a.modes.is_empty() || a.modes.iter().any(|x| x == m))
        .collect();
    let mut runs = Vec::new();
    for (mode, sync) in &modes {
        for slowed in [false, true] {
            let r = one(&a, mode, sync, slowed)?;
            let extra = match (r.dropped, r.staleness) {
                (Some(d), Some((mean, max))) => {
                    format!("  dropped {d}  staleness mean {mean:.2} max {max}")
                }
                _ => String::new(),
            };
            println!(
                "{:<12} {:<8} {:>7.1} s  {:>8.1} samples/s  {:>10.1} bytes/sample  eval loss {:.4}{extra}",
                r.mode,
                if r.slowed { "slowed" } else { "healthy" },
                r.seconds,
                r.samples_per_sec,
                r.bytes_per_sample,
                r.eval_loss
            );
            runs.push(r);
        }
    }
    let get = |m: &str, s: bool| runs.iter().find(|r| r.mode == m && r.slowed == s);
    let base = get("allreduce", false);
    println!(
        "\n{} steps of 32 samples, 3 workers, H = {h}, one worker slowed {}x",
        a.steps, a.slow
    );
    for (mode, _) in &modes {
        let (h, s) = (get(mode, false).unwrap(), get(mode, true).unwrap());
        let vs = |x: Option<f64>| x.map(|x| format!("{x:.2}")).unwrap_or_else(|| "-".into());
        println!(
            "{mode:<12} bytes/sample {:>8}x fewer than allreduce   eval loss {:>6}% vs allreduce   slowed throughput {:.0}% of healthy ({}% of allreduce's healthy)",
            vs(base.map(|b| b.bytes_per_sample / h.bytes_per_sample)),
            vs(base.map(|b| (h.eval_loss / b.eval_loss - 1.0) * 100.0)),
            s.samples_per_sec / h.samples_per_sec * 100.0,
            vs(base.map(|b| s.samples_per_sec / b.samples_per_sec * 100.0)),
        );
    }
    if a.json {
        for r in &runs {
            println!(
                "{}",
                serde_json::json!({"mode": r.mode, "slowed": r.slowed, "seconds": r.seconds,
                    "samples_per_sec": r.samples_per_sec, "bytes_per_sample": r.bytes_per_sample,
                    "eval_loss": r.eval_loss})
            );
        }
    }
    Ok(())
}

//! `tp-step`: the step time of tensor parallelism against data parallelism for the same GPT,
//! global batch and world, on one machine: each rank is a thread with a TCP mesh on loopback
//! (libtorch on one thread per rank), so what it shows on a small machine is the overhead of
//! the tensor-parallel collectives (4 activation all-reduces per block forward and backward,
//! plus the embedding's and the cross-entropy's) against one gradient all-reduce.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ductile_cluster::records::TrainingSpec;
use ductile_comm::{Communicator, Group, ReduceOp};
use ductile_worker::data::Dataset;
use ductile_worker::model::{Model, Tape};
use tch::{Device, Kind, Tensor};

use crate::median;

pub struct Args {
    pub world: u32,
    pub d_model: i64,
    pub n_layer: i64,
    pub n_head: i64,
    pub ctx: i64,
    pub batch: i64,
    pub steps: usize,
    pub json: bool,
}

/// Median step time (forward, backward, collectives; no optimizer) per rank of one mode.
fn run_mode(
    a: &Args,
    comms: &[Arc<dyn Communicator>],
    tensor_parallel: bool,
) -> anyhow::Result<f64> {
    let spec: TrainingSpec = serde_json::from_value(serde_json::json!({
        "model": "gpt",
        "model_config": {"d_model": a.d_model, "n_layer": a.n_layer, "n_head": a.n_head,
                         "ctx": a.ctx, "vocab": 256},
        "dataset": "file:///unused", "global_batch": a.batch, "seed": 1,
    }))?;
    let data = Dataset::Tokens {
        tokens: Vec::new(),
        ctx: a.ctx as usize,
        vocab: 256,
        header: None,
    };
    let world = a.world as i64;
    // data parallel: each rank its share of the batch; tensor parallel: every rank the batch
    let per_rank = if tensor_parallel {
        a.batch
    } else {
        a.batch / world
    };
    let models = (0..a.world)
        .map(|_| Model::new(&spec, &data, Device::Cpu))
        .collect::<anyhow::Result<Vec<_>>>()?;
    tch::manual_seed(2);
    let xy = Tensor::randint(256, [per_rank, a.ctx + 1], (Kind::Int64, Device::Cpu));
    let (x, y) = (
        xy.narrow(1, 0, a.ctx).contiguous(),
        xy.narrow(1, 1, a.ctx).contiguous(),
    );
    let times = std::thread::scope(|s| {
        let hs: Vec<_> = models
            .into_iter()
            .zip(comms)
            .map(|(mut m, c)| {
                let (x, y) = (x.copy(), y.copy());
                s.spawn(move || -> anyhow::Result<Vec<f64>> {
                    let group = Group::new(c.clone(), (0..c.world()).collect())?;
                    if tensor_parallel {
                        m.shard(group.clone())?;
                    }
                    let mut times = Vec::new();
                    for step in 0..=a.steps {
                        let t0 = Instant::now();
                        for (_, p) in m.params() {
                            let mut g = p.grad();
                            if g.defined() {
                                let _ = g.zero_();
                            }
                        }
                        if tensor_parallel {
                            let mut tape = Tape::default();
                            let out = m.forward(0, m.units(), &x, &mut tape)?;
                            let loss = m.loss(&out, &y, &mut tape)?;
                            m.backward(tape, &loss, None)?;
                        } else {
                            m.loss_sum(&x, &y).backward();
                            let grads: Vec<Tensor> =
                                m.params().iter().map(|(_, p)| p.grad().view(-1)).collect();
                            let mut flat = c.place(&Tensor::cat(&grads, 0));
                            c.all_reduce(&mut flat, ReduceOp::Sum)?;
                        }
                        if step > 0 {
                            times.push(t0.elapsed().as_secs_f64());
                        }
                    }
                    Ok(times)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a bench rank panicked"))
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    // a step ends when its slowest rank does
    let mut per_step: Vec<f64> = (0..a.steps)
        .map(|i| times.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect();
    Ok(median(&mut per_step))
}

pub async fn tp_step(a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.world >= 2 && a.n_head % a.world as i64 == 0 && a.batch % a.world as i64 == 0,
        "--world must be at least 2 and divide --n-head and --batch"
    );
    tch::set_num_threads(1);
    let comms = ductile_comm::tcp::loopback_mesh(a.world, "tp-step", 1).await?;
    let dp = tokio::task::block_in_place(|| run_mode(&a, &comms, false))?;
    let tp = tokio::task::block_in_place(|| run_mode(&a, &comms, true))?;
    // bytes each rank sends per step: the gradient all-reduce (ring) vs the activation ones
    let params = {
        let c = a.d_model;
        a.n_layer * (12 * c * c + 13 * c) + 2 * 256 * c + a.ctx * c + 2 * c
    } as f64;
    let w = a.world as f64;
    let dp_bytes = 2.0 * (w - 1.0) / w * params * 4.0;
    let act = (a.batch * a.ctx * a.d_model) as f64 * 4.0;
    // activation-sized: 4 per block (2 forward, 2 backward), the embedding's forward and the
    // head's backward; each goes to w − 1 peers (the cross-entropy's are a row each)
    let tp_bytes = (4 * a.n_layer + 2) as f64 * act * (w - 1.0);
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "world": a.world, "d_model": a.d_model, "n_layer": a.n_layer,
                "batch": a.batch, "ctx": a.ctx,
                "data_parallel_ms": dp * 1e3, "tensor_parallel_ms": tp * 1e3,
                "ratio": tp / dp,
                "data_parallel_bytes_per_rank": dp_bytes, "tensor_parallel_bytes_per_rank": tp_bytes,
            })
        );
    } else {
        println!(
            "GPT d_model {} n_layer {} batch {} ctx {} at world {} (forward + backward + collectives, median of {} steps)",
            a.d_model, a.n_layer, a.batch, a.ctx, a.world, a.steps
        );
        println!(
            "  data parallel:   {:8.2} ms/step  ({:.1} MiB sent per rank)",
            dp * 1e3,
            dp_bytes / (1 << 20) as f64
        );
        println!(
            "  tensor parallel: {:8.2} ms/step  ({:.1} MiB sent per rank)  {:.2}x",
            tp * 1e3,
            tp_bytes / (1 << 20) as f64,
            tp / dp
        );
    }
    Ok(())
}

/// `restore-layouts`: a GPT job at dp2×tp2 commits a checkpoint; jobs of other layouts
/// restore it (and end at once: the commit is at their last step). For each rank: the bytes it
/// read from the store (the restore's plan: every chunk read once, by one rank that needs it,
/// then served to the others) against the bytes of state it holds in the new layout.
pub async fn restore_layouts(d_model: u32) -> anyhow::Result<()> {
    use ductile_tests::*;
    let c = Cluster::start(Spec::default().agents(2, 2));
    let data = synth(c.dir.path(), "tokens", 50_000);
    let dir = TempDir::new("restore-layouts");
    let url = format!("file://{}/ck", dir.path().display());
    let job = |name: &str, desired: u32, extra: &str| {
        format!(
            "{}max_steps = 10\n{extra}\n[training.model_config]\nn_layer = 4\nd_model = {d_model}\n[checkpoint]\nurl = \"{url}\"\ninterval = 10\n",
            training_toml(name, 1, 4, desired, "gpt", &data, "")
        )
    };
    let tp = "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1";
    c.submit(&job("w", 4, tp));
    c.wait_done("w", Duration::from_secs(300));
    println!(
        "checkpoint written at dp2×pp1×tp2 (GPT n_layer 4 d_model {d_model}); restored as:\n{:<14} {:>5} {:>12} {:>12} {:>12} {:>7}",
        "layout", "rank", "held KiB", "read KiB", "received KiB", "read/held"
    );
    let cases = [
        ("dp1tp2", 2, tp.to_string()),
        ("dp3", 3, "strategy = \"data-parallel\"".to_string()),
        (
            "pp2",
            2,
            "strategy = \"pipeline\"\npipeline_parallel = 2".to_string(),
        ),
        (
            "pp2tp2",
            4,
            "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 2".to_string(),
        ),
        (
            "tp4",
            4,
            "strategy = \"hybrid\"\ntensor_parallel = 4\npipeline_parallel = 1".to_string(),
        ),
    ];
    let mut worst: f64 = 0.0;
    for (name, world, extra) in cases {
        c.submit(&job(name, world, &extra));
        c.wait_done(name, Duration::from_secs(300));
        let g = c.history(name)[0].clone();
        let joins = c.joins(name, g.number, g.world_size).await;
        let logs = c.logs();
        for j in &joins {
            let line = logs
                .lines()
                .find(|l| {
                    l.contains("restored this rank's share")
                        && l.contains(&format!("pid={} ", j.pid))
                })
                .ok_or_else(|| anyhow::anyhow!("{name}: rank {} logged no restore", j.rank))?;
            let field = |k: &str| -> u64 {
                line.split(&format!("{k}="))
                    .nth(1)
                    .and_then(|r| r.split_whitespace().next())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            let (read, received) = (field("read_bytes"), field("received_bytes"));
            let ratio = read as f64 / j.state_bytes.max(1) as f64;
            worst = worst.max(ratio);
            println!(
                "{:<14} {:>5} {:>12.1} {:>12.1} {:>12.1} {:>7.2}",
                g.layout.to_string(),
                j.rank,
                j.state_bytes as f64 / 1024.0,
                read as f64 / 1024.0,
                received as f64 / 1024.0,
                ratio
            );
        }
    }
    println!("\nmost read by one rank against what it holds: {worst:.2}x");
    Ok(())
}

/// The process's resident memory now and its peak since the last reset (Linux: VmRSS, VmHWM),
/// in bytes.
fn rss() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = |key: &str| -> u64 {
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
            * 1024
    };
    (kib("VmRSS:"), kib("VmHWM:"))
}

/// The median of `f` over paired figures (time, peak growth) of runs.
fn median_of(v: &[(f64, f64)], f: fn(&(f64, f64)) -> f64) -> f64 {
    median(&mut v.iter().map(f).collect::<Vec<f64>>())
}

/// `reshard-transfer`: see the command's help.
pub async fn reshard_transfer(
    mib: u64,
    chunk_mib: u64,
    runs: usize,
    json: bool,
) -> anyhow::Result<()> {
    use ductile_strategies::split_range;
    use ductile_worker::train::reshard::{move_state_in_process, Holding};
    use std::collections::BTreeMap;
    use tch::{Device, Kind, Tensor};
    let (tensors, cols) = (8u64, 1024u64);
    let rows = (mib << 20) / 4 / cols / tensors;
    let holding = |world: u32, rank: u32| -> Vec<Holding> {
        (0..tensors)
            .map(|_| {
                let r = if rank < world {
                    split_range(rows, world, rank)
                } else {
                    0..0
                };
                Holding {
                    boxes: if r.is_empty() {
                        Vec::new()
                    } else {
                        vec![vec![r, 0..cols]]
                    },
                    dim: 0,
                }
            })
            .collect()
    };
    let all = |world: u32| -> BTreeMap<u32, Vec<Holding>> {
        (0..4).map(|r| (r, holding(world, r))).collect()
    };
    let (old_h, new_h) = (all(4), all(3));
    // sticky row ownership (`ductile_strategies::rows`): rank 3's chunks go to the others,
    // which keep theirs
    let owners = ductile_strategies::rows::RowOwners::even(
        ductile_strategies::rows::RowOwners::chunks_for(4),
        4,
    );
    let kept = owners
        .resized(&[Some(0), Some(1), Some(2), None], 3)
        .map_err(|e| anyhow::anyhow!(e))?;
    let sticky = |o: &ductile_strategies::rows::RowOwners| -> BTreeMap<u32, Vec<Holding>> {
        (0..4u32)
            .map(|r| {
                let hs = (0..tensors)
                    .map(|_| Holding {
                        boxes: if r < o.places() {
                            o.runs(rows, r)
                                .into_iter()
                                .map(|x| vec![x, 0..cols])
                                .collect()
                        } else {
                            Vec::new()
                        },
                        dim: 0,
                    })
                    .collect();
                (r, hs)
            })
            .collect()
    };
    let (sticky_old, sticky_new) = (sticky(&owners), sticky(&kept));
    let elem = vec![4u64; tensors as usize];
    // the bytes each re-cut moves against the least any can: rank 3's rows, which must go
    let moved_of = |old: &BTreeMap<u32, Vec<Holding>>,
                    new: &BTreeMap<u32, Vec<Holding>>|
     -> anyhow::Result<(u64, u64)> {
        use ductile_strategies::redistribute::{elements, plan};
        use ductile_worker::train::reshard::{all_parts, holding_parts};
        let p = plan(&elem, &all_parts(old), &[], &all_parts(new))?;
        let moved = p.moves.iter().map(|m| elements(&m.region) * 4).sum();
        let least = holding_parts(3, &old[&3])
            .iter()
            .map(|x| elements(&x.region) * 4)
            .sum();
        Ok((moved, least))
    };
    println!(
        "reshard-transfer: {mib} MiB of f32 state ({tensors} tensors of {rows}×{cols}) row-sharded over 4 ranks in one process, re-cut to 3 over loopback TCP"
    );
    for (label, old, new) in [
        ("today's cut", &old_h, &new_h),
        ("sticky ownership", &sticky_old, &sticky_new),
    ] {
        let (moved, least) = moved_of(old, new)?;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!(
            "bytes moved, {label}: {:.1} MiB against the minimum {:.1} MiB (rank 3's rows): {:.3}× the minimum",
            mib(moved),
            mib(least),
            moved as f64 / least as f64
        );
        if json {
            println!(
                "{}",
                serde_json::json!({"layout": label, "moved_bytes": moved, "minimum_bytes": least,
                    "ratio": moved as f64 / least as f64})
            );
        }
    }
    println!(
        "{:<24} {:>4} {:>9} {:>16} {:>8}",
        "moves", "run", "seconds", "peak growth MiB", "rounds"
    );
    let mut figures: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    let mut generation = 1;
    for run in 0..runs {
        for (label, chunk, old_h, new_h) in [
            ("one round", u64::MAX / 8, &old_h, &new_h),
            ("rounds of chunk", (chunk_mib << 20) / 4, &old_h, &new_h),
            (
                "sticky, rounds of chunk",
                (chunk_mib << 20) / 4,
                &sticky_old,
                &sticky_new,
            ),
        ] {
            let comms = ductile_comm::tcp::loopback_mesh(4, "rt", generation).await?;
            generation += 1;
            let local: Vec<Vec<Tensor>> = (0..4u32)
                .map(|r| {
                    old_h[&r]
                        .iter()
                        .map(|h| {
                            Tensor::ones(h.local_shape().as_slice(), (Kind::Float, Device::Cpu))
                        })
                        .collect()
                })
                .collect();
            // the growth over what is resident before: the new state (the floor any re-cut
            // needs, as the old is still held), then the transfer's own buffers
            let before = rss().0;
            let _ = std::fs::write("/proc/self/clear_refs", "5");
            let t0 = std::time::Instant::now();
            let out = move_state_in_process(&comms, 1, chunk, &elem, &local, old_h, new_h)?;
            let secs = t0.elapsed().as_secs_f64();
            let over = rss().1.saturating_sub(before) as f64 / (1 << 20) as f64;
            let rounds = out[0].1.rounds;
            drop(out);
            drop(local);
            println!("{label:<24} {run:>4} {secs:>9.3} {over:>16.0} {rounds:>8}");
            figures.entry(label).or_default().push((secs, over));
        }
    }
    // loopback's own time to move one rank's share (a quarter) as one buffer, for scale
    let comms = ductile_comm::tcp::loopback_mesh(2, "rq", generation).await?;
    let quarter = Tensor::ones([((mib << 20) / 16) as i64], (Kind::Float, Device::Cpu));
    let t0 = std::time::Instant::now();
    std::thread::scope(|s| {
        let (a, b) = (&comms[0], &comms[1]);
        let q = a.place(&quarter);
        let buf = b.zeros(&[quarter.numel() as i64], Kind::Float);
        let h = s.spawn(move || a.send(&q, 1));
        b.recv(&buf, 0)?;
        h.join().expect("the sender")
    })?;
    let quarter_secs = t0.elapsed().as_secs_f64();
    let (one, chunked, kept) = (
        &figures["one round"],
        &figures["rounds of chunk"],
        &figures["sticky, rounds of chunk"],
    );
    println!(
        "sticky ownership, rounds of {chunk_mib} MiB: {:.3} s (today's cut {:.3} s: {:.2}×)",
        median_of(kept, |x| x.0),
        median_of(chunked, |x| x.0),
        median_of(kept, |x| x.0) / median_of(chunked, |x| x.0)
    );
    println!(
        "medians: one round {:.3} s, peak +{:.0} MiB; rounds of {chunk_mib} MiB {:.3} s, peak +{:.0} MiB (the new state alone: +{mib} MiB); time ratio (rounds / one) {:.2}×, peak ratio {:.2}×; a quarter of the state ({} MiB) over loopback as one buffer: {quarter_secs:.3} s",
        median_of(one, |x| x.0),
        median_of(one, |x| x.1),
        median_of(chunked, |x| x.0),
        median_of(chunked, |x| x.1),
        median_of(chunked, |x| x.0) / median_of(one, |x| x.0),
        median_of(chunked, |x| x.1) / median_of(one, |x| x.1).max(1.0),
        mib / 4,
    );
    Ok(())
}

/// `seed-rows`: see the command's help. Each make runs in a process of its own (this binary
/// again, with `--arm`), so one's freed memory does not hide the next one's peak.
pub fn seed_rows(world: u32, layers: i64, runs: usize, arm: Option<String>) -> anyhow::Result<()> {
    use ductile_worker::data::Dataset;
    use ductile_worker::model::{shard_rows, Model};
    let mib = |b: f64| b / (1 << 20) as f64;
    if let Some(arm) = arm {
        // SmolLM2-360M's architecture (tied embeddings, GQA), random init
        let spec: ductile_cluster::records::TrainingSpec =
            serde_json::from_value(serde_json::json!({
                "model": "hf", "model_path": "file:///unused", "model_config": {"ctx": 64},
                "hf_config": {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
                    "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": layers,
                    "num_attention_heads": 15, "num_key_value_heads": 5,
                    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                    "tie_word_embeddings": true, "initializer_range": 0.02},
                "dataset": "file:///unused", "global_batch": 4, "seed": 1,
            }))?;
        let data = Dataset::Tokens {
            tokens: Vec::new(),
            header: None,
            ctx: 64,
            vocab: 49152,
        };
        let place = (world, world - 1);
        let before = rss().0;
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let t0 = std::time::Instant::now();
        let held: Vec<tch::Tensor> = if arm == "whole" {
            // made whole, then cut at the first agreement, as before
            let m = Model::new(&spec, &data, tch::Device::Cpu)?;
            m.params()
                .into_iter()
                .map(|(_, t)| shard_rows(&t, place))
                .collect()
        } else {
            let m = Model::with_rows(&spec, &data, tch::Device::Cpu, place)?;
            m.params().into_iter().map(|(_, t)| t).collect()
        };
        let secs = t0.elapsed().as_secs_f64();
        let over = mib(rss().1.saturating_sub(before) as f64);
        let bytes: i64 = held.iter().map(|t| t.numel() as i64 * 4).sum();
        println!(
            "{}",
            serde_json::json!({"secs": secs, "peak_growth_mib": over, "held_mib": mib(bytes as f64)})
        );
        return Ok(());
    }
    println!(
        "seed-rows: a new process's model (SmolLM2-360M's architecture with {layers} layers), made whole then cut (before) or made in its rows of a shard group of {world} unit by unit (now), each in a process of its own; peak growth over what was resident before"
    );
    println!(
        "{:<8} {:>4} {:>9} {:>16} {:>10}",
        "made", "run", "seconds", "peak growth MiB", "held MiB"
    );
    let mut figures: std::collections::BTreeMap<&str, Vec<(f64, f64)>> = Default::default();
    for run in 0..runs {
        for (label, arm) in [("whole", "whole"), ("in rows", "rows")] {
            let out = std::process::Command::new(std::env::current_exe()?)
                .args(["seed-rows", "--world", &world.to_string()])
                .args(["--layers", &layers.to_string(), "--arm", arm])
                .output()?;
            anyhow::ensure!(
                out.status.success(),
                "seed-rows --arm {arm}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let line = String::from_utf8_lossy(&out.stdout);
            let v: serde_json::Value = serde_json::from_str(
                line.lines()
                    .last()
                    .ok_or_else(|| anyhow::anyhow!("seed-rows --arm {arm} printed nothing"))?,
            )?;
            let field = |k: &str| {
                v[k].as_f64()
                    .ok_or_else(|| anyhow::anyhow!("seed-rows --arm {arm} printed no {k}: {v}"))
            };
            let (secs, over, held) = (
                field("secs")?,
                field("peak_growth_mib")?,
                field("held_mib")?,
            );
            println!("{label:<8} {run:>4} {secs:>9.3} {over:>16.0} {held:>10.0}");
            figures.entry(label).or_default().push((secs, over));
        }
    }
    let (whole, rows) = (&figures["whole"], &figures["in rows"]);
    println!(
        "medians: whole then cut {:.3} s, peak +{:.0} MiB; in rows {:.3} s, peak +{:.0} MiB; peak ratio (rows / whole) {:.2}x, time ratio {:.2}x",
        median_of(whole, |x| x.0),
        median_of(whole, |x| x.1),
        median_of(rows, |x| x.0),
        median_of(rows, |x| x.1),
        median_of(rows, |x| x.1) / median_of(whole, |x| x.1).max(1.0),
        median_of(rows, |x| x.0) / median_of(whole, |x| x.0),
    );
    Ok(())
}

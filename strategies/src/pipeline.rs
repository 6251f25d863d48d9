//! Planning without tch: the model as a list of units (embeddings, each block, the head) with a
//! cost model, and the layout search of a world (`dp × pp × tp`, spares, balanced stage
//! boundaries) for every job, data-parallel ones too. The schedules' per-stage order of work
//! is [`schedule`]; the submit-time checks are [`check`]; each member's coordinates are
//! [`crate::mesh`].
//!
//! The daemon plans every generation with [`plan`]; the worker reads the plan from the
//! generation and maps its parameters to units with [`unit_of`], so both sides agree on what
//! a stage holds.

mod check;
pub mod schedule;

pub use check::check_job;
pub use schedule::*;

use ductile_cluster::modes::Sharding;
use ductile_cluster::records::{Degree, Layout, ShardGroup, Strategy, TrainingSpec};

use crate::arch::Architecture;
use serde::Serialize;

/// Modelled compute rate of one slot, FLOP/s (a CPU core with one torch thread; only ratios
/// between candidate plans matter).
pub const SLOT_FLOPS: f64 = 2.0e10;
/// Modelled bandwidth between two slots, bytes/s.
pub const LINK_BYTES_PER_S: f64 = 1.0e9;
/// Modelled per-message latency, s.
pub const LINK_LATENCY_S: f64 = 50e-6;

/// One unit of the model: the smallest block a stage boundary may not cut.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Unit {
    pub name: String,
    /// The parameter-name prefixes this unit holds, whole path segments (`h3` holds
    /// `h3.qkv.weight`; `model.layers.3` holds `model.layers.3.mlp.up_proj.weight`).
    pub prefixes: Vec<String>,
    pub params: u64,
    /// Forward and backward FLOPs per sample.
    pub flops: f64,
    /// Bytes of the activation this unit hands to the next, per sample.
    pub out_bytes: u64,
    /// Bytes kept for the backward pass per sample in flight.
    pub stash_bytes: u64,
}

/// The unit a parameter (by its name, `h3.qkv.weight`) belongs to.
pub fn unit_of(units: &[Unit], param: &str) -> Option<usize> {
    units.iter().position(|u| {
        u.prefixes.iter().any(|p| {
            param
                .strip_prefix(p.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
        })
    })
}

/// One stage of a plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StagePlan {
    pub stage: u32,
    /// Units `[first, end)` (its first chunk with `interleaved-1f1b`).
    pub first: u32,
    pub end: u32,
    /// Every chunk of units it holds, `[first, end)` each.
    pub chunks: Vec<[u32; 2]>,
    /// `embed..h1` (chunks joined by ` + `).
    pub units: String,
    pub params: u64,
    /// Modelled memory of a rank of this stage: weights, gradients, optimizer state and the
    /// activations the schedule keeps in flight.
    pub memory_bytes: u64,
    /// Modelled compute of one step on one replica, s.
    pub compute_s: f64,
}

/// What the daemon publishes for a world size.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub world: u32,
    pub layout: Layout,
    /// Members past `dp × pp × tp` idle as spares.
    pub spares: u32,
    /// Chunk k holds units `[boundaries[k], boundaries[k+1])`; stage s holds chunks s, s + p,
    /// ... (one per stage, two with `interleaved-1f1b`).
    pub boundaries: Vec<u32>,
    pub stages: Vec<StagePlan>,
    /// Micro-batches per step per replica.
    pub micro_batches: u32,
    pub schedule: Schedule,
    /// The schedule's idle fraction per stage, by formula.
    pub bubble: f64,
    /// Modelled step time, s.
    pub step_time_s: f64,
    /// Modelled memory of the fullest rank.
    pub max_memory_bytes: u64,
    /// Why this layout, in words.
    pub reason: String,
    /// The other layouts considered, best first: (`dp×pp×tp`, step time, max memory, or why
    /// not).
    pub runners_up: Vec<RunnerUp>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunnerUp {
    pub layout: String,
    pub step_time_s: Option<f64>,
    pub max_memory_bytes: Option<u64>,
    pub refused: Option<String>,
}

/// Contiguous boundaries of `costs` into `parts` non-empty stages minimising the costliest
/// stage (binary search on the bound, greedy packing that leaves a unit for every later
/// stage; deterministic).
pub fn balance(costs: &[u64], parts: usize) -> Vec<u32> {
    let n = costs.len();
    assert!(parts >= 1 && parts <= n, "1 ≤ parts ≤ units");
    let pack = |bound: u64| -> Option<Vec<u32>> {
        let mut b = vec![0u32];
        let mut acc = 0u64;
        for (i, c) in costs.iter().enumerate() {
            let stages_left = parts - b.len(); // stages still to open after the current one
            let units_left = n - i;
            let must_cut = acc > 0 && units_left == stages_left;
            if must_cut || (acc > 0 && acc + c > bound) {
                if b.len() == parts {
                    return None;
                }
                b.push(i as u32);
                acc = 0;
            }
            if *c > bound {
                return None;
            }
            acc += c;
        }
        (b.len() == parts).then(|| {
            b.push(n as u32);
            b
        })
    };
    let (mut lo, mut hi) = (
        *costs.iter().max().unwrap(),
        costs.iter().sum::<u64>().max(1),
    );
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pack(mid).is_some() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    pack(lo).expect("the sum of all costs always packs")
}

struct Candidate {
    dp: u32,
    pp: u32,
    tp: u32,
}

fn model_step(
    t: &TrainingSpec,
    arch: &dyn Architecture,
    us: &[Unit],
    world: u32,
    c: &Candidate,
    shard: u32,
) -> Result<(Vec<u32>, Vec<StagePlan>, u32, f64), String> {
    let (dp, pp, tp) = (c.dp, c.pp, c.tp);
    if tp > 1 {
        arch.check_tp(tp)?;
        arch.check_layout(pp, tp)?;
        if t.deterministic {
            match t.tensor_slices {
                Some(k) if k % tp == 0 => {}
                Some(k) => {
                    return Err(format!(
                        "tensor_slices = {k} does not split over {tp} tensor ranks"
                    ))
                }
                None => return Err("deterministic tensor parallelism needs tensor_slices".into()),
            }
        }
    }
    if pp as usize > us.len() {
        return Err(format!("{pp} stages but the model has {} units", us.len()));
    }
    let per_replica = t.global_batch / dp;
    if per_replica == 0 {
        return Err(format!(
            "global_batch {} cannot feed {dp} replicas",
            t.global_batch
        ));
    }
    let m = if t.deterministic {
        // micro-batches are the replica's logical shards
        (t.logical_shards.unwrap_or(world).max(1) / dp).max(1)
    } else {
        t.pipeline_micro_batches.unwrap_or(4 * pp).min(per_replica)
    };
    if pp > 1 && t.pipeline_micro_batches.is_some_and(|m| m < pp) {
        return Err(format!(
            "pipeline_micro_batches {} is below {pp} stages",
            t.pipeline_micro_batches.unwrap()
        ));
    }
    let v = if pp > 1 {
        t.schedule.chunks_per_stage()
    } else {
        1
    };
    if v > 1 && (v * pp) as usize > us.len() {
        return Err(format!(
            "interleaved-1f1b cuts {pp} stages into {} chunks but the model has {} units",
            v * pp,
            us.len()
        ));
    }
    if v > 1 && m % pp != 0 {
        return Err(format!(
            "interleaved-1f1b needs micro-batches in multiples of the {pp} stages; {m} is not"
        ));
    }
    let costs: Vec<u64> = us.iter().map(|u| u.flops.max(1.0) as u64).collect();
    let b = balance(&costs, (v * pp) as usize);
    let opt_states = t.optimizer.states() as u64;
    let micro = per_replica.div_ceil(m) as u64;
    let mut stages = Vec::new();
    for s in 0..pp {
        let chunks: Vec<[u32; 2]> = (0..v)
            .map(|j| {
                let k = (j * pp + s) as usize;
                [b[k], b[k + 1]]
            })
            .collect();
        let part: Vec<&Unit> = chunks
            .iter()
            .flat_map(|[a, e]| &us[*a as usize..*e as usize])
            .collect();
        let params: u64 = part.iter().map(|u| u.params).sum();
        let stash: u64 = part.iter().map(|u| u.stash_bytes).sum();
        // activations kept for the backward pass, in chunk-micro-batches of 1/v of the stage
        let in_flight = match t.schedule {
            Schedule::Gpipe => (m * v) as u64,
            _ if v > 1 => ((2 * (pp - s - 1) + (v - 1) * pp + 1).min(m * v)) as u64,
            _ => (pp - s).min(m) as u64,
        };
        let flops: f64 = part.iter().map(|u| u.flops).sum();
        let names: Vec<String> = chunks
            .iter()
            .map(|[a, e]| {
                let (a, e) = (*a as usize, *e as usize);
                if e - a == 1 {
                    us[a].name.clone()
                } else {
                    format!("{}..{}", us[a].name, us[e - 1].name)
                }
            })
            .collect();
        stages.push(StagePlan {
            stage: s,
            first: chunks[0][0],
            end: chunks[0][1],
            chunks,
            units: names.join(" + "),
            params,
            // a tensor group splits the parameters, their state, and (by heads and MLP
            // columns) most of the activations kept for the backward pass; a sharded
            // data-parallel rank holds its share (the submit check's figure); stages and
            // tensor groups with the optimizer state sharded (ZeRO-1) hold their rows of it
            // over the shard group of their replicas
            memory_bytes: match t.min_slot_bytes(world).filter(|_| t.sharding.is_sharded()) {
                Some(b) if !over_replicas(t) => b,
                _ if t.sharding == Sharding::Full && pp > 1 => {
                    // 3D: rows of the slices' parameters and of their state over the shard
                    // group; during a step the stage's slices gathered whole, with their
                    // gradients (each micro-batch runs on them), and the stash
                    let slice = params.div_ceil(tp as u64) * 4;
                    slice * 2
                        + (slice * (1 + opt_states)).div_ceil(shard as u64)
                        + stash.div_ceil(tp as u64) * micro * in_flight / v as u64
                }
                _ if t.sharding == Sharding::Full => {
                    // 2D: rows of the slices' parameters and of their state over the shard
                    // group; one unit's slices gathered, with their gradients, at a time; each
                    // unit's input kept per micro-batch (the units run again in the backward)
                    let slice = params.div_ceil(tp as u64) * 4;
                    let biggest = part.iter().map(|u| u.params).max().unwrap_or(0);
                    let unit = biggest.div_ceil(tp as u64) * 4;
                    (slice * (1 + opt_states)).div_ceil(shard as u64)
                        + 4 * unit
                        + stash.div_ceil(tp as u64) * micro * in_flight / v as u64
                }
                _ => {
                    let slice = params.div_ceil(tp as u64) * 4;
                    slice * 2
                        + (slice * opt_states).div_ceil(shard as u64)
                        + stash.div_ceil(tp as u64) * micro * in_flight / v as u64
                }
            },
            compute_s: flops * per_replica as f64 / SLOT_FLOPS / tp as f64,
        });
    }
    if let Some(gib) = t.memory_per_slot_gib {
        let cap = (gib * (1u64 << 30) as f64) as u64;
        if let Some(s) = stages.iter().find(|s| s.memory_bytes > cap) {
            return Err(format!(
                "stage {} needs {:.2} GiB, a slot has {gib} GiB",
                s.stage,
                s.memory_bytes as f64 / (1u64 << 30) as f64
            ));
        }
    }
    let slowest = stages.iter().map(|s| s.compute_s).fold(0.0, f64::max);
    let pipeline = slowest * (v * m + pp - 1) as f64 / (v * m) as f64;
    let p2p = if pp > 1 {
        let act = us[b[1] as usize - 1].out_bytes * micro;
        2.0 * (v * pp - 1) as f64 * (act as f64 / LINK_BYTES_PER_S + LINK_LATENCY_S)
    } else {
        0.0
    };
    // tensor parallelism: per block and micro-batch, two activation all-reduces forward and two
    // backward, each sending the activation to the tp − 1 other members
    let tensor = if tp > 1 {
        let blocks = arch.tensor_synced_units().max(1) as f64 / pp as f64;
        let act = us[0].out_bytes * micro;
        4.0 * blocks
            * (m * v) as f64
            * ((act * (tp as u64 - 1)) as f64 / LINK_BYTES_PER_S + LINK_LATENCY_S)
    } else {
        0.0
    };
    let biggest = stages.iter().map(|s| s.params).max().unwrap_or(0) / tp as u64;
    let allreduce = if dp > 1 {
        2.0 * (dp - 1) as f64 / dp as f64 * (biggest * 4) as f64 / LINK_BYTES_PER_S
            + 2.0 * (dp - 1) as f64 * LINK_LATENCY_S
    } else {
        0.0
    };
    Ok((b, stages, m, pipeline + p2p + allreduce + tensor))
}

/// Whether the job's pipeline or tensor layouts may shard their optimizer state over each
/// stage's replicas: `"optimizer"` and `"gradients"` always, `"auto"` (with strategy pipeline or hybrid) where a
/// layout's stages do not fit unsharded. (`"auto"` with strategy `"auto"` is made concrete at
/// submit, before it is planned for a world.)
fn over_replicas(t: &TrainingSpec) -> bool {
    match t.sharding {
        Sharding::Optimizer | Sharding::Gradients | Sharding::Full => t.strategy.pipelined(),
        Sharding::Auto => matches!(t.strategy, Strategy::Pipeline | Strategy::Hybrid),
        _ => false,
    }
}

/// The shard group of a pipeline or tensor layout's optimizer state over `dp` replicas
/// (`sharding = "optimizer"`, ZeRO-1: each (stage, tensor place) shards over its replicas, in
/// groups of `shard_group` of them, else all): the largest divisor of `dp` not above the group,
/// so every group is whole; 1 unsharded.
pub fn dp_shard(t: &TrainingSpec, dp: u32) -> u32 {
    if !over_replicas(t) {
        return 1;
    }
    let group = match t.shard_group {
        Some(ShardGroup::Ranks(n)) => n,
        // (refused at submit for stages and tensor groups)
        Some(ShardGroup::Node) | None => dp,
    };
    Layout::sharded(dp, group).dp_shard
}

/// The plan for job `t` at `world` ranks.
pub fn plan(t: &TrainingSpec, world: u32) -> Result<Plan, String> {
    if world == 0 {
        return Err("a world has at least one rank".into());
    }
    let arch = crate::arch::of(t)?;
    let us = arch.units();
    let tps: Vec<u32> = match (t.strategy, t.tensor_parallel) {
        (Strategy::DataParallel | Strategy::Pipeline, _) => vec![1],
        (_, Degree::Fixed(n)) if n > world => {
            return Err(format!(
                "{world} ranks cannot host tensor_parallel = {n} ranks per group"
            ))
        }
        (_, Degree::Fixed(n)) => vec![n],
        (_, Degree::Auto) => (1..=world).collect(),
    };
    let mut cands = Vec::new();
    let mut why = String::new();
    for tp in tps {
        // each tensor group acts as one rank of the data × pipeline layout
        let groups = world / tp;
        let max_pp = (us.len() as u32).min(groups);
        let one = |dp: u32, pp: u32| Candidate { dp, pp, tp };
        match (t.strategy, t.pipeline_parallel) {
            (Strategy::DataParallel, _) => {
                cands.push(one(world, 1));
                why = "strategy data-parallel".into();
            }
            (_, Degree::Fixed(n)) if n > groups => {
                if tp == 1 {
                    return Err(format!(
                        "{world} ranks cannot host pipeline_parallel = {n} stages"
                    ));
                }
            }
            (_, Degree::Fixed(n)) => {
                cands.push(one(groups / n, n));
                why = format!("pipeline_parallel = {n}");
            }
            (s, Degree::Auto) => {
                // one stage only where it may be chosen, or where nothing else fits
                if s != Strategy::Pipeline || max_pp < 2 {
                    cands.push(one(groups, 1));
                }
                cands.extend((2..=max_pp).map(|pp| one(groups / pp, pp)));
                why = match s {
                    Strategy::Pipeline => "pipeline_parallel = auto: the fastest modelled layout with every layer held by two replicas where the world allows it".into(),
                    Strategy::Hybrid => "strategy hybrid: the fastest modelled dp × pp × tp layout".into(),
                    _ => "strategy auto: the fastest modelled layout".into(),
                };
            }
        }
    }
    if let (Degree::Fixed(n), true) = (t.tensor_parallel, t.strategy.tensor_split()) {
        if n > 1 {
            why.push_str(&format!("; tensor_parallel = {n}"));
        }
    }
    if cands.is_empty() {
        return Err(format!(
            "{world} ranks cannot host the fixed degrees of this job"
        ));
    }
    let mut scored = Vec::new();
    let mut refused = Vec::new();
    for c in &cands {
        let group = dp_shard(t, c.dp);
        // sharding = "auto" with stages: the optimizer state whole where the layout's stages
        // fit the slots (memory_per_slot_gib), else sharded over each stage's replicas
        let tries: &[u32] = if t.sharding == Sharding::Auto && group > 1 {
            &[1, group]
        } else {
            &[group]
        };
        let mut outcome = None;
        for &shard in tries {
            let layout = Layout {
                data_parallel: c.dp,
                pipeline_parallel: c.pp,
                tensor_parallel: c.tp,
                dp_shard: shard,
            };
            match model_step(t, arch.as_ref(), &us, world, c, shard) {
                Ok(r) => {
                    outcome = Some(Ok((layout, r)));
                    break;
                }
                Err(e) => outcome = Some(Err((layout, e))),
            }
        }
        match outcome.expect("at least one shard size is tried") {
            Ok((layout, r)) => scored.push((c, layout, r)),
            Err((layout, e)) => refused.push(RunnerUp {
                layout: layout.to_string(),
                step_time_s: None,
                max_memory_bytes: None,
                refused: Some(e),
            }),
        }
    }
    if scored.is_empty() {
        let reasons: Vec<String> = refused
            .iter()
            .map(|r| format!("{}: {}", r.layout, r.refused.as_deref().unwrap_or("")))
            .collect();
        return Err(format!(
            "no layout fits {world} ranks ({})",
            reasons.join("; ")
        ));
    }
    let redundant = t.strategy == Strategy::Pipeline;
    // order: redundancy first, then modelled time, then fewer spares and fewer stages
    scored.sort_by(|a, b| {
        let ra = redundant && a.0.dp < 2;
        let rb = redundant && b.0.dp < 2;
        ra.cmp(&rb)
            .then(a.2 .3.total_cmp(&b.2 .3))
            .then((world - a.0.dp * a.0.pp * a.0.tp).cmp(&(world - b.0.dp * b.0.pp * b.0.tp)))
            .then(a.0.pp.cmp(&b.0.pp))
            .then(a.0.tp.cmp(&b.0.tp))
    });
    let mut it = scored.into_iter();
    let (best, layout, (boundaries, stages, m, step)) = it.next().unwrap();
    let mut runners_up: Vec<RunnerUp> = it
        .map(|(_, l, r)| RunnerUp {
            layout: l.to_string(),
            step_time_s: Some(r.3),
            max_memory_bytes: r.1.iter().map(|s| s.memory_bytes).max(),
            refused: None,
        })
        .collect();
    runners_up.extend(refused);
    let spares = world - best.dp * best.pp * best.tp;
    let mut reason = why;
    if spares > 0 {
        reason.push_str(&format!(
            "; {spares} spare rank(s): {world} does not split into {} stages of {} tensor rank(s)",
            best.pp, best.tp
        ));
    }
    Ok(Plan {
        world,
        layout,
        spares,
        max_memory_bytes: stages.iter().map(|s| s.memory_bytes).max().unwrap_or(0),
        boundaries: if best.pp > 1 { boundaries } else { Vec::new() },
        stages,
        micro_batches: m,
        schedule: t.schedule,
        bubble: bubble_fraction(t.schedule, best.pp, m),
        step_time_s: step,
        reason,
        runners_up,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::Mesh;
    use std::collections::BTreeSet;

    fn coords(layout: &Layout, rank: u32) -> Option<(u32, u32, u32)> {
        Mesh::new(layout)
            .coords(rank)
            .map(|c| (c.dp, c.stage, c.tp))
    }

    fn gpt(strategy: &str, pp: Degree, layers: i64) -> TrainingSpec {
        serde_json::from_value(serde_json::json!({
            "strategy": strategy,
            "model": "gpt",
            "model_config": {"d_model": 32, "n_layer": layers, "n_head": 4, "ctx": 16, "vocab": 64},
            "dataset": "file:///d",
            "global_batch": 32,
            "pipeline_parallel": pp,
        }))
        .unwrap()
    }

    /// `sharding = "optimizer"` with stages: each stage's replicas shard its optimizer state
    /// (the layout says the shard group), and each stage plans the smaller share of it.
    #[test]
    fn stages_shard_their_optimizer_state_over_their_replicas() {
        let mut t = gpt("pipeline", Degree::Fixed(2), 4);
        let whole = plan(&t, 8).unwrap();
        assert_eq!(whole.layout.to_string(), "dp4×pp2×tp1");
        t.sharding = Sharding::Optimizer;
        let p = plan(&t, 8).unwrap();
        assert_eq!(p.layout.to_string(), "dp4(shard4)×pp2×tp1");
        for (a, b) in whole.stages.iter().zip(&p.stages) {
            // AdamW's two states of the stage, three quarters of them gone
            let state = a.params * 4 * 2;
            assert_eq!(a.memory_bytes - b.memory_bytes, state - state.div_ceil(4));
        }
        t.shard_group = Some(ShardGroup::Ranks(3));
        assert_eq!(
            plan(&t, 8).unwrap().layout.to_string(),
            "dp4(shard2)×pp2×tp1"
        );
        // data parallel keeps its own shard groups (the daemon's), not the planner's
        t.strategy = Strategy::DataParallel;
        assert_eq!(dp_shard(&t, 8), 1);
    }

    /// `sharding = "full"` under tensor groups (2D FSDP + TP): each tensor place's replicas
    /// shard its slices' parameters and state (the layout says the shard group), and the
    /// planned memory per rank is below ZeRO-1's (and so below the unsharded layout's) at the
    /// same layout, above the rows alone (a unit gathered at a time).
    #[test]
    fn tensor_groups_shard_their_parameters_over_their_replicas_under_full_sharding() {
        let mut t = gpt("hybrid", Degree::Fixed(1), 4);
        t.tensor_parallel = Degree::Fixed(2);
        let at = |t: &TrainingSpec| {
            let p = plan(t, 8).unwrap();
            (
                p.layout.to_string(),
                p.stages[0].memory_bytes,
                p.stages[0].params,
            )
        };
        let (layout, whole, params) = at(&t);
        assert_eq!(layout, "dp4×pp1×tp2");
        t.sharding = Sharding::Optimizer;
        let (layout, zero1, _) = at(&t);
        assert_eq!(layout, "dp4(shard4)×pp1×tp2");
        t.sharding = Sharding::Full;
        let (layout, full, _) = at(&t);
        assert_eq!(layout, "dp4(shard4)×pp1×tp2");
        assert!(full < zero1 && zero1 < whole, "{full} {zero1} {whole}");
        // a slice's parameters and AdamW's two states, a quarter of them on each rank
        assert!(
            full > (params / 2 * 4 * 3) / 4,
            "{full} for {params} parameters"
        );
        t.shard_group = Some(ShardGroup::Ranks(2));
        assert_eq!(at(&t).0, "dp4(shard2)×pp1×tp2");
    }

    /// `sharding = "auto"` with stages: a layout keeps its optimizer state whole where its
    /// stages fit the slot (`memory_per_slot_gib`) and shards it over each stage's replicas
    /// where only that fits; where neither fits, the layout is refused; one replica per stage
    /// has nothing to shard over.
    #[test]
    fn auto_shards_a_layout_s_optimizer_state_only_where_its_stages_do_not_fit() {
        let mut t = gpt("pipeline", Degree::Fixed(2), 4);
        let most = |p: &Plan| p.stages.iter().map(|s| s.memory_bytes).max().unwrap();
        let whole = most(&plan(&t, 8).unwrap());
        t.sharding = Sharding::Optimizer;
        let sharded = most(&plan(&t, 8).unwrap());
        assert!(sharded < whole, "{sharded} vs {whole}");
        t.sharding = Sharding::Auto;
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        for (cap, want) in [
            (whole, Some("dp4×pp2×tp1")),
            (whole - 1, Some("dp4(shard4)×pp2×tp1")),
            (sharded, Some("dp4(shard4)×pp2×tp1")),
            (sharded - 1, None),
        ] {
            t.memory_per_slot_gib = Some(gib(cap));
            let got = plan(&t, 8);
            assert_eq!(
                got.as_ref().ok().map(|p| p.layout.to_string()),
                want.map(String::from),
                "{cap}: {got:?}"
            );
            if let Ok(p) = got {
                assert!(most(&p) <= cap);
            }
        }
        // two ranks: one replica per stage, nothing to shard over
        let mut u = gpt("pipeline", Degree::Fixed(2), 4);
        let two = most(&plan(&u, 2).unwrap());
        u.sharding = Sharding::Auto;
        u.memory_per_slot_gib = Some(gib(two));
        assert_eq!(plan(&u, 2).unwrap().layout.to_string(), "dp1×pp2×tp1");
        u.memory_per_slot_gib = Some(gib(two - 1));
        assert!(plan(&u, 2).is_err());
    }

    /// Recomputed blocks keep only their inputs for the backward (less memory per stage) and
    /// run their forward again (more compute); the embedding and the head are as they were.
    #[test]
    fn activation_checkpointing_trades_stashed_activations_for_a_second_forward() {
        let t = gpt("pipeline", Degree::Fixed(2), 4);
        let mut r = t.clone();
        r.activation_checkpointing = ductile_cluster::records::ActivationCheckpointing::Full;
        let (p, q) = (plan(&t, 2).unwrap(), plan(&r, 2).unwrap());
        for (a, b) in p.stages.iter().zip(&q.stages) {
            assert!(b.memory_bytes < a.memory_bytes, "{a:?} vs {b:?}");
            assert!(b.compute_s > a.compute_s, "{a:?} vs {b:?}");
        }
        let (plain, rec) = (
            crate::arch::of(&t).unwrap().units(),
            crate::arch::of(&r).unwrap().units(),
        );
        assert_eq!(rec[0], plain[0]);
        assert_eq!(rec[5], plain[5]);
        assert_eq!(rec[2].stash_bytes, plain[1].out_bytes);
        assert!((rec[2].flops / plain[2].flops - 4.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn interleaving_cuts_two_chunks_per_stage_and_shrinks_the_bubble() {
        let mut t = gpt("pipeline", Degree::Fixed(2), 4); // 6 units
        t.schedule = Schedule::Interleaved1F1B;
        let p = plan(&t, 2).unwrap();
        assert_eq!(p.boundaries.len(), 5, "{p:?}");
        assert_eq!(p.boundaries[4], 6);
        for s in &p.stages {
            let k = s.stage as usize;
            assert_eq!(
                s.chunks,
                vec![
                    [p.boundaries[k], p.boundaries[k + 1]],
                    [p.boundaries[k + 2], p.boundaries[k + 3]]
                ]
            );
        }
        let m = p.micro_batches;
        assert_eq!(m % 2, 0);
        assert!((p.bubble - 1.0 / (2 * m + 1) as f64).abs() < 1e-12);
        let mut plain = t.clone();
        plain.schedule = Schedule::OneFOneB;
        let q = plan(&plain, 2).unwrap();
        assert!(p.bubble < q.bubble && p.step_time_s < q.step_time_s);
        // four chunks need four units; micro-batches must tile by the stages
        let mut small = gpt("pipeline", Degree::Fixed(3), 1); // 3 units
        small.schedule = Schedule::Interleaved1F1B;
        assert!(plan(&small, 3).unwrap_err().contains("6 chunks"));
        t.pipeline_micro_batches = Some(3);
        assert!(plan(&t, 2).unwrap_err().contains("multiples"));
    }

    #[test]
    fn balance_is_contiguous_non_empty_and_minimises_the_costliest_stage() {
        let costs = [1u64, 10, 10, 10, 10, 5];
        for parts in 1..=costs.len() {
            let b = balance(&costs, parts);
            assert_eq!(b.len(), parts + 1);
            assert_eq!((b[0], *b.last().unwrap()), (0, costs.len() as u32));
            assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
            // brute force over every cut: nothing has a lower maximum
            let max_of = |b: &[u32]| {
                b.windows(2)
                    .map(|w| costs[w[0] as usize..w[1] as usize].iter().sum::<u64>())
                    .max()
                    .unwrap()
            };
            let mut best = u64::MAX;
            let n = costs.len();
            for mask in 0u32..(1 << (n - 1)) {
                if mask.count_ones() as usize != parts - 1 {
                    continue;
                }
                let mut cut = vec![0u32];
                cut.extend(
                    (1..n)
                        .filter(|i| mask & (1 << (i - 1)) != 0)
                        .map(|i| i as u32),
                );
                cut.push(n as u32);
                best = best.min(max_of(&cut));
            }
            assert_eq!(max_of(&b), best, "parts {parts}: {b:?}");
        }
    }

    /// Runs every stage's ops in order with buffered sends (an op starts once the message it
    /// needs was sent): forward 1 and backward 2 time units per stage, split over its chunks.
    /// Returns each stage's idle fraction of the step, or None on a deadlock.
    fn simulate(sched: Schedule, p: u32, m: u32) -> Option<Vec<f64>> {
        use std::collections::HashMap;
        let v = sched.chunks_per_stage();
        let ops: Vec<Vec<Op>> = (0..p).map(|s| stage_ops(sched, p, m, s)).collect();
        let mut next = vec![0usize; p as usize];
        let mut clock = vec![0f64; p as usize];
        let mut busy = vec![0f64; p as usize];
        let mut sent: HashMap<(u32, Msg), f64> = HashMap::new();
        loop {
            let mut progress = false;
            for s in 0..p as usize {
                while next[s] < ops[s].len() {
                    let op = ops[s][next[s]];
                    let ready = match needs(op, s as u32, p, v) {
                        None => 0.0,
                        Some((from, msg)) => match sent.get(&(from, msg)) {
                            Some(t) => *t,
                            None => break,
                        },
                    };
                    let d = match op {
                        Op::Fwd(..) => 1.0,
                        Op::Bwd(..) => 2.0,
                    } / v as f64;
                    clock[s] = clock[s].max(ready) + d;
                    busy[s] += d;
                    if let Some((_, msg)) = sends(op, s as u32, p, v) {
                        sent.insert((s as u32, msg), clock[s]);
                    }
                    next[s] += 1;
                    progress = true;
                }
            }
            if next.iter().zip(&ops).all(|(n, o)| *n == o.len()) {
                break;
            }
            if !progress {
                return None;
            }
        }
        let span = clock.iter().cloned().fold(0.0, f64::max);
        Some(busy.iter().map(|b| 1.0 - b / span).collect())
    }

    #[test]
    fn schedules_run_every_chunk_of_every_micro_batch_once_without_deadlock_at_the_formula_bubble()
    {
        for sched in [
            Schedule::Gpipe,
            Schedule::OneFOneB,
            Schedule::Interleaved1F1B,
        ] {
            let v = sched.chunks_per_stage();
            for p in 1..=4 {
                for m in [1, 2, 4, 8, 12] {
                    for s in 0..p {
                        let ops = stage_ops(sched, p, m, s);
                        assert_eq!(ops.len() as u32, 2 * m * v);
                        for j in 0..v {
                            // the micro-batches of chunk j's forwards (or backwards), in order
                            let order = |bwd: bool| -> Vec<u32> {
                                ops.iter()
                                    .filter_map(|o| match *o {
                                        Op::Fwd(i, c) if !bwd && c == j => Some(i),
                                        Op::Bwd(i, c) if bwd && c == j => Some(i),
                                        _ => None,
                                    })
                                    .collect()
                            };
                            let (f, b) = (order(false), order(true));
                            // each chunk's backwards in micro-batch order: its gradients
                            // accumulate in the same order whatever the schedule
                            assert_eq!(f, (0..m).collect::<Vec<_>>(), "{sched} p{p} m{m}");
                            assert_eq!(b, (0..m).collect::<Vec<_>>(), "{sched} p{p} m{m}");
                            for i in 0..m {
                                let fi = ops.iter().position(|o| *o == Op::Fwd(i, j)).unwrap();
                                let bi = ops.iter().position(|o| *o == Op::Bwd(i, j)).unwrap();
                                assert!(fi < bi);
                            }
                        }
                    }
                    let idle = simulate(sched, p, m)
                        .unwrap_or_else(|| panic!("{sched} p{p} m{m} deadlocks"));
                    if m >= p && (v == 1 || m % p == 0) {
                        let want = bubble_fraction(sched, p, m);
                        for (s, x) in idle.iter().enumerate() {
                            assert!(
                                (x - want).abs() < 1e-9,
                                "{sched} p{p} m{m} stage {s}: idle {x}, formula {want}"
                            );
                        }
                    }
                }
            }
        }
        // 1F1B keeps at most p − stage micro-batches in flight
        let ops = stage_ops(Schedule::OneFOneB, 4, 8, 0);
        let f4: Vec<Op> = (0..4).map(|i| Op::Fwd(i, 0)).collect();
        assert_eq!(&ops[..4], f4.as_slice());
        assert_eq!(ops[4], Op::Bwd(0, 0));
        // interleaved: stage 0 of 2 warms up with 2 + 2 forwards, chunk 0 then chunk 1
        let ops = stage_ops(Schedule::Interleaved1F1B, 2, 4, 0);
        assert_eq!(
            &ops[..5],
            &[
                Op::Fwd(0, 0),
                Op::Fwd(1, 0),
                Op::Fwd(0, 1),
                Op::Fwd(1, 1),
                Op::Fwd(2, 0)
            ]
        );
        assert_eq!(ops[5], Op::Bwd(0, 1));
        // the last stage hands chunk p − 1's output to stage 0's second chunk; at p = 2 one
        // direction carries activations and gradients alike
        assert_eq!(
            sends(Op::Fwd(3, 0), 1, 2, 2),
            Some((0, Msg::Act { mb: 3, chunk: 2 }))
        );
        assert_eq!(
            send_order(Schedule::Interleaved1F1B, 2, 2, 1, 0),
            vec![
                Msg::Act { mb: 0, chunk: 2 },
                Msg::Act { mb: 1, chunk: 2 },
                Msg::Grad { mb: 0, chunk: 2 },
                Msg::Grad { mb: 1, chunk: 2 },
                Msg::Grad { mb: 0, chunk: 0 },
                Msg::Grad { mb: 1, chunk: 0 }
            ]
        );
    }

    #[test]
    fn a_pipeline_keeps_two_replicas_where_it_can_and_stages_cover_the_model() {
        let t = gpt("pipeline", Degree::Auto, 4); // 6 units
        let p4 = plan(&t, 4).unwrap();
        assert_eq!(
            (p4.layout.data_parallel, p4.layout.pipeline_parallel),
            (2, 2)
        );
        assert_eq!(p4.boundaries.len(), 3);
        assert_eq!(p4.boundaries[2], 6);
        let p3 = plan(&t, 3).unwrap();
        assert_eq!(
            p3.layout.data_parallel * p3.layout.pipeline_parallel + p3.spares,
            3
        );
        assert!(p3.layout.pipeline_parallel > 1);
        let p1 = plan(&t, 1).unwrap();
        assert_eq!(p1.layout.pipeline_parallel, 1);
        assert!(p1.boundaries.is_empty());
        // coordinates
        assert_eq!(coords(&p4.layout, 3), Some((1, 1, 0)));
        assert_eq!(coords(&p4.layout, 1), Some((0, 1, 0)));
        let dp = plan(&gpt("data-parallel", Degree::Auto, 4), 4).unwrap();
        assert_eq!(dp.layout, Layout::data_parallel(4));
    }

    #[test]
    fn fixed_stages_constrain_the_plan_and_memory_bounds_refuse() {
        let t = gpt("pipeline", Degree::Fixed(3), 4);
        let p = plan(&t, 4).unwrap();
        assert_eq!(
            (p.layout.data_parallel, p.layout.pipeline_parallel, p.spares),
            (1, 3, 1)
        );
        assert!(plan(&t, 2).unwrap_err().contains("cannot host"));
        let mut small = gpt("auto", Degree::Auto, 4);
        small.memory_per_slot_gib = Some(1e-6);
        assert!(plan(&small, 4).unwrap_err().contains("GiB"));
    }

    #[test]
    fn units_name_every_parameter_prefix() {
        let us = crate::arch::of(&gpt("pipeline", Degree::Auto, 2))
            .unwrap()
            .units();
        let names: Vec<&str> = us.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["embed", "h0", "h1", "head"]);
        assert_eq!(unit_of(&us, "tok.weight"), Some(0));
        assert_eq!(unit_of(&us, "h1.qkv.bias"), Some(2));
        assert_eq!(unit_of(&us, "ln_f.weight"), Some(3));
        assert_eq!(unit_of(&us, "nope.weight"), None);
    }

    #[test]
    fn auto_degrees_under_a_memory_bound_walk_between_tensor_groups_and_stages() {
        // the integration test's job (tests/tests/tensor.rs): the modelled costs pick these
        let t: TrainingSpec = serde_json::from_value(serde_json::json!({
            "strategy": "hybrid",
            "model": "gpt",
            "model_config": {"d_model": 128, "n_layer": 2, "n_head": 4, "ctx": 32, "vocab": 256},
            "dataset": "file:///d",
            "global_batch": 32,
            "tensor_parallel": "auto",
            "pipeline_parallel": "auto",
            "memory_per_slot_gib": 0.008,
        }))
        .unwrap();
        let at = |world: u32| plan(&t, world).unwrap().layout.to_string();
        assert_eq!(at(4), "dp2×pp1×tp2");
        assert_eq!(at(3), "dp1×pp3×tp1");
        assert_eq!(at(2), "dp1×pp1×tp2");
    }

    #[test]
    fn a_fixed_tensor_degree_makes_groups_and_leaves_spares_where_the_world_does_not_divide() {
        let mut t = gpt("hybrid", Degree::Fixed(1), 2);
        t.tensor_parallel = Degree::Fixed(2);
        let p4 = plan(&t, 4).unwrap();
        assert_eq!(p4.layout.to_string(), "dp2×pp1×tp2");
        assert_eq!(p4.spares, 0);
        assert_eq!(coords(&p4.layout, 0), Some((0, 0, 0)));
        assert_eq!(coords(&p4.layout, 1), Some((0, 0, 1)));
        assert_eq!(coords(&p4.layout, 3), Some((1, 0, 1)));
        let p3 = plan(&t, 3).unwrap();
        assert_eq!(p3.layout.to_string(), "dp1×pp1×tp2");
        assert_eq!(p3.spares, 1);
        assert!(p3.reason.contains("1 spare rank(s)"), "{}", p3.reason);
        assert_eq!(coords(&p3.layout, 2), None, "rank 2 is the spare");
        // a split rank holds less: parameters and optimizer state are divided over the group
        let mut one = t.clone();
        one.tensor_parallel = Degree::Fixed(1);
        let whole = plan(&one, 2).unwrap();
        assert!(plan(&t, 2).unwrap().max_memory_bytes < whole.max_memory_bytes);
        let e = plan(&t, 1).unwrap_err();
        assert!(e.contains("tensor_parallel = 2"), "{e}");
        t.tensor_parallel = Degree::Fixed(3);
        let e = plan(&t, 3).unwrap_err();
        assert!(e.contains("n_head = 4"), "{e}");
    }

    #[test]
    fn auto_tensor_parallelism_splits_only_when_memory_needs_it_and_lists_the_runners_up() {
        let mut t = gpt("hybrid", Degree::Fixed(1), 2);
        t.tensor_parallel = Degree::Auto;
        // a small model: splitting its tensors only adds communication
        let p = plan(&t, 4).unwrap();
        assert_eq!(p.layout.tensor_parallel, 1, "{p:?}");
        let tps: BTreeSet<String> = p.runners_up.iter().map(|r| r.layout.clone()).collect();
        assert!(
            tps.contains("dp2×pp1×tp2") && tps.contains("dp1×pp1×tp4"),
            "{tps:?}"
        );
        // a wide one, whose parameters and their state outweigh the activations, on slots
        // with room for 60% of what a data-parallel rank holds: split it must be
        t.model_config = Some(
            serde_json::json!({"d_model": 256, "n_layer": 2, "n_head": 4, "ctx": 16, "vocab": 64}),
        );
        let mut dp = t.clone();
        dp.tensor_parallel = Degree::Fixed(1);
        let whole = plan(&dp, 4).unwrap().max_memory_bytes as f64 / (1u64 << 30) as f64;
        t.memory_per_slot_gib = Some(whole * 0.6);
        let q = plan(&t, 4).unwrap();
        assert!(
            q.layout.tensor_parallel > 1 || q.layout.pipeline_parallel > 1,
            "{:?}",
            q.layout
        );
        assert!(q.max_memory_bytes as f64 <= whole * 0.6 * (1u64 << 30) as f64);
        // the same inputs, the same choice
        assert_eq!(plan(&t, 4).unwrap(), q);
        // an MLP is not split by tensors and stages at once
        let mut m: TrainingSpec = serde_json::from_value(serde_json::json!({
            "strategy": "hybrid", "model": "mlp", "model_config": {"hidden": 64, "layers": 4},
            "dataset": "file:///d", "global_batch": 32, "pipeline_parallel": 2,
            "tensor_parallel": 2,
        }))
        .unwrap();
        let e = plan(&m, 4).unwrap_err();
        assert!(e.contains("column/row pair"), "{e}");
        m.pipeline_parallel = Degree::Fixed(1);
        assert_eq!(plan(&m, 4).unwrap().layout.to_string(), "dp2×pp1×tp2");
    }
}

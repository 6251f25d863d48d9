//! Pipeline planning without tch: the model as a list of units (embeddings, each block, the
//! head) with a cost model, the layout of a world (`dp × pp × tp`, spares), balanced stage
//! boundaries, the schedules' per-stage order of work, and each member's coordinates.
//!
//! The daemon plans every generation with [`plan`]; the worker reads the plan from the
//! generation and maps its parameters to units with [`unit_of`], so both sides agree on what
//! a stage holds.

use ductile_cluster::records::{Degree, JobSpec, Layout, TrainingSpec};
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
    /// The parameter-name prefixes (before the first `.`) this unit holds.
    pub prefixes: Vec<String>,
    pub params: u64,
    /// Forward and backward FLOPs per sample.
    pub flops: f64,
    /// Bytes of the activation this unit hands to the next, per sample.
    pub out_bytes: u64,
    /// Bytes kept for the backward pass per sample in flight.
    pub stash_bytes: u64,
}

/// The units of a job's model, in order (the GPT: `embed`, `h0..`, `head`; the MLP: `l0..`,
/// `out`). Sizes the spec leaves to the dataset (the GPT's vocabulary when `vocab = 0`, the
/// MLP's input and output widths) are estimated; they only weigh the balance.
pub fn units(t: &TrainingSpec) -> Result<Vec<Unit>, String> {
    match t.model.as_str() {
        "gpt" => {
            let g = t.gpt_config().map_err(|e| e.to_string())?;
            let (c, l, ctx, heads) = (
                g.d_model as u64,
                g.n_layer as u64,
                g.ctx as u64,
                g.n_head as u64,
            );
            let vocab = (g.vocab as u64).max(256);
            let mut v = vec![Unit {
                name: "embed".into(),
                prefixes: vec!["tok".into(), "pos".into()],
                params: (vocab + ctx) * c,
                flops: (4 * ctx * c) as f64,
                out_bytes: 4 * ctx * c,
                stash_bytes: 4 * ctx * c,
            }];
            for i in 0..l {
                v.push(Unit {
                    name: format!("h{i}"),
                    prefixes: vec![format!("h{i}")],
                    params: 12 * c * c + 13 * c,
                    flops: 6.0 * (12 * c * c * ctx) as f64 + 12.0 * (ctx * ctx * c) as f64,
                    out_bytes: 4 * ctx * c,
                    stash_bytes: 4 * (17 * ctx * c + 3 * heads * ctx * ctx),
                });
            }
            v.push(Unit {
                name: "head".into(),
                prefixes: vec!["ln_f".into(), "head".into()],
                params: c * vocab + 2 * c,
                flops: 6.0 * (c * vocab * ctx) as f64,
                out_bytes: 4,
                stash_bytes: 4 * (2 * ctx * vocab + ctx * c),
            });
            Ok(v)
        }
        "mlp" => {
            let m = t.mlp_config().map_err(|e| e.to_string())?;
            let h = m.hidden as u64;
            let mut v = Vec::new();
            for i in 0..m.layers as u64 {
                v.push(Unit {
                    name: format!("l{i}"),
                    prefixes: vec![format!("l{i}")],
                    params: h * h + h,
                    flops: 6.0 * (h * h) as f64,
                    out_bytes: 4 * h,
                    stash_bytes: 8 * h,
                });
            }
            v.push(Unit {
                name: "out".into(),
                prefixes: vec!["out".into()],
                params: h + 1,
                flops: 6.0 * h as f64,
                out_bytes: 4,
                stash_bytes: 4 * h,
            });
            Ok(v)
        }
        m => Err(format!("model {m:?} is unknown")),
    }
}

/// The unit a parameter (by its name, `h3.qkv.weight`) belongs to.
pub fn unit_of(units: &[Unit], param: &str) -> Option<usize> {
    let head = param.split('.').next().unwrap_or(param);
    units
        .iter()
        .position(|u| u.prefixes.iter().any(|p| p == head))
}

/// One stage of a plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StagePlan {
    pub stage: u32,
    /// Units `[first, end)`.
    pub first: u32,
    pub end: u32,
    /// `embed..h1`.
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
    /// Stage s holds units `[boundaries[s], boundaries[s+1])`.
    pub boundaries: Vec<u32>,
    pub stages: Vec<StagePlan>,
    /// Micro-batches per step per replica.
    pub micro_batches: u32,
    pub schedule: String,
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

/// The schedules' idle fraction per stage: `(p−1)/(m+p−1)` for GPipe and 1F1B.
pub fn bubble_fraction(_schedule: &str, p: u32, m: u32) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    (p - 1) as f64 / (m + p - 1) as f64
}

/// One piece of a stage's work in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Forward of micro-batch i.
    Fwd(u32),
    /// Backward of micro-batch i.
    Bwd(u32),
}

/// The order of work of `stage` of `p` over `m` micro-batches. GPipe: every forward, then
/// every backward. 1F1B: `p − stage − 1` warm-up forwards, then one forward and one backward
/// in turn, then the remaining backwards. Backwards run in micro-batch order in both, so a
/// stage's gradients accumulate in the same order whatever the schedule.
pub fn stage_ops(schedule: &str, p: u32, m: u32, stage: u32) -> Vec<Op> {
    let mut ops = Vec::with_capacity(2 * m as usize);
    if schedule == "gpipe" {
        ops.extend((0..m).map(Op::Fwd));
        ops.extend((0..m).map(Op::Bwd));
        return ops;
    }
    let warm = (p - stage - 1).min(m);
    ops.extend((0..warm).map(Op::Fwd));
    for i in 0..m - warm {
        ops.push(Op::Fwd(warm + i));
        ops.push(Op::Bwd(i));
    }
    ops.extend((m - warm..m).map(Op::Bwd));
    ops
}

/// A member's coordinates: `(dp_rank, pp_stage)`, or None for a spare. Ranks are laid out
/// `rank = dp_rank · pp + pp_stage`, so the stages of one replica are neighbours.
pub fn coords(layout: &Layout, rank: u32) -> Option<(u32, u32)> {
    let pp = layout.pipeline_parallel.max(1);
    (rank < layout.data_parallel * pp).then(|| (rank / pp, rank % pp))
}

struct Candidate {
    dp: u32,
    pp: u32,
}

fn model_step(
    t: &TrainingSpec,
    us: &[Unit],
    world: u32,
    c: &Candidate,
) -> Result<(Vec<u32>, Vec<StagePlan>, u32, f64), String> {
    let (dp, pp) = (c.dp, c.pp);
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
    let costs: Vec<u64> = us.iter().map(|u| u.flops.max(1.0) as u64).collect();
    let b = balance(&costs, pp as usize);
    let opt_states = if t.optimizer == "sgd" { 1 } else { 2 };
    let micro = per_replica.div_ceil(m) as u64;
    let mut stages = Vec::new();
    for s in 0..pp {
        let (a, e) = (b[s as usize] as usize, b[s as usize + 1] as usize);
        let part = &us[a..e];
        let params: u64 = part.iter().map(|u| u.params).sum();
        let stash: u64 = part.iter().map(|u| u.stash_bytes).sum();
        let in_flight = if t.schedule == "gpipe" {
            m
        } else {
            (pp - s).min(m)
        } as u64;
        let flops: f64 = part.iter().map(|u| u.flops).sum();
        stages.push(StagePlan {
            stage: s,
            first: a as u32,
            end: e as u32,
            units: if e - a == 1 {
                part[0].name.clone()
            } else {
                format!("{}..{}", part[0].name, part[e - a - 1].name)
            },
            params,
            memory_bytes: params * 4 * (2 + opt_states) + stash * micro * in_flight,
            compute_s: flops * per_replica as f64 / SLOT_FLOPS,
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
    let pipeline = slowest * (m + pp - 1) as f64 / m as f64;
    let p2p = if pp > 1 {
        let act = us[b[1] as usize - 1].out_bytes * micro;
        2.0 * (pp - 1) as f64 * (act as f64 / LINK_BYTES_PER_S + LINK_LATENCY_S)
    } else {
        0.0
    };
    let biggest = stages.iter().map(|s| s.params).max().unwrap_or(0);
    let allreduce = if dp > 1 {
        2.0 * (dp - 1) as f64 / dp as f64 * (biggest * 4) as f64 / LINK_BYTES_PER_S
            + 2.0 * (dp - 1) as f64 * LINK_LATENCY_S
    } else {
        0.0
    };
    Ok((b, stages, m, pipeline + p2p + allreduce))
}

/// The plan for job `t` at `world` ranks.
pub fn plan(t: &TrainingSpec, world: u32) -> Result<Plan, String> {
    if world == 0 {
        return Err("a world has at least one rank".into());
    }
    let us = units(t)?;
    let max_pp = (us.len() as u32).min(world);
    let one = |dp: u32, pp: u32| Candidate { dp, pp };
    let (cands, why): (Vec<Candidate>, String) = match (t.strategy.as_str(), t.pipeline_parallel) {
        ("data-parallel", _) => (vec![one(world, 1)], "strategy data-parallel".into()),
        (_, Degree::Fixed(n)) if n > world => {
            return Err(format!(
                "{world} ranks cannot host pipeline_parallel = {n} stages"
            ))
        }
        (_, Degree::Fixed(n)) => (vec![one(world / n, n)], format!("pipeline_parallel = {n}")),
        (s, Degree::Auto) => {
            // one stage only where it may be chosen, or where nothing else fits
            let single = (s == "auto" || max_pp < 2).then(|| one(world, 1));
            let cands = single
                .into_iter()
                .chain((2..=max_pp).map(|pp| one(world / pp, pp)))
                .collect();
            let why = if s == "pipeline" {
                "pipeline_parallel = auto: the fastest modelled layout with every layer held by two replicas where the world allows it"
            } else {
                "strategy auto: the fastest modelled layout"
            };
            (cands, why.into())
        }
    };
    let mut scored = Vec::new();
    let mut refused = Vec::new();
    for c in &cands {
        let layout = Layout {
            data_parallel: c.dp,
            pipeline_parallel: c.pp,
            tensor_parallel: 1,
        };
        match model_step(t, &us, world, c) {
            Ok(r) => scored.push((c, layout, r)),
            Err(e) => refused.push(RunnerUp {
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
    let redundant = t.strategy == "pipeline";
    // order: redundancy first, then modelled time, then fewer spares and fewer stages
    scored.sort_by(|a, b| {
        let ra = redundant && a.0.dp < 2;
        let rb = redundant && b.0.dp < 2;
        ra.cmp(&rb)
            .then(a.2 .3.total_cmp(&b.2 .3))
            .then((world - a.0.dp * a.0.pp).cmp(&(world - b.0.dp * b.0.pp)))
            .then(a.0.pp.cmp(&b.0.pp))
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
    let spares = world - best.dp * best.pp;
    let mut reason = why;
    if spares > 0 {
        reason.push_str(&format!(
            "; {spares} spare rank(s): {world} does not split into {} stages",
            best.pp
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
        schedule: t.schedule.clone(),
        bubble: bubble_fraction(&t.schedule, best.pp, m),
        step_time_s: step,
        reason,
        runners_up,
    })
}

/// Checks at submission what the records cannot: the stage count against the model and the
/// sizes the job may take. Returns (field, reason).
pub fn check_job(spec: &JobSpec) -> Result<(), (String, String)> {
    let Some(t) = &spec.training else {
        return Ok(());
    };
    if !t.pipelined() {
        return Ok(());
    }
    let us = units(t).map_err(|e| ("training.model_config".to_string(), e))?;
    if let Degree::Fixed(n) = t.pipeline_parallel {
        if n as usize > us.len() {
            return Err((
                "training.pipeline_parallel".into(),
                format!(
                    "{n} stages but the model has {} units (embeddings, blocks, head)",
                    us.len()
                ),
            ));
        }
        if n > spec.max {
            return Err((
                "training.pipeline_parallel".into(),
                format!(
                    "{n} stages: no allowed world size in [min, max] = [{}, {}] can host them",
                    spec.min, spec.max
                ),
            ));
        }
        if let Some(m) = t.pipeline_micro_batches {
            if m < n {
                return Err((
                    "training.pipeline_micro_batches".into(),
                    format!("{m} is below pipeline_parallel = {n}: every stage needs a micro-batch in flight"),
                ));
            }
        }
    }
    if let (Some(m), Degree::Auto) = (t.pipeline_micro_batches, t.pipeline_parallel) {
        if m < 2 && t.strategy == "pipeline" && spec.max > 1 {
            return Err((
                "training.pipeline_micro_batches".into(),
                format!("{m} is below 2: no pipeline of 2 or more stages fits"),
            ));
        }
    }
    let mut last = String::new();
    for n in spec.min..=spec.max.min(spec.min + 4096) {
        match plan(t, n) {
            Ok(_) => return Ok(()),
            Err(e) => last = e,
        }
    }
    Err((
        "training".into(),
        format!(
            "no world size in [min, max] = [{}, {}] can run this job: {last}",
            spec.min, spec.max
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn schedules_run_every_micro_batch_once_and_backwards_in_order() {
        for sched in ["gpipe", "1f1b"] {
            for p in 1..=4 {
                for m in [1, 2, 4, 8] {
                    for s in 0..p {
                        let ops = stage_ops(sched, p, m, s);
                        let f: Vec<u32> = ops
                            .iter()
                            .filter_map(|o| match o {
                                Op::Fwd(i) => Some(*i),
                                _ => None,
                            })
                            .collect();
                        let b: Vec<u32> = ops
                            .iter()
                            .filter_map(|o| match o {
                                Op::Bwd(i) => Some(*i),
                                _ => None,
                            })
                            .collect();
                        assert_eq!(f, (0..m).collect::<Vec<_>>());
                        assert_eq!(b, (0..m).collect::<Vec<_>>());
                        // a backward never precedes its forward
                        for i in 0..m {
                            let fi = ops.iter().position(|o| *o == Op::Fwd(i)).unwrap();
                            let bi = ops.iter().position(|o| *o == Op::Bwd(i)).unwrap();
                            assert!(fi < bi);
                        }
                    }
                }
            }
        }
        // 1F1B keeps at most p − stage micro-batches in flight
        let ops = stage_ops("1f1b", 4, 8, 0);
        assert_eq!(&ops[..4], &[Op::Fwd(0), Op::Fwd(1), Op::Fwd(2), Op::Fwd(3)]);
        assert_eq!(ops[4], Op::Bwd(0));
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
        assert_eq!(coords(&p4.layout, 3), Some((1, 1)));
        assert_eq!(coords(&p4.layout, 1), Some((0, 1)));
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
        let us = units(&gpt("pipeline", Degree::Auto, 2)).unwrap();
        let names: Vec<&str> = us.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["embed", "h0", "h1", "head"]);
        assert_eq!(unit_of(&us, "tok.weight"), Some(0));
        assert_eq!(unit_of(&us, "h1.qkv.bias"), Some(2));
        assert_eq!(unit_of(&us, "ln_f.weight"), Some(3));
        assert_eq!(unit_of(&us, "nope.weight"), None);
    }
}

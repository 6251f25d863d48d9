//! The pipeline schedules (GPipe, 1F1B, interleaved 1F1B): each stage's order of work in a
//! step, what it sends and needs, and the bubble they leave.

pub use ductile_cluster::records::Schedule;

/// The schedules' idle fraction of a step per stage: `(p−1)/(m+p−1)` for GPipe and 1F1B,
/// `(p−1)/(v·m+p−1)` for interleaved 1F1B with v chunks per stage (whose bubble, measured
/// against the ideal step rather than the whole, is Megatron's `(p−1)/(v·m)`).
pub fn bubble_fraction(schedule: Schedule, p: u32, m: u32) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let v = schedule.chunks_per_stage();
    (p - 1) as f64 / (v * m + p - 1) as f64
}

/// One piece of a stage's work in a step: (micro-batch, the stage's local chunk).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Forward of micro-batch i through local chunk j.
    Fwd(u32, u32),
    /// Backward of micro-batch i through local chunk j.
    Bwd(u32, u32),
}

/// The order of work of `stage` of `p` over `m` micro-batches. GPipe: every forward, then
/// every backward. 1F1B: `p − stage − 1` warm-up forwards, then one forward and one backward
/// in turn, then the remaining backwards. Backwards run in micro-batch order in both, so a
/// stage's gradients accumulate in the same order whatever the schedule. Interleaved 1F1B
/// (Megatron's, v = 2 chunks per stage, `m` a multiple of `p`): forwards visit groups of `p`
/// micro-batches chunk by chunk, backwards the chunks in reverse; `2(p − stage − 1) + (v−1)p`
/// warm-up forwards (all of them when m = p); each chunk's backwards still in micro-batch
/// order. Where p does not divide m, every forward, then every backward.
pub fn stage_ops(schedule: Schedule, p: u32, m: u32, stage: u32) -> Vec<Op> {
    let v = schedule.chunks_per_stage();
    let mut ops = Vec::with_capacity((2 * m * v) as usize);
    if v > 1 && !m.is_multiple_of(p) {
        // groups of p micro-batches do not tile m (the planner avoids it): every forward,
        // chunk by chunk, then every backward, chunks in reverse
        for j in 0..v {
            ops.extend((0..m).map(|i| Op::Fwd(i, j)));
        }
        for j in (0..v).rev() {
            ops.extend((0..m).map(|i| Op::Bwd(i, j)));
        }
        return ops;
    }
    if v > 1 {
        let total = m * v;
        let warm = if m == p {
            total
        } else {
            (2 * (p - stage - 1) + (v - 1) * p).min(total)
        };
        let at = |k: u32, backward: bool| {
            let (group, inside) = (k / (p * v), k % (p * v));
            let chunk = inside / p;
            let mb = group * p + inside % p;
            if backward {
                Op::Bwd(mb, v - 1 - chunk)
            } else {
                Op::Fwd(mb, chunk)
            }
        };
        ops.extend((0..warm).map(|k| at(k, false)));
        for i in 0..total - warm {
            ops.push(at(warm + i, false));
            ops.push(at(i, true));
        }
        ops.extend((total - warm..total).map(|k| at(k, true)));
        return ops;
    }
    if schedule == Schedule::Gpipe {
        ops.extend((0..m).map(|i| Op::Fwd(i, 0)));
        ops.extend((0..m).map(|i| Op::Bwd(i, 0)));
        return ops;
    }
    let warm = (p - stage - 1).min(m);
    ops.extend((0..warm).map(|i| Op::Fwd(i, 0)));
    for i in 0..m - warm {
        ops.push(Op::Fwd(warm + i, 0));
        ops.push(Op::Bwd(i, 0));
    }
    ops.extend((m - warm..m).map(|i| Op::Bwd(i, 0)));
    ops
}

/// A point-to-point message of a step, named by what the receiver does with it: the input
/// activation of micro-batch `mb` into global chunk `chunk`, or the gradient of that chunk's
/// output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    Act { mb: u32, chunk: u32 },
    Grad { mb: u32, chunk: u32 },
}

/// The message `op` of `stage` sends when it completes, and to whom (`p` stages, `v` chunks
/// each: global chunk `j·p + stage`, its successor on stage `(stage + 1) % p`).
pub fn sends(op: Op, stage: u32, p: u32, v: u32) -> Option<(u32, Msg)> {
    match op {
        Op::Fwd(mb, j) => {
            let k = j * p + stage;
            (k + 1 < v * p).then(|| ((stage + 1) % p, Msg::Act { mb, chunk: k + 1 }))
        }
        Op::Bwd(mb, j) => {
            let k = j * p + stage;
            (k > 0).then(|| ((stage + p - 1) % p, Msg::Grad { mb, chunk: k - 1 }))
        }
    }
}

/// The message `op` of `stage` waits for, and from whom.
pub fn needs(op: Op, stage: u32, p: u32, v: u32) -> Option<(u32, Msg)> {
    match op {
        Op::Fwd(mb, j) => {
            let k = j * p + stage;
            (k > 0).then(|| ((stage + p - 1) % p, Msg::Act { mb, chunk: k }))
        }
        Op::Bwd(mb, j) => {
            let k = j * p + stage;
            (k + 1 < v * p).then(|| ((stage + 1) % p, Msg::Grad { mb, chunk: k }))
        }
    }
}

/// Every message stage `from` sends stage `to` in a step, in the order it sends them (a
/// receiver reading them in another order keeps the early ones aside).
pub fn send_order(schedule: Schedule, p: u32, m: u32, from: u32, to: u32) -> Vec<Msg> {
    let v = schedule.chunks_per_stage();
    stage_ops(schedule, p, m, from)
        .into_iter()
        .filter_map(|op| sends(op, from, p, v))
        .filter(|(peer, _)| *peer == to)
        .map(|(_, msg)| msg)
        .collect()
}

//! `ductile-bench reshard-plan`: the time to plan a fully sharded job's re-cut when its world
//! shrinks or grows by one (`dctl scale`: every old rank alive, handing its rows over), for a
//! model of many tensors: what every rank computes before a sharded generation moves its
//! state. Also the share of the state that moves, with the row cut re-made from scratch (today's
//! cut) and with sticky row ownership ([`ductile_strategies::rows`]), against the least a
//! re-cut can move: a newcomer's share on a grow, the leaver's rows on a shrink.

use std::time::Instant;

use ductile_strategies::redistribute::{elements, plan, Part, Region};
use ductile_strategies::rows::RowOwners;

/// Rows `r` of `world` of a tensor of `rows` rows and `cols` columns: the dim-0 cut.
fn rows_of(rows: u64, cols: u64, world: u64, r: u64) -> Region {
    vec![r * rows / world..(r + 1) * rows / world, 0..cols]
}

/// Every rank's rows of every tensor at `world`.
fn sharded(shapes: &[(u64, u64)], world: u64) -> Vec<Part> {
    (0..world)
        .flat_map(|r| {
            shapes
                .iter()
                .enumerate()
                .map(move |(t, &(rows, cols))| Part {
                    rank: r as u32,
                    tensor: t,
                    region: rows_of(rows, cols, world, r),
                })
        })
        .collect()
}

/// Every place's rows of every tensor under sticky ownership `o`, ranks renamed by `rank_of`
/// (`None`: left out).
fn owned(shapes: &[(u64, u64)], o: &RowOwners, rank_of: impl Fn(u32) -> Option<u32>) -> Vec<Part> {
    (0..o.places())
        .filter_map(|p| rank_of(p).map(|r| (p, r)))
        .flat_map(|(p, r)| {
            shapes
                .iter()
                .enumerate()
                .flat_map(move |(t, &(rows, cols))| {
                    o.runs(rows, p).into_iter().map(move |x| Part {
                        rank: r,
                        tensor: t,
                        region: vec![x, 0..cols],
                    })
                })
        })
        .collect()
}

/// The median of `iters` timed plans, and the last plan's bytes moved.
fn timed(
    iters: usize,
    elem: &[u64],
    held: &[Part],
    need: &[Part],
) -> anyhow::Result<(f64, usize, u64)> {
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..iters.max(1) {
        let t0 = Instant::now();
        let p = plan(elem, held, &[], need);
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        last = Some(p);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let p = last.expect("at least one iteration")?;
    let moved = p
        .moves
        .iter()
        .map(|m| elements(&m.region) * elem[m.tensor])
        .sum();
    Ok((times[times.len() / 2], p.moves.len(), moved))
}

pub fn run(worlds: &[u32], tensors: usize, iters: usize, json: bool) -> anyhow::Result<()> {
    // a decoder's tensors: per layer 7 matrices (q, k, v, o, gate, up, down) and 2 norms,
    // SmolLM2-135M's sizes, to `tensors` in all
    let layer: [(u64, u64); 9] = [
        (576, 576),
        (192, 576),
        (192, 576),
        (576, 576),
        (1536, 576),
        (1536, 576),
        (576, 1536),
        (576, 1),
        (576, 1),
    ];
    let shapes: Vec<(u64, u64)> = (0..tensors).map(|i| layer[i % layer.len()]).collect();
    let elem = vec![4u64; shapes.len()];
    let total: u64 = shapes.iter().map(|(r, c)| r * c).sum();
    if !json {
        println!(
            "{:>6} {:>8} {:>6} {:>10} {:>8} {:>11} {:>10} {:>12} {:>10} {:>11} {:>12}",
            "world",
            "tensors",
            "to",
            "plan_ms",
            "moves",
            "moved_share",
            "minimal",
            "cut_ratio",
            "sticky_ms",
            "sticky_share",
            "sticky_ratio"
        );
    }
    for &w in worlds {
        for to in [w - 1, w + 1].into_iter().filter(|t| *t >= 1) {
            // a planned resize (`dctl scale`): every rank of the old world is alive and
            // hands its rows over; a shrink's leaver is the last rank
            let held = sharded(&shapes, w as u64);
            let need = sharded(&shapes, to as u64);
            let (ms, moves, moved) = timed(iters, &elem, &held, &need)
                .map_err(|e| anyhow::anyhow!("{w} -> {to}: {e}"))?;
            let owners = RowOwners::even(RowOwners::chunks_for(w.max(to)), w);
            let stay: Vec<Option<u32>> = (0..w).map(|p| (p < to).then_some(p)).collect();
            let next = owners
                .resized(&stay, to)
                .map_err(|e| anyhow::anyhow!("{w} -> {to}: {e}"))?;
            let (sticky_ms, _, sticky_moved) = timed(
                iters,
                &elem,
                &owned(&shapes, &owners, Some),
                &owned(&shapes, &next, Some),
            )
            .map_err(|e| anyhow::anyhow!("{w} -> {to} (sticky): {e}"))?;
            // the least any re-cut moves: the newcomer's even share, or the leaver's rows
            // (each layout's own)
            let least = |leaver: u64| {
                if to > w {
                    total as f64 * 4.0 / to as f64
                } else {
                    leaver as f64
                }
            };
            let bytes_of = |parts: &[Part]| -> u64 {
                parts
                    .iter()
                    .map(|p| elements(&p.region) * elem[p.tensor])
                    .sum()
            };
            let cut_least = least(bytes_of(
                &held
                    .iter()
                    .filter(|p| p.rank == w - 1)
                    .cloned()
                    .collect::<Vec<_>>(),
            ));
            let sticky_least = least(bytes_of(&owned(&shapes, &owners, |p| {
                (p == w - 1).then_some(p)
            })));
            let share = moved as f64 / (total * 4) as f64;
            let sticky_share = sticky_moved as f64 / (total * 4) as f64;
            let minimal = 1.0 / w.max(to) as f64;
            let cut_ratio = moved as f64 / cut_least;
            let sticky_ratio = sticky_moved as f64 / sticky_least;
            if json {
                println!(
                    "{}",
                    serde_json::json!({"world": w, "tensors": tensors, "to": to, "plan_ms": ms,
                        "moves": moves, "moved_share": share, "minimal_share": minimal,
                        "cut_ratio": cut_ratio, "sticky_plan_ms": sticky_ms,
                        "sticky_share": sticky_share, "sticky_ratio": sticky_ratio})
                );
            } else {
                println!(
                    "{w:>6} {tensors:>8} {to:>6} {ms:>10.3} {moves:>8} {share:>11.3} {minimal:>10.3} {cut_ratio:>12.2} {sticky_ms:>10.3} {sticky_share:>11.3} {sticky_ratio:>12.3}"
                );
            }
        }
    }
    Ok(())
}

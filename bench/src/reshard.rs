//! `ductile-bench reshard-plan`: the time to plan a fully sharded job's re-cut when its world
//! shrinks or grows by one (`dctl scale`: every old rank alive, handing its rows over), for a
//! model of many tensors: what every rank computes before a sharded generation moves its
//! state. Also the share of the state that moves (the row cut re-made from scratch) against the
//! 1/N a minimal re-cut would move.

use std::time::Instant;

use ductile_strategies::redistribute::{elements, plan, Part, Region};

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
            "{:>6} {:>8} {:>6} {:>12} {:>10} {:>12} {:>10}",
            "world", "tensors", "to", "plan_ms", "moves", "moved_share", "minimal"
        );
    }
    for &w in worlds {
        let w = w as u64;
        for to in [w - 1, w + 1].into_iter().filter(|t| *t >= 1) {
            // a planned resize (`dctl scale`): every rank of the old world is alive and
            // hands its rows over
            let held = sharded(&shapes, w);
            let need = sharded(&shapes, to);
            let mut times = Vec::new();
            let mut last = None;
            for _ in 0..iters.max(1) {
                let t0 = Instant::now();
                let p = plan(&elem, &held, &[], &need);
                times.push(t0.elapsed().as_secs_f64() * 1e3);
                last = Some(p);
            }
            times.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let ms = times[times.len() / 2];
            let p = last
                .expect("at least one iteration")
                .map_err(|e| anyhow::anyhow!("world {w} -> {to}: {e}"))?;
            let moves = p.moves.len();
            let moved: u64 = p.moves.iter().map(|m| elements(&m.region)).sum();
            let share = moved as f64 / total as f64;
            let minimal = 1.0 / w.max(to) as f64;
            if json {
                println!(
                    "{}",
                    serde_json::json!({"world": w, "tensors": tensors, "to": to, "plan_ms": ms,
                        "moves": moves, "moved_share": share, "minimal_share": minimal})
                );
            } else {
                println!(
                    "{w:>6} {tensors:>8} {to:>6} {ms:>12.3} {moves:>10} {share:>12.3} {minimal:>10.3}"
                );
            }
        }
    }
    Ok(())
}

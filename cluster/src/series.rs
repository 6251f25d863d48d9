//! A job's training history for charts: a bounded, downsampled per-step series (loss,
//! samples/s, generation, world size, each rank's step time) and the generations as markers.
//!
//! The leader appends a point per progress report (rank 0 reports about once a second) and
//! keeps the series in one etcd key per job (`jobs/{job}/series`, fenced like its other writes),
//! so it survives a failover (the next leader reads it back) and compaction (it is a value, not
//! watch history). It stays bounded: past [`MAX_POINTS`] points the older half is merged pair
//! by pair (within a generation: a marker's neighbourhood keeps its resolution the longest), so
//! recent steps are at full resolution and old ones coarser; past [`MAX_MARKS`] markers the
//! oldest go.

use serde::{Deserialize, Serialize};

use crate::records::{Layout, Reason};

/// Points kept at most; the series' JSON stays under about 120 KB with 4 ranks.
pub const MAX_POINTS: usize = 1024;
/// Generation markers kept at most.
pub const MAX_MARKS: usize = 256;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Series {
    pub job: String,
    /// In step order.
    pub points: Vec<Point>,
    /// By generation number.
    pub marks: Vec<Mark>,
}

/// One progress report, or the mean of `merged` consecutive ones of a generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub step: u64,
    /// Wall-clock time of the (last) report, ms since the epoch.
    pub t_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sps: Option<f32>,
    /// The latest eval loss as of this report, and the step it was computed at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_step: Option<u64>,
    /// The learning rate and the gradient norm (before clipping) of the report's step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f32>,
    pub generation: u64,
    pub world: u32,
    /// Each rank's mean step time (ms), by rank; empty when not reported.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_ms: Vec<f32>,
    /// How many reports this point stands for.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub merged: u32,
}

fn one() -> u32 {
    1
}
fn is_one(n: &u32) -> bool {
    *n == 1
}

/// A TorchFT quorum of a `runtime = "torchft"` job, drawn as a marker at its highest step (the
/// API adds the job room's quorums to the chart history; the leader's series does not hold
/// them).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QuorumMark {
    pub quorum_id: i64,
    /// When the lighthouse issued it, ms since the epoch.
    pub at_ms: u64,
    /// The highest step among its members (where the groups train on from).
    pub step: u64,
    pub members: u32,
    /// How many of its members heal from another.
    pub healing: u32,
}

/// A generation, drawn as a vertical marker at the step it resumed from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Mark {
    pub generation: u64,
    pub reason: Reason,
    pub detail: String,
    /// The step the generation resumed from.
    pub step: u64,
    /// When its triggering event was observed, ms since the epoch.
    pub at_ms: u64,
    pub world_size: u32,
    pub layout: Layout,
    /// From the trigger to the last member joining, once known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reform_s: Option<f64>,
}

/// Four significant digits are plenty for a chart and keep the JSON short.
pub fn round4(x: f64) -> f32 {
    if x == 0.0 || !x.is_finite() {
        return x as f32;
    }
    let scale = 10f64.powi(3 - x.abs().log10().floor() as i32);
    ((x * scale).round() / scale) as f32
}

impl Series {
    pub fn new(job: &str) -> Series {
        Series {
            job: job.into(),
            ..Default::default()
        }
    }

    /// Append a report. A report at or below the last point's step (a run resumed from an
    /// earlier checkpoint, a resubmission) replaces the points from that step on.
    pub fn push(&mut self, p: Point) {
        if let Some(i) = self.points.iter().position(|q| q.step >= p.step) {
            self.points.truncate(i);
        }
        self.points.push(p);
        while self.points.len() > MAX_POINTS {
            if !self.merge_older_half() {
                self.points.remove(0);
            }
        }
    }

    /// Merge consecutive pairs of the same generation in the older half; false if none.
    fn merge_older_half(&mut self) -> bool {
        let half = self.points.len() / 2;
        let mut out: Vec<Point> = Vec::with_capacity(self.points.len());
        let mut merged_any = false;
        let mut it = std::mem::take(&mut self.points)
            .into_iter()
            .enumerate()
            .peekable();
        while let Some((i, a)) = it.next() {
            let pair = i < half
                && it
                    .peek()
                    .is_some_and(|(j, b)| *j < half && b.generation == a.generation);
            if pair {
                let (_, b) = it.next().unwrap();
                out.push(merge(a, b));
                merged_any = true;
            } else {
                out.push(a);
            }
        }
        self.points = out;
        merged_any
    }

    /// Add or update a generation's marker.
    pub fn mark(&mut self, m: Mark) {
        match self
            .marks
            .binary_search_by_key(&m.generation, |x| x.generation)
        {
            Ok(i) => self.marks[i] = m,
            Err(i) => self.marks.insert(i, m),
        }
        if self.marks.len() > MAX_MARKS {
            let extra = self.marks.len() - MAX_MARKS;
            self.marks.drain(..extra);
        }
    }

    /// The points from step `from` on, at most one per `every` steps (the first of each
    /// stretch; the last point is always kept, so a chart ends where the job is).
    pub fn query(&self, from: u64, every: u64) -> Vec<Point> {
        let mut out: Vec<Point> = Vec::new();
        let pts: Vec<&Point> = self.points.iter().filter(|p| p.step >= from).collect();
        for (i, p) in pts.iter().enumerate() {
            let last = i + 1 == pts.len();
            match out.last() {
                Some(q) if p.step < q.step + every.max(1) && !last => {}
                _ => out.push((*p).clone()),
            }
        }
        out
    }
}

fn merge(a: Point, b: Point) -> Point {
    let (wa, wb) = (a.merged as f64, b.merged as f64);
    // each side weighted by the reports it stands for
    let w = |x: f32, y: f32| round4((x as f64 * wa + y as f64 * wb) / (wa + wb));
    let mean = |x: Option<f32>, y: Option<f32>| match (x, y) {
        (Some(x), Some(y)) => Some(w(x, y)),
        (x, y) => y.or(x),
    };
    let rank_ms = if a.rank_ms.len() == b.rank_ms.len() {
        a.rank_ms
            .iter()
            .zip(&b.rank_ms)
            .map(|(x, y)| w(*x, *y))
            .collect()
    } else {
        b.rank_ms.clone()
    };
    Point {
        step: b.step,
        t_ms: b.t_ms,
        loss: mean(a.loss, b.loss),
        sps: mean(a.sps, b.sps),
        // the later eval (an eval loss is a measurement at its step, not averaged)
        eval_loss: b.eval_loss.or(a.eval_loss),
        eval_step: b.eval_step.or(a.eval_step),
        // the rate of the point's step (the later report's)
        lr: b.lr.or(a.lr),
        grad_norm: mean(a.grad_norm, b.grad_norm),
        generation: b.generation,
        world: b.world,
        rank_ms,
        merged: a.merged + b.merged,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(step: u64, generation: u64) -> Point {
        Point {
            step,
            t_ms: step * 10,
            loss: Some(round4(10.0 / (step + 1) as f64)),
            sps: Some(100.0),
            eval_loss: None,
            eval_step: None,
            lr: None,
            grad_norm: None,
            generation,
            world: 4,
            rank_ms: vec![10.0, 12.5, 11.0, 30.0],
            merged: 1,
        }
    }

    #[test]
    fn a_long_run_stays_bounded_keeps_recent_points_and_every_generation_boundary() {
        let mut s = Series::new("j");
        // 100k steps, a report every 5 steps, a new generation every 10k steps
        for step in (0..100_000u64).step_by(5) {
            s.push(pt(step, 1 + step / 10_000));
        }
        assert!(s.points.len() <= MAX_POINTS, "{}", s.points.len());
        assert!(s.points.windows(2).all(|w| w[0].step < w[1].step));
        // every report is counted once
        let reports: u32 = s.points.iter().map(|p| p.merged).sum();
        assert_eq!(reports, 20_000);
        // the newest reports are untouched
        let tail = &s.points[s.points.len() - 100..];
        assert!(tail.iter().all(|p| p.merged == 1));
        assert_eq!(s.points.last().unwrap().step, 99_995);
        // every generation still has points, and no point mixes two
        for g in 1..=10 {
            assert!(s.points.iter().any(|p| p.generation == g), "generation {g}");
        }
        let json = serde_json::to_vec(&s).unwrap();
        assert!(json.len() < 128_000, "{} bytes", json.len());
    }

    #[test]
    fn a_report_below_the_last_step_replaces_the_rest_and_queries_thin_out() {
        let mut s = Series::new("j");
        for step in 0..100 {
            s.push(pt(step, 1));
        }
        s.push(pt(40, 2));
        assert_eq!(s.points.len(), 41);
        assert_eq!(s.points.last().unwrap().generation, 2);
        let q = s.query(10, 10);
        let steps: Vec<u64> = q.iter().map(|p| p.step).collect();
        assert_eq!(steps, vec![10, 20, 30, 40]);
        assert_eq!(s.query(41, 1), vec![]);
    }

    #[test]
    fn markers_are_kept_in_order_updated_in_place_and_bounded() {
        let mut s = Series::new("j");
        let m = |g: u64, reform_s| Mark {
            generation: g,
            reason: Reason::Failure,
            detail: format!("g{g}"),
            step: g * 10,
            at_ms: g,
            world_size: 2,
            layout: Layout {
                data_parallel: 2,
                pipeline_parallel: 1,
                tensor_parallel: 1,
                dp_shard: 1,
            },
            reform_s,
        };
        s.mark(m(2, None));
        s.mark(m(1, None));
        s.mark(m(2, Some(0.5)));
        assert_eq!(
            s.marks.iter().map(|x| x.generation).collect::<Vec<_>>(),
            [1, 2]
        );
        assert_eq!(s.marks[1].reform_s, Some(0.5));
        for g in 3..400 {
            s.mark(m(g, None));
        }
        assert_eq!(s.marks.len(), MAX_MARKS);
        assert_eq!(s.marks.last().unwrap().generation, 399);
        assert_eq!(round4(1.234567), 1.235);
        assert_eq!(round4(12345.67), 12350.0);
    }
}

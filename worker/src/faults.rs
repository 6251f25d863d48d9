//! Fault injection for tests and benches, honoured only when the job sets
//! `allow_fault_injection = true` (a variable without it is ignored, with a warning).
//!
//! `DUCTILE_FAULT_OVERSIZED_FRAME=RANK:STEP`: at step STEP the worker of rank RANK announces to
//! the next rank a frame of 2^62 bytes, once per process, as a broken or hostile peer would.
//! `DUCTILE_SLOWDOWN=RANK:FACTOR`: the worker of rank RANK computes FACTOR times slower (after
//! each step's forward and backward it waits (FACTOR − 1) times as long), a straggler.
//! `DUCTILE_FAULT_EXIT_BETWEEN_EXCHANGES=RANK:ROUND[:EVERY]`: streaming DiLoCo: in round ROUND
//! (and every EVERY rounds after it) the worker of rank RANK, having trained part of its piece
//! and seen the round's first exchange complete, exits (as a killed process would, a second
//! later) before the second.
//! `DUCTILE_FAULT_EXIT_MID_DECIDE=POSITIONS[:EVERY]`: async: member 0, recording the decision
//! that takes the positions applied to POSITIONS (or POSITIONS + k·EVERY) or beyond, sends it to
//! one owner only and exits (once per crossing: the owner that got it carries the count on).
//! `DUCTILE_FAULT_OLD_BUCKET_PLAN=NODE`: the workers on node NODE cut their gradient buckets in
//! parameter order, as builds before the one-plan fix did: a fleet running two builds.
//! `DUCTILE_FAULT_STALE_SEED_PLACE=1`: a new process of a fully sharded job makes its seed's
//! rows for the shard place after its own, as a process whose world changed between its start
//! and its first agreement does.
//! `DUCTILE_FAULT_EXIT_AT_COMMIT=RANK:STEP:before|after`: a fully sharded job with buddy
//! copies: at step STEP of the job's first generation the worker of rank RANK, having sent its
//! gradient rows to its copy's keeper, exits before the step's commit (`before`: no rank applies
//! the step) or after it (`after`: every other rank applies it, this one does not). Only in
//! the first generation, so the re-formed world goes on past the step.

use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

static OVERSIZED_FRAME: OnceLock<Option<(u32, u64)>> = OnceLock::new();
static SLOWDOWN: OnceLock<Option<(u32, f64)>> = OnceLock::new();
static EXIT_BETWEEN_EXCHANGES: OnceLock<Option<(u32, Every)>> = OnceLock::new();
static EXIT_MID_DECIDE: OnceLock<Option<Every>> = OnceLock::new();
static OLD_BUCKET_PLAN: OnceLock<Option<String>> = OnceLock::new();
static STALE_SEED_PLACE: OnceLock<bool> = OnceLock::new();
static EXIT_AT_COMMIT: OnceLock<Option<(u32, CommitPoint)>> = OnceLock::new();

/// A step and a side of its commit (`STEP:before` or `STEP:after`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CommitPoint {
    step: u64,
    after: bool,
}

impl FromStr for CommitPoint {
    type Err = ();
    fn from_str(s: &str) -> Result<CommitPoint, ()> {
        let (step, side) = s.split_once(':').ok_or(())?;
        let after = match side {
            "before" => false,
            "after" => true,
            _ => return Err(()),
        };
        Ok(CommitPoint {
            step: step.parse().map_err(|_| ())?,
            after,
        })
    }
}

/// A point (a round, a count of positions) and, optionally, the period it repeats at.
#[derive(Clone, Copy, Debug)]
struct Every {
    at: u64,
    every: Option<u64>,
}

impl FromStr for Every {
    type Err = ();
    fn from_str(s: &str) -> Result<Every, ()> {
        let (at, every) = match s.split_once(':') {
            Some((a, e)) => (a, Some(e.parse().map_err(|_| ())?)),
            None => (s, None),
        };
        match (at.parse().map_err(|_| ())?, every) {
            (_, Some(0)) => Err(()),
            (at, every) => Ok(Every { at, every }),
        }
    }
}

impl Every {
    /// The index of the last point at or below `x` (none below the first).
    fn index(&self, x: u64) -> Option<u64> {
        match (x.checked_sub(self.at), self.every) {
            (None, _) => None,
            (Some(_), None) => Some(0),
            (Some(d), Some(e)) => Some(d / e),
        }
    }

    /// Whether `x` is one of the points.
    fn hits(&self, x: u64) -> bool {
        match (x.checked_sub(self.at), self.every) {
            (Some(d), Some(e)) => d % e == 0,
            (Some(d), None) => d == 0,
            (None, _) => false,
        }
    }
}
static FIRED: AtomicBool = AtomicBool::new(false);

/// The variable `name` as `A:B`; none when unset, or set without `allowed` (with a warning).
fn pair<A: FromStr, B: FromStr>(
    name: &str,
    form: &str,
    allowed: bool,
) -> anyhow::Result<Option<(A, B)>> {
    let Some(s) = single(name, allowed) else {
        return Ok(None);
    };
    let bad = || anyhow::anyhow!("{name}={s:?} is not {form}");
    let (a, b) = s.split_once(':').ok_or_else(bad)?;
    Ok(Some((
        a.parse().map_err(|_| bad())?,
        b.parse().map_err(|_| bad())?,
    )))
}

/// Read the fault variables once, at start; `allowed` is the job's `allow_fault_injection`.
pub fn init(allowed: bool) -> anyhow::Result<()> {
    let _ = OVERSIZED_FRAME.set(pair("DUCTILE_FAULT_OVERSIZED_FRAME", "RANK:STEP", allowed)?);
    let slow: Option<(u32, f64)> = pair("DUCTILE_SLOWDOWN", "RANK:FACTOR", allowed)?;
    if let Some((_, f)) = slow {
        if !(f.is_finite() && f >= 1.0) {
            anyhow::bail!("DUCTILE_SLOWDOWN: FACTOR {f} is not at least 1");
        }
    }
    let _ = SLOWDOWN.set(slow);
    let _ = EXIT_BETWEEN_EXCHANGES.set(pair(
        "DUCTILE_FAULT_EXIT_BETWEEN_EXCHANGES",
        "RANK:ROUND[:EVERY]",
        allowed,
    )?);
    let mid = match single("DUCTILE_FAULT_EXIT_MID_DECIDE", allowed) {
        Some(s) => Some(s.parse().map_err(|_| {
            anyhow::anyhow!("DUCTILE_FAULT_EXIT_MID_DECIDE={s:?} is not POSITIONS[:EVERY]")
        })?),
        None => None,
    };
    let _ = EXIT_MID_DECIDE.set(mid);
    let _ = OLD_BUCKET_PLAN.set(single("DUCTILE_FAULT_OLD_BUCKET_PLAN", allowed));
    let stale = match single("DUCTILE_FAULT_STALE_SEED_PLACE", allowed).as_deref() {
        None | Some("0") => false,
        Some("1") => true,
        Some(s) => anyhow::bail!("DUCTILE_FAULT_STALE_SEED_PLACE={s:?} is not 0 or 1"),
    };
    let _ = STALE_SEED_PLACE.set(stale);
    let _ = EXIT_AT_COMMIT.set(pair(
        "DUCTILE_FAULT_EXIT_AT_COMMIT",
        "RANK:STEP:before|after",
        allowed,
    )?);
    Ok(())
}

/// The variable `name` as it is; none when unset, or set without `allowed` (with a warning).
fn single(name: &str, allowed: bool) -> Option<String> {
    let s = std::env::var(name).ok()?;
    if !allowed {
        tracing::warn!("{name} is set but the job does not allow_fault_injection: ignored");
        return None;
    }
    Some(s)
}

/// Whether the workers on `node` cut their gradient buckets as an older build did.
pub fn old_bucket_plan(node: &str) -> bool {
    matches!(OLD_BUCKET_PLAN.get(), Some(Some(n)) if n == node)
}

/// Whether a new process makes its seed's rows for the next shard place, not its own.
pub fn stale_seed_place() -> bool {
    STALE_SEED_PLACE.get().copied().unwrap_or(false)
}

/// How much longer rank `rank` waits after computing for `computed` (a straggler), if at all.
pub fn slowdown(rank: u32, computed: std::time::Duration) -> Option<std::time::Duration> {
    match SLOWDOWN.get() {
        Some(Some((r, f))) if *r == rank => Some(computed.mul_f64(f - 1.0)),
        _ => None,
    }
}

/// Whether rank `rank` injects the oversized frame now, at `step` (true once at most).
pub fn oversized_frame_now(rank: u32, step: u64) -> bool {
    matches!(OVERSIZED_FRAME.get(), Some(Some((r, s))) if *r == rank && *s == step)
        && !FIRED.swap(true, Ordering::SeqCst)
}

/// Exit now if rank `rank` is told to leave round `round` between two exchanges (the caller
/// checks that the round's first exchange just completed and that this process trained part
/// of its piece).
pub fn exit_between_exchanges(rank: u32, round: u64) {
    if matches!(EXIT_BETWEEN_EXCHANGES.get(), Some(Some((r, n))) if *r == rank && n.hits(round)) {
        exit_now("exiting between two exchanges");
    }
}

/// Whether member 0 cuts the decision that takes the positions applied from `before` to
/// `after` short (it then calls [`exit_now`] after sending it to one owner).
pub fn exit_mid_decide(before: u64, after: u64) -> bool {
    matches!(EXIT_MID_DECIDE.get(), Some(Some(n)) if n.index(after).is_some() && n.index(before) != n.index(after))
}

/// Exit now if rank `rank` of generation `generation` is told to leave step `step` at this
/// side of its commit (`after`).
pub fn exit_at_commit(generation: u64, rank: u32, step: u64, after: bool) {
    if generation == 1 && EXIT_AT_COMMIT.get() == Some(&Some((rank, CommitPoint { step, after }))) {
        let side = if after { "after" } else { "before" };
        exit_now(&format!("exiting {side} the commit of step {step}"));
    }
}

/// Exit as a killed process would (status 137), a second after saying why: what it sent
/// last reaches its peers first.
pub fn exit_now(why: &str) -> ! {
    tracing::warn!("fault injection: {why}");
    std::thread::sleep(std::time::Duration::from_secs(1));
    std::process::exit(137);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_point_repeats_at_its_period() {
        let once: Every = "1600".parse().unwrap();
        assert_eq!(
            (once.index(1599), once.index(1600), once.index(9000)),
            (None, Some(0), Some(0))
        );
        assert!(once.hits(1600) && !once.hits(1601));
        let every: Every = "3:5".parse().unwrap();
        assert!(every.hits(3) && every.hits(8) && !every.hits(5) && !every.hits(2));
        assert_eq!((every.index(7), every.index(8)), (Some(0), Some(1)));
        assert!("3:0".parse::<Every>().is_err() && "x".parse::<Every>().is_err());
        let p: CommitPoint = "20:after".parse().unwrap();
        assert_eq!((p.step, p.after), (20, true));
        assert!("20:before".parse::<CommitPoint>().is_ok_and(|p| !p.after));
        assert!(
            "20".parse::<CommitPoint>().is_err() && "20:during".parse::<CommitPoint>().is_err()
        );
    }
}

//! Fault injection for tests and benches, honoured only when the job sets
//! `allow_fault_injection = true` (a variable without it is ignored, with a warning).
//!
//! `DUCTILE_FAULT_OVERSIZED_FRAME=RANK:STEP`: at step STEP the worker of rank RANK announces to
//! the next rank a frame of 2^62 bytes, once per process, as a broken or hostile peer would.
//! `DUCTILE_SLOWDOWN=RANK:FACTOR`: the worker of rank RANK computes FACTOR times slower (after
//! each step's forward and backward it waits (FACTOR − 1) times as long), a straggler.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

static OVERSIZED_FRAME: OnceLock<Option<(u32, u64)>> = OnceLock::new();
static SLOWDOWN: OnceLock<Option<(u32, f64)>> = OnceLock::new();
static FIRED: AtomicBool = AtomicBool::new(false);

/// Read the fault variables once, at start; `allowed` is the job's `allow_fault_injection`.
pub fn init(allowed: bool) -> anyhow::Result<()> {
    let v = std::env::var("DUCTILE_FAULT_OVERSIZED_FRAME").ok();
    let parsed = match v.as_deref() {
        None => None,
        Some(_) if !allowed => {
            tracing::warn!("DUCTILE_FAULT_OVERSIZED_FRAME is set but the job does not allow_fault_injection: ignored");
            None
        }
        Some(s) => {
            let (r, st) = s.split_once(':').ok_or_else(|| {
                anyhow::anyhow!("DUCTILE_FAULT_OVERSIZED_FRAME={s:?} is not RANK:STEP")
            })?;
            Some((
                r.parse().map_err(|_| {
                    anyhow::anyhow!("DUCTILE_FAULT_OVERSIZED_FRAME: rank {r:?} is not a number")
                })?,
                st.parse().map_err(|_| {
                    anyhow::anyhow!("DUCTILE_FAULT_OVERSIZED_FRAME: step {st:?} is not a number")
                })?,
            ))
        }
    };
    let _ = OVERSIZED_FRAME.set(parsed);
    let slow = match std::env::var("DUCTILE_SLOWDOWN").ok() {
        None => None,
        Some(_) if !allowed => {
            tracing::warn!(
                "DUCTILE_SLOWDOWN is set but the job does not allow_fault_injection: ignored"
            );
            None
        }
        Some(s) => {
            let bad =
                || anyhow::anyhow!("DUCTILE_SLOWDOWN={s:?} is not RANK:FACTOR with FACTOR >= 1");
            let (r, f) = s.split_once(':').ok_or_else(bad)?;
            let (r, f): (u32, f64) = (r.parse().map_err(|_| bad())?, f.parse().map_err(|_| bad())?);
            if !(f.is_finite() && f >= 1.0) {
                return Err(bad());
            }
            Some((r, f))
        }
    };
    let _ = SLOWDOWN.set(slow);
    Ok(())
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

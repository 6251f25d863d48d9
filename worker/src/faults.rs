//! Fault injection for tests and benches, honoured only when the job sets
//! `allow_fault_injection = true` (a variable without it is ignored, with a warning).
//!
//! `DUCTILE_FAULT_OVERSIZED_FRAME=RANK:STEP`: at step STEP the worker of rank RANK announces to
//! the next rank a frame of 2^62 bytes, once per process, as a broken or hostile peer would.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

static OVERSIZED_FRAME: OnceLock<Option<(u32, u64)>> = OnceLock::new();
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
    Ok(())
}

/// Whether rank `rank` injects the oversized frame now, at `step` (true once at most).
pub fn oversized_frame_now(rank: u32, step: u64) -> bool {
    matches!(OVERSIZED_FRAME.get(), Some(Some((r, s))) if *r == rank && *s == step)
        && !FIRED.swap(true, Ordering::SeqCst)
}

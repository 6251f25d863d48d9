//! The submit-time checks of a job's parallel degrees against its model and world sizes.

use ductile_cluster::records::{Degree, JobSpec, Strategy};

use super::plan;

/// Checks at submission what the records cannot: the stage count against the model and the
/// sizes the job may take. Returns (field, reason).
pub fn check_job(spec: &JobSpec) -> Result<(), (String, String)> {
    let Some(t) = &spec.training else {
        return Ok(());
    };
    if !t.strategy.pipelined() {
        return Ok(());
    }
    if let Degree::Fixed(n) = t.tensor_parallel {
        crate::arch::of(t)
            .map_err(|e| ("training.model_config".to_string(), e))?
            .check_tp(n)
            .map_err(|e| ("training.tensor_parallel".to_string(), e))?;
        if let (true, Some(k)) = (t.deterministic, t.tensor_slices) {
            if k % n != 0 {
                return Err((
                    "training.tensor_slices".into(),
                    format!("{k} logical slices do not split over tensor_parallel = {n} ranks"),
                ));
            }
        }
        if n > spec.max {
            return Err((
                "training.tensor_parallel".into(),
                format!(
                    "groups of {n} ranks: no allowed world size in [min, max] = [{}, {}] can host one",
                    spec.min, spec.max
                ),
            ));
        }
    }
    let arch = crate::arch::of(t).map_err(|e| ("training.model_config".to_string(), e))?;
    let us = arch.units();
    if let Degree::Fixed(n) = t.pipeline_parallel {
        let tp = match t.tensor_parallel {
            Degree::Fixed(k) => k,
            Degree::Auto => 1,
        };
        arch.check_layout(n, tp)
            .map_err(|e| ("training.pipeline_parallel".to_string(), e))?;
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
            if t.schedule.chunks_per_stage() > 1 && n > 1 && m % n != 0 {
                return Err((
                    "training.pipeline_micro_batches".into(),
                    format!("{m} is not a multiple of pipeline_parallel = {n}, which schedule = \"interleaved-1f1b\" needs"),
                ));
            }
        }
        let v = t.schedule.chunks_per_stage();
        if v > 1 && n > 1 && (v * n) as usize > us.len() {
            return Err((
                "training.schedule".into(),
                format!(
                    "interleaved-1f1b cuts {n} stages into {} chunks but the model has {} units",
                    v * n,
                    us.len()
                ),
            ));
        }
    }
    if let (Some(m), Degree::Auto) = (t.pipeline_micro_batches, t.pipeline_parallel) {
        if m < 2 && t.strategy == Strategy::Pipeline && spec.max > 1 {
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

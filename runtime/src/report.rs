//! What a worker tells the control plane, through etcd: its join record and the weights it
//! joined with, fault reports of a failed generation, progress (rank 0) and each rank's
//! figures. Writes that the leader waits on are retried, bounded; the periodic ones go in the
//! background and the next replaces a lost one.

use std::sync::Arc;
use std::time::Duration;

use ductile_cluster::records::*;
use ductile_cluster::Store;

use crate::GenCell;

/// How long a worker whose generation failed waits for the leader's answer
/// (`DUCTILE_FAULT_WAIT_SECS`, default 120).
pub fn fault_wait() -> Duration {
    Duration::from_secs(
        std::env::var("DUCTILE_FAULT_WAIT_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(120),
    )
}

/// One worker's reports, written on the async runtime `rt` (the callers are blocking
/// threads).
#[derive(Clone)]
pub struct Reporter {
    pub store: Store,
    pub rt: tokio::runtime::Handle,
    pub job: String,
    pub node: String,
    pub slot: u32,
    pub cell: Arc<GenCell>,
}

impl Reporter {
    /// The work of `g` failed (`kind`, the ranks it points at, the error). If a newer
    /// generation exists, that was the reason and the caller goes on to it. Otherwise tell the
    /// control plane (`faults/{gen}/{rank}`) and wait, bounded ([`fault_wait`]), for the
    /// generation the leader publishes in answer (without the culprit, or the same members
    /// again); the error says none came. A generation is never formed twice: every attempt is
    /// a generation of its own, so no attempt reads another's rendezvous entries.
    pub fn failed_generation(
        &self,
        g: &Generation,
        rank: u32,
        kind: FaultKind,
        suspects: Vec<u32>,
        error: String,
    ) -> anyhow::Result<()> {
        if self.cell.newest() > g.number {
            return Ok(());
        }
        let report = FaultReport {
            generation: g.number,
            rank,
            node: self.node.clone(),
            slot: self.slot,
            kind,
            suspects,
            error: error.clone(),
            at_ms: now_ms(),
        };
        let store = self.store.clone();
        let key = store.keys.fault(&self.job, g.number, rank);
        let cell = self.cell.clone();
        let n = g.number;
        // etcd may be briefly unreachable: retry the report (bounded) unless a newer
        // generation makes it moot
        let put = self.rt.block_on(async move {
            let mut last = None;
            for i in 0..20u32 {
                if cell.newest() > n {
                    return Ok(());
                }
                match store.put_json(&key, &report, None).await {
                    Ok(_) => return Ok(()),
                    Err(err) => last = Some(err),
                }
                tokio::time::sleep(Duration::from_millis(250 * (i + 1).min(4) as u64)).await;
            }
            Err(last.unwrap())
        });
        match put {
            Ok(()) => {
                tracing::warn!(generation = n, kind = %kind, error = %error, "reported the failed generation; waiting for the next")
            }
            Err(err) => {
                tracing::error!(generation = n, error = %err, "cannot report the failed generation")
            }
        }
        let bound = fault_wait();
        match self.cell.wait_newer_for(n, bound) {
            Some(_) => Ok(()),
            None => anyhow::bail!(
                "generation {n} failed ({error}) and no newer generation came within {} s: giving up so the agent reports this slot",
                bound.as_secs()
            ),
        }
    }

    /// This rank joined generation `gnum`: the weights it joined with (`step:sha256`, the
    /// tests' and benches' view), if it holds any (a torchrun job's launcher does not), then
    /// its join record (retried, bounded, while the generation is current: the leader records
    /// the re-formation once every rank joined). In that order, so that a join record the
    /// leader has read means the weights record was written too, even where the process ends
    /// right after (a short job's last steps), before a later write could run.
    pub fn joined(&self, gnum: u64, rank: u32, join: JoinRecord, weights: Option<String>) {
        let (store, job, cell) = (self.store.clone(), self.job.clone(), self.cell.clone());
        self.rt.spawn(async move {
            if let Some(w) = weights {
                let _ = store
                    .backend
                    .put(&store.keys.weights_of(&job, gnum, rank), w.into_bytes(), None)
                    .await;
            }
            let key = store.keys.joined_rank(&job, gnum, rank);
            for i in 0..40u32 {
                match store.put_json(&key, &join, None).await {
                    Ok(_) => break,
                    Err(e) if i == 39 || cell.newest() > gnum => {
                        tracing::error!(generation = gnum, error = %e, "cannot write the join record");
                        return;
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(250 * (i + 1).min(8) as u64)).await,
                }
            }
        });
    }

    /// Rank 0's progress (in the background; the next report replaces it).
    pub fn progress(&self, p: Progress) {
        let (store, job) = (self.store.clone(), self.job.clone());
        self.rt.spawn(async move {
            let _ = store.put_json(&store.keys.progress(&job), &p, None).await;
        });
    }

    /// Rank 0's last progress, `done`: written before the worker exits, keeping the figures
    /// of the last periodic report (loss, rate, sync mode's) that `p` does not carry.
    pub fn final_progress(&self, p: Progress) -> anyhow::Result<()> {
        let store = self.store.clone();
        let prev = self.rt.block_on(store.progress(&self.job)).ok().flatten();
        // what the final report does not say (the loss and throughput of the last steps) is
        // the last report's; its own figures (a mode's at the run's end) win
        let p = match prev {
            Some(x) => Progress {
                loss: p.loss.or(x.loss),
                samples_per_sec: p.samples_per_sec.or(x.samples_per_sec),
                sync: p.sync.clone().or(x.sync),
                round: p.round.or(x.round),
                bytes_per_sample: p.bytes_per_sample.or(x.bytes_per_sample),
                staleness_mean: p.staleness_mean.or(x.staleness_mean),
                staleness_max: p.staleness_max.or(x.staleness_max),
                dropped_updates: p.dropped_updates.or(x.dropped_updates),
                grad_norm: p.grad_norm.or(x.grad_norm),
                lr: p.lr.or(x.lr),
                eval_loss: p.eval_loss.or(x.eval_loss),
                eval_step: if p.eval_loss.is_some() {
                    p.eval_step
                } else {
                    x.eval_step
                },
                ..p
            },
            None => p,
        };
        self.rt
            .block_on(store.put_json(&store.keys.progress(&self.job), &p, None))?;
        Ok(())
    }

    /// A rank's own figures (a straggler shows in its compute time), in the background.
    pub fn rank_stats(&self, s: RankStats) {
        let (store, job) = (self.store.clone(), self.job.clone());
        self.rt.spawn(async move {
            let _ = store
                .put_json(&store.keys.rank_stats(&job, s.rank), &s, None)
                .await;
        });
    }

    /// When the world of generation `gnum` completed its first step (the recovery benchmarks
    /// read it).
    pub fn first_step(&self, gnum: u64) {
        let (store, job, at) = (self.store.clone(), self.job.clone(), now_ms());
        self.rt.spawn(async move {
            let _ = store
                .backend
                .put(
                    &store.keys.first_step(&job, gnum),
                    at.to_string().into_bytes(),
                    None,
                )
                .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ductile_cluster::memory::MemoryBackend;
    use ductile_cluster::Keys;

    /// A run that ends within a second of its last periodic report: the final record keeps
    /// that report's loss and rate, and says the mode's figures as of the end (the last round).
    #[test]
    fn the_final_progress_keeps_the_last_report_s_figures_and_says_its_own() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let store = {
            let _in_rt = rt.enter(); // the memory backend's lease ticker runs on it
            Store::new(Arc::new(MemoryBackend::new()), Keys::new("/t"))
        };
        let reports = Reporter {
            store: store.clone(),
            rt: rt.handle().clone(),
            job: "j".into(),
            node: "n".into(),
            slot: 0,
            cell: Arc::new(GenCell::default()),
        };
        let last = Progress {
            generation: 2,
            step: 300,
            loss: Some(1.5),
            samples_per_sec: Some(900.0),
            sync: Some("diloco".into()),
            round: Some(14),
            ..Default::default()
        };
        rt.block_on(store.put_json(&store.keys.progress("j"), &last, None))
            .unwrap();
        let end = Progress {
            generation: 2,
            step: 480,
            done: true,
            final_weights_sha256: Some("ab".into()),
            sync: Some("diloco".into()),
            round: Some(30),
            ..Default::default()
        };
        reports.final_progress(end).unwrap();
        let got = rt.block_on(store.progress("j")).unwrap().unwrap();
        assert!(got.done);
        assert_eq!(
            (got.step, got.round),
            (480, Some(30)),
            "the end's own figures"
        );
        assert_eq!(got.loss, Some(1.5), "the last report's loss");
        assert_eq!(got.samples_per_sec, Some(900.0));
        assert_eq!(got.final_weights_sha256.as_deref(), Some("ab"));
    }
}

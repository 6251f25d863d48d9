//! The leader's keeper of the jobs' chart histories (`ductile_cluster::series`): a point per
//! progress report, a marker per generation, written to etcd every [`WRITE_EVERY`] while it
//! changes (fenced like the leader's other writes), read back by the next leader.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use ductile_cluster::kv::LeaderKey;
use ductile_cluster::records::Generation;
use ductile_cluster::series::{round4, Mark, Point, Series};
use ductile_cluster::store::{decode, Fence};
use ductile_cluster::watch::Snapshot;
use ductile_cluster::Store;
use tokio::time::Instant;

use crate::observe::job_kvs;
use crate::reconcile::JobObs;

/// How often a changing series is written (a failover loses at most this much of it; the
/// job's current figures are in its progress record either way).
pub const WRITE_EVERY: Duration = Duration::from_secs(5);

pub struct Keeper {
    kept: HashMap<String, Kept>,
    write_every: Duration,
}

impl Default for Keeper {
    fn default() -> Self {
        Keeper::new(WRITE_EVERY)
    }
}

struct Kept {
    series: Series,
    /// The last progress report taken: (generation, step, updated_at_ms).
    last: Option<(u64, u64, u64)>,
    /// The current generation as last marked, and whether its re-formation time was known.
    marked: Option<(u64, bool)>,
    dirty: bool,
    written: Option<Instant>,
}

/// A generation's marker.
pub fn mark_of(g: &Generation, reform_s: Option<f64>) -> Mark {
    Mark {
        generation: g.number,
        reason: g.reason,
        detail: g.detail.clone(),
        step: g.resume_step,
        at_ms: g.triggered_at_ms,
        world_size: g.world_size,
        layout: g.layout,
        reform_s,
    }
}

/// The series a job has in the `jobs/` snapshot (a new one when it has none; an error when
/// what is stored cannot be decoded).
pub fn stored(store: &Store, snap: &Snapshot, job: &str) -> ductile_cluster::Result<Series> {
    match snap.kvs.get(&store.keys.series(job)) {
        Some(kv) => decode::<Series>(kv, "job series"),
        None => Ok(Series::new(job)),
    }
}

/// The point a job's latest progress report makes (with each rank's step time when every rank
/// of the report's generation has one).
pub fn point_of(obs: &JobObs, series: &Series) -> Option<Point> {
    let p = obs.progress.as_ref()?;
    let world = match &obs.generation {
        Some((g, _)) if g.number == p.generation => g.world_size,
        _ => series
            .marks
            .iter()
            .find(|m| m.generation == p.generation)
            .map_or(0, |m| m.world_size),
    };
    let ranks: Vec<f32> = (0..world)
        .map_while(|r| {
            obs.rank_stats
                .get(&r)
                .filter(|s| s.generation == p.generation)
                .map(|s| round4(s.step_ms))
        })
        .collect();
    Some(Point {
        step: p.step,
        t_ms: p.updated_at_ms,
        loss: p.loss.map(round4),
        sps: p.samples_per_sec.map(round4),
        eval_loss: p.eval_loss.map(round4),
        eval_step: p.eval_step,
        lr: p.lr.map(|x| x as f32),
        grad_norm: p.grad_norm.map(round4),
        generation: p.generation,
        world,
        rank_ms: if ranks.len() == world as usize {
            ranks
        } else {
            vec![]
        },
        merged: 1,
    })
}

impl Keeper {
    /// A keeper that writes a changing series at most every `write_every`.
    pub fn new(write_every: Duration) -> Self {
        Keeper {
            kept: HashMap::new(),
            write_every,
        }
    }

    /// Bring the series in line with what this pass observed.
    pub fn observe(&mut self, store: &Store, snap: &Snapshot, jobs: &BTreeMap<String, JobObs>) {
        self.kept.retain(|j, _| jobs.contains_key(j));
        for (name, obs) in jobs {
            if obs.spec.is_none() {
                continue;
            }
            let k = self.kept.entry(name.clone()).or_insert_with(|| Kept {
                // an unreadable one is replaced at the next write (the API says it is unreadable
                // until then)
                series: stored(store, snap, name).unwrap_or_else(|e| {
                    tracing::warn!(job = %name, error = %e, "the stored chart history cannot be decoded; starting a new one");
                    Series::new(name)
                }),
                last: None,
                marked: None,
                dirty: false,
                written: None,
            });
            let Some((g, _)) = &obs.generation else {
                continue;
            };
            let reform = obs
                .status
                .as_ref()
                .and_then(|s| s.last_reformation.as_ref())
                .filter(|r| r.generation == g.number)
                .map(|r| r.seconds);
            if k.marked != Some((g.number, reform.is_some())) {
                // generations published while another replica led, or superseded before
                // this one saw them, are in the history
                let prefix = store.keys.history(name);
                for kv in job_kvs(snap, &prefix) {
                    if let Ok(h) = decode::<Generation>(kv, "generation") {
                        if !k.series.marks.iter().any(|m| m.generation == h.number) {
                            k.series.mark(mark_of(&h, None));
                        }
                    }
                }
                let old = k
                    .series
                    .marks
                    .iter()
                    .find(|m| m.generation == g.number)
                    .and_then(|m| m.reform_s);
                k.series.mark(mark_of(g, reform.or(old)));
                k.marked = Some((g.number, reform.is_some()));
                k.dirty = true;
            }
            let Some(p) = &obs.progress else { continue };
            let key = (p.generation, p.step, p.updated_at_ms);
            if k.last == Some(key) {
                continue;
            }
            k.last = Some(key);
            if let Some(pt) = point_of(obs, &k.series) {
                k.series.push(pt);
                k.dirty = true;
            }
        }
    }

    /// Write the series that changed (each at most every `write_every`, at once when its job
    /// ended); (false, _) when a write was fenced (the caller checks whether it still leads). A
    /// failed write is logged and retried a second later. With it, the next time a write is
    /// due, so the leader wakes for it.
    pub async fn flush(
        &mut self,
        store: &Store,
        leader: &LeaderKey,
        jobs: &BTreeMap<String, JobObs>,
    ) -> (bool, Option<Instant>) {
        let now = Instant::now();
        let mut due: Option<Instant> = None;
        for (name, k) in self.kept.iter_mut() {
            let Some(obs) = jobs.get(name) else { continue };
            if !k.dirty {
                continue;
            }
            let ended = obs.status.as_ref().is_some_and(|s| s.state.is_terminal())
                || obs.progress.as_ref().is_some_and(|p| p.done);
            if let Some(at) = k
                .written
                .map(|w| w + self.write_every)
                .filter(|at| *at > now && !ended)
            {
                due = Some(due.map_or(at, |d| d.min(at)));
                continue;
            }
            let fence = Fence {
                leader: Some(leader),
                spec_revision: obs.spec_revision,
            };
            match store.put_series(&k.series, &fence).await {
                Ok(true) => {
                    k.dirty = false;
                    k.written = Some(now);
                }
                Ok(false) => return (false, due),
                Err(e) => {
                    tracing::warn!(job = %name, error = %e, "cannot write the job's chart history; will retry");
                    let at = now + Duration::from_secs(1);
                    due = Some(due.map_or(at, |d| d.min(at)));
                }
            }
        }
        (true, due)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ductile_cluster::kv::KvBackend;
    use ductile_cluster::records::{JobSpec, JobState, JobStatus, Progress, RankStats};
    use ductile_cluster::Keys;

    use super::*;
    use crate::observe::jobs_from;

    async fn snapshot(store: &Store, prefix: &str) -> Snapshot {
        let (kvs, revision) = store.backend.list(prefix).await.unwrap();
        Snapshot {
            revision,
            kvs: kvs.into_iter().map(|kv| (kv.key.clone(), kv)).collect(),
            ..Default::default()
        }
    }

    /// Rank 0's progress report and both ranks' figures at `step`.
    async fn report(store: &Store, step: u64) {
        let k = &store.keys;
        let p = Progress {
            generation: 1,
            step,
            loss: Some(5.0 / (1 + step) as f64),
            samples_per_sec: Some(100.0),
            updated_at_ms: 1000 + step,
            ..Default::default()
        };
        store.put_json(&k.progress("j"), &p, None).await.unwrap();
        for rank in 0..2 {
            let r = RankStats {
                generation: 1,
                rank,
                step,
                step_ms: 10.0 + rank as f64,
                compute_ms: 5.0,
                data_ms: 0.5,
                updated_at_ms: 0,
            };
            store
                .put_json(&k.rank_stats("j", rank), &r, None)
                .await
                .unwrap();
        }
    }

    /// One leader pass: observe what etcd holds, flush.
    async fn pass(store: &Store, leader: &LeaderKey, keeper: &mut Keeper) -> bool {
        let jobs_snap = snapshot(store, &store.keys.jobs()).await;
        let live = snapshot(store, &store.keys.live()).await;
        let jobs = jobs_from(store, &[&jobs_snap, &live]);
        keeper.observe(store, &jobs_snap, &jobs);
        keeper.flush(store, leader, &jobs).await.0
    }

    async fn in_etcd(store: &Store) -> Series {
        store
            .get_json(&store.keys.series("j"), "series")
            .await
            .unwrap()
            .unwrap()
            .0
    }

    /// The steps of the points written to etcd.
    async fn written(store: &Store) -> Vec<u64> {
        in_etcd(store).await.points.iter().map(|p| p.step).collect()
    }

    #[tokio::test]
    async fn the_keeper_adds_a_point_per_report_writes_every_few_seconds_and_stops_when_fenced() {
        let backend = Arc::new(ductile_cluster::memory::MemoryBackend::new());
        let store = Store::new(backend.clone(), Keys::default());
        let spec = JobSpec::from_toml("name = \"j\"\nmin = 1\nmax = 2\ndesired = 2\n").unwrap();
        store.submit(&spec).await.unwrap();
        let mut g = crate::reconcile::test_generation(1, &[("n1", 0), ("n1", 1)]);
        g.job = "j".into();
        store
            .put_json(&store.keys.generation("j"), &g, None)
            .await
            .unwrap();
        let status = JobStatus {
            job: "j".into(),
            state: JobState::Running,
            generation: 1,
            world_size: 2,
            last_reformation: None,
            message: String::new(),
            updated_at_ms: 0,
            reformations: Default::default(),
            reformation_seconds: Default::default(),
        };
        store
            .put_json(&store.keys.status("j"), &status, None)
            .await
            .unwrap();
        let lease = backend.grant(60).await.unwrap();
        let leader = backend.campaign("el", b"me".to_vec(), lease).await.unwrap();
        let every = Duration::from_millis(300);
        let mut keeper = Keeper::new(every);

        report(&store, 10).await;
        assert!(pass(&store, &leader, &mut keeper).await);
        let s = in_etcd(&store).await;
        assert_eq!(s.points.len(), 1);
        assert_eq!(s.points[0].rank_ms, vec![10.0, 11.0]);
        assert_eq!(
            s.marks.iter().map(|m| m.generation).collect::<Vec<_>>(),
            [1]
        );
        // the next report waits for `every`, then it is written
        report(&store, 20).await;
        assert!(pass(&store, &leader, &mut keeper).await);
        assert_eq!(written(&store).await, [10]);
        tokio::time::sleep(every).await;
        assert!(pass(&store, &leader, &mut keeper).await);
        assert_eq!(written(&store).await, [10, 20]);
        // a deposed leader's write is refused; the next leader reads the series back
        backend.revoke(lease).await.unwrap();
        report(&store, 30).await;
        tokio::time::sleep(every).await;
        assert!(!pass(&store, &leader, &mut keeper).await);
        assert_eq!(written(&store).await, [10, 20]);
        let lease = backend.grant(60).await.unwrap();
        let leader = backend
            .campaign("el", b"next".to_vec(), lease)
            .await
            .unwrap();
        let mut next = Keeper::new(every);
        assert!(pass(&store, &leader, &mut next).await);
        assert_eq!(written(&store).await, [10, 20, 30]);
    }
}

//! The observed state, decoded from the view's snapshots: the fleet (nodes and drain
//! requests) and each job's control and live records. The leader loop reconciles it and the
//! API serves it; undecodable records are skipped with a warning.

use std::collections::BTreeMap;

use ductile_cluster::keys::KeyKind;
use ductile_cluster::kv::KeyValue;
use ductile_cluster::records::*;
use ductile_cluster::store::decode;
use ductile_cluster::watch::Snapshot;
use ductile_cluster::Store;

use crate::reconcile::{Fleet, JobObs};

fn decoded<T: serde::de::DeserializeOwned>(kv: &KeyValue, what: &'static str) -> Option<T> {
    match decode(kv, what) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!(error = %e, "ignoring undecodable record");
            None
        }
    }
}

/// Build the fleet view from the node and drain snapshots.
pub fn fleet_from(store: &Store, nodes: &Snapshot, drains: &Snapshot) -> Fleet {
    let mut f = Fleet::default();
    for kv in nodes.kvs.values() {
        if let KeyKind::Node { node } = store.keys.parse(&kv.key) {
            if let Some(rec) = decoded::<NodeRecord>(kv, "node record") {
                f.nodes.insert(node, rec);
            }
        }
    }
    for kv in drains.kvs.values() {
        if let KeyKind::Drain { node } = store.keys.parse(&kv.key) {
            f.drain_requests.insert(node);
        }
    }
    f
}

/// Build each job's observed state from the snapshots of `jobs/` (control state) and `live/`
/// (what the workers write).
pub fn jobs_from(store: &Store, snaps: &[&Snapshot]) -> BTreeMap<String, JobObs> {
    jobs_from_kvs(store, snaps.iter().flat_map(|s| s.kvs.values()))
}

/// The keys of one job in a snapshot (under `jobs/{job}/` or `live/{job}/`).
pub fn job_kvs<'a>(snap: &'a Snapshot, prefix: &'a str) -> impl Iterator<Item = &'a KeyValue> {
    snap.kvs
        .range(prefix.to_string()..)
        .take_while(move |(k, _)| k.starts_with(prefix))
        .map(|(_, kv)| kv)
}

/// [`jobs_from`] over any keys of `jobs/` and `live/`.
pub fn jobs_from_kvs<'a>(
    store: &Store,
    kvs: impl Iterator<Item = &'a KeyValue>,
) -> BTreeMap<String, JobObs> {
    let kvs: Vec<&KeyValue> = kvs.collect();
    let mut jobs = control_from_kvs(store, kvs.iter().copied());
    overlay_live(store, &mut jobs, kvs.iter().copied());
    jobs
}

/// Each job's control state (what `jobs/` holds), without what the workers write: the leader
/// keeps this between passes while `jobs/` does not move.
pub fn control_from_kvs<'a>(
    store: &Store,
    kvs: impl Iterator<Item = &'a KeyValue>,
) -> BTreeMap<String, JobObs> {
    let mut jobs: BTreeMap<String, JobObs> = BTreeMap::new();
    let mut history: BTreeMap<String, BTreeMap<u64, &KeyValue>> = BTreeMap::new();
    for kv in kvs {
        match store.keys.parse(&kv.key) {
            KeyKind::JobSpec { job } => {
                let o = jobs.entry(job).or_default();
                o.spec = decoded(kv, "job spec");
                o.spec_revision = kv.mod_revision;
                o.spec_created = kv.create_revision;
            }
            KeyKind::JobStatus { job } => {
                let o = jobs.entry(job).or_default();
                o.status = decoded(kv, "job status");
                o.status_revision = kv.mod_revision;
            }
            KeyKind::History { job, generation } => {
                history
                    .entry(job.clone())
                    .or_default()
                    .insert(generation, kv);
                let o = jobs.entry(job).or_default();
                o.last_number = o.last_number.max(generation);
            }
            KeyKind::Restarts { job } => {
                if let Some(n) = decoded::<u32>(kv, "restart count") {
                    jobs.entry(job).or_default().restarts_used = n;
                }
            }
            KeyKind::Generation { job } => {
                jobs.entry(job).or_default().generation =
                    decoded(kv, "generation").map(|g| (g, kv.mod_revision))
            }
            KeyKind::Slot { job, node, slot } => {
                if let Some(h) = decoded(kv, "slot health") {
                    jobs.entry(job).or_default().failed.insert((node, slot), h);
                }
            }
            KeyKind::Worker { job, node, slot } => {
                if let Some(w) = decoded(kv, "worker record") {
                    jobs.entry(job).or_default().workers.insert((node, slot), w);
                }
            }
            KeyKind::Stop { job } => jobs.entry(job).or_default().stop_requested = true,
            KeyKind::Access { job } => {
                jobs.entry(job).or_default().access = decoded(kv, "job access")
            }
            KeyKind::Checkpoint { job } => {
                jobs.entry(job).or_default().checkpoint = decoded(kv, "checkpoint record")
            }
            KeyKind::CheckpointRequest { job } => {
                jobs.entry(job).or_default().checkpoint_request = decoded(kv, "checkpoint request")
            }
            _ => {}
        }
    }
    for (name, obs) in jobs.iter_mut() {
        if let Some((g, _)) = &obs.generation {
            obs.member_since = member_since(g, history.get(name));
        }
    }
    jobs
}

/// Add what the workers write (`live/`: progress, joins and fault reports of the current
/// generation, checkpoint figures) to the jobs' control state.
pub fn overlay_live<'a>(
    store: &Store,
    jobs: &mut BTreeMap<String, JobObs>,
    kvs: impl Iterator<Item = &'a KeyValue>,
) {
    let mut joined: BTreeMap<(String, u64), BTreeMap<u32, JoinRecord>> = BTreeMap::new();
    let mut faults: BTreeMap<(String, u64), BTreeMap<u32, FaultReport>> = BTreeMap::new();
    let mut ranks: BTreeMap<String, BTreeMap<u32, RankStats>> = BTreeMap::new();
    let mut usage: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for kv in kvs {
        if let Some(job) = store.keys.live_job_of(&kv.key) {
            let u = usage.entry(job).or_default();
            u.0 += 1;
            u.1 += (kv.key.len() + kv.value.len()) as u64;
        }
        match store.keys.parse(&kv.key) {
            KeyKind::Joined {
                job,
                generation,
                rank,
            } => {
                if let Some(j) = decoded(kv, "join record") {
                    joined.entry((job, generation)).or_default().insert(rank, j);
                }
            }
            KeyKind::Fault {
                job,
                generation,
                rank,
            } => {
                if let Some(f) = decoded(kv, "fault report") {
                    faults.entry((job, generation)).or_default().insert(rank, f);
                }
            }
            KeyKind::Progress { job } => {
                jobs.entry(job).or_default().progress = decoded(kv, "progress")
            }
            KeyKind::CheckpointStats { job } => {
                jobs.entry(job).or_default().checkpoint_stats = decoded(kv, "checkpoint stats")
            }
            KeyKind::RankStats { job, rank } => {
                if let Some(r) = decoded::<RankStats>(kv, "rank stats") {
                    ranks.entry(job).or_default().insert(rank, r);
                }
            }
            _ => {}
        }
    }
    for (name, obs) in jobs.iter_mut() {
        (obs.live_keys, obs.live_bytes) = usage.get(name.as_str()).copied().unwrap_or_default();
        if let Some(((g, _), r)) = obs.generation.as_ref().zip(ranks.remove(name)) {
            obs.rank_stats = r
                .into_iter()
                .filter(|(_, s)| s.generation == g.number)
                .collect();
        }
        // `live/` comes through a watch of its own, so a job just resubmitted (its status
        // deleted with its old progress, in one transaction) may still show the previous run's
        // progress here for a moment: a job without a status has no progress of this run yet
        if obs.status.is_none() {
            obs.progress = None;
        }
        if let Some((g, _)) = &obs.generation {
            if let Some(j) = joined.remove(&(name.clone(), g.number)) {
                obs.joined = j;
            }
            if let Some(f) = faults.remove(&(name.clone(), g.number)) {
                obs.faults = f;
            }
        }
    }
}

/// For each member of `current`, the first generation of its unbroken run of membership,
/// walking the history back only as far as some member's run goes.
fn member_since(
    current: &Generation,
    history: Option<&BTreeMap<u64, &KeyValue>>,
) -> BTreeMap<(String, u32), u64> {
    let mut since: BTreeMap<(String, u32), u64> = current
        .members
        .iter()
        .map(|m| ((m.node.clone(), m.slot), current.number))
        .collect();
    let mut open: Vec<(String, u32)> = since.keys().cloned().collect();
    let mut n = current.number;
    while !open.is_empty() && n > 1 {
        n -= 1;
        let Some(g) = history
            .and_then(|h| h.get(&n))
            .and_then(|kv| decoded::<Generation>(kv, "generation"))
        else {
            break; // forgotten (or unreadable) history breaks every run
        };
        open.retain(|(node, slot)| {
            let still = g.member(node, *slot).is_some();
            if still {
                since.insert((node.clone(), *slot), n);
            }
            still
        });
    }
    since
}

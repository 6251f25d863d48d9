//! Leadership and the leader-only reconcile loop.
//!
//! Every replica campaigns in etcd's election under a lease of its own. The winner runs
//! [`lead`] until its lease is lost (expired, or unrefreshed for a whole TTL), then campaigns
//! again; every generation it publishes is fenced on its leader key, so a deposed leader can
//! never publish.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ductile_cluster::keys::KeyKind;
use ductile_cluster::kv::{KeyValue, LeaderKey};
use ductile_cluster::lease::{LeaseKeeper, LeaseState};
use ductile_cluster::records::*;
use ductile_cluster::store::decode;
use ductile_cluster::store::Fence;
use ductile_cluster::watch::{synced, Snapshot};
use ductile_cluster::Store;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::reconcile::{drain_checkpoint, plan, Decision, DrainCheckpoint, Fleet, JobObs};
use crate::view::ClusterView;

/// What the leader loop needs to know.
#[derive(Clone, Debug)]
pub struct LeaderConfig {
    pub id: String,
    pub election_ttl: i64,
    pub debounce: Duration,
    /// Set (unix ms) by every pass of the leader loop: what the watchdog ping vouches for.
    pub beat: Arc<AtomicU64>,
    /// Give each job an etcd user of its own (etcd auth on: the daemon connects as a user with
    /// the root role); agents start a job's workers only once it has one.
    pub job_users: bool,
}

/// Campaign, lead while elected, campaign again; until `cancel`.
pub async fn run_replica(
    store: Store,
    cfg: LeaderConfig,
    view: ClusterView,
    is_leader: Arc<AtomicBool>,
    cancel: CancellationToken,
) {
    let mut backoff = Duration::from_millis(200);
    while !cancel.is_cancelled() {
        let lease_cancel = cancel.child_token();
        let keeper = match LeaseKeeper::start(
            store.backend.clone(),
            cfg.election_ttl,
            lease_cancel.clone(),
        )
        .await
        {
            Ok(k) => k,
            Err(_) => return, // cancelled
        };
        let lease = keeper.current();
        let election = store.keys.election();
        let campaign = store
            .backend
            .campaign(&election, cfg.id.clone().into_bytes(), lease.id);
        let leader_key = tokio::select! {
            r = campaign => r,
            _ = lease_lost(keeper.subscribe(), cfg.election_ttl) => {
                tracing::warn!("election lease lost while campaigning; starting over");
                lease_cancel.cancel();
                keeper.join().await;
                continue;
            }
            _ = cancel.cancelled() => {
                lease_cancel.cancel();
                keeper.join().await;
                return;
            }
        };
        let leader_key = match leader_key {
            Ok(k) => k,
            Err(e) if keeper.current().healthy => {
                // etcd answers (our lease is kept alive): the campaign call only ran out of
                // its request time while another replica leads; campaign again
                tracing::debug!(error = %e, "still campaigning");
                lease_cancel.cancel();
                keeper.join().await;
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "campaign failed; retrying");
                lease_cancel.cancel();
                keeper.join().await;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(200);
        tracing::info!(id = %cfg.id, key = %leader_key.key, "became leader");
        ductile_cluster::service::sd_notify(&[ductile_cluster::service::NotifyState::Status(
            "leader",
        )]);
        cfg.beat.store(now_ms(), Ordering::SeqCst);
        is_leader.store(true, Ordering::SeqCst);
        let lead_cancel = lease_cancel.child_token();
        tokio::select! {
            r = lead(store.clone(), leader_key.clone(), cfg.clone(), view.clone(), lead_cancel.clone()) => {
                if let Err(e) = r {
                    tracing::error!(error = %ductile_cluster::service::error_chain(&e), "leader loop failed");
                }
            }
            _ = lease_lost(keeper.subscribe(), cfg.election_ttl) => {
                tracing::warn!("leadership lost (election lease expired or unrefreshed for a TTL)");
            }
            _ = cancel.cancelled() => {
                let _ = tokio::time::timeout(Duration::from_secs(1), store.backend.resign(&leader_key)).await;
                tracing::info!("resigned leadership");
            }
        }
        is_leader.store(false, Ordering::SeqCst);
        ductile_cluster::service::sd_notify(&[ductile_cluster::service::NotifyState::Status(
            "standby",
        )]);
        lead_cancel.cancel();
        lease_cancel.cancel();
        keeper.join().await;
    }
}

/// Resolves when the lease expired (a new one had to be granted) or was not refreshed for a
/// whole TTL (another replica may lead by now).
async fn lease_lost(mut rx: watch::Receiver<LeaseState>, ttl: i64) {
    let start_epoch = rx.borrow().epoch;
    loop {
        let st = *rx.borrow_and_update();
        if st.epoch != start_epoch {
            return;
        }
        if st.healthy {
            if rx.changed().await.is_err() {
                return;
            }
        } else {
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                _ = tokio::time::sleep(Duration::from_secs(ttl as u64)) => return,
            }
        }
    }
}

struct Pending {
    members: Vec<Member>,
    first: Instant,
    last: Instant,
}

/// The leader's loop: follow nodes, drains and jobs (the replica's watches, shared with the
/// API); reconcile each job; publish.
pub async fn lead(
    store: Store,
    leader: LeaderKey,
    cfg: LeaderConfig,
    view: ClusterView,
    cancel: CancellationToken,
) -> ductile_cluster::Result<()> {
    let k = &store.keys;
    let mut nodes_rx = view.nodes;
    let mut drains_rx = view.drains;
    let mut jobs_rx = view.jobs;
    let mut live_rx = view.live;
    synced(&mut nodes_rx).await;
    synced(&mut drains_rx).await;
    synced(&mut jobs_rx).await;
    synced(&mut live_rx).await;
    let mut pending: HashMap<String, Pending> = HashMap::new();
    // drain-time checkpoints whose outcome was logged (request ids)
    let mut told: HashSet<String> = HashSet::new();
    // requests put but maybe not seen by the watch yet: id -> deadline
    let mut asked: HashMap<String, u64> = HashMap::new();
    // when this leader first saw each job's current (generation, step), and the first fault
    // report of a generation: on its own clock, never compared with another host's
    let mut steps: HashMap<String, (u64, u64, Instant)> = HashMap::new();
    let mut faults_seen: HashMap<(String, u64), Instant> = HashMap::new();
    let mut drain_seen: HashMap<String, u64> = HashMap::new();
    // the nodes' views, and the `jobs/` snapshot they were last brought in line with
    let mut assignments = crate::assign::Assignments::default();
    let mut assigned_at: Option<(i64, u64)> = None;
    // what is decoded only when its snapshot moved: the fleet, and the jobs' control state
    let mut fleet_cache: Option<((i64, u64, i64, u64), Fleet)> = None;
    let mut control_cache: Option<((i64, u64), BTreeMap<String, JobObs>)> = None;
    // the `jobs/` snapshot the jobs' etcd users were last brought in line with, and when
    let mut users_at: Option<((i64, u64), Instant)> = None;
    // the jobs' chart histories
    let mut series = crate::series::Keeper::default();
    loop {
        if cancel.is_cancelled() {
            return Ok(());
        }
        cfg.beat.store(now_ms(), Ordering::SeqCst);
        let (nodes_snap, drains_snap) = (
            nodes_rx.borrow_and_update().clone(),
            drains_rx.borrow_and_update().clone(),
        );
        let fkey = (
            nodes_snap.revision,
            nodes_snap.relists,
            drains_snap.revision,
            drains_snap.relists,
        );
        let mut fleet = match &fleet_cache {
            Some((k, f)) if *k == fkey => f.clone(),
            _ => {
                let f = fleet_from(&store, &nodes_snap, &drains_snap);
                fleet_cache = Some((fkey, f.clone()));
                f
            }
        };
        // a leaving agent's deadline, timed on this leader's clock from when it saw the drain
        drain_seen.retain(|n, _| fleet.nodes.get(n).is_some_and(|r| r.draining));
        for (n, r) in &fleet.nodes {
            if let (true, Some(t)) = (r.draining, r.drain_timeout_ms) {
                let d = *drain_seen.entry(n.clone()).or_insert(now_ms() + t);
                fleet.drain_deadlines.insert(n.clone(), d);
            }
        }
        let snap = jobs_rx.borrow_and_update().clone();
        let live = live_rx.borrow_and_update().clone();
        let ckey = (snap.revision, snap.relists);
        let mut jobs = match &control_cache {
            Some((k, c)) if *k == ckey => c.clone(),
            _ => {
                let c = control_from_kvs(&store, snap.kvs.values());
                control_cache = Some((ckey, c.clone()));
                c
            }
        };
        overlay_live(&store, &mut jobs, live.kvs.values());
        fleet.hold_active(&jobs);
        let now = Instant::now();
        let mut wake: Option<Instant> = None;
        steps.retain(|j, _| jobs.contains_key(j));
        faults_seen.retain(|(j, g), _| {
            jobs.get(j)
                .and_then(|o| o.generation.as_ref())
                .is_some_and(|(cur, _)| cur.number == *g)
        });
        for (name, obs) in jobs.iter_mut() {
            if let Some((g, _)) = &obs.generation {
                let step = obs
                    .progress
                    .as_ref()
                    .filter(|p| p.generation == g.number)
                    .map(|p| p.step)
                    .unwrap_or(0);
                let e = steps.entry(name.clone()).or_insert((g.number, step, now));
                if (e.0, e.1) != (g.number, step) {
                    *e = (g.number, step, now);
                }
                obs.stalled_ms = Some((now - e.2).as_millis() as u64);
                if !obs.faults.is_empty() {
                    let at = *faults_seen.entry((name.clone(), g.number)).or_insert(now);
                    obs.faults_seen_ms = (now - at).as_millis() as u64;
                    // decide when the grace ends even if nothing else happens
                    let at = at + Duration::from_millis(crate::reconcile::FAULT_GRACE_MS + 10);
                    if at > now {
                        wake = Some(wake.map_or(at, |w| w.min(at)));
                    }
                }
            }
        }
        // The jobs' etcd users follow the control state too, and are checked every
        // USERS_EVERY in case one was deleted behind our back.
        if cfg.job_users && users_at.is_none_or(|(at, t)| at != ckey || now >= t + USERS_EVERY) {
            match crate::access::sync_job_users(&store, &leader, &jobs).await {
                Ok(true) => users_at = Some((ckey, now)),
                Ok(false) => {
                    if !still_leader(&store, &leader).await {
                        return Err(fenced(&leader));
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot bring the jobs' etcd users in line; will retry");
                    let at = now + Duration::from_millis(500);
                    wake = Some(wake.map_or(at, |w| w.min(at)));
                }
            }
        }
        // The nodes' views follow the control state (`jobs/` only: progress does not move
        // them), as observed; what this pass publishes reaches them on the next.
        if assigned_at != Some((snap.revision, snap.relists)) {
            let desired = crate::assign::node_assignments(&jobs, cfg.job_users);
            match assignments.sync(&store, &leader, &desired).await {
                Ok(true) => assigned_at = Some((snap.revision, snap.relists)),
                Ok(false) => {
                    if !still_leader(&store, &leader).await {
                        return Err(fenced(&leader));
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot update the nodes' views; will retry");
                    let at = now + Duration::from_millis(200);
                    wake = Some(wake.map_or(at, |w| w.min(at)));
                }
            }
        }
        for (name, obs) in &jobs {
            let ms = now_ms();
            let decision = plan(obs, &fleet, ms);
            // A planned drain first asks for a checkpoint, and its re-formation waits for the
            // commit while there is time (a failure's does not: the communicator is gone).
            let mut note = None;
            let hold_until_ms = match drain_checkpoint(obs, &fleet, ms) {
                DrainCheckpoint::Ask(req) if asked.contains_key(&req.id) => {
                    asked.get(&req.id).copied()
                }
                DrainCheckpoint::Ask(req) => {
                    let key = k.checkpoint_request(name);
                    match store.put_json(&key, &req, None).await {
                        Ok(_) => {
                            tracing::info!(job = %name, id = %req.id, reason = %req.reason,
                                wait_s = req.deadline_ms.saturating_sub(ms) as f64 / 1000.0,
                                "planned drain: asked the workers for a checkpoint before re-forming");
                            asked.insert(req.id.clone(), req.deadline_ms);
                        }
                        Err(e) => {
                            tracing::warn!(job = %name, error = %e, "cannot ask for a drain-time checkpoint; will retry")
                        }
                    }
                    Some(req.deadline_ms)
                }
                DrainCheckpoint::Wait { until_ms, .. } => Some(until_ms),
                DrainCheckpoint::Committed { id, step } => {
                    if told.insert(id.clone()) {
                        tracing::info!(job = %name, id = %id, step, "drain-time checkpoint committed; re-forming");
                    }
                    note = Some(format!("; checkpoint at step {step} committed first"));
                    None
                }
                DrainCheckpoint::NoTime { id, detail } => {
                    if told.insert(id.clone()) {
                        tracing::warn!(job = %name, id = %id, "{detail}; re-forming without it");
                    }
                    note = Some(format!("; {detail}"));
                    None
                }
                DrainCheckpoint::NotNeeded => None,
            };
            let fence = Fence {
                leader: Some(&leader),
                spec_revision: obs.spec_revision,
            };
            match decision {
                Decision::Nothing => {
                    pending.remove(name);
                }
                Decision::Exclude(slots) => {
                    pending.remove(name);
                    let rev = obs.generation.as_ref().map(|(_, r)| *r).unwrap_or(0);
                    match store.exclude_slots(name, rev, &fence, &slots).await {
                        Ok(true) => {
                            for (node, slot, h) in &slots {
                                tracing::warn!(job = %name, node = %node, slot, generation = h.generation, detail = %h.exit, "excluding a worker its peers cannot reach");
                            }
                        }
                        Ok(false) => {
                            if !still_leader(&store, &leader).await {
                                return Err(fenced(&leader));
                            }
                        }
                        Err(e) => {
                            tracing::warn!(job = %name, error = %e, "cannot exclude; will retry")
                        }
                    }
                }
                Decision::Status(st) => {
                    pending.remove(name);
                    match store.put_status(&st, obs.status_revision, &fence).await {
                        Ok(true) => {
                            if let Some(r) = &st.last_reformation {
                                if obs
                                    .status
                                    .as_ref()
                                    .and_then(|s| s.last_reformation.as_ref())
                                    .map(|x| x.generation)
                                    != Some(r.generation)
                                {
                                    tracing::info!(job = %name, generation = r.generation, reason = %r.reason, seconds = r.seconds, "re-formation complete");
                                    forget_old_generations(
                                        &store,
                                        &[&snap, &live],
                                        name,
                                        r.generation,
                                    )
                                    .await;
                                }
                            }
                        }
                        Ok(false) => {
                            if !still_leader(&store, &leader).await {
                                return Err(fenced(&leader));
                            }
                            tracing::debug!(job = %name, "job changed under us; re-reading");
                        }
                        Err(e) => tracing::warn!(job = %name, error = %e, "status write failed"),
                    }
                }
                Decision::Publish {
                    mut generation,
                    mut status,
                    debounce,
                } => {
                    if let Some(n) = note.filter(|_| generation.reason == Reason::Drain) {
                        generation.detail.push_str(&n);
                        status.message.push_str(&n);
                    }
                    if let Some(until) =
                        hold_until_ms.filter(|_| generation.reason == Reason::Drain)
                    {
                        let at = now + Duration::from_millis(until.saturating_sub(ms));
                        wake = Some(wake.map_or(at, |w| w.min(at)));
                        continue;
                    }
                    if debounce {
                        let p = pending.entry(name.clone()).or_insert_with(|| Pending {
                            members: generation.members.clone(),
                            first: now,
                            last: now,
                        });
                        if p.members != generation.members {
                            p.members = generation.members.clone();
                            p.last = now;
                        }
                        let ready_at = (p.last + cfg.debounce).min(p.first + cfg.debounce * 4);
                        if now < ready_at {
                            wake = Some(wake.map_or(ready_at, |w| w.min(ready_at)));
                            continue;
                        }
                    }
                    pending.remove(name);
                    let prev = obs.generation.as_ref().map(|(_, r)| *r).unwrap_or(0);
                    match store
                        .publish_generation(&generation, prev, &fence, &status)
                        .await
                    {
                        Ok(true) => {
                            tracing::info!(
                                job = %name, generation = generation.number, world_size = generation.world_size,
                                reason = %generation.reason, detail = %generation.detail, "published generation"
                            );
                            // the jobs planned after this one in the same pass see its slots taken
                            fleet.hold(name, &generation.members);
                            fleet.want(
                                name,
                                generation.world_size,
                                obs.spec.as_ref().map_or(0, |s| s.min),
                            );
                        }
                        Ok(false) => {
                            // Either the generation moved (our view is stale: the watch will
                            // catch up) or we are no longer leader.
                            if !still_leader(&store, &leader).await {
                                return Err(fenced(&leader));
                            }
                            tracing::debug!(job = %name, "job or generation changed under us; re-reading");
                        }
                        Err(e) => {
                            tracing::warn!(job = %name, error = %e, "publish failed; will retry")
                        }
                    }
                }
            }
        }
        series.observe(&store, &snap, &jobs);
        let (written, due) = series.flush(&store, &leader, &jobs).await;
        if !written && !still_leader(&store, &leader).await {
            return Err(fenced(&leader));
        }
        if let Some(at) = due {
            wake = Some(wake.map_or(at, |w| w.min(at)));
        }
        let sleep_until = wake.unwrap_or(now + Duration::from_secs(1));
        tokio::select! {
            _ = nodes_rx.changed() => {}
            _ = drains_rx.changed() => {}
            _ = jobs_rx.changed() => {}
            _ = live_rx.changed() => {}
            _ = tokio::time::sleep_until(sleep_until) => {}
            _ = cancel.cancelled() => return Ok(()),
        }
    }
}

/// How often the leader checks the jobs' etcd users when nothing else moved.
const USERS_EVERY: Duration = Duration::from_secs(10);

/// How many generations of history a job keeps in etcd (agents read the recent ones to fence
/// workers that missed one; older ones only grow etcd).
pub const HISTORY_KEPT: u64 = 256;

/// Once a generation is complete, the join records, rendezvous data and fault reports of
/// every earlier generation (attempts that failed included) are of no use: delete them, and
/// history entries older than [`HISTORY_KEPT`] generations, so etcd does not grow with a job's
/// age.
async fn forget_old_generations(store: &Store, snaps: &[&Snapshot], job: &str, current: u64) {
    let k = &store.keys;
    let mut prefixes = std::collections::BTreeSet::new();
    let mut old_history = Vec::new();
    for kv in snaps.iter().flat_map(|s| s.kvs.values()) {
        match k.parse(&kv.key) {
            KeyKind::Joined {
                job: j, generation, ..
            } if j == job && generation < current => {
                prefixes.insert(k.joined(job, generation));
            }
            KeyKind::Rendezvous { job: j, generation } if j == job && generation < current => {
                prefixes.insert(k.rendezvous(job, generation));
            }
            KeyKind::Fault {
                job: j, generation, ..
            } if j == job && generation < current => {
                prefixes.insert(k.faults(job, generation));
            }
            KeyKind::History { job: j, generation }
                if j == job && generation + HISTORY_KEPT <= current =>
            {
                old_history.push(kv.key.clone());
            }
            _ => {}
        }
    }
    for p in prefixes {
        if let Err(e) = store.backend.delete_prefix(&p).await {
            tracing::warn!(prefix = %p, error = %e, "cannot clean up an old generation's keys; will retry at the next re-formation");
        }
    }
    for key in old_history {
        if let Err(e) = store.backend.delete(&key).await {
            tracing::warn!(%key, error = %e, "cannot delete an old history entry");
        }
    }
}

async fn still_leader(store: &Store, leader: &LeaderKey) -> bool {
    match store.backend.get(&leader.key).await {
        Ok(Some(kv)) => kv.create_revision == leader.create_revision,
        Ok(None) => false,
        Err(_) => true, // unknown: the lease watcher decides
    }
}

fn fenced(leader: &LeaderKey) -> ductile_cluster::ClusterError {
    ductile_cluster::ClusterError::Conflict {
        key: leader.key.clone(),
        reason: "no longer the leader".into(),
    }
}

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
    for kv in kvs {
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

#[cfg(test)]
mod tests {
    use super::*;
    use ductile_cluster::store::encode;
    use ductile_cluster::Keys;

    fn kv(key: String, value: Vec<u8>, rev: i64) -> (String, KeyValue) {
        (
            key.clone(),
            KeyValue {
                key,
                value,
                create_revision: rev,
                mod_revision: rev,
                lease: 0,
            },
        )
    }

    #[tokio::test]
    async fn a_resubmitted_job_is_not_taken_for_done_by_the_previous_runs_progress() {
        let store = Store::new(
            Arc::new(ductile_cluster::memory::MemoryBackend::new()),
            Keys::default(),
        );
        let k = &store.keys;
        let spec = JobSpec::from_toml("name = \"j\"\nmin = 1\nmax = 2\ndesired = 2\n").unwrap();
        let done = Progress {
            generation: 4,
            step: 60,
            updated_at_ms: 0,
            done: true,
            final_weights_sha256: Some("abc".into()),
            ..Default::default()
        };
        // the control watch already shows the new spec without a status; the live watch
        // still shows the last run's final progress
        let jobs = Snapshot {
            revision: 10,
            kvs: [kv(k.spec("j"), encode(&spec), 10)].into(),
            relists: 0,
        };
        let live = Snapshot {
            revision: 9,
            kvs: [kv(k.progress("j"), encode(&done), 8)].into(),
            relists: 0,
        };
        let obs = &jobs_from(&store, &[&jobs, &live])["j"];
        assert!(obs.progress.is_none());
        assert!(matches!(
            crate::reconcile::plan(obs, &Default::default(), 100),
            Decision::Status(ref s) if s.state != JobState::Succeeded
        ));
    }

    #[tokio::test]
    async fn a_slots_membership_run_is_read_back_from_history_and_broken_by_a_gap() {
        let store = Store::new(
            Arc::new(ductile_cluster::memory::MemoryBackend::new()),
            Keys::default(),
        );
        let k = &store.keys;
        let g = |number: u64, nodes: &[&str]| {
            let members: Vec<(&str, u32)> = nodes.iter().map(|n| (*n, 0)).collect();
            crate::reconcile::test_generation(number, &members)
        };
        let spec = JobSpec::from_toml("name = \"j\"\nmin = 1\nmax = 3\ndesired = 3\n").unwrap();
        // a is in 1, 2, 3; c in 1 and 3 (missed 2); b joined at 3; "d" was only in 1
        let (g1, g2, g3) = (g(1, &["a", "c", "d"]), g(2, &["a"]), g(3, &["a", "b", "c"]));
        let jobs = Snapshot {
            revision: 10,
            kvs: [
                kv(k.spec("j"), encode(&spec), 1),
                kv(k.history_entry("j", 1), encode(&g1), 2),
                kv(k.history_entry("j", 2), encode(&g2), 3),
                kv(k.history_entry("j", 3), encode(&g3), 4),
                kv(k.generation("j"), encode(&g3), 4),
                kv(k.restarts("j"), encode(&2u32), 5),
            ]
            .into(),
            relists: 0,
        };
        let obs = &jobs_from(&store, &[&jobs])["j"];
        let since = |n: &str| obs.member_since[&(n.to_string(), 0)];
        assert_eq!((since("a"), since("b"), since("c")), (1, 3, 3));
        assert_eq!(obs.restarts_used, 2);
        let views =
            crate::assign::node_assignments(&[("j".to_string(), obs.clone())].into(), false);
        assert_eq!(views.len(), 3, "no view for d, which left");
        let c = &views[&("c".to_string(), "j".to_string())];
        // a worker of c started in generation 1 missed generation 2: it must not act in 3
        assert!(!c.member_since(0, 1) && c.member_since(0, 2));
        // history the leader no longer keeps breaks the run too
        let mut kvs = jobs.kvs.clone();
        kvs.remove(&k.history_entry("j", 2));
        let jobs = Snapshot { kvs, ..jobs };
        let obs = &jobs_from(&store, &[&jobs])["j"];
        assert_eq!(obs.member_since[&("a".to_string(), 0)], 3);
    }
}

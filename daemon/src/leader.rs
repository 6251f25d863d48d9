//! Leadership and the leader-only reconcile loop.
//!
//! Every replica campaigns in etcd's election under a lease of its own. The winner runs
//! [`lead`] until its lease is lost (expired, or unrefreshed for a whole TTL), then campaigns
//! again; every generation it publishes is fenced on its leader key, so a deposed leader can
//! never publish.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ductile_cluster::keys::KeyKind;
use ductile_cluster::kv::LeaderKey;
use ductile_cluster::lease::{LeaseKeeper, LeaseState};
use ductile_cluster::records::*;
use ductile_cluster::store::Fence;
use ductile_cluster::watch::{synced, Snapshot};
use ductile_cluster::Store;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::observe::{control_from_kvs, fleet_from, overlay_live};
use crate::reconcile::{
    drain_checkpoint, plan, resize_notice, Decision, DrainCheckpoint, Fleet, JobObs,
};
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
    leader_key_tx: watch::Sender<Option<LeaderKey>>,
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
        leader_key_tx.send_replace(Some(leader_key.clone()));
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
        leader_key_tx.send_replace(None);
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

/// A debounced generation waiting for its members to settle.
struct Pending {
    members: Vec<Member>,
    first: Instant,
    last: Instant,
}

/// What the leader remembers of one job between passes, on its own clock (never compared
/// with another host's).
#[derive(Default)]
struct JobMemory {
    /// A debounced generation waiting for its members to settle.
    pending: Option<Pending>,
    /// When this leader first saw the job's current (generation, step).
    progress_seen: Option<(u64, u64, Instant)>,
    /// When it first saw a fault report of the current generation (generation, when).
    faults_seen: Option<(u64, Instant)>,
}

/// The earliest of the times a pass asked to look again at.
#[derive(Default)]
struct Wake(Option<Instant>);

impl Wake {
    fn at(&mut self, t: Instant) {
        self.0 = Some(self.0.map_or(t, |w| w.min(t)));
    }
}

/// A snapshot's identity: (revision, relists).
type SnapKey = (i64, u64);

/// The leader's state between passes: per job, per node (drains), per drain-time checkpoint
/// request, and the caches of what is decoded only when its snapshot moved.
struct Leader {
    store: Store,
    key: LeaderKey,
    cfg: LeaderConfig,
    jobs: HashMap<String, JobMemory>,
    /// A leaving agent's deadline, timed on this leader's clock from when it saw the drain.
    drain_seen: HashMap<String, u64>,
    /// Drain-time checkpoints whose outcome was logged (request ids).
    told: HashSet<String>,
    /// Requests put but maybe not seen by the watch yet: id -> deadline.
    asked: HashMap<String, u64>,
    /// The nodes' views, and the `jobs/` snapshot they were last brought in line with.
    assignments: crate::assign::Assignments,
    assigned_at: Option<SnapKey>,
    fleet_cache: Option<((SnapKey, SnapKey), Fleet)>,
    control_cache: Option<(SnapKey, BTreeMap<String, JobObs>)>,
    /// The `jobs/` snapshot the jobs' etcd users were last brought in line with, and when.
    users_at: Option<(SnapKey, Instant)>,
    /// The jobs' chart histories.
    series: crate::series::Keeper,
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
    let mut nodes_rx = view.nodes;
    let mut drains_rx = view.drains;
    let mut jobs_rx = view.jobs;
    let mut live_rx = view.live;
    synced(&mut nodes_rx).await;
    synced(&mut drains_rx).await;
    synced(&mut jobs_rx).await;
    synced(&mut live_rx).await;
    let mut l = Leader {
        store,
        key: leader,
        cfg,
        jobs: HashMap::new(),
        drain_seen: HashMap::new(),
        told: HashSet::new(),
        asked: HashMap::new(),
        assignments: Default::default(),
        assigned_at: None,
        fleet_cache: None,
        control_cache: None,
        users_at: None,
        series: Default::default(),
    };
    loop {
        if cancel.is_cancelled() {
            return Ok(());
        }
        l.cfg.beat.store(now_ms(), Ordering::SeqCst);
        let nodes = nodes_rx.borrow_and_update().clone();
        let drains = drains_rx.borrow_and_update().clone();
        let snap = jobs_rx.borrow_and_update().clone();
        let live = live_rx.borrow_and_update().clone();
        let now = Instant::now();
        let wake = l.pass(&nodes, &drains, &snap, &live, now).await?;
        let sleep_until = wake.0.unwrap_or(now + Duration::from_secs(1));
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

impl Leader {
    /// One pass over the snapshots: observe, bring the jobs' users and the nodes' views in
    /// line, reconcile and apply each job, keep the chart histories. Returns when to look
    /// again if nothing moves before; the error is a lost leadership.
    async fn pass(
        &mut self,
        nodes: &Snapshot,
        drains: &Snapshot,
        snap: &Snapshot,
        live: &Snapshot,
        now: Instant,
    ) -> ductile_cluster::Result<Wake> {
        let mut wake = Wake::default();
        let mut fleet = self.fleet(nodes, drains);
        let ckey = (snap.revision, snap.relists);
        let mut jobs = match &self.control_cache {
            Some((k, c)) if *k == ckey => c.clone(),
            _ => {
                let c = control_from_kvs(&self.store, snap.kvs.values());
                self.control_cache = Some((ckey, c.clone()));
                c
            }
        };
        overlay_live(&self.store, &mut jobs, live.kvs.values());
        fleet.hold_active(&jobs);
        self.remember(&mut jobs, now, &mut wake);
        self.sync_users(&jobs, ckey, now, &mut wake).await?;
        self.sync_assignments(&jobs, ckey, now, &mut wake).await?;
        for (name, obs) in &jobs {
            self.apply(name, obs, &mut fleet, (snap, live), now, &mut wake)
                .await?;
        }
        clean_ended_live(&self.store, &jobs, live).await;
        self.series.observe(&self.store, snap, &jobs);
        let (written, due) = self.series.flush(&self.store, &self.key, &jobs).await;
        if !written && !still_leader(&self.store, &self.key).await {
            return Err(fenced(&self.key));
        }
        if let Some(at) = due {
            wake.at(at);
        }
        Ok(wake)
    }

    /// The fleet (decoded again only when a snapshot moved), with each draining node's
    /// deadline on this leader's clock.
    fn fleet(&mut self, nodes: &Snapshot, drains: &Snapshot) -> Fleet {
        let fkey = (
            (nodes.revision, nodes.relists),
            (drains.revision, drains.relists),
        );
        let mut fleet = match &self.fleet_cache {
            Some((k, f)) if *k == fkey => f.clone(),
            _ => {
                let f = fleet_from(&self.store, nodes, drains);
                self.fleet_cache = Some((fkey, f.clone()));
                f
            }
        };
        self.drain_seen
            .retain(|n, _| fleet.nodes.get(n).is_some_and(|r| r.draining));
        for (n, r) in &fleet.nodes {
            if let (true, Some(t)) = (r.draining, r.drain_timeout_ms) {
                let d = *self.drain_seen.entry(n.clone()).or_insert(now_ms() + t);
                fleet.drain_deadlines.insert(n.clone(), d);
            }
        }
        fleet
    }

    /// What this leader's clock says of each job: how long its (generation, step) has not
    /// moved, and how long ago it first saw the current generation's fault reports (the
    /// grace's end is a time to look again even if nothing else happens).
    fn remember(&mut self, jobs: &mut BTreeMap<String, JobObs>, now: Instant, wake: &mut Wake) {
        self.jobs.retain(|j, _| jobs.contains_key(j));
        for (name, obs) in jobs.iter_mut() {
            let mem = self.jobs.entry(name.clone()).or_default();
            let Some((g, _)) = &obs.generation else {
                mem.progress_seen = None;
                mem.faults_seen = None;
                continue;
            };
            if mem.faults_seen.is_some_and(|(n, _)| n != g.number) {
                mem.faults_seen = None;
            }
            let step = obs
                .progress
                .as_ref()
                .filter(|p| p.generation == g.number)
                .map(|p| p.step)
                .unwrap_or(0);
            let seen = match mem.progress_seen {
                Some((n, s, at)) if (n, s) == (g.number, step) => at,
                _ => {
                    mem.progress_seen = Some((g.number, step, now));
                    now
                }
            };
            obs.stalled_ms = Some((now - seen).as_millis() as u64);
            if !obs.faults.is_empty() {
                let at = mem.faults_seen.get_or_insert((g.number, now)).1;
                obs.faults_seen_ms = (now - at).as_millis() as u64;
                let at = at + Duration::from_millis(crate::reconcile::FAULT_GRACE_MS + 10);
                if at > now {
                    wake.at(at);
                }
            }
        }
    }

    /// The jobs' etcd users follow the control state too, and are checked every
    /// [`USERS_EVERY`] in case one was deleted behind our back.
    async fn sync_users(
        &mut self,
        jobs: &BTreeMap<String, JobObs>,
        ckey: SnapKey,
        now: Instant,
        wake: &mut Wake,
    ) -> ductile_cluster::Result<()> {
        if !self.cfg.job_users
            || self
                .users_at
                .is_some_and(|(at, t)| at == ckey && now < t + USERS_EVERY)
        {
            return Ok(());
        }
        match crate::access::sync_job_users(&self.store, &self.key, jobs).await {
            Ok(true) => self.users_at = Some((ckey, now)),
            Ok(false) => self.check_leader().await?,
            Err(e) => {
                tracing::warn!(error = %e, "cannot bring the jobs' etcd users in line; will retry");
                wake.at(now + Duration::from_millis(500));
            }
        }
        Ok(())
    }

    /// The nodes' views follow the control state (`jobs/` only: progress does not move
    /// them), as observed; what this pass publishes reaches them on the next.
    async fn sync_assignments(
        &mut self,
        jobs: &BTreeMap<String, JobObs>,
        ckey: SnapKey,
        now: Instant,
        wake: &mut Wake,
    ) -> ductile_cluster::Result<()> {
        if self.assigned_at == Some(ckey) {
            return Ok(());
        }
        let desired = crate::assign::node_assignments(jobs, self.cfg.job_users);
        match self
            .assignments
            .sync(&self.store, &self.key, &desired)
            .await
        {
            Ok(true) => self.assigned_at = Some(ckey),
            Ok(false) => self.check_leader().await?,
            Err(e) => {
                tracing::warn!(error = %e, "cannot update the nodes' views; will retry");
                wake.at(now + Duration::from_millis(200));
            }
        }
        Ok(())
    }

    /// A conditional write failed: the error when this replica no longer leads.
    async fn check_leader(&self) -> ductile_cluster::Result<()> {
        if still_leader(&self.store, &self.key).await {
            Ok(())
        } else {
            Err(fenced(&self.key))
        }
    }

    /// A planned drain first asks for a checkpoint, and its re-formation waits for the
    /// commit while there is time (a failure's does not: the communicator is gone). Returns
    /// until when a drain's generation holds, and what to add to its detail.
    async fn drain_checkpoint(
        &mut self,
        name: &str,
        wanted: DrainCheckpoint,
        ms: u64,
    ) -> (Option<u64>, Option<String>) {
        match wanted {
            DrainCheckpoint::Ask(req) if self.asked.contains_key(&req.id) => {
                (self.asked.get(&req.id).copied(), None)
            }
            DrainCheckpoint::Ask(req) => {
                let key = self.store.keys.checkpoint_request(name);
                match self.store.put_json(&key, &req, None).await {
                    Ok(_) => {
                        tracing::info!(job = %name, id = %req.id, reason = %req.reason,
                            wait_s = req.deadline_ms.saturating_sub(ms) as f64 / 1000.0,
                            "planned change: asked the workers for a checkpoint (or a program for its save) before re-forming");
                        self.asked.insert(req.id.clone(), req.deadline_ms);
                    }
                    Err(e) => {
                        tracing::warn!(job = %name, error = %e, "cannot ask for a drain-time checkpoint; will retry")
                    }
                }
                (Some(req.deadline_ms), None)
            }
            DrainCheckpoint::Wait { until_ms, .. } => (Some(until_ms), None),
            DrainCheckpoint::Committed { id, step } => {
                if self.told.insert(id.clone()) {
                    tracing::info!(job = %name, id = %id, step, "the planned change's checkpoint is saved; re-forming");
                }
                (
                    None,
                    Some(format!("; checkpoint at step {step} committed first")),
                )
            }
            DrainCheckpoint::NoTime { id, detail } => {
                if self.told.insert(id.clone()) {
                    tracing::warn!(job = %name, id = %id, "{detail}; re-forming without it");
                }
                (None, Some(format!("; {detail}")))
            }
            DrainCheckpoint::NotNeeded => (None, None),
        }
    }

    /// Reconcile one job and carry out the decision (fenced on this leader's key and the
    /// spec's revision); a publish the debounce or a drain's checkpoint holds back sets when
    /// to look again.
    async fn apply(
        &mut self,
        name: &str,
        obs: &JobObs,
        fleet: &mut Fleet,
        (snap, live): (&Snapshot, &Snapshot),
        now: Instant,
        wake: &mut Wake,
    ) -> ductile_cluster::Result<()> {
        let ms = now_ms();
        let decision = plan(obs, fleet, ms);
        // a drain's checkpoint, or a torchrun job's notice of its resize
        let noticed = |r: Reason| matches!(r, Reason::Drain | Reason::Scale);
        let wanted = match &decision {
            Decision::Publish { generation, .. } if generation.reason == Reason::Scale => {
                resize_notice(obs, ms)
            }
            _ => drain_checkpoint(obs, fleet, ms),
        };
        let (hold_until_ms, note) = self.drain_checkpoint(name, wanted, ms).await;
        let store = self.store.clone();
        let fence = Fence {
            leader: Some(&self.key),
            spec_revision: obs.spec_revision,
        };
        let mem = self.jobs.entry(name.to_string()).or_default();
        match decision {
            Decision::Nothing => mem.pending = None,
            Decision::Exclude(slots) => {
                mem.pending = None;
                let rev = obs.generation.as_ref().map(|(_, r)| *r).unwrap_or(0);
                match store.exclude_slots(name, rev, &fence, &slots).await {
                    Ok(true) => {
                        for (node, slot, h) in &slots {
                            tracing::warn!(job = %name, node = %node, slot, generation = h.generation, detail = %h.exit, "excluding a worker its peers cannot reach");
                        }
                    }
                    Ok(false) => self.check_leader().await?,
                    Err(e) => {
                        tracing::warn!(job = %name, error = %e, "cannot exclude; will retry")
                    }
                }
            }
            Decision::Status(st) => {
                mem.pending = None;
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
                                forget_old_generations(&store, &[snap, live], name, r.generation)
                                    .await;
                            }
                        }
                    }
                    Ok(false) => {
                        self.check_leader().await?;
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
                if let Some(n) = note.filter(|_| noticed(generation.reason)) {
                    generation.detail.push_str(&n);
                    status.message.push_str(&n);
                }
                if let Some(until) = hold_until_ms.filter(|_| noticed(generation.reason)) {
                    wake.at(now + Duration::from_millis(until.saturating_sub(ms)));
                    return Ok(());
                }
                if debounce {
                    let p = mem.pending.get_or_insert_with(|| Pending {
                        members: generation.members.clone(),
                        first: now,
                        last: now,
                    });
                    if p.members != generation.members {
                        p.members = generation.members.clone();
                        p.last = now;
                    }
                    let ready_at =
                        (p.last + self.cfg.debounce).min(p.first + self.cfg.debounce * 4);
                    if now < ready_at {
                        wake.at(ready_at);
                        return Ok(());
                    }
                }
                mem.pending = None;
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
                        self.check_leader().await?;
                        tracing::debug!(job = %name, "job or generation changed under us; re-reading");
                    }
                    Err(e) => {
                        tracing::warn!(job = %name, error = %e, "publish failed; will retry")
                    }
                }
            }
        }
        Ok(())
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

/// The most `live/` keys of ended jobs one pass deletes (the next pass goes on).
const LIVE_CLEANED_PER_PASS: usize = 2000;

/// An ended job's `live/{job}/` keys are of no more use but what its status shows: its
/// progress (the final step and weights), its checkpoint figures and its last generation's
/// joins. Everything else (rendezvous data, fault reports, shard reports, rank figures, what a
/// job's etcd user wrote besides) is deleted, each key fenced on its revision (a job
/// resubmitted under the same name meanwhile keeps what its new run wrote), in transactions
/// of at most 100 operations.
async fn clean_ended_live(store: &Store, jobs: &BTreeMap<String, JobObs>, live: &Snapshot) {
    use ductile_cluster::kv::{Compare, Op};
    let k = &store.keys;
    let ended = |job: &str| {
        jobs.get(job)
            .filter(|o| o.status.as_ref().is_some_and(|s| s.state.is_terminal()))
    };
    let mut batch = crate::batch::Batch::new(store.clone());
    let mut n = 0;
    for kv in live.kvs.values() {
        let Some(obs) = k.live_job_of(&kv.key).and_then(ended) else {
            continue;
        };
        let last = obs.generation.as_ref().map(|(g, _)| g.number);
        let keep = match k.parse(&kv.key) {
            KeyKind::Progress { .. } | KeyKind::CheckpointStats { .. } => true,
            KeyKind::Joined { generation, .. } => Some(generation) == last,
            _ => false,
        };
        if keep {
            continue;
        }
        if !batch
            .add(
                vec![Compare::ModRevision(kv.key.clone(), kv.mod_revision)],
                vec![Op::Delete {
                    key: kv.key.clone(),
                }],
            )
            .await
        {
            return;
        }
        n += 1;
        if n >= LIVE_CLEANED_PER_PASS {
            break;
        }
    }
    if batch.flush().await && n > 0 {
        tracing::debug!(keys = n, "deleted ended jobs' live keys");
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::jobs_from;
    use ductile_cluster::kv::KeyValue;
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
            kvs: [kv(k.spec("j"), encode(&spec), 10)].into_iter().collect(),
            ..Default::default()
        };
        let live = Snapshot {
            revision: 9,
            kvs: [kv(k.progress("j"), encode(&done), 8)]
                .into_iter()
                .collect(),
            ..Default::default()
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
            .into_iter()
            .collect(),
            ..Default::default()
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
        kvs.remove_mut(&k.history_entry("j", 2));
        let jobs = Snapshot { kvs, ..jobs };
        let obs = &jobs_from(&store, &[&jobs])["j"];
        assert_eq!(obs.member_since[&("a".to_string(), 0)], 3);
    }
}

//! ductile-agent: one per node. Registers the node under a lease, runs a worker for each slot
//! of this node in each job's current generation, reports worker exits at once, restarts failed
//! workers within the job's budget, fences workers of superseded generations, and drains.
//!
//! The agent is one actor: a single loop owns all state and handles one event at a time, and
//! never waits on etcd: writes go through [`writer::Writer`], the restart budget's
//! compare-and-swap runs in a task that reports back. Its systemd watchdog ping comes from
//! that loop, so it vouches for the actor itself.

pub mod check;
pub mod config;
pub mod devices;
pub mod joblog;
pub mod libtorch;
pub mod preempt;
pub mod secrets;
pub mod workdir;
pub mod writer;

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use ductile_cluster::access::Secret;
use ductile_cluster::keys::KeyKind;
use ductile_cluster::kv::{Compare, KvBackend, Op, Txn};
use ductile_cluster::lease::{LeaseKeeper, LeaseState};
use ductile_cluster::records::*;
use ductile_cluster::store::{decode, encode};
use ductile_cluster::watch::{synced, watch_prefix, Snapshot};
use ductile_cluster::{Keys, Store};
use tokio::io::BufReader;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::time::DelayQueue;

use config::Config;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

type SlotKey = (String, u32);

struct Child {
    pid: u32,
    /// The newest generation this worker is known to be a member of.
    generation: u64,
    stop: Option<oneshot::Sender<()>>,
    stopping: bool,
    /// Where its output is kept on this node (none when the log file cannot be written).
    log: Option<joblog::Shared>,
}

struct Exit {
    key: SlotKey,
    pid: u32,
    code: Option<i32>,
    signal: Option<i32>,
    /// The worker's last `ductile-worker: ...` line on stderr (why it gave up), if any.
    last_words: Option<String>,
    /// Its cgroup, when processes of it outlived a kill (stuck in the kernel): the slot
    /// stays busy until it is empty and removed.
    lingering: Option<(ductile_runtime::cgroup::Cgroup, String)>,
}

pub struct Agent {
    cfg: Config,
    store: Store,
    node: NodeRecord,
    lease: LeaseState,
    children: HashMap<SlotKey, Child>,
    /// Slots whose worker failed, as reported.
    failed: HashMap<SlotKey, SlotHealth>,
    /// Restarts waiting out their backoff, and which slots they are for (one per slot).
    restarts_due: DelayQueue<SlotKey>,
    restarts_queued: std::collections::HashSet<SlotKey>,
    /// Writes to etcd, queued and retried off the actor's path.
    writer: writer::Writer,
    restarts_tx: mpsc::Sender<(SlotKey, RestartOutcome)>,
    draining: Option<(String, Instant)>,
    /// Slots whose worker finished (exit 0) in the given generation: not started again in it.
    finished: HashMap<SlotKey, u64>,
    exits_tx: mpsc::Sender<Exit>,
    /// Exclusions already acted on (slot, and the exclusion's generation and time).
    exclusions_seen: std::collections::HashSet<(SlotKey, (u64, u64))>,
    /// This node's view of each active job with a slot on it, as the leader keeps it
    /// (`assign/{node}/`): an absent job is one whose workers here must stop.
    jobs: BTreeMap<String, NodeAssignment>,
    /// The cgroup subtree its programs run in (None: the subreaper sweep only).
    cgroups: Option<ductile_runtime::cgroup::Cgroups>,
    /// Slots whose last program's cgroup still holds processes: no program starts there.
    lingering: HashMap<u32, (ductile_runtime::cgroup::Cgroup, String)>,
    /// When the log directories were last collected ([`Agent::collect_logs`]).
    logs_collected: Option<Instant>,
    /// The log requests already being answered.
    log_requests_seen: std::collections::BTreeSet<String>,
    /// A number for each program's cgroup name.
    spawned: u64,
    /// The cloud's events to acknowledge once drained (Azure's `StartRequests`).
    preemption_ack: Option<preempt::Ack>,
    /// Each job's uid on this node (`job_users`), held while its directory is here.
    job_uids: BTreeMap<String, u32>,
    /// The jobs whose private directory (`work_root/JOB`) this agent made.
    work_dirs: std::collections::BTreeSet<String>,
    /// Whether the assignments have been read once, and `work_root` swept of what no job here
    /// owns (an earlier agent's leftovers).
    jobs_seen: bool,
    work_swept: bool,
    /// A number for each directory moved aside for removal.
    removed: u64,
}

/// What of the agent's environment ductile-worker (the default runtime's process) is given,
/// beside what every job's process inherits ([`secrets::inherited`]): the node's settings for
/// ductile's own code, which load nothing of a job's choosing.
fn worker_node_setting(k: &str) -> bool {
    [
        "DUCTILE_HF_FIXTURES",
        "DUCTILE_SMOLLM2",
        "DUCTILE_TORCH_PYTHON",
        "DUCTILE_NCCL_LIB",
        "DUCTILE_LEDGER_DIR",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
    ]
    .contains(&k)
        || ["DUCTILE_COMM_", "DUCTILE_DATA_"]
            .iter()
            .any(|p| k.starts_with(p))
}

fn describe_exit(code: Option<i32>, signal: Option<i32>, last_words: Option<&str>) -> String {
    let how = match (code, signal) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "exited".into(),
    };
    match last_words {
        Some(w) if code != Some(EXIT_DONE) => {
            // one line, bounded: it travels in etcd records and generation details
            let w: String = w.chars().take(400).collect();
            format!("{how}: {w}")
        }
        _ => how,
    }
}

impl Agent {
    /// Runs the agent until drained (first signal) or forced.
    pub async fn run(
        cfg: Config,
        backend: Arc<dyn KvBackend>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        Self::run_with_reload(cfg, backend, shutdown, None).await
    }

    /// [`Agent::run`], taking each configuration `reload` yields (SIGHUP): see
    /// [`Agent::on_reload`].
    pub async fn run_with_reload(
        cfg: Config,
        backend: Arc<dyn KvBackend>,
        shutdown: CancellationToken,
        reload: Option<mpsc::Receiver<anyhow::Result<Config>>>,
    ) -> anyhow::Result<()> {
        let mut reload = reload;
        let store = Store::new(backend.clone(), Keys::new(&cfg.prefix));
        // what a launcher that died leaves of its program comes here (see sweep_orphans)
        if let Err(e) = ductile_runtime::reap::become_subreaper() {
            tracing::warn!(error = %e, "not a child subreaper: processes a dead launcher leaves are not swept");
        }
        let lease_cancel = CancellationToken::new();
        let keeper =
            LeaseKeeper::start(backend.clone(), cfg.lease_ttl, lease_cancel.clone()).await?;
        let devices = devices::devices(&cfg.gpus, cfg.gpu_slots_per_device, cfg.cpu_slots);
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap_or_default()
            .trim()
            .to_string();
        // each program in a cgroup of its own where one can be had (see runtime::cgroup)
        let cgroups = match ductile_runtime::cgroup::Cgroups::open(&cfg.cgroup) {
            Ok(c) => c,
            Err(why) if cfg.cgroup == ductile_runtime::cgroup::CgroupMode::Auto => {
                tracing::info!(%why, "no cgroup for programs: their descendants are swept instead");
                None
            }
            Err(why) => anyhow::bail!("invalid cgroup: {why}"),
        };
        let containment = match &cgroups {
            Some(c) => format!("cgroup {}", c.base().display()),
            None => "subreaper".to_string(),
        };
        tracing::info!(%containment, "programs' processes are contained");
        let node = NodeRecord {
            policy: Some(cfg.policy.clone()),
            containment: Some(containment),
            ..NodeRecord::new(&cfg.node, &hostname, devices, std::process::id())
        };
        let (exits_tx, mut exits_rx) = mpsc::channel(256);
        let (restarts_tx, mut restarts_rx) = mpsc::channel(256);
        let writer_cancel = CancellationToken::new();
        let writer =
            writer::Writer::start(store.clone(), keeper.subscribe(), writer_cancel.clone());
        let mut agent = Agent {
            cfg: cfg.clone(),
            store: store.clone(),
            node,
            lease: keeper.current(),
            children: HashMap::new(),
            failed: HashMap::new(),
            restarts_due: DelayQueue::new(),
            restarts_queued: Default::default(),
            writer,
            restarts_tx,
            draining: None,
            finished: HashMap::new(),
            exits_tx,
            exclusions_seen: Default::default(),
            jobs: BTreeMap::new(),
            cgroups,
            lingering: HashMap::new(),
            logs_collected: None,
            log_requests_seen: Default::default(),
            spawned: 0,
            preemption_ack: None,
            job_uids: BTreeMap::new(),
            work_dirs: Default::default(),
            jobs_seen: false,
            work_swept: false,
            removed: 0,
        };
        match workdir::prepare_root(&cfg.work_root) {
            // a fresh work root has nothing of an earlier agent's to sweep
            Ok(false) => agent.work_swept = true,
            Ok(true) => {}
            Err(why) => anyhow::bail!("invalid work_root: {why}"),
        }
        claim_node(&store, &agent.node, keeper.current().id, cfg.lease_ttl).await?;
        agent.register();
        tracing::info!(node = %agent.node.name, slots = agent.node.slots(), lease = format!("{:x}", agent.lease.id), "node registered");

        let watch_cancel = CancellationToken::new();
        // only what concerns this node: its view, and its drain request (the prefix also
        // matches longer names, which `on_drains` ignores)
        let mut jobs_rx = watch_prefix(
            backend.clone(),
            store.keys.node_assignments(&cfg.node),
            watch_cancel.clone(),
        );
        let mut drains_rx = watch_prefix(
            backend.clone(),
            store.keys.drain(&cfg.node),
            watch_cancel.clone(),
        );
        // `dctl logs`: the daemons' requests for this node's programs' output
        let mut logs_rx = watch_prefix(
            backend.clone(),
            store.keys.log_requests(&cfg.node),
            watch_cancel.clone(),
        );
        let mut lease_rx = keeper.subscribe();
        let (spot_tx, mut spot_rx) = mpsc::channel::<preempt::Notice>(4);
        tokio::spawn(preempt::watch(
            cfg.spot.clone(),
            spot_tx,
            watch_cancel.clone(),
        ));
        // act on the view as it stands: it changes only when something changes for this node
        // (an agent restarted in place must start its slots' workers without waiting for that)
        let first = synced(&mut jobs_rx).await;
        agent.on_jobs(&first);
        agent.reconcile();
        ductile_cluster::service::sd_notify(&[ductile_cluster::service::NotifyState::Ready]);
        let tick_every = ductile_cluster::service::watchdog_interval()
            .map(|w| w.min(Duration::from_secs(1)))
            .unwrap_or(Duration::from_secs(1));
        let mut tick = tokio::time::interval(tick_every);
        let mut shutdown_seen = false;
        loop {
            tokio::select! {
                r = jobs_rx.changed() => if r.is_ok() {
                    let snap = jobs_rx.borrow_and_update().clone();
                    agent.on_jobs(&snap);
                },
                r = drains_rx.changed() => if r.is_ok() {
                    let snap = drains_rx.borrow_and_update().clone();
                    agent.on_drains(&snap);
                },
                r = logs_rx.changed() => if r.is_ok() {
                    let snap = logs_rx.borrow_and_update().clone();
                    agent.on_log_requests(&snap);
                },
                Some(exit) = exits_rx.recv() => agent.on_exit(exit),
                r = lease_rx.changed() => if r.is_ok() {
                    let st = *lease_rx.borrow_and_update();
                    agent.on_lease(st);
                },
                Some(due) = std::future::poll_fn(|cx| agent.restarts_due.poll_expired(cx)), if !agent.restarts_due.is_empty() => {
                    let key = due.into_inner();
                    agent.restarts_queued.remove(&key);
                    agent.on_restart_due(key);
                }
                Some((key, outcome)) = restarts_rx.recv() => agent.on_restart_outcome(key, outcome),
                Some(notice) = spot_rx.recv() => agent.on_preemption(notice),
                Some(new) = async { match reload.as_mut() { Some(r) => r.recv().await, None => std::future::pending().await } } => match new {
                    Ok(cfg) => agent.on_reload(cfg),
                    Err(e) => tracing::error!(error = %format!("{e:#}"), "configuration reload refused: the policy in force stays"),
                },
                _ = shutdown.cancelled(), if !shutdown_seen => {
                    shutdown_seen = true;
                    ductile_cluster::service::sd_notify(&[ductile_cluster::service::NotifyState::Stopping]);
                    agent.start_drain("agent stopping (SIGTERM)".into());
                }
                _ = tick.tick() => {
                    // this loop never waits on etcd: a ping says the actor is turning
                    ductile_cluster::service::sd_notify(&[ductile_cluster::service::NotifyState::Watchdog]);
                    agent.sweep_orphans();
                    agent.retry_lingering();
                    agent.collect_logs();
                }
            }
            agent.reconcile();
            if agent.drain_done() {
                break;
            }
        }
        tracing::info!(node = %agent.node.name, "drained; leaving");
        if let Some(ack) = agent.preemption_ack.take() {
            // the cloud may start its events now rather than at their NotBefore
            match ack.send().await {
                Ok(()) => {
                    tracing::info!(events = ?ack.event_ids(), "acknowledged the cloud's scheduled events")
                }
                Err(e) => {
                    tracing::warn!(events = ?ack.event_ids(), error = %e, "could not acknowledge the cloud's scheduled events: they start at their own time")
                }
            }
        }
        // the workers' exit records are written before the lease goes
        if !agent.writer.flush(Duration::from_secs(5)).await {
            tracing::warn!(
                pending = agent.writer.pending(),
                "leaving with writes etcd did not take"
            );
        }
        writer_cancel.cancel();
        watch_cancel.cancel();
        lease_cancel.cancel();
        keeper.join().await;
        if let Some(cg) = agent.cgroups.take() {
            let n = tokio::task::spawn_blocking(move || cg.remove_all(Duration::from_secs(5)))
                .await
                .unwrap_or(0);
            if n > 0 {
                tracing::warn!(
                    killed = n,
                    "killed programs' processes left in their cgroups"
                );
            }
        }
        Ok(())
    }

    fn write(&mut self, key: String, value: Vec<u8>, leased: bool) {
        self.writer.put(key, value, leased);
    }

    fn register(&mut self) {
        let key = self.store.keys.node(&self.node.name);
        let rec = encode(&self.node);
        self.write(key, rec, true);
    }

    fn on_lease(&mut self, st: LeaseState) {
        let old = self.lease;
        self.lease = st;
        if st.epoch != old.epoch {
            // Our lease expired while we could not refresh it: the cluster has treated this
            // node as lost. Register again; workers of generations that left us out are fenced
            // by `reconcile`.
            self.node.reregistrations += 1;
            tracing::warn!(node = %self.node.name, lease = format!("{:x}", st.id), "lease was lost; registering again as a rejoining node");
            self.register();
            let keys: Vec<SlotKey> = self.children.keys().cloned().collect();
            for k in keys {
                let c = &self.children[&k];
                let rec = WorkerRecord {
                    pid: c.pid,
                    generation: c.generation,
                    state: WorkerState::Running,
                    exit: None,
                    code: None,
                    started_at_ms: now_ms(),
                };
                self.write(
                    self.store.keys.worker(&k.0, &self.node.name, k.1),
                    encode(&rec),
                    true,
                );
            }
            let failed: Vec<(SlotKey, SlotHealth)> = self
                .failed
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            for (k, h) in failed {
                self.write(
                    self.store.keys.slot(&k.0, &self.node.name, k.1),
                    encode(&h),
                    true,
                );
            }
        } else if !st.healthy && old.healthy {
            tracing::warn!("etcd unreachable: keeping workers running");
        }
    }

    fn on_jobs(&mut self, snap: &Snapshot) {
        let mut jobs: BTreeMap<String, NodeAssignment> = BTreeMap::new();
        let mut excluded = Vec::new();
        for kv in snap.kvs.values() {
            let KeyKind::Assignment { node, job } = self.store.keys.parse(&kv.key) else {
                continue;
            };
            if node != self.node.name {
                continue;
            }
            match decode::<NodeAssignment>(kv, "node assignment") {
                Ok(a) => {
                    for (slot, h) in &a.excluded {
                        excluded.push(((job.clone(), *slot), h.clone()));
                    }
                    jobs.insert(job, a);
                }
                Err(e) => {
                    // a view this agent cannot read (a newer leader's format?): keep acting
                    // on the last one it could, rather than stopping that job's workers
                    tracing::warn!(job = %job, error = %e, "ignoring an undecodable view; keeping the last one");
                    if let Some(old) = self.jobs.remove(&job) {
                        jobs.insert(job, old);
                    }
                }
            }
        }
        self.jobs = jobs;
        self.jobs_seen = true;
        // a job no longer assigned here (it ended; a resubmission of its name is a new run):
        // its slots' failures and finishes were that run's. The leader goes by the records in
        // etcd, which a resubmission clears; kept here, they left a resubmitted job's slot
        // unstarted for good.
        let jobs = &self.jobs;
        self.failed.retain(|k, _| jobs.contains_key(&k.0));
        self.finished.retain(|k, _| jobs.contains_key(&k.0));
        if !self.node.refused_running.is_empty() {
            let before = self.node.refused_running.len();
            let jobs = &self.jobs;
            self.node
                .refused_running
                .retain(|j, _| jobs.get(j).is_some_and(|a| !a.slots.is_empty()));
            if self.node.refused_running.len() != before {
                self.register();
            }
        }
        // The leader excluded a worker of ours that its peers could not reach (stopped,
        // wedged, cut off): the generation without it fences it (`reconcile` stops it, SIGKILL
        // after the grace reaches a stopped one too), and it is restarted like a failed one.
        // an exclusion is acted on once: a view written before the restart cleared it must
        // not take a second restart from the budget
        self.exclusions_seen
            .retain(|(k, _)| self.jobs.contains_key(&k.0));
        for (key, h) in excluded {
            let first = self
                .exclusions_seen
                .insert((key.clone(), (h.generation, h.failed_at_ms)));
            if !first || self.failed.contains_key(&key) {
                continue;
            }
            tracing::warn!(job = %key.0, slot = key.1, detail = %h.exit, "the leader excluded this slot's worker");
            self.failed.insert(key.clone(), h.clone());
            if h.will_restart {
                self.schedule_restart(key);
            }
        }
    }

    fn schedule_restart(&mut self, key: SlotKey) {
        if !self.restarts_queued.insert(key.clone()) {
            return; // one restart per failure (an exclusion and an exit report may both ask)
        }
        self.restarts_due.insert(key, self.cfg.restart_backoff);
    }

    fn on_drains(&mut self, snap: &Snapshot) {
        let mine = snap.kvs.values().find(|kv| matches!(self.store.keys.parse(&kv.key), KeyKind::Drain { node } if node == self.node.name));
        let reason = mine.map(|kv| {
            decode::<DrainRequest>(kv, "drain request")
                .map(|d| d.reason)
                .unwrap_or_else(|_| "drained by the operator".into())
        });
        if self.draining.is_some() {
            return; // leaving anyway
        }
        if reason != self.node.drain_reason {
            self.node.draining = reason.is_some();
            self.node.drain_reason = reason.clone();
            match &reason {
                Some(r) => tracing::info!(reason = %r, "cordoned: no work will be placed here"),
                None => tracing::info!("uncordoned"),
            }
            self.register();
        }
    }

    /// A configuration read again (SIGHUP, `systemctl reload`): the policy (allowed commands,
    /// paths, prefixes, modules, env, grace), the job credentials, the restart, stop and drain
    /// timings take effect for what starts from now on, and the node's record shows the new
    /// policy. Running jobs the new policy refuses keep running, named in the log and in the
    /// node's record (`dctl nodes`). What a running agent cannot change (etcd, the node's name,
    /// slots, cgroups, directories, the worker user, spot notices) waits for a restart, and the
    /// log says so.
    fn on_reload(&mut self, new: Config) {
        let old = &self.cfg;
        let mut waits = Vec::new();
        macro_rules! fixed {
            ($($f:ident),*) => {$(
                if format!("{:?}", old.$f) != format!("{:?}", new.$f) {
                    waits.push(stringify!($f));
                }
            )*};
        }
        fixed!(
            node,
            prefix,
            cpu_slots,
            gpus,
            gpu_slots_per_device,
            lease_ttl,
            worker_user,
            job_users,
            cgroup,
            work_root,
            log_dir,
            advertise_host,
            spot,
            etcd_worker_client
        );
        if old.etcd.endpoints != new.etcd.endpoints {
            waits.push("etcd");
        }
        if !waits.is_empty() {
            tracing::warn!(settings = ?waits, "these settings changed in the configuration but take effect only when the agent restarts (a restart drains the node)");
        }
        let mut cfg = self.cfg.clone();
        cfg.policy = new.policy;
        cfg.mesh_tls = new.mesh_tls;
        cfg.policy.mesh_tls = cfg.mesh_tls.is_some();
        cfg.job_credentials_dir = new.job_credentials_dir;
        cfg.worker_credentials = new.worker_credentials;
        cfg.torchft_ca = new.torchft_ca;
        cfg.restart_backoff = new.restart_backoff;
        cfg.stop_grace = new.stop_grace;
        cfg.drain_timeout = new.drain_timeout;
        cfg.log_max_bytes = new.log_max_bytes;
        cfg.log_keep = new.log_keep;
        cfg.libtorch = new.libtorch;
        self.cfg = cfg;
        self.node.policy = Some(self.cfg.policy.clone());
        self.node.refused_running = self.refused_running();
        for (job, why) in &self.node.refused_running {
            tracing::warn!(%job, %why, "the new policy refuses this running job: it keeps running, and no new worker of it starts here");
        }
        tracing::info!(policy = ?self.cfg.policy, refused_running = self.node.refused_running.len(), "configuration reloaded: the new policy applies to what starts from now on");
        self.register();
    }

    /// The jobs with a slot on this node that the current policy refuses, and why.
    fn refused_running(&self) -> BTreeMap<String, String> {
        let p = &self.cfg.policy;
        self.jobs
            .iter()
            .filter(|(_, a)| !a.slots.is_empty())
            .filter_map(|(job, a)| {
                p.check(&a.spec)
                    .and_then(|_| p.check_real_paths(&a.spec))
                    .err()
                    .map(|(field, reason)| (job.clone(), format!("{field}: {reason}")))
            })
            .collect()
    }

    /// A cloud's notice: an interruption drains the node within the notice's deadline; an
    /// advisory is recorded on the node (or drains it, with `spot_rebalance = "drain"`).
    fn on_preemption(&mut self, notice: preempt::Notice) {
        let rec = notice.record(self.cfg.spot.advisories_drain);
        let line = rec.describe();
        if let Some(ack) = notice.ack.clone() {
            self.preemption_ack = Some(ack);
        }
        self.node.preemption = Some(rec.clone());
        if rec.drains {
            tracing::warn!(notice = %line, "draining");
            // the cloud's deadline, where it is sooner than the drain timeout; one already past
            // by this host's clock (a clock off the cloud's, or a stale notice) cannot be met:
            // drain_timeout holds then, and the log says so
            let now = now_ms();
            let left = match rec.deadline_ms {
                Some(d) if d > now => Some(Duration::from_millis(d - now)),
                Some(d) => {
                    tracing::warn!(
                        deadline = %ductile_cluster::records::utc(d),
                        "the notice's deadline has passed by this host's clock: draining within drain_timeout"
                    );
                    None
                }
                None => None,
            };
            self.start_drain_within(line, left);
        } else {
            tracing::warn!(notice = %line, "recorded; not draining (spot_rebalance = \"drain\" would)");
            self.register();
        }
    }

    fn start_drain(&mut self, reason: String) {
        self.start_drain_within(reason, None);
    }

    /// Drain within the drain timeout, or within `left` where that is sooner (a cloud's
    /// deadline; at least a second).
    fn start_drain_within(&mut self, reason: String, left: Option<Duration>) {
        if self.draining.is_some() {
            return;
        }
        let timeout = match left {
            Some(l) => self.cfg.drain_timeout.min(l.max(Duration::from_secs(1))),
            None => self.cfg.drain_timeout,
        };
        self.draining = Some((reason.clone(), Instant::now() + timeout));
        self.node.draining = true;
        self.node.drain_reason = Some(reason);
        // the daemon fits a drain-time checkpoint before this (see `drain_done`)
        self.node.drain_deadline_ms = Some(now_ms() + timeout.as_millis() as u64);
        self.node.drain_timeout_ms = Some(timeout.as_millis() as u64);
        self.register();
    }

    /// Draining is done when no active job's generation includes this node and every worker
    /// has exited; past the drain timeout, remaining workers are stopped.
    fn drain_done(&mut self) -> bool {
        let Some((_, deadline)) = &self.draining else {
            return false;
        };
        let included = self.jobs.values().any(|j| !j.slots.is_empty());
        if !included || Instant::now() >= *deadline {
            if included {
                tracing::warn!(
                    "drain timeout: stopping workers before the job re-formed without this node"
                );
            }
            for c in self.children.values_mut() {
                if let Some(tx) = c.stop.take() {
                    c.stopping = true;
                    let _ = tx.send(());
                }
            }
        }
        self.children.is_empty() && (!included || Instant::now() >= *deadline)
    }

    /// Make the running workers match the current generations.
    fn reconcile(&mut self) {
        // Fence: stop workers whose job ended or whose slot left (even for one generation).
        let mut to_stop = Vec::new();
        for (key, child) in self.children.iter_mut() {
            if child.stopping {
                continue;
            }
            let keep = match self.jobs.get(&key.0) {
                // a snapshot older than what the worker already saw: leave it be
                Some(j) if j.generation < child.generation => true,
                Some(j) => {
                    let ok = j.member_since(key.1, child.generation);
                    if ok && j.generation != child.generation {
                        child.generation = j.generation;
                        // the slot's rank in the generation it now serves opens its lines
                        if let (Some(log), Some(m)) =
                            (&child.log, j.slots.iter().find(|m| m.slot == key.1))
                        {
                            log.lock().unwrap_or_else(|e| e.into_inner()).mark(
                                j.generation,
                                m.rank,
                                child.pid,
                            );
                        }
                    }
                    ok
                }
                _ => false,
            };
            if !keep {
                to_stop.push(key.clone());
            }
        }
        for key in to_stop {
            if let Some(c) = self.children.get_mut(&key) {
                tracing::info!(job = %key.0, slot = key.1, pid = c.pid, "stopping worker: its slot is not in the current generation (fenced) or the job ended");
                c.stopping = true;
                if let Some(tx) = c.stop.take() {
                    let _ = tx.send(());
                }
            }
        }
        if self.draining.is_some() || self.node.draining {
            return;
        }
        // Start workers for slots of this node in current generations.
        let mut to_start = Vec::new();
        for (name, j) in &self.jobs {
            for m in &j.slots {
                let key = (name.clone(), m.slot);
                let finished = self
                    .finished
                    .get(&key)
                    .is_some_and(|gen| *gen >= j.generation);
                // a slot still held by a worker (of any job: a fenced program in its grace
                // keeps its GPU) gets its next worker once that one has exited
                let busy = self.children.keys().any(|(_, s)| *s == m.slot)
                    || self.lingering.contains_key(&m.slot);
                if !busy
                    && !self.failed.contains_key(&key)
                    && !finished
                    && m.slot < self.node.slots()
                {
                    to_start.push((key, m.rank));
                }
            }
        }
        for (key, rank) in to_start {
            if let Some(j) = self.jobs.get(&key.0).cloned() {
                self.spawn(key, &j, rank);
            }
        }
        self.tidy_work_dirs();
    }

    /// The job's own S3 credentials (`job_credentials_dir/JOB.env`; none without the setting
    /// or the file); None when the file is unusable: the slot has then failed for good, saying
    /// why.
    fn job_credentials(
        &mut self,
        key: &SlotKey,
        generation: u64,
    ) -> Option<std::collections::BTreeMap<String, String>> {
        let Some(dir) = &self.cfg.job_credentials_dir else {
            return Some(Default::default());
        };
        match secrets::job_credentials(dir, &key.0) {
            Ok(c) => Some(c),
            Err(why) => {
                tracing::error!(job = %key.0, slot = key.1, %why, "the job's credentials file is unusable");
                let exit = format!("agent {}: job credentials: {why}", self.node.name);
                self.fail_for_good(key.clone(), generation, exit);
                None
            }
        }
    }

    /// The identity job `job` (cluster-wide number `number`) runs as on this node: its own
    /// uid from `job_users` (the one its number prefers unless another job here holds it),
    /// or `worker_user`, or None (the agent's own). (uid, gid, name)
    fn job_identity(&mut self, job: &str, number: u64) -> Option<(u32, u32, String)> {
        if let Some(r) = self.cfg.job_users {
            let uid = match self.job_uids.get(job) {
                Some(u) => *u,
                None => {
                    let n = if number > 0 {
                        number
                    } else {
                        // an older leader's view: a stable number from the name
                        job.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
                        })
                    };
                    let held: std::collections::BTreeSet<u32> =
                        self.job_uids.values().copied().collect();
                    let start = r.preferred(n) - r.first;
                    let free = (0..r.count)
                        .map(|i| r.first + (start + i) % r.count)
                        .find(|u| !held.contains(u))?;
                    if free != r.first + start {
                        tracing::info!(%job, uid = free, preferred = r.first + start, "the job's preferred uid is another job's here: it runs as the next free one");
                    }
                    self.job_uids.insert(job.to_string(), free);
                    free
                }
            };
            let gid = self.cfg.job_group.unwrap_or(uid);
            return Some((uid, gid, format!("ductile-job-{uid}")));
        }
        self.cfg
            .worker_user
            .as_ref()
            .map(|(name, uid, gid)| (*uid, *gid, name.clone()))
    }

    /// Removes the private directories of jobs with no slot and no process here any more
    /// (moved aside at once, deleted off the event loop); the first time, also what an earlier
    /// agent left under `work_root`.
    fn tidy_work_dirs(&mut self) {
        if !self.jobs_seen {
            return;
        }
        let active = |me: &Self, job: &str| {
            me.jobs.contains_key(job) || me.children.keys().any(|(j, _)| j == job)
        };
        let mut gone: Vec<String> = self
            .work_dirs
            .iter()
            .filter(|j| !active(self, j))
            .cloned()
            .collect();
        if !self.work_swept {
            self.work_swept = true;
            if let Ok(rd) = std::fs::read_dir(&self.cfg.work_root) {
                for e in rd.flatten() {
                    let name = e.file_name().to_string_lossy().to_string();
                    // an earlier agent's job directories (only directories: the marker and
                    // anything else stay)
                    let dir = e.file_type().is_ok_and(|t| t.is_dir());
                    if dir && (name.starts_with(".gone-") || !active(self, &name)) {
                        gone.push(name);
                    }
                }
            }
        }
        for job in gone {
            self.work_dirs.remove(&job);
            self.job_uids.remove(&job);
            let root = self.cfg.work_root.clone();
            let aside = if job.starts_with(".gone-") {
                job.clone()
            } else {
                self.removed += 1;
                let aside = format!(".gone-{job}-{}-{}", std::process::id(), self.removed);
                if let Err(e) = std::fs::rename(root.join(&job), root.join(&aside)) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!(%job, error = %e, "cannot move the job's directory aside for removal");
                    }
                    continue;
                }
                aside
            };
            tokio::task::spawn_blocking(move || {
                if let Err(why) = workdir::remove(&root, &aside) {
                    tracing::warn!(dir = %aside, %why, "cannot remove an ended job's directory");
                }
            });
        }
    }

    /// Kills what a launcher that died left of its program's processes (re-parented here:
    /// this agent is a child subreaper), so that no process of a job outlives it.
    fn sweep_orphans(&mut self) {
        let tracked: std::collections::BTreeSet<i32> =
            self.children.values().map(|c| c.pid as i32).collect();
        let n = ductile_runtime::reap::sweep_orphans(&tracked);
        if n > 0 {
            tracing::warn!(killed = n, "killed processes a dead launcher left running");
        }
    }

    /// Answer each new `dctl logs` request for this node (read off the actor, on the blocking
    /// pool): the answer goes under the request's lease, and the request is deleted.
    fn on_log_requests(&mut self, snap: &ductile_cluster::watch::Snapshot) {
        self.log_requests_seen
            .retain(|k| snap.kvs.contains_key(k.as_str()));
        for (key, kv) in snap.kvs.iter() {
            if !self.log_requests_seen.insert(key.clone()) {
                continue;
            }
            let (store, root, key, value) = (
                self.store.clone(),
                self.cfg.log_dir.clone(),
                key.clone(),
                kv.value.clone(),
            );
            tokio::spawn(async move {
                let id = key.rsplit('/').next().unwrap_or_default().to_string();
                let req: ductile_cluster::records::LogRequest = match serde_json::from_slice(&value)
                {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(key = %key, error = %e, "an unreadable log request: deleted");
                        let _ = store.backend.delete(&key).await;
                        return;
                    }
                };
                let lease = req.lease;
                let ans =
                    match tokio::task::spawn_blocking(move || joblog::answer(&root, &req)).await {
                        Ok(a) => a,
                        Err(e) => ductile_cluster::records::LogAnswer {
                            error: Some(format!("reading the log failed: {e}")),
                            ..Default::default()
                        },
                    };
                if let Err(e) = store
                    .backend
                    .put(&store.keys.log_answer(&id), encode(&ans), Some(lease))
                    .await
                {
                    tracing::warn!(request = %id, error = %e, "cannot write the answer to a log request (its lease may have ended)");
                }
                let _ = store.backend.delete(&key).await;
            });
        }
    }

    /// Once an hour (and at start): the log directories of jobs no process of which wrote for
    /// `log_keep` go, unless the job is still known here.
    fn collect_logs(&mut self) {
        if self
            .logs_collected
            .is_some_and(|t| t.elapsed() < Duration::from_secs(3600))
        {
            return;
        }
        self.logs_collected = Some(Instant::now());
        let known: std::collections::BTreeSet<String> = self
            .jobs
            .keys()
            .cloned()
            .chain(self.children.keys().map(|k| k.0.clone()))
            .collect();
        let (dir, keep) = (self.cfg.log_dir.clone(), self.cfg.log_keep);
        let gone = joblog::collect(&dir, keep, &|j| known.contains(j));
        if gone > 0 {
            tracing::info!(jobs = gone, dir = %dir.display(), "deleted the logs of jobs idle past --log-keep-hours");
        }
    }

    /// Slots whose last program's cgroup did not empty: killed again, and freed (and the
    /// node record says so) once empty and removed.
    fn retry_lingering(&mut self) {
        if self.lingering.is_empty() {
            return;
        }
        let before = self.lingering.len();
        self.lingering.retain(|slot, (cg, why)| match cg.destroy(Duration::from_millis(200)) {
            Ok(()) => {
                tracing::info!(slot, dir = %cg.dir().display(), "a busy slot's processes are gone: the slot is free");
                false
            }
            Err(e) => {
                *why = e;
                true
            }
        });
        if self.lingering.len() != before {
            self.publish_busy();
        }
    }

    fn publish_busy(&mut self) {
        self.node.busy_slots = self
            .lingering
            .iter()
            .map(|(s, (_, why))| (*s, why.clone()))
            .collect();
        self.register();
    }

    /// A slot whose worker cannot run here: reported with why, and not restarted.
    fn fail_for_good(&mut self, key: SlotKey, generation: u64, exit: String) {
        let h = SlotHealth {
            failed_at_ms: now_ms(),
            generation,
            exit,
            will_restart: false,
            excluded: false,
        };
        self.failed.insert(key.clone(), h.clone());
        self.write(
            self.store.keys.slot(&key.0, &self.node.name, key.1),
            encode(&h),
            true,
        );
    }

    fn spawn(&mut self, key: SlotKey, j: &NodeAssignment, rank: u32) {
        let spec = &j.spec;
        // what this agent's policy refuses never starts (the daemon refuses it at submit too,
        // but an agent does not take that on trust), the real paths included (on this node: a
        // symlink under an allowed root can point anywhere)
        let policy = &self.cfg.policy;
        if let Err((field, reason)) = policy
            .check(spec)
            .and_then(|_| policy.check_real_paths(spec))
        {
            tracing::error!(job = %key.0, slot = key.1, %field, %reason, "refused by this agent's policy");
            let exit = format!(
                "refused by agent {}'s policy: {field}: {reason}",
                self.node.name
            );
            self.fail_for_good(key, j.generation, exit);
            return;
        }
        let dev = self.node.devices[key.1 as usize].clone();
        let own_dir = std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(|d| d.to_path_buf()));
        // a torchrun job's program runs under `ductile-worker launch`, which follows the
        // generations, gives it torchrun's environment and restarts it in each new world
        let torchrun = spec.runtime.runs_program();
        let mut cmd = if torchrun {
            let launcher = own_dir
                .as_ref()
                .map(|d| d.join("ductile-worker"))
                .filter(|p| p.exists())
                .unwrap_or_else(|| "ductile-worker".into());
            let mut c = tokio::process::Command::new(launcher);
            c.arg("launch");
            c
        } else {
            let mut c = tokio::process::Command::new(&spec.command[0]);
            c.args(&spec.command[1..]);
            c
        };
        // every process of a job starts from a built environment, never the agent's: locale,
        // paths and the node's NCCL/CUDA settings (no credentials); ductile-worker as the
        // job's worker also the node's settings for ductile's own code, and S3 credentials
        // as `worker_credentials` says
        let worker_itself = !torchrun
            && std::path::Path::new(&spec.command[0])
                .file_name()
                .is_some_and(|n| n == "ductile-worker");
        cmd.env_clear()
            .envs(std::env::vars().filter(|(k, _)| secrets::inherited(k)));
        if worker_itself {
            cmd.envs(std::env::vars().filter(|(k, _)| worker_node_setting(k)));
            match self.cfg.worker_credentials {
                config::WorkerCredentials::Node => {
                    cmd.envs(std::env::vars().filter(|(k, _)| k.starts_with("AWS_")));
                }
                config::WorkerCredentials::Job => match self.job_credentials(&key, j.generation) {
                    Some(c) => {
                        cmd.envs(c);
                    }
                    None => return,
                },
            }
        }
        // the job's identity on this node, and its private directory (HOME, and the working
        // directory of a process the job runs directly)
        let identity = self.job_identity(&key.0, j.job_number);
        let home = match workdir::make(
            &self.cfg.work_root,
            &key.0,
            identity.as_ref().map(|(u, g, _)| (*u, *g)),
        ) {
            Ok(d) => d,
            Err(why) => {
                tracing::error!(job = %key.0, slot = key.1, %why, "cannot make the job's directory");
                let exit = format!("agent {}: the job's directory: {why}", self.node.name);
                self.fail_for_good(key, j.generation, exit);
                return;
            }
        };
        self.work_dirs.insert(key.0.clone());
        cmd.env("HOME", &home);
        if let Some((_, _, name)) = &identity {
            cmd.env("USER", name).env("LOGNAME", name);
        }
        if !torchrun {
            cmd.current_dir(&home).env("TMPDIR", &home);
        }
        cmd.envs(&spec.env);
        // `ductile-worker` resolves next to the agent first.
        if let Some(dir) = &own_dir {
            let path = std::env::var("PATH").unwrap_or_default();
            cmd.env("PATH", format!("{}:{path}", dir.display()));
        }
        // ductile-worker (a job's worker, or a program's launcher) loads the node's libtorch;
        // the launcher takes it off its programs' LD_LIBRARY_PATH again (DUCTILE_LIBTORCH_LIB)
        let runs_worker = torchrun
            || std::path::Path::new(&spec.command[0])
                .file_name()
                .is_some_and(|n| n == "ductile-worker");
        match self.cfg.libtorch.as_ref().filter(|_| runs_worker) {
            Some(lib) => {
                let current = std::env::var("LD_LIBRARY_PATH").ok();
                cmd.env(
                    "LD_LIBRARY_PATH",
                    libtorch::library_path(lib, current.as_deref()),
                )
                .env("DUCTILE_LIBTORCH_LIB", lib);
            }
            None => {
                cmd.env_remove("DUCTILE_LIBTORCH_LIB");
            }
        }
        let device = match dev.kind {
            DeviceKind::Gpu => {
                cmd.env("CUDA_VISIBLE_DEVICES", dev.index.to_string());
                "cuda:0".to_string()
            }
            DeviceKind::Cpu => "cpu".to_string(),
        };
        cmd.env("DUCTILE_JOB", &key.0)
            .env("DUCTILE_NODE", &self.node.name)
            .env("DUCTILE_SLOT", key.1.to_string())
            .env("DUCTILE_GENERATION", j.generation.to_string())
            .env("DUCTILE_RANK", rank.to_string())
            .env("DUCTILE_WORLD_SIZE", j.world_size.to_string())
            .env("DUCTILE_PREFIX", &self.cfg.prefix)
            .env("DUCTILE_DEVICE", device)
            .env(
                "DUCTILE_COMM_HOST",
                std::env::var("DUCTILE_COMM_HOST")
                    .unwrap_or_else(|_| self.cfg.advertise_host.clone()),
            )
            .env("DUCTILE_DEVICE_INDEX", dev.index.to_string());
        if torchrun {
            // each slot's GPU (empty for a CPU slot): a torchrun program's CUDA_VISIBLE_DEVICES
            // lists the node's GPUs of its generation in local-rank order
            let gpus: Vec<String> = self
                .node
                .devices
                .iter()
                .map(|d| match d.kind {
                    DeviceKind::Gpu => d.index.to_string(),
                    DeviceKind::Cpu => String::new(),
                })
                .collect();
            cmd.env("DUCTILE_NODE_GPUS", gpus.join(","));
            // where the job's programs run when it names no workdir: WORK_ROOT/JOB
            cmd.env("DUCTILE_WORK_ROOT", &self.cfg.work_root);
            // the lighthouse replicas' CA, for a torchft launcher's relay
            match &self.cfg.torchft_ca {
                Some(ca) => cmd.env("DUCTILE_TORCHFT_CA", ca),
                None => cmd.env_remove("DUCTILE_TORCHFT_CA"),
            };
        }
        // the job's own etcd user (etcd auth on), never this agent's credentials: every
        // DUCTILE_ETCD_* the agent was given is replaced or removed
        let job_user = j
            .access
            .as_ref()
            .map(|a| (a.user.as_str(), Secret::new(a.password.clone())));
        cmd.envs(
            self.cfg.etcd.worker_env(
                job_user.as_ref().map(|(u, p)| (*u, p)),
                self.cfg
                    .etcd_worker_client
                    .as_ref()
                    .map(|(c, k)| (c.as_path(), k.as_path())),
            ),
        );
        cmd.env_remove("DUCTILE_ETCD_PASSWORD_FILE")
            .env_remove("DUCTILE_ETCD_WORKER_CERT")
            .env_remove("DUCTILE_ETCD_WORKER_KEY");
        // a launcher's secrets (the job's etcd password, the job's credentials for its
        // programs) come on an inherited pipe, not in an environment its program can read
        let mut secrets_fd = None;
        if torchrun {
            let Some(program_env) = self.job_credentials(&key, j.generation) else {
                return;
            };
            let payload = serde_json::json!({
                "etcd_password": job_user.as_ref().map(|(_, p)| p.expose().to_string()),
                "program_env": program_env,
            });
            match secrets::pipe_with(payload.to_string().as_bytes()) {
                Ok(fd) => {
                    cmd.env("DUCTILE_ETCD_PASSWORD", "")
                        .env("DUCTILE_SECRETS_FD", secrets::SECRETS_FD.to_string());
                    secrets_fd = Some(fd);
                }
                Err(e) => {
                    tracing::error!(job = %key.0, slot = key.1, error = %e, "cannot hand the launcher its secrets");
                    let exit = format!(
                        "agent {}: cannot hand the launcher its secrets: {e}",
                        self.node.name
                    );
                    self.fail_for_good(key, j.generation, exit);
                    return;
                }
            }
        }
        let secrets_raw = secrets_fd.as_ref().map(|f| {
            use std::os::fd::AsRawFd;
            f.as_raw_fd()
        });
        // the node's mesh certificate, for a job whose mesh runs over TLS (its policy check
        // above made sure this agent has one)
        for (name, file) in [
            "DUCTILE_MESH_TLS_CA",
            "DUCTILE_MESH_TLS_CERT",
            "DUCTILE_MESH_TLS_KEY",
        ]
        .iter()
        .enumerate()
        .map(|(i, n)| (*n, self.cfg.mesh_tls.as_ref().map(|m| m[i].clone())))
        {
            match file.filter(|_| spec.training.as_ref().is_some_and(|t| t.mesh_tls)) {
                Some(f) => cmd.env(name, f),
                None => cmd.env_remove(name),
            };
        }
        let private = self.cfg.job_users.is_some();
        if let Some((uid, gid, _)) = &identity {
            // std drops the supplementary groups when it switches from root
            cmd.uid(*uid).gid(*gid);
        }
        // its cgroup, which the child joins before it runs anything of the job's (through a
        // descriptor this agent opened: the kernel checks the opener's rights)
        self.spawned += 1;
        let cg_name = format!("{}.{}.{}", key.0, key.1, self.spawned);
        let cgroup = match self.cgroups.as_ref().map(|c| c.create(&cg_name)) {
            None => None,
            Some(Ok(cg)) => match cg.procs_file() {
                Ok(f) => Some((cg, f)),
                Err(e) => {
                    let _ = cg.destroy(Duration::from_secs(1));
                    let exit = format!(
                        "agent {}: cannot move it into its cgroup: {e}",
                        self.node.name
                    );
                    self.fail_for_good(key, j.generation, exit);
                    return;
                }
            },
            Some(Err(e)) => {
                let exit = format!("agent {}: cannot create its cgroup: {e}", self.node.name);
                self.fail_for_good(key, j.generation, exit);
                return;
            }
        };
        let procs_raw = cgroup.as_ref().map(|(_, f)| {
            use std::os::fd::AsRawFd;
            f.as_raw_fd()
        });
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // The worker dies with its agent (a lost node takes its workers with it) and gets a
        // process group of its own, so stopping it reaches its children too.
        unsafe {
            cmd.pre_exec(move || {
                // a job with a user of its own makes files only it can read, by default
                if private {
                    nix::libc::umask(0o077);
                }
                // capabilities the agent holds in its ambient set (to switch users) do not
                // pass to a job's code
                nix::libc::prctl(
                    nix::libc::PR_CAP_AMBIENT,
                    nix::libc::PR_CAP_AMBIENT_CLEAR_ALL as nix::libc::c_ulong,
                    0,
                    0,
                    0,
                );
                if let Some(fd) = procs_raw {
                    // "0": the writing process itself
                    if nix::libc::write(fd, b"0\n".as_ptr().cast(), 2) != 2 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
                nix::unistd::setpgid(Pid::from_raw(0), Pid::from_raw(0))?;
                if let Some(fd) = secrets_raw {
                    secrets::install_in_child(fd)?;
                }
                Ok(())
            });
        }
        let spawned = cmd.spawn();
        drop(secrets_fd);
        let cgroup = cgroup.map(|(cg, _)| cg);
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                if let Some(cg) = &cgroup {
                    let _ = cg.destroy(Duration::from_secs(1));
                }
                tracing::error!(job = %key.0, slot = key.1, command = ?spec.command, error = %e, "cannot start worker");
                let exit = format!("cannot start {:?}: {e}", spec.command[0]);
                self.fail_for_good(key, j.generation, exit);
                return;
            }
        };
        let pid = child.id().unwrap_or(0);
        tracing::info!(job = %key.0, slot = key.1, pid, generation = j.generation, rank, "worker started");
        let log = match joblog::SlotLog::open(
            &self.cfg.log_dir,
            &key.0,
            key.1,
            self.cfg.log_max_bytes,
        ) {
            Ok(l) => {
                l.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .mark(j.generation, rank, pid);
                Some(l)
            }
            Err(e) => {
                tracing::warn!(job = %key.0, slot = key.1, dir = %self.cfg.log_dir.display(), error = %e, "cannot keep this worker's output in a log file (--log-dir): it goes to the agent's log only");
                None
            }
        };
        let last_words = Arc::new(std::sync::Mutex::new(None::<String>));
        let mut stderr_done = None;
        for (stream, name) in [
            (
                child
                    .stdout
                    .take()
                    .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
                "stdout",
            ),
            (
                child
                    .stderr
                    .take()
                    .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
                "stderr",
            ),
        ] {
            if let Some(s) = stream {
                let (job, slot) = key.clone();
                let last = (name == "stderr").then(|| last_words.clone());
                let file = log.clone();
                let h = tokio::spawn(async move {
                    let mut lines = ductile_cluster::lines::BoundedLines::new(
                        BufReader::new(s),
                        ductile_cluster::lines::MAX_LINE,
                    );
                    while let Ok(Some(line)) = lines.next_line().await {
                        tracing::info!(target: "worker", job = %job, slot, pid, stream = name, "{line}");
                        if let Some(f) = &file {
                            f.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .line(name, &line);
                        }
                        // the worker's own last words: its fatal errors start with its name
                        if let Some(l) = &last {
                            if line.starts_with("ductile-worker:") {
                                *l.lock().unwrap() = Some(line.trim().to_string());
                            }
                        }
                    }
                });
                if name == "stderr" {
                    stderr_done = Some(h);
                }
            }
        }
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let exits = self.exits_tx.clone();
        // a torchrun launcher gives its program the job's grace itself, then exits
        let grace = if torchrun {
            self.cfg
                .stop_grace
                .max(Duration::from_secs(spec.torchrun_settings().grace_s + 5))
        } else {
            self.cfg.stop_grace
        };
        let k2 = key.clone();
        let cg2 = cgroup.clone();
        tokio::spawn(async move {
            let status = tokio::select! {
                s = child.wait() => s,
                _ = stop_rx => {
                    let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGTERM);
                    match tokio::time::timeout(grace, child.wait()).await {
                        Ok(s) => s,
                        Err(_) => {
                            let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
                            if let Some(cg) = &cg2 {
                                cg.kill();
                            }
                            let _ = child.kill().await;
                            child.wait().await
                        }
                    }
                }
            };
            // whatever of it is left (a setsid() daemon, a double fork) dies with it, whole;
            // processes that do not die keep the slot busy
            let lingering = match cg2 {
                Some(cg) => {
                    let (job, slot) = k2.clone();
                    tokio::task::spawn_blocking(move || {
                    let n = cg.pids().len();
                    if n > 0 {
                        tracing::warn!(job = %job, slot, processes = n, "killing what the program left in its cgroup");
                    }
                    cg.destroy(Duration::from_secs(10)).err().map(|why| (cg, why))
                })
                .await
                .ok()
                .flatten()
                }
                None => None,
            };
            use std::os::unix::process::ExitStatusExt;
            let (code, signal) = match status {
                Ok(s) => (s.code(), s.signal()),
                Err(_) => (None, None),
            };
            // the worker's last lines are still in the pipe: read them, bounded (a child of
            // the worker may hold the pipe open)
            if let Some(h) = stderr_done {
                let _ = tokio::time::timeout(Duration::from_secs(1), h).await;
            }
            let last_words = last_words.lock().unwrap().take();
            let _ = exits
                .send(Exit {
                    key: k2,
                    pid,
                    code,
                    signal,
                    last_words,
                    lingering,
                })
                .await;
        });
        self.children.insert(
            key.clone(),
            Child {
                pid,
                generation: j.generation,
                stop: Some(stop_tx),
                stopping: false,
                log,
            },
        );
        let rec = WorkerRecord {
            pid,
            generation: j.generation,
            state: WorkerState::Running,
            exit: None,
            code: None,
            started_at_ms: now_ms(),
        };
        self.write(
            self.store.keys.worker(&key.0, &self.node.name, key.1),
            encode(&rec),
            true,
        );
    }

    fn on_exit(&mut self, exit: Exit) {
        if let Some((cg, why)) = exit.lingering {
            tracing::error!(job = %exit.key.0, slot = exit.key.1, %why, "the slot stays busy until its last program's processes are gone");
            self.lingering.insert(exit.key.1, (cg, why));
            self.publish_busy();
        }
        let Some(child) = self.children.remove(&exit.key) else {
            return;
        };
        let (job, slot) = exit.key.clone();
        let how = describe_exit(exit.code, exit.signal, exit.last_words.as_deref());
        let jv = self.jobs.get(&job);
        let still_member = jv.is_some_and(|j| j.member_since(slot, child.generation));
        let (used, budget) = (
            jv.map(|j| j.restarts_used).unwrap_or(0),
            jv.map(|j| j.spec.restart_budget).unwrap_or(0),
        );
        let expected = child.stopping || !still_member;
        let rec = WorkerRecord {
            pid: exit.pid,
            generation: child.generation,
            state: WorkerState::Exited,
            exit: Some(how.clone()),
            code: exit.code,
            started_at_ms: 0,
        };
        self.write(
            self.store.keys.worker(&job, &self.node.name, slot),
            encode(&rec),
            true,
        );
        if expected || exit.code == Some(EXIT_DONE) || exit.code == Some(EXIT_FENCED) {
            tracing::info!(job = %job, slot, pid = exit.pid, how = %how, "worker exited");
            if exit.code == Some(EXIT_DONE) && still_member {
                // it finished its work: leave the slot alone until a new generation
                self.finished.insert(exit.key.clone(), child.generation);
            }
            return;
        }
        // A failure: report it at once so the daemon re-forms without this slot. A worker that
        // cannot run on this slot (its device or backend is missing) is not restarted: it
        // would fail the same way.
        let unusable = exit.code == Some(EXIT_UNUSABLE);
        let will_restart = used < budget && !unusable;
        tracing::warn!(job = %job, slot, pid = exit.pid, how = %how, restarts_used = used, budget, will_restart, "worker failed");
        let h = SlotHealth {
            failed_at_ms: now_ms(),
            generation: child.generation,
            exit: how,
            will_restart,
            excluded: false,
        };
        self.failed.insert(exit.key.clone(), h.clone());
        self.write(
            self.store.keys.slot(&job, &self.node.name, slot),
            encode(&h),
            true,
        );
        if will_restart {
            self.schedule_restart(exit.key);
        }
    }

    /// Take one restart from the job's budget (compare-and-swap), then clear the slot's failure
    /// so the daemon lets it rejoin. The etcd side runs in a task that reports back
    /// ([`Agent::on_restart_outcome`]).
    fn on_restart_due(&mut self, key: SlotKey) {
        let (job, slot) = key.clone();
        let slot_key = self.store.keys.slot(&job, &self.node.name, slot);
        if self.children.contains_key(&key) || self.writer.is_pending(&slot_key) {
            // an excluded worker that has not exited yet, or a failure record not written yet
            // (it must not land after the restart cleared it): later
            self.schedule_restart(key);
            return;
        }
        let (store, tx) = (self.store.clone(), self.restarts_tx.clone());
        tokio::spawn(async move {
            let out = take_restart(&store, &job, &slot_key).await;
            let _ = tx.send((key, out)).await;
        });
    }

    fn on_restart_outcome(&mut self, key: SlotKey, outcome: RestartOutcome) {
        let (job, slot) = key.clone();
        match outcome {
            RestartOutcome::Restarted { used, budget } => {
                tracing::info!(job = %job, slot, restart = used, budget, "restarting failed worker: the slot rejoins");
                self.failed.remove(&key);
            }
            RestartOutcome::Exhausted { used, budget } => {
                tracing::warn!(job = %job, slot, used, budget, "restart budget exhausted: the slot stays out");
                if let Some(h) = self.failed.get_mut(&key) {
                    h.will_restart = false;
                    let v = encode(h);
                    self.write(self.store.keys.slot(&job, &self.node.name, slot), v, true);
                }
            }
            RestartOutcome::JobGone => {
                tracing::info!(job = %job, slot, "the job is gone: not restarting");
                self.failed.remove(&key);
            }
            RestartOutcome::Retry(why) => {
                tracing::warn!(job = %job, slot, reason = %why, "restart bookkeeping did not go through; retrying later");
                self.schedule_restart(key);
            }
        }
    }
}

/// Register `node` only if no other agent holds its name: a second agent started with the same
/// `--node` must not take over the first one's record (and its workers' slots). A predecessor
/// that crashed leaves its record until its lease expires, so the claim waits that long first.
async fn claim_node(
    store: &Store,
    node: &NodeRecord,
    lease: ductile_cluster::kv::LeaseId,
    ttl: i64,
) -> anyhow::Result<()> {
    let key = store.keys.node(&node.name);
    let deadline = Instant::now() + Duration::from_secs(ttl.max(1) as u64 + 2);
    let mut told = false;
    loop {
        let txn = Txn {
            compares: vec![Compare::Absent(key.clone())],
            ops: vec![Op::Put {
                key: key.clone(),
                value: encode(node),
                lease: Some(lease),
            }],
        };
        match store.backend.txn(txn).await {
            Ok(o) if o.succeeded => return Ok(()),
            Ok(_) => {}
            Err(e) => anyhow::bail!("cannot register node {:?}: {e}", node.name),
        }
        let kv = match store.backend.get(&key).await {
            Ok(Some(kv)) => kv,
            Ok(None) => continue, // it just expired
            Err(e) => anyhow::bail!("cannot register node {:?}: {e}", node.name),
        };
        let rec = decode::<NodeRecord>(&kv, "node record");
        // our own predecessor on this host, gone (systemd restarted us): take over at once
        if let Ok(r) = &rec {
            let gone = nix::sys::signal::kill(Pid::from_raw(r.agent_pid as i32), None)
                == Err(nix::errno::Errno::ESRCH);
            if r.hostname == node.hostname && gone {
                let txn = Txn {
                    compares: vec![Compare::ModRevision(key.clone(), kv.mod_revision)],
                    ops: vec![Op::Put {
                        key: key.clone(),
                        value: encode(node),
                        lease: Some(lease),
                    }],
                };
                match store.backend.txn(txn).await {
                    Ok(o) if o.succeeded => {
                        tracing::info!(node = %node.name, old_pid = r.agent_pid, "took over the record of this host's previous agent, which is gone");
                        return Ok(());
                    }
                    Ok(_) => continue,
                    Err(e) => anyhow::bail!("cannot register node {:?}: {e}", node.name),
                }
            }
        }
        let holder = rec
            .map(|r| format!("pid {} on host {:?}", r.agent_pid, r.hostname))
            .unwrap_or_else(|e| format!("an unreadable record: {e}"));
        if Instant::now() >= deadline {
            anyhow::bail!(
                "node name {:?} is held by another live agent ({holder}); start this one with another --node",
                node.name
            );
        }
        if !told {
            told = true;
            tracing::warn!(node = %node.name, holder = %holder, "the node name is registered by another agent; waiting for its lease to expire (a crashed predecessor's does)");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// How a restart's bookkeeping ended.
enum RestartOutcome {
    Restarted {
        used: u32,
        budget: u32,
    },
    Exhausted {
        used: u32,
        budget: u32,
    },
    /// The job is gone (stopped and deleted): nothing to restart.
    JobGone,
    /// etcd failed, or the counter kept changing under us: try again after the backoff (never
    /// dropped silently).
    Retry(String),
}

/// Increment the job's restart counter if it is below the job's budget, deleting the slot's
/// failure record in the same transaction. The budget is read from the spec here: a slot no
/// generation includes any more is in this node's view only while its failure record is.
async fn take_restart(store: &Store, job: &str, slot_key: &str) -> RestartOutcome {
    let budget = match store.spec(job).await {
        Ok(Some((spec, _))) => spec.restart_budget,
        Ok(None) => return RestartOutcome::JobGone,
        Err(e) => return RestartOutcome::Retry(format!("cannot read the job's spec: {e}")),
    };
    let ckey = store.keys.restarts(job);
    for _ in 0..10 {
        let cur = match store.backend.get(&ckey).await {
            Ok(kv) => kv,
            Err(e) => return RestartOutcome::Retry(format!("cannot read the restart count: {e}")),
        };
        let used: u32 = match cur.as_ref().map(|kv| serde_json::from_slice(&kv.value)) {
            None => 0,
            Some(Ok(n)) => n,
            Some(Err(e)) => {
                return RestartOutcome::Retry(format!("the restart count is unreadable: {e}"))
            }
        };
        if used >= budget {
            return RestartOutcome::Exhausted { used, budget };
        }
        let cmp = match &cur {
            Some(kv) => Compare::ModRevision(ckey.clone(), kv.mod_revision),
            None => Compare::Absent(ckey.clone()),
        };
        let txn = Txn {
            compares: vec![cmp],
            ops: vec![
                Op::put(&ckey, encode(&(used + 1))),
                Op::Delete {
                    key: slot_key.to_string(),
                },
            ],
        };
        match store.backend.txn(txn).await {
            Ok(o) if o.succeeded => {
                return RestartOutcome::Restarted {
                    used: used + 1,
                    budget,
                }
            }
            Ok(_) => continue, // another agent took one meanwhile
            Err(e) => return RestartOutcome::Retry(format!("the restart transaction failed: {e}")),
        }
    }
    RestartOutcome::Retry("the restart count changed under us 10 times in a row".into())
}

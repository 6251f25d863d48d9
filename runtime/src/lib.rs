//! The worker runtime, without tch: everything a process that works through a job's
//! generations needs from the control plane, whatever it runs between them. It reads the
//! identity the agent gave it ([`WorkerEnv`]), follows the job's generations ([`GenCell`],
//! [`watch_generations`]; [`follow_generations`] for jobs that only join), writes join and fault
//! records and reports to the leader ([`report::Reporter`]), and says why it stopped ([`Left`],
//! the exit codes the agent reads). The tch trainer (`ductile-worker`) is one user of it.
//!
//! Environment (set by the agent): `DUCTILE_JOB`, `DUCTILE_NODE`, `DUCTILE_SLOT`,
//! `DUCTILE_GENERATION`, `DUCTILE_RANK`, `DUCTILE_WORLD_SIZE`, `DUCTILE_ETCD`,
//! `DUCTILE_PREFIX`, `DUCTILE_DEVICE` (`cpu` or `cuda:0`), `DUCTILE_DEVICE_INDEX`.

pub mod cell;
pub mod cgroup;
pub mod launch;
pub mod reap;
pub mod report;

use std::sync::Arc;
use std::time::Duration;

use ductile_cluster::records::*;
use ductile_cluster::watch::{synced, watch_prefix};
use ductile_cluster::{Keys, KvBackend, Store};
use tokio_util::sync::CancellationToken;

pub use cell::GenCell;
pub use ductile_cluster::records::{EXIT_DONE, EXIT_FENCED, EXIT_TERMINATED, EXIT_UNUSABLE};

/// Why a worker's work through its generations ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Left {
    /// The job's work is done: exit [`EXIT_DONE`].
    Done,
    /// A generation left this worker out: exit [`EXIT_FENCED`].
    Fenced,
}

/// A failure that restarting this worker on this slot would not fix (no GPU, no NCCL): exit
/// [`EXIT_UNUSABLE`], which the agent does not restart.
#[derive(Debug)]
pub struct Unusable(pub String);

impl std::fmt::Display for Unusable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unusable {}

/// The worker's identity, from the agent's environment.
#[derive(Clone, Debug)]
pub struct WorkerEnv {
    pub job: String,
    pub node: String,
    pub slot: u32,
    pub generation: u64,
    /// etcd endpoints, TLS and the job's etcd user, as the agent set them.
    pub etcd: ductile_cluster::access::EtcdAccess,
    pub prefix: String,
    pub device: String,
    /// What the agent handed this worker through an inherited descriptor rather than the
    /// environment (a launcher's: see [`Secrets`]): the job's credentials for its programs.
    pub program_secrets: std::collections::BTreeMap<String, String>,
}

/// Secrets an agent hands a launcher on the descriptor `DUCTILE_SECRETS_FD` (a pipe it wrote
/// and closed), never in its environment: a launcher's environment is readable by its program
/// (`/proc/PPID/environ`) and by anything else of its uid. Read once at start and closed.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Secrets {
    /// The job's etcd password (etcd auth on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_password: Option<String>,
    /// Credentials the operator configured for the job's programs (`AWS_*`).
    #[serde(default)]
    pub program_env: std::collections::BTreeMap<String, String>,
}

/// The descriptor number secrets arrive on (the agent moves the pipe's read end there).
pub const SECRETS_FD: i32 = 3;

impl Secrets {
    /// Reads and closes `DUCTILE_SECRETS_FD` if the agent gave one (at most 64 KiB).
    pub fn take_from_fd() -> anyhow::Result<Option<Secrets>> {
        let Ok(v) = std::env::var("DUCTILE_SECRETS_FD") else {
            return Ok(None);
        };
        let fd: i32 = v
            .parse()
            .map_err(|_| anyhow::anyhow!("DUCTILE_SECRETS_FD={v:?} is not a descriptor"))?;
        use std::io::Read;
        use std::os::fd::FromRawFd;
        // SAFETY: the agent opened this descriptor for this process alone; it is read here once
        let f = unsafe { std::fs::File::from_raw_fd(fd) };
        let mut buf = Vec::new();
        f.take(64 << 10)
            .read_to_end(&mut buf)
            .map_err(|e| anyhow::anyhow!("cannot read the secrets descriptor {fd}: {e}"))?;
        let s: Secrets = serde_json::from_slice(&buf).map_err(|e| {
            anyhow::anyhow!("the secrets descriptor {fd} holds no secrets record: {e}")
        })?;
        Ok(Some(s))
    }
}

impl WorkerEnv {
    pub fn from_env() -> anyhow::Result<WorkerEnv> {
        fn var(name: &str) -> anyhow::Result<String> {
            std::env::var(name).map_err(|_| {
                anyhow::anyhow!(
                    "{name} is not set: ductile-worker is started by ductile-agent, which sets it"
                )
            })
        }
        fn num<T: std::str::FromStr>(name: &str) -> anyhow::Result<T> {
            let v = var(name)?;
            v.parse()
                .map_err(|_| anyhow::anyhow!("{name}={v:?} is not a number"))
        }
        let secrets = Secrets::take_from_fd()?;
        // the user is named in the environment; a launcher's password comes on the descriptor
        let mut etcd = ductile_cluster::access::EtcdAccess::from_env_unchecked();
        if let Some(p) = secrets.as_ref().and_then(|s| s.etcd_password.clone()) {
            etcd.password = Some(ductile_cluster::access::Secret::new(p));
        }
        let etcd = (if etcd.endpoints.is_empty() {
            Err("DUCTILE_ETCD is not set".to_string())
        } else {
            etcd.validate().map(|_| etcd)
        })
        .map_err(|e| {
            anyhow::anyhow!("{e}: ductile-worker is started by ductile-agent, which sets it")
        });
        Ok(WorkerEnv {
            program_secrets: secrets.map(|s| s.program_env).unwrap_or_default(),
            job: var("DUCTILE_JOB")?,
            node: var("DUCTILE_NODE")?,
            slot: num("DUCTILE_SLOT")?,
            generation: num("DUCTILE_GENERATION")?,
            etcd: etcd?,
            prefix: std::env::var("DUCTILE_PREFIX")
                .unwrap_or_else(|_| ductile_cluster::keys::DEFAULT_PREFIX.into()),
            device: std::env::var("DUCTILE_DEVICE").unwrap_or_else(|_| "cpu".into()),
        })
    }
}

/// The generation stored at `key` in a watch snapshot, if any (undecodable records are skipped).
fn current_generation(snap: &ductile_cluster::watch::Snapshot, key: &str) -> Option<Generation> {
    snap.kvs
        .get(key)
        .and_then(|kv| serde_json::from_slice(&kv.value).ok())
}

/// Follow generations until fenced out (returns) or `cancel`.
pub async fn follow_generations(
    env: WorkerEnv,
    backend: Arc<dyn KvBackend>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let store = Store::new(backend.clone(), Keys::new(&env.prefix));
    let gkey = store.keys.generation(&env.job);
    let mut rx = watch_prefix(backend, gkey.clone(), cancel.clone());
    synced(&mut rx).await;
    let mut joined: u64 = 0;
    loop {
        let g = current_generation(&rx.borrow_and_update(), &gkey);
        if let Some(g) = g {
            if g.number >= env.generation && g.number != joined {
                match g.member(&env.node, env.slot) {
                    Some(m) => {
                        let rec = JoinRecord {
                            node: env.node.clone(),
                            slot: env.slot,
                            rank: m.rank,
                            pid: std::process::id(),
                            joined_at_ms: now_ms(),
                            // this mode holds no training state
                            step: 0,
                            ..Default::default()
                        };
                        let key = store.keys.joined_rank(&env.job, g.number, m.rank);
                        let mut delay = Duration::from_millis(50);
                        loop {
                            match store.put_json(&key, &rec, None).await {
                                Ok(_) => break,
                                Err(e) => {
                                    tracing::warn!(error = %e, "cannot write join record; retrying");
                                    tokio::time::sleep(delay).await;
                                    delay = (delay * 2).min(Duration::from_secs(1));
                                }
                            }
                        }
                        joined = g.number;
                        println!(
                            "joined generation {} as rank {} of {} ({}; {}) on {}",
                            g.number, m.rank, g.world_size, g.reason, g.detail, env.device
                        );
                    }
                    None => {
                        println!(
                            "generation {} does not include {}/{}: leaving",
                            g.number, env.node, env.slot
                        );
                        return Ok(());
                    }
                }
            }
        }
        tokio::select! {
            r = rx.changed() => if r.is_err() { return Ok(()) },
            _ = cancel.cancelled() => return Ok(()),
        }
    }
}

/// Feed every new generation of the job into `cell` (which aborts an older communicator).
pub fn watch_generations(store: Store, job: String, cell: Arc<GenCell>, cancel: CancellationToken) {
    let gkey = store.keys.generation(&job);
    let mut rx = watch_prefix(store.backend.clone(), gkey.clone(), cancel.clone());
    tokio::spawn(async move {
        loop {
            let g = current_generation(&rx.borrow_and_update(), &gkey);
            if let Some(g) = g {
                cell.publish(g);
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                _ = cancel.cancelled() => return,
            }
        }
    });
}

/// Keep `latest` set to the job's newest checkpoint request id (a planned drain asks for one).
pub fn watch_checkpoint_requests(
    store: Store,
    job: String,
    latest: Arc<std::sync::Mutex<Option<CheckpointRequest>>>,
    rt: &tokio::runtime::Handle,
) {
    let key = store.keys.checkpoint_request(&job);
    let cancel = CancellationToken::new();
    let mut rx = watch_prefix(store.backend.clone(), key.clone(), cancel);
    rt.spawn(async move {
        loop {
            let req = rx
                .borrow_and_update()
                .kvs
                .get(&key)
                .and_then(|kv| serde_json::from_slice::<CheckpointRequest>(&kv.value).ok());
            if let Some(r) = req {
                *latest.lock().unwrap() = Some(r);
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    });
}

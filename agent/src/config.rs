//! ductile-agent's configuration: flags (and `DUCTILE_*` environment) over a TOML file over
//! defaults, validated after merging.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use ductile_cluster::access::{EtcdAccess, EtcdArgs};
use ductile_cluster::records::AgentPolicy;
use ductile_cluster::service::LogFormat;
use serde::Deserialize;

use crate::preempt::{Source, SpotConfig};

#[derive(Parser, Debug)]
#[command(
    name = "ductile-agent",
    version,
    about = "ductile node agent: registers the node, runs and supervises workers"
)]
pub struct Cli {
    /// Check this node instead of running: the config, the files it names, the workers'
    /// libtorch, etcd, the clock and the cloud; prints what is wrong in plain words and exits 1
    /// if anything is (run it as the service's user).
    #[arg(long)]
    pub check: bool,
    #[command(flatten)]
    pub etcd_access: EtcdArgs,
    /// Client certificate (PEM) this node's workers present to an etcd that asks for one; never
    /// the agent's own (etcd takes a certificate's CN for a user when no password is given).
    #[arg(long, env = "DUCTILE_ETCD_WORKER_CERT")]
    pub etcd_worker_cert: Option<PathBuf>,
    /// The workers' client certificate's key (PEM).
    #[arg(long, env = "DUCTILE_ETCD_WORKER_KEY")]
    pub etcd_worker_key: Option<PathBuf>,
    /// Run workers as this Unix user (and its group), not as the agent's: jobs then cannot read
    /// the agent's own files (its etcd credentials). The agent needs root, or CAP_SETUID and
    /// CAP_SETGID, for it.
    #[arg(long, env = "DUCTILE_WORKER_USER")]
    pub worker_user: Option<String>,
    /// For jobs with `mesh_tls`: the CA (PEM) that signed every node's mesh certificate.
    #[arg(long, env = "DUCTILE_MESH_TLS_CA")]
    pub mesh_tls_ca: Option<PathBuf>,
    /// This node's mesh certificate (PEM; server and client, naming its advertise_host).
    #[arg(long, env = "DUCTILE_MESH_TLS_CERT")]
    pub mesh_tls_cert: Option<PathBuf>,
    /// The mesh certificate's key (PEM).
    #[arg(long, env = "DUCTILE_MESH_TLS_KEY")]
    pub mesh_tls_key: Option<PathBuf>,
    /// This node's name (default: the hostname).
    #[arg(long, env = "DUCTILE_NODE")]
    pub node: Option<String>,
    /// CPU slots to offer when the node has no GPU (or with --gpus off).
    #[arg(long, env = "DUCTILE_CPU_SLOTS")]
    pub cpu_slots: Option<u32>,
    /// TTL in seconds of the node's lease; keep-alive every TTL/3.
    #[arg(long, env = "DUCTILE_LEASE_TTL")]
    pub lease_ttl: Option<i64>,
    /// TOML config file; flags override it.
    #[arg(long, env = "DUCTILE_CONFIG")]
    pub config: Option<PathBuf>,
    /// etcd key prefix.
    #[arg(long, env = "DUCTILE_PREFIX")]
    pub prefix: Option<String>,
    /// auto (use NVIDIA GPUs when present), off, or a comma-separated list of GPU indices to
    /// offer (offered as given, even where nvidia-smi does not list them: their workers then
    /// fail at start, saying what is missing).
    #[arg(long, env = "DUCTILE_GPUS")]
    pub gpus: Option<String>,
    /// Slots offered per GPU (workers sharing a GPU communicate over TCP: NCCL refuses two
    /// ranks on one GPU).
    #[arg(long, env = "DUCTILE_GPU_SLOTS_PER_DEVICE")]
    pub gpu_slots_per_device: Option<u32>,
    /// The libtorch the workers load (ductile-worker links libtorch 2.11.0): a libtorch
    /// directory (with lib/libtorch_cpu.so) or a torch/lib directory. The agent starts
    /// ductile-worker with it first on LD_LIBRARY_PATH; users' programs do not inherit it.
    /// (Its variable is DUCTILE_AGENT_*: DUCTILE_TORCH_PYTHON is the tests' own interpreter.)
    #[arg(long, env = "DUCTILE_AGENT_LIBTORCH")]
    pub libtorch: Option<PathBuf>,
    /// A Python interpreter whose `torch` package (2.11.0) the workers load, instead of
    /// --libtorch: most GPU nodes have one.
    #[arg(long, env = "DUCTILE_AGENT_TORCH_PYTHON")]
    pub torch_python: Option<PathBuf>,
    /// Preemption notices of the node's cloud: auto (find the cloud once at start; nothing is
    /// probed again off a cloud), aws (IMDSv2: spot instance-action and rebalance
    /// recommendation), gcp (preempted, maintenance-event), azure (Scheduled Events), or off
    /// (the default).
    #[arg(long, env = "DUCTILE_SPOT_NOTICE")]
    pub spot_notice: Option<String>,
    /// A URL of your own polled for a notice (a 200 answer is one); `aws`, `gcp`, `azure` and
    /// `auto` here mean what they mean for --spot-notice.
    #[arg(long, env = "DUCTILE_SPOT_NOTICE_URL")]
    pub spot_notice_url: Option<String>,
    /// The cloud metadata service's base URL (default http://169.254.169.254).
    #[arg(long, env = "DUCTILE_SPOT_METADATA_ENDPOINT")]
    pub spot_metadata_endpoint: Option<String>,
    /// What an advisory (EC2's rebalance recommendation, a GCP live migration, an Azure
    /// freeze) does: notify (recorded on the node, shown by `dctl nodes` and the dashboard;
    /// the default) or drain (the node drains as for an interruption).
    #[arg(long, env = "DUCTILE_SPOT_REBALANCE")]
    pub spot_rebalance: Option<String>,
    /// Poll interval of the spot notice, in milliseconds.
    #[arg(long, env = "DUCTILE_SPOT_POLL_MS")]
    pub spot_poll_ms: Option<u64>,
    /// Longest wait, in seconds, for the job to re-form without this node when draining.
    #[arg(long, env = "DUCTILE_DRAIN_TIMEOUT")]
    pub drain_timeout: Option<u64>,
    /// Wait before restarting a failed worker, in milliseconds.
    #[arg(long, env = "DUCTILE_RESTART_BACKOFF_MS")]
    pub restart_backoff_ms: Option<u64>,
    /// Grace between SIGTERM and SIGKILL when stopping a worker, in milliseconds.
    #[arg(long, env = "DUCTILE_STOP_GRACE_MS")]
    pub stop_grace_ms: Option<u64>,
    /// plain or json.
    #[arg(long, env = "DUCTILE_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// How long to wait for etcd at start-up, in seconds.
    #[arg(long, env = "DUCTILE_ETCD_WAIT")]
    pub etcd_wait: Option<u64>,
    /// Address other nodes' workers reach this node's workers at (default: this host's first
    /// non-loopback IPv4 address, else 127.0.0.1).
    #[arg(long, env = "DUCTILE_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// Worker programs this agent runs (a job's command[0]), comma-separated; `*` for any.
    /// Default: ductile-worker.
    #[arg(long, env = "DUCTILE_ALLOWED_COMMANDS", value_delimiter = ',')]
    pub allowed_commands: Option<Vec<String>>,
    /// Roots under which a job's file:// dataset and checkpoint may be, comma-separated; `/`
    /// for any. Default: /var/lib/ductile.
    #[arg(long, env = "DUCTILE_ALLOWED_PATHS", value_delimiter = ',')]
    pub allowed_paths: Option<Vec<String>>,
    /// Prefixes (s3://bucket/prefix) under which a job's s3:// dataset, checkpoint and
    /// arguments may be, comma-separated; `*` for any (the default).
    #[arg(long, env = "DUCTILE_ALLOWED_S3_PREFIXES", value_delimiter = ',')]
    pub allowed_s3_prefixes: Option<Vec<String>>,
    /// Python modules a job may run with `python -m` while commands are restricted,
    /// comma-separated (`torch.distributed.run`, `pkg.*`, `*`); default none.
    #[arg(long, env = "DUCTILE_ALLOWED_MODULES", value_delimiter = ',')]
    pub allowed_modules: Option<Vec<String>>,
    /// Roots a job's script and workdir must really lie under (symlinks resolved), apart from
    /// where jobs write; default: allowed_paths.
    #[arg(long, env = "DUCTILE_ALLOWED_CODE_PATHS", value_delimiter = ',')]
    pub allowed_code_paths: Option<Vec<String>>,
    /// The longest program.grace_s a job may ask for, in seconds (default 120).
    #[arg(long, env = "DUCTILE_MAX_GRACE_S")]
    pub max_grace_s: Option<u64>,
    /// More environment names a job may set while commands are restricted, beyond the built-in
    /// list, comma-separated: NAME or PREFIX* (DUCTILE_* stays reserved).
    #[arg(long, env = "DUCTILE_ALLOWED_ENV", value_delimiter = ',')]
    pub allowed_env: Option<Vec<String>>,
    /// A directory of per-job credentials for users' programs: `JOB.env` (KEY=VALUE lines of
    /// AWS_* names) is given to that job's programs; the agent's own are never given.
    #[arg(long, env = "DUCTILE_JOB_CREDENTIALS_DIR")]
    pub job_credentials_dir: Option<PathBuf>,
    /// Programs besides ductile-worker that a default-runtime job may start directly,
    /// comma-separated (they must also be in allowed_commands); default none.
    #[arg(long, env = "DUCTILE_DIRECT_COMMANDS", value_delimiter = ',')]
    pub direct_commands: Option<Vec<String>>,
    /// The runtimes this agent runs, comma-separated (ductile, torchrun, torchft, tf,
    /// horovod); default every one. Leave out tf where TensorFlow's unauthenticated gRPC
    /// servers (every interface) are not acceptable.
    #[arg(long, env = "DUCTILE_ALLOWED_RUNTIMES", value_delimiter = ',')]
    pub allowed_runtimes: Option<Vec<String>>,
    /// Whose S3 credentials ductile-worker (the default runtime) gets: "job" (default: only the
    /// job's own `job_credentials_dir/JOB.env`) or "node" (this agent's AWS_* variables: a
    /// fleet whose jobs all may read and write what the node may).
    #[arg(long, env = "DUCTILE_WORKER_CREDENTIALS")]
    pub worker_credentials: Option<String>,
    /// Run each job's processes as a Unix user of its own, from this uid range (FIRST-LAST,
    /// e.g. 70000-79999: uids no account in /etc/passwd has); needs root or CAP_SETUID,
    /// CAP_SETGID and CAP_CHOWN. Not with worker_user.
    #[arg(long, env = "DUCTILE_JOB_USERS")]
    pub job_users: Option<String>,
    /// With job_users: the group every job's processes run in (e.g. ductile-worker, which may
    /// read the node's worker and mesh keys); default each job's own (its uid's number). Jobs
    /// still cannot reach each other: their files are made mode 600/700 (umask 077) and
    /// /proc/PID/environ needs the same uid.
    #[arg(long, env = "DUCTILE_JOB_GROUP")]
    pub job_group: Option<String>,
    /// The CA (PEM) of the lighthouse replicas' TLS certificates (ductiled
    /// --torchft-tls-cert): torchft jobs' launchers then speak TLS to them.
    #[arg(long, env = "DUCTILE_TORCHFT_CA")]
    pub torchft_ca: Option<PathBuf>,
    /// How programs' processes are contained: auto (a cgroup v2 of their own, under this
    /// agent's cgroup, when it can be written; else the subreaper sweep), off (the sweep
    /// only), or the absolute path of a delegated cgroup2 directory to use (required then).
    #[arg(long, env = "DUCTILE_CGROUP")]
    pub cgroup: Option<String>,
    /// Where a torchrun or torchft job's programs run when the job names no
    /// `program.workdir`: WORK_ROOT/JOB, one per job on this node, kept across its generations
    /// (a relative output path stays there). Keep it under allowed_paths. Default
    /// /var/lib/ductile/work.
    #[arg(long, env = "DUCTILE_WORK_ROOT")]
    pub work_root: Option<PathBuf>,
    /// Where every worker's and program's output is kept on this node: LOG_DIR/JOB/slot-S.log
    /// (a mark opens each generation with the slot's rank), rotated past --log-max-mib to
    /// slot-S.log.1. Default /var/lib/ductile/logs.
    #[arg(long, env = "DUCTILE_LOG_DIR")]
    pub log_dir: Option<PathBuf>,
    /// A program's log file is rotated past this many MiB (one older file kept). Default 16.
    #[arg(long, env = "DUCTILE_LOG_MAX_MIB")]
    pub log_max_mib: Option<u64>,
    /// A job's logs go once no process of it wrote for this many hours. Default 168 (a week).
    #[arg(long, env = "DUCTILE_LOG_KEEP_HOURS")]
    pub log_keep_hours: Option<u64>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub etcd_worker_cert: Option<PathBuf>,
    pub etcd_worker_key: Option<PathBuf>,
    pub worker_user: Option<String>,
    pub mesh_tls_ca: Option<PathBuf>,
    pub mesh_tls_cert: Option<PathBuf>,
    pub mesh_tls_key: Option<PathBuf>,
    pub node: Option<String>,
    pub cpu_slots: Option<u32>,
    pub lease_ttl: Option<i64>,
    pub prefix: Option<String>,
    pub gpus: Option<String>,
    pub gpu_slots_per_device: Option<u32>,
    pub libtorch: Option<PathBuf>,
    pub torch_python: Option<PathBuf>,
    pub spot_notice: Option<String>,
    pub spot_notice_url: Option<String>,
    pub spot_metadata_endpoint: Option<String>,
    pub spot_rebalance: Option<String>,
    pub spot_poll_ms: Option<u64>,
    pub drain_timeout: Option<u64>,
    pub restart_backoff_ms: Option<u64>,
    pub stop_grace_ms: Option<u64>,
    pub log_format: Option<LogFormat>,
    pub etcd_wait: Option<u64>,
    pub advertise_host: Option<String>,
    pub allowed_commands: Option<Vec<String>>,
    pub allowed_paths: Option<Vec<String>>,
    pub allowed_s3_prefixes: Option<Vec<String>>,
    pub allowed_modules: Option<Vec<String>>,
    pub allowed_code_paths: Option<Vec<String>>,
    pub max_grace_s: Option<u64>,
    pub allowed_env: Option<Vec<String>>,
    pub job_credentials_dir: Option<PathBuf>,
    pub direct_commands: Option<Vec<String>>,
    pub allowed_runtimes: Option<Vec<String>>,
    pub worker_credentials: Option<String>,
    pub job_users: Option<String>,
    pub job_group: Option<String>,
    pub torchft_ca: Option<PathBuf>,
    pub cgroup: Option<String>,
    pub work_root: Option<PathBuf>,
    pub log_dir: Option<PathBuf>,
    pub log_max_mib: Option<u64>,
    pub log_keep_hours: Option<u64>,
}

/// Which GPUs a node offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gpus {
    /// Those nvidia-smi lists; CPU slots when it lists none.
    Auto,
    /// None: CPU slots only.
    Off,
    /// These indices, as given.
    List(Vec<u32>),
}

impl Gpus {
    pub fn parse(s: &str) -> anyhow::Result<Gpus> {
        match s.trim() {
            "auto" => Ok(Gpus::Auto),
            "off" => Ok(Gpus::Off),
            list => {
                let mut v = Vec::new();
                for part in list.split(',') {
                    let i: u32 = part.trim().parse().map_err(|_| {
                        anyhow::anyhow!(
                            "invalid gpus: {s:?} is not auto, off or a list of GPU indices like 0,1"
                        )
                    })?;
                    if v.contains(&i) {
                        anyhow::bail!("invalid gpus: GPU {i} is listed twice in {s:?}");
                    }
                    v.push(i);
                }
                Ok(Gpus::List(v))
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    /// How this agent reaches etcd (endpoints, TLS, its own user).
    pub etcd: EtcdAccess,
    /// The client certificate and key its workers present, if etcd asks for one.
    pub etcd_worker_client: Option<(PathBuf, PathBuf)>,
    /// CA, certificate and key of this node's TLS mesh, for jobs with `mesh_tls`.
    pub mesh_tls: Option<[PathBuf; 3]>,
    /// The user workers run as (name, uid, gid), when not the agent's.
    pub worker_user: Option<(String, u32, u32)>,
    /// The uid range of per-job users (`job_users`), when each job runs as its own.
    pub job_users: Option<JobUsers>,
    /// The gid of every job's processes with job_users (`job_group`); None: the uid's number.
    pub job_group: Option<u32>,
    /// Whose S3 credentials ductile-worker gets.
    pub worker_credentials: WorkerCredentials,
    pub node: String,
    pub cpu_slots: u32,
    pub lease_ttl: i64,
    pub prefix: String,
    pub gpus: Gpus,
    pub gpu_slots_per_device: u32,
    /// Where preemption notices come from, and what they do.
    pub spot: SpotConfig,
    /// The directory of libtorch's libraries the workers load (`libtorch`, `torch_python`),
    /// where the configuration names one.
    pub libtorch: Option<PathBuf>,
    pub drain_timeout: Duration,
    pub restart_backoff: Duration,
    pub stop_grace: Duration,
    pub log_format: LogFormat,
    pub etcd_wait: Duration,
    pub advertise_host: String,
    /// What this agent agrees to run (published in its node record).
    pub policy: AgentPolicy,
    /// Per-job credentials for users' programs (`JOB.env` files); see [`crate::secrets`].
    pub job_credentials_dir: Option<PathBuf>,
    /// The lighthouse replicas' CA: torchft launchers speak TLS to them.
    pub torchft_ca: Option<PathBuf>,
    /// How programs' processes are contained (see ductile_runtime::cgroup).
    pub cgroup: ductile_runtime::cgroup::CgroupMode,
    /// The root of the per-job working directories of programs (`work_root`).
    pub work_root: PathBuf,
    /// Where programs' output is kept, per job and slot ([`crate::joblog`]).
    pub log_dir: PathBuf,
    pub log_max_bytes: u64,
    pub log_keep: Duration,
}

/// Whose S3 credentials ductile-worker (the default runtime's process) gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerCredentials {
    /// The job's own (`job_credentials_dir/JOB.env`), none without it.
    Job,
    /// The agent's `AWS_*` variables.
    Node,
}

impl WorkerCredentials {
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        match s {
            "job" => Ok(WorkerCredentials::Job),
            "node" => Ok(WorkerCredentials::Node),
            _ => anyhow::bail!("invalid worker_credentials {s:?}: \"job\" or \"node\""),
        }
    }
}

/// A range of uids for per-job users: job `n` (its cluster-wide number) runs as
/// `first + n mod count` where no other job on the node holds that uid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobUsers {
    pub first: u32,
    pub count: u32,
}

impl JobUsers {
    /// `FIRST-LAST`, refused where it includes root, a system uid (under 1000), `nobody`
    /// (65534), or a uid that an account in `passwd` (the text of /etc/passwd) has.
    pub fn parse(s: &str, passwd: &str) -> anyhow::Result<Self> {
        let bad = |why: String| anyhow::anyhow!("invalid job_users {s:?}: {why}");
        let (a, b) = s
            .split_once('-')
            .ok_or_else(|| bad("give a range FIRST-LAST, e.g. 70000-79999".into()))?;
        let first: u32 = a.trim().parse().map_err(|e| bad(format!("{a:?}: {e}")))?;
        let last: u32 = b.trim().parse().map_err(|e| bad(format!("{b:?}: {e}")))?;
        if first < 1000 || last < first {
            return Err(bad(
                "FIRST must be at least 1000 and LAST at least FIRST".into()
            ));
        }
        if last >= u32::MAX - 1 || (first..=last).contains(&65534) {
            return Err(bad("it includes nobody (65534) or the invalid uid".into()));
        }
        for line in passwd.lines() {
            let f: Vec<&str> = line.split(':').collect();
            if let (Some(name), Some(Ok(uid))) = (f.first(), f.get(2).map(|u| u.parse::<u32>())) {
                if (first..=last).contains(&uid) {
                    return Err(bad(format!(
                        "uid {uid} is the account {name:?}'s (/etc/passwd): pick uids no account has"
                    )));
                }
            }
        }
        Ok(JobUsers {
            first,
            count: last - first + 1,
        })
    }

    /// The uid job number `n` prefers.
    pub fn preferred(&self, n: u64) -> u32 {
        self.first + (n % self.count as u64) as u32
    }
}

/// Whether this process holds every capability of `bits` (CapEff) in its effective set.
pub fn has_caps(bits: u64) -> bool {
    let eff = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .unwrap_or(0);
    eff & bits == bits
}

/// `name`'s uid and gid, once this agent is able to switch to them (root, or CAP_SETUID and
/// CAP_SETGID in its effective set).
/// Whether this process holds CAP_SETUID and CAP_SETGID in its effective set (CapEff bits 7
/// and 6): what the agent's unit gives it to run jobs as worker_user.
pub fn can_switch_users() -> bool {
    has_caps(1 << 6 | 1 << 7)
}

/// With `need_caps` false (`--check`, run by hand without the unit's capabilities) the switch
/// is not required: the check says what it found instead.
fn resolve_worker_user(name: &str, need_caps: bool) -> anyhow::Result<(String, u32, u32)> {
    let u = nix::unistd::User::from_name(name)
        .map_err(|e| anyhow::anyhow!("invalid worker_user {name:?}: cannot look it up: {e}"))?
        .ok_or_else(|| anyhow::anyhow!("invalid worker_user {name:?}: no such user"))?;
    let (uid, gid) = (u.uid.as_raw(), u.gid.as_raw());
    if uid == 0 {
        anyhow::bail!("invalid worker_user {name:?}: it is root; name an unprivileged user");
    }
    let current = nix::unistd::geteuid().as_raw();
    if need_caps && current != uid && !can_switch_users() {
        anyhow::bail!(
            "invalid worker_user {name:?}: this agent (uid {current}) cannot switch to it: run it as root, or with CAP_SETUID and CAP_SETGID"
        );
    }
    Ok((name.to_string(), uid, gid))
}

/// The mesh TLS files parse: certificates in the CA and certificate files, a key in the key
/// file (the workers build their TLS configuration from them).
fn check_mesh_tls(
    ca: &std::path::Path,
    cert: &std::path::Path,
    key: &std::path::Path,
) -> anyhow::Result<()> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    for (what, p) in [("mesh_tls_ca", ca), ("mesh_tls_cert", cert)] {
        let n = CertificateDer::pem_file_iter(p)
            .map_err(|e| anyhow::anyhow!("invalid {what} {}: {e}", p.display()))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("invalid {what} {}: {e}", p.display()))?
            .len();
        if n == 0 {
            anyhow::bail!("invalid {what} {}: no certificate in it", p.display());
        }
    }
    PrivateKeyDer::from_pem_file(key)
        .map_err(|e| anyhow::anyhow!("invalid mesh_tls_key {}: {e}", key.display()))?;
    Ok(())
}

/// This host's first non-loopback IPv4 address, from its hostname; else 127.0.0.1.
fn default_advertise_host(hostname: &str) -> String {
    use std::net::ToSocketAddrs;
    (hostname, 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.find(|s| s.is_ipv4() && !s.ip().is_loopback()))
        .map(|s| s.ip().to_string())
        .unwrap_or_else(|| "127.0.0.1".into())
}

impl Config {
    pub fn load(cli: Cli) -> anyhow::Result<Config> {
        let checking = cli.check;
        let (file, etcd_file): (FileConfig, _) =
            ductile_cluster::service::read_service_config(cli.config.as_deref())
                .map_err(|e| anyhow::anyhow!(e))?;
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap_or_else(|_| "node".into())
            .trim()
            .to_string();
        let gpus = cli.gpus.or(file.gpus).unwrap_or_else(|| "auto".into());
        // flags over the file, as a pair: a flag of either kind replaces the file's choice
        let (notice, notice_url) = if cli.spot_notice.is_some() || cli.spot_notice_url.is_some() {
            (cli.spot_notice, cli.spot_notice_url)
        } else {
            (file.spot_notice, file.spot_notice_url)
        };
        let source = match (notice, notice_url) {
            (Some(_), Some(_)) => {
                anyhow::bail!("invalid spot_notice/spot_notice_url: give one of them, not both")
            }
            (Some(s), None) => Source::parse(&s)?,
            (None, Some(u)) => match u.trim() {
                "" | "off" | "auto" | "aws" | "gcp" | "azure" => Source::parse(&u)?,
                url => Source::Url(url.to_string()),
            },
            (None, None) => Source::Off,
        };
        let spot = SpotConfig {
            source,
            endpoint: cli
                .spot_metadata_endpoint
                .or(file.spot_metadata_endpoint)
                .unwrap_or_else(|| crate::preempt::DEFAULT_ENDPOINT.into()),
            poll: Duration::from_millis(cli.spot_poll_ms.or(file.spot_poll_ms).unwrap_or(2000)),
            advisories_drain: match cli
                .spot_rebalance
                .or(file.spot_rebalance)
                .as_deref()
                .unwrap_or("notify")
            {
                "notify" => false,
                "drain" => true,
                other => anyhow::bail!("invalid spot_rebalance: {other:?} is not notify or drain"),
            },
        };
        let libtorch = match (
            cli.libtorch.or(file.libtorch),
            cli.torch_python.or(file.torch_python),
        ) {
            (Some(_), Some(_)) => {
                anyhow::bail!("invalid libtorch/torch_python: give one of them, not both")
            }
            (Some(d), None) => Some(crate::libtorch::from_dir(&d)?),
            (None, Some(py)) => Some(crate::libtorch::from_python(&py)?),
            (None, None) => None,
        };
        let etcd =
            EtcdAccess::from_args(cli.etcd_access, etcd_file).map_err(|e| anyhow::anyhow!(e))?;
        let etcd_worker_client = match (
            cli.etcd_worker_cert.or(file.etcd_worker_cert),
            cli.etcd_worker_key.or(file.etcd_worker_key),
        ) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => anyhow::bail!("invalid etcd_worker_cert/etcd_worker_key: give both or neither"),
        };
        let mesh_tls = match (
            cli.mesh_tls_ca.or(file.mesh_tls_ca),
            cli.mesh_tls_cert.or(file.mesh_tls_cert),
            cli.mesh_tls_key.or(file.mesh_tls_key),
        ) {
            (Some(a), Some(c), Some(k)) => {
                // fail at start, naming the file, rather than in every mesh_tls job's worker
                check_mesh_tls(&a, &c, &k)?;
                Some([a, c, k])
            }
            (None, None, None) => None,
            _ => anyhow::bail!(
                "invalid mesh_tls_ca/mesh_tls_cert/mesh_tls_key: give all three or none"
            ),
        };
        let worker_user = match cli.worker_user.or(file.worker_user) {
            Some(name) => Some(resolve_worker_user(&name, !checking)?),
            None => None,
        };
        let job_users = match cli.job_users.or(file.job_users) {
            Some(range) => {
                if worker_user.is_some() {
                    anyhow::bail!("invalid job_users: give job_users (a user per job) or worker_user (one user for every job), not both");
                }
                let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
                let r = JobUsers::parse(&range, &passwd)?;
                // CAP_CHOWN (bit 0): each job's working directory is made its user's
                if !checking && !nix::unistd::geteuid().is_root() && !has_caps(1 | 1 << 6 | 1 << 7)
                {
                    anyhow::bail!(
                        "invalid job_users {range:?}: this agent (uid {}) cannot run jobs as users of their own: run it as root, or with CAP_SETUID, CAP_SETGID and CAP_CHOWN (the shipped unit gives them)",
                        nix::unistd::geteuid()
                    );
                }
                Some(r)
            }
            None => None,
        };
        let job_group = match cli.job_group.or(file.job_group) {
            Some(name) => {
                if job_users.is_none() {
                    anyhow::bail!("invalid job_group {name:?}: it applies with job_users only");
                }
                let g = nix::unistd::Group::from_name(&name)
                    .map_err(|e| {
                        anyhow::anyhow!("invalid job_group {name:?}: cannot look it up: {e}")
                    })?
                    .ok_or_else(|| anyhow::anyhow!("invalid job_group {name:?}: no such group"))?;
                if g.gid.as_raw() == 0 {
                    anyhow::bail!("invalid job_group {name:?}: it is root's group");
                }
                Some(g.gid.as_raw())
            }
            None => None,
        };
        let worker_credentials = WorkerCredentials::parse(
            cli.worker_credentials
                .or(file.worker_credentials)
                .as_deref()
                .unwrap_or("job"),
        )?;
        let cfg = Config {
            etcd,
            etcd_worker_client,
            mesh_tls: mesh_tls.clone(),
            worker_user,
            job_users,
            job_group,
            worker_credentials,
            node: cli.node.or(file.node).unwrap_or_else(|| hostname.clone()),
            cpu_slots: cli.cpu_slots.or(file.cpu_slots).unwrap_or(1),
            lease_ttl: cli.lease_ttl.or(file.lease_ttl).unwrap_or(5),
            prefix: cli
                .prefix
                .or(file.prefix)
                .unwrap_or_else(|| ductile_cluster::keys::DEFAULT_PREFIX.into()),
            gpus: Gpus::parse(&gpus)?,
            gpu_slots_per_device: cli
                .gpu_slots_per_device
                .or(file.gpu_slots_per_device)
                .unwrap_or(1),
            spot,
            libtorch,
            drain_timeout: Duration::from_secs(
                cli.drain_timeout.or(file.drain_timeout).unwrap_or(30),
            ),
            restart_backoff: Duration::from_millis(
                cli.restart_backoff_ms
                    .or(file.restart_backoff_ms)
                    .unwrap_or(2000),
            ),
            stop_grace: Duration::from_millis(
                cli.stop_grace_ms.or(file.stop_grace_ms).unwrap_or(5000),
            ),
            log_format: cli
                .log_format
                .or(file.log_format)
                .unwrap_or(LogFormat::Plain),
            etcd_wait: Duration::from_secs(cli.etcd_wait.or(file.etcd_wait).unwrap_or(30)),
            advertise_host: cli
                .advertise_host
                .or(file.advertise_host)
                .unwrap_or_else(|| default_advertise_host(&hostname)),
            policy: {
                let d = AgentPolicy::default();
                AgentPolicy {
                    allowed_commands: cli
                        .allowed_commands
                        .or(file.allowed_commands)
                        .unwrap_or(d.allowed_commands),
                    allowed_paths: cli
                        .allowed_paths
                        .or(file.allowed_paths)
                        .unwrap_or(d.allowed_paths),
                    allowed_s3_prefixes: cli
                        .allowed_s3_prefixes
                        .or(file.allowed_s3_prefixes)
                        .unwrap_or(d.allowed_s3_prefixes),
                    mesh_tls: mesh_tls.is_some(),
                    allowed_modules: cli
                        .allowed_modules
                        .or(file.allowed_modules)
                        .unwrap_or(d.allowed_modules),
                    allowed_code_paths: cli
                        .allowed_code_paths
                        .or(file.allowed_code_paths)
                        .unwrap_or(d.allowed_code_paths),
                    max_grace_s: cli
                        .max_grace_s
                        .or(file.max_grace_s)
                        .unwrap_or(d.max_grace_s),
                    allowed_env: cli
                        .allowed_env
                        .or(file.allowed_env)
                        .unwrap_or(d.allowed_env),
                    direct_commands: cli
                        .direct_commands
                        .or(file.direct_commands)
                        .unwrap_or(d.direct_commands),
                    allowed_runtimes: {
                        let r = cli
                            .allowed_runtimes
                            .or(file.allowed_runtimes)
                            .unwrap_or(d.allowed_runtimes);
                        for x in &r {
                            x.parse::<ductile_cluster::modes::Runtime>().map_err(|_| {
                                anyhow::anyhow!("invalid allowed_runtimes: {x:?} is not ductile, torchrun, torchft, tf or horovod")
                            })?;
                        }
                        r
                    },
                }
            },
            job_credentials_dir: cli.job_credentials_dir.or(file.job_credentials_dir),
            torchft_ca: cli.torchft_ca.or(file.torchft_ca),
            cgroup: ductile_runtime::cgroup::CgroupMode::parse(
                cli.cgroup.or(file.cgroup).as_deref().unwrap_or("auto"),
            )
            .map_err(|e| anyhow::anyhow!(e))?,
            work_root: cli
                .work_root
                .or(file.work_root)
                .unwrap_or_else(|| "/var/lib/ductile/work".into()),
            log_dir: cli
                .log_dir
                .or(file.log_dir)
                .unwrap_or_else(|| "/var/lib/ductile/logs".into()),
            log_max_bytes: cli
                .log_max_mib
                .or(file.log_max_mib)
                .unwrap_or(16)
                .clamp(1, 4096)
                << 20,
            log_keep: Duration::from_secs(
                cli.log_keep_hours
                    .or(file.log_keep_hours)
                    .unwrap_or(168)
                    .max(1)
                    * 3600,
            ),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        ductile_cluster::keys::validate_name("node", &self.node)?;
        if self.lease_ttl < 1 {
            anyhow::bail!(
                "invalid lease_ttl: {} must be at least 1 second",
                self.lease_ttl
            );
        }
        if self.cpu_slots == 0 || self.cpu_slots > 1024 {
            anyhow::bail!("invalid cpu_slots: {} must be in 1..=1024", self.cpu_slots);
        }
        if self.gpu_slots_per_device == 0 || self.gpu_slots_per_device > 64 {
            anyhow::bail!(
                "invalid gpu_slots_per_device: {} must be in 1..=64",
                self.gpu_slots_per_device
            );
        }
        if self.spot.poll < Duration::from_millis(50) {
            anyhow::bail!("invalid spot_poll_ms: must be at least 50");
        }
        if let Source::Url(u) = &self.spot.source {
            if !u.starts_with("http://") && !u.starts_with("https://") {
                anyhow::bail!("invalid spot_notice_url: {u:?} is not an http(s) URL, nor auto, aws, gcp, azure or off");
            }
        }
        let e = &self.spot.endpoint;
        if !e.starts_with("http://") && !e.starts_with("https://") {
            anyhow::bail!("invalid spot_metadata_endpoint: {e:?} is not an http(s) URL");
        }
        Ok(())
    }
}

//! Typed records stored as JSON under the key layout of [`crate::keys`]. No I/O here.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::keys::validate_name;
pub use crate::modes::{
    ActivationCheckpointing, CommChoice, Init, ModelKind, OptimizerKind, Precision, Quantize,
    Runtime, Schedule, Sharding, Strategy, SyncMode,
};
pub use crate::recipe::{LrSchedule, OptimizerSpec};
use crate::{ClusterError, Result};

/// `bytes` from the system's CSPRNG, as hex.
pub fn random_hex(bytes: usize) -> String {
    use ring::rand::SecureRandom;
    let mut b = vec![0u8; bytes];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .expect("the system's random source");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Milliseconds since the Unix epoch, the time unit of every record.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `YYYY-MM-DD HH:MM:SS` (UTC) of milliseconds since the epoch.
pub fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // civil-from-days (Howard Hinnant)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    Gpu,
    Cpu,
}

/// One schedulable device of a node: a GPU, or a CPU slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    pub kind: DeviceKind,
    pub index: u32,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
}

/// A live node, written by its agent under the agent's lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub name: String,
    pub hostname: String,
    pub devices: Vec<Device>,
    pub agent_pid: u32,
    pub registered_at_ms: u64,
    /// The agent is leaving (SIGTERM, spot notice, `dctl drain`): schedule nothing new on it.
    #[serde(default)]
    pub draining: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_reason: Option<String>,
    /// When a leaving agent stops its workers whether or not the job re-formed (unix ms, on the
    /// agent's clock: shown to operators, never compared with another host's clock). None for a
    /// cordon (`dctl drain`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_deadline_ms: Option<u64>,
    /// How long a leaving agent gives its workers from the moment it published the drain (a
    /// duration): the leader times it on its own clock from when it saw the drain, and that is
    /// the deadline the drain-time checkpoint must beat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_timeout_ms: Option<u64>,
    /// How many times this agent had to register again after losing its lease.
    #[serde(default)]
    pub reregistrations: u32,
    /// What this agent agrees to run (None: an agent from before policies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<AgentPolicy>,
    /// How the agent contains its programs' processes: `cgroup DIR` (each program in a cgroup
    /// of its own under DIR, killed whole) or `subreaper` (the descendants' sweep).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub containment: Option<String>,
    /// Slots no program may start on, and why: a previous program's processes did not die
    /// (stuck in the kernel). The planner leaves them out until the agent clears them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub busy_slots: BTreeMap<u32, String>,
    /// The last preemption notice the node's cloud sent (a spot interruption, a maintenance
    /// event, a rebalance recommendation), with its deadline where the cloud gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preemption: Option<PreemptionNotice>,
    /// Running jobs that the agent's current policy (re-read on SIGHUP) would refuse, and why:
    /// they keep running (a policy change drains nothing); new spawns of them are refused.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub refused_running: BTreeMap<String, String>,
}

/// A notice from the node's cloud that the instance goes away or may soon (`spot_notice`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreemptionNotice {
    /// `aws`, `gcp`, `azure`, or `url` (a plain URL that answers 200 with a notice).
    pub cloud: String,
    /// What the cloud said, in its own words (`spot instance-action terminate`,
    /// `rebalance recommendation`, `preempted`, `maintenance-event TERMINATE_ON_HOST_MAINTENANCE`,
    /// `Preempt`).
    pub what: String,
    /// When the instance goes (unix ms on the agent's clock), where the cloud said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// When the agent read the notice (unix ms).
    pub received_ms: u64,
    /// Whether the node drains for it (an interruption), or only records it (an advisory such
    /// as EC2's rebalance recommendation or a live migration).
    pub drains: bool,
}

impl PreemptionNotice {
    /// One line for logs, `dctl nodes` and the dashboard.
    pub fn describe(&self) -> String {
        let deadline = match self.deadline_ms {
            Some(d) => format!(", deadline {} UTC", utc(d)),
            None => String::new(),
        };
        format!(
            "{} notice from {}: {}{deadline}",
            if self.drains {
                "preemption"
            } else {
                "advisory"
            },
            self.cloud,
            self.what
        )
    }
}

/// What an agent agrees to run: the worker programs (`allowed_commands`, matched against the
/// job's `command[0]`; `"*"` allows any) and the roots under which a job's `file://` dataset and
/// checkpoint may be (`allowed_paths`; `"/"` allows any). While commands are restricted, a job's
/// `env` may not set the dynamic loader's variables (`LD_*`), which would run other code inside
/// an allowed program.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentPolicy {
    pub allowed_commands: Vec<String>,
    pub allowed_paths: Vec<String>,
    /// Prefixes (`s3://bucket/prefix`) under which a job's s3:// URLs may be, in its dataset,
    /// checkpoint and arguments; `*` for any (the default, for records of older agents too).
    #[serde(default = "AgentPolicy::any_s3")]
    pub allowed_s3_prefixes: Vec<String>,
    /// The agent has a mesh TLS certificate (`mesh_tls_*`): it can run `mesh_tls` jobs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mesh_tls: bool,
    /// Python modules a job's interpreter may run with `-m` while commands are restricted
    /// (`torch.distributed.run`, `pkg.*` for a package and what is under it, `*` for any);
    /// empty (the default): none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_modules: Vec<String>,
    /// Roots a job's script and `program.workdir` must really lie under (after symlinks are
    /// resolved, at spawn) while commands are restricted; empty (the default): `allowed_paths`.
    /// Set it where jobs may write under `allowed_paths`, so that what a job wrote never runs
    /// as another job's code.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_code_paths: Vec<String>,
    /// The longest `program.grace_s` this agent gives a fenced program (it keeps its slot, and
    /// its GPU, that long).
    #[serde(default = "AgentPolicy::default_max_grace_s")]
    pub max_grace_s: u64,
    /// More names a job's `env` may set while commands are restricted, beyond
    /// [`JOB_ENV_ALLOWED`] and [`JOB_ENV_PATHS`]: names, or `PREFIX*` (the operator's
    /// `allowed_env`); `DUCTILE_*` stays reserved whatever it says.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_env: Vec<String>,
    /// Programs besides `ductile-worker` that a job of the default runtime may start directly
    /// (with the built environment of every job's process, no launcher), for an operator's
    /// smoke tests (`sleep`, `nvidia-smi`); empty (the default): `ductile-worker` only. They
    /// must also be in `allowed_commands`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub direct_commands: Vec<String>,
    /// The runtimes this agent runs (`ductile`, `torchrun`, `torchft`, `tf`, `horovod`); empty
    /// (the default, and an older agent's record): every one. An operator leaves out `tf`
    /// where TensorFlow's unauthenticated gRPC servers, which listen on every interface, are
    /// not acceptable.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_runtimes: Vec<String>,
}

impl Default for AgentPolicy {
    fn default() -> Self {
        AgentPolicy {
            allowed_commands: vec!["ductile-worker".into()],
            allowed_paths: vec!["/var/lib/ductile".into()],
            allowed_s3_prefixes: AgentPolicy::any_s3(),
            mesh_tls: false,
            allowed_modules: Vec::new(),
            allowed_code_paths: Vec::new(),
            max_grace_s: AgentPolicy::default_max_grace_s(),
            allowed_env: Vec::new(),
            direct_commands: Vec::new(),
            allowed_runtimes: Vec::new(),
        }
    }
}

/// The most ranks one job may have (its `max`): every search over world sizes (the planner's,
/// the API's `plan?world=`) is bounded by it.
pub const MAX_WORLD: u32 = 65_536;

/// The environment names a job's `env` may set on an agent whose `allowed_commands` is
/// restricted: logging, thread counts, locale, and CUDA, torch and NCCL tuning that loads no
/// other code and writes no file. Every other name is refused there (the dynamic loader's
/// `LD_*`, `CUDA_INJECTION64_PATH`, NCCL's `*_PLUGIN` and `NCCL_DEBUG_FILE`, credentials and
/// endpoints such as `AWS_*`, `PATH`, `PYTHONPATH` among them). `DUCTILE_SLOWDOWN` and
/// `DUCTILE_FAULT_*` are allowed in a job with `allow_fault_injection`.
pub const JOB_ENV_ALLOWED: &[&str] = &[
    "RUST_LOG",
    "RUST_BACKTRACE",
    "RUST_LIB_BACKTRACE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "TZ",
    "LANG",
    "LC_ALL",
    "CUBLAS_WORKSPACE_CONFIG",
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
    "NCCL_SOCKET_IFNAME",
    "NCCL_SOCKET_FAMILY",
    "NCCL_SOCKET_NTHREADS",
    "NCCL_NSOCKS_PERTHREAD",
    "NCCL_IB_DISABLE",
    "NCCL_IB_HCA",
    "NCCL_IB_GID_INDEX",
    "NCCL_IB_TIMEOUT",
    "NCCL_IB_RETRY_CNT",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE",
    "NCCL_CUMEM_ENABLE",
    "NCCL_CROSS_NIC",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_BUFFSIZE",
    "NCCL_NTHREADS",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "DUCTILE_COMM_BIND",
    // TorchFT's own tuning: retries and timeouts of its Manager's calls
    "TORCHFT_QUORUM_RETRIES",
    "TORCHFT_TIMEOUT_SEC",
    "TORCHFT_QUORUM_TIMEOUT_SEC",
    "TORCHFT_CONNECT_TIMEOUT_SEC",
    // Python's own switches that load nothing: unbuffered output (lines arrive as printed),
    // encodings, hash seed, fault handler, no .pyc writes
    "PYTHONUNBUFFERED",
    "PYTHONIOENCODING",
    "PYTHONUTF8",
    "PYTHONHASHSEED",
    "PYTHONFAULTHANDLER",
    "PYTHONDONTWRITEBYTECODE",
    // Hugging Face: offline switches, telemetry, progress bars, verbosity, timeouts
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HUB_DISABLE_TELEMETRY",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "HF_HUB_DISABLE_SYMLINKS_WARNING",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN",
    "HF_HUB_ETAG_TIMEOUT",
    "HF_HUB_DOWNLOAD_TIMEOUT",
    "HF_HUB_VERBOSITY",
    "HF_DATASETS_DISABLE_PROGRESS_BARS",
    "TRANSFORMERS_VERBOSITY",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS",
    "DATASETS_VERBOSITY",
    "TOKENIZERS_PARALLELISM",
    // torch.distributed's and TensorFlow's diagnostics, gloo's interface
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_CPP_LOG_LEVEL",
    "TORCH_SHOW_CPP_STACKTRACES",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "GLOO_SOCKET_IFNAME",
    "TF_CPP_MIN_LOG_LEVEL",
    "TF_ENABLE_ONEDNN_OPTS",
    // which Keras `tf.keras` is (Keras 2, `tf_keras`: what MultiWorkerMirroredStrategy's
    // model.fit needs), loading nothing else
    "TF_USE_LEGACY_KERAS",
    // experiment trackers off
    "WANDB_DISABLED",
    "WANDB_MODE",
];

/// Names a job's `env` may set to a directory while commands are restricted, when the value
/// lies under the agent's `allowed_paths` (caches of downloaded files and scratch space; not
/// `HF_HOME`, whose `modules/` holds code that `trust_remote_code` imports).
pub const JOB_ENV_PATHS: &[&str] = &[
    "HF_HUB_CACHE",
    "HF_DATASETS_CACHE",
    "TRANSFORMERS_CACHE",
    "TMPDIR",
];

/// Whether `name` matches one of an operator's `allowed_env` entries (`NAME` or `PREFIX*`).
fn env_listed(list: &[String], name: &str) -> bool {
    list.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => p == name,
    })
}

/// Environment names that make a process load code or libraries of the setter's choosing:
/// never settable by a job, whatever the agent's `allowed_env` says (exact names).
pub const JOB_ENV_NEVER: &[&str] = &[
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONUSERBASE",
    "PYTHONBREAKPOINT",
    "PYTHONWARNINGS",
    "PYTHONPLATLIBDIR",
    "PYTHONEXECUTABLE",
    "PYTHONSAFEPATH",
    "PYTHONNOUSERSITE",
    "PYTHONINSPECT",
    "BASH_ENV",
    "ENV",
    "PERL5LIB",
    "PERL5OPT",
    "RUBYLIB",
    "RUBYOPT",
    "NODE_OPTIONS",
    "NODE_PATH",
    "GCONV_PATH",
    "OPENSSL_CONF",
    "OPENSSL_ENGINES",
    "OPENSSL_MODULES",
    "CUDA_INJECTION64_PATH",
    "NCCL_NET",
    "TRITON_LIBCUDA_PATH",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "PATH",
    "HOME",
];

/// Whether a job may never set `name` (see [`JOB_ENV_NEVER`]): also the dynamic loader's
/// `LD_*` (and macOS's `DYLD_*`), any `*PLUGIN*` (NCCL's net, tuner and profiler plugins load
/// a library), and any `*_LIBRARY_PATH`.
pub fn env_never_allowed(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    JOB_ENV_NEVER.contains(&upper.as_str())
        || upper.starts_with("LD_")
        || upper.starts_with("DYLD_")
        || upper.contains("PLUGIN")
        || upper.ends_with("_LIBRARY_PATH")
}

/// Whether `program` (a job's command[0]) is ductile's worker.
fn is_worker(program: &str) -> bool {
    std::path::Path::new(program)
        .file_name()
        .is_some_and(|n| n == "ductile-worker")
}

/// The URLs and paths an argument names: the argument itself and, for `--flag=value`, its value.
fn named_locations(arg: &str) -> Vec<&str> {
    let mut out = vec![arg];
    if let Some((_, v)) = arg.split_once('=') {
        out.push(v);
    }
    out.into_iter()
        .filter(|a| a.starts_with('/') || a.contains("://"))
        .collect()
}

impl AgentPolicy {
    fn any_s3() -> Vec<String> {
        vec!["*".into()]
    }
    pub fn default_max_grace_s() -> u64 {
        120
    }

    /// Where a job's code may lie: `allowed_code_paths`, else `allowed_paths`.
    pub fn code_roots(&self) -> &[String] {
        if self.allowed_code_paths.is_empty() {
            &self.allowed_paths
        } else {
            &self.allowed_code_paths
        }
    }

    /// At spawn, on this node: the real paths (symlinks resolved) of a program job's
    /// `program.workdir` and script lie under the code roots (`allowed_code_paths`, else
    /// `allowed_paths`); a check of the text alone lets a symlink under an allowed root point
    /// anywhere. Nothing is checked while commands are unrestricted.
    pub fn check_real_paths(&self, spec: &JobSpec) -> Result<(), (String, String)> {
        if !spec.runtime.runs_program() || self.allowed_commands.iter().any(|c| c == "*") {
            return Ok(());
        }
        let roots = self.code_roots();
        let under =
            |field: &str, p: &std::path::Path| -> Result<std::path::PathBuf, (String, String)> {
                let real = std::fs::canonicalize(p).map_err(|e| {
                    (
                        field.to_string(),
                        format!("{}: cannot be resolved on this node: {e}", p.display()),
                    )
                })?;
                let root_real = |r: &String| std::fs::canonicalize(r).unwrap_or_else(|_| r.into());
                if roots
                    .iter()
                    .any(|r| r == "/" || real.starts_with(root_real(r)))
                {
                    Ok(real)
                } else {
                    Err((
                        field.to_string(),
                        format!(
                            "{} resolves to {}, outside the agent's {} {roots:?}",
                            p.display(),
                            real.display(),
                            if self.allowed_code_paths.is_empty() {
                                "allowed_paths"
                            } else {
                                "allowed_code_paths"
                            }
                        ),
                    ))
                }
            };
        let workdir = spec.torchrun.as_ref().and_then(|t| t.workdir.clone());
        let wd = match &workdir {
            Some(w) => Some(under(
                "program.workdir",
                std::path::Path::new(w.trim_start_matches("file://")),
            )?),
            None => None,
        };
        let Some(script) = python_script(&spec.command) else {
            return Ok(());
        };
        let i = python_script_index(&spec.command).unwrap_or(1);
        let p = std::path::Path::new(script);
        let full = match (&wd, p.is_absolute()) {
            (_, true) => p.to_path_buf(),
            (Some(w), false) => w.join(p),
            (None, false) => p.to_path_buf(),
        };
        under(&format!("command[{i}]"), &full).map(|_| ())
    }

    /// Whether `url` (file://, s3://, or a plain absolute path) lies under the allow-lists.
    fn check_location(&self, field: &str, url: &str) -> Result<(), (String, String)> {
        let deny = |why: String| Err((field.to_string(), why));
        if let Some(rest) = url.strip_prefix("s3://") {
            let within = |prefix: &str| {
                prefix == "*"
                    || prefix.strip_prefix("s3://").is_some_and(|p| {
                        let p = p.trim_end_matches('/');
                        rest == p || rest.starts_with(&format!("{p}/"))
                    })
            };
            if rest.split('/').any(|c| c == ".." || c == ".") {
                return deny(format!(
                    "{url}: an s3:// key must not hold . or .. components"
                ));
            }
            if !self.allowed_s3_prefixes.iter().any(|p| within(p)) {
                return deny(format!(
                    "{url} is outside the agent's allowed_s3_prefixes {:?}",
                    self.allowed_s3_prefixes
                ));
            }
            return Ok(());
        }
        let path = match url.strip_prefix("file://") {
            Some(p) => p,
            None if url.starts_with('/') => url,
            None => {
                return deny(format!(
                    "{url}: only file:// and s3:// locations (or absolute paths) may be named"
                ))
            }
        };
        let p = std::path::Path::new(path);
        let plain = p.is_absolute()
            && p.components().all(|c| {
                !matches!(
                    c,
                    std::path::Component::ParentDir | std::path::Component::CurDir
                )
            });
        if !plain {
            return deny(format!(
                "{url}: a file:// path must be absolute, without . or .."
            ));
        }
        if !self.allowed_paths.iter().any(|root| p.starts_with(root)) {
            return deny(format!(
                "{url} is outside the agent's allowed_paths {:?}",
                self.allowed_paths
            ));
        }
        Ok(())
    }

    /// A torchrun job's program under restricted commands: a Python interpreter runs a script
    /// file under `allowed_paths` (absolute, or relative to a checked `program.workdir`), or an
    /// installed module (`-m`); inline code (`-c`) would run anything. The working directory is
    /// checked too.
    fn check_program(&self, spec: &JobSpec) -> Result<(), (String, String)> {
        let workdir = spec.torchrun.as_ref().and_then(|t| t.workdir.clone());
        if let Some(w) = &workdir {
            self.check_location("program.workdir", w)?;
        }
        if !is_python(&spec.command[0]) {
            return Ok(());
        }
        use crate::pycmd::PyMain;
        let parsed = crate::pycmd::parse(&spec.command[1..])
            .map_err(|(i, why)| (format!("command[{i}]"), why))?;
        for (i, opt, value) in &parsed.options {
            // a warnings filter's category is imported: -W action::pkg.Category runs pkg
            if *opt == 'W'
                && value
                    .as_deref()
                    .is_some_and(|v| v.split(':').nth(2).is_some_and(|c| c.contains('.')))
            {
                return Err((
                    format!("command[{i}]"),
                    "a -W filter whose category names a module imports that module; only built-in categories may be named".into(),
                ));
            }
        }
        let script = match &parsed.main {
            PyMain::Inline(i) => {
                return Err((
                    format!("command[{i}]"),
                    "inline Python (-c) runs code no allow-list sees; name a script under allowed_paths"
                        .into(),
                ))
            }
            PyMain::Stdin(i) => {
                return Err((
                    format!("command[{}]", (*i).max(1)),
                    "the interpreter would read its program from standard input; name a script under allowed_paths".into(),
                ))
            }
            PyMain::Module(i, m) => {
                if crate::pycmd::module_allowed(&self.allowed_modules, m) {
                    return Ok(());
                }
                return Err((
                    format!("command[{i}]"),
                    format!(
                        "module {m:?} (-m) is not in the agent's allowed_modules {:?}",
                        self.allowed_modules
                    ),
                ));
            }
            PyMain::Script(i, s) => (*i, s.as_str()),
        };
        {
            let (i, script) = script;
            let field = format!("command[{i}]");
            if script.starts_with('/') {
                return self.check_location(&field, script);
            }
            match &workdir {
                Some(_) => {
                    let p = std::path::Path::new(script);
                    if p.components().any(|c| {
                        matches!(c, std::path::Component::ParentDir | std::path::Component::RootDir)
                    }) {
                        return Err((field, format!("{script:?} must stay inside program.workdir")));
                    }
                }
                None => {
                    return Err((
                        field,
                        format!("{script:?} is a relative path: set program.workdir (checked against allowed_paths) or name the script by its absolute path"),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Whether a job may run under this policy; the error names the spec's field and why.
    pub fn check(&self, spec: &JobSpec) -> Result<(), (String, String)> {
        let runtime = spec.runtime.as_str();
        if !self.allowed_runtimes.is_empty() && !self.allowed_runtimes.iter().any(|r| r == runtime)
        {
            return Err((
                "runtime".into(),
                format!(
                    "{runtime:?} is not in the agent's allowed_runtimes {:?}",
                    self.allowed_runtimes
                ),
            ));
        }
        let any_command = self.allowed_commands.iter().any(|c| c == "*");
        let program = spec.command.first().map(String::as_str).unwrap_or("");
        if !any_command && !self.allowed_commands.iter().any(|c| c == program) {
            return Err((
                "command".into(),
                format!(
                    "{program:?} is not in the agent's allowed_commands {:?}",
                    self.allowed_commands
                ),
            ));
        }
        if !any_command && spec.runtime.is_ductile() && !is_worker(program) {
            // a program of the job's own runs under a launcher (torchrun, torchft, tf,
            // horovod), which gives it a private HOME and its credentials by pipe; directly,
            // only what the operator listed for that
            let direct = |c: &String| c == program;
            if !self.direct_commands.iter().any(direct) {
                return Err((
                    "command".into(),
                    format!(
                        "the default runtime runs ductile-worker; {program:?} is not in the agent's direct_commands {:?} (a program of the job's own runs with runtime = \"torchrun\", \"torchft\", \"tf\" or \"horovod\")",
                        self.direct_commands
                    ),
                ));
            }
        }
        if !any_command {
            // the worker runs as a job's worker only: its other subcommands (synth-data) write
            // where they are told, past every allow-list
            let args = &spec.command[1..];
            if is_worker(program) && !(args.is_empty() || args == ["run"]) {
                return Err((
                    "command".into(),
                    format!(
                        "{program} runs as the job's worker only (no arguments, or \"run\"); {args:?} is refused"
                    ),
                ));
            }
            let injection = |k: &str| {
                spec.allow_fault_injection
                    && (k == "DUCTILE_SLOWDOWN" || k.starts_with("DUCTILE_FAULT_"))
            };
            for (k, v) in &spec.env {
                if env_never_allowed(k) && !injection(k) {
                    return Err((
                        format!("env.{k}"),
                        format!("{k} makes a process load code or a library of the setter's choosing: no job may set it, whatever the agent's allowed_env says"),
                    ));
                }
                if JOB_ENV_PATHS.contains(&k.as_str()) {
                    self.check_location(&format!("env.{k}"), v)?;
                    continue;
                }
                if JOB_ENV_ALLOWED.contains(&k.as_str())
                    || injection(k)
                    || (!k.starts_with("DUCTILE_") && env_listed(&self.allowed_env, k))
                {
                    continue;
                }
                let why = format!("{k} is not among the names a job may set while allowed_commands is restricted (docs/security.md: \"A job's environment\"; the operator may add names with the agent's allowed_env)");
                return Err((format!("env.{k}"), why));
            }
            for (i, arg) in args.iter().enumerate() {
                for loc in named_locations(arg) {
                    self.check_location(&format!("command[{}]", i + 1), loc)?;
                }
            }
            if spec.runtime.runs_program() {
                self.check_program(spec)?;
            }
        }
        if spec.runtime.runs_program() {
            let grace = spec.torchrun_settings().grace_s;
            if grace > self.max_grace_s {
                return Err((
                    "program.grace_s".into(),
                    format!(
                        "{grace} s is past the agent's max_grace_s ({} s): a fenced program keeps its slot that long",
                        self.max_grace_s
                    ),
                ));
            }
        }
        if spec.training.as_ref().is_some_and(|t| t.mesh_tls) && !self.mesh_tls {
            return Err((
                "training.mesh_tls".into(),
                "the agent has no mesh TLS certificate (mesh_tls_ca, mesh_tls_cert, mesh_tls_key)"
                    .into(),
            ));
        }
        let mut urls = Vec::new();
        if let Some(t) = &spec.training {
            urls.push(("training.dataset", t.dataset.as_str()));
            if let Some(e) = &t.eval_dataset {
                urls.push(("training.eval_dataset", e.as_str()));
            }
            if let Some(m) = &t.model_path {
                // the daemon reads config.json and tokenizer.json there at submit
                self.check_location("training.model_path", m)?;
            }
        }
        if let Some(c) = &spec.checkpoint {
            urls.push(("checkpoint.url", c.url.as_str()));
        }
        if let Some(t) = &spec.torchrun {
            if let Some(u) = &t.checkpoint_url {
                urls.push(("program.checkpoint_url", u.as_str()));
            }
        }
        for (field, url) in urls {
            if url.starts_with("file://") || url.starts_with("s3://") {
                self.check_location(field, url)?;
            }
        }
        Ok(())
    }
}

impl NodeRecord {
    /// A node as its agent registers it: not draining, registered now.
    pub fn new(name: &str, hostname: &str, devices: Vec<Device>, agent_pid: u32) -> NodeRecord {
        NodeRecord {
            name: name.to_string(),
            hostname: hostname.to_string(),
            devices,
            agent_pid,
            registered_at_ms: now_ms(),
            draining: false,
            drain_reason: None,
            drain_deadline_ms: None,
            drain_timeout_ms: None,
            reregistrations: 0,
            policy: None,
            containment: None,
            busy_slots: BTreeMap::new(),
            preemption: None,
            refused_running: BTreeMap::new(),
        }
    }
    pub fn slots(&self) -> u32 {
        self.devices.len() as u32
    }
}

/// An operator's request that a node drain (`dctl drain NODE`). Not leased: it stays until
/// the operator clears it (`dctl uncordon NODE`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainRequest {
    pub reason: String,
    pub requested_at_ms: u64,
}

fn default_command() -> Vec<String> {
    vec!["ductile-worker".to_string()]
}
fn default_restart_budget() -> u32 {
    10
}
fn default_fault_retries() -> u32 {
    3
}
fn default_stall_timeout_s() -> u64 {
    300
}

/// A job as submitted (TOML file, or JSON over the API). Unknown fields are refused.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// The job's name: letters, digits, `-`, `_` and `.`; what every `dctl` verb names it by.
    pub name: String,
    /// The worker program and its arguments; `ductile-worker` when omitted. With
    /// `runtime = "torchrun"`, the job's own program (`["python3", "train.py", ...]`).
    #[serde(default = "default_command")]
    pub command: Vec<String>,
    /// `ductile` (the built-in trainer, `[training]`) or a job's own program (`[program]`):
    /// `torchrun` (torchrun's worker contract: every generation stops the old world and
    /// starts the new one), `torchft` (replica groups that live through the others'
    /// failures), `tf` (TensorFlow's MultiWorkerMirroredStrategy) or `horovod`.
    #[serde(default, skip_serializing_if = "Runtime::is_ductile")]
    pub runtime: Runtime,
    /// The fewest slots the job runs on: below it, it waits (its state kept).
    pub min: u32,
    /// The most slots it grows to when agents have them free.
    pub max: u32,
    /// The size it is asked to run at (`dctl scale` changes it), between `min` and `max`.
    pub desired: u32,
    /// How many worker restarts the whole job may use before failed slots stay out.
    #[serde(default = "default_restart_budget")]
    pub restart_budget: u32,
    /// How many times in a row the leader re-forms the same members after a communicator
    /// failure that names no culprit, or a stall, without a step in between; then the job fails.
    #[serde(default = "default_fault_retries")]
    pub fault_retries: u32,
    /// A running job that completes no step for this long is re-formed (then failed, after
    /// `fault_retries`); 0 turns the check off. Only jobs that report progress (`[training]`).
    #[serde(
        default = "default_stall_timeout_s",
        deserialize_with = "crate::units::secs"
    )]
    #[schemars(schema_with = "crate::units::secs_schema")]
    pub stall_timeout_s: u64,
    /// Extra environment for the workers.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// The workers honour fault-injection variables in their environment (for tests and
    /// benches: `DUCTILE_FAULT_OVERSIZED_FRAME=RANK:STEP`); off, they ignore them and say so.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_fault_injection: bool,
    /// `[training]`: what the built-in trainer trains (`runtime = "ductile"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub training: Option<TrainingSpec>,
    /// `[checkpoint]`: where and how often the job's state is committed; a program job's
    /// `url` is handed to its program.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointSpec>,
    /// `[program]`: how the job's own program is run (`runtime = "torchrun"`, `"torchft"`,
    /// `"tf"` or `"horovod"`). The older name `[torchrun]` is still read.
    // On the wire and in etcd it keeps its older name, which every release reads: a dctl or
    // daemon of this release talks to one of the previous release through a rolling upgrade.
    #[serde(
        default,
        rename = "torchrun",
        alias = "program",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(rename = "program")]
    pub torchrun: Option<TorchrunSpec>,
    /// `runtime = "torchft"`: how its slots form TorchFT replica groups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torchft: Option<TorchftSpec>,
}

/// The `[torchft]` section of a `runtime = "torchft"` job.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TorchftSpec {
    /// Slots per replica group, cut from one node's slots in slot order (a group never spans
    /// nodes); 0 or left out: each node's slots of the job form one group. With N, a group
    /// runs only with all N of its slots, and `min`, `max` and `desired` are multiples of N.
    #[serde(default)]
    pub group_size: u32,
}

/// The `[program]` section of a job that runs its own program (`runtime = "torchrun"`,
/// `"torchft"`, `"tf"` or `"horovod"`); `[torchrun]` is its older name, still read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TorchrunSpec {
    /// When a generation replaces the workers: SIGTERM, this long, then SIGKILL.
    #[serde(
        default = "TorchrunSpec::default_grace_s",
        deserialize_with = "crate::units::secs"
    )]
    #[schemars(schema_with = "crate::units::secs_schema")]
    pub grace_s: u64,
    /// Handed to the program as `DUCTILE_CHECKPOINT_URL` (file:// or s3://; checked against
    /// the agents' allow-lists like any location a job names). Write it as `[checkpoint] url`,
    /// the one checkpoint key of every runtime; this older key is still read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_url: Option<String>,
    /// The program's working directory (absolute); the agent's own when left out. Where the
    /// agents restrict commands, a relative script path needs it (it is checked against
    /// `allowed_paths`, and the script is found there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// A Python program (`python3 script.py ...`, `python3 -m module ...`) starts in an
    /// interpreter that imported torch while the previous world trained (runpy runs the script
    /// in it as `python3` would): a generation's workers start in tenths of a second, not the
    /// seconds an import of torch takes. Off: every generation starts the command afresh.
    #[serde(default = "TorchrunSpec::default_warm_start")]
    pub warm_start: bool,
    /// A planned drain (`dctl drain`, an agent's SIGTERM, a spot notice) of a node the job runs
    /// on: `ductile.preempted()` turns true on every rank this long before the generation
    /// without the node replaces the workers (bounded by the node's drain timeout); 0: off.
    #[serde(
        default = "TorchrunSpec::default_drain_notice_s",
        deserialize_with = "crate::units::secs"
    )]
    #[schemars(schema_with = "crate::units::secs_schema")]
    pub drain_notice_s: u64,
    /// Integrations the launcher loads into the Python program before its script runs
    /// (`ductile.integrations`): `transformers` adds ductile's callback to
    /// every `Trainer` (progress reports, a save on notice of a change of the world) and
    /// resumes `trainer.train()` from the newest complete checkpoint of its `output_dir`;
    /// `keras` adds ductile's callback to every Keras `model.fit` (progress reports).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub integrations: Vec<String>,
}

/// The integrations a `[torchrun]` section may name.
pub const INTEGRATIONS: &[&str] = &["transformers", "keras"];

impl Default for TorchrunSpec {
    fn default() -> Self {
        TorchrunSpec {
            grace_s: Self::default_grace_s(),
            checkpoint_url: None,
            workdir: None,
            warm_start: Self::default_warm_start(),
            drain_notice_s: Self::default_drain_notice_s(),
            integrations: Vec::new(),
        }
    }
}

impl TorchrunSpec {
    fn default_grace_s() -> u64 {
        30
    }
    fn default_warm_start() -> bool {
        true
    }
    fn default_drain_notice_s() -> u64 {
        10
    }
}

/// The script a Python command runs (`python3 [-u] script.py ...` → `script.py`), if the
/// command is a Python interpreter running a file.
pub fn python_script(command: &[String]) -> Option<&str> {
    python_script_index(command).map(|i| command[i].as_str())
}

/// The index in `command` of the script a Python command runs (see [`crate::pycmd`]).
pub fn python_script_index(command: &[String]) -> Option<usize> {
    if !is_python(command.first()?) {
        return None;
    }
    match crate::pycmd::parse(&command[1..]).ok()?.main {
        crate::pycmd::PyMain::Script(i, _) => Some(i),
        _ => None,
    }
}

/// Whether `program` is a Python interpreter (`python`, `python3`, `python3.12`, a venv's).
pub fn is_python(program: &str) -> bool {
    std::path::Path::new(program)
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("python"))
        .is_some_and(|v| v.chars().all(|c| c.is_ascii_digit() || c == '.'))
}

/// The `[training]` section: what the worker trains. Validated here; used by the worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TrainingSpec {
    /// The parallel layout: `data-parallel`, `pipeline`, `hybrid` (stages and tensor
    /// groups) or `auto` (the planner's choice at every world size).
    #[serde(default)]
    pub strategy: Strategy,
    /// `gpt` or `mlp` (built in, `model_config`), or `hf`: a Hugging Face directory
    /// (`model_path`; Llama, Qwen2, Mistral, GPT-2).
    pub model: ModelKind,
    /// The built-in model's shape: GPT `d_model`, `n_layer`, `n_head`, `ctx`, `vocab`; MLP
    /// `hidden`, `layers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_config: Option<serde_json::Value>,
    /// `model = "hf"`: the Hugging Face-format directory (file:// or s3://) holding
    /// `config.json`, the safetensors weights (one file, or shards and their index) and
    /// `tokenizer.json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_path: Option<String>,
    /// `model = "hf"`: start from the directory's weights (`"pretrained"`, the default) or from
    /// seeded random weights of its architecture (`"random"`).
    #[serde(default, skip_serializing_if = "Init::is_pretrained")]
    pub init: Init,
    /// `model = "hf"`: the directory's `config.json`, as the daemon read it at submit (the
    /// workers build exactly the model the submit checked). Written by the daemon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(skip)]
    pub hf_config: Option<serde_json::Value>,
    /// file:// or s3://: one token stream, a prefix ending in `/` holding `index.json` and
    /// its shards, a bare u16 stream (read whole), or a safetensors regression set (`mlp`).
    pub dataset: String,
    /// A held-out token dataset (any form `dataset` takes) for the eval loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_dataset: Option<String>,
    /// Or: this fraction of the dataset's samples, cut from its end (by sample index, the
    /// index's last shards), held out of training for the eval loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_fraction: Option<f64>,
    /// Evaluate every N committed steps (synchronous jobs), on the job's current layout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_every: Option<u64>,
    /// The eval loss is the mean over the eval split's first M samples (default 256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_samples: Option<u64>,
    /// Samples per optimizer step, whatever the world size (the ranks split it).
    pub global_batch: u32,
    /// The job finishes after this many steps; left out, it trains until stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<u64>,
    /// The optimizer: a name (`"adamw"`, `"sgd"`) or a table with its name and settings
    /// (`[training.optimizer]`: AdamW `betas`, `eps`, `weight_decay`; SGD `momentum`,
    /// `nesterov`, `weight_decay`; `no_decay` name patterns).
    #[serde(default)]
    pub optimizer: OptimizerSpec,
    /// The peak learning rate.
    #[serde(default = "TrainingSpec::default_lr")]
    pub lr: f64,
    /// The learning-rate schedule (`[training.lr_schedule]`); default: a warm-up of at most
    /// 10 steps, then a cosine to a tenth of `lr` at `max_steps`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr_schedule: Option<LrSchedule>,
    /// Seeds the weights' initialisation and the data order.
    #[serde(default)]
    pub seed: u64,
    /// The same bits at every world size and layout: reductions in a fixed order over
    /// `logical_shards`.
    #[serde(default)]
    pub deterministic: bool,
    /// Samples per micro-batch (gradient accumulation); default: a rank's whole share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<u32>,
    /// Deterministic mode: the global batch is cut into this many logical shards (at least the
    /// job's max size); default: max.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logical_shards: Option<u32>,
    /// Data parallel: gradients are all-reduced in buckets of about this many MiB (whole
    /// parameters, in order), each copied into one reused buffer and back: no whole-model
    /// flat copy. Default 25 (PyTorch DDP's `bucket_cap_mb`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::units::opt_mib_u32"
    )]
    #[schemars(schema_with = "crate::units::size_schema")]
    pub bucket_mb: Option<u32>,
    /// Live state moves (a resize's re-cut, a joiner's share, a restore's point-to-point part)
    /// go in rounds of at most this many KiB per pair of ranks, so their buffers stay bounded
    /// however much state moves. Default 65536 (64 MiB).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::units::opt_kib_u32"
    )]
    #[schemars(schema_with = "crate::units::size_schema")]
    pub transfer_chunk_kib: Option<u32>,
    /// Clip the summed gradients to this global L2 norm before the optimizer step (PyTorch's
    /// `clip_grad_norm_`: scaled by max / (norm + 1e-6) when the norm is larger). The norm is
    /// taken over every parameter (every stage's, tensor slice's and shard's), in f64, in
    /// parameter order: in deterministic mode the same value at every world size and layout.
    /// All-reduce jobs (not DiLoCo or async).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_grad_norm: Option<f64>,
    /// Data parallel: how the ranks share the training state. `optimizer` (ZeRO-1): each
    /// rank holds the AdamW/SGD state of its rows of every parameter only (cut on dim 0 over its
    /// shard group), steps those rows and all-gathers the updated rows; re-cut live at every
    /// world size. Default `none`.
    #[serde(default, skip_serializing_if = "Sharding::is_none")]
    pub sharding: Sharding,
    /// With `sharding`: shard within groups of this many data-parallel ranks, or within each
    /// node (`"node"`), and replicate across the groups (HSDP: a rank's loss is made good by
    /// its replica). Default: every data-parallel rank in one group. At a world size it does
    /// not divide, the group is the largest divisor of the world below it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_group: Option<ShardGroup>,
    /// With `sharding = "full"`: whether a unit's gathered parameters are freed after its
    /// forward (`true`, the default: gathered again in the backward, where the unit is run
    /// again from its input) or kept whole until its backward is done (`false`: one gather
    /// per unit and step, no forward run twice, every unit's activations kept; the
    /// parameters whole during the step, as ZeRO-2). PyTorch FSDP2's `reshard_after_forward`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reshard_after_forward: Option<bool>,
    /// With `sharding = "full"`: every rank also keeps a copy of another rank's shard (its
    /// rows of the parameters and of their optimizer state) in host memory, on another node
    /// where the job has one, refreshed every step (its reduced gradient rows sent to the copy's
    /// keeper before the step is applied). The loss of any one rank, or node, then re-shards
    /// from the survivors at the step reached, without the checkpoint (which stays for losing
    /// a rank and its copy's keeper together). Costs a shard's worth of host memory per rank and
    /// a send of the gradient rows per step. Applies where each shard has one holder (every
    /// data-parallel rank in one shard group, no stages or tensor groups). Default `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buddy_copies: Option<bool>,
    /// Communicator backend: `auto` (NCCL when every member has a GPU of its own, else TCP),
    /// `nccl` or `tcp` (TCP stages CUDA tensors through pinned host memory).
    #[serde(default)]
    pub comm: CommChoice,
    /// The longest one communicator call waits for a peer that is alive but sends nothing (a
    /// slow step, rank 0 listing checkpoints), in seconds, on every backend (TCP and NCCL);
    /// default 300. A stopped or dead peer is found sooner, by the heartbeats.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::units::opt_secs"
    )]
    #[schemars(schema_with = "crate::units::secs_schema")]
    pub comm_timeout_s: Option<u64>,
    /// The workers' TCP mesh runs over TLS (certificates from the agents' `mesh_tls_*`),
    /// for fleets across networks that are not trusted; `comm` must then not be `nccl`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mesh_tls: bool,
    /// Pipeline stages: `"auto"` (the planner chooses per world size) or a number.
    #[serde(default)]
    pub pipeline_parallel: Degree,
    /// Tensor-parallel group size: 1 (default), a number, or `"auto"` (the planner chooses per
    /// world size); more than 1 needs `strategy = "hybrid"` or `"auto"`.
    #[serde(default = "TrainingSpec::one", skip_serializing_if = "Degree::is_one")]
    pub tensor_parallel: Degree,
    /// Deterministic mode with tensor parallelism: split layers are computed in this many
    /// logical slices, folded in slice order, whatever the group size (a multiple of every
    /// `tensor_parallel` the job runs; the GPT's heads divide by it). The same value in a
    /// data-parallel run gives the same bits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor_slices: Option<u32>,
    /// Micro-batches per step per data-parallel replica (at least the stages); default four
    /// per stage, at most the replica's samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline_micro_batches: Option<u32>,
    /// The pipeline schedule: `"1f1b"` (default) or `"gpipe"`.
    #[serde(default)]
    pub schedule: Schedule,
    /// `"none"` (default) or `"full"`: recompute each transformer block in the backward pass,
    /// keeping only its input (the planner counts the activations so kept and the extra
    /// forward).
    #[serde(default)]
    pub activation_checkpointing: ActivationCheckpointing,
    /// `"fp32"` (default) or `"bf16"`: matrix products in bfloat16, f32 master weights and
    /// optimizer state (`model = "hf"`).
    #[serde(default)]
    pub precision: Precision,
    /// Plan as if each slot had this much memory (GiB); default: no memory bound.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::units::opt_gib_f64"
    )]
    #[schemars(schema_with = "crate::units::size_schema")]
    pub memory_per_slot_gib: Option<f64>,
    /// How the replicas combine their work: `"allreduce"` (default: a synchronous all-reduce
    /// of the gradient every step), `"diloco"` (local steps, then an outer step on the averaged
    /// pseudo-gradient, `[training.diloco]`) or `"async"`.
    #[serde(default)]
    pub sync: SyncMode,
    #[serde(default)]
    pub diloco: DilocoSpec,
    #[serde(default, rename = "async")]
    pub async_: AsyncSpec,
}

/// `[training.diloco]`: DiLoCo's rounds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DilocoSpec {
    /// H: local optimizer steps per round (a replica with a full share takes H steps of its
    /// share of the global batch).
    pub inner_steps: u32,
    /// The outer learning rate.
    pub outer_lr: f64,
    /// Nesterov momentum on the averaged pseudo-gradient.
    pub outer_momentum: f64,
    /// More than 1: streaming DiLoCo, the parameters cut into this many fragments, one
    /// exchanged at a time, each at its own point of the round.
    pub fragments: u32,
    /// `"none"`, `"fp16"` or `"int8"` for the pseudo-gradient exchange.
    pub quantize: Quantize,
}

impl Default for DilocoSpec {
    fn default() -> Self {
        DilocoSpec {
            inner_steps: 50,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            fragments: 1,
            quantize: Quantize::None,
        }
    }
}

/// `[training.async]`: bounded-staleness asynchronous training.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct AsyncSpec {
    /// A worker never computes on parameters more than this many updates old.
    pub staleness: u32,
}

impl Default for AsyncSpec {
    fn default() -> Self {
        AsyncSpec { staleness: 2 }
    }
}

/// `[training.model_config]` of a GPT, with its defaults.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GptConfig {
    pub d_model: i64,
    pub n_layer: i64,
    pub n_head: i64,
    /// Context length: each sample is `ctx + 1` tokens.
    pub ctx: i64,
    /// At least the dataset's vocabulary (tokens are u16: at most 65,536).
    pub vocab: i64,
}

impl GptConfig {
    /// About how many parameters it has (blocks, embeddings, head).
    pub fn approx_params(&self) -> i64 {
        12 * self.n_layer * self.d_model * self.d_model
            + (self.vocab.max(1) * 2 + self.ctx) * self.d_model
    }

    /// About how many parameters its largest unit has: a block (12·d²), the embeddings
    /// ((vocab + ctx)·d) or the head (vocab·d).
    pub fn approx_largest_unit(&self) -> i64 {
        let d = self.d_model;
        let block = if self.n_layer > 0 { 12 * d * d } else { 0 };
        block.max((self.vocab.max(1) + self.ctx) * d)
    }
}

impl Default for GptConfig {
    fn default() -> Self {
        GptConfig {
            d_model: 64,
            n_layer: 2,
            n_head: 4,
            ctx: 32,
            vocab: 0,
        }
    }
}

/// `[training.model_config]` of an MLP, with its defaults.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MlpConfig {
    pub hidden: i64,
    /// Hidden layers (0: a linear model).
    pub layers: i64,
}

impl Default for MlpConfig {
    fn default() -> Self {
        MlpConfig {
            hidden: 64,
            layers: 2,
        }
    }
}

/// Parameters past which a job is refused at submission (a typo like `d_model = 655360` would
/// otherwise exhaust every worker's memory).
pub const MAX_MODEL_PARAMS: i64 = 20_000_000_000;

impl TrainingSpec {
    fn model_config_of<T: serde::de::DeserializeOwned + Default>(&self) -> Result<T> {
        match &self.model_config {
            None => Ok(T::default()),
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| {
                ClusterError::invalid(
                    "training.model_config",
                    format!("{e} (model {:?})", self.model.as_str()),
                )
            }),
        }
    }

    /// The GPT's sizes, checked: every field in range, `d_model` divisible by `n_head`.
    pub fn gpt_config(&self) -> Result<GptConfig> {
        let c: GptConfig = self.model_config_of()?;
        let range = |field: &str, v: i64, lo: i64, hi: i64| {
            if v < lo || v > hi {
                Err(ClusterError::invalid(
                    format!("training.model_config.{field}"),
                    format!("{v} is outside {lo}..={hi}"),
                ))
            } else {
                Ok(())
            }
        };
        range("d_model", c.d_model, 1, 1 << 16)?;
        range("n_layer", c.n_layer, 1, 1 << 10)?;
        range("n_head", c.n_head, 1, 1 << 10)?;
        range("ctx", c.ctx, 1, 1 << 16)?;
        range("vocab", c.vocab, 0, 1 << 16)?;
        if c.d_model % c.n_head != 0 {
            return Err(ClusterError::invalid(
                "training.model_config.n_head",
                format!(
                    "d_model {} does not divide into {} heads",
                    c.d_model, c.n_head
                ),
            ));
        }
        let params = c.approx_params();
        if params > MAX_MODEL_PARAMS {
            return Err(ClusterError::invalid(
                "training.model_config",
                format!("about {params} parameters, more than {MAX_MODEL_PARAMS}"),
            ));
        }
        Ok(c)
    }

    /// A Hugging Face model's context (`model_config = { ctx = N }`, default 2048 or the
    /// model's `max_position_embeddings` if shorter).
    pub fn hf_ctx(&self) -> Result<i64> {
        let c = self.hf_model_config()?;
        let max = self.hf_config().ok().map(|h| h.max_positions);
        let ctx = c.ctx.unwrap_or(max.unwrap_or(2048).min(2048));
        if !(1..=1 << 20).contains(&ctx) {
            return Err(ClusterError::invalid(
                "training.model_config.ctx",
                format!("{ctx} is outside 1..=1048576"),
            ));
        }
        Ok(ctx)
    }

    /// A Hugging Face model's `model_config`: `ctx`, and `dropout = "off"` (train without the
    /// dropout config.json asks for, which ductile does not implement).
    fn hf_model_config(&self) -> Result<HfModelConfig> {
        let c: HfModelConfig = match &self.model_config {
            None => HfModelConfig::default(),
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| {
                ClusterError::invalid(
                    "training.model_config",
                    format!("{e} (model \"hf\" takes ctx and dropout = \"off\": the rest is config.json's)"),
                )
            })?,
        };
        match c.dropout.as_deref() {
            None | Some("off") => Ok(c),
            Some(other) => Err(ClusterError::invalid(
                "training.model_config.dropout",
                format!(
                    "{other:?}: only \"off\" (train without config.json's dropout) is implemented"
                ),
            )),
        }
    }

    /// A Hugging Face model's checked `config.json` (the daemon fills `hf_config` in at submit).
    pub fn hf_config(&self) -> Result<crate::hf::HfConfig> {
        let v = self.hf_config.as_ref().ok_or_else(|| {
            ClusterError::invalid(
                "training.hf_config",
                "missing: the daemon reads model_path's config.json at submit",
            )
        })?;
        let parsed = if self.hf_model_config()?.dropout.is_some() {
            crate::hf::HfConfig::parse_without_dropout(v)
        } else {
            crate::hf::HfConfig::parse(v)
        };
        let c = parsed.map_err(|e| ClusterError::invalid("training.model_path", e))?;
        if c.params() > MAX_MODEL_PARAMS {
            return Err(ClusterError::invalid(
                "training.model_path",
                format!("{} parameters, more than {MAX_MODEL_PARAMS}", c.params()),
            ));
        }
        Ok(c)
    }

    /// About how many parameters the model has (the size caps' estimate; an MLP's input and
    /// output widths, from its dataset, are counted as 64).
    pub fn approx_params(&self) -> Option<i64> {
        match self.model {
            ModelKind::Hf => self.hf_config().ok().map(|c| c.params()),
            ModelKind::Gpt => self.gpt_config().ok().map(|c| c.approx_params()),
            ModelKind::Mlp => self
                .mlp_config()
                .ok()
                .map(|c| c.hidden * c.hidden * c.layers + c.hidden * 2 * 64),
        }
    }

    /// `sharding = "auto"` made concrete: the least sharding (none, then optimizer, gradients,
    /// full) whose state fits `cap` bytes a slot at every world size in `min..=max` (a rank
    /// needs the most at the fewest ranks); where none fits at `min`, the least that fits at
    /// `max` (the layout that splits the state most: the daemon's memory check then says from
    /// which world it fits); full when none fits even there; none when no slot's memory is
    /// known. Returns what was chosen and why.
    pub fn resolve_auto_sharding(
        &mut self,
        min: u32,
        max: u32,
        cap: Option<u64>,
    ) -> Option<String> {
        if self.sharding != Sharding::Auto {
            return None;
        }
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        if matches!(self.strategy, Strategy::Pipeline | Strategy::Hybrid) {
            // stages and tensor groups: the planner decides at every world size, keeping each
            // layout's optimizer state whole where its stages fit a slot and sharding it over
            // the stage's replicas (ZeRO-1) where they do not; the slot's memory it plans
            // against is the spec's, else the smallest live slot's, kept in the spec
            if self.memory_per_slot_gib.is_none() {
                self.memory_per_slot_gib = cap.map(gib);
            }
            return Some(match self.memory_per_slot_gib {
                Some(m) => format!(
                    "sharding \"auto\" with strategy \"{}\": each layout's stages hold their optimizer state whole where they fit {m:.2} GiB per slot, else shard it over their replicas",
                    self.strategy
                ),
                None => format!(
                    "sharding \"auto\" with strategy \"{}\": no slot's memory is known (training.memory_per_slot_gib sets it), so the stages hold their optimizer state whole",
                    self.strategy
                ),
            });
        }
        // with strategy = "auto": sharded data parallelism first, the model split over pipeline
        // or tensor layouts only where no sharding level fits (torchtitan's guidance: FSDP
        // first)
        let planned = self.strategy == Strategy::Auto;
        let need_at = |s: Sharding, ranks: u32| {
            let mut t = self.clone();
            t.sharding = s;
            if planned {
                t.strategy = Strategy::DataParallel;
            }
            t.min_slot_bytes(ranks)
        };
        let (min, ranks) = (min.clamp(1, max.max(1)), max.max(1));
        let need = |s: Sharding| need_at(s, ranks);
        let fits =
            |s: Sharding, at: u32| cap.is_some_and(|c| need_at(s, at).is_none_or(|n| n <= c));
        let everywhere = Sharding::LEVELS.iter().find(|s| fits(**s, min));
        let (chosen, why) = match cap {
            None => (
                Sharding::None,
                "no slot's memory is known (training.memory_per_slot_gib sets it)".to_string(),
            ),
            Some(cap) if everywhere.is_some() => {
                let s = *everywhere.unwrap();
                let at = if min < ranks {
                    format!("from {min} rank(s) (the job's min) up")
                } else {
                    format!("at {ranks} rank(s)")
                };
                (
                    s,
                    format!(
                        "about {:.2} GiB per slot {at}, a slot has {:.2} GiB",
                        gib(need_at(s, min).unwrap_or(0)),
                        gib(cap)
                    ),
                )
            }
            Some(cap) => match Sharding::LEVELS
                .iter()
                .find(|s| need(**s).is_none_or(|n| n <= cap))
            {
                Some(s) => (
                    *s,
                    format!(
                        "about {:.2} GiB per slot at {ranks} rank(s), a slot has {:.2} GiB (no level fits at the job's min of {min} rank(s))",
                        gib(need(*s).unwrap_or(0)),
                        gib(cap)
                    ),
                ),
                None if planned => (
                    Sharding::None,
                    format!(
                        "data parallel needs about {:.2} GiB per slot at {ranks} rank(s) even fully sharded, a slot has {:.2} GiB: strategy \"auto\" splits the model over pipeline or tensor layouts instead",
                        gib(need(Sharding::Full).unwrap_or(0)),
                        gib(cap)
                    ),
                ),
                None => (
                    Sharding::Full,
                    format!(
                        "even fully sharded it needs about {:.2} GiB per slot at {ranks} rank(s), a slot has {:.2} GiB",
                        gib(need(Sharding::Full).unwrap_or(0)),
                        gib(cap)
                    ),
                ),
            },
        };
        self.sharding = chosen;
        if chosen == Sharding::None {
            self.shard_group = None;
        } else if planned {
            self.strategy = Strategy::DataParallel;
        }
        let strategy = match (planned, chosen.is_sharded()) {
            (true, true) => " (strategy \"auto\": data parallel, sharded)",
            _ => "",
        };
        Some(format!(
            "sharding \"auto\" chose \"{chosen}\"{strategy}: {why}"
        ))
    }

    /// Whether the job keeps buddy copies of its shards (`buddy_copies`, on by default with
    /// full sharding).
    pub fn keeps_buddy_copies(&self) -> bool {
        self.sharding == Sharding::Full && self.buddy_copies != Some(false)
    }

    /// About how many parameters the model's largest unit (the pipeline's blocks, what full
    /// sharding gathers at a time) has: a layer, or an end (a language model's embeddings or
    /// head, often the largest by far: SmolLM2-135M's embedding is 28 M of its 135 M).
    pub fn approx_largest_unit(&self) -> Option<u64> {
        let n = match self.model {
            ModelKind::Hf => self.hf_config().ok().map(|c| c.largest_unit_params()),
            ModelKind::Gpt => self.gpt_config().ok().map(|c| c.approx_largest_unit()),
            ModelKind::Mlp => self
                .mlp_config()
                .ok()
                .map(|c| (c.hidden * c.hidden).max(c.hidden * 64)),
        }?;
        // (never more than the whole model)
        Some((n.max(0) as u64).min(self.approx_params()?.max(0) as u64))
    }

    /// The fewest bytes one slot must hold for this job at `max` ranks: f32 parameters,
    /// gradients, the copies of the gradients the step reduces and the optimizer state (AdamW
    /// two tensors, SGD one; DiLoCo two more: the global weights and their momentum), for the
    /// layout that splits the model most (a data-parallel job holds it whole; a pipelined or
    /// tensor-parallel one as few as 1/`max` of it). The reduced copies: none for a
    /// data-parallel all-reduce step outside deterministic mode (it reduces in buckets of
    /// `bucket_mb`, counted), one flat copy per logical shard a rank folds in deterministic
    /// mode (at `max` ranks), one otherwise. Activations come on top. None where the spec does
    /// not say.
    pub fn min_slot_bytes(&self, max: u32) -> Option<u64> {
        if self.sharding == Sharding::Auto {
            // not made concrete yet: the least of what it may become (a data-parallel job
            // any level; stages the optimizer state's, whole where they split most; strategy
            // "auto" sharded data parallelism or the planner's layouts unsharded)
            let as_ = |strategy: Strategy, sharding: Sharding| {
                let mut t = self.clone();
                (t.strategy, t.sharding) = (strategy, sharding);
                t.min_slot_bytes(max)
            };
            return match self.strategy {
                Strategy::DataParallel => as_(Strategy::DataParallel, Sharding::Full),
                Strategy::Auto => as_(Strategy::DataParallel, Sharding::Full)
                    .into_iter()
                    .chain(as_(Strategy::Auto, Sharding::None))
                    .min(),
                s => as_(s, Sharding::Optimizer),
            };
        }
        let params = self.approx_params()? as u64;
        let max = max.max(1) as u64;
        let data_parallel = self.strategy == Strategy::DataParallel;
        let bucketed = data_parallel && !self.deterministic && self.sync == SyncMode::Allreduce;
        let reduced = if bucketed {
            0
        } else if self.deterministic && data_parallel {
            (self.logical_shards.map_or(max, u64::from)).div_ceil(max)
        } else {
            1
        };
        let copies = 2 + reduced + if self.is_diloco() { 2 } else { 0 };
        let split = if data_parallel { 1 } else { max };
        let bucket = if bucketed {
            u64::from(self.bucket_mb.unwrap_or(25)) << 20
        } else {
            0
        };
        // a sharded job's optimizer state: its rows over the shard group (a data-parallel
        // job's; the layout that splits a pipelined job most has one replica per stage, so its
        // state is whole there)
        let shard = if self.sharding.is_sharded() && data_parallel {
            // ("node": the nodes' sizes are not known at submit; counted as one group)
            match self.shard_group {
                Some(ShardGroup::Ranks(n)) => u64::from(n),
                Some(ShardGroup::Node) | None => max,
            }
            .clamp(1, max)
        } else {
            1
        };
        let opt = (params * 4 * self.optimizer.states() as u64).div_ceil(shard);
        // the largest unit, not the average one: a unit is gathered and reduced whole, and a
        // language model's embeddings or head are several blocks' worth
        let unit = self.approx_largest_unit().unwrap_or(params) * 4;
        if self.sharding == Sharding::Gradients && data_parallel {
            // whole parameters; rows of the state; a unit's gradients at a time
            return Some(params * 4 + opt + 2 * unit);
        }
        if self.sharding == Sharding::Full && data_parallel {
            // rows of the parameters and their state; a unit's gathered parameters and
            // gradients at a time, the next unit's gather in flight, or with
            // reshard_after_forward = false every unit's parameters gathered through the step
            // (a new process makes only its rows of the seed, unit by unit)
            let rows = (params * 4).div_ceil(shard) + opt;
            if self.reshard_after_forward == Some(false) {
                return Some(rows + params * 4 + 2 * unit);
            }
            return Some(rows + 4 * unit);
        }
        Some((params * 4 * copies + opt) / split + bucket)
    }

    /// The MLP's sizes, checked.
    pub fn mlp_config(&self) -> Result<MlpConfig> {
        let c: MlpConfig = self.model_config_of()?;
        if !(1..=1 << 16).contains(&c.hidden) {
            return Err(ClusterError::invalid(
                "training.model_config.hidden",
                format!("{} is outside 1..=65536", c.hidden),
            ));
        }
        if !(0..=1 << 10).contains(&c.layers) {
            return Err(ClusterError::invalid(
                "training.model_config.layers",
                format!("{} is outside 0..=1024", c.layers),
            ));
        }
        Ok(c)
    }

    /// DiLoCo rounds (`sync = "diloco"`).
    pub fn is_diloco(&self) -> bool {
        self.sync == SyncMode::Diloco
    }
    fn one() -> Degree {
        Degree::Fixed(1)
    }
    fn default_lr() -> f64 {
        3e-4
    }

    /// The learning rate of every step: `lr`, `max_steps` and `[training.lr_schedule]`.
    pub fn lr_plan(&self) -> crate::recipe::LrPlan {
        crate::recipe::LrPlan::new(self.lr, self.max_steps, self.lr_schedule.as_ref())
    }

    /// The recipe resolved (what checkpoints record and status shows).
    pub fn recipe(&self) -> crate::recipe::Recipe {
        crate::recipe::Recipe::new(&self.optimizer, self.lr_plan(), self.lr_schedule.is_some())
    }
}

/// The `[checkpoint]` section: sharded safetensors and a JSON manifest per commit, committed
/// atomically. A job that runs its own program takes only `url` (handed to it as
/// `DUCTILE_CHECKPOINT_URL`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Where the commits go: `s3://bucket/prefix` or `file:///dir` (checked against the
    /// agents' allow-lists).
    pub url: String,
    /// Commit every this many steps.
    #[serde(default = "CheckpointSpec::default_interval")]
    pub interval: u64,
    /// Commits kept (older ones deleted once a newer one is committed).
    #[serde(default = "CheckpointSpec::default_keep")]
    pub keep: u32,
    /// Multipart part size, MiB.
    #[serde(
        default = "CheckpointSpec::default_part_mib",
        deserialize_with = "crate::units::mib"
    )]
    #[schemars(schema_with = "crate::units::size_schema")]
    pub part_size_mib: u64,
    /// Parts in flight per writer.
    #[serde(default = "CheckpointSpec::default_concurrency")]
    pub upload_concurrency: u32,
    /// Uncommitted attempts older than this are deleted by retention, seconds.
    #[serde(
        default = "CheckpointSpec::default_attempt_ttl",
        deserialize_with = "crate::units::secs"
    )]
    #[schemars(schema_with = "crate::units::secs_schema")]
    pub attempt_ttl_s: u64,
    /// On a planned drain, the daemon asks for a checkpoint and holds the re-formation up to
    /// this long (and never past the leaving node's deadline) for it to commit; 0: do not ask.
    #[serde(
        default = "CheckpointSpec::default_drain_wait",
        deserialize_with = "crate::units::secs"
    )]
    #[schemars(schema_with = "crate::units::secs_schema")]
    pub drain_wait_s: u64,
    /// Resume from the commit at this step rather than the latest: the first cold start after
    /// the job is submitted with it reads exactly that step (no fallback to another), and the
    /// commits after it are superseded (kept, never restored automatically). What the job
    /// commits from then on is its history; later cold starts read the latest as usual.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_step: Option<u64>,
    /// Jobs (finished) whose commits at this location this job may restore: a run carried on
    /// under another name, in any layout (list every job of the lineage whose commits are
    /// there). Without it a job whose location holds another job's commits does not start.
    /// Their commits are never counted, superseded or deleted by this job's retention, and
    /// never written over.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resume_from: Vec<String>,
    /// Restore a checkpoint saved with another recipe (optimizer settings, learning rate,
    /// schedule, max_steps): without it such a restore is refused, naming what differs (the
    /// rate of every step is the recipe's function of the step, so a run resumed with another
    /// recipe is another run).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_recipe_change: bool,
}

impl CheckpointSpec {
    /// A checkpoint at `url` with every other key at its default.
    pub fn at(url: &str) -> CheckpointSpec {
        CheckpointSpec {
            url: url.to_string(),
            interval: Self::default_interval(),
            keep: Self::default_keep(),
            part_size_mib: Self::default_part_mib(),
            upload_concurrency: Self::default_concurrency(),
            attempt_ttl_s: Self::default_attempt_ttl(),
            drain_wait_s: Self::default_drain_wait(),
            restore_step: None,
            resume_from: Vec::new(),
            allow_recipe_change: false,
        }
    }

    fn default_interval() -> u64 {
        100
    }
    fn default_keep() -> u32 {
        3
    }
    fn default_part_mib() -> u64 {
        64
    }
    fn default_concurrency() -> u32 {
        4
    }
    fn default_attempt_ttl() -> u64 {
        3600
    }
    fn default_drain_wait() -> u64 {
        60
    }
}

impl JobSpec {
    /// Parse a TOML job spec; the error names the field (and line) at fault.
    pub fn from_toml(text: &str) -> Result<JobSpec> {
        Self::from_toml_noting(text).map(|(spec, _)| spec)
    }

    /// [`JobSpec::from_toml`], with a sentence for each older key the text uses (still read)
    /// naming the key to write instead.
    pub fn from_toml_noting(text: &str) -> Result<(JobSpec, Vec<String>)> {
        let mut notes = Vec::new();
        if let Ok(raw) = toml::from_str::<toml::Table>(text) {
            if raw.contains_key("torchrun") {
                notes.push(
                    "[torchrun] is now [program] (the table of every job that runs its own program): it is still read; write [program]"
                        .to_string(),
                );
            }
            for table in ["torchrun", "program"] {
                if let Some(t) = raw.get(table).and_then(|t| t.as_table()) {
                    if t.contains_key("checkpoint_url") {
                        notes.push(format!(
                            "{table}.checkpoint_url is now [checkpoint] url (one key for every runtime): it is still read; write [checkpoint] url"
                        ));
                    }
                }
            }
        }
        let mut spec: JobSpec = toml::from_str(text).map_err(|e| {
            let msg = e.message().to_string();
            let field = e
                .span()
                .map(|s| {
                    let line = text[..s.start.min(text.len())].lines().count().max(1);
                    format!("job spec (line {line})")
                })
                .unwrap_or_else(|| "job spec".to_string());
            ClusterError::invalid(field, msg)
        })?;
        spec.normalize()?;
        spec.validate()?;
        Ok((spec, notes))
    }

    /// The spec as a user writes it (`[program]`; a program's location as `[checkpoint] url`),
    /// what `dctl describe` shows; [`JobSpec::from_toml`] reads it back to the same spec.
    pub fn to_toml(&self) -> std::result::Result<String, toml::ser::Error> {
        let mut t = match toml::Value::try_from(self)? {
            toml::Value::Table(t) => t,
            _ => return toml::to_string(self),
        };
        if let Some(mut p) = t.remove("torchrun") {
            if let Some(url) = p.as_table_mut().and_then(|p| p.remove("checkpoint_url")) {
                let mut c = toml::Table::new();
                c.insert("url".into(), url);
                t.insert("checkpoint".into(), toml::Value::Table(c));
            }
            if p.as_table().is_some_and(|p| !p.is_empty()) {
                t.insert("program".into(), p);
            }
        }
        toml::to_string(&t)
    }

    /// Parse a JSON job spec (the API's form).
    pub fn from_json(text: &[u8]) -> Result<JobSpec> {
        let mut spec: JobSpec = serde_json::from_slice(text)
            .map_err(|e| ClusterError::invalid("job spec", e.to_string()))?;
        spec.normalize()?;
        spec.validate()?;
        Ok(spec)
    }

    /// One form for what may be written two ways: a program job's `[checkpoint] url` is the
    /// location handed to its program (kept as `program.checkpoint_url`). A `[checkpoint]`
    /// table of a program job holds only `url`: its other keys are the built-in trainer's.
    pub fn normalize(&mut self) -> Result<()> {
        if !self.runtime.runs_program() {
            return Ok(());
        }
        let Some(c) = self.checkpoint.take() else {
            return Ok(());
        };
        let bare = CheckpointSpec::at(&c.url);
        if c != bare {
            return Err(ClusterError::invalid(
                "checkpoint",
                format!("a runtime = \"{}\" job's [checkpoint] holds only url (handed to its program as DUCTILE_CHECKPOINT_URL; the program saves its own): interval, keep and the rest are the built-in trainer's", self.runtime),
            ));
        }
        let p = self.torchrun.get_or_insert_with(TorchrunSpec::default);
        match &p.checkpoint_url {
            Some(old) if *old != c.url => Err(ClusterError::invalid(
                "checkpoint.url",
                format!(
                    "{:?} and program.checkpoint_url {old:?} differ: write one ([checkpoint] url)",
                    c.url
                ),
            )),
            _ => {
                p.checkpoint_url = Some(c.url);
                Ok(())
            }
        }
    }

    /// Checks every value; the error names the field and the reason.
    pub fn validate(&self) -> Result<()> {
        validate_name("name", &self.name)?;
        if self.command.is_empty() || self.command[0].trim().is_empty() {
            return Err(ClusterError::invalid("command", "must name a program"));
        }
        if self.min == 0 {
            return Err(ClusterError::invalid("min", "must be at least 1"));
        }
        if self.max < self.min {
            return Err(ClusterError::invalid(
                "max",
                format!("{} is below min {}", self.max, self.min),
            ));
        }
        if self.max > MAX_WORLD {
            return Err(ClusterError::invalid(
                "max",
                format!(
                    "{} is over {MAX_WORLD} ranks, the most one job may have",
                    self.max
                ),
            ));
        }
        self.check_size(self.desired)
            .map_err(|reason| ClusterError::invalid("desired", reason))?;
        for k in self.env.keys() {
            let injection = self.allow_fault_injection
                && (k.starts_with("DUCTILE_FAULT_") || k == "DUCTILE_SLOWDOWN");
            // the one DUCTILE_* name a job sets for itself: where its workers listen (NAT)
            let own = k == "DUCTILE_COMM_BIND";
            if k.is_empty() || k.contains('=') || (k.starts_with("DUCTILE_") && !injection && !own)
            {
                return Err(ClusterError::invalid(
                    format!("env.{k}"),
                    "names must be non-empty, without '=', and not start with DUCTILE_ (reserved; DUCTILE_COMM_BIND is allowed, DUCTILE_FAULT_* and DUCTILE_SLOWDOWN only with allow_fault_injection = true)",
                ));
            }
        }
        if let Some(t) = &self.training {
            t.validate(self.max)?;
            if t.sharding.is_sharded() && self.checkpoint.is_none() {
                return Err(ClusterError::invalid(
                    "training.sharding",
                    "a sharded job needs a [checkpoint]: each shard of the optimizer state lives on its rank (and its shard group's replicas) only, and a shard that dies with its ranks is restored from the latest checkpoint",
                ));
            }
        }
        self.validate_runtime()?;
        if let Some(c) = &self.checkpoint {
            if !(c.url.starts_with("s3://") || c.url.starts_with("file://")) {
                return Err(ClusterError::invalid(
                    "checkpoint.url",
                    format!("{:?} must be s3://... or file://...", c.url),
                ));
            }
            if c.interval == 0 {
                return Err(ClusterError::invalid(
                    "checkpoint.interval",
                    "must be at least 1 step",
                ));
            }
            if c.keep == 0 {
                return Err(ClusterError::invalid(
                    "checkpoint.keep",
                    "must keep at least 1 checkpoint",
                ));
            }
            // S3 parts are 5 MiB to 5 GiB (the last may be smaller)
            if !(5..=5120).contains(&c.part_size_mib) {
                return Err(ClusterError::invalid(
                    "checkpoint.part_size_mib",
                    "must be 5 to 5120 (S3's part size limits)",
                ));
            }
            if c.upload_concurrency == 0 {
                return Err(ClusterError::invalid(
                    "checkpoint.upload_concurrency",
                    "must be at least 1",
                ));
            }
            if c.restore_step == Some(0) {
                return Err(ClusterError::invalid(
                    "checkpoint.restore_step",
                    "must be a committed step (at least 1); leave it out for the latest",
                ));
            }
            for j in &c.resume_from {
                validate_name("checkpoint.resume_from", j)?;
                if *j == self.name {
                    return Err(ClusterError::invalid(
                        "checkpoint.resume_from",
                        "names this job itself: leave it out (a job resumes its own commits)",
                    ));
                }
            }
            if c.drain_wait_s > 3600 {
                return Err(ClusterError::invalid(
                    "checkpoint.drain_wait_s",
                    "must be at most 3600 seconds (0 turns drain-time checkpoints off)",
                ));
            }
        }
        Ok(())
    }

    /// `runtime` and its section agree: a torchrun job names its own program and has no
    /// `[training]` or `[checkpoint]` (its program trains and saves); `[torchrun]` only with it.
    fn validate_runtime(&self) -> Result<()> {
        if self.torchft.is_some() && self.runtime != Runtime::Torchft {
            return Err(ClusterError::invalid(
                "torchft",
                "is for runtime = \"torchft\" jobs",
            ));
        }
        match self.runtime {
            Runtime::Ductile => {
                if self.torchrun.is_some() {
                    return Err(ClusterError::invalid(
                        "torchrun",
                        "is for runtime = \"torchrun\", \"torchft\", \"tf\" and \"horovod\" jobs (this job runs the built-in trainer)",
                    ));
                }
            }
            Runtime::Torchrun | Runtime::Torchft | Runtime::Tf | Runtime::Horovod => {
                let n = self.torchft_group_size();
                if n > 0 {
                    for (field, v) in [
                        ("min", self.min),
                        ("max", self.max),
                        ("desired", self.desired),
                    ] {
                        if v % n != 0 {
                            return Err(ClusterError::invalid(
                                field,
                                format!("{v} is not a multiple of torchft.group_size = {n}: a replica group runs only whole"),
                            ));
                        }
                    }
                }
                if is_worker(&self.command[0]) {
                    return Err(ClusterError::invalid(
                        "command",
                        format!("a runtime = \"{}\" job runs its own program (command = [\"python3\", \"train.py\", ...]), not ductile-worker", self.runtime),
                    ));
                }
                if self.training.is_some() {
                    return Err(ClusterError::invalid(
                        "training",
                        format!("is the built-in trainer's; a runtime = \"{}\" job's program trains itself", self.runtime),
                    ));
                }
                if self.checkpoint.is_some() {
                    return Err(ClusterError::invalid(
                        "checkpoint",
                        format!("is the built-in trainer's; a {} job's program saves its own (program.checkpoint_url is handed to it as DUCTILE_CHECKPOINT_URL)", self.runtime),
                    ));
                }
                let t = self.torchrun.clone().unwrap_or_default();
                if t.drain_notice_s > 3600 {
                    return Err(ClusterError::invalid(
                        "program.drain_notice_s",
                        "must be at most 3600 seconds (0 turns the notice off)",
                    ));
                }
                if t.grace_s > 3600 {
                    return Err(ClusterError::invalid(
                        "program.grace_s",
                        "must be at most 3600 seconds",
                    ));
                }
                if let Some(n) = t
                    .integrations
                    .iter()
                    .find(|n| !INTEGRATIONS.contains(&n.as_str()))
                {
                    return Err(ClusterError::invalid(
                        "program.integrations",
                        format!("{n:?} is unknown (known: {})", INTEGRATIONS.join(", ")),
                    ));
                }
                if self.runtime == Runtime::Tf && t.integrations.iter().any(|n| n == "transformers")
                {
                    return Err(ClusterError::invalid(
                        "program.integrations",
                        "\"transformers\" is for the PyTorch Trainer (runtime = \"torchrun\"); a tf job's Keras model.fit takes \"keras\"",
                    ));
                }
                if !t.integrations.is_empty() {
                    let runs = crate::pycmd::parse(&self.command[1..]).ok().map(|c| c.main);
                    let python = std::path::Path::new(&self.command[0])
                        .file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("python"));
                    if !python
                        || !matches!(
                            runs,
                            Some(
                                crate::pycmd::PyMain::Script(..) | crate::pycmd::PyMain::Module(..)
                            )
                        )
                    {
                        return Err(ClusterError::invalid(
                            "program.integrations",
                            "load into a Python program: the command must run a script or a module with a Python interpreter (python3 train.py ..., python3 -m pkg.train ...)",
                        ));
                    }
                }
                if let Some(u) = &t.checkpoint_url {
                    if !(u.starts_with("s3://") || u.starts_with("file://")) {
                        return Err(ClusterError::invalid(
                            "program.checkpoint_url",
                            format!("{u:?} must be s3://... or file://..."),
                        ));
                    }
                }
                if let Some(w) = &t.workdir {
                    let p = std::path::Path::new(w);
                    if !p.is_absolute()
                        || p.components().any(|c| {
                            matches!(
                                c,
                                std::path::Component::ParentDir | std::path::Component::CurDir
                            )
                        })
                    {
                        return Err(ClusterError::invalid(
                            "program.workdir",
                            format!("{w:?} must be an absolute path without . or .."),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The `[torchrun]` settings of a torchrun job (its defaults when the section is left out).
    pub fn torchrun_settings(&self) -> TorchrunSpec {
        self.torchrun.clone().unwrap_or_default()
    }

    /// A torchft job's `[torchft] group_size` (0: a node's slots form one group).
    pub fn torchft_group_size(&self) -> u32 {
        self.torchft.as_ref().map(|t| t.group_size).unwrap_or(0)
    }

    /// Whether `n` is an acceptable size for this job (`dctl scale`).
    pub fn check_size(&self, n: u32) -> std::result::Result<(), String> {
        if n < self.min || n > self.max {
            Err(format!(
                "{n} is outside [min, max] = [{}, {}]",
                self.min, self.max
            ))
        } else {
            Ok(())
        }
    }
}

/// A Hugging Face model's `model_config` (the rest of its configuration is config.json's).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct HfModelConfig {
    ctx: Option<i64>,
    dropout: Option<String>,
}

impl TrainingSpec {
    /// The eval split's keys: one source (a dataset or a fraction), a cadence that needs one,
    /// synchronous training for a cadence, token models only.
    fn validate_eval(&self) -> Result<()> {
        let bad = |k: &str, m: String| Err(ClusterError::invalid(k, m));
        if let Some(u) = &self.eval_dataset {
            if !(u.starts_with("file://") || u.starts_with("s3://")) {
                return bad(
                    "training.eval_dataset",
                    format!("{u:?} must be a file:// or s3:// URL"),
                );
            }
            if self.eval_fraction.is_some() {
                return bad(
                    "training.eval_fraction",
                    "give eval_dataset or eval_fraction, not both".into(),
                );
            }
        }
        if let Some(f) = self.eval_fraction {
            if !(f > 0.0 && f < 1.0) {
                return bad("training.eval_fraction", format!("{f} must be in (0, 1)"));
            }
        }
        let split = self.eval_dataset.is_some() || self.eval_fraction.is_some();
        if split && self.model == ModelKind::Mlp {
            return bad(
                if self.eval_dataset.is_some() {
                    "training.eval_dataset"
                } else {
                    "training.eval_fraction"
                },
                "is for token models (gpt, hf)".into(),
            );
        }
        if let Some(n) = self.eval_every {
            if n == 0 {
                return bad("training.eval_every", "must be at least 1".into());
            }
            if !split {
                return bad(
                    "training.eval_every",
                    "needs a held-out split: eval_dataset or eval_fraction".into(),
                );
            }
            if self.sync != SyncMode::Allreduce {
                return bad(
                    "training.eval_every",
                    format!(
                        "is for synchronous training (sync = \"allreduce\"); a {} job reports the eval loss of its final weights",
                        self.sync.as_str()
                    ),
                );
            }
        }
        if self.eval_samples == Some(0) {
            return bad("training.eval_samples", "must be at least 1".into());
        }
        Ok(())
    }

    fn validate(&self, max: u32) -> Result<()> {
        if self.tensor_parallel != Degree::Fixed(1) {
            let why = if !self.strategy.tensor_split() {
                Some(format!(
                    "needs strategy = \"hybrid\" or \"auto\" (strategy is {:?})",
                    self.strategy.as_str()
                ))
            } else if self.deterministic && self.tensor_slices.is_none() {
                Some("with deterministic = true needs tensor_slices = K (a multiple of every tensor_parallel the job may use; the same K in a data-parallel run gives the same bits)".into())
            } else if self.comm == CommChoice::Nccl {
                Some("runs its tensor groups on the TCP backend for now: use comm = \"tcp\" or \"auto\"".into())
            } else {
                None
            };
            if let Some(why) = why {
                return Err(ClusterError::invalid("training.tensor_parallel", why));
            }
        }
        if self.comm == CommChoice::Nccl
            && self.strategy.pipelined()
            && self.pipeline_parallel != Degree::Fixed(1)
        {
            return Err(ClusterError::invalid(
                "training.comm",
                "\"nccl\" with pipeline stages: a stage sends activations on a thread beside the one that receives, which an NCCL communicator does not allow; use comm = \"auto\" (NCCL where a layout has one stage, TCP otherwise), \"tcp\", or pipeline_parallel = 1",
            ));
        }
        if self.sync == SyncMode::Async {
            let why = if self.strategy != Strategy::DataParallel {
                Some(format!("\"async\" runs data-parallel workers (strategy = \"data-parallel\"); strategy is {:?}", self.strategy.as_str()))
            } else if self.deterministic {
                Some("\"async\" applies updates in the order they arrive: it cannot be deterministic".into())
            } else if self.comm == CommChoice::Nccl {
                Some("\"async\" sends its updates as host messages, which NCCL does not carry: use comm = \"tcp\" or \"auto\" (auto picks TCP for async jobs)".into())
            } else {
                None
            };
            if let Some(why) = why {
                return Err(ClusterError::invalid("training.sync", why));
            }
            if self.async_.staleness > 1000 {
                return Err(ClusterError::invalid(
                    "training.async.staleness",
                    format!("{} is outside 0..=1000", self.async_.staleness),
                ));
            }
        }
        if self.is_diloco() {
            let d = &self.diloco;
            let bad = |field: &str, why: String| {
                Err(ClusterError::invalid(
                    format!("training.diloco.{field}"),
                    why,
                ))
            };
            if self.strategy != Strategy::DataParallel {
                return Err(ClusterError::invalid(
                    "training.sync",
                    format!("\"diloco\" runs data-parallel replicas (strategy = \"data-parallel\"); strategy is {:?}", self.strategy.as_str()),
                ));
            }
            if !(1..=1_000_000).contains(&d.inner_steps) {
                return bad(
                    "inner_steps",
                    format!("{} is outside 1..=1000000", d.inner_steps),
                );
            }
            if !(d.outer_lr.is_finite() && d.outer_lr > 0.0) {
                return bad(
                    "outer_lr",
                    format!("{} must be a positive number", d.outer_lr),
                );
            }
            if !(d.outer_momentum.is_finite() && (0.0..1.0).contains(&d.outer_momentum)) {
                return bad(
                    "outer_momentum",
                    format!("{} is outside [0, 1)", d.outer_momentum),
                );
            }
            if !(1..=1024).contains(&d.fragments) || d.fragments > d.inner_steps {
                return bad(
                    "fragments",
                    format!(
                        "{} must be 1 to 1024 and at most inner_steps ({})",
                        d.fragments, d.inner_steps
                    ),
                );
            }
            if self.tensor_slices.is_some() {
                return Err(ClusterError::invalid(
                    "training.tensor_slices",
                    "logical slices are for tensor parallelism; DiLoCo replicas run whole models",
                ));
            }
        }
        if let Some(k) = self.tensor_slices {
            if !self.deterministic || k == 0 {
                return Err(ClusterError::invalid(
                    "training.tensor_slices",
                    format!("{k}: logical slices need deterministic = true and at least 1"),
                ));
            }
            if self.model == ModelKind::Gpt {
                let heads = self.gpt_config()?.n_head;
                if heads % k as i64 != 0 {
                    return Err(ClusterError::invalid(
                        "training.tensor_slices",
                        format!("{k} does not divide n_head = {heads}"),
                    ));
                }
            }
            if self.model == ModelKind::Hf && self.hf_config.is_some() {
                let kv = self.hf_config()?.n_kv_head;
                if kv % k as i64 != 0 {
                    return Err(ClusterError::invalid(
                        "training.tensor_slices",
                        format!("{k} does not divide num_key_value_heads = {kv}"),
                    ));
                }
            }
        }
        if self.pipeline_micro_batches == Some(0) {
            return Err(ClusterError::invalid(
                "training.pipeline_micro_batches",
                "must be at least 1",
            ));
        }
        if let Some(m) = self.memory_per_slot_gib {
            if !(m.is_finite() && m > 0.0) {
                return Err(ClusterError::invalid(
                    "training.memory_per_slot_gib",
                    "must be a positive number of GiB",
                ));
            }
        }
        if self.precision == Precision::Bf16 && self.model != ModelKind::Hf {
            return Err(ClusterError::invalid(
                "training.precision",
                format!(
                    "\"bf16\" is implemented for model = \"hf\" (the Llama family, GPT-2); model is {:?}",
                    self.model.as_str()
                ),
            ));
        }
        if self.model == ModelKind::Mlp
            && self.activation_checkpointing == ActivationCheckpointing::Full
        {
            return Err(ClusterError::invalid(
                "training.activation_checkpointing",
                "\"full\" recomputes transformer blocks; model \"mlp\" has none",
            ));
        }
        match self.model {
            ModelKind::Gpt => self.gpt_config().map(|_| ())?,
            ModelKind::Mlp => self.mlp_config().map(|_| ())?,
            ModelKind::Hf => {
                match &self.model_path {
                    Some(p) if p.starts_with("file://") || p.starts_with("s3://") => {}
                    Some(p) => {
                        return Err(ClusterError::invalid(
                            "training.model_path",
                            format!("{p:?} must be a file:// or s3:// URL"),
                        ))
                    }
                    None => {
                        return Err(ClusterError::invalid(
                            "training.model_path",
                            "model = \"hf\" needs the model's directory (file:// or s3://)",
                        ))
                    }
                }
                let ctx = self.hf_ctx()?;
                // before the daemon has read config.json, only the spec's own keys are checked
                if self.hf_config.is_some() {
                    self.hf_config()?
                        .check_ctx(ctx)
                        .map_err(|e| ClusterError::invalid("training.model_config.ctx", e))?;
                }
            }
        }
        if self.model != ModelKind::Hf {
            for (key, set) in [
                ("training.model_path", self.model_path.is_some()),
                ("training.hf_config", self.hf_config.is_some()),
                ("training.init", self.init != Init::Pretrained),
            ] {
                if set {
                    return Err(ClusterError::invalid(
                        key,
                        format!("is for model = \"hf\" (model is {:?})", self.model.as_str()),
                    ));
                }
            }
        }
        if !(self.dataset.starts_with("file://") || self.dataset.starts_with("s3://")) {
            return Err(ClusterError::invalid(
                "training.dataset",
                format!("{:?} must be a file:// or s3:// URL", self.dataset),
            ));
        }
        self.validate_eval()?;
        if self.global_batch == 0 {
            return Err(ClusterError::invalid(
                "training.global_batch",
                "must be at least 1",
            ));
        }
        if self.global_batch < max {
            return Err(ClusterError::invalid(
                "training.global_batch",
                format!("{} cannot be split over max = {max} ranks (each rank needs at least one sample)", self.global_batch),
            ));
        }
        if self.micro_batch == Some(0) {
            return Err(ClusterError::invalid(
                "training.micro_batch",
                "must be at least 1",
            ));
        }
        if let Some(n) = self.max_grad_norm {
            if !(n.is_finite() && n > 0.0) {
                return Err(ClusterError::invalid(
                    "training.max_grad_norm",
                    format!("{n} is not a positive number"),
                ));
            }
            // (every layout of the all-reduce step: data parallel, sharded, stages, tensor
            // groups, the norm over all of them; DiLoCo's inner steps and async's pushes:
            // each rank's own, a rank being the whole replica there)
        }
        match self.sharding {
            Sharding::None
            | Sharding::Optimizer
            | Sharding::Gradients
            | Sharding::Full
            | Sharding::Auto => {}
        }
        if matches!(self.sharding, Sharding::Full | Sharding::Gradients)
            && self.tensor_slices.is_some()
            && !self.strategy.pipelined()
        {
            return Err(ClusterError::invalid(
                "training.tensor_slices",
                format!("\"{}\" sharding computes each unit whole: tensor_slices is for tensor-parallel layouts", self.sharding),
            ));
        }
        // stages and tensor groups shard the optimizer state over each (stage, tensor place)'s
        // replicas (ZeRO-1, torchtitan's 2D/3D with the state sharded), and with "gradients"
        // the summed gradient too (each replica receives its rows of it alone)
        // ("auto" with stages: the planner shards a layout's optimizer state over its
        // replicas where its stages do not fit the slots unsharded)
        let over_stages = matches!(
            self.sharding,
            Sharding::Optimizer | Sharding::Gradients | Sharding::Auto
        ) && self.strategy.pipelined();
        // "full" under tensor groups or stages (torchtitan's 2D FSDP + TP and 3D): each
        // (stage, tensor place)'s replicas shard its parameters too; under tensor groups
        // alone one unit is gathered at a time, with stages a stage's parameters once a step
        let full_tp = self.sharding == Sharding::Full && self.strategy.pipelined();
        if full_tp {
            let why = match self.strategy {
                Strategy::Hybrid if !matches!(self.tensor_parallel, Degree::Fixed(n) if n > 1) => {
                    Some("under tensor groups needs a fixed tensor_parallel of 2 or more (stages alone: strategy = \"pipeline\")".to_string())
                }
                Strategy::Hybrid | Strategy::Pipeline => None,
                _ => Some("needs strategy = \"pipeline\", or \"hybrid\" with a fixed tensor_parallel (full sharding over each stage's and tensor place's replicas: 2D and 3D)".to_string()),
            };
            let why = why.or_else(|| {
                (self.reshard_after_forward == Some(false)).then(|| {
                    "with tensor groups or stages gathers each unit again for its backward (tensor groups) or a stage once a step (stages): reshard_after_forward = false runs with strategy = \"data-parallel\"".to_string()
                })
            });
            if let Some(why) = why {
                return Err(ClusterError::invalid(
                    "training.sharding",
                    format!("\"full\" {why}"),
                ));
            }
        }
        let over_stages = over_stages || full_tp;
        if self.sharding.is_sharded() && self.sync != SyncMode::Allreduce {
            return Err(ClusterError::invalid(
                "training.sharding",
                "sharding cuts a data-parallel group's state, which sync = \"allreduce\" has: a DiLoCo replica is one rank that keeps its whole model and inner optimizer between exchanges (its outer state, the global weights and outer momentum, stays whole too), and sync = \"async\" already shards its parameters and optimizer state over the workers (each owns one slice, as a parameter server)",
            ));
        }
        if over_stages && self.shard_group == Some(ShardGroup::Node) {
            return Err(ClusterError::invalid(
                "training.shard_group",
                "\"node\" groups a node's data-parallel ranks; pipeline and tensor layouts shard over each stage's replicas, which the planner spreads over nodes: give a number of replicas",
            ));
        }
        if let Some(g) = self.shard_group {
            if !self.sharding.is_sharded() {
                return Err(ClusterError::invalid(
                    "training.shard_group",
                    "needs training.sharding (a job without sharding holds the whole state on every rank)",
                ));
            }
            if let ShardGroup::Ranks(n) = g {
                if !(1..=max).contains(&n) {
                    return Err(ClusterError::invalid(
                        "training.shard_group",
                        format!("{n} is not between 1 and the job's max size {max}"),
                    ));
                }
                // (under stages the groups are of a stage's replicas, which the plan chooses)
                if !over_stages && !max.is_multiple_of(n) {
                    return Err(ClusterError::invalid(
                        "training.shard_group",
                        format!(
                            "{n} does not divide the job's max size {max}: at a world of {max} the shards would be cut in groups of {} (the largest that divides it); give a divisor of max",
                            Layout::sharded(max, n).dp_shard
                        ),
                    ));
                }
            }
        }
        if let Some(b) = self.bucket_mb {
            if !(1..=4096).contains(&b) {
                return Err(ClusterError::invalid(
                    "training.bucket_mb",
                    format!("{b} is not between 1 and 4096 (MiB)"),
                ));
            }
        }
        // the keys of full sharding alone
        for (key, set) in [
            ("training.buddy_copies", self.buddy_copies.is_some()),
            (
                "training.reshard_after_forward",
                self.reshard_after_forward.is_some(),
            ),
        ] {
            if set && self.sharding != Sharding::Full {
                return Err(ClusterError::invalid(
                    key,
                    format!(
                        "applies to sharding = \"full\" (the parameters sharded), not \"{}\"",
                        self.sharding
                    ),
                ));
            }
        }
        if let Some(k) = self.transfer_chunk_kib {
            if !(1..=(4 << 20)).contains(&k) {
                return Err(ClusterError::invalid(
                    "training.transfer_chunk_kib",
                    format!("{k} is not between 1 and 4194304 (KiB: 4 GiB)"),
                ));
            }
        }
        if let Some(v) = self.logical_shards {
            if v < max {
                return Err(ClusterError::invalid(
                    "training.logical_shards",
                    format!("{v} is below max = {max}: every rank needs at least one shard"),
                ));
            }
            if v > self.global_batch {
                return Err(ClusterError::invalid("training.logical_shards", format!("{v} shards cannot split global_batch = {} (each needs at least one sample)", self.global_batch)));
            }
        }
        if let Some(t) = self.comm_timeout_s {
            if !(1..=86_400).contains(&t) {
                return Err(ClusterError::invalid(
                    "training.comm_timeout_s",
                    format!("{t} s: must be 1 to 86400"),
                ));
            }
        }
        if self.mesh_tls && self.comm == CommChoice::Nccl {
            return Err(ClusterError::invalid(
                "training.mesh_tls",
                "NCCL has no TLS: a job with mesh_tls uses comm = \"tcp\" (or \"auto\", which then picks TCP)",
            ));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(ClusterError::invalid(
                "training.lr",
                "must be a positive finite number",
            ));
        }
        self.optimizer.validate()?;
        if !self.optimizer.no_decay.is_empty() && self.sync == SyncMode::Async {
            return Err(ClusterError::invalid(
                "training.optimizer.no_decay",
                "async updates step the model as one flat vector: no_decay is for sync = \"allreduce\" and \"diloco\"",
            ));
        }
        if let Some(sched) = &self.lr_schedule {
            crate::recipe::validate_schedule(sched, self.lr, self.max_steps)?;
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobState {
    /// Submitted, no generation yet.
    Pending,
    /// A generation is current and at or above `min`.
    Running,
    /// Fewer live slots than `min`: no generation is published; state is kept.
    Waiting,
    /// Stopped by the operator.
    Stopped,
    /// Every worker of the last generation exited successfully.
    Succeeded,
    /// The job cannot go on (for example its workers keep failing past the restart budget below min).
    Failed,
}

impl JobState {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Stopped | JobState::Succeeded | JobState::Failed
        )
    }
}

/// Why a generation was published.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reason {
    /// The first generation of a job.
    Start,
    /// Slots joined (a node came, a failed worker was restarted).
    Join,
    /// A node was lost or a worker died.
    Failure,
    /// The operator asked for a new size.
    Scale,
    /// A node is leaving in an orderly way (SIGTERM, spot notice, `dctl drain`).
    Drain,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Reason::Start => "start",
            Reason::Join => "join",
            Reason::Failure => "failure",
            Reason::Scale => "scale",
            Reason::Drain => "drain",
        };
        f.write_str(s)
    }
}

/// Where the members of a generation get their training state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StateSource {
    /// Nobody holds state yet: start from the seed.
    Seed,
    /// Survivors hold it in memory; newcomers receive it from them.
    Peers,
    /// No survivor: read the latest committed checkpoint of the job's checkpoint URL, if it
    /// holds one (a first start with an empty URL starts from the seed).
    Checkpoint,
    /// The job's own program restores its state (torchrun and torchft jobs: the script's own
    /// checkpoint, or TorchFT's healing from a live replica group).
    Program,
}

/// One (node, slot) of a generation, its rank and its coordinates in the generation's layout
/// (`rank = (dp_rank · pipeline_parallel + pp_stage) · tensor_parallel + tp_rank`). A spare is
/// a member the plan leaves idle (it holds no layer and computes nothing until a later plan
/// gives it a stage).
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Member {
    pub node: String,
    pub slot: u32,
    pub rank: u32,
    #[serde(default)]
    pub dp_rank: u32,
    #[serde(default)]
    pub pp_stage: u32,
    #[serde(default)]
    pub tp_rank: u32,
    #[serde(default, skip_serializing_if = "is_false")]
    pub spare: bool,
    /// `runtime = "torchft"`: the member's replica group (`REPLICA_GROUP_ID`), kept while the
    /// group lives; the leader gives a new group the smallest number no live group holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_group: Option<u32>,
    /// `runtime = "torchft"`: the generation in which the member's group last started. A
    /// group's programs are restarted exactly when this moves (its members changed, or one of
    /// its programs failed); the other groups keep running through the new generation.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub group_since: u64,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

/// A parallel degree in a job spec: `"auto"` (the planner chooses per world size) or a fixed
/// number.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Degree {
    #[default]
    Auto,
    Fixed(u32),
}

impl Degree {
    pub fn is_one(&self) -> bool {
        *self == Degree::Fixed(1)
    }
}

impl Serialize for Degree {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Degree::Auto => s.serialize_str("auto"),
            Degree::Fixed(n) => s.serialize_u32(*n),
        }
    }
}

impl schemars::JsonSchema for Degree {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Degree".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "anyOf": [
                { "type": "integer", "minimum": 1, "maximum": 65536 },
                { "const": "auto" }
            ]
        })
    }
}

impl<'de> Deserialize<'de> for Degree {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Num(i64),
            Word(String),
        }
        match Raw::deserialize(d)? {
            Raw::Word(w) if w == "auto" => Ok(Degree::Auto),
            Raw::Num(n) if (1..=1 << 16).contains(&n) => Ok(Degree::Fixed(n as u32)),
            Raw::Num(n) => Err(serde::de::Error::custom(format!(
                "{n} is outside 1..=65536"
            ))),
            Raw::Word(w) => Err(serde::de::Error::custom(format!(
                "{w:?} is neither \"auto\" nor a number"
            ))),
        }
    }
}

/// The parallel layout of a generation: dp × pp × tp = world size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    pub data_parallel: u32,
    #[serde(default = "one")]
    pub pipeline_parallel: u32,
    #[serde(default = "one")]
    pub tensor_parallel: u32,
    /// The data-parallel ranks' shard group size (`training.sharding`): data-parallel rank d
    /// holds shard d mod `dp_shard` of the sharded state, replicated over the
    /// data_parallel / dp_shard groups (HSDP when both exceed 1). 1: nothing sharded.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub dp_shard: u32,
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

fn one() -> u32 {
    1
}

/// `dp2×pp2×tp1`; `dp4(shard2)×pp1×tp1`: shard groups of 2 (ZeRO), replicated twice.
impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "dp{}", self.data_parallel)?;
        if self.dp_shard > 1 {
            write!(f, "(shard{})", self.dp_shard)?;
        }
        write!(
            f,
            "×pp{}×tp{}",
            self.pipeline_parallel, self.tensor_parallel
        )
    }
}

impl Layout {
    pub fn data_parallel(n: u32) -> Layout {
        Layout {
            data_parallel: n,
            pipeline_parallel: 1,
            tensor_parallel: 1,
            dp_shard: 1,
        }
    }

    /// Data parallel over `n` ranks with the state sharded in groups of up to `group` (the
    /// largest divisor of `n` not above it, so every group is whole).
    pub fn sharded(n: u32, group: u32) -> Layout {
        let g = (1..=group.clamp(1, n.max(1)))
            .rev()
            .find(|d| n.is_multiple_of(*d))
            .unwrap_or(1);
        Layout {
            dp_shard: g,
            ..Layout::data_parallel(n)
        }
    }
}

/// `training.shard_group`: groups of a number of data-parallel ranks, or the ranks of each node
/// (`"node"`: the shard traffic stays inside a node, the replicas span the nodes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ShardGroupRepr", into = "ShardGroupRepr")]
pub enum ShardGroup {
    Ranks(u32),
    Node,
}

#[derive(Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum ShardGroupRepr {
    Ranks(u32),
    Word(String),
}

impl schemars::JsonSchema for ShardGroup {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ShardGroup".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "anyOf": [
                { "type": "integer", "minimum": 1 },
                { "const": "node" }
            ]
        })
    }
}

impl TryFrom<ShardGroupRepr> for ShardGroup {
    type Error = String;
    fn try_from(r: ShardGroupRepr) -> std::result::Result<Self, String> {
        match r {
            ShardGroupRepr::Ranks(n) => Ok(ShardGroup::Ranks(n)),
            ShardGroupRepr::Word(w) if w == "node" => Ok(ShardGroup::Node),
            ShardGroupRepr::Word(w) => Err(format!(
                "training.shard_group: {w:?} is neither a number of ranks nor \"node\""
            )),
        }
    }
}

impl From<ShardGroup> for ShardGroupRepr {
    fn from(g: ShardGroup) -> Self {
        match g {
            ShardGroup::Ranks(n) => ShardGroupRepr::Ranks(n),
            ShardGroup::Node => ShardGroupRepr::Word("node".into()),
        }
    }
}

impl ShardGroup {
    /// The shard group of a world whose members sit `per_node` to a node (in rank order,
    /// each node's ranks consecutive): the number given, or for `"node"` the largest group
    /// that fits inside every node (the greatest common divisor of the counts), so every
    /// group lies within one node.
    pub fn size(self, per_node: impl IntoIterator<Item = u32>) -> u32 {
        fn gcd(a: u32, b: u32) -> u32 {
            if b == 0 {
                a
            } else {
                gcd(b, a % b)
            }
        }
        match self {
            ShardGroup::Ranks(n) => n,
            ShardGroup::Node => per_node.into_iter().fold(0, gcd).max(1),
        }
    }
}

/// A generation: who is in the world, at which rank, and where state comes from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    pub job: String,
    pub number: u64,
    pub members: Vec<Member>,
    pub world_size: u32,
    pub layout: Layout,
    /// The last step known committed when this generation was published (a floor: survivors
    /// that completed more win in the rendezvous).
    pub resume_step: u64,
    pub state_source: StateSource,
    /// The job's desired size when this generation was published.
    pub desired: u32,
    pub reason: Reason,
    /// What happened, in words (`node n2 lost its lease`).
    pub detail: String,
    /// When the event that caused this generation was observed.
    pub triggered_at_ms: u64,
    pub published_at_ms: u64,
    /// The communicator backend every member forms (resolved from the job's `comm` by the
    /// leader, so that all ranks agree).
    #[serde(default)]
    pub backend: Backend,
    /// How many generations in a row were re-formed with the same members after a
    /// communicator failure or a stall without the job making a step (bounded by the job's
    /// `fault_retries`; then the job fails).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub fault_retries: u32,
    /// The pipeline's chunk boundaries in units of the model (embeddings, each block, the
    /// head): chunk k holds units `[b[k], b[k+1])`, stage s the chunks s, s + p, ... (see
    /// [`Generation::stage_chunks`]). Empty: one stage holds every unit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stage_boundaries: Vec<u32>,
    /// Microseconds the leader spent planning this generation's layout (0 when it had
    /// nothing to plan: data parallel).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub plan_us: u64,
    /// A hand-over: the trailing spares are leaving (a scale-down or a drain) and hold layers
    /// no one staying holds; they stay for this generation to hand them over, and the leader
    /// removes them once every member joined (the layers moved).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub handover: bool,
    /// How many of the job's generations so far, this one included, were formed after a
    /// failure (a torchrun job's `TORCHELASTIC_RESTART_COUNT`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failures: u32,
    /// A torchrun or torchft world restarted after an early failure (a program that failed
    /// soon after its generation started, before any progress report): its root cause and how
    /// many such failures came in a row. The same one twice in a row is a crash loop: the job
    /// fails with it instead of spending its restart budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_crash: Option<EarlyCrash>,
}

/// An early failure of a world's programs (see [`Generation::early_crash`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EarlyCrash {
    /// The root cause's error, its digits blanked (pids, ports and times do not make two
    /// failures different).
    pub error: String,
    /// Early failures in a row, this one included.
    pub streak: u32,
}

impl EarlyCrash {
    /// `error` with every run of digits replaced by `#`.
    pub fn normalize(error: &str) -> String {
        let mut out = String::with_capacity(error.len());
        let mut digits = false;
        for c in error.chars() {
            if c.is_ascii_digit() {
                if !digits {
                    out.push('#');
                }
                digits = true;
            } else {
                out.push(c);
                digits = false;
            }
        }
        out
    }
}

impl Generation {
    /// A data-parallel generation of `job` whose members are (node, slot) in rank order, started
    /// from the seed, with nothing else said (tests, benches, tools).
    pub fn data_parallel(job: &str, number: u64, members: &[(&str, u32)]) -> Generation {
        let world = members.len() as u32;
        Generation {
            job: job.into(),
            number,
            members: members
                .iter()
                .enumerate()
                .map(|(r, (n, s))| Member {
                    node: n.to_string(),
                    slot: *s,
                    rank: r as u32,
                    dp_rank: r as u32,
                    ..Default::default()
                })
                .collect(),
            world_size: world,
            layout: Layout::data_parallel(world.max(1)),
            resume_step: 0,
            state_source: StateSource::Seed,
            desired: world.max(1),
            reason: Reason::Start,
            detail: String::new(),
            triggered_at_ms: 0,
            published_at_ms: 0,
            backend: Backend::Tcp,
            fault_retries: 0,
            stage_boundaries: Vec::new(),
            plan_us: 0,
            handover: false,
            failures: 0,
            early_crash: None,
        }
    }

    /// The members' (node, slot) in rank order (the same world again).
    pub fn slots_in_rank_order(&self) -> Vec<(String, u32)> {
        let mut ms: Vec<&Member> = self.members.iter().collect();
        ms.sort_by_key(|m| m.rank);
        ms.into_iter().map(|m| (m.node.clone(), m.slot)).collect()
    }

    /// The chunks of units stage `stage` holds, in order; `units` is the model's count
    /// (every unit without stages). The boundaries cut the model into contiguous chunks and
    /// stage s holds chunks s, s + p, s + 2p, ... (one chunk per stage, or two with
    /// `interleaved-1f1b`).
    pub fn stage_chunks(&self, stage: u32, units: u32) -> Vec<std::ops::Range<u32>> {
        if self.stage_boundaries.len() < 2 {
            return vec![0..units];
        }
        let p = self.layout.pipeline_parallel.max(1) as usize;
        let n = self.stage_boundaries.len() - 1;
        (stage as usize..n)
            .step_by(p)
            .map(|k| self.stage_boundaries[k]..self.stage_boundaries[k + 1])
            .collect()
    }

    /// The stage holding unit `unit` of a model of `units` (0 without stages).
    pub fn stage_of(&self, unit: u32, units: u32) -> u32 {
        let p = self.layout.pipeline_parallel.max(1);
        (0..p)
            .find(|s| {
                self.stage_chunks(*s, units)
                    .iter()
                    .any(|c| c.contains(&unit))
            })
            .unwrap_or(0)
    }
}

fn is_zero<T: Default + PartialEq>(n: &T) -> bool {
    *n == T::default()
}

/// A generation's communicator backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    #[default]
    Tcp,
    Nccl,
}

impl Backend {
    /// `comm` of a job (`auto`, `nccl`, `tcp`) for members on `devices` (one per member): auto
    /// picks NCCL when every member has a GPU and no two members share one (NCCL refuses two
    /// ranks on one GPU), TCP otherwise.
    pub fn resolve(comm: CommChoice, devices: &[(String, Option<&Device>)]) -> Backend {
        match comm {
            CommChoice::Nccl => Backend::Nccl,
            CommChoice::Tcp => Backend::Tcp,
            CommChoice::Auto => {
                let mut seen = std::collections::BTreeSet::new();
                let all_own_gpu = !devices.is_empty()
                    && devices.iter().all(|(node, d)| {
                        d.is_some_and(|d| {
                            d.kind == DeviceKind::Gpu && seen.insert((node.clone(), d.index))
                        })
                    });
                if all_own_gpu {
                    Backend::Nccl
                } else {
                    Backend::Tcp
                }
            }
        }
    }
}

impl Generation {
    pub fn member(&self, node: &str, slot: u32) -> Option<&Member> {
        self.members
            .iter()
            .find(|m| m.node == node && m.slot == slot)
    }
}

/// How the last re-formation went.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reformation {
    pub generation: u64,
    pub reason: Reason,
    pub detail: String,
    /// From the triggering event to the last member joining the new generation.
    pub seconds: f64,
    /// From the triggering event to the first progress report of the new generation the
    /// leader saw (training going again); None until one comes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_step_seconds: Option<f64>,
}

/// A job's status, written by the leader.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobStatus {
    pub job: String,
    pub state: JobState,
    pub generation: u64,
    pub world_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_reformation: Option<Reformation>,
    #[serde(default)]
    pub message: String,
    pub updated_at_ms: u64,
    /// Generations published for this job, by reason (`start`, `failure`, ...): counted at
    /// each publish (history is bounded; these counts are not).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub reformations: BTreeMap<String, u64>,
    /// How long the job's re-formations took (trigger to the last member joining), counted
    /// once per generation as it completes.
    #[serde(default, skip_serializing_if = "SecondsHistogram::is_empty")]
    pub reformation_seconds: SecondsHistogram,
}

/// A histogram of durations over [`SecondsHistogram::BOUNDS`] (the counts per bucket, not
/// cumulative; the last bucket is everything above the last bound), with their sum.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SecondsHistogram {
    pub counts: Vec<u64>,
    pub sum: f64,
}

impl SecondsHistogram {
    pub const BOUNDS: [f64; 10] = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

    pub fn observe(&mut self, seconds: f64) {
        self.counts.resize(Self::BOUNDS.len() + 1, 0);
        let i = Self::BOUNDS
            .iter()
            .position(|b| seconds <= *b)
            .unwrap_or(Self::BOUNDS.len());
        self.counts[i] += 1;
        self.sum += seconds;
    }
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
    pub fn is_empty(&self) -> bool {
        self.count() == 0
    }
    /// (upper bound, count) per bucket, the last one +Inf: what a Prometheus histogram encodes.
    pub fn buckets(&self) -> Vec<(f64, u64)> {
        (0..=Self::BOUNDS.len())
            .map(|i| {
                (
                    Self::BOUNDS.get(i).copied().unwrap_or(f64::INFINITY),
                    self.counts.get(i).copied().unwrap_or(0),
                )
            })
            .collect()
    }
}

/// Exit statuses of `ductile-worker`, each with one meaning (docs/failures.md lists them): its
/// agent and the daemon read them.
///
/// The job's training finished (`max_steps`): the job succeeds when every member did.
pub const EXIT_DONE: i32 = 0;
/// A failure (the last `ductile-worker: ...` line on stderr says which): restarted within the
/// job's budget.
pub const EXIT_FAILED: i32 = 1;
/// The job's spec is missing or cannot be used.
pub const EXIT_BAD_SPEC: i32 = 2;
/// A generation no longer includes this worker: it left, as asked (not a failure).
pub const EXIT_FENCED: i32 = 3;
/// Stopped by SIGTERM or SIGINT (128 + 15): expected when its agent stopped it, a failure when
/// something else did (the slot is still in the generation).
pub const EXIT_TERMINATED: i32 = 143;
/// The worker cannot run on its slot (its GPU is not there, NCCL cannot load): it says why in
/// one `ductile-worker: ...` line on stderr, and its agent does not restart it.
pub const EXIT_UNUSABLE: i32 = 78;

/// A slot whose worker failed; the daemon leaves it out until the agent clears it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotHealth {
    pub failed_at_ms: u64,
    pub generation: u64,
    pub exit: String,
    /// The agent will restart it after its backoff (within the job's restart budget).
    pub will_restart: bool,
    /// Written by the leader, not the agent: the worker is alive but its peers could not reach
    /// it (stopped, wedged, cut off). Its agent stops it and restarts it within the budget.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub excluded: bool,
}

/// One job as one node's agent needs it (`assign/{node}/{job}`). The leader derives it from
/// the job's control state and rewrites it only when it changes for that node, so that an
/// agent watches its own node's view and wakes only for what concerns it. Present while the
/// job is active and has a member or a failed slot on the node (its agent restarts that from
/// the job's budget): a job absent from the view is one whose workers on the node must stop.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeAssignment {
    pub job: String,
    pub spec: JobSpec,
    /// The job's current generation and its size.
    pub generation: u64,
    pub world_size: u32,
    /// This node's members of that generation.
    pub slots: Vec<AssignedSlot>,
    /// This node's slots the leader excluded (alive workers their peers could not reach).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub excluded: BTreeMap<u32, SlotHealth>,
    /// Restarts taken from the job's budget so far.
    #[serde(default)]
    pub restarts_used: u32,
    /// The etcd user the job's workers connect as (absent while etcd has no auth).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access: Option<JobAccess>,
    /// A number unique to this job in the cluster for its life (the etcd revision that
    /// created its spec): agents with `job_users` derive the job's Unix identity from it, so
    /// that a job has the same uid on every node and across restarts. 0 from an older leader.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub job_number: u64,
}

/// The etcd user a job's workers connect as, made by the leader when etcd has auth on: its
/// role reads the job's control state, writes its checkpoint commits and what workers write as
/// they run, and nothing else ([`crate::access::job_grants`]).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobAccess {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for JobAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobAccess {{ user: {:?}, password: *** }}", self.user)
    }
}

/// A slot of a node in a generation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AssignedSlot {
    pub slot: u32,
    pub rank: u32,
    /// The first generation of the slot's unbroken run of membership up to the current one
    /// (history the leader no longer keeps breaks the run).
    pub since: u64,
}

impl NodeAssignment {
    pub fn slot(&self, slot: u32) -> Option<&AssignedSlot> {
        self.slots.iter().find(|s| s.slot == slot)
    }
    /// Whether `slot` is a member of the current generation and was one in every generation
    /// published after `from` (a worker that missed one must not act in a later one).
    pub fn member_since(&self, slot: u32, from: u64) -> bool {
        self.slot(slot)
            .is_some_and(|s| s.since <= from.saturating_add(1))
    }
}

/// What a worker's communicator failure was, as its fault report says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// The peer sent nothing, not even a heartbeat: stopped, frozen or cut off.
    Silent,
    /// The peer is alive (its heartbeats arrive) but sent no data within the op timeout.
    Timeout,
    /// The peer closed its connections: most likely it died (its agent reports that).
    PeerLost,
    /// The peer could not be reached to form the communicator.
    Connect,
    /// Ranks never published at the rendezvous.
    Rendezvous,
    /// A malformed frame or one of another generation.
    Protocol,
    /// etcd failed the rendezvous.
    Store,
    Aborted,
    Invalid,
    Unavailable,
    /// A torchrun job's program exited by itself (an error, a signal) while its world still
    /// stood: the first such exit is the root cause, as torchrun reports it.
    Exited,
    /// A kind this version does not know (a newer worker's).
    #[serde(other)]
    Other,
}

impl FaultKind {
    /// A closed connection alone is weak evidence: the dead member's agent or lease says more.
    pub fn is_weak(self) -> bool {
        self == FaultKind::PeerLost
    }
}

impl std::fmt::Display for FaultKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = serde_json::to_value(self).ok();
        f.write_str(s.as_ref().and_then(|v| v.as_str()).unwrap_or("other"))
    }
}

/// A worker's report that its generation's communicator failed while no newer generation
/// exists (a stopped, wedged or unreachable peer, a protocol error): the leader acts on it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultReport {
    pub generation: u64,
    pub rank: u32,
    pub node: String,
    pub slot: u32,
    pub kind: FaultKind,
    /// The ranks the failure points at.
    #[serde(default)]
    pub suspects: Vec<u32>,
    pub error: String,
    pub at_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerState {
    Running,
    Exited,
}

/// A worker process on a node, written by its agent under the agent's lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    pub pid: u32,
    /// The generation the agent started it for.
    pub generation: u64,
    pub state: WorkerState,
    /// How it ended, in words (`exit code 1`, `killed by signal 9`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<String>,
    /// Its exit code, when it exited by itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<i32>,
    pub started_at_ms: u64,
}

/// A worker joined a generation (it is at the rendezvous and ready).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct JoinRecord {
    pub node: String,
    pub slot: u32,
    pub rank: u32,
    pub pid: u32,
    pub joined_at_ms: u64,
    /// The last step this worker completed (0 if it holds no state).
    pub step: u64,
    /// When the worker saw the generation (unix ms): re-formation's phases are
    /// published → seen → formed (communicator) → joined (state agreed and moved).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub seen_at_ms: u64,
    /// When its communicator was formed (unix ms).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub formed_at_ms: u64,
    /// Bytes of state (layers, optimizer state) it received from peers before joining.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub received_bytes: u64,
    /// Bytes of parameters and optimizer state it holds in this generation (a pipeline
    /// stage: its own layers' only).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub state_bytes: u64,
}

/// The latest committed checkpoint of a job: the commit point is the etcd transaction that
/// writes this record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRecord {
    /// The job that wrote it (None: a record from before jobs were named in it). Retention and
    /// restore leave another job's commits alone, even in a location the job now uses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    pub step: u64,
    /// The generation whose workers wrote it.
    pub generation: u64,
    /// The manifest's key, relative to the job's checkpoint URL.
    pub manifest: String,
    pub manifest_crc32c: u32,
    /// Bytes of all shards.
    pub bytes: u64,
    pub world_size: u32,
    pub layout: Layout,
    pub committed_at_ms: u64,
    /// Set when the checkpoint answered a [`CheckpointRequest`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    /// Earlier commits of this lineage that etcd acknowledged but whose `COMMIT` record had
    /// not reached the store when this one was made (each without a list of its own): carried
    /// from commit to commit until retention writes their records, so none is ever taken for
    /// an abandoned attempt and deleted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unrecorded: Vec<CheckpointRecord>,
}

impl CheckpointRecord {
    /// This commit's own record, without the lineage it carries (what its `COMMIT` object
    /// holds).
    pub fn alone(&self) -> CheckpointRecord {
        CheckpointRecord {
            unrecorded: Vec::new(),
            ..self.clone()
        }
    }
}

/// The secret the members of one generation prove to each other when their meshes connect
/// (HMAC of a challenge both ways): fresh for every generation, so a key seen once opens no
/// later mesh. Never part of a generation record, which the API serves.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshKey {
    pub generation: u64,
    /// 32 random bytes, hex.
    pub key: String,
}

impl MeshKey {
    /// A fresh key for `generation`, from the system's CSPRNG.
    pub fn fresh(generation: u64) -> MeshKey {
        MeshKey {
            generation,
            key: random_hex(32),
        }
    }

    /// The key's bytes; an error for a record that is not 64 hex digits.
    pub fn bytes(&self) -> Result<Vec<u8>, String> {
        let k = self.key.as_bytes();
        if k.len() != 64 || !k.iter().all(|c| c.is_ascii_hexdigit()) {
            return Err(format!(
                "mesh key of generation {} is not 64 hex digits",
                self.generation
            ));
        }
        Ok(k.chunks(2)
            .map(|c| u8::from_str_radix(std::str::from_utf8(c).unwrap(), 16).unwrap())
            .collect())
    }
}

impl std::fmt::Debug for MeshKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MeshKey {{ generation: {}, key: <redacted> }}",
            self.generation
        )
    }
}

/// Ask the workers for a checkpoint at their next step boundary (before a planned drain).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRequest {
    pub id: String,
    pub reason: String,
    pub requested_at_ms: u64,
    /// The generation whose re-formation waits for it.
    #[serde(default)]
    pub generation: u64,
    /// The daemon publishes the next generation at this time (unix ms) even without it.
    #[serde(default)]
    pub deadline_ms: u64,
}

/// What the workers measured of their last checkpoints (read by `/metrics`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CheckpointStats {
    /// Training stall of the last save (copy into host buffers), milliseconds.
    pub last_stall_ms: f64,
    /// Upload time of the last committed checkpoint, seconds (snapshot to commit).
    pub last_upload_seconds: f64,
    pub last_bytes: u64,
    pub last_step: u64,
    pub committed_total: u64,
    /// Saves that were due while one was still in flight.
    pub skipped_total: u64,
    pub failed_total: u64,
    /// The last restore from a checkpoint (cold start), seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_restore_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_restore_step: Option<u64>,
}

/// Training progress, reported by rank 0 at most once a second.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub generation: u64,
    pub step: u64,
    /// A program's last `ductile.saved(step)` (it saved its own checkpoint at that step, after
    /// a notice) and when it said so (unix ms): a resize's notice ends there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_per_sec: Option<f64>,
    pub updated_at_ms: u64,
    #[serde(default)]
    pub done: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_weights_sha256: Option<String>,
    /// The job's `sync` mode, when not `"allreduce"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync: Option<String>,
    /// DiLoCo: rounds committed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round: Option<u64>,
    /// Bytes the workers sent each other per committed sample in the current generation
    /// (rank 0's count times the world size: the exchanges are symmetric).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_per_sample: Option<f64>,
    /// The eval loss: the mean loss on the eval split's first `eval_samples` samples (without
    /// a split: the dataset's first 256), at `eval_step` (at the end: the final weights').
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_step: Option<u64>,
    /// Async: the staleness of the updates applied (mean, max) and the updates dropped for
    /// being staler than the bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness_mean: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness_max: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropped_updates: Option<u64>,
    /// The global L2 norm of the last committed step's summed gradients, before clipping
    /// (jobs with `max_grad_norm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// The learning rate the last committed step ran at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
}

/// `dctl logs`: a daemon asks the agent of a node for what a slot's processes wrote (the
/// agent's `LOG_DIR/JOB/slot-S.log`). Written under a lease of a few seconds that the answer
/// shares, so neither outlives the question.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LogRequest {
    pub job: String,
    pub slot: u32,
    /// Only the lines of this generation (after its mark, before the next).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// Only the last N lines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail: Option<u32>,
    /// What the file holds from this byte on (`--follow`: the previous answer's `offset`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// The lease the answer is written under.
    pub lease: i64,
}

/// The agent's answer to a [`LogRequest`]: at most [`LogAnswer::MAX_BYTES`] of text.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LogAnswer {
    pub text: String,
    /// The file's length after what `text` holds: where a follow-up request starts.
    pub offset: u64,
    /// Older lines were left out to stay within the bound.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// The file the lines came from, on the node.
    pub file: String,
    /// Why there is nothing (no such file: the slot's processes wrote nothing here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl LogAnswer {
    /// An answer's text bound (etcd's requests stay well below their 1.5 MiB limit).
    pub const MAX_BYTES: usize = 512 << 10;
}

/// One rank's step figures over its last report window (about 2 s), so a straggler shows:
/// in a synchronous step every rank waits for the slowest, so the wall time per step is the
/// same everywhere and the compute time (forward and backward, before the collective) is what
/// tells them apart.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankStats {
    pub generation: u64,
    pub rank: u32,
    pub step: u64,
    /// Mean wall time per step, in milliseconds.
    pub step_ms: f64,
    /// Mean time per step this rank spent computing (not waiting for its peers), ms.
    pub compute_ms: f64,
    /// Mean time per step this rank waited for its data (a read the read-ahead had not done
    /// yet), ms: a slow store shows here.
    #[serde(default)]
    pub data_ms: f64,
    pub updated_at_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_nccl_only_when_every_member_has_a_gpu_of_its_own() {
        let gpu = |i| Device {
            kind: DeviceKind::Gpu,
            index: i,
            name: "g".into(),
            memory_mb: None,
        };
        let cpu = Device {
            kind: DeviceKind::Cpu,
            index: 0,
            name: "c".into(),
            memory_mb: None,
        };
        let (g0, g1) = (gpu(0), gpu(1));
        let n = |s: &str| s.to_string();
        let own = [
            (n("a"), Some(&g0)),
            (n("a"), Some(&g1)),
            (n("b"), Some(&g0)),
        ];
        assert_eq!(Backend::resolve(CommChoice::Auto, &own), Backend::Nccl);
        // two slots sharing GPU 0 of node a: NCCL would refuse them
        let shared = [(n("a"), Some(&g0)), (n("a"), Some(&g0))];
        assert_eq!(Backend::resolve(CommChoice::Auto, &shared), Backend::Tcp);
        let mixed = [(n("a"), Some(&g0)), (n("b"), Some(&cpu))];
        assert_eq!(Backend::resolve(CommChoice::Auto, &mixed), Backend::Tcp);
        assert_eq!(
            Backend::resolve(CommChoice::Auto, &[(n("a"), None)]),
            Backend::Tcp
        );
        assert_eq!(Backend::resolve(CommChoice::Nccl, &shared), Backend::Nccl);
        assert_eq!(Backend::resolve(CommChoice::Tcp, &own), Backend::Tcp);
    }

    const SPEC: &str = r#"
name = "tiny-gpt"
command = ["ductile-worker", "--verbose"]
min = 1
max = 4
desired = 4
[training]
strategy = "data-parallel"
model = "gpt"
dataset = "file:///var/lib/ductile/data/tokens.bin"
global_batch = 32
max_steps = 200
optimizer = "adamw"
lr = 3e-4
seed = 7
deterministic = false
[checkpoint]
url = "s3://bucket/jobs/tiny-gpt"
interval = 50
keep = 3
"#;

    #[test]
    fn the_readme_spec_parses() {
        let s = JobSpec::from_toml(SPEC).unwrap();
        assert_eq!(s.name, "tiny-gpt");
        assert_eq!((s.min, s.max, s.desired), (1, 4, 4));
        assert_eq!(s.training.as_ref().unwrap().global_batch, 32);
        assert_eq!(s.checkpoint.as_ref().unwrap().keep, 3);
        // JSON round trip (the API's form)
        let j = serde_json::to_vec(&s).unwrap();
        assert_eq!(JobSpec::from_json(&j).unwrap(), s);
    }

    /// Clipping by global norm runs at every layout of the all-reduce step (data parallel,
    /// sharded, stages, tensor groups), and with DiLoCo and async (each rank's own norm).
    #[test]
    fn clipping_runs_at_every_all_reduce_layout() {
        let spec = |extra: &str| {
            JobSpec::from_toml(&format!(
                "name = \"a\"\nmin = 1\nmax = 8\ndesired = 8\n[training]\nmodel = \"gpt\"\ndataset = \"file:///d.bin\"\nglobal_batch = 8\nmax_grad_norm = 1.0\n{extra}\n[checkpoint]\nurl = \"file:///ck\"\n"
            ))
        };
        for ok in [
            "",
            "sharding = \"full\"",
            "strategy = \"pipeline\"\npipeline_parallel = 2",
            "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 2\nsharding = \"optimizer\"",
        ] {
            assert!(spec(ok).is_ok(), "{ok}: {:?}", spec(ok).err());
        }
        for sync in ["diloco", "async"] {
            let s = format!("sync = \"{sync}\"");
            assert!(spec(&s).is_ok(), "{s}: {:?}", spec(&s).err());
        }
    }

    /// Sharding runs with the all-reduce step: DiLoCo and async are refused, saying what
    /// holds their state instead.
    #[test]
    fn sharding_with_diloco_or_async_is_refused_with_what_holds_their_state() {
        for sync in ["diloco", "async"] {
            for level in ["optimizer", "gradients", "full", "auto"] {
                let e = JobSpec::from_toml(&format!(
                    "name = \"a\"\nmin = 1\nmax = 4\ndesired = 4\n[training]\nmodel = \"gpt\"\ndataset = \"file:///d.bin\"\nglobal_batch = 8\nsync = \"{sync}\"\nsharding = \"{level}\"\n[checkpoint]\nurl = \"file:///ck\"\n"
                ))
                .unwrap_err()
                .to_string();
                assert!(
                    e.contains("training.sharding")
                        && e.contains("DiLoCo replica is one rank")
                        && e.contains("already shards its parameters and optimizer state"),
                    "{sync} {level}: {e}"
                );
            }
        }
    }

    /// Stages and tensor groups shard the optimizer state ("optimizer") and the summed
    /// gradients ("gradients") over their replicas, with logical tensor slices too, and count
    /// their memory alike (a stage accumulates its micro-batches' gradients whole); "full"
    /// runs under tensor groups (2D) and with stages (3D), refused where its layouts could
    /// not run it, with the reason.
    #[test]
    fn stages_and_tensor_groups_shard_the_state_the_gradients_and_the_parameters() {
        let with = |layout: &str, extra: &str| {
            JobSpec::from_toml(&format!(
                "name = \"a\"\nmin = 1\nmax = 8\ndesired = 8\n[training]\nmodel = \"gpt\"\ndataset = \"file:///d.bin\"\nglobal_batch = 8\n{layout}\n{extra}\n[checkpoint]\nurl = \"file:///ck\"\n"
            ))
        };
        let spec = |extra: &str| {
            with(
                "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 2",
                extra,
            )
        };
        let bytes = |level: &str| {
            spec(&format!(
                "sharding = \"{level}\"\ndeterministic = true\ntensor_slices = 2"
            ))
            .unwrap()
            .training
            .unwrap()
            .min_slot_bytes(8)
        };
        assert!(bytes("gradients").is_some());
        assert_eq!(bytes("gradients"), bytes("optimizer"));
        // "full" with stages and tensor groups (3D) too
        assert!(spec("sharding = \"full\"").is_ok());
        // "full" under tensor groups alone (2D FSDP + TP), deterministic mode included
        let two_d = |extra: &str| {
            with(
                "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1\nsharding = \"full\"",
                extra,
            )
        };
        assert!(two_d("").is_ok(), "{:?}", two_d("").err());
        let det = two_d("deterministic = true\ntensor_slices = 2\nlogical_shards = 8");
        assert!(det.is_ok(), "{:?}", det.err());
        for (extra, says) in [
            (
                "reshard_after_forward = false",
                "reshard_after_forward = false runs",
            ),
            ("shard_group = \"node\"", "give a number of replicas"),
        ] {
            let e = two_d(extra).unwrap_err().to_string();
            assert!(e.contains(says), "{extra}: {e}");
        }
        let staged = with(
            "strategy = \"pipeline\"\npipeline_parallel = 2",
            "sharding = \"full\"",
        );
        assert!(staged.is_ok(), "{:?}", staged.err());
        let e = with(
            "strategy = \"hybrid\"\npipeline_parallel = 2",
            "sharding = \"full\"",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("(stages alone: strategy = \"pipeline\")"), "{e}");
        // data parallel alone computes each unit whole under "gradients": no logical slices
        let e = with(
            "strategy = \"data-parallel\"",
            "sharding = \"gradients\"\ntensor_slices = 2",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("training.tensor_slices"), "{e}");
    }

    /// `reshard_after_forward` is full sharding's: accepted there (false: the memory model
    /// counts the whole parameters through the step, where resharding holds less than them),
    /// refused with any other level, naming the key.
    #[test]
    fn reshard_after_forward_is_full_sharding_s() {
        let spec = |extra: &str| {
            JobSpec::from_toml(&format!(
                "name = \"a\"\nmin = 1\nmax = 4\ndesired = 4\n[training]\nmodel = \"gpt\"\ndataset = \"file:///d.bin\"\nglobal_batch = 8\nmodel_config = {{ d_model = 256, n_layer = 8, n_head = 4, vocab = 1000 }}\n{extra}\n[checkpoint]\nurl = \"file:///ck\"\n"
            ))
        };
        let need = |extra: &str| {
            spec(extra)
                .unwrap()
                .training
                .unwrap()
                .min_slot_bytes(4)
                .unwrap()
        };
        let t = spec("sharding = \"full\"\nreshard_after_forward = false")
            .unwrap()
            .training
            .unwrap();
        assert_eq!(t.reshard_after_forward, Some(false));
        let params = t.approx_params().unwrap() as u64;
        let (resharded, kept) = (
            need("sharding = \"full\""),
            need("sharding = \"full\"\nreshard_after_forward = false"),
        );
        assert_eq!(
            need("sharding = \"full\"\nreshard_after_forward = true"),
            resharded
        );
        // (kept: the whole parameters through the step, on top of the rows)
        assert!(kept > resharded && kept > params * 4, "{kept} {resharded}");
        for level in ["none", "optimizer", "gradients", "auto"] {
            let e = spec(&format!(
                "sharding = \"{level}\"\nreshard_after_forward = false"
            ))
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("training.reshard_after_forward") && e.contains(level),
                "{e}"
            );
        }
    }

    /// `buddy_copies` is full sharding's and on by default there: `false` turns it off,
    /// another level with the key is refused, naming it.
    #[test]
    fn buddy_copies_are_full_sharding_s_and_on_by_default() {
        let spec = |extra: &str| {
            JobSpec::from_toml(&format!(
                "name = \"a\"\nmin = 1\nmax = 4\ndesired = 4\n[training]\nmodel = \"gpt\"\ndataset = \"file:///d.bin\"\nglobal_batch = 8\n{extra}\n[checkpoint]\nurl = \"file:///ck\"\n"
            ))
            .map(|s| s.training.unwrap())
        };
        assert!(spec("sharding = \"full\"").unwrap().keeps_buddy_copies());
        assert!(!spec("sharding = \"full\"\nbuddy_copies = false")
            .unwrap()
            .keeps_buddy_copies());
        assert!(!spec("sharding = \"optimizer\"")
            .unwrap()
            .keeps_buddy_copies());
        assert!(!spec("").unwrap().keeps_buddy_copies());
        for level in ["none", "optimizer", "gradients"] {
            let e = spec(&format!("sharding = \"{level}\"\nbuddy_copies = true"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("training.buddy_copies") && e.contains(level),
                "{e}"
            );
        }
    }

    /// Live state moves' chunk: a size in KiB between 1 and 4 GiB, the key named otherwise.
    #[test]
    fn a_transfer_chunk_is_a_size_in_kib() {
        let spec = |extra: &str| {
            JobSpec::from_toml(&format!(
                "name = \"a\"\nmin = 1\nmax = 2\ndesired = 2\n[training]\nmodel = \"gpt\"\ndataset = \"file:///d.bin\"\nglobal_batch = 8\n{extra}\n"
            ))
        };
        assert_eq!(spec("").unwrap().training.unwrap().transfer_chunk_kib, None);
        for k in [1u32, 65536, 4 << 20] {
            let t = spec(&format!("transfer_chunk_kib = {k}"))
                .unwrap()
                .training
                .unwrap();
            assert_eq!(t.transfer_chunk_kib, Some(k));
        }
        for k in ["0", "4194305"] {
            let e = spec(&format!("transfer_chunk_kib = {k}"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("training.transfer_chunk_kib") && e.contains(k),
                "{e}"
            );
        }
    }

    #[test]
    fn the_memory_model_counts_what_each_step_reduces() {
        let spec = |extra: &str| {
            JobSpec::from_toml(&format!(
                "name = \"a\"\nmin = 1\nmax = 2\ndesired = 2\n[training]\nmodel = \"mlp\"\ndataset = \"file:///d.bin\"\nglobal_batch = 8\noptimizer = \"adamw\"\nmodel_config = {{ hidden = 256, layers = 4 }}\n{extra}"
            ))
            .unwrap()
            .training
            .unwrap()
        };
        let p = (256 * 256 * 4 + 256 * 2 * 64) as u64;
        // bucketed data parallel: parameters, gradients, AdamW's two states, one bucket
        assert_eq!(spec("").min_slot_bytes(2), Some(p * 4 * 4 + (25 << 20)));
        assert_eq!(
            spec("bucket_mb = 1\n").min_slot_bytes(2),
            Some(p * 4 * 4 + (1 << 20))
        );
        // deterministic: one flat copy per logical shard a rank folds at max ranks
        assert_eq!(
            spec("deterministic = true\nlogical_shards = 8\n").min_slot_bytes(2),
            Some(p * 4 * 8)
        );
        // a pipelined job: one flat copy, split over max ranks
        assert_eq!(
            spec("strategy = \"pipeline\"\n").min_slot_bytes(2),
            Some(p * 4 * 5 / 2)
        );
        // sharded over its replicas: the same least (two stages of one replica each); so with
        // "auto", which the planner makes concrete layout by layout
        for sharding in ["optimizer", "auto"] {
            assert_eq!(
                spec(&format!("strategy = \"pipeline\"\nsharding = \"{sharding}\"\n[checkpoint]\nurl = \"file:///ck\"\n"))
                    .min_slot_bytes(2),
                Some(p * 4 * 5 / 2)
            );
        }
        // "auto" before submit makes it concrete: the least it may become (data parallel:
        // fully sharded)
        let ck = "\n[checkpoint]\nurl = \"file:///ck\"\n";
        assert_eq!(
            spec(&format!("sharding = \"auto\"{ck}")).min_slot_bytes(2),
            spec(&format!("sharding = \"full\"{ck}")).min_slot_bytes(2)
        );
        // ZeRO-1 at max 2: AdamW's two states halved; in groups of 1, whole
        assert_eq!(
            spec(&format!("sharding = \"optimizer\"{ck}")).min_slot_bytes(2),
            Some(p * 4 * 3 + (25 << 20))
        );
        assert_eq!(
            spec(&format!("sharding = \"optimizer\"\nshard_group = 1{ck}")).min_slot_bytes(2),
            Some(p * 4 * 4 + (25 << 20))
        );
        // ZeRO-2 and full sharding hold a unit whole at a time: the largest (a hidden layer,
        // 256 × 256), not the average of the model's
        let unit = 256 * 256 * 4;
        assert_eq!(
            spec(&format!("sharding = \"gradients\"{ck}")).min_slot_bytes(2),
            Some(p * 4 + p * 4 * 2 / 2 + 2 * unit)
        );
        assert_eq!(
            spec(&format!("sharding = \"full\"{ck}")).min_slot_bytes(2),
            Some(p * 4 / 2 + p * 4 * 2 / 2 + 4 * unit)
        );
    }

    /// A GPT whose vocabulary makes its embeddings the largest unit: full sharding's figure
    /// counts them, where the average unit would count a sixth of them.
    #[test]
    fn the_memory_model_gathers_the_largest_unit() {
        let t = JobSpec::from_toml(
            "name = \"a\"\nmin = 4\nmax = 4\ndesired = 4\n[training]\nmodel = \"gpt\"\ndataset = \"file:///d.bin\"\nglobal_batch = 8\nsharding = \"full\"\nmodel_config = { d_model = 256, n_layer = 4, n_head = 4, ctx = 64, vocab = 50000 }\n[checkpoint]\nurl = \"file:///ck\"\n",
        )
        .unwrap()
        .training
        .unwrap();
        let p = t.approx_params().unwrap() as u64;
        let embed = (50000 + 64) * 256;
        assert_eq!(t.approx_largest_unit(), Some(embed));
        // (the average unit, what the figure used to count, is under half of it)
        let units = t.gpt_config().unwrap().n_layer as u64 + 2;
        assert!(embed > 2 * p / units);
        // rows of parameters and AdamW's two states over 4 ranks, four units' worth whole
        assert_eq!(
            t.min_slot_bytes(4),
            Some((p * 4).div_ceil(4) + (p * 4 * 2).div_ceil(4) + 4 * embed * 4)
        );
    }

    /// `sharding = "auto"`: the least sharding whose state fits the slot at the job's fewest
    /// ranks; full (with the reason) when nothing fits; none when no slot's memory is known.
    #[test]
    fn auto_sharding_takes_the_least_that_fits() {
        let spec = || {
            JobSpec::from_toml(
                "name = \"a\"\nmin = 4\nmax = 4\ndesired = 4\n[training]\nmodel = \"gpt\"\ndataset = \"file:///d.bin\"\nglobal_batch = 8\nsharding = \"auto\"\nmodel_config = { d_model = 256, n_layer = 8, n_head = 4, vocab = 1000 }\n[checkpoint]\nurl = \"file:///ck\"\n",
            )
            .unwrap()
            .training
            .unwrap()
        };
        let need = |s: Sharding| {
            let mut t = spec();
            t.sharding = s;
            t.min_slot_bytes(4).unwrap()
        };
        let (none, opt, grads, full) = (
            need(Sharding::None),
            need(Sharding::Optimizer),
            need(Sharding::Gradients),
            need(Sharding::Full),
        );
        assert!(
            none > opt && opt > grads && grads > full,
            "{none} {opt} {grads} {full}"
        );
        for (cap, want) in [
            (Some(none), Sharding::None),
            (Some(none - 1), Sharding::Optimizer),
            (Some(opt - 1), Sharding::Gradients),
            (Some(grads - 1), Sharding::Full),
            (None, Sharding::None),
        ] {
            let mut t = spec();
            let said = t.resolve_auto_sharding(4, 4, cap).unwrap();
            assert_eq!(t.sharding, want, "{cap:?}: {said}");
            assert!(said.contains(&format!("chose \"{want}\"")), "{said}");
        }
        let mut t = spec();
        let said = t.resolve_auto_sharding(4, 4, Some(full - 1)).unwrap();
        assert_eq!(t.sharding, Sharding::Full);
        assert!(said.contains("even fully sharded"), "{said}");
        // an elastic job: the least level that fits at its min too (a rank holds the most at
        // the fewest ranks), so a shrink does not outgrow the slot
        let at = |s: Sharding, w: u32| {
            let mut t = spec();
            t.sharding = s;
            t.min_slot_bytes(w).unwrap()
        };
        assert!(at(Sharding::Full, 2) > at(Sharding::Full, 4));
        let cap = at(Sharding::Full, 2);
        assert!(cap >= at(Sharding::Gradients, 4) && cap < at(Sharding::Gradients, 2));
        let mut t = spec();
        let said = t.resolve_auto_sharding(2, 4, Some(cap)).unwrap();
        assert_eq!(t.sharding, Sharding::Full, "{said}");
        assert!(said.contains("from 2 rank(s) (the job's min) up"), "{said}");
        // at 4 alone ZeRO-2 would have fitted
        let mut t = spec();
        t.resolve_auto_sharding(4, 4, Some(cap)).unwrap();
        assert_eq!(t.sharding, Sharding::Gradients);
        // where no level fits at the min, the least that fits at the max, saying so
        let mut t = spec();
        let said = t
            .resolve_auto_sharding(1, 4, Some(at(Sharding::Gradients, 4)))
            .unwrap();
        assert_eq!(t.sharding, Sharding::Gradients, "{said}");
        assert!(
            said.contains("no level fits at the job's min of 1"),
            "{said}"
        );
        // a concrete choice is left as it is
        let mut t = spec();
        t.sharding = Sharding::Optimizer;
        assert_eq!(t.resolve_auto_sharding(4, 4, Some(1)), None);
        // strategy = "auto": sharded data parallelism where a level fits, before the
        // planner's pipeline and tensor layouts; unsharded and planned where none does
        let planned = || {
            JobSpec::from_toml(
                "name = \"a\"\nmin = 4\nmax = 4\ndesired = 4\n[training]\nmodel = \"gpt\"\ndataset = \"file:///d.bin\"\nglobal_batch = 8\nstrategy = \"auto\"\nsharding = \"auto\"\nmodel_config = { d_model = 256, n_layer = 8, n_head = 4, vocab = 1000 }\n[checkpoint]\nurl = \"file:///ck\"\n",
            )
            .unwrap()
            .training
            .unwrap()
        };
        for (cap, want, strategy) in [
            (none, Sharding::None, Strategy::Auto),
            (grads - 1, Sharding::Full, Strategy::DataParallel),
            (opt - 1, Sharding::Gradients, Strategy::DataParallel),
            (full - 1, Sharding::None, Strategy::Auto),
        ] {
            let mut t = planned();
            let said = t.resolve_auto_sharding(4, 4, Some(cap)).unwrap();
            assert_eq!((t.sharding, t.strategy), (want, strategy), "{cap}: {said}");
            t.validate(4).unwrap();
        }
        let mut t = planned();
        let said = t.resolve_auto_sharding(4, 4, Some(full - 1)).unwrap();
        assert!(
            said.contains("pipeline or tensor layouts instead"),
            "{said}"
        );
        // stages and tensor groups: left to the planner, layout by layout, against the slot's
        // memory (the spec's, else the one given, kept in the spec)
        let staged = |extra: &str| {
            JobSpec::from_toml(&format!(
                "name = \"a\"\nmin = 4\nmax = 4\ndesired = 4\n[training]\nmodel = \"gpt\"\ndataset = \"file:///d.bin\"\nglobal_batch = 8\nstrategy = \"hybrid\"\nsharding = \"auto\"\n{extra}\n[checkpoint]\nurl = \"file:///ck\"\n",
            ))
        };
        let mut t = staged("").unwrap().training.unwrap();
        let said = t.resolve_auto_sharding(4, 4, Some(3 << 30)).unwrap();
        assert_eq!(
            (t.sharding, t.memory_per_slot_gib),
            (Sharding::Auto, Some(3.0))
        );
        assert!(
            said.contains("whole where they fit 3.00 GiB per slot"),
            "{said}"
        );
        t.validate(4).unwrap();
        let mut t = staged("memory_per_slot_gib = 1.5")
            .unwrap()
            .training
            .unwrap();
        t.resolve_auto_sharding(4, 4, Some(3 << 30)).unwrap();
        assert_eq!(t.memory_per_slot_gib, Some(1.5));
        let mut t = staged("").unwrap().training.unwrap();
        let said = t.resolve_auto_sharding(4, 4, None).unwrap();
        assert!(said.contains("no slot's memory is known"), "{said}");
        // (a node's ranks are not a stage's replicas)
        let err = staged("shard_group = \"node\"").unwrap_err().to_string();
        assert!(err.contains("training.shard_group"), "{err}");
    }

    #[test]
    fn a_shard_group_is_a_number_of_ranks_or_the_node() {
        let t = |v: &str| -> std::result::Result<TrainingSpec, String> {
            serde_json::from_str(&format!(
                r#"{{"model":"gpt","dataset":"file:///d","global_batch":8,"sharding":"full","shard_group":{v}}}"#
            ))
            .map_err(|e| e.to_string())
        };
        assert_eq!(t("2").unwrap().shard_group, Some(ShardGroup::Ranks(2)));
        assert_eq!(t("\"node\"").unwrap().shard_group, Some(ShardGroup::Node));
        let e = t("\"nodes\"").unwrap_err();
        assert!(
            e.contains("\"nodes\" is neither a number of ranks nor \"node\""),
            "{e}"
        );
        // written back as given
        let v = serde_json::to_value(t("\"node\"").unwrap()).unwrap();
        assert_eq!(v["shard_group"], "node");
        // within every node: 4 + 4 → 4; 4 + 2 → 2; 3 + 2 → 1
        assert_eq!(ShardGroup::Node.size([4, 4]), 4);
        assert_eq!(ShardGroup::Node.size([4, 2]), 2);
        assert_eq!(ShardGroup::Node.size([3, 2]), 1);
        assert_eq!(ShardGroup::Ranks(2).size([3, 2]), 2);
    }

    #[test]
    fn a_shard_group_that_does_not_divide_max_is_refused_naming_it() {
        let t = |max: u32, g: u32| {
            let spec: TrainingSpec = serde_json::from_str(&format!(
                r#"{{"model":"mlp","dataset":"file:///d","global_batch":8,"sharding":"optimizer","shard_group":{g}}}"#
            ))
            .unwrap();
            spec.validate(max)
        };
        let err = t(4, 3).unwrap_err().to_string();
        assert!(
            err.contains("training.shard_group")
                && err.contains("3 does not divide the job's max size 4"),
            "{err}"
        );
        assert!(t(4, 2).is_ok() && t(6, 3).is_ok() && t(4, 4).is_ok());
    }

    #[test]
    fn a_sharded_layout_takes_whole_shard_groups_and_says_so() {
        assert_eq!(Layout::sharded(4, 4).to_string(), "dp4(shard4)×pp1×tp1");
        assert_eq!(Layout::sharded(4, 2).to_string(), "dp4(shard2)×pp1×tp1");
        // 3 ranks in groups of up to 2: groups of 1, nothing sharded
        assert_eq!(Layout::sharded(3, 2).dp_shard, 1);
        assert_eq!(Layout::sharded(6, 4).dp_shard, 3);
        assert_eq!(Layout::sharded(1, 8).to_string(), "dp1×pp1×tp1");
        // an unsharded layout's record is unchanged (no dp_shard key)
        let j = serde_json::to_string(&Layout::data_parallel(2)).unwrap();
        assert!(!j.contains("dp_shard"), "{j}");
        let back: Layout = serde_json::from_str(&j).unwrap();
        assert_eq!(back.dp_shard, 1);
    }

    #[test]
    fn command_defaults_to_the_worker() {
        let s = JobSpec::from_toml("name = \"a\"\nmin = 1\nmax = 2\ndesired = 2\n").unwrap();
        assert_eq!(s.command, vec!["ductile-worker".to_string()]);
    }

    fn err(text: &str) -> String {
        JobSpec::from_toml(text).unwrap_err().to_string()
    }

    #[test]
    fn bad_specs_name_the_field() {
        let base = "name = \"a\"\nmin = 1\nmax = 2\ndesired = 2\n";
        assert!(err(&format!("{base}colour = 3\n")).contains("unknown field `colour`"));
        assert!(err("name = \"a\"\nmin = 2\nmax = 1\ndesired = 1\n").contains("invalid max"));
        assert!(
            err("name = \"a\"\nmin = 1\nmax = 4000000000\ndesired = 1\n").contains("invalid max")
        );
        assert!(err("name = \"a\"\nmin = 1\nmax = 2\ndesired = 5\n").contains("invalid desired"));
        assert!(err("name = \"a b\"\nmin = 1\nmax = 2\ndesired = 2\n").contains("invalid name"));
        assert!(err("name = \"a\"\nmin = 1\nmax = 2\n").contains("missing field `desired`"));
        assert!(err("name = \"a\"\nmin = 1\nmax = 2\ndesired = \"two\"\n").contains("line 4"));
        let t = |extra: &str| {
            format!("{base}[training]\nmodel = \"gpt\"\ndataset = \"file:///d\"\nglobal_batch = 8\n{extra}")
        };
        assert!(JobSpec::from_toml(&t("")).is_ok());
        assert!(err(&t("").replace("gpt", "resnet")).contains("training.model"));
        assert!(err(&t("").replace("global_batch = 8", "global_batch = 1"))
            .contains("training.global_batch"));
        assert!(err(&t("").replace("file:///d", "/d")).contains("training.dataset"));
        // one op timeout for every backend: seconds, bounded; async cannot ask for NCCL
        assert!(JobSpec::from_toml(&t("comm_timeout_s = 600\n")).is_ok());
        assert!(err(&t("comm_timeout_s = 0\n")).contains("training.comm_timeout_s"));
        assert!(err(&t("comm_timeout_s = 100000\n")).contains("training.comm_timeout_s"));
        let e = err(&t("sync = \"async\"\ncomm = \"nccl\"\n").replace("gpt", "mlp"));
        assert!(e.contains("training.sync") && e.contains("NCCL"), "{e}");
        // what NCCL cannot run yet is refused when asked for explicitly (auto picks TCP there)
        let e = err(&t("strategy = \"pipeline\"\ncomm = \"nccl\"\n"));
        assert!(e.contains("training.comm") && e.contains("pipeline"), "{e}");
        assert!(JobSpec::from_toml(&t("strategy = \"pipeline\"\ncomm = \"auto\"\n")).is_ok());
        assert!(JobSpec::from_toml(&t(
            "strategy = \"pipeline\"\npipeline_parallel = 1\ncomm = \"nccl\"\n"
        ))
        .is_ok());
        // model_config is typed per model: unknown keys, zero heads, a d_model that does not
        // split into heads and absurd sizes are refused, naming the field
        let mc = |m: &str| t(&format!("[training.model_config]\n{m}\n"));
        assert!(JobSpec::from_toml(&mc("d_model = 128\nn_head = 8\nctx = 64")).is_ok());
        assert!(err(&mc("n_heads = 4")).contains("unknown field `n_heads`"));
        assert!(err(&mc("n_head = 0")).contains("training.model_config.n_head"));
        assert!(err(&mc("d_model = 100\nn_head = 3")).contains("does not divide"));
        assert!(err(&mc("d_model = 65536\nn_layer = 1024")).contains("parameters"));
        assert!(err(&mc("ctx = -1")).contains("training.model_config.ctx"));
        assert!(err(&mc("hidden = 3")).contains("unknown field `hidden`"));
        let mlp = |m: &str| mc(m).replace("model = \"gpt\"", "model = \"mlp\"");
        assert!(JobSpec::from_toml(&mlp("hidden = 32\nlayers = 0")).is_ok());
        assert!(err(&mlp("hidden = 0")).contains("training.model_config.hidden"));
        assert!(err(&mlp("n_head = 2")).contains("unknown field `n_head`"));
        assert!(
            err(&format!("{base}[checkpoint]\nurl = \"http://x\"\n")).contains("checkpoint.url")
        );
        // bf16 products are for the Hugging Face models; recomputation for transformer blocks
        assert!(JobSpec::from_toml(&t("activation_checkpointing = \"full\"\n")).is_ok());
        assert!(err(&t("precision = \"bf16\"\n")).contains("training.precision"));
        assert!(err(&t("precision = \"fp16\"\n")).contains("\"fp16\" is unknown"));
        let e = err(&t("activation_checkpointing = \"full\"\n").replace("gpt", "mlp"));
        assert!(e.contains("training.activation_checkpointing"), "{e}");
        assert!(err(&t("activation_checkpointing = \"selective\"\n")).contains("is unknown"));
        // the eval split: one source, a cadence that has one, synchronous jobs, token models
        assert!(JobSpec::from_toml(&t(
            "eval_fraction = 0.05\neval_every = 10\neval_samples = 64\n"
        ))
        .is_ok());
        assert!(
            JobSpec::from_toml(&t("eval_dataset = \"s3://b/eval/\"\neval_every = 10\n")).is_ok()
        );
        let e = err(&t("eval_dataset = \"s3://b/e\"\neval_fraction = 0.1\n"));
        assert!(
            e.contains("training.eval_fraction") && e.contains("not both"),
            "{e}"
        );
        assert!(err(&t("eval_fraction = 1.0\n")).contains("must be in (0, 1)"));
        assert!(err(&t("eval_dataset = \"/e\"\n")).contains("training.eval_dataset"));
        let e = err(&t("eval_every = 10\n"));
        assert!(
            e.contains("training.eval_every") && e.contains("held-out split"),
            "{e}"
        );
        assert!(err(&t("eval_fraction = 0.1\neval_every = 0\n")).contains("at least 1"));
        assert!(
            err(&t("eval_fraction = 0.1\neval_samples = 0\n")).contains("training.eval_samples")
        );
        let e = err(&t(
            "eval_fraction = 0.1\neval_every = 5\nsync = \"diloco\"\n",
        ));
        assert!(e.contains("synchronous training"), "{e}");
        let e = err(&t("eval_fraction = 0.1\n").replace("gpt", "mlp"));
        assert!(e.contains("token models"), "{e}");
    }
}

#[cfg(test)]
mod policy_tests {
    use super::*;

    fn spec(extra: &str) -> JobSpec {
        JobSpec::from_toml(&format!(
            "name = \"p\"\nmin = 1\nmax = 1\ndesired = 1\n{extra}"
        ))
        .unwrap()
    }

    /// A torchrun job under restricted commands: its interpreter must be allowed, its script
    /// under allowed_paths (absolute, or relative inside a checked workdir), no inline code;
    /// its checkpoint_url and workdir are locations like any other.
    #[test]
    fn a_torchrun_job_s_program_and_paths_are_checked() {
        let p = AgentPolicy {
            allowed_commands: vec!["/v/bin/python3".into()],
            allowed_paths: vec!["/srv/jobs".into()],
            ..AgentPolicy::default()
        };
        let job = |command: &str, torchrun: &str| {
            spec(&format!(
                "runtime = \"torchrun\"\ncommand = {command}\n[torchrun]\n{torchrun}"
            ))
        };
        let ok = |c: &str, t: &str| p.check(&job(c, t));
        assert_eq!(
            ok(r#"["/v/bin/python3", "/srv/jobs/t.py", "--x", "1"]"#, ""),
            Ok(())
        );
        assert_eq!(
            ok(r#"["/v/bin/python3", "t.py"]"#, "workdir = \"/srv/jobs/a\""),
            Ok(())
        );
        let refused = |c: &str, t: &str, field: &str, why: &str| {
            let (f, w) = ok(c, t).unwrap_err();
            assert_eq!(f, field, "{w}");
            assert!(w.contains(why), "{w}");
        };
        // modules: none unless the operator allows them
        refused(
            r#"["/v/bin/python3", "-m", "pkg.train"]"#,
            "",
            "command[2]",
            "allowed_modules",
        );
        let with_modules = AgentPolicy {
            allowed_modules: vec!["pkg.*".into(), "torch.distributed.run".into()],
            ..p.clone()
        };
        for c in [
            r#"["/v/bin/python3", "-m", "pkg.train"]"#,
            r#"["/v/bin/python3", "-u", "-mtorch.distributed.run", "/srv/jobs/t.py"]"#,
        ] {
            assert_eq!(with_modules.check(&job(c, "")), Ok(()), "{c}");
        }
        let (f, w) = with_modules
            .check(&job(
                r#"["/v/bin/python3", "-m", "timeit", "import os"]"#,
                "",
            ))
            .unwrap_err();
        assert_eq!(f, "command[2]");
        assert!(
            w.contains("\"timeit\" (-m) is not in the agent's allowed_modules"),
            "{w}"
        );
        // inline code in every form CPython takes it (what a hostile tenant tried)
        for (c, field) in [
            (r#"["/v/bin/python3", "-cimport os"]"#, "command[1]"),
            (r#"["/v/bin/python3", "-Ic", "import os"]"#, "command[1]"),
            (
                r#"["/v/bin/python3", "-u", "-BIc", "import os"]"#,
                "command[2]",
            ),
            (
                r#"["/v/bin/python3", "-W", "ignore", "-c", "x"]"#,
                "command[3]",
            ),
        ] {
            refused(c, "", field, "inline Python (-c)");
        }
        refused(
            r#"["/v/bin/python3", "-"]"#,
            "",
            "command[1]",
            "standard input",
        );
        refused(
            r#"["/v/bin/python3", "-u"]"#,
            "",
            "command[1]",
            "standard input",
        );
        refused(
            r#"["/v/bin/python3", "-Wignore::evil.Warning", "/srv/jobs/t.py"]"#,
            "",
            "command[1]",
            "imports that module",
        );
        refused(
            r#"["/v/bin/python3", "-Z", "/srv/jobs/t.py"]"#,
            "",
            "command[1]",
            "not an option",
        );
        // the script after options is the one checked; arguments after it are the script's
        assert_eq!(
            ok(
                r#"["/v/bin/python3", "-u", "-W", "ignore", "/srv/jobs/t.py", "-c", "x"]"#,
                ""
            ),
            Ok(())
        );
        refused(
            r#"["/v/bin/python3", "-u", "/opt/t.py"]"#,
            "",
            "command[2]",
            "outside",
        );
        refused(
            r#"["/v/bin/python3", "/srv/jobs/t.py"]"#,
            "grace_s = 3000",
            "program.grace_s",
            "max_grace_s",
        );
        refused(
            r#"["python3", "/srv/jobs/t.py"]"#,
            "",
            "command",
            "allowed_commands",
        );
        refused(
            r#"["/v/bin/python3", "/opt/t.py"]"#,
            "",
            "command[1]",
            "outside",
        );
        refused(
            r#"["/v/bin/python3", "-c", "import os"]"#,
            "",
            "command[1]",
            "inline Python",
        );
        refused(
            r#"["/v/bin/python3", "t.py"]"#,
            "",
            "command[1]",
            "program.workdir",
        );
        refused(
            r#"["/v/bin/python3", "../t.py"]"#,
            "workdir = \"/srv/jobs\"",
            "command[1]",
            "inside program.workdir",
        );
        refused(
            r#"["/v/bin/python3", "t.py"]"#,
            "workdir = \"/home/u\"",
            "program.workdir",
            "outside",
        );
        refused(
            r#"["/v/bin/python3", "/srv/jobs/t.py"]"#,
            "checkpoint_url = \"file:///tmp/c\"",
            "program.checkpoint_url",
            "outside",
        );
    }

    /// A model directory is a location like any other: the daemon reads it at submit, so a
    /// `model_path` outside the allow-lists is refused before anything is read there.
    #[test]
    fn a_model_path_is_checked_against_the_allow_lists() {
        let p = AgentPolicy {
            allowed_s3_prefixes: vec!["s3://models/ok".into()],
            ..AgentPolicy::default()
        };
        let hf = |path: &str| {
            let mut s = spec("[training]\nmodel = \"mlp\"\ndataset = \"file:///var/lib/ductile/d.bin\"\nglobal_batch = 8\n");
            s.training.as_mut().unwrap().model_path = Some(path.into());
            s
        };
        assert_eq!(p.check(&hf("file:///var/lib/ductile/models/smol")), Ok(()));
        assert_eq!(p.check(&hf("s3://models/ok/smol")), Ok(()));
        for (path, why) in [
            ("file:///etc/ductile", "outside the agent's allowed_paths"),
            ("/root/.aws", "outside the agent's allowed_paths"),
            (
                "s3://other-tenant/model",
                "outside the agent's allowed_s3_prefixes",
            ),
            ("file:///var/lib/ductile/../../etc", "without . or .."),
        ] {
            let (f, w) = p.check(&hf(path)).unwrap_err();
            assert_eq!(f, "training.model_path", "{path}");
            assert!(w.contains(why), "{path}: {w}");
        }
    }

    /// At spawn the real paths count: a script or workdir under an allowed root that is a
    /// symlink to elsewhere is refused; `allowed_code_paths`, when set, is where code must lie.
    #[test]
    fn a_program_s_real_paths_are_checked_at_spawn() {
        let base = std::env::temp_dir().join(format!("ductile-realpath-{}", std::process::id()));
        let (jobs, code, outside) = (base.join("jobs"), base.join("code"), base.join("outside"));
        for d in [&jobs, &code, &outside] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(outside.join("evil.py"), "").unwrap();
        std::fs::write(code.join("t.py"), "").unwrap();
        std::fs::write(jobs.join("w.py"), "").unwrap();
        std::os::unix::fs::symlink(outside.join("evil.py"), jobs.join("t.py")).unwrap();
        std::os::unix::fs::symlink(&outside, jobs.join("wd")).unwrap();
        let p = AgentPolicy {
            allowed_commands: vec!["/v/bin/python3".into()],
            allowed_paths: vec![jobs.display().to_string()],
            ..AgentPolicy::default()
        };
        let job = |command: String, workdir: Option<&std::path::Path>| {
            let w = workdir
                .map(|w| format!("workdir = {:?}\n", w.display().to_string()))
                .unwrap_or_default();
            spec(&format!(
                "runtime = \"torchrun\"\ncommand = [\"/v/bin/python3\", {command:?}]\n[torchrun]\n{w}"
            ))
        };
        let s = job(jobs.join("w.py").display().to_string(), None);
        assert_eq!(p.check(&s), Ok(()));
        assert_eq!(p.check_real_paths(&s), Ok(()));
        // the text is under the root, the file is not
        let link = job(jobs.join("t.py").display().to_string(), None);
        assert_eq!(p.check(&link), Ok(()));
        let (f, w) = p.check_real_paths(&link).unwrap_err();
        assert_eq!(f, "command[1]");
        assert!(
            w.contains("evil.py") && w.contains("outside the agent's allowed_paths"),
            "{w}"
        );
        let wd = job("evil.py".into(), Some(&jobs.join("wd")));
        assert_eq!(p.check(&wd), Ok(()));
        assert_eq!(p.check_real_paths(&wd).unwrap_err().0, "program.workdir");
        // code roots apart from data roots
        let split = AgentPolicy {
            allowed_paths: vec![jobs.display().to_string(), code.display().to_string()],
            allowed_code_paths: vec![code.display().to_string()],
            ..p.clone()
        };
        let (f, w) = split
            .check_real_paths(&job(jobs.join("w.py").display().to_string(), None))
            .unwrap_err();
        assert_eq!(f, "command[1]");
        assert!(w.contains("allowed_code_paths"), "{w}");
        assert!(split
            .check_real_paths(&job(code.join("t.py").display().to_string(), None))
            .is_ok());
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// A torchft job: its program, `[torchrun]` for how it is run, `[torchft]` for its groups,
    /// whose size divides the job's sizes.
    #[test]
    fn a_torchft_spec_is_validated() {
        let job = |sizes: &str, extra: &str| {
            JobSpec::from_toml(&format!(
                "name = \"f\"\n{sizes}\nruntime = \"torchft\"\ncommand = [\"python3\", \"/t.py\"]\n{extra}"
            ))
        };
        let ok = job(
            "min = 2\nmax = 6\ndesired = 4",
            "[torchrun]\ngrace_s = 5\n[torchft]\ngroup_size = 2\n",
        )
        .unwrap();
        assert_eq!(
            (ok.torchft_group_size(), ok.torchrun_settings().grace_s),
            (2, 5)
        );
        assert!(ok.runtime.runs_program());
        let none = job("min = 1\nmax = 3\ndesired = 3", "").unwrap();
        assert_eq!(none.torchft_group_size(), 0);
        let e = job(
            "min = 2\nmax = 6\ndesired = 3",
            "[torchft]\ngroup_size = 2\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("desired") && e.contains("multiple of torchft.group_size"),
            "{e}"
        );
        let e = JobSpec::from_toml(
            "name = \"f\"\nmin = 1\nmax = 1\ndesired = 1\nruntime = \"torchft\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("runtime = \"torchft\" job runs its own program"),
            "{e}"
        );
        let e = job("min = 1\nmax = 1\ndesired = 1", "[torchft]\ngroups = 2\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field"), "{e}");
        let e = JobSpec::from_toml("name = \"f\"\nmin = 1\nmax = 1\ndesired = 1\nruntime = \"torchrun\"\ncommand = [\"python3\", \"/t.py\"]\n[torchft]\ngroup_size = 1\n").unwrap_err().to_string();
        assert!(e.contains("is for runtime = \"torchft\""), "{e}");
    }

    /// `runtime` and its section agree; a torchrun job names its program and leaves
    /// `[training]` and `[checkpoint]` to the built-in trainer.
    #[test]
    fn a_torchrun_spec_is_validated() {
        let err = |extra: &str| {
            JobSpec::from_toml(&format!(
                "name = \"p\"\nmin = 1\nmax = 1\ndesired = 1\n{extra}"
            ))
            .unwrap_err()
            .to_string()
        };
        let t = spec("runtime = \"torchrun\"\ncommand = [\"python3\", \"/t.py\"]\n");
        assert_eq!(t.torchrun_settings(), TorchrunSpec::default());
        assert_eq!(
            (
                t.torchrun_settings().grace_s,
                t.torchrun_settings().warm_start
            ),
            (30, true)
        );
        assert!(err("runtime = \"torchrun\"\n").contains("not ductile-worker"));
        assert!(err("runtime = \"torch\"\n").contains("\"torchrun\""));
        assert!(err("[torchrun]\ngrace_s = 1\n").contains("is for runtime = \"torchrun\""));
        let tr = "runtime = \"torchrun\"\ncommand = [\"python3\", \"/t.py\"]\n";
        assert!(err(&format!(
            "{tr}[training]\nmodel = \"mlp\"\ndataset = \"file:///d\"\nglobal_batch = 8\n"
        ))
        .contains("trains itself"));
        // one checkpoint key: a program job's [checkpoint] url is handed to its program
        let one = spec(&format!("{tr}[checkpoint]\nurl = \"file:///c\"\n"));
        assert_eq!(
            (
                one.checkpoint.as_ref(),
                one.torchrun_settings().checkpoint_url.as_deref()
            ),
            (None, Some("file:///c"))
        );
        assert!(err(&format!(
            "{tr}[checkpoint]\nurl = \"file:///c\"\ninterval = 5\n"
        ))
        .contains("holds only url"));
        assert!(err(&format!(
            "{tr}[checkpoint]\nurl = \"file:///c\"\n[program]\ncheckpoint_url = \"file:///d\"\n"
        ))
        .contains("differ"));
        // [torchrun] is [program]'s older name: still read, and said
        let (old, notes) = JobSpec::from_toml_noting(&format!(
            "name = \"j\"\nmin = 1\nmax = 1\ndesired = 1\n{tr}[torchrun]\ngrace_s = \"1m\"\ncheckpoint_url = \"file:///c\"\n"
        ))
        .unwrap();
        assert_eq!(old.torchrun_settings().grace_s, 60);
        assert!(
            notes
                .iter()
                .any(|n| n.contains("[torchrun] is now [program]")),
            "{notes:?}"
        );
        assert!(
            notes.iter().any(|n| n.contains("write [checkpoint] url")),
            "{notes:?}"
        );
        // on the wire, the name every release reads
        let wire = serde_json::to_value(&old).unwrap();
        assert!(
            wire.get("torchrun").is_some() && wire.get("program").is_none(),
            "{wire}"
        );
        assert_eq!(
            JobSpec::from_json(wire.to_string().as_bytes()).unwrap(),
            old
        );
        // shown as written today, and read back to the same spec
        let shown = old.to_toml().unwrap();
        assert!(
            shown.contains("[program]")
                && shown.contains("[checkpoint]")
                && !shown.contains("torchrun]"),
            "{shown}"
        );
        assert_eq!(JobSpec::from_toml(&shown).unwrap(), old);
        assert!(err(&format!(
            "{tr}[program]\ngrace_s = 1\n[torchrun]\ngrace_s = 2\n"
        ))
        .contains("duplicate"));
        assert!(err(&format!("{tr}[torchrun]\nworkdir = \"rel\"\n")).contains("absolute"));
        assert!(err(&format!("{tr}[torchrun]\ncheckpoint_url = \"/c\"\n")).contains("s3://"));
        assert!(err(&format!("{tr}[torchrun]\ngrace = 3\n")).contains("unknown field"));
        // a tf job: its program, the [torchrun] section's settings; Keras' integration, not
        // the PyTorch Trainer's; no [training] or [torchft]
        let tf = "runtime = \"tf\"\ncommand = [\"python3\", \"/t.py\"]\n";
        let ok = spec(&format!(
            "{tf}[torchrun]\nintegrations = [\"keras\"]\ngrace_s = 3\n"
        ));
        assert!(ok.runtime.runs_program());
        assert_eq!(ok.torchrun_settings().integrations, ["keras"]);
        assert!(err(&format!(
            "{tf}[torchrun]\nintegrations = [\"transformers\"]\n"
        ))
        .contains("\"keras\""));
        assert!(err(&format!(
            "{tf}[training]\nmodel = \"mlp\"\ndataset = \"file:///d\"\nglobal_batch = 8\n"
        ))
        .contains("trains itself"));
        assert!(err(&format!("{tf}[torchft]\ngroup_size = 1\n")).contains("runtime = \"torchft\""));
        assert!(err("runtime = \"tf\"\n").contains("not ductile-worker"));
        assert_eq!(
            python_script(&["python3".into(), "-u".into(), "a.py".into()]),
            Some("a.py")
        );
        assert_eq!(
            python_script(&["python3".into(), "-m".into(), "m".into()]),
            None
        );
        assert!(is_python("/v/bin/python3.11") && !is_python("pythonic"));
    }

    #[test]
    fn the_default_policy_runs_the_worker_under_its_root_and_nothing_else() {
        let p = AgentPolicy::default();
        let train = |url: &str| {
            spec(&format!(
                "[training]\nmodel = \"mlp\"\ndataset = \"{url}\"\nglobal_batch = 8\n"
            ))
        };
        assert_eq!(p.check(&spec("")), Ok(()));
        assert_eq!(
            p.check(&train("file:///var/lib/ductile/data/x.bin")),
            Ok(())
        );
        assert_eq!(p.check(&train("s3://bucket/x.bin")), Ok(()));
        // a sibling that merely shares the prefix is outside
        let (field, why) = p
            .check(&train("file:///var/lib/ductile2/x.bin"))
            .unwrap_err();
        assert_eq!(field, "training.dataset");
        assert!(why.contains("outside the agent's allowed_paths"), "{why}");
        let (_, why) = p
            .check(&train("file:///var/lib/ductile/../../etc/shadow"))
            .unwrap_err();
        assert!(why.contains("without . or .."), "{why}");
        // a held-out dataset is checked as the dataset is (a prefix of shards too)
        let with_eval = |url: &str| {
            spec(&format!(
                "[training]\nmodel = \"gpt\"\ndataset = \"file:///var/lib/ductile/data/corpus/\"\neval_dataset = \"{url}\"\nglobal_batch = 8\n"
            ))
        };
        assert_eq!(
            p.check(&with_eval("file:///var/lib/ductile/data/eval/")),
            Ok(())
        );
        let (field, why) = p.check(&with_eval("file:///etc/eval/")).unwrap_err();
        assert_eq!(field, "training.eval_dataset");
        assert!(why.contains("outside the agent's allowed_paths"), "{why}");
        let (field, _) = p.check(&spec("command = [\"sh\"]\n")).unwrap_err();
        assert_eq!(field, "command");
        let (field, _) = p
            .check(&spec("env = { LD_LIBRARY_PATH = \"/tmp\" }\n"))
            .unwrap_err();
        assert_eq!(field, "env.LD_LIBRARY_PATH");
        // the review's hostile specs: the worker's other subcommands, code-loading variables,
        // paths and keys in arguments past the allow-lists
        let (field, why) = p
            .check(&spec(
                "command = [\"ductile-worker\", \"synth-data\", \"--out\", \"file:///etc/ductile/agent.toml\"]\n",
            ))
            .unwrap_err();
        assert_eq!(field, "command");
        assert!(why.contains("worker only"), "{why}");
        assert!(p
            .check(&spec(
                "command = [\"/usr/bin/ductile-worker\", \"synth-data\"]\n"
            ))
            .is_err());
        assert_eq!(
            p.check(&spec("command = [\"ductile-worker\", \"run\"]\n")),
            Ok(())
        );
        for (k, v) in [
            ("CUDA_INJECTION64_PATH", "/tmp/x.so"),
            ("NCCL_NET_PLUGIN", "/tmp/x.so"),
            ("NCCL_DEBUG_FILE", "/etc/x"),
            ("AWS_ENDPOINT_URL", "http://evil"),
            ("PYTHONPATH", "/tmp"),
        ] {
            let (field, _) = p
                .check(&spec(&format!("env = {{ {k} = \"{v}\" }}\n")))
                .unwrap_err();
            assert_eq!(field, format!("env.{k}"));
        }
        assert_eq!(
            p.check(&spec("env = { RUST_LOG = \"debug\", NCCL_DEBUG = \"INFO\", DUCTILE_COMM_BIND = \"0.0.0.0\" }\n")),
            Ok(())
        );
        // what Python and Hugging Face users set, by default; cache directories under
        // allowed_paths only; HF_HOME (its modules/ is imported code) and PYTHONWARNINGS (a
        // filter imports its category's module) refused
        assert_eq!(
            p.check(&spec("env = { PYTHONUNBUFFERED = \"1\", HF_HUB_OFFLINE = \"1\", TOKENIZERS_PARALLELISM = \"false\", TRANSFORMERS_VERBOSITY = \"info\", HF_DATASETS_CACHE = \"/var/lib/ductile/hf\" }\n")),
            Ok(())
        );
        for (k, v, says) in [
            (
                "HF_DATASETS_CACHE",
                "/etc/hf",
                "outside the agent's allowed_paths",
            ),
            ("HF_HOME", "/var/lib/ductile/hf", "allowed_env"),
            ("PYTHONWARNINGS", "error::evil.Warning", "allowed_env"),
        ] {
            let (field, why) = p
                .check(&spec(&format!("env = {{ {k} = \"{v}\" }}\n")))
                .unwrap_err();
            assert_eq!(field, format!("env.{k}"));
            assert!(why.contains(says), "{k}: {why}");
        }
        // the operator's additions: names and prefixes, never DUCTILE_*
        let more = AgentPolicy {
            allowed_env: vec!["MY_FLAG".into(), "ACME_*".into(), "DUCTILE_*".into()],
            ..p.clone()
        };
        assert_eq!(
            more.check(&spec("env = { MY_FLAG = \"1\", ACME_LEVEL = \"3\" }\n")),
            Ok(())
        );
        // (the spec's own check refuses it first; the agent's holds without it)
        let mut reserved = spec("");
        reserved
            .env
            .insert("DUCTILE_ETCD".into(), "http://evil".into());
        assert!(more.check(&reserved).is_err());
        assert!(more.check(&spec("env = { MY_FLAGS = \"1\" }\n")).is_err());
        // fault injection names in a job that allows fault injection (the spec refuses them
        // otherwise)
        assert_eq!(
            p.check(&spec(
                "allow_fault_injection = true\nenv = { DUCTILE_SLOWDOWN = \"1:4\" }\n"
            )),
            Ok(())
        );
        let sleeper = AgentPolicy {
            allowed_commands: vec!["sleep".into()],
            direct_commands: vec!["sleep".into()],
            allowed_s3_prefixes: vec!["s3://ok/jobs".into()],
            ..AgentPolicy::default()
        };
        for (arg, ok) in [
            ("5", true),
            ("/var/lib/ductile/x", true),
            ("--out=/etc/passwd", false),
            ("file:///etc/shadow", false),
            ("/var/lib/ductile/../../etc", false),
            ("s3://ok/jobs/a/COMMIT", true),
            ("s3://ok/jobsx/a", false),
            ("--to=s3://other/jobs/COMMIT", false),
            ("s3://ok/jobs/../other", false),
            ("http://example/x", false),
        ] {
            let r = sleeper.check(&spec(&format!("command = [\"sleep\", \"{arg}\"]\n")));
            assert_eq!(r.is_ok(), ok, "{arg}: {r:?}");
            if let Err((field, _)) = r {
                assert_eq!(field, "command[1]");
            }
        }
        let s3 = |url: &str| {
            spec(&format!(
                "command = [\"sleep\"]\n[training]\nmodel = \"mlp\"\ndataset = \"s3://ok/jobs/d\"\nglobal_batch = 8\n[checkpoint]\nurl = \"{url}\"\ninterval = 10\n"
            ))
        };
        assert_eq!(sleeper.check(&s3("s3://ok/jobs/ck")), Ok(()));
        let (field, why) = sleeper.check(&s3("s3://other/ck")).unwrap_err();
        assert_eq!(field, "checkpoint.url");
        assert!(why.contains("allowed_s3_prefixes"), "{why}");
        // "*" and "/" open it up; env is then the job's own business
        let open = AgentPolicy {
            allowed_commands: vec!["*".into()],
            allowed_paths: vec!["/".into()],
            allowed_s3_prefixes: vec!["*".into()],
            ..AgentPolicy::default()
        };
        assert_eq!(
            open.check(&spec("command = [\"sh\"]\nenv = { LD_PRELOAD = \"x\" }\n")),
            Ok(())
        );
        assert_eq!(open.check(&train("file:///etc/x")), Ok(()));
    }

    /// Issue 66's tenant: an agent that allows a Python for torchrun jobs does not run it as a
    /// default-runtime job (no launcher: no private HOME, no credentials by pipe), and no
    /// operator's allowed_env lets a job set what loads code.
    #[test]
    fn the_default_runtime_runs_the_worker_and_code_loading_names_are_never_allowed() {
        let p = AgentPolicy {
            allowed_commands: vec!["/usr/bin/python3".into(), "ductile-worker".into()],
            allowed_env: vec!["*".into(), "LD_*".into(), "NCCL_NET_PLUGIN".into()],
            ..AgentPolicy::default()
        };
        let (field, why) = p
            .check(&spec(
                "command = [\"/usr/bin/python3\", \"-c\", \"import os\"]\n",
            ))
            .unwrap_err();
        assert_eq!(field, "command");
        assert!(
            why.contains("direct_commands") && why.contains("torchrun"),
            "{why}"
        );
        // the same interpreter under a launcher is the torchrun checks' business
        let (field, why) = p
            .check(&spec(
                "runtime = \"torchrun\"\ncommand = [\"/usr/bin/python3\", \"-c\", \"import os\"]\n",
            ))
            .unwrap_err();
        assert_eq!(field, "command[1]", "{why}");
        assert!(why.contains("inline Python"), "{why}");
        assert_eq!(p.check(&spec("command = [\"ductile-worker\"]\n")), Ok(()));
        for k in [
            "LD_PRELOAD",
            "LD_AUDIT",
            "NCCL_NET_PLUGIN",
            "NCCL_TUNER_PLUGIN",
            "NCCL_PROFILER_PLUGIN",
            "PYTHONPATH",
            "PYTHONSTARTUP",
            "BASH_ENV",
            "CUDA_INJECTION64_PATH",
            "CUDA_LIBRARY_PATH",
            "PATH",
        ] {
            let (field, why) = p
                .check(&spec(&format!(
                    "command = [\"ductile-worker\"]\nenv = {{ {k} = \"/tmp/x.so\" }}\n"
                )))
                .unwrap_err();
            assert_eq!(field, format!("env.{k}"));
            assert!(why.contains("no job may set it"), "{k}: {why}");
        }
        let no_tf = AgentPolicy {
            allowed_runtimes: vec!["ductile".into(), "torchrun".into()],
            ..p.clone()
        };
        let (field, why) = no_tf
            .check(&spec(
                "runtime = \"tf\"\ncommand = [\"/usr/bin/python3\", \"/srv/t.py\"]\n",
            ))
            .unwrap_err();
        assert_eq!(field, "runtime");
        assert!(why.contains("allowed_runtimes"), "{why}");
        assert_eq!(
            no_tf.check(&spec("command = [\"ductile-worker\"]\n")),
            Ok(())
        );
        // what allowed_env adds that loads nothing still passes
        assert_eq!(
            p.check(&spec(
                "command = [\"ductile-worker\"]\nenv = { ACME_LEVEL = \"3\" }\n"
            )),
            Ok(())
        );
    }
}

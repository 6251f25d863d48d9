//! `ductile-worker launch`: the worker of a `runtime = "torchrun"` job. It follows the job's
//! generations like any worker and, in each one that includes its slot, runs the job's own
//! program under torchrun's worker contract (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ... as
//! `torch.distributed.run` documents them): rank 0's launcher picks a free port on its host for
//! the program's c10d store and publishes it in the generation's rendezvous space, the others
//! read it. A newer generation stops the program (SIGTERM, `grace_s`, SIGKILL) and starts it in
//! the new world; the program resumes from its own checkpoint.
//!
//! When the program exits by itself with an error (or a signal), its launcher reports the
//! generation failed (`FaultKind::Exited`, the error file's message) and waits for the leader's
//! answer, as a built-in worker whose communicator failed does: the leader takes the first
//! exit as the root cause (torchrun's rule), excludes that slot (its agent restarts it within
//! the job's budget, the message is the reason shown) and re-forms the others. A program that
//! exits 0 ends this worker with `EXIT_DONE`; the job succeeds when a generation's members all
//! did.
//!
//! The program gets an allow-listed environment: torchrun's variables, the job's `env`, the
//! node's locale, paths and NCCL/CUDA settings, never the launcher's etcd credentials. The
//! `ductile` Python module (python/ in the repository) talks to its launcher through
//! `DUCTILE_CONTROL` (a Unix datagram socket: `ductile.report(step=, loss=, samples=)` feeds
//! progress, the chart history and stall detection) and `DUCTILE_PREEMPT_FILE` (present once a
//! planned drain is coming: `ductile.preempted()`).
//!
//! `runtime = "torchft"`: the program runs in TorchFT replica groups (the leader gives each
//! member its `replica_group` and the generation its group started in, `group_since`). A
//! group's launchers run it under torchrun's contract within the group (`RANK` is the rank in
//! the group), with `REPLICA_GROUP_ID`, `NUM_REPLICA_GROUPS` and `TORCHFT_LIGHTHOUSE` (this
//! launcher's relay to every ductiled replica's lighthouse, in the job's room); the launcher of
//! the group's first slot hosts the group's c10d store, as torchrun's agent does
//! (`TORCHELASTIC_USE_AGENT_STORE=True`): TorchFT's Manager never hosts one. A new generation
//! that leaves the group as it was (same members, same `group_since`) does not touch the
//! program: the other groups' failures, joins and departures go by it, and TorchFT's quorum
//! takes them in.
//!
//! `runtime = "tf"`: the program runs under `tf.distribute`'s contract. Every rank's launcher
//! picks a free port on its host for the program's gRPC server and publishes it in the
//! generation's rendezvous space; once all ranks' are there, each program gets `TF_CONFIG`
//! (the cluster's `worker` list in rank order, its own `task`: `worker`, index = rank; worker 0
//! is `MultiWorkerMirroredStrategy`'s chief), beside `RANK`, `WORLD_SIZE` and `LOCAL_RANK`.
//! The world restarts at every generation as a torchrun world does; the program resumes from
//! its own backup (Keras' `BackupAndRestore`).
//!
//! `runtime = "horovod"`: the program gets what `horovodrun`'s gloo launcher gives its workers.
//! Rank 0's launcher hosts the generation's Horovod rendezvous server (Horovod's own
//! `RendezvousHTTPServer`, run by the job's interpreter, initialised with the generation's slot
//! plan: ranks, local and cross ranks by node) on a free port and publishes it as torchrun's
//! `MASTER_PORT` is; every rank gets `HOROVOD_RANK`, `HOROVOD_SIZE`, `HOROVOD_LOCAL_*`,
//! `HOROVOD_CROSS_*`, `HOROVOD_HOSTNAME`, `HOROVOD_GLOO_RENDEZVOUS_ADDR`/`_PORT`,
//! `HOROVOD_CONTROLLER=gloo`, `HOROVOD_CPU_OPERATIONS=gloo` and `HOROVOD_GLOO_IFACE` (the
//! interface of the node's `DUCTILE_COMM_HOST`). The world restarts at every generation.
//!
//! Warm start: a Python program (`python3 script.py ...`, `python3 -m module ...`) is run in a
//! standby interpreter that imported torch beforehand; the launcher hands it the generation's
//! environment and arguments on stdin and it runs the script with `runpy`, as `python3` would.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ductile_cluster::records::*;
use ductile_cluster::{KvBackend, Store};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use crate::report::Reporter;
use crate::{GenCell, WorkerEnv, EXIT_DONE, EXIT_FENCED, EXIT_TERMINATED};

/// How long a rank waits for rank 0's launcher to publish where the c10d store listens.
const MASTER_WAIT: Duration = Duration::from_secs(60);
/// How long a launcher waits for the first generation that includes its slot.
const FIRST_GENERATION_WAIT: Duration = Duration::from_secs(60);
/// A standby interpreter is started this long after a program starts (its own imports come
/// first), or at its first report.
const STANDBY_DELAY: Duration = Duration::from_secs(5);

/// What the standby interpreter imports before it is needed: torch, its distributed and data
/// packages, torchelastic's `@record`, and `torch._dynamo`, which torch 2.x's optimizers import
/// on their first construction (0.8 s alone on this machine). A module that is not there is
/// skipped.
const PRELOAD: &str = "torch,torch.distributed,torch.nn.parallel,torch.utils.data,\
torch.distributed.elastic.multiprocessing.errors,torch._dynamo";

/// What a tf job's standby interpreter imports: TensorFlow and Keras 2 (`tf_keras`, what
/// `tf.keras` is under `TF_USE_LEGACY_KERAS=1`), 3 to 5 s of a program's start on this machine.
/// `TF_CONFIG` is read when the program makes its strategy, after the generation's environment
/// is in place.
const PRELOAD_TF: &str = "tensorflow,tf_keras";

/// What a horovod job's standby interpreter imports: torch and Horovod's PyTorch binding.
const PRELOAD_HOROVOD: &str = "torch,torch.utils.data,horovod.torch";

/// The end of [`STANDBY`] and [`BOOT`]: run `_argv` (a script and its arguments, or `-m MODULE
/// ...`) as `python3` would (`sys.argv`, `sys.path[0]`, `__main__`).
macro_rules! run_main {
    () => {
        r#"if _argv[0] == "-m":
    sys.argv = [_argv[1]] + _argv[2:]
    sys.path.insert(0, os.getcwd())
    runpy.run_module(_argv[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = _argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(_argv[0])))
    runpy.run_path(_argv[0], run_name="__main__")
"#
    };
}

/// The first lines of [`STANDBY`] and [`BOOT`], before anything is imported: `python -c`
/// puts the working directory (`''`) first on `sys.path`, so a `json.py` or `runpy.py` left
/// there would be imported in place of the standard library's. Taken off (what CPython 3.11's
/// `-P` does; `sys` is built in and searched for nowhere); [`run_main`] then puts the script's
/// directory first, as `python3 script.py` does.
macro_rules! safe_path {
    () => {
        "import sys\nif sys.path and sys.path[0] in ('', '.'):\n    del sys.path[0]\n"
    };
}

/// The lines of [`STANDBY`] and [`BOOT`] that close the program's default process group at its
/// exit, where the program made one on gloo and left it open, as most scripts do: gloo's
/// threads, torn down in the interpreter's last destructors while a peer is still connected,
/// abort the process ("terminate called without an active exception", SIGABRT, exit 134): in
/// 4 of 12 tries here (torch 2.11, two ranks, rank 0 leaving 1 s before rank 1, without
/// ductile) where `destroy_process_group()` first gave 0 of 12. Registered before the
/// program runs, so it runs after the program's own exit handlers; bounded (10 s, on a thread
/// of its own) so a close that hangs cannot keep the process from exiting. NCCL's process
/// groups are left alone (their destroy can wait on work in flight).
macro_rules! exit_hook {
    () => {
        r#"
import atexit as _ductile_atexit
def _ductile_close_pg():
    _d = sys.modules.get("torch.distributed")
    try:
        if _d is None or not (_d.is_available() and _d.is_initialized()):
            return
        if _d.get_backend() != "gloo":
            return
        import threading
        _t = threading.Thread(target=_d.destroy_process_group, daemon=True)
        _t.start()
        _t.join(10)
    except Exception:
        pass
_ductile_atexit.register(_ductile_close_pg)
"#
    };
}

/// What the standby interpreter runs: import what a PyTorch program imports, then wait on stdin
/// for the generation's environment and arguments, and run the program as `python3` would.
const STANDBY: &str = concat!(
    safe_path!(),
    exit_hook!(),
    r#"
import importlib, json, os, runpy
for _m in os.environ.pop("DUCTILE_PRELOAD", "").split(","):
    if _m:
        try:
            importlib.import_module(_m)
        except Exception:
            pass
_line = sys.stdin.readline()
if not _line:
    sys.exit(0)
_req = json.loads(_line)
sys.stdin.close()
sys.stdin = open(os.devnull)
os.environ.update(_req["env"])
if os.environ.get("DUCTILE_INTEGRATIONS"):
    if os.environ.get("DUCTILE_PYTHON_DIR", "") not in sys.path:
        sys.path.append(os.environ.get("DUCTILE_PYTHON_DIR", ""))
    import ductile.integrations
    ductile.integrations.install()
_argv = _req["argv"]
del _line, _req, _m
"#,
    run_main!()
);

/// Where job `job`'s program runs: its `program.workdir`, else `DUCTILE_WORK_ROOT/JOB` (made
/// here if need be: the job's slots on this node share it, across generations, so a relative
/// output path lands in it and not in the agent's own directory).
fn job_workdir(settings: &TorchrunSpec, job: &str) -> anyhow::Result<PathBuf> {
    if let Some(w) = &settings.workdir {
        return Ok(PathBuf::from(w));
    }
    let root = std::env::var_os("DUCTILE_WORK_ROOT")
        .map(PathBuf::from)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "the agent gave no DUCTILE_WORK_ROOT and the job names no program.workdir"
            )
        })?;
    let dir = root.join(job);
    std::fs::create_dir_all(&dir).map_err(|e| {
        anyhow::anyhow!(
            "cannot make the job's working directory {}: {e} (the agent's work_root; or name program.workdir)",
            dir.display()
        )
    })?;
    Ok(dir)
}

/// What a Python program runs when it starts afresh: [`exit_hook`], the integrations installed
/// where the job names some (`[torchrun] integrations`: `ductile.integrations`), then the
/// script or module, as `python3` would run it.
const BOOT: &str = concat!(
    safe_path!(),
    exit_hook!(),
    r#"
import os, runpy
if os.environ.get("DUCTILE_INTEGRATIONS"):
    if os.environ.get("DUCTILE_PYTHON_DIR", "") not in sys.path:
        sys.path.append(os.environ.get("DUCTILE_PYTHON_DIR", ""))
    import ductile.integrations
    ductile.integrations.install()
_argv = sys.argv[1:]
"#,
    run_main!()
);

/// What the launcher runs once, with the program's interpreter and environment, before a job
/// with `integrations` starts: the packages they need that it cannot import (JSON), found
/// without importing them.
const PREFLIGHT: &str = concat!(
    safe_path!(),
    r#"
import json, os
if os.environ.get("DUCTILE_PYTHON_DIR", "") not in sys.path:
    sys.path.append(os.environ.get("DUCTILE_PYTHON_DIR", ""))
import ductile.integrations
print(json.dumps(ductile.integrations.missing()))
"#
);

/// ductile's own Python module (`python/ductile`, standard library only), as this launcher was
/// built with it: written into the launcher's directory and put on the program's `PYTHONPATH`
/// (after the node's), so `import ductile` and the integrations need no install step and
/// always speak this launcher's protocol.
const PY_MODULE: [(&str, &str); 2] = [
    (
        "__init__.py",
        include_str!("../../python/ductile/__init__.py"),
    ),
    (
        "integrations.py",
        include_str!("../../python/ductile/integrations.py"),
    ),
];

/// Writes [`PY_MODULE`] under `dir/python/ductile`; `dir/python`, the directory to put on
/// the program's path.
fn write_py_module(dir: &Path) -> anyhow::Result<PathBuf> {
    let root = dir.join("python");
    let pkg = root.join("ductile");
    std::fs::create_dir_all(&pkg)
        .map_err(|e| anyhow::anyhow!("cannot make {}: {e}", pkg.display()))?;
    for (name, text) in PY_MODULE {
        std::fs::write(pkg.join(name), text)
            .map_err(|e| anyhow::anyhow!("cannot write {}/{name}: {e}", pkg.display()))?;
    }
    Ok(root)
}

/// The packages the job's `integrations` need that its interpreter (`command[0]`) cannot
/// import: one bounded run of [`PREFLIGHT`] in the program's environment. An interpreter that
/// cannot run the check is an error (the program would fail the same way), not an absence.
async fn integrations_missing(
    command: &[String],
    base: &BTreeMap<String, String>,
    workdir: &Path,
) -> anyhow::Result<Vec<String>> {
    let mut cmd = Command::new(&command[0]);
    cmd.arg("-c")
        .arg(PREFLIGHT)
        .env_clear()
        .envs(base)
        .current_dir(workdir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let out = match tokio::time::timeout(Duration::from_secs(60), cmd.output()).await {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => anyhow::bail!(
            "cannot run {:?} to check what the job's integrations need: {e}",
            command[0]
        ),
        Err(_) => anyhow::bail!(
            "{:?} did not say within 60 s which packages the job's integrations lack",
            command[0]
        ),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    match (
        out.status.success(),
        serde_json::from_str::<Vec<String>>(stdout.trim()),
    ) {
        (true, Ok(m)) => Ok(m),
        _ => {
            let err = String::from_utf8_lossy(&out.stderr);
            anyhow::bail!(
                "{:?} could not check what the job's integrations need ({}): {}",
                command[0],
                out.status,
                err.trim().lines().last().unwrap_or("no output")
            )
        }
    }
}

/// `command` (a Python interpreter running a script or a module) with [`BOOT`] in front of
/// its script: `python3 [options] -c BOOT script.py args...` (or `... -c BOOT -m module
/// args...`); None for any other command.
pub fn boot_command(command: &[String]) -> Option<Vec<String>> {
    use ductile_cluster::pycmd::{parse, PyMain};
    let (opts, main): (&[String], Vec<String>) = match parse(command.get(1..)?).ok()?.main {
        PyMain::Script(i, _) => (&command[1..i], command[i..].to_vec()),
        PyMain::Module(i, name) => {
            let start = if command[i] == name && command[i - 1] == "-m" {
                i - 1
            } else {
                i
            };
            let mut main = vec!["-m".to_string(), name];
            main.extend(command[i + 1..].iter().cloned());
            (&command[1..start], main)
        }
        _ => return None,
    };
    let mut out = vec![command[0].clone()];
    out.extend(opts.iter().cloned());
    out.extend(["-c".to_string(), BOOT.to_string()]);
    out.extend(main);
    Some(out)
}

/// Environment names a program inherits from the node (the agent's environment), besides
/// torchrun's, the job's `env` and the launcher's own: locale, paths, and the NCCL/CUDA settings
/// an operator gives a node. Nothing else passes (no etcd credentials, no `DUCTILE_*`).
const INHERITED: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TMPDIR",
    "TERM",
    "LD_LIBRARY_PATH",
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "PYTHONHOME",
];
const INHERITED_PREFIXES: &[&str] = &["LC_", "NCCL_", "CUDA_"];

/// Whether a program inherits the node's variable `k` (see [`INHERITED`]).
pub fn node_inherited(k: &str) -> bool {
    INHERITED.contains(&k) || INHERITED_PREFIXES.iter().any(|p| k.starts_with(p))
}

/// What hosts a torchft group's c10d store: `torch.distributed.TCPStore` as the master, as
/// torchrun's agent hosts it for its workers; it lives until its launcher stops it.
const STORE_HOST: &str = r#"
import sys, threading
from torch.distributed import TCPStore
_s = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False)
print(f"c10d store for the replica group listening on {sys.argv[1]}:{sys.argv[2]}", flush=True)
threading.Event().wait()
"#;

/// What hosts a horovod generation's rendezvous: Horovod's own HTTP rendezvous server (what
/// `horovodrun --gloo` runs in its driver), initialised with the generation's slot plan
/// (argv: host, port, the plan as JSON); it lives until its launcher stops it.
const HOROVOD_HOST: &str = r#"
import json, sys
from horovod.runner.common.util.hosts import SlotInfo
from horovod.runner.http.http_server import RendezvousHTTPServer, RendezvousHandler
_httpd = RendezvousHTTPServer((sys.argv[1], int(sys.argv[2])), RendezvousHandler, 0)
_httpd.init([SlotInfo(**s) for s in json.loads(sys.argv[3])])
print(f"Horovod's rendezvous server for the generation listening on {sys.argv[1]}:{sys.argv[2]}", flush=True)
_httpd.serve_forever()
"#;

/// A horovod generation's slot plan, in rank order, as `horovodrun` makes it from its hosts
/// (nodes in the order of their first rank): each slot's node (`hostname`), rank, rank on its
/// node (`local_rank`, `local_size`) and the node's index among the nodes that have that
/// local rank (`cross_rank`, `cross_size`).
pub fn horovod_plan(g: &Generation) -> Vec<serde_json::Value> {
    let mut ranks: Vec<&Member> = g.members.iter().collect();
    ranks.sort_by_key(|m| m.rank);
    let mut nodes: Vec<&str> = Vec::new();
    for m in &ranks {
        if !nodes.contains(&m.node.as_str()) {
            nodes.push(&m.node);
        }
    }
    let local = |m: &Member| {
        let on: Vec<u32> = ranks
            .iter()
            .filter(|o| o.node == m.node)
            .map(|o| o.rank)
            .collect();
        (on.iter().position(|r| *r == m.rank).unwrap_or(0), on.len())
    };
    ranks
        .iter()
        .map(|m| {
            let (local_rank, local_size) = local(m);
            // the nodes having a slot at this local rank, in node order
            let cross: Vec<&str> = nodes
                .iter()
                .copied()
                .filter(|n| ranks.iter().filter(|o| o.node == *n).count() > local_rank)
                .collect();
            serde_json::json!({
                "hostname": m.node,
                "rank": m.rank,
                "local_rank": local_rank,
                "cross_rank": cross.iter().position(|n| *n == m.node).unwrap_or(0),
                "size": ranks.len(),
                "local_size": local_size,
                "cross_size": cross.len(),
            })
        })
        .collect()
}

/// A horovod program's variables, made from torchrun's (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// the GPUs stay): its slot of [`horovod_plan`], the rendezvous server at `rendezvous`, gloo as
/// controller and CPU operations, and `iface` (the network interface of the node's address)
/// as gloo's; no `MASTER_*`, no torchelastic names.
pub fn horovod_env(
    out: &mut BTreeMap<String, String>,
    g: &Generation,
    rank: u32,
    rendezvous: (&str, u16),
    iface: Option<&str>,
) {
    drop_c10d_names(out);
    let plan = horovod_plan(g);
    if let Some(slot) = plan.iter().find(|s| s["rank"] == rank) {
        for (k, f) in [
            ("HOROVOD_RANK", "rank"),
            ("HOROVOD_SIZE", "size"),
            ("HOROVOD_LOCAL_RANK", "local_rank"),
            ("HOROVOD_LOCAL_SIZE", "local_size"),
            ("HOROVOD_CROSS_RANK", "cross_rank"),
            ("HOROVOD_CROSS_SIZE", "cross_size"),
        ] {
            out.insert(k.into(), slot[f].to_string());
        }
        out.insert(
            "HOROVOD_HOSTNAME".into(),
            slot["hostname"].as_str().unwrap_or_default().into(),
        );
    }
    out.insert(
        "HOROVOD_GLOO_RENDEZVOUS_ADDR".into(),
        rendezvous.0.to_string(),
    );
    out.insert(
        "HOROVOD_GLOO_RENDEZVOUS_PORT".into(),
        rendezvous.1.to_string(),
    );
    out.insert("HOROVOD_CONTROLLER".into(), "gloo".into());
    out.insert("HOROVOD_CPU_OPERATIONS".into(), "gloo".into());
    if let Some(i) = iface {
        out.insert("HOROVOD_GLOO_IFACE".into(), i.into());
    }
}

/// The network interface that has address `addr` on this host (gloo binds to an interface
/// by name), or None.
fn interface_of(addr: &str) -> Option<String> {
    let want: std::net::IpAddr = addr.parse().ok()?;
    nix::ifaddrs::getifaddrs().ok()?.find_map(|ifa| {
        let a = ifa.address?;
        let ip = match (a.as_sockaddr_in(), a.as_sockaddr_in6()) {
            (Some(v4), _) => std::net::IpAddr::V4(v4.ip()),
            (_, Some(v6)) => std::net::IpAddr::V6(v6.ip()),
            _ => return None,
        };
        (ip == want).then(|| ifa.interface_name.clone())
    })
}

/// Why a Horovod program cannot run on a host of this `name`, if it cannot: Horovod 0.28.1
/// makes its process sets' gloo device from the host's name, whatever `HOROVOD_GLOO_IFACE`
/// says, so `hvd.init()` aborts where the name does not resolve.
fn horovod_host_check(name: &str) -> Result<(), String> {
    use std::net::ToSocketAddrs;
    let why = match (name, 0u16).to_socket_addrs() {
        Ok(a) if a.len() > 0 => return Ok(()),
        Ok(_) => "no address".to_string(),
        Err(e) => e.to_string(),
    };
    Err(format!(
        "this node's name {name:?} does not resolve ({why}): Horovod's hvd.init() makes its process sets from the host's name whatever HOROVOD_GLOO_IFACE says, and would abort (\"Unable to find address for: {name}\"). Name the host in /etc/hosts, or install libnss-myhostname (scripts/setup.sh does where the name does not resolve)"
    ))
}

/// The program's environment that does not change between generations: the node's locale,
/// paths and NCCL/CUDA settings, a private `HOME` and `TMPDIR` (in the launcher's own
/// directory: nothing one job plants there, a `.pth` in a user site, a poisoned cache, reaches
/// another), no user site directory, the job's `env`, and the credentials the operator
/// configured for this job (`secrets`: never the node's own).
fn base_env(
    spec: &JobSpec,
    dir: &Path,
    settings: &TorchrunSpec,
    secrets: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = std::env::vars()
        .filter(|(k, _)| node_inherited(k))
        .collect();
    // the libtorch the agent gave this launcher is not the program's: its own torch loads its own
    if let (Ok(lib), Some(path)) = (
        std::env::var("DUCTILE_LIBTORCH_LIB"),
        env.get("LD_LIBRARY_PATH").cloned(),
    ) {
        let rest: Vec<&str> = path
            .split(':')
            .filter(|p| !p.is_empty() && *p != lib)
            .collect();
        if rest.is_empty() {
            env.remove("LD_LIBRARY_PATH");
        } else {
            env.insert("LD_LIBRARY_PATH".into(), rest.join(":"));
        }
    }
    env.insert("HOME".into(), dir.join("home").display().to_string());
    env.insert("TMPDIR".into(), dir.join("tmp").display().to_string());
    env.insert("PYTHONNOUSERSITE".into(), "1".into());
    env.extend(spec.env.clone());
    env.extend(secrets.clone());
    // ductile's own module, after the node's own path (a job's env cannot set PYTHONPATH)
    let ours = dir.join("python").display().to_string();
    let path = match env.get("PYTHONPATH").filter(|p| !p.is_empty()) {
        Some(p) => format!("{p}:{ours}"),
        None => ours.clone(),
    };
    env.insert("PYTHONPATH".into(), path);
    env.insert("DUCTILE_PYTHON_DIR".into(), ours);
    // torchrun's default with more than one process per node, unless the job says otherwise
    env.entry("OMP_NUM_THREADS".into())
        .or_insert_with(|| "1".into());
    env.entry("TORCH_NCCL_ASYNC_ERROR_HANDLING".into())
        .or_insert_with(|| "1".into());
    env.insert(
        "DUCTILE_CONTROL".into(),
        dir.join("control.sock").display().to_string(),
    );
    env.insert(
        "DUCTILE_PREEMPT_FILE".into(),
        dir.join("preempted").display().to_string(),
    );
    if let Some(u) = &settings.checkpoint_url {
        env.insert("DUCTILE_CHECKPOINT_URL".into(), u.clone());
    }
    env.insert("DUCTILE_JOB".into(), spec.name.clone());
    if !settings.integrations.is_empty() {
        env.insert(
            "DUCTILE_INTEGRATIONS".into(),
            settings.integrations.join(","),
        );
    }
    env
}

/// torchrun's variables for this slot in generation `g` (`master`: rank 0's host and port).
pub fn torchrun_env(
    env: &WorkerEnv,
    spec: &JobSpec,
    g: &Generation,
    master: (&str, u16),
    error_file: &Path,
    node_gpus: &[Option<u32>],
) -> BTreeMap<String, String> {
    let me = g
        .member(&env.node, env.slot)
        .expect("the caller checked membership");
    let mut ranks: Vec<&Member> = g.members.iter().collect();
    ranks.sort_by_key(|m| m.rank);
    // nodes in the order of their first rank (torchrun's GROUP_RANK: the agent's rank)
    let mut nodes: Vec<&str> = Vec::new();
    for m in &ranks {
        if !nodes.contains(&m.node.as_str()) {
            nodes.push(&m.node);
        }
    }
    let local: Vec<&&Member> = ranks.iter().filter(|m| m.node == env.node).collect();
    let local_rank = local.iter().position(|m| m.rank == me.rank).unwrap_or(0);
    let group_rank = nodes.iter().position(|n| *n == env.node).unwrap_or(0);
    let mut out = BTreeMap::new();
    let mut put = |k: &str, v: String| {
        out.insert(k.to_string(), v);
    };
    put("RANK", me.rank.to_string());
    put("LOCAL_RANK", local_rank.to_string());
    put("WORLD_SIZE", g.world_size.to_string());
    put("LOCAL_WORLD_SIZE", local.len().to_string());
    put("GROUP_RANK", group_rank.to_string());
    put("GROUP_WORLD_SIZE", nodes.len().to_string());
    put("ROLE_RANK", me.rank.to_string());
    put("ROLE_WORLD_SIZE", g.world_size.to_string());
    put("ROLE_NAME", "default".into());
    put("MASTER_ADDR", master.0.to_string());
    put("MASTER_PORT", master.1.to_string());
    put("TORCHELASTIC_RUN_ID", spec.name.clone());
    put("TORCHELASTIC_RESTART_COUNT", g.failures.to_string());
    put("TORCHELASTIC_MAX_RESTARTS", spec.restart_budget.to_string());
    put("TORCHELASTIC_ERROR_FILE", error_file.display().to_string());
    put("TORCHELASTIC_USE_AGENT_STORE", "False".into());
    // what torchrun's agent forwards to its workers (its default --signals-to-handle)
    put(
        "TORCHELASTIC_SIGNALS_TO_HANDLE",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT".into(),
    );
    put("DUCTILE_GENERATION", g.number.to_string());
    // GPU slots: this node's GPUs of the generation in local-rank order, so that
    // cuda:LOCAL_RANK is this slot's GPU (what torchrun scripts index), when they are distinct;
    // otherwise (slots sharing a GPU) this slot's GPU alone
    let gpus: Vec<Option<u32>> = local
        .iter()
        .map(|m| node_gpus.get(m.slot as usize).copied().flatten())
        .collect();
    if let Some(Some(own)) = node_gpus.get(env.slot as usize) {
        let distinct = gpus.iter().all(|g| g.is_some())
            && (0..gpus.len()).all(|i| !gpus[..i].contains(&gpus[i]));
        let visible = if distinct {
            gpus.iter()
                .map(|g| g.unwrap().to_string())
                .collect::<Vec<_>>()
                .join(",")
        } else {
            own.to_string()
        };
        put("CUDA_VISIBLE_DEVICES", visible);
        if !distinct {
            out.insert("LOCAL_RANK".into(), "0".into());
        }
    }
    out
}

/// torchrun's variables a program without a c10d store does not get: `MASTER_*` and the
/// torchelastic names.
fn drop_c10d_names(out: &mut BTreeMap<String, String>) {
    out.retain(|k, _| !k.starts_with("MASTER_") && !k.starts_with("TORCHELASTIC_"));
}

/// A tf program's variables, made from torchrun's (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// `DUCTILE_GENERATION`, the GPUs stay): `TF_CONFIG` with the generation's `cluster` (every
/// rank's gRPC address, in rank order) and this rank's `task`; no c10d store, so no
/// `MASTER_*`, and no torchelastic names.
pub fn tf_env(out: &mut BTreeMap<String, String>, cluster: &[(String, u16)], rank: u32) {
    drop_c10d_names(out);
    let workers: Vec<String> = cluster
        .iter()
        .map(|(a, p)| match a.contains(':') {
            true => format!("[{a}]:{p}"),
            false => format!("{a}:{p}"),
        })
        .collect();
    let config = serde_json::json!({
        "cluster": { "worker": workers },
        "task": { "type": "worker", "index": rank },
    });
    out.insert("TF_CONFIG".into(), config.to_string());
}

/// A directory of this launcher's own under `base` (0700, made anew: never one that was there).
fn fresh_dir(base: &Path) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    for i in 0..100u32 {
        let dir = base.join(format!(
            "ductile-launch-{}-{:x}",
            std::process::id(),
            nanos.wrapping_add(i.wrapping_mul(0x9e37_79b9))
        ));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => anyhow::bail!("cannot make {}: {e}", dir.display()),
        }
    }
    anyhow::bail!(
        "cannot make a directory of its own under {}",
        base.display()
    )
}

/// The program's error file, if it is a regular file (a FIFO or a device there would block or
/// never end), read up to 64 KiB.
fn read_error_file(path: &Path) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_NOFOLLOW)
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut buf = Vec::new();
    f.take(64 << 10).read_to_end(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// The message of a torchelastic error file (`{"message": {"message": ...}}` as `@record`
/// writes it, or `{"message": "..."}`).
pub fn error_file_message(text: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let m = v.get("message")?;
    let s = match m {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Object(o) => o.get("message")?.as_str()?.to_string(),
        _ => return None,
    };
    let s = s.trim().to_string();
    (!s.is_empty()).then_some(s)
}

/// A torchft member's replica group in `g`: its members in slot order (ranks 0.. within the
/// group), or None when `g` does not give `me` a group.
pub fn torchft_group(g: &Generation, me: &Member) -> Option<Vec<Member>> {
    let id = me.replica_group?;
    let mut group: Vec<Member> = g
        .members
        .iter()
        .filter(|m| m.replica_group == Some(id))
        .cloned()
        .collect();
    group.sort_by_key(|m| m.slot);
    Some(group)
}

/// The environment of a torchft member: torchrun's variables within its group (a world of
/// the group's members), the group's store, and TorchFT's variables.
#[allow(clippy::too_many_arguments)]
pub fn torchft_env(
    env: &WorkerEnv,
    spec: &JobSpec,
    g: &Generation,
    group: &[Member],
    master: (&str, u16),
    error_file: &Path,
    node_gpus: &[Option<u32>],
    lighthouse: &str,
) -> BTreeMap<String, String> {
    let mut world = g.clone();
    world.members = group
        .iter()
        .enumerate()
        .map(|(r, m)| Member {
            rank: r as u32,
            ..m.clone()
        })
        .collect();
    world.world_size = group.len() as u32;
    let mut out = torchrun_env(env, spec, &world, master, error_file, node_gpus);
    let groups: std::collections::BTreeSet<u32> =
        g.members.iter().filter_map(|m| m.replica_group).collect();
    let id = group.first().and_then(|m| m.replica_group).unwrap_or(0);
    let n = (groups.len() as u32).max(groups.iter().max().map(|m| m + 1).unwrap_or(1));
    out.insert("TORCHELASTIC_USE_AGENT_STORE".into(), "True".into());
    out.insert("REPLICA_GROUP_ID".into(), id.to_string());
    out.insert("NUM_REPLICA_GROUPS".into(), n.to_string());
    out.insert("TORCHFT_LIGHTHOUSE".into(), lighthouse.to_string());
    // a lighthouse call that broke with its replica (a ductiled leader SIGKILLed) is tried
    // again, through this launcher's relay, on a live one: without it torchft 0.2.0's manager
    // leaves its ranks waiting out the whole quorum timeout (60 s), and the job's groups then
    // restart. TorchFT sleeps quorum_timeout / (retries + 1) before each retry: 120 make that
    // half a second at its default timeout. It reads this over the Manager's own argument;
    // the job's env may set it.
    if !spec.env.contains_key(TORCHFT_QUORUM_RETRIES) {
        out.insert(
            TORCHFT_QUORUM_RETRIES.into(),
            DEFAULT_QUORUM_RETRIES.to_string(),
        );
    }
    out
}

/// TorchFT's override of its Manager's `quorum_retries`.
pub const TORCHFT_QUORUM_RETRIES: &str = "TORCHFT_QUORUM_RETRIES";
/// What a torchft job's programs get unless the job's env says otherwise.
pub const DEFAULT_QUORUM_RETRIES: u32 = 120;

/// Starts this launcher's relay to the TorchFT lighthouse (every ductiled replica that
/// publishes one under `lighthouses/`, read again for each connection; calls in the job's
/// room); `TORCHFT_LIGHTHOUSE` for the program.
async fn start_relay(store: &Store, job: &str) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen for the lighthouse relay: {e}"))?;
    let url = format!("http://{}", listener.local_addr()?);
    let key_store = store.clone();
    let store = store.clone();
    let upstreams: ductile_cluster::relay::Upstreams = Arc::new(move || {
        let store = store.clone();
        Box::pin(async move {
            let prefix = store.keys.lighthouses();
            match tokio::time::timeout(Duration::from_secs(5), store.backend.list(&prefix)).await {
                Ok(Ok((kvs, _))) => kvs
                    .iter()
                    .filter_map(|kv| serde_json::from_slice::<serde_json::Value>(&kv.value).ok())
                    .filter_map(|v| v["addr"].as_str().map(str::to_string))
                    .collect(),
                Ok(Err(e)) => {
                    eprintln!("torchft-relay: cannot read where the lighthouse is served: {e}");
                    Vec::new()
                }
                Err(_) => {
                    eprintln!("torchft-relay: etcd did not list the lighthouses within 5 s");
                    Vec::new()
                }
            }
        })
    });
    // the job's lighthouse key, written at submit: it opens the job's room and no other
    let key = match key_store.backend.get(&key_store.keys.lighthouse_key(job)).await {
        Ok(Some(kv)) => kv.value,
        Ok(None) => anyhow::bail!(
            "job {job:?} has no lighthouse key (jobs/{job}/lighthouse_key): submitted before rooms were authenticated? submit it again"
        ),
        Err(e) => anyhow::bail!("cannot read the job's lighthouse key: {e}"),
    };
    let room = Some(ductile_cluster::relay::RoomKey {
        job: job.to_string(),
        key,
    });
    // TLS to the replicas when the node's agent names their CA (`torchft_ca`)
    let tls = match std::env::var_os("DUCTILE_TORCHFT_CA").filter(|v| !v.is_empty()) {
        Some(ca) => Some(ductile_cluster::relay::client_tls(std::path::Path::new(
            &ca,
        ))?),
        None => None,
    };
    tokio::spawn(async move {
        // only this launcher's own user (its job's, where the node gives jobs users of their
        // own) reaches the job's room through it
        let me = nix::unistd::geteuid().as_raw();
        if let Err(e) =
            ductile_cluster::relay::serve(listener, upstreams, room, tls, Some(me)).await
        {
            eprintln!("torchft-relay: stopped: {e:#}");
        }
    });
    Ok(url)
}

/// A Python command the standby interpreter can run: its arguments after the interpreter
/// (`script.py args...`, `-m module args...`), when it takes no interpreter options.
fn warm_args(command: &[String]) -> Option<Vec<String>> {
    if !is_python(command.first()?) {
        return None;
    }
    let rest = &command[1..];
    match rest.first().map(String::as_str) {
        Some("-m") if rest.len() >= 2 => Some(rest.to_vec()),
        Some(a) if !a.starts_with('-') => Some(rest.to_vec()),
        _ => None,
    }
}

/// A started program (or standby interpreter), its stderr's last line kept.
struct Program {
    child: Child,
    pid: u32,
    last_line: Arc<Mutex<Option<String>>>,
}

impl Program {
    fn spawn(mut cmd: Command, what: &str) -> anyhow::Result<Program> {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        // its own process group (stopping it reaches its children: data loader workers), and
        // it dies with this launcher
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
                nix::unistd::setpgid(Pid::from_raw(0), Pid::from_raw(0))?;
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {what}: {e}"))?;
        let pid = child.id().unwrap_or(0);
        let last_line = Arc::new(Mutex::new(None));
        use ductile_cluster::lines::{BoundedLines, MAX_LINE};
        if let Some(out) = child.stdout.take() {
            tokio::spawn(async move {
                let mut lines = BoundedLines::new(BufReader::new(out), MAX_LINE);
                while let Ok(Some(l)) = lines.next_line().await {
                    println!("{l}");
                }
            });
        }
        if let Some(err) = child.stderr.take() {
            let last = last_line.clone();
            tokio::spawn(async move {
                let mut lines = BoundedLines::new(BufReader::new(err), MAX_LINE);
                while let Ok(Some(l)) = lines.next_line().await {
                    eprintln!("{l}");
                    if !l.trim().is_empty() {
                        *last.lock().unwrap() = Some(l.trim().chars().take(400).collect());
                    }
                }
            });
        }
        Ok(Program {
            child,
            pid,
            last_line,
        })
    }

    /// SIGTERM to its process group, `grace`, then SIGKILL.
    async fn stop(&mut self, grace: Duration) {
        let pg = Pid::from_raw(self.pid as i32);
        let _ = killpg(pg, Signal::SIGTERM);
        if tokio::time::timeout(grace, self.child.wait())
            .await
            .is_err()
        {
            let _ = killpg(pg, Signal::SIGKILL);
            let _ = self.child.kill().await;
            let _ = self.child.wait().await;
        }
        // what its children left behind
        let _ = killpg(pg, Signal::SIGKILL);
    }
}

/// How the program of one generation ended.
enum Outcome {
    /// It exited 0.
    Done,
    /// It failed by itself: the message (the error file's, else its last line on stderr), and
    /// whether a signal killed it (then it is the root cause beyond doubt).
    Failed(String, bool),
    /// A newer generation replaced it (stopped).
    Replaced,
    /// This launcher was told to stop (SIGTERM from its agent).
    Stopped,
}

struct Launcher {
    env: WorkerEnv,
    spec: JobSpec,
    settings: TorchrunSpec,
    cell: Arc<GenCell>,
    reporter: Reporter,
    dir: PathBuf,
    /// Where the program runs: `program.workdir`, else WORK_ROOT/JOB (the agent's
    /// `work_root`), made at start and kept across generations.
    workdir: PathBuf,
    base: BTreeMap<String, String>,
    node_gpus: Vec<Option<u32>>,
    host: String,
    standby: Option<Program>,
    requests: Arc<Mutex<Option<CheckpointRequest>>>,
    control: tokio::net::UnixDatagram,
    cancel: CancellationToken,
    /// `runtime = "torchft"`: `TORCHFT_LIGHTHOUSE` (this launcher's relay, in the job's room).
    lighthouse: Option<String>,
    /// `runtime = "torchft"`, the group's first slot: the process hosting its c10d store.
    store_host: Option<Program>,
}

/// Run a torchrun job's program through the job's generations; the worker's exit code.
pub async fn run(env: WorkerEnv, backend: Arc<dyn KvBackend>, cancel: CancellationToken) -> i32 {
    if let Err(e) = crate::reap::contain_descendants() {
        eprintln!("ductile-worker: cannot contain the program's processes (prctl): {e}");
        return 1;
    }
    match Launcher::new(env, backend, cancel).await {
        Ok(mut l) => {
            let code = l.run().await;
            if let Some(mut s) = l.standby.take() {
                s.stop(Duration::from_millis(200)).await;
            }
            l.stop_store_host().await;
            l.sweep(false).await;
            let _ = std::fs::remove_dir_all(&l.dir);
            code
        }
        Err(e) => {
            eprintln!("ductile-worker: {e:#}");
            match e.downcast_ref::<crate::Unusable>() {
                Some(_) => crate::EXIT_UNUSABLE,
                None => 1,
            }
        }
    }
}

impl Launcher {
    async fn new(
        env: WorkerEnv,
        backend: Arc<dyn KvBackend>,
        cancel: CancellationToken,
    ) -> anyhow::Result<Launcher> {
        let store = Store::new(backend, ductile_cluster::Keys::new(&env.prefix));
        let spec = match store.spec(&env.job).await {
            Ok(Some((s, _))) => s,
            Ok(None) => anyhow::bail!("job {:?} has no spec", env.job),
            Err(e) => anyhow::bail!("cannot read the job spec: {e}"),
        };
        if !spec.runtime.runs_program() {
            anyhow::bail!(
                "job {:?} is not a runtime = \"torchrun\", \"torchft\" or \"tf\" job: `launch` runs only those",
                env.job
            );
        }
        let settings = spec.torchrun_settings();
        // short: the control socket's path must fit a Unix socket address (108 bytes); made
        // anew (a stale directory of an earlier process with this pid is left alone), 0700
        let dir = fresh_dir(&std::env::temp_dir())?;
        for sub in ["home", "tmp"] {
            std::fs::create_dir(dir.join(sub))
                .map_err(|e| anyhow::anyhow!("cannot make {}/{sub}: {e}", dir.display()))?;
        }
        let control = tokio::net::UnixDatagram::bind(dir.join("control.sock")).map_err(|e| {
            anyhow::anyhow!("cannot bind the control socket in {}: {e}", dir.display())
        })?;
        let cell = Arc::new(GenCell::default());
        crate::watch_generations(store.clone(), env.job.clone(), cell.clone(), cancel.clone());
        let requests = Arc::new(Mutex::new(None));
        crate::watch_checkpoint_requests(
            store.clone(),
            env.job.clone(),
            requests.clone(),
            &tokio::runtime::Handle::current(),
        );
        let node_gpus = std::env::var("DUCTILE_NODE_GPUS")
            .unwrap_or_default()
            .split(',')
            .map(|s| s.parse().ok())
            .collect();
        let host = std::env::var("DUCTILE_COMM_HOST").unwrap_or_else(|_| "127.0.0.1".into());
        let reporter = Reporter {
            store: store.clone(),
            rt: tokio::runtime::Handle::current(),
            job: env.job.clone(),
            node: env.node.clone(),
            slot: env.slot,
            cell: cell.clone(),
        };
        write_py_module(&dir)?;
        let workdir = job_workdir(&settings, &env.job)?;
        let base = base_env(&spec, &dir, &settings, &env.program_secrets);
        // a job whose interpreter lacks what its integrations need is refused here, once,
        // naming what is missing: restarting would fail the same way
        if !settings.integrations.is_empty() {
            let missing = integrations_missing(&spec.command, &base, &workdir).await?;
            if !missing.is_empty() {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(anyhow::Error::new(crate::Unusable(format!(
                    "the job's integrations = {:?} need the Python package(s) {}, which {} cannot import: install them in the job's interpreter (not restarted)",
                    settings.integrations,
                    missing.join(", "),
                    spec.command[0]
                ))));
            }
        }
        if settings
            .checkpoint_url
            .as_deref()
            .is_some_and(|u| u.starts_with("s3://"))
            && !env.program_secrets.contains_key("AWS_SECRET_ACCESS_KEY")
        {
            println!("the job's program gets no S3 credentials: the operator configures them per job (the agent's job_credentials_dir), never the node's");
        }
        let lighthouse = if spec.runtime == Runtime::Torchft {
            Some(start_relay(&store, &env.job).await?)
        } else {
            None
        };
        Ok(Launcher {
            workdir,
            env,
            spec,
            settings,
            cell,
            reporter,
            dir,
            base,
            node_gpus,
            host,
            standby: None,
            requests,
            control,
            cancel,
            lighthouse,
            store_host: None,
        })
    }

    /// Whether `g` supersedes the program this launcher runs as `me`: for torchrun, any newer
    /// generation; for torchft, a newer one that changes `me`'s group (or leaves it out).
    fn superseded(&self, g: &Generation, me: &Member) -> Option<Generation> {
        let latest = self.cell.latest().filter(|l| l.number > g.number)?;
        if self.spec.runtime != Runtime::Torchft {
            return Some(latest);
        }
        let kept = latest
            .member(&self.env.node, self.env.slot)
            .filter(|m| m.replica_group == me.replica_group && m.group_since == me.group_since)
            .is_some();
        if kept {
            None
        } else {
            Some(latest)
        }
    }

    /// Kills every process the program left behind (see [`crate::reap`]); the standby
    /// interpreter and the group's store host are kept when `keep_own`. False when one would
    /// not die within the bound: then the slot is not reused.
    async fn sweep(&mut self, keep_own: bool) -> bool {
        let mut keep = std::collections::BTreeSet::new();
        if keep_own {
            for p in [&self.standby, &self.store_host].into_iter().flatten() {
                keep.insert(p.pid as i32);
            }
        }
        let r =
            tokio::task::spawn_blocking(move || crate::reap::sweep(&keep, Duration::from_secs(5)))
                .await;
        match r {
            Ok((0, _)) => true,
            Ok((n, left)) if left.is_empty() => {
                println!("killed {n} process(es) the program left running");
                true
            }
            Ok((_, left)) => {
                eprintln!("ductile-worker: processes {left:?} of the previous program would not die within 5 s: this slot is busy");
                false
            }
            Err(e) => {
                eprintln!("ductile-worker: the sweep of the program's processes failed: {e}");
                false
            }
        }
    }

    /// Stops the group's c10d store, if this launcher hosts one.
    async fn stop_store_host(&mut self) {
        if let Some(mut s) = self.store_host.take() {
            s.stop(Duration::from_millis(200)).await;
        }
    }

    fn workdir(&self) -> PathBuf {
        self.workdir.clone()
    }

    /// A standby interpreter for a Python program (warm start), started now.
    fn start_standby(&mut self) {
        if !self.settings.warm_start || self.standby.is_some() {
            return;
        }
        let Some(_) = warm_args(&self.spec.command) else {
            return;
        };
        let mut cmd = Command::new(&self.spec.command[0]);
        cmd.arg("-c")
            .arg(STANDBY)
            .env_clear()
            .envs(&self.base)
            .env(
                "DUCTILE_PRELOAD",
                match self.spec.runtime {
                    Runtime::Tf => PRELOAD_TF,
                    Runtime::Horovod => PRELOAD_HOROVOD,
                    _ => PRELOAD,
                },
            )
            .current_dir(self.workdir())
            .stdin(Stdio::piped());
        match Program::spawn(cmd, "the standby interpreter") {
            Ok(p) => self.standby = Some(p),
            Err(e) => tracing::warn!(error = %e, "no warm start: the program starts afresh"),
        }
    }

    /// Start the program for one generation, in the standby interpreter when there is one.
    async fn start_program(
        &mut self,
        gen_env: &BTreeMap<String, String>,
    ) -> anyhow::Result<Program> {
        if let (Some(mut s), Some(argv)) = (self.standby.take(), warm_args(&self.spec.command)) {
            if s.child.try_wait().ok().flatten().is_none() {
                let req = serde_json::json!({ "env": gen_env, "argv": argv });
                let mut line = serde_json::to_vec(&req)?;
                line.push(b'\n');
                if let Some(mut stdin) = s.child.stdin.take() {
                    if stdin.write_all(&line).await.is_ok() && stdin.flush().await.is_ok() {
                        drop(stdin);
                        return Ok(s);
                    }
                }
            }
            tracing::warn!("the standby interpreter is gone: starting the program afresh");
            s.stop(Duration::from_millis(100)).await;
        }
        // a Python script or module runs through BOOT (its exit hook; the integrations), as
        // in the standby interpreter; another command (`python -c`, a shell) as it is
        let command = match (
            self.settings.integrations.is_empty(),
            Some(&self.spec.command)
                .filter(|c| is_python(&c[0]))
                .and_then(|c| boot_command(c)),
        ) {
            (_, Some(boot)) => boot,
            (true, None) => self.spec.command.clone(),
            (false, None) => anyhow::bail!(
                "program.integrations need a Python command running a script or a module"
            ),
        };
        let mut cmd = Command::new(&command[0]);
        cmd.args(&command[1..])
            .env_clear()
            .envs(&self.base)
            .envs(gen_env)
            .current_dir(self.workdir())
            .stdin(Stdio::null());
        Program::spawn(cmd, &format!("{:?}", self.spec.command[0]))
    }

    /// The newest generation, waiting (bounded) for one at or past this worker's own.
    async fn newest(&self) -> Option<Generation> {
        let t0 = Instant::now();
        loop {
            if let Some(g) = self
                .cell
                .latest()
                .filter(|g| g.number >= self.env.generation)
            {
                return Some(g);
            }
            if t0.elapsed() > FIRST_GENERATION_WAIT || self.cancel.is_cancelled() {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Where the program's c10d store listens: the host (rank 0; a torchft group's first slot)
    /// picks a free port on its host and publishes it at `key` (a torchft group's host also
    /// starts the store); the others wait for it (None: a newer generation superseded `me`, or
    /// this launcher is stopping).
    async fn master(
        &mut self,
        g: &Generation,
        me: &Member,
        key: String,
        host: bool,
    ) -> anyhow::Result<Option<(String, u16)>> {
        if host {
            let port = std::net::TcpListener::bind(("0.0.0.0", 0))
                .and_then(|l| l.local_addr())
                .map_err(|e| anyhow::anyhow!("cannot find a free port for the program: {e}"))?
                .port();
            if self.spec.runtime == Runtime::Torchft {
                self.stop_store_host().await;
                let python = if is_python(&self.spec.command[0]) {
                    self.spec.command[0].clone()
                } else {
                    "python3".to_string()
                };
                let mut cmd = Command::new(python);
                cmd.arg("-c")
                    .arg(STORE_HOST)
                    .arg(&self.host)
                    .arg(port.to_string())
                    .env_clear()
                    .envs(&self.base)
                    .current_dir(self.workdir())
                    .stdin(Stdio::null());
                self.store_host = Some(Program::spawn(cmd, "the replica group's c10d store")?);
            }
            if self.spec.runtime == Runtime::Horovod {
                self.stop_store_host().await;
                let plan = serde_json::Value::Array(horovod_plan(g)).to_string();
                let mut cmd = Command::new(&self.spec.command[0]);
                cmd.arg("-c")
                    .arg(HOROVOD_HOST)
                    .arg(&self.host)
                    .arg(port.to_string())
                    .arg(plan)
                    .env_clear()
                    .envs(&self.base)
                    .current_dir(self.workdir())
                    .stdin(Stdio::null());
                let host = Program::spawn(cmd, "the generation's Horovod rendezvous server")?;
                self.store_host = Some(host);
                self.wait_listening(port).await?;
            }
            let v = serde_json::json!({ "addr": self.host, "port": port });
            let mut delay = Duration::from_millis(50);
            for i in 0.. {
                match self.reporter.store.put_json(&key, &v, None).await {
                    Ok(_) => break,
                    Err(e) if i >= 20 => {
                        anyhow::bail!("cannot publish the program's address at {key}: {e}")
                    }
                    Err(_) => {
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(1));
                    }
                }
            }
            return Ok(Some((self.host.clone(), port)));
        }
        self.read_address(g, me, &key, "the c10d store's host")
            .await
    }

    /// Until the server this launcher hosts (`store_host`) accepts connections on `port` (at
    /// most [`MASTER_WAIT`]): Horovod's workers do not wait for a rendezvous server that is not
    /// there yet.
    async fn wait_listening(&mut self, port: u16) -> anyhow::Result<()> {
        let t0 = Instant::now();
        loop {
            if tokio::net::TcpStream::connect((self.host.as_str(), port))
                .await
                .is_ok()
            {
                return Ok(());
            }
            if let Some(h) = self.store_host.as_mut() {
                if let Ok(Some(status)) = h.child.try_wait() {
                    let said = h.last_line.lock().unwrap().clone().unwrap_or_default();
                    anyhow::bail!("the Horovod rendezvous server exited ({status}): {said}");
                }
            }
            if t0.elapsed() > MASTER_WAIT || self.cancel.is_cancelled() {
                anyhow::bail!(
                    "the Horovod rendezvous server did not listen on {}:{port} within {} s",
                    self.host,
                    MASTER_WAIT.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// The address `whose` launcher published at `key` in generation `g`, waited for (at most
    /// [`MASTER_WAIT`]; None: a newer generation superseded `me`, or this launcher is stopping).
    async fn read_address(
        &self,
        g: &Generation,
        me: &Member,
        key: &str,
        whose: &str,
    ) -> anyhow::Result<Option<(String, u16)>> {
        let t0 = Instant::now();
        loop {
            if self.superseded(g, me).is_some() || self.cancel.is_cancelled() {
                return Ok(None);
            }
            match self.reporter.store.backend.get(key).await {
                Ok(Some(kv)) => {
                    let v: serde_json::Value = serde_json::from_slice(&kv.value)
                        .map_err(|e| anyhow::anyhow!("{whose}'s address is unreadable: {e}"))?;
                    let addr = v["addr"].as_str().unwrap_or_default().to_string();
                    let port = v["port"].as_u64().unwrap_or(0) as u16;
                    if addr.is_empty() || port == 0 {
                        anyhow::bail!("{whose}'s address is malformed: {v}");
                    }
                    return Ok(Some((addr, port)));
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "cannot read {whose}'s address; retrying"),
            }
            if t0.elapsed() > MASTER_WAIT {
                anyhow::bail!(
                    "{whose} in generation {} did not publish its address within {} s",
                    g.number,
                    MASTER_WAIT.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// A tf job's cluster in generation `g`: every rank's gRPC address in rank order, this
    /// launcher's own published first (None as [`Self::read_address`]).
    async fn tf_cluster(
        &mut self,
        g: &Generation,
        me: &Member,
    ) -> anyhow::Result<Option<Vec<(String, u16)>>> {
        let keys = self.reporter.store.keys.clone();
        let own = keys.tf_worker(&self.env.job, g.number, me.rank);
        if self.master(g, me, own, true).await?.is_none() {
            return Ok(None);
        }
        let mut cluster = Vec::with_capacity(g.world_size as usize);
        for rank in 0..g.world_size {
            let key = keys.tf_worker(&self.env.job, g.number, rank);
            match self
                .read_address(g, me, &key, &format!("rank {rank}'s TensorFlow server"))
                .await?
            {
                Some(a) => cluster.push(a),
                None => return Ok(None),
            }
        }
        Ok(Some(cluster))
    }

    async fn run(&mut self) -> i32 {
        if self.spec.runtime == Runtime::Horovod {
            // (gethostname's answer, on Linux)
            match std::fs::read_to_string("/proc/sys/kernel/hostname") {
                Ok(name) => {
                    if let Err(e) = horovod_host_check(name.trim()) {
                        // a clear error rather than the program's abort in every generation
                        eprintln!("ductile-worker: {e}");
                        return 1;
                    }
                }
                Err(e) => eprintln!(
                    "ductile-worker: this node's name could not be read from /proc/sys/kernel/hostname ({e}), so whether it resolves (Horovod's hvd.init() needs it to) was not checked"
                ),
            }
        }
        self.start_standby();
        let mut last_run: u64 = 0;
        loop {
            let Some(mut g) = self.newest().await else {
                if self.cancel.is_cancelled() {
                    return EXIT_TERMINATED;
                }
                eprintln!(
                    "ductile-worker: no generation of job {:?} includes this slot within {} s",
                    self.env.job,
                    FIRST_GENERATION_WAIT.as_secs()
                );
                return 1;
            };
            if g.number == last_run {
                // this generation's program already ran and failed: wait for the leader's answer
                tokio::select! {
                    _ = self.cancel.cancelled() => return EXIT_TERMINATED,
                    _ = tokio::time::sleep(Duration::from_millis(20)) => continue,
                }
            }
            let Some(mut me) = g.member(&self.env.node, self.env.slot).cloned() else {
                println!(
                    "generation {} does not include {}/{}: leaving",
                    g.number, self.env.node, self.env.slot
                );
                self.stop_store_host().await;
                return EXIT_FENCED;
            };
            last_run = g.number;
            // a torchft member runs in its replica group, once the group is whole
            let group = match &self.lighthouse {
                None => None,
                Some(_) => {
                    let size = self.spec.torchft_group_size() as usize;
                    match torchft_group(&g, &me) {
                        Some(gr) if size == 0 || gr.len() == size => Some(gr),
                        other => {
                            println!(
                                "generation {}: replica group {:?} has {} of its {size} slots: waiting for the rest",
                                g.number,
                                me.replica_group,
                                other.map(|o| o.len()).unwrap_or(0)
                            );
                            continue;
                        }
                    }
                }
            };
            let (key, host) = match (&group, me.replica_group) {
                (Some(gr), Some(id)) => (
                    self.reporter
                        .store
                        .keys
                        .torchft_master(&self.env.job, me.group_since, id),
                    gr.first().is_some_and(|f| f.slot == me.slot),
                ),
                _ => (
                    self.reporter.store.keys.master(&self.env.job, g.number),
                    me.rank == 0,
                ),
            };
            let tf = match self.spec.runtime {
                Runtime::Tf => match self.tf_cluster(&g, &me).await {
                    Ok(Some(c)) => Some(c),
                    Ok(None) if self.cancel.is_cancelled() => return EXIT_TERMINATED,
                    Ok(None) => continue,
                    Err(e) => {
                        eprintln!("ductile-worker: {e:#}");
                        return 1;
                    }
                },
                _ => None,
            };
            let master = match &tf {
                Some(c) => Ok(c.first().cloned()),
                None => self.master(&g, &me, key, host).await,
            };
            let master = match master {
                Ok(Some(m)) => m,
                Ok(None) if self.cancel.is_cancelled() => return EXIT_TERMINATED,
                Ok(None) => continue,
                Err(e) => {
                    eprintln!("ductile-worker: {e:#}");
                    return 1;
                }
            };
            if self.superseded(&g, &me).is_some() {
                continue;
            }
            let error_file = self.dir.join(format!("error-g{}.json", g.number));
            let _ = std::fs::remove_file(&error_file);
            let _ = std::fs::remove_file(self.dir.join("preempted"));
            let gen_env = match (&group, &self.lighthouse) {
                (Some(gr), Some(lh)) => torchft_env(
                    &self.env,
                    &self.spec,
                    &g,
                    gr,
                    (&master.0, master.1),
                    &error_file,
                    &self.node_gpus,
                    lh,
                ),
                _ => {
                    let mut e = torchrun_env(
                        &self.env,
                        &self.spec,
                        &g,
                        (&master.0, master.1),
                        &error_file,
                        &self.node_gpus,
                    );
                    if let Some(c) = &tf {
                        tf_env(&mut e, c, me.rank);
                    }
                    if self.spec.runtime == Runtime::Horovod {
                        let iface = interface_of(&master.0);
                        horovod_env(&mut e, &g, me.rank, (&master.0, master.1), iface.as_deref());
                    }
                    e
                }
            };
            let mut program = match self.start_program(&gen_env).await {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("ductile-worker: {e:#}");
                    return 1;
                }
            };
            println!(
                "generation {}: started {:?} as rank {} of {}{} (pid {}, {} at {}:{})",
                g.number,
                self.spec.command,
                gen_env.get("RANK").map(String::as_str).unwrap_or("?"),
                gen_env.get("WORLD_SIZE").map(String::as_str).unwrap_or("?"),
                gen_env
                    .get("REPLICA_GROUP_ID")
                    .map(|r| format!(" in replica group {r}"))
                    .unwrap_or_default(),
                program.pid,
                match (&tf, self.spec.runtime) {
                    (Some(_), _) => "TensorFlow's chief",
                    (None, Runtime::Horovod) => "Horovod's rendezvous",
                    _ => "c10d store",
                },
                master.0,
                master.1
            );
            let join = JoinRecord {
                node: self.env.node.clone(),
                slot: self.env.slot,
                rank: me.rank,
                pid: program.pid,
                joined_at_ms: now_ms(),
                ..Default::default()
            };
            self.reporter.joined(g.number, me.rank, join, None);
            let outcome = self
                .supervise(&mut g, &mut me, &mut program, &error_file)
                .await;
            // (a torchft program may have run on through newer generations)
            last_run = g.number;
            // what the program left running ends with it, before anything starts again
            if !self.sweep(true).await {
                return 1;
            }
            if !matches!(outcome, Outcome::Done) {
                self.stop_store_host().await;
            }
            match outcome {
                Outcome::Done => {
                    println!("generation {}: the program finished (exit 0)", g.number);
                    return EXIT_DONE;
                }
                Outcome::Replaced => continue,
                Outcome::Stopped => return EXIT_TERMINATED,
                Outcome::Failed(msg, killed) => {
                    if self.superseded(&g, &me).is_some() {
                        continue; // the world changed under it: the next generation
                    }
                    let (reporter, g2, msg2) = (self.reporter.clone(), g.clone(), msg.clone());
                    let wait = tokio::task::spawn_blocking(move || {
                        // a program killed by a signal names itself: no other exit caused it
                        let suspects = if killed { vec![me.rank] } else { Vec::new() };
                        reporter.failed_generation(&g2, me.rank, FaultKind::Exited, suspects, msg2)
                    });
                    tokio::select! {
                        r = wait => match r {
                            Ok(Ok(())) => continue,
                            Ok(Err(e)) => {
                                eprintln!("ductile-worker: {msg} ({e:#})");
                                return 1;
                            }
                            Err(e) => {
                                eprintln!("ductile-worker: {msg} (the fault report failed: {e})");
                                return 1;
                            }
                        },
                        _ = self.cancel.cancelled() => return EXIT_TERMINATED,
                    }
                }
            }
        }
    }

    /// Watch the program of generation `g` until it ends, a newer generation replaces it, or
    /// this launcher is stopped; meanwhile relay its reports and the drain notice.
    async fn supervise(
        &mut self,
        g: &mut Generation,
        me: &mut Member,
        program: &mut Program,
        error_file: &Path,
    ) -> Outcome {
        let mut rank = me.rank;
        let started = Instant::now();
        let grace = Duration::from_secs(self.settings.grace_s);
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        let mut buf = vec![0u8; 4096];
        let mut progress = ProgressRelay::new(g.number);
        let mut noticed = false;
        loop {
            tokio::select! {
                status = program.child.wait() => {
                    let status = match status {
                        Ok(s) => s,
                        Err(e) => return Outcome::Failed(format!("cannot wait for the program: {e}"), false),
                    };
                    if status.success() {
                        if rank == 0 {
                            progress.flush(&self.reporter);
                        }
                        return Outcome::Done;
                    }
                    // its last lines are still in the pipe
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    use std::os::unix::process::ExitStatusExt;
                    let how = match (status.code(), status.signal()) {
                        (Some(c), _) => format!("exit code {c}"),
                        (None, Some(s)) => format!("killed by signal {s}"),
                        _ => "exited".into(),
                    };
                    let said = read_error_file(error_file)
                        .and_then(|t| error_file_message(&t))
                        .or_else(|| program.last_line.lock().unwrap().clone());
                    let msg = match said {
                        Some(m) if status.code().is_some() => format!("{how}: {}", m.chars().take(400).collect::<String>()),
                        _ => how,
                    };
                    eprintln!("generation {}: rank {rank}'s program failed ({msg})", g.number);
                    return Outcome::Failed(msg, status.signal().is_some());
                }
                _ = self.cancel.cancelled() => {
                    // the agent stops this worker (fenced, drained, the job ended): the program
                    // is told first, then gets its grace
                    let _ = std::fs::write(self.dir.join("preempted"), b"stopping\n");
                    program.stop(grace).await;
                    return Outcome::Stopped;
                }
                r = self.control.recv(&mut buf) => {
                    if let Ok(n) = r {
                        if rank == 0 {
                            progress.take(&buf[..n], &self.reporter);
                        }
                        if self.standby.is_none() {
                            self.start_standby();
                        }
                    }
                }
                _ = tick.tick() => {
                    if self.superseded(g, me).is_some() {
                        program.stop(grace).await;
                        return Outcome::Replaced;
                    }
                    // a torchft group that a newer generation keeps as it was runs on in it
                    if let Some(latest) = self.cell.latest().filter(|l| l.number > g.number) {
                        if let Some(m) = latest.member(&self.env.node, self.env.slot).cloned() {
                            *me = m;
                            rank = me.rank;
                            *g = latest;
                            let join = JoinRecord {
                                node: self.env.node.clone(),
                                slot: self.env.slot,
                                rank,
                                pid: program.pid,
                                joined_at_ms: now_ms(),
                                ..Default::default()
                            };
                            self.reporter.joined(g.number, rank, join, None);
                            println!(
                                "generation {}: replica group {:?} runs on unchanged (pid {})",
                                g.number, me.replica_group, program.pid
                            );
                        }
                    }
                    if !noticed {
                        let req = self.requests.lock().unwrap().clone();
                        if let Some(r) = req.filter(|r| r.generation >= g.number) {
                            noticed = true;
                            println!("generation {}: a planned change of the world is coming ({}): ductile.preempted() is true", g.number, r.reason);
                            let _ = std::fs::write(self.dir.join("preempted"), format!("{}\n", r.reason));
                        }
                    }
                    if rank == 0 {
                        progress.tick(&self.reporter);
                    }
                    if self.standby.is_none() && started.elapsed() > STANDBY_DELAY {
                        self.start_standby();
                    }
                }
            }
        }
    }
}

/// Rank 0's reports (`ductile.report`) turned into the job's progress: at most one write a
/// second, the first of a generation at once (its first step).
struct ProgressRelay {
    generation: u64,
    last: Option<Progress>,
    written: Option<Instant>,
    dirty: bool,
    first_step: bool,
    /// (when, samples) of the reports in the rate's window
    window: std::collections::VecDeque<(Instant, f64)>,
    /// The program's last `ductile.saved(step)`: (step, unix ms).
    saved: Option<(u64, u64)>,
}

impl ProgressRelay {
    fn new(generation: u64) -> Self {
        ProgressRelay {
            generation,
            last: None,
            written: None,
            dirty: false,
            first_step: false,
            window: Default::default(),
            saved: None,
        }
    }

    fn take(&mut self, datagram: &[u8], reporter: &Reporter) {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(datagram) else {
            return;
        };
        let Some(step) = v.get("step").and_then(|s| s.as_u64()) else {
            return;
        };
        let now = Instant::now();
        let saved = v.get("saved").and_then(|s| s.as_bool()) == Some(true);
        if saved {
            self.saved = Some((step, now_ms()));
        }
        if let Some(n) = v.get("samples").and_then(|s| s.as_f64()) {
            self.window.push_back((now, n));
        }
        while self.window.len() > 2
            && now.duration_since(self.window[0].0) > Duration::from_secs(10)
        {
            self.window.pop_front();
        }
        let rate = match (self.window.front(), self.window.len()) {
            (Some((t0, _)), n) if n >= 2 && now.duration_since(*t0).as_secs_f64() > 0.0 => {
                let s: f64 = self.window.iter().skip(1).map(|(_, n)| n).sum();
                Some(s / now.duration_since(*t0).as_secs_f64())
            }
            _ => None,
        };
        self.last = Some(Progress {
            generation: self.generation,
            step,
            loss: v
                .get("loss")
                .and_then(|l| l.as_f64())
                .filter(|l| l.is_finite()),
            samples_per_sec: rate,
            updated_at_ms: now_ms(),
            saved_step: self.saved.map(|s| s.0),
            saved_at_ms: self.saved.map(|s| s.1),
            ..Default::default()
        });
        self.dirty = true;
        if saved {
            // the leader may be holding a resize for it
            self.flush(reporter);
        }
        if !self.first_step {
            self.first_step = true;
            reporter.first_step(self.generation);
            self.flush(reporter);
        }
    }

    fn tick(&mut self, reporter: &Reporter) {
        if self.dirty
            && self
                .written
                .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
        {
            self.flush(reporter);
        }
    }

    fn flush(&mut self, reporter: &Reporter) {
        if let (true, Some(p)) = (self.dirty, self.last.clone()) {
            reporter.progress(p);
            self.written = Some(Instant::now());
            self.dirty = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Horovod program is not started where the host's name does not resolve: the reason
    /// and the fix, not gloo's abort.
    #[test]
    fn a_horovod_host_must_resolve_its_own_name() {
        horovod_host_check("localhost").unwrap();
        let e = horovod_host_check("no-such-host.invalid").unwrap_err();
        assert!(
            e.contains("\"no-such-host.invalid\" does not resolve")
                && e.contains("/etc/hosts")
                && e.contains("libnss-myhostname"),
            "{e}"
        );
    }

    fn gen(members: &[(&str, u32)]) -> Generation {
        Generation {
            failures: 2,
            ..Generation::data_parallel("j", 4, members)
        }
    }

    fn worker(node: &str, slot: u32) -> WorkerEnv {
        WorkerEnv {
            job: "j".into(),
            node: node.into(),
            slot,
            generation: 1,
            etcd: ductile_cluster::access::EtcdAccess::default(),
            prefix: "/t".into(),
            device: "cpu".into(),
            program_secrets: Default::default(),
        }
    }

    /// torchrun's variables, as `torch.distributed.run` sets them for two nodes of two.
    #[test]
    fn torchrun_variables_follow_the_generation() {
        let spec = JobSpec::from_toml(
            "name = \"j\"\nruntime = \"torchrun\"\ncommand = [\"python3\", \"t.py\"]\nmin = 1\nmax = 4\ndesired = 4\nrestart_budget = 5\n",
        )
        .unwrap();
        let g = gen(&[("b", 0), ("a", 1), ("b", 1), ("a", 0)]);
        let e = torchrun_env(
            &worker("a", 0),
            &spec,
            &g,
            ("10.0.0.2", 29500),
            Path::new("/x/e.json"),
            &[Some(3), Some(5)],
        );
        let v = |k: &str| e[k].as_str();
        assert_eq!((v("RANK"), v("WORLD_SIZE")), ("3", "4"));
        // node a holds ranks 1 and 3: this is its second local rank; node b came first
        assert_eq!((v("LOCAL_RANK"), v("LOCAL_WORLD_SIZE")), ("1", "2"));
        assert_eq!((v("GROUP_RANK"), v("GROUP_WORLD_SIZE")), ("1", "2"));
        assert_eq!(
            (v("ROLE_RANK"), v("ROLE_WORLD_SIZE"), v("ROLE_NAME")),
            ("3", "4", "default")
        );
        assert_eq!((v("MASTER_ADDR"), v("MASTER_PORT")), ("10.0.0.2", "29500"));
        assert_eq!(v("TORCHELASTIC_RESTART_COUNT"), "2");
        assert_eq!(v("TORCHELASTIC_MAX_RESTARTS"), "5");
        assert_eq!(v("TORCHELASTIC_RUN_ID"), "j");
        assert_eq!(v("TORCHELASTIC_ERROR_FILE"), "/x/e.json");
        // local rank 0 is slot 1 (GPU 5), local rank 1 this slot (GPU 3): cuda:1 is its GPU
        assert_eq!(v("CUDA_VISIBLE_DEVICES"), "5,3");
        // slots sharing one GPU: that GPU alone, as cuda:0
        let e = torchrun_env(
            &worker("a", 0),
            &spec,
            &g,
            ("h", 1),
            Path::new("/e"),
            &[Some(0), Some(0)],
        );
        assert_eq!(
            (e["CUDA_VISIBLE_DEVICES"].as_str(), e["LOCAL_RANK"].as_str()),
            ("0", "0")
        );
        // CPU slots: no CUDA_VISIBLE_DEVICES of ours
        let e = torchrun_env(
            &worker("b", 1),
            &spec,
            &g,
            ("h", 1),
            Path::new("/e"),
            &[None, None],
        );
        assert!(!e.contains_key("CUDA_VISIBLE_DEVICES"));
        assert_eq!(
            (
                e["RANK"].as_str(),
                e["LOCAL_RANK"].as_str(),
                e["GROUP_RANK"].as_str()
            ),
            ("2", "1", "0")
        );
    }

    #[test]
    fn tf_config_lists_every_rank_s_server_in_rank_order_and_names_this_task() {
        let spec = JobSpec::from_toml(
            "name = \"j\"\nruntime = \"tf\"\ncommand = [\"python3\", \"t.py\"]\nmin = 1\nmax = 4\ndesired = 3\n",
        )
        .unwrap();
        let g = gen(&[("a", 0), ("b", 0), ("a", 1)]);
        let mut e = torchrun_env(&worker("a", 1), &spec, &g, ("h", 1), Path::new("/e"), &[]);
        let cluster = [
            ("10.0.0.1".to_string(), 4001),
            ("10.0.0.2".to_string(), 4002),
            ("fd00::3".to_string(), 4003),
        ];
        tf_env(&mut e, &cluster, 2);
        let c: serde_json::Value = serde_json::from_str(&e["TF_CONFIG"]).unwrap();
        assert_eq!(
            c,
            serde_json::json!({
                "cluster": {"worker": ["10.0.0.1:4001", "10.0.0.2:4002", "[fd00::3]:4003"]},
                "task": {"type": "worker", "index": 2},
            })
        );
        assert_eq!((e["RANK"].as_str(), e["WORLD_SIZE"].as_str()), ("2", "3"));
        assert_eq!(e["LOCAL_RANK"], "1");
        assert!(
            e.keys()
                .all(|k| !k.starts_with("MASTER_") && !k.starts_with("TORCHELASTIC_")),
            "no c10d store, no torchelastic: {e:?}"
        );
    }

    #[test]
    fn horovod_gets_horovodrun_s_slot_plan_and_rendezvous() {
        let spec = JobSpec::from_toml(
            "name = \"j\"\nruntime = \"horovod\"\ncommand = [\"python3\", \"t.py\"]\nmin = 1\nmax = 4\ndesired = 3\n",
        )
        .unwrap();
        // node b has ranks 0 and 2, node a rank 1: b is the first host
        let g = gen(&[("b", 0), ("a", 0), ("b", 1)]);
        let plan = horovod_plan(&g);
        let row = |r: usize| {
            let s = &plan[r];
            (
                s["hostname"].as_str().unwrap().to_string(),
                [
                    s["rank"].as_u64().unwrap(),
                    s["local_rank"].as_u64().unwrap(),
                    s["local_size"].as_u64().unwrap(),
                    s["cross_rank"].as_u64().unwrap(),
                    s["cross_size"].as_u64().unwrap(),
                    s["size"].as_u64().unwrap(),
                ],
            )
        };
        assert_eq!(row(0), ("b".into(), [0, 0, 2, 0, 2, 3]));
        assert_eq!(row(1), ("a".into(), [1, 0, 1, 1, 2, 3]));
        // local rank 1 exists on b alone
        assert_eq!(row(2), ("b".into(), [2, 1, 2, 0, 1, 3]));
        let mut e = torchrun_env(&worker("b", 1), &spec, &g, ("h", 1), Path::new("/e"), &[]);
        horovod_env(&mut e, &g, 2, ("10.0.0.5", 4242), Some("eth0"));
        let v = |k: &str| e[k].as_str();
        assert_eq!(
            (
                v("HOROVOD_RANK"),
                v("HOROVOD_SIZE"),
                v("HOROVOD_LOCAL_RANK")
            ),
            ("2", "3", "1")
        );
        assert_eq!(
            (
                v("HOROVOD_CROSS_RANK"),
                v("HOROVOD_CROSS_SIZE"),
                v("HOROVOD_HOSTNAME")
            ),
            ("0", "1", "b")
        );
        assert_eq!(
            (
                v("HOROVOD_GLOO_RENDEZVOUS_ADDR"),
                v("HOROVOD_GLOO_RENDEZVOUS_PORT"),
                v("HOROVOD_GLOO_IFACE")
            ),
            ("10.0.0.5", "4242", "eth0")
        );
        assert_eq!(
            (v("HOROVOD_CONTROLLER"), v("HOROVOD_CPU_OPERATIONS")),
            ("gloo", "gloo")
        );
        assert!(e.keys().all(|k| !k.starts_with("MASTER_")), "{e:?}");
        assert_eq!(interface_of("127.0.0.1").as_deref(), Some("lo"));
    }

    #[test]
    fn error_files_as_torch_writes_them() {
        let rec = r#"{"message": {"message": "ValueError: boom at step 7", "extraInfo": {"py_callstack": "Traceback...", "timestamp": "1"}}}"#;
        assert_eq!(
            error_file_message(rec).as_deref(),
            Some("ValueError: boom at step 7")
        );
        assert_eq!(
            error_file_message(r#"{"message": "plain"}"#).as_deref(),
            Some("plain")
        );
        assert_eq!(error_file_message("not json"), None);
        assert_eq!(error_file_message(r#"{"message": ""}"#), None);
    }

    #[test]
    fn the_standby_imports_nothing_from_the_working_directory_and_runs_as_python_does() {
        // the tenant's plant (issue 66): modules named as the standard library's, in the
        // directory the standby interpreter starts in
        let dir = std::env::temp_dir().join(format!("ductile-safe-path-{}", std::process::id()));
        let code = dir.join("code");
        std::fs::create_dir_all(&code).unwrap();
        for m in ["json", "runpy", "importlib"] {
            std::fs::write(
                dir.join(format!("{m}.py")),
                "import sys\nsys.stderr.write('PLANTED\\n')\nsys.exit(3)\n",
            )
            .unwrap();
        }
        std::fs::write(code.join("helper.py"), "OK = 'helper ok'\n").unwrap();
        std::fs::write(
            code.join("prog.py"),
            "import sys, helper\nprint(sys.path[0])\nprint(helper.OK)\n",
        )
        .unwrap();
        let mut child = std::process::Command::new("python3")
            .arg("-c")
            .arg(STANDBY)
            .current_dir(&dir)
            .env_remove("PYTHONPATH")
            .env("DUCTILE_PRELOAD", "")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        let req = serde_json::json!({"env": {}, "argv": [code.join("prog.py")]});
        writeln!(child.stdin.take().unwrap(), "{req}").unwrap();
        let out = child.wait_with_output().unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{stdout}{stderr}");
        assert!(!stderr.contains("PLANTED"), "{stderr}");
        // the script's directory first, as `python3 prog.py` puts it
        let mut lines = stdout.lines();
        assert_eq!(lines.next(), Some(code.to_str().unwrap()));
        assert_eq!(lines.next(), Some("helper ok"));
        assert!(BOOT.starts_with(safe_path!()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn warm_start_takes_scripts_and_modules_only() {
        let c = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            warm_args(&c(&["python3", "t.py", "--x"])),
            Some(c(&["t.py", "--x"]))
        );
        assert_eq!(
            warm_args(&c(&["/v/bin/python3.11", "-m", "pkg.train"])),
            Some(c(&["-m", "pkg.train"]))
        );
        assert_eq!(
            warm_args(&c(&["python3", "-u", "t.py"])),
            None,
            "interpreter options: a cold start"
        );
        assert_eq!(warm_args(&c(&["bash", "run.sh"])), None);
        assert_eq!(warm_args(&c(&["python3"])), None);
    }

    #[test]
    fn the_integrations_boot_goes_in_front_of_the_script_keeping_interpreter_options() {
        let c = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            boot_command(&c(&["python3", "-u", "t.py", "--lr", "1"])),
            Some(c(&["python3", "-u", "-c", BOOT, "t.py", "--lr", "1"]))
        );
        assert_eq!(
            boot_command(&c(&["python3", "-m", "pkg.train", "--x"])),
            Some(c(&["python3", "-c", BOOT, "-m", "pkg.train", "--x"]))
        );
        assert_eq!(
            boot_command(&c(&["python3", "-B", "-mpkg.train"])),
            Some(c(&["python3", "-B", "-c", BOOT, "-m", "pkg.train"]))
        );
        assert_eq!(boot_command(&c(&["python3", "-c", "print(1)"])), None);
        assert_eq!(boot_command(&c(&["python3"])), None);
    }
}

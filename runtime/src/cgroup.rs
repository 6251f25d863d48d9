//! A program's processes in a cgroup of their own (cgroup v2), killed whole.
//!
//! The agent makes a subtree `ductile-agent.{pid}` under its own cgroup (systemd's
//! `Delegate=yes` gives a service one it may write; a root agent in a container with a
//! writable cgroup2 mount has one too) and one cgroup per worker or launcher it starts, the
//! process moved in before it runs any of the job's code. Stopping a slot, or its program
//! ending by itself, kills the cgroup whole (`cgroup.kill`: atomic, no process escapes by
//! forking, `setsid()` or a double fork), and the slot is not given to another program until
//! the cgroup is empty and removed. No controller is enabled: this is containment, not limits.
//!
//! Where no cgroup can be had, the launcher's and the agent's child-subreaper sweep
//! ([`crate::reap`]) is the fallback.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How an agent contains the processes it starts: `auto` (a cgroup when one can be had, else
/// the subreaper sweep), `off` (the sweep only), or a cgroup2 directory to create the subtree
/// in (a delegated one: the agent fails at start if it cannot write there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupMode {
    Auto,
    Off,
    At(PathBuf),
}

impl CgroupMode {
    pub fn parse(s: &str) -> Result<CgroupMode, String> {
        match s.trim() {
            "auto" | "" => Ok(CgroupMode::Auto),
            "off" => Ok(CgroupMode::Off),
            p if p.starts_with('/') => Ok(CgroupMode::At(PathBuf::from(p))),
            other => Err(format!(
                "invalid cgroup {other:?}: give auto, off, or the absolute path of a cgroup2 directory this agent may write"
            )),
        }
    }
}

/// The agent's subtree: one child cgroup per program.
#[derive(Debug, Clone)]
pub struct Cgroups {
    base: PathBuf,
}

/// The cgroup2 mount point and this process's cgroup in it (from `/proc/self/mountinfo` and
/// `/proc/self/cgroup`).
fn own_cgroup_dir() -> Result<PathBuf, String> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
    // "36 35 0:30 / /sys/fs/cgroup rw,... shared:9 - cgroup2 cgroup2 rw,..."
    let mount = mounts
        .lines()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            (post.split_whitespace().next()? == "cgroup2")
                .then(|| pre.split_whitespace().nth(4).map(PathBuf::from))
                .flatten()
        })
        .ok_or("no cgroup2 hierarchy is mounted")?;
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
    let rel = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or("this process has no cgroup2 membership")?;
    Ok(mount.join(rel.trim_start_matches('/')))
}

impl Cgroups {
    /// The subtree for this agent, or why there is none. A subtree a dead agent left
    /// (`ductile-agent.{pid}` whose pid is gone) is killed and removed first.
    pub fn open(mode: &CgroupMode) -> Result<Option<Cgroups>, String> {
        let parent = match mode {
            CgroupMode::Off => return Ok(None),
            CgroupMode::At(p) => p.clone(),
            CgroupMode::Auto => own_cgroup_dir()?,
        };
        if !parent.join("cgroup.procs").exists() {
            return Err(format!("{} is not a cgroup2 directory", parent.display()));
        }
        if let Ok(dir) = std::fs::read_dir(&parent) {
            for e in dir.flatten() {
                let name = e.file_name();
                let Some(pid) = name
                    .to_str()
                    .and_then(|n| n.strip_prefix("ductile-agent."))
                    .and_then(|p| p.parse::<u32>().ok())
                else {
                    continue;
                };
                if !Path::new(&format!("/proc/{pid}")).exists() {
                    let stale = Cgroups { base: e.path() };
                    let n = stale.remove_all(Duration::from_secs(5));
                    tracing::warn!(dir = %e.path().display(), killed = n, "removed a dead agent's cgroups");
                }
            }
        }
        let base = parent.join(format!("ductile-agent.{}", std::process::id()));
        match std::fs::create_dir(&base) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("cannot create {}: {e}", base.display())),
        }
        // a child cgroup must be creatable and joinable there (a read-only or undelegated
        // mount fails here, not at a job's start)
        let probe = Cgroup {
            dir: base.join("probe"),
        };
        let tried = std::fs::create_dir(&probe.dir)
            .map_err(|e| format!("cannot create a cgroup under {}: {e}", base.display()))
            .and_then(|_| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(probe.dir.join("cgroup.procs"))
                    .map(drop)
                    .map_err(|e| format!("cannot write cgroup.procs under {}: {e}", base.display()))
            });
        let _ = std::fs::remove_dir(&probe.dir);
        if let Err(e) = tried {
            let _ = std::fs::remove_dir(&base);
            return Err(e);
        }
        Ok(Some(Cgroups { base }))
    }

    pub fn base(&self) -> &Path {
        &self.base
    }

    /// A new, empty cgroup named `name` (one process tree: a worker or a launcher).
    pub fn create(&self, name: &str) -> std::io::Result<Cgroup> {
        let dir = self.base.join(name);
        if dir.exists() {
            // a previous cgroup of that name not yet removed: kill what is left in it
            let old = Cgroup { dir: dir.clone() };
            old.kill();
            old.wait_empty(Duration::from_secs(5));
            let _ = std::fs::remove_dir(&dir);
        }
        std::fs::create_dir(&dir)?;
        Ok(Cgroup { dir })
    }

    /// Kills and removes every cgroup of this subtree, and the subtree (the agent leaving, or a
    /// dead agent's). Returns how many processes were still there.
    pub fn remove_all(&self, bound: Duration) -> usize {
        let mut n = 0;
        if let Ok(dir) = std::fs::read_dir(&self.base) {
            for e in dir.flatten() {
                if e.path().join("cgroup.procs").exists() {
                    let cg = Cgroup { dir: e.path() };
                    n += cg.pids().len();
                    cg.kill();
                    cg.wait_empty(bound);
                    let _ = std::fs::remove_dir(&cg.dir);
                }
            }
        }
        let _ = std::fs::remove_dir(&self.base);
        n
    }
}

/// One program's cgroup.
#[derive(Debug, Clone)]
pub struct Cgroup {
    dir: PathBuf,
}

impl Cgroup {
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `cgroup.procs`, opened for writing by this (privileged) process: a child writes `0`
    /// to it before it execs (cgroup v2 checks the opener's credentials, so a child that
    /// already switched to the worker user may still move itself in).
    pub fn procs_file(&self) -> std::io::Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .write(true)
            .open(self.dir.join("cgroup.procs"))
    }

    /// Moves `pid` in (a process already started).
    pub fn add(&self, pid: u32) -> std::io::Result<()> {
        self.procs_file()?.write_all(format!("{pid}\n").as_bytes())
    }

    /// The processes in it.
    pub fn pids(&self) -> Vec<i32> {
        std::fs::read_to_string(self.dir.join("cgroup.procs"))
            .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// Whether no process is left (`populated 0`; a gone directory is empty).
    pub fn is_empty(&self) -> bool {
        match std::fs::read_to_string(self.dir.join("cgroup.events")) {
            Ok(ev) => ev.lines().any(|l| l.trim() == "populated 0"),
            Err(_) => !self.dir.exists(),
        }
    }

    /// SIGKILLs every process in it: `cgroup.kill` where the kernel has it (5.14+), else each
    /// listed process, frozen first where the freezer is there so none forks meanwhile.
    pub fn kill(&self) {
        if std::fs::write(self.dir.join("cgroup.kill"), b"1").is_ok() {
            return;
        }
        let frozen = std::fs::write(self.dir.join("cgroup.freeze"), b"1").is_ok();
        for _ in 0..100 {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            for p in pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if frozen {
            let _ = std::fs::write(self.dir.join("cgroup.freeze"), b"0");
        }
    }

    /// Waits, at most `bound`, for it to be empty; whether it is.
    pub fn wait_empty(&self, bound: Duration) -> bool {
        let until = Instant::now() + bound;
        loop {
            if self.is_empty() {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills what is in it, waits (bounded) for it to empty, and removes it. `Err` names
    /// what is still there (a process stuck in the kernel): the caller keeps the slot busy.
    pub fn destroy(&self, bound: Duration) -> Result<(), String> {
        if !self.dir.exists() {
            return Ok(());
        }
        self.kill();
        if !self.wait_empty(bound) {
            return Err(format!(
                "processes {:?} of {} did not die within {bound:?}",
                self.pids(),
                self.dir.display()
            ));
        }
        std::fs::remove_dir(&self.dir)
            .map_err(|e| format!("cannot remove {}: {e}", self.dir.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse() {
        assert_eq!(CgroupMode::parse("auto").unwrap(), CgroupMode::Auto);
        assert_eq!(CgroupMode::parse("off").unwrap(), CgroupMode::Off);
        assert_eq!(
            CgroupMode::parse("/sys/fs/cgroup/x").unwrap(),
            CgroupMode::At("/sys/fs/cgroup/x".into())
        );
        assert!(CgroupMode::parse("relative/dir")
            .unwrap_err()
            .contains("absolute path"));
    }

    #[test]
    fn a_directory_that_is_no_cgroup_is_refused() {
        let d = std::env::temp_dir().join(format!("dcg-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let e = Cgroups::open(&CgroupMode::At(d.clone())).unwrap_err();
        assert!(e.contains("is not a cgroup2 directory"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}

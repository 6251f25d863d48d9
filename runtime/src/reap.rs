//! A program's processes end with it. The launcher is a child subreaper
//! (`PR_SET_CHILD_SUBREAPER`): whatever its program starts and abandons — a `setsid()` daemon,
//! a double fork, a data loader's worker — is re-parented to the launcher instead of init, so
//! it stays among the launcher's descendants, where [`sweep`] finds and kills it after the
//! program ends (by itself or stopped) and before the next program starts. Process groups
//! alone (`killpg`) miss every process that left the group. This is the fallback the issue
//! names for nodes without cgroup delegation (a plain container); it does not contain a process
//! that was re-parented before the launcher became a subreaper (none: it becomes one at start).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag};
use nix::unistd::Pid;

/// Makes this process a child subreaper and not dumpable: orphans of its descendants come to
/// it, and processes of the same uid (its program) cannot read its memory or environment
/// through `/proc` (`PR_SET_DUMPABLE` 0).
pub fn contain_descendants() -> std::io::Result<()> {
    use nix::libc;
    // SAFETY: plain prctl calls on this process
    unsafe {
        if libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Makes this process a child subreaper only (the agent: orphans of a launcher that died
/// come to it, see [`sweep_orphans`]).
pub fn become_subreaper() -> std::io::Result<()> {
    // SAFETY: a plain prctl call on this process
    if unsafe { nix::libc::prctl(nix::libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Every live process's parent and process group (from `/proc/PID/stat`).
fn stats() -> BTreeMap<i32, (i32, i32)> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let mut f = rest.split_whitespace().skip(1);
        if let (Some(Ok(ppid)), Some(Ok(pgrp))) = (
            f.next().map(str::parse::<i32>),
            f.next().map(str::parse::<i32>),
        ) {
            out.insert(pid, (ppid, pgrp));
        }
    }
    out
}

/// The agent's sweep: its children that are none of `tracked` (its workers) and not in its
/// own process group are orphans re-parented to it from a launcher that died before it could
/// sweep its program's processes (SIGKILLed, out of memory). Each is killed with every
/// descendant, and reaped. Returns how many processes were killed.
pub fn sweep_orphans(tracked: &BTreeSet<i32>) -> usize {
    let me = std::process::id() as i32;
    let my_group = nix::unistd::getpgrp().as_raw();
    let st = stats();
    let orphans: Vec<i32> = st
        .iter()
        .filter(|(pid, (ppid, pgrp))| *ppid == me && *pgrp != my_group && !tracked.contains(pid))
        .map(|(pid, _)| *pid)
        .collect();
    let mut killed = 0;
    for o in orphans {
        for p in descendants(o, &BTreeSet::new()).into_iter().chain([o]) {
            if kill(Pid::from_raw(p), Signal::SIGKILL).is_ok() {
                killed += 1;
            }
        }
        let _ = waitpid(Pid::from_raw(o), Some(WaitPidFlag::WNOHANG));
    }
    killed
}

/// Every live process's parent.
fn parents() -> BTreeMap<i32, i32> {
    stats()
        .into_iter()
        .map(|(pid, (ppid, _))| (pid, ppid))
        .collect()
}

/// The descendants of `root`, leaving out the subtrees of `keep`.
pub fn descendants(root: i32, keep: &BTreeSet<i32>) -> Vec<i32> {
    let parents = parents();
    let mut children: BTreeMap<i32, Vec<i32>> = BTreeMap::new();
    for (pid, ppid) in &parents {
        children.entry(*ppid).or_default().push(*pid);
    }
    let mut out = Vec::new();
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        for c in children.get(&p).into_iter().flatten() {
            if !keep.contains(c) {
                out.push(*c);
                stack.push(*c);
            }
        }
    }
    out
}

/// Kills (SIGKILL) every descendant of this process but the subtrees of `keep`, reaping those
/// that are its own children, until none is left or `bound` passes. Returns how many were
/// killed and how many remain (a process in uninterruptible sleep can outlive the bound).
pub fn sweep(keep: &BTreeSet<i32>, bound: Duration) -> (usize, Vec<i32>) {
    let me = std::process::id() as i32;
    let t0 = Instant::now();
    let mut killed = BTreeSet::new();
    loop {
        let left = descendants(me, keep);
        let parents = parents();
        for p in &left {
            let _ = kill(Pid::from_raw(*p), Signal::SIGKILL);
            killed.insert(*p);
            if parents.get(p) == Some(&me) {
                // a re-parented orphan: ours to reap (tokio reaps only the children it spawned)
                let _ = waitpid(Pid::from_raw(*p), Some(WaitPidFlag::WNOHANG));
            }
        }
        if left.is_empty() || t0.elapsed() > bound {
            return (killed.len(), left);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

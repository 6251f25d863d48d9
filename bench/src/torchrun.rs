//! `ductile-bench torchrun-recovery`: the DDP script of `examples/torchrun/ddp_train.py` at 4
//! CPU workers (gloo), one of them SIGKILLed per round; the time from the kill to the next
//! completed training step of the restarted world (rank 0's step log: the first step by a
//! process that did not run before the kill), under `torchrun --nproc-per-node=4
//! --max-restarts=N` (with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, else it rarely recovers) and
//! under ductile (`runtime = "torchrun"`, one agent with 4 slots, a restart budget: the world
//! restarts at 4 as torchrun's does). Also ductile's time from `dctl scale` to the first step
//! at the new size.

use std::collections::BTreeSet;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ductile_tests::*;

use crate::{median, recovery_summary as summary};

/// Training between two kills (a failure every few seconds is not what either system is for:
/// ductile's launchers start their next standby interpreter once the program reports).
pub(crate) const PAUSE: Duration = Duration::from_secs(8);

/// Rank 0's step log, read as it grows: (unix time, pid, world, step) per step.
pub(crate) struct StepLog {
    path: PathBuf,
    offset: u64,
    partial: String,
    pids: BTreeSet<u32>,
    pub(crate) last: Option<(f64, u32, u32, u64)>,
}

impl StepLog {
    pub(crate) fn new(path: &Path) -> StepLog {
        StepLog {
            path: path.to_path_buf(),
            offset: 0,
            partial: String::new(),
            pids: BTreeSet::new(),
            last: None,
        }
    }

    /// The lines written since the last call.
    fn poll(&mut self) -> Vec<(f64, u32, u32, u64)> {
        let Ok(mut f) = std::fs::File::open(&self.path) else {
            return Vec::new();
        };
        let _ = f.seek(SeekFrom::Start(self.offset));
        let mut s = String::new();
        let n = f.read_to_string(&mut s).unwrap_or(0);
        self.offset += n as u64;
        self.partial.push_str(&s);
        let mut out = Vec::new();
        while let Some(i) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=i).collect();
            let parsed = step_log_line(&line);
            if let Some(e) = parsed {
                out.push(e);
            }
        }
        for e in &out {
            self.last = Some(*e);
        }
        out
    }

    /// Wait (bounded) for `n` more steps; every step seen so far is "before".
    pub(crate) async fn steps(&mut self, n: u64, limit: Duration) -> anyhow::Result<()> {
        let t0 = Instant::now();
        let mut seen = 0;
        while seen < n {
            for e in self.poll() {
                self.pids.insert(e.1);
                seen += 1;
            }
            anyhow::ensure!(t0.elapsed() < limit, "no {n} steps within {limit:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Seconds from `t_kill` (unix time) to the first step by a process that did not step
    /// before (the restarted world), and its world size; None after `limit`.
    pub(crate) async fn restarted(
        &mut self,
        t_kill: f64,
        limit: Duration,
        world: Option<u32>,
    ) -> Option<(f64, u32)> {
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            for e in self.poll() {
                if e.0 > t_kill && !self.pids.contains(&e.1) && world.is_none_or(|w| w == e.2) {
                    self.pids.insert(e.1);
                    return Some((e.0 - t_kill, e.2));
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        None
    }
}

pub(crate) fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn script_args(dir: &Path, log: &Path) -> Vec<String> {
    [
        "--steps",
        "100000000",
        "--ckpt-every",
        "10",
        "--step-sleep",
        "0.02",
        "--ckpt-dir",
        &dir.join("ckpt").display().to_string(),
        "--step-log",
        &log.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The worker processes of a torchrun agent (its children).
pub(crate) fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

pub async fn recovery(rounds: usize, skip_torchrun: bool) -> anyhow::Result<()> {
    let py = torch_python_bin();
    let script = repo_root().join("examples/torchrun/ddp_train.py");
    let bound = Duration::from_secs(60);

    // torchrun itself
    let mut theirs = Vec::new();
    let mut theirs_failed = 0;
    if !skip_torchrun {
        let dir = TempDir::new("bench-torchrun");
        std::fs::create_dir_all(dir.path().join("ckpt"))?;
        let log = dir.path().join("steps.log");
        let mut agent: Child = Command::new(&py)
            .args([
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=4",
            ])
            .arg(format!("--max-restarts={}", rounds + 1))
            .arg(&script)
            .args(script_args(dir.path(), &log))
            .env("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("torchrun.log"))?)
            .spawn()?;
        let mut steps = StepLog::new(&log);
        steps.steps(30, bound).await?;
        for round in 0..rounds {
            tokio::time::sleep(PAUSE).await;
            let workers = children(agent.id());
            anyhow::ensure!(
                workers.len() == 4,
                "torchrun runs {} workers, not 4",
                workers.len()
            );
            let victim = workers[round % 4];
            let t_kill = unix_now();
            unsafe { libc::kill(victim as i32, libc::SIGKILL) };
            match steps.restarted(t_kill, bound, None).await {
                Some((s, w)) => {
                    println!("torchrun, kill {round} (pid {victim}): next step of the restarted world (size {w}) after {s:.3} s");
                    theirs.push(s);
                    steps.steps(30, bound).await?;
                }
                None => {
                    println!("torchrun, kill {round} (pid {victim}): no step within {} s: it did not recover (see {})", bound.as_secs(), dir.path().join("torchrun.log").display());
                    theirs_failed += 1;
                    break;
                }
            }
        }
        let _ = agent.kill();
        let _ = agent.wait();
        // its workers die with it (they are in its session); make sure
        std::thread::sleep(Duration::from_millis(300));
    }

    // ductile: one agent with 4 slots, the same script and arguments
    let mut c = Cluster::start(Spec::default());
    let flags = torchrun_agent_flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    c.start_agent("node1", 4, &flags);
    let dir = TempDir::new("bench-ductile-torchrun");
    std::fs::create_dir_all(dir.path().join("ckpt"))?;
    let log = dir.path().join("steps.log");
    let mut command = vec![py.clone(), script.display().to_string()];
    command.extend(script_args(dir.path(), &log));
    let command: Vec<String> = command.iter().map(|a| format!("{a:?}")).collect();
    c.submit(&format!(
        "name = \"bench\"\nruntime = \"torchrun\"\ncommand = [{}]\nmin = 1\nmax = 4\ndesired = 4\nrestart_budget = 1000\n[torchrun]\ngrace_s = 5\n",
        command.join(", ")
    ));
    let mut steps = StepLog::new(&log);
    let mut ours = Vec::new();
    let mut ours_failed = 0;
    for round in 0..rounds {
        let v = c.wait_world("bench", 4, bound);
        steps.steps(30, bound).await?;
        tokio::time::sleep(PAUSE).await;
        let v = if v.members.iter().all(|m| m.program_pid.is_some()) {
            v
        } else {
            c.status("bench")
        };
        // the script (what torchrun calls the worker), not its launcher
        let victim = v.members[round % 4]
            .program_pid
            .ok_or_else(|| anyhow::anyhow!("rank {}'s script has not started", round % 4))?;
        let t_kill = unix_now();
        unsafe { libc::kill(victim as i32, libc::SIGKILL) };
        match steps.restarted(t_kill, bound, None).await {
            Some((s, w)) => {
                println!("ductile, kill {round} (rank {}, pid {victim}): next step of the restarted world (size {w}) after {s:.3} s", round % 4);
                ours.push(s);
            }
            None => {
                println!(
                    "ductile, kill {round}: no step within {} s",
                    bound.as_secs()
                );
                ours_failed += 1;
                continue;
            }
        }
    }
    // dctl scale: 4 → 3 and 3 → 4, to the first step at the new size
    let mut scale = Vec::new();
    for world in [3u32, 4, 3, 4] {
        c.wait_world("bench", if world == 3 { 4 } else { 3 }, bound);
        steps.steps(30, bound).await?;
        tokio::time::sleep(PAUSE).await;
        let t = unix_now();
        c.dctl_ok(&["scale", "bench", &world.to_string()]);
        if let Some((s, _)) = steps.restarted(t, bound, Some(world)).await {
            println!("ductile, dctl scale {world}: first step at {world} after {s:.3} s");
            scale.push(s);
        }
    }
    println!();
    if !skip_torchrun {
        println!("{}", summary("torchrun --nproc-per-node=4 --max-restarts (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), SIGKILL of a worker → next step", &theirs, theirs_failed));
    }
    println!("{}", summary("ductile runtime = \"torchrun\", SIGKILL of a worker → next step of the restarted world (4)", &ours, ours_failed));
    println!(
        "{}",
        summary(
            "ductile, dctl scale → first step at the new size",
            &scale,
            0
        )
    );
    if !theirs.is_empty() && !ours.is_empty() {
        println!(
            "ratio ductile / torchrun (medians): {:.3}",
            median(&mut ours.clone()) / median(&mut theirs.clone())
        );
    }
    Ok(())
}

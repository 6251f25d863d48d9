//! The chaos soak: a local cluster (etcd, 2 daemons, 4 agents, an S3-compatible server behind a
//! proxy) trains a deterministic job with checkpoints and the exactly-once ledger while a
//! seeded random schedule of faults hits it: SIGKILL of a worker, an agent, the leader daemon;
//! SIGSTOP of a worker or an agent past its lease, then SIGCONT; etcd killed and restarted on
//! its data directory; the S3 server cut off mid-upload and back; S3 answering 503 to every
//! request while every worker is killed (a cold start against a store that sheds load: it must
//! retry and restore etcd's latest commit, never fall back to an older one); S3 answering 503 to
//! the `COMMIT` puts; `dctl scale` and `dctl drain` in between. After the last fault and the
//! job's end, a rollback: the job submitted again with `restore_step` at an older commit while
//! S3 answers 503 to the supersede markers. At the end it checks what a user relies on: the
//! job succeeded (twice); every sample was used exactly once per epoch; no committed step was
//! lost (every commit etcd recorded is still restorable, or older than the `keep` newest that
//! retention keeps, or superseded by the rollback, and every retained commit's CRCs hold);
//! every cold start restored the commit etcd named; the final weights equal an uninterrupted
//! run's bit for bit, after the faults and after the rollback; no process is left behind.
//!
//! Then two smaller clusters, each with its own faults (`Config::side_faults`): an async job
//! with checkpoints whose member 0 is killed, whose workers are killed (one, or all: a cold
//! start from an async checkpoint), and whose member 0 cuts decisions short by itself
//! (`DUCTILE_FAULT_EXIT_MID_DECIDE`); and a streaming DiLoCo job whose workers are killed and
//! whose rank 1 leaves between two exchanges by itself (`DUCTILE_FAULT_EXIT_BETWEEN_EXCHANGES`).
//! Each must finish with every sample applied once (the async and DiLoCo ledgers).
//!
//! Used by the CI test (`tests/tests/chaos.rs`, a short profile) and by `ductile-bench chaos`
//! (the long one). A violation names the seed that replays the schedule.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use ductile_checkpoint::restore::{committed, fetch, load_manifest};
use ductile_checkpoint::{plan, Bucket};
use ductile_cluster::api::JobView;
use ductile_cluster::records::{CheckpointRecord, CheckpointStats, JobState};

use crate::*;

/// What to run.
#[derive(Clone, Debug)]
pub struct Config {
    pub seed: u64,
    /// Faults to inject.
    pub faults: usize,
    /// Training steps of the job (enough to outlast the faults).
    pub steps: u64,
    /// Faults injected into each of the async and streaming DiLoCo jobs (0: no such phase).
    pub side_faults: usize,
}

/// One injected fault and how long the job took to train past where it was.
#[derive(Clone, Debug)]
pub struct Fault {
    pub kind: &'static str,
    pub target: String,
    pub at_step: u64,
    /// Seconds from the fault to the first progress report past `at_step`; None if the job
    /// did not recover within the bound (a violation).
    pub recovery_s: Option<f64>,
}

#[derive(Debug, Default)]
pub struct Report {
    pub seed: u64,
    pub faults: Vec<Fault>,
    pub generations: u64,
    pub commits_seen: usize,
    pub commits_verified: usize,
    pub final_sha256: Option<String>,
    pub reference_sha256: Option<String>,
    /// The uninterrupted run's generations (`g{n} {reason} world {w} [{state_source}]`): one,
    /// unless something re-formed even that run.
    pub reference_generations: Vec<String>,
    /// Cold starts whose restored step was checked against etcd's latest commit.
    pub restores_checked: usize,
    /// The rollback's final weights (the same bits again).
    pub rollback_sha256: Option<String>,
    /// A line per side phase (async, DiLoCo).
    pub phases: Vec<String>,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl Report {
    /// A few lines for a terminal or a test log.
    pub fn summary(&self) -> String {
        let mut by_kind: BTreeMap<&str, usize> = BTreeMap::new();
        for f in &self.faults {
            *by_kind.entry(f.kind).or_default() += 1;
        }
        let mut rec: Vec<f64> = self.faults.iter().filter_map(|f| f.recovery_s).collect();
        rec.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let median = rec.get(rec.len() / 2).copied().unwrap_or(f64::NAN);
        let max = rec.last().copied().unwrap_or(f64::NAN);
        let mut s = format!(
            "chaos seed {}: {} faults in {:.0} s ({by_kind:?}); recovery (fault → training past it) median {median:.2} s, max {max:.2} s over {}; {} generations; {} commits seen, {} retained commits verified; {} cold starts restored etcd's latest; final weights {} (after the rollback {}; uninterrupted run {})\n",
            self.seed,
            self.faults.len(),
            self.seconds,
            rec.len(),
            self.generations,
            self.commits_seen,
            self.commits_verified,
            self.restores_checked,
            self.final_sha256.as_deref().map(|h| &h[..16]).unwrap_or("-"),
            self.rollback_sha256.as_deref().map(|h| &h[..16]).unwrap_or("-"),
            self.reference_sha256.as_deref().map(|h| &h[..16]).unwrap_or("-"),
        );
        s.push_str(&format!(
            "the uninterrupted run's generations: {}\n",
            self.reference_generations.join(", ")
        ));
        for p in &self.phases {
            s.push_str(p);
            s.push('\n');
        }
        if self.violations.is_empty() {
            s.push_str("no violation\n");
        } else {
            for v in &self.violations {
                s.push_str(&format!(
                    "VIOLATION (replay with seed {}): {v}\n",
                    self.seed
                ));
            }
        }
        s
    }
}

/// SplitMix64: the schedule is a pure function of the seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

const SAMPLES: u64 = 2_000;
const BATCH: u64 = 32;
const KEEP: usize = 3;

fn job(name: &str, data: &str, steps: u64, desired: u32, ckpt: Option<&str>) -> String {
    job_at(name, data, steps, desired, ckpt, None)
}

/// [`job`], resuming from the commit at `restore` if given.
fn job_at(
    name: &str,
    data: &str,
    steps: u64,
    desired: u32,
    ckpt: Option<&str>,
    restore: Option<u64>,
) -> String {
    let mut s = format!(
        "{}max_steps = {steps}\ndeterministic = true\noptimizer = \"adamw\"\nlogical_shards = 12\n",
        training_toml(
            name,
            1,
            6,
            desired,
            "mlp",
            data,
            "restart_budget = 1000\nstall_timeout_s = 120"
        )
    );
    if let Some(url) = ckpt {
        s.push_str(&checkpoint_toml(url, 40, KEEP));
        if let Some(step) = restore {
            s.push_str(&format!("restore_step = {step}\n"));
        }
    }
    s
}

/// The agents' environment for their workers: the exactly-once ledger in `ledger`, and a
/// 3 s liveness bound (a stopped peer is found in seconds).
fn agent_env(ledger: &TempDir) -> Vec<(String, String)> {
    vec![
        (
            "DUCTILE_LEDGER_DIR".into(),
            ledger.path().display().to_string(),
        ),
        ("DUCTILE_COMM_LIVENESS_MS".into(), "3000".into()),
    ]
}

/// A job's `[checkpoint]` section.
fn checkpoint_toml(url: &str, interval: u64, keep: usize) -> String {
    format!("[checkpoint]\nurl = \"{url}\"\ninterval = {interval}\nkeep = {keep}\n")
}

fn try_status(c: &Cluster, job: &str) -> Option<JobView> {
    let (ok, out, _) = c.dctl(&["status", job, "--json"]);
    ok.then(|| serde_json::from_str(&out).ok()).flatten()
}

/// A liveness bound for training `steps` from the start: generous (10 steps a second, at
/// least 15 minutes) on a 2-core machine that trains this job at 200-300 steps a second.
fn run_bound(steps: u64) -> Duration {
    Duration::from_secs((steps / 10).max(900))
}

/// The soak's uninterrupted run of `steps` on a quiet cluster of its own (one agent of two
/// slots): its final weights' SHA-256 and its generations (a diagnosis, should the reference
/// itself be the odd one out: CI once saw its bits differ from both the faulted run's and its
/// rollback's, which agreed).
pub fn reference(steps: u64) -> (Option<String>, Vec<String>) {
    reference_killed(steps, None)
}

/// [`reference`], with the worker of rank `rank` SIGKILLed once the job has passed step
/// `step` where `kill` is given (its agent restarts it; the world re-forms on the one node
/// from the survivor's state): the same bits are due.
pub fn reference_killed(steps: u64, kill: Option<(u64, u32)>) -> (Option<String>, Vec<String>) {
    let c = Cluster::start(Spec::default().agents(1, 2));
    let data = synth(c.dir.path(), "regression", SAMPLES);
    c.submit(&job("reference", &data, steps, 2, None));
    if let Some((step, rank)) = kill {
        let pid = c.wait_for(run_bound(steps), "the step to kill at", || {
            try_status(&c, "reference")
                .filter(|v| v.step >= step)
                .and_then(|v| v.members.iter().find(|m| m.rank == rank)?.pid)
        });
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    let done = c.wait_for(run_bound(steps), "the reference run", || {
        try_status(&c, "reference").filter(|v| v.state == JobState::Succeeded)
    });
    let generations = c
        .history("reference")
        .iter()
        .map(|g| {
            format!(
                "g{} {:?} world {} [{:?}]",
                g.number, g.reason, g.world_size, g.state_source
            )
        })
        .collect();
    (done.final_weights_sha256, generations)
}

/// Run the soak. Panics only on harness failures (a process that cannot start); what the
/// system under test gets wrong is reported as violations.
pub fn run(cfg: &Config) -> Report {
    let t_start = Instant::now();
    let mut report = Report {
        seed: cfg.seed,
        ..Default::default()
    };
    println!(
        "chaos seed {} ({} faults, {} steps)",
        cfg.seed, cfg.faults, cfg.steps
    );

    // the uninterrupted run, on a quiet cluster of its own
    let (sha, generations) = reference(cfg.steps);
    report.reference_sha256 = sha;
    report.reference_generations = generations;

    let ledger = TempDir::new("chaos-ledger");
    let mut c = Cluster::start(Spec {
        daemons: 2,
        s3_proxy: true,
        lease_ttl: 2,
        election_ttl: 2,
        restart_backoff_ms: 500,
        agent_env: agent_env(&ledger),
        ..Spec::default().agents(4, 2)
    });
    let data = synth(c.dir.path(), "regression", SAMPLES);
    let url = format!("s3://{}/jobs/chaos", c.s3.as_ref().unwrap().bucket);
    c.submit(&job("chaos", &data, cfg.steps, 4, Some(&url)));
    c.wait_world("chaos", 4, Duration::from_secs(60));

    let mut rng = Rng(cfg.seed);
    let mut commits: BTreeSet<(u64, u64)> = BTreeSet::new();
    let mut pids: BTreeSet<u32> = BTreeSet::new();
    let store = {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let s = rt.block_on(c.store());
        (rt, s)
    };
    let observe = |c: &Cluster, commits: &mut BTreeSet<(u64, u64)>, pids: &mut BTreeSet<u32>| {
        if let Some(v) = try_status(c, "chaos") {
            pids.extend(v.members.iter().filter_map(|m| m.pid));
        }
        let (rt, s) = &store;
        if let Ok(Ok(Some((r, _)))) = rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(3),
                s.get_json::<CheckpointRecord>(&s.keys.checkpoint("chaos"), "checkpoint"),
            )
            .await
        }) {
            commits.insert((r.step, r.generation));
        }
    };
    for a in c.agents.values() {
        pids.insert(a.pid());
    }
    let kinds = [
        "kill-worker",
        "stop-worker",
        "kill-agent",
        "stop-agent",
        "kill-leader",
        "restart-etcd",
        "s3-outage",
        "scale",
        "drain",
        "cold-start-503",
        "commit-503",
    ];
    let mut order: Vec<usize> = (0..kinds.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut drained: Option<String> = None;
    while report.faults.len() < cfg.faults {
        // training, and past the last fault's step
        let v = match c.wait_for_opt(Duration::from_secs(120), || {
            observe(&c, &mut commits, &mut pids);
            try_status(&c, "chaos").filter(|v| {
                v.state.is_terminal()
                    || (v.state == JobState::Running
                        && v.members.iter().all(|m| m.pid.is_some())
                        && !v.members.is_empty())
            })
        }) {
            Some(v) if v.state.is_terminal() => {
                report.violations.push(format!(
                    "the job ended ({:?}) at step {} before {} faults were injected: give it more steps",
                    v.state, v.step, cfg.faults
                ));
                break;
            }
            Some(v) => v,
            None => {
                report
                    .violations
                    .push("the job was not running with every worker for 120 s".into());
                break;
            }
        };
        if v.step + 60 >= cfg.steps {
            report.violations.push(format!(
                "the job reached step {} before {} faults were injected: give it more steps",
                v.step, cfg.faults
            ));
            break;
        }
        std::thread::sleep(rng.ms(500, 2500));
        let at_step = try_status(&c, "chaos").map(|v| v.step).unwrap_or(v.step);
        // every kind once (in a seeded order) before the rest are drawn at random
        let kind = if report.faults.len() < kinds.len() {
            kinds[order[report.faults.len()]]
        } else {
            kinds[rng.below(kinds.len() as u64) as usize]
        };
        // the last restore before the fault: a cold start after it must change it
        let restore_before = restore_stats(&store);
        let t0 = Instant::now();
        let target = inject(&mut c, &mut rng, kind, &v, &mut drained);
        // a cold start against a store answering 503: what it must restore is etcd's latest
        // commit (read while no worker lives, before the store answers again)
        let restore_due = (kind == "cold-start-503").then(|| {
            std::thread::sleep(rng.ms(3000, 8000));
            let (rt, s) = &store;
            let latest = rt
                .block_on(s.get_json::<CheckpointRecord>(&s.keys.checkpoint("chaos"), "checkpoint"))
                .ok()
                .flatten()
                .map(|(r, _)| r.step);
            c.s3_proxy.as_ref().unwrap().answer_503(None);
            latest
        });
        // recovered: training past where the fault found it
        let recovered = c.wait_for_opt(Duration::from_secs(120), || {
            observe(&c, &mut commits, &mut pids);
            try_status(&c, "chaos").filter(|v| v.step > at_step + 2 || v.state.is_terminal())
        });
        let recovery_s = recovered.as_ref().map(|_| t0.elapsed().as_secs_f64());
        println!(
            "fault {:>3}: {kind:<12} {target:<18} at step {at_step:>6}: {}",
            report.faults.len() + 1,
            recovery_s
                .map(|s| format!("training again after {s:.2} s"))
                .unwrap_or_else(|| "NOT RECOVERED within 120 s".into())
        );
        if recovered.is_none() {
            report.violations.push(format!(
                "after fault {} ({kind} {target} at step {at_step}) the job did not train again within 120 s",
                report.faults.len() + 1
            ));
        }
        if let (Some(Some(want)), Some(_)) = (restore_due, &recovered) {
            let after = restore_stats(&store);
            let got = after.and_then(|(step, _)| step);
            // no new restore: a worker the status did not list yet (one that had just joined)
            // lived through the kills and held the state, so there was no cold start to check
            let restored = after != restore_before;
            report.restores_checked += restored as usize;
            if restored && got != Some(want) {
                report.violations.push(format!(
                    "fault {}: the cold start under 503s restored step {got:?}, not etcd's latest commit {want}",
                    report.faults.len() + 1
                ));
            }
        }
        report.faults.push(Fault {
            kind,
            target,
            at_step,
            recovery_s,
        });
        if recovered.is_none() {
            break;
        }
        if let Some(n) = drained.take() {
            // the drained node comes back for later faults
            let _ = c.dctl(&["drain", &n, "--undo"]);
        }
    }
    // everything back, and the job to its end
    if let Some(n) = drained.take() {
        let _ = c.dctl(&["drain", &n, "--undo"]);
    }
    let _ = c.dctl(&["scale", "chaos", "4"]);
    let done = c.wait_for_opt(run_bound(cfg.steps), || {
        observe(&c, &mut commits, &mut pids);
        try_status(&c, "chaos").filter(|v| v.state.is_terminal())
    });
    match &done {
        Some(v) if v.state == JobState::Succeeded => {
            report.final_sha256 = v.final_weights_sha256.clone();
            if v.step != cfg.steps {
                report
                    .violations
                    .push(format!("finished at step {}, not {}", v.step, cfg.steps));
            }
        }
        Some(v) => report
            .violations
            .push(format!("the job ended {:?}: {}", v.state, v.message)),
        None => report
            .violations
            .push("the job did not finish within 900 s after the last fault".into()),
    }
    if report.final_sha256.is_some() && report.final_sha256 != report.reference_sha256 {
        report.violations.push(format!(
            "final weights {:?} differ from the uninterrupted run's {:?}",
            report.final_sha256, report.reference_sha256
        ));
    }
    let s3 = c.s3.as_ref().unwrap();
    for (k, v) in s3.env() {
        std::env::set_var(k, v);
    }
    // the rollback: submitted again at the oldest retained commit while the store answers 503
    // to the supersede markers (the commits above it must end superseded, never deleted while
    // etcd's lineage names them, never restored)
    if report.final_sha256.is_some() {
        let (rt, s) = &store;
        let latest = rt
            .block_on(s.get_json::<CheckpointRecord>(&s.keys.checkpoint("chaos"), "checkpoint"))
            .ok()
            .flatten()
            .map(|(r, _)| r);
        let oldest = rt.block_on(async {
            let bucket = Bucket::open(&url).ok()?;
            let list = committed(&bucket, latest.as_ref()).await.ok()?;
            list.into_iter()
                .filter(|r| r.step < cfg.steps)
                .min_by_key(|r| r.step)
        });
        match oldest {
            None => report
                .violations
                .push("no retained commit to roll back to".into()),
            Some(r) => {
                let t0 = Instant::now();
                let p = c.s3_proxy.as_ref().unwrap();
                p.answer_503(Some("SUPERSEDED"));
                c.submit(&job_at(
                    "chaos",
                    &data,
                    cfg.steps,
                    4,
                    Some(&url),
                    Some(r.step),
                ));
                std::thread::sleep(rng.ms(3000, 6000));
                p.answer_503(None);
                // the commits above the rollback's step are superseded: no longer restorable
                commits.retain(|(step, _)| *step <= r.step);
                let done = c.wait_for_opt(run_bound(cfg.steps), || {
                    observe(&c, &mut commits, &mut pids);
                    try_status(&c, "chaos").filter(|v| v.state.is_terminal())
                });
                println!(
                    "fault {:>3}: rollback-503  to step {:>6}: {}",
                    report.faults.len() + 1,
                    r.step,
                    done.as_ref()
                        .map(|v| format!("{:?} after {:.2} s", v.state, t0.elapsed().as_secs_f64()))
                        .unwrap_or_else(|| "NOT FINISHED".into())
                );
                report.faults.push(Fault {
                    kind: "rollback-503",
                    target: format!("to step {}", r.step),
                    at_step: cfg.steps,
                    recovery_s: done.as_ref().map(|_| t0.elapsed().as_secs_f64()),
                });
                match done {
                    Some(v) if v.state == JobState::Succeeded => {
                        report.rollback_sha256 = v.final_weights_sha256.clone();
                        if report.rollback_sha256 != report.reference_sha256 {
                            report.violations.push(format!(
                                "after the rollback to step {}: final weights {:?} differ from the uninterrupted run's {:?}",
                                r.step, report.rollback_sha256, report.reference_sha256
                            ));
                        }
                    }
                    Some(v) => report.violations.push(format!(
                        "the rollback to step {} ended {:?}: {}",
                        r.step, v.state, v.message
                    )),
                    None => report
                        .violations
                        .push(format!("the rollback to step {} did not finish", r.step)),
                }
            }
        }
    }
    report.generations = try_status(&c, "chaos").map(|v| v.generation).unwrap_or(0);
    report.violations.extend(crate::ledger::violations(
        ledger.path(),
        cfg.steps,
        SAMPLES,
        BATCH,
    ));

    // no committed step lost
    report.commits_seen = commits.len();
    let (rt, s) = &store;
    let latest = rt
        .block_on(s.get_json::<CheckpointRecord>(&s.keys.checkpoint("chaos"), "checkpoint"))
        .ok()
        .flatten()
        .map(|(r, _)| r);
    match rt.block_on(async {
        let bucket = Bucket::open(&url).map_err(|e| e.to_string())?;
        let list = committed(&bucket, latest.as_ref())
            .await
            .map_err(|e| e.to_string())?;
        let mut verified = Vec::new();
        for r in &list {
            let m = load_manifest(&bucket, r)
                .await
                .map_err(|e| format!("step {}: {e}", r.step))?;
            let all = plan::readers(&m, 1).remove(0);
            fetch(&bucket, &m, &all, 4)
                .await
                .map_err(|e| format!("step {}: {e}", r.step))?;
            verified.push((r.step, r.generation));
        }
        Ok::<_, String>(verified)
    }) {
        Ok(verified) => {
            report.commits_verified = verified.len();
            let oldest = verified.iter().min().copied();
            for c in &commits {
                let kept = oldest.is_some_and(|o| *c >= o);
                if kept && !verified.contains(c) {
                    report.violations.push(format!(
                        "commit at step {} (generation {}) recorded by etcd is gone from the store",
                        c.0, c.1
                    ));
                }
            }
            if let Some(l) = &latest {
                if !verified.contains(&(l.step, l.generation)) {
                    report.violations.push(format!(
                        "etcd's latest commit (step {}) does not restore",
                        l.step
                    ));
                }
            }
        }
        Err(e) => report
            .violations
            .push(format!("a committed checkpoint does not verify: {e}")),
    }

    // no process left behind
    drop(c);
    let t = Instant::now();
    let mut left: Vec<u32> = pids.iter().copied().filter(|p| pid_alive(*p)).collect();
    while !left.is_empty() && t.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(200));
        left.retain(|p| pid_alive(*p));
    }
    if !left.is_empty() {
        report
            .violations
            .push(format!("processes left behind: {left:?}"));
    }
    if cfg.side_faults > 0 {
        side_phase(cfg, &mut rng, &mut report, Side::Async);
        side_phase(cfg, &mut rng, &mut report, Side::Diloco);
    }
    report.seconds = t_start.elapsed().as_secs_f64();
    report
}

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Async,
    Diloco,
}

/// A side phase (module docs): its own cluster and job, `cfg.side_faults` faults, then the
/// job's ledger.
fn side_phase(cfg: &Config, rng: &mut Rng, report: &mut Report, side: Side) {
    let t_start = Instant::now();
    let ledger = TempDir::new("chaos-side-ledger");
    let c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        agent_env: agent_env(&ledger),
        ..Spec::default().agents(2, 2)
    });
    let data = synth(c.dir.path(), "regression", SAMPLES);
    let name = match side {
        Side::Async => "async",
        Side::Diloco => "diloco",
    };
    let steps = cfg.side_faults as u64 * 400 + 600;
    let side_store = |dir: &str| format!("file://{}", c.dir.path().join(dir).display());
    let (env, mode, kinds) = match side {
        // member 0 cuts the decision short at every 400 steps' worth of positions applied
        Side::Async => (
            "DUCTILE_FAULT_EXIT_MID_DECIDE = \"6400:12800\"",
            format!(
                "sync = \"async\"\n[training.async]\nstaleness = 2\n{}",
                checkpoint_toml(&side_store("ckpt-async"), 50, 3)
            ),
            &["kill-member-0", "kill-worker", "kill-every-worker"][..],
        ),
        // rank 1 leaves between two exchanges in round 3 and every 5 rounds after it
        Side::Diloco => (
            "DUCTILE_FAULT_EXIT_BETWEEN_EXCHANGES = \"1:3:5\"",
            format!(
                "sync = \"diloco\"\n[training.diloco]\ninner_steps = 16\nfragments = 4\n{}",
                checkpoint_toml(&side_store("ckpt-diloco"), 40, 3)
            ),
            &["kill-member-0", "kill-worker", "scale"][..],
        ),
    };
    let spec = format!(
        "{}max_steps = {steps}\noptimizer = \"adamw\"\n{mode}",
        training_toml(
            name,
            1,
            4,
            3,
            "mlp",
            &data,
            &format!("restart_budget = 1000\nallow_fault_injection = true\nenv = {{ {env} }}"),
        )
    );
    c.submit(&spec);
    let mut faults = 0;
    let mut line_faults: BTreeMap<&str, usize> = BTreeMap::new();
    while faults < cfg.side_faults {
        let v = c.wait_for_opt(Duration::from_secs(120), || {
            try_status(&c, name).filter(|v| {
                v.state.is_terminal()
                    || (v.state == JobState::Running
                        && !v.members.is_empty()
                        && v.members.iter().all(|m| m.pid.is_some()))
            })
        });
        let Some(v) = v.filter(|v| !v.state.is_terminal() && v.step + 60 < steps) else {
            report.violations.push(format!(
                "{name}: the job was not running with every worker before {} faults (or ran out of steps)",
                cfg.side_faults
            ));
            break;
        };
        std::thread::sleep(rng.ms(500, 2500));
        let at_step = try_status(&c, name).map(|v| v.step).unwrap_or(v.step);
        let kind = kinds[rng.below(kinds.len() as u64) as usize];
        let t0 = Instant::now();
        let target = match kind {
            "kill-member-0" => {
                let m = v
                    .members
                    .iter()
                    .find(|m| m.rank == 0)
                    .unwrap_or(&v.members[0]);
                signal(m.pid.unwrap(), libc::SIGKILL);
                format!("{}/{}", m.node, m.slot)
            }
            "kill-worker" => {
                let m = &v.members[rng.below(v.members.len() as u64) as usize];
                signal(m.pid.unwrap(), libc::SIGKILL);
                format!("{}/{}", m.node, m.slot)
            }
            "kill-every-worker" => {
                for m in &v.members {
                    signal(m.pid.unwrap(), libc::SIGKILL);
                }
                "every worker".into()
            }
            "scale" => {
                let to = 2 + rng.below(3);
                let _ = c.dctl(&["scale", name, &to.to_string()]);
                format!("to {to}")
            }
            other => unreachable!("unknown fault {other}"),
        };
        let recovered = c.wait_for_opt(Duration::from_secs(120), || {
            try_status(&c, name).filter(|v| v.step > at_step + 2 || v.state.is_terminal())
        });
        let recovery_s = recovered.as_ref().map(|_| t0.elapsed().as_secs_f64());
        if recovery_s.is_none_or(|s| s > 30.0) {
            // a slow recovery: what the processes said, for the report's reader
            println!(
                "{name}: slow recovery after {kind}; the cluster's logs:{}",
                c.log_tails()
            );
        }
        faults += 1;
        *line_faults.entry(kind).or_default() += 1;
        println!(
            "{name} fault {faults:>3}: {kind:<17} {target:<12} at step {at_step:>6}: {}",
            recovery_s
                .map(|s| format!("training again after {s:.2} s"))
                .unwrap_or_else(|| "NOT RECOVERED within 120 s".into())
        );
        report.faults.push(Fault {
            kind: match (side, kind) {
                (Side::Async, "kill-member-0") => "async-kill-member-0",
                (Side::Async, "kill-worker") => "async-kill-worker",
                (Side::Async, _) => "async-kill-every-worker",
                (Side::Diloco, "kill-member-0") => "diloco-kill-member-0",
                (Side::Diloco, "kill-worker") => "diloco-kill-worker",
                (Side::Diloco, _) => "diloco-scale",
            },
            target,
            at_step,
            recovery_s,
        });
        if recovered.is_none() {
            report.violations.push(format!(
                "{name}: after {kind} at step {at_step} the job did not train again within 120 s"
            ));
            break;
        }
    }
    let _ = c.dctl(&["scale", name, "3"]);
    let done = c.wait_for_opt(run_bound(steps), || {
        try_status(&c, name).filter(|v| v.state.is_terminal())
    });
    let generations = try_status(&c, name).map(|v| v.generation).unwrap_or(0);
    match &done {
        Some(v) if v.state == JobState::Succeeded && v.step == steps => {}
        Some(v) => report.violations.push(format!(
            "{name}: the job ended {:?} at step {}: {}",
            v.state, v.step, v.message
        )),
        None => report
            .violations
            .push(format!("{name}: the job did not finish")),
    }
    let line = match side {
        Side::Async => {
            let l = crate::ledger::async_violations(ledger.path(), steps * BATCH, SAMPLES, 2);
            report
                .violations
                .extend(l.violations.iter().map(|v| format!("{name}: {v}")));
            format!(
                "async: {faults} faults {line_faults:?} in {:.0} s, {generations} generations; decisions member 0 sent to some owners only, settled in the next agreement: {}; cold starts from an async checkpoint: {}; every sample applied once: {}",
                t_start.elapsed().as_secs_f64(),
                l.recovered,
                l.restores,
                l.violations.is_empty()
            )
        }
        Side::Diloco => {
            let (v, rounds) =
                crate::ledger::round_violations(ledger.path(), steps * BATCH, SAMPLES);
            let kept = kept_rounds(ledger.path());
            report
                .violations
                .extend(v.iter().map(|v| format!("{name}: {v}")));
            format!(
                "diloco (streaming, 4 fragments): {faults} faults {line_faults:?} in {:.0} s, {generations} generations, {} rounds; rounds that kept a departed member's exchanged samples: {kept}; every sample committed once: {}",
                t_start.elapsed().as_secs_f64(),
                rounds.len(),
                v.is_empty()
            )
        }
    };
    println!("{line}");
    report.phases.push(line);
}

/// Rounds whose commit kept part of a departed member's piece (from the DiLoCo ledger).
fn kept_rounds(dir: &std::path::Path) -> usize {
    let mut rounds = BTreeSet::new();
    for f in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let text = std::fs::read_to_string(f.path()).unwrap_or_default();
        for l in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else {
                continue;
            };
            if v["committed"] == true && v["kept"].as_array().is_some_and(|k| !k.is_empty()) {
                rounds.insert(v["round"].as_u64());
            }
        }
    }
    rounds.len()
}

/// The job's last restore (its step and duration), as its checkpoint statistics record it.
fn restore_stats(
    store: &(tokio::runtime::Runtime, ductile_cluster::Store),
) -> Option<(Option<u64>, Option<f64>)> {
    let (rt, s) = store;
    rt.block_on(s.get_json::<CheckpointStats>(&s.keys.checkpoint_stats("chaos"), "stats"))
        .ok()
        .flatten()
        .map(|(x, _)| (x.last_restore_step, x.last_restore_seconds))
}

/// Inject one fault of `kind`; returns what it hit.
fn inject(
    c: &mut Cluster,
    rng: &mut Rng,
    kind: &'static str,
    v: &JobView,
    drained: &mut Option<String>,
) -> String {
    let member = &v.members[rng.below(v.members.len() as u64) as usize];
    let agent_name = |rng: &mut Rng| format!("node{}", 1 + rng.below(4));
    match kind {
        "kill-worker" => {
            let pid = member.pid.unwrap();
            signal(pid, libc::SIGKILL);
            format!("{}/{}", member.node, member.slot)
        }
        "stop-worker" => {
            let pid = member.pid.unwrap();
            signal(pid, libc::SIGSTOP);
            // until the leader excluded it (its agent then kills it), bounded
            let g = v.generation;
            let cc: &Cluster = c;
            let _ = cc.wait_for_opt(Duration::from_secs(40), || {
                try_status(cc, "chaos").filter(|x| x.generation > g)
            });
            signal(pid, libc::SIGCONT);
            format!("{}/{}", member.node, member.slot)
        }
        "kill-agent" => {
            let name = agent_name(rng);
            let pause = rng.ms(0, 2000);
            let a = c.agents.get_mut(&name).unwrap();
            a.kill();
            std::thread::sleep(pause);
            a.restart();
            name
        }
        "stop-agent" => {
            let name = agent_name(rng);
            let ttl = c.spec.lease_ttl;
            let a = &c.agents[&name];
            a.stop();
            std::thread::sleep(Duration::from_secs(ttl as u64) + rng.ms(1000, 3000));
            a.cont();
            name
        }
        "kill-leader" => {
            let leader = (0..c.daemons.len())
                .find(|i| {
                    let port = c.daemon_ports[*i];
                    http(
                        "GET",
                        &format!("http://127.0.0.1:{port}/v1/leader"),
                        &[("Authorization", &format!("Bearer {TOKEN}"))],
                        b"",
                    )
                    .ok()
                    .and_then(|(_, b)| serde_json::from_str::<serde_json::Value>(&b).ok())
                    .is_some_and(|j| j["this_replica_leads"] == true)
                })
                .unwrap_or(0);
            c.restart_daemon(leader);
            format!("daemon{leader}")
        }
        "restart-etcd" => {
            c.etcd.proc.kill();
            std::thread::sleep(rng.ms(200, 1500));
            c.etcd.restart();
            "etcd".into()
        }
        "s3-outage" => {
            let p = c.s3_proxy.as_ref().unwrap();
            // slow the uploads so the outage finds one in the middle
            p.throttle(200_000);
            std::thread::sleep(rng.ms(500, 1500));
            p.stop();
            std::thread::sleep(rng.ms(1000, 4000));
            p.throttle(0);
            p.serve();
            "s3".into()
        }
        "scale" => {
            let to = 2 + rng.below(5);
            let _ = c.dctl(&["scale", "chaos", &to.to_string()]);
            format!("to {to}")
        }
        "drain" => {
            let name = agent_name(rng);
            let _ = c.dctl(&["drain", &name]);
            *drained = Some(name.clone());
            name
        }
        "cold-start-503" => {
            // the store sheds load; every worker dies: the cold start meets the 503s (the
            // caller lets the store answer again a few seconds on)
            c.s3_proxy.as_ref().unwrap().answer_503(Some(""));
            for m in &v.members {
                if let Some(pid) = m.pid {
                    signal(pid, libc::SIGKILL);
                }
            }
            "every worker".into()
        }
        "commit-503" => {
            let p = c.s3_proxy.as_ref().unwrap();
            p.answer_503(Some("/COMMIT"));
            std::thread::sleep(rng.ms(1000, 4000));
            p.answer_503(None);
            "COMMIT puts".into()
        }
        other => unreachable!("unknown fault {other}"),
    }
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: a signal to a process id we started
    unsafe { libc::kill(pid as i32, sig) };
}

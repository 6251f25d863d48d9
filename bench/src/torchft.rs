//! `ductile-bench torchft-recovery`: three TorchFT replica groups of one process each
//! (`examples/torchft/train_ddp.py`: torchft 0.2.0's Manager and Optimizer, gloo, CPU), side by
//! side against TorchFT's own `torchft_lighthouse` and against two ductiled replicas serving
//! the lighthouse (the groups talk to the one that does not lead). Both run with
//! `min_replicas 1`, `quorum_tick_ms 100`, `join_timeout_ms 10000`.
//!
//! Per round one group is SIGKILLed and relaunched at once: the time from the kill to the
//! survivors' first commit under a new quorum, and to the relaunched group's first commit
//! (healed from a live peer). Then the lighthouse itself is SIGKILLed (ductile: the leading
//! replica): TorchFT's stops every group; ductile's longest pause between commits is printed.
//!
//! Then the same script as a `runtime = "torchft"` job on that cluster (three agents of one
//! slot each, the groups launched by ductile): per round one group's program is SIGKILLed and
//! ductile restarts that group alone; the same two times are measured.
//!
//! A survivor blocked in an all-reduce with the dead peer drops its step only after the
//! script's collective timeout (`--timeout-s`, 5 s by default as in the script): whichever
//! lighthouse, its next commit comes no sooner.

use std::path::Path;
use std::time::{Duration, Instant};

use ductile_tests::*;

use crate::median;

async fn until<T>(
    limit: Duration,
    what: &str,
    mut f: impl FnMut() -> Option<T>,
) -> anyhow::Result<T> {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        anyhow::ensure!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct Figures {
    survivors: Vec<f64>,
    healed: Vec<f64>,
    failed: usize,
}

/// Kill-and-relaunch rounds against the lighthouse at `lh`; the groups stay up afterwards.
async fn rounds(
    dir: &Path,
    lh: &str,
    n: usize,
    timeout_s: f64,
) -> anyhow::Result<(Vec<Proc>, Figures)> {
    let t = timeout_s.to_string();
    let flags = [
        "--step-sleep",
        "0.02",
        "--min-replicas",
        "1",
        "--timeout-s",
        &t,
    ];
    let mut groups: Vec<Proc> = (0..3)
        .map(|g| torchft_group(dir, &format!("g{g}-0"), g, lh, 10_000_000, &flags))
        .collect();
    let mut tags: Vec<String> = (0..3).map(|g| format!("g{g}-0")).collect();
    let log = |tag: &str| torchft_commits(&dir.join(format!("{tag}.log")));
    let mut fig = Figures {
        survivors: vec![],
        healed: vec![],
        failed: 0,
    };
    until(
        Duration::from_secs(180),
        "three groups committing together",
        || {
            tags.iter()
                .all(|t| {
                    log(t)
                        .last()
                        .is_some_and(|x| x.participants == 3 && x.step > 20)
                })
                .then_some(())
        },
    )
    .await?;
    for r in 0..n {
        let v = r % 3;
        let quorum_before = log(&tags[(v + 1) % 3]).last().map_or(-1, |x| x.quorum);
        let killed = now_s();
        groups[v].kill();
        let new_tag = format!("g{v}-{}", r + 1);
        groups[v] = torchft_group(dir, &new_tag, v as u32, lh, 10_000_000, &flags);
        tags[v] = new_tag.clone();
        let survivors: Vec<String> = (0..3)
            .filter(|&g| g != v)
            .map(|g| tags[g].clone())
            .collect();
        let s = until(
            Duration::from_secs(60),
            "survivors' commit under a new quorum",
            || {
                survivors
                    .iter()
                    .filter_map(|t| {
                        log(t)
                            .into_iter()
                            .find(|x| x.time > killed && x.quorum != quorum_before)
                    })
                    .map(|x| x.time)
                    .reduce(f64::min)
            },
        )
        .await;
        let h = until(
            Duration::from_secs(60),
            "the relaunched group's first commit",
            || log(&new_tag).first().map(|x| x.time),
        )
        .await;
        match (s, h) {
            (Ok(s), Ok(h)) => {
                println!(
                    "  round {}: group {v} killed: survivors commit {:.2} s later, the relaunched group {:.2} s later (healed)",
                    r + 1,
                    s - killed,
                    h - killed
                );
                fig.survivors.push(s - killed);
                fig.healed.push(h - killed);
            }
            (s, h) => {
                println!(
                    "  round {}: no recovery: {:?} {:?}",
                    r + 1,
                    s.err(),
                    h.err()
                );
                fig.failed += 1;
            }
        }
        // all three together again, then some training before the next kill
        let _ = until(
            Duration::from_secs(60),
            "three groups together again",
            || {
                let t = now_s();
                tags.iter()
                    .all(|g| {
                        log(g)
                            .last()
                            .is_some_and(|x| x.participants == 3 && t - x.time < 1.0)
                    })
                    .then_some(())
            },
        )
        .await;
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    // the groups' logs, for the lighthouse kill
    std::fs::write(dir.join("tags"), tags.join("\n"))?;
    Ok((groups, fig))
}

/// The job rounds: `runtime = "torchft"` on `c` (three agents of one slot), each round one
/// group's program SIGKILLed, ductile restarting it.
async fn job_rounds(
    c: &mut Cluster,
    dir: &Path,
    n: usize,
    timeout_s: f64,
) -> anyhow::Result<Figures> {
    let flags = torchrun_agent_flags();
    let extra: Vec<&str> = flags.iter().map(String::as_str).collect();
    for a in ["ft-node1", "ft-node2", "ft-node3"] {
        c.start_agent(a, 1, &extra);
    }
    let log_of = |g: u32| torchft_commits(&dir.join(format!("g{g}.log")));
    let args: Vec<String> = [
        "--steps".into(),
        "10000000".into(),
        "--step-sleep".into(),
        "0.02".into(),
        "--min-replicas".into(),
        "1".into(),
        "--timeout-s".into(),
        timeout_s.to_string(),
        "--log".into(),
        dir.join("g{group}.log").display().to_string(),
    ]
    .to_vec();
    c.submit(&torchft_job_toml(
        "ftbench",
        (1, 3, 3),
        &args,
        "restart_budget = 1000\n[torchrun]\ngrace_s = 2",
    ));
    let mut fig = Figures {
        survivors: vec![],
        healed: vec![],
        failed: 0,
    };
    let together = |fresh: f64| {
        let t = now_s();
        (0..3u32)
            .all(|g| {
                log_of(g)
                    .last()
                    .is_some_and(|x| x.participants == 3 && t - x.time < fresh)
            })
            .then_some(())
    };
    until(
        Duration::from_secs(180),
        "the job's three groups committing together",
        || together(1.0),
    )
    .await?;
    for r in 0..n {
        let v = (r % 3) as u32;
        let st = c.status("ftbench");
        let Some(pid) = st
            .members
            .iter()
            .find(|m| m.replica_group == Some(v))
            .and_then(|m| m.program_pid)
        else {
            println!("  job round {}: group {v} has no program", r + 1);
            fig.failed += 1;
            continue;
        };
        let quorum_before = log_of((v + 1) % 3).last().map_or(-1, |x| x.quorum);
        let killed = now_s();
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        let s = until(
            Duration::from_secs(60),
            "survivors' commit under a new quorum",
            || {
                (0..3u32)
                    .filter(|&g| g != v)
                    .filter_map(|g| {
                        log_of(g)
                            .into_iter()
                            .find(|x| x.time > killed && x.quorum != quorum_before)
                    })
                    .map(|x| x.time)
                    .reduce(f64::min)
            },
        )
        .await;
        let h = until(
            Duration::from_secs(60),
            "the restarted group's first commit",
            || {
                log_of(v)
                    .into_iter()
                    .find(|x| x.time > killed && x.pid != pid)
                    .map(|x| x.time)
            },
        )
        .await;
        match (s, h) {
            (Ok(s), Ok(h)) => {
                println!(
                    "  job round {}: group {v}'s program killed: survivors commit {:.2} s later, ductile's restart of the group {:.2} s later (healed)",
                    r + 1,
                    s - killed,
                    h - killed
                );
                fig.survivors.push(s - killed);
                fig.healed.push(h - killed);
            }
            (s, h) => {
                println!(
                    "  job round {}: no recovery: {:?} {:?}",
                    r + 1,
                    s.err(),
                    h.err()
                );
                fig.failed += 1;
            }
        }
        let _ = until(
            Duration::from_secs(60),
            "three groups together again",
            || together(1.0),
        )
        .await;
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    Ok(fig)
}

/// The longest pause between two commits of group 0's log in [from - 1, from + span], and
/// whether any commit came more than a second after `from`.
fn pause_after(dir: &Path, from: f64, span: f64) -> (f64, bool) {
    let tags = std::fs::read_to_string(dir.join("tags")).unwrap_or_default();
    let tag = tags.lines().next().unwrap_or("g0-0");
    let times: Vec<f64> = torchft_commits(&dir.join(format!("{tag}.log")))
        .into_iter()
        .map(|x| x.time)
        .filter(|&t| t > from - 1.0 && t < from + span)
        .collect();
    let longest = times.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max);
    (longest, times.iter().any(|&t| t > from + 1.0))
}

fn summary(name: &str, what: &str, xs: &[f64], failed: usize) -> String {
    crate::recovery_summary(&format!("{name}: {what}"), xs, failed)
}

pub async fn recovery(n: usize, timeout_s: f64) -> anyhow::Result<()> {
    println!("torchft-recovery: 3 replica groups of examples/torchft/train_ddp.py (torchft 0.2.0, gloo, CPU, --timeout-s {timeout_s}), {n} kill rounds each");
    let watch = 15.0;

    // TorchFT's own lighthouse
    let dir = TempDir::new("torchft-bench-theirs");
    let port = free_port();
    let py = torch_python_bin();
    let bin = Path::new(&py).parent().unwrap().join("torchft_lighthouse");
    let mut theirs = Proc::start(
        "torchft_lighthouse",
        &bin,
        &[
            "--min_replicas",
            "1",
            "--quorum_tick_ms",
            "100",
            "--join_timeout_ms",
            "10000",
            "--bind",
            &format!("127.0.0.1:{port}"),
        ]
        .map(String::from),
        &[],
        dir.path().join("lighthouse.log"),
    );
    let lh = format!("http://127.0.0.1:{port}");
    let (groups, t) = rounds(dir.path(), &lh, n, timeout_s).await?;
    let killed = now_s();
    theirs.kill();
    tokio::time::sleep(Duration::from_secs_f64(watch)).await;
    let (t_pause, t_went_on) = pause_after(dir.path(), killed, watch);
    drop(groups);

    // ductiled x2
    let c = Cluster::start(Spec {
        daemons: 2,
        torchft: Some(
            [
                "--torchft-min-replicas",
                "1",
                "--torchft-quorum-tick-ms",
                "100",
                "--torchft-join-timeout-ms",
                "10000",
                // the hand-launched groups use the shared room, as with torchft_lighthouse
                "--torchft-default-room",
            ]
            .map(String::from)
            .to_vec(),
        ),
        ..Default::default()
    });
    let mut c = c;
    let leader = until(Duration::from_secs(15), "a leader", || c.leader()).await?;
    let li: usize = leader.trim_start_matches("daemon").parse()?;
    let lh = format!("http://127.0.0.1:{}", c.torchft_ports[1 - li]);
    let dir2 = TempDir::new("torchft-bench-ductile");
    let (groups, o) = rounds(dir2.path(), &lh, n, timeout_s).await?;
    let killed = now_s();
    c.daemons[li].kill();
    tokio::time::sleep(Duration::from_secs_f64(watch)).await;
    let (o_pause, o_went_on) = pause_after(dir2.path(), killed, watch);
    drop(groups);

    // the same script as a runtime = "torchft" job on the replica left
    let dir3 = TempDir::new("torchft-bench-job");
    let j = job_rounds(&mut c, dir3.path(), n, timeout_s).await?;

    println!(
        "{}",
        summary(
            "torchft_lighthouse",
            "group SIGKILL → survivors' next commit",
            &t.survivors,
            t.failed
        )
    );
    println!(
        "{}",
        summary(
            "ductiled x2       ",
            "group SIGKILL → survivors' next commit",
            &o.survivors,
            o.failed
        )
    );
    println!(
        "{}",
        summary(
            "ductile job       ",
            "group SIGKILL → survivors' next commit",
            &j.survivors,
            j.failed
        )
    );
    println!(
        "{}",
        summary(
            "torchft_lighthouse",
            "group SIGKILL → relaunched group's first commit (healed)",
            &t.healed,
            t.failed
        )
    );
    println!(
        "{}",
        summary(
            "ductiled x2       ",
            "group SIGKILL → relaunched group's first commit (healed)",
            &o.healed,
            o.failed
        )
    );
    println!(
        "{}",
        summary(
            "ductile job       ",
            "group SIGKILL → ductile's restart of the group, first commit (healed)",
            &j.healed,
            j.failed
        )
    );
    let went = |on: bool, pause: f64| {
        if on {
            format!("training went on; longest pause between commits {pause:.2} s")
        } else {
            format!("no commit from 1 s after the kill to {watch:.0} s after it")
        }
    };
    println!(
        "torchft_lighthouse: lighthouse SIGKILL: {}",
        went(t_went_on, t_pause)
    );
    println!(
        "ductiled x2       : leader SIGKILL (election TTL {} s): {}",
        c.spec.election_ttl,
        went(o_went_on, o_pause)
    );
    let ratio = median(&mut o.survivors.clone()) / median(&mut t.survivors.clone());
    println!("survivors' next commit, ductile / torchft_lighthouse: {ratio:.3}");
    Ok(())
}

//! ductiled serves TorchFT's lighthouse: unmodified `torchft` 0.2.0 clients (its `Manager`,
//! through its manager server, and its `LighthouseClient`) against two real ductiled replicas
//! and a real etcd, with real replica groups training on CPU (gloo).

use std::collections::BTreeMap;
use std::time::Duration;

use ductile_tests::*;

/// Waits (bounded) until `f` finds what it looks for in the groups' logs; the groups' log
/// tails are the failure's message.
fn wait_commits<T>(
    limit: Duration,
    what: &str,
    procs: &[&Proc],
    f: impl FnMut() -> Option<T>,
) -> T {
    poll(limit, Duration::from_millis(50), f).unwrap_or_else(|| {
        let tails: Vec<String> = procs
            .iter()
            .map(|p| format!("--- {}:\n{}", p.name, p.log_tail(15)))
            .collect();
        panic!("{what}: not within {limit:?}\n{}", tails.join("\n"));
    })
}

/// The quorums each daemon logged as issued: quorum id → member ids.
fn issued(logs: &str) -> Vec<(i64, String)> {
    logs.lines()
        .filter(|l| l.contains("torchft quorum"))
        .filter_map(|l| {
            let id = l
                .split("quorum_id=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()?;
            let members = l
                .split("members=")
                .nth(1)?
                .split(" reason=")
                .next()?
                .to_string();
            Some((id, members))
        })
        .collect()
}

#[test]
fn training_torchft_groups_keep_stepping_through_a_kill_a_heal_and_the_leaders_death() {
    let mut c = Cluster::start(Spec {
        daemons: 2,
        torchft: Some(vec![
            "--torchft-min-replicas".into(),
            "2".into(),
            // hand-launched groups, as with torchft_lighthouse: the shared room
            "--torchft-default-room".into(),
        ]),
        ..Default::default()
    });
    let leader = c.wait_for(Duration::from_secs(15), "a leader", || c.leader());
    let li: usize = leader.trim_start_matches("daemon").parse().unwrap();
    // the groups talk through `dctl torchft-relay`, the leader first: when it dies, their
    // calls go on through the other replica, which answers from etcd what the new leader decides
    let dir = TempDir::new("torchft");
    let d = dir.path();
    let relay_port = free_port();
    let relay = Proc::start(
        "relay",
        &bin("dctl"),
        &[
            "torchft-relay".into(),
            "--listen".into(),
            format!("127.0.0.1:{relay_port}"),
            "--to".into(),
            format!(
                "127.0.0.1:{},127.0.0.1:{}",
                c.torchft_ports[li],
                c.torchft_ports[1 - li]
            ),
        ],
        &[],
        d.join("relay.log"),
    );
    let lh = format!("http://127.0.0.1:{relay_port}");
    let steps = 700u64;
    let sleep = ["--step-sleep", "0.02", "--quorum-retries", "5"];
    let mut g0 = torchft_group(d, "g0", 0, &lh, steps, &sleep);
    let mut g1 = torchft_group(d, "g1", 1, &lh, steps, &sleep);
    let mut g2 = torchft_group(d, "g2", 2, &lh, steps, &sleep);
    let log = |tag: &str| torchft_commits(&d.join(format!("{tag}.log")));

    // all three commit together
    wait_commits(
        Duration::from_secs(180),
        "three groups committing",
        &[&g0, &g1, &g2],
        || {
            ["g0", "g1", "g2"]
                .iter()
                .all(|t| {
                    log(t)
                        .last()
                        .is_some_and(|x| x.step >= 40 && x.participants == 3)
                })
                .then_some(())
        },
    );
    let pids = [g0.pid(), g2.pid()];

    // SIGKILL group 1: the others go on without it, in the same processes
    let killed_at = now_s();
    g1.kill();
    let after = wait_commits(
        Duration::from_secs(30),
        "the survivors committing without group 1",
        &[&g0, &g2],
        || {
            let a = log("g0")
                .into_iter()
                .find(|x| x.time > killed_at && x.participants == 2)?;
            let b = log("g2")
                .into_iter()
                .find(|x| x.time > killed_at && x.participants == 2)?;
            Some((a, b))
        },
    );
    eprintln!(
        "survivors' first commit without group 1: {:.2} s after its SIGKILL (quorum {})",
        after.0.time.min(after.1.time) - killed_at,
        after.0.quorum
    );

    // a flood of heartbeats and malformed calls, through TorchFT's own client, change nothing
    let out = torch_python(
        r#"
import sys
from datetime import timedelta
from torchft._torchft import LighthouseClient
c = LighthouseClient(sys.argv[1], timedelta(seconds=10))
for i in range(3000):
    c.heartbeat("flood")
errors = []
for bad in ["x" * 600, ""]:
    try:
        c.quorum(replica_id=bad, timeout=timedelta(seconds=5))
        errors.append("accepted")
    except Exception as e:
        errors.append(str(e).replace("\n", " "))
print("\n".join(errors))
"#,
        &[&lh],
    );
    assert!(out.lines().next().unwrap().contains("at most 512"), "{out}");
    assert!(out.lines().nth(1).unwrap().contains("empty"), "{out}");
    let flood_done = now_s();
    wait_commits(
        Duration::from_secs(10),
        "commits after the flood",
        &[&g0, &g2],
        || log("g0").into_iter().find(|x| x.time > flood_done),
    );

    // group 1 comes back: it heals from a live peer and rejoins the quorum
    let g1b = torchft_group(d, "g1b", 1, &lh, steps, &sleep);
    let healed = wait_commits(
        Duration::from_secs(120),
        "group 1 healed and back in the quorum",
        &[&g0, &g1b, &g2],
        || {
            let l = log("g1b");
            let h = l.iter().find(|x| x.healed)?.clone();
            l.iter()
                .any(|x| x.step > h.step && x.participants == 3)
                .then_some(h)
        },
    );
    assert!(
        healed.step > after.0.step,
        "group 1 healed to step {} after the survivors reached {}",
        healed.step,
        after.0.step
    );

    // dctl shows the quorum: three members, the id the groups train under
    let shown = c.wait_for(
        Duration::from_secs(10),
        "dctl torchft showing three members",
        || {
            let v: serde_json::Value =
                serde_json::from_str(&c.dctl_ok(&["torchft", "--json"])).ok()?;
            let q = v["rooms"][0]["quorum"].clone();
            (q["participants"].as_array()?.len() == 3).then_some(q)
        },
    );
    let id = shown["quorum_id"].as_i64().unwrap();
    assert!(
        log("g0").iter().any(|x| x.quorum == id),
        "dctl shows quorum {id}: {shown}"
    );
    let table = c.dctl_ok(&["torchft"]);
    assert!(
        table.contains(&format!("quorum {id} issued by daemon{li}")),
        "{table}"
    );
    assert!(table.contains("train_ddp_1:"), "{table}");

    // the leader dies: quorums go on through the other replica within the election time
    let leader_killed = now_s();
    c.daemons[li].kill();
    let next = wait_commits(
        Duration::from_secs(30),
        "a commit after the leader's death",
        &[&g0, &g1b, &g2],
        || log("g0").into_iter().find(|x| x.time > leader_killed + 0.5),
    );
    eprintln!(
        "first commit more than 0.5 s after the leader's SIGKILL: {:.2} s after it",
        next.time - leader_killed
    );

    // every group finishes: the survivors in the processes they started in, with equal weights
    let mut g1b = g1b;
    for p in [&mut g0, &mut g1b, &mut g2] {
        let st = p.wait_exit(Duration::from_secs(240));
        assert!(
            st.is_some_and(|s| s.success()),
            "{} did not finish:\n{}",
            p.name,
            p.log_tail(30)
        );
    }
    assert!(
        relay.log_tail(20).contains("now relaying to"),
        "the relay never moved to the other replica:\n{}",
        relay.log_tail(20)
    );
    for (tag, pid) in [("g0", pids[0]), ("g2", pids[1])] {
        let l = log(tag);
        assert_eq!(l.last().unwrap().step, steps, "{tag}");
        assert!(l.iter().all(|x| x.pid == pid), "{tag} was restarted");
    }
    let shas: Vec<String> = (0..3)
        .map(|g| std::fs::read_to_string(d.join(format!("g{g}.sha"))).unwrap())
        .collect();
    assert!(
        shas.iter().all(|s| s == &shas[0] && s.len() == 65),
        "{shas:?}"
    );

    // one member set per quorum id, whichever replica issued it
    let mut by_id: BTreeMap<i64, String> = BTreeMap::new();
    let logs: String = c
        .daemons
        .iter()
        .map(|p| std::fs::read_to_string(&p.log).unwrap_or_default())
        .collect();
    let all = issued(&logs);
    assert!(all.len() >= 3, "quorums issued: {all:?}");
    for (id, members) in all {
        let first = by_id.entry(id).or_insert_with(|| members.clone());
        assert_eq!(*first, members, "two quorums under id {id}");
    }
}

/// `runtime = "torchft"`: ductile launches TorchFT's DDP loop as 3 replica groups (one per
/// node's slot), each with its c10d store hosted by its launcher and `TORCHFT_LIGHTHOUSE` its
/// launcher's relay into the job's own room. A SIGKILLed group is restarted alone (the others'
/// programs keep their pids), heals from a live peer and rejoins the quorum; `dctl status`
/// shows the quorum; another job's replica id is refused; `dctl scale` removes a group without
/// touching the others; the groups end with equal weights and the job succeeds.
#[test]
fn training_torchft_job_groups_restart_alone_heal_rejoin_and_scale() {
    let mut c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        torchft: Some(vec![
            "--torchft-min-replicas".into(),
            "2".into(),
            "--torchft-join-timeout-ms".into(),
            "10000".into(),
        ]),
        ..Default::default()
    });
    let flags = torchrun_agent_flags();
    let extra: Vec<&str> = flags.iter().map(String::as_str).collect();
    for n in ["node1", "node2", "node3"] {
        c.start_agent(n, 1, &extra);
    }
    let dir = TempDir::new("torchft-job");
    let d = dir.path();
    let log_path = d.join("commits.log");
    let steps = 900u64;
    let args: Vec<String> = [
        "--steps".into(),
        steps.to_string(),
        "--step-sleep".into(),
        "0.03".into(),
        "--min-replicas".into(),
        "2".into(),
        "--log".into(),
        log_path.display().to_string(),
        "--sha-out".into(),
        d.join("g{group}.sha").display().to_string(),
    ]
    .to_vec();
    c.submit(&torchft_job_toml(
        "ft",
        (1, 3, 3),
        &args,
        "[torchrun]\ngrace_s = 5",
    ));
    let log = || torchft_commits(&log_path);
    let agents = || c.agent_logs();
    let v = c.wait_world("ft", 3, Duration::from_secs(120));
    let mut groups: Vec<u32> = v.members.iter().filter_map(|m| m.replica_group).collect();
    groups.sort();
    assert_eq!(groups, vec![0, 1, 2], "{v:?}");
    let three = c.wait_for_opt(Duration::from_secs(180), || {
        let l = log();
        (0..3u32)
            .all(|g| {
                l.iter()
                    .any(|x| x.group == g && x.step >= 40 && x.participants == 3)
            })
            .then_some(())
    });
    assert!(
        three.is_some(),
        "three groups committing together:\n{}",
        agents()
    );
    // each group is one process, started by its launcher: one pid per group so far
    let pid_of = |g: u32| -> Vec<u32> {
        let mut p: Vec<u32> = log()
            .iter()
            .filter(|x| x.group == g)
            .map(|x| x.pid)
            .collect();
        p.dedup();
        p
    };
    let v = c.status("ft");
    for m in &v.members {
        let g = m.replica_group.unwrap();
        assert_eq!(pid_of(g), vec![m.program_pid.unwrap()], "{m:?}");
    }
    // dctl status shows the job's quorum, from its own room
    let q = c.wait_for(Duration::from_secs(10), "the quorum in the status", || {
        c.status("ft").torchft.filter(|q| q.members.len() == 3)
    });
    assert!(
        q.members
            .iter()
            .all(|m| m.replica_id.starts_with("train_ddp_")),
        "{q:?}"
    );
    let text = c.dctl_ok(&["status", "ft"]);
    assert!(
        text.contains("quorum") && text.contains("replica group"),
        "{text}"
    );

    // a hostile client: without a room (the default room is off), or naming the job's room
    // without its key (a relay with a wrong key), every call is refused, naming why
    let foreign = q.members[0].replica_id.clone();
    let hostile = |url: &str| -> String {
        let out = std::process::Command::new(torch_python_bin())
            .args([
                "-c",
                "import sys\nfrom datetime import timedelta\nfrom torchft._torchft import LighthouseClient\n\
                 c = LighthouseClient(sys.argv[1], connect_timeout=timedelta(seconds=5))\n\
                 try:\n    c.heartbeat(sys.argv[2])\n    print('accepted')\nexcept Exception as e:\n    print('refused:', e)\n",
                url,
                &foreign,
            ])
            .output()
            .unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let said = hostile(&format!("http://127.0.0.1:{}", c.torchft_ports[0]));
    assert!(
        said.contains("refused") && said.contains("default room is off"),
        "{said}"
    );
    let wrong_key = d.join("wrong.key");
    std::fs::write(&wrong_key, "00112233").unwrap();
    // a relay of `dctl torchft-relay` into `job`'s room with the wrong key: its port
    let wrong_relay = |name: &str, job: &str| -> (Proc, u16) {
        let port = free_port();
        let p = Proc::start(
            name,
            &bin("dctl"),
            &[
                "torchft-relay".into(),
                "--listen".into(),
                format!("127.0.0.1:{port}"),
                "--to".into(),
                format!("127.0.0.1:{}", c.torchft_ports[0]),
                "--job".into(),
                job.into(),
                "--key-file".into(),
                wrong_key.display().to_string(),
            ],
            &[],
            d.join(format!("{name}.log")),
        );
        std::thread::sleep(Duration::from_millis(500));
        (p, port)
    };
    let (_relay, relay_port) = wrong_relay("hostile-relay", "ft");
    let said = hostile(&format!("http://127.0.0.1:{relay_port}"));
    assert!(
        said.contains("refused") && said.contains("may not enter it"),
        "{said}"
    );
    // a room of no job gets the same answer: the preamble does not tell whether a job exists
    let (_ghost, ghost_port) = wrong_relay("ghost-relay", "no-such-job");
    let ghost = hostile(&format!("http://127.0.0.1:{ghost_port}"));
    let answer = |s: &str| {
        s.lines()
            .find(|l| l.contains("may not enter it"))
            .and_then(|l| l.split("message:").nth(1)?.split(", details").next())
            .map(|m| {
                m.replace("job-no-such-job", "ROOM")
                    .replace("job-ft", "ROOM")
            })
    };
    assert!(answer(&ghost).is_some(), "{ghost}");
    assert_eq!(answer(&ghost), answer(&said), "{ghost}\n{said}");
    // chaos: for 4 s a hostile client naming the job's room floods it (200 fat joins with
    // step 2^40 and shrink_only, heartbeats as fast as it can); nothing of it is accepted and
    // the job's three groups keep committing together
    let flood_from = now_s();
    let flood = std::process::Command::new(torch_python_bin())
        .args([
            "-c",
            "import sys, threading, time\nfrom datetime import timedelta\nfrom torchft._torchft import LighthouseClient\n\
             url, secs = sys.argv[1], float(sys.argv[2])\n\
             n = {'ok': 0, 'refused': 0}\n\
             def fat(i):\n    c = LighthouseClient(url, connect_timeout=timedelta(seconds=5))\n    try:\n        c.quorum(replica_id=f'evil_{i}', timeout=timedelta(seconds=2), address='http://x', store_address='x:1', step=2**40, world_size=1, shrink_only=True, data={'x': 'y' * 3000})\n        n['ok'] += 1\n    except Exception:\n        n['refused'] += 1\n\
             ts = [threading.Thread(target=fat, args=(i,)) for i in range(200)]\n\
             [t.start() for t in ts]\n\
             c = LighthouseClient(url, connect_timeout=timedelta(seconds=5))\n\
             end = time.time() + secs\n\
             while time.time() < end:\n    try:\n        c.heartbeat('evil_hb'); n['ok'] += 1\n    except Exception:\n        n['refused'] += 1\n\
             [t.join() for t in ts]\n\
             print(f\"accepted={n['ok']} refused={n['refused']}\")\n",
            &format!("http://127.0.0.1:{relay_port}"),
            "4",
        ])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&flood.stdout);
    assert!(
        said.contains("accepted=0 "),
        "{said}{}",
        String::from_utf8_lossy(&flood.stderr)
    );
    let during: Vec<TorchftCommit> = log()
        .into_iter()
        .filter(|x| x.time >= flood_from && x.time <= flood_from + 4.0)
        .collect();
    assert!(
        (0..3u32).all(|g| during.iter().any(|x| x.group == g && x.participants == 3)),
        "the groups committed as three during the flood: {said}"
    );

    // SIGKILL group 1's program: it alone restarts; the others keep their processes
    let victim = v
        .members
        .iter()
        .find(|m| m.replica_group == Some(1))
        .unwrap();
    let survivors: Vec<(u32, u32)> = v
        .members
        .iter()
        .filter(|m| m.replica_group != Some(1))
        .map(|m| (m.replica_group.unwrap(), m.program_pid.unwrap()))
        .collect();
    let step_at_kill = log().iter().map(|x| x.step).max().unwrap();
    let killed_at = now_s();
    unsafe { libc::kill(victim.program_pid.unwrap() as i32, libc::SIGKILL) };
    let back = c.wait_for_opt(Duration::from_secs(90), || {
        let l = log();
        let survived = survivors.iter().all(|(g, _)| {
            l.iter()
                .any(|x| x.group == *g && x.time > killed_at && x.participants == 2)
        });
        let healed = l
            .iter()
            .find(|x| x.group == 1 && x.time > killed_at && x.healed)?
            .clone();
        let rejoined = l
            .iter()
            .any(|x| x.group == 1 && x.time > healed.time && x.participants == 3);
        (survived && rejoined).then_some(healed)
    });
    let healed = back.unwrap_or_else(|| panic!("group 1 back and healed:\n{}", agents()));
    assert_ne!(healed.pid, victim.program_pid.unwrap(), "a new process");
    assert!(
        healed.step > step_at_kill,
        "healed at {} (killed at {step_at_kill})",
        healed.step
    );
    for (g, pid) in &survivors {
        assert_eq!(pid_of(*g), vec![*pid], "group {g} was never restarted");
    }
    // the generation after the kill restarted group 1 alone
    let h = c.history("ft");
    let g = h
        .iter()
        .find(|g| g.number > v.generation)
        .expect("a generation after the kill");
    assert_eq!(g.reason, ductile_cluster::records::Reason::Failure, "{g:?}");
    for m in &g.members {
        let was = v
            .members
            .iter()
            .find(|o| o.node == m.node && o.slot == m.slot)
            .unwrap();
        if m.replica_group == Some(1) {
            assert_eq!(m.group_since, g.number, "{m:?}");
        } else {
            assert_eq!(Some(m.group_since), was.group_since, "{m:?}");
        }
    }
    // the quorums are in `dctl events` (between the generations, with who healed from whom)
    // and in the chart history
    let ev = c.dctl_ok(&["events", "ft"]);
    let quorum_lines: Vec<&str> = ev.lines().filter(|l| l.starts_with("quorum ")).collect();
    assert!(quorum_lines.len() >= 2, "{ev}");
    assert!(ev.lines().any(|l| l.starts_with("gen ")), "{ev}");
    assert!(
        quorum_lines
            .iter()
            .any(|l| l.contains("healing: train_ddp_1")),
        "{ev}"
    );
    let evj = c.dctl_ok(&["events", "ft", "--json", "--quorums"]);
    assert!(
        evj.lines().any(|l| l.contains("\"torchft_quorum\"")),
        "{evj}"
    );
    let svg = d.join("ft.svg");
    let plotted = c.dctl_ok(&["plot", "ft", "--out", svg.to_str().unwrap(), "--json"]);
    let p: serde_json::Value = serde_json::from_str(plotted.trim()).unwrap();
    assert!(p["quorums"].as_u64().unwrap() >= 2, "{plotted}");
    assert!(
        std::fs::read_to_string(&svg).unwrap().contains("q"),
        "quorum markers drawn"
    );
    eprintln!(
        "group 1 killed at step {step_at_kill}; back and healed at step {} after {:.2} s",
        healed.step,
        healed.time - killed_at
    );

    // dctl scale 2: one group leaves, the other two keep their processes and go on as two
    let before = c.status("ft");
    c.dctl_ok(&["scale", "ft", "2"]);
    let after = c.wait_world("ft", 2, Duration::from_secs(60));
    let scaled_at = now_s();
    for m in &after.members {
        let was = before
            .members
            .iter()
            .find(|o| o.node == m.node && o.slot == m.slot)
            .unwrap();
        assert_eq!(m.replica_group, was.replica_group);
        assert_eq!(m.group_since, was.group_since, "{m:?}");
    }
    let kept: Vec<(u32, u32)> = after
        .members
        .iter()
        .map(|m| {
            let g = m.replica_group.unwrap();
            (g, *pid_of(g).last().unwrap())
        })
        .collect();
    let two = c.wait_for_opt(Duration::from_secs(60), || {
        let l = log();
        kept.iter()
            .all(|(g, pid)| {
                l.iter().any(|x| {
                    x.group == *g && x.pid == *pid && x.time > scaled_at && x.participants == 2
                })
            })
            .then_some(())
    });
    assert!(
        two.is_some(),
        "the two groups going on as two:\n{}",
        agents()
    );

    // dctl scale 3: a group comes back on the free slot, under the number no live group
    // holds; it heals and the three commit together, the other two still in their processes
    let before = c.status("ft");
    let gone: u32 = (0..3)
        .find(|g| !before.members.iter().any(|m| m.replica_group == Some(*g)))
        .unwrap();
    let grown_at = now_s();
    c.dctl_ok(&["scale", "ft", "3"]);
    let three = c.wait_world("ft", 3, Duration::from_secs(60));
    let added = three
        .members
        .iter()
        .find(|m| {
            !before
                .members
                .iter()
                .any(|o| o.node == m.node && o.slot == m.slot)
        })
        .expect("a member added");
    assert_eq!(added.replica_group, Some(gone), "{three:?}");
    let joined = c.wait_for_opt(Duration::from_secs(90), || {
        let l = log();
        l.iter()
            .find(|x| x.group == gone && x.time > grown_at && x.participants == 3)
            .map(|x| (x.step, x.time))
    });
    let (joined_step, joined_t) = joined.unwrap_or_else(|| {
        panic!(
            "the added group committing with the other two:\n{}",
            agents()
        )
    });
    eprintln!(
        "scaled to 3: group {gone} committed with the other two at step {joined_step} (of {steps}), {:.2} s after dctl scale",
        joined_t - grown_at
    );
    for (g, pid) in &kept {
        assert_eq!(pid_of(*g).last(), Some(pid), "group {g} kept its process");
    }
    let mut kept = kept;
    kept.push((gone, added.program_pid.unwrap_or(0)));

    // the job ends; the groups that finished hold equal weights
    let done = c.wait_done("ft", Duration::from_secs(240));
    assert_eq!(
        done.state,
        ductile_cluster::records::JobState::Succeeded,
        "{done:?}"
    );
    let shas: Vec<String> = kept
        .iter()
        .map(|(g, _)| {
            std::fs::read_to_string(d.join(format!("g{g}.sha")))
                .unwrap_or_else(|e| panic!("group {g}'s weights: {e}"))
        })
        .collect();
    assert!(shas.windows(2).all(|w| w[0] == w[1]), "{shas:?}");
    for (g, _) in &kept {
        let l = log();
        let last = l.iter().filter(|x| x.group == *g).last().unwrap();
        assert_eq!(last.step, steps, "group {g}");
        // the groups that stayed ended in the process they had before the scale-up
        if let Some((_, pid)) = kept[..2].iter().find(|(k, _)| k == g) {
            assert_eq!(last.pid, *pid, "group {g}");
        }
    }
}

/// `[torchft] group_size = 2`: two nodes of two slots are two replica groups of two processes
/// each (torchrun's contract inside the group: `RANK` 0 and 1, the group's c10d store hosted by
/// its first slot's launcher). SIGKILL the second rank of one group: that group alone restarts
/// (both its processes), heals and rejoins; the other group's processes keep their pids.
#[test]
fn training_torchft_job_groups_of_two_slots_restart_as_a_group() {
    let mut c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        torchft: Some(vec!["--torchft-min-replicas".into(), "1".into()]),
        ..Default::default()
    });
    let flags = torchrun_agent_flags();
    let extra: Vec<&str> = flags.iter().map(String::as_str).collect();
    for n in ["node1", "node2"] {
        c.start_agent(n, 2, &extra);
    }
    let dir = TempDir::new("torchft-job2");
    let d = dir.path();
    let log_path = d.join("commits.log");
    let args: Vec<String> = [
        "--steps".into(),
        "500".into(),
        "--step-sleep".into(),
        "0.03".into(),
        "--log".into(),
        log_path.display().to_string(),
        "--sha-out".into(),
        d.join("g{group}.sha").display().to_string(),
    ]
    .to_vec();
    c.submit(&torchft_job_toml(
        "ft2",
        (2, 4, 4),
        &args,
        "[torchrun]\ngrace_s = 3\n[torchft]\ngroup_size = 2",
    ));
    let log = || torchft_commits(&log_path);
    let agents = || c.agent_logs();
    let v = c.wait_world("ft2", 4, Duration::from_secs(120));
    // each node's two slots are one group
    for m in &v.members {
        let peer = v
            .members
            .iter()
            .find(|o| o.node == m.node && o.slot != m.slot)
            .unwrap();
        assert_eq!(m.replica_group, peer.replica_group, "{v:?}");
    }
    let together = c.wait_for_opt(Duration::from_secs(180), || {
        let l = log();
        // both ranks of both groups commit together (4 processes, 2 per group)
        let pids: std::collections::BTreeSet<(u32, u32)> = l
            .iter()
            .filter(|x| x.step >= 30 && x.participants == 2)
            .map(|x| (x.group, x.pid))
            .collect();
        (pids.len() == 4).then_some(())
    });
    assert!(
        together.is_some(),
        "two groups of two committing:\n{}",
        agents()
    );
    let v = c.status("ft2");
    let victim = v
        .members
        .iter()
        .filter(|m| m.replica_group == Some(0))
        .max_by_key(|m| m.slot)
        .unwrap()
        .clone();
    let others: Vec<u32> = v
        .members
        .iter()
        .filter(|m| m.replica_group == Some(1))
        .map(|m| m.program_pid.unwrap())
        .collect();
    let group0: Vec<u32> = v
        .members
        .iter()
        .filter(|m| m.replica_group == Some(0))
        .map(|m| m.program_pid.unwrap())
        .collect();
    let killed_at = now_s();
    unsafe { libc::kill(victim.program_pid.unwrap() as i32, libc::SIGKILL) };
    // group 0 comes back as two new processes, healed, and commits with group 1 again
    let back = c.wait_for_opt(Duration::from_secs(120), || {
        let l = log();
        let new: std::collections::BTreeSet<u32> = l
            .iter()
            .filter(|x| x.group == 0 && x.time > killed_at && !group0.contains(&x.pid))
            .map(|x| x.pid)
            .collect();
        let healed = l
            .iter()
            .any(|x| x.group == 0 && x.time > killed_at && x.healed);
        let rejoined = l.iter().any(|x| {
            x.group == 0 && x.time > killed_at && !group0.contains(&x.pid) && x.participants == 2
        });
        (new.len() == 2 && healed && rejoined).then_some(())
    });
    assert!(
        back.is_some(),
        "group 0 restarted whole and healed:\n{}",
        agents()
    );
    let v2 = c.status("ft2");
    for m in &v2.members {
        let was = v
            .members
            .iter()
            .find(|o| o.node == m.node && o.slot == m.slot)
            .unwrap();
        if m.replica_group == Some(0) {
            assert!(m.group_since > was.group_since, "{m:?}");
        } else {
            assert_eq!(m.group_since, was.group_since, "{m:?}");
        }
    }
    let done = c.wait_done("ft2", Duration::from_secs(240));
    assert_eq!(
        done.state,
        ductile_cluster::records::JobState::Succeeded,
        "{done:?}"
    );
    // group 1's two processes were never restarted
    let l = log();
    let g1: std::collections::BTreeSet<u32> =
        l.iter().filter(|x| x.group == 1).map(|x| x.pid).collect();
    assert_eq!(g1, others.iter().copied().collect(), "group 1's processes");
    let shas: Vec<String> = (0..2)
        .map(|g| std::fs::read_to_string(d.join(format!("g{g}.sha"))).unwrap())
        .collect();
    assert_eq!(shas[0], shas[1], "equal weights");
}

/// A `runtime = "torchft"` job outlives its leader ductiled (issue 46, item 4): two replicas
/// serve the lighthouse over TLS, three groups train, the leader is SIGKILLed; the standby
/// leads and issues the next quorum within the election TTL and a few ticks, and no group
/// restarts (the same pids commit before and after, and no generation follows the kill).
#[test]
fn training_torchft_job_goes_on_through_its_leader_s_death() {
    let dir = TempDir::new("torchft-leader");
    let d = dir.path();
    // the lighthouse over TLS (the certificate names 127.0.0.1), the agents trusting its CA
    let pki = make_pki(d);
    let p = |f: &str| pki.join(f).display().to_string();
    let mut c = Cluster::start(Spec {
        daemons: 2,
        restart_backoff_ms: 300,
        torchft: Some(vec![
            "--torchft-min-replicas".into(),
            "2".into(),
            "--torchft-tls-cert".into(),
            p("api.pem"),
            "--torchft-tls-key".into(),
            p("api-key.pem"),
        ]),
        ..Default::default()
    });
    let mut flags = torchrun_agent_flags();
    flags.extend(["--torchft-ca".to_string(), p("ca.pem")]);
    let extra: Vec<&str> = flags.iter().map(String::as_str).collect();
    for n in ["node1", "node2", "node3"] {
        c.start_agent(n, 1, &extra);
    }
    let log_path = d.join("commits.log");
    let args: Vec<String> = [
        "--steps",
        "100000",
        "--step-sleep",
        "0.03",
        "--min-replicas",
        "2",
        "--log",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([log_path.display().to_string()])
    .collect();
    c.submit(&torchft_job_toml(
        "ft",
        (3, 3, 3),
        &args,
        "[torchrun]\ngrace_s = 5",
    ));
    let log = || torchft_commits(&log_path);
    c.wait_world("ft", 3, Duration::from_secs(120));
    let started = c.wait_for_opt(Duration::from_secs(180), || {
        let l = log();
        (0..3u32)
            .all(|g| {
                l.iter()
                    .any(|x| x.group == g && x.step >= 30 && x.participants == 3)
            })
            .then_some(())
    });
    assert!(
        started.is_some(),
        "three groups committing:\n{}",
        c.agent_logs()
    );
    let pids = |from: f64| -> std::collections::BTreeSet<u32> {
        log()
            .iter()
            .filter(|x| x.time >= from)
            .map(|x| x.pid)
            .collect()
    };
    let before = pids(0.0);
    let generation = c.status("ft").generation;
    let t_kill = now_s();
    let (_, _, took) = c.kill_leader();
    // the groups go on committing as three
    let after = c.wait_for_opt(Duration::from_secs(30), || {
        let l = log();
        (0..3u32)
            .all(|g| {
                l.iter()
                    .any(|x| x.group == g && x.time > t_kill + 1.0 && x.participants == 3)
            })
            .then_some(())
    });
    let l = log();
    let mut times: Vec<f64> = l.iter().filter(|x| x.group == 0).map(|x| x.time).collect();
    times.sort_by(f64::total_cmp);
    let gap = times
        .windows(2)
        .filter(|w| w[1] > t_kill - 1.0)
        .map(|w| w[1] - w[0])
        .fold(0.0, f64::max);
    println!("leader killed: standby led after {took:?}; longest pause between group 0's commits {gap:.2} s");
    assert!(
        after.is_some(),
        "commits as three after the leader's death:\n{}",
        c.log_tails()
    );
    assert!(gap < 5.0, "longest pause {gap:.2} s (election TTL 2 s)");
    assert_eq!(pids(t_kill + 1.0), before, "no group restarted");
    assert_eq!(
        c.status("ft").generation,
        generation,
        "no generation after the kill"
    );
    c.dctl_ok(&["stop", "ft"]);
    // the ended job's room goes with it (the leader's clean-up, every 10 s)
    c.wait_for(
        Duration::from_secs(40),
        "the ended job's lighthouse room deleted",
        || {
            let v: serde_json::Value = c.get_json("/v1/torchft");
            let rooms = v["rooms"].as_array()?.clone();
            (!rooms.iter().any(|r| r["room"] == "job-ft")).then_some(())
        },
    );
}

//! ductiled serves TorchFT's lighthouse: unmodified `torchft` 0.2.0 clients (its `Manager`,
//! through its manager server, and its `LighthouseClient`) against two real ductiled replicas
//! and a real etcd, with real replica groups training on CPU (gloo).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ductile_tests::*;

/// Waits (bounded) until `f` finds what it looks for in the groups' logs.
fn wait_commits<T>(
    limit: Duration,
    what: &str,
    procs: &[&Proc],
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        if t0.elapsed() > limit {
            let tails: Vec<String> = procs
                .iter()
                .map(|p| format!("--- {}:\n{}", p.name, p.log_tail(15)))
                .collect();
            panic!("{what}: not within {limit:?}\n{}", tails.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
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
        torchft: Some(vec!["--torchft-min-replicas".into(), "2".into()]),
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

fn now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

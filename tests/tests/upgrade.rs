//! Upgrades: records the previous release wrote are read by this one, and a rolling upgrade
//! (daemons, then agents, one at a time) keeps a running job training.
//!
//! The rolling upgrade needs the previous release's binaries: `scripts/upgrade-check.sh`
//! builds them (in a target dir of their own) and runs it. While that cluster runs the old
//! binaries it writes what etcd holds to `tests/fixtures/records-previous.json`, which the
//! tests that CI runs read: every record decodes into this release's types with no field lost,
//! and this release's daemon serves the cluster state the old one left.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ductile_cluster::keys::{KeyKind, Keys};
use ductile_cluster::records::*;
use ductile_tests::*;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

const S: fn(u64) -> Duration = Duration::from_secs;

/// One etcd key as the previous release left it.
#[derive(Serialize, Deserialize)]
struct Kept {
    key: String,
    value: String,
    leased: bool,
}

#[derive(Serialize, Deserialize)]
struct Fixture {
    /// The commit whose binaries wrote the records.
    release: String,
    records: Vec<Kept>,
}

fn fixture_path() -> PathBuf {
    repo_root().join("tests/fixtures/records-previous.json")
}

/// JSON without its nulls (an `Option` the old release wrote as `null` that this one skips
/// when empty is the same record).
fn without_nulls(v: &serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => serde_json::Value::Object(
            m.iter()
                .filter(|(_, x)| !x.is_null())
                .map(|(k, x)| (k.clone(), without_nulls(x)))
                .collect(),
        ),
        serde_json::Value::Array(a) => {
            serde_json::Value::Array(a.iter().map(without_nulls).collect())
        }
        x => x.clone(),
    }
}

/// The paths where `a` and `b` differ.
fn differences(a: &serde_json::Value, b: &serde_json::Value, at: &str, out: &mut Vec<String>) {
    match (a, b) {
        (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
            let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                match (x.get(k), y.get(k)) {
                    (Some(p), Some(q)) => differences(p, q, &format!("{at}.{k}"), out),
                    (Some(_), None) => out.push(format!("{at}.{k} was lost")),
                    (None, Some(q)) => out.push(format!("{at}.{k} appeared as {q}")),
                    (None, None) => {}
                }
            }
        }
        (serde_json::Value::Array(x), serde_json::Value::Array(y)) if x.len() == y.len() => {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                differences(p, q, &format!("{at}[{i}]"), out);
            }
        }
        _ if a == b => {}
        _ => out.push(format!("{at}: {a} became {b}")),
    }
}

/// Decode `raw` as a `T` and encode it again: an error, or every field the writer wrote that
/// this release would drop or change.
fn lossless<T: Serialize + DeserializeOwned>(raw: &str) -> Result<(), String> {
    let old: serde_json::Value = serde_json::from_str(raw).map_err(|e| format!("not JSON: {e}"))?;
    let t: T = serde_json::from_value(old.clone()).map_err(|e| format!("does not decode: {e}"))?;
    // through text, as the store writes it (an f32 field's value as a JSON number is its
    // shortest f32 form, which `to_value` would widen)
    let new: serde_json::Value = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
    let mut out = vec![];
    differences(&without_nulls(&old), &without_nulls(&new), "", &mut out);
    if out.is_empty() {
        Ok(())
    } else {
        Err(out.join("; "))
    }
}

/// Every record decodes into this release's type for its key with nothing lost. Returns the
/// kinds of record seen, and the problems (key: what).
fn check_records(records: &[Kept]) -> (BTreeSet<String>, Vec<String>) {
    let keys = Keys::default();
    let mut kinds = BTreeSet::new();
    let mut problems = vec![];
    for r in records {
        let kind = keys.parse(&r.key);
        let name = format!("{kind:?}")
            .split([' ', '{', '('])
            .next()
            .unwrap()
            .to_string();
        let v = &r.value;
        let res = match kind {
            KeyKind::Node { .. } => lossless::<NodeRecord>(v),
            KeyKind::Drain { .. } => lossless::<DrainRequest>(v),
            KeyKind::JobSpec { .. } => lossless::<JobSpec>(v),
            KeyKind::JobStatus { .. } => lossless::<JobStatus>(v),
            KeyKind::Generation { .. } | KeyKind::History { .. } => lossless::<Generation>(v),
            KeyKind::Slot { .. } => lossless::<SlotHealth>(v),
            KeyKind::Worker { .. } => lossless::<WorkerRecord>(v),
            KeyKind::Joined { .. } => lossless::<JoinRecord>(v),
            KeyKind::Progress { .. } => lossless::<Progress>(v),
            KeyKind::Series { .. } => lossless::<ductile_cluster::series::Series>(v),
            KeyKind::Restarts { .. } => lossless::<u32>(v),
            KeyKind::Access { .. } => lossless::<JobAccess>(v),
            KeyKind::RankStats { .. } => lossless::<RankStats>(v),
            KeyKind::Checkpoint { .. } => lossless::<CheckpointRecord>(v),
            KeyKind::CheckpointRequest { .. } => lossless::<CheckpointRequest>(v),
            KeyKind::CheckpointStats { .. } => lossless::<CheckpointStats>(v),
            KeyKind::Fault { .. } => lossless::<FaultReport>(v),
            KeyKind::Assignment { .. } => lossless::<NodeAssignment>(v),
            // a stop request is a timestamp; rendezvous data and the election are etcd's and
            // comm's own, read by the same code in both releases
            KeyKind::Stop { .. } => lossless::<u64>(v),
            KeyKind::Rendezvous { .. } | KeyKind::Other => Ok(()),
        };
        kinds.insert(name);
        if let Err(e) = res {
            problems.push(format!("{}: {e}", r.key));
        }
    }
    (kinds, problems)
}

fn read_fixture() -> Fixture {
    let p = fixture_path();
    let text = std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e} (scripts/upgrade-check.sh writes it)", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Everything under the cluster's prefix, as it is now.
fn dump(c: &Cluster) -> Vec<Kept> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = c.store().await;
        let (kvs, _) = store.backend.list("/ductile/v1/").await.unwrap();
        kvs.into_iter()
            .map(|kv| Kept {
                key: kv.key,
                value: String::from_utf8(kv.value).expect("records are UTF-8 JSON"),
                leased: kv.lease != 0,
            })
            .collect()
    })
}

#[test]
fn records_the_previous_release_wrote_decode_into_this_release_s_types_with_nothing_lost() {
    let f = read_fixture();
    let (kinds, problems) = check_records(&f.records);
    assert!(problems.is_empty(), "release {}: {problems:#?}", f.release);
    // the fixture is a running job's state: nodes, a job and its generations, workers, a
    // checkpoint, the workers' progress
    for want in [
        "Node",
        "JobSpec",
        "JobStatus",
        "Generation",
        "History",
        "Worker",
        "Joined",
        "Progress",
        "Checkpoint",
        "Assignment",
    ] {
        assert!(
            kinds.contains(want),
            "the fixture has no {want} record: {kinds:?}"
        );
    }
}

#[test]
fn this_release_s_daemon_serves_the_cluster_state_the_previous_release_left() {
    let f = read_fixture();
    let mut c = Cluster::start(Spec {
        daemons: 0,
        ..Spec::default()
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    // the old cluster's records, as etcd held them; the leased ones (nodes, workers) under a
    // lease of the test's, as a live agent's would be
    rt.block_on(async {
        let store = c.store().await;
        let lease = store.backend.grant(60).await.unwrap();
        // not the old replicas' election keys: those replicas are gone, and this one leads
        for r in f
            .records
            .iter()
            .filter(|r| !r.key.starts_with("/ductile/v1/election"))
        {
            store
                .backend
                .put(
                    &r.key,
                    r.value.clone().into_bytes(),
                    r.leased.then_some(lease),
                )
                .await
                .unwrap();
        }
    });
    c.start_daemon(0);
    let jobs: BTreeSet<String> = f
        .records
        .iter()
        .filter_map(|r| match Keys::default().parse(&r.key) {
            KeyKind::JobSpec { job } => Some(job),
            _ => None,
        })
        .collect();
    assert!(!jobs.is_empty());
    for job in &jobs {
        let v = c.status(job);
        let progress = f
            .records
            .iter()
            .find(|r| r.key == format!("/ductile/v1/live/{job}/progress"))
            .map(|r| serde_json::from_str::<Progress>(&r.value).unwrap());
        if let Some(p) = progress {
            assert_eq!(v.step, p.step, "{job}: the step the old workers reported");
        }
        // every generation the old leader published, in order; the new leader goes on from
        // the last one's number (it sees no workers: the old agents are gone)
        let old: Vec<u64> = f
            .records
            .iter()
            .filter_map(|r| match Keys::default().parse(&r.key) {
                KeyKind::History { job: j, generation } if &j == job => Some(generation),
                _ => None,
            })
            .collect();
        let h = c.history(job);
        assert!(h.len() >= old.len(), "{job}: {h:?}");
        let numbers: Vec<u64> = h.iter().map(|g| g.number).collect();
        assert_eq!(&numbers[..old.len()], &old[..], "{job}");
        assert!(
            numbers.windows(2).all(|w| w[1] == w[0] + 1),
            "{job}: generations not contiguous: {numbers:?}"
        );
    }
    c.wait_for(S(10), "this release's daemon leading", || {
        c.leader().filter(|l| l == "daemon0")
    });
    let nodes = c.dctl_ok(&["nodes", "--json"]);
    for r in f
        .records
        .iter()
        .filter(|r| r.key.starts_with("/ductile/v1/nodes/"))
    {
        let name = r.key.rsplit('/').next().unwrap();
        assert!(
            nodes.contains(&format!("\"{name}\"")),
            "{name} missing: {nodes}"
        );
    }
    let logs = c.logs();
    assert!(
        !logs.contains("undecodable"),
        "the daemon skipped records:\n{logs}"
    );
}

/// The previous release's binaries (`DUCTILE_PREV_BIN_DIR`).
fn prev_bin_dir() -> PathBuf {
    let d = PathBuf::from(std::env::var_os("DUCTILE_PREV_BIN_DIR").expect(
        "DUCTILE_PREV_BIN_DIR: the previous release's binaries (scripts/upgrade-check.sh)",
    ));
    for b in ["ductiled", "ductile-agent", "ductile-worker"] {
        assert!(d.join(b).is_file(), "{} has no {b}", d.display());
    }
    d
}

fn exe_of(pid: u32) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default()
}

#[test]
#[ignore = "needs the previous release's binaries in DUCTILE_PREV_BIN_DIR: scripts/upgrade-check.sh builds them and runs this test"]
fn a_rolling_upgrade_from_the_previous_release_keeps_a_job_training() {
    let prev = prev_bin_dir();
    let ledger = TempDir::new("ledger");
    let mut c = Cluster::start(Spec {
        daemons: 2,
        restart_backoff_ms: 300,
        bin_dir: Some(prev.clone()),
        agent_env: vec![(
            "DUCTILE_LEDGER_DIR".into(),
            ledger.path().display().to_string(),
        )],
        ..Spec::default().agents(2, 2)
    });
    let data = synth(c.dir.path(), "tokens", 20_000);
    let ckpt = c.dir.path().join("ckpt");
    let steps = 1500u64;
    c.submit(&format!(
        "{}max_steps = {steps}\nmodel_config = {{ d_model = 32, n_layer = 1, n_head = 2 }}\n[checkpoint]\nurl = \"file://{}\"\ninterval = 100\nkeep = 3\n",
        training_toml("up", 1, 4, 4, "gpt", &data, "restart_budget = 20"),
        ckpt.display()
    ));
    let v = c.wait_world("up", 4, S(30));
    // the old release runs everything
    for m in &v.members {
        let exe = exe_of(m.pid.unwrap());
        assert!(
            exe.starts_with(&prev),
            "{exe:?} is not the previous release's"
        );
    }
    c.wait_step("up", 250, S(120));
    // what the old release keeps in etcd: this release reads it all, nothing lost
    let records = dump(&c);
    let (kinds, problems) = check_records(&records);
    assert!(problems.is_empty(), "{problems:#?}");
    if let Some(out) = std::env::var_os("DUCTILE_RECORDS_OUT") {
        let release = std::env::var("DUCTILE_PREV_RELEASE").unwrap_or_else(|_| "unknown".into());
        let f = Fixture { release, records };
        std::fs::write(&out, serde_json::to_string_pretty(&f).unwrap() + "\n").unwrap();
        eprintln!("wrote {} ({kinds:?})", Path::new(&out).display());
    }
    let before = c.history("up").len();

    // the daemons, one at a time: the job never notices (no generation for it)
    for i in 0..2 {
        let s = c.status("up").step;
        c.upgrade_daemon(i);
        c.wait_step("up", s + 50, S(60));
    }
    assert_eq!(
        c.history("up").len(),
        before,
        "a daemon's upgrade re-formed the job: {:?}",
        c.history("up")
    );
    let leader = c.leader();
    assert!(leader.is_some(), "no leader after the daemons' upgrade");

    // then the agents, one at a time: each drains its node (the job shrinks to the other),
    // and the new agent's slots join again
    for node in ["node1", "node2"] {
        let s = c.status("up").step;
        c.upgrade_agent(node, S(60));
        c.wait_for(
            S(60),
            &format!("the job back at 4 workers after {node}'s upgrade"),
            || {
                let v = c.status("up");
                (v.members.len() == 4 && v.world_size == 4).then_some(())
            },
        );
        c.wait_step("up", s + 50, S(120));
    }
    // everything runs this release now
    let v = c.status("up");
    for m in &v.members {
        let exe = exe_of(m.pid.unwrap());
        assert_eq!(exe, bin("ductile-worker"), "member {m:?}");
    }
    let done = c.wait_done("up", S(300));
    assert_eq!(done.step, steps);
    let h = c.history("up");
    let numbers: Vec<u64> = h.iter().map(|g| g.number).collect();
    assert!(numbers.windows(2).all(|w| w[1] == w[0] + 1), "{numbers:?}");
    assert!(
        h.iter().all(|g| g.reason != Reason::Failure),
        "an upgrade step failed a worker: {h:?}"
    );
    // no step lost or repeated, every sample once per epoch (624 samples of ctx 32)
    let v = ductile_tests::ledger::violations(ledger.path(), steps, 624, 32);
    assert!(v.is_empty(), "{v:#?}");
}

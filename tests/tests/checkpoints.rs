//! Sharded checkpoints: real etcd, daemon, agents and tch workers; moto (S3) and local files.
//! (Named `training_…` so the test command runs them one at a time with the training tests.)

use std::time::Duration;

use ductile_checkpoint::format::attempt_dir;
use ductile_checkpoint::restore::{committed, fetch, load_manifest};
use ductile_checkpoint::save::{
    commit_fenced, gather_and_commit, write_shard, CommitInput, SaveError, ShardLayout,
};
use ductile_checkpoint::{plan, Bucket, UploadOptions};
use ductile_cluster::records::{CheckpointRecord, CheckpointStats, JobState};
use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn latest(c: &Cluster, job: &str) -> Option<CheckpointRecord> {
    rt().block_on(async {
        let store = c.store().await;
        store
            .get_json::<CheckpointRecord>(&store.keys.checkpoint(job), "checkpoint")
            .await
            .unwrap()
            .map(|(r, _)| r)
    })
}

fn stats(c: &Cluster, job: &str) -> CheckpointStats {
    rt().block_on(async {
        let store = c.store().await;
        store
            .get_json::<CheckpointStats>(&store.keys.checkpoint_stats(job), "stats")
            .await
            .unwrap()
            .map(|(r, _)| r)
            .unwrap_or_default()
    })
}

/// Every rank's "step:sha256" when it joined the job's first generation at or after `from`.
fn agent_logs(c: &Cluster) -> String {
    c.agents
        .values()
        .map(|p| std::fs::read_to_string(&p.log).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

fn set_s3_env(env: &[(String, String)]) {
    for (k, v) in env {
        std::env::set_var(k, v);
    }
}

fn mlp_job(
    name: &str,
    desired: u32,
    data: &str,
    url: &str,
    max_steps: u64,
    interval: u64,
    extra: &str,
) -> String {
    format!(
        "{}max_steps = {max_steps}\ndeterministic = true\noptimizer = \"adamw\"\nlogical_shards = 12\n{extra}\n[checkpoint]\nurl = \"{url}\"\ninterval = {interval}\nkeep = 5\n",
        training_toml(name, 1, 6, desired, "mlp", data, "restart_budget = 20")
    )
}

/// 1. Saved at world 4 (S3), restored at 1, 2, 3 and 6: every rank holds the same bits, and
/// the run continues from the same step and data cursor (deterministic mode: the final weights
/// equal the uninterrupted run's).
#[test]
fn training_checkpoint_saved_at_four_restores_bitwise_at_one_two_three_and_six() {
    let c = Cluster::start(Spec {
        s3: true,
        ..Spec::default().agents(3, 2)
    });
    let s3 = c.s3.as_ref().unwrap();
    let data = synth(c.dir.path(), "regression", 4_000);
    let url = format!("s3://{}/jobs/c1", s3.bucket);
    // commits at step 40 only (interval 40, 60 steps); the reference finishes uninterrupted
    c.submit(&mlp_job("c1", 4, &data, &url, 60, 40, ""));
    let reference = c.wait_done("c1", S(120)).final_weights_sha256.unwrap();
    let rec = latest(&c, "c1").expect("a committed checkpoint");
    assert_eq!((rec.step, rec.world_size), (40, 4));
    let mut at_restore = Vec::new();
    for world in [1u32, 2, 3, 6] {
        let before = c.status("c1").generation;
        c.submit(&mlp_job("c1", world, &data, &url, 60, 40, ""));
        let (_, w) = joined_weights(&c, "c1", before + 1);
        assert_eq!(w.len(), world as usize);
        assert!(
            w.iter().all(|x| *x == w[0]),
            "world {world}: ranks differ after the restore: {w:?}"
        );
        assert!(w[0].starts_with("40:"), "world {world} resumed at {}", w[0]);
        at_restore.push(w[0].clone());
        let done = c.wait_done("c1", S(120));
        assert_eq!(done.step, 60);
        assert_eq!(
            done.final_weights_sha256.unwrap(),
            reference,
            "world {world}: the resumed run's final weights differ from the uninterrupted run"
        );
    }
    assert!(
        at_restore.iter().all(|x| *x == at_restore[0]),
        "{at_restore:?}"
    );
    let logs = agent_logs(&c);
    assert!(
        logs.contains("restored checkpoint step 40 (generation"),
        "no restore line"
    );
    // the CLI lists it
    let out = c.dctl_ok(&["checkpoints", "c1"]);
    assert!(
        out.contains("committed") && out.contains("dp4×pp1×tp1"),
        "{out}"
    );
    let metrics = http("GET", &format!("{}/metrics", c.endpoint()), &[], b"")
        .unwrap()
        .1;
    assert!(
        metrics.contains("ductile_checkpoint_restore_seconds{job=\"c1\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ductile_checkpoint_stall_ms{job=\"c1\"}"),
        "{metrics}"
    );
}

/// 2. The S3 server dies in the middle of an upload: no commit appears, the previous commit
/// still restores, and once the server is back the next checkpoint commits.
#[test]
fn training_checkpoint_survives_the_s3_server_dying_mid_upload() {
    let c = Cluster::start(Spec {
        s3_proxy: true,
        ..Spec::default().agents(1, 2)
    });
    let s3 = c.s3.as_ref().unwrap();
    let proxy = c.s3_proxy.as_ref().unwrap();
    let data = synth(c.dir.path(), "regression", 4_000);
    let url = format!("s3://{}/jobs/c2", s3.bucket);
    c.submit(&mlp_job("c2", 2, &data, &url, 10_000_000, 50, ""));
    let first = c.wait_for(S(60), "a first commit", || latest(&c, "c2"));
    // slow uploads down to a crawl, let one start, then take the server away
    proxy.throttle(2_000);
    std::thread::sleep(S(3));
    let failed_before = stats(&c, "c2").failed_total;
    proxy.stop();
    c.wait_for(S(60), "the upload to fail", || {
        (stats(&c, "c2").failed_total > failed_before).then_some(())
    });
    let during = latest(&c, "c2").unwrap();
    std::thread::sleep(S(2));
    assert_eq!(
        latest(&c, "c2").unwrap(),
        during,
        "a commit appeared while the server was gone"
    );
    assert!(
        agent_logs(&c).contains("shard upload failed, no commit"),
        "the failure was not reported"
    );
    // the previous commit still restores, read straight from the server
    set_s3_env(&s3.env());
    rt().block_on(async {
        let bucket = Bucket::open(&url).unwrap();
        let list = committed(&bucket, None).await.unwrap();
        assert!(list.iter().any(|r| r.step == during.step), "{list:?}");
        let m = load_manifest(&bucket, &during).await.unwrap();
        let all = plan::readers(&m, 1).remove(0);
        fetch(&bucket, &m, &all, 4)
            .await
            .expect("the previous commit verifies");
    });
    proxy.throttle(0);
    proxy.serve();
    let after = c.wait_for(S(90), "a commit after the server returned", || {
        latest(&c, "c2").filter(|r| r.step > during.step)
    });
    assert!(after.step > first.step);
}

/// 3. A worker is SIGKILLed while its checkpoint uploads: that attempt never commits. A stale
/// writer from the old generation then tries to commit and is refused, also against a store
/// that ignores conditional writes.
#[test]
fn training_a_stale_writer_cannot_commit_even_where_conditional_writes_are_ignored() {
    let c = Cluster::start(Spec {
        s3_proxy: true,
        restart_backoff_ms: 300,
        ..Spec::default().agents(3, 1)
    });
    let s3 = c.s3.as_ref().unwrap();
    let proxy = c.s3_proxy.as_ref().unwrap();
    let data = synth(c.dir.path(), "regression", 4_000);
    let url = format!("s3://{}/jobs/c3", s3.bucket);
    c.submit(&mlp_job("c3", 3, &data, &url, 10_000_000, 50, ""));
    c.wait_world("c3", 3, S(30));
    c.wait_for(S(60), "a first commit", || latest(&c, "c3"));
    proxy.throttle(2_000);
    std::thread::sleep(S(3));
    let v = c.status("c3");
    let old_gen = v.generation;
    let victim = v.members.iter().find(|m| m.rank == 1).unwrap();
    unsafe { libc::kill(victim.pid.unwrap() as i32, libc::SIGKILL) };
    c.wait_for(S(30), "a new generation", || {
        (c.status("c3").generation > old_gen).then_some(())
    });
    proxy.throttle(0);
    let later = c.wait_for(S(90), "a commit of a newer generation", || {
        latest(&c, "c3").filter(|r| r.generation > old_gen)
    });
    assert!(
        agent_logs(&c).contains("a stale writer cannot commit"),
        "the old generation's attempt was not refused"
    );
    set_s3_env(&s3.env());
    let rt = rt();
    let (store, bucket) = rt.block_on(async { (c.store().await, Bucket::open(&url).unwrap()) });
    rt.block_on(async {
        // no commit of the old generation beyond what it committed before the kill
        for r in committed(&bucket, None).await.unwrap() {
            assert!(r.generation > old_gen || r.step < later.step, "{r:?}");
        }
        // the stale writer: its generation is gone
        let stale = CheckpointRecord {
            job: None,
            step: later.step + 1_000,
            generation: old_gen,
            ..later.clone()
        };
        let e = commit_fenced(&store, "c3", &stale).await.unwrap_err();
        assert!(matches!(e, SaveError::Stale { .. }), "{e}");
        let now: CheckpointRecord = store
            .get_json(&store.keys.checkpoint("c3"), "checkpoint")
            .await
            .unwrap()
            .unwrap()
            .0;
        assert!(now.generation > old_gen && now.step < stale.step, "{now:?}");
    });
    // the same stale writer against a store that ignores If-None-Match
    let lax = S3::start_lax(c.dir.path());
    set_s3_env(&lax.env());
    let lax_url = format!("s3://{}/jobs/c3", lax.bucket);
    rt.block_on(async {
        let bucket = Bucket::open(&lax_url).unwrap();
        assert!(
            !bucket.probe_conditional_create().await.unwrap(),
            "the lax store enforced a conditional create"
        );
        let ts = vec![ductile_checkpoint::format::TensorMeta {
            name: "w".into(),
            dtype: ductile_checkpoint::format::Dtype::F32,
            shape: vec![8],
            kind: ductile_checkpoint::format::TensorKind::Parameter,
        }];
        let current = c.status("c3").generation;
        let step = later.step + 2_000;
        for generation in [old_gen, current] {
            let layout = ShardLayout::new(&ts, 1, 0);
            let mut buf = Vec::new();
            layout.prepare(&mut buf);
            write_shard(
                &store,
                &bucket,
                "c3",
                step,
                generation,
                &ts,
                &layout,
                buf.into(),
                UploadOptions::default(),
            )
            .await
            .unwrap();
            let r = gather_and_commit(
                &store,
                &bucket,
                CommitInput {
                    job: "c3",
                    step,
                    generation,
                    world: 1,
                    layout: ductile_cluster::records::Layout::data_parallel(1),
                    tensors: &ts,
                    extra: serde_json::json!({}),
                    conditional_create: false,
                    request: None,
                    wait: S(5),
                },
            )
            .await;
            let commit = bucket
                .get(&format!("{}/COMMIT", attempt_dir(step, generation)))
                .await;
            if generation == old_gen {
                assert!(matches!(r, Err(SaveError::Stale { .. })), "{r:?}");
                assert!(
                    commit.unwrap_err().is_not_found(),
                    "a stale commit record was written"
                );
            } else {
                r.unwrap();
                commit.expect("the live generation's commit record");
            }
        }
    });
}

/// 4. A flipped byte in a shard fails that checkpoint with the object and tensor named; the
/// restore falls back to the previous commit. (Local files.)
#[test]
fn training_a_flipped_byte_fails_the_checkpoint_and_restore_falls_back() {
    let c = Cluster::start(Spec::default().agents(1, 2));
    let data = synth(c.dir.path(), "regression", 4_000);
    let dir = c.dir.path().join("ckpt-c4");
    let url = format!("file://{}", dir.display());
    c.submit(&mlp_job("c4", 2, &data, &url, 40, 20, ""));
    c.wait_done("c4", S(120));
    let rec = latest(&c, "c4").unwrap();
    assert_eq!(rec.step, 40);
    let m = rt().block_on(async {
        load_manifest(&Bucket::open(&url).unwrap(), &rec)
            .await
            .unwrap()
    });
    let (name, t) = m.ordered().next().unwrap();
    let chunk = &t.chunks[0];
    let path = dir
        .join(attempt_dir(40, rec.generation))
        .join(&chunk.object);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = ((chunk.byte_range[0] + chunk.byte_range[1]) / 2) as usize;
    bytes[at] ^= 0x01;
    std::fs::write(&path, bytes).unwrap();
    let before = c.status("c4").generation;
    c.submit(&mlp_job("c4", 3, &data, &url, 60, 20, ""));
    let (_, w) = joined_weights(&c, "c4", before + 1);
    assert!(
        w[0].starts_with("20:"),
        "resumed at {} instead of falling back to step 20",
        w[0]
    );
    let logs = agent_logs(&c);
    assert!(
        logs.contains("CRC32C mismatch")
            && logs.contains(&chunk.object)
            && logs.contains(&format!("tensor {name}")),
        "the CRC failure does not name the object and tensor:\n{logs}"
    );
    assert!(logs.contains("FALLING BACK"), "the fallback is not loud");
    assert_eq!(c.wait_done("c4", S(120)).step, 60);
}

/// 5. The whole job is lost mid-run (every agent killed); the job is resubmitted at another
/// size on a new cluster with a fresh etcd. The bucket's commit records suffice: the cold start
/// resumes from the latest commit, and the final weights equal an uninterrupted run's.
#[test]
fn training_a_full_restart_at_another_size_on_a_fresh_etcd_resumes_from_the_latest_commit() {
    let scratch = TempDir::new("c5");
    let data = synth(scratch.path(), "regression", 4_000);
    let url = format!("file://{}/ckpt", scratch.path().display());
    let reference = {
        let c = Cluster::start(Spec::default().agents(1, 2));
        let ref_url = format!("file://{}/ckpt-ref", scratch.path().display());
        c.submit(&mlp_job("c5", 2, &data, &ref_url, 3000, 500, ""));
        c.wait_done("c5", S(120)).final_weights_sha256.unwrap()
    };
    let committed_step = {
        let mut c = Cluster::start(Spec::default().agents(2, 2));
        c.submit(&mlp_job("c5", 4, &data, &url, 3000, 500, ""));
        let r = c.wait_for(S(120), "a commit", || latest(&c, "c5"));
        assert!(
            c.status("c5").state != JobState::Succeeded,
            "the job ended before the loss"
        );
        for a in c.agents.values_mut() {
            a.kill();
        }
        r.step
    };
    let c = Cluster::start(Spec::default().agents(2, 2));
    c.submit(&mlp_job("c5", 3, &data, &url, 3000, 500, ""));
    let (_, w) = joined_weights(&c, "c5", 1);
    let resumed: u64 = w[0].split(':').next().unwrap().parse().unwrap();
    assert!(
        resumed >= committed_step && resumed > 0,
        "resumed at {resumed}, committed {committed_step}"
    );
    let done = c.wait_done("c5", S(180));
    assert_eq!(
        done.final_weights_sha256.unwrap(),
        reference,
        "final weights differ from the uninterrupted run"
    );
}

/// A planned drain (a spot notice) of the node that holds the whole job: the daemon asks for
/// a checkpoint, holds the re-formation until it commits, then moves the job to the spare node,
/// which restores from it. Nothing trained before the drain is lost: in deterministic mode the
/// final weights equal an uninterrupted run's.
#[test]
fn training_a_spot_notice_takes_a_checkpoint_before_the_node_leaves() {
    let spot = SpotServer::start();
    let mut c = Cluster::start(Spec::default().agents(0, 1));
    c.start_agent(
        "spot1",
        2,
        &["--spot-notice-url", &spot.url, "--spot-poll-ms", "100"],
    );
    let data = synth(c.dir.path(), "regression", 4_000);
    let ref_url = format!("file://{}/ckpt-ref", c.dir.path().display());
    let url = format!("file://{}/ckpt", c.dir.path().display());
    // no interval checkpoint falls within the run: only the drain can make one
    let job = |u: &str| mlp_job("c7", 2, &data, u, 3000, 100_000, "");
    c.submit(&job(&ref_url));
    let reference = c.wait_done("c7", S(180)).final_weights_sha256.unwrap();
    assert!(
        latest(&c, "c7").is_none(),
        "an interval checkpoint was taken"
    );
    let before = c.status("c7").generation;
    c.submit(&job(&url));
    c.wait_for(S(60), "the job trains on spot1", || {
        let v = c.status("c7");
        (v.generation > before && v.state == JobState::Running && v.step >= 50).then_some(())
    });
    c.start_agent("node2", 2, &[]);
    c.wait_for(S(20), "node2 registered", || {
        c.dctl_ok(&["nodes"]).contains("node2").then_some(())
    });
    spot.notice("terminate");
    let status = c
        .agents
        .get_mut("spot1")
        .unwrap()
        .wait_exit(S(40))
        .expect("the agent drains and exits");
    assert!(status.success(), "drained agent exit status {status:?}");
    let rec = latest(&c, "c7").expect("a checkpoint committed before the node left");
    let asked = rec
        .request
        .clone()
        .expect("the commit answers the drain's request");
    assert!(asked.starts_with("drain-g"), "{asked}");
    assert!(
        rec.step > 50 && rec.step < 3000,
        "drain checkpoint at {}",
        rec.step
    );
    let (g, w) = joined_weights(&c, "c7", before + 2);
    assert!(
        w.iter().all(|x| x.starts_with(&format!("{}:", rec.step))),
        "generation {g} did not restore the drain checkpoint at step {}: {w:?}",
        rec.step
    );
    let v = c.wait_for(S(20), "the re-formation recorded", || {
        Some(c.status("c7")).filter(|v| {
            v.last_reformation
                .as_ref()
                .is_some_and(|r| r.generation == g)
        })
    });
    assert!(v.members.iter().all(|m| m.node == "node2"), "{v:?}");
    let r = v.last_reformation.clone().unwrap();
    assert!(
        r.detail.contains("spot1 is draining")
            && r.detail
                .contains(&format!("checkpoint at step {} committed first", rec.step)),
        "{r:?}"
    );
    let done = c.wait_done("c7", S(180));
    assert_eq!(
        done.final_weights_sha256.unwrap(),
        reference,
        "final weights differ from the uninterrupted run"
    );
    // the newcomers did not answer the old generation's request a second time
    assert_eq!(latest(&c, "c7").unwrap().step, rec.step);
    let daemon_log: String = c
        .daemons
        .iter()
        .map(|d| std::fs::read_to_string(&d.log).unwrap_or_default())
        .collect();
    assert!(
        daemon_log.contains("asked the workers for a checkpoint"),
        "the daemon did not say it asked:\n{daemon_log}"
    );
}

/// A job resubmitted with `restore_step` resumes from that earlier commit, exactly (the final
/// weights equal the uninterrupted run's); the commits after it are superseded, kept but never
/// restored; a step the URL does not hold is refused at submission.
#[test]
fn training_restore_step_resumes_from_a_chosen_earlier_commit() {
    let c = Cluster::start(Spec::default().agents(1, 3));
    let data = synth(c.dir.path(), "regression", 4_000);
    let url = format!("file://{}/ckpt-c8", c.dir.path().display());
    c.submit(&mlp_job("c8", 2, &data, &url, 60, 20, ""));
    let reference = c.wait_done("c8", S(120)).final_weights_sha256.unwrap();
    let first = latest(&c, "c8").unwrap();
    assert_eq!(first.step, 60);
    // the commits before the last (a due save is skipped while the previous one still uploads,
    // so which ones exist depends on the machine's speed): restore the newest of them
    let steps: Vec<u64> = rt().block_on(async {
        committed(&Bucket::open(&url).unwrap(), None)
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.step)
            .collect()
    });
    let mid = *steps
        .iter()
        .find(|s| **s < 60)
        .expect("a commit before the last");
    let pinned = |n: u64, world: u32| {
        mlp_job("c8", world, &data, &url, 60, 20, "")
            .replace("keep = 5\n", &format!("keep = 5\nrestore_step = {n}\n"))
    };
    // a step that was never committed: refused, naming what there is; nothing changes
    let p = c.dir.path().join("c8-bad.toml");
    std::fs::write(&p, pinned(30, 3)).unwrap();
    let (ok, _, err) = c.dctl(&["submit", p.to_str().unwrap()]);
    assert!(!ok, "restore_step 30 accepted");
    assert!(
        err.contains("restore_step")
            && err.contains("step 30")
            && err.contains(&format!("{steps:?}")),
        "{err}"
    );
    assert_eq!(c.status("c8").state, JobState::Succeeded);
    assert_eq!(latest(&c, "c8").unwrap(), first);
    // the earlier commit, at world 3
    let before = c.status("c8").generation;
    c.submit(&pinned(mid, 3));
    let (g, w) = joined_weights(&c, "c8", before + 1);
    assert_eq!(w.len(), 3);
    assert!(w.iter().all(|x| x.starts_with(&format!("{mid}:"))), "{w:?}");
    let done = c.wait_done("c8", S(120));
    assert_eq!(
        done.final_weights_sha256.unwrap(),
        reference,
        "resuming from step {mid} did not reproduce the run"
    );
    let now = latest(&c, "c8").unwrap();
    assert_eq!(now.step, 60);
    assert!(now.generation >= g, "{now:?}");
    let v: serde_json::Value =
        serde_json::from_str(&c.dctl_ok(&["checkpoints", "c8", "--json"])).unwrap();
    let states: Vec<(u64, u64, String)> = v["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["step"].as_u64().unwrap(),
                x["generation"].as_u64().unwrap(),
                x["state"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let of = |step: u64, gen: u64| {
        states
            .iter()
            .find(|(s, g, _)| *s == step && *g == gen)
            .map(|x| x.2.as_str())
    };
    assert_eq!(of(60, first.generation), Some("superseded"), "{states:?}");
    assert_eq!(of(60, now.generation), Some("committed"), "{states:?}");
    assert_eq!(
        of(mid, 1).or(of(mid, first.generation)),
        Some("committed"),
        "{states:?}"
    );
    // the superseded commit's data is still there
    let dir = c
        .dir
        .path()
        .join("ckpt-c8")
        .join(attempt_dir(60, first.generation));
    assert!(dir.join("SUPERSEDED").exists() && !dir.join("COMMIT").exists());
    assert!(dir.join("manifest.json").exists());
}

/// 6. Python's safetensors opens ductile's shards and reads the same values; the manifest is
/// plain JSON.
#[test]
fn training_python_safetensors_reads_the_shards_ductile_wrote() {
    let c = Cluster::start(Spec::default().agents(1, 3));
    let data = synth(c.dir.path(), "regression", 4_000);
    let dir = c.dir.path().join("ckpt-c6");
    let url = format!("file://{}", dir.display());
    c.submit(&mlp_job("c6", 3, &data, &url, 20, 20, ""));
    c.wait_done("c6", S(120));
    let rec = latest(&c, "c6").unwrap();
    let attempt = dir.join(attempt_dir(rec.step, rec.generation));
    let script = r#"
import hashlib, json, sys
import numpy as np
from safetensors import safe_open
d = sys.argv[1]
m = json.load(open(d + "/manifest.json"))
for o in m["objects"]:
    with safe_open(d + "/" + o["object"], framework="numpy") as f:
        meta = f.metadata()
        for k in f.keys():
            t = f.get_tensor(k)
            info = json.loads(meta[k])
            print(o["object"], k, str(t.dtype), list(t.shape), info["offsets"], hashlib.sha256(np.ascontiguousarray(t).tobytes()).hexdigest())
"#;
    let py = std::env::var("DUCTILE_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(py)
        .args(["-c", script, attempt.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let py_lines: std::collections::BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(String::from)
        .collect();
    let m = rt().block_on(async {
        load_manifest(&Bucket::open(&url).unwrap(), &rec)
            .await
            .unwrap()
    });
    let mut want = std::collections::BTreeSet::new();
    for (name, t) in m.ordered() {
        assert_eq!(t.dtype, ductile_checkpoint::format::Dtype::F32);
        for ch in &t.chunks {
            let bytes = std::fs::read(attempt.join(&ch.object)).unwrap();
            let b = &bytes[ch.byte_range[0] as usize..ch.byte_range[1] as usize];
            let mut h = sha256(b);
            h.truncate(64);
            want.insert(format!(
                "{} {name} float32 {:?} {:?} {h}",
                ch.object, ch.shape, ch.offsets
            ));
        }
    }
    let norm = |s: &str| s.replace(", ", ",");
    let py_lines: std::collections::BTreeSet<String> = py_lines.iter().map(|s| norm(s)).collect();
    let want: std::collections::BTreeSet<String> = want.iter().map(|s| norm(s)).collect();
    assert_eq!(py_lines, want);
    assert_eq!(m.objects.len(), 3);
}

/// Every shard of every layout is a standard safetensors file (each row range a rank holds is
/// named in its header, once: a tensor-parallel member holds several of the fused `qkv`), and a
/// PyTorch user reassembles each tensor from the manifest's chunks (`object`, `key`,
/// `offsets`): the parameters of the job's last commit hash to its final weights.
/// Data parallel, pipeline, tensor parallel, pipeline × tensor parallel, and data parallel with
/// the optimizer state sharded (alone and in replicated shard groups).
#[test]
fn training_python_safetensors_reassembles_every_layout_to_the_final_weights() {
    let c = Cluster::start(Spec::default().agents(1, 4));
    let reg = synth(c.dir.path(), "regression", 4_000);
    let tok = synth(c.dir.path(), "tokens", 40_000);
    let script = r#"
import hashlib, json, sys
import numpy as np
from safetensors import safe_open
d = sys.argv[1]
m = json.load(open(d + "/manifest.json"))
files = {}
for o in m["objects"]:
    # what a standard reader checks: the header names every byte of the data area, once
    files[o["object"]] = safe_open(d + "/" + o["object"], framework="numpy")
    for k in files[o["object"]].keys():
        files[o["object"]].get_tensor(k)
h = hashlib.sha256()
for name in m["order"]:
    t = m["tensors"][name]
    full = np.zeros(t["shape"], dtype=np.float32)
    for ch in t["chunks"]:
        part = files[ch["object"]].get_tensor(ch.get("key") or name)
        assert list(part.shape) == ch["shape"], (name, list(part.shape), ch["shape"])
        full[tuple(slice(o, o + n) for o, n in zip(ch["offsets"], ch["shape"]))] = part
    if t["kind"] == "parameter":
        h.update(np.ascontiguousarray(full).tobytes())
print(h.hexdigest())
"#;
    let py = std::env::var("DUCTILE_PYTHON").unwrap_or_else(|_| "python3".into());
    let gpt = "model_config = { d_model = 32, n_layer = 2, n_head = 4, ctx = 16 }\n";
    for (job, desired, model, extra) in [
        ("sdp", 2, "mlp", String::new()),
        (
            "spp",
            2,
            "mlp",
            "strategy = \"pipeline\"\npipeline_parallel = 2\nmodel_config = { hidden = 32, layers = 3 }\n".to_string(),
        ),
        (
            "stp",
            2,
            "gpt",
            format!("strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1\n{gpt}"),
        ),
        (
            "shy",
            4,
            "gpt",
            format!("strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 2\n{gpt}"),
        ),
        // the optimizer state sharded (ZeRO-1), and in groups of 2 replicated twice (HSDP)
        ("szero", 3, "mlp", "sharding = \"optimizer\"\n".to_string()),
        (
            "shsdp",
            4,
            "mlp",
            "sharding = \"optimizer\"\nshard_group = 2\n".to_string(),
        ),
        // every parameter's rows too (full sharding: ZeRO-3 / FSDP), a fused Q/K/V included
        ("sfull", 3, "gpt", format!("sharding = \"full\"\n{gpt}")),
    ] {
        let dir = c.dir.path().join(format!("ckpt-{job}"));
        let data = if model == "gpt" { &tok } else { &reg };
        c.submit(&format!(
            "{}max_steps = 20\n{extra}[checkpoint]\nurl = \"file://{}\"\ninterval = 20\nkeep = 2\n",
            training_toml(job, desired, desired, desired, model, data, "restart_budget = 5"),
            dir.display()
        ));
        let done = c.wait_done(job, S(180));
        let want = done.final_weights_sha256.unwrap();
        let rec = latest(&c, job).unwrap();
        assert_eq!(rec.step, 20, "{job}");
        let attempt = dir.join(attempt_dir(rec.step, rec.generation));
        let out = std::process::Command::new(&py)
            .args(["-c", script, attempt.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{job}: python failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert_eq!(got, want, "{job}: reassembled parameters vs the final weights");
    }
}

fn sha256(b: &[u8]) -> String {
    let out = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(b)?;
            c.wait_with_output()
        })
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// A cold start that cannot list the store does not take that for "no checkpoint": the workers
/// say why, never train from the seed, and restore the latest commit once the store is back.
#[test]
fn training_a_cold_start_that_cannot_list_the_store_does_not_start_from_the_seed() {
    let c = Cluster::start(Spec {
        s3_proxy: true,
        ..Spec::default().agents(1, 2)
    });
    let s3 = c.s3.as_ref().unwrap();
    let proxy = c.s3_proxy.as_ref().unwrap();
    let data = synth(c.dir.path(), "regression", 4_000);
    let url = format!("s3://{}/jobs/c9", s3.bucket);
    c.submit(&mlp_job("c9a", 2, &data, &url, 30, 10, ""));
    c.wait_done("c9a", S(120));
    // the newest commit (saves are skipped while one uploads, so not always step 30)
    let done = latest(&c, "c9a").unwrap().step;
    assert!(done >= 10, "{done}");
    // the store goes away; a new job on the same URL cold-starts
    proxy.stop();
    // (c9b carries c9a's run on)
    c.submit(
        &mlp_job("c9b", 2, &data, &url, 40, 10, "")
            .replace("keep = 5\n", "keep = 5\nresume_from = [\"c9a\"]\n"),
    );
    let c9b = |c: &Cluster| -> Vec<String> {
        agent_logs(c)
            .lines()
            .filter(|l| l.contains("job=c9b"))
            .map(str::to_string)
            .collect()
    };
    c.wait_for(S(120), "the failed listing reported", || {
        c9b(&c)
            .iter()
            .any(|l| l.contains("cannot tell which checkpoints"))
            .then_some(())
    });
    assert!(
        !c9b(&c).iter().any(|l| l.contains("starting from the seed")),
        "{:#?}",
        c9b(&c)
    );
    proxy.serve();
    c.wait_done("c9b", S(180));
    let logs = c9b(&c);
    assert!(
        logs.iter()
            .any(|l| l.contains("joined generation") && l.contains(&format!("at step {done} "))),
        "c9b did not resume from step {done}: {logs:#?}"
    );
    assert!(!logs.iter().any(|l| l.contains("starting from the seed")));
}

/// A store error that is not corruption during a cold start (here S3 answers the latest
/// manifest's GET with 403 InvalidObjectState: the object went to an archive storage class)
/// never rolls the job back to an older commit: every rank's attempt fails, saying why, the
/// workers are restarted, and once the store reads again the job resumes from the latest commit.
#[test]
fn training_a_store_error_in_a_cold_start_is_retried_never_a_fallback() {
    let c = Cluster::start(Spec {
        s3: true,
        ..Spec::default().agents(1, 2)
    });
    let s3 = c.s3.as_ref().unwrap();
    let data = synth(c.dir.path(), "regression", 4_000);
    let url = format!("s3://{}/jobs/c10", s3.bucket);
    c.submit(&mlp_job("c10", 2, &data, &url, 40, 20, ""));
    c.wait_done("c10", S(120));
    let rec = latest(&c, "c10").unwrap();
    assert_eq!(rec.step, 40);
    // the manifest's bytes kept aside, the object moved to GLACIER (S3 refuses its GETs)
    let key = format!("jobs/c10/{}", rec.manifest);
    let saved = c.dir.path().join("manifest.saved");
    let boto = |op: &str| {
        let script = r#"
import sys, boto3
endpoint, region, ak, sk, bucket, key, path, op = sys.argv[1:9]
s3 = boto3.client("s3", endpoint_url=endpoint, region_name=region, aws_access_key_id=ak, aws_secret_access_key=sk)
if op == "archive":
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    open(path, "wb").write(body)
    s3.put_object(Bucket=bucket, Key=key, Body=body, StorageClass="GLACIER")
else:
    s3.put_object(Bucket=bucket, Key=key, Body=open(path, "rb").read())
"#;
        let py = std::env::var("DUCTILE_PYTHON").unwrap_or_else(|_| "python3".into());
        let out = std::process::Command::new(py)
            .args([
                "-c",
                script,
                &s3.endpoint,
                &s3.region,
                &s3.access_key,
                &s3.secret_key,
                &s3.bucket,
                &key,
            ])
            .arg(&saved)
            .arg(op)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "boto3 {op}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    boto("archive");
    c.submit(&mlp_job("c10", 2, &data, &url, 60, 20, ""));
    c.wait_for(S(120), "the failed read reported", || {
        agent_logs(&c).contains("could not read it").then_some(())
    });
    let logs = agent_logs(&c);
    assert!(
        !logs.contains("FALLING BACK"),
        "fell back on a store error:\n{logs}"
    );
    assert!(
        !logs.contains("at step 20 ("),
        "a rank resumed from the older commit:\n{logs}"
    );
    boto("restore");
    // the first join after the store reads again is at step 40 (later re-formations may join
    // at later steps): read the joins from the logs, as they happened
    c.wait_for(S(120), "a join at step 40", || {
        agent_logs(&c)
            .lines()
            .any(|l| l.contains("joined generation") && l.contains("at step 40 ("))
            .then_some(())
    });
    assert_eq!(c.wait_done("c10", S(180)).step, 60);
    assert!(
        !agent_logs(&c).contains("at step 20 ("),
        "a rank resumed from the older commit"
    );
    assert!(!agent_logs(&c).contains("FALLING BACK"));
}

/// A checkpoint saved with another seed (or dataset, or global batch, or drawing from another
/// number of samples: an eval_fraction cut off since) does not resume a job:
/// its data position would not mean the same samples. The job says which field differs. Nor
/// does one saved with another recipe, unless checkpoint.allow_recipe_change says so.
#[test]
fn training_a_checkpoint_of_another_data_order_is_refused_naming_the_field() {
    let c = Cluster::start(Spec::default().agents(1, 2));
    let data = synth(c.dir.path(), "regression", 4_000);
    let url = format!("file://{}/ckpt-d", c.dir.path().display());
    c.submit(&mlp_job("d1", 2, &data, &url, 20, 10, ""));
    c.wait_done("d1", S(120));
    // (d2 carries d1's run on: it may restore d1's commits)
    c.submit(
        &mlp_job("d2", 2, &data, &url, 40, 10, "")
            .replace("seed = 7", "seed = 8")
            .replace("keep = 5\n", "keep = 5\nresume_from = [\"d1\"]\n"),
    );
    c.wait_for(S(90), "the refusal", || {
        agent_logs(&c)
            .contains("was saved with training.seed = 7, this job has 8")
            .then_some(())
    });
    let logs = agent_logs(&c);
    assert!(
        !logs
            .lines()
            .any(|l| l.contains("job=d2") && l.contains("joined generation")),
        "d2 trained on a checkpoint of another data order"
    );
    // the same dataset URL, but a held-out tail cut off: the order is over fewer samples
    let tokens = synth(c.dir.path(), "tokens", 20_000);
    let url = format!("file://{}/ckpt-e", c.dir.path().display());
    let gpt = |name: &str, extra: &str| {
        format!(
            "{}max_steps = 20\n{extra}\n[checkpoint]\nurl = \"{url}\"\ninterval = 10\n",
            training_toml(name, 1, 2, 2, "gpt", &tokens, "restart_budget = 20")
        )
    };
    c.submit(&gpt("e1", ""));
    c.wait_done("e1", S(120));
    c.submit(
        &(gpt("e2", "eval_fraction = 0.1").replace("max_steps = 20", "max_steps = 40")
            + "resume_from = [\"e1\"]\n"),
    );
    c.wait_for(S(90), "the refusal", || {
        agent_logs(&c)
            .contains("was saved drawing from 624 samples of the dataset, this job draws from 561")
            .then_some(())
    });
    // another recipe (issue 49): the rate and the update of every step would not be the run's;
    // the job names what differs, and goes on only when its spec says it means it
    // (a job's location is its own while it is not finished: e2 is stopped first)
    let stop = |job: &str| {
        c.dctl_ok(&["stop", job]);
        c.wait_for(S(30), "stopped", || {
            Some(c.status(job)).filter(|v| v.state.is_terminal())
        });
    };
    stop("e2");
    let wd = "optimizer = { name = \"adamw\", weight_decay = 0.05 }";
    c.submit(&(gpt("e3", wd) + "resume_from = [\"e1\"]\n"));
    c.wait_for(S(90), "the refusal", || {
        agent_logs(&c)
            .contains("saved with another recipe (optimizer.weight_decay: 0.01 in the checkpoint, 0.05 in this job)")
            .then_some(())
    });
    assert!(!c
        .logs()
        .lines()
        .any(|l| l.contains("job=e3") && l.contains("joined generation")));
    stop("e3");
    c.submit(&(gpt("e4", wd) + "resume_from = [\"e1\"]\nallow_recipe_change = true\n"));
    let e4 = c.wait_done("e4", S(120));
    assert_eq!(e4.step, 20, "e4 went on from e1's last commit");
    assert!(agent_logs(&c).contains("restoring a checkpoint saved with another recipe"));
}

/// A location another job used (issue 46, item 10): a job submitted later under another name
/// with the same `checkpoint.url` (the first one has finished, so submit allows it) neither
/// restores, overwrites nor deletes the first job's commits: it fails at its cold start, saying
/// whose checkpoints are there and what to do. Real S3 server.
#[test]
fn training_a_job_leaves_another_job_s_commits_at_its_location_alone() {
    let c = Cluster::start(Spec {
        s3: true,
        ..Spec::default().agents(1, 2)
    });
    let s3 = c.s3.as_ref().unwrap();
    let data = synth(c.dir.path(), "regression", 4_000);
    let url = format!("s3://{}/jobs/shared", s3.bucket);
    c.submit(&mlp_job("first", 2, &data, &url, 600, 100, ""));
    let done = c.wait_done("first", S(120));
    assert_eq!(done.state, JobState::Succeeded);
    // an ended job's live/ keys are deleted (its rendezvous data, shard reports, rank
    // figures) but what its status shows: progress, checkpoint figures, its last joins
    let r = rt();
    let store = r.block_on(c.store());
    c.wait_for(S(30), "first's live/ keys cleaned", || {
        let (kvs, _) = r
            .block_on(store.backend.list(&store.keys.live_job("first")))
            .unwrap();
        let rest: Vec<&str> = kvs
            .iter()
            .map(|kv| kv.key.strip_prefix(&store.keys.live_job("first")).unwrap())
            .filter(|k| *k != "progress" && *k != "checkpoint_stats" && !k.starts_with("joined/"))
            .collect();
        rest.is_empty().then_some(())
    });
    assert_eq!(
        c.status("first").final_weights_sha256,
        done.final_weights_sha256
    );
    assert!(stats(&c, "first").committed_total >= 3);
    set_s3_env(&s3.env());
    let bucket = Bucket::open(&url).unwrap();
    let list = || r.block_on(committed(&bucket, None)).unwrap();
    let firsts = list();
    assert!(firsts.len() >= 3, "{firsts:?}");
    for r in &firsts {
        assert_eq!(r.job.as_deref(), Some("first"), "{r:?}");
    }
    c.submit(
        &mlp_job("second", 2, &data, &url, 400, 100, "")
            .replace("keep = 5", "keep = 1")
            .replace("restart_budget = 20", "restart_budget = 1"),
    );
    let why = c.wait_for(S(120), "second refused at its cold start", || {
        c.history("second")
            .into_iter()
            .find(|g| g.detail.contains("holds job \"first\"'s checkpoints"))
            .map(|g| g.detail)
    });
    assert!(why.contains("a checkpoint.url of its own"), "{why}");
    c.dctl_ok(&["stop", "second"]);
    // every one of first's commits is still there, whole, and nothing of second's
    assert_eq!(list(), firsts);
    let m = r.block_on(load_manifest(&bucket, &firsts[0])).unwrap();
    let all = plan::readers(&m, 1).remove(0);
    r.block_on(fetch(&bucket, &m, &all, 4))
        .expect("first's latest commit verifies");
}

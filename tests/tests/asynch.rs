//! Asynchronous training with bounded staleness (`sync = "async"`): parameter slices owned by
//! the workers, stale updates dropped and their samples trained again. Real etcd, daemon,
//! agents and tch workers.

use std::time::Duration;

use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

/// An async job of the tokens dataset in `data` (624 samples of ctx 32), global batch 32.
fn async_toml(name: &str, desired: u32, data: &str, steps: u64, extra: &str) -> String {
    format!(
        "{}max_steps = {steps}\nsync = \"async\"\noptimizer = \"adamw\"\nmodel_config = {{ d_model = 32, n_layer = 1, n_head = 2 }}\n[training.async]\nstaleness = 2\n",
        training_toml(name, 1, 3, desired, "gpt", data, &format!("restart_budget = 50\n{extra}"))
    )
}

#[test]
fn async_a_slowed_worker_is_not_waited_for_its_stale_updates_are_dropped_and_retrained() {
    let ledger = TempDir::new("ledger");
    let c = ledger_cluster(&ledger);
    let data = synth(c.dir.path(), "tokens", 20_000);
    let steps = 300;
    c.submit(&async_toml(
        "a1",
        3,
        &data,
        steps,
        "allow_fault_injection = true\nenv = { DUCTILE_SLOWDOWN = \"2:3\" }",
    ));
    c.wait_world("a1", 3, S(30));
    let early = c.wait_step("a1", 20, S(120));
    let shown = c.dctl_ok(&["status", "a1"]);
    assert!(shown.contains("sync        async"), "{shown}");
    // the metrics carry the mode and the staleness
    let (code, metrics) = http("GET", &format!("{}/metrics", c.endpoint()), &[], b"").unwrap();
    assert_eq!(code, 200);
    for want in [
        "ductile_job_sync_mode{job=\"a1\",mode=\"async\"} 1",
        "ductile_job_async_staleness_max{job=\"a1\"}",
        "ductile_job_async_dropped_updates{job=\"a1\"}",
        "ductile_job_exchanged_bytes_per_sample{job=\"a1\"}",
    ] {
        assert!(metrics.contains(want), "{want} not in {metrics}");
    }
    let done = c.wait_done("a1", S(300));
    assert!(done.final_weights_sha256.is_some());
    let last = c.status("a1");
    assert!(
        last.loss.unwrap() < early.loss.unwrap(),
        "{early:?} → {last:?}"
    );
    assert!(last.staleness_max.is_some_and(|m| m <= 2), "{last:?}");
    let l = ductile_tests::ledger::async_violations(ledger.path(), steps * 32, 624, 2);
    assert!(l.violations.is_empty(), "{:#?}", l.violations);
    assert!(l.max_staleness <= 2);
    // the straggler's updates are mostly too stale: dropped, and their samples trained by
    // the others; the fast workers applied far more than it did
    let total_dropped: u64 = l.dropped.values().sum();
    assert!(total_dropped > 0, "{l:?}");
    let mut applied: Vec<u64> = l.applied.values().copied().collect();
    // one generation, three ranks
    applied.sort();
    assert_eq!(applied.len(), 3, "{l:?}");
    assert!(applied[1] >= 2 * applied[0], "{l:?}");
}

#[test]
fn async_slices_are_recut_when_the_job_shrinks_and_grows_and_every_sample_is_applied_once() {
    let ledger = TempDir::new("ledger");
    let c = ledger_cluster(&ledger);
    let data = synth(c.dir.path(), "tokens", 20_000);
    let steps = 600;
    c.submit(&async_toml("a2", 3, &data, steps, ""));
    c.wait_world("a2", 3, S(30));
    let early = c.wait_step("a2", 60, S(120));
    c.dctl_ok(&["scale", "a2", "2"]);
    c.wait_world("a2", 2, S(60));
    c.wait_step("a2", early.step + 100, S(120));
    c.dctl_ok(&["scale", "a2", "3"]);
    c.wait_world("a2", 3, S(60));
    let done = c.wait_done("a2", S(300));
    assert_eq!(done.step, steps);
    let last = c.status("a2");
    assert!(
        last.loss.unwrap() < early.loss.unwrap(),
        "{early:?} → {last:?}"
    );
    let l = ductile_tests::ledger::async_violations(ledger.path(), steps * 32, 624, 2);
    assert!(l.violations.is_empty(), "{:#?}", l.violations);
}

#[test]
fn async_a_killed_worker_s_slice_and_batch_are_taken_over_and_every_sample_is_applied_once() {
    let ledger = TempDir::new("ledger");
    let c = ledger_cluster(&ledger);
    let data = synth(c.dir.path(), "tokens", 20_000);
    let steps = 600;
    c.submit(&async_toml("a3", 3, &data, steps, ""));
    let v = c.wait_world("a3", 3, S(30));
    let early = c.wait_step("a3", 60, S(120));
    // not member 0 (which dispenses the positions): its slice and its batch in flight move
    let victim = v.members.iter().find(|m| m.rank == 2).unwrap().pid.unwrap();
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    c.wait_for(S(60), "a failure generation", || {
        c.history("a3")
            .into_iter()
            .find(|g| g.reason == ductile_cluster::records::Reason::Failure)
    });
    let done = c.wait_done("a3", S(300));
    assert_eq!(done.step, steps);
    let last = c.status("a3");
    assert!(
        last.loss.unwrap() < early.loss.unwrap(),
        "{early:?} → {last:?}"
    );
    let l = ductile_tests::ledger::async_violations(ledger.path(), steps * 32, 624, 2);
    assert!(l.violations.is_empty(), "{:#?}", l.violations);
}

/// Member 0 decides every update and dispenses the positions. Lost mid-decision (it recorded
/// one and sent it to one owner only, then exited), the other owner learns the decision in the
/// next agreement and applies it too; killed outright later, its dispenser is rebuilt from the
/// owners' copies. The ledger, written by the pushing workers and by every owner (not by the
/// dispenser), shows each update applied by every surviving owner or by none, and every sample
/// applied once.
#[test]
fn async_member_0_lost_mid_decision_and_killed_loses_and_repeats_no_sample() {
    let ledger = TempDir::new("ledger");
    let c = ledger_cluster(&ledger);
    let data = synth(c.dir.path(), "tokens", 20_000);
    let steps = 600;
    c.submit(&async_toml(
        "a4",
        3,
        &data,
        steps,
        "allow_fault_injection = true\nenv = { DUCTILE_FAULT_EXIT_MID_DECIDE = \"1600\" }",
    ));
    c.wait_world("a4", 3, S(30));
    let failure = |n: usize| {
        c.wait_for(S(90), &format!("failure generation {n}"), || {
            let f: Vec<_> = c
                .history("a4")
                .into_iter()
                .filter(|g| g.reason == ductile_cluster::records::Reason::Failure)
                .collect();
            (f.len() >= n).then_some(())
        })
    };
    failure(1);
    let v = c.wait_world("a4", 3, S(60));
    let early = c.wait_step("a4", 200, S(120));
    let m0 = v.members.iter().find(|m| m.rank == 0).unwrap().pid.unwrap();
    unsafe { libc::kill(m0 as i32, libc::SIGKILL) };
    failure(2);
    let done = c.wait_done("a4", S(300));
    assert_eq!(done.step, steps);
    let last = c.status("a4");
    assert!(
        last.loss.unwrap() < early.loss.unwrap(),
        "{early:?} → {last:?}"
    );
    let l = ductile_tests::ledger::async_violations(ledger.path(), steps * 32, 624, 2);
    assert!(l.violations.is_empty(), "{:#?}", l.violations);
    // the decision member 0 sent to one owner reached the other through the agreement
    assert!(l.recovered >= 1, "{l:?}");
}

/// Async checkpoints: every 50 steps the workers snap the owners' slices and save the whole
/// state with the data dispenser; a full loss (every worker killed at once) resumes from the
/// latest one, not from the seed, and every sample is still applied once.
#[test]
fn async_checkpoints_hold_the_slices_and_the_dispenser_and_a_full_loss_resumes_from_them() {
    let ledger = TempDir::new("ledger");
    let c = ledger_cluster(&ledger);
    let data = synth(c.dir.path(), "tokens", 20_000);
    let dir = c.dir.path().join("ckpt-a5");
    let steps = 600;
    c.submit(&format!(
        "{}[checkpoint]\nurl = \"file://{}\"\ninterval = 50\nkeep = 3\n",
        async_toml("a5", 3, &data, steps, ""),
        dir.display()
    ));
    let v = c.wait_world("a5", 3, S(30));
    c.wait_for(S(120), "a committed checkpoint past step 100", || {
        let v: serde_json::Value =
            serde_json::from_str(&c.dctl_ok(&["checkpoints", "a5", "--json"])).ok()?;
        v["checkpoints"]
            .as_array()?
            .iter()
            .find(|x| x["state"] == "committed" && x["step"].as_u64().is_some_and(|s| s >= 100))?;
        Some(())
    });
    let before = c.status("a5");
    for m in &v.members {
        unsafe { libc::kill(m.pid.unwrap() as i32, libc::SIGKILL) };
    }
    let done = c.wait_done("a5", S(300));
    assert_eq!(done.step, steps);
    let last = c.status("a5");
    assert!(
        last.loss.unwrap() < before.loss.unwrap(),
        "{before:?} → {last:?}"
    );
    let l = ductile_tests::ledger::async_violations(ledger.path(), steps * 32, 624, 2);
    assert!(l.violations.is_empty(), "{:#?}", l.violations);
    assert!(l.restores >= 1, "{l:?}");
    // the manifests carry the dispenser (nothing in flight at a snap) and the slices' version
    let manifests: Vec<serde_json::Value> = std::fs::read_dir(&dir)
        .unwrap()
        .flat_map(|step| std::fs::read_dir(step.unwrap().path()).unwrap())
        .filter_map(|g| std::fs::read(g.unwrap().path().join("manifest.json")).ok())
        .map(|b| serde_json::from_slice(&b).unwrap())
        .collect();
    assert!(!manifests.is_empty());
    for m in &manifests {
        let x = &m["extra"]["async"];
        assert!(x["version"].as_u64().is_some_and(|v| v > 0), "{x}");
        assert_eq!(x["dispenser"]["outstanding"], serde_json::json!({}), "{x}");
        let applied = x["dispenser"]["applied"].as_u64().unwrap();
        assert_eq!(applied / 32, m["step"].as_u64().unwrap(), "{x}");
    }
}

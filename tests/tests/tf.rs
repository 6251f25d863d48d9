//! Users' own TensorFlow scripts (issue 48): a Keras `model.fit` under
//! `MultiWorkerMirroredStrategy` with `BackupAndRestore` (`examples/tensorflow/keras_fit.py`,
//! written as TensorFlow's multi-worker guide writes one) runs as a `runtime = "tf"` job with
//! real TensorFlow on CPU: each generation's workers get `TF_CONFIG`, and the world restarts
//! through a SIGKILL of a worker, an agent's loss and `dctl scale`, resuming from its backup,
//! and ends `Succeeded` having trained every step. Real etcd, daemon, agents, launchers and
//! TensorFlow workers.

use std::time::Duration;

use ductile_cluster::records::{JobState, Reason};
use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

fn start_agent(c: &mut Cluster, name: &str, slots: u32) {
    let p = tf_agent_flags();
    let extra: Vec<&str> = p.iter().map(String::as_str).collect();
    c.start_agent(name, slots, &extra);
}

/// The first report of the current generation, once there is one: (status, seconds from the
/// change to it).
fn training_again(c: &Cluster, job: &str, after: u64) -> (ductile_cluster::api::JobView, f64) {
    c.wait_for(S(120), "the first report of the new world", || {
        let s = c.status(job);
        let r = s.last_reformation.clone()?;
        (s.generation > after && r.generation == s.generation)
            .then_some(r.first_step_seconds)
            .flatten()
            .map(|first| (s, first))
    })
}

/// The script at 3 workers on two nodes (2 + 1): a worker SIGKILLed (the world restarts at 3
/// from the chief's backup, not from step 0), node2's agent lost (2), `dctl scale 1` with
/// notice (a backup at an agreed step first: no step lost); every
/// generation's workers learn their world from `TF_CONFIG`; the job succeeds with every step
/// trained once in the optimizer's count, the chief's `final.json` written.
#[test]
fn training_tf_a_keras_multi_worker_fit_survives_a_kill_an_agent_loss_and_a_scale() {
    let mut c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default()
    });
    start_agent(&mut c, "node1", 2);
    start_agent(&mut c, "node2", 1);
    let dir = TempDir::new("tf-fit");
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let (epochs, per_epoch) = (8u64, 100u64);
    let steps = epochs * per_epoch;
    let command: Vec<String> = [
        tf_python_bin(),
        repo_root()
            .join("examples/tensorflow/keras_fit.py")
            .display()
            .to_string(),
        "--output_dir".into(),
        out.display().to_string(),
        "--epochs".into(),
        epochs.to_string(),
        "--steps_per_epoch".into(),
        per_epoch.to_string(),
        "--save_freq".into(),
        "20".into(),
        "--step_sleep".into(),
        "0.03".into(),
    ]
    .iter()
    .map(|a| format!("{a:?}"))
    .collect();
    c.submit(&format!(
        "name = \"fit\"\nruntime = \"tf\"\ncommand = [{}]\nmin = 1\nmax = 3\ndesired = 3\nrestart_budget = 5\nenv = {{ PYTHONUNBUFFERED = \"1\", TF_CPP_MIN_LOG_LEVEL = \"2\" }}\n[torchrun]\nintegrations = [\"keras\"]\ngrace_s = 3\n",
        command.join(", ")
    ));
    let v = c.wait_world("fit", 3, S(120));
    let v = c.wait_for(S(180), "the chief's reports at world 3", || {
        let s = c.status("fit");
        (s.generation == v.generation
            && s.step >= 60
            && s.members.iter().all(|m| m.program_pid.is_some()))
        .then_some(s)
    });
    assert!(v.loss.is_some_and(|l| l.is_finite()), "{v:?}");
    let logs = c.agent_logs();
    assert!(
        logs.contains("worker 0 of 3") && logs.contains("worker 2 of 3"),
        "every worker learnt its world from TF_CONFIG"
    );

    // 1. SIGKILL rank 1's program: the world restarts at 3 and resumes from the backup
    let victim = v.members.iter().find(|m| m.rank == 1).unwrap();
    unsafe { libc::kill(victim.program_pid.unwrap() as i32, libc::SIGKILL) };
    let (after_kill, secs) = training_again(&c, "fit", v.generation);
    println!("killed → first report of the restarted world: {secs:.2} s");
    let g = c
        .history("fit")
        .into_iter()
        .find(|g| g.number > v.generation)
        .unwrap();
    assert_eq!(g.reason, Reason::Failure, "{g:?}");
    assert!(
        g.detail
            .contains("rank 1's program failed first: killed by signal 9"),
        "{}",
        g.detail
    );
    assert_eq!(after_kill.world_size, 3);
    assert!(
        after_kill.step >= 20,
        "resumed at step {}: from the backup, not from 0",
        after_kill.step
    );

    // 2. node2's agent lost: its launcher and worker die with it; the world restarts at 2
    c.wait_step("fit", after_kill.step + 40, S(120));
    let before = c.status("fit").generation;
    c.agents.get_mut("node2").unwrap().kill();
    let v2 = c.wait_world("fit", 2, S(60));
    assert!(v2.members.iter().all(|m| m.node == "node1"), "{v2:?}");
    let (at2, secs) = training_again(&c, "fit", before);
    println!("agent lost → first report at world 2: {secs:.2} s");
    assert!(
        at2.step >= after_kill.step,
        "{} < {}",
        at2.step,
        after_kill.step
    );

    // 3. dctl scale 1, with notice: the keras integration's workers agree on a step, back up
    // there through BackupAndRestore and say so; the world re-forms then and resumes there
    c.wait_step("fit", at2.step + 40, S(120));
    let scale_at = c.status("fit");
    c.dctl_ok(&["scale", "fit", "1"]);
    c.wait_world("fit", 1, S(60));
    let g = c.history("fit").last().cloned().unwrap();
    assert_eq!(g.reason, Reason::Scale, "{g:?}");
    assert!(g.detail.contains("committed first"), "{}", g.detail);
    let (at1, secs) = training_again(&c, "fit", scale_at.generation);
    println!("dctl scale 1 → first report at world 1: {secs:.2} s");
    assert!(
        at1.step >= scale_at.step,
        "resumed at step {}, the scale came at step {}: no step lost",
        at1.step,
        scale_at.step
    );
    assert!(c
        .agent_logs()
        .contains("ductile: notice of a change of the world: backed up at step"));
    c.wait_for(S(30), "the worker's line at world 1", || {
        c.agent_logs().contains("worker 0 of 1").then_some(())
    });

    let done = c.wait_for(S(300), "the job's end", || {
        Some(c.status("fit")).filter(|v| v.state.is_terminal())
    });
    assert_eq!(done.state, JobState::Succeeded, "{}", done.message);
    assert_eq!(done.step, steps, "the chief's last report");
    let fin: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("final.json")).unwrap()).unwrap();
    assert_eq!(
        fin["steps"].as_u64(),
        Some(steps),
        "the optimizer's count: every step trained once after the backups: {fin}"
    );
    let loss = fin["loss"].as_f64().unwrap();
    assert!(loss.is_finite() && loss < 1.0, "it learnt: {fin}");
    let ev = c.dctl_ok(&["events", "fit"]);
    assert!(
        ev.contains("killed by signal 9") && ev.contains("node node2 was lost"),
        "{ev}"
    );
}

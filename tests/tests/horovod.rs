//! Users' own Horovod scripts (issue 48): a PyTorch script written as Horovod's examples write
//! one (`examples/horovod/hvd_train.py`: `hvd.init`, `DistributedOptimizer`, rank 0's
//! checkpoints) runs as a `runtime = "horovod"` job with real Horovod 0.28.1 (gloo, torch 2.0.1
//! in a venv of its own): each generation's workers get what `horovodrun`'s gloo launcher gives
//! them (its rendezvous server, hosted by rank 0's launcher, and `HOROVOD_*`), and the world
//! restarts through a SIGKILL and `dctl scale` up and down, resuming from the script's
//! checkpoint, ending `Succeeded` with every step run. Real etcd, daemon, agent, launchers and
//! Horovod workers.

use std::time::Duration;

use ductile_cluster::records::{JobState, Reason};
use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

/// Rank 0's step log: (time, pid, world, step) per completed step.
fn step_log(path: &std::path::Path) -> Vec<(f64, u32, u32, u64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(step_log_line)
        .collect()
}

#[test]
fn training_horovod_a_script_survives_a_kill_and_scales_up_and_down() {
    let mut c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default()
    });
    let flags = horovod_agent_flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    c.start_agent("node1", 3, &flags);
    let dir = TempDir::new("horovod");
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let log = dir.path().join("steps.log");
    let steps = 400u64;
    let command: Vec<String> = [
        horovod_python_bin(),
        repo_root()
            .join("examples/horovod/hvd_train.py")
            .display()
            .to_string(),
        "--ckpt-dir".into(),
        ckpt.display().to_string(),
        "--steps".into(),
        steps.to_string(),
        "--step-sleep".into(),
        "0.03".into(),
        "--step-log".into(),
        log.display().to_string(),
    ]
    .iter()
    .map(|a| format!("{a:?}"))
    .collect();
    c.submit(&format!(
        "name = \"hvd\"\nruntime = \"horovod\"\ncommand = [{}]\nmin = 1\nmax = 3\ndesired = 2\nrestart_budget = 5\nenv = {{ PYTHONUNBUFFERED = \"1\" }}\n[torchrun]\ngrace_s = 3\ndrain_notice_s = 5\n",
        command.join(", ")
    ));
    let v = c.wait_world("hvd", 2, S(120));
    let v = c.wait_for(S(120), "the script's reports at world 2", || {
        let s = c.status("hvd");
        (s.generation == v.generation
            && s.step >= 25
            && s.members.iter().all(|m| m.program_pid.is_some()))
        .then_some(s)
    });
    assert!(v.loss.is_some_and(|l| l.is_finite()), "{v:?}");
    assert!(step_log(&log).iter().all(|e| e.2 == 2));

    // 1. SIGKILL rank 1's program: the world restarts at 2 from the script's checkpoint
    let read_before_kill = step_log(&log).last().unwrap().3;
    let victim = v.members.iter().find(|m| m.rank == 1).unwrap();
    unsafe { libc::kill(victim.program_pid.unwrap() as i32, libc::SIGKILL) };
    let g = c.wait_for(S(60), "the generation after the kill", || {
        c.history("hvd")
            .into_iter()
            .find(|g| g.number > v.generation)
    });
    assert_eq!(g.reason, Reason::Failure, "{g:?}");
    assert!(
        g.detail
            .contains("rank 1's program failed first: killed by signal 9"),
        "{}",
        g.detail
    );
    let first_pid = step_log(&log)[0].1;
    let resumed = c.wait_for(S(120), "steps of the restarted world", || {
        step_log(&log).into_iter().find(|e| e.1 != first_pid)
    });
    // the first world's last step, read after the kill: rank 0 may finish (and checkpoint) a
    // step between the read above and the signal
    let last_before = step_log(&log)
        .iter()
        .filter(|e| e.1 == first_pid)
        .map(|e| e.3)
        .max()
        .unwrap();
    assert!(last_before >= read_before_kill);
    assert!(
        resumed.3 > 1 && resumed.3 + 10 >= last_before && resumed.3 <= last_before + 1,
        "first step after the kill: {resumed:?}, last before it {last_before}"
    );
    c.wait_for(S(30), "the script's resume line", || {
        c.agent_logs()
            .contains(&format!(
                "resumed from step {} at world size 2",
                resumed.3 - 1
            ))
            .then_some(())
    });

    // 2. dctl scale 3, then 1: each a new world of that size, from the notice's save
    for world in [3u32, 1] {
        let from = step_log(&log).len();
        c.dctl_ok(&["scale", "hvd", &world.to_string()]);
        c.wait_world("hvd", world, S(60));
        let g = c.history("hvd").last().cloned().unwrap();
        assert_eq!(g.reason, Reason::Scale, "{g:?}");
        assert!(g.detail.contains("committed first"), "{}", g.detail);
        let (prev, first) = c.wait_for(S(120), "steps at the new size", || {
            let l = step_log(&log);
            let i = (from.max(1)..l.len()).find(|i| l[*i].2 == world)?;
            Some((l[i - 1], l[i]))
        });
        assert!(
            first.3 >= prev.3,
            "resumed at step {} after step {} ran: the notice's save",
            first.3,
            prev.3
        );
    }

    let done = c.wait_for(S(300), "the job's end", || {
        Some(c.status("hvd")).filter(|v| v.state.is_terminal())
    });
    assert_eq!(done.state, JobState::Succeeded, "{}", done.message);
    let l = step_log(&log);
    assert_eq!(l.last().unwrap().3, steps, "every step ran");
    assert_eq!(l.last().unwrap().2, 1, "the last steps at world 1");
    assert!(c
        .agent_logs()
        .contains(&format!("done: step {steps}, world 1")));
    assert!(c
        .agent_logs()
        .contains("Horovod's rendezvous server for the generation listening on"));
}

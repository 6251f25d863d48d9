//! Users' own PyTorch scripts (issue 33): a DDP script written as PyTorch's tutorials write
//! them (`examples/torchrun/ddp_train.py`) runs as a `runtime = "torchrun"` job with real
//! PyTorch on CPU (gloo): through a SIGKILL of a worker, an agent's loss and `dctl scale`, from
//! its own checkpoints; the error file's message of a worker that raises is the reason shown;
//! and at a fixed size it ends with the same weights as under `torchrun` itself. Real etcd,
//! daemon, agents, launchers and Python workers.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ductile_cluster::records::{JobState, Reason};
use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

fn script() -> PathBuf {
    repo_root().join("examples/torchrun/ddp_train.py")
}

fn start_agent(c: &mut Cluster, name: &str, slots: u32) {
    let p = torchrun_agent_flags();
    let extra: Vec<&str> = p.iter().map(String::as_str).collect();
    c.start_agent(name, slots, &extra);
}

/// A torchrun job running the DDP script with `args`.
fn job_toml(
    name: &str,
    (min, max, desired): (u32, u32, u32),
    extra: &str,
    args: &[String],
) -> String {
    let mut command = vec![torch_python_bin(), script().display().to_string()];
    command.extend(args.iter().cloned());
    let command: Vec<String> = command.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "name = \"{name}\"\nruntime = \"torchrun\"\ncommand = [{}]\nmin = {min}\nmax = {max}\ndesired = {desired}\n{extra}\n",
        command.join(", ")
    )
}

/// Rank 0's step log: (time, pid, world, step) per completed step.
fn step_log(path: &Path) -> Vec<(f64, u32, u32, u64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(step_log_line)
        .collect()
}

fn events(c: &Cluster, job: &str) -> String {
    c.dctl_ok(&["events", job])
}

/// The DDP script at 4 workers on two nodes: a worker SIGKILLed (its slot has no restart left:
/// the world re-forms at 3 and the script resumes from its own checkpoint), an agent lost (2),
/// scaled to 2 while a new node joins, then `dctl scale` back to 4; a planned drain tells the
/// script first (it saves, so at most one step repeats); it finishes every step and the job
/// succeeds. Progress comes from `ductile.report`.
#[test]
fn training_torchrun_a_ddp_script_survives_a_kill_an_agent_loss_and_a_scale() {
    let mut c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default()
    });
    start_agent(&mut c, "node1", 2);
    start_agent(&mut c, "node2", 2);
    let dir = TempDir::new("torchrun-ddp");
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let log = dir.path().join("steps.log");
    let sha = dir.path().join("sha");
    let steps = 1500u64;
    let args: Vec<String> = [
        "--steps",
        &steps.to_string(),
        "--ckpt-every",
        "10",
        "--step-sleep",
        "0.03",
        "--step-log",
        &log.display().to_string(),
        "--sha-out",
        &sha.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    c.submit(&job_toml(
        "ddp",
        (1, 4, 4),
        &format!(
            "restart_budget = 0\n[torchrun]\ngrace_s = 5\ndrain_notice_s = 3\ncheckpoint_url = \"file://{}\"",
            ckpt.display()
        ),
        &args,
    ));
    let v = c.wait_world("ddp", 4, S(120));
    let v = c.wait_for(S(120), "the script's first reports", || {
        let s = c.status("ddp");
        (s.step >= 25
            && s.members.iter().all(|m| m.program_pid.is_some())
            && s.generation == v.generation)
            .then_some(s)
    });
    assert!(v.loss.is_some_and(|l| l.is_finite()), "{v:?}");
    assert!(
        v.samples_per_sec.is_some(),
        "the report's samples give a rate: {v:?}"
    );

    // 1. SIGKILL the script of rank 3: no restart left for its slot, the world re-forms at 3
    let victim = v.members.iter().find(|m| m.rank == 3).unwrap().clone();
    let read_before_kill = step_log(&log).last().unwrap().3;
    // the script, not its launcher (`pid`): what torchrun calls the worker
    let (script, launcher) = (victim.program_pid.unwrap(), victim.pid.unwrap());
    assert_ne!(script, launcher);
    unsafe { libc::kill(script as i32, libc::SIGKILL) };
    let g = c.wait_for(S(60), "the generation after the kill", || {
        c.history("ddp")
            .into_iter()
            .find(|g| g.number > v.generation)
    });
    assert_eq!(g.reason, Reason::Failure, "{g:?}");
    assert!(
        g.detail
            .contains("rank 3's program failed first: killed by signal 9"),
        "{}",
        g.detail
    );
    assert_eq!(g.failures, 1);
    let v3 = c.wait_world("ddp", 3, S(60));
    let at3 = c.wait_for(S(120), "steps at world 3", || {
        let l = step_log(&log);
        l.iter().find(|e| e.2 == 3).copied()
    });
    // the last step world 4 finished: read after the kill, as rank 0 may finish (and checkpoint)
    // a step between the read above and the signal
    let last_before = step_log(&log)
        .iter()
        .filter(|e| e.2 == 4)
        .map(|e| e.3)
        .max()
        .unwrap();
    assert!(
        last_before >= read_before_kill,
        "{last_before} < {read_before_kill}"
    );
    // resumed from its own checkpoint: at most 10 steps back, never from the start
    assert!(
        at3.3 + 10 >= last_before && at3.3 > 1 && at3.3 <= last_before + 1,
        "first step at world 3: {at3:?}, last before the kill {last_before}"
    );
    assert!(
        c.agent_logs()
            .contains(&format!("resumed from step {} at world size 3", at3.3 - 1)),
        "the script said it resumed from its checkpoint"
    );

    // 2. an agent lost: its launchers and scripts die with it; the lease lapses, 2 remain
    c.wait_step("ddp", at3.3 + 10, S(60));
    c.agents.get_mut("node2").unwrap().kill();
    let v2 = c.wait_world("ddp", 2, S(60));
    assert!(v2.generation > v3.generation);
    assert!(v2.members.iter().all(|m| m.node == "node1"), "{v2:?}");
    c.wait_for(S(120), "steps at world 2", || {
        step_log(&log).iter().any(|e| e.2 == 2).then_some(())
    });

    // 3. held at 2 while a node joins, then scaled back to 4
    c.dctl_ok(&["scale", "ddp", "2"]);
    start_agent(&mut c, "node3", 2);
    c.wait_for(S(30), "node3 registered", || {
        c.dctl_ok(&["nodes"]).contains("node3").then_some(())
    });
    std::thread::sleep(S(2));
    assert_eq!(
        c.status("ddp").world_size,
        2,
        "desired 2: the new node waits"
    );
    let scaled_at = step_log(&log).len();
    c.dctl_ok(&["scale", "ddp", "4"]);
    let v4 = c.wait_world("ddp", 4, S(60));
    assert_eq!(c.history("ddp").last().unwrap().reason, Reason::Scale);
    assert_eq!(v4.members.iter().filter(|m| m.node == "node3").count(), 2);
    c.wait_for(S(120), "steps at world 4 again", || {
        step_log(&log)[scaled_at..]
            .iter()
            .any(|e| e.2 == 4)
            .then_some(())
    });

    // 4. a planned drain of node3: the scripts are told (ductile.preempted(): rank 0 saves,
    // then says so with ductile.saved) and the world re-forms at 2 as soon as it saved, not
    // drain_notice_s later: at most one step repeats
    let drained_at = step_log(&log).len();
    c.dctl_ok(&["drain", "node3"]);
    let v2 = c.wait_world("ddp", 2, S(60));
    let g = c.history("ddp").last().cloned().unwrap();
    assert_eq!(g.reason, Reason::Drain, "{g:?}");
    assert!(g.detail.contains("committed first"), "{}", g.detail);
    let (prev, first) = c.wait_for(S(120), "steps after the drain", || {
        let l = step_log(&log);
        let i = (drained_at..l.len()).find(|i| l[*i].2 == 2)?;
        Some((l[i - 1], l[i]))
    });
    assert_eq!(prev.2, 4);
    assert!(
        first.3 >= prev.3,
        "resumed at step {} after step {} ran: the notice's save",
        first.3,
        prev.3
    );
    assert!(c
        .agent_logs()
        .contains("a planned change of the world is coming"));
    assert!(v2.members.iter().all(|m| m.node == "node1"));
    c.dctl_ok(&["drain", "node3", "--undo"]);
    c.wait_world("ddp", 4, S(60));

    let done = c.wait_done("ddp", S(300));
    assert_eq!(done.state, JobState::Succeeded, "{}", done.message);
    assert!(
        done.message.contains("all workers finished"),
        "{}",
        done.message
    );
    let l = step_log(&log);
    assert_eq!(l.last().unwrap().3, steps, "every step ran");
    assert_eq!(l.last().unwrap().2, 4, "the last steps at world 4");
    assert_eq!(std::fs::read_to_string(&sha).unwrap().trim().len(), 64);
    let ev = events(&c, "ddp");
    assert!(
        ev.contains("killed by signal 9") && ev.contains("node node2 was lost"),
        "{ev}"
    );
    // the script's output, kept on its node per job and slot (issue 48): rank 0's file has the
    // last generation's mark, then the script's last line
    let last = c.history("ddp").last().unwrap().clone();
    let m = last.members.iter().find(|m| m.rank == 0).unwrap();
    let file = c
        .dir
        .path()
        .join(format!("logs-{}", m.node))
        .join("ddp")
        .join(format!("slot-{}.log", m.slot));
    let text = std::fs::read_to_string(&file).unwrap();
    let mark = format!("=== generation {} rank 0 ", last.number);
    let after = text
        .rfind(&mark)
        .map(|i| &text[i..])
        .unwrap_or_else(|| panic!("no {mark:?} in {}:\n{text}", file.display()));
    assert!(
        after.contains(&format!(" stdout done: step {steps}, world 4")),
        "{}:\n{after}",
        file.display()
    );
    assert!(text.starts_with("=== generation "), "{text}");
    // and through the daemon: dctl logs (rank 0 in the latest generation by default), one
    // generation's lines, the last N, a follow of an ended job returns; the admin token only
    let all = c.dctl_ok(&["logs", "ddp"]);
    assert!(
        all.contains(&mark) && all.contains(&format!(" stdout done: step {steps}, world 4")),
        "{all}"
    );
    let first = c.history("ddp")[0].number;
    let one = c.dctl_ok(&[
        "logs",
        "ddp",
        "--rank",
        "1",
        "--generation",
        &first.to_string(),
    ]);
    let lines: Vec<&str> = one.lines().collect();
    assert!(
        lines[0].starts_with(&format!("=== generation {first} rank 1 "))
            && lines[1..].iter().all(|l| !l.starts_with("=== generation ")),
        "{one}"
    );
    let tail = c.dctl_ok(&["logs", "ddp", "--tail", "2", "--follow"]);
    assert_eq!(tail.lines().count(), 2, "{tail}");
    assert!(tail.contains("done: step"), "{tail}");
    let (ok, _, err) = c.dctl_as(READ_TOKEN, &["logs", "ddp"]);
    assert!(!ok && err.contains("admin token"), "{err}");
    let (ok, _, err) = c.dctl(&["logs", "ddp", "--rank", "9"]);
    assert!(!ok && err.contains("has no rank 9"), "{err}");
}

/// At a fixed size the script ends with the same weights under ductile (run in the standby
/// interpreter) as under `torchrun` itself (same arguments, no failure), and saw every variable
/// torchrun gives and no credential of the node's; a worker that raises (started afresh:
/// `warm_start = false`): its error file's message is the failure shown by `dctl status` and
/// `dctl events`, the world restarts within the budget, `TORCHELASTIC_RESTART_COUNT` says 1,
/// and the job succeeds. A job naming a script outside
/// the agents' allowed paths, or inline Python, is refused at submit.
#[test]
fn training_torchrun_same_weights_as_torchrun_and_the_error_file_shown() {
    let mut c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        // the node's settings a script must not see
        agent_env: vec![
            ("AWS_SECRET_ACCESS_KEY".into(), "node-secret".into()),
            ("NODE_OPERATOR_SETTING".into(), "x".into()),
        ],
        ..Spec::default()
    });
    start_agent(&mut c, "node1", 2);
    c.wait_for(S(30), "node1 registered", || {
        c.dctl_ok(&["nodes"]).contains("node1").then_some(())
    });
    // refused at submit: a script outside the allowed paths, inline Python
    let outside = job_toml("outside", (1, 1, 1), "", &[])
        .replace(&script().display().to_string(), "/opt/elsewhere/train.py");
    let inline = format!(
        "name = \"inline\"\nruntime = \"torchrun\"\ncommand = [{:?}, \"-c\", \"print(1)\"]\nmin = 1\nmax = 1\ndesired = 1\n",
        torch_python_bin()
    );
    let relative = format!(
        "name = \"relative\"\nruntime = \"torchrun\"\ncommand = [{:?}, \"train.py\"]\nmin = 1\nmax = 1\ndesired = 1\n",
        torch_python_bin()
    );
    assert_refused(
        &c,
        &[
            (outside.as_str(), "outside the agent's allowed_paths"),
            (inline.as_str(), "inline Python (-c)"),
            (relative.as_str(), "set program.workdir"),
        ],
    );
    let dir = TempDir::new("torchrun-same");
    let common = |sha: &Path| -> Vec<String> {
        [
            "--steps",
            "60",
            "--sha-out",
            &sha.display().to_string(),
            "--env-out",
            &sha.with_extension("env").display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    // under torchrun itself
    let ref_sha = dir.path().join("torchrun.sha");
    let out = std::process::Command::new(torch_python_bin())
        .args([
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--rdzv-backend=c10d",
            // by address: a machine without /etc/hosts has no "localhost" (--standalone's)
            &format!("--rdzv-endpoint=127.0.0.1:{}", free_port()),
            "--local-addr=127.0.0.1",
            "--nproc-per-node=2",
        ])
        .arg(script())
        .args(common(&ref_sha))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "torchrun: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // and under ductile
    let our_sha = dir.path().join("ductile.sha");
    c.submit(&job_toml("same", (2, 2, 2), "", &common(&our_sha)));
    let v = c.wait_done("same", S(180));
    assert_eq!(v.state, JobState::Succeeded, "{}", v.message);
    let (a, b) = (
        std::fs::read_to_string(&ref_sha).unwrap(),
        std::fs::read_to_string(&our_sha).unwrap(),
    );
    assert_eq!(a.trim().len(), 64);
    assert_eq!(a, b, "the same weights under torchrun and ductile");
    assert!(
        c.agent_logs().contains("as rank 1 of 2"),
        "the launcher's start line"
    );
    // torchrun's worker contract: every name torchrun gave its workers, none of the launcher's
    // etcd credentials or the agent's other settings
    let names = |p: PathBuf| -> Vec<String> {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let (theirs, ours) = (
        names(ref_sha.with_extension("env")),
        names(our_sha.with_extension("env")),
    );
    // what torchrun added to the environment it was started with (this test's)
    let given: Vec<String> = std::env::vars().map(|(k, _)| k).collect();
    let added: Vec<&String> = theirs.iter().filter(|k| !given.contains(k)).collect();
    assert!(added.len() >= 18, "torchrun's own variables: {added:?}");
    for k in added {
        assert!(ours.contains(k), "torchrun sets {k}; ours: {ours:?}");
    }
    assert!(
        ours.iter().all(|k| !k.starts_with("DUCTILE_ETCD")
            && !k.starts_with("AWS_")
            && k != "NODE_OPERATOR_SETTING"),
        "no etcd credentials, no S3 credentials without an S3 checkpoint_url: {ours:?}"
    );
    for k in [
        "DUCTILE_CONTROL",
        "DUCTILE_PREEMPT_FILE",
        "TORCHELASTIC_ERROR_FILE",
        "RANK",
    ] {
        assert!(ours.contains(&k.to_string()), "{k}: {ours:?}");
    }

    // a worker raises at step 15 (restart count 0 only): @record writes the error file
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let mut args = common(&dir.path().join("raise.sha"));
    args.extend(
        [
            "--fail-rank",
            "1",
            "--fail-at-step",
            "15",
            "--ckpt-dir",
            &ckpt.display().to_string(),
            "--step-sleep",
            "0.1",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    // (started afresh each generation, not in a standby interpreter: the cold path)
    c.submit(&job_toml(
        "raise",
        (1, 2, 2),
        "restart_budget = 1\n[torchrun]\nwarm_start = false",
        &args,
    ));
    let first = c.wait_world("raise", 2, S(120)).generation;
    let g = c.wait_for(S(120), "the generation after the error", || {
        c.history("raise").into_iter().find(|g| g.number > first)
    });
    let msg = "ValueError: injected failure on rank 1 at step 15";
    assert_eq!(g.reason, Reason::Failure);
    assert!(
        g.detail.contains(msg) && g.detail.contains("rank 1's program failed first"),
        "{}",
        g.detail
    );
    let status = c.wait_for(S(30), "dctl status showing the error", || {
        let out = c.dctl_ok(&["status", "raise"]);
        out.contains(msg).then_some(out)
    });
    let ev = events(&c, "raise");
    assert!(ev.contains(msg), "dctl events: {ev}");
    // the slot is restarted (budget 1) and rejoins: the restart count is 1, no raise again
    let done = c.wait_done("raise", S(240));
    assert_eq!(
        done.state,
        JobState::Succeeded,
        "{} / {status}",
        done.message
    );
    let h = c.history("raise");
    assert!(h.last().unwrap().failures >= 1, "{h:?}");
    assert!(
        h.iter().filter(|g| g.reason == Reason::Failure).count() == 1,
        "one failure: {h:?}"
    );
}

/// A script that fails the same way at once (a typo in an argument) is a crash loop: after the
/// second identical failure the job fails with its error, not after its whole restart budget;
/// and the names Python and Hugging Face users set (`PYTHONUNBUFFERED`, `HF_HUB_OFFLINE`,
/// `TOKENIZERS_PARALLELISM`) are allowed on a restricted agent and reach the program.
#[test]
fn training_torchrun_a_crash_loop_fails_fast_with_its_error_and_python_s_env_names_reach_the_program(
) {
    let mut c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default()
    });
    start_agent(&mut c, "node1", 2);
    let dir = TempDir::new("crash-loop");
    let script = dir.path().join("typo.py");
    std::fs::write(
        &script,
        "import os, sys\nopen('relative-output.txt', 'w').write(os.getcwd())\nprint('env', os.environ.get('PYTHONUNBUFFERED'), os.environ.get('HF_HUB_OFFLINE'), os.environ.get('TOKENIZERS_PARALLELISM'), file=sys.stderr, flush=True)\nraise ValueError(f\"--learning_rate: 'abc' is not a number (pid {os.getpid()})\")\n",
    )
    .unwrap();
    let spec = format!(
        "name = \"typo\"\nruntime = \"torchrun\"\ncommand = [{:?}, {:?}]\nmin = 1\nmax = 2\ndesired = 2\nrestart_budget = 20\nenv = {{ PYTHONUNBUFFERED = \"1\", HF_HUB_OFFLINE = \"1\", TOKENIZERS_PARALLELISM = \"false\" }}\n",
        torch_python_bin(),
        script.display().to_string()
    );
    c.submit(&spec);
    let t0 = std::time::Instant::now();
    let v = c.wait_for(S(120), "the job to fail", || {
        Some(c.status("typo")).filter(|v| v.state.is_terminal())
    });
    let took = t0.elapsed();
    assert_eq!(v.state, JobState::Failed, "{}", v.message);
    assert!(
        v.message.contains("crash loop")
            && v.message
                .contains("ValueError: --learning_rate: 'abc' is not a number"),
        "{}",
        v.message
    );
    let h = c.history("typo");
    let failures = h.iter().filter(|g| g.reason == Reason::Failure).count();
    assert_eq!(failures, 1, "one restart, not the budget of 20: {h:#?}");
    println!(
        "crash loop failed after {took:?} and {} generations",
        h.len()
    );
    assert!(
        c.logs().contains("env 1 1 false"),
        "the program saw its env names"
    );
    // a relative output lands in the job's own working directory (the agent's work_root/JOB)
    let wrote = c.dir.path().join("work-node1/typo/relative-output.txt");
    assert!(wrote.exists(), "{} is missing", wrote.display());
    // `dctl events typo | head -0`: a closed pipe ends dctl quietly, without a panic
    let mut child = std::process::Command::new(bin("dctl"))
        .args(["--endpoint", &c.endpoint(), "events", "typo"])
        .env("DCTL_TOKEN", TOKEN)
        .env("HOME", c.dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "dctl on a closed pipe: {err}");
}

/// A world whose rank 0 leaves first while rank 1 is still connected (what a Trainer's last
/// save can make happen) ends with every rank exiting 0: a program ductile starts closes its
/// gloo process group at its exit where the script left it open (the launcher's exit hook),
/// so gloo's threads are not torn down by the interpreter's last destructors, which aborted
/// rank 0 ("terminate called without an active exception", SIGABRT) in 4 of 12 such exits
/// without ductile (torch 2.11). The script records the close (it wraps
/// `destroy_process_group`); four jobs at once, none may restart.
#[test]
fn training_torchrun_rank_0_leaving_first_ends_every_rank_cleanly_its_process_group_closed() {
    let mut c = Cluster::start(Spec::default());
    start_agent(&mut c, "node1", 8);
    let dir = TempDir::new("pg-exit");
    let script = dir.path().join("leave_first.py");
    std::fs::write(
        &script,
        "import os, sys, time, torch, torch.distributed as dist\n\
         dist.init_process_group('gloo')\n\
         rank = dist.get_rank()\n\
         t = torch.ones(1000)\n\
         for _ in range(5):\n    dist.all_reduce(t)\n\
         print(f\"rank {rank} sum {t[0].item():.0f}\", flush=True)\n\
         _close = dist.destroy_process_group\n\
         def traced(*a, **k):\n    print(f\"rank {rank} process group closed at exit\", flush=True)\n    return _close(*a, **k)\n\
         dist.destroy_process_group = traced\n\
         if rank == 0:\n    sys.exit(0)\n\
         time.sleep(1.5)\n",
    )
    .unwrap();
    let names = ["leave-a", "leave-b", "leave-c", "leave-d"];
    for name in names {
        c.submit(&format!(
            "name = \"{name}\"\nruntime = \"torchrun\"\ncommand = [{:?}, {:?}]\nmin = 2\nmax = 2\ndesired = 2\nrestart_budget = 0\n",
            torch_python_bin(),
            script.display().to_string()
        ));
    }
    for name in names {
        let v = c.wait_for(S(180), "the job to end", || {
            Some(c.status(name)).filter(|v| v.state.is_terminal())
        });
        assert_eq!(
            v.state,
            JobState::Succeeded,
            "{name}: {}\n{}",
            v.message,
            events(&c, name)
        );
        let h = c.history(name);
        assert!(
            h.iter().all(|g| g.reason != Reason::Failure),
            "{name} restarted: {h:#?}"
        );
    }
    let logs = c.logs();
    assert!(
        !logs.contains("terminate called"),
        "a program aborted at its exit"
    );
    for rank in 0..2 {
        for want in [
            format!("rank {rank} sum 32"),
            format!("rank {rank} process group closed at exit"),
        ] {
            assert_eq!(
                logs.matches(&want).count(),
                names.len(),
                "{want:?} in each job"
            );
        }
    }
}

/// Hugging Face's `Trainer`, unmodified (`examples/transformers/trainer_lm.py`: nothing in it
/// knows ductile), as a job with `[torchrun] integrations = ["transformers"]`: its steps and
/// losses show in `dctl status`; a SIGKILL restarts the world, which resumes from the newest
/// complete checkpoint of its `output_dir` (not from step 0); `dctl scale 1` and `2` likewise;
/// it ends `Succeeded` at `max_steps` with weights close to an uninterrupted run's (the same
/// samples in every step at any world size; only the reduction order differs).
#[test]
fn training_torchrun_an_unmodified_hf_trainer_script_reports_resumes_and_ends_like_an_uninterrupted_run(
) {
    let mut c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default()
    });
    start_agent(&mut c, "node1", 2);
    let dir = TempDir::new("hf-trainer");
    let script = repo_root().join("examples/transformers/trainer_lm.py");
    let steps = 600u64;
    let job = |name: &str, desired: u32, warm: bool| {
        let out = dir.path().join(name);
        format!(
            "name = \"{name}\"\nruntime = \"torchrun\"\ncommand = [{:?}, {:?}, \"--output_dir\", {:?}, \"--max_steps\", \"{steps}\", \"--save_steps\", \"50\"]\nmin = 1\nmax = 2\ndesired = {desired}\nrestart_budget = 5\nenv = {{ HF_HUB_OFFLINE = \"1\", TOKENIZERS_PARALLELISM = \"false\", PYTHONUNBUFFERED = \"1\" }}\n[torchrun]\nintegrations = [\"transformers\"]\nwarm_start = {warm}\n",
            torch_python_bin(),
            script.display().to_string(),
            out.display().to_string()
        )
    };
    // the uninterrupted run (started afresh: the integrations' boot before the script)
    c.submit(&job("ref", 2, false));
    let done = c.wait_for(S(300), "the uninterrupted run's end", || {
        Some(c.status("ref")).filter(|v| v.state.is_terminal())
    });
    assert_eq!(done.state, JobState::Succeeded, "{}", done.message);
    assert_eq!(done.step, steps, "the integration reported the last step");

    c.submit(&job("hf", 2, true));
    let v = c.wait_for(S(120), "the Trainer's reports", || {
        let s = c.status("hf");
        (s.world_size == 2 && s.step >= 120 && s.members.iter().all(|m| m.program_pid.is_some()))
            .then_some(s)
    });
    assert!(
        v.progress_at_ms.is_some() && v.loss.is_some_and(|l| l.is_finite()),
        "{v:?}"
    );
    // a SIGKILL: the world restarts and resumes from its newest complete checkpoint
    let victim = v.members.iter().find(|m| m.rank == 1).unwrap();
    unsafe { libc::kill(victim.program_pid.unwrap() as i32, libc::SIGKILL) };
    // (the first report of the new generation: the re-formation's "training again" figure)
    let resumed = c.wait_for(S(120), "reports after the restart", || {
        let s = c.status("hf");
        let r = s.last_reformation.clone()?;
        (s.generation > v.generation && r.generation == s.generation)
            .then_some(r.first_step_seconds)
            .flatten()
            .map(|first| (s, first))
    });
    println!(
        "killed → first report of the restarted world: {:.2} s",
        resumed.1
    );
    let resumed = resumed.0;
    assert!(
        resumed.step >= 100,
        "resumed at step {}: from a checkpoint, not from 0",
        resumed.step
    );
    assert!(
        c.logs().contains("ductile: resuming from"),
        "the integration resumed"
    );
    // resized to 1 and back to 2 with notice: the Trainer saves at its next step and says so
    // (the integration's ductile.saved), the world re-forms then and resumes there: no step lost
    for world in [1u32, 2] {
        let at = c.status("hf").step;
        c.dctl_ok(&["scale", "hf", &world.to_string()]);
        c.wait_world("hf", world, S(60));
        let g = c.history("hf").last().cloned().unwrap();
        assert_eq!(g.reason, Reason::Scale, "{g:?}");
        assert!(g.detail.contains("committed first"), "{}", g.detail);
        let first = c.wait_for(S(120), "the first report at the new size", || {
            let s = c.status("hf");
            let reported = s
                .last_reformation
                .as_ref()
                .is_some_and(|r| r.generation == s.generation && r.first_step_seconds.is_some());
            (s.world_size == world && reported).then_some(s.step)
        });
        assert!(
            first >= at,
            "resumed at step {first}, the scale came at step {at}"
        );
    }
    let done = c.wait_for(S(300), "the elastic run's end", || {
        Some(c.status("hf")).filter(|v| v.state.is_terminal())
    });
    assert_eq!(done.state, JobState::Succeeded, "{}", done.message);
    assert_eq!(done.step, steps);
    let diff = torch_python(
        "import sys, torch\na = torch.load(sys.argv[1]); b = torch.load(sys.argv[2])\nprint(max((a[k] - b[k]).abs().max().item() for k in a), max(a[k].abs().max().item() for k in a))",
        &[
            dir.path().join("ref/final.pt"),
            dir.path().join("hf/final.pt"),
        ],
    );
    let nums: Vec<f64> = diff
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    println!(
        "largest weight difference from the uninterrupted run: {} (largest weight {})",
        nums[0], nums[1]
    );
    assert!(nums[0] < 1e-4 * nums[1].max(1.0), "weights differ: {diff}");

    // a world restarted after its last save (a rank that fails on its way out) finds a
    // checkpoint at max_steps: it ends there with that checkpoint's weights, not a step past it
    // (Trainer resumed there would take one: 600 steps is not a whole number of epochs)
    let status = std::process::Command::new("cp")
        .arg("-r")
        .arg(dir.path().join("hf"))
        .arg(dir.path().join("again"))
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::remove_file(dir.path().join("again/final.pt")).unwrap();
    c.submit(&job("again", 1, true));
    let again = c.wait_for(S(120), "the restarted finished run's end", || {
        Some(c.status("again")).filter(|v| v.state.is_terminal())
    });
    assert_eq!(again.state, JobState::Succeeded, "{}", again.message);
    assert_eq!(again.step, steps, "no step past max_steps");
    assert!(
        c.logs().contains("is the run's last step"),
        "the integration said why it trained nothing"
    );
    let same = torch_python(
        "import sys, torch\na = torch.load(sys.argv[1]); b = torch.load(sys.argv[2])\nprint(max((a[k] - b[k]).abs().max().item() for k in a))",
        &[
            dir.path().join("hf/final.pt"),
            dir.path().join("again/final.pt"),
        ],
    );
    assert_eq!(
        same.trim().parse::<f64>().ok(),
        Some(0.0),
        "the last checkpoint's weights are the run's: {same}"
    );
}

/// No install step (issue 68): a plain interpreter with nothing of ductile installed
/// (Debian's `/usr/bin/python3`) imports `ductile` under a launcher, which puts the module it
/// was built with on the program's path, and its reports reach `dctl status`. A job naming
/// `integrations = ["transformers"]` whose interpreter lacks Transformers is refused at start
/// on each slot, once, naming the missing packages in `dctl status`: not restarted.
#[test]
fn training_torchrun_ductile_s_module_needs_no_install_and_a_missing_integration_package_is_named_once(
) {
    let bare = "/usr/bin/python3";
    let have = std::process::Command::new(bare)
        .args(["-c", "import importlib.util as u; print(u.find_spec('ductile') is None and u.find_spec('transformers') is None)"])
        .output()
        .expect("Debian's python3 (scripts/setup.sh installs it)");
    assert_eq!(
        String::from_utf8_lossy(&have.stdout).trim(),
        "True",
        "{bare} must have neither ductile nor transformers installed for this test"
    );
    let mut c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default()
    });
    let flags = torchrun_agent_flags_with(&[bare]);
    let extra: Vec<&str> = flags.iter().map(String::as_str).collect();
    c.start_agent("node1", 2, &extra);
    let dir = TempDir::new("no-install");
    let script = dir.path().join("report.py");
    std::fs::write(
        &script,
        "import ductile, time\nprint('ductile from', ductile.__file__, flush=True)\nfor s in range(1, 8):\n    ductile.report(step=s, loss=1.0 / s, samples=4)\n    time.sleep(0.2)\ntime.sleep(1)\n",
    )
    .unwrap();
    let job = |name: &str, desired: u32, extra: &str| {
        format!(
            "name = \"{name}\"\nruntime = \"torchrun\"\ncommand = [{bare:?}, {:?}]\nmin = 1\nmax = 2\ndesired = {desired}\nrestart_budget = 20\n{extra}",
            script.display().to_string()
        )
    };
    c.submit(&job("bare", 1, ""));
    let v = c.wait_for(S(60), "the job to end", || {
        Some(c.status("bare")).filter(|v| v.state.is_terminal())
    });
    assert_eq!(v.state, JobState::Succeeded, "{}", v.message);
    // (reports are datagrams, lost rather than ever blocking the script: some may be)
    assert!(
        (1..=7).contains(&v.step) && v.loss.is_some(),
        "the script's reports reached dctl status: step {} loss {:?}",
        v.step,
        v.loss
    );
    let logs = c.logs();
    let from = logs
        .lines()
        .find_map(|l| l.split("ductile from ").nth(1))
        .expect("the script printed where ductile came from");
    assert!(
        from.contains("ductile-launch-") && from.contains("/python/ductile/__init__.py"),
        "the launcher's own copy: {from}"
    );

    c.submit(&job(
        "lacks",
        2,
        "[torchrun]\nintegrations = [\"transformers\"]\n",
    ));
    let want = format!(
        "need the Python package(s) transformers, accelerate, torch, which {bare} cannot import"
    );
    // (the worker's message shows while the leader may not yet have ended the job: wait for
    // both, bounded)
    let v = c.wait_for(S(60), "the job to say what its interpreter lacks", || {
        Some(c.status("lacks"))
            .filter(|v| v.message.contains(&want) && v.state != JobState::Running)
    });
    assert_ne!(v.state, JobState::Running, "{}", v.message);
    // no restart comes: each slot's launcher said it once
    std::thread::sleep(S(3));
    let logs = c.logs();
    let said = logs
        .lines()
        .filter(|l| l.contains(&want) && l.contains("stream=\"stderr\""))
        .count();
    assert_eq!(said, 2, "said once by each slot's launcher\n{logs}");
    let kept_out = logs
        .lines()
        .filter(|l| l.contains(&want) && l.contains("will_restart=false"))
        .count();
    assert_eq!(kept_out, 2, "neither slot restarted\n{logs}");
    let started = logs
        .lines()
        .filter(|l| l.contains("worker started") && l.contains("job=lacks"))
        .count();
    assert_eq!(started, 2, "one start per slot, no restart");
    let v = c.status("lacks");
    assert!(v.message.contains(&want), "{}", v.message);
    assert!(
        !logs.contains("No module named 'ductile'"),
        "the launcher found its own module"
    );
}

/// A job name used again: a run whose slots failed with no restart left ends `Failed`; the
/// same name submitted again is a new run, and every slot starts (an agent once kept the old
/// run's failures and never started them: the new run waited forever).
#[test]
fn training_torchrun_a_resubmitted_job_starts_every_slot_its_failed_run_left_out() {
    let bare = "/usr/bin/python3";
    let mut c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default()
    });
    let flags = torchrun_agent_flags_with(&[bare]);
    let extra: Vec<&str> = flags.iter().map(String::as_str).collect();
    c.start_agent("node1", 2, &extra);
    let dir = TempDir::new("resubmit");
    let fail = dir.path().join("fail.py");
    std::fs::write(&fail, "import sys\nsys.exit('not today')\n").unwrap();
    let ok = dir.path().join("ok.py");
    std::fs::write(
        &ok,
        "import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'ran', flush=True)\n",
    )
    .unwrap();
    let job = |script: &Path| {
        format!(
            "name = \"again\"\nruntime = \"torchrun\"\ncommand = [{bare:?}, {:?}]\nmin = 1\nmax = 2\ndesired = 2\nrestart_budget = 0\n",
            script.display().to_string()
        )
    };
    c.submit(&job(&fail));
    let v = c.wait_for(S(60), "the failing run to end", || {
        Some(c.status("again")).filter(|v| v.state.is_terminal())
    });
    assert_eq!(v.state, JobState::Failed, "{}", v.message);
    let before = c.history("again").last().unwrap().number;
    c.submit(&job(&ok));
    let v = c.wait_for(S(60), "the new run to end", || {
        Some(c.status("again")).filter(|v| v.state.is_terminal())
    });
    assert_eq!(v.state, JobState::Succeeded, "{}", v.message);
    let h = c.history("again");
    let first = h
        .iter()
        .find(|g| g.number > before)
        .expect("a new generation");
    assert_eq!(first.world_size, 2, "{h:#?}");
    let logs = c.logs();
    for r in ["rank 0 of 2 ran", "rank 1 of 2 ran"] {
        assert!(logs.contains(r), "{r}: every slot started\n{logs}");
    }
}

//! One tenant cannot reach another (issue 46): on an agent restricted to one Python and one
//! directory, what a hostile tenant holding a valid submit token tried is refused or contained.
//! Real etcd, daemon, agent, launchers and Python programs (the system's `python3`: no torch).

use std::path::Path;
use std::time::Duration;

use ductile_cluster::records::JobState;
use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

/// What the tenant's program does: report what it can see, leave a `setsid()` process behind,
/// print one 1 MiB line, then exit 0 (`exit`) or wait to be stopped (`wait`).
const PROGRAM: &str = r#"
import json, os, subprocess, sys, time
out, mode = sys.argv[1], sys.argv[2]
seen = {"env": dict(os.environ)}
try:
    with open(f"/proc/{os.getppid()}/environ", "rb") as f:
        seen["launcher_environ"] = f.read().decode(errors="replace")
except OSError as e:
    seen["launcher_environ"] = f"unreadable: {e}"
try:
    os.fstat(3)
    seen["fd3"] = "open"
except OSError:
    seen["fd3"] = "closed"
escapee = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                           start_new_session=True)
seen["escapee"] = escapee.pid
with open("/proc/self/cgroup") as f:
    seen["cgroup"] = f.read()
with open(out + ".tmp", "w") as f:
    json.dump(seen, f)
os.rename(out + ".tmp", out)
print("x" * (1 << 20), flush=True)
print("after the long line", flush=True)
if mode == "wait":
    time.sleep(600)
"#;

fn job(name: &str, command: &[String], torchrun: &str) -> String {
    let command: Vec<String> = command.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "name = \"{name}\"\nruntime = \"torchrun\"\ncommand = [{}]\nmin = 1\nmax = 1\ndesired = 1\n[torchrun]\nwarm_start = false\n{torchrun}\n",
        command.join(", ")
    )
}

fn seen(path: &Path, c: &Cluster) -> serde_json::Value {
    let text = c.wait_for(S(60), "the program's report", || {
        std::fs::read_to_string(path).ok()
    });
    serde_json::from_str(&text).unwrap()
}

/// Whether this (root) process can make a cgroup v2 under its own, as the agent's `auto`
/// probes; `Some(where)` when it can.
fn cgroup_writable() -> Option<String> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mount = mounts.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ")?;
        (post.split_whitespace().next()? == "cgroup2").then(|| pre.split_whitespace().nth(4))?
    })?;
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = Path::new(mount)
        .join(rel.trim_start_matches('/'))
        .join(format!("tenancy-probe.{}", std::process::id()));
    std::fs::create_dir(&dir).ok()?;
    let ok = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("cgroup.procs"))
        .is_ok();
    let _ = std::fs::remove_dir(&dir);
    ok.then(|| format!("{} is writable", dir.parent().unwrap().display()))
}

/// The program's own cgroup directory when the agent contains by cgroup (checked to be a
/// cgroup of the agent's subtree, named for the job), else None.
fn in_cgroup(seen: &serde_json::Value, containment: &str) -> Option<std::path::PathBuf> {
    let base = containment.strip_prefix("cgroup ")?;
    let line = seen["cgroup"].as_str().unwrap();
    let rel = line
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or_else(|| panic!("no cgroup2 line in {line:?}"));
    let leaf = Path::new(rel)
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let dir = Path::new(base).join(&leaf);
    assert!(
        rel.contains("/ductile-agent.") && dir.exists(),
        "the program runs in cgroup {rel}, not one of {base}"
    );
    Some(dir)
}

fn wait_dead(c: &Cluster, pid: u32, what: &str) {
    c.wait_for(S(15), what, || (!pid_alive(pid)).then_some(()));
}

#[test]
fn a_hostile_tenant_is_refused_or_contained() {
    let python = "/usr/bin/python3".to_string();
    let mut c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        agent_env: vec![
            ("AWS_SECRET_ACCESS_KEY".into(), "node-secret".into()),
            ("AWS_ACCESS_KEY_ID".into(), "node-key".into()),
        ],
        ..Spec::default()
    });
    let dir = TempDir::new("tenancy");
    let d = dir.path().canonicalize().unwrap();
    let creds = d.join("creds");
    std::fs::create_dir_all(&creds).unwrap();
    std::fs::write(
        creds.join("a.env"),
        "AWS_ACCESS_KEY_ID=job-a-key\nAWS_SECRET_ACCESS_KEY=job-a-secret\n",
    )
    .unwrap();
    let code = d.join("code");
    std::fs::create_dir_all(&code).unwrap();
    let prog = code.join("prog.py");
    std::fs::write(&prog, PROGRAM).unwrap();
    // a script under the allowed root that is a link to code outside it
    let outside = TempDir::new("tenancy-outside");
    std::fs::write(outside.path().join("evil.py"), PROGRAM).unwrap();
    std::os::unix::fs::symlink(outside.path().join("evil.py"), code.join("link.py")).unwrap();
    c.start_agent(
        "node1",
        2,
        &[
            "--allowed-commands",
            &format!("{python},ductile-worker"),
            "--allowed-paths",
            &d.display().to_string(),
            "--job-credentials-dir",
            &creds.display().to_string(),
        ],
    );
    c.wait_for(S(30), "node1 registered", || {
        c.dctl_ok(&["nodes"]).contains("node1").then_some(())
    });
    // each program in a cgroup of its own wherever this machine lets a root process make one
    // (the agent probes the same way), else the subreaper sweep
    let nodes: serde_json::Value = c.get_json("/v1/nodes");
    let containment = nodes[0]["containment"].as_str().unwrap().to_string();
    let cgroup_root = cgroup_writable();
    match &cgroup_root {
        Some(why) => assert!(
            containment.starts_with("cgroup ") && containment.contains("/ductile-agent."),
            "{why}, but the agent contains programs by {containment}"
        ),
        None => assert_eq!(containment, "subreaper"),
    }
    let p = |args: &[&str]| -> Vec<String> {
        std::iter::once(python.clone())
            .chain(args.iter().map(|s| s.to_string()))
            .collect()
    };
    let prog_s = prog.display().to_string();
    // the command line, as CPython reads it; a model directory outside the allow-lists
    let hf = format!(
        "name = \"hf\"\nmin = 1\nmax = 1\ndesired = 1\ncommand = [\"ductile-worker\"]\n[training]\nmodel = \"hf\"\nmodel_path = \"file:///etc\"\ndataset = \"file://{}/d.bin\"\nglobal_batch = 4\n",
        d.display()
    );
    assert_refused(
        &c,
        &[
            (job("c1", &p(&["-cimport os"]), ""), "inline Python (-c)"),
            (
                job("c2", &p(&["-Ic", "import os"]), ""),
                "inline Python (-c)",
            ),
            (
                job("c3", &p(&["-m", "timeit", "import os"]), ""),
                "\"timeit\" (-m) is not in the agent's allowed_modules",
            ),
            (job("c4", &p(&["-"]), ""), "standard input"),
            (
                job("g", &p(&[&prog_s, "x", "exit"]), "grace_s = 3000"),
                "max_grace_s",
            ),
            (hf, "training.model_path"),
        ],
    );

    // a program that exits by itself: it sees the job's own credentials (not the node's), a
    // private HOME and TMPDIR, no user site, no secret in its launcher's environment, no
    // inherited secrets descriptor; its setsid() child dies with it; its 1 MiB line is cut
    let a_out = d.join("a.json");
    let ck = format!(
        "s3://bucket/{}/a",
        d.display().to_string().trim_start_matches('/')
    );
    c.submit(
        &job(
            "a",
            &p(&[&prog_s, &a_out.display().to_string(), "exit"]),
            &format!("checkpoint_url = {ck:?}"),
        )
        .replace("[torchrun]", "env = { RUST_LOG = \"debug\" }\n[torchrun]"),
    );
    // the read-only token (what dashboard URLs carry) sees env's names, not its values
    let shown: serde_json::Value = c.get_json("/v1/jobs/a/spec");
    assert_eq!(
        shown["env"]["RUST_LOG"], "(hidden from the read-only token)",
        "{shown}"
    );
    let a = seen(&a_out, &c);
    let env = &a["env"];
    assert_eq!(env["AWS_SECRET_ACCESS_KEY"], "job-a-secret", "{env}");
    assert_eq!(env["AWS_ACCESS_KEY_ID"], "job-a-key");
    assert_eq!(env["PYTHONNOUSERSITE"], "1");
    // (the launcher's own directory, removed when it ends)
    for (k, leaf) in [("HOME", "home"), ("TMPDIR", "tmp")] {
        let v = env[k].as_str().unwrap();
        assert!(
            v.contains("/ductile-launch-") && v.ends_with(leaf),
            "{k}={v}"
        );
    }
    let launcher = a["launcher_environ"].as_str().unwrap();
    assert!(
        !launcher.contains("node-secret") && !launcher.contains("job-a-secret"),
        "the launcher's environment: {launcher}"
    );
    assert_eq!(a["fd3"], "closed");
    assert!(!env.to_string().contains("node-secret"));
    let program_cgroup = in_cgroup(&a, &containment);
    let v = c.wait_done("a", S(60));
    assert_eq!(v.state, JobState::Succeeded);
    if let Some(dir) = &program_cgroup {
        c.wait_for(S(15), "job a's cgroup removed", || {
            (!dir.exists()).then_some(())
        });
    }
    wait_dead(
        &c,
        a["escapee"].as_u64().unwrap() as u32,
        "job a's setsid() child killed",
    );
    let logs = c.agent_logs();
    assert!(logs.contains("bytes cut]"), "a long line is cut");
    assert!(logs.contains("after the long line"));
    assert!(logs.contains("process(es) the program left running"));

    // a second job cannot take the first one's checkpoint location (nor one inside it)
    let b_out = d.join("b.json");
    let b_ck = format!("{ck}/inner");
    let b = job(
        "b",
        &p(&[&prog_s, &b_out.display().to_string(), "wait"]),
        &format!("checkpoint_url = {b_ck:?}"),
    );
    // (a has finished: its location is free again)
    c.submit(&b);
    let b_seen = seen(&b_out, &c);
    let stolen = job(
        "thief",
        &p(&[&prog_s, &d.join("t.json").display().to_string(), "exit"]),
        &format!("checkpoint_url = {ck:?}"),
    );
    let t = d.join("thief.toml");
    std::fs::write(&t, &stolen).unwrap();
    let (ok, _, err) = c.dctl(&["submit", t.to_str().unwrap()]);
    assert!(!ok && err.contains("torchrun.checkpoint_url"), "{err}");
    assert!(err.contains("job \"b\"'s checkpoint location"), "{err}");
    // b gets no S3 credentials (none configured for it), never the node's
    assert!(b_seen["env"].get("AWS_SECRET_ACCESS_KEY").is_none());
    // stopped: its setsid() child goes with it
    let b_cgroup = in_cgroup(&b_seen, &containment);
    c.dctl_ok(&["stop", "b"]);
    wait_dead(
        &c,
        b_seen["escapee"].as_u64().unwrap() as u32,
        "job b's setsid() child killed on stop",
    );
    if let Some(dir) = &b_cgroup {
        c.wait_for(S(15), "job b's cgroup removed", || {
            (!dir.exists()).then_some(())
        });
    }

    // its launcher SIGKILLed (no chance to sweep): the agent, a child subreaper, kills what
    // the program left
    let c_out = d.join("c.json");
    c.submit(&job(
        "c",
        &p(&[&prog_s, &c_out.display().to_string(), "wait"]),
        "",
    ));
    let c_seen = seen(&c_out, &c);
    // (a member's pid is its launcher's; program_pid its program's)
    let launcher = c.wait_for(S(10), "job c's launcher", || {
        c.status("c").members.first()?.pid
    });
    unsafe { libc::kill(launcher as i32, libc::SIGKILL) };
    wait_dead(
        &c,
        c_seen["escapee"].as_u64().unwrap() as u32,
        "job c's setsid() child killed after its launcher's death",
    );
    c.dctl_ok(&["stop", "c"]);

    // what a job's etcd user writes under live/{job}/ is bounded (here written as any holder
    // of job w's credentials could): past it the job fails, and once it has ended its live/
    // keys are deleted but what its status shows
    let w_out = d.join("w.json");
    c.submit(&job(
        "w",
        &p(&[&prog_s, &w_out.display().to_string(), "wait"]),
        "",
    ));
    seen(&w_out, &c);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = rt.block_on(c.store());
    let junk = format!("{}junk/", store.keys.live_job("w"));
    rt.block_on(async {
        use ductile_cluster::kv::{Op, Txn};
        for b in 0..12 {
            let ops = (0..100)
                .map(|i| Op::put(format!("{junk}{}", b * 100 + i), vec![b'x'; 64]))
                .collect();
            store
                .backend
                .txn(Txn {
                    compares: vec![],
                    ops,
                })
                .await
                .unwrap();
        }
    });
    let v = c.wait_for(S(30), "job w failed past its live/ bound", || {
        Some(c.status("w")).filter(|v| v.state == JobState::Failed)
    });
    assert!(
        v.message.contains("past the bound of 1088 keys"),
        "{}",
        v.message
    );
    c.wait_for(S(30), "job w's live/ keys deleted", || {
        let (kvs, _) = rt
            .block_on(store.backend.list(&store.keys.live_job("w")))
            .unwrap();
        kvs.iter()
            .all(|kv| !kv.key.starts_with(&junk))
            .then_some(())
    });

    // a script whose real path is outside the allowed paths never starts
    let link = job(
        "link",
        &p(&[
            &code.join("link.py").display().to_string(),
            &d.join("l.json").display().to_string(),
            "exit",
        ]),
        "",
    );
    c.submit(&link);
    let why = c.wait_for(S(30), "the link job refused at spawn", || {
        c.history("link")
            .into_iter()
            .find(|g| g.detail.contains("resolves to"))
            .map(|g| g.detail)
    });
    assert!(
        why.contains("evil.py") && why.contains("outside the agent's allowed_paths"),
        "{why}"
    );
    assert!(!d.join("l.json").exists(), "nothing of it ran");
}

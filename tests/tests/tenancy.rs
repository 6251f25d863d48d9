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
    assert!(!ok && err.contains("program.checkpoint_url"), "{err}");
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

/// What a tenant's program on a shared node tries (issue 66): whose environment it can read,
/// whether it can list the work root or open another job's directory, and who it runs as.
const PEEK: &str = r#"
import json, os, sys, time
out, other = sys.argv[1], sys.argv[2]
me = os.getuid()
readable, secret = [], False
for p in os.listdir("/proc"):
    if not p.isdigit():
        continue
    try:
        with open(f"/proc/{p}/environ", "rb") as f:
            data = f.read().decode(errors="replace")
        with open(f"/proc/{p}/status") as f:
            uid = int(next(l for l in f if l.startswith("Uid:")).split()[1])
    except (OSError, StopIteration, ValueError):
        continue
    readable.append(uid)
    secret = secret or "node-secret" in data
work = os.path.dirname(os.getcwd())
# the other job's directory: reachable by name (the work root is 711), once it is there
for _ in range(600):
    if os.path.exists(os.path.join(work, other)):
        break
    time.sleep(0.1)
def tried(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return type(e).__name__
with open("mine.txt", "w") as f:
    f.write("the job's own file")
seen = {
    "uid": me,
    "cwd": os.getcwd(),
    "readable_uids": sorted(set(readable)),
    "secret_seen": secret or "node-secret" in json.dumps(dict(os.environ)),
    "list_work_root": tried(lambda: os.listdir(work)),
    "list_other": tried(lambda: os.listdir(os.path.join(work, other))),
    "plant_other": tried(lambda: open(os.path.join(work, other, "json.py"), "w").close()),
    "plant_root": tried(lambda: os.symlink("/etc", os.path.join(work, other + "-x"))),
}
with open(out + ".tmp", "w") as f:
    json.dump(seen, f)
os.rename(out + ".tmp", out)
time.sleep(600)
"#;

/// A directory every uid may traverse and read (mode 755) holding hard links to this build's
/// agent, worker and daemon and to libtorch's libraries: the build's own directory is under
/// root's home (mode 700), where a job's user cannot run the launcher from.
fn reachable_build(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let bins = dir.join("bin");
    let libs = dir.join("lib");
    for d in [dir, bins.as_path(), libs.as_path()] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let link = |from: &Path, to: &Path| {
        if std::fs::hard_link(from, to).is_err() {
            std::fs::copy(from, to).unwrap();
        }
    };
    for b in ["ductile-agent", "ductile-worker", "ductiled"] {
        link(&bin(b), &bins.join(b));
    }
    let libtorch = std::env::var("LIBTORCH").map(std::path::PathBuf::from).ok();
    if let Some(lib) = libtorch.map(|l| l.join("lib")).filter(|l| l.is_dir()) {
        for e in std::fs::read_dir(&lib).unwrap().flatten() {
            if e.path().is_file() {
                link(&e.path(), &libs.join(e.file_name()));
            }
        }
    }
    (bins, libs)
}

#[test]
fn jobs_on_one_node_run_as_users_of_their_own_and_see_nothing_of_each_other_or_the_node() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    assert!(
        unsafe { libc::geteuid() } == 0,
        "this test starts an agent that runs jobs as users of their own: it needs root (CI runs as root)"
    );
    let python = "/usr/bin/python3".to_string();
    let dir = TempDir::new_in(Path::new("/var/tmp"), "tenancy-users");
    let d = dir.path().canonicalize().unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (bins, libs) = reachable_build(&d.join("build"));
    let mut c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        bin_dir: Some(bins.clone()),
        agent_env: vec![
            ("AWS_SECRET_ACCESS_KEY".into(), "node-secret".into()),
            ("AWS_ACCESS_KEY_ID".into(), "node-key".into()),
            ("LD_LIBRARY_PATH".into(), libs.display().to_string()),
        ],
        ..Spec::default()
    });
    let code = d.join("code");
    let outs = d.join("outs");
    for x in [&code, &outs] {
        std::fs::create_dir_all(x).unwrap();
    }
    // where the programs report: any job's user may write there (the sticky /tmp's mode)
    std::fs::set_permissions(&code, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&outs, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let peek = code.join("peek.py");
    std::fs::write(&peek, PEEK).unwrap();
    std::fs::set_permissions(&peek, std::fs::Permissions::from_mode(0o644)).unwrap();
    let work = d.join("work");
    c.start_agent(
        "node1",
        3,
        &[
            "--job-users",
            "70000-70099",
            "--allowed-commands",
            &format!("{python},ductile-worker"),
            "--allowed-paths",
            &d.display().to_string(),
            "--worker-credentials",
            "job",
            "--work-root",
            &work.display().to_string(),
            "--libtorch",
            &libs.display().to_string(),
        ],
    );
    c.wait_for(S(30), "node1 registered", || {
        c.dctl_ok(&["nodes"]).contains("node1").then_some(())
    });
    // the issue's first try: the node's Python as a default-runtime job, refused at submit
    let inline = d.join("inline.toml");
    std::fs::write(
        &inline,
        format!("name = \"inline\"\nmin = 1\nmax = 1\ndesired = 1\ncommand = [\"{python}\", \"-c\", \"import os; print(os.environ)\"]\n"),
    )
    .unwrap();
    let (ok, _, err) = c.dctl(&["submit", inline.to_str().unwrap()]);
    assert!(!ok && err.contains("direct_commands"), "{err}");

    // two tenants' programs on the node
    let report = |j: &str| outs.join(format!("{j}.json"));
    for (j, other) in [("ta", "tb"), ("tb", "ta")] {
        c.submit(&job(
            j,
            &[
                python.clone(),
                peek.display().to_string(),
                report(j).display().to_string(),
                other.into(),
            ],
            "",
        ));
    }
    let a = seen(&report("ta"), &c);
    let b = seen(&report("tb"), &c);
    let (ua, ub) = (a["uid"].as_u64().unwrap(), b["uid"].as_u64().unwrap());
    assert_ne!(ua, ub, "two jobs share a uid");
    for (s, uid, name) in [(&a, ua, "ta"), (&b, ub, "tb")] {
        assert!((70000..=70099).contains(&uid), "{name} runs as {uid}");
        // the environments it can read are its own user's processes' only, and none holds
        // the node's secret
        assert_eq!(s["readable_uids"], serde_json::json!([uid]), "{name}: {s}");
        assert_eq!(s["secret_seen"], false, "{name}: {s}");
        // it cannot list the work root, open or write the other job's directory, or put
        // anything where another job's directory will be
        for k in ["list_work_root", "list_other", "plant_other", "plant_root"] {
            assert_eq!(s[k], "PermissionError", "{name} {k}: {s}");
        }
        // its own directory: its user's, mode 700, its working directory
        let own = work.join(name);
        assert_eq!(s["cwd"], own.display().to_string());
        let md = std::fs::symlink_metadata(&own).unwrap();
        assert_eq!(
            (md.uid() as u64, md.mode() & 0o7777),
            (uid, 0o700),
            "{name}"
        );
        assert!(own.join("mine.txt").exists());
    }
    assert_eq!(
        std::fs::metadata(&work).unwrap().mode() & 0o7777,
        0o711,
        "the work root lets a job reach its own directory only"
    );

    // ductile-worker itself (the default runtime): its own user, its directory for HOME and
    // working directory, and nothing of the agent's environment but what it needs
    let data = synth(&d, "tokens", 20_000);
    c.submit(&format!(
        "{}max_steps = 100000\nmodel_config = {{ d_model = 16, n_layer = 1, n_head = 2 }}\n",
        training_toml("tw", 1, 1, 1, "gpt", &data, "")
    ));
    c.wait_step("tw", 2, S(90));
    let pid = c.status("tw").members[0].pid.unwrap();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    let vars: Vec<&str> = environ.split('\0').collect();
    assert!(!environ.contains("node-secret"), "{vars:?}");
    assert!(
        vars.contains(&format!("HOME={}", work.join("tw").display()).as_str()),
        "{vars:?}"
    );
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (70000..=70099).contains(&uid) && uid != ua && uid != ub,
        "{uid}"
    );

    // a job that ends takes its directory with it
    c.dctl_ok(&["stop", "ta"]);
    c.wait_for(S(30), "job ta's directory removed", || {
        (!work.join("ta").exists()).then_some(())
    });
    assert!(work.join("tb").exists());
    for j in ["tb", "tw"] {
        c.dctl_ok(&["stop", j]);
    }
    c.wait_for(S(30), "every job's directory removed", || {
        std::fs::read_dir(&work)
            .unwrap()
            .flatten()
            .all(|e| e.file_name() == ".ductile-work-root")
            .then_some(())
    });
}

/// Issue 66, item 6: tenants hold tokens of their own, for jobs under their prefix; they see
/// and act on their own jobs only, within their slots, and every refusal names the scope.
#[test]
fn tenants_see_and_act_on_their_own_jobs_only_within_their_slots() {
    let dir = TempDir::new("tenants");
    let sha = |t: &str| ductile_daemon::tenants::digest_hex(t);
    let (vision, audio) = ("vision-token-0123456789", "audio-token-0123456789");
    let file = dir.path().join("tenants.toml");
    let write = |with_vision: bool| {
        let mut text = format!(
            "[[tenant]]\nname = \"audio\"\nscope = \"read\"\ntoken_sha256 = \"{}\"\n",
            sha(audio)
        );
        if with_vision {
            text.push_str(&format!(
                "[[tenant]]\nname = \"vision\"\nscope = \"submit\"\nmax_slots = 3\ntoken_sha256 = \"{}\"\n",
                sha(vision)
            ));
        }
        std::fs::write(&file, text).unwrap();
    };
    write(true);
    let c = Cluster::start(Spec {
        daemon_args: vec!["--tenants-file".into(), file.display().to_string()],
        ..Spec::default().agents(2, 2)
    });
    let sleeper = |name: &str, max: u32| {
        format!(
            "{}command = [\"sleep\", \"600\"]\n",
            job_toml(name, 1, max, 1)
        )
    };
    let submit_as = |token: &str, toml: &str| {
        let p = c.dir.path().join("t.toml");
        std::fs::write(&p, toml).unwrap();
        c.dctl_as(token, &["submit", p.to_str().unwrap()])
    };
    c.submit(&sleeper("other-1", 1));
    let (ok, _, err) = submit_as(vision, &sleeper("vision-a", 2));
    assert!(ok, "{err}");
    c.wait_world("vision-a", 1, S(30));
    c.wait_world("other-1", 1, S(30));
    // not under its prefix; past its slots (2 asked + 2 > 3)
    let (ok, _, err) = submit_as(vision, &sleeper("other-2", 1));
    assert!(
        !ok && err.contains("tenant \"vision\"") && err.contains("vision-*"),
        "{err}"
    );
    let (ok, _, err) = submit_as(vision, &sleeper("vision-b", 2));
    assert!(!ok && err.contains("max_slots"), "{err}");
    let (ok, _, err) = submit_as(vision, &sleeper("vision-b", 1));
    assert!(ok, "{err}");
    // what it sees: its jobs, its workers; another's job is refused whether it exists or not
    let (ok, out, err) = c.dctl_as(vision, &["status", "--json"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("vision-a") && !out.contains("other-1"),
        "{out}"
    );
    for args in [
        &["status", "other-1"][..],
        &["status", "no-such-job"],
        &["stop", "other-1"],
        &["scale", "other-1", "1"],
        &["logs", "other-1"],
    ] {
        let (ok, _, err) = c.dctl_as(vision, args);
        assert!(
            !ok && err.contains("its own jobs only") && err.contains("admin token"),
            "{args:?}: {err}"
        );
    }
    let (ok, out, _) = c.dctl_as(vision, &["nodes", "--json"]);
    assert!(
        ok && out.contains("vision-a") && !out.contains("other-1"),
        "{out}"
    );
    let (ok, _, err) = c.dctl_as(vision, &["drain", "node1"]);
    assert!(!ok && err.contains("needs the admin token"), "{err}");
    let (code, body) = http(
        "GET",
        &format!("{}/metrics", c.endpoint()),
        &[("Authorization", &format!("Bearer {vision}"))],
        b"",
    )
    .unwrap();
    // (a loopback daemon's /metrics needs no token; with one, a tenant's is refused)
    assert!(
        code == 200 || (code == 403 && body.contains("tenant")),
        "{code} {body}"
    );
    // its own: scale, logs, stop
    c.dctl_ok(&["status", "vision-a"]);
    let (ok, _, err) = c.dctl_as(vision, &["scale", "vision-a", "2"]);
    assert!(ok, "{err}");
    let (ok, _, err) = c.dctl_as(vision, &["stop", "vision-b"]);
    assert!(ok, "{err}");
    // a read tenant: reads its own (none yet), changes nothing
    let (ok, out, _) = c.dctl_as(audio, &["status", "--json"]);
    assert!(
        ok && !out.contains("vision-a") && !out.contains("other-1"),
        "{out}"
    );
    let (ok, _, err) = submit_as(audio, &sleeper("audio-x", 1));
    assert!(!ok && err.contains("tenant \"audio\""), "{err}");
    // the operator takes vision's token away: after a reload it is refused
    write(false);
    unsafe { libc::kill(c.daemons[0].pid() as i32, libc::SIGHUP) };
    c.wait_for(S(10), "vision's token refused after the reload", || {
        let (ok, _, err) = c.dctl_as(vision, &["status", "vision-a"]);
        (!ok && err.contains("invalid token")).then_some(())
    });
    // and nothing of its jobs changed
    assert_eq!(c.status("vision-a").world_size, 2);
}

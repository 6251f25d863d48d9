//! A cluster on an etcd with TLS, client certificates and auth: the daemon and agents connect
//! as their own users, each job's workers as their job's, which reaches nothing else.

use std::time::Duration as S;

use ductile_cluster::access::{EtcdAccess, Secret};
use ductile_cluster::records::{JobAccess, JobState};
use ductile_cluster::{ClusterError, Keys, KvBackend};
use ductile_tests::*;

/// The etcd access a worker process was started with, read from its environment.
fn worker_access(pid: u32) -> (EtcdAccess, Vec<(String, String)>) {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let env: Vec<(String, String)> = raw
        .split(|b| *b == 0)
        .filter_map(|kv| {
            let kv = String::from_utf8_lossy(kv);
            let (k, v) = kv.split_once('=')?;
            Some((k.to_string(), v.to_string()))
        })
        .collect();
    let get = |n: &str| {
        env.iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.clone())
            .filter(|v| !v.is_empty())
    };
    let a = EtcdAccess {
        endpoints: get("DUCTILE_ETCD").unwrap(),
        ca: get("DUCTILE_ETCD_CA").map(Into::into),
        cert: get("DUCTILE_ETCD_CERT").map(Into::into),
        key: get("DUCTILE_ETCD_KEY").map(Into::into),
        user: get("DUCTILE_ETCD_USER"),
        password: get("DUCTILE_ETCD_PASSWORD").map(Secret::new),
    };
    (a, env)
}

fn denied<T: std::fmt::Debug>(r: Result<T, ClusterError>, what: &str) {
    match r {
        Err(ClusterError::Rejected { message, .. }) if message.contains("permission denied") => {}
        other => panic!("{what}: expected permission denied, got {other:?}"),
    }
}

async fn connect(a: &EtcdAccess) -> Result<std::sync::Arc<dyn KvBackend>, ClusterError> {
    ductile_cluster::connect_etcd_with(a, S::from_secs(10)).await
}

#[test]
fn with_etcd_tls_and_auth_each_jobs_workers_reach_only_their_own_job() {
    let c = Cluster::start(Spec {
        secure_etcd: true,
        ..Spec::default().agents(2, 2)
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let data = synth(c.dir.path(), "tokens", 20_000);
    let ck = format!("file://{}/ck", c.dir.path().display());
    c.submit(&format!(
        "{}max_steps = 400\n[checkpoint]\nurl = \"{ck}\"\ninterval = 100\nkeep = 3\n",
        training_toml("a", 1, 2, 2, "gpt", &data, "restart_budget = 5")
    ));
    c.submit(&format!(
        "{}max_steps = 1000000\n",
        training_toml("b", 1, 2, 2, "gpt", &data, "restart_budget = 0")
    ));
    let va = c.wait_world("a", 2, S::from_secs(60));
    c.wait_world("b", 2, S::from_secs(60));
    c.wait_step("a", 5, S::from_secs(60));
    let keys = Keys::new(&c.prefix);
    let root = rt.block_on(c.store());

    // the job's user, as the leader recorded it, and what its worker was given
    let rec: JobAccess = rt
        .block_on(root.get_json(&keys.access("a"), "job access"))
        .unwrap()
        .unwrap()
        .0;
    assert_eq!(rec.user, "ductile-job-a");
    let pid = va.members[0].pid.unwrap();
    let (access, env) = worker_access(pid);
    assert_eq!(access.user.as_deref(), Some("ductile-job-a"));
    assert_eq!(
        access.password.as_ref().map(|p| p.expose()),
        Some(rec.password.as_str())
    );
    let pki = c.etcd.pki.clone().unwrap();
    assert_eq!(
        access.cert,
        Some(pki.join("worker.pem")),
        "the workers' certificate, not the agent's"
    );
    for leaked in ["DUCTILE_ETCD_PASSWORD_FILE", "DUCTILE_ETCD_WORKER_KEY"] {
        assert!(
            env.iter().all(|(k, _)| k != leaked),
            "{leaked} reached the worker"
        );
    }
    let agent_password = std::fs::read_to_string(pki.join("agent.password")).unwrap();
    assert!(
        env.iter().all(|(_, v)| !v.contains(agent_password.trim())),
        "the agent's password reached the worker"
    );

    rt.block_on(async {
        let w = connect(&access).await.expect("job a's worker connects");
        // its own job: the control state is readable, the live space writable
        assert!(w.get(&keys.generation("a")).await.unwrap().is_some());
        assert!(w.get(&keys.spec("a")).await.unwrap().is_some());
        w.put(&format!("{}probe", keys.live_job("a")), b"x".to_vec(), None)
            .await
            .unwrap();
        // the job's control state is not its to change (only checkpoint commits are), and
        // nothing of job b's or the cluster's is its to read or write
        let writes = [
            ("its own spec", keys.spec("a")),
            ("a generation", keys.generation("a")),
            ("job b's spec", keys.spec("b")),
            ("job b's checkpoint", keys.checkpoint("b")),
            ("job b's progress", keys.progress("b")),
            ("a node", keys.node("node1")),
            ("a drain", keys.drain("node1")),
        ];
        for (what, key) in writes {
            denied(
                w.put(&key, b"{}".to_vec(), None).await,
                &format!("write {what}"),
            );
        }
        for (what, key) in [
            ("job b's spec", keys.spec("b")),
            ("job b's etcd user", keys.access("b")),
        ] {
            denied(w.get(&key).await, &format!("read {what}"));
        }
        let lists = [
            ("job b", keys.job("b")),
            ("the nodes", keys.nodes()),
            ("the nodes' assignments", keys.assignments()),
            ("every job", keys.jobs()),
        ];
        for (what, prefix) in lists {
            denied(w.list(&prefix).await, &format!("list {what}"));
        }
        denied(
            w.delete_prefix(&format!("{}/", c.prefix)).await,
            "delete everything",
        );
        denied(w.users().await, "list etcd's users");

        // the workers' certificate without the job's password is nobody (etcd would take its
        // CN for a user): refused
        let mut anon = access.clone();
        anon.user = None;
        anon.password = None;
        match connect(&anon).await {
            Ok(b) => denied(
                b.get(&keys.spec("a")).await,
                "read with the bare workers' certificate",
            ),
            Err(e) => assert!(e.to_string().contains("permission denied"), "{e}"),
        }
        // a wrong password is a clear refusal at connect
        let mut wrong = access.clone();
        wrong.password = Some(Secret::new("not-the-password"));
        let e = connect(&wrong)
            .await
            .err()
            .expect("a wrong password is refused");
        assert!(e.to_string().contains("authentication failed"), "{e}");
    });

    // the job trains under all this: a kill re-forms it, its workers commit checkpoints, and
    // it finishes
    let victim = va.members[1].pid.unwrap();
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let done = c.wait_done("a", S::from_secs(240));
    assert!(done.generation >= 2, "the kill re-formed the job: {done:?}");
    let committed: ductile_cluster::records::CheckpointRecord = rt
        .block_on(root.get_json(&keys.checkpoint("a"), "checkpoint"))
        .unwrap()
        .expect("job a's workers committed a checkpoint")
        .0;
    assert!(committed.step >= 100, "{committed:?}");

    // an ended job's user is removed, and its password opens nothing any more
    c.wait_for(S::from_secs(30), "job a's etcd user removed", || {
        let users = rt.block_on(root.backend.users()).unwrap();
        let rec = rt.block_on(root.backend.get(&keys.access("a"))).unwrap();
        (!users.contains(&"ductile-job-a".to_string()) && rec.is_none()).then_some(())
    });
    let e = rt
        .block_on(connect(&access))
        .err()
        .expect("the ended job's user is gone");
    assert!(e.to_string().contains("authentication failed"), "{e}");

    // job b is untouched by all of it; etcd restarting (every token it issued is gone) costs
    // nobody their access: the daemon, the agents and b's workers log in again, and a resize
    // goes through all of them
    assert_eq!(c.status("b").state, JobState::Running);
    let before = c.status("b").step;
    let mut c = c;
    c.etcd.restart();
    c.dctl_ok(&["scale", "b", "1"]);
    let v = c.wait_world("b", 1, S::from_secs(60));
    c.wait_step("b", before.max(v.step) + 20, S::from_secs(60));
    c.dctl_ok(&["stop", "b"]);
    c.wait_for(S::from_secs(60), "job b's etcd user removed", || {
        let users = rt.block_on(root.backend.users()).unwrap();
        (!users.iter().any(|u| u.starts_with("ductile-job-"))).then_some(())
    });
}

#[test]
fn the_api_serves_tls_to_clients_that_trust_its_ca_and_plain_http_only_on_loopback() {
    let c = Cluster::start(Spec {
        api_tls: true,
        ..Spec::default().agents(1, 1)
    });
    assert!(c.endpoint().starts_with("https://"));
    // dctl with the cluster's CA: the whole API, end to end
    c.submit(&job_toml("t", 1, 1, 1));
    c.wait_world("t", 1, S::from_secs(30));
    let (ok, out, err) = c.dctl(&["status"]);
    assert!(ok && out.contains('t'), "{out}{err}");
    let (ok, _, err) = c.dctl_as(READ_TOKEN, &["scale", "t", "1"]);
    assert!(!ok && err.contains("read-only"), "{err}");

    // without it (the system's roots only) the daemon's certificate is refused, and said so
    let out = std::process::Command::new(bin("dctl"))
        .args(["--endpoint", &c.endpoint(), "status"])
        .env("DCTL_TOKEN", TOKEN)
        .env_remove("DCTL_CA")
        .env("HOME", c.dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("certificate"),
        "{err}"
    );

    // plain HTTP to the TLS port gets no API answer
    let port = c.daemon_ports[0];
    let plain = http("GET", &format!("http://127.0.0.1:{port}/healthz"), &[], b"");
    assert!(plain.as_ref().map_or(true, |r| r.0 != 200), "{plain:?}");

    // clients that connect and never finish a handshake hold up nobody
    let idle: Vec<std::net::TcpStream> = (0..20)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let t0 = std::time::Instant::now();
    let (ok, out, err) = c.dctl(&["nodes"]);
    assert!(ok && out.contains("node1"), "{out}{err}");
    assert!(
        t0.elapsed() < S::from_secs(8),
        "dctl waited {:?} behind silent connections",
        t0.elapsed()
    );
    drop(idle);

    // what the daemon refuses at start, naming it: no TLS without --insecure-http, plain HTTP
    // off loopback, TLS and plain HTTP at once, a key that is not one
    let pki = c.pki.clone().unwrap();
    let daemon = |extra: &[&str]| {
        let out = std::process::Command::new(bin("ductiled"))
            .args(["--etcd", &c.etcd.endpoint])
            .args(extra)
            .env("DUCTILE_TOKEN", TOKEN)
            .env_remove("DUCTILE_INSECURE_HTTP")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let cert = pki.join("api.pem").display().to_string();
    let key = pki.join("api-key.pem").display().to_string();
    let (code, err) = daemon(&["--listen", "127.0.0.1:0"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("the API needs TLS"), "{err}");
    let (code, err) = daemon(&["--listen", "0.0.0.0:0", "--insecure-http"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("loopback"), "{err}");
    let (code, err) = daemon(&[
        "--listen",
        "127.0.0.1:0",
        "--insecure-http",
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("choose TLS or plain HTTP"), "{err}");
    let (code, err) = daemon(&[
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        &cert,
        "--tls-key",
        &cert,
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("tls_key") && err.contains("api.pem"), "{err}");
    // token-free reads only on plain HTTP on loopback, never with TLS
    let (code, err) = daemon(&[
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--reads-without-token",
        "true",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("reads_without_token"), "{err}");
    // on loopback with plain HTTP, reads (the dashboard's) need no token; changes still do
    let port = free_port();
    let mut open = Proc::start(
        "open-daemon",
        &bin("ductiled"),
        &[
            c.etcd.flags("daemon"),
            vec!["--listen".into(), format!("127.0.0.1:{port}")],
        ]
        .concat()
        .into_iter()
        .chain([
            "--insecure-http".into(),
            "--reads-without-token".into(),
            "true".into(),
            "--prefix".into(),
            c.prefix.clone(),
        ])
        .collect::<Vec<String>>(),
        &[("DUCTILE_TOKEN".into(), TOKEN.into())],
        c.dir.path().join("open-daemon.log"),
    );
    let base = format!("http://127.0.0.1:{port}");
    let jobs = c.wait_for(S::from_secs(20), "the open daemon to serve reads", || {
        http("GET", &format!("{base}/v1/jobs"), &[], b"")
            .ok()
            .filter(|(code, _)| *code == 200)
    });
    assert!(jobs.1.starts_with('['), "{}", jobs.1);
    let (code, page) = http("GET", &format!("{base}/"), &[], b"").unwrap();
    assert!(code == 200 && page.contains("loss-chart"), "{code}");
    let (code, body) = http("POST", &format!("{base}/v1/jobs/b/stop"), &[], b"").unwrap();
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("needs the admin token"), "{body}");
    open.kill();
}

/// What an outsider, a read-only user or a broken peer tries against a running job, and what
/// it gets: refusals, and a job that trains on.
#[test]
fn attacks_on_a_running_cluster_are_refused_and_the_job_trains_on() {
    let c = Cluster::start(Spec::default().agents(2, 1));
    let data = synth(c.dir.path(), "tokens", 20_000);
    // rank 1 turns hostile at step 1000: it announces a 2^62-byte frame to rank 0
    c.submit(&format!(
        "{}max_steps = 1000000\n",
        training_toml(
            "x",
            1,
            2,
            2,
            "gpt",
            &data,
            "restart_budget = 0\nallow_fault_injection = true\nenv = { DUCTILE_FAULT_OVERSIZED_FRAME = \"1:1000\" }"
        )
    ));
    let v = c.wait_world("x", 2, S::from_secs(60));
    c.wait_step("x", 5, S::from_secs(60));
    let pids: Vec<u32> = v.members.iter().map(|m| m.pid.unwrap()).collect();
    let api = c.endpoint();

    // the API: no token, a wrong one, the read-only one asking for a change
    let body = br#"{"desired": 1}"#;
    let scale = format!("{api}/v1/jobs/x/scale");
    let ct = ("Content-Type", "application/json");
    let (code, _) = http("POST", &scale, &[ct], body).unwrap();
    assert_eq!(code, 401);
    let wrong = "Bearer not-a-token-at-all";
    let (code, _) = http("POST", &scale, &[ct, ("Authorization", wrong)], body).unwrap();
    assert_eq!(code, 401);
    let read = format!("Bearer {READ_TOKEN}");
    let (code, text) = http("POST", &scale, &[ct, ("Authorization", &read)], body).unwrap();
    assert_eq!(code, 403, "{text}");
    // a dataset outside the agents' allowed roots is refused at submit
    let (ok, _, err) = c.dctl(&["submit", &{
        let p = c.dir.path().join("evil.toml");
        std::fs::write(
            &p,
            training_toml("evil", 1, 1, 1, "gpt", "file:///etc/shadow", ""),
        )
        .unwrap();
        p.display().to_string()
    }]);
    assert!(!ok && err.contains("allowed_paths"), "{err}");

    // a foreign process at rank 0's mesh port: silence, noise, a hello without the key
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(c.store());
    let rdv = rt
        .block_on(
            store
                .backend
                .list(&store.keys.rendezvous("x", c.status("x").generation)),
        )
        .unwrap()
        .0;
    let addr = rdv
        .iter()
        .find(|kv| kv.key.ends_with("tcp/0"))
        .map(|kv| String::from_utf8(kv.value.clone()).unwrap())
        .unwrap_or_else(|| {
            panic!(
                "rank 0 published no mesh address: {:?}",
                rdv.iter().map(|kv| &kv.key).collect::<Vec<_>>()
            )
        });
    let _silent = std::net::TcpStream::connect(&addr);
    if let Ok(mut noise) = std::net::TcpStream::connect(&addr) {
        use std::io::Write;
        let _ = noise.write_all(&[0xFF; 64]);
    }
    if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
        let wrong = ductile_comm::auth::MeshKey::new(v.generation, &[0u8; 32]);
        let r = ductile_comm::auth::dial(
            &mut s,
            &wrong,
            ductile_comm::tcp::MAGIC,
            (1, 0, 2),
            S::from_secs(10),
        );
        assert!(r.is_err(), "a hello without the generation's key got in");
    }
    // (connections refused outright are refusals too: a formed mesh accepts no one)

    // the hostile frame fails that communicator, not the job: the generation that follows
    // names it (the same members again, or without the sender when its peer's report, which
    // names it, is in first), the receiver keeps its process, and the job trains on
    // (step 1000 comes some tens of seconds after the attacks above, later when the other
    // tests of this file load the machine: the bound is a liveness bound)
    let g = c.wait_for(
        S::from_secs(240),
        "a re-formation after the oversized frame",
        || c.history("x").into_iter().find(|g| g.number > v.generation),
    );
    assert!(
        g.detail.contains("4611686018427387904"),
        "the re-formation says what came: {}",
        g.detail
    );
    let step = c.status("x").step;
    let later = c.wait_step("x", step + 30, S::from_secs(60));
    assert!(later.generation >= g.number, "{later:?}");
    let receiver = pids[v.members.iter().position(|m| m.rank == 0).unwrap()];
    assert!(
        later.members.iter().any(|m| m.pid == Some(receiver)),
        "rank 0 kept its process: {later:?}"
    );
}

/// The API's request bodies, edited at random from valid ones (and random bytes), against a
/// running daemon: every answer is a success or a 4xx naming the problem, never a 5xx or a
/// dropped connection; the daemon keeps serving; the only jobs that exist afterwards are the
/// ones whose submission it accepted.
#[test]
fn fuzzed_api_request_bodies_get_clear_answers_and_change_only_what_they_were_accepted_for() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    use std::collections::BTreeSet;
    let c = Cluster::start(Spec::default().agents(1, 1));
    c.submit("name = \"x\"\ncommand = [\"sleep\", \"1000\"]\nmin = 1\nmax = 1\ndesired = 1\n");
    c.wait_world("x", 1, S::from_secs(30));
    let api = c.endpoint();
    let auth = format!("Bearer {TOKEN}");
    let toml = "name = \"fz\"\ncommand = [\"sleep\", \"5\"]\nmin = 1\nmax = 2\ndesired = 1\nrestart_budget = 1\nenv = { RUST_LOG = \"info\" }\n[checkpoint]\nurl = \"file:///tmp/fz\"\ninterval = 10\n";
    let json = r#"{"name":"fy","command":["sleep","5"],"min":1,"max":1,"desired":1,"training":{"model":"gpt","dataset":"file:///tmp/d","global_batch":8}}"#;
    // (path, content type, valid body)
    let targets: Vec<(String, &str, Vec<u8>)> = vec![
        (
            format!("{api}/v1/jobs"),
            "application/toml",
            toml.as_bytes().to_vec(),
        ),
        (
            format!("{api}/v1/jobs"),
            "application/json",
            json.as_bytes().to_vec(),
        ),
        (
            format!("{api}/v1/jobs/x/scale"),
            "application/json",
            br#"{"desired": 1}"#.to_vec(),
        ),
        (
            format!("{api}/v1/nodes/nope/drain"),
            "application/json",
            br#"{"reason": "r"}"#.to_vec(),
        ),
    ];
    let accepted = std::cell::RefCell::new(BTreeSet::from(["x".to_string()]));
    let tried = std::cell::Cell::new(0u32);
    let codes = std::cell::RefCell::new(std::collections::BTreeMap::<u16, u32>::new());
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases: 2000,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let edits = proptest::collection::vec((any::<usize>(), 0u8..3, any::<u8>()), 0..10);
    let raw = proptest::collection::vec(any::<u8>(), 0..200);
    let r = runner.run(
        &(0..targets.len(), edits, raw, any::<bool>()),
        |(t, e, raw, random)| {
            let (url, ct, base) = &targets[t];
            let body = if random {
                raw
            } else {
                ductile_cluster::fuzz::mutate(base, &e)
            };
            let (code, text) = http(
                "POST",
                url,
                &[("Content-Type", ct), ("Authorization", &auth)],
                &body,
            )
            .map_err(|e| TestCaseError::fail(format!("connection failed: {e}")))?;
            tried.set(tried.get() + 1);
            *codes.borrow_mut().entry(code).or_insert(0) += 1;
            prop_assert!(
                (200..500).contains(&code),
                "{code} for {} body {:?}: {text}",
                url,
                String::from_utf8_lossy(&body)
            );
            if code >= 400 {
                prop_assert!(!text.trim().is_empty(), "a {code} without a reason");
            }
            if code == 201 {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
                    if let Some(j) = v["job"].as_str() {
                        accepted.borrow_mut().insert(j.to_string());
                    }
                }
            }
            Ok(())
        },
    );
    r.unwrap();
    // a body that claims 16 GiB: read up to the limit (2 MiB), then refused
    {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(api.trim_start_matches("http://")).unwrap();
        s.set_read_timeout(Some(S::from_secs(20))).unwrap();
        let mut w = s.try_clone().unwrap();
        let head = format!(
            "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\nContent-Type: application/toml\r\nContent-Length: {}\r\n\r\n",
            1u64 << 34
        );
        let writer = std::thread::spawn(move || {
            let _ = w.write_all(head.as_bytes());
            for _ in 0..64 {
                // the daemon stops reading and answers; a write error then is expected
                if w.write_all(&[b'#'; 64 << 10]).is_err() {
                    return;
                }
            }
        });
        let mut answer = [0u8; 64];
        let n = s.read(&mut answer).unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]).into_owned();
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        drop(s);
        writer.join().unwrap();
    }
    let (code, _) = http("GET", &format!("{api}/healthz"), &[], b"").unwrap();
    assert_eq!(code, 200);
    let out = c.dctl_ok(&["status", "--json"]);
    let jobs: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let names: BTreeSet<String> = jobs
        .iter()
        .map(|j| j["job"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        names,
        *accepted.borrow(),
        "jobs exist only where a submission was accepted"
    );
    assert_eq!(c.status("x").state, JobState::Running);
    assert!(tried.get() >= 2000);
    // the edits reach past the parsers: some bodies are taken, most refused
    let codes = codes.into_inner();
    eprintln!(
        "answers by status: {codes:?}, jobs accepted: {:?}",
        accepted.borrow()
    );
    let refused: u32 = codes.range(400..500).map(|(_, n)| n).sum();
    assert!(
        refused >= 1000 && codes.keys().any(|c| *c < 300),
        "{codes:?}"
    );
}

/// A job whose mesh runs over TLS trains, loses a worker and re-forms over TLS, and finishes;
/// a cluster whose agents have no mesh certificate refuses such a job at submit.
#[test]
fn a_job_with_mesh_tls_trains_and_reforms_over_tls() {
    let c = Cluster::start(Spec {
        mesh_tls: true,
        ..Spec::default().agents(2, 2)
    });
    let data = synth(c.dir.path(), "tokens", 20_000);
    let job = |name: &str, max_steps: u64| {
        format!(
            "{}max_steps = {max_steps}\nmesh_tls = true\n",
            training_toml(name, 1, 3, 3, "gpt", &data, "restart_budget = 0")
        )
    };
    c.submit(&job("m", 600));
    let v = c.wait_world("m", 3, S::from_secs(60));
    c.wait_step("m", 50, S::from_secs(60));
    let victim = v.members.iter().find(|m| m.rank == 1).unwrap().pid.unwrap();
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    // the free fourth slot takes the lost one's place: a new mesh over TLS, with a newcomer
    let v2 = c.wait_for(S::from_secs(30), "a re-formed world of 3", || {
        Some(c.wait_world("m", 3, S::from_secs(30))).filter(|v| v.generation >= 2)
    });
    assert!(v2.members.iter().all(|m| m.pid != Some(victim)), "{v2:?}");
    let done = c.wait_done("m", S::from_secs(240));
    assert!(done.generation >= 2, "{done:?}");
    let logs = c.logs();
    let handshakes: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("TLS handshake:"))
        .collect();
    assert!(handshakes.is_empty(), "a handshake failed: {handshakes:#?}");

    // agents without a mesh certificate: the job is refused at submit, naming why
    let plain = Cluster::start(Spec::default().agents(1, 1));
    // (a cluster with no agent registered yet refuses nothing: wait for it)
    plain.wait_for(S::from_secs(20), "the agent to register", || {
        let (ok, out, _) = plain.dctl(&["nodes"]);
        (ok && out.contains("node1")).then_some(())
    });
    let p = plain.dir.path().join("m.toml");
    std::fs::write(&p, job("m2", 10)).unwrap();
    let (ok, _, err) = plain.dctl(&["submit", p.to_str().unwrap()]);
    assert!(!ok && err.contains("mesh_tls"), "{err}");
}

/// With `worker_user`, a job's workers run as that user, not as the agent's: the agent's own
/// files (its etcd credentials, mode 600) are out of their reach. An agent that cannot switch
/// users refuses to start, saying so.
#[test]
fn workers_run_as_the_worker_user_not_as_the_agent() {
    let nobody = std::fs::read_to_string("/etc/passwd")
        .unwrap()
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f[0] == "nobody").then(|| f[2].parse::<u32>().unwrap())
        })
        .expect("a nobody user");
    let mut c = Cluster::start(Spec::default());
    let etcd = c.etcd.endpoint.clone();
    let agent_as = |user: &str| {
        std::process::Command::new(bin("ductile-agent"))
            .args(["--etcd", &etcd, "--node", "n", "--worker-user", user])
            .output()
            .unwrap()
    };
    let root = unsafe { libc::geteuid() } == 0;
    // an agent that cannot switch users refuses to start, naming what it lacks: run here as
    // nobody (through setpriv when this test runs as root)
    let out = if root {
        // a copy nobody may run (the build's directory is root's own)
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("ductile-as-nobody-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let agent = dir.join("ductile-agent");
        std::fs::copy(bin("ductile-agent"), &agent).unwrap();
        std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::process::Command::new("setpriv")
            .args([
                "--reuid",
                &nobody.to_string(),
                "--regid",
                &nobody.to_string(),
                "--clear-groups",
                "--inh-caps=-all",
            ])
            .arg(&agent)
            // another unprivileged user than its own: switching needs root or CAP_SETUID
            .args(["--etcd", &etcd, "--node", "n", "--worker-user", "daemon"])
            .output()
            .unwrap()
    } else {
        agent_as("nobody")
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("CAP_SETUID"), "{err}");
    assert!(
        root,
        "the rest of this test starts an agent that switches its workers to nobody: it needs root (CI runs as root)"
    );
    c.start_agent("node1", 1, &["--worker-user", "nobody"]);
    c.submit("name = \"u\"\ncommand = [\"sleep\", \"1000\"]\nmin = 1\nmax = 1\ndesired = 1\n");
    let v = c.wait_world("u", 1, S::from_secs(30));
    let pid = v.members[0].pid.unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uids: Vec<u32> = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .unwrap()
        .split_whitespace()
        .map(|u| u.parse().unwrap())
        .collect();
    assert_eq!(
        uids,
        vec![nobody; 4],
        "real, effective, saved and fs uid: {status}"
    );
    let caps = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap()
        .trim()
        .to_string();
    assert_eq!(
        u64::from_str_radix(&caps, 16).unwrap(),
        0,
        "the worker holds no capability"
    );
    // a root user is refused as a worker user
    let out = agent_as("root");
    assert!(String::from_utf8_lossy(&out.stderr).contains("it is root"));
}

/// With etcd's TLS and auth (each daemon its own etcd user), the standby still takes over when
/// the leader is SIGKILLed, and the new leader re-forms a job that lost a node.
#[test]
fn with_etcd_auth_the_standby_leads_after_the_leader_is_killed() {
    let mut c = Cluster::start(Spec {
        secure_etcd: true,
        daemons: 2,
        // the shipped default: campaign calls time out and are made again meanwhile
        election_ttl: 5,
        ..Spec::default().agents(2, 1)
    });
    c.submit(&job_toml("fo", 1, 2, 2));
    c.wait_world("fo", 2, S::from_secs(30));
    // a standby that campaigned for a while (its campaign calls run out of request time and
    // are made again) before the leader goes
    std::thread::sleep(S::from_secs(12));
    let (_, second, took) = c.kill_leader();
    assert!(took <= S::from_secs(10), "{second} led after {took:?}");
    c.agents.get_mut("node2").unwrap().kill();
    c.wait_world("fo", 1, S::from_secs(20));
}

//! The shipped systemd units pass `systemd-analyze verify` without a warning, and the example
//! configs are accepted by the programs they configure.

use std::path::Path;
use std::process::Command;

use ductile_tests::{bin, TempDir};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

#[test]
fn units_verify_cleanly() {
    let dir = TempDir::new("units");
    for (unit, binary) in [
        ("ductile-daemon.service", "ductiled"),
        ("ductile-agent.service", "ductile-agent"),
    ] {
        let text = std::fs::read_to_string(root().join("systemd").join(unit)).unwrap();
        assert!(
            text.contains("Type=notify")
                && text.contains("WatchdogSec=")
                && text.contains("Restart=on-failure"),
            "{unit}"
        );
        // point ExecStart at the built binary so verify can check it is executable
        let text = text.replace(
            &format!("/usr/local/bin/{binary}"),
            bin(binary).to_str().unwrap(),
        );
        let path = dir.path().join(unit);
        std::fs::write(&path, text).unwrap();
        let out = Command::new("systemd-analyze")
            .arg("verify")
            .arg(&path)
            .output()
            .expect("systemd-analyze (installed by scripts/setup.sh)");
        let stderr = String::from_utf8_lossy(&out.stderr);
        // verify exits 0 on unknown keys and bad values, printing a warning: treat any as failure
        let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains(unit)).collect();
        assert!(
            out.status.success() && warnings.is_empty(),
            "{unit}: {stderr}"
        );
    }
    // the agent's unit must leave GPUs reachable
    let agent = std::fs::read_to_string(root().join("systemd/ductile-agent.service")).unwrap();
    for forbidden in [
        "PrivateDevices=yes",
        "DevicePolicy=closed",
        "MemoryDenyWriteExecute=yes",
    ] {
        assert!(
            !agent.contains(forbidden),
            "the agent unit must not set {forbidden}"
        );
    }
}

#[test]
fn verify_catches_a_broken_unit() {
    // the check above can fail: a unit with an unknown key produces a warning
    let dir = TempDir::new("badunit");
    let path = dir.path().join("bad.service");
    std::fs::write(
        &path,
        format!(
            "[Service]\nType=notify\nExecStart={}\nNoSuchKey=1\n",
            bin("ductiled").display()
        ),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("NoSuchKey"));
}

#[test]
fn example_configs_are_accepted() {
    let dir = TempDir::new("cfg");
    // the daemon reads its config and only then needs etcd: an unreachable etcd proves the
    // config parsed and validated
    let token = dir.path().join("token");
    std::fs::write(&token, "an-example-token").unwrap();
    let read_token = dir.path().join("read-token");
    std::fs::write(&read_token, "an-example-read-token").unwrap();
    let pki = ductile_tests::make_pki(dir.path());
    // the examples reach etcd over TLS with a user: their files, from scripts/secure.sh's
    // certificates and a password each
    for who in ["daemon", "agent"] {
        std::fs::write(pki.join(format!("{who}.password")), "an-example-password").unwrap();
    }
    let daemon_cfg = std::fs::read_to_string(root().join("systemd/daemon.toml"))
        .unwrap()
        .replace("/etc/ductile/read-token", read_token.to_str().unwrap())
        .replace("/etc/ductile/token", token.to_str().unwrap())
        .replace("/etc/ductile/tls", pki.to_str().unwrap())
        .replace("/etc/ductile/etcd", pki.to_str().unwrap());
    let p = dir.path().join("daemon.toml");
    std::fs::write(&p, daemon_cfg).unwrap();
    let port = ductile_tests::free_port();
    let out = Command::new(bin("ductiled"))
        .args([
            "--config",
            p.to_str().unwrap(),
            "--etcd",
            &format!("https://127.0.0.1:{port}"),
            "--etcd-wait",
            "1",
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach etcd"), "{err}");
    let shipped = std::fs::read_to_string(root().join("systemd/agent.toml")).unwrap();
    // secure by default: jobs run as their own user, only ductile-worker runs, notices are read
    for line in [
        "job_users = \"70000-79999\"",
        "job_group = \"ductile-worker\"",
        "allowed_commands = [\"ductile-worker\"]",
        "spot_notice = \"auto\"",
    ] {
        assert!(
            shipped.lines().any(|l| l.starts_with(line)),
            "agent.toml lacks {line}"
        );
    }
    // (this machine has no ductile-worker group: the package makes it)
    let agent_cfg = shipped
        .replace("job_group = \"ductile-worker\"", "# job_group")
        .replace("/etc/ductile/etcd", pki.to_str().unwrap());
    let a = dir.path().join("agent.toml");
    std::fs::write(&a, &agent_cfg).unwrap();
    let out = Command::new(bin("ductile-agent"))
        .args([
            "--config",
            a.to_str().unwrap(),
            "--etcd",
            &format!("https://127.0.0.1:{port}"),
            "--etcd-wait",
            "1",
            "--node",
            "n1",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach etcd"), "{err}");
    // an etcd off loopback without TLS and auth is refused at start, before any connection,
    // saying why and how to run so anyway (that --insecure-etcd lets it through is checked in
    // cluster::access's unit test: no test here sends traffic off loopback)
    let plain = dir.path().join("plain.toml");
    std::fs::write(&plain, "etcd = \"http://10.255.255.1:2379\"\n").unwrap();
    let out = Command::new(bin("ductile-agent"))
        .args([
            "--config",
            plain.to_str().unwrap(),
            "--etcd-wait",
            "1",
            "--node",
            "n1",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("not on loopback") && err.contains("--insecure-etcd"),
        "{err}"
    );
    let out = Command::new(bin("ductiled"))
        .args([
            "--etcd",
            "http://10.255.255.1:2379",
            "--listen",
            "127.0.0.1:0",
            "--insecure-http",
            "--token-file",
            token.to_str().unwrap(),
            "--etcd-wait",
            "1",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not on loopback") && err.contains("--insecure-etcd"),
        "{err}"
    );
    // and a config with an unknown key is refused, naming it
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "etcd = \"http://x\"\ncolour = 1\n").unwrap();
    let out = Command::new(bin("ductile-agent"))
        .args(["--config", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `colour`"));
}

/// `ductile-admin init` makes a cluster that runs as it is: its etcd member's settings start a
/// real etcd (TLS, client certificates), `etcd-auth` makes the users and enables auth, and a
/// daemon and an agent started with the configs it wrote (paths moved from /etc into the
/// bundles) pass their `--check`, register over TLS as their own etcd users, and run a job that
/// dctl submits over TLS with the admin token it made. No host bundle holds the CA's key, and
/// each node's certificate is its own.
#[test]
fn ductile_admin_init_makes_a_cluster_that_runs_a_job_over_tls() {
    use ductile_tests::{free_port, Proc};
    use std::time::{Duration, Instant};
    let dir = TempDir::new("admin");
    let out = dir.path().join("cluster");
    let (ep, pp, api) = (free_port(), free_port(), free_port());
    let admin = root().join("scripts/ductile-admin");
    let run = Command::new(&admin)
        .args([
            "init",
            "--out",
            out.to_str().unwrap(),
            "--etcd",
            "e1=127.0.0.1",
            "--daemons",
            "d1=127.0.0.1",
            "--nodes",
            "n1=127.0.0.1,n2=127.0.0.1",
            "--etcd-port",
            &ep.to_string(),
            "--etcd-peer-port",
            &pp.to_string(),
            "--api-port",
            &api.to_string(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{err}");
    assert!(
        err.contains("etcd does not answer"),
        "init says what to do next: {err}"
    );
    // a second init into the same directory changes nothing
    let again = Command::new(&admin)
        .args([
            "init",
            "--out",
            out.to_str().unwrap(),
            "--etcd",
            "e1",
            "--daemons",
            "d1",
            "--nodes",
            "n1",
        ])
        .output()
        .unwrap();
    assert!(
        !again.status.success() && String::from_utf8_lossy(&again.stderr).contains("already holds")
    );
    let hosts = out.join("hosts");
    let keys = |h: &str| -> Vec<String> {
        let mut v = Vec::new();
        let mut stack = vec![hosts.join(h)];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                if e.path().is_dir() {
                    stack.push(e.path());
                } else {
                    v.push(std::fs::read_to_string(e.path()).unwrap_or_default());
                }
            }
        }
        v
    };
    let ca_key = std::fs::read_to_string(out.join("ca/ca-key.pem")).unwrap();
    for h in ["e1", "d1", "n1", "n2"] {
        assert!(!keys(h).contains(&ca_key), "bundle {h} holds the CA's key");
    }
    let n1_key = std::fs::read_to_string(hosts.join("n1/etc/ductile/etcd/agent-key.pem")).unwrap();
    assert!(!keys("n2").contains(&n1_key), "n2's bundle holds n1's key");
    // the bundles' /etc paths, here
    let moved = |h: &str, file: &str| -> String {
        std::fs::read_to_string(hosts.join(h).join(file))
            .unwrap()
            .replace(
                "/etc/ductile",
                hosts.join(h).join("etc/ductile").to_str().unwrap(),
            )
    };
    // etcd with the member's settings (Debian's /etc/default/etcd: ETCD_* variables)
    let mut env: Vec<(String, String)> = moved("e1", "etc/default/etcd")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for (k, v) in env.iter_mut() {
        if k == "ETCD_DATA_DIR" {
            *v = dir.path().join("etcd-data").display().to_string();
        }
    }
    let etcd_bin = std::env::var("DUCTILE_ETCD_BIN").unwrap_or_else(|_| "etcd".into());
    let _etcd = Proc::start(
        "etcd",
        std::path::Path::new(&etcd_bin),
        &[],
        &env,
        dir.path().join("etcd.log"),
    );
    let auth = Command::new(&admin)
        .args(["etcd-auth", out.to_str().unwrap(), "--etcd-wait", "30"])
        .output()
        .unwrap();
    assert!(
        auth.status.success(),
        "{}",
        String::from_utf8_lossy(&auth.stderr)
    );
    assert!(String::from_utf8_lossy(&auth.stderr).contains("auth enabled"));
    // the daemon and the agent from the configs init wrote
    let dcfg = dir.path().join("daemon.toml");
    std::fs::write(&dcfg, moved("d1", "etc/ductile/daemon.toml")).unwrap();
    let daemon_args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = vec![
            "--config".into(),
            dcfg.display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{api}"),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let check = Command::new(bin("ductiled"))
        .args(daemon_args(&["--check", "--check-host", "127.0.0.1,d1"]))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{text}");
    assert!(
        text.contains("names 127.0.0.1")
            && text.contains("names d1")
            && text.contains("user ductile-daemon-d1 reads"),
        "{text}"
    );
    let _daemon = Proc::start(
        "d1",
        &bin("ductiled"),
        &daemon_args(&["--id", "d1"]),
        &[],
        dir.path().join("d1.log"),
    );
    let acfg = dir.path().join("agent.toml");
    let tmp = std::env::temp_dir().display().to_string();
    std::fs::write(
        &acfg,
        moved("n1", "etc/ductile/agent.toml")
            // this machine has no ductile-worker user (the package makes it), and its tests'
            // agents never probe a cloud
            // this build's binaries and libtorch lie under root's home (mode 700), where a
            // job's own user could not run them: the test's jobs run as the agent's user
            .replace("job_users = \"70000-79999\"", "# job_users")
            .replace("job_group = \"ductile-worker\"", "# job_group")
            .replace(
                "allowed_paths = [\"/var/lib/ductile/jobs\"]",
                &format!("allowed_paths = [\"{tmp}\"]"),
            )
            .replace("spot_notice = \"auto\"", "spot_notice = \"off\""),
    )
    .unwrap();
    let agent_args: Vec<String> = [
        "--config",
        acfg.to_str().unwrap(),
        "--gpus",
        "off",
        "--cpu-slots",
        "2",
        "--work-root",
        dir.path().join("work").to_str().unwrap(),
        "--log-dir",
        dir.path().join("logs").to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut check_args = agent_args.clone();
    check_args.push("--check".into());
    let check = Command::new(bin("ductile-agent"))
        .args(&check_args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{text}");
    assert!(
        text.contains("user ductile-agent-n1 reads") && text.contains("ok   clock"),
        "{text}"
    );
    let _agent = Proc::start(
        "n1",
        &bin("ductile-agent"),
        &agent_args,
        &[],
        dir.path().join("n1.log"),
    );
    // dctl with what init made for the admin (dctl.env: endpoint, CA, token file)
    let dctl_env: Vec<(String, String)> = std::fs::read_to_string(out.join("admin/dctl.env"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let dctl = |args: &[&str]| {
        let o = Command::new(bin("dctl"))
            .args(args)
            .env_remove("DCTL_TOKEN")
            .envs(dctl_env.iter().cloned())
            .env("HOME", dir.path())
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).to_string(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let t0 = Instant::now();
    while !dctl(&["nodes"]).1.contains("n1") {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "n1 never registered: {:?}",
            dctl(&["nodes"])
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let job = dir.path().join("job.toml");
    std::fs::write(&job, "name = \"boot\"\nmin = 1\nmax = 2\ndesired = 2\n").unwrap();
    let (ok, _, err) = dctl(&["submit", job.to_str().unwrap()]);
    assert!(ok, "{err}");
    let t0 = Instant::now();
    loop {
        let (_, out, _) = dctl(&["status", "boot", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        if v["world_size"] == 2
            && v["members"]
                .as_array()
                .is_some_and(|m| m.iter().all(|m| !m["pid"].is_null()))
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the job never ran at world 2: {out}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // without the token, the API refuses
    let o = Command::new(bin("dctl"))
        .args(["nodes"])
        .env_remove("DCTL_TOKEN_FILE")
        .env_remove("DCTL_TOKEN")
        .envs(
            dctl_env
                .iter()
                .filter(|(k, _)| k != "DCTL_TOKEN_FILE")
                .cloned(),
        )
        .env("HOME", dir.path())
        .output()
        .unwrap();
    assert!(!o.status.success());
}

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
        "worker_user = \"ductile-worker\"",
        "allowed_commands = [\"ductile-worker\"]",
        "spot_notice = \"auto\"",
    ] {
        assert!(shipped.lines().any(|l| l.starts_with(line)), "agent.toml lacks {line}");
    }
    // (this machine has no ductile-worker user: the package makes it)
    let agent_cfg = shipped
        .replace("worker_user = \"ductile-worker\"", "# worker_user")
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

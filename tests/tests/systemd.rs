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
    let daemon_cfg = std::fs::read_to_string(root().join("systemd/daemon.toml"))
        .unwrap()
        .replace("/etc/ductile/read-token", read_token.to_str().unwrap())
        .replace("/etc/ductile/token", token.to_str().unwrap())
        .replace("/etc/ductile/tls", pki.to_str().unwrap());
    let p = dir.path().join("daemon.toml");
    std::fs::write(&p, daemon_cfg).unwrap();
    let port = ductile_tests::free_port();
    let out = Command::new(bin("ductiled"))
        .args([
            "--config",
            p.to_str().unwrap(),
            "--etcd",
            &format!("http://127.0.0.1:{port}"),
            "--etcd-wait",
            "1",
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach etcd"), "{err}");
    let out = Command::new(bin("ductile-agent"))
        .args([
            "--config",
            root().join("systemd/agent.toml").to_str().unwrap(),
            "--etcd",
            &format!("http://127.0.0.1:{port}"),
            "--etcd-wait",
            "1",
            "--node",
            "n1",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach etcd"), "{err}");
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

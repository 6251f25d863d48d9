//! `ductile-agent --check`: this node as the agent would run it (see
//! [`ductile_cluster::check`]).

use std::time::{Duration, Instant};

use ductile_cluster::check::Report;

use crate::config::Config;
use crate::preempt::Source;

pub async fn run(cfg: &Config) -> Report {
    let mut r = Report::default();
    r.ok(
        "config",
        format!(
            "loads; node {:?}, {} slot(s) offered when there is no GPU",
            cfg.node, cfg.cpu_slots
        ),
    );
    for (what, p) in [
        ("etcd_ca", cfg.etcd.ca.as_ref()),
        ("etcd_cert", cfg.etcd.cert.as_ref()),
        ("etcd_key", cfg.etcd.key.as_ref()),
        (
            "etcd_worker_cert",
            cfg.etcd_worker_client.as_ref().map(|(c, _)| c),
        ),
        (
            "etcd_worker_key",
            cfg.etcd_worker_client.as_ref().map(|(_, k)| k),
        ),
        ("mesh_tls_ca", cfg.mesh_tls.as_ref().map(|m| &m[0])),
        ("mesh_tls_cert", cfg.mesh_tls.as_ref().map(|m| &m[1])),
        ("mesh_tls_key", cfg.mesh_tls.as_ref().map(|m| &m[2])),
        ("torchft_ca", cfg.torchft_ca.as_ref()),
    ] {
        if let Some(p) = p {
            r.readable(what, p);
        }
    }
    match (&cfg.job_users, &cfg.worker_user) {
        (Some(range), _) => {
            let caps = nix::unistd::geteuid().is_root() || crate::config::has_caps(1 | 1 << 6 | 1 << 7);
            r.ok(
                "job_users",
                format!(
                    "each job runs as a user of its own, uids {}-{}{}",
                    range.first,
                    range.first + range.count - 1,
                    if caps {
                        ""
                    } else {
                        "; this check ran without CAP_SETUID, CAP_SETGID and CAP_CHOWN, which the agent's unit gives it (AmbientCapabilities)"
                    }
                ),
            )
        }
        (None, Some((name, uid, _))) => {
            if crate::config::can_switch_users() {
                r.ok("worker_user", format!("jobs run as {name} (uid {uid})"))
            } else {
                r.ok(
                    "worker_user",
                    format!(
                        "jobs run as {name} (uid {uid}); this check ran without CAP_SETUID and CAP_SETGID, which the agent's unit gives it (AmbientCapabilities)"
                    ),
                )
            }
        }
        (None, None) => r.ok(
            "job_users",
            "not set: jobs run as the agent's own user and can read its files and each other's (set job_users)",
        ),
    }
    for (what, dir) in [("work_root", &cfg.work_root), ("log_dir", &cfg.log_dir)] {
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => r.ok(what, format!("{} exists", dir.display())),
            Ok(_) => r.fail(what, format!("{} is not a directory", dir.display())),
            // the agent makes it where its parent is there
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    && dir.parent().is_some_and(|p| p.is_dir()) =>
            {
                r.ok(
                    what,
                    format!("{} is not there yet: the agent makes it", dir.display()),
                )
            }
            Err(e) => r.fail(
                what,
                format!(
                    "{}: {e} (the package makes /var/lib/ductile/work and logs)",
                    dir.display()
                ),
            ),
        }
    }
    worker_starts(&mut r, cfg);
    r.etcd(&cfg.etcd, &cfg.prefix).await;
    r.clock(&cfg.etcd).await;
    match &cfg.spot.source {
        Source::Off => r.ok("spot_notice", "off: preemption notices are not read"),
        Source::Url(u) => r.ok("spot_notice", format!("polling {u}")),
        Source::Cloud(c) => r.ok(
            "spot_notice",
            format!("reading {}'s notices at {}", c.name(), cfg.spot.endpoint),
        ),
        Source::Auto => match crate::preempt::detect(cfg.spot.endpoint.trim_end_matches('/')).await
        {
            Ok(c) => r.ok("spot_notice", format!("auto: this node is on {}", c.name())),
            Err(why) => r.ok(
                "spot_notice",
                format!(
                    "auto: no cloud metadata service answers ({why}): notices are off on this node"
                ),
            ),
        },
    }
    r
}

/// `ductile-worker --version` starts, with the libtorch the agent would give it.
fn worker_starts(r: &mut Report, cfg: &Config) {
    let worker = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("ductile-worker")))
        .filter(|p| p.exists())
        .unwrap_or_else(|| "ductile-worker".into());
    let mut cmd = std::process::Command::new(&worker);
    cmd.arg("--version")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    if let Some(lib) = &cfg.libtorch {
        let cur = std::env::var("LD_LIBRARY_PATH").ok();
        cmd.env(
            "LD_LIBRARY_PATH",
            crate::libtorch::library_path(lib, cur.as_deref()),
        );
    }
    let from = match &cfg.libtorch {
        Some(l) => format!("libtorch from {}", l.display()),
        None => {
            "no libtorch configured (libtorch, torch_python): the binary's own search path".into()
        }
    };
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return r.fail("libtorch", format!("cannot run {}: {e}", worker.display())),
    };
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(30) {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if matches!(child.try_wait(), Ok(None)) {
        let _ = child.kill();
        let _ = child.wait();
        return r.fail(
            "libtorch",
            format!("{} --version did not finish within 30 s", worker.display()),
        );
    }
    match child.wait_with_output() {
        Ok(o) if o.status.success() => r.ok(
            "libtorch",
            format!(
                "{} starts ({}) with {from}",
                worker.display(),
                String::from_utf8_lossy(&o.stdout).trim()
            ),
        ),
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            let last = err.lines().last().unwrap_or("").trim();
            r.fail(
                "libtorch",
                format!(
                    "{} does not start with {from}: {last}{}",
                    worker.display(),
                    if last.contains("shared object") || last.contains("shared librar") {
                        " (set libtorch = \"DIR\" or torch_python = \"PYTHON\" in agent.toml: a libtorch or torch 2.11.0)"
                    } else {
                        ""
                    }
                ),
            )
        }
        Err(e) => r.fail("libtorch", format!("{}: {e}", worker.display())),
    }
}

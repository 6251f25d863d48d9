//! Process plumbing shared by the daemon, the agent and the worker: logging, systemd
//! notification, and shutdown on signals.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Log format of a service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Plain,
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "plain" => Ok(LogFormat::Plain),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("log format {other:?} is not plain or json")),
        }
    }
}

/// Logs to stderr; the level comes from `RUST_LOG` (default `info`).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    let _ = match format {
        LogFormat::Plain => b.with_ansi(false).try_init(),
        LogFormat::Json => b.json().flatten_event(true).try_init(),
    };
}

/// Tells systemd about this service (`Ready`, `Watchdog`, `Status(..)`, `Stopping`) when it was
/// started by it (`NOTIFY_SOCKET` set); does nothing otherwise. Through the `sd-notify` crate
/// (which speaks to a socket path, as systemd's units set it; not to abstract sockets).
pub fn sd_notify(states: &[sd_notify::NotifyState]) {
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::debug!(error = %e, "sd_notify failed");
    }
}

pub use sd_notify::NotifyState;

/// The watchdog interval systemd asked for (half of `WATCHDOG_USEC`), if any. A
/// `WATCHDOG_PID` naming another process means the watchdog is not ours.
pub fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Some(pid) = std::env::var("WATCHDOG_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
    {
        if pid != std::process::id() {
            return None;
        }
    }
    Some(Duration::from_micros(usec / 2))
}

/// SIGHUP (`systemctl reload`): each one calls `load` (a service's configuration read again, on
/// the blocking pool) and sends what it gave on the returned channel, an error included (the
/// service keeps what is in force then). Without this a SIGHUP would end the process.
pub fn reload_on_sighup<T: Send + 'static>(
    load: fn() -> anyhow::Result<T>,
) -> tokio::sync::mpsc::Receiver<anyhow::Result<T>> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            tracing::error!("cannot install the SIGHUP handler: reload by restarting");
            return;
        };
        while hup.recv().await.is_some() {
            tracing::info!("SIGHUP: reading the configuration again");
            let new = tokio::task::spawn_blocking(load)
                .await
                .map_err(anyhow::Error::from)
                .and_then(|r| r);
            if tx.send(new).await.is_err() {
                return;
            }
        }
    });
    rx
}

/// A token cancelled on the first SIGTERM or SIGINT (drain); a second one exits at once with
/// status 130.
pub fn shutdown_on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        let mut count = 0;
        loop {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            count += 1;
            if count == 1 {
                tracing::info!("signal received: shutting down (send again to force)");
                t.cancel();
            } else {
                tracing::warn!("second signal: exiting now");
                std::process::exit(130);
            }
        }
    });
    token
}

/// Print an error and its whole source chain.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Read a service's TOML config file (the defaults when `path` is None); the error names the
/// file and, for an unknown or bad key, the key.
/// A service's config file, with its etcd settings (`etcd`, `etcd_ca`, ...) read apart into
/// [`crate::access::EtcdFileArgs`] and the rest into the service's own `T`.
pub fn read_service_config<T: serde::de::DeserializeOwned + Default>(
    path: Option<&std::path::Path>,
) -> Result<(T, crate::access::EtcdFileArgs), String> {
    let Some(p) = path else {
        return Ok(Default::default());
    };
    let mut table: toml::Table = read_toml_config(Some(p))?;
    let mut etcd = toml::Table::new();
    for k in crate::access::EtcdFileArgs::KEYS {
        if let Some(v) = table.remove(k) {
            etcd.insert(k.to_string(), v);
        }
    }
    let what = |e: toml::de::Error| format!("config {}: {}", p.display(), e.message());
    Ok((
        serde::Deserialize::deserialize(table).map_err(what)?,
        serde::Deserialize::deserialize(etcd).map_err(what)?,
    ))
}

pub fn read_toml_config<T: serde::de::DeserializeOwned + Default>(
    path: Option<&std::path::Path>,
) -> Result<T, String> {
    let Some(p) = path else {
        return Ok(T::default());
    };
    let text = std::fs::read_to_string(p)
        .map_err(|e| format!("cannot read config {}: {e}", p.display()))?;
    toml::from_str(&text).map_err(|e| format!("config {}: {}", p.display(), e.message()))
}

#[cfg(test)]
mod config_tests {
    #[derive(serde::Deserialize, Default, Debug)]
    #[serde(deny_unknown_fields)]
    struct Own {
        listen: Option<String>,
    }

    #[test]
    fn a_service_config_splits_into_its_own_keys_and_the_etcd_ones_and_refuses_strangers() {
        let dir = std::env::temp_dir().join(format!("ductile-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("c.toml");
        std::fs::write(
            &p,
            "etcd = \"https://e:2379\"\netcd_ca = \"/ca.pem\"\nlisten = \"127.0.0.1:1\"\n",
        )
        .unwrap();
        let (own, etcd): (Own, _) = super::read_service_config(Some(&p)).unwrap();
        assert_eq!(own.listen.as_deref(), Some("127.0.0.1:1"));
        assert_eq!(etcd.etcd.as_deref(), Some("https://e:2379"));
        assert_eq!(etcd.etcd_ca, Some("/ca.pem".into()));
        std::fs::write(&p, "colour = 1\n").unwrap();
        let e = super::read_service_config::<Own>(Some(&p)).unwrap_err();
        assert!(e.contains("unknown field `colour`"), "{e}");
        std::fs::write(&p, "etcd_user = 7\n").unwrap();
        let e = super::read_service_config::<Own>(Some(&p)).unwrap_err();
        assert!(e.contains("c.toml"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }
}

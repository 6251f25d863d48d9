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

//! ductiled's configuration: flags (and `DUCTILE_*` environment) over a TOML file over
//! defaults, validated after merging.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use ductile_cluster::service::LogFormat;
use serde::Deserialize;

pub use ductile_cluster::access::Secret;
use ductile_cluster::access::{EtcdAccess, EtcdArgs};

#[derive(Parser, Debug)]
#[command(
    name = "ductiled",
    version,
    about = "ductile control-plane daemon: leader election, reconcile, API"
)]
pub struct Cli {
    /// Check this replica instead of running: the config, the files it names, the API's
    /// certificate against this host's names (or --check-host), etcd and the clock; prints what
    /// is wrong in plain words and exits 1 if anything is (run it as the service's user).
    #[arg(long)]
    pub check: bool,
    /// The names clients reach this API at, for --check (default: this host's name, and the
    /// listen address where it names one).
    #[arg(long, value_delimiter = ',')]
    pub check_host: Vec<String>,
    #[command(flatten)]
    pub etcd_access: EtcdArgs,
    /// Address the API listens on.
    #[arg(long, env = "DUCTILE_LISTEN")]
    pub listen: Option<String>,
    /// File holding the API bearer token (or set DUCTILE_TOKEN).
    #[arg(long, env = "DUCTILE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// File holding the read-only API token (or set DUCTILE_READ_TOKEN): status, nodes, events,
    /// watch, checkpoints, plans and metrics, never submit, scale, drain or stop.
    #[arg(long, env = "DUCTILE_READ_TOKEN_FILE")]
    pub read_token_file: Option<PathBuf>,
    /// Tenants' tokens, each for the jobs under its own name prefix (TOML: see
    /// daemon/src/tenants.rs and docs/security.md, "Tenants"); re-read on SIGHUP.
    #[arg(long, env = "DUCTILE_TENANTS_FILE")]
    pub tenants_file: Option<PathBuf>,
    /// `/metrics` asks for a token (the read-only or the admin one); default: true unless the
    /// API listens on loopback only.
    #[arg(long, env = "DUCTILE_METRICS_NEED_TOKEN")]
    pub metrics_need_token: Option<bool>,
    /// Reads (GET: the dashboard, status, series, metrics) need no token. Only with plain HTTP
    /// on a loopback address (`insecure_http`): a local cluster's dashboard opens as it is.
    #[arg(long, env = "DUCTILE_READS_WITHOUT_TOKEN")]
    pub reads_without_token: Option<bool>,
    /// The API's TLS certificate chain (PEM).
    #[arg(long, env = "DUCTILE_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The API certificate's private key (PEM).
    #[arg(long, env = "DUCTILE_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Serve the API over plain HTTP, on a loopback address only (no TLS certificate).
    #[arg(long, env = "DUCTILE_INSECURE_HTTP")]
    pub insecure_http: bool,
    /// TOML config file; flags override it.
    #[arg(long, env = "DUCTILE_CONFIG")]
    pub config: Option<PathBuf>,
    /// etcd key prefix.
    #[arg(long, env = "DUCTILE_PREFIX")]
    pub prefix: Option<String>,
    /// TTL in seconds of the election lease (a standby takes over within it).
    #[arg(long, env = "DUCTILE_ELECTION_TTL")]
    pub election_ttl: Option<i64>,
    /// Debounce window for joins, in milliseconds.
    #[arg(long, env = "DUCTILE_DEBOUNCE_MS")]
    pub debounce_ms: Option<u64>,
    /// This replica's name in the election.
    #[arg(long, env = "DUCTILE_ID")]
    pub id: Option<String>,
    /// plain or json.
    #[arg(long, env = "DUCTILE_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// How long to wait for etcd at start-up, in seconds.
    #[arg(long, env = "DUCTILE_ETCD_WAIT")]
    pub etcd_wait: Option<u64>,
    /// Serve TorchFT's lighthouse (gRPC `torchft.LighthouseService`) on this address: every
    /// replica serves it, the leader decides the quorums.
    #[arg(long, env = "DUCTILE_TORCHFT_LISTEN")]
    pub torchft_listen: Option<String>,
    /// Where torchft jobs' launchers reach this replica's lighthouse (HOST:PORT), published in
    /// etcd; the listen address when it names a host (required with 0.0.0.0 or [::]).
    #[arg(long, env = "DUCTILE_TORCHFT_ADVERTISE")]
    pub torchft_advertise: Option<String>,
    /// The lighthouse's `min_replicas` (as `torchft_lighthouse --min_replicas`).
    #[arg(long, env = "DUCTILE_TORCHFT_MIN_REPLICAS")]
    pub torchft_min_replicas: Option<u64>,
    /// How long a quorum waits for heartbeating stragglers, in ms (`--join_timeout_ms`).
    #[arg(long, env = "DUCTILE_TORCHFT_JOIN_TIMEOUT_MS")]
    pub torchft_join_timeout_ms: Option<u64>,
    /// How often the leader looks for a quorum while waiting, in ms (`--quorum_tick_ms`).
    #[arg(long, env = "DUCTILE_TORCHFT_QUORUM_TICK_MS")]
    pub torchft_quorum_tick_ms: Option<u64>,
    /// How long without a heartbeat a replica counts as dead, in ms (`--heartbeat_timeout_ms`).
    #[arg(long, env = "DUCTILE_TORCHFT_HEARTBEAT_TIMEOUT_MS")]
    pub torchft_heartbeat_timeout_ms: Option<u64>,
    /// Serve the shared default room to clients that name no job (as `torchft_lighthouse`
    /// does; unauthenticated, so off unless an operator turns it on for a trusted network).
    #[arg(long, env = "DUCTILE_TORCHFT_DEFAULT_ROOM")]
    pub torchft_default_room: bool,
    /// Serve the lighthouse over TLS with this certificate chain (PEM; with
    /// --torchft-tls-key): the launchers' relays speak TLS to it (their agents' --torchft-ca).
    #[arg(long, env = "DUCTILE_TORCHFT_TLS_CERT")]
    pub torchft_tls_cert: Option<PathBuf>,
    #[arg(long, env = "DUCTILE_TORCHFT_TLS_KEY")]
    pub torchft_tls_key: Option<PathBuf>,
}

/// The TorchFT lighthouse's address and options.
#[derive(Clone, Debug)]
pub struct TorchftConfig {
    pub listen: String,
    /// What the launchers connect to (`--torchft-advertise`, else the listen address).
    pub advertise: Option<String>,
    pub opt: crate::lighthouse::LighthouseOpt,
    /// TLS (certificate chain, key) for the lighthouse's connections.
    pub tls: Option<(PathBuf, PathBuf)>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<String>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub insecure_http: Option<bool>,
    pub token_file: Option<PathBuf>,
    pub read_token_file: Option<PathBuf>,
    pub tenants_file: Option<PathBuf>,
    pub metrics_need_token: Option<bool>,
    pub reads_without_token: Option<bool>,
    pub prefix: Option<String>,
    pub election_ttl: Option<i64>,
    pub debounce_ms: Option<u64>,
    pub id: Option<String>,
    pub log_format: Option<LogFormat>,
    pub etcd_wait: Option<u64>,
    pub torchft_listen: Option<String>,
    pub torchft_advertise: Option<String>,
    pub torchft_min_replicas: Option<u64>,
    pub torchft_join_timeout_ms: Option<u64>,
    pub torchft_quorum_tick_ms: Option<u64>,
    pub torchft_heartbeat_timeout_ms: Option<u64>,
    pub torchft_default_room: Option<bool>,
    pub torchft_tls_cert: Option<PathBuf>,
    pub torchft_tls_key: Option<PathBuf>,
}

#[derive(Debug)]
pub struct Config {
    /// etcd endpoints, TLS and user. With a user (etcd auth on) this replica, when it leads,
    /// makes each job's etcd user: the daemon's user needs etcd's root role.
    pub etcd: EtcdAccess,
    pub listen: String,
    /// The API's certificate chain and key; None: plain HTTP (loopback only, asked for).
    pub tls: Option<(PathBuf, PathBuf)>,
    pub token: Secret,
    /// The read-only token, if the cluster has one.
    pub read_token: Option<Secret>,
    /// Tenants' tokens (`tenants_file`).
    pub tenants: Vec<crate::tenants::Tenant>,
    pub metrics_need_token: bool,
    /// GET calls need no token (plain HTTP on loopback only).
    pub reads_without_token: bool,
    pub prefix: String,
    pub election_ttl: i64,
    pub debounce: Duration,
    pub id: String,
    pub log_format: LogFormat,
    pub etcd_wait: Duration,
    /// TorchFT's lighthouse, when `torchft_listen` is given.
    pub torchft: Option<TorchftConfig>,
}

/// A token from its file (trimmed) when one is named, else from the environment variable `env`.
fn token_from(path: Option<PathBuf>, what: &str, env: &str) -> anyhow::Result<Option<String>> {
    match path {
        Some(p) => std::fs::read_to_string(&p)
            .map(|t| Some(t.trim().to_string()))
            .map_err(|e| anyhow::anyhow!("cannot read {what} file {}: {e}", p.display())),
        None => Ok(std::env::var(env).ok()),
    }
}

impl Config {
    pub fn load(cli: Cli) -> anyhow::Result<Config> {
        let (file, etcd_file): (FileConfig, _) =
            ductile_cluster::service::read_service_config(cli.config.as_deref())
                .map_err(|e| anyhow::anyhow!(e))?;
        let token = token_from(cli.token_file.or(file.token_file), "token", "DUCTILE_TOKEN")?
            .ok_or_else(|| {
                anyhow::anyhow!("no API token: pass --token-file FILE or set DUCTILE_TOKEN")
            })?;
        let read_token = token_from(
            cli.read_token_file.or(file.read_token_file),
            "read-only token",
            "DUCTILE_READ_TOKEN",
        )?;
        let tenants = match cli.tenants_file.or(file.tenants_file) {
            Some(p) => {
                let text = std::fs::read_to_string(&p)
                    .map_err(|e| anyhow::anyhow!("invalid tenants_file {}: {e}", p.display()))?;
                crate::tenants::parse(&text)
                    .map_err(|e| anyhow::anyhow!("invalid tenants_file {}: {e}", p.display()))?
            }
            None => Vec::new(),
        };
        let id = cli.id.or(file.id).unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .unwrap_or_else(|_| "host".into());
            format!("{}-{}", host.trim(), std::process::id())
        });
        let etcd =
            EtcdAccess::from_args(cli.etcd_access, etcd_file).map_err(|e| anyhow::anyhow!(e))?;
        let tls = match (cli.tls_cert.or(file.tls_cert), cli.tls_key.or(file.tls_key)) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => anyhow::bail!("invalid tls_cert/tls_key: give both or neither"),
        };
        let torchft_tls = match (
            cli.torchft_tls_cert
                .clone()
                .or(file.torchft_tls_cert.clone()),
            cli.torchft_tls_key.clone().or(file.torchft_tls_key.clone()),
        ) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => anyhow::bail!("invalid torchft_tls_cert/torchft_tls_key: give both or neither"),
        };
        let insecure_http = cli.insecure_http || file.insecure_http.unwrap_or(false);
        let listen = cli
            .listen
            .or(file.listen)
            .unwrap_or_else(|| "127.0.0.1:7420".into());
        // /metrics behind a token wherever the API is reachable from another host, unless
        // the operator turns that off
        let metrics_need_token = cli
            .metrics_need_token
            .or(file.metrics_need_token)
            .unwrap_or(!on_loopback(&listen));
        match (&tls, insecure_http) {
            (Some(_), true) => anyhow::bail!(
                "invalid insecure_http: tls_cert and tls_key are given too; choose TLS or plain HTTP"
            ),
            (None, false) => anyhow::bail!(
                "the API needs TLS: give tls_cert and tls_key (--tls-cert, --tls-key), or pass --insecure-http to serve plain HTTP on a loopback address"
            ),
            (None, true) => {
                let addr: std::net::SocketAddr = listen
                    .parse()
                    .map_err(|e| anyhow::anyhow!("invalid listen address {listen:?}: {e}"))?;
                if !addr.ip().is_loopback() {
                    anyhow::bail!(
                        "invalid insecure_http: plain HTTP is served on a loopback address only, and {listen} is not one; give tls_cert and tls_key"
                    );
                }
            }
            // a certificate or key that cannot serve fails now, naming the file
            (Some((cert, key)), false) => {
                crate::tls::server_config(cert, key)?;
            }
        }
        let reads_without_token = cli
            .reads_without_token
            .or(file.reads_without_token)
            .unwrap_or(false);
        if reads_without_token && !insecure_http {
            anyhow::bail!(
                "invalid reads_without_token: only with insecure_http (plain HTTP on a loopback address); with TLS give the dashboard the read-only token"
            );
        }
        let cfg = Config {
            reads_without_token,
            etcd,
            tls,
            listen,
            token: Secret::new(token),
            read_token: read_token.map(Secret::new),
            tenants,
            metrics_need_token,
            prefix: cli
                .prefix
                .or(file.prefix)
                .unwrap_or_else(|| ductile_cluster::keys::DEFAULT_PREFIX.into()),
            election_ttl: cli.election_ttl.or(file.election_ttl).unwrap_or(5),
            debounce: Duration::from_millis(cli.debounce_ms.or(file.debounce_ms).unwrap_or(500)),
            id,
            log_format: cli
                .log_format
                .or(file.log_format)
                .unwrap_or(LogFormat::Plain),
            etcd_wait: Duration::from_secs(cli.etcd_wait.or(file.etcd_wait).unwrap_or(30)),
            torchft: cli.torchft_listen.or(file.torchft_listen).map(|listen| {
                let d = crate::lighthouse::LighthouseOpt::default();
                TorchftConfig {
                    listen,
                    tls: torchft_tls.clone(),
                    advertise: cli.torchft_advertise.or(file.torchft_advertise),
                    opt: crate::lighthouse::LighthouseOpt {
                        min_replicas: cli
                            .torchft_min_replicas
                            .or(file.torchft_min_replicas)
                            .unwrap_or(d.min_replicas),
                        join_timeout_ms: cli
                            .torchft_join_timeout_ms
                            .or(file.torchft_join_timeout_ms)
                            .unwrap_or(d.join_timeout_ms),
                        quorum_tick_ms: cli
                            .torchft_quorum_tick_ms
                            .or(file.torchft_quorum_tick_ms)
                            .unwrap_or(d.quorum_tick_ms),
                        heartbeat_timeout_ms: cli
                            .torchft_heartbeat_timeout_ms
                            .or(file.torchft_heartbeat_timeout_ms)
                            .unwrap_or(d.heartbeat_timeout_ms),
                        default_room: cli.torchft_default_room
                            || file.torchft_default_room.unwrap_or(d.default_room),
                    },
                }
            }),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if self.token.expose().len() < 8 {
            anyhow::bail!("invalid token: must be at least 8 characters");
        }
        if let Some(r) = &self.read_token {
            if r.expose().len() < 8 {
                anyhow::bail!("invalid read_token: must be at least 8 characters");
            }
            if r == &self.token {
                anyhow::bail!(
                    "invalid read_token: it is the admin token; give it a token of its own"
                );
            }
        }
        for t in &self.tenants {
            if t.matches(self.token.expose())
                || self
                    .read_token
                    .as_ref()
                    .is_some_and(|r| t.matches(r.expose()))
            {
                anyhow::bail!(
                    "invalid tenants_file: tenant {:?}'s token is the admin or the read-only token; give it a token of its own",
                    t.name
                );
            }
        }
        if self.election_ttl < 1 {
            anyhow::bail!(
                "invalid election_ttl: {} must be at least 1 second",
                self.election_ttl
            );
        }
        if !self.prefix.starts_with('/') {
            anyhow::bail!("invalid prefix: {:?} must start with '/'", self.prefix);
        }
        self.listen
            .parse::<std::net::SocketAddr>()
            .map_err(|e| anyhow::anyhow!("invalid listen address {:?}: {e}", self.listen))?;
        if let Some(tf) = &self.torchft {
            tf.listen.parse::<std::net::SocketAddr>().map_err(|e| {
                anyhow::anyhow!("invalid torchft_listen address {:?}: {e}", tf.listen)
            })?;
            if tf.opt.quorum_tick_ms == 0 || tf.opt.heartbeat_timeout_ms == 0 {
                anyhow::bail!(
                    "invalid torchft_quorum_tick_ms/torchft_heartbeat_timeout_ms: must be above 0"
                );
            }
        }
        Ok(())
    }
}

/// `ductiled --check`: this replica as it would run (see [`ductile_cluster::check`]).
pub async fn check(cfg: &Config, hosts: &[String]) -> ductile_cluster::check::Report {
    let mut r = ductile_cluster::check::Report::default();
    r.ok(
        "config",
        format!(
            "loads; API on {} ({}), read token {}, /metrics {}",
            cfg.listen,
            if cfg.tls.is_some() {
                "TLS"
            } else {
                "plain HTTP on loopback"
            },
            if cfg.read_token.is_some() {
                "set"
            } else {
                "not set"
            },
            if cfg.metrics_need_token {
                "behind a token"
            } else {
                "open"
            }
        ),
    );
    for (what, p) in [
        ("etcd_ca", cfg.etcd.ca.as_ref()),
        ("etcd_cert", cfg.etcd.cert.as_ref()),
        ("etcd_key", cfg.etcd.key.as_ref()),
        ("tls_key", cfg.tls.as_ref().map(|(_, k)| k)),
    ] {
        if let Some(p) = p {
            r.readable(what, p);
        }
    }
    if let Some((cert, _)) = &cfg.tls {
        let mut names: Vec<String> = hosts.to_vec();
        if names.is_empty() {
            if let Ok(h) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
                names.push(h.trim().to_string());
            }
            if let Some((host, _)) = cfg.listen.rsplit_once(':') {
                let host = host.trim_matches(['[', ']']);
                if !host.is_empty() && host != "0.0.0.0" && host != "::" {
                    names.push(host.to_string());
                }
            }
        }
        r.cert_names("tls_cert", cert, &names);
    }
    if !on_loopback(&cfg.listen) && !cfg.metrics_need_token {
        r.fail("metrics_need_token", format!("the API listens beyond loopback ({}) and /metrics was turned off its token (metrics_need_token = false): anyone who reaches it reads every job's name and figures", cfg.listen));
    }
    r.etcd(&cfg.etcd, &cfg.prefix).await;
    r.clock(&cfg.etcd).await;
    r
}

/// Whether an API listen address is on loopback only.
fn on_loopback(listen: &str) -> bool {
    listen.starts_with("127.") || listen.starts_with("[::1]") || listen.starts_with("localhost:")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// `/metrics` needs a token wherever the API is reachable from another host, unless the
    /// operator says otherwise; on loopback (the quickstart's) it does not by default.
    #[test]
    fn metrics_need_a_token_beyond_loopback_unless_turned_off() {
        let dir = std::env::temp_dir().join(format!("ductiled-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let token = dir.join("token");
        std::fs::write(&token, "0123456789abcdef0123").unwrap();
        let load = |extra: &[&str]| {
            let mut args = vec![
                "ductiled",
                "--etcd",
                "http://127.0.0.1:2379",
                "--token-file",
                token.to_str().unwrap(),
            ];
            args.extend_from_slice(extra);
            Config::load(Cli::parse_from(args)).unwrap()
        };
        // a certificate the loader can read (openssl: set-up installs it)
        let (cert, key) = (dir.join("api.pem"), dir.join("api-key.pem"));
        let made = std::process::Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=api",
            ])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .unwrap();
        assert!(
            made.status.success(),
            "{}",
            String::from_utf8_lossy(&made.stderr)
        );
        let tls = [
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ];
        let far: Vec<&str> = ["--listen", "0.0.0.0:7420"]
            .iter()
            .chain(&tls)
            .copied()
            .collect();
        assert!(load(&far).metrics_need_token);
        let mut off = far.clone();
        off.extend(["--metrics-need-token", "false"]);
        assert!(!load(&off).metrics_need_token);
        assert!(!load(&["--listen", "127.0.0.1:7420", "--insecure-http"]).metrics_need_token);
        assert!(on_loopback("[::1]:7420") && !on_loopback("10.0.0.1:7420"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

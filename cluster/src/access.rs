//! How a service reaches etcd: endpoints, TLS (a CA, optionally a client certificate) and a
//! user, from flags, `DUCTILE_ETCD_*` variables and config files; and the per-job etcd users
//! the leader makes so that a job's workers reach only their own job's keys.

use std::path::{Path, PathBuf};

use crate::{ClusterError, Keys, Result};

/// A secret that does not print.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
    /// Constant-time comparison.
    pub fn matches(&self, other: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), other.as_bytes());
        if a.len() != b.len() {
            return false;
        }
        a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// etcd connection flags shared by `ductiled` and `ductile-agent` (each also reads the same
/// names from its TOML file: `etcd_ca`, `etcd_cert`, `etcd_key`, `etcd_user`,
/// `etcd_password_file`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct EtcdArgs {
    /// etcd endpoints, comma-separated.
    #[arg(long, env = "DUCTILE_ETCD")]
    pub etcd: Option<String>,
    /// CA certificate (PEM) that signed etcd's server certificate; endpoints are then https.
    #[arg(long, env = "DUCTILE_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for etcds that ask for one (`--client-cert-auth`).
    #[arg(long, env = "DUCTILE_ETCD_CERT")]
    pub etcd_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "DUCTILE_ETCD_KEY")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user (etcd auth enabled); its password from --etcd-password-file or
    /// DUCTILE_ETCD_PASSWORD.
    #[arg(long, env = "DUCTILE_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password.
    #[arg(long, env = "DUCTILE_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
    /// Run against an etcd off loopback without TLS or without auth (refused otherwise: any
    /// job's workers could then read and write every key, other jobs' commits included).
    #[arg(long, env = "DUCTILE_INSECURE_ETCD")]
    pub insecure_etcd: bool,
}

/// The same settings as they appear in a service's TOML file.
#[derive(serde::Deserialize, Debug, Default, Clone)]
#[serde(deny_unknown_fields)]
pub struct EtcdFileArgs {
    pub etcd: Option<String>,
    pub etcd_ca: Option<PathBuf>,
    pub etcd_cert: Option<PathBuf>,
    pub etcd_key: Option<PathBuf>,
    pub etcd_user: Option<String>,
    pub etcd_password_file: Option<PathBuf>,
    pub insecure_etcd: Option<bool>,
}

impl EtcdFileArgs {
    /// The keys a service's config file holds these under.
    pub const KEYS: [&'static str; 7] = [
        "etcd",
        "etcd_ca",
        "etcd_cert",
        "etcd_key",
        "etcd_user",
        "etcd_password_file",
        "insecure_etcd",
    ];
}

/// Everything needed to open a connection to etcd.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdAccess {
    /// Comma-separated endpoints.
    pub endpoints: String,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub user: Option<String>,
    pub password: Option<Secret>,
}

/// The variables a worker reads its etcd access from (set by its agent, nothing else).
pub const WORKER_ENV: [&str; 6] = [
    "DUCTILE_ETCD",
    "DUCTILE_ETCD_CA",
    "DUCTILE_ETCD_CERT",
    "DUCTILE_ETCD_KEY",
    "DUCTILE_ETCD_USER",
    "DUCTILE_ETCD_PASSWORD",
];

impl EtcdAccess {
    /// Plain endpoints: no TLS, no user.
    pub fn plain(endpoints: impl Into<String>) -> Self {
        EtcdAccess {
            endpoints: endpoints.into(),
            ..Default::default()
        }
    }

    /// Flags over the file's settings over the default endpoint (a local etcd); the password
    /// from its file, else `DUCTILE_ETCD_PASSWORD`.
    pub fn from_args(cli: EtcdArgs, file: EtcdFileArgs) -> std::result::Result<Self, String> {
        let endpoints = cli
            .etcd
            .or(file.etcd)
            .unwrap_or_else(|| "http://127.0.0.1:2379".into());
        let user = cli.etcd_user.or(file.etcd_user);
        let password = match cli.etcd_password_file.or(file.etcd_password_file) {
            Some(p) => Some(read_secret(&p, "etcd password")?),
            None => std::env::var("DUCTILE_ETCD_PASSWORD").ok().map(Secret::new),
        };
        let a = EtcdAccess {
            endpoints,
            ca: cli.etcd_ca.or(file.etcd_ca),
            cert: cli.etcd_cert.or(file.etcd_cert),
            key: cli.etcd_key.or(file.etcd_key),
            user,
            password,
        };
        a.validate()?;
        if let Some(why) = a.exposure() {
            if !(cli.insecure_etcd || file.insecure_etcd.unwrap_or(false)) {
                return Err(format!(
                    "{why}; set up TLS and auth (scripts/secure.sh), or pass --insecure-etcd (insecure_etcd = true) to run so anyway"
                ));
            }
            tracing::warn!("{why} (--insecure-etcd)");
        }
        Ok(a)
    }

    /// Why this access leaves etcd open to whoever reaches it, or None: an endpoint off
    /// loopback without TLS (`etcd_ca`), or without auth (`etcd_user`: per-job etcd users are
    /// then off, and every job's workers can read and write every key).
    pub fn exposure(&self) -> Option<String> {
        let remote: Vec<String> = self
            .endpoint_list()
            .into_iter()
            .filter(|e| !is_loopback(e))
            .collect();
        if remote.is_empty() {
            return None;
        }
        let mut lacks = Vec::new();
        if self.ca.is_none() {
            lacks.push("no TLS (etcd_ca)");
        }
        if self.user.is_none() {
            lacks.push("no auth (etcd_user: every job's workers could read and write every key)");
        }
        (!lacks.is_empty()).then(|| {
            format!(
                "etcd at {} is not on loopback and has {}",
                remote.join(","),
                lacks.join(" and ")
            )
        })
    }

    /// What an agent set for its worker (see [`EtcdAccess::worker_env`]).
    pub fn from_env() -> std::result::Result<Self, String> {
        let var = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
        let a = EtcdAccess {
            endpoints: var("DUCTILE_ETCD").ok_or("DUCTILE_ETCD is not set")?,
            ..Self::from_env_unchecked()
        };
        a.validate()?;
        Ok(a)
    }

    /// The environment's settings as they are, unvalidated (a launcher's password comes on a
    /// descriptor: see `ductile_runtime::Secrets`).
    pub fn from_env_unchecked() -> Self {
        let var = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
        EtcdAccess {
            endpoints: var("DUCTILE_ETCD").unwrap_or_default(),
            ca: var("DUCTILE_ETCD_CA").map(PathBuf::from),
            cert: var("DUCTILE_ETCD_CERT").map(PathBuf::from),
            key: var("DUCTILE_ETCD_KEY").map(PathBuf::from),
            user: var("DUCTILE_ETCD_USER"),
            password: var("DUCTILE_ETCD_PASSWORD").map(Secret::new),
        }
    }

    /// The environment of a worker that reaches etcd as `job_user` (None: etcd without auth)
    /// with `client` as its client certificate and key (never the agent's own). Every name in
    /// [`WORKER_ENV`] is given, empty where unset, so nothing of the agent's own leaks through.
    pub fn worker_env(
        &self,
        job_user: Option<(&str, &Secret)>,
        client: Option<(&Path, &Path)>,
    ) -> Vec<(&'static str, String)> {
        let path = |p: Option<&Path>| p.map(|p| p.display().to_string()).unwrap_or_default();
        vec![
            ("DUCTILE_ETCD", self.endpoints.clone()),
            ("DUCTILE_ETCD_CA", path(self.ca.as_deref())),
            ("DUCTILE_ETCD_CERT", path(client.map(|c| c.0))),
            ("DUCTILE_ETCD_KEY", path(client.map(|c| c.1))),
            (
                "DUCTILE_ETCD_USER",
                job_user.map(|u| u.0.to_string()).unwrap_or_default(),
            ),
            (
                "DUCTILE_ETCD_PASSWORD",
                job_user
                    .map(|u| u.1.expose().to_string())
                    .unwrap_or_default(),
            ),
        ]
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.cert.is_some() != self.key.is_some() {
            return Err("invalid etcd_cert/etcd_key: give both or neither".into());
        }
        if self.user.is_some() != self.password.is_some() {
            return Err(match &self.user {
                Some(u) => format!(
                    "etcd user {u:?} has no password: pass --etcd-password-file FILE or set DUCTILE_ETCD_PASSWORD"
                ),
                None => "an etcd password is given without --etcd-user".into(),
            });
        }
        for e in self.endpoint_list() {
            if self.ca.is_some() && e.starts_with("http://") {
                return Err(format!(
                    "etcd endpoint {e:?} is http:// but etcd_ca is set: use https://"
                ));
            }
            if self.ca.is_none() && e.starts_with("https://") {
                return Err(format!(
                    "etcd endpoint {e:?} is https:// but no etcd_ca is given to check its certificate"
                ));
            }
        }
        Ok(())
    }

    pub fn endpoint_list(&self) -> Vec<String> {
        self.endpoints
            .split(',')
            .map(|e| e.trim().to_string())
            .filter(|e| !e.is_empty())
            .collect()
    }

    /// Whether this service may manage etcd users (it connects as a user: auth is on).
    pub fn has_user(&self) -> bool {
        self.user.is_some()
    }
}

/// Whether an endpoint (`scheme://host:port`) names this machine's loopback.
fn is_loopback(endpoint: &str) -> bool {
    let rest = endpoint.split_once("://").map(|x| x.1).unwrap_or(endpoint);
    let authority = rest.split('/').next().unwrap_or("");
    let host = if let Some(h) = authority.strip_prefix('[') {
        h.split(']').next().unwrap_or("")
    } else {
        authority.rsplit_once(':').map(|x| x.0).unwrap_or(authority)
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn read_secret(p: &Path, what: &str) -> std::result::Result<Secret, String> {
    let s = std::fs::read_to_string(p)
        .map_err(|e| format!("cannot read {what} file {}: {e}", p.display()))?;
    let s = s.trim();
    if s.is_empty() {
        return Err(format!("{what} file {} is empty", p.display()));
    }
    Ok(Secret::new(s))
}

/// One permission of a role: a key, or every key under a prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub key: String,
    pub prefix: bool,
    pub write: bool,
}

/// The etcd user (and role, same name) a job's workers reach etcd as.
pub fn job_user(job: &str) -> String {
    format!("{JOB_USER_PREFIX}{job}")
}

/// Every job user's name starts with this.
pub const JOB_USER_PREFIX: &str = "ductile-job-";

/// What a job's workers may touch, and nothing else: read their job's control state (spec,
/// generation, mesh key, checkpoint request), commit its checkpoints (the one control key they
/// write, fenced on the generation), and write what workers write as they run (`live/{job}/`).
pub fn job_grants(keys: &Keys, job: &str) -> Vec<Grant> {
    vec![
        Grant {
            key: keys.job(job),
            prefix: true,
            write: false,
        },
        Grant {
            key: keys.checkpoint(job),
            prefix: false,
            write: true,
        },
        Grant {
            key: keys.live_job(job),
            prefix: true,
            write: true,
        },
        // where the TorchFT lighthouse is served (a torchft job's launchers relay to it)
        Grant {
            key: keys.lighthouses(),
            prefix: true,
            write: false,
        },
    ]
}

/// A fresh random password (32 bytes, hex).
pub fn new_password() -> Result<Secret> {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| ClusterError::invalid("password", "the system's random source failed"))?;
    Ok(Secret::new(
        b.iter().map(|x| format!("{x:02x}")).collect::<String>(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_etcd_off_loopback_needs_tls_and_auth_or_insecure_etcd() {
        let args = |etcd: &str, ca: bool, user: bool, insecure: bool| {
            let dir = std::env::temp_dir().join(format!("ductile-exposure-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let pw = dir.join("pw");
            std::fs::write(&pw, "secret").unwrap();
            EtcdAccess::from_args(
                EtcdArgs {
                    etcd: Some(etcd.into()),
                    etcd_ca: ca.then(|| dir.join("ca.pem")),
                    etcd_user: user.then(|| "u".to_string()),
                    etcd_password_file: user.then_some(pw),
                    insecure_etcd: insecure,
                    ..Default::default()
                },
                EtcdFileArgs::default(),
            )
        };
        // loopback: a local cluster needs neither
        for e in [
            "http://127.0.0.1:2379",
            "http://localhost:2379",
            "http://[::1]:2379",
        ] {
            assert!(args(e, false, false, false).is_ok(), "{e}");
        }
        let e = args("http://10.0.0.10:2379", false, false, false).unwrap_err();
        assert!(
            e.contains("10.0.0.10")
                && e.contains("no TLS")
                && e.contains("no auth")
                && e.contains("--insecure-etcd"),
            "{e}"
        );
        let e = args("https://10.0.0.10:2379", true, false, false).unwrap_err();
        assert!(e.contains("no auth") && !e.contains("no TLS"), "{e}");
        let e = args(
            "http://127.0.0.1:2379,http://etcd-2:2379",
            false,
            true,
            false,
        )
        .unwrap_err();
        assert!(e.contains("etcd-2") && e.contains("no TLS"), "{e}");
        assert!(args("https://10.0.0.10:2379", true, true, false).is_ok());
        assert!(args("http://10.0.0.10:2379", false, false, true).is_ok());
    }

    #[test]
    fn settings_that_cannot_work_together_are_refused_naming_them() {
        let tls = |e: &str| EtcdAccess {
            ca: Some("/ca.pem".into()),
            ..EtcdAccess::plain(e)
        };
        assert!(tls("https://a:2379,https://b:2379").validate().is_ok());
        assert!(tls("http://a:2379")
            .validate()
            .unwrap_err()
            .contains("use https://"));
        assert!(EtcdAccess::plain("https://a:2379")
            .validate()
            .unwrap_err()
            .contains("no etcd_ca"));
        let half_cert = EtcdAccess {
            cert: Some("/c.pem".into()),
            ..tls("https://a:2379")
        };
        assert!(half_cert
            .validate()
            .unwrap_err()
            .contains("both or neither"));
        let no_password = EtcdAccess {
            user: Some("u".into()),
            ..EtcdAccess::plain("a:2379")
        };
        assert!(no_password
            .validate()
            .unwrap_err()
            .contains("has no password"));
    }

    #[test]
    fn a_workers_environment_names_every_variable_and_carries_only_its_jobs_user() {
        let agent = EtcdAccess {
            ca: Some("/pki/ca.pem".into()),
            cert: Some("/pki/agent.pem".into()),
            key: Some("/pki/agent-key.pem".into()),
            user: Some("ductile-agent".into()),
            password: Some(Secret::new("agent-secret")),
            ..EtcdAccess::plain("https://e:2379")
        };
        let pw = Secret::new("job-secret");
        let env = agent.worker_env(
            Some(("ductile-job-j", &pw)),
            Some((
                Path::new("/pki/worker.pem"),
                Path::new("/pki/worker-key.pem"),
            )),
        );
        let names: Vec<&str> = env.iter().map(|(k, _)| *k).collect();
        assert_eq!(names, WORKER_ENV);
        let text = format!("{env:?}");
        assert!(!text.contains("agent"), "{text}");
        assert!(text.contains("ductile-job-j") && text.contains("job-secret"));
        // without a job user or a workers' certificate: the names are there, empty
        let bare = agent.worker_env(None, None);
        assert!(bare[2..].iter().all(|(_, v)| v.is_empty()), "{bare:?}");
        assert_eq!(format!("{:?}", Secret::new("x")), "Secret(***)");
    }

    #[test]
    fn a_jobs_grants_stop_at_its_own_keys() {
        let k = Keys::default();
        let g = job_grants(&k, "a");
        // its own keys, and read-only where the lighthouse is served
        assert!(g.iter().all(|g| g.key.contains("/a/")
            || g.key.ends_with("/a/checkpoint")
            || (g.key == k.lighthouses() && !g.write)));
        // prefixes end with '/', so job "a" does not reach job "ab"
        assert!(g.iter().filter(|g| g.prefix).all(|g| g.key.ends_with('/')));
        assert!(g
            .iter()
            .filter(|g| g.write && g.prefix)
            .all(|g| g.key.contains("/live/")));
        assert_eq!(job_user("a"), "ductile-job-a");
        let (p1, p2) = (new_password().unwrap(), new_password().unwrap());
        assert_ne!(p1, p2);
        assert_eq!(p1.expose().len(), 64);
    }
}

//! `ductile-agent --check` and `ductiled --check`: what an operator needs to know about an
//! installed node before it takes work, each finding in plain words (a file the service cannot
//! read, etcd unreachable or refusing its user, a clock off etcd's, a certificate that does not
//! name its host). Every probe is bounded.

use std::path::Path;
use std::time::{Duration, SystemTime};

use crate::access::EtcdAccess;

/// One line of a check: what was looked at, and what was found.
#[derive(Clone, Debug)]
pub struct Finding {
    pub ok: bool,
    pub what: String,
    pub detail: String,
}

/// Every finding of one check, in order.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub findings: Vec<Finding>,
}

/// The most a node's clock may be off etcd's before the check says so: leases, drain deadlines
/// and the logs' times are read across hosts.
pub const MAX_SKEW: Duration = Duration::from_secs(2);

impl Report {
    pub fn ok(&mut self, what: &str, detail: impl Into<String>) {
        self.findings.push(Finding {
            ok: true,
            what: what.into(),
            detail: detail.into(),
        });
    }
    pub fn fail(&mut self, what: &str, detail: impl Into<String>) {
        self.findings.push(Finding {
            ok: false,
            what: what.into(),
            detail: detail.into(),
        });
    }
    pub fn passed(&self) -> bool {
        self.findings.iter().all(|f| f.ok)
    }
    /// `ok   WHAT: DETAIL` / `FAIL WHAT: DETAIL` lines, then a summary line.
    pub fn render(&self, who: &str) -> String {
        let mut s = String::new();
        for f in &self.findings {
            s.push_str(&format!(
                "{} {}: {}\n",
                if f.ok { "ok  " } else { "FAIL" },
                f.what,
                f.detail
            ));
        }
        let bad = self.findings.iter().filter(|f| !f.ok).count();
        if bad == 0 {
            s.push_str(&format!("{who}: every check passed\n"));
        } else {
            s.push_str(&format!("{who}: {bad} check(s) failed\n"));
        }
        s
    }

    /// The file can be opened and read by this process (the service's user, when run as it).
    pub fn readable(&mut self, what: &str, path: &Path) {
        match std::fs::read(path) {
            Ok(b) if b.is_empty() => self.fail(what, format!("{} is empty", path.display())),
            Ok(_) => self.ok(what, format!("{} is readable", path.display())),
            Err(e) => self.fail(
                what,
                format!(
                    "cannot read {}: {e} (run the check as the service's user: the files must be readable by it)",
                    path.display()
                ),
            ),
        }
    }

    /// etcd answers with this access, and its user may read `prefix`.
    pub async fn etcd(&mut self, access: &EtcdAccess, prefix: &str) {
        let who = access.user.clone().unwrap_or_else(|| "no user".into());
        let connect = crate::connect_etcd_with(access, Duration::from_secs(5));
        match tokio::time::timeout(Duration::from_secs(10), connect).await {
            Err(_) => self.fail(
                "etcd",
                format!("{} did not answer within 10 s", access.endpoints),
            ),
            Ok(Err(e)) => self.fail(
                "etcd",
                format!(
                    "cannot use {} as {who}: {}",
                    access.endpoints,
                    crate::service::error_chain(&e)
                ),
            ),
            Ok(Ok(b)) => match tokio::time::timeout(
                Duration::from_secs(5),
                b.list(&format!("{prefix}/nodes/")),
            )
            .await
            {
                Ok(Ok((kvs, rev))) => self.ok(
                    "etcd",
                    format!(
                        "{} answers; user {who} reads {prefix} (revision {rev}, {} node record(s))",
                        access.endpoints,
                        kvs.len()
                    ),
                ),
                Ok(Err(e)) => self.fail(
                    "etcd",
                    format!(
                        "{} answers, but user {who} cannot read {prefix}: {}",
                        access.endpoints,
                        crate::service::error_chain(&e)
                    ),
                ),
                Err(_) => self.fail(
                    "etcd",
                    format!("{} connected but a read took over 5 s", access.endpoints),
                ),
            },
        }
    }

    /// This host's clock against etcd's (the `Date` of its HTTP answer), within [`MAX_SKEW`]
    /// plus the round trip.
    pub async fn clock(&mut self, access: &EtcdAccess) {
        match tokio::time::timeout(Duration::from_secs(10), etcd_date(access)).await {
            Err(_) => self.fail("clock", "etcd's time could not be read within 10 s"),
            Ok(Err(e)) => self.fail("clock", format!("etcd's time could not be read: {e}")),
            Ok(Ok((theirs, before, after))) => {
                // the Date header has whole seconds: the answer was made within [before - 1 s, after]
                let lo = before.checked_sub(Duration::from_secs(1)).unwrap_or(before);
                let skew = if theirs < lo {
                    lo.duration_since(theirs).unwrap_or_default()
                } else if theirs > after {
                    theirs.duration_since(after).unwrap_or_default()
                } else {
                    Duration::ZERO
                };
                if skew > MAX_SKEW {
                    self.fail(
                        "clock",
                        format!(
                            "this host's clock is {:.1} s {} etcd's: run a time service (chrony, systemd-timesyncd)",
                            skew.as_secs_f64(),
                            if theirs < lo { "ahead of" } else { "behind" }
                        ),
                    );
                } else {
                    self.ok(
                        "clock",
                        format!("within {} s of etcd's", MAX_SKEW.as_secs()),
                    );
                }
            }
        }
    }

    /// The certificate at `cert` (PEM; its first certificate) is valid for each of `names` (DNS
    /// names or IP addresses, as clients reach the host).
    pub fn cert_names(&mut self, what: &str, cert: &Path, names: &[String]) {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, ServerName};
        let der = match CertificateDer::pem_file_iter(cert)
            .map_err(|e| e.to_string())
            .and_then(|mut it| {
                it.next()
                    .ok_or_else(|| "no certificate in it".to_string())?
                    .map_err(|e| e.to_string())
            }) {
            Ok(d) => d,
            Err(e) => return self.fail(what, format!("cannot read {}: {e}", cert.display())),
        };
        let ee = match webpki::EndEntityCert::try_from(&der) {
            Ok(c) => c,
            Err(e) => {
                return self.fail(
                    what,
                    format!(
                        "{} is not a certificate webpki can read: {e:?}",
                        cert.display()
                    ),
                )
            }
        };
        for n in names {
            let name = match ServerName::try_from(n.as_str()) {
                Ok(s) => s,
                Err(_) => {
                    self.fail(
                        what,
                        format!("{n:?} is neither a DNS name nor an IP address"),
                    );
                    continue;
                }
            };
            match ee.verify_is_valid_for_subject_name(&name) {
                Ok(()) => self.ok(what, format!("{} names {n}", cert.display())),
                Err(_) => self.fail(
                    what,
                    format!(
                        "{} does not name {n}: clients reaching this host as {n} will refuse it (make one that does: ductile-admin init)",
                        cert.display()
                    ),
                ),
            }
        }
    }
}

/// etcd's `Date` (from `GET /version` on its first endpoint, over TLS with the access's CA and
/// client certificate where it has them), and this host's time before and after the call.
async fn etcd_date(access: &EtcdAccess) -> Result<(SystemTime, SystemTime, SystemTime), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ep = access
        .endpoint_list()
        .into_iter()
        .next()
        .ok_or("no endpoint")?;
    let (tls, rest) = match ep.split_once("://") {
        Some(("https", r)) => (true, r.to_string()),
        Some((_, r)) => (false, r.to_string()),
        None => (access.ca.is_some(), ep.clone()),
    };
    let hostport = rest.trim_end_matches('/').to_string();
    let host = hostport
        .rsplit_once(':')
        .map(|(h, _)| h.trim_matches(['[', ']']).to_string())
        .unwrap_or_else(|| hostport.clone());
    let req = format!("GET /version HTTP/1.1\r\nHost: {hostport}\r\nConnection: close\r\n\r\n");
    let before = SystemTime::now();
    let tcp = tokio::net::TcpStream::connect(&hostport)
        .await
        .map_err(|e| format!("cannot connect to {hostport}: {e}"))?;
    let mut buf = Vec::new();
    if tls {
        let cfg = client_tls(access)?;
        let name = rustls::pki_types::ServerName::try_from(host.clone())
            .map_err(|e| format!("{host}: {e}"))?;
        let mut s = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS to {hostport}: {e}"))?;
        s.write_all(req.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let _ = s.read_to_end(&mut buf).await;
    } else {
        let mut s = tcp;
        s.write_all(req.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let _ = s.read_to_end(&mut buf).await;
    }
    let after = SystemTime::now();
    let head = String::from_utf8_lossy(&buf);
    let date = head
        .lines()
        .take_while(|l| !l.is_empty())
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case("date")
                .then(|| v.trim().to_string())
        })
        .ok_or_else(|| format!("{hostport} answered without a Date header"))?;
    let theirs = httpdate::parse_http_date(&date).map_err(|e| format!("Date {date:?}: {e}"))?;
    Ok((theirs, before, after))
}

/// rustls to etcd with the access's CA and, where it has one, its client certificate.
fn client_tls(access: &EtcdAccess) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    if let Some(ca) = &access.ca {
        for c in CertificateDer::pem_file_iter(ca)
            .map_err(|e| format!("etcd_ca {}: {e}", ca.display()))?
        {
            let c = c.map_err(|e| format!("etcd_ca {}: {e}", ca.display()))?;
            roots
                .add(c)
                .map_err(|e| format!("etcd_ca {}: {e}", ca.display()))?;
        }
    }
    let b = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("TLS: {e}"))?
    .with_root_certificates(roots);
    match (&access.cert, &access.key) {
        (Some(c), Some(k)) => {
            let chain = CertificateDer::pem_file_iter(c)
                .map_err(|e| format!("etcd_cert {}: {e}", c.display()))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("etcd_cert {}: {e}", c.display()))?;
            let key = PrivateKeyDer::from_pem_file(k)
                .map_err(|e| format!("etcd_key {}: {e}", k.display()))?;
            b.with_client_auth_cert(chain, key)
                .map_err(|e| format!("etcd client certificate: {e}"))
        }
        _ => Ok(b.with_no_client_auth()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_says_what_failed() {
        let mut r = Report::default();
        r.ok("a", "fine");
        assert!(r.passed());
        r.readable("key", Path::new("/nonexistent/ductile-key.pem"));
        assert!(!r.passed());
        let text = r.render("node n1");
        assert!(
            text.contains("FAIL key: cannot read /nonexistent/ductile-key.pem"),
            "{text}"
        );
        assert!(text.ends_with("node n1: 1 check(s) failed\n"), "{text}");
    }
}

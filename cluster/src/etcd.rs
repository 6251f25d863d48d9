//! The real [`KvBackend`]: etcd v3 through etcd-client.

use std::time::Duration;

use async_trait::async_trait;
use etcd_client as ec;
use tokio::sync::mpsc;

use crate::access::{EtcdAccess, Grant, Secret};
use crate::kv::*;
use crate::{ClusterError, Result};

/// etcd, reached at one or more endpoints. Cloning shares the connection.
#[derive(Clone)]
pub struct EtcdBackend {
    client: ec::Client,
    endpoints: String,
}

impl EtcdBackend {
    /// Builds the client. Without a user no request is made (connections are made lazily, and
    /// re-made after etcd restarts); with one, etcd is asked for a token now. Use
    /// [`EtcdBackend::connect_checked`] to wait for etcd at start-up.
    pub async fn connect(access: &EtcdAccess) -> Result<Self> {
        let endpoints = access.endpoint_list();
        let joined = endpoints.join(",");
        let mut opts = ec::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        if let (Some(u), Some(p)) = (&access.user, &access.password) {
            // tokens expire (etcd's --auth-token-ttl) and die with an etcd restart
            opts = opts
                .with_user(u.as_str(), p.expose())
                .with_auto_token_refresh(true);
        }
        if let Some(ca) = &access.ca {
            opts = opts.with_tls(tls_options(access, ca)?);
        }
        let client = ec::Client::connect(&endpoints, Some(opts))
            .await
            .map_err(|e| map_err(&joined, "connect", e))?;
        Ok(EtcdBackend {
            client,
            endpoints: joined,
        })
    }

    /// Connects and makes one read, retrying for up to `wait` while etcd cannot be reached;
    /// the error says which endpoints could not be reached, or what etcd refused (a wrong
    /// password, a certificate it does not trust).
    pub async fn connect_checked(access: &EtcdAccess, wait: Duration) -> Result<Self> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let attempt = match Self::connect(access).await {
                // a user whose role does not reach the probe key got its token (connect
                // authenticates): etcd answers, and the user is who it says
                Ok(b) => match b.get("/ductile-probe").await {
                    Err(ClusterError::Rejected { message, .. })
                        if access.user.is_some() && message.contains("permission denied") =>
                    {
                        Ok(b)
                    }
                    r => r.map(|_| b),
                },
                Err(e) => Err(e),
            };
            match attempt {
                Ok(b) => return Ok(b),
                Err(e) if e.is_retryable() && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn c(&self) -> ec::Client {
        self.client.clone()
    }

    /// One request, sent again (a few times, briefly) when etcd refused it only because its
    /// users or roles changed while it was in flight ("revision of auth store is old": it was
    /// not applied, so sending it again is safe); any other outcome is the answer.
    async fn again<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T>
    where
        F: Fn(ec::Client) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, ec::Error>>,
    {
        let mut attempt = 0u32;
        loop {
            match f(self.c()).await {
                Err(e) if auth_moved(&e) && attempt < 8 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(5 * attempt as u64)).await;
                }
                r => return r.map_err(|e| map_err(&self.endpoints, op, e)),
            }
        }
    }
}

/// The CA to trust and the client identity when one is given. Each endpoint's certificate is
/// checked against that endpoint's own host (no one name for all: with per-node certificates,
/// a failover to the second endpoint must check the second node's name).
fn tls_options(access: &EtcdAccess, ca: &std::path::Path) -> Result<ec::TlsOptions> {
    let read = |p: &std::path::Path, what: &str| {
        std::fs::read(p)
            .map_err(|e| ClusterError::invalid(what, format!("cannot read {}: {e}", p.display())))
    };
    let mut tls =
        ec::TlsOptions::new().ca_certificate(ec::Certificate::from_pem(read(ca, "etcd_ca")?));
    if let (Some(c), Some(k)) = (&access.cert, &access.key) {
        tls = tls.identity(ec::Identity::from_pem(
            read(c, "etcd_cert")?,
            read(k, "etcd_key")?,
        ));
    }
    Ok(tls)
}

fn map_err(endpoints: &str, op: &'static str, e: ec::Error) -> ClusterError {
    use tonic::Code;
    match e {
        ec::Error::GRpcStatus(s) if s.message().contains("auth store is old") => {
            ClusterError::Unavailable {
                endpoints: endpoints.into(),
                op,
                source: Box::new(s),
            }
        }
        ec::Error::GRpcStatus(s) => match s.code() {
            Code::NotFound if s.message().contains("lease") => {
                ClusterError::LeaseNotFound { lease: 0 }
            }
            Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::Aborted
            | Code::ResourceExhausted
            | Code::Internal => ClusterError::Unavailable {
                endpoints: endpoints.into(),
                op,
                source: Box::new(s),
            },
            Code::OutOfRange if s.message().contains("compacted") => ClusterError::Compacted {
                prefix: String::new(),
                from: 0,
                compacted: 0,
            },
            _ => ClusterError::Rejected {
                op,
                message: format!("{:?}: {}", s.code(), s.message()),
            },
        },
        ec::Error::TransportError(t) => ClusterError::Unavailable {
            endpoints: endpoints.into(),
            op,
            source: Box::new(t),
        },
        ec::Error::IoError(t) => ClusterError::Unavailable {
            endpoints: endpoints.into(),
            op,
            source: Box::new(t),
        },
        ec::Error::LeaseKeepAliveError(m) if m.contains("not found") => {
            ClusterError::LeaseNotFound { lease: 0 }
        }
        ec::Error::WatchError(m) | ec::Error::LeaseKeepAliveError(m) | ec::Error::ElectError(m) => {
            ClusterError::Unavailable {
                endpoints: endpoints.into(),
                op,
                source: m.into(),
            }
        }
        other => ClusterError::Rejected {
            op,
            message: other.to_string(),
        },
    }
}

fn to_kv(kv: &ec::KeyValue) -> KeyValue {
    KeyValue {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        lease: kv.lease(),
    }
}

fn to_op(op: Op) -> ec::TxnOp {
    match op {
        Op::Put { key, value, lease } => {
            let opts = lease
                .filter(|l| *l != 0)
                .map(|l| ec::PutOptions::new().with_lease(l));
            ec::TxnOp::put(key, value, opts)
        }
        Op::Delete { key } => ec::TxnOp::delete(key, None),
        Op::DeletePrefix { prefix } => {
            ec::TxnOp::delete(prefix, Some(ec::DeleteOptions::new().with_prefix()))
        }
    }
}

fn to_cmp(c: Compare) -> ec::Compare {
    use ec::CompareOp::Equal;
    match c {
        Compare::Absent(k) => ec::Compare::create_revision(k, Equal, 0),
        Compare::ModRevision(k, r) => ec::Compare::mod_revision(k, Equal, r),
        Compare::CreateRevision(k, r) => ec::Compare::create_revision(k, Equal, r),
        Compare::Value(k, v) => ec::Compare::value(k, Equal, v),
    }
}

fn lease_err(e: ClusterError, lease: LeaseId) -> ClusterError {
    match e {
        ClusterError::LeaseNotFound { .. } => ClusterError::LeaseNotFound { lease },
        other => other,
    }
}

#[async_trait]
impl KvBackend for EtcdBackend {
    fn describe(&self) -> String {
        format!("etcd {}", self.endpoints)
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        let resp = self
            .again("get", |mut c| async move { c.get(key, None).await })
            .await?;
        Ok(resp.kvs().first().map(to_kv))
    }

    async fn list(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)> {
        let resp = self
            .again("list", |mut c| async move {
                c.get(prefix, Some(ec::GetOptions::new().with_prefix()))
                    .await
            })
            .await?;
        let rev = resp.header().map(|h| h.revision()).unwrap_or(0);
        Ok((resp.kvs().iter().map(to_kv).collect(), rev))
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        let opts = lease
            .filter(|l| *l != 0)
            .map(|l| ec::PutOptions::new().with_lease(l));
        let resp = self
            .again("put", |mut c| {
                let (value, opts) = (value.clone(), opts.clone());
                async move { c.put(key, value, opts).await }
            })
            .await
            .map_err(|e| lease_err(e, lease.unwrap_or(0)))?;
        Ok(resp.header().map(|h| h.revision()).unwrap_or(0))
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        let resp = self
            .again("delete", |mut c| async move { c.delete(key, None).await })
            .await?;
        Ok(resp.deleted() > 0)
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        let resp = self
            .again("delete", |mut c| async move {
                c.delete(prefix, Some(ec::DeleteOptions::new().with_prefix()))
                    .await
            })
            .await?;
        Ok(resp.deleted() as u64)
    }

    async fn txn(&self, txn: Txn) -> Result<TxnOutcome> {
        let lease = txn.ops.iter().find_map(|o| match o {
            Op::Put { lease: Some(l), .. } => Some(*l),
            _ => None,
        });
        let t = ec::Txn::new()
            .when(txn.compares.into_iter().map(to_cmp).collect::<Vec<_>>())
            .and_then(txn.ops.into_iter().map(to_op).collect::<Vec<_>>());
        let resp = self
            .again("txn", |mut c| {
                let t = t.clone();
                async move { c.txn(t).await }
            })
            .await
            .map_err(|e| lease_err(e, lease.unwrap_or(0)))?;
        Ok(TxnOutcome {
            succeeded: resp.succeeded(),
            revision: resp.header().map(|h| h.revision()).unwrap_or(0),
        })
    }

    async fn grant(&self, ttl_secs: i64) -> Result<LeaseId> {
        let resp = self
            .c()
            .lease_grant(ttl_secs, None)
            .await
            .map_err(|e| map_err(&self.endpoints, "lease grant", e))?;
        Ok(resp.id())
    }

    async fn keep_alive_once(&self, lease: LeaseId) -> Result<i64> {
        let (mut keeper, mut stream) = self
            .c()
            .lease_keep_alive(lease)
            .await
            .map_err(|e| lease_err(map_err(&self.endpoints, "lease keep-alive", e), lease))?;
        keeper
            .keep_alive()
            .await
            .map_err(|e| map_err(&self.endpoints, "lease keep-alive", e))?;
        let fut = stream.message();
        match tokio::time::timeout(Duration::from_secs(5), fut).await {
            Err(_) => Err(ClusterError::Timeout {
                op: "lease keep-alive",
                after: Duration::from_secs(5),
            }),
            Ok(Err(e)) => Err(lease_err(
                map_err(&self.endpoints, "lease keep-alive", e),
                lease,
            )),
            Ok(Ok(None)) => Err(ClusterError::Unavailable {
                endpoints: self.endpoints.clone(),
                op: "lease keep-alive",
                source: "stream closed".into(),
            }),
            Ok(Ok(Some(r))) if r.ttl() <= 0 => Err(ClusterError::LeaseNotFound { lease }),
            Ok(Ok(Some(r))) => Ok(r.ttl()),
        }
    }

    async fn revoke(&self, lease: LeaseId) -> Result<()> {
        self.c()
            .lease_revoke(lease)
            .await
            .map_err(|e| lease_err(map_err(&self.endpoints, "lease revoke", e), lease))?;
        Ok(())
    }

    async fn watch(&self, prefix: &str, from: Revision) -> Result<WatchReceiver> {
        let mut opts = ec::WatchOptions::new().with_prefix();
        if from > 0 {
            opts = opts.with_start_revision(from);
        }
        let mut stream = self
            .c()
            .watch(prefix, Some(opts))
            .await
            .map_err(|e| map_err(&self.endpoints, "watch", e))?;
        let (tx, rx) = mpsc::channel(1024);
        let endpoints = self.endpoints.clone();
        let prefix = prefix.to_string();
        tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    m = stream.message() => m,
                    _ = tx.closed() => return,
                };
                let item = match msg {
                    Err(e) => Err(map_err(&endpoints, "watch", e)),
                    Ok(None) => Err(ClusterError::Unavailable {
                        endpoints: endpoints.clone(),
                        op: "watch",
                        source: "watch stream ended".into(),
                    }),
                    Ok(Some(resp)) if resp.compact_revision() > 0 => Err(ClusterError::Compacted {
                        prefix: prefix.clone(),
                        from,
                        compacted: resp.compact_revision(),
                    }),
                    Ok(Some(resp)) if resp.canceled() => Err(ClusterError::Unavailable {
                        endpoints: endpoints.clone(),
                        op: "watch",
                        source: format!("watch canceled: {}", resp.cancel_reason()).into(),
                    }),
                    Ok(Some(resp)) => {
                        let events: Vec<WatchEvent> = resp
                            .events()
                            .iter()
                            .filter_map(|ev| {
                                let kv = ev.kv()?;
                                Some(match ev.event_type() {
                                    ec::EventType::Put => WatchEvent::Put(to_kv(kv)),
                                    ec::EventType::Delete => WatchEvent::Delete {
                                        key: String::from_utf8_lossy(kv.key()).into_owned(),
                                        mod_revision: kv.mod_revision(),
                                    },
                                })
                            })
                            .collect();
                        if events.is_empty() {
                            continue;
                        }
                        Ok(events)
                    }
                };
                let fatal = item.is_err();
                if tx.send(item).await.is_err() || fatal {
                    return;
                }
            }
        });
        Ok(rx)
    }

    async fn campaign(&self, name: &str, value: Vec<u8>, lease: LeaseId) -> Result<LeaderKey> {
        let mut resp = self
            .c()
            .campaign(name, value, lease)
            .await
            .map_err(|e| lease_err(map_err(&self.endpoints, "campaign", e), lease))?;
        let lk = resp.take_leader().ok_or_else(|| ClusterError::Rejected {
            op: "campaign",
            message: "no leader key in response".into(),
        })?;
        Ok(LeaderKey {
            name: name.to_string(),
            key: String::from_utf8_lossy(lk.key()).into_owned(),
            create_revision: lk.rev(),
            lease: lk.lease(),
        })
    }

    async fn leader(&self, name: &str) -> Result<Option<Vec<u8>>> {
        match self.c().leader(name).await {
            Ok(resp) => Ok(resp.kv().map(|kv| kv.value().to_vec())),
            Err(ec::Error::GRpcStatus(s)) if s.message().contains("no leader") => Ok(None),
            Err(e) => Err(map_err(&self.endpoints, "leader", e)),
        }
    }

    async fn resign(&self, leader: &LeaderKey) -> Result<()> {
        let lk = ec::LeaderKey::new()
            .with_name(leader.name.clone())
            .with_key(leader.key.clone())
            .with_rev(leader.create_revision)
            .with_lease(leader.lease);
        self.c()
            .resign(Some(ec::ResignOptions::new().with_leader(lk)))
            .await
            .map_err(|e| map_err(&self.endpoints, "resign", e))?;
        Ok(())
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        self.c()
            .compact(revision, None)
            .await
            .map_err(|e| map_err(&self.endpoints, "compact", e))?;
        Ok(())
    }

    async fn set_user(&self, user: &str, password: &Secret, grants: &[Grant]) -> Result<()> {
        let mut c = self.c();
        let e = |op| move |e| map_err(&self.endpoints, op, e);
        // the role, with exactly these permissions (made afresh: a leftover keeps nothing)
        match c.role_delete(user).await {
            Ok(_) => {}
            Err(err) if not_found(&err) => {}
            Err(err) => return Err(e("role delete")(err)),
        }
        c.role_add(user).await.map_err(e("role add"))?;
        for g in grants {
            let mut p = if g.write {
                ec::Permission::read_write(g.key.as_str())
            } else {
                ec::Permission::read(g.key.as_str())
            };
            if g.prefix {
                p = p.with_prefix();
            }
            c.role_grant_permission(user, p)
                .await
                .map_err(e("role grant"))?;
        }
        match c.user_add(user, password.expose(), None).await {
            Ok(_) => {}
            Err(err) if already_exists(&err) => {
                c.user_change_password(user, password.expose())
                    .await
                    .map_err(e("user password"))?;
            }
            Err(err) => return Err(e("user add")(err)),
        }
        c.user_grant_role(user, user)
            .await
            .map_err(e("user grant role"))?;
        Ok(())
    }

    async fn remove_user(&self, user: &str) -> Result<bool> {
        let mut c = self.c();
        let mut found = false;
        match c.user_delete(user).await {
            Ok(_) => found = true,
            Err(err) if not_found(&err) => {}
            Err(err) => return Err(map_err(&self.endpoints, "user delete", err)),
        }
        match c.role_delete(user).await {
            Ok(_) => found = true,
            Err(err) if not_found(&err) => {}
            Err(err) => return Err(map_err(&self.endpoints, "role delete", err)),
        }
        Ok(found)
    }

    async fn users(&self) -> Result<Vec<String>> {
        let r = self
            .c()
            .user_list()
            .await
            .map_err(|e| map_err(&self.endpoints, "user list", e))?;
        Ok(r.users().to_vec())
    }
}

/// etcd refused a request because its auth store moved between the request's check and its
/// apply (a user or role changed meanwhile); nothing was applied.
fn auth_moved(e: &ec::Error) -> bool {
    matches!(e, ec::Error::GRpcStatus(s) if s.message().contains("auth store is old"))
}

/// etcd's answer for a user or role that is not there.
fn not_found(e: &ec::Error) -> bool {
    matches!(e, ec::Error::GRpcStatus(s) if s.message().contains("not found"))
}

fn already_exists(e: &ec::Error) -> bool {
    matches!(e, ec::Error::GRpcStatus(s) if s.message().contains("already exists"))
}

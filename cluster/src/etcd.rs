//! The real [`KvBackend`]: etcd v3 through etcd-client.

use std::time::Duration;

use async_trait::async_trait;
use etcd_client as ec;
use tokio::sync::mpsc;

use crate::kv::*;
use crate::{ClusterError, Result};

/// etcd, reached at one or more endpoints. Cloning shares the connection.
#[derive(Clone)]
pub struct EtcdBackend {
    client: ec::Client,
    endpoints: String,
}

impl EtcdBackend {
    /// Builds the client without contacting etcd (connections are made lazily, and re-made
    /// after etcd restarts). Use [`EtcdBackend::connect_checked`] to fail fast at start-up.
    pub async fn connect(endpoints: &[String]) -> Result<Self> {
        let joined = endpoints.join(",");
        let opts = ec::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        let client = ec::Client::connect(endpoints, Some(opts))
            .await
            .map_err(|e| map_err(&joined, "connect", e))?;
        Ok(EtcdBackend {
            client,
            endpoints: joined,
        })
    }

    /// Connects and makes one read, retrying for up to `wait`; the error says which endpoints
    /// could not be reached.
    pub async fn connect_checked(endpoints: &[String], wait: Duration) -> Result<Self> {
        let backend = Self::connect(endpoints).await?;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match backend.get("/ductile-probe").await {
                Ok(_) => return Ok(backend),
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
}

fn map_err(endpoints: &str, op: &'static str, e: ec::Error) -> ClusterError {
    use tonic::Code;
    match e {
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
            .c()
            .get(key, None)
            .await
            .map_err(|e| map_err(&self.endpoints, "get", e))?;
        Ok(resp.kvs().first().map(to_kv))
    }

    async fn list(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)> {
        let resp = self
            .c()
            .get(prefix, Some(ec::GetOptions::new().with_prefix()))
            .await
            .map_err(|e| map_err(&self.endpoints, "list", e))?;
        let rev = resp.header().map(|h| h.revision()).unwrap_or(0);
        Ok((resp.kvs().iter().map(to_kv).collect(), rev))
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        let opts = lease
            .filter(|l| *l != 0)
            .map(|l| ec::PutOptions::new().with_lease(l));
        let resp = self
            .c()
            .put(key, value, opts)
            .await
            .map_err(|e| lease_err(map_err(&self.endpoints, "put", e), lease.unwrap_or(0)))?;
        Ok(resp.header().map(|h| h.revision()).unwrap_or(0))
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        let resp = self
            .c()
            .delete(key, None)
            .await
            .map_err(|e| map_err(&self.endpoints, "delete", e))?;
        Ok(resp.deleted() > 0)
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        let resp = self
            .c()
            .delete(prefix, Some(ec::DeleteOptions::new().with_prefix()))
            .await
            .map_err(|e| map_err(&self.endpoints, "delete", e))?;
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
            .c()
            .txn(t)
            .await
            .map_err(|e| lease_err(map_err(&self.endpoints, "txn", e), lease.unwrap_or(0)))?;
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
}

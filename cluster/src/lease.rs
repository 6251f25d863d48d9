//! A lease kept alive in the background that survives transient etcd errors: keep-alive every
//! TTL/3, retry faster with backoff while etcd is unreachable, and grant a new lease when the old
//! one expired meanwhile, reporting it (the `epoch` goes up) so the owner can re-register.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::kv::{KvBackend, LeaseId};
use crate::ClusterError;

/// What the keeper holds now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseState {
    pub id: LeaseId,
    /// 0 for the first lease; +1 for each lease granted after the previous one expired.
    pub epoch: u64,
    /// The last keep-alive (or grant) succeeded.
    pub healthy: bool,
}

/// Handle to a running keeper. Dropping it does not stop it: cancel the token.
pub struct LeaseKeeper {
    state: watch::Receiver<LeaseState>,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseKeeper {
    /// Grants a lease (retrying until etcd answers or `cancel` fires) and keeps it alive until
    /// `cancel`, then revokes it so the keys under it disappear at once.
    pub async fn start(
        backend: Arc<dyn KvBackend>,
        ttl_secs: i64,
        cancel: CancellationToken,
    ) -> Result<LeaseKeeper, ClusterError> {
        let id = grant_retrying(&*backend, ttl_secs, &cancel).await?;
        let (tx, rx) = watch::channel(LeaseState {
            id,
            epoch: 0,
            healthy: true,
        });
        let task = tokio::spawn(keep(backend, ttl_secs, cancel, tx));
        Ok(LeaseKeeper { state: rx, task })
    }

    pub fn current(&self) -> LeaseState {
        *self.state.borrow()
    }

    pub fn subscribe(&self) -> watch::Receiver<LeaseState> {
        self.state.clone()
    }

    /// Waits for the keeper to finish (after cancellation it revokes, then ends).
    pub async fn join(self) {
        let _ = self.task.await;
    }
}

async fn grant_retrying(
    backend: &dyn KvBackend,
    ttl: i64,
    cancel: &CancellationToken,
) -> Result<LeaseId, ClusterError> {
    let mut delay = Duration::from_millis(100);
    loop {
        match backend.grant(ttl).await {
            Ok(id) => return Ok(id),
            Err(e) if e.is_retryable() => {
                tracing::warn!(error = %e, "lease grant failed; retrying");
            }
            Err(e) => return Err(e),
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = cancel.cancelled() => return Err(ClusterError::Closed),
        }
        delay = (delay * 2).min(Duration::from_secs(2));
    }
}

async fn keep(
    backend: Arc<dyn KvBackend>,
    ttl: i64,
    cancel: CancellationToken,
    tx: watch::Sender<LeaseState>,
) {
    let period = Duration::from_millis((ttl as u64 * 1000 / 3).max(100));
    let mut delay = period;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = cancel.cancelled() => {
                let id = tx.borrow().id;
                let _ = tokio::time::timeout(Duration::from_secs(1), backend.revoke(id)).await;
                return;
            }
        }
        let st = *tx.borrow();
        match backend.keep_alive_once(st.id).await {
            Ok(_) => {
                delay = period;
                if !st.healthy {
                    tracing::info!(lease = format!("{:x}", st.id), "lease keep-alive recovered");
                    tx.send_replace(LeaseState {
                        healthy: true,
                        ..st
                    });
                }
            }
            Err(ClusterError::LeaseNotFound { .. }) => {
                tracing::warn!(
                    lease = format!("{:x}", st.id),
                    "lease expired; granting a new one"
                );
                match grant_retrying(&*backend, ttl, &cancel).await {
                    Ok(id) => {
                        delay = period;
                        tx.send_replace(LeaseState {
                            id,
                            epoch: st.epoch + 1,
                            healthy: true,
                        });
                    }
                    Err(_) => return,
                }
            }
            Err(e) => {
                if st.healthy {
                    tracing::warn!(lease = format!("{:x}", st.id), error = %e, "lease keep-alive failed; retrying");
                    tx.send_replace(LeaseState {
                        healthy: false,
                        ..st
                    });
                }
                delay = Duration::from_millis(250).min(period);
            }
        }
    }
}

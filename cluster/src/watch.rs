//! A watch over a prefix as an explicit state machine: list at a revision, watch from
//! revision + 1, apply events to a cache, and re-list (swapping the whole cache at once) on
//! compaction or a broken stream. Consumers read whole snapshots and reconcile against them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::kv::{KeyValue, KvBackend, Revision, WatchEvent};
use crate::ClusterError;

/// The keys under a prefix as of `revision`.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// 0 until the first list succeeded.
    pub revision: Revision,
    pub kvs: BTreeMap<String, KeyValue>,
    /// How many times the cache was rebuilt from a fresh list (compaction, lost stream).
    pub relists: u64,
}

/// Starts the watcher task; it runs until `cancel`.
pub fn watch_prefix(
    backend: Arc<dyn KvBackend>,
    prefix: String,
    cancel: CancellationToken,
) -> watch::Receiver<Arc<Snapshot>> {
    let (tx, rx) = watch::channel(Arc::new(Snapshot::default()));
    tokio::spawn(async move {
        let mut relists = 0u64;
        let mut backoff = Duration::from_millis(100);
        loop {
            // List.
            let listed = tokio::select! {
                r = backend.list(&prefix) => r,
                _ = cancel.cancelled() => return,
            };
            let (kvs, rev) = match listed {
                Ok(x) => x,
                Err(e) => {
                    tracing::debug!(%prefix, error = %e, "list failed; retrying");
                    if sleep_or_cancel(backoff, &cancel).await {
                        return;
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            let mut snap = Snapshot {
                revision: rev,
                kvs: kvs.into_iter().map(|kv| (kv.key.clone(), kv)).collect(),
                relists,
            };
            relists += 1;
            tx.send_replace(Arc::new(snap.clone()));
            // Watch from the next revision.
            let mut stream = match backend.watch(&prefix, rev + 1).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(%prefix, error = %e, "watch failed; re-listing");
                    if sleep_or_cancel(backoff, &cancel).await {
                        return;
                    }
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            loop {
                let batch = tokio::select! {
                    b = stream.recv() => b,
                    _ = cancel.cancelled() => return,
                };
                match batch {
                    Some(Ok(events)) => {
                        for ev in events {
                            snap.revision = snap.revision.max(ev.revision());
                            match ev {
                                WatchEvent::Put(kv) => {
                                    snap.kvs.insert(kv.key.clone(), kv);
                                }
                                WatchEvent::Delete { key, .. } => {
                                    snap.kvs.remove(&key);
                                }
                            }
                        }
                        tx.send_replace(Arc::new(snap.clone()));
                    }
                    Some(Err(ClusterError::Compacted { .. })) => {
                        tracing::info!(%prefix, "watch compacted; re-listing");
                        break;
                    }
                    Some(Err(e)) => {
                        tracing::debug!(%prefix, error = %e, "watch broke; re-listing");
                        if sleep_or_cancel(backoff, &cancel).await {
                            return;
                        }
                        break;
                    }
                    None => {
                        if sleep_or_cancel(backoff, &cancel).await {
                            return;
                        }
                        break;
                    }
                }
            }
        }
    });
    rx
}

async fn sleep_or_cancel(d: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => false,
        _ = cancel.cancelled() => true,
    }
}

/// Waits until the watcher has listed at least once.
pub async fn synced(rx: &mut watch::Receiver<Arc<Snapshot>>) -> Arc<Snapshot> {
    loop {
        {
            let s = rx.borrow_and_update();
            if s.revision > 0 {
                return s.clone();
            }
        }
        if rx.changed().await.is_err() {
            return rx.borrow().clone();
        }
    }
}

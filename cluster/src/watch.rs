//! A watch over a prefix as an explicit state machine: list at a revision, watch from
//! revision + 1, apply events to a cache, and re-list (swapping the whole cache at once) on
//! compaction or a broken stream. Consumers read whole snapshots and reconcile against them.
//!
//! The cache is a persistent map: publishing a snapshot after each batch of events shares
//! everything the batch did not touch (a clone is O(1), an event O(log n)), and the snapshot
//! names the keys its batch changed, so a consumer can decode incrementally.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::kv::{KeyValue, KvBackend, Revision, WatchEvent};
use crate::ClusterError;

/// The keys of a snapshot, by key (a persistent map: cheap to clone).
pub type KvMap = rpds::RedBlackTreeMapSync<String, KeyValue>;

/// The keys under a prefix as of `revision`.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// 0 until the first list succeeded.
    pub revision: Revision,
    pub kvs: KvMap,
    /// How many times the cache was rebuilt from a fresh list (compaction, lost stream).
    pub relists: u64,
    /// The keys put or deleted lately, oldest first, each with its revision: every change
    /// after `changes_from` (at most [`CHANGES_KEPT`]; a re-list starts it afresh).
    pub changes: rpds::QueueSync<(Revision, String)>,
    /// The revision the change log starts after.
    pub changes_from: Revision,
}

/// How many changes a snapshot's log keeps.
pub const CHANGES_KEPT: usize = 4096;

impl Snapshot {
    /// The keys changed after `revision` (a snapshot of the same listing, `relists`), or None
    /// when the log does not reach back that far (decode everything again).
    pub fn changed_since(&self, revision: Revision, relists: u64) -> Option<Vec<&str>> {
        if relists != self.relists || revision < self.changes_from || revision > self.revision {
            return None;
        }
        Some(
            self.changes
                .iter()
                .filter(|(r, _)| *r > revision)
                .map(|(_, k)| k.as_str())
                .collect(),
        )
    }
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
                changes: Default::default(),
                changes_from: rev,
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
                            let rev = ev.revision();
                            snap.revision = snap.revision.max(rev);
                            let key = match ev {
                                WatchEvent::Put(kv) => {
                                    let key = kv.key.clone();
                                    snap.kvs.insert_mut(kv.key.clone(), kv);
                                    key
                                }
                                WatchEvent::Delete { key, .. } => {
                                    snap.kvs.remove_mut(&key);
                                    key
                                }
                            };
                            snap.changes.enqueue_mut((rev, key));
                            while snap.changes.len() > CHANGES_KEPT {
                                if let Some((r, _)) = snap.changes.peek() {
                                    snap.changes_from = *r;
                                }
                                snap.changes.dequeue_mut();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryBackend;

    /// A snapshot names the keys changed after an earlier revision of its listing, and says
    /// when its log does not reach back that far.
    #[tokio::test]
    async fn a_snapshot_names_the_keys_changed_since_an_earlier_one() {
        let backend: Arc<dyn KvBackend> = Arc::new(MemoryBackend::new());
        backend.put("/p/a", b"1".to_vec(), None).await.unwrap();
        let cancel = CancellationToken::new();
        let mut rx = watch_prefix(backend.clone(), "/p/".into(), cancel.clone());
        let first = synced(&mut rx).await;
        backend.put("/p/b", b"2".to_vec(), None).await.unwrap();
        backend.delete("/p/a").await.unwrap();
        let later = tokio::time::timeout(
            Duration::from_secs(5),
            rx.wait_for(|s| s.kvs.size() == 1 && s.kvs.contains_key("/p/b")),
        )
        .await
        .unwrap()
        .unwrap()
        .clone();
        let mut changed = later.changed_since(first.revision, first.relists).unwrap();
        changed.sort();
        assert_eq!(changed, vec!["/p/a", "/p/b"]);
        assert_eq!(
            later.changed_since(later.revision, later.relists).unwrap(),
            Vec::<&str>::new()
        );
        // before the listing, or of another listing: unknown
        assert!(later
            .changed_since(first.revision - 1, first.relists)
            .is_none());
        assert!(later
            .changed_since(first.revision, first.relists + 1)
            .is_none());
        // the earlier snapshot is untouched by the later changes (shared, not mutated)
        assert!(first.kvs.contains_key("/p/a") && !first.kvs.contains_key("/p/b"));
        cancel.cancel();
    }
}

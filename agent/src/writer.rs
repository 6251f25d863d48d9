//! The agent's writes to etcd, off the actor's path: the actor queues the newest value of a key
//! and goes on; this task writes it (under the agent's current lease when asked) and retries
//! until it is written. An etcd outage therefore never stalls the actor, whose loop is what
//! the systemd watchdog ping vouches for.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ductile_cluster::lease::LeaseState;
use ductile_cluster::Store;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

#[derive(Default)]
struct Inner {
    /// key → (value, under the lease)
    pending: Mutex<BTreeMap<String, (Vec<u8>, bool)>>,
    notify: Notify,
    /// woken after each pass, for `flush`
    passed: Notify,
}

#[derive(Clone)]
pub struct Writer {
    inner: Arc<Inner>,
}

impl Writer {
    pub fn start(
        store: Store,
        lease: watch::Receiver<LeaseState>,
        cancel: CancellationToken,
    ) -> Writer {
        let inner = Arc::new(Inner::default());
        tokio::spawn(run(store, inner.clone(), lease, cancel));
        Writer { inner }
    }

    /// Queue `value` for `key` (replacing a value not yet written).
    pub fn put(&self, key: String, value: Vec<u8>, leased: bool) {
        self.inner
            .pending
            .lock()
            .unwrap()
            .insert(key, (value, leased));
        self.inner.notify.notify_one();
    }

    /// Whether a write of `key` is still queued.
    pub fn is_pending(&self, key: &str) -> bool {
        self.inner.pending.lock().unwrap().contains_key(key)
    }

    pub fn pending(&self) -> usize {
        self.inner.pending.lock().unwrap().len()
    }

    /// Wait until every queued write is done, at most `limit`; whether it was.
    pub async fn flush(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let passed = self.inner.passed.notified();
            if self.pending() == 0 {
                return true;
            }
            self.inner.notify.notify_one();
            if tokio::time::timeout_at(deadline, passed).await.is_err() {
                return self.pending() == 0;
            }
        }
    }
}

async fn run(
    store: Store,
    inner: Arc<Inner>,
    lease: watch::Receiver<LeaseState>,
    cancel: CancellationToken,
) {
    let mut retry = Duration::from_secs(1);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = inner.notify.notified() => {}
            _ = tokio::time::sleep(retry) => {}
            _ = cancel.cancelled() => return,
        }
        let batch: Vec<(String, (Vec<u8>, bool))> = inner
            .pending
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let id = lease.borrow().id;
        let mut ok = true;
        for (key, (value, leased)) in batch {
            match store
                .backend
                .put(&key, value.clone(), leased.then_some(id))
                .await
            {
                Ok(_) => {
                    let mut p = inner.pending.lock().unwrap();
                    // a newer value queued meanwhile is written in the next pass
                    if p.get(&key)
                        .is_some_and(|(v, l)| *v == value && *l == leased)
                    {
                        p.remove(&key);
                    }
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(%key, error = %e, "write failed; will retry");
                    }
                    ok = false;
                    break;
                }
            }
        }
        if ok && failing {
            tracing::info!("etcd writes go through again");
        }
        failing = !ok;
        retry = if ok {
            Duration::from_secs(1)
        } else {
            (retry * 2).clamp(Duration::from_millis(250), Duration::from_secs(2))
        };
        inner.passed.notify_waiters();
    }
}

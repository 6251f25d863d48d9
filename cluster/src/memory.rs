//! An in-memory [`KvBackend`] with etcd's semantics (revisions, leases that expire, watches
//! with history and compaction, transactions, elections), for fast unit tests. Time is tokio's,
//! so tests can run it on a paused clock.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use crate::kv::*;
use crate::{ClusterError, Result};

struct Lease {
    ttl: i64,
    deadline: Instant,
}

#[derive(Default)]
struct State {
    revision: Revision,
    compacted: Revision,
    kvs: BTreeMap<String, KeyValue>,
    leases: HashMap<LeaseId, Lease>,
    next_lease: LeaseId,
    history: Vec<WatchEvent>,
    watchers: Vec<(String, mpsc::Sender<Result<Vec<WatchEvent>>>)>,
}

struct Inner {
    state: Mutex<State>,
    changed: Notify,
}

/// See the module docs. Cloning shares the store.
#[derive(Clone)]
pub struct MemoryBackend {
    inner: Arc<Inner>,
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBackend {
    /// Needs a tokio runtime: it runs the lease-expiry ticker (every 50 ms of tokio time).
    pub fn new() -> Self {
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                next_lease: 0x1000,
                revision: 1,
                ..Default::default()
            }),
            changed: Notify::new(),
        });
        let weak: Weak<Inner> = Arc::downgrade(&inner);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let Some(inner) = weak.upgrade() else { return };
                let now = Instant::now();
                let mut st = inner.state.lock().unwrap();
                let expired: Vec<LeaseId> = st
                    .leases
                    .iter()
                    .filter(|(_, l)| l.deadline <= now)
                    .map(|(id, _)| *id)
                    .collect();
                if !expired.is_empty() {
                    for id in expired {
                        revoke_locked(&mut st, id);
                    }
                    drop(st);
                    inner.changed.notify_waiters();
                }
            }
        });
        MemoryBackend { inner }
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let mut st = self.inner.state.lock().unwrap();
        let out = f(&mut st);
        drop(st);
        self.inner.changed.notify_waiters();
        out
    }
}

/// Apply one batch of events at a new revision: history, then fan out to watchers.
fn commit(st: &mut State, events: Vec<WatchEvent>) {
    if events.is_empty() {
        return;
    }
    st.history.extend(events.iter().cloned());
    st.watchers.retain(|(prefix, tx)| {
        let mine: Vec<WatchEvent> = events
            .iter()
            .filter(|e| e.key().starts_with(prefix.as_str()))
            .cloned()
            .collect();
        if mine.is_empty() {
            return !tx.is_closed();
        }
        tx.try_send(Ok(mine)).is_ok()
    });
}

fn put_locked(
    st: &mut State,
    rev: Revision,
    key: &str,
    value: Vec<u8>,
    lease: Option<LeaseId>,
) -> Result<WatchEvent> {
    let lease = lease.unwrap_or(0);
    if lease != 0 && !st.leases.contains_key(&lease) {
        return Err(ClusterError::LeaseNotFound { lease });
    }
    let create_revision = st.kvs.get(key).map(|kv| kv.create_revision).unwrap_or(rev);
    let kv = KeyValue {
        key: key.to_string(),
        value,
        create_revision,
        mod_revision: rev,
        lease,
    };
    st.kvs.insert(key.to_string(), kv.clone());
    Ok(WatchEvent::Put(kv))
}

fn delete_locked(st: &mut State, rev: Revision, key: &str) -> Option<WatchEvent> {
    st.kvs.remove(key).map(|_| WatchEvent::Delete {
        key: key.to_string(),
        mod_revision: rev,
    })
}

fn revoke_locked(st: &mut State, id: LeaseId) -> bool {
    if st.leases.remove(&id).is_none() {
        return false;
    }
    let keys: Vec<String> = st
        .kvs
        .values()
        .filter(|kv| kv.lease == id)
        .map(|kv| kv.key.clone())
        .collect();
    if !keys.is_empty() {
        st.revision += 1;
        let rev = st.revision;
        let events = keys
            .iter()
            .filter_map(|k| delete_locked(st, rev, k))
            .collect();
        commit(st, events);
    }
    true
}

fn holds(st: &State, c: &Compare) -> bool {
    match c {
        Compare::Absent(k) => !st.kvs.contains_key(k),
        Compare::ModRevision(k, r) => st.kvs.get(k).map(|kv| kv.mod_revision).unwrap_or(0) == *r,
        Compare::CreateRevision(k, r) => {
            st.kvs.get(k).map(|kv| kv.create_revision).unwrap_or(0) == *r
        }
        Compare::Value(k, v) => st.kvs.get(k).map(|kv| &kv.value == v).unwrap_or(false),
    }
}

fn leader_locked(st: &State, name: &str) -> Option<KeyValue> {
    let prefix = format!("{name}/");
    st.kvs
        .range(prefix.clone()..)
        .take_while(|(k, _)| k.starts_with(&prefix))
        .map(|(_, kv)| kv)
        .min_by_key(|kv| kv.create_revision)
        .cloned()
}

#[async_trait]
impl KvBackend for MemoryBackend {
    fn describe(&self) -> String {
        "memory".into()
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        Ok(self.inner.state.lock().unwrap().kvs.get(key).cloned())
    }

    async fn list(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)> {
        let st = self.inner.state.lock().unwrap();
        let kvs = st
            .kvs
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v.clone())
            .collect();
        Ok((kvs, st.revision))
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        self.with(|st| {
            let rev = st.revision + 1;
            let ev = put_locked(st, rev, key, value, lease)?;
            st.revision = rev;
            commit(st, vec![ev]);
            Ok(rev)
        })
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        self.with(|st| {
            let rev = st.revision + 1;
            match delete_locked(st, rev, key) {
                Some(ev) => {
                    st.revision = rev;
                    commit(st, vec![ev]);
                    Ok(true)
                }
                None => Ok(false),
            }
        })
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        self.with(|st| {
            let keys: Vec<String> = st
                .kvs
                .range(prefix.to_string()..)
                .take_while(|(k, _)| k.starts_with(prefix))
                .map(|(k, _)| k.clone())
                .collect();
            if keys.is_empty() {
                return Ok(0);
            }
            st.revision += 1;
            let rev = st.revision;
            let events: Vec<_> = keys
                .iter()
                .filter_map(|k| delete_locked(st, rev, k))
                .collect();
            let n = events.len() as u64;
            commit(st, events);
            Ok(n)
        })
    }

    async fn txn(&self, txn: Txn) -> Result<TxnOutcome> {
        self.with(|st| {
            if !txn.compares.iter().all(|c| holds(st, c)) {
                return Ok(TxnOutcome {
                    succeeded: false,
                    revision: st.revision,
                });
            }
            // check leases first so a failing op leaves nothing half-applied
            for op in &txn.ops {
                if let Op::Put { lease: Some(l), .. } = op {
                    if *l != 0 && !st.leases.contains_key(l) {
                        return Err(ClusterError::LeaseNotFound { lease: *l });
                    }
                }
            }
            let rev = st.revision + 1;
            let mut events = Vec::new();
            for op in txn.ops {
                match op {
                    Op::Put { key, value, lease } => {
                        events.push(put_locked(st, rev, &key, value, lease)?)
                    }
                    Op::Delete { key } => events.extend(delete_locked(st, rev, &key)),
                    Op::DeletePrefix { prefix } => {
                        let keys: Vec<String> = st
                            .kvs
                            .range(prefix.clone()..)
                            .take_while(|(k, _)| k.starts_with(&prefix))
                            .map(|(k, _)| k.clone())
                            .collect();
                        for k in keys {
                            events.extend(delete_locked(st, rev, &k));
                        }
                    }
                }
            }
            if !events.is_empty() {
                st.revision = rev;
            }
            commit(st, events);
            Ok(TxnOutcome {
                succeeded: true,
                revision: st.revision,
            })
        })
    }

    async fn grant(&self, ttl_secs: i64) -> Result<LeaseId> {
        if ttl_secs <= 0 {
            return Err(ClusterError::Rejected {
                op: "lease grant",
                message: format!("ttl {ttl_secs} must be positive"),
            });
        }
        self.with(|st| {
            st.next_lease += 1;
            let id = st.next_lease;
            st.leases.insert(
                id,
                Lease {
                    ttl: ttl_secs,
                    deadline: Instant::now() + Duration::from_secs(ttl_secs as u64),
                },
            );
            Ok(id)
        })
    }

    async fn keep_alive_once(&self, lease: LeaseId) -> Result<i64> {
        let mut st = self.inner.state.lock().unwrap();
        match st.leases.get_mut(&lease) {
            Some(l) => {
                l.deadline = Instant::now() + Duration::from_secs(l.ttl as u64);
                Ok(l.ttl)
            }
            None => Err(ClusterError::LeaseNotFound { lease }),
        }
    }

    async fn revoke(&self, lease: LeaseId) -> Result<()> {
        self.with(|st| {
            if revoke_locked(st, lease) {
                Ok(())
            } else {
                Err(ClusterError::LeaseNotFound { lease })
            }
        })
    }

    async fn watch(&self, prefix: &str, from: Revision) -> Result<WatchReceiver> {
        let (tx, rx) = mpsc::channel(65_536);
        let mut st = self.inner.state.lock().unwrap();
        if from <= st.compacted && from != 0 {
            let _ = tx.try_send(Err(ClusterError::Compacted {
                prefix: prefix.into(),
                from,
                compacted: st.compacted,
            }));
            return Ok(rx);
        }
        // replay history from `from`, batched by revision
        let mut batch: Vec<WatchEvent> = Vec::new();
        for ev in st
            .history
            .iter()
            .filter(|e| e.revision() >= from && e.key().starts_with(prefix))
        {
            if batch.last().is_some_and(|b| b.revision() != ev.revision()) {
                let _ = tx.try_send(Ok(std::mem::take(&mut batch)));
            }
            batch.push(ev.clone());
        }
        if !batch.is_empty() {
            let _ = tx.try_send(Ok(batch));
        }
        st.watchers.push((prefix.to_string(), tx));
        Ok(rx)
    }

    async fn campaign(&self, name: &str, value: Vec<u8>, lease: LeaseId) -> Result<LeaderKey> {
        let key = format!("{name}/{lease:x}");
        let mine = self.with(|st| {
            if let Some(kv) = st.kvs.get(&key) {
                return Ok(kv.create_revision);
            }
            let rev = st.revision + 1;
            let ev = put_locked(st, rev, &key, value, Some(lease))?;
            st.revision = rev;
            commit(st, vec![ev]);
            Ok(rev)
        })?;
        loop {
            let notified = self.inner.changed.notified();
            {
                let st = self.inner.state.lock().unwrap();
                match st.kvs.get(&key) {
                    None => return Err(ClusterError::LeaseNotFound { lease }),
                    Some(kv) if kv.create_revision != mine => {
                        return Err(ClusterError::LeaseNotFound { lease })
                    }
                    Some(_) => {}
                }
                if leader_locked(&st, name).is_some_and(|l| l.key == key) {
                    return Ok(LeaderKey {
                        name: name.into(),
                        key,
                        create_revision: mine,
                        lease,
                    });
                }
            }
            notified.await;
        }
    }

    async fn leader(&self, name: &str) -> Result<Option<Vec<u8>>> {
        Ok(leader_locked(&self.inner.state.lock().unwrap(), name).map(|kv| kv.value))
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        self.with(|st| {
            st.compacted = st.compacted.max(revision);
            st.history.retain(|e| e.revision() > revision);
        });
        Ok(())
    }

    async fn resign(&self, leader: &LeaderKey) -> Result<()> {
        let _ = self
            .txn(Txn {
                compares: vec![Compare::CreateRevision(
                    leader.key.clone(),
                    leader.create_revision,
                )],
                ops: vec![Op::Delete {
                    key: leader.key.clone(),
                }],
            })
            .await?;
        Ok(())
    }
}

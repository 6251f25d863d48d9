//! The store trait over etcd's data model, implemented by [`crate::etcd::EtcdBackend`] and
//! [`crate::memory::MemoryBackend`]. Both pass the same conformance suite
//! ([`crate::conformance`]).

use async_trait::async_trait;
use tokio::sync::mpsc;

use crate::Result;

pub type Revision = i64;
pub type LeaseId = i64;

/// A key and its value, with etcd's revision bookkeeping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    pub create_revision: Revision,
    pub mod_revision: Revision,
    pub lease: LeaseId,
}

/// A condition of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Compare {
    /// The key does not exist.
    Absent(String),
    /// The key's last modification was at this revision.
    ModRevision(String, Revision),
    /// The key was created at this revision (and still exists).
    CreateRevision(String, Revision),
    /// The key holds exactly this value.
    Value(String, Vec<u8>),
}

/// A write inside a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    },
    Delete {
        key: String,
    },
    DeletePrefix {
        prefix: String,
    },
}

impl Op {
    pub fn put(key: impl Into<String>, value: Vec<u8>) -> Op {
        Op::Put {
            key: key.into(),
            value,
            lease: None,
        }
    }
}

/// All compares hold → all ops applied atomically at one new revision; else nothing changes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Txn {
    pub compares: Vec<Compare>,
    pub ops: Vec<Op>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxnOutcome {
    pub succeeded: bool,
    pub revision: Revision,
}

/// One change seen by a watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    Put(KeyValue),
    Delete { key: String, mod_revision: Revision },
}

impl WatchEvent {
    pub fn key(&self) -> &str {
        match self {
            WatchEvent::Put(kv) => &kv.key,
            WatchEvent::Delete { key, .. } => key,
        }
    }
    pub fn revision(&self) -> Revision {
        match self {
            WatchEvent::Put(kv) => kv.mod_revision,
            WatchEvent::Delete { mod_revision, .. } => *mod_revision,
        }
    }
}

/// A stream of watch batches. Ends with `Err` (compaction, transport) or `None` (closed).
pub type WatchReceiver = mpsc::Receiver<Result<Vec<WatchEvent>>>;

/// A key whose owner leads an election. Its create revision fences the leader's writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderKey {
    pub name: String,
    pub key: String,
    pub create_revision: Revision,
    pub lease: LeaseId,
}

/// etcd's data model: keys, revisions, leases, watches, transactions, elections.
#[async_trait]
pub trait KvBackend: Send + Sync + 'static {
    /// A short description for errors and logs (`etcd http://127.0.0.1:2379`, `memory`).
    fn describe(&self) -> String;
    async fn get(&self, key: &str) -> Result<Option<KeyValue>>;
    /// Every key starting with `prefix`, sorted, and the store revision it was read at.
    async fn list(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)>;
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision>;
    /// Returns whether the key existed.
    async fn delete(&self, key: &str) -> Result<bool>;
    /// Returns how many keys were deleted.
    async fn delete_prefix(&self, prefix: &str) -> Result<u64>;
    async fn txn(&self, txn: Txn) -> Result<TxnOutcome>;
    async fn grant(&self, ttl_secs: i64) -> Result<LeaseId>;
    /// Refresh a lease once; returns its remaining TTL, or `LeaseNotFound` if it expired.
    async fn keep_alive_once(&self, lease: LeaseId) -> Result<i64>;
    async fn revoke(&self, lease: LeaseId) -> Result<()>;
    /// Watch every key under `prefix` from revision `from` (inclusive).
    async fn watch(&self, prefix: &str, from: Revision) -> Result<WatchReceiver>;
    /// Block until `value` leads election `name`; the candidacy lives as long as `lease`.
    async fn campaign(&self, name: &str, value: Vec<u8>, lease: LeaseId) -> Result<LeaderKey>;
    /// The current leader's value, if there is one.
    async fn leader(&self, name: &str) -> Result<Option<Vec<u8>>>;
    async fn resign(&self, leader: &LeaderKey) -> Result<()>;
    /// Forget history up to `revision`; later watches from before it fail with `Compacted`.
    async fn compact(&self, revision: Revision) -> Result<()>;

    /// Make `user` (or give it a new password) with exactly `grants`, through a role of the
    /// same name (etcd auth; needs the root role). Stores without users refuse.
    async fn set_user(
        &self,
        user: &str,
        _password: &crate::access::Secret,
        _grants: &[crate::access::Grant],
    ) -> Result<()> {
        Err(no_users(&self.describe(), user))
    }
    /// Remove `user` and its role; Ok(false) when neither was there.
    async fn remove_user(&self, user: &str) -> Result<bool> {
        Err(no_users(&self.describe(), user))
    }
    /// The names of all users.
    async fn users(&self) -> Result<Vec<String>> {
        Err(no_users(&self.describe(), "any"))
    }
}

fn no_users(store: &str, user: &str) -> crate::ClusterError {
    crate::ClusterError::Rejected {
        op: "user management",
        message: format!("{store} has no users (user {user:?})"),
    }
}

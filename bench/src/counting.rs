//! A [`KvBackend`] that counts the requests it forwards, by kind.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use ductile_cluster::kv::*;
use ductile_cluster::Result;

#[derive(Clone)]
pub struct Counting {
    pub inner: Arc<dyn KvBackend>,
    pub counts: Arc<Mutex<BTreeMap<&'static str, u64>>>,
}

impl Counting {
    pub fn new(inner: Arc<dyn KvBackend>) -> Self {
        Counting {
            inner,
            counts: Arc::default(),
        }
    }
    fn hit(&self, k: &'static str) {
        *self.counts.lock().unwrap().entry(k).or_default() += 1;
    }
    pub fn snapshot(&self) -> BTreeMap<&'static str, u64> {
        self.counts.lock().unwrap().clone()
    }
}

#[async_trait]
impl KvBackend for Counting {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        self.hit("get");
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)> {
        self.hit("list");
        self.inner.list(prefix).await
    }
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        self.hit("put");
        self.inner.put(key, value, lease).await
    }
    async fn delete(&self, key: &str) -> Result<bool> {
        self.hit("delete");
        self.inner.delete(key).await
    }
    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        self.hit("delete");
        self.inner.delete_prefix(prefix).await
    }
    async fn txn(&self, txn: Txn) -> Result<TxnOutcome> {
        self.hit("txn");
        self.inner.txn(txn).await
    }
    async fn grant(&self, ttl: i64) -> Result<LeaseId> {
        self.hit("lease");
        self.inner.grant(ttl).await
    }
    async fn keep_alive_once(&self, lease: LeaseId) -> Result<i64> {
        self.hit("lease");
        self.inner.keep_alive_once(lease).await
    }
    async fn revoke(&self, lease: LeaseId) -> Result<()> {
        self.hit("lease");
        self.inner.revoke(lease).await
    }
    async fn watch(&self, prefix: &str, from: Revision) -> Result<WatchReceiver> {
        self.hit("watch");
        self.inner.watch(prefix, from).await
    }
    async fn campaign(&self, name: &str, value: Vec<u8>, lease: LeaseId) -> Result<LeaderKey> {
        self.hit("election");
        self.inner.campaign(name, value, lease).await
    }
    async fn leader(&self, name: &str) -> Result<Option<Vec<u8>>> {
        self.hit("election");
        self.inner.leader(name).await
    }
    async fn resign(&self, leader: &LeaderKey) -> Result<()> {
        self.hit("election");
        self.inner.resign(leader).await
    }
    async fn compact(&self, revision: Revision) -> Result<()> {
        self.hit("compact");
        self.inner.compact(revision).await
    }
}

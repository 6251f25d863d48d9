//! Clean-up deletes gathered into etcd transactions of bounded size (the lighthouse's rooms,
//! ended jobs' `live/` keys).

use ductile_cluster::kv::{Compare, Op, Txn};
use ductile_cluster::Store;

/// Clean-up writes gathered into transactions of at most [`Batch::MAX_OPS`] compares and
/// operations (etcd's `--max-txn-ops` is 128 by default). A batch whose compare fails (a key
/// moved meanwhile) is dropped whole: the next clean-up decides again from a newer snapshot.
pub struct Batch {
    store: Store,
    compares: Vec<Compare>,
    ops: Vec<Op>,
}

impl Batch {
    const MAX_OPS: usize = 100;

    pub fn new(store: Store) -> Self {
        Batch {
            store,
            compares: Vec::new(),
            ops: Vec::new(),
        }
    }

    /// Adds one change; false when a write failed (the clean-up stops until next time).
    pub async fn add(&mut self, compares: Vec<Compare>, ops: Vec<Op>) -> bool {
        if self.compares.len() + self.ops.len() + compares.len() + ops.len() > Self::MAX_OPS
            && !self.flush().await
        {
            return false;
        }
        self.compares.extend(compares);
        self.ops.extend(ops);
        true
    }

    pub async fn flush(&mut self) -> bool {
        if self.ops.is_empty() {
            return true;
        }
        let txn = Txn {
            compares: std::mem::take(&mut self.compares),
            ops: std::mem::take(&mut self.ops),
        };
        match self.store.backend.txn(txn).await {
            Ok(_) => true,
            Err(e) => {
                tracing::debug!(error = %e, "clean-up batch failed; next time");
                false
            }
        }
    }
}

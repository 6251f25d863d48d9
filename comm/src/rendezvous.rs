//! The per-generation exchange through etcd (via `cluster`).

use crate::auth::MeshKey;
use std::collections::BTreeMap;
use std::time::Duration;

use ductile_cluster::keys::Keys;
use ductile_cluster::watch::watch_prefix;
use ductile_cluster::Store;
use tokio_util::sync::CancellationToken;

pub use crate::error::CommError;

/// One rank's view of its generation's rendezvous.
pub struct Rendezvous {
    pub store: Store,
    pub job: String,
    pub generation: u64,
    pub world: u32,
    pub rank: u32,
}

impl Rendezvous {
    pub fn new(
        store: Store,
        job: &str,
        generation: u64,
        world: u32,
        rank: u32,
    ) -> Result<Self, CommError> {
        if rank >= world {
            return Err(CommError::BadRank {
                generation,
                rank,
                world,
            });
        }
        Ok(Rendezvous {
            store,
            job: job.to_string(),
            generation,
            world,
            rank,
        })
    }

    /// This generation's mesh key (`jobs/{job}/mesh_key`, written with the generation). A key
    /// of a later generation means this one is over; none, or an older one, is an error naming
    /// the key (the leader writes it with every generation it publishes).
    pub async fn mesh_key(&self) -> Result<MeshKey, CommError> {
        let key = self.store.keys.mesh_key(&self.job);
        let rec = self
            .store
            .get_json::<ductile_cluster::records::MeshKey>(&key, "mesh key")
            .await
            .map_err(|source| CommError::Store {
                generation: self.generation,
                source,
            })?
            .map(|(r, _)| r);
        match rec {
            Some(r) if r.generation == self.generation => r
                .bytes()
                .map(|b| MeshKey::new(self.generation, &b))
                .map_err(|e| CommError::Unavailable(format!("{key}: {e}"))),
            Some(r) if r.generation > self.generation => Err(CommError::Aborted {
                generation: self.generation,
                op: "form",
            }),
            Some(r) => Err(CommError::Unavailable(format!(
                "{key} holds the mesh key of generation {}, not {}'s",
                r.generation, self.generation
            ))),
            None => Err(CommError::Unavailable(format!(
                "no mesh key at {key} for generation {} (the leader writes one with every generation)",
                self.generation
            ))),
        }
    }

    fn prefix(&self, topic: &str) -> String {
        format!(
            "{}{topic}/",
            Keys::rendezvous(&self.store.keys, &self.job, self.generation)
        )
    }

    /// Publish this rank's value under `topic`, once: a value another attempt left there is
    /// never taken for this one's (a generation is formed once; every retry is a new
    /// generation with its own space), so a second, different value is refused.
    pub async fn publish(&self, topic: &str, value: &[u8]) -> Result<(), CommError> {
        use ductile_cluster::kv::{Compare, Op, Txn};
        let key = format!("{}{}", self.prefix(topic), self.rank);
        let store_err = |source| CommError::Store {
            generation: self.generation,
            source,
        };
        let created = self
            .store
            .backend
            .txn(Txn {
                compares: vec![Compare::Absent(key.clone())],
                ops: vec![Op::put(&key, value.to_vec())],
            })
            .await
            .map_err(store_err)?
            .succeeded;
        if created {
            return Ok(());
        }
        match self.store.backend.get(&key).await.map_err(store_err)? {
            Some(kv) if kv.value == value => Ok(()),
            _ => Err(CommError::Unavailable(format!(
                "generation {}: rank {} already published {topic:?} in another attempt; a generation is formed once (waiting for the next)",
                self.generation, self.rank
            ))),
        }
    }

    /// Wait until every rank published under `topic`; values in rank order. The error names the
    /// ranks that never did.
    pub async fn gather(&self, topic: &str, timeout: Duration) -> Result<Vec<Vec<u8>>, CommError> {
        let prefix = self.prefix(topic);
        let cancel = CancellationToken::new();
        let _stop = cancel.clone().drop_guard();
        let mut rx = watch_prefix(self.store.backend.clone(), prefix.clone(), cancel);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let have: BTreeMap<u32, Vec<u8>> = {
                let snap = rx.borrow_and_update();
                snap.kvs
                    .iter()
                    .filter_map(|(k, kv)| {
                        k.strip_prefix(&prefix)?
                            .parse::<u32>()
                            .ok()
                            .filter(|r| *r < self.world)
                            .map(|r| (r, kv.value.clone()))
                    })
                    .collect()
            };
            if have.len() == self.world as usize {
                return Ok(have.into_values().collect());
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => {
                    let missing = (0..self.world).filter(|r| !have.contains_key(r)).collect();
                    return Err(CommError::RendezvousTimeout {
                        generation: self.generation,
                        after: timeout,
                        missing,
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn every_rank_sees_every_value_in_rank_order_and_missing_ranks_are_named() {
        let store = Store::new(
            Arc::new(ductile_cluster::memory::MemoryBackend::new()),
            Keys::default(),
        );
        let mut tasks = Vec::new();
        for rank in 0..4u32 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let r = Rendezvous::new(store, "j", 7, 4, rank).unwrap();
                r.publish("addr", format!("127.0.0.1:{}", 1000 + rank).as_bytes())
                    .await
                    .unwrap();
                r.gather("addr", Duration::from_secs(5)).await.unwrap()
            }));
        }
        for t in tasks {
            let v = t.await.unwrap();
            let got: Vec<String> = v
                .into_iter()
                .map(|b| String::from_utf8(b).unwrap())
                .collect();
            assert_eq!(
                got,
                vec![
                    "127.0.0.1:1000",
                    "127.0.0.1:1001",
                    "127.0.0.1:1002",
                    "127.0.0.1:1003"
                ]
            );
        }
        // a second attempt at the same generation cannot reuse or overwrite the first's entry
        let again = Rendezvous::new(store.clone(), "j", 7, 4, 2).unwrap();
        again.publish("addr", b"127.0.0.1:1002").await.unwrap(); // the same value: idempotent
        let e = again.publish("addr", b"127.0.0.1:9999").await.unwrap_err();
        assert!(e.to_string().contains("formed once"), "{e}");
        // another generation is a different space; a missing rank is named
        let r = Rendezvous::new(store.clone(), "j", 8, 3, 0).unwrap();
        r.publish("addr", b"x").await.unwrap();
        match r.gather("addr", Duration::from_millis(200)).await {
            Err(CommError::RendezvousTimeout {
                generation: 8,
                missing,
                ..
            }) => assert_eq!(missing, vec![1, 2]),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            Rendezvous::new(store, "j", 8, 3, 3),
            Err(CommError::BadRank { .. })
        ));
    }
}

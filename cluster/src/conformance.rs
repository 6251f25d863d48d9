//! One conformance suite for every [`KvBackend`]: run against [`crate::memory::MemoryBackend`]
//! in unit tests and against a real etcd in the integration tests. Each check panics with what
//! it expected. `ns` keeps runs apart (a unique key prefix).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep, timeout, Instant};
use tokio_util::sync::CancellationToken;

use crate::kv::*;
use crate::lease::LeaseKeeper;
use crate::ClusterError;

/// Runs every check in order.
pub async fn run_all(b: Arc<dyn KvBackend>, ns: &str) {
    kv_basics(&*b, &format!("{ns}/kv")).await;
    txn_is_all_or_nothing(&*b, &format!("{ns}/txn")).await;
    leases_expire_and_take_their_keys(&*b, &format!("{ns}/lease")).await;
    watch_replays_history_then_follows(&*b, &format!("{ns}/watch")).await;
    watch_from_compacted_revision_fails(&*b, &format!("{ns}/compact")).await;
    election_has_one_leader(&*b, &format!("{ns}/election")).await;
    lease_keeper_regrants_after_expiry(b.clone(), &format!("{ns}/keeper")).await;
    prefix_watcher_follows_and_relists(b.clone(), &format!("{ns}/pw")).await;
}

pub async fn kv_basics(b: &dyn KvBackend, ns: &str) {
    assert_eq!(b.get(&format!("{ns}/a")).await.unwrap(), None);
    let r1 = b
        .put(&format!("{ns}/a"), b"1".to_vec(), None)
        .await
        .unwrap();
    let r2 = b
        .put(&format!("{ns}/b"), b"2".to_vec(), None)
        .await
        .unwrap();
    let r3 = b
        .put(&format!("{ns}/a"), b"3".to_vec(), None)
        .await
        .unwrap();
    assert!(
        r1 < r2 && r2 < r3,
        "revisions must increase: {r1} {r2} {r3}"
    );
    let a = b.get(&format!("{ns}/a")).await.unwrap().unwrap();
    assert_eq!(a.value, b"3");
    assert_eq!((a.create_revision, a.mod_revision), (r1, r3));
    b.put(&format!("{ns}x/other"), b"x".to_vec(), None)
        .await
        .unwrap();
    let (kvs, rev) = b.list(&format!("{ns}/")).await.unwrap();
    assert_eq!(
        kvs.iter().map(|k| k.key.as_str()).collect::<Vec<_>>(),
        vec![format!("{ns}/a"), format!("{ns}/b")]
    );
    assert!(rev >= r3);
    assert!(b.delete(&format!("{ns}/a")).await.unwrap());
    assert!(!b.delete(&format!("{ns}/a")).await.unwrap());
    assert_eq!(b.delete_prefix(&format!("{ns}/")).await.unwrap(), 1);
    assert_eq!(b.delete_prefix(&format!("{ns}x/")).await.unwrap(), 1);
    assert!(b.list(&format!("{ns}/")).await.unwrap().0.is_empty());
}

pub async fn txn_is_all_or_nothing(b: &dyn KvBackend, ns: &str) {
    let k = format!("{ns}/gen");
    let ok = b
        .txn(Txn {
            compares: vec![Compare::Absent(k.clone())],
            ops: vec![
                Op::put(&k, b"1".to_vec()),
                Op::put(format!("{ns}/h1"), b"1".to_vec()),
            ],
        })
        .await
        .unwrap();
    assert!(ok.succeeded);
    let kv = b.get(&k).await.unwrap().unwrap();
    // absent no longer holds: nothing of the txn applies
    let no = b
        .txn(Txn {
            compares: vec![Compare::Absent(k.clone())],
            ops: vec![Op::put(format!("{ns}/h2"), b"2".to_vec())],
        })
        .await
        .unwrap();
    assert!(!no.succeeded);
    assert_eq!(b.get(&format!("{ns}/h2")).await.unwrap(), None);
    // mod revision compare, then a stale one fails
    let ok = b
        .txn(Txn {
            compares: vec![Compare::ModRevision(k.clone(), kv.mod_revision)],
            ops: vec![Op::put(&k, b"2".to_vec())],
        })
        .await
        .unwrap();
    assert!(ok.succeeded);
    let stale = b
        .txn(Txn {
            compares: vec![Compare::ModRevision(k.clone(), kv.mod_revision)],
            ops: vec![Op::put(&k, b"3".to_vec())],
        })
        .await
        .unwrap();
    assert!(!stale.succeeded);
    assert_eq!(b.get(&k).await.unwrap().unwrap().value, b"2");
    // create revision and value compares
    assert!(
        b.txn(Txn {
            compares: vec![
                Compare::CreateRevision(k.clone(), kv.create_revision),
                Compare::Value(k.clone(), b"2".to_vec())
            ],
            ops: vec![Op::Delete {
                key: format!("{ns}/h1")
            }]
        })
        .await
        .unwrap()
        .succeeded
    );
    assert_eq!(b.get(&format!("{ns}/h1")).await.unwrap(), None);
    assert!(
        !b.txn(Txn {
            compares: vec![Compare::Value(k.clone(), b"nope".to_vec())],
            ops: vec![Op::Delete { key: k.clone() }]
        })
        .await
        .unwrap()
        .succeeded
    );
    assert!(
        b.txn(Txn {
            compares: vec![],
            ops: vec![Op::DeletePrefix {
                prefix: format!("{ns}/")
            }]
        })
        .await
        .unwrap()
        .succeeded
    );
    assert!(b.list(&format!("{ns}/")).await.unwrap().0.is_empty());
}

pub async fn leases_expire_and_take_their_keys(b: &dyn KvBackend, ns: &str) {
    let l = b.grant(1).await.unwrap();
    b.put(&format!("{ns}/n1"), b"x".to_vec(), Some(l))
        .await
        .unwrap();
    assert_eq!(b.get(&format!("{ns}/n1")).await.unwrap().unwrap().lease, l);
    assert!(b.keep_alive_once(l).await.unwrap() >= 1);
    let t0 = Instant::now();
    loop {
        if b.get(&format!("{ns}/n1")).await.unwrap().is_none() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "a 1 s lease must expire within 5 s"
        );
        sleep(Duration::from_millis(50)).await;
    }
    let r = b.keep_alive_once(l).await;
    assert!(
        matches!(r, Err(ClusterError::LeaseNotFound { .. })),
        "{r:?}"
    );
    assert!(matches!(
        b.put(&format!("{ns}/n2"), b"x".to_vec(), Some(l)).await,
        Err(ClusterError::LeaseNotFound { .. })
    ));
    let l2 = b.grant(30).await.unwrap();
    b.put(&format!("{ns}/n3"), b"x".to_vec(), Some(l2))
        .await
        .unwrap();
    b.revoke(l2).await.unwrap();
    assert_eq!(b.get(&format!("{ns}/n3")).await.unwrap(), None);
}

async fn next(rx: &mut WatchReceiver) -> Vec<WatchEvent> {
    timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("watch event within 5 s")
        .expect("watch open")
        .expect("watch ok")
}

pub async fn watch_replays_history_then_follows(b: &dyn KvBackend, ns: &str) {
    let r1 = b
        .put(&format!("{ns}/a"), b"1".to_vec(), None)
        .await
        .unwrap();
    b.put(&format!("{ns}/b"), b"2".to_vec(), None)
        .await
        .unwrap();
    let mut rx = b.watch(&format!("{ns}/"), r1).await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < 2 {
        seen.extend(next(&mut rx).await);
    }
    assert_eq!(seen[0].key(), format!("{ns}/a"));
    assert_eq!(seen[1].key(), format!("{ns}/b"));
    let l = b.grant(1).await.unwrap();
    b.put(&format!("{ns}/c"), b"3".to_vec(), Some(l))
        .await
        .unwrap();
    let ev = next(&mut rx).await;
    assert!(matches!(&ev[0], WatchEvent::Put(kv) if kv.value == b"3"));
    // a lease expiry is seen as a delete
    let t0 = Instant::now();
    let ev = timeout(Duration::from_secs(6), rx.recv())
        .await
        .expect("expiry seen")
        .unwrap()
        .unwrap();
    assert!(
        matches!(&ev[0], WatchEvent::Delete { key, .. } if key == &format!("{ns}/c")),
        "{ev:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(6));
    b.delete_prefix(&format!("{ns}/")).await.unwrap();
}

pub async fn watch_from_compacted_revision_fails(b: &dyn KvBackend, ns: &str) {
    let r1 = b
        .put(&format!("{ns}/a"), b"1".to_vec(), None)
        .await
        .unwrap();
    let r2 = b
        .put(&format!("{ns}/a"), b"2".to_vec(), None)
        .await
        .unwrap();
    b.compact(r2).await.unwrap();
    let mut rx = b.watch(&format!("{ns}/"), r1).await.unwrap();
    match timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("answer within 5 s")
    {
        Some(Err(ClusterError::Compacted { .. })) => {}
        other => panic!("expected Compacted, got {other:?}"),
    }
    b.delete_prefix(&format!("{ns}/")).await.unwrap();
}

pub async fn election_has_one_leader(b: &dyn KvBackend, ns: &str) {
    let l1 = b.grant(10).await.unwrap();
    let l2 = b.grant(10).await.unwrap();
    let k1 = b.campaign(ns, b"one".to_vec(), l1).await.unwrap();
    assert_eq!(b.leader(ns).await.unwrap().as_deref(), Some(&b"one"[..]));
    // the second candidate blocks while the first leads
    let second = b.campaign(ns, b"two".to_vec(), l2);
    tokio::pin!(second);
    assert!(
        timeout(Duration::from_millis(500), &mut second)
            .await
            .is_err(),
        "two leaders at once"
    );
    // the leader's key fences: a txn comparing it succeeds now ...
    let fence = || Txn {
        compares: vec![Compare::CreateRevision(k1.key.clone(), k1.create_revision)],
        ops: vec![Op::put(format!("{ns}-fenced"), b"x".to_vec())],
    };
    assert!(b.txn(fence()).await.unwrap().succeeded);
    // ... the first loses its lease: the second leads, and the first's fenced writes fail
    b.revoke(l1).await.unwrap();
    let k2 = timeout(Duration::from_secs(5), &mut second)
        .await
        .expect("second leads within 5 s")
        .unwrap();
    assert_eq!(b.leader(ns).await.unwrap().as_deref(), Some(&b"two"[..]));
    assert!(!b.txn(fence()).await.unwrap().succeeded);
    b.resign(&k2).await.unwrap();
    assert_eq!(b.leader(ns).await.unwrap(), None);
    b.revoke(l2).await.unwrap();
    b.delete(&format!("{ns}-fenced")).await.unwrap();
}

pub async fn lease_keeper_regrants_after_expiry(b: Arc<dyn KvBackend>, _ns: &str) {
    let cancel = CancellationToken::new();
    let keeper = LeaseKeeper::start(b.clone(), 1, cancel.clone())
        .await
        .unwrap();
    let first = keeper.current();
    // kept alive well past its TTL
    sleep(Duration::from_millis(2500)).await;
    assert_eq!(keeper.current().id, first.id);
    assert!(b.keep_alive_once(first.id).await.is_ok());
    // the lease vanishes behind its back: the keeper grants another and says so
    b.revoke(first.id).await.unwrap();
    let mut rx = keeper.subscribe();
    timeout(Duration::from_secs(5), rx.wait_for(|s| s.epoch == 1))
        .await
        .expect("re-granted within 5 s")
        .unwrap();
    let now = keeper.current();
    assert_ne!(now.id, first.id);
    cancel.cancel();
    keeper.join().await;
    assert!(
        matches!(
            b.keep_alive_once(now.id).await,
            Err(ClusterError::LeaseNotFound { .. })
        ),
        "revoked on cancel"
    );
}

pub async fn prefix_watcher_follows_and_relists(b: Arc<dyn KvBackend>, ns: &str) {
    let cancel = CancellationToken::new();
    b.put(&format!("{ns}/a"), b"1".to_vec(), None)
        .await
        .unwrap();
    let mut rx = crate::watch::watch_prefix(b.clone(), format!("{ns}/"), cancel.clone());
    let s = crate::watch::synced(&mut rx).await;
    assert_eq!(s.kvs.size(), 1);
    b.put(&format!("{ns}/b"), b"2".to_vec(), None)
        .await
        .unwrap();
    let s = timeout(Duration::from_secs(5), rx.wait_for(|s| s.kvs.size() == 2))
        .await
        .expect("put seen")
        .unwrap()
        .clone();
    assert_eq!(s.kvs[&format!("{ns}/b")].value, b"2");
    b.delete(&format!("{ns}/a")).await.unwrap();
    timeout(Duration::from_secs(5), rx.wait_for(|s| s.kvs.size() == 1))
        .await
        .expect("delete seen")
        .unwrap();
    cancel.cancel();
    b.delete_prefix(&format!("{ns}/")).await.unwrap();
}

#[cfg(test)]
mod tests {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory_backend_conforms() {
        let b = std::sync::Arc::new(crate::memory::MemoryBackend::new());
        super::run_all(b, "/conf").await;
    }
}

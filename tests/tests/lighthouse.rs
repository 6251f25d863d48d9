//! ductiled's TorchFT lighthouse against a real etcd, at a size the in-memory store cannot
//! show: etcd refuses a transaction of more than 128 operations (`--max-txn-ops`) and a request
//! over 1.5 MiB, so a quorum whose transaction grew with its participants never formed past a
//! few dozen replica groups (issue 46). 200 participants join one room and get one quorum.

use std::time::Duration;

use ductile_cluster::kv::LeaderKey;
use ductile_cluster::{Keys, Store};
use ductile_daemon::lighthouse::{Lighthouse, LighthouseOpt, Member, DEFAULT_ROOM};
use ductile_tests::*;

#[test]
fn two_hundred_participants_get_one_quorum_on_a_real_etcd() {
    let dir = TempDir::new("lighthouse-200");
    let etcd = Etcd::start(dir.path());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let backend =
            ductile_cluster::connect_etcd_with(&etcd.access("t"), Duration::from_secs(10))
                .await
                .unwrap();
        let store = Store::new(backend.clone(), Keys::new("/lh"));
        // the leader key the decisions are fenced on, as the election writes it
        let key = "/lh/election/leader".to_string();
        backend.put(&key, b"me".to_vec(), None).await.unwrap();
        let kv = backend.get(&key).await.unwrap().unwrap();
        let leader = LeaderKey {
            name: "me".into(),
            key,
            create_revision: kv.create_revision,
            lease: 0,
        };
        let cancel = tokio_util::sync::CancellationToken::new();
        let n = 200;
        let lh = Lighthouse::new(
            store,
            LighthouseOpt {
                min_replicas: n,
                join_timeout_ms: 60_000,
                ..Default::default()
            },
            cancel.clone(),
        );
        let decider = {
            let (lh, c) = (lh.clone(), cancel.clone());
            tokio::spawn(async move { lh.decide(leader, "me".into(), c).await })
        };
        let calls: Vec<_> = (0..n)
            .map(|i| {
                let lh = lh.clone();
                tokio::spawn(async move {
                    let id = format!("replica_{i:03}:{}", "f".repeat(36));
                    let m = Member {
                        replica_id: id,
                        address: format!("http://127.0.0.1:{}", 20_000 + i),
                        store_address: format!("127.0.0.1:{}", 30_000 + i),
                        step: 7,
                        world_size: 1,
                        shrink_only: false,
                        data: String::new(),
                        commit_failures: 0,
                    };
                    lh.quorum(DEFAULT_ROOM, m).await
                })
            })
            .collect();
        let t0 = std::time::Instant::now();
        let mut ids = std::collections::BTreeSet::new();
        for c in calls {
            let q = tokio::time::timeout(Duration::from_secs(60), c)
                .await
                .expect("every participant gets its quorum within 60 s")
                .unwrap()
                .unwrap();
            assert_eq!(q.participants.len(), n as usize);
            ids.insert(q.quorum_id);
        }
        assert_eq!(ids.len(), 1, "one quorum for all of them: {ids:?}");
        println!("200 participants: one quorum in {:?}", t0.elapsed());
        cancel.cancel();
        let _ = decider.await;
    });
}

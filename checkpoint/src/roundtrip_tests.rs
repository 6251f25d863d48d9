//! Save → commit → restore through the same code as the workers, against an in-memory object
//! store and the in-memory etcd. (The integration tests run it against moto, files and etcd.)

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ductile_cluster::memory::MemoryBackend;
use ductile_cluster::records::*;
use ductile_cluster::{Keys, KvBackend, Store};

use crate::format::*;
use crate::restore::{chunk_offset_bytes, committed, fetch, load_manifest, RestoreError};
use crate::save::*;
use crate::{plan, Bucket, UploadOptions};

fn tensors() -> Vec<TensorMeta> {
    let t = |name: &str, shape: &[u64], kind| TensorMeta {
        name: name.into(),
        dtype: Dtype::F32,
        shape: shape.to_vec(),
        kind,
    };
    vec![
        t("emb.weight", &[97, 16], TensorKind::Parameter),
        t("head.bias", &[33], TensorKind::Parameter),
        t("scale", &[], TensorKind::Buffer),
        t(
            "optimizer.emb.weight.exp_avg",
            &[97, 16],
            TensorKind::OptimizerState,
        ),
        t(
            "optimizer.head.bias.exp_avg",
            &[33],
            TensorKind::OptimizerState,
        ),
    ]
}

/// Deterministic contents of every tensor, by name.
fn contents(ts: &[TensorMeta]) -> Vec<Vec<u8>> {
    ts.iter()
        .enumerate()
        .map(|(i, t)| {
            (0..t.bytes())
                .map(|b| ((b * 31 + i as u64 * 7) % 251) as u8)
                .collect()
        })
        .collect()
}

async fn set_generation(store: &Store, job: &str, number: u64) {
    let g = Generation {
        world_size: 4,
        layout: Layout::data_parallel(4),
        state_source: StateSource::Peers,
        desired: 4,
        ..Generation::data_parallel(job, number, &[])
    };
    store
        .put_json(&store.keys.generation(job), &g, None)
        .await
        .unwrap();
}

/// Every rank of a `world` writes its shard; the committer commits.
async fn save(
    store: &Store,
    bucket: &Bucket,
    step: u64,
    generation: u64,
    world: u32,
) -> Result<CheckpointRecord, SaveError> {
    save_with(store, bucket, step, generation, world, |_| async {}).await
}

/// [`save`], with `between` run after the shards are written and before the commit.
async fn save_with<F: std::future::Future<Output = ()>>(
    store: &Store,
    bucket: &Bucket,
    step: u64,
    generation: u64,
    world: u32,
    between: impl FnOnce(Store) -> F,
) -> Result<CheckpointRecord, SaveError> {
    let ts = tensors();
    let data = contents(&ts);
    for rank in 0..world {
        let layout = ShardLayout::new(&ts, world, rank);
        let mut buf = Vec::new();
        layout.prepare(&mut buf);
        for p in &layout.placed {
            let rb = ts[p.tensor].row_bytes();
            let src = &data[p.tensor][(p.row * rb) as usize..((p.row + p.rows) * rb) as usize];
            buf[p.start as usize..p.end as usize].copy_from_slice(src);
        }
        write_shard(
            store,
            bucket,
            "j",
            step,
            generation,
            &ts,
            &layout,
            Bytes::from(buf),
            UploadOptions::default(),
        )
        .await?;
    }
    between(store.clone()).await;
    gather_and_commit(
        store,
        bucket,
        CommitInput {
            job: "j",
            step,
            generation,
            world,
            layout: Layout::data_parallel(world),
            tensors: &ts,
            extra: serde_json::json!({"step": step}),
            conditional_create: true,
            request: None,
            wait: Duration::from_secs(5),
        },
    )
    .await
}

/// Restore with `world` readers; every tensor's bytes.
async fn restore(
    bucket: &Bucket,
    rec: &CheckpointRecord,
    world: u32,
) -> Result<Vec<Vec<u8>>, RestoreError> {
    let m = load_manifest(bucket, rec).await?;
    let mut out: Vec<Vec<u8>> = m
        .ordered()
        .map(|(_, t)| vec![0u8; (t.dtype.size() * t.shape.iter().product::<u64>()) as usize])
        .collect();
    let names: Vec<String> = m.order.clone();
    for share in plan::readers(&m, world) {
        let got = fetch(bucket, &m, &share, 4).await?;
        for ((name, k), bytes) in share.iter().zip(got) {
            let t = &m.tensors[name];
            let at = chunk_offset_bytes(t, &t.chunks[*k]) as usize;
            let i = names.iter().position(|n| n == name).unwrap();
            out[i][at..at + bytes.len()].copy_from_slice(&bytes);
        }
    }
    Ok(out)
}

fn setup() -> (Store, Bucket) {
    let kv: Arc<dyn KvBackend> = Arc::new(MemoryBackend::new());
    let store = Store::new(kv, Keys::new("/t"));
    let bucket = Bucket::from_store(
        "memory://ckpt",
        Arc::new(object_store::memory::InMemory::new()),
    );
    (store, bucket)
}

#[tokio::test]
async fn saved_at_four_restores_bitwise_at_one_two_three_and_six() {
    let (store, bucket) = setup();
    set_generation(&store, "j", 3).await;
    let rec = save(&store, &bucket, 40, 3, 4).await.unwrap();
    assert_eq!(rec.world_size, 4);
    let want = contents(&tensors());
    for world in [1, 2, 3, 4, 6] {
        assert_eq!(
            restore(&bucket, &rec, world).await.unwrap(),
            want,
            "world {world}"
        );
    }
    // the bucket alone tells what is committed
    let found = committed(&bucket, None).await.unwrap();
    assert_eq!(found, vec![rec.clone()]);
    // every shard is a safetensors file whose keys are the full tensor names
    let m = load_manifest(&bucket, &rec).await.unwrap();
    assert_eq!(m.objects.len(), 4);
    let shard = bucket
        .get(&format!("{}/{}", attempt_dir(40, 3), m.objects[0].object))
        .await
        .unwrap();
    let st = safetensors::SafeTensors::deserialize(&shard).unwrap();
    assert!(st.names().contains(&&"emb.weight".to_string()));
    let (_, meta) = safetensors::SafeTensors::read_metadata(&shard).unwrap();
    assert!(meta.metadata().as_ref().unwrap().contains_key("emb.weight"));
    let latest: CheckpointRecord = store
        .get_json(&store.keys.checkpoint("j"), "checkpoint")
        .await
        .unwrap()
        .unwrap()
        .0;
    assert_eq!(latest, rec);
}

#[tokio::test]
async fn a_stale_generation_or_an_older_step_cannot_commit() {
    let (store, bucket) = setup();
    set_generation(&store, "j", 5).await;
    let rec = save(&store, &bucket, 10, 5, 2).await.unwrap();
    // a writer of generation 4 finishes its upload late
    let e = save(&store, &bucket, 20, 4, 2).await.unwrap_err();
    assert!(matches!(e, SaveError::Stale { current: 5, .. }), "{e}");
    assert!(e.to_string().contains("generation 5"), "{e}");
    // an older step never replaces a newer commit
    let e = save(&store, &bucket, 5, 5, 2).await.unwrap_err();
    assert!(matches!(e, SaveError::NotNewer { latest: 10, .. }), "{e}");
    assert_eq!(committed(&bucket, None).await.unwrap(), vec![rec]);
}

#[tokio::test]
async fn a_flipped_byte_fails_the_chunk_naming_object_and_tensor() {
    let (store, bucket) = setup();
    set_generation(&store, "j", 1).await;
    let rec = save(&store, &bucket, 10, 1, 2).await.unwrap();
    let m = load_manifest(&bucket, &rec).await.unwrap();
    let c = &m.tensors["head.bias"].chunks[0];
    let key = format!("{}/{}", attempt_dir(10, 1), c.object);
    let mut b = bucket.get(&key).await.unwrap().to_vec();
    b[c.byte_range[0] as usize + 3] ^= 0x10;
    bucket.put(&key, Bytes::from(b)).await.unwrap();
    let e = restore(&bucket, &rec, 3).await.unwrap_err().to_string();
    assert!(
        e.contains("head.bias") && e.contains(&c.object) && e.contains("CRC32C"),
        "{e}"
    );
}

#[tokio::test]
async fn retention_keeps_the_last_commits_and_drops_stale_attempts() {
    let (store, bucket) = setup();
    set_generation(&store, "j", 2).await;
    for step in [10, 20, 30, 40] {
        save(&store, &bucket, step, 2, 3).await.unwrap();
    }
    // an attempt that never committed (its writer died)
    bucket
        .put(
            &format!("{}/{}", attempt_dir(50, 2), shard_name(0, 3)),
            Bytes::from_static(b"x"),
        )
        .await
        .unwrap();
    let listed = crate::retention::list(&bucket, None).await.unwrap();
    assert_eq!(
        listed.iter().map(|i| i.step).collect::<Vec<_>>(),
        vec![50, 40, 30, 20, 10]
    );
    assert_eq!(listed[0].state, crate::retention::CheckpointState::Attempt);
    // a fresh attempt survives (it may be in flight)
    let r = crate::retention::retain(&bucket, 2, Duration::from_secs(3600), None, None)
        .await
        .unwrap();
    assert_eq!(r.kept, vec![40, 30]);
    assert_eq!(r.deleted_commits, vec![20, 10]);
    assert!(r.deleted_attempts.is_empty());
    let r = crate::retention::retain(&bucket, 2, Duration::ZERO, None, None)
        .await
        .unwrap();
    assert_eq!(r.deleted_attempts, vec![(50, 2)]);
    let steps: Vec<u64> = crate::retention::list(&bucket, None)
        .await
        .unwrap()
        .iter()
        .map(|i| i.step)
        .collect();
    assert_eq!(steps, vec![40, 30]);
}

/// A location another job used before: its commits (their records name it) are neither
/// restored nor counted, superseded or deleted by this job's retention (issue 46, item 10).
#[tokio::test]
async fn another_job_s_commits_in_the_location_are_left_alone() {
    let (store, bucket) = setup();
    set_generation(&store, "j", 2).await;
    let mut recs = Vec::new();
    for step in [10, 20] {
        recs.push(save(&store, &bucket, step, 2, 3).await.unwrap());
    }
    assert_eq!(recs[0].job.as_deref(), Some("j"));
    // "other" committed steps 30 and 40 there, and left an attempt with its manifest
    for (step, generation) in [(30u64, 7u64), (40, 7)] {
        let dir = attempt_dir(step, generation);
        let rec = CheckpointRecord {
            job: Some("other".into()),
            step,
            generation,
            manifest: format!("{dir}/{MANIFEST}"),
            ..recs[1].clone()
        };
        bucket
            .put(
                &format!("{dir}/{}", shard_name(0, 1)),
                Bytes::from_static(b"x"),
            )
            .await
            .unwrap();
        bucket
            .put(
                &format!("{dir}/{COMMIT}"),
                Bytes::from(serde_json::to_vec(&rec).unwrap()),
            )
            .await
            .unwrap();
    }
    let attempt = attempt_dir(50, 7);
    bucket
        .put(
            &format!("{attempt}/{MANIFEST}"),
            Bytes::from_static(br#"{"job": "other", "step": 50}"#),
        )
        .await
        .unwrap();
    // restore: j's newest is its own step 20, never other's 40
    let mine = crate::restore::committed_for(&bucket, None, Some("j"))
        .await
        .unwrap();
    assert_eq!(
        mine.iter().map(|r| r.step).collect::<Vec<_>>(),
        vec![20, 10]
    );
    // and with etcd's latest for j (20), other's later commits are not superseded either
    let r = crate::retention::retain(&bucket, 1, Duration::ZERO, Some(&recs[1]), Some("j"))
        .await
        .unwrap();
    assert_eq!(r.kept, vec![20]);
    assert_eq!(r.deleted_commits, vec![10]);
    assert!(r.superseded.is_empty(), "{:?}", r.superseded);
    assert!(r.deleted_attempts.is_empty(), "{:?}", r.deleted_attempts);
    assert_eq!(r.foreign, vec![(50, 7), (40, 7), (30, 7)]);
    let listed = crate::retention::list(&bucket, None).await.unwrap();
    assert_eq!(
        listed
            .iter()
            .map(|i| (i.step, i.job.clone().unwrap_or_default()))
            .collect::<Vec<_>>(),
        vec![
            (50, "other".to_string()),
            (40, "other".into()),
            (30, "other".into()),
            (20, "j".into())
        ]
    );
    // a caller that names no job (an operator's listing) still sees every commit
    assert_eq!(committed(&bucket, None).await.unwrap()[0].step, 40);
    // an attempt naming no job (no manifest yet) at the same location
    let bare = attempt_dir(60, 8);
    bucket
        .put(
            &format!("{bare}/{}", shard_name(0, 1)),
            Bytes::from_static(b"x"),
        )
        .await
        .unwrap();
    // dctl delete j --purge: j's own directories go, other's and the unowned one stay
    let p = crate::retention::purge(&bucket, "j").await.unwrap();
    assert_eq!(p.deleted, vec![(20, 2)]);
    assert_eq!(p.foreign, vec![(50, 7), (40, 7), (30, 7)]);
    assert_eq!(p.unowned, vec![(60, 8)]);
    let listed = crate::retention::list(&bucket, None).await.unwrap();
    assert_eq!(
        listed.iter().map(|i| i.step).collect::<Vec<_>>(),
        vec![60, 50, 40, 30]
    );
    assert!(crate::restore::committed_for(&bucket, None, Some("j"))
        .await
        .unwrap()
        .is_empty());
    // and a second purge finds nothing more of j's
    assert!(crate::retention::purge(&bucket, "j")
        .await
        .unwrap()
        .deleted
        .is_empty());
}

/// A commit whose `COMMIT` record reads but does not parse is still a commit: retention does
/// not take it for an abandoned attempt (and delete it at `attempt_ttl`).
#[tokio::test]
async fn retention_never_takes_an_unparsable_commit_for_an_attempt() {
    let (store, bucket) = setup();
    set_generation(&store, "j", 2).await;
    for step in [10, 20] {
        save(&store, &bucket, step, 2, 3).await.unwrap();
    }
    let commit = format!("{}/{COMMIT}", attempt_dir(20, 2));
    bucket
        .put(&commit, Bytes::from_static(b"{ torn"))
        .await
        .unwrap();
    let listed = crate::retention::list(&bucket, None).await.unwrap();
    assert_eq!(listed[0].step, 20);
    assert_eq!(
        listed[0].state,
        crate::retention::CheckpointState::Committed
    );
    let r = crate::retention::retain(&bucket, 2, Duration::ZERO, None, None)
        .await
        .unwrap();
    assert!(r.deleted_attempts.is_empty(), "{:?}", r.deleted_attempts);
    assert_eq!(r.kept, vec![20, 10]);
    assert!(
        bucket.get(&commit).await.is_ok(),
        "the commit record was deleted"
    );
}

/// Retention follows etcd's lineage. A rollback whose supersede failed left commits 20 and 30
/// above etcd's latest; the job goes on from 10 and commits 15. With keep = 2, 15 and 10 are
/// the lineage's newest and are kept; 20 and 30 are superseded (their data kept for the
/// operator), never counted, never deleted; nothing etcd names is deleted.
#[tokio::test]
async fn retention_follows_etcd_s_lineage_over_commits_above_it() {
    let (store, bucket) = setup();
    set_generation(&store, "j", 2).await;
    let mut recs = Vec::new();
    for step in [10, 20, 30] {
        recs.push(save(&store, &bucket, step, 2, 2).await.unwrap());
    }
    // the rollback to 10 (its supersede of 20 and 30 failed): etcd names 10 again
    store
        .put_json(&store.keys.checkpoint("j"), &recs[0], None)
        .await
        .unwrap();
    let r15 = save(&store, &bucket, 15, 2, 2).await.unwrap();
    let r = crate::retention::retain(&bucket, 2, Duration::ZERO, Some(&r15), None)
        .await
        .unwrap();
    assert_eq!(r.superseded, vec![(30, 2), (20, 2)]);
    assert_eq!(r.kept, vec![15, 10]);
    assert!(r.deleted_commits.is_empty(), "{:?}", r.deleted_commits);
    let listed = crate::retention::list(&bucket, Some(&r15)).await.unwrap();
    let states: Vec<(u64, crate::retention::CheckpointState)> =
        listed.iter().map(|i| (i.step, i.state.clone())).collect();
    use crate::retention::CheckpointState::*;
    assert_eq!(
        states,
        vec![
            (30, Superseded),
            (20, Superseded),
            (15, Committed),
            (10, Committed)
        ]
    );
    // what etcd names restores
    assert_eq!(
        restore(&bucket, &r15, 2).await.unwrap(),
        contents(&tensors())
    );
    // a later pass changes nothing
    let again = crate::retention::retain(&bucket, 2, Duration::ZERO, Some(&r15), None)
        .await
        .unwrap();
    assert!(again.superseded.is_empty() && again.deleted_commits.is_empty());
}

/// A commit etcd acknowledged whose `COMMIT` record never reached the store is carried in the
/// next commit's record, and retention writes its record: it is never taken for an abandoned
/// attempt and deleted, even with an attempt TTL of zero.
#[tokio::test]
async fn a_commit_whose_record_never_landed_is_repaired_not_deleted() {
    let (store, bucket) = setup();
    set_generation(&store, "j", 2).await;
    let r10 = save(&store, &bucket, 10, 2, 2).await.unwrap();
    let commit10 = format!("{}/{COMMIT}", attempt_dir(10, 2));
    // the put of 10's COMMIT "failed"
    bucket.delete(&commit10).await.unwrap();
    let r20 = save(&store, &bucket, 20, 2, 2).await.unwrap();
    assert_eq!(
        r20.unrecorded.iter().map(|r| r.step).collect::<Vec<_>>(),
        vec![10]
    );
    let r = crate::retention::retain(&bucket, 5, Duration::ZERO, Some(&r20), None)
        .await
        .unwrap();
    assert_eq!(r.repaired, 1);
    assert!(r.deleted_attempts.is_empty(), "{:?}", r.deleted_attempts);
    assert_eq!(r.kept, vec![20, 10]);
    let written: CheckpointRecord =
        serde_json::from_slice(&bucket.get(&commit10).await.unwrap()).unwrap();
    assert_eq!(written, r10);
    assert_eq!(
        restore(&bucket, &r10, 1).await.unwrap(),
        contents(&tensors())
    );
    // once its record is there, the next commit stops carrying it
    let r30 = save(&store, &bucket, 30, 2, 2).await.unwrap();
    assert!(r30.unrecorded.is_empty(), "{:?}", r30.unrecorded);
}

/// When etcd holds the job's latest commit, commits after it in the store (left behind by a
/// rollback whose supersede did not finish) are not restore candidates.
#[tokio::test]
async fn etcd_s_record_decides_the_lineage_over_later_commits_in_the_store() {
    let (store, bucket) = setup();
    set_generation(&store, "j", 2).await;
    let mut recs = Vec::new();
    for step in [10, 20, 30] {
        recs.push(save(&store, &bucket, step, 2, 2).await.unwrap());
    }
    assert_eq!(committed(&bucket, None).await.unwrap()[0].step, 30);
    // etcd says the job's lineage is at step 20 (it resumed from there)
    let steps: Vec<u64> = committed(&bucket, Some(&recs[1]))
        .await
        .unwrap()
        .iter()
        .map(|r| r.step)
        .collect();
    assert_eq!(steps, vec![20, 10]);
}

/// A shard report that cannot be read leaves rows of some tensors without a chunk: the
/// manifest is refused, naming the tensor, and nothing commits.
#[tokio::test]
async fn a_manifest_that_misses_rows_is_never_committed() {
    let (store, bucket) = setup();
    set_generation(&store, "j", 2).await;
    let prefix = store.keys.checkpoint_shards("j", 10, 2);
    let e = save_with(&store, &bucket, 10, 2, 2, |store| async move {
        // rank 1's report lost its last chunk (a well-formed report that misses rows)
        let (kvs, _) = store.backend.list(&prefix).await.unwrap();
        let last = kvs.last().unwrap();
        let mut r: ShardReport = serde_json::from_slice(&last.value).unwrap();
        r.chunks.pop();
        store
            .backend
            .put(&last.key, serde_json::to_vec(&r).unwrap(), None)
            .await
            .unwrap();
    })
    .await
    .unwrap_err();
    assert!(matches!(e, SaveError::Uncovered { .. }), "{e}");
    assert!(e.to_string().contains("tensor"), "{e}");
    assert!(committed(&bucket, None).await.unwrap().is_empty());
    assert!(store
        .get_json::<CheckpointRecord>(&store.keys.checkpoint("j"), "checkpoint")
        .await
        .unwrap()
        .is_none());
}

#[tokio::test]
async fn a_writer_that_fails_abandons_the_attempt_at_once_and_a_torn_report_is_named() {
    let (store, bucket) = setup();
    set_generation(&store, "j", 3).await;
    let ts = tensors();
    let input = |wait| CommitInput {
        job: "j",
        step: 20,
        generation: 3,
        world: 2,
        layout: Layout::data_parallel(2),
        tensors: &ts,
        extra: serde_json::json!({}),
        conditional_create: true,
        request: None,
        wait,
    };
    // rank 1's upload failed: it says so, and the committer gives up at once although it
    // would wait ten minutes for a missing report
    report_failure(&store, "j", 20, 3, 1, "S3 503 on part 4").await;
    let t0 = std::time::Instant::now();
    let e = gather_and_commit(&store, &bucket, input(Duration::from_secs(600)))
        .await
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(
        matches!(
            e,
            SaveError::WriterFailed {
                rank: 1,
                step: 20,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("S3 503 on part 4"), "{e}");
    // the attempt's reports are gone, so the next attempt at this step starts clean
    let (kvs, _) = store
        .backend
        .list(&store.keys.checkpoint_shards("j", 20, 3))
        .await
        .unwrap();
    assert!(kvs.is_empty());
    // a report that is not a report fails the attempt, naming its key
    let k = format!("{}0", store.keys.checkpoint_shards("j", 20, 3));
    store
        .backend
        .put(&k, b"{ torn".to_vec(), None)
        .await
        .unwrap();
    let e = gather_and_commit(&store, &bucket, input(Duration::from_secs(600)))
        .await
        .unwrap_err();
    assert!(matches!(e, SaveError::BadReport { .. }), "{e}");
    assert!(e.to_string().contains(&k), "{e}");
    assert!(store
        .get_json::<CheckpointRecord>(&store.keys.checkpoint("j"), "checkpoint")
        .await
        .unwrap()
        .is_none());
}

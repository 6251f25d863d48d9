//! Saving: each writing rank fills one shard buffer (the only stall: a copy into host memory),
//! uploads it in the background with CRC32C computed per chunk as the parts go out, and reports
//! the shard in etcd. The committing rank gathers every report, writes the manifest, commits
//! through an etcd transaction fenced by the job's generation, then writes the commit record
//! into the store.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ductile_cluster::kv::{Compare, Op, Txn};
use ductile_cluster::records::{now_ms, CheckpointRecord, Generation, Layout};
use ductile_cluster::Store;
use serde::{Deserialize, Serialize};

use crate::bucket::{Bucket, BucketError, UploadOptions};
use crate::format::*;
use crate::plan;

/// Where this rank's chunks go in its shard.
#[derive(Clone, Debug)]
pub struct ShardLayout {
    pub rank: u32,
    pub world: u32,
    pub object: String,
    pub header: Vec<u8>,
    pub placed: Vec<Placed>,
    pub size: u64,
}

impl ShardLayout {
    /// The shard of `rank` among `world` writers of `tensors`.
    pub fn new(tensors: &[TensorMeta], world: u32, rank: u32) -> ShardLayout {
        let chunks = plan::writers(tensors, world)
            .into_iter()
            .nth(rank as usize)
            .unwrap_or_default();
        ShardLayout::with_chunks(tensors, world, rank, chunks)
    }

    /// The shard of `rank` when each tensor is held only by `owners[t]`
    /// ([`plan::writers_by_owner`]: a pipeline stage writes its own layers).
    pub fn by_owner(
        tensors: &[TensorMeta],
        owners: &[Vec<u32>],
        world: u32,
        rank: u32,
    ) -> ShardLayout {
        let chunks = plan::writers_by_owner(tensors, owners, world)
            .into_iter()
            .nth(rank as usize)
            .unwrap_or_default();
        ShardLayout::with_chunks(tensors, world, rank, chunks)
    }

    pub fn with_chunks(
        tensors: &[TensorMeta],
        world: u32,
        rank: u32,
        chunks: Vec<(usize, u64, u64)>,
    ) -> ShardLayout {
        let (header, placed) = safetensors_header(tensors, &chunks);
        let size = placed.last().map(|p| p.end).unwrap_or(header.len() as u64);
        ShardLayout {
            rank,
            world,
            object: shard_name(rank, world),
            header,
            placed,
            size,
        }
    }

    /// Make `buf` this shard's size with the header in place (reusing its allocation).
    pub fn prepare(&self, buf: &mut Vec<u8>) {
        buf.clear();
        buf.extend_from_slice(&self.header);
        buf.resize(self.size as usize, 0);
    }
}

/// What a writer reports once its shard is in the store.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardReport {
    pub rank: u32,
    pub object: String,
    pub size: u64,
    /// (tensor name, chunk)
    pub chunks: Vec<(String, ChunkEntry)>,
    pub upload_seconds: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error("checkpoint step {step}: {source}")]
    Store {
        step: u64,
        #[source]
        source: BucketError,
    },
    #[error("checkpoint step {step}: etcd: {0}", step = .1)]
    Etcd(ductile_cluster::ClusterError, u64),
    #[error("checkpoint step {step} of generation {generation} refused: the job is at generation {current} now (a stale writer cannot commit)")]
    Stale {
        step: u64,
        generation: u64,
        current: u64,
    },
    #[error("checkpoint step {step} refused: step {latest} is already committed")]
    NotNewer { step: u64, latest: u64 },
    #[error("checkpoint step {step} not committed: tensor {tensor}: {reason}")]
    Uncovered {
        step: u64,
        tensor: String,
        reason: String,
    },
    #[error("checkpoint step {step} of generation {generation} abandoned: rank {rank} could not write its shard: {error}")]
    WriterFailed {
        step: u64,
        generation: u64,
        rank: u32,
        error: String,
    },
    #[error("checkpoint step {step}: the shard report at {key} is unreadable: {reason}")]
    BadReport {
        step: u64,
        key: String,
        reason: String,
    },
    #[error("checkpoint step {step} of generation {generation}: {reports} of {world} shard reports after {waited:?}")]
    Incomplete {
        step: u64,
        generation: u64,
        reports: usize,
        world: u32,
        waited: Duration,
    },
}

/// Upload one rank's filled shard buffer and report it in etcd.
#[allow(clippy::too_many_arguments)]
pub async fn write_shard(
    store: &Store,
    bucket: &Bucket,
    job: &str,
    step: u64,
    generation: u64,
    tensors: &[TensorMeta],
    layout: &ShardLayout,
    data: Bytes,
    opts: UploadOptions,
) -> Result<ShardReport, SaveError> {
    let t0 = Instant::now();
    let dir = attempt_dir(step, generation);
    let key = format!("{dir}/{}", layout.object);
    let marker = format!("{dir}/uploads/{:05}.json", layout.rank);
    // CRC32C per chunk, fed part by part as the parts go out
    let mut crcs = vec![0u32; layout.placed.len()];
    let placed = layout.placed.clone();
    let feed = data.clone();
    let mut next = 0usize;
    bucket
        .upload(&key, data, &marker, opts, |r| {
            while next < placed.len() {
                let p = &placed[next];
                let (s, e) = ((p.start as usize).max(r.start), (p.end as usize).min(r.end));
                if s < e {
                    crcs[next] = crc32c_append(crcs[next], &feed[s..e]);
                }
                if p.end as usize <= r.end {
                    next += 1;
                } else {
                    break;
                }
            }
        })
        .await
        .map_err(|source| SaveError::Store { step, source })?;
    let chunks = layout
        .placed
        .iter()
        .zip(crcs)
        .map(|(p, crc)| {
            let t = &tensors[p.tensor];
            let mut offsets = vec![0u64; t.shape.len()];
            let mut shape = t.shape.clone();
            if let Some(f) = shape.first_mut() {
                *f = p.rows;
                offsets[0] = p.row;
            }
            (
                t.name.clone(),
                ChunkEntry {
                    object: layout.object.clone(),
                    key: p.key.clone(),
                    byte_range: [p.start, p.end],
                    offsets,
                    shape,
                    crc32c: crc,
                },
            )
        })
        .collect();
    let report = ShardReport {
        rank: layout.rank,
        object: layout.object.clone(),
        size: layout.size,
        chunks,
        upload_seconds: t0.elapsed().as_secs_f64(),
    };
    let k = format!(
        "{}{}",
        store.keys.checkpoint_shards(job, step, generation),
        layout.rank
    );
    store
        .put_json(&k, &report, None)
        .await
        .map_err(|e| SaveError::Etcd(e, step))?;
    Ok(report)
}

/// A writer's report that its shard could not be written: the committer abandons the attempt
/// at once instead of waiting for a report that will never come.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShardFailure {
    pub rank: u32,
    pub failed: String,
}

/// What a shard report key holds.
#[derive(Deserialize)]
#[serde(untagged)]
enum ShardOutcome {
    Failed(ShardFailure),
    Written(ShardReport),
}

/// Tell the committer of (step, generation) that this rank's shard failed (best effort, a few
/// tries: the committer also gives up when the generation moves or its wait ends).
pub async fn report_failure(
    store: &Store,
    job: &str,
    step: u64,
    generation: u64,
    rank: u32,
    error: &str,
) {
    let k = format!(
        "{}{rank}",
        store.keys.checkpoint_shards(job, step, generation)
    );
    let f = ShardFailure {
        rank,
        failed: error.chars().take(500).collect(),
    };
    for i in 0..5u64 {
        match store.put_json(&k, &f, None).await {
            Ok(_) => return,
            Err(e) if i == 4 => {
                tracing::warn!(step, rank, error = %e, "cannot report the failed shard")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200 * (i + 1))).await,
        }
    }
}

/// What the committer knows besides the shard reports.
pub struct CommitInput<'a> {
    pub job: &'a str,
    pub step: u64,
    pub generation: u64,
    pub world: u32,
    pub layout: Layout,
    pub tensors: &'a [TensorMeta],
    pub extra: serde_json::Value,
    /// The store enforces conditional creates (see [`Bucket::probe_conditional_create`]).
    pub conditional_create: bool,
    pub request: Option<String>,
    /// How long to wait for the other ranks' reports.
    pub wait: Duration,
}

/// Gather every shard report of (step, generation), write the manifest and commit.
/// That `t`'s chunks (sorted by first row) cover its rows exactly once, each with the tensor's
/// other dimensions: a manifest that misses a row is never committed.
pub fn covered(t: &TensorEntry) -> Result<(), String> {
    if t.chunks.is_empty() {
        return Err("no chunk holds it (a shard report is missing or unreadable)".into());
    }
    let Some((&rows, rest)) = t.shape.split_first() else {
        // a scalar: one chunk of no dimensions
        return if t.chunks.len() == 1 && t.chunks[0].shape.is_empty() {
            Ok(())
        } else {
            Err(format!("a scalar in {} chunks", t.chunks.len()))
        };
    };
    let mut next = 0u64;
    for ch in &t.chunks {
        let (first, n) = (ch.offsets.first().copied(), ch.shape.first().copied());
        if first != Some(next) {
            return Err(format!(
                "rows from {next} are missing (a chunk starts at {first:?})"
            ));
        }
        if ch.shape.get(1..) != Some(rest) {
            return Err(format!(
                "a chunk of shape {:?} in a tensor of shape {:?}",
                ch.shape, t.shape
            ));
        }
        next += n.unwrap_or(0);
    }
    if next != rows {
        return Err(format!("chunks cover {next} of {rows} rows"));
    }
    Ok(())
}

pub async fn gather_and_commit(
    store: &Store,
    bucket: &Bucket,
    c: CommitInput<'_>,
) -> Result<CheckpointRecord, SaveError> {
    let step = c.step;
    let prefix = store.keys.checkpoint_shards(c.job, step, c.generation);
    let t0 = Instant::now();
    let mut poll = Duration::from_millis(5);
    let reports: Vec<ShardReport> = loop {
        let (kvs, _) = store
            .backend
            .list(&prefix)
            .await
            .map_err(|e| SaveError::Etcd(e, step))?;
        let mut written = Vec::with_capacity(kvs.len());
        for kv in &kvs {
            match serde_json::from_slice::<ShardOutcome>(&kv.value) {
                Ok(ShardOutcome::Written(r)) => written.push(r),
                Ok(ShardOutcome::Failed(f)) => {
                    let _ = store.backend.delete_prefix(&prefix).await;
                    return Err(SaveError::WriterFailed {
                        step,
                        generation: c.generation,
                        rank: f.rank,
                        error: f.failed,
                    });
                }
                Err(e) => {
                    return Err(SaveError::BadReport {
                        step,
                        key: kv.key.clone(),
                        reason: e.to_string(),
                    })
                }
            }
        }
        if written.len() >= c.world as usize {
            break written;
        }
        let current = current_generation(store, c.job, step).await?;
        if current != c.generation {
            return Err(SaveError::Stale {
                step,
                generation: c.generation,
                current,
            });
        }
        if t0.elapsed() > c.wait {
            return Err(SaveError::Incomplete {
                step,
                generation: c.generation,
                reports: kvs.len(),
                world: c.world,
                waited: c.wait,
            });
        }
        // the reports come within milliseconds of each other: look again soon, then less often
        tokio::time::sleep(poll).await;
        poll = (poll * 2).min(Duration::from_millis(100));
    };
    let mut tensors: BTreeMap<String, TensorEntry> = c
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                TensorEntry {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    kind: t.kind,
                    chunks: vec![],
                },
            )
        })
        .collect();
    let mut objects = Vec::new();
    let mut reports = reports;
    reports.sort_by_key(|r| r.rank);
    for r in &reports {
        objects.push(ObjectEntry {
            object: r.object.clone(),
            size: r.size,
        });
        for (name, ch) in &r.chunks {
            if let Some(t) = tensors.get_mut(name) {
                t.chunks.push(ch.clone());
            }
        }
    }
    for t in tensors.values_mut() {
        t.chunks
            .sort_by_key(|ch| ch.offsets.first().copied().unwrap_or(0));
    }
    for (name, t) in &tensors {
        covered(t).map_err(|reason| SaveError::Uncovered {
            step,
            tensor: name.clone(),
            reason,
        })?;
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        job: c.job.into(),
        step,
        generation: c.generation,
        created_at_ms: now_ms(),
        world_size: c.world,
        layout: c.layout,
        order: c.tensors.iter().map(|t| t.name.clone()).collect(),
        tensors,
        objects,
        extra: c.extra,
    };
    let dir = attempt_dir(step, c.generation);
    let body = serde_json::to_vec_pretty(&manifest).expect("a manifest serializes");
    // the commits etcd acknowledged whose COMMIT record is not in the store yet (the previous
    // latest among them): carried in this record until retention writes theirs
    let mut unrecorded = Vec::new();
    let prev: Option<CheckpointRecord> = store
        .get_json(&store.keys.checkpoint(c.job), "checkpoint")
        .await
        .map_err(|e| SaveError::Etcd(e, step))?
        .map(|(r, _)| r);
    if let Some(p) = prev {
        for r in p.unrecorded.iter().cloned().chain([p.alone()]) {
            // a read that fails keeps it in the list: it is repaired or dropped later
            if r.step < step
                && !crate::retention::has_commit_record(bucket, &r)
                    .await
                    .unwrap_or(false)
            {
                unrecorded.push(r);
            }
        }
        if unrecorded.len() > MAX_UNRECORDED {
            let dropped = unrecorded.len() - MAX_UNRECORDED;
            tracing::warn!(step, dropped, "more commits without a COMMIT record than the record carries: the oldest are no longer carried");
            unrecorded.drain(..dropped);
        }
    }
    let rec = CheckpointRecord {
        job: Some(c.job.to_string()),
        step,
        generation: c.generation,
        manifest: format!("{dir}/{MANIFEST}"),
        manifest_crc32c: crc32c(&body),
        bytes: manifest.bytes(),
        world_size: c.world,
        layout: c.layout,
        committed_at_ms: 0,
        request: c.request,
        unrecorded,
    };
    bucket
        .put(&rec.manifest, Bytes::from(body))
        .await
        .map_err(|source| SaveError::Store { step, source })?;
    let rec = CheckpointRecord {
        committed_at_ms: now_ms(),
        ..rec
    };
    commit_fenced(store, c.job, &rec).await?;
    // the commit record in the store, so that a bucket alone tells what is complete (without
    // the lineage list: each COMMIT describes its own checkpoint)
    let commit = Bytes::from(serde_json::to_vec_pretty(&rec.alone()).expect("a record serializes"));
    let key = format!("{dir}/{COMMIT}");
    let mut tries = 0;
    loop {
        let written = if c.conditional_create {
            bucket.create(&key, commit.clone()).await.map(|_| ())
        } else {
            bucket.put(&key, commit.clone()).await
        };
        match written {
            Ok(()) => break,
            Err(e) if tries < 2 => {
                tries += 1;
                tracing::warn!(step, error = %e, "the commit record could not be written: trying again");
                tokio::time::sleep(Duration::from_millis(200 << tries)).await;
            }
            Err(e) => {
                // etcd holds the commit; the next commit carries it and retention writes it
                tracing::warn!(step, error = %e, "committed in etcd, but the commit record could not be written to the store yet");
                break;
            }
        }
    }
    let _ = store.backend.delete_prefix(&prefix).await;
    Ok(rec)
}

/// Most commits without a `COMMIT` record one record carries.
const MAX_UNRECORDED: usize = 64;

async fn current_generation(store: &Store, job: &str, step: u64) -> Result<u64, SaveError> {
    Ok(store
        .generation(job)
        .await
        .map_err(|e| SaveError::Etcd(e, step))?
        .map(|(g, _)| g.number)
        .unwrap_or(0))
}

/// The commit point: move the job's latest-checkpoint record to `rec` in one transaction that
/// compares the job's generation (it must still be `rec.generation`) and the record's revision
/// (it must not have moved since it was read, and only ever to a higher step).
pub async fn commit_fenced(
    store: &Store,
    job: &str,
    rec: &CheckpointRecord,
) -> Result<(), SaveError> {
    let step = rec.step;
    let gkey = store.keys.generation(job);
    let ckey = store.keys.checkpoint(job);
    let etcd = |e| SaveError::Etcd(e, step);
    loop {
        let g = store.backend.get(&gkey).await.map_err(etcd)?;
        let current = g
            .as_ref()
            .and_then(|kv| serde_json::from_slice::<Generation>(&kv.value).ok())
            .map(|g| g.number)
            .unwrap_or(0);
        let Some(g) = g.filter(|_| current == rec.generation) else {
            return Err(SaveError::Stale {
                step,
                generation: rec.generation,
                current,
            });
        };
        let latest = store.backend.get(&ckey).await.map_err(etcd)?;
        if let Some(l) = latest
            .as_ref()
            .and_then(|kv| serde_json::from_slice::<CheckpointRecord>(&kv.value).ok())
        {
            if l.step >= step {
                return Err(SaveError::NotNewer {
                    step,
                    latest: l.step,
                });
            }
        }
        let txn = Txn {
            compares: vec![
                Compare::ModRevision(gkey.clone(), g.mod_revision),
                match &latest {
                    Some(kv) => Compare::ModRevision(ckey.clone(), kv.mod_revision),
                    None => Compare::Absent(ckey.clone()),
                },
            ],
            ops: vec![Op::put(
                ckey.clone(),
                serde_json::to_vec(rec).expect("a record serializes"),
            )],
        };
        if store.backend.txn(txn).await.map_err(etcd)?.succeeded {
            return Ok(());
        }
        // something moved between the reads and the transaction: look again
    }
}

//! Restoring: find the committed checkpoints (the bucket's commit records, and etcd's latest
//! record when there is an etcd), read a manifest, fetch chunks with concurrent ranged GETs and
//! verify every CRC32C. Which chunks a rank fetches is [`crate::plan::readers`]; assembling
//! them into tensors of the current layout is the caller's (it owns the tensors).

use std::collections::BTreeMap;

use bytes::Bytes;
use ductile_cluster::records::CheckpointRecord;
use futures_util::stream::{self, StreamExt, TryStreamExt};

use crate::bucket::{Bucket, BucketError};
use crate::format::*;
use crate::plan::ChunkRef;

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    Store(#[from] BucketError),
    #[error("checkpoint step {step}: {url}/{object}: tensor {tensor}: {reason}")]
    Corrupt {
        step: u64,
        url: String,
        object: String,
        tensor: String,
        reason: String,
    },
}

/// Where a chunk's bytes start in its whole tensor (row-major, split along dimension 0).
pub fn chunk_offset_bytes(t: &TensorEntry, c: &ChunkEntry) -> u64 {
    let row: u64 = t.dtype.size() * t.shape.iter().skip(1).product::<u64>();
    c.offsets.first().copied().unwrap_or(0) * row
}

/// Every committed checkpoint, newest first: the store's commit records, plus `latest` (etcd's
/// record) whose commit record may not have reached the store yet.
pub async fn committed(
    bucket: &Bucket,
    latest: Option<&CheckpointRecord>,
) -> Result<Vec<CheckpointRecord>, BucketError> {
    let mut out: BTreeMap<(u64, u64), CheckpointRecord> = BTreeMap::new();
    for (key, _) in bucket.list("").await? {
        if !key.ends_with(&format!("/{COMMIT}")) {
            continue;
        }
        match bucket.get(&key).await {
            Ok(b) => match serde_json::from_slice::<CheckpointRecord>(&b) {
                Ok(r) => {
                    out.insert((r.step, r.generation), r);
                }
                Err(e) => {
                    tracing::warn!(object = %key, error = %e, "unreadable commit record skipped")
                }
            },
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e),
        }
    }
    if let Some(l) = latest {
        out.entry((l.step, l.generation))
            .or_insert_with(|| l.clone());
    }
    Ok(out.into_values().rev().collect())
}

/// The manifest a commit record names, checked against the record's CRC.
pub async fn load_manifest(
    bucket: &Bucket,
    rec: &CheckpointRecord,
) -> Result<Manifest, RestoreError> {
    let corrupt = |reason: String| RestoreError::Corrupt {
        step: rec.step,
        url: bucket.url.clone(),
        object: rec.manifest.clone(),
        tensor: "(manifest)".into(),
        reason,
    };
    let body = bucket.get(&rec.manifest).await?;
    let crc = crc32c(&body);
    if crc != rec.manifest_crc32c {
        return Err(corrupt(format!(
            "CRC32C {crc:08x}, the commit record says {:08x}",
            rec.manifest_crc32c
        )));
    }
    serde_json::from_slice(&body).map_err(|e| corrupt(format!("not a manifest: {e}")))
}

/// Fetch `chunks` of `m` and verify each CRC32C off the async threads. Per object, one
/// `get_ranges` of all its chunks (object_store coalesces adjacent ranges into few large GETs
/// and hands back slices without copying); objects are read `concurrency` at a time. The bytes
/// come back in the order of `chunks`.
pub async fn fetch(
    bucket: &Bucket,
    m: &Manifest,
    chunks: &[ChunkRef],
    concurrency: usize,
) -> Result<Vec<Bytes>, RestoreError> {
    let dir = attempt_dir(m.step, m.generation);
    let step = m.step;
    let mut by_object: BTreeMap<String, Vec<(usize, String, ChunkEntry)>> = BTreeMap::new();
    for (i, (name, k)) in chunks.iter().enumerate() {
        let c = m.tensors[name].chunks[*k].clone();
        by_object
            .entry(format!("{dir}/{}", c.object))
            .or_default()
            .push((i, name.clone(), c));
    }
    let verified: Vec<Vec<(usize, Bytes)>> =
        stream::iter(by_object.into_iter().map(|(object, list)| async move {
            let ranges: Vec<std::ops::Range<u64>> = list
                .iter()
                .map(|(_, _, c)| c.byte_range[0]..c.byte_range[1])
                .collect();
            let got = bucket.get_ranges(&object, &ranges).await?;
            let url = bucket.url.clone();
            tokio::task::spawn_blocking(move || {
                let mut out = Vec::with_capacity(list.len());
                for ((i, name, c), bytes) in list.into_iter().zip(got) {
                    let corrupt = |reason: String| RestoreError::Corrupt {
                        step,
                        url: url.clone(),
                        object: object.clone(),
                        tensor: name.clone(),
                        reason,
                    };
                    let want = (c.byte_range[1] - c.byte_range[0]) as usize;
                    if bytes.len() != want {
                        return Err(corrupt(format!("{} bytes, expected {want}", bytes.len())));
                    }
                    let crc = crc32c(&bytes);
                    if crc != c.crc32c {
                        return Err(corrupt(format!(
                            "CRC32C mismatch in bytes {}..{}: {crc:08x}, the manifest says {:08x}",
                            c.byte_range[0], c.byte_range[1], c.crc32c
                        )));
                    }
                    out.push((i, bytes));
                }
                Ok(out)
            })
            .await
            .expect("the CRC check does not panic")
        }))
        .buffer_unordered(concurrency.max(1))
        .try_collect()
        .await?;
    let mut out = vec![Bytes::new(); chunks.len()];
    for (i, b) in verified.into_iter().flatten() {
        out[i] = b;
    }
    Ok(out)
}

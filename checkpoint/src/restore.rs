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
/// record) whose commit record may not have reached the store yet. When `latest` is given it
/// is the newest candidate: commits after it are left out.
pub async fn committed(
    bucket: &Bucket,
    latest: Option<&CheckpointRecord>,
) -> Result<Vec<CheckpointRecord>, BucketError> {
    committed_for(bucket, latest, None).await
}

/// [`committed`], for `job`: a commit whose record names another job (one that used the
/// location before) is never a candidate.
pub async fn committed_for(
    bucket: &Bucket,
    latest: Option<&CheckpointRecord>,
    job: Option<&str>,
) -> Result<Vec<CheckpointRecord>, BucketError> {
    let mut out: BTreeMap<(u64, u64), CheckpointRecord> = BTreeMap::new();
    let keys: Vec<String> = bucket.list("").await?.into_iter().map(|(k, _)| k).collect();
    let superseded: std::collections::BTreeSet<&str> = keys
        .iter()
        .filter_map(|k| k.strip_suffix(&format!("/{SUPERSEDED}")))
        .collect();
    for key in &keys {
        let Some(dir) = key.strip_suffix(&format!("/{COMMIT}")) else {
            continue;
        };
        if superseded.contains(dir) {
            continue;
        }
        match bucket.get(key).await {
            Ok(b) => match serde_json::from_slice::<CheckpointRecord>(&b) {
                Ok(r) => match (job, r.job.as_deref()) {
                    (Some(me), Some(owner)) if owner != me => {
                        tracing::debug!(object = %key, owner, "another job's commit: not a candidate")
                    }
                    _ => {
                        out.insert((r.step, r.generation), r);
                    }
                },
                Err(e) => {
                    tracing::warn!(object = %key, error = %e, "unreadable commit record skipped")
                }
            },
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e),
        }
    }
    if let Some(l) = latest {
        // etcd's record decides the lineage: a later commit in the store is one the job left
        // (a rollback whose supersede did not finish), never a candidate
        out.retain(|k, _| *k <= (l.step, l.generation));
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
    let m: Manifest =
        serde_json::from_slice(&body).map_err(|e| corrupt(format!("not a manifest: {e}")))?;
    m.validate().map_err(corrupt)?;
    Ok(m)
}

/// Below this, a local object is not split for parallel reads.
const MIN_LOCAL_PIECE: u64 = 8 << 20;

/// Cut an object's chunks (in byte order) into at most `parts` runs of about equal bytes, none
/// under `min` bytes unless it is the whole object.
fn pieces<T>(list: Vec<(T, u64)>, parts: usize, min: u64) -> Vec<Vec<T>> {
    let total: u64 = list.iter().map(|(_, n)| n).sum();
    let target = (total / parts.max(1) as u64).max(min).max(1);
    let mut out: Vec<Vec<T>> = vec![Vec::new()];
    let mut acc = 0u64;
    for (x, n) in list {
        if acc >= target {
            out.push(Vec::new());
            acc = 0;
        }
        acc += n;
        out.last_mut().unwrap().push(x);
    }
    out
}

/// Fetch `chunks` of `m` and verify each CRC32C off the async threads; `concurrency` reads in
/// flight. From S3, one `get_ranges` per object: object_store coalesces adjacent ranges into
/// few large GETs and hands back slices without copying, and fewer, larger requests are what
/// a server wants. From a local directory, each object is cut into up to `concurrency` runs of
/// chunks read (and checked) in parallel, since a read there is a copy that one core bounds.
/// The bytes come back in the order of `chunks`.
pub async fn fetch(
    bucket: &Bucket,
    m: &Manifest,
    chunks: &[ChunkRef],
    concurrency: usize,
) -> Result<Vec<Bytes>, RestoreError> {
    let dir = attempt_dir(m.step, m.generation);
    fetch_in(bucket, &dir, m, chunks, concurrency, true).await
}

/// [`fetch`] from objects under `dir` (empty: the bucket's root), checking each chunk's
/// CRC32C when `verify` (a Hugging Face directory records none: its chunks are only checked
/// for their length).
pub async fn fetch_in(
    bucket: &Bucket,
    dir: &str,
    m: &Manifest,
    chunks: &[ChunkRef],
    concurrency: usize,
    verify: bool,
) -> Result<Vec<Bytes>, RestoreError> {
    let step = m.step;
    let mut by_object: BTreeMap<String, Vec<(usize, String, ChunkEntry)>> = BTreeMap::new();
    for (i, (name, k)) in chunks.iter().enumerate() {
        let c = m.tensors[name].chunks[*k].clone();
        let key = if dir.is_empty() {
            c.object.clone()
        } else {
            format!("{dir}/{}", c.object)
        };
        by_object.entry(key).or_default().push((i, name.clone(), c));
    }
    let parts = if bucket.is_local() {
        4 * concurrency
    } else {
        1
    };
    let work = by_object.into_iter().flat_map(|(object, mut list)| {
        list.sort_by_key(|(_, _, c)| c.byte_range[0]);
        let sized = list
            .into_iter()
            .map(|x| {
                let n = x.2.byte_range[1] - x.2.byte_range[0];
                (x, n)
            })
            .collect();
        pieces(sized, parts, MIN_LOCAL_PIECE)
            .into_iter()
            .map(move |p| (object.clone(), p))
    });
    let verified: Vec<Vec<(usize, Bytes)>> = stream::iter(work.map(|(object, list)| async move {
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
                if verify {
                    let crc = crc32c(&bytes);
                    if crc != c.crc32c {
                        return Err(corrupt(format!(
                            "CRC32C mismatch in bytes {}..{}: {crc:08x}, the manifest says {:08x}",
                            c.byte_range[0], c.byte_range[1], c.crc32c
                        )));
                    }
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

#[cfg(test)]
mod tests {
    use super::pieces;

    #[test]
    fn pieces_keep_order_cover_everything_and_respect_the_minimum() {
        let list: Vec<(u32, u64)> = (0..16).map(|i| (i, 64)).collect();
        let p = pieces(list.clone(), 4, 1);
        assert_eq!(p.len(), 4);
        assert_eq!(p.concat(), (0..16).collect::<Vec<_>>());
        assert!(p.iter().all(|x| x.len() == 4), "{p:?}");
        // small objects stay whole
        assert_eq!(
            pieces(list.clone(), 8, 10_000),
            vec![(0..16).collect::<Vec<_>>()]
        );
        // one part: the whole object
        assert_eq!(pieces(list, 1, 1).len(), 1);
        // uneven chunks: no run is empty
        let p = pieces(vec![(0, 1000), (1, 1), (2, 1), (3, 1000)], 3, 1);
        assert!(p.iter().all(|x| !x.is_empty()));
        assert_eq!(p.concat(), vec![0, 1, 2, 3]);
    }
}

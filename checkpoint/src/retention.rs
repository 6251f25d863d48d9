//! What a checkpoint URL holds (`dctl checkpoints`), and retention: keep the last K commits,
//! delete older ones, uncommitted attempts older than a TTL, and the multipart uploads that
//! crashed writers left open.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use ductile_cluster::records::{now_ms, CheckpointRecord, Layout};
use object_store::ObjectMeta;
use serde::{Deserialize, Serialize};

use crate::bucket::{Bucket, BucketError};
use crate::format::*;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointState {
    Committed,
    Attempt,
    /// Committed once, then left behind by a job that resumed from an earlier chosen step.
    Superseded,
}

/// What replaces a `COMMIT` when its checkpoint is superseded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SupersededRecord {
    pub record: CheckpointRecord,
    pub reason: String,
    pub superseded_at_ms: u64,
}

/// One (step, generation) directory of a checkpoint URL.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointInfo {
    pub step: u64,
    pub generation: u64,
    pub state: CheckpointState,
    /// Commit time, or the newest object's time for an attempt (ms since the epoch).
    pub time_ms: u64,
    /// Bytes of its shards.
    pub bytes: u64,
    pub world_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<Layout>,
    pub objects: usize,
    /// The job its commit record or manifest names (None: not known, or a record from before
    /// jobs were named).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
}

struct Dir {
    objects: Vec<(String, ObjectMeta)>,
    /// Its commit (or superseded) record, where one was read and parsed.
    record: Option<CheckpointRecord>,
    /// The job its record or manifest names.
    job: Option<String>,
}

/// The largest manifest read only to learn which job an uncommitted attempt belongs to.
const MAX_OWNER_MANIFEST: u64 = 64 << 20;

/// Just the field of a manifest that names its job.
#[derive(Deserialize)]
struct ManifestOwner {
    job: String,
}

async fn dirs(bucket: &Bucket) -> Result<BTreeMap<(u64, u64), Dir>, BucketError> {
    let mut out: BTreeMap<(u64, u64), Dir> = BTreeMap::new();
    for (key, meta) in bucket.list("").await? {
        let mut parts = key.splitn(3, '/');
        let (Some(a), Some(b)) = (parts.next(), parts.next()) else {
            continue;
        };
        if let Some(sg) = parse_attempt_dir(&format!("{a}/{b}")) {
            out.entry(sg)
                .or_insert_with(|| Dir {
                    objects: vec![],
                    record: None,
                    job: None,
                })
                .objects
                .push((key, meta));
        }
    }
    Ok(out)
}

/// Every checkpoint directory, newest step first. `latest` (etcd's record) counts as committed
/// even before its commit record reaches the store.
pub async fn list(
    bucket: &Bucket,
    latest: Option<&CheckpointRecord>,
) -> Result<Vec<CheckpointInfo>, BucketError> {
    Ok(list_dirs(bucket, latest).await?.0)
}

/// [`list`], and the objects of each directory (one listing of the bucket).
async fn list_dirs(
    bucket: &Bucket,
    latest: Option<&CheckpointRecord>,
) -> Result<(Vec<CheckpointInfo>, BTreeMap<(u64, u64), Dir>), BucketError> {
    let mut all = dirs(bucket).await?;
    let mut out = Vec::new();
    for (&(step, generation), d) in &mut all {
        let commit_key = format!("{}/{COMMIT}", attempt_dir(step, generation));
        let superseded_key = format!("{}/{SUPERSEDED}", attempt_dir(step, generation));
        // A read error fails the listing (and so retention) with that error: a commit is never
        // taken for an attempt because it could not be read. A record that reads but does not
        // parse keeps its class (committed or superseded) with what the objects tell.
        let mut rec = None;
        let mut state = CheckpointState::Attempt;
        if d.objects.iter().any(|(k, _)| *k == superseded_key) {
            state = CheckpointState::Superseded;
            // (listed, then deleted by a retention pass meanwhile: gone, not an error)
            let b = match bucket.get(&superseded_key).await {
                Err(e) if e.is_not_found() => continue,
                r => r?,
            };
            match serde_json::from_slice::<SupersededRecord>(&b) {
                Ok(s) => rec = Some(s.record),
                Err(e) => {
                    tracing::warn!(object = %superseded_key, error = %e, "unparsable superseded record: kept as superseded")
                }
            }
        } else if d.objects.iter().any(|(k, _)| *k == commit_key) {
            state = CheckpointState::Committed;
            let b = match bucket.get(&commit_key).await {
                Err(e) if e.is_not_found() => continue,
                r => r?,
            };
            match serde_json::from_slice::<CheckpointRecord>(&b) {
                Ok(r) => rec = Some(r),
                Err(e) => {
                    tracing::warn!(object = %commit_key, error = %e, "unparsable commit record: kept as a commit")
                }
            }
        }
        if rec.is_none() {
            rec = latest
                .filter(|l| l.step == step && l.generation == generation)
                .cloned();
            if rec.is_some() && state == CheckpointState::Attempt {
                state = CheckpointState::Committed;
            }
        }
        d.job = rec.as_ref().and_then(|r| r.job.clone());
        if rec.is_none() {
            // an attempt that got as far as its manifest names its job there
            let manifest_key = format!("{}/{MANIFEST}", attempt_dir(step, generation));
            if d.objects.iter().any(|(k, _)| *k == manifest_key) {
                if let crate::bucket::Capped::Bytes(b) =
                    bucket.get_capped(&manifest_key, MAX_OWNER_MANIFEST).await?
                {
                    d.job = serde_json::from_slice::<ManifestOwner>(&b)
                        .ok()
                        .map(|m| m.job);
                }
            }
        }
        d.record = rec.clone();
        let shards: Vec<&(String, ObjectMeta)> = d
            .objects
            .iter()
            .filter(|(k, _)| k.ends_with(".safetensors"))
            .collect();
        let world_from_names = shards
            .first()
            .and_then(|(k, _)| k.rsplit("-of-").next())
            .and_then(|s| s.trim_end_matches(".safetensors").parse().ok())
            .unwrap_or(0);
        let newest = d
            .objects
            .iter()
            .map(|(_, m)| m.last_modified.timestamp_millis().max(0) as u64)
            .max()
            .unwrap_or(0);
        out.push(match rec {
            Some(r) => CheckpointInfo {
                step,
                generation,
                state,
                time_ms: r.committed_at_ms,
                bytes: r.bytes,
                world_size: r.world_size,
                layout: Some(r.layout),
                objects: d.objects.len(),
                job: d.job.clone(),
            },
            None => CheckpointInfo {
                step,
                generation,
                state,
                time_ms: newest,
                bytes: shards.iter().map(|(_, m)| m.size).sum(),
                world_size: world_from_names,
                layout: None,
                objects: d.objects.len(),
                job: d.job.clone(),
            },
        });
    }
    out.reverse();
    Ok((out, all))
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Retained {
    pub kept: Vec<u64>,
    pub deleted_commits: Vec<u64>,
    pub deleted_attempts: Vec<(u64, u64)>,
    pub aborted_uploads: usize,
    /// Commit records written for etcd commits whose record had not reached the store.
    pub repaired: usize,
    /// Commits above etcd's latest, superseded: (step, generation).
    pub superseded: Vec<(u64, u64)>,
    /// Directories another job wrote (its record or manifest says so), left alone.
    pub foreign: Vec<(u64, u64)>,
}

/// The job that committed the directory of (`step`, `generation`), if it holds a commit (or
/// superseded) record naming one; a read error is an error, never an absence.
pub async fn dir_owner(
    bucket: &Bucket,
    step: u64,
    generation: u64,
) -> Result<Option<String>, BucketError> {
    let dir = attempt_dir(step, generation);
    for (name, superseded) in [(COMMIT, false), (SUPERSEDED, true)] {
        let b = match bucket.get(&format!("{dir}/{name}")).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => continue,
            Err(e) => return Err(e),
        };
        let job = if superseded {
            serde_json::from_slice::<SupersededRecord>(&b)
                .ok()
                .and_then(|s| s.record.job)
        } else {
            serde_json::from_slice::<CheckpointRecord>(&b)
                .ok()
                .and_then(|r| r.job)
        };
        if job.is_some() {
            return Ok(job);
        }
    }
    Ok(None)
}

/// Whether the `COMMIT` record of `rec` is in the store; a read error is an error, never an
/// absence.
pub async fn has_commit_record(
    bucket: &Bucket,
    rec: &CheckpointRecord,
) -> Result<bool, BucketError> {
    match bucket.get(&commit_key(rec.step, rec.generation)).await {
        Ok(_) => Ok(true),
        Err(e) if e.is_not_found() => Ok(false),
        Err(e) => Err(e),
    }
}

/// Keep the `keep` newest commits of the job's lineage; delete older commits, and uncommitted
/// attempts whose newest object is older than `attempt_ttl` (aborting their open multipart
/// uploads first).
///
/// With `latest` (etcd's record of the job's latest commit) retention follows etcd's lineage:
/// every commit etcd knows of (the latest and the earlier ones whose `COMMIT` record had not
/// reached the store, `latest.unrecorded`) gets its record now; commits above the latest (a
/// history the job left by resuming from an earlier step, or an etcd restored from an older
/// snapshot) are superseded, never counted nor deleted, and that happens before anything is
/// deleted (a supersede that fails fails the pass); the latest is never deleted.
///
/// With `job`, a directory whose commit record or manifest names another job (one that used
/// this location before) is that job's: never counted, superseded nor deleted (`foreign`).
pub async fn retain(
    bucket: &Bucket,
    keep: usize,
    attempt_ttl: Duration,
    latest: Option<&CheckpointRecord>,
    job: Option<&str>,
) -> Result<Retained, BucketError> {
    let mut r = Retained::default();
    // every etcd commit whose record is missing from the store gets it now
    if let Some(l) = latest {
        for rec in std::iter::once(&l.alone()).chain(&l.unrecorded) {
            if !has_commit_record(bucket, rec).await? {
                bucket
                    .put(
                        &commit_key(rec.step, rec.generation),
                        Bytes::from(serde_json::to_vec_pretty(rec).unwrap()),
                    )
                    .await?;
                r.repaired += 1;
            }
        }
    }
    let (mut infos, all) = list_dirs(bucket, latest).await?;
    if let Some(me) = job {
        infos.retain(|i| match i.job.as_deref() {
            Some(owner) if owner != me => {
                r.foreign.push((i.step, i.generation));
                false
            }
            _ => true,
        });
    }
    if let Some(l) = latest {
        // commits above etcd's latest: superseded, with the record the listing read (or what
        // it knows of one whose record does not parse)
        let above: Vec<CheckpointRecord> = infos
            .iter()
            .filter(|i| i.state == CheckpointState::Committed && i.step > l.step)
            .map(|i| match &all[&(i.step, i.generation)].record {
                Some(rec) => rec.clone(),
                None => CheckpointRecord {
                    job: None,
                    step: i.step,
                    generation: i.generation,
                    manifest: format!("{}/{MANIFEST}", attempt_dir(i.step, i.generation)),
                    manifest_crc32c: 0,
                    bytes: i.bytes,
                    world_size: i.world_size,
                    layout: Layout::data_parallel(i.world_size.max(1)),
                    committed_at_ms: i.time_ms,
                    request: None,
                    unrecorded: Vec::new(),
                },
            })
            .collect();
        if !above.is_empty() {
            let why = format!(
                "above etcd's latest commit (step {}, generation {}): a history the job left",
                l.step, l.generation
            );
            r.superseded = supersede(bucket, &above, &why).await?;
            for i in infos
                .iter_mut()
                .filter(|i| r.superseded.contains(&(i.step, i.generation)))
            {
                i.state = CheckpointState::Superseded;
            }
        }
    }
    let is_latest = |step: u64, generation: u64| {
        latest.is_some_and(|l| l.step == step && l.generation == generation)
    };
    let now = now_ms();
    let mut commits_seen = 0usize;
    for info in infos {
        let dir = attempt_dir(info.step, info.generation);
        let objects = &all[&(info.step, info.generation)].objects;
        let drop = match info.state {
            CheckpointState::Committed => {
                commits_seen += 1;
                if commits_seen <= keep || is_latest(info.step, info.generation) {
                    r.kept.push(info.step);
                    false
                } else {
                    r.deleted_commits.push(info.step);
                    true
                }
            }
            // the operator's to delete: it was a commit, and may be wanted again
            CheckpointState::Superseded => false,
            CheckpointState::Attempt => {
                let old = now.saturating_sub(info.time_ms) >= attempt_ttl.as_millis() as u64;
                if old {
                    r.deleted_attempts.push((info.step, info.generation));
                }
                old
            }
        };
        if !drop {
            continue;
        }
        for (key, _) in objects.iter().filter(|(k, _)| k.contains("/uploads/")) {
            bucket.abort_recorded(key).await?;
            r.aborted_uploads += 1;
        }
        // the commit record goes first, so a half-deleted commit is never read as complete
        let commit = format!("{dir}/{COMMIT}");
        bucket.delete(&commit).await?;
        for (key, _) in objects.iter().filter(|(k, _)| *k != commit) {
            bucket.delete(key).await?;
        }
        bucket.remove_local_dir(&dir);
    }
    Ok(r)
}

/// What `dctl delete JOB --purge` removed from a checkpoint URL, and what it left.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Purged {
    /// The job's own directories, deleted: (step, generation).
    pub deleted: Vec<(u64, u64)>,
    /// Directories another job's record or manifest names: left alone.
    pub foreign: Vec<(u64, u64)>,
    /// Directories naming no job (an attempt that never wrote its manifest, a record from
    /// before jobs were named): left, for the operator to judge.
    pub unowned: Vec<(u64, u64)>,
}

/// Delete every checkpoint directory of `job` at this location (commits, superseded commits,
/// attempts), each commit record first so that no half-deleted commit is ever read as whole;
/// other jobs' directories, and those naming no job, are left. An error stops the purge with
/// what was deleted so far still deleted; a second purge finishes it.
pub async fn purge(bucket: &Bucket, job: &str) -> Result<Purged, BucketError> {
    let (infos, all) = list_dirs(bucket, None).await?;
    let mut p = Purged::default();
    for info in infos {
        let at = (info.step, info.generation);
        match info.job.as_deref() {
            Some(owner) if owner == job => {}
            Some(_) => {
                p.foreign.push(at);
                continue;
            }
            None => {
                p.unowned.push(at);
                continue;
            }
        }
        let dir = attempt_dir(info.step, info.generation);
        let objects = &all[&at].objects;
        for (key, _) in objects.iter().filter(|(k, _)| k.contains("/uploads/")) {
            bucket.abort_recorded(key).await?;
        }
        for record in [COMMIT, SUPERSEDED] {
            let key = format!("{dir}/{record}");
            if objects.iter().any(|(k, _)| *k == key) {
                bucket.delete(&key).await?;
            }
        }
        for (key, _) in objects.iter().filter(|(k, _)| {
            !k.ends_with(&format!("/{COMMIT}")) && !k.ends_with(&format!("/{SUPERSEDED}"))
        }) {
            bucket.delete(key).await?;
        }
        bucket.remove_local_dir(&dir);
        p.deleted.push(at);
    }
    Ok(p)
}

/// Supersede `records` (commits after the step a job resumed from with `restore_step`: they
/// belong to the history it left). Their data stays: a `SUPERSEDED` record (the commit record,
/// `reason`, the time) is written, then the `COMMIT` deleted, so no restore picks them and
/// retention keeps them for the operator. Returns the (step, generation)s superseded.
pub async fn supersede(
    bucket: &Bucket,
    records: &[CheckpointRecord],
    reason: &str,
) -> Result<Vec<(u64, u64)>, BucketError> {
    let mut done = Vec::new();
    for record in records {
        let dir = attempt_dir(record.step, record.generation);
        let s = SupersededRecord {
            record: record.clone(),
            reason: reason.to_string(),
            superseded_at_ms: now_ms(),
        };
        bucket
            .put(
                &format!("{dir}/{SUPERSEDED}"),
                Bytes::from(serde_json::to_vec_pretty(&s).unwrap()),
            )
            .await?;
        bucket.delete(&format!("{dir}/{COMMIT}")).await?;
        done.push((record.step, record.generation));
    }
    Ok(done)
}

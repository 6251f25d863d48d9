//! A job's checkpoint URL as a place to put, read, list and delete objects: S3 and local files
//! through the same object_store calls. Uploads of big objects go in parts: S3's multipart API
//! with our per-part retries (the upload id is recorded beside the attempt first, so that
//! retention can abort it after a crash), the local store's staged multipart writer for files.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{self, StreamExt, TryStreamExt};
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::store::{open_multipart, StoreError};
use crate::Location;

/// What [`Bucket::get_capped`] found.
#[derive(Debug)]
pub enum Capped {
    Absent,
    /// Longer than the cap: its size.
    TooLarge(u64),
    Bytes(Bytes),
}

#[derive(Debug, thiserror::Error)]
#[error("{url}/{key}: {op} failed: {source}")]
pub struct BucketError {
    pub url: String,
    pub key: String,
    pub op: &'static str,
    #[source]
    pub source: object_store::Error,
}

impl BucketError {
    pub fn is_not_found(&self) -> bool {
        matches!(self.source, object_store::Error::NotFound { .. })
    }
}

/// How big objects are uploaded.
#[derive(Clone, Copy, Debug)]
pub struct UploadOptions {
    pub part_size: usize,
    pub concurrency: usize,
    /// Tries per part (S3), with exponential backoff from 200 ms.
    pub part_tries: u32,
}

impl Default for UploadOptions {
    fn default() -> Self {
        UploadOptions {
            part_size: 64 << 20,
            concurrency: 4,
            part_tries: 4,
        }
    }
}

#[derive(Clone)]
pub struct Bucket {
    pub url: String,
    pub store: Arc<dyn ObjectStore>,
    root: Path,
    multipart: Option<Arc<dyn MultipartStore>>,
    local_root: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bucket({})", self.url)
    }
}

impl Bucket {
    pub fn open(url: &str) -> Result<Bucket, StoreError> {
        let url = url.trim_end_matches('/').to_string();
        let (store, root, multipart) = open_multipart(&url)?;
        let local_root = match Location::parse(&url)? {
            Location::File { path } => Some(path),
            Location::S3 { .. } => None,
        };
        Ok(Bucket {
            url,
            store,
            root,
            multipart,
            local_root,
        })
    }

    /// A bucket over any object store (in-memory stores in unit tests).
    pub fn from_store(url: &str, store: Arc<dyn ObjectStore>) -> Bucket {
        Bucket {
            url: url.into(),
            store,
            root: Path::default(),
            multipart: None,
            local_root: None,
        }
    }

    /// A local directory (`file://`): reads are copies from the page cache, not requests.
    pub fn is_local(&self) -> bool {
        self.local_root.is_some()
    }

    pub fn path(&self, key: &str) -> Path {
        let mut p = self.root.clone();
        for part in key.split('/').filter(|s| !s.is_empty()) {
            p = p.join(part);
        }
        p
    }

    /// `key` relative to the root, for a listed path.
    pub fn key_of(&self, p: &Path) -> String {
        let root = self.root.as_ref();
        let s = p.as_ref();
        s.strip_prefix(root)
            .unwrap_or(s)
            .trim_start_matches('/')
            .to_string()
    }

    fn err(&self, key: &str, op: &'static str) -> impl Fn(object_store::Error) -> BucketError {
        let (url, key) = (self.url.clone(), key.to_string());
        move |source| BucketError {
            url: url.clone(),
            key: key.clone(),
            op,
            source,
        }
    }

    pub async fn put(&self, key: &str, bytes: Bytes) -> Result<(), BucketError> {
        retry(4, || async {
            self.store
                .put(&self.path(key), PutPayload::from(bytes.clone()))
                .await
        })
        .await
        .map_err(self.err(key, "put"))?;
        Ok(())
    }

    /// Create `key` only if it does not exist (`PutMode::Create`). Returns false if it existed.
    pub async fn create(&self, key: &str, bytes: Bytes) -> Result<bool, BucketError> {
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .store
            .put_opts(&self.path(key), PutPayload::from(bytes), opts)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(self.err(key, "conditional create")(e)),
        }
    }

    /// Whether this store enforces conditional creates: two creates of a probe key, the second
    /// must fail. Many S3-compatible servers accept `If-None-Match` and ignore it.
    pub async fn probe_conditional_create(&self) -> Result<bool, BucketError> {
        let key = format!(
            "_ductile_probe/{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        );
        let first = match self.create(&key, Bytes::from_static(b"1")).await {
            Ok(c) => c,
            Err(e) if matches!(e.source, object_store::Error::NotImplemented { .. }) => {
                return Ok(false)
            }
            Err(e) => return Err(e),
        };
        let second = self.create(&key, Bytes::from_static(b"2")).await?;
        let _ = self.delete(&key).await;
        Ok(first && !second)
    }

    pub async fn get(&self, key: &str) -> Result<Bytes, BucketError> {
        let r = self
            .store
            .get(&self.path(key))
            .await
            .map_err(self.err(key, "get"))?;
        r.bytes().await.map_err(self.err(key, "get"))
    }

    /// An object's bytes, or `None` when there is no such object (any other failure is an
    /// error, never an absence).
    pub async fn get_if_exists(&self, key: &str) -> Result<Option<Bytes>, BucketError> {
        match self.get(key).await {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// An object's bytes if it is at most `max` long: what a reader that must not be made to
    /// hold an arbitrary object (the daemon, reading what a job names) asks for. The object's
    /// size is asked first, and no more than `max` bytes are read even if it grew since.
    pub async fn get_capped(&self, key: &str, max: u64) -> Result<Capped, BucketError> {
        let meta = match self.head(key).await {
            Ok(m) => m,
            Err(e) if e.is_not_found() => return Ok(Capped::Absent),
            Err(e) => return Err(e),
        };
        if meta.size > max {
            return Ok(Capped::TooLarge(meta.size));
        }
        let b = self
            .store
            .get_range(&self.path(key), 0..meta.size)
            .await
            .map_err(self.err(key, "get"))?;
        Ok(Capped::Bytes(b))
    }

    /// An object's metadata (its size).
    pub async fn head(&self, key: &str) -> Result<ObjectMeta, BucketError> {
        self.store
            .head(&self.path(key))
            .await
            .map_err(self.err(key, "head"))
    }

    /// Concurrent ranged GETs of one object.
    pub async fn get_ranges(
        &self,
        key: &str,
        ranges: &[Range<u64>],
    ) -> Result<Vec<Bytes>, BucketError> {
        self.store
            .get_ranges(&self.path(key), ranges)
            .await
            .map_err(self.err(key, "ranged get"))
    }

    pub async fn delete(&self, key: &str) -> Result<(), BucketError> {
        match self.store.delete(&self.path(key)).await {
            Ok(()) => Ok(()),
            Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err(key, "delete")(e)),
        }
    }

    /// Every object under `prefix` (recursive), keys relative to the root.
    pub async fn list(&self, prefix: &str) -> Result<Vec<(String, ObjectMeta)>, BucketError> {
        let p = self.path(prefix);
        let metas: Vec<ObjectMeta> = self
            .store
            .list(Some(&p))
            .try_collect()
            .await
            .map_err(self.err(prefix, "list"))?;
        Ok(metas
            .into_iter()
            .map(|m| (self.key_of(&m.location), m))
            .collect())
    }

    /// Remove what a local directory holds beyond its objects (staged uploads of a crashed
    /// writer), once its objects are deleted. A no-op for S3.
    pub fn remove_local_dir(&self, dir: &str) {
        if let Some(root) = &self.local_root {
            let _ = std::fs::remove_dir_all(root.join(dir));
        }
    }

    /// Upload `bytes` to `key` in parts of `opts.part_size`, at most `opts.concurrency` at a time.
    /// `marker` is where the multipart upload id is recorded while the upload is open (S3).
    /// On failure the upload is aborted.
    /// `on_part` sees each part's byte range, in order, as the part is handed to the uploader
    /// (the writer computes its CRCs there).
    pub async fn upload(
        &self,
        key: &str,
        bytes: Bytes,
        marker: &str,
        opts: UploadOptions,
        mut on_part: impl FnMut(Range<usize>),
    ) -> Result<(), BucketError> {
        let part = opts.part_size.max(5 << 20);
        if bytes.len() <= part {
            on_part(0..bytes.len());
            return self.put(key, bytes).await;
        }
        let ranges: Vec<Range<usize>> = (0..bytes.len().div_ceil(part))
            .map(|i| i * part..((i + 1) * part).min(bytes.len()))
            .collect();
        let path = self.path(key);
        match &self.multipart {
            Some(mp) => {
                let id = mp
                    .create_multipart(&path)
                    .await
                    .map_err(self.err(key, "create multipart upload"))?;
                let rec = serde_json::json!({"object": key, "upload_id": id});
                self.put(marker, Bytes::from(rec.to_string())).await?;
                let parts: Result<Vec<(usize, PartId)>, object_store::Error> =
                    stream::iter(ranges.into_iter().enumerate())
                        .map(|(i, r)| {
                            on_part(r.clone());
                            let (mp, path, id, data) =
                                (mp.clone(), path.clone(), id.clone(), bytes.slice(r));
                            async move {
                                let p = retry(opts.part_tries, || {
                                    mp.put_part(&path, &id, i, PutPayload::from(data.clone()))
                                })
                                .await?;
                                Ok((i, p))
                            }
                        })
                        .buffer_unordered(opts.concurrency.max(1))
                        .try_collect()
                        .await;
                let done = match parts {
                    Ok(mut parts) => {
                        parts.sort_by_key(|p| p.0);
                        let parts = parts.into_iter().map(|p| p.1).collect();
                        mp.complete_multipart(&path, &id, parts)
                            .await
                            .map_err(self.err(key, "complete multipart upload"))
                    }
                    Err(e) => Err(self.err(key, "upload part")(e)),
                };
                match done {
                    Ok(_) => {
                        let _ = self.delete(marker).await;
                        Ok(())
                    }
                    Err(e) => {
                        // the marker stays if the abort fails: retention aborts it later
                        if mp.abort_multipart(&path, &id).await.is_ok() {
                            let _ = self.delete(marker).await;
                        } else {
                            tracing::warn!(object = key, upload_id = %id, "could not abort the multipart upload; retention will");
                        }
                        Err(e)
                    }
                }
            }
            None => {
                let mut up = self
                    .store
                    .put_multipart(&path)
                    .await
                    .map_err(self.err(key, "create multipart upload"))?;
                let mut pending = futures_util::stream::FuturesOrdered::new();
                let mut failed = None;
                for r in ranges {
                    on_part(r.clone());
                    pending.push_back(up.put_part(PutPayload::from(bytes.slice(r))));
                    if pending.len() >= opts.concurrency.max(1) {
                        if let Some(Err(e)) = pending.next().await {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                while failed.is_none() {
                    match pending.next().await {
                        Some(Err(e)) => failed = Some(e),
                        Some(Ok(())) => {}
                        None => break,
                    }
                }
                drop(pending);
                match failed {
                    None => up
                        .complete()
                        .await
                        .map(|_| ())
                        .map_err(self.err(key, "complete multipart upload")),
                    Some(e) => {
                        let _ = up.abort().await;
                        Err(self.err(key, "upload part")(e))
                    }
                }
            }
        }
    }

    /// Abort a multipart upload recorded in `marker` (a crashed writer's), then drop the marker.
    pub async fn abort_recorded(&self, marker: &str) -> Result<(), BucketError> {
        let Some(mp) = &self.multipart else {
            return self.delete(marker).await;
        };
        let rec: serde_json::Value = match self.get(marker).await {
            Ok(b) => serde_json::from_slice(&b).unwrap_or_default(),
            Err(e) if e.is_not_found() => return Ok(()),
            Err(e) => return Err(e),
        };
        if let (Some(object), Some(id)) = (rec["object"].as_str(), rec["upload_id"].as_str()) {
            match mp
                .abort_multipart(&self.path(object), &id.to_string())
                .await
            {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.err(object, "abort multipart upload")(e)),
            }
        }
        self.delete(marker).await
    }
}

/// Run `f` up to `tries` times, backing off 200 ms, 400 ms, … between tries.
async fn retry<T, F, Fut>(tries: u32, mut f: F) -> Result<T, object_store::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, object_store::Error>>,
{
    let mut delay = Duration::from_millis(200);
    let mut left = tries.max(1);
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if left > 1 && !matches!(e, object_store::Error::NotFound { .. }) => {
                left -= 1;
                tracing::debug!(error = %e, "object store request failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e),
        }
    }
}

//! Object storage by URL, through object_store: `s3://bucket/prefix` (endpoint, region and keys
//! from the environment: `AWS_ENDPOINT`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, …) and `file:///path`, by the same code path.

use std::sync::Arc;

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::{Location, UrlError};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Url(#[from] UrlError),
    #[error("{url}: {op} failed: {source}")]
    Object {
        url: String,
        op: &'static str,
        #[source]
        source: object_store::Error,
    },
}

/// rustls needs one crypto provider per process; ring builds fast and is what we link.
fn install_crypto() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// How S3 requests are retried inside object_store (each request: transport errors and 5xx,
/// with backoff). The checkpoint writer adds its own per-part retries on top.
pub fn retry_config() -> object_store::RetryConfig {
    object_store::RetryConfig {
        backoff: object_store::BackoffConfig {
            init_backoff: std::time::Duration::from_millis(100),
            max_backoff: std::time::Duration::from_secs(2),
            base: 2.0,
        },
        max_retries: 2,
        retry_timeout: std::time::Duration::from_secs(10),
    }
}

/// What failed (`op`) on the store at `url`.
fn object_err(url: &str) -> impl Fn(&'static str, object_store::Error) -> StoreError + '_ {
    move |op, source| StoreError::Object {
        url: url.to_string(),
        op,
        source,
    }
}

/// An object store, the key of `url` in it, and its multipart API where it has one (S3).
pub fn open_multipart(
    url: &str,
) -> Result<
    (
        Arc<dyn ObjectStore>,
        Path,
        Option<Arc<dyn object_store::multipart::MultipartStore>>,
    ),
    StoreError,
> {
    let err = object_err(url);
    match Location::parse(url)? {
        Location::S3 { bucket, prefix } => {
            let b = s3_builder(bucket).with_retry(retry_config());
            let s3 = Arc::new(b.build().map_err(|e| err("configure S3", e))?);
            Ok((s3.clone(), Path::from(prefix), Some(s3)))
        }
        Location::File { path } => {
            std::fs::create_dir_all(&path).map_err(|e| {
                let source = object_store::Error::Generic {
                    store: "LocalFileSystem",
                    source: Box::new(e),
                };
                err("create directory", source)
            })?;
            let (s, p) = open(url)?;
            Ok((s, p, None))
        }
    }
}

/// S3 for `bucket`: region and keys from the environment, and `AWS_ENDPOINT` (or
/// `AWS_ENDPOINT_URL`) for S3-compatible servers.
fn s3_builder(bucket: String) -> object_store::aws::AmazonS3Builder {
    install_crypto();
    let b = object_store::aws::AmazonS3Builder::from_env().with_bucket_name(bucket);
    match std::env::var("AWS_ENDPOINT").or_else(|_| std::env::var("AWS_ENDPOINT_URL")) {
        // loopback or in-cluster servers speak plain HTTP
        Ok(e) => b.with_allow_http(e.starts_with("http://")).with_endpoint(e),
        Err(_) => b,
    }
}

/// The local file system as an object store, every write durable before it returns: each file
/// and its parent directory are fsynced (as S3 holds what it acknowledged), so a shard or
/// manifest is on disk before the commit record that names it is written, and a power loss
/// cannot void a committed checkpoint.
fn local_fs() -> object_store::local::LocalFileSystem {
    object_store::local::LocalFileSystem::new().with_fsync(true)
}

/// An object store and the key of `url` in it.
pub fn open(url: &str) -> Result<(Arc<dyn ObjectStore>, Path), StoreError> {
    let err = object_err(url);
    match Location::parse(url)? {
        Location::S3 { bucket, prefix } => {
            let s3 = s3_builder(bucket)
                .build()
                .map_err(|e| err("configure S3", e))?;
            Ok((Arc::new(s3), Path::from(prefix)))
        }
        Location::File { path } => Ok((
            Arc::new(local_fs()),
            Path::from_absolute_path(&path).map_err(|e| err("parse path", e.into()))?,
        )),
    }
}

/// Read a whole object with concurrent ranged GETs of `chunk` bytes.
pub async fn read_ranged(url: &str, chunk: u64) -> Result<Bytes, StoreError> {
    let (store, path) = open(url)?;
    let err = object_err(url);
    let size = store.head(&path).await.map_err(|e| err("head", e))?.size;
    let ranges: Vec<std::ops::Range<u64>> = (0..size.div_ceil(chunk.max(1)))
        .map(|i| i * chunk..((i + 1) * chunk).min(size))
        .collect();
    let parts = store
        .get_ranges(&path, &ranges)
        .await
        .map_err(|e| err("ranged get", e))?;
    let mut out = Vec::with_capacity(size as usize);
    for p in parts {
        out.extend_from_slice(&p);
    }
    Ok(Bytes::from(out))
}

/// Write a whole object (a new dataset, a small file), creating parent directories for files.
pub async fn write(url: &str, bytes: Vec<u8>) -> Result<(), StoreError> {
    let (store, path) = open(url)?;
    store
        .put(&path, PutPayload::from(bytes))
        .await
        .map_err(|e| object_err(url)("put", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    /// file:// checkpoints are written durably (object_store's fsync is off by default).
    #[test]
    fn file_urls_are_written_with_fsync() {
        let (store, _) = super::open("file:///tmp/ductile-fsync-check").unwrap();
        let shown = format!("{store:?}");
        assert!(shown.contains("fsync: true"), "{shown}");
    }

    #[tokio::test]
    async fn a_file_url_round_trips_through_ranged_reads() {
        let dir = std::env::temp_dir().join(format!("ductile-store-{}", std::process::id()));
        let url = format!("file://{}/a/b.bin", dir.display());
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        super::write(&url, data.clone()).await.unwrap();
        assert_eq!(
            &super::read_ranged(&url, 4096).await.unwrap()[..],
            &data[..]
        );
        let missing = super::read_ranged(&format!("file://{}/nope", dir.display()), 4096)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("nope") && missing.contains("head failed"),
            "{missing}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}

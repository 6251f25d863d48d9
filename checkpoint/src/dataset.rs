//! Sharded token datasets: the index `ductile-worker tokenize --out PREFIX/` writes, and the
//! checks both the daemon (at submit) and the workers (at open) make of a prefix: the index
//! reads and holds together, every shard it names is there and as long as it says.
//!
//! A store that does not answer is an error of its own ([`DatasetError::Store`], retried
//! first), never taken for a missing shard.

use std::sync::Arc;
use std::time::Duration;

use object_store::{path::Path, ObjectStore, ObjectStoreExt};

/// The index of a sharded token stream: `index.json` under the dataset's prefix.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ShardIndex {
    /// [`INDEX_FORMAT`].
    pub format: String,
    pub width: u8,
    pub vocab: u64,
    pub tokenizer_sha256: String,
    #[serde(default)]
    pub eos: Option<u32>,
    pub documents: u64,
    pub tokens: u64,
    /// In sample order: the global sample space spans the shards in this order.
    pub shards: Vec<ShardEntry>,
}

pub const INDEX_FORMAT: &str = "ductile-token-shards/1";
pub const INDEX_NAME: &str = "index.json";

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ShardEntry {
    /// The shard's name under the prefix (a plain file name: no `/`, no `..`).
    pub name: String,
    pub tokens: u64,
    /// The shard file's size in bytes.
    pub bytes: u64,
    /// SHA-256 of the shard's token bytes (its header says the same).
    pub sha256: String,
    pub documents: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The dataset is not what it must be (missing, cut, inconsistent): no retry helps.
    #[error("{0}")]
    Invalid(String),
    /// The store did not answer (after retries).
    #[error("{0}")]
    Store(String),
}

impl ShardIndex {
    /// The index's own checks: format, widths, counts, names that stay under the prefix.
    pub fn check(&self, url: &str) -> Result<(), DatasetError> {
        let bad = |m: String| Err(DatasetError::Invalid(format!("dataset {url}: {m}")));
        if self.format != INDEX_FORMAT {
            return bad(format!(
                "index format {:?}, ductile reads {INDEX_FORMAT:?}",
                self.format
            ));
        }
        if self.width != 2 && self.width != 4 {
            return bad(format!("token width {} (2 or 4)", self.width));
        }
        if self.shards.is_empty() {
            return bad("the index names no shard".into());
        }
        let mut sum = 0u64;
        for s in &self.shards {
            if s.name.is_empty()
                || s.name.contains('/')
                || s.name.contains('\\')
                || s.name == "."
                || s.name == ".."
                || s.name == INDEX_NAME
            {
                return bad(format!(
                    "shard name {:?} is not a plain file name under the prefix",
                    s.name
                ));
            }
            sum = match sum.checked_add(s.tokens) {
                Some(v) => v,
                None => return bad("the shards' token counts overflow".into()),
            };
        }
        if sum != self.tokens {
            return bad(format!(
                "the shards hold {sum} tokens, the index says {}",
                self.tokens
            ));
        }
        Ok(())
    }
}

const ATTEMPTS: u32 = 3;

/// A store call with retries (backing off): `what` names it in the error. A missing object
/// is [`DatasetError::Invalid`] at once; other errors are retried, then
/// [`DatasetError::Store`].
pub async fn retried<T, F, Fut>(what: &str, mut f: F) -> Result<T, DatasetError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = object_store::Result<T>>,
{
    let mut last = None;
    for attempt in 0..ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
        }
        match f().await {
            Ok(v) => return Ok(v),
            Err(e @ object_store::Error::NotFound { .. }) => {
                return Err(DatasetError::Invalid(format!("{what}: not found ({e})")))
            }
            Err(e) => {
                tracing::warn!(attempt, "{what}: {e}");
                last = Some(e);
            }
        }
    }
    Err(DatasetError::Store(format!(
        "{what}: failed {ATTEMPTS} times, the last with: {}",
        last.expect("an attempt failed")
    )))
}

/// A prefix dataset, opened: its store, each shard's key, and the index.
pub struct Opened {
    pub store: Arc<dyn ObjectStore>,
    pub index: ShardIndex,
    pub paths: Vec<Path>,
}

/// The largest shard index read (64 MiB: half a million shards).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;

/// Read and check the index under `url` (a prefix ending in `/`), then HEAD every shard (16 at
/// a time): each must be there, as long as the index says.
pub async fn open_prefix(url: &str) -> Result<Opened, DatasetError> {
    let index_url = format!("{url}{INDEX_NAME}");
    let (store, index_path) = crate::store::open(&index_url)
        .map_err(|e| DatasetError::Invalid(format!("dataset {url}: {e}")))?;
    // bounded: whoever reads it (the daemon at submit, every worker) holds it whole
    let size = retried(&format!("dataset {index_url}"), || {
        let (s, p) = (store.clone(), index_path.clone());
        async move { s.head(&p).await.map(|m| m.size) }
    })
    .await?;
    if size > MAX_INDEX_BYTES {
        return Err(DatasetError::Invalid(format!(
            "dataset {index_url}: the index is {size} bytes, past the {MAX_INDEX_BYTES} ductile reads"
        )));
    }
    let bytes = retried(&format!("dataset {index_url}"), || {
        let (s, p) = (store.clone(), index_path.clone());
        async move { s.get_range(&p, 0..size).await }
    })
    .await?;
    let index: ShardIndex = serde_json::from_slice(&bytes).map_err(|e| {
        DatasetError::Invalid(format!("dataset {index_url}: not a shard index: {e}"))
    })?;
    index.check(url)?;
    let base = index_path
        .as_ref()
        .strip_suffix(INDEX_NAME)
        .unwrap_or("")
        .to_string();
    let paths: Vec<Path> = index
        .shards
        .iter()
        .map(|s| Path::from(format!("{base}{}", s.name)))
        .collect();
    use futures_util::stream::{StreamExt, TryStreamExt};
    let heads: Vec<(String, Path)> = index
        .shards
        .iter()
        .zip(&paths)
        .map(|(s, p)| (format!("dataset {url}: shard {}", s.name), p.clone()))
        .collect();
    let sizes: Vec<u64> = futures_util::stream::iter(heads.into_iter().map(|(what, path)| {
        let store = store.clone();
        async move {
            retried(&what, || {
                let (st, p) = (store.clone(), path.clone());
                async move { st.head(&p).await }
            })
            .await
            .map(|m| m.size)
        }
    }))
    .buffered(16)
    .try_collect()
    .await?;
    for (s, size) in index.shards.iter().zip(sizes) {
        if size != s.bytes {
            return Err(DatasetError::Invalid(format!(
                "dataset {url}: shard {} is {size} bytes, the index says {} ({})",
                s.name,
                s.bytes,
                if size < s.bytes {
                    "cut short"
                } else {
                    "longer"
                }
            )));
        }
    }
    Ok(Opened {
        store,
        index,
        paths,
    })
}

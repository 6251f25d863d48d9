//! Token streams read by range: one stream from `ductile-worker tokenize`, or a prefix of many
//! shards named by an `index.json`.
//!
//! Nothing reads a whole stream. Opening reads the index (or the one stream's header) and checks
//! every shard's size with a HEAD; a shard's own header is read, and checked against the index,
//! the first time one of its samples is wanted. Sample k of shard s is the byte range of its
//! `ctx + 1` tokens; a batch's ranges are fetched with `get_ranges` (object_store coalesces
//! neighbours and fetches in parallel), shard by shard concurrently. A read-ahead thread fetches
//! the samples of the next steps the trainer names ([`Stream::prefetch`]); the samples held are
//! bounded by a byte budget (`DUCTILE_DATA_BUDGET_MB`, default 64), so a worker's data memory
//! does not grow with the dataset. A store error is retried (three attempts, backing off) and
//! then fails the read naming the shard; a token past the vocabulary fails naming the shard and
//! its offset. Nothing is skipped.

use super::TokenHeader;
use object_store::{path::Path, ObjectStore, ObjectStoreExt};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ductile_checkpoint::dataset::retried;
pub use ductile_checkpoint::dataset::{ShardEntry, ShardIndex, INDEX_FORMAT, INDEX_NAME};

/// One shard as the reader knows it.
struct Shard {
    name: String,
    path: Path,
    tokens: u64,
    bytes: u64,
    sha256: Option<String>,
    /// The byte offset of the first token, once the shard's header was read and checked.
    body: Mutex<Option<u64>>,
}

/// What a reader holds: its shards, the samples fetched and the time batches waited.
struct Inner {
    url: String,
    store: Arc<dyn ObjectStore>,
    rt: tokio::runtime::Handle,
    header: TokenHeader,
    ctx: usize,
    shards: Vec<Shard>,
    /// `starts[s]`: the first global sample of shard s; `starts[len]`: the sample count.
    starts: Vec<u64>,
    cache: Mutex<Cache>,
    /// Ids at or past this are refused: the header's vocabulary, or the model's if smaller.
    vocab: std::sync::atomic::AtomicU64,
    /// Nanoseconds batches spent reading what the read-ahead had not fetched.
    waited: std::sync::atomic::AtomicU64,
}

struct Cache {
    held: HashMap<u64, Arc<[u32]>>,
    order: VecDeque<u64>,
    /// Tokens held at most (the byte budget over 4: samples are held as u32).
    budget: usize,
    tokens: usize,
}

impl Cache {
    fn insert(&mut self, k: u64, v: Arc<[u32]>) {
        if self.held.contains_key(&k) {
            return;
        }
        self.tokens += v.len();
        self.held.insert(k, v);
        self.order.push_back(k);
        while self.tokens > self.budget {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(v) = self.held.remove(&old) {
                self.tokens -= v.len();
            }
        }
    }
}

/// A token stream read by range (see the module's comment).
pub struct Stream {
    inner: Arc<Inner>,
    ahead: Option<std::sync::mpsc::Sender<Vec<u64>>>,
}

/// The bytes of `ranges` (sorted by start) of the object at `path`: ranges less than `gap`
/// apart are read in one request, up to 10 requests at a time.
async fn read_ranges(
    store: &Arc<dyn ObjectStore>,
    path: &Path,
    ranges: &[std::ops::Range<u64>],
    gap: u64,
) -> object_store::Result<Vec<bytes::Bytes>> {
    use futures_util::stream::{StreamExt, TryStreamExt};
    let mut merged: Vec<std::ops::Range<u64>> = Vec::new();
    for r in ranges {
        match merged.last_mut() {
            // (a merged request stays under MAX_REQUEST: what is in flight stays bounded)
            Some(m) if r.start <= m.end + gap && r.end - m.start <= MAX_REQUEST => {
                m.end = m.end.max(r.end)
            }
            _ => merged.push(r.clone()),
        }
    }
    let got: Vec<bytes::Bytes> = futures_util::stream::iter(merged.iter().cloned())
        .map(|r| async move { store.get_range(path, r).await })
        .buffered(REQUESTS_PER_SHARD)
        .try_collect()
        .await?;
    Ok(ranges
        .iter()
        .map(|r| {
            let i = merged.partition_point(|m| m.start <= r.start) - 1;
            let a = (r.start - merged[i].start) as usize;
            let b = ((r.end - merged[i].start) as usize).min(got[i].len());
            got[i].slice(a.min(b)..b)
        })
        .collect())
}

/// Ranges of a shard closer than this are read in one request (`DUCTILE_DATA_COALESCE_KB`,
/// default 256 KiB: about what a request costs in transfer time): fewer requests, at the price
/// of reading the gaps.
fn coalesce_bytes() -> u64 {
    std::env::var("DUCTILE_DATA_COALESCE_KB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(256)
        << 10
}

/// The longest request a merge makes, the requests in flight per shard, the shards read at
/// once: at most 4 × 4 × 4 MiB in flight.
const MAX_REQUEST: u64 = 4 << 20;
const REQUESTS_PER_SHARD: usize = 4;
const SHARDS_AT_ONCE: usize = 4;

/// The read-ahead's byte budget: `DUCTILE_DATA_BUDGET_MB` (default 64) MiB.
pub fn budget_bytes() -> usize {
    std::env::var("DUCTILE_DATA_BUDGET_MB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(64)
        << 20
}

/// The largest header read ahead of knowing its length.
const HEADER_READ: u64 = 64 << 10;

impl Stream {
    /// Open `url`: a prefix ending in `/` holding `index.json` and its shards, or one stream
    /// with a header. `Ok(None)`: a single object that is not a headered stream (a bare u16
    /// stream, which the caller reads whole).
    pub fn open(
        url: &str,
        ctx: usize,
        rt: &tokio::runtime::Handle,
    ) -> anyhow::Result<Option<Stream>> {
        let ds = |e: &dyn std::fmt::Display| anyhow::anyhow!("dataset {url}: {e}");
        let (store, shards, header) = if url.ends_with('/') {
            let opened = rt.block_on(ductile_checkpoint::dataset::open_prefix(url))?;
            let (store, index) = (opened.store, opened.index);
            let shards: Vec<Shard> = index
                .shards
                .iter()
                .zip(opened.paths)
                .map(|(s, path)| Shard {
                    name: s.name.clone(),
                    path,
                    tokens: s.tokens,
                    bytes: s.bytes,
                    sha256: Some(s.sha256.clone()),
                    body: Mutex::new(None),
                })
                .collect();
            let header = TokenHeader {
                width: index.width,
                vocab: index.vocab,
                tokenizer_sha256: index.tokenizer_sha256.clone(),
                eos: index.eos,
                documents: index.documents,
                tokens: index.tokens,
                sha256: None,
            };
            (store, shards, header)
        } else {
            let (store, path) = ductile_checkpoint::store::open(url).map_err(|e| ds(&e))?;
            let size = rt
                .block_on(retried(&format!("dataset {url}"), || {
                    let (s, p) = (store.clone(), path.clone());
                    async move { s.head(&p).await }
                }))?
                .size;
            let first = rt.block_on(retried(&format!("dataset {url}"), || {
                let (s, p) = (store.clone(), path.clone());
                async move { s.get_range(&p, 0..size.min(HEADER_READ)).await }
            }))?;
            let Some((h, body)) = TokenHeader::parse(&format!("dataset {url}"), &first)? else {
                return Ok(None);
            };
            let w = h.width as u64;
            anyhow::ensure!(
                h.tokens.checked_mul(w).and_then(|b| b.checked_add(body)) == Some(size),
                "dataset {url}: {} bytes of tokens, the header says {} tokens of {w} bytes (a cut or padded stream)",
                size - body.min(size),
                h.tokens
            );
            let shard = Shard {
                name: url.rsplit('/').next().unwrap_or(url).to_string(),
                path,
                tokens: h.tokens,
                bytes: size,
                sha256: None,
                body: Mutex::new(Some(body)),
            };
            (store, vec![shard], h)
        };
        let header_vocab = header.vocab;
        let mut starts = vec![0u64];
        for s in &shards {
            let n = if s.tokens as usize >= ctx + 2 {
                (s.tokens - 1) / ctx as u64
            } else {
                0
            };
            starts.push(starts.last().unwrap() + n);
        }
        anyhow::ensure!(
            *starts.last().unwrap() > 0,
            "dataset {url}: {} tokens, no shard holds one sample of ctx = {ctx} ({} tokens)",
            header.tokens,
            ctx + 2
        );
        let inner = Arc::new(Inner {
            url: url.to_string(),
            store,
            rt: rt.clone(),
            header,
            ctx,
            shards,
            starts,
            cache: Mutex::new(Cache {
                held: HashMap::new(),
                order: VecDeque::new(),
                budget: budget_bytes() / 4,
                tokens: 0,
            }),
            vocab: header_vocab.into(),
            waited: 0.into(),
        });
        // the read-ahead thread: fetches what the trainer says it will want next
        let (tx, rx) = std::sync::mpsc::channel::<Vec<u64>>();
        let reader = inner.clone();
        std::thread::Builder::new()
            .name("data-ahead".into())
            .spawn(move || {
                while let Ok(mut want) = rx.recv() {
                    // every wish queued meanwhile, in one read
                    while let Ok(more) = rx.try_recv() {
                        want.extend(more);
                    }
                    let missing = reader.missing(&want);
                    if missing.is_empty() {
                        continue;
                    }
                    match reader.fetch(&missing) {
                        Ok(got) => {
                            let mut c = reader.cache.lock().unwrap();
                            for (k, v) in got {
                                c.insert(k, v);
                            }
                        }
                        // the step that wants these reads them again and fails there, if
                        // it must: the read-ahead only warns
                        Err(e) => tracing::warn!("read-ahead: {e:#}"),
                    }
                }
            })?;
        Ok(Some(Stream {
            inner,
            ahead: Some(tx),
        }))
    }

    pub fn header(&self) -> &TokenHeader {
        &self.inner.header
    }

    pub fn len(&self) -> u64 {
        *self.inner.starts.last().unwrap()
    }

    /// Refuse ids at or past `vocab` too (a model's vocabulary smaller than its tokenizer's).
    pub fn limit_vocab(&self, vocab: u64) {
        self.inner
            .vocab
            .fetch_min(vocab, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn shards(&self) -> usize {
        self.inner.shards.len()
    }

    /// The time batches waited for reads since the last call.
    pub fn take_waited(&self) -> Duration {
        Duration::from_nanos(
            self.inner
                .waited
                .swap(0, std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Fetch these samples in the background (the next steps' share of this rank).
    pub fn prefetch(&self, samples: Vec<u64>) {
        if let Some(tx) = &self.ahead {
            let _ = tx.send(samples);
        }
    }

    /// The tokens of these samples, `ctx + 1` each, in order: from what the read-ahead holds,
    /// the rest read now.
    pub fn samples(&self, idx: &[u64]) -> anyhow::Result<Vec<Arc<[u32]>>> {
        // what the read-ahead holds is taken (its handles) together with what it lacks: the
        // samples read next may evict held ones (the read-ahead's thread, or this step's own
        // samples when one step's tokens exceed the budget), and a sample counted as held must
        // not be lost in between
        let (held, missing) = self.inner.split(idx);
        let mut got: HashMap<u64, Arc<[u32]>> = if missing.is_empty() {
            HashMap::new()
        } else {
            let t0 = std::time::Instant::now();
            let got = self.inner.fetch(&missing)?.into_iter().collect();
            self.inner.waited.fetch_add(
                t0.elapsed().as_nanos() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
            got
        };
        {
            let mut c = self.inner.cache.lock().unwrap();
            for (k, v) in &got {
                c.insert(*k, v.clone());
            }
        }
        got.extend(held);
        idx.iter()
            .map(|k| {
                got.get(k).cloned().ok_or_else(|| {
                    anyhow::anyhow!("dataset {}: sample {k} was not read", self.inner.url)
                })
            })
            .collect()
    }
}

impl Inner {
    fn missing(&self, want: &[u64]) -> Vec<u64> {
        self.split(want).1
    }

    /// Of `want`, the samples held now (their handles) and the ones to read (sorted, once).
    fn split(&self, want: &[u64]) -> (HashMap<u64, Arc<[u32]>>, Vec<u64>) {
        let c = self.cache.lock().unwrap();
        let mut held = HashMap::new();
        let mut m = Vec::new();
        for k in want {
            match c.held.get(k) {
                Some(v) => {
                    held.insert(*k, v.clone());
                }
                None => m.push(*k),
            }
        }
        m.sort_unstable();
        m.dedup();
        (held, m)
    }

    /// (shard, sample within it) of global sample k.
    fn locate(&self, k: u64) -> (usize, u64) {
        let s = self.starts.partition_point(|&st| st <= k) - 1;
        (s, k - self.starts[s])
    }

    /// The byte offset of shard s's first token: its header read and checked on first use.
    async fn body(&self, s: usize) -> anyhow::Result<u64> {
        let shard = &self.shards[s];
        if let Some(b) = *shard.body.lock().unwrap() {
            return Ok(b);
        }
        let what = format!("dataset {}: shard {}", self.url, shard.name);
        let first = retried(&what, || {
            let (st, p) = (self.store.clone(), shard.path.clone());
            let end = shard.bytes.min(HEADER_READ);
            async move { st.get_range(&p, 0..end).await }
        })
        .await?;
        let Some((h, body)) = TokenHeader::parse(&what, &first)? else {
            anyhow::bail!(
                "{what}: not a token stream from `ductile-worker tokenize` (no DUCTOK01 header)"
            );
        };
        let want = &self.header;
        anyhow::ensure!(
            h.width == want.width && h.tokenizer_sha256 == want.tokenizer_sha256,
            "{what}: made with a tokenizer of SHA-256 {} and width {}, the index says {} and {}",
            h.tokenizer_sha256,
            h.width,
            want.tokenizer_sha256,
            want.width
        );
        anyhow::ensure!(
            h.tokens == shard.tokens
                && h.tokens
                    .checked_mul(h.width as u64)
                    .and_then(|b| b.checked_add(body))
                    == Some(shard.bytes),
            "{what}: its header says {} tokens in {} bytes, the index {} tokens in {} bytes",
            h.tokens,
            body.saturating_add(h.tokens.saturating_mul(h.width as u64)),
            shard.tokens,
            shard.bytes
        );
        if let Some(sha) = &shard.sha256 {
            anyhow::ensure!(
                h.sha256.as_deref() == Some(sha.as_str()),
                "{what}: checksum mismatch: its tokens' SHA-256 is {}, the index says {sha} (a shard from another run of tokenize?)",
                h.sha256.as_deref().unwrap_or("not recorded")
            );
        }
        *shard.body.lock().unwrap() = Some(body);
        Ok(body)
    }

    /// Read these samples (sorted, distinct), every shard's ranges concurrently.
    fn fetch(&self, idx: &[u64]) -> anyhow::Result<Vec<(u64, Arc<[u32]>)>> {
        let mut by_shard: std::collections::BTreeMap<usize, Vec<(u64, u64)>> = Default::default();
        for &k in idx {
            anyhow::ensure!(
                k < *self.starts.last().unwrap(),
                "dataset {}: sample {k} past its {} samples",
                self.url,
                self.starts.last().unwrap()
            );
            let (s, local) = self.locate(k);
            by_shard.entry(s).or_default().push((k, local));
        }
        let w = self.header.width as u64;
        let ctx = self.ctx as u64;
        let vocab = self.vocab.load(std::sync::atomic::Ordering::Relaxed);
        self.rt.block_on(async {
            use futures_util::stream::{StreamExt, TryStreamExt};
            futures_util::stream::iter(by_shard.into_iter().map(|(s, ks)| async move {
                let body = self.body(s).await?;
                let shard = &self.shards[s];
                let ranges: Vec<std::ops::Range<u64>> = ks
                    .iter()
                    .map(|(_, l)| {
                        let a = body + l * ctx * w;
                        a..a + (ctx + 1) * w
                    })
                    .collect();
                let what = format!("dataset {}: shard {}", self.url, shard.name);
                let got = retried(&what, || {
                    let (st, p, r) = (self.store.clone(), shard.path.clone(), ranges.clone());
                    async move { read_ranges(&st, &p, &r, coalesce_bytes()).await }
                })
                .await?;
                let mut out = Vec::with_capacity(ks.len());
                for ((k, l), bytes) in ks.into_iter().zip(got) {
                    anyhow::ensure!(
                        bytes.len() as u64 == (ctx + 1) * w,
                        "{what}: {} bytes read at token {}, asked for {}",
                        bytes.len(),
                        l * ctx,
                        (ctx + 1) * w
                    );
                    let toks: Vec<u32> = if w == 2 {
                        bytes
                            .chunks_exact(2)
                            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
                            .collect()
                    } else {
                        bytes
                            .chunks_exact(4)
                            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                            .collect()
                    };
                    if let Some(i) = toks.iter().position(|t| *t as u64 >= vocab) {
                        anyhow::bail!(
                            "{what}: token {} at offset {} (token {} of the shard) is outside the vocabulary of {vocab}",
                            toks[i],
                            body + (l * ctx + i as u64) * w,
                            l * ctx + i as u64
                        );
                    }
                    out.push((k, Arc::<[u32]>::from(toks)));
                }
                anyhow::Ok(out)
            }))
            .buffer_unordered(SHARDS_AT_ONCE)
            .try_collect::<Vec<_>>()
            .await
        })
        .map(|v| v.into_iter().flatten().collect())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // ends the read-ahead thread once it finishes what it is fetching
        self.ahead.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenize::Sink;

    fn dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("ductile-stream-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn header(vocab: u64) -> TokenHeader {
        TokenHeader {
            width: 2,
            vocab,
            tokenizer_sha256: "t".into(),
            eos: None,
            documents: 0,
            tokens: 0,
            sha256: None,
        }
    }

    /// `tokens` written as shards of `per` under `d` (or one stream at `d/one.tok`).
    fn write(d: &std::path::Path, tokens: &[u32], per: u64, sharded: bool) -> String {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let out = if sharded {
            format!("file://{}/", d.display())
        } else {
            format!("file://{}/one.tok", d.display())
        };
        let mut s = Sink::new(&out, header(300), per).unwrap();
        s.add(&rt, tokens.to_vec(), vec![]).unwrap();
        s.finish(&rt).unwrap();
        out
    }

    fn tokens(n: u32) -> Vec<u32> {
        (0..n).map(|i| (i * 7 + i / 13) % 300).collect()
    }

    /// Samples span the shards in index order, each shard contributing its own windows: what
    /// is read by range is the shard's tokens at the sample's place, and a single stream reads
    /// the same way.
    #[test]
    fn shards_read_by_range_give_each_samples_tokens() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let all = tokens(10_000);
        let d = dir("read");
        let url = write(&d, &all, 1000, true);
        let ctx = 16usize;
        let s = Stream::open(&url, ctx, rt.handle()).unwrap().unwrap();
        assert_eq!(s.shards(), 10);
        // (1000 - 1) / 16 = 62 samples in each shard
        assert_eq!(s.len(), 620);
        s.prefetch(vec![5, 70, 619]);
        let got = s.samples(&[0, 62, 63, 619, 5]).unwrap();
        let want = |shard: usize, k: usize| {
            let a = shard * 1000 + k * ctx;
            all[a..a + ctx + 1].to_vec()
        };
        assert_eq!(got[0].to_vec(), want(0, 0));
        assert_eq!(got[1].to_vec(), want(1, 0));
        assert_eq!(got[2].to_vec(), want(1, 1));
        assert_eq!(got[3].to_vec(), want(9, 61));
        assert_eq!(got[4].to_vec(), want(0, 5));
        let one = write(&d, &all, 1000, false);
        let s1 = Stream::open(&one, ctx, rt.handle()).unwrap().unwrap();
        assert_eq!(s1.len(), (10_000 - 1) / ctx as u64);
        assert_eq!(
            s1.samples(&[100]).unwrap()[0].to_vec(),
            all[1600..1617].to_vec()
        );
    }

    /// What the index promises is checked: a missing shard and a short one at open, a shard
    /// from another run (its checksum) and an id past the vocabulary when read, each error
    /// naming the shard (and the offset); a shard name that leaves the prefix is refused.
    #[test]
    fn a_broken_shard_fails_naming_it() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let all = tokens(4000);
        let open = |url: &str| Stream::open(url, 8, rt.handle()).map(|s| s.unwrap());
        let d = dir("missing");
        let url = write(&d, &all, 1000, true);
        std::fs::remove_file(d.join("shard-00002.tok")).unwrap();
        let e = open(&url).err().unwrap().to_string();
        assert!(
            e.contains("shard shard-00002.tok") && e.contains("not found"),
            "{e}"
        );

        let d = dir("short");
        let url = write(&d, &all, 1000, true);
        let f = d.join("shard-00001.tok");
        let len = std::fs::metadata(&f).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .unwrap()
            .set_len(len - 10)
            .unwrap();
        let e = open(&url).err().unwrap().to_string();
        assert!(
            e.contains("shard shard-00001.tok") && e.contains("cut short"),
            "{e}"
        );

        // shard 3 replaced by one of the same size from other tokens
        let d = dir("swapped");
        let url = write(&d, &all, 1000, true);
        let other = dir("other");
        let mut changed = all.clone();
        changed[3500] = (changed[3500] + 1) % 300;
        write(&other, &changed, 1000, true);
        std::fs::copy(other.join("shard-00003.tok"), d.join("shard-00003.tok")).unwrap();
        let s = open(&url).unwrap();
        assert!(s.samples(&[0, 130]).is_ok());
        let e = format!("{:#}", s.samples(&[3 * 124 + 1]).unwrap_err());
        assert!(
            e.contains("shard shard-00003.tok") && e.contains("checksum mismatch"),
            "{e}"
        );

        let d = dir("vocab");
        let mut past = all.clone();
        past[2000 + 8 * 3 + 2] = 300;
        let url = write(&d, &past, 1000, true);
        let s = open(&url).unwrap();
        let e = format!("{:#}", s.samples(&[2 * 124 + 3]).unwrap_err());
        assert!(
            e.contains("shard shard-00002.tok: token 300 at offset")
                && e.contains("(token 26 of the shard) is outside the vocabulary of 300"),
            "{e}"
        );
        // the model's vocabulary, when smaller than the tokenizer's, is the bound
        let d = dir("model-vocab");
        let url = write(&d, &all, 1000, true);
        let s = open(&url).unwrap();
        s.limit_vocab(10);
        let e = format!("{:#}", s.samples(&[0]).unwrap_err());
        assert!(e.contains("outside the vocabulary of 10"), "{e}");

        let d = dir("escape");
        let url = write(&d, &all, 1000, true);
        let index = d.join(INDEX_NAME);
        let text = std::fs::read_to_string(&index).unwrap();
        std::fs::write(&index, text.replace("shard-00000.tok", "..")).unwrap();
        let e = open(&url).err().unwrap().to_string();
        assert!(
            e.contains("is not a plain file name under the prefix"),
            "{e}"
        );
    }

    /// A step whose samples' tokens exceed the read-ahead's budget still gets every sample:
    /// the held ones it counted on are not lost to the eviction its own reads cause.
    #[test]
    fn a_step_larger_than_the_budget_gets_every_sample() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let all = tokens(10_000);
        let d = dir("over-budget");
        let url = write(&d, &all, 1000, true);
        let ctx = 16usize;
        let s = Stream::open(&url, ctx, rt.handle()).unwrap().unwrap();
        // a budget of 5 samples' tokens; 3 of them held, then a step of 12 (9 read now)
        s.inner.cache.lock().unwrap().budget = 5 * (ctx + 1);
        assert!(s.samples(&[0, 1, 2]).is_ok());
        let idx: Vec<u64> = (0..12).collect();
        let got = s.samples(&idx).unwrap();
        for (k, v) in idx.iter().zip(&got) {
            let a = *k as usize * ctx;
            assert_eq!(v.to_vec(), all[a..a + ctx + 1].to_vec(), "sample {k}");
        }
        assert!(s.inner.cache.lock().unwrap().tokens <= 5 * (ctx + 1));
    }

    /// The samples held stay within the byte budget, however many are read.
    #[test]
    fn the_read_ahead_holds_at_most_its_budget() {
        let mut c = Cache {
            held: HashMap::new(),
            order: VecDeque::new(),
            budget: 1000,
            tokens: 0,
        };
        for k in 0..500u64 {
            c.insert(k, Arc::from(vec![0u32; 17]));
            assert!(c.tokens <= 1000);
        }
        assert_eq!(c.held.len(), 1000 / 17);
        assert!(c.held.contains_key(&499) && !c.held.contains_key(&0));
    }
}

/// Bounded fuzzing (proptest, in CI) of a prefix's index: random edits of a valid
/// `index.json` open as a dataset or fail with a message naming it, and every sample of one
/// that opens reads or fails with a message: a hostile index never panics a worker or reads
/// outside its shards.
#[cfg(test)]
mod fuzz {
    use super::tests_support::*;
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        #[test]
        fn edited_indexes_open_or_fail_cleanly(
            e in prop::collection::vec((0usize..2000, any::<u8>(), any::<u8>()), 1..6),
        ) {
            let (d, url, index) = seeded();
            let edited = ductile_cluster::fuzz::mutate(&index, &e);
            std::fs::write(d.join(INDEX_NAME), &edited).unwrap();
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            if let Ok(Some(s)) = Stream::open(&url, 8, rt.handle()) {
                for k in 0..s.len().min(64) {
                    if let Ok(got) = s.samples(&[k]) {
                        prop_assert_eq!(got[0].len(), 9);
                    }
                }
            }
            std::fs::write(d.join(INDEX_NAME), &index).unwrap();
        }
    }
}

#[cfg(test)]
mod tests_support {
    use super::*;

    /// A prefix of three shards under a directory of this process (made once): its
    /// directory, URL and index bytes.
    pub fn seeded() -> (std::path::PathBuf, String, Vec<u8>) {
        static MADE: std::sync::OnceLock<(std::path::PathBuf, String, Vec<u8>)> =
            std::sync::OnceLock::new();
        MADE.get_or_init(|| {
            let d =
                std::env::temp_dir().join(format!("ductile-stream-fuzz-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            let rt = tokio::runtime::Runtime::new().unwrap();
            let url = format!("file://{}/", d.display());
            let header = TokenHeader {
                width: 2,
                vocab: 300,
                tokenizer_sha256: "t".into(),
                eos: None,
                documents: 0,
                tokens: 0,
                sha256: None,
            };
            let mut s = crate::tokenize::Sink::new(&url, header, 100).unwrap();
            s.add(&rt, (0..300u32).collect(), vec![]).unwrap();
            s.finish(&rt).unwrap();
            let index = std::fs::read(d.join(INDEX_NAME)).unwrap();
            (d, url, index)
        })
        .clone()
    }
}

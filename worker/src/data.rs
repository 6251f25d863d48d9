//! Datasets addressed by URL, and the exactly-once order of samples.
//!
//! A token dataset is a token stream ([`TokenHeader`]: what `ductile-worker tokenize` writes,
//! u16 or u32 tokens after a header naming the tokenizer), or a bare stream of little-endian u16
//! tokens (the built-in GPT's); sample k is the window
//! `tokens[k·ctx .. k·ctx + ctx + 1]` (inputs and next-token targets). A regression dataset is a
//! safetensors file with tensors `x` [N, d_in] and `y` [N, d_out]. Global position p of the
//! training run is sample `perm(epoch)[p mod N]` with `epoch = p / N`, a seeded permutation per
//! epoch: step s consumes positions [s·B, (s+1)·B), so each sample is used once per epoch by
//! the committed steps, whatever the world size.

use ductile_cluster::records::ModelKind;
use tch::{Kind, Tensor};

pub mod stream;
pub use stream::{ShardEntry, ShardIndex, Stream};

/// The magic bytes that open a token stream with a header.
pub const TOKENS_MAGIC: &[u8; 8] = b"DUCTOK01";

/// What a token stream says of itself: `DUCTOK01`, the header's length (u32 LE), the header as
/// JSON, then the tokens, little-endian, `width` bytes each.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenHeader {
    /// Bytes per token: 2 (u16) or 4 (u32, a vocabulary over 65,536).
    pub width: u8,
    /// The tokenizer's vocabulary size (special tokens included).
    pub vocab: u64,
    /// SHA-256 of the `tokenizer.json` that made the stream, hex.
    pub tokenizer_sha256: String,
    /// The token appended after each document, if the tokenizer has one.
    #[serde(default)]
    pub eos: Option<u32>,
    pub documents: u64,
    pub tokens: u64,
    /// SHA-256 of the token bytes that follow, hex (a shard's index says the same).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

impl TokenHeader {
    /// The stream's bytes: magic, header, tokens.
    pub fn encode(&self, tokens: &[u32]) -> Vec<u8> {
        let json = serde_json::to_vec(self).expect("a header serialises");
        let mut out = Vec::with_capacity(12 + json.len() + tokens.len() * self.width as usize);
        out.extend_from_slice(TOKENS_MAGIC);
        out.extend_from_slice(&(json.len() as u32).to_le_bytes());
        out.extend_from_slice(&json);
        for t in tokens {
            if self.width == 2 {
                out.extend_from_slice(&(*t as u16).to_le_bytes());
            } else {
                out.extend_from_slice(&t.to_le_bytes());
            }
        }
        out
    }

    /// A stream's header from its first bytes (`what` names the stream in errors), and the
    /// byte offset of its first token; `None`: no magic, not a stream with a header.
    pub fn parse(what: &str, first: &[u8]) -> anyhow::Result<Option<(TokenHeader, u64)>> {
        let Some(rest) = first.strip_prefix(TOKENS_MAGIC.as_slice()) else {
            return Ok(None);
        };
        anyhow::ensure!(
            rest.len() >= 4,
            "{what}: a token stream cut inside its header"
        );
        let n = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
        anyhow::ensure!(
            rest.len() >= 4 + n,
            "{what}: a header of {n} bytes, longer than the {} bytes read",
            rest.len() - 4
        );
        let h: TokenHeader = serde_json::from_slice(&rest[4..4 + n])
            .map_err(|e| anyhow::anyhow!("{what}: unreadable token stream header: {e}"))?;
        anyhow::ensure!(
            h.width == 2 || h.width == 4,
            "{what}: token width {} (2 or 4)",
            h.width
        );
        Ok(Some((h, (12 + n) as u64)))
    }

    /// A stream's header and tokens; `None` for a bare u16 stream (no magic).
    pub fn decode(url: &str, bytes: &[u8]) -> anyhow::Result<Option<(TokenHeader, Vec<u32>)>> {
        let Some((h, at)) = TokenHeader::parse(&format!("dataset {url}"), bytes)? else {
            return Ok(None);
        };
        let body = &bytes[at as usize..];
        let w = h.width as usize;
        anyhow::ensure!(
            body.len().is_multiple_of(w),
            "dataset {url}: {} bytes of tokens of width {w}",
            body.len()
        );
        anyhow::ensure!(
            body.len() / w == h.tokens as usize,
            "dataset {url}: {} tokens, the header says {} (a cut or padded stream)",
            body.len() / w,
            h.tokens
        );
        let tokens = if w == 2 {
            body.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
                .collect()
        } else {
            body.chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        Ok(Some((h, tokens)))
    }
}

pub enum Dataset {
    Tokens {
        tokens: Vec<u32>,
        ctx: usize,
        vocab: usize,
        /// The stream's header, if it has one.
        header: Option<TokenHeader>,
    },
    /// A stream read by range, samples fetched as they are wanted (see [`stream`]).
    Stream {
        stream: Stream,
        ctx: usize,
    },
    Regression {
        x: Tensor,
        y: Tensor,
    },
}

/// The tensors of a safetensors file (f32 only), parsed from its bytes by the `safetensors`
/// crate (offsets, sizes and header checked there).
pub fn parse_safetensors(bytes: &[u8]) -> anyhow::Result<Vec<(String, Tensor)>> {
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| anyhow::anyhow!("not a safetensors file: {e:?}"))?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        anyhow::ensure!(
            view.dtype() == safetensors::Dtype::F32,
            "tensor {name}: dtype {:?} (only F32 datasets)",
            view.dtype()
        );
        let shape: Vec<i64> = view.shape().iter().map(|d| *d as i64).collect();
        out.push((
            name,
            Tensor::from_data_size(view.data(), &shape, Kind::Float),
        ));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

impl Dataset {
    /// Read a dataset by URL (file:// or s3://, through object_store with ranged reads).
    pub fn open(
        url: &str,
        model: ModelKind,
        ctx: usize,
        rt: &tokio::runtime::Handle,
    ) -> anyhow::Result<Dataset> {
        if matches!(model, ModelKind::Gpt | ModelKind::Hf) {
            if let Some(stream) = Stream::open(url, ctx, rt)? {
                return Ok(Dataset::Stream { stream, ctx });
            }
            anyhow::ensure!(
                !url.ends_with('/'),
                "dataset {url}: a prefix without an index"
            );
        }
        // a bare u16 stream (no header to say its vocabulary: read whole, the quickstart's
        // small format) or a safetensors regression dataset
        let bytes = rt
            .block_on(ductile_checkpoint::store::read_ranged(url, 8 << 20))
            .map_err(|e| anyhow::anyhow!("dataset: {e}"))?;
        Self::from_bytes(url, &bytes, model, ctx)
    }

    pub fn from_bytes(
        url: &str,
        bytes: &[u8],
        model: ModelKind,
        ctx: usize,
    ) -> anyhow::Result<Dataset> {
        match model {
            ModelKind::Gpt | ModelKind::Hf => {
                let (header, tokens) = match TokenHeader::decode(url, bytes)? {
                    Some((h, t)) => (Some(h), t),
                    None => {
                        anyhow::ensure!(
                            bytes.len().is_multiple_of(2),
                            "dataset {url}: not a u16 token stream (an odd number of bytes) nor a stream from `ductile-worker tokenize`"
                        );
                        let t = bytes
                            .chunks_exact(2)
                            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
                            .collect();
                        (None, t)
                    }
                };
                anyhow::ensure!(
                    tokens.len() >= ctx + 2,
                    "dataset {url}: {} tokens, fewer than one sample of ctx = {ctx} needs ({})",
                    tokens.len(),
                    ctx + 2
                );
                let vocab = *tokens.iter().max().unwrap() as usize + 1;
                Ok(Dataset::Tokens {
                    tokens,
                    ctx,
                    vocab,
                    header,
                })
            }
            _ => {
                let named =
                    parse_safetensors(bytes).map_err(|e| anyhow::anyhow!("dataset {url}: {e}"))?;
                let get = |n: &str| {
                    named
                        .iter()
                        .find(|(k, _)| k == n)
                        .map(|(_, t)| t.shallow_clone())
                        .ok_or_else(|| anyhow::anyhow!("dataset {url}: no tensor {n:?}"))
                };
                let (x, y) = (get("x")?, get("y")?);
                anyhow::ensure!(
                    x.dim() == 2 && y.dim() == 2,
                    "dataset {url}: x and y must be 2-D ([samples, features]), not {:?} and {:?}",
                    x.size(),
                    y.size()
                );
                anyhow::ensure!(
                    x.size()[0] == y.size()[0],
                    "dataset {url}: x and y differ in length"
                );
                anyhow::ensure!(x.size()[0] > 0, "dataset {url}: no samples");
                Ok(Dataset::Regression { x, y })
            }
        }
    }

    /// A token dataset's vocabulary (a stream's header's; a bare stream's largest id + 1) and
    /// context length.
    pub fn token_shape(&self) -> Option<(usize, usize)> {
        match self {
            Dataset::Tokens { vocab, ctx, .. } => Some((*vocab, *ctx)),
            Dataset::Stream { stream, ctx } => Some((stream.header().vocab as usize, *ctx)),
            Dataset::Regression { .. } => None,
        }
    }

    /// The header of a token stream, if it has one.
    pub fn header(&self) -> Option<&TokenHeader> {
        match self {
            Dataset::Tokens { header, .. } => header.as_ref(),
            Dataset::Stream { stream, .. } => Some(stream.header()),
            Dataset::Regression { .. } => None,
        }
    }

    /// The time batches waited for a stream's reads since the last call (zero for data held
    /// in memory).
    pub fn take_waited(&self) -> std::time::Duration {
        match self {
            Dataset::Stream { stream, .. } => stream.take_waited(),
            _ => std::time::Duration::ZERO,
        }
    }

    /// Fetch these samples in the background: what this rank will want in the next steps
    /// (a no-op for data held in memory).
    pub fn prefetch(&self, samples: Vec<u64>) {
        if let Dataset::Stream { stream, .. } = self {
            stream.prefetch(samples)
        }
    }

    pub fn len(&self) -> u64 {
        match self {
            Dataset::Tokens { tokens, ctx, .. } => ((tokens.len() - 1) / ctx) as u64,
            Dataset::Stream { stream, .. } => stream.len(),
            Dataset::Regression { x, .. } => x.size()[0] as u64,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The batch of these sample indices: (inputs, targets). A stream's read that fails after
    /// its retries, or a token past the vocabulary, ends the worker with the error (naming the
    /// shard and offset): a step never trains on less than its samples.
    pub fn batch(&self, idx: &[u64]) -> (Tensor, Tensor) {
        match self.try_batch(idx) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("ductile-worker: {e:#}");
                tracing::error!("{e:#}");
                std::process::exit(1);
            }
        }
    }

    /// [`Dataset::batch`], its read errors returned.
    pub fn try_batch(&self, idx: &[u64]) -> anyhow::Result<(Tensor, Tensor)> {
        Ok(match self {
            Dataset::Stream { stream, ctx } => {
                let got = stream.samples(idx)?;
                let mut x = Vec::with_capacity(idx.len() * ctx);
                let mut y = Vec::with_capacity(idx.len() * ctx);
                for s in &got {
                    x.extend(s[..*ctx].iter().map(|t| *t as i64));
                    y.extend(s[1..].iter().map(|t| *t as i64));
                }
                let n = idx.len() as i64;
                (
                    Tensor::from_slice(&x).view([n, *ctx as i64]),
                    Tensor::from_slice(&y).view([n, *ctx as i64]),
                )
            }
            Dataset::Tokens { tokens, ctx, .. } => {
                let mut x = Vec::with_capacity(idx.len() * ctx);
                let mut y = Vec::with_capacity(idx.len() * ctx);
                for &k in idx {
                    let a = k as usize * ctx;
                    x.extend(tokens[a..a + ctx].iter().map(|t| *t as i64));
                    y.extend(tokens[a + 1..a + ctx + 1].iter().map(|t| *t as i64));
                }
                let n = idx.len() as i64;
                (
                    Tensor::from_slice(&x).view([n, *ctx as i64]),
                    Tensor::from_slice(&y).view([n, *ctx as i64]),
                )
            }
            Dataset::Regression { x, y } => {
                let i = Tensor::from_slice(&idx.iter().map(|v| *v as i64).collect::<Vec<_>>());
                (x.index_select(0, &i), y.index_select(0, &i))
            }
        })
    }
}

/// splitmix64: a small, fixed, seedable generator (the order must never change between builds).
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seeded permutation of `n` samples for `epoch` (Fisher–Yates).
pub fn permutation(n: u64, seed: u64, epoch: u64) -> Vec<u64> {
    let mut p: Vec<u64> = (0..n).collect();
    let mut state = mix(seed ^ mix(epoch.wrapping_add(0x5eed)));
    for i in (1..n as usize).rev() {
        state = mix(state);
        let j = (state % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

/// Above this many samples an epoch's order is computed, not stored: a seeded Feistel
/// permutation of the sample indices (cycle-walked into `[0, n)`), O(1) memory whatever the
/// dataset's size. At or below it, the stored Fisher–Yates permutation (the order of every run
/// so far, kept so their checkpoints resume in the same order).
pub const STORED_ORDER_MAX: u64 = 1 << 22;

/// The Feistel permutation of `[0, n)` for `epoch`: position → sample.
pub fn feistel(n: u64, seed: u64, epoch: u64, position: u64) -> u64 {
    debug_assert!(position < n);
    // an even number of bits covering n: two halves of `half` bits
    let bits = (64 - (n - 1).leading_zeros()).max(2);
    let half = bits.div_ceil(2);
    let mask = (1u64 << half) - 1;
    let key = mix(seed ^ mix(epoch.wrapping_add(0x0fe1_57e1)));
    let mut x = position;
    loop {
        let (mut l, mut r) = (x >> half, x & mask);
        for round in 0..4u64 {
            let f = mix(key ^ mix(r ^ (round << 56))) & mask;
            (l, r) = (r, l ^ f);
        }
        x = (l << half) | r;
        // the domain is under 4n: a walk ends after a few steps on average
        if x < n {
            return x;
        }
    }
}

/// Maps global positions to sample indices, caching the stored permutations of the current
/// and the next epoch (a read-ahead crosses epochs).
pub struct Order {
    n: u64,
    seed: u64,
    cached: Vec<(u64, Vec<u64>)>,
}

impl Order {
    pub fn new(n: u64, seed: u64) -> Self {
        Order {
            n,
            seed,
            cached: Vec::new(),
        }
    }
    pub fn sample(&mut self, position: u64) -> u64 {
        let epoch = position / self.n;
        if self.n > STORED_ORDER_MAX {
            return feistel(self.n, self.seed, epoch, position % self.n);
        }
        let i = match self.cached.iter().position(|c| c.0 == epoch) {
            Some(i) => i,
            None => {
                if self.cached.len() == 2 {
                    // keep the later epoch: positions only move forward
                    let older = if self.cached[0].0 < self.cached[1].0 {
                        0
                    } else {
                        1
                    };
                    self.cached.remove(older);
                }
                self.cached
                    .push((epoch, permutation(self.n, self.seed, epoch)));
                self.cached.len() - 1
            }
        };
        self.cached[i].1[(position % self.n) as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_epoch_is_a_permutation_and_epochs_differ() {
        let a = permutation(1000, 7, 0);
        let mut s = a.clone();
        s.sort();
        assert_eq!(s, (0..1000).collect::<Vec<_>>());
        assert_ne!(a, permutation(1000, 7, 1));
        assert_eq!(a, permutation(1000, 7, 0), "seeded");
        let mut o = Order::new(10, 3);
        let first: Vec<u64> = (0..10).map(|p| o.sample(p)).collect();
        assert_eq!(first, permutation(10, 3, 0));
        // two epochs interleaved (a read-ahead across the boundary) keep their orders
        let mixed: Vec<u64> = (0..10)
            .flat_map(|p| [o.sample(p), o.sample(10 + p)])
            .collect();
        let second = permutation(10, 3, 1);
        assert_eq!(
            mixed,
            (0..10)
                .flat_map(|p| [first[p], second[p]])
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn the_computed_order_is_a_seeded_permutation_of_every_size() {
        for n in [1u64, 2, 3, 5, 64, 1000, 4097] {
            let mut seen: Vec<u64> = (0..n).map(|p| feistel(n, 9, 0, p)).collect();
            let order = seen.clone();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n = {n}");
            let again: Vec<u64> = (0..n).map(|p| feistel(n, 9, 0, p)).collect();
            assert_eq!(order, again, "seeded");
            if n > 5 {
                let other: Vec<u64> = (0..n).map(|p| feistel(n, 9, 1, p)).collect();
                assert_ne!(order, other, "epochs differ");
                assert_ne!(order, (0..n).collect::<Vec<_>>(), "shuffled");
            }
        }
        // past the stored bound, Order computes it
        let n = STORED_ORDER_MAX + 3;
        let mut o = Order::new(n, 4);
        assert_eq!(o.sample(n + 7), feistel(n, 4, 1, 7));
    }
}

/// Bounded fuzzing (proptest, in CI) of the dataset readers: random edits of a valid
/// safetensors regression file, and random token streams, open as a dataset or fail with a
/// message naming it; a dataset that opens can be batched.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn file(header: &[u8]) -> Vec<u8> {
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend((0..16).flat_map(|i| (i as f32).to_le_bytes()));
        file
    }

    fn regression_file() -> Vec<u8> {
        file(br#"{"x":{"dtype":"F32","shape":[4,3],"data_offsets":[0,48]},"y":{"dtype":"F32","shape":[4,1],"data_offsets":[48,64]}}"#)
    }

    #[test]
    fn the_seed_file_opens_and_a_one_dimensional_x_is_refused() {
        let d = Dataset::from_bytes("seed", &regression_file(), ModelKind::Mlp, 4).unwrap();
        assert_eq!(d.len(), 4);
        let flat = file(br#"{"x":{"dtype":"F32","shape":[12],"data_offsets":[0,48]},"y":{"dtype":"F32","shape":[4,1],"data_offsets":[48,64]}}"#);
        let e = Dataset::from_bytes("flat", &flat, ModelKind::Mlp, 4)
            .err()
            .expect("a 1-D x is refused");
        assert!(e.to_string().contains("2-D"), "{e}");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

        #[test]
        fn edited_regression_files_open_or_fail_cleanly(
            e in prop::collection::vec((0usize..160, any::<u8>(), any::<u8>()), 1..8),
        ) {
            let f = ductile_cluster::fuzz::mutate(&regression_file(), &e);
            if let Ok(d) = Dataset::from_bytes("fuzz", &f, ModelKind::Mlp, 4) {
                prop_assert!(d.len() > 0);
                let (x, y) = d.batch(&[0, d.len() - 1]);
                prop_assert_eq!(x.size()[0], 2);
                prop_assert_eq!(y.size()[0], 2);
            }
        }

        #[test]
        fn random_token_streams_open_or_fail_cleanly(
            b in prop::collection::vec(any::<u8>(), 0..256),
            ctx in 1usize..16,
        ) {
            if let Ok(d) = Dataset::from_bytes("fuzz", &b, ModelKind::Gpt, ctx) {
                prop_assert!(d.len() > 0);
                let (x, _) = d.batch(&[d.len() - 1]);
                prop_assert_eq!(x.size(), vec![1, ctx as i64]);
            }
        }
    }
}

//! The on-store format: safetensors shards, the JSON manifest, the commit record, CRC32C.
//!
//! One checkpoint attempt is a directory `step-{step:012}/g{generation}/` under the job's URL:
//!
//! ```text
//! shard-00000-of-00004.safetensors   one per writing rank; a valid safetensors file whose keys
//!                                     are full tensor names; __metadata__ holds, per key, the
//!                                     global shape and this chunk's offsets (JSON strings)
//! manifest.json                      per tensor: dtype, global shape, kind, chunks (object,
//!                                     absolute byte range, offsets, shape, CRC32C); extra state
//! COMMIT                             the commit record (JSON), written after the etcd commit
//! SUPERSEDED                         replaces COMMIT when a job resumed from an earlier chosen
//!                                     step (`restore_step`): the record, why and when; its data
//!                                     is kept but never restored automatically
//! uploads/{rank}.json                an in-flight multipart upload id (deleted on completion)
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const FORMAT: &str = "ductile-checkpoint/1";
pub const MANIFEST: &str = "manifest.json";
pub const COMMIT: &str = "COMMIT";
pub const SUPERSEDED: &str = "SUPERSEDED";

/// Element types, by their safetensors names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Dtype {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    U8,
}

impl Dtype {
    pub fn size(self) -> u64 {
        match self {
            Dtype::F64 | Dtype::I64 => 8,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U8 => 1,
        }
    }
}

/// What a tensor is, for readers of the manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    Parameter,
    OptimizerState,
    Buffer,
}

/// A tensor of the state being saved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub kind: TensorKind,
}

impl TensorMeta {
    /// Bytes of one slice along dimension 0 (the whole tensor for a scalar).
    pub fn row_bytes(&self) -> u64 {
        self.dtype.size() * self.shape.iter().skip(1).product::<u64>()
    }
    pub fn rows(&self) -> u64 {
        self.shape.first().copied().unwrap_or(1)
    }
    pub fn bytes(&self) -> u64 {
        self.row_bytes() * self.rows()
    }
}

/// One piece of a tensor in a shard: rows [row, row + rows) of dimension 0.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkEntry {
    /// The shard's key, relative to the attempt directory.
    pub object: String,
    /// The chunk's key in that shard's safetensors header (empty in manifests from before it
    /// was recorded: the tensor's name).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub key: String,
    /// Absolute byte range of the data in the object.
    pub byte_range: [u64; 2],
    /// Where the chunk starts in the global tensor, per dimension.
    pub offsets: Vec<u64>,
    pub shape: Vec<u64>,
    pub crc32c: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub kind: TensorKind,
    pub chunks: Vec<ChunkEntry>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectEntry {
    pub object: String,
    pub size: u64,
}

/// The manifest of one checkpoint attempt (plain JSON).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub job: String,
    pub step: u64,
    pub generation: u64,
    pub created_at_ms: u64,
    pub world_size: u32,
    pub layout: ductile_cluster::records::Layout,
    /// Tensor names in save order (the JSON map below is sorted by name).
    pub order: Vec<String>,
    pub tensors: std::collections::BTreeMap<String, TensorEntry>,
    pub objects: Vec<ObjectEntry>,
    /// What resumes the run exactly: step, data cursor, RNG, optimizer hyper-parameters.
    pub extra: serde_json::Value,
}

impl Manifest {
    pub fn bytes(&self) -> u64 {
        self.objects.iter().map(|o| o.size).sum()
    }
    /// Check what readers rely on, so that a corrupt or hostile manifest is an error naming
    /// the tensor and chunk, never a panic or a wild read: every name in `order` is a tensor,
    /// once, and every tensor is named; each chunk has one offset and one extent per dimension
    /// of its tensor and lies inside it; its byte range runs forward, inside an object the
    /// manifest lists, and holds exactly its elements' bytes (all in checked arithmetic).
    pub fn validate(&self) -> Result<(), String> {
        let mut seen = std::collections::BTreeSet::new();
        for n in &self.order {
            if !self.tensors.contains_key(n) {
                return Err(format!("order names {n:?}, which is not among the tensors"));
            }
            if !seen.insert(n) {
                return Err(format!("order names {n:?} twice"));
            }
        }
        if seen.len() != self.tensors.len() {
            return Err(format!(
                "{} tensors, {} of them in order",
                self.tensors.len(),
                seen.len()
            ));
        }
        let objects: std::collections::BTreeMap<&str, u64> = self
            .objects
            .iter()
            .map(|o| (o.object.as_str(), o.size))
            .collect();
        for (name, t) in &self.tensors {
            for (k, c) in t.chunks.iter().enumerate() {
                let bad = |why: String| Err(format!("tensor {name} chunk {k}: {why}"));
                if c.offsets.len() != t.shape.len() || c.shape.len() != t.shape.len() {
                    return bad(format!(
                        "offsets {:?} and shape {:?} for a tensor of shape {:?}",
                        c.offsets, c.shape, t.shape
                    ));
                }
                for ((o, n), d) in c.offsets.iter().zip(&c.shape).zip(&t.shape) {
                    if o.checked_add(*n).is_none_or(|end| end > *d) {
                        return bad(format!(
                            "offsets {:?} shape {:?} reach outside {:?}",
                            c.offsets, c.shape, t.shape
                        ));
                    }
                }
                let [a, b] = c.byte_range;
                let Some(size) = objects.get(c.object.as_str()) else {
                    return bad(format!("object {:?} is not listed", c.object));
                };
                if a > b || b > *size {
                    return bad(format!("byte range {a}..{b} in an object of {size} bytes"));
                }
                let want = c
                    .shape
                    .iter()
                    .try_fold(t.dtype.size(), |acc, n| acc.checked_mul(*n));
                if want != Some(b - a) {
                    return bad(format!(
                        "{} bytes for a chunk of shape {:?} of {:?}",
                        b - a,
                        c.shape,
                        t.dtype
                    ));
                }
            }
        }
        Ok(())
    }

    /// The tensors in save order.
    pub fn ordered(&self) -> impl Iterator<Item = (&String, &TensorEntry)> {
        self.order
            .iter()
            .filter_map(|n| self.tensors.get_key_value(n))
    }
}

/// CRC-32C (Castagnoli, "CRC-32/ISCSI"), as S3 and safetensors users compute it. crc-fast picks
/// the widest instructions present at run time (VPCLMULQDQ with AVX-512 where there is one:
/// about 23 GB/s on one core of this machine, against 14.6 for the crc32c crate's SSE4.2 path).
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(bytes)
}

/// Continue `crc` (a finished CRC-32C) over `bytes`.
pub fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    let mut d = crc_fast::Digest::new_with_init_state(
        crc_fast::CrcAlgorithm::Crc32Iscsi,
        (crc ^ 0xffff_ffff) as u64,
    );
    d.update(bytes);
    d.finalize() as u32
}

/// The attempt directory of (step, generation), relative to the job's URL.
pub fn attempt_dir(step: u64, generation: u64) -> String {
    format!("step-{step:012}/g{generation}")
}

/// The key of the `COMMIT` record of (step, generation).
pub fn commit_key(step: u64, generation: u64) -> String {
    format!("{}/{COMMIT}", attempt_dir(step, generation))
}

/// (step, generation) of an attempt directory name `step-…/g…`.
pub fn parse_attempt_dir(dir: &str) -> Option<(u64, u64)> {
    let (s, g) = dir.split_once('/')?;
    Some((
        s.strip_prefix("step-")?.parse().ok()?,
        g.strip_prefix('g')?.parse().ok()?,
    ))
}

pub fn shard_name(rank: u32, world: u32) -> String {
    format!("shard-{rank:05}-of-{world:05}.safetensors")
}

/// One chunk placed in a shard being written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    /// Index into the tensor list.
    pub tensor: usize,
    /// Its key in the shard's safetensors header: the tensor's name, or, where the shard holds
    /// several row ranges of one tensor (a tensor-parallel member's heads of Q, K and V), the
    /// name with the rows (`name#rows=START-END`) for each of them.
    pub key: String,
    pub row: u64,
    pub rows: u64,
    /// Byte range in the shard object.
    pub start: u64,
    pub end: u64,
}

/// A safetensors header for `chunks` of `tensors`; returns the header bytes (length prefix
/// included, padded to 8) and where each chunk's data goes in the object.
pub fn safetensors_header(
    tensors: &[TensorMeta],
    chunks: &[(usize, u64, u64)],
) -> (Vec<u8>, Vec<Placed>) {
    let mut head = serde_json::Map::new();
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), FORMAT.into());
    let mut at = 0u64;
    let mut rel = Vec::with_capacity(chunks.len());
    // a standard reader needs every byte range of the data area named, once: a tensor held
    // in several row ranges gets one key per range
    let mut count = BTreeMap::new();
    for &(ti, _, _) in chunks {
        *count.entry(ti).or_insert(0usize) += 1;
    }
    for &(ti, row, rows) in chunks {
        let t = &tensors[ti];
        let n = rows * t.row_bytes();
        let mut shape = t.shape.clone();
        let mut offsets = vec![0u64; t.shape.len()];
        if let Some(first) = shape.first_mut() {
            *first = rows;
            offsets[0] = row;
        }
        let key = if count[&ti] > 1 {
            format!("{}#rows={row}-{}", t.name, row + rows)
        } else {
            t.name.clone()
        };
        head.insert(
            key.clone(),
            serde_json::json!({"dtype": t.dtype, "shape": shape, "data_offsets": [at, at + n]}),
        );
        meta.insert(
            key.clone(),
            serde_json::json!({"tensor": t.name, "global_shape": t.shape, "offsets": offsets, "kind": t.kind})
                .to_string()
                .into(),
        );
        rel.push((ti, key, row, rows, at, at + n));
        at += n;
    }
    head.insert("__metadata__".into(), serde_json::Value::Object(meta));
    let mut json = serde_json::to_vec(&head).expect("a JSON map");
    while !(json.len() + 8).is_multiple_of(8) {
        json.push(b' ');
    }
    let base = 8 + json.len() as u64;
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    let placed = rel
        .into_iter()
        .map(|(tensor, key, row, rows, s, e)| Placed {
            tensor,
            key,
            row,
            rows,
            start: base + s,
            end: base + e,
        })
        .collect();
    (out, placed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value_and_appends() {
        // the catalogue's check value of CRC-32/ISCSI, and RFC 3720's 32 zero bytes
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(b""), 0);
        let data: Vec<u8> = (0..100_003u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 11) as u8)
            .collect();
        let whole = crc32c(&data);
        for cut in [0, 1, 7, 4096, 65_537, data.len()] {
            let (a, b) = data.split_at(cut);
            assert_eq!(crc32c_append(crc32c(a), b), whole, "cut at {cut}");
        }
        let mut acc = 0;
        for piece in data.chunks(1000) {
            acc = crc32c_append(acc, piece);
        }
        assert_eq!(acc, whole);
    }

    #[test]
    fn a_header_places_chunks_back_to_back_after_an_aligned_header() {
        let t = vec![
            TensorMeta {
                name: "w".into(),
                dtype: Dtype::F32,
                shape: vec![4, 3],
                kind: TensorKind::Parameter,
            },
            TensorMeta {
                name: "b".into(),
                dtype: Dtype::F32,
                shape: vec![3],
                kind: TensorKind::Parameter,
            },
        ];
        let (h, placed) = safetensors_header(&t, &[(0, 1, 3), (1, 0, 3)]);
        assert_eq!(h.len() % 8, 0);
        assert_eq!(placed[0].start, h.len() as u64);
        assert_eq!(placed[0].end - placed[0].start, 36);
        assert_eq!(placed[1].start, placed[0].end);
        // the safetensors crate (the reader PyTorch users' tools share) reads it back
        let mut file = h.clone();
        file.resize(placed[1].end as usize, 0);
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        let w = st.tensor("w").unwrap();
        assert_eq!(w.shape(), &[3, 3]);
        assert_eq!(w.dtype(), safetensors::Dtype::F32);
        assert_eq!(w.data().len() as u64, placed[0].end - placed[0].start);
        let (_, meta) = safetensors::SafeTensors::read_metadata(&file).unwrap();
        let meta = meta.metadata().clone().unwrap();
        let m: serde_json::Value = serde_json::from_str(&meta["w"]).unwrap();
        assert_eq!(m["offsets"], serde_json::json!([1, 0]));
        assert_eq!(m["global_shape"], serde_json::json!([4, 3]));
        assert_eq!(meta["format"], FORMAT);
        assert_eq!(parse_attempt_dir(&attempt_dir(120, 7)), Some((120, 7)));
    }
}

//! A Hugging Face model directory as one more source of state: its safetensors files (one
//! `model.safetensors`, or the shards `model.safetensors.index.json` names) described as a
//! [`Manifest`] whose chunks are row blocks of each tensor at their byte ranges in the files,
//! so the restore path's redistribution plan loads it: each rank reads only chunks of the
//! tensors or slices it holds, once, and the ranks exchange the rest.
//!
//! Only the files' headers are read here (a ranged GET each); a header that does not parse, a
//! tensor whose bytes reach outside its file, a shard the index names that is not there, a
//! tensor of a dtype ductile does not read: each is an error naming the file and the tensor.

use std::collections::BTreeMap;

use crate::bucket::Bucket;
use crate::format::{ChunkEntry, Dtype, Manifest, ObjectEntry, TensorEntry, TensorKind};

/// The most of a model directory's `config.json` anyone reads on a job's word (the daemon at
/// submit, `dctl submit --dry-run`): a real one is a few KiB.
pub const MAX_CONFIG_JSON: u64 = 1 << 20;

/// Why a model directory's `config.json` could not be had.
#[derive(Debug)]
pub enum ConfigJsonError {
    /// The directory answered, and it is not a model directory (no config.json, one too large
    /// or not JSON, a URL that names no store): the job's fault.
    NotAModel(String),
    /// The store did not answer: nothing is known of the directory.
    Store(String),
}

/// A model directory's `config.json` (file:// or s3://), read at most [`MAX_CONFIG_JSON`]
/// bytes; `reader` names who reads it in the too-large sentence.
pub async fn read_config_json(
    url: &str,
    reader: &str,
) -> Result<serde_json::Value, ConfigJsonError> {
    use crate::bucket::Capped;
    let bucket = Bucket::open(url.trim_end_matches('/'))
        .map_err(|e| ConfigJsonError::NotAModel(e.to_string()))?;
    let body = match bucket.get_capped("config.json", MAX_CONFIG_JSON).await {
        Ok(Capped::Bytes(b)) => b,
        Ok(Capped::Absent) => {
            return Err(ConfigJsonError::NotAModel(format!(
                "{url} has no config.json (not a Hugging Face model directory)"
            )))
        }
        Ok(Capped::TooLarge(n)) => {
            return Err(ConfigJsonError::NotAModel(format!(
                "{url}/config.json is {n} bytes: a model's config.json is at most {MAX_CONFIG_JSON} ({reader} reads no more)"
            )))
        }
        Err(e) => return Err(ConfigJsonError::Store(format!("reading config.json: {e}"))),
    };
    serde_json::from_slice(&body)
        .map_err(|e| ConfigJsonError::NotAModel(format!("{url}/config.json is not JSON: {e}")))
}

/// The first bytes of a weight file read at once: its length prefix and, mostly, its header.
const HEAD_GUESS: u64 = 256 << 10;

/// At most this many bytes per chunk (a tensor's rows are cut into blocks of about this size),
/// so a rank that holds part of a tensor reads little beyond it.
pub const CHUNK_BYTES: u64 = 1 << 20;

/// A header's tensor: its dtype, shape and byte range in the file.
#[derive(Clone, Debug, PartialEq)]
pub struct FileTensor {
    pub file: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Absolute byte range in the file.
    pub range: [u64; 2],
}

fn dtype_of(s: &str) -> Option<Dtype> {
    Some(match s {
        "F64" => Dtype::F64,
        "F32" => Dtype::F32,
        "F16" => Dtype::F16,
        "BF16" => Dtype::BF16,
        "I64" => Dtype::I64,
        "I32" => Dtype::I32,
        "U8" => Dtype::U8,
        _ => return None,
    })
}

/// The safetensors files of the directory: the index's (each once, in name order) or
/// `model.safetensors`.
pub async fn weight_files(dir: &Bucket) -> anyhow::Result<Vec<String>> {
    let index = dir
        .get_if_exists("model.safetensors.index.json")
        .await
        .map_err(|e| anyhow::anyhow!("{}/model.safetensors.index.json: {e}", dir.url))?;
    match index {
        Some(b) => {
            let v: serde_json::Value = serde_json::from_slice(&b).map_err(|e| {
                anyhow::anyhow!("{}/model.safetensors.index.json: not JSON: {e}", dir.url)
            })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "{}/model.safetensors.index.json: no weight_map object",
                        dir.url
                    )
                })?;
            let mut files: Vec<String> = map
                .values()
                .map(|f| {
                    f.as_str().map(str::to_string).ok_or_else(|| {
                        anyhow::anyhow!("{}/model.safetensors.index.json: a weight_map value is not a file name", dir.url)
                    })
                })
                .collect::<anyhow::Result<_>>()?;
            files.sort();
            files.dedup();
            for f in &files {
                anyhow::ensure!(
                    !f.contains('/') && !f.starts_with('.') && !f.is_empty(),
                    "{}/model.safetensors.index.json: weight file {f:?} is not a file of the directory",
                    dir.url
                );
            }
            Ok(files)
        }
        None => Ok(vec!["model.safetensors".to_string()]),
    }
}

/// The tensors a safetensors file's header lists, checked against the file's size.
pub async fn read_header(dir: &Bucket, file: &str) -> anyhow::Result<Vec<(String, FileTensor)>> {
    let at = format!("{}/{file}", dir.url);
    let size = match dir.head(file).await {
        Ok(m) => m.size,
        Err(e) if e.is_not_found() => anyhow::bail!("{at}: the weight file is missing"),
        Err(e) => anyhow::bail!("{at}: {e}"),
    };
    anyhow::ensure!(size >= 8, "{at}: {size} bytes, not a safetensors file");
    // one GET holds the header of almost every file; a longer header takes a second
    let first = dir
        .get_ranges(file, std::slice::from_ref(&(0..size.min(HEAD_GUESS))))
        .await
        .map_err(|e| anyhow::anyhow!("{at}: {e}"))?
        .remove(0);
    let n = u64::from_le_bytes(first[..8].try_into().unwrap());
    anyhow::ensure!(
        n <= 100 << 20 && 8 + n <= size,
        "{at}: a header of {n} bytes in a file of {size} (not a safetensors file, or a cut one)"
    );
    let head = if 8 + n <= first.len() as u64 {
        first.slice(8..8 + n as usize)
    } else {
        dir.get_ranges(file, std::slice::from_ref(&(8..8 + n)))
            .await
            .map_err(|e| anyhow::anyhow!("{at}: {e}"))?
            .remove(0)
    };
    // the header as the safetensors crate reads it (dtypes, shapes, offsets typed); where the
    // bytes lie in this file is checked here, since only the header was read
    let meta: safetensors::tensor::Metadata = serde_json::from_slice(&head)
        .map_err(|e| anyhow::anyhow!("{at}: not a safetensors header: {e}"))?;
    let base = 8 + n;
    let mut out = Vec::new();
    for (name, info) in meta.tensors() {
        let bad = |why: String| anyhow::anyhow!("{at}: tensor {name}: {why}");
        let dt = format!("{:?}", info.dtype);
        let dtype = dtype_of(&dt).ok_or_else(|| bad(format!("dtype {dt} is not read")))?;
        let shape: Vec<u64> = info.shape.iter().map(|d| *d as u64).collect();
        let offs = [info.data_offsets.0 as u64, info.data_offsets.1 as u64];
        let want = shape
            .iter()
            .try_fold(dtype.size(), |a, d| a.checked_mul(*d))
            .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
        let (a, b) = (base + offs[0], base.saturating_add(offs[1]));
        if offs[0] > offs[1] || b > size || b - a != want {
            return Err(bad(format!(
                "bytes {}..{} of a {size}-byte file for {want} bytes of shape {shape:?} (a corrupt or cut file)",
                offs[0], offs[1]
            )));
        }
        out.push((
            name,
            FileTensor {
                file: file.to_string(),
                dtype,
                shape,
                range: [a, b],
            },
        ));
    }
    Ok(out)
}

/// Every tensor of the directory's weight files, by name.
pub async fn tensors(dir: &Bucket) -> anyhow::Result<BTreeMap<String, FileTensor>> {
    let mut all = BTreeMap::new();
    for f in weight_files(dir).await? {
        for (name, t) in read_header(dir, &f).await? {
            if let Some(prev) = all.insert(name.clone(), t) {
                anyhow::bail!(
                    "{}: tensor {name} is in both {} and {f}",
                    dir.url,
                    prev.file
                );
            }
        }
    }
    Ok(all)
}

/// The tensor the model calls `name` in the directory's files: by that name, or, for a model
/// saved before transformers prefixed its base model's names (the GPT-2 checkpoints on the Hub:
/// `h.0.attn.c_attn.weight` for `transformer.h.0.attn.c_attn.weight`), without the prefix.
pub fn lookup<'a>(files: &'a BTreeMap<String, FileTensor>, name: &str) -> Option<&'a FileTensor> {
    files.get(name).or_else(|| {
        name.strip_prefix("transformer.")
            .and_then(|bare| files.get(bare))
    })
}

/// The manifest of `wanted` (name, shape), in that order, over the directory's files: each
/// tensor cut into row blocks of at most [`CHUNK_BYTES`]. A wanted tensor the files lack, or
/// hold with another shape, is an error naming it and its file.
pub fn manifest(
    url: &str,
    files: &BTreeMap<String, FileTensor>,
    wanted: &[(String, Vec<u64>)],
) -> anyhow::Result<Manifest> {
    let mut tensors = BTreeMap::new();
    let mut objects: BTreeMap<String, u64> = BTreeMap::new();
    for (name, shape) in wanted {
        let t = lookup(files, name)
            .ok_or_else(|| anyhow::anyhow!("{url}: the weight files hold no tensor {name}"))?;
        anyhow::ensure!(
            &t.shape == shape,
            "{url}/{}: tensor {name} has shape {:?}, the model's config.json makes it {shape:?}",
            t.file,
            t.shape
        );
        let rows = shape.first().copied().unwrap_or(1);
        let row_bytes = t.dtype.size() * shape.iter().skip(1).product::<u64>();
        let per = (CHUNK_BYTES / row_bytes.max(1)).max(1);
        let mut chunks = Vec::new();
        let mut r = 0;
        while r < rows {
            let n = per.min(rows - r);
            let mut offsets = vec![0; shape.len()];
            let mut cshape = shape.clone();
            if !shape.is_empty() {
                offsets[0] = r;
                cshape[0] = n;
            }
            let a = t.range[0] + r * row_bytes;
            chunks.push(ChunkEntry {
                object: t.file.clone(),
                key: name.clone(),
                byte_range: [a, a + n * row_bytes],
                offsets,
                shape: cshape,
                crc32c: 0,
            });
            r += n;
        }
        let end = objects.entry(t.file.clone()).or_default();
        *end = (*end).max(t.range[1]);
        tensors.insert(
            name.clone(),
            TensorEntry {
                dtype: t.dtype,
                shape: shape.clone(),
                kind: TensorKind::Parameter,
                chunks,
            },
        );
    }
    Ok(Manifest {
        format: "huggingface".into(),
        job: String::new(),
        step: 0,
        generation: 0,
        created_at_ms: 0,
        world_size: 1,
        layout: ductile_cluster::records::Layout {
            data_parallel: 1,
            pipeline_parallel: 1,
            tensor_parallel: 1,
            dp_shard: 1,
        },
        order: wanted.iter().map(|(n, _)| n.clone()).collect(),
        tensors,
        objects: objects
            .into_iter()
            .map(|(object, size)| ObjectEntry { object, size })
            .collect(),
        extra: serde_json::Value::Null,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of f32 tensors `(name, shape)`, filled with their element index.
    fn file(tensors: &[(&str, Vec<u64>)]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        let mut at = 0u64;
        for (n, s) in tensors {
            let b = 4 * s.iter().product::<u64>();
            header.insert(
                n.to_string(),
                serde_json::json!({"dtype": "F32", "shape": s, "data_offsets": [at, at + b]}),
            );
            at += b;
        }
        let h = serde_json::to_vec(&header).unwrap();
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        for (_, s) in tensors {
            out.extend((0..s.iter().product::<u64>()).flat_map(|i| (i as f32).to_le_bytes()));
        }
        out
    }

    fn dir(name: &str, files: &[(&str, Vec<u8>)]) -> Bucket {
        let d = std::env::temp_dir().join(format!("ductile-hf-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        for (f, b) in files {
            std::fs::write(d.join(f), b).unwrap();
        }
        Bucket::open(&format!("file://{}", d.display())).unwrap()
    }

    fn index(map: &[(&str, &str)]) -> Vec<u8> {
        let m: serde_json::Map<String, serde_json::Value> = map
            .iter()
            .map(|(t, f)| (t.to_string(), serde_json::Value::String(f.to_string())))
            .collect();
        serde_json::to_vec(&serde_json::json!({"metadata": {}, "weight_map": m})).unwrap()
    }

    fn wanted() -> Vec<(String, Vec<u64>)> {
        vec![
            ("a.weight".into(), vec![4, 3]),
            ("b.weight".into(), vec![5]),
        ]
    }

    /// Sharded weights read into a manifest whose chunks cover every wanted tensor at its
    /// bytes; each thing wrong with a directory is an error naming the file and the tensor.
    #[tokio::test]
    async fn a_directory_reads_or_fails_naming_the_file_and_the_tensor() {
        let good = dir(
            "good",
            &[
                (
                    "model.safetensors.index.json",
                    index(&[
                        ("a.weight", "one.safetensors"),
                        ("b.weight", "two.safetensors"),
                    ]),
                ),
                ("one.safetensors", file(&[("a.weight", vec![4, 3])])),
                (
                    "two.safetensors",
                    file(&[("b.weight", vec![5]), ("extra", vec![2])]),
                ),
            ],
        );
        let t = tensors(&good).await.unwrap();
        let m = manifest(&good.url, &t, &wanted()).unwrap();
        m.validate().unwrap();
        assert_eq!(m.order, vec!["a.weight", "b.weight"]);
        assert_eq!(m.tensors["b.weight"].chunks[0].object, "two.safetensors");

        let missing_shard = dir(
            "missing",
            &[
                (
                    "model.safetensors.index.json",
                    index(&[
                        ("a.weight", "one.safetensors"),
                        ("b.weight", "two.safetensors"),
                    ]),
                ),
                ("one.safetensors", file(&[("a.weight", vec![4, 3])])),
            ],
        );
        let e = tensors(&missing_shard).await.unwrap_err().to_string();
        assert!(
            e.contains("two.safetensors: the weight file is missing"),
            "{e}"
        );

        let misshapen = dir(
            "shape",
            &[(
                "model.safetensors",
                file(&[("a.weight", vec![3, 4]), ("b.weight", vec![5])]),
            )],
        );
        let t = tensors(&misshapen).await.unwrap();
        let e = manifest(&misshapen.url, &t, &wanted())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.safetensors: tensor a.weight has shape [3, 4]"),
            "{e}"
        );

        let lacking = dir(
            "lacking",
            &[("model.safetensors", file(&[("a.weight", vec![4, 3])]))],
        );
        let t = tensors(&lacking).await.unwrap();
        let e = manifest(&lacking.url, &t, &wanted())
            .unwrap_err()
            .to_string();
        assert!(e.contains("no tensor b.weight"), "{e}");

        let mut cut = file(&[("a.weight", vec![4, 3]), ("b.weight", vec![5])]);
        cut.truncate(cut.len() - 4);
        let cut = dir("cut", &[("model.safetensors", cut)]);
        let e = tensors(&cut).await.unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors: tensor b.weight") && e.contains("cut"),
            "{e}"
        );

        let garbage = dir(
            "garbage",
            &[(
                "model.safetensors",
                b"not a safetensors file at all".to_vec(),
            )],
        );
        let e = tensors(&garbage).await.unwrap_err().to_string();
        assert!(e.contains("model.safetensors"), "{e}");
    }

    /// A large tensor is cut into row blocks of at most CHUNK_BYTES, back to back.
    #[test]
    fn large_tensors_are_cut_into_row_blocks() {
        let t = FileTensor {
            file: "m.safetensors".into(),
            dtype: Dtype::F32,
            shape: vec![1000, 600],
            range: [100, 100 + 4 * 600_000],
        };
        let files = BTreeMap::from([("w".to_string(), t)]);
        let m = manifest("file:///x", &files, &[("w".into(), vec![1000, 600])]).unwrap();
        let c = &m.tensors["w"].chunks;
        assert!(
            c.len() > 2
                && c.iter()
                    .all(|c| c.byte_range[1] - c.byte_range[0] <= CHUNK_BYTES)
        );
        assert_eq!(c[0].byte_range[0], 100);
        assert!(c
            .windows(2)
            .all(|w| w[0].byte_range[1] == w[1].byte_range[0]));
        assert_eq!(c.last().unwrap().byte_range[1], 100 + 4 * 600_000);
    }
}

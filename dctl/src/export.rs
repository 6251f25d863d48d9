//! `dctl export JOB [--step N] --out URL`: a committed checkpoint of a `model = "hf"` job as a
//! Hugging Face directory that `transformers.AutoModelForCausalLM.from_pretrained` loads as it
//! is: the parameters (Hugging Face's names already; optimizer state left out) assembled from
//! the checkpoint's chunks at whatever layout saved them, every chunk's CRC32C checked, written
//! as safetensors (shards and an index past `--max-shard-mb`), the job's `config.json` and the
//! model directory's tokenizer files.

use std::collections::BTreeMap;

use bytes::Bytes;
use ductile_checkpoint::format::{Manifest, TensorKind};
use ductile_checkpoint::restore::{committed, fetch, load_manifest};
use ductile_checkpoint::Bucket;
use ductile_cluster::records::JobSpec;

/// The files a model directory may hold besides its weights and config that a user of the
/// export needs (the tokenizer's, the generation defaults).
const COPIED: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

/// Copy the box `offsets`/`shape` of a row-major tensor of `full` (element size `e`) from
/// `src` (the box's own bytes, row-major) into `dst` (the whole tensor's bytes).
fn place(dst: &mut [u8], full: &[u64], offsets: &[u64], shape: &[u64], e: u64, src: &[u8]) {
    if full.is_empty() {
        dst[..e as usize].copy_from_slice(&src[..e as usize]);
        return;
    }
    let n = full.len();
    let run = (shape[n - 1] * e) as usize;
    // strides of the whole tensor, in elements
    let mut stride = vec![1u64; n];
    for d in (0..n - 1).rev() {
        stride[d] = stride[d + 1] * full[d + 1];
    }
    let rows: u64 = shape[..n - 1].iter().product();
    let mut idx = vec![0u64; n - 1];
    for r in 0..rows {
        let at: u64 = (0..n - 1)
            .map(|d| (offsets[d] + idx[d]) * stride[d])
            .sum::<u64>()
            + offsets[n - 1];
        let a = (at * e) as usize;
        let s = r as usize * run;
        dst[a..a + run].copy_from_slice(&src[s..s + run]);
        for d in (0..n - 1).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// A whole tensor: name, safetensors dtype, shape, bytes.
type Whole = (String, safetensors::Dtype, Vec<u64>, Vec<u8>);

/// The parameters of checkpoint `m`, whole, in name order.
async fn parameters(bucket: &Bucket, m: &Manifest) -> anyhow::Result<Vec<Whole>> {
    let params: Vec<(&String, _)> = m
        .tensors
        .iter()
        .filter(|(_, t)| t.kind == TensorKind::Parameter)
        .collect();
    let refs: Vec<(String, usize)> = params
        .iter()
        .flat_map(|(n, t)| (0..t.chunks.len()).map(move |k| ((*n).clone(), k)))
        .collect();
    let got = fetch(bucket, m, &refs, 8)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut out: BTreeMap<String, (safetensors::Dtype, Vec<u64>, Vec<u8>)> = BTreeMap::new();
    for ((name, k), bytes) in refs.iter().zip(got) {
        let t = &m.tensors[name];
        let e = t.dtype.size();
        let dtype = match t.dtype {
            ductile_checkpoint::format::Dtype::F32 => safetensors::Dtype::F32,
            ductile_checkpoint::format::Dtype::BF16 => safetensors::Dtype::BF16,
            ductile_checkpoint::format::Dtype::F16 => safetensors::Dtype::F16,
            other => anyhow::bail!("parameter {name} is {other:?}, not a float"),
        };
        let entry = out.entry(name.clone()).or_insert_with(|| {
            let n: u64 = t.shape.iter().product();
            (dtype, t.shape.clone(), vec![0u8; (n * e) as usize])
        });
        let c = &t.chunks[*k];
        place(&mut entry.2, &t.shape, &c.offsets, &c.shape, e, &bytes);
    }
    Ok(out.into_iter().map(|(n, (d, s, b))| (n, d, s, b)).collect())
}

/// A safetensors file of `tensors` (the `safetensors` crate's writer, `format = pt` in its
/// metadata, which transformers' loader asks for).
fn safetensors_file(tensors: &[&Whole]) -> anyhow::Result<Vec<u8>> {
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let shape = shape.iter().map(|d| *d as usize).collect();
            let view = safetensors::tensor::TensorView::new(*dtype, shape, bytes)
                .map_err(|e| anyhow::anyhow!("tensor {name}: {e:?}"))?;
            Ok((name.as_str(), view))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let meta = std::collections::HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("written_by".to_string(), "dctl export".to_string()),
    ]);
    safetensors::serialize(views, &Some(meta)).map_err(|e| anyhow::anyhow!("safetensors: {e:?}"))
}

/// What `dctl export` wrote: (step, files).
pub async fn export(
    spec: &JobSpec,
    step: Option<u64>,
    out: &str,
    max_shard_mb: u64,
) -> anyhow::Result<(u64, Vec<String>)> {
    let t = spec
        .training
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("job {} trains nothing", spec.name))?;
    anyhow::ensure!(
        t.model == ductile_cluster::modes::ModelKind::Hf,
        "job {} trains model {:?}: only model = \"hf\" jobs export to a Hugging Face directory",
        spec.name,
        t.model.as_str()
    );
    let ck = spec.checkpoint.as_ref().ok_or_else(|| {
        anyhow::anyhow!(
            "job {} has no [checkpoint]: nothing committed to export",
            spec.name
        )
    })?;
    let bucket = Bucket::open(&ck.url)?;
    let commits = committed(&bucket, None)
        .await
        .map_err(|e| anyhow::anyhow!("listing the checkpoints at {}: {e}", ck.url))?;
    let rec = match step {
        None => commits.first(),
        Some(n) => commits.iter().find(|c| c.step == n),
    }
    .ok_or_else(|| {
        anyhow::anyhow!(
            "{} holds no committed checkpoint{} (committed steps: {:?})",
            ck.url,
            step.map(|n| format!(" at step {n}")).unwrap_or_default(),
            commits.iter().map(|c| c.step).collect::<Vec<_>>()
        )
    })?;
    let m = load_manifest(&bucket, rec)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let params = parameters(&bucket, &m).await?;
    let dest = Bucket::open(out.trim_end_matches('/'))?;
    let mut written = Vec::new();
    let put = |name: String, bytes: Vec<u8>| {
        let dest = &dest;
        async move {
            dest.put(&name, Bytes::from(bytes))
                .await
                .map_err(|e| anyhow::anyhow!("writing {out}/{name}: {e}"))?;
            anyhow::Ok(name)
        }
    };
    // the weights: one file, or shards of at most max_shard_mb and their index
    let limit = max_shard_mb.max(1) << 20;
    let mut shards: Vec<Vec<&Whole>> = vec![Vec::new()];
    let mut size = 0u64;
    for p in &params {
        let n = p.3.len() as u64;
        if size > 0 && size + n > limit {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().unwrap().push(p);
        size += n;
    }
    if shards.len() == 1 {
        written.push(put("model.safetensors".into(), safetensors_file(&shards[0])?).await?);
    } else {
        let total: u64 = params.iter().map(|p| p.3.len() as u64).sum();
        let mut map = serde_json::Map::new();
        let k = shards.len();
        for (i, s) in shards.iter().enumerate() {
            let name = format!("model-{:05}-of-{k:05}.safetensors", i + 1);
            for p in s {
                map.insert(p.0.clone(), serde_json::Value::String(name.clone()));
            }
            written.push(put(name, safetensors_file(s)?).await?);
        }
        let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": map});
        written.push(
            put(
                "model.safetensors.index.json".into(),
                serde_json::to_vec_pretty(&index)?,
            )
            .await?,
        );
    }
    // config.json: the one the job trained (as the daemon read it at submit), in f32
    let mut config = t
        .hf_config
        .clone()
        .ok_or_else(|| anyhow::anyhow!("job {} has no config.json recorded", spec.name))?;
    if let Some(o) = config.as_object_mut() {
        o.insert("torch_dtype".into(), "float32".into());
        if o.contains_key("dtype") {
            o.insert("dtype".into(), "float32".into());
        }
    }
    written.push(put("config.json".into(), serde_json::to_vec_pretty(&config)?).await?);
    // the tokenizer's files, from the model directory
    let src_url = t.model_path.clone().unwrap_or_default();
    let src = Bucket::open(src_url.trim_end_matches('/'))?;
    for f in COPIED {
        let got = src
            .get_if_exists(f)
            .await
            .map_err(|e| anyhow::anyhow!("reading {src_url}/{f}: {e}"))?;
        if let Some(b) = got {
            written.push(put(f.to_string(), b.to_vec()).await?);
        }
    }
    Ok((m.step, written))
}

#[cfg(test)]
mod tests {
    use super::place;

    /// Boxes of a 2-D tensor (row blocks, column blocks) land where they belong.
    #[test]
    fn boxes_assemble_the_whole_tensor() {
        let full = [3u64, 4];
        let whole: Vec<u8> = (0..12).collect();
        let mut dst = vec![0u8; 12];
        // columns 0..1 of all rows, then columns 1..4
        let left: Vec<u8> = (0..3).map(|r| whole[r * 4]).collect();
        let right: Vec<u8> = (0..3)
            .flat_map(|r| whole[r * 4 + 1..r * 4 + 4].to_vec())
            .collect();
        place(&mut dst, &full, &[0, 0], &[3, 1], 1, &left);
        place(&mut dst, &full, &[0, 1], &[3, 3], 1, &right);
        assert_eq!(dst, whole);
        let mut d1 = vec![0u8; 12];
        place(&mut d1, &full, &[1, 0], &[2, 4], 1, &whole[4..]);
        place(&mut d1, &full, &[0, 0], &[1, 4], 1, &whole[..4]);
        assert_eq!(d1, whole);
    }
}

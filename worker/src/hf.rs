//! Hugging Face model directories on the worker: their `config.json`, their weights whole (for
//! `generate` and the tests; training loads them by plan, `train::ckpt`), and the hash of their
//! `tokenizer.json` that token streams record.

use std::collections::BTreeMap;

use ductile_checkpoint::hf::{self, FileTensor};
use ductile_checkpoint::Bucket;
use sha2::{Digest, Sha256};
use tch::Tensor;

use crate::train::ckpt::kind_of;

/// The directory at `url` (file:// or s3://).
pub fn open(url: &str) -> anyhow::Result<Bucket> {
    Bucket::open(url.trim_end_matches('/')).map_err(|e| anyhow::anyhow!("model_path {url}: {e}"))
}

/// Its `config.json`, as JSON.
pub async fn config(dir: &Bucket) -> anyhow::Result<serde_json::Value> {
    config_if_exists(dir).await?.ok_or_else(|| {
        anyhow::anyhow!(
            "{}: no config.json (not a Hugging Face model directory)",
            dir.url
        )
    })
}

/// Its `config.json`, as JSON, if it has one.
async fn config_if_exists(dir: &Bucket) -> anyhow::Result<Option<serde_json::Value>> {
    let at = format!("{}/config.json", dir.url);
    match dir
        .get_if_exists("config.json")
        .await
        .map_err(|e| anyhow::anyhow!("{at}: {e}"))?
    {
        Some(b) => Ok(Some(
            serde_json::from_slice(&b).map_err(|e| anyhow::anyhow!("{at}: not JSON: {e}"))?,
        )),
        None => Ok(None),
    }
}

/// SHA-256 of `tokenizer.json`'s bytes, hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The directory's `tokenizer.json`, if it has one.
pub async fn tokenizer_bytes(dir: &Bucket) -> anyhow::Result<Option<bytes::Bytes>> {
    dir.get_if_exists("tokenizer.json")
        .await
        .map_err(|e| anyhow::anyhow!("{}/tokenizer.json: {e}", dir.url))
}

/// A `tokenizer.json`, parsed, with the SHA-256 of its bytes (what token streams record).
pub struct TokenizerFile {
    pub tok: tokenizers::Tokenizer,
    pub sha256: String,
}

impl TokenizerFile {
    pub fn from_bytes(json: &[u8]) -> anyhow::Result<TokenizerFile> {
        Ok(TokenizerFile {
            tok: tokenizers::Tokenizer::from_bytes(json)
                .map_err(|e| anyhow::anyhow!("not a tokenizer.json: {e}"))?,
            sha256: sha256_hex(json),
        })
    }
}

/// Every tensor of `names` with `shapes`, whole, as f32 on the CPU, read from the directory's
/// weight files (the same checks as a load by plan: missing, misshapen, cut).
pub async fn read_whole(
    dir: &Bucket,
    wanted: &[(String, Vec<u64>)],
) -> anyhow::Result<BTreeMap<String, Tensor>> {
    let files: BTreeMap<String, FileTensor> = hf::tensors(dir).await?;
    let m = hf::manifest(&dir.url, &files, wanted)?;
    let refs: Vec<(String, usize)> = m
        .ordered()
        .flat_map(|(n, t)| (0..t.chunks.len()).map(move |k| (n.clone(), k)))
        .collect();
    let got = ductile_checkpoint::restore::fetch_in(dir, "", &m, &refs, 8, false)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut parts: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
    for ((name, k), bytes) in refs.iter().zip(got) {
        let t = &m.tensors[name];
        let shape: Vec<i64> = t.chunks[*k].shape.iter().map(|d| *d as i64).collect();
        let x = Tensor::from_data_size(&bytes, &shape, kind_of(t.dtype)).to_kind(tch::Kind::Float);
        parts.entry(name.clone()).or_default().push(x);
    }
    Ok(parts
        .into_iter()
        .map(|(n, p)| {
            let whole = if p.len() == 1 {
                p.into_iter().next().unwrap()
            } else {
                Tensor::cat(&p, 0)
            };
            (n, whole)
        })
        .collect())
}

/// A `model = "hf"` job's token stream fits its model: made by `ductile-worker tokenize` (it
/// has a header) with the model directory's own `tokenizer.json` (the same SHA-256), and every
/// id inside the model's vocabulary; else an error naming the first offending position.
pub fn check_stream(
    spec: &ductile_cluster::records::TrainingSpec,
    data: &crate::data::Dataset,
    rt: &tokio::runtime::Handle,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        data.token_shape().is_some(),
        "dataset {}: a Hugging Face model trains on tokens",
        spec.dataset
    );
    let header = data.header();
    let vocab = spec.hf_config()?.vocab as u64;
    let url = spec.model_path.clone().unwrap_or_default();
    let Some(h) = header else {
        anyhow::bail!(
            "dataset {}: a bare token stream, with no header naming its tokenizer: make it with `ductile-worker tokenize --tokenizer {url}`",
            spec.dataset
        );
    };
    let dir = open(&url)?;
    if let Some(tok) = rt.block_on(tokenizer_bytes(&dir))? {
        let sha = sha256_hex(&tok);
        anyhow::ensure!(
            sha == h.tokenizer_sha256,
            "dataset {}: made by a tokenizer of SHA-256 {}, but {url}/tokenizer.json is {sha}: tokenize it again with this model's tokenizer",
            spec.dataset,
            h.tokenizer_sha256
        );
    }
    let (tokens, seen) = match data {
        // a stream read by range checks each sample's ids as it reads them
        crate::data::Dataset::Stream { stream, .. } => {
            stream.limit_vocab(vocab);
            return Ok(());
        }
        crate::data::Dataset::Tokens { tokens, vocab, .. } => (tokens, *vocab),
        crate::data::Dataset::Regression { .. } => unreachable!("checked above"),
    };
    // the stream's largest id is known from its opening: only a stream past the vocabulary is
    // walked again, for the first offending position
    if seen as u64 > vocab {
        let p = tokens
            .iter()
            .position(|t| *t as u64 >= vocab)
            .expect("an id past the vocabulary");
        anyhow::bail!(
            "dataset {}: token {} at position {p} is outside the model's vocabulary of {vocab} (config.json's vocab_size)",
            spec.dataset,
            tokens[p]
        );
    }
    Ok(())
}

/// The tokenizer at `url`: a `tokenizer.json` (file:// or s3://, or a local path), or a model
/// directory holding one; with the directory's `config.json` when there is one (its
/// `eos_token_id`).
pub async fn tokenizer_at(url: &str) -> anyhow::Result<(TokenizerFile, Option<serde_json::Value>)> {
    let url = if url.contains("://") {
        url.to_string()
    } else {
        let p = std::fs::canonicalize(url).map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
        format!("file://{}", p.display())
    };
    let url = url.trim_end_matches('/');
    let (dir, is_file) = match url.strip_suffix("/tokenizer.json") {
        Some(d) => (open(d)?, true),
        None => (open(url)?, false),
    };
    let bytes = tokenizer_bytes(&dir)
        .await?
        .ok_or_else(|| anyhow::anyhow!("{url}: no tokenizer.json there"))?;
    let tok = TokenizerFile::from_bytes(&bytes).map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
    let config = if is_file {
        None
    } else {
        config_if_exists(&dir).await?
    };
    Ok((tok, config))
}

/// The end-of-sequence id: `--eos` (a token or an id), else config.json's `eos_token_id`, else
/// the tokenizer's own end-of-text special token.
pub fn eos_of(
    tok: &tokenizers::Tokenizer,
    config: Option<&serde_json::Value>,
    given: Option<&str>,
) -> anyhow::Result<Option<u32>> {
    if let Some(g) = given {
        if let Ok(id) = g.parse::<u32>() {
            return Ok(Some(id));
        }
        return tok
            .token_to_id(g)
            .map(Some)
            .ok_or_else(|| anyhow::anyhow!("--eos {g:?} is not a token of the tokenizer"));
    }
    if let Some(id) = config
        .and_then(|c| c.get("eos_token_id"))
        .and_then(|e| e.as_u64().or_else(|| e.as_array()?.first()?.as_u64()))
    {
        return Ok(Some(id as u32));
    }
    for t in [
        "</s>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<|im_end|>",
        "<eos>",
    ] {
        if let Some(id) = tok.token_to_id(t) {
            return Ok(Some(id));
        }
    }
    Ok(None)
}

/// A model directory (or an exported checkpoint) loaded whole on the CPU: the model with its
/// weights, its checked config, and its tokenizer when it has one.
pub fn load_whole(
    url: &str,
    rt: &tokio::runtime::Handle,
) -> anyhow::Result<(
    crate::model::Model,
    ductile_cluster::hf::HfConfig,
    Option<tokenizers::Tokenizer>,
)> {
    let dir = open(url)?;
    let config = rt.block_on(self::config(&dir))?;
    // (inference applies no dropout: the config's dropout keys do not matter here)
    let c = ductile_cluster::hf::HfConfig::parse_without_dropout(&config)
        .map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
    let ctx = c.max_positions.min(2048);
    let spec: ductile_cluster::records::TrainingSpec = serde_json::from_value(serde_json::json!({
        "model": "hf", "model_path": url, "hf_config": config,
        "model_config": {"ctx": ctx, "dropout": "off"},
        "dataset": "file:///unused", "global_batch": 1,
    }))?;
    let data = crate::data::Dataset::Tokens {
        tokens: Vec::new(),
        ctx: ctx as usize,
        vocab: c.vocab as usize,
        header: None,
    };
    let model = crate::model::Model::new(&spec, &data, tch::Device::Cpu)?;
    let wanted: Vec<(String, Vec<u64>)> = model
        .params()
        .iter()
        .map(|(n, p)| (n.clone(), p.size().iter().map(|d| *d as u64).collect()))
        .collect();
    let weights = rt.block_on(read_whole(&dir, &wanted))?;
    for (n, mut p) in model.params() {
        tch::no_grad(|| p.copy_(&weights[&n]));
    }
    let tok = match rt.block_on(tokenizer_bytes(&dir))? {
        Some(b) => Some(
            TokenizerFile::from_bytes(&b)
                .map_err(|e| anyhow::anyhow!("{url}/tokenizer.json: {e}"))?
                .tok,
        ),
        None => None,
    };
    Ok((model, c, tok))
}

/// `ductile-worker generate`: the prompt's greedy continuation (decoded).
pub fn generate(url: &str, prompt: &str, n: usize) -> anyhow::Result<String> {
    let rt = tokio::runtime::Runtime::new()?;
    let (model, c, tok) = load_whole(url, rt.handle())?;
    let tok =
        tok.ok_or_else(|| anyhow::anyhow!("{url}: no tokenizer.json to encode the prompt"))?;
    let ids = tok
        .encode(prompt, false)
        .map_err(|e| anyhow::anyhow!("encoding the prompt: {e}"))?;
    let eos = c.eos_token_id.map(|e| e as u32);
    let out = model.generate(ids.get_ids(), n, eos)?;
    tok.decode(&out, true)
        .map_err(|e| anyhow::anyhow!("decoding: {e}"))
}

#[cfg(test)]
mod stream_tests {
    use super::*;
    use crate::data::{Dataset, TokenHeader};

    /// A job's stream must come from its model's tokenizer and stay inside its vocabulary; a
    /// bare stream, another tokenizer's, or an id past the vocabulary is refused, naming why
    /// (and the position).
    #[test]
    fn a_stream_from_another_tokenizer_or_past_the_vocabulary_is_refused() {
        let dir = crate::model::llama_tests::fixtures().join("llama");
        let spec = crate::model::llama_tests::spec_for(&dir, 4);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let sha = sha256_hex(&std::fs::read(dir.join("tokenizer.json")).unwrap());
        let stream = |sha: &str, tokens: Vec<u32>, header: bool| {
            let h = TokenHeader {
                width: 2,
                vocab: 300,
                tokenizer_sha256: sha.to_string(),
                eos: Some(0),
                documents: 1,
                tokens: tokens.len() as u64,
                sha256: None,
            };
            let bytes = if header {
                h.encode(&tokens)
            } else {
                tokens
                    .iter()
                    .flat_map(|t| (*t as u16).to_le_bytes())
                    .collect()
            };
            Dataset::from_bytes("file:///d.tok", &bytes, spec.model, 4).unwrap()
        };
        let ok: Vec<u32> = (0..40).map(|i| i * 7 % 300).collect();
        check_stream(&spec, &stream(&sha, ok.clone(), true), rt.handle()).unwrap();
        let e = check_stream(&spec, &stream(&sha, ok.clone(), false), rt.handle()).unwrap_err();
        assert!(
            e.to_string().contains("no header naming its tokenizer"),
            "{e}"
        );
        let e = check_stream(&spec, &stream("0ther", ok.clone(), true), rt.handle()).unwrap_err();
        assert!(
            e.to_string()
                .contains("made by a tokenizer of SHA-256 0ther"),
            "{e}"
        );
        let mut past = ok;
        past[17] = 300;
        let e = check_stream(&spec, &stream(&sha, past, true), rt.handle()).unwrap_err();
        assert!(
            e.to_string()
                .contains("token 300 at position 17 is outside the model's vocabulary of 300"),
            "{e}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `tokenizers` crate reading the fixture's tokenizer.json gives the ids Python's
    /// `tokenizers` gave for the same text, and the stream round-trips through its header.
    #[test]
    fn tokenize_gives_pythons_ids_and_a_stream_that_reads_back() {
        let dir = crate::model::llama_tests::fixtures();
        let tok =
            TokenizerFile::from_bytes(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
        let want: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("tokenized.json")).unwrap()).unwrap();
        let text = want["text"].as_str().unwrap().to_string();
        let ids: Vec<u32> = want["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect();
        let (tokens, ends) =
            crate::tokenize::encode(&tok, Some(0), vec![text.clone(), text]).unwrap();
        let mut expect = ids.clone();
        expect.push(0);
        expect.extend(&ids);
        expect.push(0);
        assert_eq!(tokens, expect);
        assert_eq!(ends, vec![ids.len() + 1, 2 * ids.len() + 2]);
        let header = crate::data::TokenHeader {
            width: 2,
            vocab: 300,
            tokenizer_sha256: tok.sha256.clone(),
            eos: Some(0),
            documents: 2,
            tokens: tokens.len() as u64,
            sha256: None,
        };
        let bytes = header.encode(&tokens);
        let (h, back) = crate::data::TokenHeader::decode("t", &bytes)
            .unwrap()
            .unwrap();
        assert_eq!((h, back), (header, tokens));
        let e = crate::data::TokenHeader::decode("t", &bytes[..bytes.len() - 2]).unwrap_err();
        assert!(e.to_string().contains("the header says"), "{e}");
    }
}

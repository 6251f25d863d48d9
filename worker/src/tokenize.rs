//! `ductile-worker tokenize`: text in (`.txt`, `.jsonl`, `.parquet`), token streams out.
//!
//! A reader thread turns the inputs, in the order given, into batches of documents (a `.txt`
//! file is one document, a `.jsonl` line one, a Parquet row one: the string in `field`); the
//! main thread encodes each batch with the tokenizer's `encode_batch` (its documents in
//! parallel, on every core) and appends the ids, with `eos` after each document, to the
//! output. The output is the same bytes whatever the parallelism: documents keep their order.
//!
//! `--out` a file URL: one stream (header, then the tokens). `--out` a prefix ending in `/`:
//! shards of exactly `--shard-tokens` tokens (the last shorter), each a stream of its own
//! whose header carries the SHA-256 of its tokens, then `index.json` naming them in order
//! (written last: a prefix without an index is not a dataset). Memory: one shard and one batch.
//!
//! Bad input stops the run naming the file and where: a line that is not JSON or lacks the
//! field, text that is not UTF-8 (with its byte offset), a Parquet column that is missing, not
//! a string, or null.

use crate::data::{ShardEntry, ShardIndex, TokenHeader};
use crate::hf::TokenizerFile;
use sha2::Digest;
use std::io::BufRead;

/// Documents per batch handed to the tokenizer (and bytes, whichever comes first).
const BATCH_DOCS: usize = 512;
const BATCH_BYTES: usize = 2 << 20;

/// What a run wrote.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Summary {
    pub out: String,
    pub documents: u64,
    pub tokens: u64,
    pub shards: u64,
    pub input_bytes: u64,
    pub seconds: f64,
    pub tokens_per_s: f64,
    /// The process's peak resident memory (VmHWM), MiB.
    pub peak_rss_mib: f64,
    pub width: u8,
    pub vocab: u64,
    pub eos: Option<u32>,
    pub tokenizer_sha256: String,
}

/// The ids of these documents, `eos` after each, in order; and where each document ends.
pub fn encode(
    t: &TokenizerFile,
    eos: Option<u32>,
    docs: Vec<String>,
) -> anyhow::Result<(Vec<u32>, Vec<usize>)> {
    let enc = t
        .tok
        .encode_batch(docs, false)
        .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    let mut out = Vec::with_capacity(enc.iter().map(|e| e.len() + 1).sum());
    let mut ends = Vec::with_capacity(enc.len());
    for e in enc {
        out.extend_from_slice(e.get_ids());
        if let Some(id) = eos {
            out.push(id);
        }
        ends.push(out.len());
    }
    Ok((out, ends))
}

fn utf8(path: &str, at: &str, bytes: Vec<u8>) -> anyhow::Result<String> {
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{path}{at}: not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

/// Read every input in order, sending batches of documents (a failure ends the stream).
fn read_inputs(
    inputs: &[String],
    field: &str,
    tx: &std::sync::mpsc::SyncSender<anyhow::Result<Vec<String>>>,
    read: &std::sync::atomic::AtomicU64,
) -> anyhow::Result<()> {
    let mut batch: Vec<String> = Vec::new();
    let mut bytes = 0usize;
    let mut push = |doc: String, batch: &mut Vec<String>| -> bool {
        bytes += doc.len();
        batch.push(doc);
        if batch.len() >= BATCH_DOCS || bytes >= BATCH_BYTES {
            bytes = 0;
            return tx.send(Ok(std::mem::take(batch))).is_ok();
        }
        true
    };
    let count = |n: usize| read.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    for path in inputs {
        let open = || std::fs::File::open(path).map_err(|e| anyhow::anyhow!("{path}: {e}"));
        if path.ends_with(".txt") {
            let b = std::fs::read(path).map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
            count(b.len());
            if !push(utf8(path, "", b)?, &mut batch) {
                return Ok(());
            }
        } else if path.ends_with(".jsonl") {
            let mut r = std::io::BufReader::new(open()?);
            let mut line = Vec::new();
            for n in 1.. {
                line.clear();
                let got = r
                    .read_until(b'\n', &mut line)
                    .map_err(|e| anyhow::anyhow!("{path}:{n}: {e}"))?;
                if got == 0 {
                    break;
                }
                count(got);
                let l = utf8(path, &format!(":{n}"), std::mem::take(&mut line))?;
                if l.trim().is_empty() {
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(&l)
                    .map_err(|e| anyhow::anyhow!("{path}:{n}: not JSON: {e}"))?;
                let text = v
                    .get(field)
                    .and_then(|t| t.as_str())
                    .ok_or_else(|| anyhow::anyhow!("{path}:{n}: no string field {field:?}"))?;
                if !push(text.to_string(), &mut batch) {
                    return Ok(());
                }
            }
        } else if path.ends_with(".parquet") {
            if !parquet_documents(path, field, &mut |doc, n| {
                count(n);
                push(doc, &mut batch)
            })? {
                return Ok(());
            }
        } else {
            anyhow::bail!(
                "{path}: not .txt (a document per file), .jsonl (a document per line) nor .parquet (a document per row)"
            );
        }
    }
    if !batch.is_empty() {
        let _ = tx.send(Ok(batch));
    }
    Ok(())
}

/// Each row's string in column `field` of a Parquet file, in row order; `false` when the
/// receiver stopped listening.
fn parquet_documents(
    path: &str,
    field: &str,
    each: &mut dyn FnMut(String, usize) -> bool,
) -> anyhow::Result<bool> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    let f = std::fs::File::open(path).map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
    let reader =
        SerializedFileReader::new(f).map_err(|e| anyhow::anyhow!("{path}: not Parquet: {e}"))?;
    let schema = reader.metadata().file_metadata().schema();
    let column = schema
        .get_fields()
        .iter()
        .find(|c| c.name() == field)
        .ok_or_else(|| {
            let names: Vec<&str> = schema.get_fields().iter().map(|c| c.name()).collect();
            anyhow::anyhow!("{path}: no column {field:?} (it has {names:?})")
        })?
        .clone();
    let projection = parquet::schema::types::Type::group_type_builder(schema.name())
        .with_fields(vec![column])
        .build()
        .map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
    let rows = reader
        .get_row_iter(Some(projection))
        .map_err(|e| anyhow::anyhow!("{path}: column {field:?}: {e}"))?;
    for (i, row) in rows.enumerate() {
        let row = row.map_err(|e| anyhow::anyhow!("{path}: row {i}: {e}"))?;
        let (_, value) = row
            .get_column_iter()
            .next()
            .ok_or_else(|| anyhow::anyhow!("{path}: row {i}: no column {field:?}"))?;
        let text = match value {
            Field::Str(s) => s.clone(),
            Field::Bytes(b) => utf8(path, &format!(": row {i}"), b.data().to_vec())?,
            Field::Null => anyhow::bail!("{path}: row {i}: column {field:?} is null"),
            other => {
                anyhow::bail!("{path}: row {i}: column {field:?} holds {other:?}, not a string")
            }
        };
        let n = text.len();
        if !each(text, n) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Where the tokens go: one stream, or shards and their index under a prefix.
pub struct Sink {
    out: String,
    bucket: ductile_checkpoint::Bucket,
    /// The file's name (one stream), or None (shards under the bucket's prefix).
    file: Option<String>,
    shard_tokens: usize,
    header: TokenHeader,
    pending: Vec<u32>,
    /// Where the documents in `pending` end (a document counts in the shard its end falls in).
    pending_ends: std::collections::VecDeque<usize>,
    shards: Vec<ShardEntry>,
}

impl Sink {
    /// A sink writing streams with `header`'s width, vocabulary, tokenizer and eos to `out`:
    /// a file URL (one stream), or a prefix ending in `/` (shards of `shard_tokens`).
    pub fn new(out: &str, header: TokenHeader, shard_tokens: u64) -> anyhow::Result<Sink> {
        anyhow::ensure!(
            shard_tokens >= 2,
            "--shard-tokens {shard_tokens}: at least 2"
        );
        let (dir, file) = match out.strip_suffix('/') {
            Some(prefix) => (prefix.to_string(), None),
            None => {
                let (d, n) = out
                    .rsplit_once('/')
                    .ok_or_else(|| anyhow::anyhow!("--out {out}: not a URL of a file"))?;
                (d.to_string(), Some(n.to_string()))
            }
        };
        let bucket = ductile_checkpoint::Bucket::open(&dir)
            .map_err(|e| anyhow::anyhow!("--out {out}: {e}"))?;
        Ok(Sink {
            out: out.to_string(),
            bucket,
            file,
            shard_tokens: shard_tokens as usize,
            header,
            pending: Vec::new(),
            pending_ends: Default::default(),
            shards: Vec::new(),
        })
    }

    fn put(&self, rt: &tokio::runtime::Runtime, name: &str, bytes: Vec<u8>) -> anyhow::Result<()> {
        rt.block_on(self.bucket.put(name, bytes::Bytes::from(bytes)))
            .map_err(|e| anyhow::anyhow!("--out {}: writing {name}: {e}", self.out))
    }

    fn shard(
        &mut self,
        rt: &tokio::runtime::Runtime,
        tokens: &[u32],
        docs: u64,
    ) -> anyhow::Result<()> {
        let name = format!("shard-{:05}.tok", self.shards.len());
        let bytes = stream_bytes(&self.header, tokens, docs);
        let sha = TokenHeader::decode(&name, &bytes)?
            .and_then(|(h, _)| h.sha256)
            .expect("a header with its checksum");
        let entry = ShardEntry {
            name: name.clone(),
            tokens: tokens.len() as u64,
            bytes: bytes.len() as u64,
            sha256: sha,
            documents: docs,
        };
        self.put(rt, &name, bytes)?;
        self.shards.push(entry);
        Ok(())
    }

    /// Append tokens; `ends`: where documents end in `ids` (a shard is written when full).
    pub fn add(
        &mut self,
        rt: &tokio::runtime::Runtime,
        ids: Vec<u32>,
        ends: Vec<usize>,
    ) -> anyhow::Result<()> {
        let at = self.pending.len();
        self.pending.extend_from_slice(&ids);
        self.pending_ends.extend(ends.into_iter().map(|e| e + at));
        if self.file.is_none() {
            let n = self.shard_tokens;
            while self.pending.len() >= n {
                let rest = self.pending.split_off(n);
                let full = std::mem::replace(&mut self.pending, rest);
                let mut docs = 0;
                while self.pending_ends.front().is_some_and(|e| *e <= n) {
                    self.pending_ends.pop_front();
                    docs += 1;
                }
                for e in self.pending_ends.iter_mut() {
                    *e -= n;
                }
                self.shard(rt, &full, docs)?;
            }
        }
        Ok(())
    }

    /// Write what is left, and the index: the header of the whole (counts summed) and the
    /// number of streams written.
    pub fn finish(mut self, rt: &tokio::runtime::Runtime) -> anyhow::Result<(TokenHeader, u64)> {
        let tokens = std::mem::take(&mut self.pending);
        match self.file.clone() {
            Some(name) => {
                let bytes = stream_bytes(&self.header, &tokens, self.pending_ends.len() as u64);
                let header = TokenHeader::decode(&name, &bytes)?.expect("a header").0;
                self.put(rt, &name, bytes)?;
                Ok((header, 1))
            }
            None => {
                if !tokens.is_empty() {
                    let docs = self.pending_ends.len() as u64;
                    self.shard(rt, &tokens, docs)?;
                }
                anyhow::ensure!(
                    !self.shards.is_empty(),
                    "--out {}: no tokens to write",
                    self.out
                );
                let index = ShardIndex {
                    format: crate::data::stream::INDEX_FORMAT.to_string(),
                    width: self.header.width,
                    vocab: self.header.vocab,
                    tokenizer_sha256: self.header.tokenizer_sha256.clone(),
                    eos: self.header.eos,
                    documents: self.shards.iter().map(|s| s.documents).sum(),
                    tokens: self.shards.iter().map(|s| s.tokens).sum(),
                    shards: self.shards.clone(),
                };
                let json = serde_json::to_vec_pretty(&index)?;
                self.put(rt, crate::data::stream::INDEX_NAME, json)?;
                let mut header = self.header.clone();
                header.documents = index.documents;
                header.tokens = index.tokens;
                Ok((header, self.shards.len() as u64))
            }
        }
    }
}

/// A stream's bytes: its header (with these counts and the tokens' SHA-256) and the tokens.
fn stream_bytes(base: &TokenHeader, tokens: &[u32], docs: u64) -> Vec<u8> {
    let mut body = Vec::with_capacity(tokens.len() * base.width as usize);
    for t in tokens {
        if base.width == 2 {
            body.extend_from_slice(&(*t as u16).to_le_bytes());
        } else {
            body.extend_from_slice(&t.to_le_bytes());
        }
    }
    let mut h = base.clone();
    h.documents = docs;
    h.tokens = tokens.len() as u64;
    h.sha256 = Some(hex(&sha2::Sha256::digest(&body)));
    // the header, then the body as made (what `TokenHeader::encode` writes)
    let json = serde_json::to_vec(&h).expect("a header serialises");
    let mut out = Vec::with_capacity(12 + json.len() + body.len());
    out.extend_from_slice(crate::data::TOKENS_MAGIC);
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    out.extend_from_slice(&body);
    out
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The process's peak resident memory in MiB (VmHWM), where /proc says.
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

/// Tokenize `inputs` into `out` (see the module's comment).
pub fn run(
    t: &TokenizerFile,
    eos: Option<u32>,
    inputs: &[String],
    field: &str,
    out: &str,
    shard_tokens: u64,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<Summary> {
    let vocab = t.tok.get_vocab_size(true) as u64;
    // the width holds the largest id, not the count: added tokens can sit past the count
    let largest = t
        .tok
        .get_vocab(true)
        .values()
        .copied()
        .max()
        .map_or(0, u64::from)
        .max(vocab.saturating_sub(1));
    let header = TokenHeader {
        width: if largest < 1 << 16 { 2 } else { 4 },
        vocab,
        tokenizer_sha256: t.sha256.clone(),
        eos,
        documents: 0,
        tokens: 0,
        sha256: None,
    };
    let mut sink = Sink::new(out, header, shard_tokens)?;
    let total: u64 = inputs
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .sum();
    let bar = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "tokenize {bar:30} {bytes}/{total_bytes} {msg} (eta {eta})",
            )
            .expect("a valid template"),
        );
        Some(b)
    } else {
        None
    };
    let t0 = std::time::Instant::now();
    let read = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (tx, rx) = std::sync::mpsc::sync_channel::<anyhow::Result<Vec<String>>>(2);
    let reader = {
        let (inputs, field, read) = (inputs.to_vec(), field.to_string(), read.clone());
        std::thread::spawn(move || {
            if let Err(e) = read_inputs(&inputs, &field, &tx, &read) {
                let _ = tx.send(Err(e));
            }
        })
    };
    let (mut docs, mut tokens, mut reported) = (0u64, 0u64, 0u64);
    let result: anyhow::Result<()> = (|| {
        for batch in rx {
            let batch = batch?;
            let n = batch.len() as u64;
            let (ids, ends) = encode(t, eos, batch)?;
            docs += n;
            tokens += ids.len() as u64;
            sink.add(rt, ids, ends)?;
            let done = read.load(std::sync::atomic::Ordering::Relaxed);
            let rate = tokens as f64 / t0.elapsed().as_secs_f64().max(1e-9);
            if let Some(b) = &bar {
                b.set_position(done);
                b.set_message(format!(
                    "{docs} documents, {tokens} tokens, {rate:.0} tokens/s"
                ));
            } else if done - reported >= 256 << 20 {
                reported = done;
                eprintln!(
                    "tokenize: {} of {} MiB, {docs} documents, {tokens} tokens, {rate:.0} tokens/s",
                    done >> 20,
                    total >> 20
                );
            }
        }
        Ok(())
    })();
    let _ = reader.join();
    result?;
    let (h, shards) = sink.finish(rt)?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let seconds = t0.elapsed().as_secs_f64();
    Ok(Summary {
        out: out.to_string(),
        documents: docs,
        tokens: h.tokens,
        shards,
        input_bytes: total,
        seconds,
        tokens_per_s: h.tokens as f64 / seconds.max(1e-9),
        peak_rss_mib: peak_rss_mib(),
        width: h.width,
        vocab: h.vocab,
        eos: h.eos,
        tokenizer_sha256: h.tokenizer_sha256,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("ductile-tokenize-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn tokenizer() -> TokenizerFile {
        let d = crate::model::llama_tests::fixtures();
        TokenizerFile::from_bytes(&std::fs::read(d.join("tokenizer.json")).unwrap()).unwrap()
    }

    const TEXTS: [&str; 4] = [
        "The quick brown fox jumps over the lazy dog.",
        "Ünïcödé and emoji 🦀 survive, as do \"quotes\" and\nnew lines.",
        "",
        "A last, longer document: elastic training keeps every sample exactly once per epoch.",
    ];

    /// Parquet written by pyarrow (as Hugging Face datasets ship it: snappy, other columns
    /// beside the text), from the test venv.
    fn parquet(path: &std::path::Path, texts: &[&str], column: &str) {
        let py = std::env::var("DUCTILE_TORCH_PYTHON")
            .expect("DUCTILE_TORCH_PYTHON is not set: run scripts/setup.sh --tests");
        let script = format!(
            "import json, sys, pyarrow as pa, pyarrow.parquet as pq\n\
             t = json.loads(sys.argv[2])\n\
             pq.write_table(pa.table({{'id': list(range(len(t))), '{column}': t}}), sys.argv[1], compression='snappy', row_group_size=2)\n"
        );
        let st = std::process::Command::new(py)
            .args([
                "-c",
                &script,
                path.to_str().unwrap(),
                &serde_json::to_string(texts).unwrap(),
            ])
            .status()
            .unwrap();
        assert!(st.success());
    }

    fn run_to(inputs: &[std::path::PathBuf], out: &str, per: u64) -> anyhow::Result<Summary> {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let inputs: Vec<String> = inputs.iter().map(|p| p.display().to_string()).collect();
        run(&tokenizer(), Some(0), &inputs, "text", out, per, &rt)
    }

    /// The same documents as `.txt` files, `.jsonl` lines and Parquet rows give the same
    /// stream; a second run gives identical bytes; shards, concatenated, are that stream.
    #[test]
    fn txt_jsonl_and_parquet_give_the_same_tokens_and_runs_repeat_bitwise() {
        let d = dir("same");
        let txt: Vec<std::path::PathBuf> = TEXTS
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let p = d.join(format!("{i}.txt"));
                std::fs::write(&p, t).unwrap();
                p
            })
            .collect();
        let jsonl = d.join("docs.jsonl");
        let lines: Vec<String> = TEXTS
            .iter()
            .map(|t| serde_json::json!({"text": t, "meta": 1}).to_string())
            .collect();
        std::fs::write(&jsonl, lines.join("\n") + "\n").unwrap();
        let pq = d.join("docs.parquet");
        parquet(&pq, &TEXTS, "text");
        let stream = |inputs: &[std::path::PathBuf], name: &str| {
            let out = format!("file://{}/{name}", d.display());
            let s = run_to(inputs, &out, 1 << 20).unwrap();
            assert_eq!(s.documents, 4);
            std::fs::read(d.join(name)).unwrap()
        };
        let a = stream(&txt, "a.tok");
        assert_eq!(stream(std::slice::from_ref(&jsonl), "b.tok"), a);
        assert_eq!(stream(std::slice::from_ref(&pq), "c.tok"), a);
        assert_eq!(
            stream(&txt, "d.tok"),
            a,
            "a second run gives the same bytes"
        );
        let (h, toks) = TokenHeader::decode("a", &a).unwrap().unwrap();
        let (ids, _) = encode(
            &tokenizer(),
            Some(0),
            TEXTS.iter().map(|t| t.to_string()).collect(),
        )
        .unwrap();
        assert_eq!(toks, ids);
        assert_eq!(h.documents, 4);
        // shards of 7 tokens: their tokens in index order are the stream's
        let out = format!("file://{}/shards/", d.display());
        let s = run_to(&[jsonl.clone(), pq.clone()], &out, 7).unwrap();
        let index: ShardIndex =
            serde_json::from_slice(&std::fs::read(d.join("shards/index.json")).unwrap()).unwrap();
        assert_eq!(index.shards.len() as u64, s.shards);
        assert_eq!(index.documents, 8);
        assert_eq!(index.shards.iter().map(|x| x.documents).sum::<u64>(), 8);
        let mut joined = Vec::new();
        for e in &index.shards {
            let b = std::fs::read(d.join("shards").join(&e.name)).unwrap();
            assert_eq!(b.len() as u64, e.bytes);
            let (h, t) = TokenHeader::decode(&e.name, &b).unwrap().unwrap();
            assert_eq!(h.sha256.as_deref(), Some(e.sha256.as_str()));
            assert!(t.len() == 7 || e.name == index.shards.last().unwrap().name);
            joined.extend(t);
        }
        assert_eq!(joined, [ids.clone(), ids].concat());
    }

    /// Bad input stops the run naming the file and the place.
    #[test]
    fn bad_input_is_refused_naming_file_and_place() {
        let d = dir("bad");
        let out = format!("file://{}/x.tok", d.display());
        let err = |name: &str, bytes: &[u8]| {
            let p = d.join(name);
            std::fs::write(&p, bytes).unwrap();
            format!("{:#}", run_to(&[p], &out, 1 << 20).unwrap_err())
        };
        let e = err("a.jsonl", b"{\"text\": \"ok\"}\n{\"body\": \"no text\"}\n");
        assert!(e.contains("a.jsonl:2: no string field \"text\""), "{e}");
        let e = err("b.jsonl", b"{\"text\": \"ok\"}\nnot json\n");
        assert!(e.contains("b.jsonl:2: not JSON"), "{e}");
        let e = err("c.txt", b"caf\xe9 latin-1");
        assert!(
            e.contains("c.txt: not UTF-8 text (invalid byte at offset 3)"),
            "{e}"
        );
        let e = err("d.jsonl", b"{\"text\": \"ok\"}\n{\"text\": \"\xff\"}\n");
        assert!(e.contains("d.jsonl:2: not UTF-8"), "{e}");
        let e = err("e.csv", b"a,b");
        assert!(e.contains("e.csv: not .txt"), "{e}");
        let pq = d.join("f.parquet");
        parquet(&pq, &["x"], "content");
        let e = format!("{:#}", run_to(&[pq], &out, 1 << 20).unwrap_err());
        assert!(
            e.contains("f.parquet: no column \"text\"") && e.contains("content"),
            "{e}"
        );
        assert!(!d.join("x.tok").exists(), "nothing written");
    }
}

//! `ductile-worker synth-data`: small synthetic datasets with a learnable structure, generated
//! locally (nothing is downloaded).

use tch::{Kind, Tensor};

use crate::data::mix;

/// A seeded Markov source over `vocab` tokens: each token has four likely successors, so a
/// model's loss falls well below log(vocab). `url` a file: a bare u16 stream (the quickstart's);
/// a prefix ending in `/`: shards of `shard_tokens` with their index (header: the vocabulary,
/// tokenizer "synthetic"), written as they are generated (memory: one shard).
pub fn tokens(url: &str, seed: u64, n: usize, vocab: u16, shard_tokens: u64) -> anyhow::Result<()> {
    let mut state = mix(seed);
    let mut next = |m: u64| {
        state = mix(state);
        state % m
    };
    let succ: Vec<[u16; 4]> = (0..vocab)
        .map(|_| [0; 4].map(|_| next(vocab as u64) as u16))
        .collect();
    let mut t = next(vocab as u64) as u16;
    let mut emit = |count: usize, out: &mut Vec<u32>| {
        for _ in 0..count {
            out.push(t as u32);
            // 90%: one of the four successors (weighted 4:3:2:1), else any token
            t = if next(10) < 9 {
                let r = next(10);
                succ[t as usize][if r < 4 {
                    0
                } else if r < 7 {
                    1
                } else if r < 9 {
                    2
                } else {
                    3
                }]
            } else {
                next(vocab as u64) as u16
            };
        }
    };
    if url.ends_with('/') {
        let rt = tokio::runtime::Runtime::new()?;
        let header = crate::data::TokenHeader {
            width: 2,
            vocab: vocab as u64,
            tokenizer_sha256: "synthetic".into(),
            eos: None,
            documents: 0,
            tokens: 0,
            sha256: None,
        };
        let mut sink = crate::tokenize::Sink::new(url, header, shard_tokens)?;
        let mut left = n;
        let mut buf = Vec::new();
        while left > 0 {
            let k = left.min(1 << 22);
            buf.clear();
            emit(k, &mut buf);
            sink.add(&rt, std::mem::take(&mut buf), vec![])?;
            left -= k;
        }
        sink.finish(&rt)?;
        return Ok(());
    }
    let mut toks = Vec::with_capacity(n);
    emit(n, &mut toks);
    let out: Vec<u8> = toks
        .iter()
        .flat_map(|t| (*t as u16).to_le_bytes())
        .collect();
    write(url, out)
}

/// A regression task from a seeded teacher network: y = tanh(x·W1)·W2 + noise.
pub fn regression(url: &str, seed: u64, n: i64, d_in: i64, d_out: i64) -> anyhow::Result<()> {
    tch::manual_seed(seed as i64);
    let x = Tensor::randn([n, d_in], (Kind::Float, tch::Device::Cpu));
    let w1 = Tensor::randn([d_in, 32], (Kind::Float, tch::Device::Cpu)) / (d_in as f64).sqrt();
    let w2 = Tensor::randn([32, d_out], (Kind::Float, tch::Device::Cpu)) / 32f64.sqrt();
    let y = x.matmul(&w1).tanh().matmul(&w2)
        + Tensor::randn([n, d_out], (Kind::Float, tch::Device::Cpu)) * 0.01;
    let tmp =
        std::env::temp_dir().join(format!("ductile-synth-{}.safetensors", std::process::id()));
    Tensor::write_safetensors(&[("x", &x), ("y", &y)], &tmp)
        .map_err(|e| anyhow::anyhow!("{}: {e}", tmp.display()))?;
    let bytes = std::fs::read(&tmp)?;
    let _ = std::fs::remove_file(&tmp);
    write(url, bytes)
}

/// Write through object_store: file:// or s3:// alike.
fn write(url: &str, bytes: Vec<u8>) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(ductile_checkpoint::store::write(url, bytes))
        .map_err(|e| anyhow::anyhow!("{e}"))
}

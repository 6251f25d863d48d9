//! `ductile-worker synth-data`: small synthetic datasets with a learnable structure, generated
//! locally (nothing is downloaded).

use tch::{Kind, Tensor};

use crate::data::mix;

/// A seeded Markov source over `vocab` tokens: each token has four likely successors, so a
/// model's loss falls well below log(vocab).
pub fn tokens(url: &str, seed: u64, n: usize, vocab: u16) -> anyhow::Result<()> {
    let mut state = mix(seed);
    let mut next = |m: u64| {
        state = mix(state);
        state % m
    };
    let succ: Vec<[u16; 4]> = (0..vocab)
        .map(|_| [0; 4].map(|_| next(vocab as u64) as u16))
        .collect();
    let mut t = next(vocab as u64) as u16;
    let mut out = Vec::with_capacity(n * 2);
    for _ in 0..n {
        out.extend_from_slice(&t.to_le_bytes());
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

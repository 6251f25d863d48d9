//! `ductile-bench checkpoint`: a state of `--mib` MiB of f32 tensors (tch), saved and restored
//! through the checkpoint crate, against the plain operations on the same bytes and server:
//!
//! - stall: the training-side cost of a save (layout + copy into the reused host buffer),
//!   against copying the state into host memory (a fresh buffer, and a preallocated one);
//! - upload: `write_shard` (multipart, part size and concurrency as the job's defaults, CRC32C
//!   per chunk) against object_store's plain `WriteMultipart` of the same bytes;
//! - restore: `fetch` of every chunk (ranged GETs, CRC check) against plain reads of the same
//!   byte ranges: object_store's `get_ranges`, and one GET per range with 8 in flight. The
//!   three run in an order that rotates with the iteration; the reference is the plain method
//!   with the lower median time.
//!
//! It starts moto (S3) and etcd itself; `--store file` uses a local directory instead.

use std::time::Instant;

use bytes::Bytes;
use ductile_checkpoint::format::{Dtype, TensorKind, TensorMeta};
use ductile_checkpoint::restore::{fetch, load_manifest};
use ductile_checkpoint::save::{gather_and_commit, write_shard, CommitInput, ShardLayout};
use ductile_checkpoint::{plan, Bucket, UploadOptions};
use ductile_cluster::records::*;
use ductile_cluster::{Keys, Store};
use futures_util::{StreamExt, TryStreamExt};
use object_store::{ObjectStoreExt, WriteMultipart};
use tch::{Kind, Tensor};

use crate::median;

pub async fn run(mib: u64, stores: &[String], iters: usize) -> anyhow::Result<()> {
    let dir = ductile_tests::TempDir::new("bench-ckpt");
    let etcd = ductile_tests::Etcd::start(dir.path());
    let kv =
        ductile_cluster::connect_etcd(&etcd.endpoint, std::time::Duration::from_secs(10)).await?;
    let store = Store::new(kv, Keys::new("/bench/v1"));
    // the state: tensors of 4096 × 4096 f32 (64 MiB), plus one remainder
    tch::set_num_threads(1);
    let rows = ((mib << 20) / 4 / 4096) as i64;
    let tensors: Vec<Tensor> = (0..(rows + 4095) / 4096)
        .map(|i| {
            let r = (rows - i * 4096).min(4096);
            Tensor::rand([r, 4096], (Kind::Float, tch::Device::Cpu))
        })
        .collect();
    let metas: Vec<TensorMeta> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| TensorMeta {
            name: format!("layers.{i}.weight"),
            dtype: Dtype::F32,
            shape: t.size().iter().map(|d| *d as u64).collect(),
            kind: TensorKind::Parameter,
        })
        .collect();
    let bytes: u64 = metas.iter().map(|m| m.bytes()).sum();
    println!(
        "checkpoint bench: {} tensors, {:.2} GiB of f32 state, {iters} timed iterations (median), one writer, part size 64 MiB, 4 parts in flight",
        metas.len(),
        bytes as f64 / (1u64 << 30) as f64
    );

    // stall
    let layout = ShardLayout::new(&metas, 1, 0);
    let mut buf: Vec<u8> = Vec::new();
    let (mut ours, mut fresh, mut pre) = (vec![], vec![], vec![]);
    let mut prealloc = vec![0u8; bytes as usize];
    for i in 0..iters + 1 {
        let t0 = Instant::now();
        let layout = ShardLayout::new(&metas, 1, 0);
        layout.prepare(&mut buf);
        for p in &layout.placed {
            let t = tensors[p.tensor].narrow(0, p.row as i64, p.rows as i64);
            let n = t.numel();
            t.copy_data_u8(&mut buf[p.start as usize..p.end as usize], n);
        }
        let a = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let mut v = Vec::<u8>::with_capacity(bytes as usize);
        for t in &tensors {
            let n = t.numel();
            let at = v.len();
            v.resize(at + n * 4, 0);
            t.copy_data_u8(&mut v[at..], n);
        }
        let b = t0.elapsed().as_secs_f64();
        drop(v);
        let t0 = Instant::now();
        let mut at = 0;
        for t in &tensors {
            let n = t.numel();
            t.copy_data_u8(&mut prealloc[at..at + n * 4], n);
            at += n * 4;
        }
        let c = t0.elapsed().as_secs_f64();
        if i > 0 {
            ours.push(a);
            fresh.push(b);
            pre.push(c);
        }
    }
    drop(prealloc);
    let (s, f, p) = (median(&mut ours), median(&mut fresh), median(&mut pre));
    println!(
        "stall: save copy {:.1} ms | copy into a fresh host buffer {:.1} ms (ratio {:.2}, goal ≤ 1.5) | into a preallocated one {:.1} ms (ratio {:.2})",
        s * 1e3,
        f * 1e3,
        s / f,
        p * 1e3,
        s / p
    );

    let data = Bytes::from(buf);
    for kind in stores {
        let (url, _s3) = match kind.as_str() {
            "s3" => {
                let s3 = ductile_tests::S3::start(dir.path());
                for (k, v) in s3.env() {
                    std::env::set_var(k, v);
                }
                (format!("s3://{}/bench", s3.bucket), Some(s3))
            }
            "file" => (format!("file://{}/ckpt", dir.path().display()), None),
            other => anyhow::bail!("unknown store {other:?} (s3, file)"),
        };
        let bucket = Bucket::open(&url)?;
        let opts = UploadOptions::default();
        let (mut up_ours, mut up_plain, mut rd_ours, mut rd_plain, mut rd_plain2) =
            (vec![], vec![], vec![], vec![], vec![]);
        let job = format!("bench-{kind}");
        let job = job.as_str();
        for i in 0..iters {
            let generation = 1;
            let step = i as u64 + 1;
            put_generation(&store, job, generation).await?;
            // ours: multipart with CRC, report, commit
            let t0 = Instant::now();
            write_shard(
                &store,
                &bucket,
                job,
                step,
                generation,
                &metas,
                &layout,
                data.clone(),
                opts,
            )
            .await?;
            let a = t0.elapsed().as_secs_f64();
            let rec = gather_and_commit(
                &store,
                &bucket,
                CommitInput {
                    job,
                    step,
                    generation,
                    world: 1,
                    layout: Layout::data_parallel(1),
                    tensors: &metas,
                    extra: serde_json::json!({}),
                    conditional_create: false,
                    request: None,
                    wait: std::time::Duration::from_secs(60),
                },
            )
            .await?;
            // plain: object_store's multipart writer, same part size
            let key = bucket.path(&format!("plain/{step}.bin"));
            let t0 = Instant::now();
            let up = bucket.store.put_multipart(&key).await?;
            let mut w = WriteMultipart::new_with_chunk_size(up, opts.part_size);
            for chunk in data.chunks(opts.part_size) {
                w.wait_for_capacity(opts.concurrency).await?;
                w.put(Bytes::copy_from_slice(chunk));
            }
            w.finish().await?;
            let b = t0.elapsed().as_secs_f64();
            // restore: ours (every chunk, verified) and the two plain reads of the same bytes,
            // in an order that rotates with the iteration so none always runs first
            let m = load_manifest(&bucket, &rec).await?;
            let all = plan::readers(&m, 1).remove(0);
            let shard = format!(
                "{}/{}",
                ductile_checkpoint::format::attempt_dir(step, generation),
                layout.object
            );
            let ranges: Vec<std::ops::Range<u64>> = m
                .ordered()
                .flat_map(|(_, t)| t.chunks.iter().map(|c| c.byte_range[0]..c.byte_range[1]))
                .collect();
            let mut took = [0.0f64; 3];
            for k in 0..3 {
                let which = (k + i) % 3;
                let t0 = Instant::now();
                let got: Vec<Bytes> =
                    match which {
                        0 => fetch(&bucket, &m, &all, 8).await?,
                        // plain 1: object_store's get_ranges (it coalesces adjacent ranges)
                        1 => bucket.get_ranges(&shard, &ranges).await?,
                        // plain 2: one GET per range, 8 in flight, no check
                        _ => {
                            futures_util::stream::iter(ranges.iter().cloned())
                                .map(|r| {
                                    let (b, k) = (bucket.clone(), shard.clone());
                                    async move {
                                        b.get_ranges(&k, &[r]).await.map(|mut v| v.pop().unwrap())
                                    }
                                })
                                .buffered(8)
                                .try_collect()
                                .await?
                        }
                    };
                took[which] = t0.elapsed().as_secs_f64();
                assert_eq!(got.iter().map(|b| b.len() as u64).sum::<u64>(), bytes);
            }
            up_ours.push(a);
            up_plain.push(b);
            rd_ours.push(took[0]);
            rd_plain.push(took[1]);
            rd_plain2.push(took[2]);
            let _ = bucket.delete(&format!("plain/{step}.bin")).await;
            let _ = ductile_checkpoint::retention::retain(
                &bucket,
                1,
                std::time::Duration::ZERO,
                Some(&rec),
                None,
            )
            .await;
        }
        let gb = bytes as f64 / 1e9;
        let (a, b, c, d) = (
            median(&mut up_ours),
            median(&mut up_plain),
            median(&mut rd_ours),
            // the faster plain method, by its median
            median(&mut rd_plain).min(median(&mut rd_plain2)),
        );
        println!(
            "{kind}: upload {:.2} GB/s vs plain multipart {:.2} GB/s (ratio {:.2}, goal ≥ 0.9) | restore {:.2} GB/s vs plain ranged GETs {:.2} GB/s (the faster of get_ranges and per-chunk GETs; ratio {:.2}, goal ≥ 0.9)",
            gb / a,
            gb / b,
            b / a,
            gb / c,
            gb / d,
            d / c
        );
    }
    Ok(())
}

async fn put_generation(store: &Store, job: &str, number: u64) -> anyhow::Result<()> {
    let g = Generation {
        world_size: 1,
        ..Generation::data_parallel(job, number, &[])
    };
    store
        .put_json(&store.keys.generation(job), &g, None)
        .await?;
    Ok(())
}

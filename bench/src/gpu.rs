//! GPU benchmarks: `nccl` (NCCL communicator lifecycle and all-reduce, plus the self-test of
//! every collective on CUDA tensors for NCCL and for the TCP backend's host staging) and
//! `gpu-step` (the elastic loop's CUDA step against a bare tch loop, and the checkpoint stall
//! against one pinned device→host copy). On a machine without a GPU (or a build without the
//! `cuda` feature) each says what it skipped and exits 0.

use std::time::Instant;

use tch::{Device, Kind, Tensor};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Why CUDA cannot be benchmarked here, if it cannot.
pub fn gpu_missing() -> Option<String> {
    if !tch::Cuda::is_available() {
        return Some(
            "no CUDA device is usable by libtorch here (no GPU, or a CPU libtorch)".into(),
        );
    }
    None
}

#[cfg(not(feature = "cuda"))]
pub async fn nccl(_iters: usize, _sizes: &[u64]) -> anyhow::Result<()> {
    println!("nccl: skipped: this ductile-bench was built without the cuda feature (cargo build --release -p ductile-bench --features cuda)");
    if let Some(why) = gpu_missing() {
        println!("nccl: (and {why})");
    }
    Ok(())
}

#[cfg(feature = "cuda")]
pub async fn nccl(iters: usize, sizes: &[u64]) -> anyhow::Result<()> {
    use ductile_cluster::{memory::MemoryBackend, Keys, Store};
    use ductile_comm::nccl::{available, NcclComm};
    use ductile_comm::{Communicator, ReduceOp, Rendezvous};
    use std::sync::Arc;
    use std::time::Duration;

    if let Some(why) = gpu_missing() {
        println!("nccl: skipped: {why}");
        return Ok(());
    }
    if let Err(e) = available() {
        println!("nccl: skipped: {e}");
        return Ok(());
    }
    let lib = ductile_comm::nccl::nccl().map_err(anyhow::Error::msg)?;
    println!(
        "nccl: NCCL {} from {} (the copy libtorch loaded; copies mapped: {:?})",
        lib.version,
        lib.path,
        ductile_comm::nccl::mapped_copies()
    );
    let store = Store::new(Arc::new(MemoryBackend::new()), Keys::default());
    let timeout = Duration::from_secs(60);
    let mut gen = 0u64;
    let mut form = |store: &Store| {
        gen += 1;
        let (store, g) = (store.clone(), gen);
        async move {
            store.ensure_mesh_key("bench", g).await?;
            let rdv = Rendezvous::new(store, "bench", g, 1, 0).unwrap();
            let t0 = Instant::now();
            let cfg = ductile_comm::TcpConfig {
                form_timeout: timeout,
                ..Default::default()
            };
            let c = NcclComm::form(&rdv, 0, cfg, false).await?;
            anyhow::Ok((c, t0.elapsed().as_secs_f64()))
        }
    };
    let (first, first_s) = form(&store).await?;
    println!("nccl: first init {:.3} s", first_s);
    // correctness first: every collective on CUDA tensors against its reference
    let first = Arc::new(first);
    let c2: Arc<dyn Communicator> = first.clone();
    let r = tokio::task::spawn_blocking(move || {
        ductile_comm::selftest::all(&c2)?;
        ductile_comm::selftest::ordered(c2.as_ref(), 7, 100_003).map(|_| ())
    })
    .await?;
    match &r {
        Ok(()) => println!("nccl: conformance suite on CUDA tensors (world 1: f32, f64, f16, bf16; all-reduce sum/avg, in place, broadcast, all-gather, reduce-scatter, barrier, groups, the host face over TCP, ordered; exchanges need two ranks: TCP in CI): ok"),
        Err(e) => println!("nccl: self-test on CUDA tensors FAILED: {e}"),
    }
    // NCCL's own teardown cost, inline (what ductile keeps off the re-formation's path)
    let mut aborts = Vec::new();
    let mut reinits = Vec::new();
    for _ in 0..iters {
        let (c, s) = form(&store).await?;
        reinits.push(s);
        let t0 = Instant::now();
        c.abort_blocking();
        aborts.push(t0.elapsed().as_secs_f64());
    }
    // ductile's re-formation: abort (torn down in the background) then form the next
    // generation and complete its first all-reduce
    let mut reform = Vec::new();
    let mut cur = form(&store).await?.0;
    for _ in 0..iters {
        let t0 = Instant::now();
        cur.abort();
        let (next, _) = form(&store).await?;
        let next = tokio::task::spawn_blocking(move || {
            let mut t = next.place(&Tensor::ones([1024], (Kind::Float, Device::Cuda(0))));
            next.all_reduce(&mut t, ReduceOp::Sum).map(|_| next)
        })
        .await??;
        reform.push(t0.elapsed().as_secs_f64());
        cur = next;
    }
    println!(
        "nccl: re-init (median of {iters}) {:.1} ms; ncclCommAbort inline (median) {:.3} s; abort + re-init + first all-reduce, ductile's path (median) {:.1} ms [min {:.1}, max {:.1}]",
        median(reinits) * 1e3,
        median(aborts.clone()),
        median(reform.clone()) * 1e3,
        reform.iter().cloned().fold(f64::INFINITY, f64::min) * 1e3,
        reform.iter().cloned().fold(0.0, f64::max) * 1e3,
    );
    let cur = Arc::new(cur);
    for &mib in sizes {
        let c = cur.clone();
        let (t, n) = tokio::task::spawn_blocking(move || -> anyhow::Result<(f64, i64)> {
            let n = (mib << 20) as i64 / 4;
            let mut x = c.place(&Tensor::ones([n], (Kind::Float, Device::Cuda(0))));
            c.all_reduce(&mut x, ReduceOp::Sum)?;
            let mut ts = Vec::new();
            for _ in 0..iters.max(5) {
                let t0 = Instant::now();
                c.all_reduce(&mut x, ReduceOp::Sum)?;
                ts.push(t0.elapsed().as_secs_f64());
            }
            Ok((median(ts), n))
        })
        .await??;
        let world = cur.world() as f64;
        let bytes = (n * 4) as f64;
        if cur.world() == 1 {
            // in place at world 1 NCCL moves no data: the time is the call's own cost
            println!(
                "nccl: all-reduce world 1 {mib:>4} MiB: {:>9.1} µs (in place, world 1: no data moves; busbw 0 by definition)",
                t * 1e6
            );
        } else {
            println!(
                "nccl: all-reduce world {} {mib:>4} MiB: {:>9.1} µs, algbw {:>7.1} GB/s, busbw {:>7.1} GB/s",
                cur.world(),
                t * 1e6,
                bytes / t / 1e9,
                bytes / t / 1e9 * 2.0 * (world - 1.0) / world
            );
        }
    }
    // the TCP backend on CUDA tensors: host staging through pinned buffers
    let tcp_store = store.clone();
    let r2 = {
        tcp_store.ensure_mesh_key("bench-tcp", 1).await?;
        let rdv = Rendezvous::new(tcp_store, "bench-tcp", 1, 1, 0)?;
        let comm = ductile_comm::TcpComm::form(
            &rdv,
            ductile_comm::TcpConfig {
                bind_host: "127.0.0.1".into(),
                advertise_host: "127.0.0.1".into(),
                device: Device::Cuda(0),
                ..Default::default()
            },
        )
        .await?;
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        tokio::task::spawn_blocking(move || ductile_comm::selftest::all(&comm)).await?
    };
    match &r2 {
        Ok(()) => {
            println!("nccl: TCP backend on CUDA tensors (pinned host staging), self-test: ok")
        }
        Err(e) => println!("nccl: TCP backend on CUDA tensors self-test FAILED: {e}"),
    }
    if r.is_err() || r2.is_err() {
        anyhow::bail!("a self-test failed");
    }
    Ok(())
}

/// One pinned device→host copy of `bytes`, median of `iters` (the floor of a checkpoint stall),
/// and the same copy into pageable memory.
pub fn d2h_copies(bytes: i64, iters: usize) -> (f64, f64) {
    let n = bytes / 4;
    let src = Tensor::ones([n], (Kind::Float, Device::Cuda(0)));
    let pinned = Tensor::empty([n], (Kind::Float, Device::Cpu)).pin_memory(Device::Cuda(0));
    let mut pageable = Tensor::empty([n], (Kind::Float, Device::Cpu));
    let mut p = pinned.shallow_clone();
    let mut tp = Vec::new();
    let mut tq = Vec::new();
    for _ in 0..iters {
        tch::Cuda::synchronize(0);
        let t0 = Instant::now();
        p.copy_(&src);
        tch::Cuda::synchronize(0);
        tp.push(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        pageable.copy_(&src);
        tq.push(t0.elapsed().as_secs_f64());
    }
    (median(tp), median(tq))
}

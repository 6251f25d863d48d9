//! Training benchmarks.
//!
//! `ductile-bench recovery`: 4 CPU workers train a GPT; SIGKILL a worker (or an agent) and
//! measure the time to the first completed step of the new generation; SIGSTOP a worker (alive
//! but stuck) and measure when the leader excluded it and when the survivors stepped again.
//! `ductile-bench dp-step`: step time of the elastic loop (the real worker under the control
//! plane) against a bare tch loop doing the same forward, backward and all-reduce.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ductile_cluster::records::{now_ms, Generation, TrainingSpec};

use ductile_comm::{Communicator, ReduceOp};
use ductile_tests::*;

use crate::median;

fn job(name: &str, data: &str, extra: &str) -> String {
    format!(
        "{}max_steps = 1000000\n{extra}",
        training_toml(name, 1, 4, 4, "gpt", data, "restart_budget = 1000")
    )
}

/// Samples/s of job "bench" from `n` distinct progress reports past step `after` (fewer when
/// `limit` passes first).
pub(crate) async fn throughput(c: &Cluster, after: u64, n: usize, limit: Duration) -> Vec<f64> {
    let (mut sps, mut last, t0) = (Vec::new(), 0, Instant::now());
    while sps.len() < n && t0.elapsed() < limit {
        let v = c.status("bench");
        if let Some(s) = v.samples_per_sec {
            if v.step != last && v.step > after {
                sps.push(s);
                last = v.step;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    sps
}

pub(crate) async fn first_step(c: &Cluster, g: u64) -> u64 {
    let store = c.store().await;
    loop {
        if let Ok(Some(kv)) = store.backend.get(&store.keys.first_step("bench", g)).await {
            return String::from_utf8_lossy(&kv.value).parse().unwrap();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Generation `n` of the bench job, from its history (waiting up to 60 s).
pub(crate) async fn generation(c: &Cluster, n: u64) -> anyhow::Result<Generation> {
    let store = c.store().await;
    let t0 = Instant::now();
    loop {
        if let Some((g, _)) = store
            .get_json::<Generation>(&store.keys.history_entry("bench", n), "generation")
            .await?
        {
            return Ok(g);
        }
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(60),
            "generation {n} was not published within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub async fn recovery(rounds: usize, node_rounds: usize, stop_rounds: usize) -> anyhow::Result<()> {
    let mut c = Cluster::start(Spec {
        restart_backoff_ms: 3000,
        lease_ttl: 2,
        ..Spec::default().agents(2, 2)
    });
    let data = synth(c.dir.path(), "tokens", 200_000);
    c.submit(&job("bench", &data, ""));
    let mut worker = Vec::new();
    for round in 0..rounds {
        let v = c.wait_world("bench", 4, Duration::from_secs(60));
        let g = v.generation;
        first_step(&c, g).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let victim = v.members[round % 4].pid.unwrap();
        let t0 = now_ms();
        unsafe { libc::kill(victim as i32, libc::SIGKILL) };
        let t1 = first_step(&c, g + 1).await;
        let s = (t1 - t0) as f64 / 1000.0;
        println!(
            "worker kill {round}: first step of generation {} after {s:.3} s",
            g + 1
        );
        worker.push(s);
    }
    let mut node = Vec::new();
    for round in 0..node_rounds {
        let v = c.wait_world("bench", 4, Duration::from_secs(60));
        let g = v.generation;
        first_step(&c, g).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let name = format!("node{}", 1 + round % 2);
        let t0 = now_ms();
        c.agents.get_mut(&name).unwrap().kill();
        let t1 = first_step(&c, g + 1).await;
        let s = (t1 - t0) as f64 / 1000.0;
        println!("agent kill {round} ({name}): first step of generation {} after {s:.3} s (lease TTL {} s)", g + 1, c.spec.lease_ttl);
        node.push(s);
        c.agents.get_mut(&name).unwrap().restart();
    }
    // alive but stuck: SIGSTOP a worker; its peers find it silent (no heartbeat), report it,
    // and the leader excludes it
    let mut stop_excluded = Vec::new();
    let mut stop_first = Vec::new();
    for round in 0..stop_rounds {
        let v = c.wait_world("bench", 4, Duration::from_secs(90));
        let g = v.generation;
        first_step(&c, g).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let victim = v.members[(round + 1) % 4].pid.unwrap();
        let t0 = now_ms();
        unsafe { libc::kill(victim as i32, libc::SIGSTOP) };
        let tp = generation(&c, g + 1).await?.published_at_ms;
        let t1 = first_step(&c, g + 1).await;
        unsafe { libc::kill(victim as i32, libc::SIGCONT) };
        let (e, s) = (
            tp.saturating_sub(t0) as f64 / 1000.0,
            (t1 - t0) as f64 / 1000.0,
        );
        println!(
            "worker SIGSTOP {round}: excluded (generation {} published) after {e:.3} s, its first step after {s:.3} s",
            g + 1
        );
        stop_excluded.push(e);
        stop_first.push(s);
    }
    if stop_rounds > 0 {
        println!("\nrecovery, 4 CPU workers: worker SIGSTOP → excluded median {:.3} s (max {:.3}), first step of the new generation median {:.3} s over {stop_rounds} (liveness timeout {} ms)",
            median(&mut stop_excluded.clone()), stop_excluded.iter().cloned().fold(0.0, f64::max), median(&mut stop_first),
            ductile_comm::TcpConfig::from_env().liveness_timeout.as_millis());
    }
    println!("\nrecovery, 4 CPU workers: worker SIGKILL → first step of the new generation median {:.3} s over {rounds}; lost node median {:.3} s over {node_rounds} (TTL {} s)", median(&mut worker), median(&mut node), c.spec.lease_ttl);
    Ok(())
}

pub async fn dp_step(steps: u64) -> anyhow::Result<()> {
    let dir = TempDir::new("dpstep");
    // the elastic loop: the real thing, uninterrupted
    let c = Cluster::start(Spec::default().agents(2, 2));
    let data = synth(dir.path(), "tokens", 200_000);
    c.submit(&job("bench", &data, ""));
    c.wait_world("bench", 4, Duration::from_secs(60));
    let sps = throughput(&c, 40, 12, Duration::from_secs(600)).await;
    anyhow::ensure!(
        !sps.is_empty(),
        "the job reported no throughput:\n{}",
        c.logs()
    );
    let elastic_ms = 32.0 / median(&mut sps.clone()) * 1000.0;
    drop(c);
    // the bare loop: same model, data and all-reduce, no control plane
    let etcd = Etcd::start(dir.path());
    let exe = std::env::current_exe()?;
    let children: Vec<_> = (0..4)
        .map(|r| {
            Command::new(&exe)
                .args([
                    "dp-bare-rank",
                    &etcd.endpoint,
                    &data,
                    &r.to_string(),
                    &steps.to_string(),
                ])
                .stdout(Stdio::piped())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let mut bare = Vec::new();
    for ch in children {
        let out = ch.wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        bare.push(
            text.trim()
                .parse::<f64>()
                .map_err(|_| anyhow::anyhow!("bare rank printed {text:?}"))?,
        );
    }
    let bare_ms = bare[0];
    println!("dp-step, GPT (d_model 64, 2 layers), global batch 32, 4 CPU workers: elastic loop {elastic_ms:.2} ms/step, bare tch loop {bare_ms:.2} ms/step, ratio {:.3}", elastic_ms / bare_ms);
    Ok(())
}

/// One step of a bare loop (no control plane): forward and backward on `idx` (on the
/// parameters' device), the flat gradient and the loss all-reduced, the loss read once, the
/// update applied.
#[allow(clippy::too_many_arguments)]
fn bare_step(
    model: &ductile_worker::model::Model,
    params: &[tch::Tensor],
    opt: &mut ductile_worker::optim::Optimizer,
    data: &ductile_worker::data::Dataset,
    idx: &[u64],
    gb: u64,
    comm: &dyn Communicator,
    lr: f64,
    step: u64,
) -> anyhow::Result<()> {
    let dev = params[0].device();
    for p in params {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    let (x, y) = data.batch(idx);
    let loss = model.loss_sum(&x.to_device(dev), &y.to_device(dev)) / gb as f64;
    loss.backward();
    let mut parts: Vec<tch::Tensor> = params.iter().map(|p| p.grad().reshape([-1])).collect();
    parts.push(loss.detach().reshape([1]).to_kind(tch::Kind::Float));
    let mut flat = comm.place(&tch::Tensor::cat(&parts, 0).contiguous());
    comm.all_reduce(&mut flat, ReduceOp::Sum)?;
    let flat = flat.into_tensor();
    let _ = flat.double_value(&[flat.size()[0] - 1]);
    let mut grads = Vec::new();
    let mut at = 0;
    for p in params {
        let k = p.numel() as i64;
        grads.push(flat.narrow(0, at, k).view(p.size().as_slice()));
        at += k;
    }
    ductile_worker::optim::Optimizer::step(
        opt,
        params,
        &grads,
        ductile_cluster::recipe::LrPlan::new(lr, None, None).at(step),
        step,
    );
    Ok(())
}

/// One rank of the bare loop: prints its mean ms per step (after 20 warm-up steps).
pub async fn dp_bare_rank(etcd: &str, data: &str, rank: u32, steps: u64) -> anyhow::Result<()> {
    let comm = crate::allreduce::form_loopback(etcd, "/bench-dp", 1, 4, rank).await?;
    let spec: TrainingSpec = serde_json::from_value(
        serde_json::json!({"model": "gpt", "dataset": data, "global_batch": 32, "lr": 3e-3, "seed": 7}),
    )?;
    let rt = tokio::runtime::Handle::current();
    let ms = tokio::task::spawn_blocking(move || -> anyhow::Result<f64> {
        use ductile_worker::{data::*, model::*, optim::*};
        tch::set_num_threads(1);
        let data = Dataset::open(&spec.dataset, spec.model, ctx(&spec), &rt)?;
        let model = Model::new(&spec, &data, tch::Device::Cpu)?;
        let params: Vec<tch::Tensor> = model.params().into_iter().map(|(_, t)| t).collect();
        let mut opt = Optimizer::new(&spec.optimizer, &params);
        let mut order = Order::new(data.len(), 7);
        let share = ductile_strategies::split_batch(32, 4)[rank as usize];
        let mut times = Vec::new();
        for step in 0..steps {
            let t0 = Instant::now();
            let idx: Vec<u64> = (share.start..share.start + share.len)
                .map(|p| order.sample(step * 32 + p))
                .collect();
            bare_step(
                &model, &params, &mut opt, &data, &idx, 32, &comm, 3e-3, step,
            )?;
            if step >= 20 {
                times.push(t0.elapsed().as_secs_f64() * 1000.0);
            }
        }
        // a mean, like the elastic loop's throughput over its reporting windows
        Ok(times.iter().sum::<f64>() / times.len() as f64)
    })
    .await??;
    println!("{ms:.3}");
    Ok(())
}

/// `gpu-step`: the elastic loop on `cuda:0` (the real worker under the control plane, NCCL,
/// world 1) against a bare tch CUDA loop doing the same forward, backward, all-reduce and
/// update; then the checkpoint stall the worker reported against one pinned device→host copy
/// of the same bytes. Without a GPU it says what it skipped.
pub async fn gpu_step(steps: u64) -> anyhow::Result<()> {
    if let Some(why) = crate::gpu::gpu_missing() {
        println!("gpu-step: skipped: {why}");
        return Ok(());
    }
    if !cfg!(feature = "cuda") {
        println!("gpu-step: skipped: this ductile-bench was built without the cuda feature");
        return Ok(());
    }
    let model = "[training.model_config]\nd_model = 512\nn_layer = 6\nn_head = 8\nctx = 128\n";
    let gb = 32u64;
    let dir = TempDir::new("gpustep");
    let mut c = Cluster::start(Spec {
        s3: false,
        ..Spec::default()
    });
    c.start_agent("gpu0", 1, &["--gpus", "0"]);
    let data = synth(dir.path(), "tokens", 2_000_000);
    let ckdir = dir.path().join("ckpt");
    let spec = format!(
        "name = \"bench\"\nmin = 1\nmax = 1\ndesired = 1\nrestart_budget = 10\n[training]\nmodel = \"gpt\"\ndataset = \"{data}\"\nglobal_batch = {gb}\nlr = 3e-4\nseed = 7\nmax_steps = 1000000\ncomm = \"nccl\"\n{model}[checkpoint]\nurl = \"file://{}\"\ninterval = 100\nkeep = 2\n",
        ckdir.display()
    );
    c.submit(&spec);
    c.wait_world("bench", 1, Duration::from_secs(120));
    let sps = throughput(&c, 30, 10, Duration::from_secs(300)).await;
    anyhow::ensure!(
        !sps.is_empty(),
        "the GPU job reported no throughput:\n{}",
        c.logs()
    );
    let elastic_ms = gb as f64 / median(&mut sps.clone()) * 1000.0;
    // the worker's own checkpoint figures
    let store = c.store().await;
    let stats: Option<ductile_cluster::records::CheckpointStats> = store
        .get_json(&store.keys.checkpoint_stats("bench"), "stats")
        .await
        .ok()
        .flatten()
        .map(|(s, _)| s);
    drop(c);
    // the bare loop, in this process: the same model and data, NCCL world 1
    let spec: TrainingSpec = serde_json::from_value(serde_json::json!({
        "model": "gpt", "dataset": data, "global_batch": gb, "lr": 3e-4, "seed": 7,
        "model_config": {"d_model": 512, "n_layer": 6, "n_head": 8, "ctx": 128}
    }))?;
    let rt = tokio::runtime::Handle::current();
    let comm = bare_nccl().await?;
    let (bare_ms, state_bytes) =
        tokio::task::spawn_blocking(move || -> anyhow::Result<(f64, i64)> {
            use ductile_worker::{data::*, model::*, optim::*};
            let dev = tch::Device::Cuda(0);
            let data = Dataset::open(&spec.dataset, spec.model, ctx(&spec), &rt)?;
            let model = Model::new(&spec, &data, dev)?;
            let params: Vec<tch::Tensor> = model.params().into_iter().map(|(_, t)| t).collect();
            let mut opt = Optimizer::new(&spec.optimizer, &params);
            let bytes: i64 = params
                .iter()
                .chain(opt.state.iter())
                .map(|t| t.numel() as i64 * 4)
                .sum();
            let mut order = Order::new(data.len(), 7);
            let mut times = Vec::new();
            for step in 0..steps {
                let t0 = Instant::now();
                let idx: Vec<u64> = (0..gb).map(|p| order.sample(step * gb + p)).collect();
                bare_step(
                    &model, &params, &mut opt, &data, &idx, gb, &comm, 3e-4, step,
                )?;
                tch::Cuda::synchronize(0);
                if step >= 20 {
                    times.push(t0.elapsed().as_secs_f64() * 1000.0);
                }
            }
            staging_breakdown(&params, &opt.state);
            Ok((times.iter().sum::<f64>() / times.len() as f64, bytes))
        })
        .await??;
    println!("gpu-step, GPT (d_model 512, 6 layers, ctx 128), global batch {gb}, 1 worker on cuda:0 (NCCL): elastic loop {elastic_ms:.2} ms/step, bare tch CUDA loop {bare_ms:.2} ms/step, ratio {:.3} (goal <= 1.03)", elastic_ms / bare_ms);
    let (pinned_s, pageable_s) =
        tokio::task::spawn_blocking(move || crate::gpu::d2h_copies(state_bytes, 5)).await?;
    let mib = state_bytes as f64 / (1 << 20) as f64;
    println!(
        "gpu-step: state {mib:.1} MiB: one pinned device->host copy {:.2} ms ({:.1} GB/s), pageable {:.2} ms ({:.1} GB/s)",
        pinned_s * 1e3,
        state_bytes as f64 / pinned_s / 1e9,
        pageable_s * 1e3,
        state_bytes as f64 / pageable_s / 1e9
    );
    match stats {
        Some(s) if s.last_stall_ms > 0.0 => println!(
            "gpu-step: checkpoint stall {:.2} ms = {:.2}x the pinned copy (goal <= 1.5); staging bandwidth {:.1} GB/s = {:.2}x pinned (goal >= 0.8)",
            s.last_stall_ms,
            s.last_stall_ms / (pinned_s * 1e3),
            state_bytes as f64 / (s.last_stall_ms / 1e3) / 1e9,
            pinned_s * 1e3 / s.last_stall_ms
        ),
        _ => println!("gpu-step: no checkpoint committed during the run (stall not measured)"),
    }
    Ok(())
}

#[cfg(feature = "cuda")]
async fn bare_nccl() -> anyhow::Result<ductile_comm::nccl::NcclComm> {
    use ductile_cluster::{memory::MemoryBackend, Keys, Store};
    let store = Store::new(std::sync::Arc::new(MemoryBackend::new()), Keys::default());
    store.ensure_mesh_key("bare", 1).await?;
    let rdv = ductile_comm::Rendezvous::new(store, "bare", 1, 1, 0)?;
    let cfg = ductile_comm::TcpConfig {
        form_timeout: Duration::from_secs(60),
        ..Default::default()
    };
    Ok(ductile_comm::nccl::NcclComm::form(&rdv, 0, cfg, false).await?)
}

#[cfg(not(feature = "cuda"))]
async fn bare_nccl() -> anyhow::Result<ductile_comm::TcpComm> {
    anyhow::bail!("built without the cuda feature")
}

/// The worker's checkpoint staging on this state, by chunk size, against its parts: what a
/// save's stall is made of.
fn staging_breakdown(params: &[tch::Tensor], state: &[tch::Tensor]) {
    use ductile_checkpoint::format::{Dtype, TensorKind, TensorMeta};
    use ductile_checkpoint::save::ShardLayout;
    use ductile_worker::train::ckpt::{pinned_stage, StagePlan, STAGE_CHUNK};
    let tensors: Vec<tch::Tensor> = params
        .iter()
        .chain(state)
        .map(|t| t.shallow_clone())
        .collect();
    let metas: Vec<TensorMeta> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| TensorMeta {
            name: format!("t{i:04}"),
            dtype: Dtype::F32,
            shape: t.size().iter().map(|d| *d as u64).collect(),
            kind: TensorKind::Parameter,
        })
        .collect();
    let layout = ShardLayout::new(&metas, 1, 0);
    let ms = |f: &mut dyn FnMut()| {
        let mut v = Vec::new();
        for _ in 0..7 {
            tch::Cuda::synchronize(0);
            let t0 = Instant::now();
            f();
            tch::Cuda::synchronize(0);
            v.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        median(&mut v)
    };
    let mut slot = None;
    let plan = StagePlan::new(layout.clone(), &tensors, false, STAGE_CHUNK);
    let full = ms(&mut || {
        let _ = pinned_stage(&mut slot, &plan, 0);
    });
    let stage = slot.unwrap();
    let mut by_chunk = Vec::new();
    for mib in [16u64, 64, 256, 1024] {
        let plan = StagePlan::new(layout.clone(), &tensors, false, mib << 20);
        by_chunk.push((mib, ms(&mut || plan.write(&stage))));
    }
    let views: Vec<tch::Tensor> = tensors
        .iter()
        .map(|t| t.contiguous().view([-1]).view_dtype(tch::Kind::Uint8))
        .collect();
    let cat = ms(&mut || {
        let _ = tch::Tensor::cat(&views, 0);
    });
    let all = tch::Tensor::cat(&views, 0);
    let mut dst = stage.narrow(0, 0, all.numel() as i64);
    let copy = ms(&mut || {
        dst.copy_(&all);
    });
    println!(
        "gpu-step: staging {} tensors, {:.1} MiB: pinned_stage (plan reused) {full:.2} ms; by chunk {}; parts: one device cat {cat:.2} ms, one pinned copy of it {copy:.2} ms",
        tensors.len(),
        layout.size as f64 / (1 << 20) as f64,
        by_chunk
            .iter()
            .map(|(m, t)| format!("{m} MiB {t:.2} ms"))
            .collect::<Vec<_>>()
            .join(", "),
    );
}

//! Training benchmarks.
//!
//! `ductile-bench recovery`: 4 CPU workers train a GPT; SIGKILL a worker (or an agent) and
//! measure the time to the first completed step of the new generation.
//! `ductile-bench dp-step`: step time of the elastic loop (the real worker under the control
//! plane) against a bare tch loop doing the same forward, backward and all-reduce.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ductile_cluster::records::{now_ms, TrainingSpec};

use ductile_comm::{Communicator, ReduceOp};
use ductile_tests::*;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn job(name: &str, data: &str, extra: &str) -> String {
    format!(
        "{}max_steps = 1000000\n{extra}",
        training_toml(name, 1, 4, 4, "gpt", data, "restart_budget = 1000")
    )
}

async fn first_step(c: &Cluster, g: u64) -> u64 {
    let store = c.store().await;
    loop {
        if let Ok(Some(kv)) = store
            .backend
            .get(&format!("{}first_step", store.keys.rendezvous("bench", g)))
            .await
        {
            return String::from_utf8_lossy(&kv.value).parse().unwrap();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub async fn recovery(rounds: usize, node_rounds: usize) -> anyhow::Result<()> {
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
    println!("\nrecovery, 4 CPU workers: worker SIGKILL → first step of the new generation median {:.3} s over {rounds}; lost node median {:.3} s over {node_rounds} (TTL {} s)", median(worker), median(node), c.spec.lease_ttl);
    Ok(())
}

pub async fn dp_step(steps: u64) -> anyhow::Result<()> {
    let dir = TempDir::new("dpstep");
    // the elastic loop: the real thing, uninterrupted
    let c = Cluster::start(Spec::default().agents(2, 2));
    let data = synth(dir.path(), "tokens", 200_000);
    c.submit(&job("bench", &data, ""));
    c.wait_world("bench", 4, Duration::from_secs(60));
    let mut sps = Vec::new();
    let mut last = 0;
    while sps.len() < 12 {
        let v = c.status("bench");
        if let Some(s) = v.samples_per_sec {
            if v.step != last && v.step > 40 {
                sps.push(s);
                last = v.step;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let elastic_ms = 32.0 / median(sps) * 1000.0;
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
        let data = Dataset::open(&spec.dataset, "gpt", ctx(&spec), &rt)?;
        let model = Model::new(&spec, &data)?;
        let params: Vec<tch::Tensor> = model.params().into_iter().map(|(_, t)| t).collect();
        let mut opt = Optimizer::new("adamw", &params);
        let mut order = Order::new(data.len(), 7);
        let share = ductile_strategies::split_batch(32, 4)[rank as usize];
        let mut times = Vec::new();
        for step in 0..steps {
            let t0 = Instant::now();
            for p in &params {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            let idx: Vec<u64> = (share.start..share.start + share.len)
                .map(|p| order.sample(step * 32 + p))
                .collect();
            let (x, y) = data.batch(&idx);
            let loss = model.loss_sum(&x, &y) / 32.0;
            loss.backward();
            let mut parts: Vec<tch::Tensor> =
                params.iter().map(|p| p.grad().reshape([-1])).collect();
            parts.push(tch::Tensor::from_slice(&[loss.double_value(&[]) as f32]));
            let mut flat = tch::Tensor::cat(&parts, 0).contiguous();
            comm.all_reduce(&mut flat, ReduceOp::Sum)?;
            let mut grads = Vec::new();
            let mut at = 0;
            for p in &params {
                let k = p.numel() as i64;
                grads.push(flat.narrow(0, at, k).view(p.size().as_slice()));
                at += k;
            }
            opt.step(&params, &grads, lr_at(3e-3, step, None), step);
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

//! ductile-bench: benchmarks run by hand; each prints its figures.
//!
//! `ductile-bench control-plane`: N simulated agents (one lease each, in this process) on a real
//! etcd and the daemon's leader loop in process; for each round one agent stops refreshing its
//! lease, and the bench measures the time from the lease's expiry event (the node key's delete,
//! as a watcher sees it) to the new generation, and the etcd requests the daemon made for it.

mod counting;

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use ductile_cluster::kv::WatchEvent;
use ductile_cluster::records::*;
use ductile_cluster::store::encode;
use ductile_cluster::{Keys, Store};
use ductile_daemon::leader::{lead, LeaderConfig};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(name = "ductile-bench")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Re-formation latency and etcd requests per re-formation with many agents.
    ControlPlane {
        /// Simulated agents (one slot and one lease each).
        #[arg(long, default_value_t = 1000)]
        agents: usize,
        /// Lease TTL of every simulated agent, in seconds.
        #[arg(long, default_value_t = 6)]
        ttl: i64,
        /// Rounds (one lost agent each).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Use this etcd instead of starting one.
        #[arg(long)]
        etcd: Option<String>,
        /// Print one JSON object per round as well.
        #[arg(long)]
        json: bool,
    },
    /// All-reduce bus bandwidth of the TCP backend (ring and ordered modes), one process per rank,
    /// with the machine's loopback-TCP and memcpy ceilings.
    Allreduce {
        #[arg(long, value_delimiter = ',', default_value = "2,4")]
        worlds: Vec<u32>,
        #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
        sizes_mib: Vec<u64>,
        /// Timed iterations per cell (after one warm-up).
        #[arg(long, default_value_t = 7)]
        iters: usize,
        /// One JSON object per cell instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Recovery time of elastic training: worker kills and node losses, 4 CPU workers.
    Recovery {
        #[arg(long, default_value_t = 10)]
        rounds: usize,
        #[arg(long, default_value_t = 4)]
        node_rounds: usize,
        /// Rounds that SIGSTOP a worker (alive but stuck) instead of killing it.
        #[arg(long, default_value_t = 3)]
        stop_rounds: usize,
    },
    /// Step time of the elastic loop against a bare tch loop with the same all-reduce.
    DpStep {
        #[arg(long, default_value_t = 300)]
        steps: u64,
    },
    /// (internal) one rank of `dp-step`'s bare loop.
    #[command(hide = true)]
    DpBareRank {
        etcd: String,
        data: String,
        rank: u32,
        steps: u64,
    },
    /// Checkpoint save stall, upload and restore throughput against plain object_store calls.
    Checkpoint {
        /// State size, MiB (f32 tensors of 4096 × 4096).
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        #[arg(long, value_delimiter = ',', default_value = "s3,file")]
        stores: Vec<String>,
        #[arg(long, default_value_t = 3)]
        iters: usize,
    },
    /// NCCL on this machine's GPU: first init, re-init, abort, abort + re-init (ductile's
    /// re-formation), all-reduce time and bus bandwidth; self-tests every collective on CUDA
    /// tensors (NCCL and the TCP backend's pinned staging). Says what it skipped without a GPU.
    Nccl {
        #[arg(long, default_value_t = 10)]
        iters: usize,
        #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
        sizes_mib: Vec<u64>,
    },
    /// CUDA step time of the elastic loop against a bare tch CUDA loop, and the checkpoint
    /// stall and staging bandwidth against one pinned device→host copy.
    GpuStep {
        #[arg(long, default_value_t = 200)]
        steps: u64,
    },
    /// (internal) one rank of `allreduce`.
    #[command(hide = true)]
    AllreduceRank {
        etcd: String,
        world: u32,
        rank: u32,
        #[arg(long, value_delimiter = ',')]
        sizes_mib: Vec<u64>,
        #[arg(long)]
        iters: usize,
    },
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

async fn control_plane(
    agents: usize,
    ttl: i64,
    rounds: usize,
    etcd: Option<String>,
    json: bool,
) -> anyhow::Result<()> {
    let dir = ductile_tests::TempDir::new("bench");
    let _etcd_proc;
    let endpoint = match etcd {
        Some(e) => e,
        None => {
            let e = ductile_tests::Etcd::start(dir.path());
            let ep = e.endpoint.clone();
            _etcd_proc = e;
            ep
        }
    };
    let keys = Keys::new("/bench/v1");
    let raw = ductile_cluster::connect_etcd(&endpoint, Duration::from_secs(10)).await?;
    let store = Store::new(raw.clone(), keys.clone());
    println!("control-plane bench: {agents} simulated agents, lease TTL {ttl} s, {rounds} rounds, etcd {endpoint}");

    // Register the agents, each under its own lease.
    let t0 = Instant::now();
    let mut leases = Vec::with_capacity(agents);
    for i in 0..agents {
        let lease = raw.grant(ttl).await?;
        let node = NodeRecord {
            name: format!("sim{i:04}"),
            hostname: "bench".into(),
            devices: vec![Device {
                kind: DeviceKind::Cpu,
                index: 0,
                name: "cpu-slot-0".into(),
                memory_mb: None,
            }],
            agent_pid: std::process::id(),
            registered_at_ms: now_ms(),
            draining: false,
            drain_reason: None,
            drain_deadline_ms: None,
            drain_timeout_ms: None,
            reregistrations: 0,
        };
        raw.put(&keys.node(&node.name), encode(&node), Some(lease))
            .await?;
        leases.push(lease);
    }
    println!(
        "registered {agents} agents in {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    // Keep every lease alive, except the ones marked lost.
    let lost: Arc<std::sync::Mutex<std::collections::HashSet<usize>>> = Arc::default();
    let cancel = CancellationToken::new();
    {
        let (raw, leases, lost, cancel) =
            (raw.clone(), leases.clone(), lost.clone(), cancel.clone());
        tokio::spawn(async move {
            let period = Duration::from_millis(ttl as u64 * 1000 / 3);
            loop {
                let started = Instant::now();
                for (i, l) in leases.iter().enumerate() {
                    if !lost.lock().unwrap().contains(&i) {
                        let _ = raw.keep_alive_once(*l).await;
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(period.saturating_sub(started.elapsed())) => {}
                    _ = cancel.cancelled() => return,
                }
            }
        });
    }

    // The daemon's leader loop, in process, over a counting backend.
    let counting = counting::Counting::new(raw.clone());
    let daemon_store = Store::new(Arc::new(counting.clone()), keys.clone());
    let keeper =
        ductile_cluster::lease::LeaseKeeper::start(raw.clone(), 10, cancel.clone()).await?;
    let leader = raw
        .campaign(&keys.election(), b"bench".to_vec(), keeper.current().id)
        .await?;
    let spec = JobSpec::from_toml(&format!(
        "name = \"bench\"\nmin = 1\nmax = {agents}\ndesired = {agents}\ncommand = [\"true\"]\n"
    ))?;
    store.submit(&spec).await?;
    let lcfg = LeaderConfig {
        id: "bench".into(),
        election_ttl: 30,
        debounce: Duration::from_millis(200),
        beat: Default::default(),
    };
    let leading = tokio::spawn(lead(daemon_store, leader, lcfg, cancel.clone()));
    tokio::spawn(async move {
        match leading.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("leader loop ended: {e}"),
            Err(e) => eprintln!("leader loop panicked: {e}"),
        }
    });

    let gkey = keys.generation("bench");
    let wait_gen = |min_number: u64| {
        let store = store.clone();
        async move {
            loop {
                if let Some((g, _)) = store.generation("bench").await.unwrap() {
                    if g.number >= min_number {
                        return g;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let t = Instant::now();
    let g = wait_gen(1).await;
    println!(
        "first generation: {} members, published {:.2} s after submit",
        g.world_size,
        t.elapsed().as_secs_f64()
    );

    let mut lat_ms = Vec::new();
    let mut total_ms = Vec::new();
    let mut reqs = Vec::new();
    for round in 0..rounds {
        let victim = (round * 7919 + 13) % agents;
        let node_key = keys.node(&format!("sim{victim:04}"));
        let (_, rev) = raw.list(&node_key).await?;
        let mut nodes_w = raw.watch(&node_key, rev + 1).await?;
        let mut gen_w = raw.watch(&gkey, rev + 1).await?;
        let before = store
            .generation("bench")
            .await?
            .map(|(g, _)| g.number)
            .unwrap_or(0);
        let counts_before = counting.snapshot();
        let stopped = Instant::now();
        lost.lock().unwrap().insert(victim);
        // the lease's expiry, as a watcher sees it
        let expired_at = loop {
            let batch = nodes_w
                .recv()
                .await
                .ok_or_else(|| anyhow::anyhow!("watch closed"))??;
            if batch.iter().any(|e| matches!(e, WatchEvent::Delete { .. })) {
                break Instant::now();
            }
        };
        let published_at = loop {
            let batch = gen_w
                .recv()
                .await
                .ok_or_else(|| anyhow::anyhow!("watch closed"))??;
            let newer = batch.iter().any(|e| matches!(e, WatchEvent::Put(kv) if serde_json::from_slice::<Generation>(&kv.value).map(|g| g.number > before).unwrap_or(false)));
            if newer {
                break Instant::now();
            }
        };
        // every request the daemon made from the loss to the settled new generation (it only
        // watches in between)
        tokio::time::sleep(Duration::from_millis(300)).await;
        let counts_after = counting.snapshot();
        let n_req: u64 = counts_after
            .iter()
            .map(|(k, v)| v - counts_before.get(k).copied().unwrap_or(0))
            .sum();
        let detail: Vec<String> = counts_after
            .iter()
            .filter_map(|(k, v)| {
                let d = v - counts_before.get(k).copied().unwrap_or(0);
                (d > 0).then(|| format!("{k} {d}"))
            })
            .collect();
        let l = (published_at - expired_at).as_secs_f64() * 1000.0;
        let total = (published_at - stopped).as_secs_f64() * 1000.0;
        println!("round {round}: sim{victim:04} lost; expiry event → new generation {l:.1} ms; last keep-alive → generation {total:.0} ms; daemon etcd requests {n_req} ({})", detail.join(", "));
        if json {
            println!(
                "{}",
                serde_json::json!({"bench": "control-plane", "agents": agents, "round": round, "expiry_to_generation_ms": l, "requests": n_req})
            );
        }
        lat_ms.push(l);
        total_ms.push(total);
        reqs.push(n_req as f64);
    }
    cancel.cancel();
    println!(
        "\nsummary ({agents} agents, {rounds} rounds): expiry event → published generation median {:.1} ms (max {:.1} ms); stop of keep-alive → generation median {:.0} ms (TTL {ttl} s); etcd requests per re-formation median {:.0}",
        median(&mut lat_ms.clone()),
        lat_ms.iter().cloned().fold(0.0, f64::max),
        median(&mut total_ms),
        median(&mut reqs)
    );
    Ok(())
}

mod allreduce;
mod checkpoint;
mod gpu;
mod training;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    ductile_cluster::service::init_logging(ductile_cluster::service::LogFormat::Plain);
    match Cli::parse().cmd {
        Cmd::ControlPlane {
            agents,
            ttl,
            rounds,
            etcd,
            json,
        } => control_plane(agents, ttl, rounds, etcd, json).await,
        Cmd::Allreduce {
            worlds,
            sizes_mib,
            iters,
            json,
        } => allreduce::run(&worlds, &sizes_mib, iters, json).await,
        Cmd::Recovery {
            rounds,
            node_rounds,
            stop_rounds,
        } => training::recovery(rounds, node_rounds, stop_rounds).await,
        Cmd::DpStep { steps } => training::dp_step(steps).await,
        Cmd::Nccl { iters, sizes_mib } => gpu::nccl(iters, &sizes_mib).await,
        Cmd::GpuStep { steps } => training::gpu_step(steps).await,
        Cmd::Checkpoint { mib, stores, iters } => checkpoint::run(mib, &stores, iters).await,
        Cmd::DpBareRank {
            etcd,
            data,
            rank,
            steps,
        } => training::dp_bare_rank(&etcd, &data, rank, steps).await,
        Cmd::AllreduceRank {
            etcd,
            world,
            rank,
            sizes_mib,
            iters,
        } => allreduce::rank(&etcd, world, rank, &sizes_mib, iters).await,
    }
}

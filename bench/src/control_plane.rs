//! `ductile-bench control-plane`: N simulated agents (one slot and one lease each, kept alive
//! from this process) and J jobs spread over them, each reporting progress at H Hz, on a real
//! etcd, with the daemon's leader loop in process on a thread of its own. It measures, under
//! that load: the etcd requests the leader makes per second and its CPU; the watch events per
//! second an agent receives (sampled over W watchers of what agents watch) against what it
//! would receive if the workers' writes were in its view; and, for each round in which one
//! agent stops refreshing its lease, the time from the lease's expiry event to the job's new
//! generation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ductile_cluster::keys::KeyKind;
use ductile_cluster::kv::{KvBackend, WatchEvent};
use ductile_cluster::records::*;
use ductile_cluster::store::encode;
use ductile_cluster::{Keys, Store};
use ductile_daemon::leader::{lead, LeaderConfig};
use tokio_util::sync::CancellationToken;

use crate::counting::Counting;
use crate::median;

pub struct Args {
    pub agents: usize,
    pub jobs: usize,
    pub progress_hz: f64,
    pub watchers: usize,
    pub ttl: i64,
    pub rounds: usize,
    pub etcd: Option<String>,
    pub json: bool,
}

/// CPU time of the calling thread, in seconds.
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec out-pointer
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Count the events a watch of `prefix` delivers, until `cancel`.
fn count_events(
    raw: Arc<dyn KvBackend>,
    prefix: String,
    from: i64,
    counter: Arc<AtomicU64>,
    cancel: CancellationToken,
) {
    tokio::spawn(async move {
        let Ok(mut w) = raw.watch(&prefix, from).await else {
            return;
        };
        loop {
            tokio::select! {
                b = w.recv() => match b {
                    Some(Ok(batch)) => { counter.fetch_add(batch.len() as u64, Ordering::Relaxed); }
                    _ => return,
                },
                _ = cancel.cancelled() => return,
            }
        }
    });
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let dir = ductile_tests::TempDir::new("bench");
    let _etcd_proc;
    let endpoint = match a.etcd.clone() {
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
    let (agents, jobs) = (a.agents, a.jobs.clamp(1, a.agents));
    println!(
        "control-plane bench: {agents} simulated agents, {jobs} jobs with progress at {} Hz, lease TTL {} s, {} rounds, etcd {endpoint}",
        a.progress_hz, a.ttl, a.rounds
    );

    // Register the agents, each under its own lease.
    let t0 = Instant::now();
    let mut leases = Vec::with_capacity(agents);
    for i in 0..agents {
        let lease = raw.grant(a.ttl).await?;
        let node = NodeRecord::new(
            &format!("sim{i:04}"),
            "bench",
            vec![Device {
                kind: DeviceKind::Cpu,
                index: 0,
                name: "cpu-slot-0".into(),
                memory_mb: None,
            }],
            std::process::id(),
        );
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
        let ttl = a.ttl;
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

    // The daemon's leader loop over a counting backend, alone on a thread (its CPU is that
    // thread's).
    let counting = Counting::new(raw.clone());
    let daemon_store = Store::new(Arc::new(counting.clone()), keys.clone());
    let keeper =
        ductile_cluster::lease::LeaseKeeper::start(raw.clone(), 10, cancel.clone()).await?;
    let leader = raw
        .campaign(&keys.election(), b"bench".to_vec(), keeper.current().id)
        .await?;
    let leader_cpu = Arc::new(AtomicU64::new(0)); // µs
    {
        let (cancel, cpu) = (cancel.clone(), leader_cpu.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let lcfg = LeaderConfig {
                    id: "bench".into(),
                    election_ttl: 30,
                    debounce: Duration::from_millis(200),
                    beat: Default::default(),
                    job_users: false,
                };
                let c2 = cancel.clone();
                tokio::spawn(async move {
                    loop {
                        cpu.store((thread_cpu() * 1e6) as u64, Ordering::Relaxed);
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                            _ = c2.cancelled() => return,
                        }
                    }
                });
                let view = ductile_daemon::view::ClusterView::start(&daemon_store, cancel.clone());
                if let Err(e) = lead(daemon_store, leader, lcfg, view, cancel).await {
                    eprintln!("leader loop ended: {e}");
                }
            });
        });
    }

    // J jobs over the agents' slots.
    let per_job = (agents / jobs).max(1);
    let names: Vec<String> = (0..jobs).map(|j| format!("job{j:03}")).collect();
    for n in &names {
        let spec = JobSpec::from_toml(&format!(
            "name = \"{n}\"\nmin = 1\nmax = {per_job}\ndesired = {per_job}\ncommand = [\"true\"]\n"
        ))?;
        store.submit(&spec).await?;
    }
    let t = Instant::now();
    loop {
        let mut have = 0;
        for n in &names {
            if store.generation(n).await?.is_some() {
                have += 1;
            }
        }
        if have == jobs {
            break;
        }
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(120),
            "only {have} of {jobs} jobs got a generation in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "{jobs} jobs of {per_job} members each published in {:.2} s",
        t.elapsed().as_secs_f64()
    );

    // progress from every job's rank 0
    let progress_writes = Arc::new(AtomicU64::new(0));
    if a.progress_hz > 0.0 {
        let (store, names, cancel, writes) = (
            store.clone(),
            names.clone(),
            cancel.clone(),
            progress_writes.clone(),
        );
        let period = Duration::from_secs_f64(1.0 / a.progress_hz);
        tokio::spawn(async move {
            let mut step = 0u64;
            loop {
                let started = Instant::now();
                step += 1;
                for n in &names {
                    let p = Progress {
                        generation: 1,
                        step,
                        loss: Some(1.0),
                        samples_per_sec: Some(100.0),
                        updated_at_ms: now_ms(),
                        ..Default::default()
                    };
                    if store
                        .put_json(&store.keys.progress(n), &p, None)
                        .await
                        .is_ok()
                    {
                        writes.fetch_add(1, Ordering::Relaxed);
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(period.saturating_sub(started.elapsed())) => {}
                    _ = cancel.cancelled() => return,
                }
            }
        });
    }
    // what agents watch (their own node's view), sampled over nodes spread across the fleet;
    // and what they would see watching all of `jobs/` or `live/` as before
    let (_, rev) = raw.list(&keys.election()).await?;
    let agent_events = Arc::new(AtomicU64::new(0));
    for w in 0..a.watchers {
        let node = format!("sim{:04}", w * agents / a.watchers.max(1));
        count_events(
            raw.clone(),
            keys.node_assignments(&node),
            rev + 1,
            agent_events.clone(),
            cancel.clone(),
        );
    }
    let jobs_events = Arc::new(AtomicU64::new(0));
    count_events(
        raw.clone(),
        keys.jobs(),
        rev + 1,
        jobs_events.clone(),
        cancel.clone(),
    );
    let live_events = Arc::new(AtomicU64::new(0));
    count_events(
        raw.clone(),
        keys.live(),
        rev + 1,
        live_events.clone(),
        cancel.clone(),
    );

    // steady state
    tokio::time::sleep(Duration::from_secs(2)).await;
    let window = Duration::from_secs(10);
    let j0 = jobs_events.load(Ordering::Relaxed);
    let (c0, e0, l0, w0, cpu0) = (
        counting.snapshot(),
        agent_events.load(Ordering::Relaxed),
        live_events.load(Ordering::Relaxed),
        progress_writes.load(Ordering::Relaxed),
        leader_cpu.load(Ordering::Relaxed),
    );
    let ts = Instant::now();
    tokio::time::sleep(window).await;
    let secs = ts.elapsed().as_secs_f64();
    let j1 = jobs_events.load(Ordering::Relaxed);
    let (c1, e1, l1, w1, cpu1) = (
        counting.snapshot(),
        agent_events.load(Ordering::Relaxed),
        live_events.load(Ordering::Relaxed),
        progress_writes.load(Ordering::Relaxed),
        leader_cpu.load(Ordering::Relaxed),
    );
    let reqs: u64 = c1
        .iter()
        .map(|(k, v)| v - c0.get(k).copied().unwrap_or(0))
        .sum();
    let per_agent = (e1 - e0) as f64 / a.watchers.max(1) as f64 / secs;
    let live_rate = (l1 - l0) as f64 / secs;
    let jobs_rate = (j1 - j0) as f64 / secs;
    let cpu = (cpu1.saturating_sub(cpu0)) as f64 / 1e6 / secs * 100.0;
    println!(
        "steady state over {secs:.1} s: {:.0} progress writes/s; leader etcd requests {:.1}/s, leader CPU {cpu:.1}% of a core; watch events per agent {per_agent:.2}/s (watching all of jobs/: {jobs_rate:.2}/s; with the workers' writes too: {:.2}/s)",
        (w1 - w0) as f64 / secs,
        reqs as f64 / secs,
        jobs_rate + live_rate
    );

    // re-formations under that load: one agent's lease lapses; every job with a member on it
    // re-forms (jobs place independently, so several share a node)
    let mut first_ms = Vec::new();
    let mut all_ms = Vec::new();
    let mut views_ms = Vec::new();
    let mut woken_n = Vec::new();
    let mut affected_n = 0;
    for round in 0..a.rounds {
        let (kvs, rev) = raw.list(&keys.jobs()).await?;
        let gens: HashMap<String, Generation> = kvs
            .iter()
            .filter_map(|kv| match keys.parse(&kv.key) {
                KeyKind::Generation { job } => serde_json::from_slice::<Generation>(&kv.value)
                    .ok()
                    .map(|g| (job, g)),
                _ => None,
            })
            .collect();
        let g0 = &gens[&names[round % jobs]];
        let victim_name = g0.members[round % g0.members.len()].node.clone();
        let victim: usize = victim_name.trim_start_matches("sim").parse()?;
        let affected: HashMap<String, u64> = gens
            .iter()
            .filter(|(_, g)| g.members.iter().any(|m| m.node == victim_name))
            .map(|(j, g)| (j.clone(), g.number))
            .collect();
        affected_n = affected.len();
        let mut nodes_w = raw.watch(&keys.node(&victim_name), rev + 1).await?;
        let mut gen_w = raw.watch(&keys.jobs(), rev + 1).await?;
        let mut view_w = raw.watch(&keys.assignments(), rev + 1).await?;
        lost.lock().unwrap().insert(victim);
        let expired_at = loop {
            let batch = nodes_w
                .recv()
                .await
                .ok_or_else(|| anyhow::anyhow!("watch closed"))??;
            if batch.iter().any(|e| matches!(e, WatchEvent::Delete { .. })) {
                break Instant::now();
            }
        };
        let mut pending = affected.clone();
        let mut first = None;
        let last = loop {
            let batch = tokio::time::timeout(Duration::from_secs(60), gen_w.recv())
                .await
                .map_err(|_| anyhow::anyhow!("{} jobs did not re-form within 60 s", pending.len()))?
                .ok_or_else(|| anyhow::anyhow!("watch closed"))??;
            for e in &batch {
                if let WatchEvent::Put(kv) = e {
                    if let KeyKind::Generation { job } = keys.parse(&kv.key) {
                        let newer = serde_json::from_slice::<Generation>(&kv.value)
                            .is_ok_and(|g| pending.get(&job).is_some_and(|b| g.number > *b));
                        if newer {
                            pending.remove(&job);
                            first.get_or_insert_with(Instant::now);
                        }
                    }
                }
            }
            if pending.is_empty() {
                break Instant::now();
            }
        };
        // the new generations in the views of the agents they concern (every surviving
        // member's node): when the last one arrived, and how many agents woke at all
        let mut pending_views = affected.clone();
        let mut woken = std::collections::HashSet::new();
        let views_at = loop {
            let batch = tokio::time::timeout(Duration::from_secs(60), view_w.recv())
                .await
                .map_err(|_| {
                    anyhow::anyhow!(
                        "{} jobs' views did not change within 60 s",
                        pending_views.len()
                    )
                })?
                .ok_or_else(|| anyhow::anyhow!("watch closed"))??;
            for e in &batch {
                if let KeyKind::Assignment { node, job } = keys.parse(e.key()) {
                    woken.insert(node);
                    let value = match e {
                        WatchEvent::Put(kv) => Some(&kv.value),
                        WatchEvent::Delete { .. } => None,
                    };
                    let newer = value
                        .and_then(|v| serde_json::from_slice::<NodeAssignment>(v).ok())
                        .is_some_and(|v| {
                            pending_views.get(&job).is_some_and(|b| v.generation > *b)
                        });
                    if newer {
                        pending_views.remove(&job);
                    }
                }
            }
            if pending_views.is_empty() {
                break Instant::now();
            }
        };
        // stragglers of the same re-formation (other nodes' views of the same jobs)
        let settle = Instant::now() + Duration::from_millis(500);
        while let Ok(Some(Ok(batch))) = tokio::time::timeout_at(settle.into(), view_w.recv()).await
        {
            for e in &batch {
                if let KeyKind::Assignment { node, .. } = keys.parse(e.key()) {
                    woken.insert(node);
                }
            }
        }
        let f = (first.unwrap() - expired_at).as_secs_f64() * 1000.0;
        let l = (last - expired_at).as_secs_f64() * 1000.0;
        let v = (views_at - expired_at).as_secs_f64() * 1000.0;
        println!(
            "round {round}: {victim_name} lost ({} jobs had a member there); expiry event → first new generation {f:.1} ms, all {l:.1} ms, in the agents' views {v:.1} ms; {} of {agents} agents woke",
            affected.len(),
            woken.len()
        );
        if a.json {
            println!(
                "{}",
                serde_json::json!({"bench": "control-plane", "agents": agents, "jobs": jobs, "round": round, "affected_jobs": affected.len(), "expiry_to_generation_ms": f, "expiry_to_all_generations_ms": l, "expiry_to_views_ms": v, "agents_woken": woken.len()})
            );
        }
        first_ms.push(f);
        all_ms.push(l);
        views_ms.push(v);
        woken_n.push(woken.len() as f64);
    }
    cancel.cancel();
    println!(
        "\nsummary ({agents} agents, {jobs} jobs, progress {} Hz): expiry event → first new generation median {:.1} ms (max {:.1} ms), all {affected_n} affected jobs re-formed median {:.1} ms (max {:.1} ms), in the agents' views median {:.1} ms (max {:.1} ms), agents woken per re-formation median {:.0} of {agents}; leader in steady state {:.1} etcd requests/s, CPU {cpu:.1}% of a core; {per_agent:.2} watch events per agent per second ({jobs_rate:.2} watching all of jobs/, {:.2} with the workers' writes too)",
        a.progress_hz,
        median(&mut first_ms.clone()),
        first_ms.iter().cloned().fold(0.0, f64::max),
        median(&mut all_ms.clone()),
        all_ms.iter().cloned().fold(0.0, f64::max),
        median(&mut views_ms.clone()),
        views_ms.iter().cloned().fold(0.0, f64::max),
        median(&mut woken_n.clone()),
        reqs as f64 / secs,
        jobs_rate + live_rate
    );
    Ok(())
}

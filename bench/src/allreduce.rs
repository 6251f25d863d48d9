//! `ductile-bench allreduce`: median time and bus bandwidth of the TCP backend's collectives,
//! one process per rank on this machine, and the loopback-TCP and memcpy ceilings: the
//! all-reduce in both modes (ring; ordered, one logical shard per rank), 2(n-1)/n · bytes /
//! time, and the sharded data-parallel step's all-gather and reduce-scatter on the same ring,
//! (n-1)/n · bytes / time (nccl-tests' bus bandwidths; `bytes` the whole gathered tensor, the
//! whole tensor scattered). With `--gloo`, PyTorch's gloo in the same cells.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ductile_cluster::{Keys, Store};
use ductile_comm::buffer::DType;
use ductile_comm::{Rendezvous, TcpComm, TcpConfig};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Bus bandwidth in GB/s of collective `mode` over `bytes` (nccl-tests' factors: an
/// all-reduce moves 2(n-1)/n of the tensor through each rank's link, an all-gather or a
/// reduce-scatter (n-1)/n).
fn busbw(mode: &str, world: u32, bytes: u64, secs: f64) -> f64 {
    let n = world as f64;
    let factor = match mode {
        "all_gather" | "reduce_scatter" => (n - 1.0) / n,
        _ => 2.0 * (n - 1.0) / n,
    };
    factor * bytes as f64 / secs / 1e9
}

/// The whole tensor of a sharded collective cell: `mib` MiB cut to world equal f32 pieces.
fn sharded_bytes(mib: u64, world: u32) -> u64 {
    (mib << 20) / (4 * world as u64) * 4 * world as u64
}

/// PyTorch's gloo all-reduce, all-gather (`all_gather_into_tensor`) and reduce-scatter
/// (`reduce_scatter_tensor`) at the same worlds and sizes (one process per rank on this
/// machine, f32 tensors, a barrier before each timed call, the median of `iters` after a
/// warm-up): the peer the TCP backend is measured against. One JSON line per cell.
const GLOO: &str = r#"
import json, os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank(r, world, sizes, iters, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=r, world_size=world)
    def timed(op):
        times = []
        for it in range(iters + 1):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            if it > 0:
                times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]
    def cell(mode, b, m, factor):
        if r == 0:
            print(json.dumps({"backend": "gloo", "mode": mode, "world": world, "bytes": b,
                              "median_s": m, "busbw_gbps": factor * b / m / 1e9}), flush=True)
    for mib in sizes:
        b = mib << 20
        t = torch.arange(b // 4, dtype=torch.float32) % 13
        cell("ring", b, timed(lambda: dist.all_reduce(t)), 2 * (world - 1) / world)
        # the sharded step's collectives: the whole tensor cut into world equal pieces
        piece = b // (4 * world)
        whole = torch.arange(piece * world, dtype=torch.float32) % 13
        mine = whole[r * piece:(r + 1) * piece].clone()
        out = torch.empty(piece, dtype=torch.float32)
        cell("all_gather", piece * world * 4,
             timed(lambda: dist.all_gather_into_tensor(whole, mine)), (world - 1) / world)
        cell("reduce_scatter", piece * world * 4,
             timed(lambda: dist.reduce_scatter_tensor(out, whole)), (world - 1) / world)
    dist.destroy_process_group()

if __name__ == "__main__":
    world, iters, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sizes = [int(x) for x in sys.argv[4].split(",")]
    mp.spawn(rank, args=(world, sizes, iters, port), nprocs=world)
"#;

fn gloo_cells(
    world: u32,
    sizes_mib: &[u64],
    iters: usize,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let dir = ductile_tests::TempDir::new("gloo");
    let script = dir.path().join("gloo_allreduce.py");
    std::fs::write(&script, GLOO)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let sizes = sizes_mib
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let out = Command::new(ductile_tests::torch_python_bin())
        .arg(&script)
        .args([
            world.to_string(),
            iters.to_string(),
            port.to_string(),
            sizes,
        ])
        .stderr(Stdio::inherit())
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "gloo's collectives at world {world} failed: {}",
        out.status
    );
    String::from_utf8(out.stdout)?
        .lines()
        .map(|l| Ok(serde_json::from_str(l)?))
        .collect()
}

pub async fn run(
    worlds: &[u32],
    sizes_mib: &[u64],
    iters: usize,
    json: bool,
    mesh_tls: bool,
    gloo: bool,
) -> anyhow::Result<()> {
    let dir = ductile_tests::TempDir::new("allreduce");
    let etcd = ductile_tests::Etcd::start(dir.path());
    // the ranks' mesh certificates, as scripts/secure.sh makes them
    let tls_env: Vec<(&str, std::path::PathBuf)> = if mesh_tls {
        let pki = ductile_tests::make_pki(dir.path());
        vec![
            ("DUCTILE_MESH_TLS_CA", pki.join("ca.pem")),
            ("DUCTILE_MESH_TLS_CERT", pki.join("mesh.pem")),
            ("DUCTILE_MESH_TLS_KEY", pki.join("mesh-key.pem")),
        ]
    } else {
        vec![]
    };
    let sizes = sizes_mib
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let (tcp, mem) = ceilings();
    if !json {
        println!("ceilings on this machine: loopback TCP {tcp:.2} GB/s (one stream), memcpy {mem:.2} GB/s");
        println!(
            "{:<8} {:<14} {:<6} {:>9} {:>12} {:>12}",
            "backend", "mode", "world", "MiB", "median_s", "busbw_GB/s"
        );
    }
    let exe = std::env::current_exe()?;
    for &world in worlds {
        let children: Vec<_> = (0..world)
            .map(|r| {
                Command::new(&exe)
                    .args([
                        "allreduce-rank",
                        &etcd.endpoint,
                        &world.to_string(),
                        &r.to_string(),
                        "--sizes-mib",
                        &sizes,
                        "--iters",
                        &iters.to_string(),
                    ])
                    .envs(tls_env.iter().cloned())
                    .stdout(Stdio::piped())
                    .spawn()
            })
            .collect::<Result<_, _>>()?;
        for (r, mut c) in children.into_iter().enumerate() {
            let out = BufReader::new(c.stdout.take().unwrap());
            for line in out.lines() {
                let line = line?;
                if r == 0 {
                    print_cell(serde_json::from_str(&line)?, json, (tcp, mem));
                }
            }
            let st = c.wait()?;
            anyhow::ensure!(st.success(), "rank {r} of world {world} failed: {st}");
        }
        if gloo {
            for v in gloo_cells(world, sizes_mib, iters)? {
                print_cell(v, json, (tcp, mem));
            }
        }
    }
    Ok(())
}

/// One cell, as a table row or (`json`) one object with the machine's ceilings riding along.
fn print_cell(mut v: serde_json::Value, json: bool, (tcp, mem): (f64, f64)) {
    if json {
        v["loopback_tcp_gbps"] = serde_json::json!(tcp);
        v["memcpy_gbps"] = serde_json::json!(mem);
        println!("{v}");
    } else {
        println!(
            "{:<8} {:<14} {:<6} {:>9} {:>12.4} {:>12.2}",
            v["backend"].as_str().unwrap_or("?"),
            v["mode"].as_str().unwrap_or("?"),
            v["world"],
            v["bytes"].as_u64().unwrap_or(0) >> 20,
            v["median_s"].as_f64().unwrap_or(f64::NAN),
            v["busbw_gbps"].as_f64().unwrap_or(f64::NAN)
        );
    }
}

pub async fn rank(
    etcd: &str,
    world: u32,
    rank: u32,
    sizes_mib: &[u64],
    iters: usize,
) -> anyhow::Result<()> {
    let comm = form_loopback(etcd, "/bench-allreduce", world as u64, world, rank).await?;
    let backend = if ductile_comm::mesh_tls::MeshTls::from_env()?.is_some() {
        "tcp+tls"
    } else {
        "tcp"
    };
    let sizes = sizes_mib.to_vec();
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        for mib in sizes {
            let bytes = mib << 20;
            let mut buf = vec![0f32; (bytes / 4) as usize];
            for (i, x) in buf.iter_mut().enumerate() {
                *x = (i % 13) as f32;
            }
            let raw = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, bytes as usize) };
            let shard = raw.to_vec();
            let mut out = vec![0u8; bytes as usize];
            for mode in ["ring", "ordered"] {
                let m = timed(&comm, iters, || match mode {
                    "ring" => comm.all_reduce_bytes(raw, DType::F32),
                    _ => comm.ordered_all_reduce_bytes(
                        &[(rank as u64, &shard)],
                        world as u64,
                        &mut out,
                        DType::F32,
                    ),
                })?;
                println!("{}", serde_json::json!({"backend": backend, "mode": mode, "world": world, "bytes": bytes, "median_s": m, "busbw_gbps": busbw(mode, world, bytes, m)}));
            }
            drop((buf, shard, out));
            // the sharded step's collectives on the same ring: the whole tensor in world
            // equal pieces, this rank's piece gathered / the whole reduced to this rank's piece
            let whole = sharded_bytes(mib, world) as usize;
            let piece = whole / world as usize;
            let mine: Vec<u8> = (0..piece / 4)
                .flat_map(|i| ((i % 13) as f32).to_le_bytes())
                .collect();
            let mut gathered = vec![0u8; whole];
            let m = timed(&comm, iters, || comm.all_gather_bytes(&mine, &mut gathered))?;
            println!("{}", serde_json::json!({"backend": backend, "mode": "all_gather", "world": world, "bytes": whole, "median_s": m, "busbw_gbps": busbw("all_gather", world, whole as u64, m)}));
            let mut work = gathered;
            let mut reduced = vec![0u8; piece];
            let m = timed(&comm, iters, || {
                comm.reduce_scatter_bytes(&mut work, &mut reduced, DType::F32)
            })?;
            println!("{}", serde_json::json!({"backend": backend, "mode": "reduce_scatter", "world": world, "bytes": whole, "median_s": m, "busbw_gbps": busbw("reduce_scatter", world, whole as u64, m)}));
        }
        Ok(())
    })
    .await??;
    Ok(())
}

/// The median of `iters` timed calls of `op` (after one warm-up), each after a barrier.
fn timed(
    comm: &TcpComm,
    iters: usize,
    mut op: impl FnMut() -> Result<(), ductile_comm::CommError>,
) -> anyhow::Result<f64> {
    let mut times = Vec::new();
    for it in 0..=iters {
        comm.barrier()?;
        let t0 = Instant::now();
        op()?;
        if it > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

/// One loopback TCP stream's throughput, and memcpy's, in GB/s.
fn ceilings() -> (f64, f64) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let total: usize = 2 << 30;
    let reader = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = vec![0u8; 4 << 20];
        let mut n = 0;
        while n < total {
            n += s.read(&mut buf).unwrap();
        }
    });
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let buf = vec![7u8; 4 << 20];
    let t0 = Instant::now();
    let mut n = 0;
    while n < total {
        s.write_all(&buf).unwrap();
        n += buf.len();
    }
    reader.join().unwrap();
    let tcp = total as f64 / t0.elapsed().as_secs_f64() / 1e9;
    let src = vec![1u8; 256 << 20];
    let mut dst = vec![0u8; 256 << 20];
    let mut t = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        t.push(t0.elapsed().as_secs_f64());
    }
    (tcp, (256u64 << 20) as f64 / median(t) / 1e9)
}

/// A TCP communicator on loopback, formed through the etcd at `etcd` under `prefix`.
pub async fn form_loopback(
    etcd: &str,
    prefix: &str,
    generation: u64,
    world: u32,
    rank: u32,
) -> anyhow::Result<TcpComm> {
    let store = Store::new(
        ductile_cluster::connect_etcd(etcd, Duration::from_secs(10)).await?,
        Keys::new(prefix),
    );
    store.ensure_mesh_key("bench", generation).await?;
    let rdv = Rendezvous::new(store, "bench", generation, world, rank)?;
    Ok(TcpComm::form(
        &rdv,
        TcpConfig {
            bind_host: "127.0.0.1".into(),
            advertise_host: "127.0.0.1".into(),
            tls: ductile_comm::mesh_tls::MeshTls::from_env()?.map(std::sync::Arc::new),
            ..TcpConfig::from_env()
        },
    )
    .await?)
}

/// `ductile-bench mesh-hello`: what the authenticated hello adds to a mesh connection. Over
/// loopback, `rounds` times: a plain TCP connect and accept, and the same followed by the
/// handshake (both nonces, both HMACs, three messages); medians, and the formation of a TCP
/// mesh of `world` ranks in-process (in-memory rendezvous), whose every connection pays it.
pub async fn hello(rounds: usize, world: u32) -> anyhow::Result<()> {
    use ductile_comm::auth::{self, MeshKey};
    use std::net::{TcpListener, TcpStream};
    let key = MeshKey::new(1, &[7u8; 32]);
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let (mut plain, mut authed) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t0 = Instant::now();
        let c = TcpStream::connect(addr)?;
        let (a, _) = l.accept()?;
        plain.push(t0.elapsed().as_secs_f64());
        drop((c, a));
        let t0 = Instant::now();
        let mut c = TcpStream::connect(addr)?;
        let (mut a, _) = l.accept()?;
        let k = key.clone();
        let h = std::thread::spawn(move || auth::accept(&mut a, &k, 0x42, (0, 2), |f| f == 1));
        auth::dial(&mut c, &key, 0x42, (1, 0, 2), Duration::from_secs(5))
            .map_err(anyhow::Error::msg)?;
        h.join().unwrap().map_err(anyhow::Error::msg)?;
        authed.push(t0.elapsed().as_secs_f64());
    }
    let (p, a) = (crate::median(&mut plain), crate::median(&mut authed));
    println!(
        "mesh hello over loopback, median of {rounds}: connect+accept {:.1} µs; with the authenticated handshake {:.1} µs (+{:.1} µs per connection, a thread spawn included)",
        p * 1e6,
        a * 1e6,
        (a - p) * 1e6
    );
    let store = Store::new(
        std::sync::Arc::new(ductile_cluster::memory::MemoryBackend::new()),
        Keys::default(),
    );
    let mut forms = Vec::new();
    for g in 1..=rounds.min(50) as u64 {
        store.ensure_mesh_key("hello", g).await?;
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..world)
            .map(|r| {
                let store = store.clone();
                tokio::spawn(async move {
                    let rdv = Rendezvous::new(store, "hello", g, world, r)?;
                    anyhow::Ok(TcpComm::form(&rdv, TcpConfig::default()).await?)
                })
            })
            .collect();
        let mut comms = Vec::new();
        for t in tasks {
            comms.push(t.await??);
        }
        forms.push(t0.elapsed().as_secs_f64());
    }
    println!(
        "TCP mesh formation, world {world} in one process ({} connections), median of {}: {:.2} ms",
        world * (world - 1) / 2,
        forms.len(),
        crate::median(&mut forms) * 1e3
    );
    Ok(())
}

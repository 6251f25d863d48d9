//! One rank of a communicator check, for the multi-process tests: forms the TCP communicator of
//! a generation through etcd and runs a scenario; prints one JSON line per result.
//!
//! ductile-comm-check ETCD JOB GENERATION WORLD RANK SCENARIO [ARGS]
//!   collectives              every collective against its reference
//!   ordered TOTAL LEN        ordered all-reduce; prints a hash of the result
//!   loop VICTIM              16 MiB all-reduces until one fails (a peer was killed); then
//!                            re-forms generation+1 without VICTIM and runs the collectives

use std::time::{Duration, Instant};

use ductile_cluster::records::now_ms;
use ductile_cluster::{Keys, Store};
use ductile_comm::{selftest, Communicator, Rendezvous, TcpComm, TcpConfig};

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

async fn form(store: &Store, job: &str, generation: u64, world: u32, rank: u32) -> TcpComm {
    store.ensure_mesh_key(job, generation).await.unwrap();
    let rdv = Rendezvous::new(store.clone(), job, generation, world, rank).unwrap();
    let cfg = TcpConfig {
        bind_host: "127.0.0.1".into(),
        op_timeout: Duration::from_secs(60),
        ..TcpConfig::default()
    };
    TcpComm::form(&rdv, cfg).await.unwrap_or_else(|e| {
        println!(
            "{}",
            serde_json::json!({"rank": rank, "error": e.to_string()})
        );
        std::process::exit(3)
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 7 {
        eprintln!("usage: ductile-comm-check ETCD JOB GENERATION WORLD RANK SCENARIO [ARGS]");
        std::process::exit(2);
    }
    let (etcd, job) = (&a[1], &a[2]);
    let (generation, world, rank): (u64, u32, u32) = (
        a[3].parse().unwrap(),
        a[4].parse().unwrap(),
        a[5].parse().unwrap(),
    );
    let backend = ductile_cluster::connect_etcd(etcd, Duration::from_secs(10))
        .await
        .unwrap();
    let store = Store::new(backend, Keys::default());
    let comm = form(&store, job, generation, world, rank).await;
    let out = match a[6].as_str() {
        "collectives" => {
            let comm: std::sync::Arc<dyn Communicator> = std::sync::Arc::new(comm);
            let r = tokio::task::spawn_blocking(move || selftest::all(&comm))
                .await
                .unwrap();
            serde_json::json!({"rank": rank, "ok": r.is_ok(), "error": r.err()})
        }
        "ordered" => {
            let (total, len): (u64, i64) = (a[7].parse().unwrap(), a[8].parse().unwrap());
            let r = tokio::task::spawn_blocking(move || selftest::ordered(&comm, total, len))
                .await
                .unwrap();
            match r {
                Ok(bytes) => {
                    serde_json::json!({"rank": rank, "ok": true, "hash": format!("{:016x}", fnv(&bytes))})
                }
                Err(e) => serde_json::json!({"rank": rank, "ok": false, "error": e}),
            }
        }
        "loop" => {
            let victim: u32 = a[7].parse().unwrap();
            println!("{}", serde_json::json!({"rank": rank, "looping": true}));
            let err = tokio::task::spawn_blocking(move || {
                let mut t = comm.place(&tch::Tensor::ones(
                    [4 << 20],
                    (tch::Kind::Float, tch::Device::Cpu),
                ));
                loop {
                    if let Err(e) =
                        Communicator::all_reduce(&comm, &mut t, ductile_comm::ReduceOp::Sum)
                    {
                        return (e.to_string(), now_ms());
                    }
                    let _ = t.tensor().shallow_clone().fill_(1.0);
                }
            })
            .await
            .unwrap();
            let t0 = Instant::now();
            let new_rank = rank - u32::from(rank > victim);
            let comm = form(&store, job, generation + 1, world - 1, new_rank).await;
            let r = tokio::task::spawn_blocking(move || selftest::collectives(&comm))
                .await
                .unwrap();
            serde_json::json!({"rank": rank, "failed_at_ms": err.1, "error_seen": err.0, "reformed_in_ms": t0.elapsed().as_millis() as u64, "ok": r.is_ok(), "error": r.err()})
        }
        other => {
            eprintln!("unknown scenario {other}");
            std::process::exit(2);
        }
    };
    println!("{out}");
    std::process::exit(if out["ok"] == true { 0 } else { 1 });
}

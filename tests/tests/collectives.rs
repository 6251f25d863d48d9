//! Communicators across processes: one process per rank, a real etcd for the exchange.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ductile_cluster::records::now_ms;
use ductile_tests::*;

fn rank(etcd: &Etcd, job: &str, generation: u64, world: u32, r: u32, scenario: &[&str]) -> Child {
    Command::new(bin("ductile-comm-check"))
        .args([
            &etcd.endpoint,
            job,
            &generation.to_string(),
            &world.to_string(),
            &r.to_string(),
        ])
        .args(scenario)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// Wait (bounded) for every child; the last JSON line of each.
fn finish(children: Vec<Child>, limit: Duration) -> Vec<serde_json::Value> {
    let t0 = Instant::now();
    children
        .into_iter()
        .map(|mut c| {
            while c.try_wait().unwrap().is_none() {
                if t0.elapsed() > limit {
                    let _ = c.kill();
                    panic!("a rank hung for {limit:?}");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let out = BufReader::new(c.stdout.take().unwrap())
                .lines()
                .map_while(Result::ok)
                .last()
                .unwrap_or_default();
            serde_json::from_str(&out).unwrap_or_else(|_| panic!("rank printed {out:?}"))
        })
        .collect()
}

#[test]
fn every_collective_is_right_across_processes_for_worlds_1_to_4() {
    let dir = TempDir::new("coll");
    let etcd = Etcd::start(dir.path());
    for world in 1..=4u32 {
        let children = (0..world)
            .map(|r| rank(&etcd, "coll", world as u64, world, r, &["collectives"]))
            .collect();
        for v in finish(children, Duration::from_secs(120)) {
            assert_eq!(v["ok"], true, "world {world}: {v}");
        }
    }
}

/// While rank 0 waits for rank 1 at the rendezvous, strangers connect to its mesh port: one
/// that says nothing, one that sends noise, one that claims rank 1 of this generation without
/// the generation's key. Rank 0 takes none of them for a peer, the real rank 1 joins, and every
/// collective is right.
#[test]
fn strangers_at_a_mesh_port_are_refused_and_the_mesh_forms_and_works() {
    use std::io::Write;
    use std::net::TcpStream;
    let dir = TempDir::new("strangers");
    let etcd = Etcd::start(dir.path());
    let (job, generation) = ("strangers", 5u64);
    let r0 = rank(&etcd, job, generation, 2, 0, &["collectives"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(async {
        ductile_cluster::Store::new(
            ductile_cluster::connect_etcd(&etcd.endpoint, Duration::from_secs(10))
                .await
                .unwrap(),
            ductile_cluster::Keys::default(),
        )
    });
    let at = format!("{}tcp/0", store.keys.rendezvous(job, generation));
    let t0 = Instant::now();
    let addr = loop {
        if let Some(kv) = rt.block_on(store.backend.get(&at)).unwrap() {
            break String::from_utf8(kv.value).unwrap();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "rank 0 never published {at}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let _silent = TcpStream::connect(&addr).unwrap();
    // and a flood from another address: up to 200 silent connections held open and opened
    // again as fast as they are closed, for the whole formation (more than the acceptor's
    // bound of handshakes, from one stranger)
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let (addr, stop) = (addr.clone(), stop.clone());
        std::thread::spawn(move || {
            let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
            let mut held: Vec<TcpStream> = Vec::new();
            let mut opened = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // what the acceptor closed (end of stream, a reset) goes; the rest stays open
                held.retain(|s| {
                    use std::io::Read;
                    let mut b = [0u8; 1];
                    s.set_nonblocking(true).ok();
                    matches!((&*s).read(&mut b), Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock)
                });
                // (at most 20 new ones each 50 ms: a flood, not a load that starves the
                // machine's two cores)
                let mut fresh = 0;
                while held.len() < 200 && fresh < 20 {
                    fresh += 1;
                    match connect_from("127.0.0.2", port) {
                        Some(s) => {
                            held.push(s);
                            opened += 1;
                        }
                        None => break,
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            opened
        })
    };
    let mut noise = TcpStream::connect(&addr).unwrap();
    noise.write_all(&[0xFF; 64]).unwrap();
    let forged = std::thread::spawn(move || {
        let mut s = TcpStream::connect(&addr).unwrap();
        let wrong = ductile_comm::auth::MeshKey::new(generation, &[0u8; 32]);
        ductile_comm::auth::dial(
            &mut s,
            &wrong,
            ductile_comm::tcp::MAGIC,
            (1, 0, 2),
            Duration::from_secs(60),
        )
    });
    let r1 = rank(&etcd, job, generation, 2, 1, &["collectives"]);
    for v in finish(vec![r0, r1], Duration::from_secs(120)) {
        assert_eq!(v["ok"], true, "{v}");
    }
    let e = forged.join().unwrap().unwrap_err();
    assert!(e.contains("mesh key"), "{e}");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let opened = flood.join().unwrap();
    // more than the acceptor's whole bound of handshakes before (32), which such a flood kept
    // full: rank 1 then never got through
    assert!(
        opened > 2 * ductile_comm::auth::MAX_HANDSHAKES_PER_SOURCE as u64,
        "the flood opened {opened} connections"
    );
}

/// A TCP connection to 127.0.0.1:`port` from the loopback address `from` (another source
/// than the ranks', which are all 127.0.0.1 here).
fn connect_from(from: &str, port: u16) -> Option<std::net::TcpStream> {
    use std::os::fd::FromRawFd;
    let ip = |a: &str| u32::from(a.parse::<std::net::Ipv4Addr>().unwrap()).to_be();
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let mut local: libc::sockaddr_in = std::mem::zeroed();
        local.sin_family = libc::AF_INET as libc::sa_family_t;
        local.sin_addr.s_addr = ip(from);
        let mut remote = local;
        remote.sin_addr.s_addr = ip("127.0.0.1");
        remote.sin_port = port.to_be();
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        if libc::bind(fd, &local as *const _ as *const libc::sockaddr, len) != 0
            || libc::connect(fd, &remote as *const _ as *const libc::sockaddr, len) != 0
        {
            libc::close(fd);
            return None;
        }
        Some(std::net::TcpStream::from_raw_fd(fd))
    }
}

#[test]
fn the_ordered_all_reduce_gives_the_same_bits_at_every_world_size() {
    let dir = TempDir::new("ord");
    let etcd = Etcd::start(dir.path());
    let mut hashes = Vec::new();
    for world in 1..=4u32 {
        // 12 logical shards: uneven over 4? no, but over 3 the split is 4/4/4 and over 4 it is 3/3/3/3
        let children = (0..world)
            .map(|r| {
                rank(
                    &etcd,
                    "ord",
                    world as u64,
                    world,
                    r,
                    &["ordered", "7", "100003"],
                )
            })
            .collect();
        let out = finish(children, Duration::from_secs(120));
        for v in &out {
            assert_eq!(v["ok"], true, "world {world}: {v}");
        }
        let h: Vec<String> = out
            .iter()
            .map(|v| v["hash"].as_str().unwrap().to_string())
            .collect();
        assert!(
            h.windows(2).all(|w| w[0] == w[1]),
            "ranks of world {world} disagree: {h:?}"
        );
        hashes.push(h[0].clone());
    }
    assert!(
        hashes.windows(2).all(|w| w[0] == w[1]),
        "results differ between world sizes: {hashes:?}"
    );
}

#[test]
fn killing_a_rank_mid_all_reduce_fails_every_survivor_within_a_second_and_they_reform() {
    let dir = TempDir::new("kill");
    let etcd = Etcd::start(dir.path());
    for round in 0..4u64 {
        let world = 3u32;
        let victim = (round % world as u64) as u32;
        let generation = 100 + round * 10;
        let mut children: Vec<Child> = (0..world)
            .map(|r| {
                rank(
                    &etcd,
                    "kill",
                    generation,
                    world,
                    r,
                    &["loop", &victim.to_string()],
                )
            })
            .collect();
        // wait until every rank is looping, then let them run some all-reduces
        for c in children.iter_mut() {
            let mut line = String::new();
            BufReader::new(c.stdout.as_mut().unwrap())
                .read_line(&mut line)
                .unwrap();
            assert!(line.contains("looping"), "{line}");
        }
        std::thread::sleep(Duration::from_millis(300 + 150 * round));
        let killed_at = now_ms();
        let mut v = children.remove(victim as usize);
        v.kill().unwrap();
        v.wait().unwrap();
        for out in finish(children, Duration::from_secs(60)) {
            let failed_at = out["failed_at_ms"].as_u64().unwrap();
            assert!(
                failed_at.saturating_sub(killed_at) < 1000,
                "round {round}: a survivor noticed {} ms after the kill: {out}",
                failed_at - killed_at
            );
            assert_eq!(
                out["ok"], true,
                "round {round}: re-formed world failed: {out}"
            );
        }
    }
}

//! Heartbeats beside a communicator whose transport cannot carry ours (NCCL). Every rank
//! connects to every peer over TCP (addresses through the generation's rendezvous, key `hb`),
//! sends one byte every `liveness_timeout / 4`, and reads its peers' bytes on a thread per peer.
//! A peer from which nothing arrived for `liveness_timeout` is **silent** (stopped, frozen,
//! cut off); one whose connection closed without saying goodbye is **lost** (killed). The first
//! such verdict calls `on_fault` once (the NCCL communicator aborts, so its pending collective
//! ends in milliseconds instead of at the op timeout) and is what the failed op reports: the
//! leader then excludes the named rank as it does for the TCP backend.
//!
//! A rank that leaves normally (its communicator dropped: a new generation, or done) says
//! goodbye first, so its peers never take it for lost.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::auth::{self, MeshKey};
use crate::error::{CommError, Result};
use crate::rendezvous::Rendezvous;
use crate::tcp::{dial_peer, listen_and_exchange, TcpConfig};

const MAGIC: u32 = 0x4443_4842; // "DCHB"
const BEAT: u8 = 1;
const GOODBYE: u8 = 2;

/// What the heartbeats found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing arrived from `peer` for `after`.
    Silent { peer: u32, after: Duration },
    /// `peer`'s connection closed (or failed) without a goodbye.
    Lost { peer: u32, reason: String },
}

/// The heartbeat mesh of one generation; dropping it says goodbye and stops its threads.
pub struct Liveness {
    generation: u64,
    verdict: Arc<Mutex<Option<Verdict>>>,
    stop: Arc<AtomicBool>,
    outgoing: Arc<Mutex<Vec<Option<TcpStream>>>>,
    incoming: Vec<TcpStream>,
}

impl Liveness {
    /// Form the mesh of `rdv`'s generation (bounded by `cfg.form_timeout`); `on_fault` is
    /// called once, from a heartbeat thread, with the first verdict.
    pub async fn form(
        rdv: &Rendezvous,
        cfg: &TcpConfig,
        on_fault: Arc<dyn Fn(&Verdict) + Send + Sync>,
    ) -> Result<Liveness> {
        let generation = rdv.generation;
        let key = rdv.mesh_key().await?;
        let (listener, addrs) = listen_and_exchange(rdv, cfg, "hb").await?;
        let (rank, world, cfg) = (rdv.rank, rdv.world, cfg.clone());
        tokio::task::spawn_blocking(move || {
            Self::connect(
                listener, addrs, key, generation, rank, world, &cfg, on_fault,
            )
        })
        .await
        .map_err(|e| CommError::Unavailable(format!("heartbeat mesh task failed: {e}")))?
    }

    #[allow(clippy::too_many_arguments)]
    fn connect(
        listener: TcpListener,
        addrs: Vec<String>,
        key: MeshKey,
        generation: u64,
        rank: u32,
        world: u32,
        cfg: &TcpConfig,
        on_fault: Arc<dyn Fn(&Verdict) + Send + Sync>,
    ) -> Result<Liveness> {
        let deadline = Instant::now() + cfg.form_timeout;
        // accept the peers' connections while connecting to theirs
        let acceptor = {
            let (key, form_timeout) = (key.clone(), cfg.form_timeout);
            std::thread::spawn(move || -> Result<Vec<(u32, TcpStream)>> {
                // heartbeats carry no data: the authenticated hello, never TLS
                Ok(auth::accept_peers(
                    &listener,
                    &key,
                    MAGIC,
                    (rank, world),
                    move |p| p != rank,
                    world as usize - 1,
                    (deadline, form_timeout),
                    None,
                )?
                .into_iter()
                .filter_map(|(p, l)| l.into_plain().ok().map(|s| (p, s)))
                .collect())
            })
        };
        let mut outgoing: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        for (peer, addr) in addrs.iter().enumerate() {
            let peer = peer as u32;
            if peer == rank {
                continue;
            }
            let s = dial_peer(addr, &key, MAGIC, (rank, peer, world), deadline)?;
            s.set_nodelay(true).ok();
            s.set_write_timeout(Some(cfg.liveness_timeout)).ok();
            outgoing[peer as usize] = Some(s);
        }
        let incoming = acceptor
            .join()
            .map_err(|_| CommError::Unavailable("heartbeat acceptor panicked".into()))??;

        let verdict: Arc<Mutex<Option<Verdict>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let judge = {
            let (verdict, stop) = (verdict.clone(), stop.clone());
            Arc::new(move |v: Verdict| {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                let mut slot = verdict.lock().unwrap();
                if slot.is_none() {
                    tracing::warn!(generation, ?v, "heartbeats: a peer failed");
                    *slot = Some(v.clone());
                    drop(slot);
                    on_fault(&v);
                }
            })
        };
        let timeout = cfg.liveness_timeout;
        let tick = (timeout / 4).max(Duration::from_millis(20));
        let mut readers = Vec::new();
        for (peer, s) in incoming {
            let (stop, judge) = (stop.clone(), judge.clone());
            let mut r = s.try_clone().map_err(|e| {
                CommError::Unavailable(format!("heartbeats: cannot share a socket: {e}"))
            })?;
            r.set_read_timeout(Some(tick)).ok();
            std::thread::Builder::new()
                .name(format!("hb-read-{peer}"))
                .spawn(move || {
                    let mut last = Instant::now();
                    let mut buf = [0u8; 64];
                    while !stop.load(Ordering::SeqCst) {
                        match r.read(&mut buf) {
                            Ok(0) => {
                                judge(Verdict::Lost {
                                    peer,
                                    reason: "closed its heartbeat connection".into(),
                                });
                                return;
                            }
                            Ok(n) => {
                                if buf[..n].contains(&GOODBYE) {
                                    return; // it left in order
                                }
                                last = Instant::now();
                            }
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) => {}
                            Err(e) => {
                                judge(Verdict::Lost {
                                    peer,
                                    reason: e.to_string(),
                                });
                                return;
                            }
                        }
                        if last.elapsed() >= timeout {
                            judge(Verdict::Silent {
                                peer,
                                after: last.elapsed(),
                            });
                            return;
                        }
                    }
                })
                .map_err(|e| CommError::Unavailable(format!("heartbeats: no thread: {e}")))?;
            readers.push(s);
        }
        let outgoing = Arc::new(Mutex::new(outgoing));
        {
            let (stop, outgoing) = (stop.clone(), outgoing.clone());
            std::thread::Builder::new()
                .name("hb-send".into())
                .spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        {
                            let mut out = outgoing.lock().unwrap();
                            for s in out.iter_mut() {
                                // a peer that takes no more is the reader side's verdict
                                if let Some(st) = s {
                                    if st.write_all(&[BEAT]).is_err() {
                                        *s = None;
                                    }
                                }
                            }
                        }
                        std::thread::sleep(tick);
                    }
                })
                .map_err(|e| CommError::Unavailable(format!("heartbeats: no thread: {e}")))?;
        }
        Ok(Liveness {
            generation,
            verdict,
            stop,
            outgoing,
            incoming: readers,
        })
    }

    /// The first verdict, if any.
    pub fn verdict(&self) -> Option<Verdict> {
        self.verdict.lock().unwrap().clone()
    }

    /// The verdict as the error of the op it ended.
    pub fn error(&self, op: &'static str) -> Option<CommError> {
        self.verdict().map(|v| match v {
            Verdict::Silent { peer, after } => CommError::Silent {
                generation: self.generation,
                op,
                peer,
                after,
            },
            Verdict::Lost { peer, reason } => CommError::PeerLost {
                generation: self.generation,
                op,
                peer,
                source: std::io::Error::new(std::io::ErrorKind::ConnectionAborted, reason),
            },
        })
    }
}

impl Drop for Liveness {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for s in self.outgoing.lock().unwrap().iter_mut().flatten() {
            let _ = s.write_all(&[GOODBYE]);
            let _ = s.shutdown(Shutdown::Both);
        }
        for s in &self.incoming {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ductile_cluster::{Keys, Store};
    use std::sync::atomic::AtomicU32;

    fn cfg(ms: u64) -> TcpConfig {
        TcpConfig {
            liveness_timeout: Duration::from_millis(ms),
            form_timeout: Duration::from_secs(10),
            bind_host: "127.0.0.1".into(),
            ..TcpConfig::default()
        }
    }

    /// Wait until `l` has a verdict or `limit` passed since `since`; the verdict.
    async fn verdict_by(l: &Liveness, since: Instant, limit: Duration) -> Option<Verdict> {
        while l.verdict().is_none() && since.elapsed() < limit {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        l.verdict()
    }

    async fn mesh(world: u32, generation: u64, ms: u64) -> Vec<(Liveness, Arc<AtomicU32>)> {
        let store = Store::new(
            Arc::new(ductile_cluster::memory::MemoryBackend::new()),
            Keys::default(),
        );
        let mut tasks = Vec::new();
        for rank in 0..world {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                store.ensure_mesh_key("j", generation).await.unwrap();
                let rdv = Rendezvous::new(store, "j", generation, world, rank).unwrap();
                let faults = Arc::new(AtomicU32::new(0));
                let f = faults.clone();
                let l = Liveness::form(
                    &rdv,
                    &cfg(ms),
                    Arc::new(move |_| {
                        f.fetch_add(1, Ordering::SeqCst);
                    }),
                )
                .await
                .unwrap();
                (l, faults)
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn live_peers_stay_quiet_and_an_orderly_leave_is_no_fault() {
        let mut m = mesh(3, 4, 300).await;
        tokio::time::sleep(Duration::from_millis(1200)).await; // four liveness timeouts
        for (l, f) in &m {
            assert_eq!(l.verdict(), None);
            assert_eq!(f.load(Ordering::SeqCst), 0);
        }
        drop(m.remove(2)); // rank 2 leaves in order
        tokio::time::sleep(Duration::from_millis(700)).await;
        for (l, f) in &m {
            assert_eq!(l.verdict(), None, "an orderly leave was taken for a fault");
            assert_eq!(f.load(Ordering::SeqCst), 0);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_peer_is_named_within_the_timeout_and_a_vanished_one_as_lost() {
        let m = mesh(3, 5, 400).await;
        // rank 2 freezes: its sender stops, its sockets stay open
        m[2].0.stop.store(true, Ordering::SeqCst);
        let t0 = Instant::now();
        verdict_by(&m[0].0, t0, Duration::from_secs(5)).await;
        let took = t0.elapsed();
        match m[0].0.error("all_reduce") {
            Some(CommError::Silent {
                peer: 2,
                op: "all_reduce",
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        assert!(took < Duration::from_secs(3), "named after {took:?}");
        assert_eq!(m[0].1.load(Ordering::SeqCst), 1, "on_fault is called once");
        // rank 1 names it too, on its own clock (a moment after rank 0, under load)
        let v = verdict_by(&m[1].0, t0, Duration::from_secs(5)).await;
        assert!(matches!(v, Some(Verdict::Silent { peer: 2, .. })), "{v:?}");

        // a peer that dies without a goodbye (SIGKILL closes its sockets) is lost
        let mut m = mesh(2, 6, 5_000).await;
        let (gone, _) = m.remove(1);
        gone.stop.store(true, Ordering::SeqCst);
        for s in gone.outgoing.lock().unwrap().iter().flatten() {
            let _ = s.shutdown(Shutdown::Both); // closed, no goodbye
        }
        let v = verdict_by(&m[0].0, Instant::now(), Duration::from_secs(3)).await;
        assert!(matches!(v, Some(Verdict::Lost { peer: 1, .. })), "{v:?}");
        std::mem::forget(gone); // no orderly goodbye from its Drop
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_from_another_generation_is_never_taken_for_a_peer() {
        let store = Store::new(
            Arc::new(ductile_cluster::memory::MemoryBackend::new()),
            Keys::default(),
        );
        let c = TcpConfig {
            form_timeout: Duration::from_millis(800),
            ..cfg(500)
        };
        store.ensure_mesh_key("j", 9).await.unwrap();
        let rdv = Rendezvous::new(store.clone(), "j", 9, 2, 0).unwrap();
        let r0 = tokio::spawn(async move { Liveness::form(&rdv, &c, Arc::new(|_| {})).await });
        // rank 1's address takes connections, but what calls rank 0 says generation 8
        let rank1 = TcpListener::bind("127.0.0.1:0").unwrap();
        let rdv1 = Rendezvous::new(store, "j", 9, 2, 1).unwrap();
        rdv1.publish("hb", rank1.local_addr().unwrap().to_string().as_bytes())
            .await
            .unwrap();
        let addr0 =
            String::from_utf8(rdv1.gather("hb", Duration::from_secs(5)).await.unwrap()[0].clone())
                .unwrap();
        let mut s = TcpStream::connect(&addr0).unwrap();
        let mut hello = [0u8; 16];
        hello[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        hello[4..12].copy_from_slice(&8u64.to_le_bytes());
        hello[12..16].copy_from_slice(&1u32.to_le_bytes());
        s.write_all(&hello).unwrap();
        // rank 0 finds no rank 1 it can authenticate: neither the stranger that called it nor
        // the listener that never answers its hello
        match r0.await.unwrap() {
            Err(CommError::RendezvousTimeout { missing, .. }) => assert_eq!(missing, vec![1]),
            Err(CommError::Unavailable(m)) => assert!(m.contains("rank 1"), "{m}"),
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("took a connection of generation 8 as rank 1 of generation 9"),
        }
    }
}

//! The authenticated hello of a generation's meshes (the TCP backend's and the heartbeats').
//!
//! Every generation has a fresh 32-byte key (`jobs/{job}/mesh_key`, written by the leader in
//! the transaction that publishes the generation). A connection proves both ends know it
//! before any frame is read:
//!
//! 1. the dialler sends `magic, version, generation, from, to, world, nonce_d` (44 bytes);
//! 2. the acceptor checks them (this generation, addressed to it, from a rank it expects), then
//!    answers `nonce_a, HMAC(key, "accept" ‖ hello ‖ nonce_a)`;
//! 3. the dialler checks that MAC and sends `HMAC(key, "dial" ‖ hello ‖ nonce_a)`;
//! 4. the acceptor checks it. Only then is the stream a peer's.
//!
//! Both nonces are fresh, so a recorded exchange replays nowhere; the MACs are compared in
//! constant time (ring). Each step has a deadline, and the acceptor runs each handshake on a
//! thread of its own (at most [`MAX_HANDSHAKES`] at once), so a silent or slow stranger delays
//! no peer.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use crate::error::{CommError, Result};
use crate::mesh_tls::{Link, MeshTls};

const VERSION: u32 = 1;
const HELLO: usize = 44;
const NONCE: usize = 16;
const MAC: usize = 32;
/// Handshakes an acceptor runs at once; connections beyond are closed unread (a dialler
/// retries until its deadline).
pub const MAX_HANDSHAKES: usize = 128;
/// Handshakes an acceptor runs at once for one source address: a stranger holding
/// connections open takes that many threads, never the acceptor's, so peers elsewhere still
/// get through.
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 16;
/// Longest a single handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// A generation's mesh key.
#[derive(Clone)]
pub struct MeshKey {
    generation: u64,
    key: hmac::Key,
}

impl MeshKey {
    pub fn new(generation: u64, bytes: &[u8]) -> MeshKey {
        MeshKey {
            generation,
            key: hmac::Key::new(hmac::HMAC_SHA256, bytes),
        }
    }
    pub fn generation(&self) -> u64 {
        self.generation
    }
}

impl std::fmt::Debug for MeshKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MeshKey(generation {})", self.generation)
    }
}

fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    SystemRandom::new()
        .fill(&mut n)
        .expect("the system's random source");
    n
}

fn hello(
    magic: u32,
    generation: u64,
    from: u32,
    to: u32,
    world: u32,
    n: &[u8; NONCE],
) -> [u8; HELLO] {
    let mut h = [0u8; HELLO];
    h[0..4].copy_from_slice(&magic.to_le_bytes());
    h[4..8].copy_from_slice(&VERSION.to_le_bytes());
    h[8..16].copy_from_slice(&generation.to_le_bytes());
    h[16..20].copy_from_slice(&from.to_le_bytes());
    h[20..24].copy_from_slice(&to.to_le_bytes());
    h[24..28].copy_from_slice(&world.to_le_bytes());
    h[28..44].copy_from_slice(n);
    h
}

/// The MACs cover `binding` too: the TLS session's exporter value when the hello runs inside
/// TLS (so it cannot be relayed into another session), empty over plain TCP.
fn mac(key: &MeshKey, label: &[u8], binding: &[u8], hello: &[u8], nonce_a: &[u8]) -> hmac::Tag {
    let mut c = hmac::Context::with_key(&key.key);
    c.update(label);
    c.update(binding);
    c.update(hello);
    c.update(nonce_a);
    c.sign()
}

fn verify(
    key: &MeshKey,
    label: &[u8],
    binding: &[u8],
    hello: &[u8],
    nonce_a: &[u8],
    tag: &[u8],
) -> bool {
    let mut msg = Vec::with_capacity(label.len() + binding.len() + hello.len() + nonce_a.len());
    msg.extend_from_slice(label);
    msg.extend_from_slice(binding);
    msg.extend_from_slice(hello);
    msg.extend_from_slice(nonce_a);
    hmac::verify(&key.key, &msg, tag).is_ok()
}

/// Dial side, on a connected stream to `peer`: prove the key and check the acceptor does. The
/// error says what failed; the stream is then useless.
pub fn dial(
    s: &mut TcpStream,
    key: &MeshKey,
    magic: u32,
    ranks: (u32, u32, u32),
    timeout: Duration,
) -> std::result::Result<(), String> {
    s.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
        .ok();
    dial_over(s, key, &[], magic, ranks)?;
    s.set_read_timeout(None).ok();
    Ok(())
}

/// Whether a [`dial`] error means the acceptor closed the connection before answering (it was
/// at its bound of handshakes), which a dialler may try again.
pub fn closed_unread(e: &str) -> bool {
    e.starts_with("hello: ")
        || (e.starts_with("no answer to the hello: ")
            && (e.contains("failed to fill whole buffer")
                || e.contains("reset by peer")
                || e.contains("Broken pipe")))
}

/// [`dial`] over any stream (a TLS session: `binding` is its exporter value); the caller
/// bounds its reads.
pub fn dial_over(
    s: &mut (impl Read + Write),
    key: &MeshKey,
    binding: &[u8],
    magic: u32,
    (me, peer, world): (u32, u32, u32),
) -> std::result::Result<(), String> {
    let h = hello(magic, key.generation, me, peer, world, &nonce());
    s.write_all(&h).map_err(|e| format!("hello: {e}"))?;
    let mut answer = [0u8; NONCE + MAC];
    s.read_exact(&mut answer)
        .map_err(|e| format!("no answer to the hello: {e}"))?;
    let (nonce_a, tag) = answer.split_at(NONCE);
    if !verify(key, b"accept", binding, &h, nonce_a, tag) {
        return Err("the peer does not hold this generation's mesh key".into());
    }
    s.write_all(mac(key, b"dial", binding, &h, nonce_a).as_ref())
        .map_err(|e| format!("proof: {e}"))?;
    s.flush().map_err(|e| format!("proof: {e}"))?;
    Ok(())
}

/// Accept side of one connection: the dialler's rank once it proved the key. `expect(from)`
/// says whether this rank waits for a connection from `from`.
pub fn accept(
    s: &mut TcpStream,
    key: &MeshKey,
    magic: u32,
    ranks: (u32, u32),
    expect: impl Fn(u32) -> bool,
) -> std::result::Result<u32, String> {
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).ok();
    s.set_write_timeout(Some(HANDSHAKE_TIMEOUT)).ok();
    let from = accept_over(s, key, &[], magic, ranks, expect)?;
    s.set_read_timeout(None).ok();
    s.set_write_timeout(None).ok();
    Ok(from)
}

/// [`accept`] over any stream (a TLS session: `binding` is its exporter value); the caller
/// bounds its reads and writes.
pub fn accept_over(
    s: &mut (impl Read + Write),
    key: &MeshKey,
    binding: &[u8],
    magic: u32,
    (me, world): (u32, u32),
    expect: impl Fn(u32) -> bool,
) -> std::result::Result<u32, String> {
    let mut h = [0u8; HELLO];
    s.read_exact(&mut h).map_err(|e| format!("no hello: {e}"))?;
    let u32_at = |a: usize| u32::from_le_bytes(h[a..a + 4].try_into().unwrap());
    let g = u64::from_le_bytes(h[8..16].try_into().unwrap());
    let (from, to, w) = (u32_at(16), u32_at(20), u32_at(24));
    if u32_at(0) != magic || u32_at(4) != VERSION {
        return Err("not a ductile mesh hello".into());
    }
    if g != key.generation || to != me || w != world || from >= world || !expect(from) {
        return Err(format!(
            "a hello for generation {g}, rank {to} of {w}, from rank {from}: this is rank {me} of {world} in generation {}",
            key.generation
        ));
    }
    let nonce_a = nonce();
    let mut answer = Vec::with_capacity(NONCE + MAC);
    answer.extend_from_slice(&nonce_a);
    answer.extend_from_slice(mac(key, b"accept", binding, &h, &nonce_a).as_ref());
    s.write_all(&answer).map_err(|e| format!("answer: {e}"))?;
    s.flush().map_err(|e| format!("answer: {e}"))?;
    let mut proof = [0u8; MAC];
    s.read_exact(&mut proof)
        .map_err(|e| format!("no proof of the key: {e}"))?;
    if !verify(key, b"dial", binding, &h, &nonce_a, &proof) {
        return Err(format!(
            "rank {from}'s claim does not prove this generation's mesh key"
        ));
    }
    Ok(from)
}

/// Accept authenticated connections on `listener` until `want` ranks (each at most once, as
/// `expect` allows) have proved the key, or `deadline` (`after`, the formation's timeout, is
/// what the error reports). With `tls`, each connection first completes a TLS handshake (the
/// peer's certificate checked against the CA) and the hello runs inside it. Strangers are
/// logged and dropped; each handshake runs on its own thread, so none of them holds up a peer.
#[allow(clippy::too_many_arguments)]
pub fn accept_peers(
    listener: &TcpListener,
    key: &MeshKey,
    magic: u32,
    (me, world): (u32, u32),
    expect: impl Fn(u32) -> bool + Clone + Send + 'static,
    want: usize,
    (deadline, after): (Instant, Duration),
    tls: Option<Arc<MeshTls>>,
) -> Result<Vec<(u32, Link)>> {
    let generation = key.generation;
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::Unavailable(e.to_string()))?;
    type Handshake = (
        std::result::Result<(u32, Link), String>,
        std::net::SocketAddr,
    );
    let (tx, rx) = mpsc::channel::<Handshake>();
    let mut running = 0usize;
    let mut per_source: std::collections::HashMap<std::net::IpAddr, usize> = Default::default();
    let mut got: Vec<(u32, Link)> = Vec::new();
    while got.len() < want {
        while let Ok((r, from)) = rx.try_recv() {
            running -= 1;
            if let Some(n) = per_source.get_mut(&from.ip()) {
                *n -= 1;
                if *n == 0 {
                    per_source.remove(&from.ip());
                }
            }
            match r {
                Ok((peer, s)) if !got.iter().any(|(p, _)| *p == peer) => got.push((peer, s)),
                Ok((peer, _)) => {
                    tracing::warn!(%from, generation, peer, "refused a second connection claiming the same rank")
                }
                Err(reason) => {
                    tracing::warn!(%from, generation, %reason, "refused a connection that did not authenticate as this generation's mesh")
                }
            }
        }
        if got.len() >= want {
            break;
        }
        match listener.accept() {
            Ok((s, from)) => {
                if running >= MAX_HANDSHAKES {
                    tracing::warn!(%from, generation, "too many handshakes at once: connection closed unread");
                    continue;
                }
                let from_here = per_source.entry(from.ip()).or_insert(0);
                if *from_here >= MAX_HANDSHAKES_PER_SOURCE {
                    tracing::warn!(%from, generation, "too many handshakes at once from this address: connection closed unread");
                    continue;
                }
                *from_here += 1;
                s.set_nonblocking(false).ok();
                running += 1;
                let (tx, key, expect, tls) = (tx.clone(), key.clone(), expect.clone(), tls.clone());
                std::thread::Builder::new()
                    .name("mesh-handshake".into())
                    .spawn(move || {
                        let r = accept_link(s, &key, magic, (me, world), expect, tls.as_deref());
                        let _ = tx.send((r, from));
                    })
                    .map_err(|e| CommError::Unavailable(format!("handshake thread: {e}")))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<u32> = (0..world)
                        .filter(|p| expect(*p) && got.iter().all(|(g, _)| g != p))
                        .collect();
                    return Err(CommError::RendezvousTimeout {
                        generation,
                        after,
                        missing,
                    });
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => {
                return Err(CommError::Unavailable(format!(
                    "generation {generation}: accept failed: {e}"
                )))
            }
        }
    }
    Ok(got)
}

/// One accepted connection: TLS first when asked for, then the hello, all within
/// [`HANDSHAKE_TIMEOUT`].
fn accept_link(
    mut s: TcpStream,
    key: &MeshKey,
    magic: u32,
    ranks: (u32, u32),
    expect: impl Fn(u32) -> bool,
    tls: Option<&MeshTls>,
) -> std::result::Result<(u32, Link), String> {
    let Some(tls) = tls else {
        return accept(&mut s, key, magic, ranks, expect).map(|p| (p, Link::Plain(s)));
    };
    let mut pipe = tls
        .accept(s, Instant::now() + HANDSHAKE_TIMEOUT)
        .map_err(|e| format!("TLS handshake: {e}"))?;
    let binding = pipe.binding().map_err(|e| format!("TLS exporter: {e}"))?;
    let from = accept_over(&mut pipe, key, &binding, magic, ranks, expect)?;
    pipe.socket().set_read_timeout(None).ok();
    pipe.socket().set_write_timeout(None).ok();
    Ok((from, Link::Tls(Box::new(pipe))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn both_ends_with_the_key_connect_and_a_wrong_key_or_generation_is_refused() {
        let key = MeshKey::new(5, &[7u8; 32]);
        let t = Duration::from_secs(5);
        // the right key
        let (mut d, mut a) = pair();
        let k = key.clone();
        let h = std::thread::spawn(move || accept(&mut a, &k, 0xABCD, (0, 3), |f| f == 2));
        dial(&mut d, &key, 0xABCD, (2, 0, 3), t).unwrap();
        assert_eq!(h.join().unwrap(), Ok(2));
        // a dialler with another key: the acceptor refuses it, and the dialler finds out too
        let (mut d, mut a) = pair();
        let k = key.clone();
        let h = std::thread::spawn(move || accept(&mut a, &k, 0xABCD, (0, 3), |_| true));
        let wrong = MeshKey::new(5, &[8u8; 32]);
        assert!(dial(&mut d, &wrong, 0xABCD, (1, 0, 3), t)
            .unwrap_err()
            .contains("does not hold"));
        assert!(h.join().unwrap().is_err());
        // another generation, a rank not expected, another protocol's magic: refused unanswered
        for (gen, from, magic) in [(6u64, 1u32, 0xABCDu32), (5, 0, 0xABCD), (5, 1, 0x1234)] {
            let (mut d, mut a) = pair();
            let k = key.clone();
            let h = std::thread::spawn(move || accept(&mut a, &k, 0xABCD, (0, 3), |f| f != 0));
            let other = MeshKey::new(gen, &[7u8; 32]);
            assert!(dial(&mut d, &other, magic, (from, 0, 3), t).is_err());
            assert!(
                h.join().unwrap().is_err(),
                "gen {gen} from {from} magic {magic:x}"
            );
        }
        // a stranger that replays a recorded hello and proof cannot pass a fresh nonce: the
        // acceptor's answer changes every time, so an old proof does not verify
        let (mut d, mut a) = pair();
        let k = key.clone();
        let h = std::thread::spawn(move || accept(&mut a, &k, 0xABCD, (0, 3), |_| true));
        let hl = hello(0xABCD, 5, 1, 0, 3, &[1u8; NONCE]);
        d.write_all(&hl).unwrap();
        let mut ans = [0u8; NONCE + MAC];
        d.read_exact(&mut ans).unwrap();
        d.write_all(mac(&key, b"dial", &[], &hl, &[9u8; NONCE]).as_ref())
            .unwrap();
        assert!(h.join().unwrap().unwrap_err().contains("does not prove"));
    }

    #[test]
    fn silent_strangers_do_not_hold_up_the_peers() {
        let key = MeshKey::new(9, &[3u8; 32]);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        // strangers that connect and say nothing, then one that talks nonsense
        let _silent: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let mut noise = TcpStream::connect(addr).unwrap();
        noise.write_all(&[0xFFu8; 64]).unwrap();
        let k = key.clone();
        let peers = std::thread::spawn(move || {
            (1..3u32)
                .map(|r| {
                    let mut s = TcpStream::connect(addr).unwrap();
                    dial(&mut s, &k, 0x55, (r, 0, 3), Duration::from_secs(5)).unwrap();
                    s
                })
                .collect::<Vec<_>>()
        });
        let t0 = Instant::now();
        let got = accept_peers(
            &l,
            &key,
            0x55,
            (0, 3),
            |f| f > 0,
            2,
            (t0 + Duration::from_secs(20), Duration::from_secs(20)),
            None,
        )
        .unwrap();
        // the silent ones' handshakes wait out their 5 s on their own threads
        assert!(t0.elapsed() < HANDSHAKE_TIMEOUT, "{:?}", t0.elapsed());
        let mut ranks: Vec<u32> = got.iter().map(|g| g.0).collect();
        ranks.sort();
        assert_eq!(ranks, vec![1, 2]);
        peers.join().unwrap();
    }

    /// Bounded fuzzing (proptest, in CI): whatever a stranger sends, the acceptor answers with
    /// an error, never a panic, and never takes it for a peer.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

            #[test]
            fn any_bytes_are_refused(
                edits in prop::collection::vec((0usize..HELLO, any::<u8>()), 0..6),
                tail in prop::collection::vec(any::<u8>(), 0..80),
            ) {
                let key = MeshKey::new(5, &[7u8; 32]);
                // a hello for this generation and rank, edited, then bytes that prove nothing
                let mut h = hello(0xABCD, 5, 1, 0, 2, &[3u8; NONCE]).to_vec();
                for (at, b) in edits {
                    h[at] = b;
                }
                h.extend_from_slice(&tail);
                let (mut d, mut a) = pair();
                let t = std::thread::spawn(move || {
                    let _ = d.write_all(&h);
                    // then hang up, so no read waits for its timeout
                    let _ = d.shutdown(std::net::Shutdown::Write);
                    let mut sink = Vec::new();
                    let _ = d.read_to_end(&mut sink);
                });
                let r = accept(&mut a, &key, 0xABCD, (0, 2), |f| f == 1);
                drop(a);
                t.join().unwrap();
                prop_assert!(r.is_err(), "{:?}", r);
            }
        }
    }
}

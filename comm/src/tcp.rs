//! The TCP backend for CPU workers: a full mesh of sockets per generation, generation-stamped
//! frames, a chunked and pipelined ring all-reduce (a sender thread writes to the next rank while
//! the caller's thread reads from the previous one and reduces), a latency path for small
//! buffers, and the ordered chain of the deterministic mode. `abort()` from any thread shuts every
//! socket down, which unblocks any pending read or write at once.
//!
//! Liveness: a heartbeat thread writes an empty frame to every peer whose socket is idle every
//! `liveness_timeout / 4`, and readers skip those frames. A read that gets nothing at all (not
//! even a heartbeat) for `liveness_timeout` fails with [`CommError::Silent`] naming the peer: a
//! stopped (SIGSTOP), frozen or cut-off process is found in seconds, while a peer that is merely
//! busy (a long step, a checkpoint) keeps its heartbeats coming and is waited for up to
//! `op_timeout`.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use crate::auth::{self, MeshKey};
use crate::buffer::{add_into, DType, Scratch};
use crate::error::{CommError, Result};
use crate::mesh_tls::{Link, MeshTls, TlsReader, TlsWriter};
use crate::rendezvous::Rendezvous;
use crate::strict::{self, DeviceCall, Strict};

/// The TCP backend's protocol tag (its hello and frames).
pub const MAGIC: u32 = 0x4443_544C; // "DCTL"
const HEADER: usize = 32;

/// Tunables of the TCP backend.
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Longest wait of one call for a peer that is alive (its heartbeats arrive) but sends no
    /// data: a slow or wedged step.
    pub op_timeout: Duration,
    /// Longest silence of a peer (no data, no heartbeat) before a read fails naming it.
    pub liveness_timeout: Duration,
    /// Longest wait for every rank at the rendezvous and for the mesh to connect.
    pub form_timeout: Duration,
    /// Pipelining unit of the ring.
    pub chunk_bytes: usize,
    /// All-reduces up to this size take the latency path (everyone to everyone).
    pub small_bytes: usize,
    /// Address peers use to reach this rank.
    pub advertise_host: String,
    /// Address to listen on (default: `advertise_host`, never every interface unless asked).
    pub bind_host: String,
    /// Largest frame or variable-length broadcast a peer may send; a longer one fails the
    /// communicator (naming the peer) before anything is allocated for it. The worker sets it
    /// from its job's state size.
    pub max_frame_bytes: u64,
    /// TLS for every connection of the mesh (a job's `mesh_tls`), else plain TCP.
    pub tls: Option<Arc<MeshTls>>,
    /// The device of the worker's tensors (the device face's `place`); CUDA tensors are staged
    /// through host memory.
    pub device: tch::Device,
    /// Check NCCL's rules on the device face ([`crate::strict`]): a call that breaks one fails.
    /// Every rank of a generation must agree (the point-to-point frames' header differs).
    pub strict: bool,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            op_timeout: Duration::from_secs(300),
            liveness_timeout: Duration::from_secs(6),
            form_timeout: Duration::from_secs(60),
            chunk_bytes: 1 << 20,
            small_bytes: 64 << 10,
            advertise_host: "127.0.0.1".into(),
            bind_host: "127.0.0.1".into(),
            max_frame_bytes: 1 << 30,
            tls: None,
            device: tch::Device::Cpu,
            strict: false,
        }
    }
}

impl TcpConfig {
    /// The defaults, with `DUCTILE_COMM_CHUNK_BYTES`, `DUCTILE_COMM_SMALL_BYTES`,
    /// `DUCTILE_COMM_TIMEOUT_SECS`, `DUCTILE_COMM_LIVENESS_MS`, `DUCTILE_COMM_HOST` (the
    /// address peers reach this rank at, and listens on) and `DUCTILE_COMM_BIND` (listen
    /// elsewhere, say `0.0.0.0` behind NAT) applied when set; `DUCTILE_COMM_STRICT=1` checks
    /// NCCL's rules ([`crate::strict`]).
    pub fn from_env() -> TcpConfig {
        let mut c = TcpConfig {
            strict: matches!(
                std::env::var("DUCTILE_COMM_STRICT").as_deref(),
                Ok("1") | Ok("true")
            ),
            ..TcpConfig::default()
        };
        let num = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
        if let Some(v) = num("DUCTILE_COMM_CHUNK_BYTES") {
            c.chunk_bytes = (v as usize).max(4096);
        }
        if let Some(v) = num("DUCTILE_COMM_SMALL_BYTES") {
            c.small_bytes = v as usize;
        }
        if let Some(v) = num("DUCTILE_COMM_TIMEOUT_SECS") {
            c.op_timeout = Duration::from_secs(v.max(1));
        }
        if let Some(v) = num("DUCTILE_COMM_LIVENESS_MS") {
            c.liveness_timeout = Duration::from_millis(v.max(200));
        }
        if let Ok(h) = std::env::var("DUCTILE_COMM_HOST") {
            c.bind_host = h.clone();
            c.advertise_host = h;
        }
        if let Ok(h) = std::env::var("DUCTILE_COMM_BIND") {
            c.bind_host = h;
        }
        c
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
enum Kind {
    // 1 was the unauthenticated hello (now `auth`'s handshake)
    AllReduce = 2,
    Broadcast = 3,
    AllGather = 4,
    ReduceScatter = 5,
    P2P = 6,
    Barrier = 7,
    Ordered = 8,
    /// An empty frame that says "alive"; readers skip it.
    Heartbeat = 9,
}

struct Peer {
    read: Mutex<Reader>,
    write: Mutex<Writer>,
}

/// The reading side of a peer's connection.
enum Reader {
    Plain(TcpStream),
    Tls(TlsReader),
}

impl Read for Reader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Reader::Plain(s) => s.read(buf),
            Reader::Tls(t) => t.read(buf),
        }
    }
}

/// The writing side of a peer's connection.
enum Writer {
    Plain(TcpStream),
    Tls(TlsWriter),
}

impl Write for Writer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Writer::Plain(s) => s.write(buf),
            Writer::Tls(t) => t.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Writer::Plain(s) => s.flush(),
            Writer::Tls(t) => t.flush(),
        }
    }
}

/// Aborts a communicator from any thread.
#[derive(Clone)]
pub struct AbortHandle {
    aborted: Arc<AtomicBool>,
    streams: Arc<Vec<TcpStream>>,
}

impl AbortHandle {
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        for s in self.streams.iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

/// A communicator of one generation over TCP.
pub struct TcpComm {
    generation: u64,
    rank: u32,
    world: u32,
    peers: Arc<Vec<Option<Peer>>>,
    abort: AbortHandle,
    seq: AtomicU64,
    op_lock: Mutex<Scratch>,
    cfg: TcpConfig,
    /// When the current op gives up on a live but silent peer (ms since `epoch`).
    op_deadline_ms: AtomicU64,
    epoch: Instant,
    heartbeat: Heartbeat,
    /// Bytes of frames (headers and payloads) this rank wrote to its peers.
    sent: AtomicU64,
    /// NCCL's rules checked (`TcpConfig::strict`).
    strict: Option<Strict>,
}

/// The heartbeat thread of a communicator; stopped when the communicator is dropped.
struct Heartbeat {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Heartbeat {
    fn start(
        peers: Arc<Vec<Option<Peer>>>,
        aborted: Arc<AtomicBool>,
        generation: u64,
        every: Duration,
    ) -> Heartbeat {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("heartbeat-g{generation}"))
            .spawn(move || {
                let frame = header(Kind::Heartbeat, generation, 0, 0);
                loop {
                    std::thread::park_timeout(every);
                    if s.load(Ordering::SeqCst) || aborted.load(Ordering::SeqCst) {
                        return;
                    }
                    for p in peers.iter().flatten() {
                        // a frame being written already says "alive"; never wait behind it
                        let Ok(mut w) = p.write.try_lock() else {
                            continue;
                        };
                        let _ = match &mut *w {
                            Writer::Plain(s) => send_heartbeat(s, &frame),
                            Writer::Tls(t) => t.write_if_ready(&frame),
                        };
                    }
                }
            })
            .ok();
        Heartbeat { stop, thread }
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Write a heartbeat without blocking on a full socket buffer (a peer that does not read is
/// found by its own silence, not by ours): skipped when nothing fits; a partly written frame
/// is finished (blocking, bounded by the write timeout) so the stream stays framed.
fn send_heartbeat(w: &mut TcpStream, frame: &[u8; HEADER]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain send(2) on an open socket from a valid buffer
    let n = unsafe {
        libc::send(
            w.as_raw_fd(),
            frame.as_ptr() as *const libc::c_void,
            frame.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return match e.kind() {
            std::io::ErrorKind::WouldBlock => Ok(()),
            _ => Err(e),
        };
    }
    w.write_all(&frame[n as usize..])
}

struct SendPtr(*const u8, usize, Kind);
unsafe impl Send for SendPtr {}

fn header(kind: Kind, generation: u64, seq: u64, len: u64) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&(kind as u32).to_le_bytes());
    h[8..16].copy_from_slice(&generation.to_le_bytes());
    h[16..24].copy_from_slice(&seq.to_le_bytes());
    h[24..32].copy_from_slice(&len.to_le_bytes());
    h
}

/// Connect to `addr` (each attempt bounded, retried until `deadline` while the peer is not
/// listening yet) and authenticate as rank `me` to rank `peer` of `world`.
pub(crate) fn dial_peer(
    addr: &str,
    key: &MeshKey,
    magic: u32,
    (me, peer, world): (u32, u32, u32),
    deadline: Instant,
) -> Result<TcpStream> {
    dial_link(addr, key, magic, (me, peer, world), deadline, None)?
        .into_plain()
        .map_err(|_| CommError::Unavailable("a plain dial came back with TLS".into()))
}

/// [`dial_peer`], over TLS when `tls` is given (the peer's certificate must name the host of
/// `addr`; the hello then runs inside the session, bound to it).
pub(crate) fn dial_link(
    addr: &str,
    key: &MeshKey,
    magic: u32,
    (me, peer, world): (u32, u32, u32),
    deadline: Instant,
    tls: Option<&MeshTls>,
) -> Result<Link> {
    let generation = key.generation();
    let fail = |e: std::io::Error| CommError::Connect {
        generation,
        peer,
        addr: addr.to_string(),
        source: e,
    };
    let to = addr
        .to_socket_addrs()
        .map_err(fail)?
        .next()
        .ok_or_else(|| fail(std::io::Error::other("no address")))?;
    let connect = || loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(
            &to,
            left.clamp(Duration::from_millis(1), Duration::from_secs(5)),
        ) {
            Ok(s) => break Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(fail(e)),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    let refused = |reason: String| {
        CommError::Unavailable(format!(
            "generation {generation}: rank {peer} at {addr}: {reason}"
        ))
    };
    let Some(tls) = tls else {
        // an acceptor at its bound of handshakes (strangers holding connections open) closes
        // a connection unread: dial again until the deadline
        loop {
            let mut s = connect()?;
            let left = deadline.saturating_duration_since(Instant::now());
            match auth::dial(&mut s, key, magic, (me, peer, world), left) {
                Ok(()) => return Ok(Link::Plain(s)),
                Err(e) if auth::closed_unread(&e) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(refused(e)),
            }
        }
    };
    let s = connect()?;
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    // the handshake and the hello, bounded by the formation's deadline like a plain hello
    let mut pipe = tls
        .connect(s, host, deadline)
        .map_err(|e| refused(format!("TLS handshake: {e}")))?;
    let binding = pipe
        .binding()
        .map_err(|e| refused(format!("TLS exporter: {e}")))?;
    auth::dial_over(&mut pipe, key, &binding, magic, (me, peer, world)).map_err(refused)?;
    pipe.socket().set_read_timeout(None).ok();
    pipe.socket().set_write_timeout(None).ok();
    Ok(Link::Tls(Box::new(pipe)))
}

/// Listen on `cfg.bind_host` (a free port), publish this rank's address under `topic` in the
/// generation's rendezvous, and gather every rank's address (bounded by `cfg.form_timeout`).
pub(crate) async fn listen_and_exchange(
    rdv: &Rendezvous,
    cfg: &TcpConfig,
    topic: &str,
) -> Result<(TcpListener, Vec<String>)> {
    let generation = rdv.generation;
    let listener = TcpListener::bind((cfg.bind_host.as_str(), 0)).map_err(|e| {
        CommError::Unavailable(format!(
            "generation {generation}: {topic}: cannot listen on {}: {e}",
            cfg.bind_host
        ))
    })?;
    let port = listener
        .local_addr()
        .map_err(|e| CommError::Unavailable(e.to_string()))?
        .port();
    rdv.publish(topic, format!("{}:{port}", cfg.advertise_host).as_bytes())
        .await?;
    let addrs = rdv
        .gather(topic, cfg.form_timeout)
        .await?
        .into_iter()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .collect();
    Ok((listener, addrs))
}

impl TcpComm {
    /// Form the communicator of `rdv`'s generation: listen, publish the address, gather every
    /// rank's, and connect the mesh (lower ranks are dialled, higher ranks accepted).
    pub async fn form(rdv: &Rendezvous, cfg: TcpConfig) -> Result<TcpComm> {
        let generation = rdv.generation;
        let key = rdv.mesh_key().await?;
        let (listener, addrs) = listen_and_exchange(rdv, &cfg, "tcp").await?;
        let (rank, world) = (rdv.rank, rdv.world);
        tokio::task::spawn_blocking(move || {
            Self::connect(listener, addrs, key, generation, rank, world, cfg)
        })
        .await
        .map_err(|e| CommError::Unavailable(format!("mesh task failed: {e}")))?
    }

    fn connect(
        listener: TcpListener,
        addrs: Vec<String>,
        key: MeshKey,
        generation: u64,
        rank: u32,
        world: u32,
        cfg: TcpConfig,
    ) -> Result<TcpComm> {
        let deadline = Instant::now() + cfg.form_timeout;
        let mut streams: Vec<Option<Link>> = (0..world).map(|_| None).collect();
        for peer in 0..rank {
            let addr = &addrs[peer as usize];
            streams[peer as usize] = Some(dial_link(
                addr,
                &key,
                MAGIC,
                (rank, peer, world),
                deadline,
                cfg.tls.as_deref(),
            )?);
        }
        for (peer, s) in auth::accept_peers(
            &listener,
            &key,
            MAGIC,
            (rank, world),
            move |p| p > rank,
            (world - rank - 1) as usize,
            (deadline, cfg.form_timeout),
            cfg.tls.clone(),
        )? {
            streams[peer as usize] = Some(s);
        }
        let mut raw = Vec::new();
        let mut peers = Vec::new();
        let unavailable = |e: std::io::Error| CommError::Unavailable(e.to_string());
        for link in streams {
            match link {
                Some(link) => {
                    let s = link.socket();
                    s.set_nodelay(true).ok();
                    // a read waits for a frame or a heartbeat; a write waits for a peer that is
                    // busy before it reads (compute is uneven), up to the op timeout
                    s.set_read_timeout(Some(cfg.liveness_timeout)).ok();
                    s.set_write_timeout(Some(cfg.op_timeout)).ok();
                    raw.push(s.try_clone().map_err(unavailable)?);
                    let (read, write) = match link {
                        Link::Plain(s) => (
                            Reader::Plain(s.try_clone().map_err(unavailable)?),
                            Writer::Plain(s),
                        ),
                        Link::Tls(pipe) => {
                            let (r, w) = pipe.split().map_err(unavailable)?;
                            (Reader::Tls(r), Writer::Tls(w))
                        }
                    };
                    peers.push(Some(Peer {
                        write: Mutex::new(write),
                        read: Mutex::new(read),
                    }));
                }
                None => peers.push(None),
            }
        }
        let peers = Arc::new(peers);
        let aborted = Arc::new(AtomicBool::new(false));
        let heartbeat = Heartbeat::start(
            peers.clone(),
            aborted.clone(),
            generation,
            (cfg.liveness_timeout / 4).max(Duration::from_millis(50)),
        );
        let cfg_strict = cfg.strict;
        Ok(TcpComm {
            generation,
            rank,
            world,
            peers,
            abort: AbortHandle {
                aborted,
                streams: Arc::new(raw),
            },
            seq: AtomicU64::new(0),
            op_lock: Mutex::new(Scratch::new()),
            cfg,
            op_deadline_ms: AtomicU64::new(u64::MAX),
            epoch: Instant::now(),
            heartbeat,
            sent: AtomicU64::new(0),
            strict: cfg_strict.then(|| Strict::new(generation, rank, world)),
        })
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }
    /// Bytes this rank wrote to its peers so far (frames of data; heartbeats not counted).
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
    pub fn world(&self) -> u32 {
        self.world
    }
    pub fn generation(&self) -> u64 {
        self.generation
    }
    pub fn device(&self) -> tch::Device {
        self.cfg.device
    }
    pub fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }
    pub fn abort(&self) {
        self.abort.abort()
    }

    /// A failed read: a timeout means the peer sent nothing, not even a heartbeat.
    fn read_err(&self, op: &'static str, peer: u32, e: std::io::Error) -> CommError {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                if !self.abort.is_aborted() =>
            {
                CommError::Silent {
                    generation: self.generation,
                    op,
                    peer,
                    after: self.cfg.liveness_timeout,
                }
            }
            _ => self.io_err(op, peer, e),
        }
    }

    fn io_err(&self, op: &'static str, peer: u32, e: std::io::Error) -> CommError {
        if self.abort.is_aborted() {
            return CommError::Aborted {
                generation: self.generation,
                op,
            };
        }
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => CommError::Timeout {
                generation: self.generation,
                op,
                peer,
                after: self.cfg.op_timeout,
            },
            _ => CommError::PeerLost {
                generation: self.generation,
                op,
                peer,
                source: e,
            },
        }
    }

    fn peer(&self, r: u32) -> &Peer {
        self.peers[r as usize]
            .as_ref()
            .expect("a peer of this mesh")
    }

    fn send(&self, op: &'static str, kind: Kind, seq: u64, to: u32, data: &[u8]) -> Result<()> {
        let mut w = self.peer(to).write.lock().unwrap();
        let h = header(kind, self.generation, seq, data.len() as u64);
        self.sent
            .fetch_add((HEADER + data.len()) as u64, Ordering::Relaxed);
        w.write_all(&h)
            .and_then(|_| w.write_all(data))
            .map_err(|e| self.io_err(op, to, e))
    }

    /// Read one frame's header from `from`, check it, and read its payload into `dst` (whose
    /// length must match).
    fn recv_into(
        &self,
        op: &'static str,
        kind: Kind,
        seq: u64,
        from: u32,
        dst: &mut [u8],
    ) -> Result<()> {
        let mut r = self.peer(from).read.lock().unwrap();
        let len = self.read_header(&mut *r, op, kind, seq, from)?;
        if len != dst.len() as u64 {
            return Err(CommError::Protocol {
                generation: self.generation,
                op,
                peer: from,
                reason: format!("frame of {len} bytes, expected {}", dst.len()),
            });
        }
        r.read_exact(dst).map_err(|e| self.read_err(op, from, e))
    }

    fn recv_frame(&self, op: &'static str, kind: Kind, seq: u64, from: u32) -> Result<Vec<u8>> {
        let mut r = self.peer(from).read.lock().unwrap();
        let len = self.read_header(&mut *r, op, kind, seq, from)?;
        self.check_len(op, from, len)?;
        let mut v = vec![0u8; len as usize];
        r.read_exact(&mut v)
            .map_err(|e| self.read_err(op, from, e))?;
        Ok(v)
    }

    fn read_header(
        &self,
        r: &mut impl Read,
        op: &'static str,
        kind: Kind,
        seq: u64,
        from: u32,
    ) -> Result<u64> {
        self.read_header_seq(r, op, kind, Some(seq), from)
            .map(|(len, _)| len)
    }

    /// [`TcpComm::read_header`] returning the frame's length and sequence field; `seq` None
    /// takes any sequence field (strict mode's point-to-point frames carry their own).
    fn read_header_seq(
        &self,
        r: &mut impl Read,
        op: &'static str,
        kind: Kind,
        seq: Option<u64>,
        from: u32,
    ) -> Result<(u64, u64)> {
        let mut h = [0u8; HEADER];
        loop {
            r.read_exact(&mut h)
                .map_err(|e| self.read_err(op, from, e))?;
            if u32::from_le_bytes(h[4..8].try_into().unwrap()) != Kind::Heartbeat as u32 {
                break;
            }
            // alive, but is it getting anywhere?
            let now = self.epoch.elapsed().as_millis() as u64;
            if now >= self.op_deadline_ms.load(Ordering::SeqCst) {
                return Err(CommError::Timeout {
                    generation: self.generation,
                    op,
                    peer: from,
                    after: self.cfg.op_timeout,
                });
            }
        }
        let magic = u32::from_le_bytes(h[0..4].try_into().unwrap());
        let k = u32::from_le_bytes(h[4..8].try_into().unwrap());
        let g = u64::from_le_bytes(h[8..16].try_into().unwrap());
        let s = u64::from_le_bytes(h[16..24].try_into().unwrap());
        if magic != MAGIC {
            return Err(CommError::Protocol {
                generation: self.generation,
                op,
                peer: from,
                reason: "bad magic".into(),
            });
        }
        if g != self.generation {
            return Err(CommError::WrongGeneration {
                generation: self.generation,
                op,
                peer: from,
                got: g,
            });
        }
        if k != kind as u32 || seq.is_some_and(|q| q != s) {
            return Err(CommError::Protocol {
                generation: self.generation,
                op,
                peer: from,
                reason: format!(
                    "frame of op {k} #{s}, expected op {} #{} (calls out of step)",
                    kind as u32,
                    seq.map_or("any".to_string(), |q| q.to_string())
                ),
            });
        }
        Ok((u64::from_le_bytes(h[24..32].try_into().unwrap()), s))
    }

    /// Enter a device-face call (strict mode: one thread at a time, [`crate::strict`]).
    pub(crate) fn device_call(&self, op: &'static str) -> Result<DeviceCall<'_>> {
        match &self.strict {
            Some(s) => s.enter(op),
            None => Ok(strict::off()),
        }
    }

    /// Whether NCCL's rules are checked ([`TcpConfig::strict`]).
    pub fn is_strict(&self) -> bool {
        self.strict.is_some()
    }

    /// Write one point-to-point frame to `to`; `lone`: from an exchange of sends only
    /// (strict mode numbers the frame and flags it, [`crate::strict`]).
    fn send_p2p(&self, op: &'static str, to: u32, data: &[u8], lone: bool) -> Result<()> {
        let mut w = self.peer(to).write.lock().unwrap();
        let seq = self.strict.as_ref().map_or(0, |s| s.on_send(to, lone));
        let h = header(Kind::P2P, self.generation, seq, data.len() as u64);
        self.sent
            .fetch_add((HEADER + data.len()) as u64, Ordering::Relaxed);
        w.write_all(&h)
            .and_then(|_| w.write_all(data))
            .map_err(|e| self.io_err(op, to, e))
    }

    /// Read one point-to-point frame's header from `from` (under its read lock), checked as
    /// strict mode asks; returns the payload's length.
    fn recv_p2p_header(&self, op: &'static str, from: u32, r: &mut Reader) -> Result<u64> {
        match &self.strict {
            None => self.read_header(r, op, Kind::P2P, 0, from),
            Some(s) => {
                let (len, seq) = self.read_header_seq(r, op, Kind::P2P, None, from)?;
                s.on_recv(op, from, seq)?;
                Ok(len)
            }
        }
    }

    /// Start an op: fail fast if aborted; on failure, abort the whole communicator so that every
    /// peer's pending call fails at once too (no one waits for a timeout).
    fn run<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut Scratch, u64) -> Result<T>,
    ) -> Result<T> {
        self.start_op(op)?;
        let mut scratch = self.op_lock.lock().unwrap();
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        self.arm_deadline();
        self.end_op(f(&mut scratch, seq))
    }

    /// Like `run` for point-to-point calls: no collectives' lock and no sequence number
    /// (frames between two ranks stay in order), the same deadline and abort on failure.
    fn run_p2p<T>(&self, op: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.start_op(op)?;
        self.arm_deadline();
        self.end_op(f())
    }

    fn start_op(&self, op: &'static str) -> Result<()> {
        if self.abort.is_aborted() {
            return Err(CommError::Aborted {
                generation: self.generation,
                op,
            });
        }
        Ok(())
    }

    fn arm_deadline(&self) {
        self.op_deadline_ms.store(
            (self.epoch.elapsed() + self.cfg.op_timeout).as_millis() as u64,
            Ordering::SeqCst,
        );
    }

    /// Any failure but a caller's mistake aborts the whole communicator, so peers fail fast.
    fn end_op<T>(&self, out: Result<T>) -> Result<T> {
        if let Err(e) = &out {
            if !matches!(e, CommError::Invalid { .. }) {
                if !self.abort.is_aborted() {
                    tracing::warn!(generation = self.generation, rank = self.rank, error = %e, "communicator call failed; aborting the communicator");
                }
                self.abort.abort();
            }
        }
        out
    }

    /// Runs `main` on this thread while a sender thread writes the frames `main` queues to `to`.
    fn with_sender<T>(
        &self,
        op: &'static str,
        seq: u64,
        to: u32,
        main: impl FnOnce(&mpsc::Sender<SendPtr>) -> Result<T>,
    ) -> Result<T> {
        std::thread::scope(|scope| {
            let (tx, rx) = mpsc::channel::<SendPtr>();
            let sender = scope.spawn(move || -> Result<()> {
                for SendPtr(p, n, k) in rx {
                    // SAFETY: `main` queues regions it no longer writes (see the ring's comments)
                    // and joins this thread before returning.
                    let data = unsafe { std::slice::from_raw_parts(p, n) };
                    self.send(op, k, seq, to, data)?;
                }
                Ok(())
            });
            let out = main(&tx);
            drop(tx);
            if out.is_err() {
                self.abort.abort();
            }
            let sent = sender
                .join()
                .unwrap_or_else(|_| Err(CommError::Unavailable("sender thread panicked".into())));
            let out = out?;
            sent?;
            Ok(out)
        })
    }

    fn chunks(&self, start: usize, end: usize, esize: usize) -> Vec<(usize, usize)> {
        let step = (self.cfg.chunk_bytes / esize).max(1) * esize;
        let mut v = Vec::new();
        let mut at = start;
        while at < end {
            let n = step.min(end - at);
            v.push((at, n));
            at += n;
        }
        v
    }

    /// Byte range of segment `k` of `n` over `len` bytes of `esize`-byte elements.
    fn segment(len: usize, esize: usize, n: u32, k: u32) -> (usize, usize) {
        let elems = len / esize;
        let a = elems * k as usize / n as usize;
        let b = elems * (k as usize + 1) / n as usize;
        (a * esize, b * esize)
    }

    /// Sum over all ranks, in place; every rank ends with the same bits.
    pub fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType) -> Result<()> {
        let op = "all_reduce";
        if !buf.len().is_multiple_of(dtype.size()) {
            return Err(CommError::Invalid {
                op,
                reason: "buffer is not whole elements".into(),
            });
        }
        if self.world == 1 {
            return self.run(op, |_, _| Ok(()));
        }
        self.run(op, |scratch, seq| {
            if buf.len() <= self.cfg.small_bytes {
                self.all_reduce_small(buf, dtype, seq, scratch)
            } else {
                self.ring_reduce_scatter(buf, dtype, seq, 0, scratch, true)
            }
        })
    }

    /// Latency path: everyone sends its whole buffer to everyone; each rank folds the buffers in
    /// rank order (so every rank holds the same bits).
    fn all_reduce_small(
        &self,
        buf: &mut [u8],
        dtype: DType,
        seq: u64,
        scratch: &mut Scratch,
    ) -> Result<()> {
        let op = "all_reduce";
        let (n, r, len) = (self.world as usize, self.rank as usize, buf.len());
        let all = scratch.get(len * n);
        all[r * len..(r + 1) * len].copy_from_slice(buf);
        std::thread::scope(|scope| -> Result<()> {
            let mine = SendPtr(buf.as_ptr(), len, Kind::AllReduce);
            let sender = scope.spawn(move || -> Result<()> {
                let mine = mine;
                let data = unsafe { std::slice::from_raw_parts(mine.0, mine.1) };
                for p in 0..self.world {
                    if p != self.rank {
                        self.send(op, Kind::AllReduce, seq, p, data)?;
                    }
                }
                Ok(())
            });
            let mut out = Ok(());
            for p in 0..self.world {
                if p != self.rank {
                    if let Err(e) = self.recv_into(
                        op,
                        Kind::AllReduce,
                        seq,
                        p,
                        &mut all[p as usize * len..(p as usize + 1) * len],
                    ) {
                        self.abort.abort();
                        out = Err(e);
                        break;
                    }
                }
            }
            let sent = sender
                .join()
                .unwrap_or_else(|_| Err(CommError::Unavailable("sender thread panicked".into())));
            out?;
            sent
        })?;
        let (first, rest) = all.split_at_mut(len);
        for k in 1..n {
            add_into(dtype, first, &rest[(k - 1) * len..k * len]);
        }
        buf.copy_from_slice(first);
        Ok(())
    }

    /// The ring: reduce-scatter (n-1 steps) and, for an all-reduce, all-gather (n-1 steps), each
    /// segment cut into chunks that are forwarded as soon as they are ready. With `shift` s,
    /// rank r ends the reduce-scatter owning segment (r + 1 + s) mod n.
    fn ring_reduce_scatter(
        &self,
        buf: &mut [u8],
        dtype: DType,
        seq: u64,
        shift: i64,
        scratch: &mut Scratch,
        all_gather: bool,
    ) -> Result<()> {
        let op = if all_gather {
            "all_reduce"
        } else {
            "reduce_scatter"
        };
        let kind = if all_gather {
            Kind::AllReduce
        } else {
            Kind::ReduceScatter
        };
        let (n, r) = (self.world as i64, self.rank as i64);
        let (next, prev) = (((r + 1) % n) as u32, ((r - 1 + n) % n) as u32);
        let len = buf.len();
        let seg = |k: i64| Self::segment(len, dtype.size(), self.world, k.rem_euclid(n) as u32);
        let base = buf.as_mut_ptr();
        let tmp = scratch.get(self.cfg.chunk_bytes.max(dtype.size()));
        self.with_sender(op, seq, next, |tx| {
            let q = |at: usize, n: usize| {
                let _ = tx.send(SendPtr(unsafe { base.add(at) }, n, kind));
            };
            // step 0 of the reduce-scatter: our own segment
            let (a, b) = seg(r + shift);
            for (at, n) in self.chunks(a, b, dtype.size()) {
                q(at, n);
            }
            for s in 0..n - 1 {
                let (a, b) = seg(r - s - 1 + shift);
                for (at, cn) in self.chunks(a, b, dtype.size()) {
                    let t = &mut tmp[..cn];
                    self.recv_into(op, kind, seq, prev, t)?;
                    // SAFETY: this chunk is not queued for sending until it is reduced here
                    let dst = unsafe { std::slice::from_raw_parts_mut(base.add(at), cn) };
                    add_into(dtype, dst, t);
                    // forward: the next reduce-scatter step, or (last step) the first all-gather step
                    if s + 1 < n - 1 || all_gather {
                        q(at, cn);
                    }
                }
            }
            if all_gather {
                // rank r owns segment r + 1 (+ shift); receive the others, forwarding each chunk
                for s in 0..n - 1 {
                    let (a, b) = seg(r - s + shift);
                    for (at, cn) in self.chunks(a, b, dtype.size()) {
                        // SAFETY: a segment arrives here only after our reduce-scatter send of it
                        // was consumed downstream (its reduction passed through us), so the
                        // sender no longer reads it
                        let dst = unsafe { std::slice::from_raw_parts_mut(base.add(at), cn) };
                        self.recv_into(op, kind, seq, prev, dst)?;
                        if s + 1 < n - 1 {
                            q(at, cn);
                        }
                    }
                }
            }
            Ok(())
        })
    }

    /// `input` holds world × k elements; each rank gets the sum of slot `rank` over all ranks in
    /// `out` (k elements).
    pub fn reduce_scatter_bytes(
        &self,
        input: &mut [u8],
        out: &mut [u8],
        dtype: DType,
    ) -> Result<()> {
        let op = "reduce_scatter";
        if input.len() != out.len() * self.world as usize || !out.len().is_multiple_of(dtype.size())
        {
            return Err(CommError::Invalid {
                op,
                reason: format!(
                    "input of {} bytes is not world ({}) × output ({} bytes)",
                    input.len(),
                    self.world,
                    out.len()
                ),
            });
        }
        if self.world > 1 {
            self.run(op, |scratch, seq| {
                self.ring_reduce_scatter(input, dtype, seq, -1, scratch, false)
            })?;
        }
        let (a, b) = Self::segment(input.len(), dtype.size(), self.world, self.rank);
        out.copy_from_slice(&input[a..b]);
        Ok(())
    }

    /// Every rank's `input` concatenated in rank order into `out` (world × input bytes).
    pub fn all_gather_bytes(&self, input: &[u8], out: &mut [u8]) -> Result<()> {
        let op = "all_gather";
        let len = input.len();
        if out.len() != len * self.world as usize {
            return Err(CommError::Invalid {
                op,
                reason: format!(
                    "output of {} bytes is not world ({}) × input ({len} bytes)",
                    out.len(),
                    self.world
                ),
            });
        }
        let (n, r) = (self.world as i64, self.rank as i64);
        out[r as usize * len..(r as usize + 1) * len].copy_from_slice(input);
        if n == 1 {
            return Ok(());
        }
        let (next, prev) = (((r + 1) % n) as u32, ((r - 1 + n) % n) as u32);
        let base = out.as_mut_ptr();
        self.run(op, |_, seq| {
            self.with_sender(op, seq, next, |tx| {
                let _ = tx.send(SendPtr(
                    unsafe { base.add(r as usize * len) },
                    len,
                    Kind::AllGather,
                ));
                for s in 0..n - 1 {
                    let slot = (r - s - 1).rem_euclid(n) as usize;
                    let dst = unsafe { std::slice::from_raw_parts_mut(base.add(slot * len), len) };
                    self.recv_into(op, Kind::AllGather, seq, prev, dst)?;
                    if s + 1 < n - 1 {
                        let _ = tx.send(SendPtr(dst.as_ptr(), len, Kind::AllGather));
                    }
                }
                Ok(())
            })
        })
    }

    /// `root`'s `buf` to every rank, pipelined along the ring from the root.
    pub fn broadcast_bytes(&self, buf: &mut [u8], root: u32) -> Result<()> {
        let op = "broadcast";
        if root >= self.world {
            return Err(CommError::Invalid {
                op,
                reason: format!("root {root} outside world {}", self.world),
            });
        }
        if self.world == 1 {
            return Ok(());
        }
        self.run(op, |_, seq| {
            self.chain_broadcast(op, Kind::Broadcast, seq, buf, root)
        })
    }

    fn chain_broadcast(
        &self,
        op: &'static str,
        kind: Kind,
        seq: u64,
        buf: &mut [u8],
        root: u32,
    ) -> Result<()> {
        let n = self.world;
        let (next, prev) = ((self.rank + 1) % n, (self.rank + n - 1) % n);
        let forward = next != root;
        let chunks = self.chunks(0, buf.len(), 1);
        let base = buf.as_mut_ptr();
        if self.rank == root {
            return self.with_sender(op, seq, next, |tx| {
                for (at, cn) in &chunks {
                    let _ = tx.send(SendPtr(unsafe { base.add(*at) }, *cn, kind));
                }
                Ok(())
            });
        }
        let recv_all = |tx: Option<&mpsc::Sender<SendPtr>>| -> Result<()> {
            for (at, cn) in &chunks {
                let dst = unsafe { std::slice::from_raw_parts_mut(base.add(*at), *cn) };
                self.recv_into(op, kind, seq, prev, dst)?;
                if let Some(tx) = tx {
                    let _ = tx.send(SendPtr(dst.as_ptr(), *cn, kind));
                }
            }
            Ok(())
        };
        if forward {
            self.with_sender(op, seq, next, |tx| recv_all(Some(tx)))
        } else {
            recv_all(None)
        }
    }

    /// Every rank's bytes, of any length up to `max_frame_bytes`, in rank order: the lengths
    /// first (each checked against the cap), then the payloads padded to the longest.
    pub fn all_gather_vec(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let op = "all_gather";
        let w = self.world as usize;
        let mut lens = vec![0u8; 8 * w];
        self.all_gather_bytes(&(mine.len() as u64).to_le_bytes(), &mut lens)?;
        let lens: Vec<u64> = lens
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        for (p, l) in lens.iter().enumerate() {
            if let Err(e) = self.check_len(op, p as u32, *l) {
                self.abort();
                return Err(e);
            }
        }
        let max = *lens.iter().max().unwrap_or(&0) as usize;
        if max == 0 {
            return Ok(vec![Vec::new(); w]);
        }
        let mut padded = mine.to_vec();
        padded.resize(max, 0);
        let mut all = vec![0u8; max * w];
        self.all_gather_bytes(&padded, &mut all)?;
        Ok(all
            .chunks_exact(max)
            .zip(&lens)
            .map(|(c, l)| c[..*l as usize].to_vec())
            .collect())
    }

    /// A byte buffer of any length from `root` (state transfer): the length goes first.
    pub fn broadcast_vec(&self, buf: &mut Vec<u8>, root: u32) -> Result<()> {
        let mut len = (buf.len() as u64).to_le_bytes();
        self.broadcast_bytes(&mut len, root)?;
        let len = u64::from_le_bytes(len);
        if let Err(e) = self.check_len("broadcast", root, len) {
            self.abort();
            return Err(e);
        }
        buf.resize(len as usize, 0);
        self.broadcast_bytes(buf, root)
    }

    /// Fault injection: write to `peer` the header of the next all-reduce's frame announcing
    /// 2^62 bytes (see [`crate::Communicator::inject_oversized_frame`]).
    pub fn inject_oversized_frame(&self, peer: u32) -> Result<()> {
        self.check_peer("inject_oversized_frame", peer)?;
        let seq = self.seq.load(Ordering::SeqCst);
        let mut w = self.peer(peer).write.lock().unwrap();
        w.write_all(&header(Kind::AllReduce, self.generation, seq, 1 << 62))
            .map_err(|e| CommError::Invalid {
                op: "inject_oversized_frame",
                reason: e.to_string(),
            })
    }

    /// A length a peer announced, against `max_frame_bytes`.
    fn check_len(&self, op: &'static str, peer: u32, len: u64) -> Result<()> {
        if len > self.cfg.max_frame_bytes {
            return Err(CommError::Protocol {
                generation: self.generation,
                op,
                peer,
                reason: format!(
                    "announced {len} bytes, over this job's cap of {} (max_frame_bytes)",
                    self.cfg.max_frame_bytes
                ),
            });
        }
        Ok(())
    }

    /// Point to point: send to `peer` (which must call `recv_*` from us, in the same order).
    /// Point-to-point calls take only the peer's socket lock, not the collectives' lock, so
    /// one thread may send while another receives (a pipeline stage sends activations on a
    /// sender thread while it waits for gradients); frames between two ranks stay in order.
    pub fn send_bytes(&self, data: &[u8], peer: u32) -> Result<()> {
        self.send_bytes_from(data, peer, false)
    }

    /// [`TcpComm::send_bytes`] from an exchange of sends only (`lone`) or not.
    pub(crate) fn send_bytes_from(&self, data: &[u8], peer: u32, lone: bool) -> Result<()> {
        self.check_peer("send", peer)?;
        self.run_p2p("send", || self.send_p2p("send", peer, data, lone))
    }

    /// Receive into `dst` exactly what `peer` sent.
    pub fn recv_bytes(&self, dst: &mut [u8], peer: u32) -> Result<()> {
        let op = "recv";
        self.check_peer(op, peer)?;
        self.run_p2p(op, || {
            let mut r = self.peer(peer).read.lock().unwrap();
            let len = self.recv_p2p_header(op, peer, &mut r)?;
            if len != dst.len() as u64 {
                return Err(CommError::Protocol {
                    generation: self.generation,
                    op,
                    peer,
                    reason: format!("frame of {len} bytes, expected {}", dst.len()),
                });
            }
            r.read_exact(dst).map_err(|e| self.read_err(op, peer, e))
        })
    }

    /// Receive a message of any length from `peer`.
    pub fn recv_vec(&self, peer: u32) -> Result<Vec<u8>> {
        let op = "recv";
        self.check_peer(op, peer)?;
        self.run_p2p(op, || {
            let mut r = self.peer(peer).read.lock().unwrap();
            let len = self.recv_p2p_header(op, peer, &mut r)?;
            self.check_len(op, peer, len)?;
            let mut v = vec![0u8; len as usize];
            r.read_exact(&mut v)
                .map_err(|e| self.read_err(op, peer, e))?;
            Ok(v)
        })
    }

    fn check_peer(&self, op: &'static str, peer: u32) -> Result<()> {
        if peer >= self.world || peer == self.rank {
            return Err(CommError::Invalid {
                op,
                reason: format!("peer {peer} is not another rank of world {}", self.world),
            });
        }
        Ok(())
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        let op = "barrier";
        if self.world == 1 {
            return Ok(());
        }
        self.run(op, |_, seq| {
            for p in 0..self.world {
                if p != self.rank {
                    self.send(op, Kind::Barrier, seq, p, &[])?;
                }
            }
            for p in 0..self.world {
                if p != self.rank {
                    self.recv_into(op, Kind::Barrier, seq, p, &mut [])?;
                }
            }
            Ok(())
        })
    }

    /// Deterministic all-reduce: `shards` are this rank's logical shards (global index and
    /// bytes, indices contiguous and increasing; rank r's come after rank r-1's); `out` gets, on
    /// every rank, the left fold c0 + c1 + … + c(total-1) in global index order, so the bits do
    /// not depend on the world size or on which rank holds which shard. A chain through the ranks
    /// in rank order (pipelined by chunks), then a broadcast from the last rank.
    pub fn ordered_all_reduce_bytes(
        &self,
        shards: &[(u64, &[u8])],
        total: u64,
        out: &mut [u8],
        dtype: DType,
    ) -> Result<()> {
        let op = "ordered_all_reduce";
        let len = out.len();
        for (i, (idx, s)) in shards.iter().enumerate() {
            if s.len() != len {
                return Err(CommError::Invalid {
                    op,
                    reason: format!("shard {idx} has {} bytes, the output {len}", s.len()),
                });
            }
            if i > 0 && *idx != shards[i - 1].0 + 1 {
                return Err(CommError::Invalid {
                    op,
                    reason: format!(
                        "shard indices must be contiguous: {} after {}",
                        idx,
                        shards[i - 1].0
                    ),
                });
            }
        }
        let n = self.world;
        self.run(op, |_, seq| {
            // 1. how far the fold has come: each rank learns the next index from its predecessor
            let mut next_index = 0u64;
            if self.rank > 0 {
                let v = self.recv_frame(op, Kind::Ordered, seq, self.rank - 1)?;
                let bytes: [u8; 8] = v.as_slice().try_into().map_err(|_| CommError::Protocol {
                    generation: self.generation,
                    op,
                    peer: self.rank - 1,
                    reason: format!("an index frame of {} bytes, not 8", v.len()),
                })?;
                next_index = u64::from_le_bytes(bytes);
            }
            if let Some((first, _)) = shards.first() {
                if *first != next_index {
                    return Err(CommError::Invalid { op, reason: format!("rank {} holds shards from {first}, but the fold reached {next_index}: shards must be in rank order", self.rank) });
                }
            }
            let after = next_index + shards.len() as u64;
            let has_partial = next_index > 0;
            if self.rank + 1 < n {
                self.send(op, Kind::Ordered, seq, self.rank + 1, &after.to_le_bytes())?;
            } else if after != total {
                return Err(CommError::Invalid { op, reason: format!("the ranks hold {after} shards in all, expected {total}") });
            }
            // 2. the chain, chunk by chunk: receive the partial fold, add our shards in order,
            //    pass it on; the last rank sends each finished chunk straight on to rank 0, so
            //    3. the broadcast of the result (last → 0 → 1 → … → n-2) overlaps the chain.
            let chunks = self.chunks(0, len, dtype.size());
            let base = out.as_mut_ptr();
            let fold = |at: usize, cn: usize| {
                let dst = unsafe { std::slice::from_raw_parts_mut(base.add(at), cn) };
                let mut rest = shards;
                if !has_partial {
                    dst.copy_from_slice(&shards[0].1[at..at + cn]);
                    rest = &shards[1..];
                }
                for (_, s) in rest {
                    add_into(dtype, dst, &s[at..at + cn]);
                }
            };
            if n == 1 {
                for (at, cn) in &chunks {
                    fold(*at, *cn);
                }
                return Ok(());
            }
            let (r, last) = (self.rank, n - 1);
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            let in_chain = has_partial || !shards.is_empty();
            self.with_sender(op, seq, next, |tx| {
                let q = |at: usize, cn: usize, k: Kind| {
                    let _ = tx.send(SendPtr(unsafe { base.add(at) }, cn, k));
                };
                if in_chain && !has_partial && shards.len() == 1 && r != last {
                    // a chain head with one shard: its partial fold is the shard itself; send it
                    // as it is (the result arrives with the broadcast)
                    for (at, cn) in &chunks {
                        let _ = tx.send(SendPtr(unsafe { shards[0].1.as_ptr().add(*at) }, *cn, Kind::Ordered));
                    }
                } else if in_chain {
                    for (at, cn) in &chunks {
                        if has_partial {
                            let dst = unsafe { std::slice::from_raw_parts_mut(base.add(*at), *cn) };
                            self.recv_into(op, Kind::Ordered, seq, r - 1, dst)?;
                        }
                        fold(*at, *cn);
                        // SAFETY: the chunk is final here; nothing writes it again until the
                        // broadcast brings it back, which needs this send to have gone through
                        if r < last {
                            q(*at, *cn, Kind::Ordered);
                        } else {
                            q(*at, *cn, Kind::Broadcast);
                        }
                    }
                }
                if r != last {
                    for (at, cn) in &chunks {
                        let dst = unsafe { std::slice::from_raw_parts_mut(base.add(*at), *cn) };
                        self.recv_into(op, Kind::Broadcast, seq, prev, dst)?;
                        if next != last {
                            q(*at, *cn, Kind::Broadcast);
                        }
                    }
                }
                Ok(())
            })
        })
    }
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        self.heartbeat.stop();
        for s in self.abort.streams.iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Communicator, HostChannel, ReduceOp};
    use ductile_cluster::{Keys, Store};
    use std::sync::Arc;

    fn store() -> Store {
        Store::new(
            Arc::new(ductile_cluster::memory::MemoryBackend::new()),
            Keys::default(),
        )
    }

    async fn world(store: &Store, generation: u64, n: u32, cfg: TcpConfig) -> Vec<TcpComm> {
        let tasks: Vec<_> = (0..n)
            .map(|r| {
                let (store, cfg) = (store.clone(), cfg.clone());
                tokio::spawn(async move {
                    store.ensure_mesh_key("j", generation).await.unwrap();
                    let rdv = Rendezvous::new(store, "j", generation, n, r).unwrap();
                    TcpComm::form(&rdv, cfg).await.unwrap()
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    }

    fn on_threads<T: Send>(comms: &[TcpComm], f: impl Fn(&TcpComm) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            comms
                .iter()
                .map(|c| s.spawn(|| f(c)))
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect()
        })
    }

    /// Certificates as an operator makes them (`scripts/secure.sh certs`), in a fresh directory.
    fn pki(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "ductile-pki-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/secure.sh");
        let out = std::process::Command::new("bash")
            .arg(script)
            .arg("certs")
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    }

    fn mesh_tls(dir: &std::path::Path) -> Arc<MeshTls> {
        Arc::new(
            MeshTls::from_files(
                &dir.join("ca.pem"),
                &dir.join("mesh.pem"),
                &dir.join("mesh-key.pem"),
            )
            .unwrap(),
        )
    }

    /// Over TLS every collective gives what it gives over plain TCP (the small and the ring
    /// paths, broadcasts of any length, point to point), and a quiet mesh stays alive on its
    /// heartbeats, which go through TLS too.
    /// Two groups of a world of 4, one listing its members out of rank order: each sums in
    /// its own member order (the same bits on both members), gathers in member order, and a
    /// group whose peer is gone fails with the error instead of waiting.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn groups_sum_in_member_order_and_fail_when_a_member_is_gone() {
        use crate::group::Group;
        let comms: Vec<Arc<dyn Communicator>> = world(&store(), 80, 4, TcpConfig::default())
            .await
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect();
        let members = |r: u32| if r < 2 { vec![0, 1] } else { vec![3, 2] };
        // 4 MiB each: more than a socket buffer, so both members send at once
        let n = 1 << 20;
        let value = move |r: u32| {
            // sums that depend on the order: 1e8 + 1 − 1e8 is 0 in f32, −1e8 + 1 + 1e8 is 0 too,
            // but 1 + (1e8 − 1e8) is 1
            let v = [1e8f32, 1.0, -1e8, 1.0][r as usize];
            tch::Tensor::full([n], v as f64, (tch::Kind::Float, tch::Device::Cpu))
        };
        let out = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let g = Group::new(c.clone(), members(c.rank())).unwrap();
                        let sum = g.all_reduce_sum(&value(c.rank())).unwrap();
                        let parts = g.all_gather(&value(c.rank())).unwrap();
                        let max = g.all_reduce_max(&value(c.rank())).unwrap();
                        (g.rank(), sum, parts, max)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        assert_eq!(out[3].0, 0, "rank 3 is the first member of its group");
        for (r, (_, sum, parts, max)) in out.iter().enumerate() {
            let ms = members(r as u32);
            let want = value(ms[0]) + value(ms[1]);
            assert!(sum.equal(&want), "rank {r}: member-order sum");
            for (p, m) in parts.iter().zip(&ms) {
                assert!(p.equal(&value(*m)), "rank {r}: gathered in member order");
            }
            assert!(max.equal(&value(ms[0]).maximum(&value(ms[1]))));
        }
        assert!(out[0].1.equal(&out[1].1) && out[2].1.equal(&out[3].1));
        // refused groups
        for bad in [vec![0, 0, 1], vec![1, 2], vec![0, 9]] {
            let e = Group::new(comms[0].clone(), bad.clone()).unwrap_err();
            assert!(matches!(e, CommError::Invalid { .. }), "{bad:?}: {e}");
        }
        // a gone member: the other one's collective fails, bounded
        comms[1].abort();
        let g = Group::new(comms[0].clone(), vec![0, 1]).unwrap();
        let t0 = std::time::Instant::now();
        let mine = value(0);
        let e = std::thread::spawn(move || g.all_reduce_sum(&mine).unwrap_err())
            .join()
            .unwrap();
        assert!(t0.elapsed() < Duration::from_secs(60), "bounded: {e}");
    }

    /// A group's ring all-reduce sums every member's tensor (integers, exact in f32) and
    /// leaves the same bits on every member, members in any rank order, chunks uneven and
    /// larger than a socket buffer, and a tensor shorter than the group (empty chunks).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_group_s_ring_all_reduce_sums_every_member_s_tensor() {
        use crate::group::Group;
        let comms: Vec<Arc<dyn Communicator>> = world(&store(), 81, 4, TcpConfig::default())
            .await
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect();
        let order = vec![2u32, 0, 3, 1];
        for len in [1_000_003i64, 3, 0] {
            let value = move |r: u32| {
                tch::Tensor::arange(len, (tch::Kind::Float, tch::Device::Cpu)).fmod(97)
                    * (r + 1) as f64
            };
            let out = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .iter()
                    .map(|c| {
                        let order = order.clone();
                        s.spawn(move || {
                            let g = Group::new(c.clone(), order).unwrap();
                            let mine = value(c.rank());
                            let sum = g.ring_all_reduce_sum(&mine).unwrap();
                            assert!(mine.equal(&value(c.rank())), "the input keeps its value");
                            sum
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap())
                    .collect::<Vec<_>>()
            });
            let want = value(0) * 10.0;
            for (r, sum) in out.iter().enumerate() {
                assert_eq!(sum.size(), vec![len], "rank {r}");
                assert!(
                    sum.equal(&want),
                    "rank {r}, length {len}: the sum of 1..=4 times the base"
                );
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_collective_works_over_tls_and_its_heartbeats_keep_it_alive() {
        let dir = pki("ok");
        let cfg = TcpConfig {
            tls: Some(mesh_tls(&dir)),
            liveness_timeout: Duration::from_millis(400),
            ..TcpConfig::default()
        };
        let comms = world(&store(), 70, 3, cfg).await;
        for r in on_threads(&comms, |c| crate::selftest::collectives(c)) {
            r.unwrap();
        }
        // quiet for 5 liveness timeouts: heartbeats alone keep every peer alive
        std::thread::sleep(Duration::from_secs(2));
        let sums = on_threads(&comms, |c| {
            let mut v: Vec<u8> = (0..(3u32 << 20) / 4)
                .flat_map(|i| ((i % 1000) as f32 + c.rank() as f32).to_le_bytes())
                .collect();
            c.all_reduce_bytes(&mut v, DType::F32).map(|_| v)
        });
        let first = sums[0].as_ref().unwrap();
        for s in &sums {
            assert_eq!(s.as_ref().unwrap(), first, "every rank holds the same bits");
        }
        let x = f32::from_le_bytes(first[4 * 7..4 * 8].try_into().unwrap());
        assert_eq!(x, 3.0 * 7.0 + 3.0, "7·3 + (0+1+2)");
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A rank whose certificate another CA signed cannot join: its TLS handshake fails, the
    /// mesh does not form with it, and the error says where.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rank_with_a_certificate_of_another_ca_is_refused() {
        let (good, other) = (pki("good"), pki("other"));
        let s = store();
        s.ensure_mesh_key("j", 71).await.unwrap();
        let cfg = |dir: &std::path::Path| TcpConfig {
            tls: Some(mesh_tls(dir)),
            form_timeout: Duration::from_secs(3),
            ..TcpConfig::default()
        };
        let (s0, c0) = (s.clone(), cfg(&good));
        let rank0 = tokio::spawn(async move {
            TcpComm::form(&Rendezvous::new(s0, "j", 71, 2, 0).unwrap(), c0).await
        });
        let (s1, c1) = (s.clone(), cfg(&other));
        let rank1 = tokio::spawn(async move {
            TcpComm::form(&Rendezvous::new(s1, "j", 71, 2, 1).unwrap(), c1).await
        });
        let e1 = rank1.await.unwrap().err().expect("rank 1 must not join");
        assert!(e1.to_string().contains("TLS handshake"), "{e1}");
        let e0 = rank0
            .await
            .unwrap()
            .err()
            .expect("rank 0 must not form with it");
        assert!(e0.to_string().contains("rank"), "{e0}");
        let _ = std::fs::remove_dir_all(good);
        let _ = std::fs::remove_dir_all(other);
    }

    /// Every collective through the host-staging path that CUDA tensors take (plain host
    /// buffers stand in for pinned ones on a machine without CUDA), against the same references.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn staged_collectives_match_their_references() {
        use crate::staging::HostStaged;
        let s = store();
        let comms = world(&s, 40, 3, TcpConfig::default()).await;
        for r in on_threads(&comms, |c| crate::selftest::collectives(&HostStaged(c))) {
            r.unwrap();
        }
        let comms = world(&s, 41, 2, TcpConfig::default()).await;
        let outs = on_threads(&comms, |c| {
            crate::selftest::ordered(&HostStaged(c), 5, 4099)
        });
        let outs: Vec<Vec<u8>> = outs.into_iter().map(|o| o.unwrap()).collect();
        assert_eq!(outs[0], outs[1]);
        // and the direct path gives the same bits
        let comms = world(&s, 42, 2, TcpConfig::default()).await;
        let direct = on_threads(&comms, |c| crate::selftest::ordered(c, 5, 4099));
        assert_eq!(direct[0].as_ref().unwrap(), &outs[0]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn collectives_match_references_for_worlds_1_to_4() {
        let s = store();
        for n in 1..=4 {
            // a small chunk size so the pipelined ring runs many chunks
            let cfg = TcpConfig {
                chunk_bytes: 8 << 10,
                small_bytes: 4 << 10,
                ..TcpConfig::default()
            };
            let comms = world(&s, 10 + n as u64, n, cfg).await;
            for r in on_threads(&comms, |c| crate::selftest::collectives(c)) {
                r.unwrap_or_else(|e| panic!("world {n}: {e}"));
            }
        }
    }

    /// The whole conformance suite (groups included) on the TCP backend, worlds 1 to 4: what
    /// `scripts/gpu-check.sh` runs on NCCL.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_conformance_suite_passes_at_worlds_1_to_4() {
        let s = store();
        for n in 1..=4u32 {
            let comms: Vec<Arc<dyn Communicator>> =
                world(&s, 90 + n as u64, n, TcpConfig::default())
                    .await
                    .into_iter()
                    .map(|c| Arc::new(c) as Arc<dyn Communicator>)
                    .collect();
            let results = std::thread::scope(|sc| {
                comms
                    .iter()
                    .map(|c| sc.spawn(|| crate::selftest::all(c)))
                    .collect::<Vec<_>>()
                    .into_iter()
                    .map(|h| h.join().unwrap())
                    .collect::<Vec<_>>()
            });
            for r in results {
                r.unwrap_or_else(|e| panic!("world {n}: {e}"));
            }
        }
    }

    /// The deadlock shape: two ranks that both send first, 64 MiB each, far more than the
    /// sockets buffer. Sending, then receiving, each blocks in its write until the op timeout
    /// (bounded: it fails, naming the op); one exchange of the same send and receive completes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_ranks_that_both_send_first_complete_in_one_exchange() {
        let cfg = TcpConfig {
            op_timeout: Duration::from_secs(3),
            ..TcpConfig::default()
        };
        let s = store();
        let n = 16 << 20;
        let naive = world(&s, 97, 2, cfg.clone()).await;
        let t0 = Instant::now();
        let outs = on_threads(&naive, |c| {
            let peer = 1 - c.rank();
            let out = c.place(&tch::Tensor::ones(
                [n],
                (tch::Kind::Float, tch::Device::Cpu),
            ));
            let inn = c.zeros(&[n], tch::Kind::Float);
            Communicator::send(c, &out, peer).and_then(|_| Communicator::recv(c, &inn, peer))
        });
        assert!(
            outs.iter().all(|o| o.is_err()),
            "send-then-receive of 64 MiB both ways should block until the op timeout: {:?}",
            outs.iter()
                .map(|o| o.as_ref().err().map(|e| e.to_string()))
                .collect::<Vec<_>>()
        );
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "bounded by the op timeout"
        );
        let comms = world(&s, 98, 2, cfg).await;
        let t0 = Instant::now();
        let got = on_threads(&comms, |c| {
            let peer = 1 - c.rank();
            let out = c.place(
                &(tch::Tensor::ones([n], (tch::Kind::Float, tch::Device::Cpu))
                    * (c.rank() + 1) as f64),
            );
            let inn = c.zeros(&[n], tch::Kind::Float);
            c.exchange(&[(peer, &out)], &[(peer, &inn)])
                .map(|_| inn.tensor().sum(tch::Kind::Double).double_value(&[]))
        });
        for (r, g) in got.iter().enumerate() {
            let peer = 1 - r;
            assert_eq!(
                *g.as_ref().unwrap(),
                (n * (peer as i64 + 1)) as f64,
                "rank {r}"
            );
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    }

    /// Strict mode ([`crate::strict`]): two ranks that each send before receiving, in
    /// exchanges of sends only, pass on TCP (the socket buffers take a small tensor) but would
    /// hang on NCCL: strict mode fails them on receipt, naming the rule; the same tensors in
    /// one exchange, or a send met by a receive, pass; small tensors, so only the rule can fail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn strict_mode_fails_two_lone_sends_that_cross_and_passes_legal_exchanges() {
        let s = store();
        let lenient = TcpConfig {
            op_timeout: Duration::from_secs(5),
            ..TcpConfig::default()
        };
        let strict = TcpConfig {
            strict: true,
            ..lenient.clone()
        };
        let cross = |c: &TcpComm| {
            let peer = 1 - c.rank();
            let out = c.place(&tch::Tensor::ones(
                [16],
                (tch::Kind::Float, tch::Device::Cpu),
            ));
            let inn = c.zeros(&[16], tch::Kind::Float);
            Communicator::send(c, &out, peer).and_then(|_| Communicator::recv(c, &inn, peer))
        };
        // lenient: TCP buffers the small sends, both complete
        let comms = world(&s, 201, 2, lenient).await;
        assert!(on_threads(&comms, cross).iter().all(|r| r.is_ok()));
        // strict: both fail, naming the rule
        let comms = world(&s, 202, 2, strict.clone()).await;
        assert!(comms[0].is_strict());
        for r in on_threads(&comms, cross) {
            let e = r.expect_err("two lone sends that cross");
            assert!(
                matches!(e, CommError::Rule { .. })
                    && e.to_string().contains("breaks NCCL's rules")
                    && e.to_string().contains("outside one exchange"),
                "{e}"
            );
        }
        // strict, legal: one exchange both ways; then rank 0 sends first and rank 1 receives
        // first, twice (earlier frames counted on both sides); host messages between
        let comms = world(&s, 203, 2, strict).await;
        let got = on_threads(&comms, |c| -> Result<f64> {
            let peer = 1 - c.rank();
            let out = c.place(
                &(tch::Tensor::ones([16], (tch::Kind::Float, tch::Device::Cpu))
                    * (c.rank() + 1) as f64),
            );
            let inn = c.zeros(&[16], tch::Kind::Float);
            c.exchange(&[(peer, &out)], &[(peer, &inn)])?;
            let mut sum = inn.tensor().sum(tch::Kind::Double).double_value(&[]);
            for _ in 0..2 {
                if c.rank() == 0 {
                    Communicator::send(c, &out, peer)?;
                    Communicator::recv(c, &inn, peer)?;
                } else {
                    Communicator::recv(c, &inn, peer)?;
                    Communicator::send(c, &out, peer)?;
                }
                sum += inn.tensor().sum(tch::Kind::Double).double_value(&[]);
                HostChannel::send_msg(c, b"x", peer)?;
                HostChannel::recv_msg(c, peer)?;
            }
            Ok(sum)
        });
        assert_eq!(got[0].as_ref().unwrap(), &(3.0 * 32.0));
        assert_eq!(got[1].as_ref().unwrap(), &(3.0 * 16.0));
    }

    /// Strict mode: a device call that starts while another thread's is in flight on the same
    /// communicator fails at once, naming both (NCCL takes one thread's calls at a time); the
    /// first call completes; afterwards, calls from another thread are fine.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn strict_mode_fails_a_second_thread_s_call_while_one_is_in_flight() {
        let s = store();
        let cfg = TcpConfig {
            op_timeout: Duration::from_secs(10),
            strict: true,
            ..TcpConfig::default()
        };
        let comms = world(&s, 204, 2, cfg).await;
        let (a, b) = (&comms[0], &comms[1]);
        std::thread::scope(|sc| {
            // rank 0's all-reduce waits for rank 1's
            let first = sc.spawn(|| {
                let mut t = a.place(&tch::Tensor::ones(
                    [8],
                    (tch::Kind::Float, tch::Device::Cpu),
                ));
                a.all_reduce(&mut t, ReduceOp::Sum)
                    .map(|_| t.tensor().double_value(&[0]))
            });
            std::thread::sleep(Duration::from_millis(300));
            let mut u = a.place(&tch::Tensor::ones(
                [8],
                (tch::Kind::Float, tch::Device::Cpu),
            ));
            let e = a.broadcast(&mut u, 0).expect_err("a second thread's call");
            assert!(
                matches!(e, CommError::Rule { .. })
                    && e.to_string().contains("broadcast")
                    && e.to_string().contains("all_reduce was in flight"),
                "{e}"
            );
            let mut t = b.place(&tch::Tensor::ones(
                [8],
                (tch::Kind::Float, tch::Device::Cpu),
            ));
            b.all_reduce(&mut t, ReduceOp::Sum).unwrap();
            assert_eq!(first.join().unwrap().unwrap(), 2.0);
        });
        // one thread at a time, whichever: fine
        let got = on_threads(&comms, |c| {
            let mut t = c.place(&tch::Tensor::ones(
                [8],
                (tch::Kind::Float, tch::Device::Cpu),
            ));
            c.all_reduce(&mut t, ReduceOp::Sum)
                .map(|_| t.tensor().double_value(&[0]))
        });
        assert!(got.iter().all(|g| g.as_ref().ok() == Some(&2.0)), "{got:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ordered_all_reduce_is_bitwise_equal_for_worlds_1_to_4() {
        let s = store();
        let mut results = Vec::new();
        for n in 1..=4u32 {
            let cfg = TcpConfig {
                chunk_bytes: 4 << 10,
                ..TcpConfig::default()
            };
            let comms = world(&s, 20 + n as u64, n, cfg).await;
            let outs = on_threads(&comms, |c| crate::selftest::ordered(c, 8, 5003).unwrap());
            assert!(
                outs.windows(2).all(|w| w[0] == w[1]),
                "ranks of world {n} disagree"
            );
            results.push(outs[0].clone());
        }
        assert!(
            results.windows(2).all(|w| w[0] == w[1]),
            "the result depends on the world size"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn abort_unblocks_a_pending_all_reduce_at_once_and_fails_later_calls() {
        let comms = world(&store(), 30, 2, TcpConfig::default()).await;
        let handle = comms[0].abort_handle();
        let (aborted_at, returned_at) = std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let mut buf = vec![0u8; 4 << 20];
                let r = comms[0].all_reduce_bytes(&mut buf, DType::F32);
                (r, std::time::Instant::now())
            });
            std::thread::sleep(Duration::from_millis(200));
            let at = std::time::Instant::now();
            handle.abort();
            let (r, done) = waiter.join().unwrap();
            assert!(
                matches!(r, Err(CommError::Aborted { generation: 30, .. })),
                "{r:?}"
            );
            assert!(
                done - at < Duration::from_millis(100),
                "took {:?} to return after abort",
                done - at
            );
            (at, done)
        });
        // the all-reduce was still pending when the abort came (its peer never joined it), and
        // returned only because of it
        assert!(
            returned_at >= aborted_at,
            "the all-reduce returned {:?} before the abort: it was never blocked",
            aborted_at - returned_at
        );
        let mut b = vec![0u8; 16];
        assert!(matches!(
            comms[0].all_reduce_bytes(&mut b, DType::F32),
            Err(CommError::Aborted { .. })
        ));
        // the peer's next call fails too (its socket to rank 0 is shut), instead of waiting
        let t1 = std::time::Instant::now();
        let r = comms[1].all_reduce_bytes(&mut vec![0u8; 1 << 20], DType::F32);
        assert!(
            matches!(
                r,
                Err(CommError::PeerLost { peer: 0, .. }) | Err(CommError::Protocol { peer: 0, .. })
            ),
            "{r:?}"
        );
        assert!(t1.elapsed() < Duration::from_secs(1));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_frame_from_another_generation_is_refused() {
        let comms = world(&store(), 41, 2, TcpConfig::default()).await;
        // rank 1 writes a frame stamped with generation 40 to rank 0
        {
            let mut w = comms[1].peer(0).write.lock().unwrap();
            w.write_all(&header(Kind::P2P, 40, 0, 4)).unwrap();
            w.write_all(&[1, 2, 3, 4]).unwrap();
        }
        let mut dst = [0u8; 4];
        match comms[0].recv_bytes(&mut dst, 1) {
            Err(CommError::WrongGeneration {
                generation: 41,
                got: 40,
                peer: 1,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(Communicator::generation(&comms[0]), 41);
    }

    /// Bounded fuzzing (proptest, in CI): a peer that writes any header and bytes makes the
    /// receiving call fail with an error (or, for a well-formed frame, succeed), never panic,
    /// and never allocate past the cap.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

            #[test]
            fn any_frame_from_a_peer_is_an_error_or_a_frame(
                head in prop::collection::vec(any::<u8>(), HEADER..=HEADER),
                valid_prefix in any::<bool>(),
                body in prop::collection::vec(any::<u8>(), 0..64),
            ) {
                let rt = tokio::runtime::Runtime::new().unwrap();
                let _in = rt.enter();
                let cfg = TcpConfig {
                    max_frame_bytes: 1 << 16,
                    liveness_timeout: Duration::from_secs(2),
                    op_timeout: Duration::from_secs(2),
                    ..TcpConfig::default()
                };
                let comms = rt.block_on(world(&store(), 90, 2, cfg));
                let mut h = head.clone();
                if valid_prefix {
                    // right magic, kind and generation: the length and sequence decide
                    h[..16].copy_from_slice(&header(Kind::P2P, 90, 0, 0)[..16]);
                }
                {
                    let mut w = comms[1].peer(0).write.lock().unwrap();
                    w.write_all(&h).unwrap();
                    w.write_all(&body).unwrap();
                }
                comms[1].abort();
                match comms[0].recv_vec(1) {
                    Ok(v) => prop_assert!(v.len() as u64 <= 1 << 16),
                    Err(_) => {}
                }
            }
        }
    }

    /// A peer whose ordered all-reduce index frame is short (3 bytes, not 8) is a protocol
    /// error naming it, never a panic of the reading rank.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_short_index_frame_in_the_ordered_all_reduce_is_an_error() {
        let comms = world(&store(), 44, 2, TcpConfig::default()).await;
        {
            // rank 0 plays the broken predecessor: the first ordered op's index frame, short
            let mut w = comms[0].peer(1).write.lock().unwrap();
            w.write_all(&header(Kind::Ordered, 44, 0, 3)).unwrap();
            w.write_all(&[1, 2, 3]).unwrap();
        }
        let shard = vec![0u8; 16];
        let mut out = vec![0u8; 16];
        match comms[1].ordered_all_reduce_bytes(&[(1, &shard)], 2, &mut out, DType::F32) {
            Err(CommError::Protocol {
                peer: 0, reason, ..
            }) => {
                assert!(reason.contains("3 bytes"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_oversized_frame_or_broadcast_fails_the_communicator_unallocated() {
        let cfg = TcpConfig {
            max_frame_bytes: 1 << 20,
            ..TcpConfig::default()
        };
        let comms = world(&store(), 43, 2, cfg).await;
        // rank 1 announces an 8 EiB frame to rank 0
        {
            let mut w = comms[1].peer(0).write.lock().unwrap();
            w.write_all(&header(Kind::P2P, 43, 0, 1 << 63)).unwrap();
        }
        match comms[0].recv_vec(1) {
            Err(CommError::Protocol {
                peer: 1, reason, ..
            }) => {
                assert!(reason.contains("over this job's cap"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        // the communicator is done: rank 1's next call fails too
        assert!(comms[1].barrier().is_err());
        // a broadcast that announces more than the cap fails every rank, before allocating
        let comms = world(
            &store(),
            44,
            2,
            TcpConfig {
                max_frame_bytes: 1 << 20,
                ..TcpConfig::default()
            },
        )
        .await;
        let outs = on_threads(&comms, |c| {
            let mut v = if c.rank() == 0 {
                vec![7u8; 2 << 20]
            } else {
                Vec::new()
            };
            c.broadcast_vec(&mut v, 0).map(|_| v.len())
        });
        assert!(outs.iter().all(|o| o.is_err()), "{outs:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_from_another_generation_is_refused_and_the_mesh_still_forms() {
        let s = store();
        s.ensure_mesh_key("j", 61).await.unwrap();
        let cfg = TcpConfig::default();
        let (s0, c0) = (s.clone(), cfg.clone());
        let rank0 = tokio::spawn(async move {
            TcpComm::form(&Rendezvous::new(s0, "j", 61, 2, 0).unwrap(), c0).await
        });
        // a worker of generation 60 (with that generation's key) dials rank 0 of generation 61
        let addr = loop {
            if let Some(kv) = s
                .backend
                .get(&format!("{}tcp/0", s.keys.rendezvous("j", 61)))
                .await
                .unwrap()
            {
                break String::from_utf8(kv.value).unwrap();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let mut rogue = TcpStream::connect(&addr).unwrap();
        let stale = MeshKey::new(60, &[1u8; 32]);
        let refused = std::thread::spawn(move || {
            auth::dial(
                &mut rogue,
                &stale,
                MAGIC,
                (1, 0, 2),
                Duration::from_secs(10),
            )
        });
        // the real rank 1 joins: the stale connection is refused, and the mesh forms and works
        let rank1 = TcpComm::form(&Rendezvous::new(s.clone(), "j", 61, 2, 1).unwrap(), cfg)
            .await
            .unwrap();
        let rank0 = rank0.await.unwrap().unwrap();
        assert!(
            refused.join().unwrap().is_err(),
            "the stale worker was refused"
        );
        let outs = on_threads(&[rank0, rank1], |c| {
            let mut v = 1.5f32.to_le_bytes().to_vec();
            c.all_reduce_bytes(&mut v, DType::F32).unwrap();
            f32::from_le_bytes(v.try_into().unwrap())
        });
        assert_eq!(outs, vec![3.0, 3.0]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_timeout_names_the_peer() {
        let cfg = TcpConfig {
            op_timeout: Duration::from_millis(300),
            ..TcpConfig::default()
        };
        let comms = world(&store(), 50, 2, cfg).await;
        let mut b = vec![0u8; 1024];
        let t0 = std::time::Instant::now();
        match comms[0].recv_bytes(&mut b, 1) {
            Err(CommError::Timeout {
                peer: 1,
                generation: 50,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(3));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_peer_is_named_within_the_liveness_timeout_while_a_busy_one_is_waited_for() {
        let cfg = TcpConfig {
            liveness_timeout: Duration::from_millis(800),
            op_timeout: Duration::from_secs(60),
            ..TcpConfig::default()
        };
        let mut comms = world(&store(), 51, 2, cfg).await;
        // busy: rank 1 sends only after three liveness timeouts; its heartbeats keep rank 0
        // waiting
        std::thread::scope(|s| {
            let c1 = &comms[1];
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(2500));
                c1.send_bytes(&[7u8; 16], 0).unwrap();
            });
            let mut b = [0u8; 16];
            comms[0].recv_bytes(&mut b, 1).unwrap();
            assert_eq!(b, [7u8; 16]);
        });
        // silent: rank 1's heartbeats stop, as a stopped (SIGSTOP) process's do
        comms[1].heartbeat.stop();
        let t0 = std::time::Instant::now();
        let mut b = [0u8; 16];
        match comms[0].recv_bytes(&mut b, 1) {
            Err(
                e @ CommError::Silent {
                    peer: 1,
                    generation: 51,
                    ..
                },
            ) => assert_eq!(
                e.blame(),
                (ductile_cluster::records::FaultKind::Silent, vec![1])
            ),
            other => panic!("{other:?}"),
        }
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(700) && took < Duration::from_secs(5),
            "{took:?}"
        );
    }
}

/// A TCP mesh of `n` ranks on loopback, formed through an in-memory store under job `job`
/// (unit tests and in-process benches: every rank a thread of this process).
pub async fn loopback_mesh(
    n: u32,
    job: &str,
    generation: u64,
) -> Result<Vec<std::sync::Arc<dyn crate::Communicator>>> {
    let store = ductile_cluster::Store::new(
        std::sync::Arc::new(ductile_cluster::memory::MemoryBackend::new()),
        ductile_cluster::Keys::default(),
    );
    let tasks: Vec<_> = (0..n)
        .map(|r| {
            let (store, job) = (store.clone(), job.to_string());
            tokio::spawn(async move {
                store
                    .ensure_mesh_key(&job, generation)
                    .await
                    .map_err(|source| CommError::Store { generation, source })?;
                let rdv = Rendezvous::new(store, &job, generation, n, r)?;
                TcpComm::form(&rdv, TcpConfig::default()).await
            })
        })
        .collect();
    let mut out: Vec<std::sync::Arc<dyn crate::Communicator>> = Vec::new();
    for t in tasks {
        let c = t.await.map_err(|e| CommError::Invalid {
            op: "loopback mesh",
            reason: e.to_string(),
        })??;
        out.push(std::sync::Arc::new(c));
    }
    Ok(out)
}

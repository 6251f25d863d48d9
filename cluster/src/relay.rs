//! One local address for TorchFT's `TORCHFT_LIGHTHOUSE` in front of every ductiled replica that
//! serves the lighthouse (`dctl torchft-relay`, and each torchft job's launcher). `torchft`
//! 0.2.0 takes one lighthouse address; the relay passes each connection to the first replica
//! that accepts it, starting from the last one that did, so when that replica dies the client's
//! next connection (tonic reconnects; `Manager(quorum_retries=N)` retries the call that broke)
//! reaches another. The bytes pass through untouched (HTTP/2 gRPC end to end); any replica
//! answers the same, as the leader decides for all. With a job, each connection first says
//! `DUCTILE-ROOM {job}\n`, which puts its calls in the job's own lighthouse room.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A byte stream to a lighthouse replica: plain TCP, or TLS over it.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// TLS to the lighthouse replicas (ductiled `--torchft-tls-cert`), checked against `ca` (PEM):
/// the replica's certificate must name the host the relay connects to.
pub fn client_tls(ca: &std::path::Path) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca)
        .map_err(|e| anyhow::anyhow!("cannot read the lighthouse CA {}: {e}", ca.display()))?
    {
        let c =
            c.map_err(|e| anyhow::anyhow!("the lighthouse CA {} is not PEM: {e}", ca.display()))?;
        roots
            .add(c)
            .map_err(|e| anyhow::anyhow!("the lighthouse CA {}: {e}", ca.display()))?;
    }
    anyhow::ensure!(
        !roots.is_empty(),
        "the lighthouse CA {} holds no certificate",
        ca.display()
    );
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| anyhow::anyhow!("TLS: {e}"))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(cfg))
}

/// `tcp` to `addr` (HOST:PORT), in TLS when `tls` is given (bounded: 5 s for the handshake).
async fn secure(
    tcp: TcpStream,
    addr: &str,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> anyhow::Result<Box<dyn Io>> {
    let Some(cfg) = tls else {
        return Ok(Box::new(tcp));
    };
    let host = addr
        .rsplit_once(':')
        .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']'))
        .unwrap_or(addr);
    let name = rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| anyhow::anyhow!("{host} is no TLS server name: {e}"))?;
    let s = tokio::time::timeout(
        Duration::from_secs(5),
        tokio_rustls::TlsConnector::from(cfg.clone()).connect(name, tcp),
    )
    .await
    .map_err(|_| anyhow::anyhow!("TLS handshake with {addr}: no answer within 5 s"))?
    .map_err(|e| anyhow::anyhow!("TLS handshake with {addr}: {e}"))?;
    Ok(Box::new(s))
}

/// What a connection that names its lighthouse room starts with (then the job, then `\n`).
pub const ROOM_PREAMBLE: &[u8] = b"DUCTILE-ROOM ";
/// The lighthouse's answer to a room preamble: a fresh nonce (hex), then `\n`.
pub const NONCE_PREAMBLE: &[u8] = b"DUCTILE-NONCE ";

/// A job's lighthouse room and the key that opens it (`jobs/{job}/lighthouse_key`).
#[derive(Clone)]
pub struct RoomKey {
    pub job: String,
    pub key: Vec<u8>,
}

impl std::fmt::Debug for RoomKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RoomKey({}, ...)", self.job)
    }
}

/// What proves a client holds `key` for `job`'s room, for the lighthouse's `nonce`: HMAC-SHA256
/// over the room and the nonce, hex. A nonce is fresh for each connection, so a proof seen on
/// the wire opens nothing later.
pub fn room_proof(key: &[u8], job: &str, nonce: &str) -> String {
    let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let tag = ring::hmac::sign(
        &k,
        format!("ductile-lighthouse-room\n{job}\n{nonce}").as_bytes(),
    );
    tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `proof` is `room_proof(key, job, nonce)` (compared in constant time).
pub fn room_proof_ok(key: &[u8], job: &str, nonce: &str, proof: &str) -> bool {
    let Some(tag) = (0..proof.len())
        .step_by(2)
        .map(|i| {
            proof
                .get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        })
        .collect::<Option<Vec<u8>>>()
    else {
        return false;
    };
    let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    ring::hmac::verify(
        &k,
        format!("ductile-lighthouse-room\n{job}\n{nonce}").as_bytes(),
        &tag,
    )
    .is_ok()
}

/// The client's side of entering a room on `up`: the preamble, the lighthouse's nonce (read
/// within 5 s, at most 128 bytes), the proof. Then the connection is the room's gRPC stream.
pub async fn enter_room(up: &mut dyn Io, room: &RoomKey) -> anyhow::Result<()> {
    use tokio::io::AsyncReadExt;
    let mut pre = ROOM_PREAMBLE.to_vec();
    pre.extend_from_slice(room.job.as_bytes());
    pre.push(b'\n');
    up.write_all(&pre).await?;
    let mut line = Vec::new();
    let read = async {
        let mut b = [0u8; 1];
        while line.len() <= 128 {
            up.read_exact(&mut b).await?;
            if b[0] == b'\n' {
                return Ok::<_, std::io::Error>(());
            }
            line.push(b[0]);
        }
        Err(std::io::Error::other(
            "the lighthouse's nonce line is too long",
        ))
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .map_err(|_| anyhow::anyhow!("the lighthouse sent no nonce within 5 s"))??;
    let nonce = line
        .strip_prefix(NONCE_PREAMBLE)
        .and_then(|n| std::str::from_utf8(n).ok())
        .ok_or_else(|| {
            anyhow::anyhow!("the lighthouse answered the room preamble with no nonce")
        })?;
    let mut proof = room_proof(&room.key, &room.job, nonce).into_bytes();
    proof.push(b'\n');
    up.write_all(&proof).await?;
    Ok(())
}

/// A boxed future.
pub type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// Where the relay's upstreams come from: a fixed list, or read again for each connection.
pub type Upstreams = Arc<dyn Fn() -> BoxFuture<Vec<String>> + Send + Sync>;

/// A fixed list of upstreams.
pub fn fixed(list: Vec<String>) -> Upstreams {
    Arc::new(move || {
        let l = list.clone();
        Box::pin(async move { l })
    })
}

/// Connects to the first upstream that accepts within `timeout`, from `start` on; its index.
pub async fn connect(
    upstreams: &[String],
    start: usize,
    timeout: Duration,
) -> Option<(usize, TcpStream)> {
    for k in 0..upstreams.len() {
        let i = (start + k) % upstreams.len();
        match tokio::time::timeout(timeout, TcpStream::connect(&upstreams[i])).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                return Some((i, s));
            }
            Ok(Err(e)) => eprintln!("torchft-relay: {} refused: {e}", upstreams[i]),
            Err(_) => eprintln!(
                "torchft-relay: {} did not answer in {timeout:?}",
                upstreams[i]
            ),
        }
    }
    None
}

/// Relays every connection `listener` accepts, until the listener fails.
pub async fn serve(
    listener: TcpListener,
    upstreams: Upstreams,
    room: Option<RoomKey>,
    tls: Option<Arc<rustls::ClientConfig>>,
    only_uid: Option<u32>,
) -> anyhow::Result<()> {
    let last = Arc::new(AtomicUsize::new(0));
    let here = listener.local_addr()?;
    loop {
        let (mut client, peer) = listener.accept().await?;
        // the room is the job's alone: a connection from a process of another user (another
        // job's, on a node whose jobs have users of their own) is closed unread
        if let Some(uid) = only_uid {
            match socket_uid(peer, here) {
                Some(u) if u == uid => {}
                found => {
                    let why = format!(
                        "this lighthouse relay serves its job's own processes (uid {uid}) only; {peer} is {}",
                        found.map_or("a socket whose owner could not be read".to_string(), |u| format!("uid {u}'s"))
                    );
                    eprintln!("torchft-relay: PERMISSION_DENIED: {why}");
                    tokio::spawn(deny_grpc(client, why));
                    continue;
                }
            }
        }
        let _ = client.set_nodelay(true);
        let (upstreams, last, room, tls) =
            (upstreams.clone(), last.clone(), room.clone(), tls.clone());
        tokio::spawn(async move {
            let list = upstreams().await;
            if list.is_empty() {
                eprintln!("torchft-relay: no lighthouse replica is published; closing {peer}");
                return;
            }
            let start = last.load(Ordering::Relaxed) % list.len();
            let Some((i, tcp)) = connect(&list, start, Duration::from_secs(2)).await else {
                eprintln!("torchft-relay: no lighthouse replica accepts; closing {peer}");
                return;
            };
            let mut up = match secure(tcp, &list[i], tls.as_ref()).await {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("torchft-relay: {e:#}; closing {peer}");
                    return;
                }
            };
            if i != start {
                eprintln!("torchft-relay: now relaying to {}", list[i]);
            }
            last.store(i, Ordering::Relaxed);
            if let Some(r) = &room {
                if let Err(e) = enter_room(up.as_mut(), r).await {
                    eprintln!("torchft-relay: cannot enter job {}'s lighthouse room at {}: {e:#}; closing {peer}", r.job, list[i]);
                    return;
                }
            }
            let _ = tokio::io::copy_bidirectional(&mut client, &mut up).await;
        });
    }
}

/// `dctl torchft-relay`: listen on `listen`, relay to `upstreams` (in the job's room if given,
/// with the room's key).
pub async fn run(
    listen: &str,
    upstreams: Vec<String>,
    room: Option<RoomKey>,
    ca: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let tls = ca.map(client_tls).transpose()?;
    anyhow::ensure!(!upstreams.is_empty(), "give --to HOST:PORT[,HOST:PORT...]");
    if let Some(r) = &room {
        crate::keys::validate_name("job", &r.job)?;
    }
    let job = room.as_ref().map(|r| r.job.clone());
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {listen}: {e}"))?;
    println!(
        "torchft-relay: TORCHFT_LIGHTHOUSE=http://{} -> {}{}",
        listener.local_addr()?,
        upstreams.join(", "),
        job.as_deref()
            .map(|j| format!(" (job {j}'s room)"))
            .unwrap_or_default()
    );
    serve(listener, fixed(upstreams), room, tls, None).await
}

/// Answers every gRPC call on `io` with `PERMISSION_DENIED` and `why` (a trailers-only
/// response), then closes, all within 10 s: what a process that may not reach the room sees,
/// in its own client's words.
pub async fn deny_grpc<T: AsyncRead + AsyncWrite + Unpin>(io: T, why: String) {
    // grpc-message is percent-encoded: printable ASCII but '%' as is
    let message: String = why
        .bytes()
        .map(|b| match b {
            0x20..=0x7e if b != b'%' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let Ok(Ok(mut conn)) = tokio::time::timeout_at(deadline, h2::server::handshake(io)).await
    else {
        return;
    };
    while let Ok(Some(Ok((_req, mut respond)))) =
        tokio::time::timeout_at(deadline, conn.accept()).await
    {
        let resp = http::Response::builder()
            .status(200)
            .header("content-type", "application/grpc")
            .header("grpc-status", "7")
            .header("grpc-message", message.as_str())
            .body(())
            .expect("a well-formed response");
        let _ = respond.send_response(resp, true);
    }
    conn.graceful_shutdown();
    let _ = tokio::time::timeout_at(
        deadline,
        futures_util::future::poll_fn(|cx| conn.poll_closed(cx)),
    )
    .await;
}

/// The uid that owns the loopback TCP socket `local` → `remote` (a client's end, as the
/// kernel lists it in /proc/net/tcp or tcp6), if listed.
pub fn socket_uid(local: std::net::SocketAddr, remote: std::net::SocketAddr) -> Option<u32> {
    fn hex(a: std::net::SocketAddr) -> String {
        match a {
            std::net::SocketAddr::V4(v) => {
                let o = v.ip().octets();
                format!(
                    "{:02X}{:02X}{:02X}{:02X}:{:04X}",
                    o[3],
                    o[2],
                    o[1],
                    o[0],
                    v.port()
                )
            }
            std::net::SocketAddr::V6(v) => {
                let mut s = String::new();
                for w in v.ip().octets().chunks(4) {
                    s.push_str(&format!("{:02X}{:02X}{:02X}{:02X}", w[3], w[2], w[1], w[0]));
                }
                format!("{s}:{:04X}", v.port())
            }
        }
    }
    let (l, r) = (hex(local), hex(remote));
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 7 && f[1] == l && f[2] == r {
                return f[7].parse().ok();
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// A refused client hears `PERMISSION_DENIED` from its gRPC client, saying why (here the
    /// relay serves another uid than this test's, so this test's own connection is refused).
    #[tokio::test]
    async fn a_refused_grpc_call_gets_permission_denied() {
        let me = std::fs::metadata("/proc/self").unwrap().uid();
        let relay = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = relay.local_addr().unwrap();
        tokio::spawn(serve(
            relay,
            fixed(vec!["127.0.0.1:9".into()]),
            None,
            None,
            Some(me.wrapping_add(1)),
        ));
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (mut client, conn) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(conn);
        let req = http::Request::builder()
            .method("POST")
            .uri(format!("http://{addr}/torchft.LighthouseService/Quorum"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let (resp, _) = client.send_request(req, true).unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(5), resp)
            .await
            .expect("answered at once")
            .unwrap();
        assert_eq!(resp.headers()["grpc-status"], "7");
        let msg = resp.headers()["grpc-message"].to_str().unwrap().to_string();
        assert!(
            msg.contains("its job's own processes") && msg.contains(&format!("uid {me}")),
            "{msg}"
        );
    }

    /// Issue 66: a torchft job's relay serves its own user only. A process of another user
    /// that finds the port is refused (PERMISSION_DENIED); the job's own is relayed.
    #[tokio::test]
    async fn the_relay_serves_its_own_user_only() {
        let me = std::fs::metadata("/proc/self").unwrap().uid();
        // a stand-in lighthouse that greets whoever is relayed to it
        let up = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up_addr = up.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = up.accept().await else {
                    return;
                };
                use tokio::io::AsyncWriteExt;
                let _ = s.write_all(b"UP").await;
            }
        });
        let relay = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = relay.local_addr().unwrap().port();
        tokio::spawn(serve(relay, fixed(vec![up_addr]), None, None, Some(me)));
        // this process's own user is relayed, and its socket's owner reads as this uid
        let mut own = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let (l, r) = (own.local_addr().unwrap(), own.peer_addr().unwrap());
        assert_eq!(socket_uid(l, r), Some(me));
        let mut buf = [0u8; 2];
        use tokio::io::AsyncReadExt;
        tokio::time::timeout(Duration::from_secs(5), own.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf, b"UP");
        assert!(
            me == 0,
            "the rest connects as another user through setpriv: it needs root (CI runs as root)"
        );
        let other = tokio::process::Command::new("setpriv")
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups", "/usr/bin/python3", "-c"])
            .arg(format!(
                "import socket; s = socket.create_connection(('127.0.0.1', {port})); s.settimeout(5); print(repr(s.recv(2)))"
            ))
            .output()
            .await
            .unwrap();
        let out = String::from_utf8_lossy(&other.stdout);
        assert!(
            other.status.success(),
            "{out}{}",
            String::from_utf8_lossy(&other.stderr)
        );
        // refused: the other user reads the relay's own HTTP/2 (a SETTINGS frame, type 4, to
        // answer its calls with PERMISSION_DENIED), never the lighthouse's greeting
        assert!(!out.contains("UP") && out.trim() != "b''", "{out}");
    }
}

//! TLS for the TCP mesh (a job's `mesh_tls = true`), for fleets across networks that are not
//! trusted: every connection runs a TLS 1.3 handshake (rustls, ring) with certificates on both
//! sides checked against the cluster's CA, then the generation's authenticated hello *inside*
//! the TLS session, bound to it (the MACs cover the session's exporter value, so a relay that
//! terminates TLS on both sides cannot pass the hello on), then every frame.
//!
//! The mesh reads and writes one connection from two threads at once (a ring's sender writes
//! while its receiver reads; the heartbeat writes while a reader waits). A TLS session's state
//! is shared by both directions, so the session sits behind a mutex that is held only while
//! bytes are encrypted or decrypted in memory, never while a socket blocks: a reader waits for
//! ciphertext on its own clone of the socket, a writer encrypts and then writes on its own.
//! Nothing the reader processes ever asks the session to write (no session tickets are sent,
//! no key updates are asked for), so the reading side never needs the writing one.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::error::{CommError, Result};

/// The label of the exporter value the hello's MACs are bound to.
const EXPORTER_LABEL: &[u8] = b"EXPORTER-ductile-mesh-hello";

/// Both ends' TLS configuration: this node's certificate and key, the cluster's CA.
pub struct MeshTls {
    client: Arc<rustls::ClientConfig>,
    server: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for MeshTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MeshTls")
    }
}

fn invalid(what: &str, path: &Path, e: impl std::fmt::Display) -> CommError {
    CommError::Invalid {
        op: "mesh TLS",
        reason: format!("{what} {}: {e}", path.display()),
    }
}

impl MeshTls {
    /// From PEM files: the CA that signed every node's mesh certificate, this node's
    /// certificate chain and its key.
    pub fn from_files(ca: &Path, cert: &Path, key: &Path) -> Result<MeshTls> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let certs = |p: &Path| -> Result<Vec<CertificateDer<'static>>> {
            let v: Vec<_> = CertificateDer::pem_file_iter(p)
                .map_err(|e| invalid("cannot read", p, e))?
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| invalid("not PEM certificates:", p, e))?;
            if v.is_empty() {
                return Err(invalid("no certificate in", p, "empty"));
            }
            Ok(v)
        };
        let mut roots = rustls::RootCertStore::empty();
        for c in certs(ca)? {
            roots
                .add(c)
                .map_err(|e| invalid("bad CA certificate in", ca, e))?;
        }
        let roots = Arc::new(roots);
        let chain = certs(cert)?;
        let private =
            || PrivateKeyDer::from_pem_file(key).map_err(|e| invalid("no private key in", key, e));
        let tls13 = |e: rustls::Error| CommError::Invalid {
            op: "mesh TLS",
            reason: e.to_string(),
        };
        let client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls13)?
            .with_root_certificates(roots.clone())
            .with_client_auth_cert(chain.clone(), private()?)
            .map_err(tls13)?;
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .map_err(|e| CommError::Invalid {
                    op: "mesh TLS",
                    reason: e.to_string(),
                })?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls13)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, private()?)
            .map_err(tls13)?;
        // nothing arrives after the handshake that asks this side to write (see the module)
        server.send_tls13_tickets = 0;
        Ok(MeshTls {
            client: Arc::new(client),
            server: Arc::new(server),
        })
    }

    /// From `DUCTILE_MESH_TLS_CA`, `_CERT`, `_KEY` (set by the agent for a job with
    /// `mesh_tls`); None when none is set, an error when only some are.
    pub fn from_env() -> Result<Option<MeshTls>> {
        let v = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
        match (
            v("DUCTILE_MESH_TLS_CA"),
            v("DUCTILE_MESH_TLS_CERT"),
            v("DUCTILE_MESH_TLS_KEY"),
        ) {
            (None, None, None) => Ok(None),
            (Some(ca), Some(c), Some(k)) => {
                MeshTls::from_files(Path::new(&ca), Path::new(&c), Path::new(&k)).map(Some)
            }
            _ => Err(CommError::Invalid {
                op: "mesh TLS",
                reason: "DUCTILE_MESH_TLS_CA, _CERT and _KEY must be set together".into(),
            }),
        }
    }

    /// The dialling side's handshake with the peer at `host` (its certificate must name it).
    pub fn connect(&self, sock: TcpStream, host: &str, deadline: Instant) -> io::Result<TlsPipe> {
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| io::Error::other(format!("{host:?} is no TLS server name: {e}")))?;
        let conn =
            rustls::ClientConnection::new(self.client.clone(), name).map_err(io::Error::other)?;
        TlsPipe::handshake(sock, rustls::Connection::Client(conn), deadline)
    }

    /// The accepting side's handshake.
    pub fn accept(&self, sock: TcpStream, deadline: Instant) -> io::Result<TlsPipe> {
        let conn = rustls::ServerConnection::new(self.server.clone()).map_err(io::Error::other)?;
        TlsPipe::handshake(sock, rustls::Connection::Server(conn), deadline)
    }
}

/// A TLS session over a socket, used by one thread (the hello), then split in two.
pub struct TlsPipe {
    sock: TcpStream,
    conn: rustls::Connection,
}

impl TlsPipe {
    fn handshake(
        mut sock: TcpStream,
        mut conn: rustls::Connection,
        deadline: Instant,
    ) -> io::Result<TlsPipe> {
        while conn.is_handshaking() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "TLS handshake"));
            }
            sock.set_read_timeout(Some(left))?;
            sock.set_write_timeout(Some(left))?;
            conn.complete_io(&mut sock)?;
        }
        // the last flight (the client's Finished) may still be queued
        while conn.wants_write() {
            conn.write_tls(&mut sock)?;
        }
        Ok(TlsPipe { sock, conn })
    }

    /// The session's exporter value the hello binds its MACs to.
    pub fn binding(&self) -> io::Result<[u8; 32]> {
        self.conn
            .export_keying_material([0u8; 32], EXPORTER_LABEL, None)
            .map_err(io::Error::other)
    }

    pub fn socket(&self) -> &TcpStream {
        &self.sock
    }

    /// The reading and the writing half, each with its own clone of the socket.
    pub fn split(self) -> io::Result<(TlsReader, TlsWriter)> {
        let shared = Arc::new(Mutex::new(self.conn));
        Ok((
            TlsReader {
                sock: self.sock.try_clone()?,
                conn: shared.clone(),
                buf: vec![0u8; 64 << 10],
                start: 0,
                end: 0,
            },
            TlsWriter {
                sock: self.sock,
                conn: shared,
                out: Vec::new(),
            },
        ))
    }
}

impl Read for TlsPipe {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.conn.reader().read(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return r,
            }
            if self.conn.read_tls(&mut self.sock)? == 0 {
                return Ok(0);
            }
            self.conn.process_new_packets().map_err(io::Error::other)?;
        }
    }
}

impl Write for TlsPipe {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.conn.writer().write(buf)?;
        while self.conn.wants_write() {
            self.conn.write_tls(&mut self.sock)?;
        }
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        while self.conn.wants_write() {
            self.conn.write_tls(&mut self.sock)?;
        }
        self.sock.flush()
    }
}

/// The reading half: waits for ciphertext on its socket without the session's lock, and
/// hands the session only what its plaintext buffer (16 KiB) can take: the rest waits here.
pub struct TlsReader {
    sock: TcpStream,
    conn: Arc<Mutex<rustls::Connection>>,
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Read for TlsReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        loop {
            {
                let mut c = self.conn.lock().unwrap();
                loop {
                    match c.reader().read(out) {
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        r => return r,
                    }
                    if self.start == self.end {
                        break;
                    }
                    // the plaintext is drained: feed the session the next ciphertext
                    let mut rest = &self.buf[self.start..self.end];
                    self.start += c.read_tls(&mut rest)?;
                    c.process_new_packets().map_err(io::Error::other)?;
                }
            }
            let n = self.sock.read(&mut self.buf)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection",
                ));
            }
            (self.start, self.end) = (0, n);
        }
    }
}

/// The writing half: encrypts under the session's lock, writes on its socket without it.
pub struct TlsWriter {
    sock: TcpStream,
    conn: Arc<Mutex<rustls::Connection>>,
    out: Vec<u8>,
}

impl TlsWriter {
    pub fn socket(&self) -> &TcpStream {
        &self.sock
    }

    /// Encrypt `buf` into records (in `self.out`).
    fn seal(&mut self, buf: &[u8]) -> io::Result<()> {
        self.out.clear();
        let mut c = self.conn.lock().unwrap();
        let mut rest = buf;
        while !rest.is_empty() {
            // the session takes what its send buffer holds; sealed records then move out
            let n = c.writer().write(rest)?;
            rest = &rest[n..];
            while c.wants_write() {
                c.write_tls(&mut self.out)?;
            }
        }
        Ok(())
    }

    /// Write `frame` only if the socket takes bytes now (a heartbeat: a record, once sealed,
    /// must be sent whole, so nothing is sealed for a socket that would block).
    pub fn write_if_ready(&mut self, frame: &[u8]) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut p = libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        if n <= 0 || p.revents & libc::POLLOUT == 0 {
            return Ok(());
        }
        self.write_all(frame)
    }
}

impl Write for TlsWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // up to 1 MiB a time: records are 16 KiB, the sealed copy stays small
        let n = buf.len().min(1 << 20);
        self.seal(&buf[..n])?;
        self.sock.write_all(&self.out)?;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.sock.flush()
    }
}

/// A connection of the mesh: plain TCP, or TLS.
pub enum Link {
    Plain(TcpStream),
    Tls(Box<TlsPipe>),
}

impl Link {
    pub fn socket(&self) -> &TcpStream {
        match self {
            Link::Plain(s) => s,
            Link::Tls(p) => p.socket(),
        }
    }
    /// The plain stream, for meshes that never use TLS (the heartbeat mesh).
    pub fn into_plain(self) -> std::result::Result<TcpStream, Self> {
        match self {
            Link::Plain(s) => Ok(s),
            other => Err(other),
        }
    }
}

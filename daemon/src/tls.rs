//! TLS for the API: a listener that completes each TLS handshake on a task of its own (bounded
//! in time and in number) and hands axum only finished streams, so a client that connects and
//! says nothing holds up no one else.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// Longest a client may take to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; more connections wait in the kernel's backlog.
pub const HANDSHAKES_AT_ONCE: usize = 256;

/// The server configuration from a certificate chain and its key (PEM files), naming the file
/// and what is wrong with it.
pub fn server_config(cert: &Path, key: &Path) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| anyhow::anyhow!("cannot read tls_cert {}: {e}", cert.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("tls_cert {} is not PEM certificates: {e}", cert.display()))?;
    if chain.is_empty() {
        anyhow::bail!("tls_cert {} holds no certificate", cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        anyhow::anyhow!(
            "cannot read a private key from tls_key {}: {e}",
            key.display()
        )
    })?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| anyhow::anyhow!("TLS: {e}"))?
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .map_err(|e| anyhow::anyhow!("tls_cert and tls_key do not make a server identity: {e}"))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// A TCP listener whose connections come out TLS-terminated.
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    pub fn new(
        tcp: TcpListener,
        cfg: Arc<rustls::ServerConfig>,
        cancel: CancellationToken,
    ) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let (tx, rx) = mpsc::channel(64);
        let acceptor = TlsAcceptor::from(cfg);
        let permits = Arc::new(Semaphore::new(HANDSHAKES_AT_ONCE));
        tokio::spawn(async move {
            loop {
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    return;
                };
                let (sock, peer) = tokio::select! {
                    r = tcp.accept() => match r {
                        Ok(x) => x,
                        Err(e) => {
                            // out of descriptors and the like: say so, breathe, go on
                            tracing::warn!(error = %e, "API accept failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    },
                    _ = cancel.cancelled() => return,
                    _ = tx.closed() => return,
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(sock)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send((stream, peer)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "API TLS handshake failed")
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "API TLS handshake timed out")
                        }
                    }
                });
            }
        });
        Ok(TlsListener { rx, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(x) => x,
            // the acceptor ended (shutdown): wait for the server's graceful stop
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

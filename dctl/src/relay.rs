//! `dctl torchft-relay`: one local address for TorchFT's `TORCHFT_LIGHTHOUSE` in front of
//! every ductiled replica that serves the lighthouse. `torchft` 0.2.0 takes one lighthouse
//! address; the relay passes each connection to the first replica that accepts it, starting
//! from the last one that did, so when that replica dies the client's next connection (tonic
//! reconnects; `Manager(quorum_retries=N)` retries the call that broke) reaches another. The
//! bytes pass through untouched (HTTP/2 gRPC end to end); any replica answers the same, as the
//! leader decides for all.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

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

pub async fn run(listen: &str, upstreams: Vec<String>) -> anyhow::Result<()> {
    anyhow::ensure!(!upstreams.is_empty(), "give --to HOST:PORT[,HOST:PORT...]");
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {listen}: {e}"))?;
    println!(
        "torchft-relay: TORCHFT_LIGHTHOUSE=http://{} -> {}",
        listener.local_addr()?,
        upstreams.join(", ")
    );
    let upstreams = Arc::new(upstreams);
    let last = Arc::new(AtomicUsize::new(0));
    loop {
        let (mut client, peer) = listener.accept().await?;
        let _ = client.set_nodelay(true);
        let (upstreams, last) = (upstreams.clone(), last.clone());
        tokio::spawn(async move {
            let start = last.load(Ordering::Relaxed);
            let Some((i, mut up)) = connect(&upstreams, start, Duration::from_secs(2)).await else {
                eprintln!("torchft-relay: no lighthouse replica accepts; closing {peer}");
                return;
            };
            if i != start {
                eprintln!("torchft-relay: now relaying to {}", upstreams[i]);
            }
            last.store(i, Ordering::Relaxed);
            let _ = tokio::io::copy_bidirectional(&mut client, &mut up).await;
        });
    }
}

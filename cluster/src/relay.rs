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

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

/// What a connection that names its lighthouse room starts with (then the job, then `\n`).
pub const ROOM_PREAMBLE: &[u8] = b"DUCTILE-ROOM ";

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
    room: Option<String>,
) -> anyhow::Result<()> {
    let last = Arc::new(AtomicUsize::new(0));
    loop {
        let (mut client, peer) = listener.accept().await?;
        let _ = client.set_nodelay(true);
        let (upstreams, last, room) = (upstreams.clone(), last.clone(), room.clone());
        tokio::spawn(async move {
            let list = upstreams().await;
            if list.is_empty() {
                eprintln!("torchft-relay: no lighthouse replica is published; closing {peer}");
                return;
            }
            let start = last.load(Ordering::Relaxed) % list.len();
            let Some((i, mut up)) = connect(&list, start, Duration::from_secs(2)).await else {
                eprintln!("torchft-relay: no lighthouse replica accepts; closing {peer}");
                return;
            };
            if i != start {
                eprintln!("torchft-relay: now relaying to {}", list[i]);
            }
            last.store(i, Ordering::Relaxed);
            if let Some(job) = &room {
                let mut pre = ROOM_PREAMBLE.to_vec();
                pre.extend_from_slice(job.as_bytes());
                pre.push(b'\n');
                if up.write_all(&pre).await.is_err() {
                    return;
                }
            }
            let _ = tokio::io::copy_bidirectional(&mut client, &mut up).await;
        });
    }
}

/// `dctl torchft-relay`: listen on `listen`, relay to `upstreams` (in the job's room if given).
pub async fn run(listen: &str, upstreams: Vec<String>, job: Option<String>) -> anyhow::Result<()> {
    anyhow::ensure!(!upstreams.is_empty(), "give --to HOST:PORT[,HOST:PORT...]");
    if let Some(j) = &job {
        crate::keys::validate_name("job", j)?;
    }
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
    serve(listener, fixed(upstreams), job).await
}

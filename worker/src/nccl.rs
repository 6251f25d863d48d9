//! Forming a generation's NCCL communicator (cargo feature `cuda`). Without the feature, or
//! where NCCL cannot load, the worker fails at once with a message naming what is missing.

use std::future::Future;
use std::sync::Arc;

use ductile_comm::{CommError, Communicator, Rendezvous, TcpConfig};

use ductile_runtime::Unusable;

/// The outer error is final for this slot (the worker exits with it, not restarted); the inner
/// one is the generation's (the loop waits for the next generation or retries).
#[cfg(feature = "cuda")]
pub fn form(
    rt: &tokio::runtime::Handle,
    rdv: &Rendezvous,
    device: usize,
    cfg: TcpConfig,
    newer: impl Future<Output = ()>,
) -> anyhow::Result<Result<Arc<dyn Communicator>, CommError>> {
    use ductile_comm::nccl::{available, NcclComm};
    if let Err(e) = available() {
        return Err(Unusable(e.to_string()).into());
    }
    let n = rdv.generation;
    // the job's op timeout for NCCL's ops as for TCP's; beside NCCL, its host face and
    // heartbeats over TCP (DUCTILE_COMM_LIVENESS_MS, 6 s), as the TCP backend has them
    let r = rt.block_on(async {
        tokio::select! {
            r = NcclComm::form(rdv, device as i32, cfg, true) => r,
            _ = newer => Err(CommError::Aborted { generation: n, op: "form" }),
        }
    });
    match r {
        Ok(c) => Ok(Ok(Arc::new(c))),
        Err(CommError::Unavailable(m)) if m.contains("ncclInvalidUsage") => Err(Unusable(format!(
            "{m}: NCCL refuses two ranks on one GPU; with several slots per GPU use comm = \"auto\" or \"tcp\""
        ))
        .into()),
        Err(e) => Ok(Err(e)),
    }
}

#[cfg(not(feature = "cuda"))]
pub fn form(
    _rt: &tokio::runtime::Handle,
    rdv: &Rendezvous,
    _device: usize,
    _cfg: TcpConfig,
    _newer: impl Future<Output = ()>,
) -> anyhow::Result<Result<Arc<dyn Communicator>, CommError>> {
    Err(Unusable(format!(
        "generation {} uses NCCL, but this ductile-worker was built without the cuda feature \
         (cargo build --features cuda)",
        rdv.generation
    ))
    .into())
}

//! Errors of communicators: each says which op, which generation and, where known, which peer.

use std::time::Duration;

use ductile_cluster::records::FaultKind;
use ductile_cluster::ClusterError;

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("generation {generation}: {op} aborted (a new generation is forming)")]
    Aborted { generation: u64, op: &'static str },
    #[error("generation {generation}: {op} timed out after {after:?} waiting for rank {peer}")]
    Timeout {
        generation: u64,
        op: &'static str,
        peer: u32,
        after: Duration,
    },
    /// The peer sent nothing at all, not even a heartbeat: stopped, frozen or cut off.
    #[error("generation {generation}: rank {peer} sent nothing (not even a heartbeat) for {after:?} during {op}: it is stopped, frozen or cut off")]
    Silent {
        generation: u64,
        op: &'static str,
        peer: u32,
        after: Duration,
    },
    #[error("generation {generation}: rank {peer} went away during {op}: {source}")]
    PeerLost {
        generation: u64,
        op: &'static str,
        peer: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("generation {generation}: rank {peer} sent a frame of generation {got} during {op}; refused")]
    WrongGeneration {
        generation: u64,
        op: &'static str,
        peer: u32,
        got: u64,
    },
    #[error("generation {generation}: rank {peer} sent a malformed frame during {op}: {reason}")]
    Protocol {
        generation: u64,
        op: &'static str,
        peer: u32,
        reason: String,
    },
    #[error("generation {generation}: rendezvous timed out after {after:?}; ranks {missing:?} never published")]
    RendezvousTimeout {
        generation: u64,
        after: Duration,
        missing: Vec<u32>,
    },
    #[error("generation {generation}: rank {rank} is outside world size {world}")]
    BadRank {
        generation: u64,
        rank: u32,
        world: u32,
    },
    #[error("generation {generation}: rendezvous store error: {source}")]
    Store {
        generation: u64,
        #[source]
        source: ClusterError,
    },
    #[error("generation {generation}: cannot connect to rank {peer} at {addr}: {source}")]
    Connect {
        generation: u64,
        peer: u32,
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{op}: {reason}")]
    Invalid { op: &'static str, reason: String },
    /// A call that NCCL would hang on or refuse, found by the TCP backend's strict mode
    /// ([`crate::strict`]): a bug in the caller, on any backend.
    #[error("generation {generation}: {op} breaks NCCL's rules (strict mode): {reason}")]
    Rule {
        generation: u64,
        op: &'static str,
        reason: String,
    },
    #[error("{0}")]
    Unavailable(String),
}

pub type Result<T, E = CommError> = std::result::Result<T, E>;

impl CommError {
    /// What kind of failure this is and which ranks it points at: what a worker tells the
    /// control plane when its generation's communicator fails (`silent`, `timeout`,
    /// `peer_lost`, `connect`, `rendezvous` and `protocol` name ranks).
    pub fn blame(&self) -> (FaultKind, Vec<u32>) {
        use CommError::*;
        match self {
            Silent { peer, .. } => (FaultKind::Silent, vec![*peer]),
            Timeout { peer, .. } => (FaultKind::Timeout, vec![*peer]),
            PeerLost { peer, .. } => (FaultKind::PeerLost, vec![*peer]),
            WrongGeneration { peer, .. } | Protocol { peer, .. } => {
                (FaultKind::Protocol, vec![*peer])
            }
            RendezvousTimeout { missing, .. } => (FaultKind::Rendezvous, missing.clone()),
            Connect { peer, .. } => (FaultKind::Connect, vec![*peer]),
            Aborted { .. } => (FaultKind::Aborted, vec![]),
            BadRank { .. } | Invalid { .. } | Rule { .. } => (FaultKind::Invalid, vec![]),
            Store { .. } => (FaultKind::Store, vec![]),
            Unavailable(_) => (FaultKind::Unavailable, vec![]),
        }
    }
}

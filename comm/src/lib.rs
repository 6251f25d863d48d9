//! Communicators between the workers of one generation. Invariant: only this crate moves bytes
//! between workers (sockets, NCCL).
//!
//! Every communicator belongs to one generation. Forming one starts with the per-generation
//! rendezvous ([`rendezvous`]): each rank publishes what its peers need under the generation's
//! prefix in etcd and waits, bounded, for the rest. `abort()` from any thread makes every pending
//! and future call fail with [`CommError::Aborted`]; each call also has a timeout. Frames of
//! another generation are refused.
//!
//! Backends: [`tcp::TcpComm`] for host tensors (CUDA tensors are staged through pinned host
//! buffers, [`staging`]); NCCL for CUDA tensors behind the `cuda` feature ([`nccl`]).

pub mod auth;
pub mod buffer;
pub mod error;
pub mod group;
pub mod liveness;
pub mod mesh_tls;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod quant;
pub mod rendezvous;
pub mod selftest;
pub mod staging;
pub mod tcp;

pub use error::{CommError, Result};
pub use group::Group;
pub use rendezvous::Rendezvous;
pub use tcp::{AbortHandle, TcpComm, TcpConfig};

use buffer::{bytes_mut, check_cpu};
use staging::HostStaged;
use tch::{Device, Tensor};

/// Whether a tensor must go through host staging on the TCP backend.
fn off_host(t: &Tensor) -> bool {
    t.device() != Device::Cpu
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// Sum, then divide by the world size.
    Avg,
}

/// The output shape of a reduce-scatter of `t` over `world` ranks (dim 0 split in `world`).
pub(crate) fn scatter_shape(t: &Tensor, world: u32) -> Result<Vec<i64>> {
    let mut shape = t.size();
    if shape.is_empty() || shape[0] % world as i64 != 0 {
        return Err(CommError::Invalid {
            op: "reduce_scatter",
            reason: format!("first dimension of {shape:?} must split into {world} slices"),
        });
    }
    shape[0] /= world as i64;
    Ok(shape)
}

/// The first of a rank's shards for the ordered all-reduce; every rank needs at least one.
pub(crate) fn first_shard(shards: &[(u64, Tensor)]) -> Result<&Tensor> {
    shards
        .first()
        .map(|(_, t)| t)
        .ok_or_else(|| CommError::Invalid {
            op: "ordered_all_reduce",
            reason: "every rank needs at least one shard".into(),
        })
}

/// After a summing all-reduce: divide by the world size for `ReduceOp::Avg`.
pub(crate) fn finish_avg(t: &mut Tensor, op: ReduceOp, world: u32) -> Result<()> {
    if op == ReduceOp::Avg {
        let _ = t
            .f_div_scalar_(world as f64)
            .map_err(|e| CommError::Invalid {
                op: "all_reduce",
                reason: e.to_string(),
            })?;
    }
    Ok(())
}

/// Collectives over tch tensors (contiguous; CPU for TCP, CUDA for NCCL) and byte buffers.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> u32;
    fn world(&self) -> u32;
    fn generation(&self) -> u64;
    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<()>;
    fn broadcast(&self, t: &mut Tensor, root: u32) -> Result<()>;
    /// Every rank's `t` stacked along a new first dimension, in rank order.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor>;
    /// `t` holds world equal slices along dim 0; returns the sum of slice `rank` over all ranks.
    fn reduce_scatter(&self, t: &Tensor) -> Result<Tensor>;
    fn send(&self, t: &Tensor, peer: u32) -> Result<()>;
    fn recv(&self, t: &mut Tensor, peer: u32) -> Result<()>;
    fn barrier(&self) -> Result<()>;
    /// Deterministic all-reduce over logical shards (see [`TcpComm::ordered_all_reduce_bytes`]).
    fn ordered_all_reduce(&self, shards: &[(u64, Tensor)], total: u64) -> Result<Tensor>;
    /// A byte buffer of any length from `root` to every rank.
    fn broadcast_vec(&self, buf: &mut Vec<u8>, root: u32) -> Result<()>;
    fn abort(&self);
    /// A message of any length to `peer`, point to point (messages between two ranks arrive
    /// in order); `peer` reads it with [`Communicator::recv_msg`].
    fn send_msg(&self, data: &[u8], peer: u32) -> Result<()> {
        let _ = (data, peer);
        Err(CommError::Invalid {
            op: "send_msg",
            reason: "this backend has no messages of any length".into(),
        })
    }
    /// The next message `peer` sent with [`Communicator::send_msg`].
    fn recv_msg(&self, peer: u32) -> Result<Vec<u8>> {
        let _ = peer;
        Err(CommError::Invalid {
            op: "recv_msg",
            reason: "this backend has no messages of any length".into(),
        })
    }
    /// Bytes of data this rank sent to its peers on this communicator so far (0 where the
    /// backend does not count them).
    fn bytes_sent(&self) -> u64 {
        0
    }
    /// Fault injection (a job with `allow_fault_injection`): announce to `peer`, as the next
    /// collective's frame, one of 2^62 bytes, as a hostile or broken peer would.
    fn inject_oversized_frame(&self, peer: u32) -> Result<()> {
        let _ = peer;
        Err(CommError::Invalid {
            op: "inject_oversized_frame",
            reason: "this backend does not inject faults".into(),
        })
    }
}

impl Communicator for TcpComm {
    fn rank(&self) -> u32 {
        TcpComm::rank(self)
    }
    fn bytes_sent(&self) -> u64 {
        TcpComm::bytes_sent(self)
    }
    fn send_msg(&self, data: &[u8], peer: u32) -> Result<()> {
        self.send_bytes(data, peer)
    }
    fn recv_msg(&self, peer: u32) -> Result<Vec<u8>> {
        self.recv_vec(peer)
    }
    fn world(&self) -> u32 {
        TcpComm::world(self)
    }
    fn generation(&self) -> u64 {
        TcpComm::generation(self)
    }

    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<()> {
        if off_host(t) {
            return HostStaged(self).all_reduce(t, op);
        }
        let dtype = check_cpu(t, "all_reduce")?;
        self.all_reduce_bytes(unsafe { bytes_mut(t) }, dtype)?;
        finish_avg(t, op, self.world())?;
        Ok(())
    }

    fn broadcast(&self, t: &mut Tensor, root: u32) -> Result<()> {
        if off_host(t) {
            return HostStaged(self).broadcast(t, root);
        }
        check_cpu(t, "broadcast")?;
        self.broadcast_bytes(unsafe { bytes_mut(t) }, root)
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        if off_host(t) {
            return HostStaged(self).all_gather(t);
        }
        check_cpu(t, "all_gather")?;
        let mut shape = vec![self.world() as i64];
        shape.extend(t.size());
        let out = Tensor::empty(shape.as_slice(), (t.kind(), t.device()));
        self.all_gather_bytes(unsafe { bytes_mut(t) }, unsafe { bytes_mut(&out) })?;
        Ok(out)
    }

    fn reduce_scatter(&self, t: &Tensor) -> Result<Tensor> {
        if off_host(t) {
            return HostStaged(self).reduce_scatter(t);
        }
        let dtype = check_cpu(t, "reduce_scatter")?;
        let out_shape = scatter_shape(t, self.world())?;
        let work = t.copy();
        let out = Tensor::empty(out_shape.as_slice(), (t.kind(), t.device()));
        self.reduce_scatter_bytes(
            unsafe { bytes_mut(&work) },
            unsafe { bytes_mut(&out) },
            dtype,
        )?;
        Ok(out)
    }

    fn send(&self, t: &Tensor, peer: u32) -> Result<()> {
        if off_host(t) {
            return HostStaged(self).send(t, peer);
        }
        check_cpu(t, "send")?;
        self.send_bytes(unsafe { bytes_mut(t) }, peer)
    }

    fn recv(&self, t: &mut Tensor, peer: u32) -> Result<()> {
        if off_host(t) {
            return HostStaged(self).recv(t, peer);
        }
        check_cpu(t, "recv")?;
        self.recv_bytes(unsafe { bytes_mut(t) }, peer)
    }

    fn barrier(&self) -> Result<()> {
        TcpComm::barrier(self)
    }

    fn ordered_all_reduce(&self, shards: &[(u64, Tensor)], total: u64) -> Result<Tensor> {
        let op = "ordered_all_reduce";
        let first = first_shard(shards)?;
        if shards.iter().any(|(_, s)| off_host(s)) {
            return HostStaged(self).ordered_all_reduce(shards, total);
        }
        let dtype = check_cpu(first, op)?;
        for (_, s) in shards {
            check_cpu(s, op)?;
            if s.size() != first.size() || s.kind() != first.kind() {
                return Err(CommError::Invalid {
                    op,
                    reason: "shards differ in shape or dtype".into(),
                });
            }
        }
        let out = Tensor::empty(first.size().as_slice(), (first.kind(), first.device()));
        let views: Vec<(u64, &[u8])> = shards
            .iter()
            .map(|(i, t)| (*i, &*unsafe { bytes_mut(t) }))
            .collect();
        self.ordered_all_reduce_bytes(&views, total, unsafe { bytes_mut(&out) }, dtype)?;
        Ok(out)
    }

    fn broadcast_vec(&self, buf: &mut Vec<u8>, root: u32) -> Result<()> {
        TcpComm::broadcast_vec(self, buf, root)
    }

    fn abort(&self) {
        TcpComm::abort(self)
    }
    fn inject_oversized_frame(&self, peer: u32) -> Result<()> {
        TcpComm::inject_oversized_frame(self, peer)
    }
}

//! Communicators between the workers of one generation. Invariant: only this crate moves bytes
//! between workers (sockets, NCCL).
//!
//! Every communicator belongs to one generation. Forming one starts with the per-generation
//! rendezvous ([`rendezvous`]): each rank publishes what its peers need under the generation's
//! prefix in etcd and waits, bounded, for the rest. `abort()` from any thread makes every pending
//! and future call fail with [`CommError::Aborted`]; each call also has a timeout. Frames of
//! another generation are refused.
//!
//! Two faces: a communicator's device face ([`Communicator`]) moves model state as
//! [`DevTensor`]s, tensors on the worker's device that only this crate makes; its host face
//! ([`HostChannel`], `Communicator::host`) moves control data in host memory, over TCP on
//! every backend. Point to point is one primitive, [`Communicator::exchange`], whose sends and
//! receives are issued together.
//!
//! Backends: [`tcp::TcpComm`] for host tensors (CUDA tensors are staged through pinned host
//! buffers, [`staging`]); NCCL for CUDA tensors behind the `cuda` feature ([`nccl`]), with a
//! TCP mesh beside it as its host face.

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
pub mod strict;
pub mod tcp;

pub use error::{CommError, Result};
pub use group::Group;
pub use rendezvous::Rendezvous;
pub use tcp::{AbortHandle, TcpComm, TcpConfig};

use buffer::{bytes_mut, check_cpu};
use staging::HostStaged;
use tch::{Device, Kind, Tensor};

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
pub(crate) fn first_shard(shards: &[(u64, DevTensor)]) -> Result<&Tensor> {
    shards
        .first()
        .map(|(_, t)| &t.0)
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

/// A tensor on a communicator's device: the only kind of tensor the device face moves. It is
/// made only by this crate, through [`Communicator::place`] and [`Communicator::zeros`] (which
/// put it on the communicator's device) and as the result of a collective, so host data (an
/// agreement row, a length, a message) cannot reach a device collective by mistake: it either
/// goes through the host face ([`Communicator::host`]) or is placed on the device first.
pub struct DevTensor(Tensor);

impl DevTensor {
    pub fn tensor(&self) -> &Tensor {
        &self.0
    }
    pub fn into_tensor(self) -> Tensor {
        self.0
    }
    /// Another handle on the same storage.
    pub fn shallow_clone(&self) -> DevTensor {
        DevTensor(self.0.shallow_clone())
    }
    pub fn numel(&self) -> usize {
        self.0.numel()
    }
}

impl std::fmt::Debug for DevTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DevTensor({:?} {:?} on {:?})",
            self.0.size(),
            self.0.kind(),
            self.0.device()
        )
    }
}

/// The host face of a generation's communicator: control data (agreement rows, protocol
/// messages, lengths, small blobs that are not model state) between the ranks, in host memory.
/// Every generation has one whatever its backend: the TCP mesh (on NCCL generations, the one
/// formed beside NCCL). Every length a peer announces is checked against the mesh's cap
/// before anything is allocated for it.
pub trait HostChannel: Send + Sync {
    fn rank(&self) -> u32;
    fn world(&self) -> u32;
    fn generation(&self) -> u64;
    /// Every rank's bytes (of any length up to the cap), in rank order.
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// A byte buffer of any length (up to the cap) from `root` to every rank.
    fn broadcast_vec(&self, buf: &mut Vec<u8>, root: u32) -> Result<()>;
    /// A message to `peer` (messages between two ranks arrive in order); `peer` reads it with
    /// [`HostChannel::recv_msg`].
    fn send_msg(&self, data: &[u8], peer: u32) -> Result<()>;
    /// The next message `peer` sent with [`HostChannel::send_msg`].
    fn recv_msg(&self, peer: u32) -> Result<Vec<u8>>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
}

impl dyn HostChannel + '_ {
    /// Every rank's row of integers (as many as this rank's), in rank order.
    pub fn all_gather_i64(&self, row: &[i64]) -> Result<Vec<Vec<i64>>> {
        self.all_gather_words(row, |v| v.to_le_bytes(), i64::from_le_bytes)
    }

    /// Every rank's row of floats (as many as this rank's), in rank order.
    pub fn all_gather_f64(&self, row: &[f64]) -> Result<Vec<Vec<f64>>> {
        self.all_gather_words(row, |v| v.to_le_bytes(), f64::from_le_bytes)
    }

    /// Every rank's row of 8-byte values (as many as this rank's), in rank order; a row of
    /// another length is a protocol error naming its rank.
    fn all_gather_words<T>(
        &self,
        row: &[T],
        to: impl Fn(&T) -> [u8; 8],
        from: impl Fn([u8; 8]) -> T,
    ) -> Result<Vec<Vec<T>>> {
        let bytes: Vec<u8> = row.iter().flat_map(&to).collect();
        let rows = self.all_gather_bytes(&bytes)?;
        if let Some((p, b)) = rows
            .iter()
            .enumerate()
            .find(|(_, b)| b.len() != bytes.len())
        {
            return Err(CommError::Protocol {
                generation: self.generation(),
                op: "host all_gather",
                peer: p as u32,
                reason: format!("a row of {} bytes, expected {}", b.len(), bytes.len()),
            });
        }
        Ok(rows
            .iter()
            .map(|b| {
                b.chunks_exact(8)
                    .map(|c| from(c.try_into().unwrap()))
                    .collect()
            })
            .collect())
    }

    /// The element-wise sum of every rank's `row` (same length everywhere), folded in rank
    /// order: the same bits on every rank.
    pub fn sum_f64(&self, row: &[f64]) -> Result<Vec<f64>> {
        let mut sum = vec![0f64; row.len()];
        for r in self.all_gather_f64(row)? {
            for (s, v) in sum.iter_mut().zip(r) {
                *s += v;
            }
        }
        Ok(sum)
    }
}

/// The device face of a generation's communicator: collectives and point-to-point exchanges
/// of model state (gradients, parameters, optimizer state, activations, state transfers) as
/// [`DevTensor`]s on the worker's device (contiguous). Host control data goes through
/// [`Communicator::host`].
pub trait Communicator: Send + Sync {
    fn rank(&self) -> u32;
    fn world(&self) -> u32;
    fn generation(&self) -> u64;
    /// The device this communicator's tensors live on.
    fn device(&self) -> Device;
    /// The host face of this generation.
    fn host(&self) -> &dyn HostChannel;
    fn all_reduce(&self, t: &mut DevTensor, op: ReduceOp) -> Result<()>;
    fn broadcast(&self, t: &mut DevTensor, root: u32) -> Result<()>;
    /// Every rank's `t` stacked along a new first dimension, in rank order.
    fn all_gather(&self, t: &DevTensor) -> Result<DevTensor>;
    /// `t` holds world equal slices along dim 0; returns the sum of slice `rank` over all ranks.
    fn reduce_scatter(&self, t: &DevTensor) -> Result<DevTensor>;
    /// One point-to-point exchange: every `(peer, tensor)` of `sends` goes to its peer and every
    /// `(peer, buffer)` of `recvs` is filled (in place) with what that peer sent, all issued
    /// together (one NCCL group; on TCP the sends go on a thread of their own while the caller
    /// receives), so two ranks that both send first cannot wait on each other. Between two ranks
    /// the n-th tensor one sends is the n-th the other receives, across exchanges: the plan of
    /// an exchange must be the same on every rank.
    fn exchange(&self, sends: &[(u32, &DevTensor)], recvs: &[(u32, &DevTensor)]) -> Result<()>;
    /// Deterministic all-reduce over logical shards (see [`TcpComm::ordered_all_reduce_bytes`]).
    fn ordered_all_reduce(&self, shards: &[(u64, DevTensor)], total: u64) -> Result<DevTensor>;
    /// Aborts both faces: every pending and future call fails.
    fn abort(&self);
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()> {
        self.host().barrier()
    }
    /// `t` on this communicator's device: the same storage when it is there already (so an
    /// in-place collective on the result writes through), else a copy.
    fn place(&self, t: &Tensor) -> DevTensor {
        DevTensor(t.to_device(self.device()))
    }
    /// A zero tensor on this communicator's device (a receive buffer).
    fn zeros(&self, shape: &[i64], kind: Kind) -> DevTensor {
        DevTensor(Tensor::zeros(shape, (kind, self.device())))
    }
    /// Point to point: `t` to `peer` (an exchange of one send).
    fn send(&self, t: &DevTensor, peer: u32) -> Result<()> {
        self.exchange(&[(peer, t)], &[])
    }
    /// Point to point: what `peer` sent into `t` (an exchange of one receive).
    fn recv(&self, t: &DevTensor, peer: u32) -> Result<()> {
        self.exchange(&[], &[(peer, t)])
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

impl HostChannel for TcpComm {
    fn rank(&self) -> u32 {
        TcpComm::rank(self)
    }
    fn world(&self) -> u32 {
        TcpComm::world(self)
    }
    fn generation(&self) -> u64 {
        TcpComm::generation(self)
    }
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.all_gather_vec(mine)
    }
    fn broadcast_vec(&self, buf: &mut Vec<u8>, root: u32) -> Result<()> {
        TcpComm::broadcast_vec(self, buf, root)
    }
    fn send_msg(&self, data: &[u8], peer: u32) -> Result<()> {
        self.send_bytes(data, peer)
    }
    fn recv_msg(&self, peer: u32) -> Result<Vec<u8>> {
        self.recv_vec(peer)
    }
    fn barrier(&self) -> Result<()> {
        TcpComm::barrier(self)
    }
}

impl Communicator for TcpComm {
    fn rank(&self) -> u32 {
        TcpComm::rank(self)
    }
    fn bytes_sent(&self) -> u64 {
        TcpComm::bytes_sent(self)
    }
    fn world(&self) -> u32 {
        TcpComm::world(self)
    }
    fn generation(&self) -> u64 {
        TcpComm::generation(self)
    }
    fn device(&self) -> Device {
        TcpComm::device(self)
    }
    fn host(&self) -> &dyn HostChannel {
        self
    }

    fn all_reduce(&self, t: &mut DevTensor, op: ReduceOp) -> Result<()> {
        let _call = self.device_call("all_reduce")?;
        if off_host(&t.0) {
            return HostStaged(self).all_reduce(t, op);
        }
        let dtype = check_cpu(&t.0, "all_reduce")?;
        self.all_reduce_bytes(unsafe { bytes_mut(&t.0) }, dtype)?;
        finish_avg(&mut t.0, op, self.world())?;
        Ok(())
    }

    fn broadcast(&self, t: &mut DevTensor, root: u32) -> Result<()> {
        let _call = self.device_call("broadcast")?;
        if off_host(&t.0) {
            return HostStaged(self).broadcast(t, root);
        }
        check_cpu(&t.0, "broadcast")?;
        self.broadcast_bytes(unsafe { bytes_mut(&t.0) }, root)
    }

    fn all_gather(&self, t: &DevTensor) -> Result<DevTensor> {
        let _call = self.device_call("all_gather")?;
        if off_host(&t.0) {
            return HostStaged(self).all_gather(t);
        }
        let t = &t.0;
        check_cpu(t, "all_gather")?;
        let mut shape = vec![self.world() as i64];
        shape.extend(t.size());
        let out = Tensor::empty(shape.as_slice(), (t.kind(), t.device()));
        self.all_gather_bytes(unsafe { bytes_mut(t) }, unsafe { bytes_mut(&out) })?;
        Ok(DevTensor(out))
    }

    fn reduce_scatter(&self, t: &DevTensor) -> Result<DevTensor> {
        let _call = self.device_call("reduce_scatter")?;
        if off_host(&t.0) {
            return HostStaged(self).reduce_scatter(t);
        }
        let t = &t.0;
        let dtype = check_cpu(t, "reduce_scatter")?;
        let out_shape = scatter_shape(t, self.world())?;
        let work = t.copy();
        let out = Tensor::empty(out_shape.as_slice(), (t.kind(), t.device()));
        self.reduce_scatter_bytes(
            unsafe { bytes_mut(&work) },
            unsafe { bytes_mut(&out) },
            dtype,
        )?;
        Ok(DevTensor(out))
    }

    fn exchange(&self, sends: &[(u32, &DevTensor)], recvs: &[(u32, &DevTensor)]) -> Result<()> {
        let op = "exchange";
        let _call = self.device_call(op)?;
        if sends.iter().chain(recvs).any(|(_, t)| off_host(&t.0)) {
            return HostStaged(self).exchange(sends, recvs);
        }
        for (_, t) in sends.iter().chain(recvs) {
            check_cpu(&t.0, op)?;
        }
        let recv_all = || -> Result<()> {
            for (peer, t) in recvs {
                self.recv_bytes(unsafe { bytes_mut(&t.0) }, *peer)?;
            }
            Ok(())
        };
        if sends.is_empty() {
            return recv_all();
        }
        let out: Vec<(u32, Tensor)> = sends
            .iter()
            .map(|(p, t)| (*p, t.0.shallow_clone()))
            .collect();
        // (an exchange of sends only: strict mode flags its frames, `strict`)
        let lone = recvs.is_empty();
        let send_all = move || -> Result<()> {
            for (peer, t) in &out {
                self.send_bytes_from(unsafe { bytes_mut(t) }, *peer, lone)?;
            }
            Ok(())
        };
        if recvs.is_empty() {
            return send_all();
        }
        // the sends on a thread of their own while this one receives: neither side of a pair
        // that both send first waits for the other to read
        std::thread::scope(|s| {
            let sender = s.spawn(send_all);
            let got = recv_all();
            if got.is_err() {
                self.abort();
            }
            let sent = sender.join().unwrap_or_else(|_| {
                Err(CommError::Invalid {
                    op,
                    reason: "the sender thread panicked".into(),
                })
            });
            got.and(sent)
        })
    }

    fn ordered_all_reduce(&self, shards: &[(u64, DevTensor)], total: u64) -> Result<DevTensor> {
        let op = "ordered_all_reduce";
        let _call = self.device_call(op)?;
        let first = first_shard(shards)?;
        if shards.iter().any(|(_, s)| off_host(&s.0)) {
            return HostStaged(self).ordered_all_reduce(shards, total);
        }
        let dtype = check_cpu(first, op)?;
        for (_, s) in shards {
            check_cpu(&s.0, op)?;
            if s.0.size() != first.size() || s.0.kind() != first.kind() {
                return Err(CommError::Invalid {
                    op,
                    reason: "shards differ in shape or dtype".into(),
                });
            }
        }
        let out = Tensor::empty(first.size().as_slice(), (first.kind(), first.device()));
        let views: Vec<(u64, &[u8])> = shards
            .iter()
            .map(|(i, t)| (*i, &*unsafe { bytes_mut(&t.0) }))
            .collect();
        self.ordered_all_reduce_bytes(&views, total, unsafe { bytes_mut(&out) }, dtype)?;
        Ok(DevTensor(out))
    }

    fn abort(&self) {
        TcpComm::abort(self)
    }
    fn inject_oversized_frame(&self, peer: u32) -> Result<()> {
        TcpComm::inject_oversized_frame(self, peer)
    }
}

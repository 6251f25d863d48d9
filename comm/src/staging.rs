//! The TCP backend on tensors that are not in host memory (CUDA): each collective copies its
//! input into a page-locked (pinned) host buffer, runs on the host, and copies the result back.
//! Buffers are kept per (dtype, length, slot) and reused, since pinning costs about 0.4 s per
//! GiB on an H100 host; where pinning is not possible (a CPU-only libtorch) plain host buffers
//! stand in, which is also how the staging path is tested on machines without a GPU.

use std::cell::RefCell;
use std::collections::HashMap;

use tch::{Device, Kind, Tensor};

use crate::error::Result;
use crate::{Communicator, ReduceOp};

thread_local! {
    static POOL: RefCell<HashMap<(Kind, i64, u8), Tensor>> = RefCell::new(HashMap::new());
}

/// At most this many bytes of staging buffers are kept per thread (beyond it, buffers are
/// allocated per call and dropped).
const POOL_BYTES: i64 = 4 << 30;

/// An uninitialised host tensor of `n` elements, page-locked for `like`'s GPU when `like` is a
/// CUDA device (and pinning works), else plain host memory.
pub fn pinned_empty(n: i64, kind: Kind, like: Device) -> Tensor {
    let host = Tensor::empty([n], (kind, Device::Cpu));
    match like {
        Device::Cuda(_) => host.f_pin_memory(like).unwrap_or(host),
        _ => host,
    }
}

/// A host copy of `t` (flattened), in reused buffer `slot`, for `device`'s tensors.
fn to_host(t: &Tensor, slot: u8) -> Tensor {
    let (n, kind, dev) = (t.numel() as i64, t.kind(), t.device());
    let key = (kind, n, slot);
    let buf = POOL.with(|p| {
        let mut p = p.borrow_mut();
        if let Some(b) = p.get(&key) {
            return b.shallow_clone();
        }
        let b = pinned_empty(n, kind, dev);
        let held: i64 = p
            .iter()
            .map(|((k, n, _), _)| n * k.elt_size_in_bytes() as i64)
            .sum();
        if held + n * kind.elt_size_in_bytes() as i64 <= POOL_BYTES {
            p.insert(key, b.shallow_clone());
        }
        b
    });
    let mut view = buf.view(t.size().as_slice());
    let _ = view.copy_(t);
    view
}

/// Copy a host result back into `t` (on its device).
fn back(t: &mut Tensor, host: &Tensor) {
    let _ = t.copy_(host);
}

/// A communicator that stages every tensor through host buffers, whatever its device.
/// The TCP backend uses it for CUDA tensors.
pub struct HostStaged<'a, C: Communicator + ?Sized>(pub &'a C);

impl<C: Communicator + ?Sized> Communicator for HostStaged<'_, C> {
    fn rank(&self) -> u32 {
        self.0.rank()
    }
    fn world(&self) -> u32 {
        self.0.world()
    }
    fn generation(&self) -> u64 {
        self.0.generation()
    }
    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<()> {
        let mut h = to_host(t, 0);
        self.0.all_reduce(&mut h, op)?;
        back(t, &h);
        Ok(())
    }
    fn broadcast(&self, t: &mut Tensor, root: u32) -> Result<()> {
        let mut h = to_host(t, 0);
        self.0.broadcast(&mut h, root)?;
        back(t, &h);
        Ok(())
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let h = to_host(t, 0);
        Ok(self.0.all_gather(&h)?.to_device(t.device()))
    }
    fn reduce_scatter(&self, t: &Tensor) -> Result<Tensor> {
        let h = to_host(t, 0);
        Ok(self.0.reduce_scatter(&h)?.to_device(t.device()))
    }
    fn send(&self, t: &Tensor, peer: u32) -> Result<()> {
        self.0.send(&to_host(t, 0), peer)
    }
    fn recv(&self, t: &mut Tensor, peer: u32) -> Result<()> {
        let mut h = to_host(t, 0);
        self.0.recv(&mut h, peer)?;
        back(t, &h);
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        self.0.barrier()
    }
    fn ordered_all_reduce(&self, shards: &[(u64, Tensor)], total: u64) -> Result<Tensor> {
        let Some((_, first)) = shards.first() else {
            return self.0.ordered_all_reduce(shards, total);
        };
        let dev = first.device();
        let host: Vec<(u64, Tensor)> = shards
            .iter()
            .enumerate()
            .map(|(i, (k, t))| (*k, to_host(t, 1 + (i as u8 % 254))))
            .collect();
        Ok(self.0.ordered_all_reduce(&host, total)?.to_device(dev))
    }
    fn broadcast_vec(&self, buf: &mut Vec<u8>, root: u32) -> Result<()> {
        self.0.broadcast_vec(buf, root)
    }
    fn abort(&self) {
        self.0.abort()
    }
}

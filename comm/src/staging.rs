//! The TCP backend on tensors that are not in host memory (CUDA): each collective copies its
//! input into a page-locked (pinned) host buffer, runs on the host, and copies the result back.
//! Buffers are kept per (dtype, length, slot) and reused, since pinning costs about 0.4 s per
//! GiB on an H100 host; where pinning is not possible (a CPU-only libtorch) plain host buffers
//! stand in, which is also how the staging path is tested on machines without a GPU.

use std::cell::RefCell;
use std::collections::HashMap;

use tch::{Device, Kind, Tensor};

use crate::error::Result;
use crate::{Communicator, DevTensor, HostChannel, ReduceOp, TcpComm};

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
    view.copy_(t);
    view
}

/// Copy a host result back into `t` (on its device).
fn back(t: &Tensor, host: &Tensor) {
    let mut t = t.shallow_clone();
    t.copy_(host);
}

/// The TCP backend with every tensor staged through host buffers, whatever its device: what
/// [`TcpComm`] does for CUDA tensors (and, wrapped around it in tests, for CPU ones too, so the
/// staging path runs on machines without a GPU).
pub struct HostStaged<'a>(pub &'a TcpComm);

impl Communicator for HostStaged<'_> {
    fn rank(&self) -> u32 {
        self.0.rank()
    }
    fn world(&self) -> u32 {
        self.0.world()
    }
    fn generation(&self) -> u64 {
        self.0.generation()
    }
    fn device(&self) -> Device {
        TcpComm::device(self.0)
    }
    fn host(&self) -> &dyn HostChannel {
        self.0
    }
    fn all_reduce(&self, t: &mut DevTensor, op: ReduceOp) -> Result<()> {
        let mut h = DevTensor(to_host(&t.0, 0));
        Communicator::all_reduce(self.0, &mut h, op)?;
        back(&t.0, &h.0);
        Ok(())
    }
    fn broadcast(&self, t: &mut DevTensor, root: u32) -> Result<()> {
        let mut h = DevTensor(to_host(&t.0, 0));
        Communicator::broadcast(self.0, &mut h, root)?;
        back(&t.0, &h.0);
        Ok(())
    }
    fn all_gather(&self, t: &DevTensor) -> Result<DevTensor> {
        let h = DevTensor(to_host(&t.0, 0));
        Ok(DevTensor(
            Communicator::all_gather(self.0, &h)?
                .0
                .to_device(t.0.device()),
        ))
    }
    fn reduce_scatter(&self, t: &DevTensor) -> Result<DevTensor> {
        let h = DevTensor(to_host(&t.0, 0));
        Ok(DevTensor(
            Communicator::reduce_scatter(self.0, &h)?
                .0
                .to_device(t.0.device()),
        ))
    }
    fn exchange(&self, sends: &[(u32, &DevTensor)], recvs: &[(u32, &DevTensor)]) -> Result<()> {
        // buffers of their own per call: one exchange may move several tensors of one size
        let stage = |t: &Tensor| {
            let h = pinned_empty(t.numel() as i64, t.kind(), t.device());
            let mut view = h.view(t.size().as_slice());
            view.copy_(t);
            DevTensor(view)
        };
        let hs: Vec<DevTensor> = sends.iter().map(|(_, t)| stage(&t.0)).collect();
        let hr: Vec<DevTensor> = recvs.iter().map(|(_, t)| stage(&t.0)).collect();
        let s: Vec<(u32, &DevTensor)> = sends.iter().zip(&hs).map(|((p, _), h)| (*p, h)).collect();
        let r: Vec<(u32, &DevTensor)> = recvs.iter().zip(&hr).map(|((p, _), h)| (*p, h)).collect();
        Communicator::exchange(self.0, &s, &r)?;
        for ((_, t), h) in recvs.iter().zip(&hr) {
            back(&t.0, &h.0);
        }
        Ok(())
    }
    fn ordered_all_reduce(&self, shards: &[(u64, DevTensor)], total: u64) -> Result<DevTensor> {
        let Some((_, first)) = shards.first() else {
            return Communicator::ordered_all_reduce(self.0, shards, total);
        };
        let dev = first.0.device();
        let host: Vec<(u64, DevTensor)> = shards
            .iter()
            .enumerate()
            .map(|(i, (k, t))| (*k, DevTensor(to_host(&t.0, 1 + (i as u8 % 254)))))
            .collect();
        Ok(DevTensor(
            Communicator::ordered_all_reduce(self.0, &host, total)?
                .0
                .to_device(dev),
        ))
    }
    fn abort(&self) {
        TcpComm::abort(self.0)
    }
}

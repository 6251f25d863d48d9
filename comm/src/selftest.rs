//! Checks of a communicator's collectives against local references, run by every rank of a
//! world (in-process in unit tests, one process per rank in the integration tests). Inputs are
//! integer-valued so sums are exact whatever the order; the ordered all-reduce uses non-integer
//! values and is checked against the left fold, bit for bit.

use tch::{Device, Kind, Tensor};

use crate::{Communicator, ReduceOp};

thread_local! {
    /// The device the self-test's tensors live on (CPU unless [`collectives_on`] says).
    static DEVICE: std::cell::Cell<Device> = const { std::cell::Cell::new(Device::Cpu) };
}

fn dev() -> Device {
    DEVICE.with(|d| d.get())
}

fn input(rank: u32, n: i64, kind: Kind) -> Tensor {
    // (rank + 1) + (i mod 7): exact in every dtype for small worlds
    (Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).remainder(7) + (rank as i64 + 1))
        .to_kind(kind)
        .to_device(dev())
}

/// [`collectives`] with every tensor on `device` (CUDA tensors for NCCL, or for the TCP
/// backend's host staging).
pub fn collectives_on(c: &dyn Communicator, device: Device) -> Result<(), String> {
    on(device, || collectives(c))
}

/// Run `f` with the self-test's tensors on `device`.
fn on<R>(device: Device, f: impl FnOnce() -> R) -> R {
    let prev = DEVICE.with(|d| d.replace(device));
    let r = f();
    DEVICE.with(|d| d.set(prev));
    r
}

/// [`ordered`] with the shards on `device`.
pub fn ordered_on(
    c: &dyn Communicator,
    total: u64,
    len: i64,
    device: Device,
) -> Result<Vec<u8>, String> {
    on(device, || ordered(c, total, len))
}

fn same(a: &Tensor, b: &Tensor) -> bool {
    a.size() == b.size() && a.kind() == b.kind() && a.equal(b)
}

/// Runs every collective; `Err` says which one disagreed with its reference.
pub fn collectives(c: &dyn Communicator) -> Result<(), String> {
    let (r, w) = (c.rank(), c.world());
    fn e(what: &str) -> impl Fn(crate::CommError) -> String + '_ {
        move |err| format!("{what}: {err}")
    }
    for (kind, sizes) in [
        (Kind::Float, &[1i64, 3, 1000, 16_411, 300_001][..]),
        (Kind::Double, &[5, 70_001][..]),
        (Kind::Half, &[17, 65_537][..]),
        (Kind::BFloat16, &[33, 40_003][..]),
    ] {
        for &n in sizes {
            let tag = format!("{kind:?} × {n}");
            let reference = (0..w)
                .map(|p| input(p, n, kind))
                .reduce(|a, b| a + b)
                .unwrap();
            let mut t = input(r, n, kind);
            c.all_reduce(&mut t, ReduceOp::Sum)
                .map_err(|x| format!("all_reduce {tag}: {x}"))?;
            if !same(&t, &reference) {
                return Err(format!("all_reduce {tag}: wrong sum"));
            }
            let mut t = input(r, n, kind);
            c.all_reduce(&mut t, ReduceOp::Avg)
                .map_err(|x| format!("all_reduce avg {tag}: {x}"))?;
            if !same(&t, &(&reference / (w as f64))) {
                return Err(format!("all_reduce avg {tag}: wrong mean"));
            }
        }
    }
    for root in 0..w {
        let mut t = if r == root {
            input(root, 50_001, Kind::Float)
        } else {
            Tensor::zeros([50_001], (Kind::Float, dev()))
        };
        c.broadcast(&mut t, root).map_err(e("broadcast"))?;
        if !same(&t, &input(root, 50_001, Kind::Float)) {
            return Err(format!("broadcast from {root}: wrong data"));
        }
    }
    let g = c
        .all_gather(&input(r, 1001, Kind::Float))
        .map_err(e("all_gather"))?;
    let want = Tensor::stack(
        &(0..w)
            .map(|p| input(p, 1001, Kind::Float))
            .collect::<Vec<_>>(),
        0,
    );
    if !same(&g, &want) {
        return Err("all_gather: wrong data".into());
    }
    let big = input(r, 2003 * w as i64, Kind::Float).reshape([w as i64, 2003]);
    let rs = c.reduce_scatter(&big).map_err(e("reduce_scatter"))?;
    let full = (0..w)
        .map(|p| input(p, 2003 * w as i64, Kind::Float).reshape([w as i64, 2003]))
        .reduce(|a, b| a + b)
        .unwrap();
    if !same(&rs, &full.get(r as i64).unsqueeze(0)) {
        return Err("reduce_scatter: wrong slice".into());
    }
    if w > 1 {
        // a ring of point-to-point messages (pipeline stages)
        let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
        let out = input(r, 777, Kind::Float);
        let mut inn = Tensor::zeros([777], (Kind::Float, dev()));
        if r % 2 == 0 {
            c.send(&out, next).map_err(e("send"))?;
            c.recv(&mut inn, prev).map_err(e("recv"))?;
        } else {
            c.recv(&mut inn, prev).map_err(e("recv"))?;
            c.send(&out, next).map_err(e("send"))?;
        }
        if !same(&inn, &input(prev, 777, Kind::Float)) {
            return Err("send/recv: wrong data".into());
        }
    }
    c.barrier().map_err(e("barrier"))?;
    let mut v = if r == 0 {
        (0..10_240u32).map(|i| (i % 251) as u8).collect()
    } else {
        Vec::new()
    };
    c.broadcast_vec(&mut v, 0).map_err(e("broadcast_vec"))?;
    if v.len() != 10_240 || v.iter().enumerate().any(|(i, b)| *b != (i % 251) as u8) {
        return Err("broadcast_vec: wrong data".into());
    }
    Ok(())
}

/// Logical shard `index` of the ordered all-reduce test: non-integer values.
pub fn shard(index: u64, len: i64) -> Tensor {
    let g = Tensor::arange(len, (Kind::Float, tch::Device::Cpu));
    ((&g * 0.618_034 + index as f64 * std::f64::consts::SQRT_2).sin() * 1000.0
        / (index as f64 + 3.0))
        .contiguous()
        .to_device(dev())
}

/// Runs the ordered all-reduce over `total` shards of `len` floats; returns the result's bytes
/// after checking them against the left fold computed locally.
pub fn ordered(c: &dyn Communicator, total: u64, len: i64) -> Result<Vec<u8>, String> {
    let shards: Vec<(u64, Tensor)> = ductile_strategies::split_range(total, c.world(), c.rank())
        .map(|i| (i, shard(i, len)))
        .collect();
    let out = c
        .ordered_all_reduce(&shards, total)
        .map_err(|e| format!("ordered_all_reduce: {e}"))?;
    let mut fold = shard(0, len);
    for i in 1..total {
        fold = &fold + &shard(i, len);
    }
    if !same(&out, &fold) {
        return Err("ordered_all_reduce: result differs from the left fold".into());
    }
    let out = out.to_device(Device::Cpu);
    let mut bytes = vec![0u8; (len * 4) as usize];
    out.copy_data_u8(&mut bytes, len as usize);
    Ok(bytes)
}

//! The conformance suite every backend runs: each collective, host-face call and
//! point-to-point pattern the worker uses, checked against local references, by every rank of a
//! world (in-process over the TCP backend in CI, one process per rank in the integration tests,
//! NCCL on CUDA tensors in `scripts/gpu-check.sh` through `ductile-bench nccl`). Inputs are
//! integer-valued so sums are exact whatever the order; the ordered all-reduce uses non-integer
//! values and is checked against the left fold, bit for bit. Tensors are made on the host and
//! put on the communicator's device with [`Communicator::place`], as the worker does.

use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use crate::{Communicator, DevTensor, Group, HostChannel, ReduceOp};

fn input(rank: u32, n: i64, kind: Kind) -> Tensor {
    // (rank + 1) + (i mod 7): exact in every dtype for small worlds
    (Tensor::arange(n, (Kind::Int64, Device::Cpu)).remainder(7) + (rank as i64 + 1)).to_kind(kind)
}

/// `t` (on any device) equals the host reference `want`.
fn same(t: &Tensor, want: &Tensor) -> bool {
    let t = t.to_device(Device::Cpu);
    t.size() == want.size() && t.kind() == want.kind() && t.equal(want)
}

/// Runs every check but the groups'; `Err` says which one disagreed with its reference.
pub fn collectives(c: &dyn Communicator) -> Result<(), String> {
    device_face(c)?;
    exchanges(c)?;
    host_face(c.host())
}

/// Every check, the groups' too.
pub fn all(c: &Arc<dyn Communicator>) -> Result<(), String> {
    collectives(c.as_ref())?;
    groups(c)
}

fn e(what: &str) -> impl Fn(crate::CommError) -> String + '_ {
    move |err| format!("{what}: {err}")
}

/// The device face's collectives, every dtype the worker moves.
pub fn device_face(c: &dyn Communicator) -> Result<(), String> {
    let (r, w) = (c.rank(), c.world());
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
            let mut t = c.place(&input(r, n, kind));
            if t.tensor().device() != c.device() {
                return Err(format!(
                    "place {tag}: on {:?}, not the communicator's {:?}",
                    t.tensor().device(),
                    c.device()
                ));
            }
            c.all_reduce(&mut t, ReduceOp::Sum)
                .map_err(|x| format!("all_reduce {tag}: {x}"))?;
            if !same(t.tensor(), &reference) {
                return Err(format!("all_reduce {tag}: wrong sum"));
            }
            let mut t = c.place(&input(r, n, kind));
            c.all_reduce(&mut t, ReduceOp::Avg)
                .map_err(|x| format!("all_reduce avg {tag}: {x}"))?;
            if !same(t.tensor(), &(&reference / (w as f64))) {
                return Err(format!("all_reduce avg {tag}: wrong mean"));
            }
        }
    }
    // an in-place collective on a placed tensor writes through to the worker's own tensor
    let mine = input(r, 4099, Kind::Float).to_device(c.device());
    let mut placed = c.place(&mine);
    c.all_reduce(&mut placed, ReduceOp::Sum)
        .map_err(e("all_reduce in place"))?;
    let total = (0..w)
        .map(|p| input(p, 4099, Kind::Float))
        .reduce(|a, b| a + b)
        .unwrap();
    if !same(&mine, &total) {
        return Err("all_reduce of a placed tensor did not write through to it".into());
    }
    for root in 0..w {
        let mut t = if r == root {
            c.place(&input(root, 50_001, Kind::Float))
        } else {
            c.zeros(&[50_001], Kind::Float)
        };
        c.broadcast(&mut t, root).map_err(e("broadcast"))?;
        if !same(t.tensor(), &input(root, 50_001, Kind::Float)) {
            return Err(format!("broadcast from {root}: wrong data"));
        }
    }
    let g = c
        .all_gather(&c.place(&input(r, 1001, Kind::Float)))
        .map_err(e("all_gather"))?;
    let want = Tensor::stack(
        &(0..w)
            .map(|p| input(p, 1001, Kind::Float))
            .collect::<Vec<_>>(),
        0,
    );
    if !same(g.tensor(), &want) {
        return Err("all_gather: wrong data".into());
    }
    let big = input(r, 2003 * w as i64, Kind::Float).reshape([w as i64, 2003]);
    let rs = c
        .reduce_scatter(&c.place(&big))
        .map_err(e("reduce_scatter"))?;
    let full = (0..w)
        .map(|p| input(p, 2003 * w as i64, Kind::Float).reshape([w as i64, 2003]))
        .reduce(|a, b| a + b)
        .unwrap();
    if !same(rs.tensor(), &full.get(r as i64).unsqueeze(0)) {
        return Err("reduce_scatter: wrong slice".into());
    }
    c.barrier().map_err(e("barrier"))?;
    Ok(())
}

/// Point-to-point exchanges in the shapes the worker uses, the deadlock shape included: every
/// rank sends first (tensors far larger than a socket's buffers) to its next rank and to every
/// other rank at once, several tensors to one peer in order, and a pipeline ring.
pub fn exchanges(c: &dyn Communicator) -> Result<(), String> {
    let (r, w) = (c.rank(), c.world());
    if w == 1 {
        return Ok(());
    }
    let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
    // everyone sends 16 MiB to the next rank and receives from the previous one, together
    let n = 4 << 20;
    let out = c.place(&input(r, n, Kind::Float));
    let inn = c.zeros(&[n], Kind::Float);
    c.exchange(&[(next, &out)], &[(prev, &inn)])
        .map_err(e("exchange (both send first)"))?;
    if !same(inn.tensor(), &input(prev, n, Kind::Float)) {
        return Err("exchange (both send first): wrong data".into());
    }
    // all to all, two tensors to each peer (arriving in the order sent), of mixed kinds
    let peers: Vec<u32> = (0..w).filter(|p| *p != r).collect();
    let sends: Vec<(u32, DevTensor)> = peers
        .iter()
        .flat_map(|p| {
            [
                (*p, c.place(&input(r * 10 + p, 300_007, Kind::Float))),
                (*p, c.place(&input(r + p, 5_003, Kind::Half))),
            ]
        })
        .collect();
    let recvs: Vec<(u32, DevTensor)> = peers
        .iter()
        .flat_map(|p| {
            [
                (*p, c.zeros(&[300_007], Kind::Float)),
                (*p, c.zeros(&[5_003], Kind::Half)),
            ]
        })
        .collect();
    let s: Vec<(u32, &DevTensor)> = sends.iter().map(|(p, t)| (*p, t)).collect();
    let rv: Vec<(u32, &DevTensor)> = recvs.iter().map(|(p, t)| (*p, t)).collect();
    c.exchange(&s, &rv).map_err(e("exchange (all to all)"))?;
    for (i, p) in peers.iter().enumerate() {
        if !same(
            recvs[2 * i].1.tensor(),
            &input(p * 10 + r, 300_007, Kind::Float),
        ) || !same(
            recvs[2 * i + 1].1.tensor(),
            &input(p + r, 5_003, Kind::Half),
        ) {
            return Err(format!("exchange (all to all): wrong data from rank {p}"));
        }
    }
    // a pipeline ring of single sends and receives, half the ranks receiving first
    let out = c.place(&input(r, 777, Kind::Float));
    let inn = c.zeros(&[777], Kind::Float);
    if r % 2 == 0 {
        c.send(&out, next).map_err(e("send"))?;
        c.recv(&inn, prev).map_err(e("recv"))?;
    } else {
        c.recv(&inn, prev).map_err(e("recv"))?;
        c.send(&out, next).map_err(e("send"))?;
    }
    if !same(inn.tensor(), &input(prev, 777, Kind::Float)) {
        return Err("send/recv: wrong data".into());
    }
    Ok(())
}

/// Groups over the communicator (tensor-parallel groups, DiLoCo's exchanges): uneven
/// all-gathers and sums folded in member order.
pub fn groups(c: &Arc<dyn Communicator>) -> Result<(), String> {
    let (r, w) = (c.rank(), c.world());
    let g = Group::new(c.clone(), (0..w).rev().collect()).map_err(e("group"))?;
    let me = g.rank();
    let shapes: Vec<Vec<i64>> = (0..w).map(|i| vec![3, 100 + i as i64]).collect();
    let mine = input(r, 3 * (100 + me as i64), Kind::Float).view([3, 100 + me as i64]);
    let parts = g
        .all_gather_shaped(&mine.to_device(c.device()), &shapes)
        .map_err(e("group all_gather"))?;
    for (i, p) in parts.iter().enumerate() {
        let rank = g.members()[i];
        if !same(
            p,
            &input(rank, 3 * (100 + i as i64), Kind::Float).view([3, 100 + i as i64]),
        ) {
            return Err(format!("group all_gather: wrong part from member {i}"));
        }
    }
    let sum = g
        .all_reduce_sum(&input(r, 999, Kind::Float).to_device(c.device()))
        .map_err(e("group sum"))?;
    let mut want = input(w - 1, 999, Kind::Float);
    for m in (0..w - 1).rev() {
        want += input(m, 999, Kind::Float);
    }
    if !same(&sum, &want) {
        return Err("group sum: wrong data".into());
    }
    Ok(())
}

/// The host face: rows of any length, sums in rank order, broadcasts from every root,
/// messages around a ring.
pub fn host_face(h: &dyn HostChannel) -> Result<(), String> {
    let (r, w) = (h.rank(), h.world());
    let mine: Vec<u8> = (0..(r * 3 + 1))
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(r as u8))
        .collect();
    let rows = h.all_gather_bytes(&mine).map_err(e("host all_gather"))?;
    for (p, row) in rows.iter().enumerate() {
        let want: Vec<u8> = (0..(p as u32 * 3 + 1))
            .map(|i| (i as u8).wrapping_mul(7).wrapping_add(p as u8))
            .collect();
        if *row != want {
            return Err(format!("host all_gather: wrong row from rank {p}"));
        }
    }
    let ints = h
        .all_gather_i64(&[r as i64, -(r as i64), i64::MAX - r as i64])
        .map_err(e("host all_gather_i64"))?;
    if ints
        .iter()
        .enumerate()
        .any(|(p, v)| *v != [p as i64, -(p as i64), i64::MAX - p as i64])
    {
        return Err("host all_gather_i64: wrong rows".into());
    }
    let sum = h
        .sum_f64(&[0.1 * (r + 1) as f64, 1.0])
        .map_err(e("host sum"))?;
    let want = (0..w).fold(0f64, |a, p| a + 0.1 * (p + 1) as f64);
    if sum != [want, w as f64] {
        return Err(format!(
            "host sum: {sum:?}, expected [{want}, {w}] folded in rank order"
        ));
    }
    for root in 0..w {
        let mut v = if r == root {
            (0..10_240u32).map(|i| ((i + root) % 251) as u8).collect()
        } else {
            Vec::new()
        };
        h.broadcast_vec(&mut v, root).map_err(e("broadcast_vec"))?;
        if v.len() != 10_240
            || v.iter()
                .enumerate()
                .any(|(i, b)| *b != ((i as u32 + root) % 251) as u8)
        {
            return Err(format!("broadcast_vec from {root}: wrong data"));
        }
    }
    if w > 1 {
        let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
        // messages never block their sender on the reader: everyone sends first
        h.send_msg(format!("from {r}").as_bytes(), next)
            .map_err(e("send_msg"))?;
        h.send_msg(&[], next).map_err(e("send_msg (empty)"))?;
        let a = h.recv_msg(prev).map_err(e("recv_msg"))?;
        let b = h.recv_msg(prev).map_err(e("recv_msg"))?;
        if a != format!("from {prev}").as_bytes() || !b.is_empty() {
            return Err("send_msg/recv_msg: wrong messages or order".into());
        }
    }
    h.barrier().map_err(e("host barrier"))?;
    Ok(())
}

/// Logical shard `index` of the ordered all-reduce test: non-integer values.
pub fn shard(index: u64, len: i64) -> Tensor {
    let g = Tensor::arange(len, (Kind::Float, Device::Cpu));
    ((&g * 0.618_034 + index as f64 * std::f64::consts::SQRT_2).sin() * 1000.0
        / (index as f64 + 3.0))
        .contiguous()
}

/// Runs the ordered all-reduce over `total` shards of `len` floats; returns the result's bytes
/// after checking them against the left fold computed locally.
pub fn ordered(c: &dyn Communicator, total: u64, len: i64) -> Result<Vec<u8>, String> {
    let shards: Vec<(u64, DevTensor)> = ductile_strategies::split_range(total, c.world(), c.rank())
        .map(|i| (i, c.place(&shard(i, len))))
        .collect();
    let out = c
        .ordered_all_reduce(&shards, total)
        .map_err(|e| format!("ordered_all_reduce: {e}"))?;
    let mut fold = shard(0, len);
    for i in 1..total {
        fold = &fold + &shard(i, len);
    }
    if !same(out.tensor(), &fold) {
        return Err("ordered_all_reduce: result differs from the left fold".into());
    }
    let out = out.into_tensor().to_device(Device::Cpu);
    let mut bytes = vec![0u8; (len * 4) as usize];
    out.copy_data_u8(&mut bytes, len as usize);
    Ok(bytes)
}

//! A sum over a group exchanged in fewer bytes: each member's flat f32 tensor is cut into one
//! range per member; every member sends each other member that member's range, encoded
//! (`fp16`, or `int8` with one f32 scale per block of [`BLOCK`] values); each member decodes
//! the parts of its range and folds them in member order, encodes the sum and sends it to every
//! other member; every member decodes the sums. Each member sends 2·(n − 1)/n of the tensor,
//! encoded, as a ring all-reduce does in f32, so `int8` moves a quarter of the bytes.
//!
//! Every member ends with the same bits (the owner of a range uses the decoded encoding of its
//! sum, as the others do), whatever the arrival order.
//!
//! Error bounds (per element): `int8` rounds to the nearest multiple of its block's scale
//! (max |x| / 127), so an element is off by at most max|x| / 254 of its block; `fp16` rounds to
//! 11 significant bits (relative 2^-11; values past ±65504 are clamped). The sum is encoded
//! twice (each part, then the sum), so it is off by at most the sum of the parts' bounds plus
//! the sum's own ([`bound`]).

use tch::{Device, Kind, Tensor};

use crate::{CommError, Group, Result};

/// Values per int8 block (each block carries its own f32 scale).
pub const BLOCK: usize = 256;

/// The exchange's encoding: a job's `diloco.quantize`.
pub use ductile_cluster::records::Quantize as Quant;

/// Encoded bytes of `n` values.
pub fn encoded_len(q: Quant, n: usize) -> usize {
    match q {
        Quant::None => 4 * n,
        Quant::Fp16 => 2 * n,
        Quant::Int8 => n + 4 * n.div_ceil(BLOCK),
    }
}

/// Encode the f32 values of `x`.
pub fn encode(x: &[f32], q: Quant) -> Vec<u8> {
    let mut out = Vec::with_capacity(encoded_len(q, x.len()));
    match q {
        Quant::None => {
            for v in x {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Quant::Fp16 => {
            for v in x {
                let h = half::f16::from_f32(v.clamp(-65504.0, 65504.0));
                out.extend_from_slice(&h.to_le_bytes());
            }
        }
        Quant::Int8 => {
            for block in x.chunks(BLOCK) {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let scale = if amax > 0.0 && amax.is_finite() {
                    amax / 127.0
                } else {
                    0.0
                };
                out.extend_from_slice(&scale.to_le_bytes());
                for v in block {
                    let q = if scale > 0.0 {
                        (v / scale).round().clamp(-127.0, 127.0) as i8
                    } else {
                        0
                    };
                    out.push(q as u8);
                }
            }
        }
    }
    out
}

/// Decode `n` values encoded by [`encode`]; an encoding of another length is an error.
pub fn decode(b: &[u8], n: usize, q: Quant) -> std::result::Result<Vec<f32>, String> {
    if b.len() != encoded_len(q, n) {
        return Err(format!(
            "{} bytes do not encode {n} values as {q:?} ({} would)",
            b.len(),
            encoded_len(q, n)
        ));
    }
    Ok(match q {
        Quant::None => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Quant::Fp16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32())
            .collect(),
        Quant::Int8 => {
            let mut out = Vec::with_capacity(n);
            let mut at = 0;
            let mut left = n;
            while left > 0 {
                let k = left.min(BLOCK);
                let scale = f32::from_le_bytes(b[at..at + 4].try_into().unwrap());
                out.extend(
                    b[at + 4..at + 4 + k]
                        .iter()
                        .map(|q| *q as i8 as f32 * scale),
                );
                at += 4 + k;
                left -= k;
            }
            out
        }
    })
}

/// The largest error [`encode`] then [`decode`] may make on an element of `x` (per element).
pub fn bound(x: &[f32], q: Quant) -> Vec<f32> {
    match q {
        Quant::None => vec![0.0; x.len()],
        Quant::Fp16 => x.iter().map(|v| v.abs() * (1.0 / 2048.0) + 6e-8).collect(),
        Quant::Int8 => x
            .chunks(BLOCK)
            .flat_map(|b| {
                let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                // half a step, and a little for f32 rounding of the scale and the product
                std::iter::repeat_n(amax / 254.0 * (1.0 + 1e-5), b.len())
            })
            .collect(),
    }
}

/// The ranges of `n` values the members own, in member order (as even as can be).
pub fn ranges(n: usize, members: usize) -> Vec<std::ops::Range<usize>> {
    let (per, extra) = (n / members, n % members);
    let mut at = 0;
    (0..members)
        .map(|i| {
            let len = per + usize::from(i < extra);
            at += len;
            at - len..at
        })
        .collect()
}

/// The sum of the members' `t` (flat f32, the same length everywhere), exchanged as `q`
/// (module docs). Returns the sum (a CPU tensor) and the bytes this member sent.
pub fn all_reduce(group: &Group, t: &Tensor, q: Quant) -> Result<(Tensor, u64)> {
    let invalid = |reason: String| CommError::Invalid {
        op: "quantized all_reduce",
        reason,
    };
    if t.dim() != 1 || t.kind() != Kind::Float {
        return Err(invalid(format!(
            "needs a flat f32 tensor, not {:?} {:?}",
            t.size(),
            t.kind()
        )));
    }
    let x = Vec::<f32>::try_from(t.to_device(Device::Cpu))
        .map_err(|e| invalid(format!("reading the tensor: {e}")))?;
    let n = x.len();
    let size = group.size() as usize;
    let me = group.rank() as usize;
    let rs = ranges(n, size);
    // the backends move float tensors: an encoding travels as the bytes of an f16 tensor
    // (padded to an even length)
    let as_u8 = |mut b: Vec<u8>| {
        if b.len() % 2 == 1 {
            b.push(0);
        }
        Tensor::from_data_size(&b, &[b.len() as i64 / 2], Kind::Half)
    };
    let lens: Vec<Vec<i64>> = rs
        .iter()
        .map(|r| vec![encoded_len(q, r.len()).div_ceil(2) as i64])
        .collect();
    let bytes_of = |t: &Tensor, n: usize| {
        let mut b = vec![0u8; t.numel() * 2];
        t.copy_data_u8(&mut b, t.numel());
        b.truncate(encoded_len(q, n));
        b
    };
    // 1. every member gets the others' encodings of its range
    let parts: Vec<Tensor> = rs.iter().map(|r| as_u8(encode(&x[r.clone()], q))).collect();
    let mut sent: u64 = parts
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != me)
        .map(|(_, p)| 2 * p.numel() as u64)
        .sum();
    let mine_len = vec![lens[me].clone(); size];
    let got = group.all_to_all(&parts, &mine_len)?;
    let mut sum = vec![0f32; rs[me].len()];
    for (i, p) in got.iter().enumerate() {
        let bytes = bytes_of(p, rs[me].len());
        let v = decode(&bytes, rs[me].len(), q)
            .map_err(|e| invalid(format!("member {i}'s part: {e}")))?;
        for (s, v) in sum.iter_mut().zip(v) {
            *s += v;
        }
    }
    // 2. every member gets the encoded sums of the others' ranges
    let enc = as_u8(encode(&sum, q));
    sent += 2 * enc.numel() as u64 * (size as u64 - 1);
    let sums = group.all_gather_shaped(&enc, &lens)?;
    let mut out = Vec::with_capacity(n);
    for (i, s) in sums.iter().enumerate() {
        let bytes = bytes_of(s, rs[i].len());
        out.extend(
            decode(&bytes, rs[i].len(), q)
                .map_err(|e| invalid(format!("member {i}'s sum: {e}")))?,
        );
    }
    Ok((Tensor::from_slice(&out), sent))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        // a spread of magnitudes, both signs, some exact zeros
        (0..n)
            .map(|i| {
                let h = (i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                let v = (h as f32 / (1u64 << 24) as f32) - 0.5;
                if i % 97 == 0 {
                    0.0
                } else {
                    v * 10f32.powi((i % 7) as i32 - 4)
                }
            })
            .collect()
    }

    #[test]
    fn encodings_round_trip_within_their_bound() {
        let x = values(1000, 3);
        for q in [Quant::None, Quant::Fp16, Quant::Int8] {
            let b = encode(&x, q);
            assert_eq!(b.len(), encoded_len(q, x.len()));
            let y = decode(&b, x.len(), q).unwrap();
            let bound = bound(&x, q);
            for i in 0..x.len() {
                assert!(
                    (x[i] - y[i]).abs() <= bound[i],
                    "{q:?} element {i}: {} decoded as {} (bound {})",
                    x[i],
                    y[i],
                    bound[i]
                );
            }
            if q == Quant::None {
                assert_eq!(x, y);
            }
        }
        // int8 moves about a quarter of f32's bytes
        assert!(encoded_len(Quant::Int8, 1 << 20) * 100 <= 4 * (1 << 20) * 26);
        assert!(decode(&[0u8; 7], 3, Quant::Fp16).is_err());
    }

    #[test]
    fn the_quantized_sum_is_within_its_bound_and_the_same_on_every_member() {
        let world = 3u32;
        let rt = tokio::runtime::Runtime::new().unwrap();
        let comms = rt
            .block_on(crate::tcp::loopback_mesh(world, "quant", 77))
            .unwrap();
        let n = 1001;
        let xs: Vec<Vec<f32>> = (0..world).map(|r| values(n, r as u64 + 10)).collect();
        let exact: Vec<f32> = (0..n).map(|i| xs.iter().map(|x| x[i]).sum()).collect();
        for q in [Quant::None, Quant::Fp16, Quant::Int8] {
            let outs: Vec<(Vec<f32>, u64)> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .iter()
                    .zip(&xs)
                    .map(|(c, x)| {
                        let c = c.clone();
                        s.spawn(move || {
                            let g = Group::new(c, (0..world).collect()).unwrap();
                            let (t, sent) = all_reduce(&g, &Tensor::from_slice(x), q).unwrap();
                            (Vec::<f32>::try_from(t).unwrap(), sent)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (r, (o, _)) in outs.iter().enumerate() {
                assert_eq!(o, &outs[0].0, "{q:?}: member {r} has other bits");
            }
            // per element: each part's bound, plus the sum's
            let mut b = vec![0f32; n];
            for x in &xs {
                for (b, e) in b.iter_mut().zip(bound(x, q)) {
                    *b += e;
                }
            }
            let approx_sum: Vec<f32> = exact.clone();
            for (b, e) in b.iter_mut().zip(bound(&approx_sum, q)) {
                // the sum's bound, on a sum already off by the parts' errors
                *b += e * 1.01 + 1e-9;
            }
            for i in 0..n {
                assert!(
                    (outs[0].0[i] - exact[i]).abs() <= b[i] + exact[i].abs() * 1e-6,
                    "{q:?} element {i}: {} for {} (bound {})",
                    outs[0].0[i],
                    exact[i],
                    b[i]
                );
            }
            let want = 2 * (world as u64 - 1) * encoded_len(q, n / 3) as u64;
            let sent = outs[0].1;
            assert!(
                sent.abs_diff(want) <= 64,
                "{q:?}: sent {sent} bytes, about {want} expected"
            );
        }
    }
}

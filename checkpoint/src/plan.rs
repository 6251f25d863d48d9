//! Who writes and who reads what.
//!
//! Saving: the tensors, in order, form one byte stream of T bytes; writer w of n owns the rows
//! whose first byte falls in [⌈w·T/n⌉, ⌈(w+1)·T/n⌉), so each byte is written once and writers
//! differ by at most one row. A writer's rows of one tensor are one chunk.
//!
//! Restoring: the manifest's chunks, in save order, are dealt to the n readers of the current
//! world by their byte position in the same way (whole chunks, since a chunk's CRC covers it).

use crate::format::{Manifest, TensorMeta};

/// Per writer: its chunks as (tensor index, first row, rows), in tensor order.
pub fn writers(tensors: &[TensorMeta], n: u32) -> Vec<Vec<(usize, u64, u64)>> {
    let n = n.max(1) as u128;
    let total: u128 = tensors.iter().map(|t| t.bytes() as u128).sum();
    let bound = |w: u128| (w * total).div_ceil(n);
    let mut out = vec![Vec::new(); n as usize];
    let mut base = 0u128;
    for (ti, t) in tensors.iter().enumerate() {
        let rb = t.row_bytes() as u128;
        let rows = t.rows() as u128;
        if rb == 0 || rows == 0 {
            // empty tensors still appear (in the first writer's shard)
            out[0].push((ti, 0, t.rows()));
            continue;
        }
        // first row of this tensor owned by writer w
        let first = |w: u128| -> u128 {
            let b = bound(w);
            if b <= base {
                0
            } else {
                (b - base).div_ceil(rb).min(rows)
            }
        };
        for w in 0..n {
            let (a, b) = (first(w), if w + 1 == n { rows } else { first(w + 1) });
            if b > a {
                out[w as usize].push((ti, a as u64, (b - a) as u64));
            }
        }
        base += rb * rows;
    }
    out
}

/// Per writer of `world`: its chunks when each tensor is held only by some ranks (a pipeline
/// stage's replicas): `owners[t]` lists, in order, the ranks that hold tensor t. Tensors with
/// the same owners are split over them as [`writers`] splits everything over all; a rank that
/// holds nothing writes an empty shard.
pub fn writers_by_owner(
    tensors: &[TensorMeta],
    owners: &[Vec<u32>],
    world: u32,
) -> Vec<Vec<(usize, u64, u64)>> {
    let mut out = vec![Vec::new(); world.max(1) as usize];
    let mut groups: Vec<(&Vec<u32>, Vec<usize>)> = Vec::new();
    for (ti, o) in owners.iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| *g == o) {
            Some((_, ts)) => ts.push(ti),
            None => groups.push((o, vec![ti])),
        }
    }
    for (ranks, ts) in groups {
        if ranks.is_empty() {
            continue;
        }
        let sub: Vec<TensorMeta> = ts.iter().map(|t| tensors[*t].clone()).collect();
        for (w, chunks) in writers(&sub, ranks.len() as u32).into_iter().enumerate() {
            let r = ranks[w] as usize;
            out[r].extend(chunks.into_iter().map(|(i, a, n)| (ts[i], a, n)));
        }
    }
    for o in &mut out {
        o.sort();
    }
    out
}

/// A chunk of the manifest: (tensor name, chunk index).
pub type ChunkRef = (String, usize);

/// Per reader: the chunks it fetches and verifies.
pub fn readers(m: &Manifest, n: u32) -> Vec<Vec<ChunkRef>> {
    let n = n.max(1) as u128;
    let all: Vec<(ChunkRef, u64)> = m
        .ordered()
        .flat_map(|(name, t)| {
            t.chunks
                .iter()
                .enumerate()
                .map(move |(i, c)| ((name.clone(), i), c.byte_range[1] - c.byte_range[0]))
        })
        .collect();
    let total: u128 = all.iter().map(|(_, b)| *b as u128).sum::<u128>().max(1);
    let mut out = vec![Vec::new(); n as usize];
    let mut at = 0u128;
    for (c, b) in all {
        // the reader whose share holds the chunk's middle byte
        let mid = at + b as u128 / 2;
        let r = ((mid * n) / total).min(n - 1);
        out[r as usize].push(c);
        at += b as u128;
    }
    out
}

#[cfg(test)]
mod owner_tests {
    use super::*;
    use crate::format::{Dtype, TensorKind};

    #[test]
    fn owners_split_only_what_they_hold_and_every_byte_once() {
        let t = |name: &str, rows| TensorMeta {
            name: name.into(),
            dtype: Dtype::F32,
            shape: vec![rows, 3],
            kind: TensorKind::Parameter,
        };
        let ts = vec![t("a", 10), t("b", 7), t("c", 5)];
        // a, b on ranks 0 and 2 (stage 0 of two replicas), c on 1 and 3, rank 4 a spare
        let owners = vec![vec![0, 2], vec![0, 2], vec![1, 3]];
        let w = writers_by_owner(&ts, &owners, 5);
        assert!(w[4].is_empty());
        let mut rows = [0u64; 3];
        for (r, chunks) in w.iter().enumerate() {
            for (ti, _, n) in chunks {
                assert!(
                    owners[*ti].contains(&(r as u32)),
                    "rank {r} wrote tensor {ti}"
                );
                rows[*ti] += n;
            }
        }
        assert_eq!(rows, [10, 7, 5]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Dtype, TensorKind};

    fn t(name: &str, shape: &[u64]) -> TensorMeta {
        TensorMeta {
            name: name.into(),
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            kind: TensorKind::Parameter,
        }
    }

    #[test]
    fn writers_cover_every_row_once_and_balance_bytes() {
        let ts = vec![
            t("a", &[100, 7]),
            t("b", &[13]),
            t("c", &[]),
            t("d", &[50, 3, 2]),
        ];
        for n in 1..=7u32 {
            let plan = writers(&ts, n);
            assert_eq!(plan.len(), n as usize);
            for (ti, tm) in ts.iter().enumerate() {
                let mut rows: Vec<(u64, u64)> = plan
                    .iter()
                    .flatten()
                    .filter(|c| c.0 == ti)
                    .map(|c| (c.1, c.2))
                    .collect();
                rows.sort();
                let mut next = 0;
                for (r, k) in rows {
                    assert_eq!(r, next, "n={n} tensor {}", tm.name);
                    next = r + k;
                }
                assert_eq!(next, tm.rows(), "n={n} tensor {}", tm.name);
            }
            let bytes: Vec<u64> = plan
                .iter()
                .map(|cs| cs.iter().map(|c| c.2 * ts[c.0].row_bytes()).sum())
                .collect();
            let total: u64 = ts.iter().map(|x| x.bytes()).sum();
            let max_row = ts.iter().map(|x| x.row_bytes()).max().unwrap();
            for b in &bytes {
                assert!(
                    b.abs_diff(total / n as u64) <= max_row + 4,
                    "n={n}: {bytes:?}"
                );
            }
        }
    }
}

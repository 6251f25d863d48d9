//! Parallel strategies, re-planned for each world size: the layout of a generation, each
//! rank's share of a fixed global batch, and pipeline plans ([`pipeline`]). No I/O, no tch.

pub mod arch;
pub mod buddy;
pub mod diloco;
pub mod mesh;
pub mod pipeline;
pub mod redistribute;
pub mod rows;
pub mod tensor;

use ductile_cluster::records::Layout;

/// The layout of a data-parallel world of `world` ranks.
pub fn data_parallel_layout(world: u32) -> Layout {
    Layout::data_parallel(world)
}

/// One rank's share of a step's global batch: global positions `start .. start + len` of the
/// epoch's permutation, counted from the step's first position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    pub rank: u32,
    pub start: u64,
    pub len: u64,
}

/// Split a fixed global batch over `world` ranks in contiguous shares that differ by at most
/// one sample (the first `batch % world` ranks take one more). Every position is in exactly one
/// share, whatever the world size.
pub fn split_batch(global_batch: u64, world: u32) -> Vec<Share> {
    assert!(world > 0, "a world has at least one rank");
    let (base, extra) = (global_batch / world as u64, global_batch % world as u64);
    let mut start = 0;
    (0..world)
        .map(|rank| {
            let len = base + u64::from((rank as u64) < extra);
            let s = Share { rank, start, len };
            start += len;
            s
        })
        .collect()
}

/// The contiguous range of `total` items (logical shards) that rank `rank` of `world` holds;
/// uneven when `world` does not divide `total`, in rank order.
pub fn split_range(total: u64, world: u32, rank: u32) -> std::ops::Range<u64> {
    (total * rank as u64 / world as u64)..(total * (rank as u64 + 1) / world as u64)
}

/// Cut a share into micro-batches of at most `micro` samples (gradient accumulation).
pub fn micro_batches(share: Share, micro: u64) -> Vec<(u64, u64)> {
    assert!(micro > 0);
    let mut out = Vec::new();
    let mut at = share.start;
    let end = share.start + share.len;
    while at < end {
        let n = micro.min(end - at);
        out.push((at, n));
        at += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_global_batch_exactly_for_every_world_size() {
        for batch in [1u64, 7, 32, 33, 1000] {
            for world in 1..=12u32 {
                let shares = split_batch(batch, world);
                assert_eq!(shares.len(), world as usize);
                let mut next = 0;
                for s in &shares {
                    assert_eq!(s.start, next, "contiguous");
                    next += s.len;
                }
                assert_eq!(next, batch, "batch {batch} world {world}");
                let (min, max) = (
                    shares.iter().map(|s| s.len).min().unwrap(),
                    shares.iter().map(|s| s.len).max().unwrap(),
                );
                assert!(max - min <= 1, "balanced");
            }
        }
    }

    #[test]
    fn micro_batches_tile_a_share() {
        let s = Share {
            rank: 1,
            start: 10,
            len: 7,
        };
        assert_eq!(micro_batches(s, 3), vec![(10, 3), (13, 3), (16, 1)]);
        assert_eq!(
            micro_batches(
                Share {
                    rank: 0,
                    start: 0,
                    len: 0
                },
                4
            ),
            vec![]
        );
        assert_eq!(data_parallel_layout(5).data_parallel, 5);
    }
}

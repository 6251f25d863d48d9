//! Where every rank of a generation sits in its layout, built once per generation.
//!
//! Ranks are laid out `rank = (dp_rank · pp + pp_stage) · tp + tp_rank`: a tensor group is a run
//! of consecutive ranks, and the stages of one replica are neighbouring groups. This module is
//! the only place that formula is written; the daemon assigns members' coordinates with it and
//! the workers find their tensor group, stage peers and replicas with it.

use ductile_cluster::records::Layout;

/// A rank's place: its replica (`dp`), its pipeline stage and its place in its tensor group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Coords {
    pub dp: u32,
    pub stage: u32,
    pub tp: u32,
}

/// The `dp × pp × tp` layout of a generation's working ranks (spares come after them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mesh {
    pub dp: u32,
    pub pp: u32,
    pub tp: u32,
}

impl Mesh {
    pub fn new(layout: &Layout) -> Mesh {
        Mesh {
            dp: layout.data_parallel,
            pp: layout.pipeline_parallel.max(1),
            tp: layout.tensor_parallel.max(1),
        }
    }

    /// The working ranks (the rest of a world are spares).
    pub fn working(&self) -> u32 {
        self.dp * self.pp * self.tp
    }

    /// The rank at `c`.
    pub fn rank(&self, c: Coords) -> u32 {
        (c.dp * self.pp + c.stage) * self.tp + c.tp
    }

    /// The coordinates of `rank`, or None for a spare.
    pub fn coords(&self, rank: u32) -> Option<Coords> {
        (rank < self.working()).then(|| Coords {
            dp: rank / self.tp / self.pp,
            stage: rank / self.tp % self.pp,
            tp: rank % self.tp,
        })
    }

    /// The tensor group of the rank at `c`: its replica's and stage's members, in `tp` order.
    pub fn tensor_group(&self, c: Coords) -> Vec<u32> {
        (0..self.tp)
            .map(|tp| self.rank(Coords { tp, ..c }))
            .collect()
    }

    /// The rank that holds stage `stage` of `c`'s replica at the same place in its tensor group.
    pub fn stage_peer(&self, c: Coords, stage: u32) -> u32 {
        self.rank(Coords { stage, ..c })
    }

    /// The ranks holding `c`'s stage and tensor place in every replica, in replica order.
    pub fn replicas(&self, c: Coords) -> Vec<u32> {
        (0..self.dp)
            .map(|dp| self.rank(Coords { dp, ..c }))
            .collect()
    }

    /// The shard group of the rank at `c` when its stage's replicas shard the optimizer state
    /// in groups of `shard` (`Layout::dp_shard`): the replicas `[dp − dp mod shard, + shard)`
    /// of its stage and tensor place, in replica order (its place in it: `dp mod shard`).
    pub fn shard_group(&self, c: Coords, shard: u32) -> Vec<u32> {
        let shard = shard.clamp(1, self.dp.max(1));
        let first = c.dp - c.dp % shard;
        (first..(first + shard).min(self.dp))
            .map(|dp| self.rank(Coords { dp, ..c }))
            .collect()
    }

    /// HSDP's other axis: the ranks at `c`'s place (`dp mod shard`) in every shard group of
    /// its stage and tensor place ([`Mesh::shard_group`]'s groups), in replica order: they
    /// hold the same rows.
    pub fn shard_peers(&self, c: Coords, shard: u32) -> Vec<u32> {
        let shard = shard.clamp(1, self.dp.max(1));
        (0..self.dp)
            .filter(|dp| dp % shard == c.dp % shard)
            .map(|dp| self.rank(Coords { dp, ..c }))
            .collect()
    }

    /// Whether the rank at `c` counts its tensor group's loss and samples (the group's members
    /// compute the same loss over the same samples: one of them counts them).
    pub fn counts_loss(c: Coords) -> bool {
        c.tp == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_working_rank_round_trips_and_groups_are_consecutive_runs() {
        let m = Mesh::new(&Layout {
            data_parallel: 2,
            pipeline_parallel: 3,
            tensor_parallel: 2,
            dp_shard: 1,
        });
        for r in 0..m.working() {
            let c = m.coords(r).unwrap();
            assert_eq!(m.rank(c), r);
            let g = m.tensor_group(c);
            assert_eq!(g, vec![r - c.tp, r - c.tp + 1]);
            assert_eq!(m.replicas(c).len(), 2);
            assert!(m.replicas(c).contains(&r));
            assert_eq!(m.coords(m.stage_peer(c, 2)).unwrap().stage, 2);
        }
        assert_eq!(m.coords(12), None, "rank 12 is a spare");
        // shard groups of 2 replicas (all of them here), and of 1
        let c = m.coords(7).unwrap();
        assert_eq!(m.shard_group(c, 2), vec![1, 7]);
        assert_eq!(m.shard_group(c, 1), vec![7]);
        // HSDP's other axis: with one shard group of both replicas, nobody else; with groups
        // of 1, the other replica
        assert_eq!(m.shard_peers(c, 2), vec![7]);
        assert_eq!(m.shard_peers(c, 1), vec![1, 7]);
        let four = Mesh {
            dp: 4,
            pp: 1,
            tp: 2,
        };
        let c = four.coords(3).unwrap();
        assert_eq!(four.shard_group(c, 2), vec![1, 3]);
        assert_eq!(
            four.shard_peers(c, 2),
            vec![3, 7],
            "place 1 of groups {{0, 1}} and {{2, 3}}"
        );
        assert_eq!(
            m.coords(7),
            Some(Coords {
                dp: 1,
                stage: 0,
                tp: 1
            })
        );
    }
}

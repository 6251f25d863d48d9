//! Tensor-parallel generations (`tensor_parallel` > 1, alone or with stages): the agreement
//! moves each rank's slices ([`super::reshard::move_state`]) from the up-to-date holders, and
//! the model joins its tensor group (the members of its replica and stage, in `tp_rank` order).
//!
//! Ranks are laid out by `strategies::mesh::Mesh`: a tensor group is a
//! run of consecutive ranks (Megatron's order, so a group stays on one node where it fits).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use ductile_cluster::records::{Generation, Member};
use ductile_comm::{CommError, Communicator, Group};
use ductile_strategies::mesh::Mesh;
use ductile_strategies::redistribute::{self, Part};
use ductile_strategies::tensor::{held_ranges, split_of, Split};
use tch::Tensor;

use super::reshard::{holding_parts, move_state, Holding};
use super::Trainer;

impl Trainer {
    /// The holding of each state tensor (parameters, then optimizer states) of a rank that
    /// holds the units in `chunks` as member `k` of tensor groups of `tp`, and place `place` of
    /// shard groups of `shard` (`training.sharding`: its optimizer state holds its rows of each
    /// parameter only, [`ductile_strategies::split_range`] of dim 0).
    pub(super) fn holdings_of(
        &self,
        chunks: &[Range<usize>],
        tp: u32,
        k: u32,
        (shard, place): (u32, u32),
    ) -> Vec<Holding> {
        let arch = self.model.arch();
        let names: Vec<String> = self.model.params().into_iter().map(|(n, _)| n).collect();
        let of_param: Vec<Holding> = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                if !self.holds_param(chunks, i) {
                    return Holding {
                        boxes: Vec::new(),
                        dim: 0,
                    };
                }
                let shape: Vec<u64> = self.shapes[i].iter().map(|d| *d as u64).collect();
                Holding::of_tensor_place(arch, name, &shape, tp, k)
            })
            .collect();
        let per = self.opt.state.len() / self.params.len().max(1);
        let rows = |i: usize, h: &Holding| {
            if shard == 1 || h.boxes.is_empty() {
                return h.clone();
            }
            if tp == 1 {
                // whole tensors: one box, the shard's rows of the tensor (not of each of a
                // fused Q, K, V's blocks)
                let mut b: Vec<Range<u64>> = self.shapes[i].iter().map(|d| 0..*d as u64).collect();
                b[0] = ductile_strategies::split_range(b[0].end, shard, place);
                return Holding {
                    boxes: if b[0].is_empty() { Vec::new() } else { vec![b] },
                    dim: 0,
                };
            }
            shard_rows(h, shard, place)
        };
        // full sharding cuts the parameters too
        let mut out: Vec<Holding> = if self.fully_sharded() {
            of_param
                .iter()
                .enumerate()
                .map(|(i, h)| rows(i, h))
                .collect()
        } else {
            of_param.clone()
        };
        for j in 0..self.params.len() * per {
            out.push(rows(j / per, &of_param[j / per]));
        }
        out
    }

    /// Hold the tensor layout `(tp, k)`: each parameter's shape when whole on this rank
    /// follows (its slice's).
    pub(super) fn set_tp_held(&mut self, (tp, k): (u32, u32)) {
        self.tp_held = (tp, k);
        let arch = self.model.arch();
        self.gathered = self
            .model
            .params()
            .iter()
            .zip(&self.shapes)
            .map(|((name, _), shape)| {
                if tp == 1 {
                    return shape.clone();
                }
                let whole: Vec<u64> = shape.iter().map(|d| *d as u64).collect();
                Holding::of_tensor_place(arch, name, &whole, tp, k).local_shape()
            })
            .collect();
    }

    /// A member's place in `g`'s shard groups: (group size, its place), (1, 0) unsharded.
    pub(super) fn shard_of(g: &Generation, m: &Member) -> (u32, u32) {
        let s = g.layout.dp_shard.max(1);
        if s > 1 && !m.spare {
            (s, m.dp_rank % s)
        } else {
            (1, 0)
        }
    }

    /// The tensor group of member `me` in `g` (none without tensor parallelism or for a spare).
    pub(super) fn tensor_group(
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
    ) -> Result<Option<Group>, CommError> {
        let mesh = Mesh::new(&g.layout);
        match mesh.coords(me.rank) {
            Some(c) if mesh.tp > 1 && !me.spare => {
                Group::new(comm.clone(), mesh.tensor_group(c)).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Replace every state tensor (and each parameter's gradient) by `fresh`, in place, so the
    /// model's and the optimizer's handles see the new shapes.
    fn install(&mut self, fresh: Vec<Tensor>) {
        let n = self.params.len();
        tch::no_grad(|| {
            let olds: Vec<Tensor> = self.tensors().iter().map(|t| t.shallow_clone()).collect();
            for (i, (mut old, new)) in olds.into_iter().zip(fresh).enumerate() {
                if i < n {
                    let mut g = old.grad();
                    if g.defined() {
                        g.set_data(&new.zeros_like());
                    }
                }
                old.set_data(&new);
            }
        });
    }

    /// Start the job over from step 0 with the state a first start makes, cut to `mine`: the
    /// seed's parameters (or the model directory's, `init = "pretrained"`) and zero optimizer
    /// state. Every rank makes the same seed, so no rank sends any of it.
    fn start_over(
        &mut self,
        comm: &Arc<dyn Communicator>,
        need: &[Part],
        mine: &[Holding],
    ) -> anyhow::Result<Result<(), CommError>> {
        self.step = 0;
        if self.pretrained() {
            // (the optimizer state is the zeros installed before the restore)
            return self.load_pretrained(comm, need);
        }
        let seed = self.seed_params()?;
        let n = self.params.len();
        let fresh = self
            .tensors()
            .iter()
            .zip(mine)
            .enumerate()
            .map(|(i, (t, h))| match seed.get(i).filter(|_| i < n) {
                Some(whole) => h.cut(whole).to_device(t.device()),
                None => Tensor::zeros(h.local_shape().as_slice(), (t.kind(), t.device())),
            })
            .collect();
        self.install(fresh);
        Ok(Ok(()))
    }

    /// The agreement of a generation where tensor slices move (see [`super::pipe`]'s
    /// `agree`): `rows` are the members' [step, pending, tp, tp_rank, shard group,
    /// place, chunks...], `at` says
    /// whether a row is up to date at step `max`. A cold start takes the seed's slices, then
    /// the latest checkpoint's if there is one; a slice no live rank holds makes every rank
    /// restore its slices from the checkpoint. The outer error stops the worker (no holder and
    /// no checkpoint).
    pub(super) fn agree_tp(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        rows: &[Vec<f64>],
        held_by: &dyn Fn(&[f64]) -> Vec<Range<usize>>,
        at: &dyn Fn(&[f64]) -> bool,
        max: f64,
    ) -> anyhow::Result<Result<(), CommError>> {
        let step = max as u64;
        let tp = g.layout.tensor_parallel.max(1);
        let me = g.members.iter().find(|m| m.rank == comm.rank()).unwrap();
        let new_of = |m: &Member| {
            self.holdings_of(&self.units_of(g, m), tp, m.tp_rank, Self::shard_of(g, m))
        };
        let need: Vec<Part> = g
            .members
            .iter()
            .flat_map(|m| holding_parts(m.rank, &new_of(m)))
            .collect();
        let mut held: Vec<Part> = rows
            .iter()
            .enumerate()
            .filter(|(_, r)| at(r))
            .flat_map(|(rank, r)| {
                let shard = (r[4] as u32, r[5] as u32);
                let hs = self.holdings_of(&held_by(r), r[2] as u32, r[3] as u32, shard);
                holding_parts(rank as u32, &hs)
            })
            .collect();
        // the buddy copies that reach the step hold their wards' shards too
        // (the spec and the agreement's rows are every rank's, so every rank gathers or none)
        if self.spec.keeps_buddy_copies() && self.buddy_peers {
            match super::gather_rows(comm.as_ref(), &self.buddy_row()) {
                Ok(copies) => held.extend(self.buddy_parts(&copies, step)),
                Err(e) => return Ok(Err(e)),
            }
        }
        let elem = self.elem_sizes();
        let mine = new_of(me);
        if let Err(e) = redistribute::plan(&elem, &held, &[], &need) {
            self.buddy = None;
            // no live rank holds some of the state: the latest checkpoint's, or the seed's
            // where the checkpoint URL holds no commit yet (said once, by rank 0, and done in
            // this generation); a job without a checkpoint stops (the leader fails it first)
            if self.ckpt.is_none() {
                anyhow::bail!(
                    "generation {}: state at step {step} has no holder ({e}) and the job has no checkpoint: stopping rather than starting it from the seed",
                    g.number
                );
            }
            let fresh = self
                .tensors()
                .iter()
                .zip(&mine)
                .map(|(t, h)| Tensor::zeros(h.local_shape().as_slice(), (t.kind(), t.device())))
                .collect();
            self.install(fresh);
            self.held = self.units_of(g, me);
            self.set_tp_held((tp, me.tp_rank));
            self.shard_held = Self::shard_of(g, me);
            // (no pending step: the agreement took it before coming here)
            self.step = 0;
            match Self::tensor_group(comm, g, me) {
                Ok(grp) => self.model.set_tensor_group(grp),
                Err(e) => return Ok(Err(e)),
            }
            if comm.rank() == 0 {
                println!("state at step {step} has no holder ({e}): every rank restores its slices from the latest checkpoint");
            }
            let r = self.restore(comm, &need)?;
            if r.is_err() || self.step > 0 {
                return Ok(r);
            }
            if comm.rank() == 0 {
                println!("the checkpoint URL holds no commit yet: the job starts over from the seed at step 0 (the {step} steps it had taken are lost)");
            }
            return self.start_over(comm, &need, &mine);
        }
        let old: Vec<(Tensor, Holding)> = self
            .tensors()
            .into_iter()
            .map(|t| t.detach())
            .zip(self.holdings_of(&self.held, self.tp_held.0, self.tp_held.1, self.shard_held))
            .collect();
        let also = self.buddy_at(step);
        let t0 = std::time::Instant::now();
        let chunk = self.transfer_chunk();
        let moved = move_state(comm, step, chunk, &elem, &old, &also, &mine, &held, &need);
        let (fresh, got) = match moved {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        drop(old);
        drop(also);
        // (the generation makes its copies anew once the agreement is done)
        self.buddy = None;
        self.install(fresh);
        let group = match Self::tensor_group(comm, g, me) {
            Ok(grp) => grp,
            Err(e) => return Ok(Err(e)),
        };
        self.model.set_tensor_group(group);
        self.step = step;
        self.received = got.bytes as u64;
        self.held = self.units_of(g, me);
        self.set_tp_held((tp, me.tp_rank));
        self.shard_held = Self::shard_of(g, me);
        tracing::info!(
            step,
            bytes = got.bytes,
            rounds = got.rounds,
            tp,
            tp_rank = me.tp_rank,
            shard = ?self.shard_held,
            ms = t0.elapsed().as_millis() as u64,
            "tensor slices and shards in place"
        );
        if step == 0 {
            // a cold start: the seed's slices, unless the checkpoint holds a commit or the
            // model directory its weights
            return self.cold_start(comm, &need);
        }
        Ok(Ok(()))
    }

    /// Rank 0 gathers every tensor whole (for the final weights hash) from the members holding
    /// its slices; the others keep theirs.
    pub(super) fn gather_tp_to_rank0(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> Result<(), CommError> {
        let (tp, k) = self.tp_held;
        let holdings: BTreeMap<u32, Vec<Holding>> = g
            .members
            .iter()
            .map(|m| {
                (
                    m.rank,
                    self.holdings_of(&self.units_of(g, m), tp, m.tp_rank, Self::shard_of(g, m)),
                )
            })
            .collect();
        let held: Vec<Part> = holdings
            .iter()
            .flat_map(|(r, hs)| holding_parts(*r, hs))
            .collect();
        let whole = self.holdings_of(&[0..self.units()], 1, 0, (1, 0));
        let need = holding_parts(0, &whole);
        let me = comm.rank();
        let mine = if me == 0 {
            whole
        } else {
            self.holdings_of(&self.held, tp, k, self.shard_held)
        };
        let old: Vec<(Tensor, Holding)> = self
            .tensors()
            .into_iter()
            .map(|t| t.detach())
            .zip(self.holdings_of(&self.held, tp, k, self.shard_held))
            .collect();
        let (fresh, _) = move_state(
            comm,
            self.step,
            self.transfer_chunk(),
            &self.elem_sizes(),
            &old,
            &[],
            &mine,
            &held,
            &need,
        )?;
        drop(old);
        if me == 0 {
            self.install(fresh);
            self.model.set_tensor_group(None);
            self.held = vec![0..self.units()];
            self.set_tp_held((1, 0));
            self.shard_held = (1, 0);
        }
        Ok(())
    }
}

/// A chunk of a checkpoint shard: (state tensor, first row, rows), with its data.
pub(super) type RowChunk = ((usize, u64, u64), Tensor);

impl Trainer {
    /// What this rank writes in a checkpoint of a generation with stages or tensor groups:
    /// the members of replica 0 write the parameters, and the optimizer state too unless it
    /// is sharded over the stage's replicas, where each member of shard group 0 writes its
    /// rows; each writes row ranges of the logical tensors (the manifest stays layout-free).
    /// Row-split tensors (and each of Q, K, V) are the member's own rows; a replicated tensor
    /// is written by the group's first member; a column-split one is gathered over the group
    /// (the rows the member holds: every member of a group holds the same ones) and each
    /// member writes its share of those rows, whole.
    pub(super) fn tp_save_parts(
        &self,
        g: &Generation,
        rank: u32,
    ) -> Result<Vec<RowChunk>, CommError> {
        let Some(me) = g.members.iter().find(|m| m.rank == rank) else {
            return Ok(Vec::new());
        };
        let s = self.shard_held.0;
        if me.spare || me.dp_rank / s != 0 {
            return Ok(Vec::new());
        }
        let (tp, k) = self.tp_held;
        let grp = match tp > 1 {
            true => Some(
                self.model
                    .tensor_shard()
                    .map(|s| s.group.clone())
                    .ok_or_else(|| CommError::Invalid {
                        op: "checkpoint",
                        reason: "a tensor-parallel rank without its tensor group".into(),
                    })?,
            ),
            false => None,
        };
        let arch = self.model.arch();
        let names: Vec<String> = self.model.params().into_iter().map(|(n, _)| n).collect();
        let n = self.params.len();
        let hs = self.holdings_of(&self.held, tp, k, self.shard_held);
        // (detached: a view of a parameter taken with gradients on would keep its gradient
        // accumulator, and with it the parameter's shape now, alive while the save is in
        // flight, and full sharding changes that shape when it gathers the parameter)
        let tensors: Vec<Tensor> = self.tensors().iter().map(|t| t.detach()).collect();
        let mut out = Vec::new();
        for (t, h) in hs.iter().enumerate() {
            // (replica 0 alone writes what is not sharded: the parameters under ZeRO-1; under
            // full sharding each member of shard group 0 writes its rows of them)
            if h.boxes.is_empty() || (t < n && me.dp_rank != 0 && !self.fully_sharded()) {
                continue;
            }
            let i = self.param_of(t);
            let full = &self.shapes[i];
            let local = &tensors[t];
            let split = match (grp.as_ref(), split_of(arch, &names[i])) {
                (Some(grp), split @ (Split::Cols | Split::HeadCols { .. })) => Some((grp, split)),
                (_, Split::Replicated) if k != 0 => continue,
                _ => None,
            };
            let Some((grp, split)) = split else {
                // the boxes hold whole rows: each as it is
                for b in &h.boxes {
                    let v = h.view(local, b).expect("a held box");
                    out.push(((t, b[0].start, b[0].end - b[0].start), v));
                }
                continue;
            };
            // every member's columns (one range, or one per Q, K, V block), in the order its
            // local tensor holds them, of the rows the group's members hold
            let held_rows = h.boxes[0][0].clone();
            let mut cols: Vec<(usize, Range<u64>)> = Vec::new();
            let shapes: Vec<Vec<i64>> = (0..tp)
                .map(|j| {
                    let shape: Vec<u64> = full.iter().map(|d| *d as u64).collect();
                    let ranges = held_ranges(arch, split, &shape, tp, j)
                        .map(|(_, r)| r)
                        .unwrap_or_default();
                    let mut s = full.clone();
                    s[0] = (held_rows.end - held_rows.start) as i64;
                    s[1] = ranges.iter().map(|r| (r.end - r.start) as i64).sum();
                    cols.extend(ranges.into_iter().map(|r| (j as usize, r)));
                    s
                })
                .collect();
            let all = grp.all_gather_shaped(&local.contiguous(), &shapes)?;
            let rows = ductile_strategies::split_range(held_rows.end - held_rows.start, tp, k);
            if rows.end > rows.start {
                let count = (rows.end - rows.start) as i64;
                let mut pieces: Vec<(u64, Tensor)> = Vec::new();
                let mut at = vec![0i64; tp as usize];
                for (j, r) in cols {
                    let w = (r.end - r.start) as i64;
                    pieces.push((
                        r.start,
                        all[j]
                            .narrow(0, rows.start as i64, count)
                            .narrow(1, at[j], w),
                    ));
                    at[j] += w;
                }
                pieces.sort_by_key(|(c, _)| *c);
                let pieces: Vec<Tensor> = pieces.into_iter().map(|(_, p)| p).collect();
                out.push((
                    (t, held_rows.start + rows.start, rows.end - rows.start),
                    Tensor::cat(&pieces, 1),
                ));
            }
        }
        Ok(out)
    }
}

impl Trainer {
    /// This rank's holdings when it holds tensor slices (`None`: whole tensors).
    pub(super) fn slice_holdings(&self) -> Option<Vec<Holding>> {
        (self.tp_held.0 > 1 || self.shard_held.0 > 1)
            .then(|| self.holdings_of(&self.held, self.tp_held.0, self.tp_held.1, self.shard_held))
    }

    /// What this rank writes in a checkpoint of a sharded generation: the first replica of each
    /// shard (shard group 0) writes its rows of every parameter and of its optimizer state,
    /// so every row is written once and the manifest stays layout-free.
    pub(super) fn shard_save_parts(&self, g: &Generation, rank: u32) -> Vec<RowChunk> {
        let Some(me) = g.members.iter().find(|m| m.rank == rank) else {
            return Vec::new();
        };
        let (s, place) = self.shard_held;
        if me.spare || me.dp_rank / s != 0 {
            return Vec::new();
        }
        let n = self.params.len();
        let mut out = Vec::new();
        for (t, local) in self.tensors().iter().map(|t| t.detach()).enumerate() {
            let i = self.param_of(t);
            let rows = ductile_strategies::split_range(self.shapes[i][0] as u64, s, place);
            if rows.is_empty() {
                continue;
            }
            let len = rows.end - rows.start;
            let v = if t < n && !self.fully_sharded() {
                local.narrow(0, rows.start as i64, len as i64)
            } else {
                // the optimizer state (and under full sharding the parameter) holds just
                // these rows
                local.shallow_clone()
            };
            out.push(((t, rows.start, len), v));
        }
        out
    }
}

/// The shard's rows of a tensor slice: rows `split_range(local rows, shard, place)` of the
/// local tensor `h` describes (its boxes laid along `h.dim`), as boxes of the logical tensor
/// in the same order, so the local tensor of the result is those rows of the slice's. Along
/// dim 0 the rows fall in the boxes they cross (a fused Q, K, V slice's blocks); along another
/// dim every box keeps those rows.
pub(super) fn shard_rows(h: &Holding, shard: u32, place: u32) -> Holding {
    let local = h.local_shape();
    let r = ductile_strategies::split_range(local[0].max(0) as u64, shard, place);
    let mut boxes = Vec::new();
    let mut at = 0u64;
    for b in &h.boxes {
        let mut nb = b.clone();
        if h.dim == 0 {
            let len = b[0].end - b[0].start;
            let (lo, hi) = (r.start.max(at), r.end.min(at + len));
            at += len;
            if lo >= hi {
                continue;
            }
            nb[0] = b[0].start + lo - (at - len)..b[0].start + hi - (at - len);
        } else {
            if r.is_empty() {
                continue;
            }
            nb[0] = b[0].start + r.start..b[0].start + r.end;
        }
        boxes.push(nb);
    }
    Holding { boxes, dim: h.dim }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_of_a_slice_is_its_rows_of_the_slice_s_boxes() {
        // a fused Q, K, V slice: three blocks of 4 rows along dim 0 (rows 4..8 of each 16)
        let qkv = Holding {
            boxes: (0..3u64)
                .map(|b| vec![b * 16 + 4..b * 16 + 8, 0..8])
                .collect(),
            dim: 0,
        };
        assert_eq!(qkv.local_shape(), vec![12, 8]);
        let second = shard_rows(&qkv, 2, 1);
        assert_eq!(
            second.boxes,
            vec![vec![22..24, 0..8], vec![36..40, 0..8]],
            "local rows 6..12: the last two rows of K's block and V's whole"
        );
        assert_eq!(second.local_shape(), vec![6, 8]);
        let first = shard_rows(&qkv, 2, 0);
        assert_eq!(first.boxes, vec![vec![4..8, 0..8], vec![20..22, 0..8]]);
        // a column slice (two blocks along dim 1): every block keeps the shard's rows
        let cols = Holding {
            boxes: vec![vec![0..10, 2..4], vec![0..10, 6..8]],
            dim: 1,
        };
        let third = shard_rows(&cols, 3, 2);
        assert_eq!(third.boxes, vec![vec![6..10, 2..4], vec![6..10, 6..8]]);
        assert_eq!(third.local_shape(), vec![4, 4]);
        // more places than rows: the first holds nothing (split_range's cut)
        let row = Holding {
            boxes: vec![vec![3..4]],
            dim: 0,
        };
        assert!(shard_rows(&row, 2, 0).boxes.is_empty());
        assert_eq!(shard_rows(&row, 2, 1).boxes, vec![vec![3..4]]);
    }
}

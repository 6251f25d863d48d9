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
use ductile_strategies::tensor::{held_ranges, held_regions, split_of, Split};
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
                Holding {
                    boxes: held_regions(arch, name, &shape, tp, k),
                    dim: split_of(arch, name).dim(),
                }
            })
            .collect();
        let per = self.opt.state.len() / self.params.len().max(1);
        let rows = |i: usize, h: &Holding| {
            if shard == 1 || h.boxes.is_empty() {
                return h.clone();
            }
            // sharding runs without tensor slices: one box, the shard's rows of the whole
            // tensor (not of each of a fused Q, K, V's blocks)
            let mut b: Vec<Range<u64>> = self.shapes[i].iter().map(|d| 0..*d as u64).collect();
            b[0] = ductile_strategies::split_range(b[0].end, shard, place);
            Holding {
                boxes: if b[0].is_empty() { Vec::new() } else { vec![b] },
                dim: 0,
            }
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
        let held: Vec<Part> = rows
            .iter()
            .enumerate()
            .filter(|(_, r)| at(r))
            .flat_map(|(rank, r)| {
                let shard = (r[4] as u32, r[5] as u32);
                let hs = self.holdings_of(&held_by(r), r[2] as u32, r[3] as u32, shard);
                holding_parts(rank as u32, &hs)
            })
            .collect();
        let elem = self.elem_sizes();
        let mine = new_of(me);
        if let Err(e) = redistribute::plan(&elem, &held, &[], &need) {
            if self.ckpt.is_none() {
                anyhow::bail!(
                    "generation {}: state at step {step} has no holder ({e}) and the job has no checkpoint: stopping rather than starting it from the seed",
                    g.number
                );
            }
            if comm.rank() == 0 {
                println!("state at step {step} has no holder ({e}): every rank restores its slices from the latest checkpoint");
            }
            let fresh = self
                .tensors()
                .iter()
                .zip(&mine)
                .map(|(t, h)| Tensor::zeros(h.local_shape().as_slice(), (t.kind(), t.device())))
                .collect();
            self.install(fresh);
            self.held = self.units_of(g, me);
            self.tp_held = (tp, me.tp_rank);
            self.shard_held = Self::shard_of(g, me);
            // (no pending step: the agreement took it before coming here)
            self.step = 0;
            match Self::tensor_group(comm, g, me) {
                Ok(grp) => self.model.set_tensor_group(grp),
                Err(e) => return Ok(Err(e)),
            }
            let r = self.restore(comm, &need)?;
            if r.is_ok() && self.step == 0 {
                anyhow::bail!(
                    "state at step {step} has no holder and the checkpoint URL holds no commit: stopping rather than starting it from the seed"
                );
            }
            return Ok(r);
        }
        let old: Vec<(Tensor, Holding)> = self
            .tensors()
            .into_iter()
            .map(|t| t.shallow_clone())
            .zip(self.holdings_of(&self.held, self.tp_held.0, self.tp_held.1, self.shard_held))
            .collect();
        let t0 = std::time::Instant::now();
        let (fresh, bytes) = match move_state(comm, step, &elem, &old, &mine, &held, &need) {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        drop(old);
        self.install(fresh);
        let group = match Self::tensor_group(comm, g, me) {
            Ok(grp) => grp,
            Err(e) => return Ok(Err(e)),
        };
        self.model.set_tensor_group(group);
        self.step = step;
        self.received = bytes as u64;
        self.held = self.units_of(g, me);
        self.tp_held = (tp, me.tp_rank);
        self.shard_held = Self::shard_of(g, me);
        tracing::info!(
            step,
            bytes,
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
            .map(|t| t.shallow_clone())
            .zip(self.holdings_of(&self.held, tp, k, self.shard_held))
            .collect();
        let (fresh, _) = move_state(
            comm,
            self.step,
            &self.elem_sizes(),
            &old,
            &mine,
            &held,
            &need,
        )?;
        drop(old);
        if me == 0 {
            self.install(fresh);
            self.model.set_tensor_group(None);
            self.held = vec![0..self.units()];
            self.tp_held = (1, 0);
            self.shard_held = (1, 0);
        }
        Ok(())
    }
}

/// A chunk of a checkpoint shard: (state tensor, first row, rows), with its data.
pub(super) type RowChunk = ((usize, u64, u64), Tensor);

impl Trainer {
    /// What this rank writes in a checkpoint of a tensor-parallel generation: the members of
    /// replica 0 write, each its row ranges of the logical tensors (the manifest stays
    /// layout-free). Row-split tensors (and each of Q, K, V) are the member's own rows; a
    /// replicated tensor is written by the group's first member; a column-split one is
    /// gathered over the group and each member writes its share of the rows, whole.
    pub(super) fn tp_save_parts(
        &self,
        g: &Generation,
        rank: u32,
    ) -> Result<Vec<RowChunk>, CommError> {
        let Some(me) = g.members.iter().find(|m| m.rank == rank) else {
            return Ok(Vec::new());
        };
        if me.spare || me.dp_rank != 0 {
            return Ok(Vec::new());
        }
        let (tp, k) = self.tp_held;
        let grp = self
            .model
            .tensor_shard()
            .map(|s| s.group.clone())
            .ok_or_else(|| CommError::Invalid {
                op: "checkpoint",
                reason: "a tensor-parallel rank without its tensor group".into(),
            })?;
        let arch = self.model.arch();
        let names: Vec<String> = self.model.params().into_iter().map(|(n, _)| n).collect();
        let hs = self.holdings_of(&self.held, tp, k, (1, 0));
        let tensors: Vec<Tensor> = self.tensors().iter().map(|t| t.shallow_clone()).collect();
        let mut out = Vec::new();
        for (t, h) in hs.iter().enumerate() {
            if h.boxes.is_empty() {
                continue;
            }
            let i = self.param_of(t);
            let full = &self.shapes[i];
            let local = &tensors[t];
            match split_of(arch, &names[i]) {
                Split::Replicated => {
                    if k == 0 {
                        out.push(((t, 0, full[0] as u64), local.shallow_clone()));
                    }
                }
                Split::Rows | Split::HeadRows { .. } => {
                    for b in &h.boxes {
                        let v = h.view(local, b).expect("a held box");
                        out.push(((t, b[0].start, b[0].end - b[0].start), v));
                    }
                }
                split @ (Split::Cols | Split::HeadCols { .. }) => {
                    // every member's columns (one range, or one per Q, K, V block), in the
                    // order its local tensor holds them
                    let mut cols: Vec<(usize, Range<u64>)> = Vec::new();
                    let shapes: Vec<Vec<i64>> = (0..tp)
                        .map(|j| {
                            let shape: Vec<u64> = full.iter().map(|d| *d as u64).collect();
                            let ranges = held_ranges(arch, split, &shape, tp, j)
                                .map(|(_, r)| r)
                                .unwrap_or_default();
                            let mut s = full.clone();
                            s[1] = ranges.iter().map(|r| (r.end - r.start) as i64).sum();
                            cols.extend(ranges.into_iter().map(|r| (j as usize, r)));
                            s
                        })
                        .collect();
                    let all = grp.all_gather_shaped(&local.contiguous(), &shapes)?;
                    let rows = ductile_strategies::split_range(full[0] as u64, tp, k);
                    if rows.end > rows.start {
                        let n = (rows.end - rows.start) as i64;
                        let mut pieces: Vec<(u64, Tensor)> = Vec::new();
                        let mut at = vec![0i64; tp as usize];
                        for (j, r) in cols {
                            let w = (r.end - r.start) as i64;
                            pieces.push((
                                r.start,
                                all[j].narrow(0, rows.start as i64, n).narrow(1, at[j], w),
                            ));
                            at[j] += w;
                        }
                        pieces.sort_by_key(|(c, _)| *c);
                        let pieces: Vec<Tensor> = pieces.into_iter().map(|(_, p)| p).collect();
                        out.push((
                            (t, rows.start, rows.end - rows.start),
                            Tensor::cat(&pieces, 1),
                        ));
                    }
                }
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
        for (t, local) in self.tensors().into_iter().enumerate() {
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

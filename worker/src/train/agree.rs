//! The state agreement every generation starts with, and what a rank holds.
//!
//! The agreement ([`Trainer::agree`]): every rank says its step, its pending step and the
//! units it holds; the resume step is the highest; each rank obtains the units of its new
//! stage that it does not hold at that step from a holder (spread over the holders), point to
//! point, as checksummed blobs of parameters and optimizer state, by the redistribution plan
//! ([`ductile_strategies::redistribute`]). A unit nobody holds comes from the latest
//! checkpoint, through the same plan (every rank restores its own stage from it, since the
//! survivors are ahead of it); with no checkpoint the worker stops rather than start those
//! layers from the seed. A rank one step behind with that step pending applies it (the
//! commit completed elsewhere, so every rank had it).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use ductile_cluster::records::{Generation, Member};
use ductile_comm::{CommError, Communicator};
use ductile_strategies::redistribute::{self, relative, whole, Move, Part, Region};
use tch::Tensor;

use super::reshard::{holds_unit, region_of, state_view, transfer, Received, TRANSFER_CHUNK_BYTES};
use super::Trainer;
use crate::model::{shard_rows, Model};

/// A reduced gradient waiting for its step's commit.
pub struct Pending {
    /// The step it applies (the rank's `step` when it was computed).
    pub step: u64,
    /// The generation that computed it (the ledger's line says so).
    pub generation: u64,
    pub params: Vec<usize>,
    pub grads: Vec<Tensor>,
}

/// Chunks of units a rank may hold: one per stage, two with `interleaved-1f1b`.
pub(super) const HELD_SLOTS: usize = 2;

/// The marker a build that gathers buddy rows ([`super::buddy`]) puts in its first free chunk
/// slot of the agreement row: an empty chunk to any reader (negative bounds saturate to 0).
const BUDDY_ROWS: f64 = -2.0;

/// Whether a row's chunk slots carry the [`BUDDY_ROWS`] marker.
fn speaks_buddy_rows(slots: &[f64]) -> bool {
    slots.chunks(2).any(|c| c == [BUDDY_ROWS; 2])
}

/// The ranks whose plan digest (at `at` in each agreement row) differs from rank `me`'s, in
/// words, if any: their collectives would sum other tensors than this rank's.
fn plan_mismatch(rows: &[Vec<f64>], at: usize, me: u32) -> Option<String> {
    let mine = rows.get(me as usize)?.get(at).copied();
    let hex = |d: Option<f64>| d.map_or("none".into(), |d| format!("{:012x}", d as u64));
    let odd: Vec<String> = rows
        .iter()
        .enumerate()
        .filter(|(_, r)| r.get(at).copied() != mine)
        .map(|(k, r)| format!("rank {k} ({})", hex(r.get(at).copied())))
        .collect();
    (!odd.is_empty()).then(|| {
        format!(
            "{} cut the model or its gradient buckets otherwise than rank {me} ({}): their all-reduces would add one rank's tensors to another's. Stopping rather than training on mismatched sums: do all nodes run the same ductile-worker build?",
            odd.join(", "),
            hex(mine)
        )
    })
}

impl Trainer {
    /// The chunks of units a member holds in generation `g` (every unit without stages;
    /// none for a spare).
    pub(super) fn units_of(&self, g: &Generation, m: &Member) -> Vec<Range<usize>> {
        if m.spare {
            return Vec::new();
        }
        g.stage_chunks(m.pp_stage, self.units() as u32)
            .into_iter()
            .map(|r| r.start as usize..r.end as usize)
            .collect()
    }

    /// Whether a rank holding the units in `chunks` holds parameter `i`: its own unit's, or
    /// a copy for another unit that uses it (a tied head).
    pub(super) fn holds_param(&self, chunks: &[Range<usize>], i: usize) -> bool {
        holds_unit(chunks, self.param_unit[i])
            || self.param_also[i].is_some_and(|u| holds_unit(chunks, u))
    }

    /// Parameter indices of the units in `chunks`, in index order.
    pub(super) fn params_in(&self, chunks: &[Range<usize>]) -> Vec<usize> {
        (0..self.params.len())
            .filter(|i| self.holds_param(chunks, *i))
            .collect()
    }

    /// Parameters (with their gradients) and optimizer state of the units in `keep` keep
    /// their storage; every other unit's is released (an empty tensor of the same kind), so
    /// a stage holds its own layers only.
    pub(super) fn hold_only(&mut self, keep: &[Range<usize>]) {
        let release: Vec<bool> = (0..self.params.len())
            .map(|i| !self.holds_param(keep, i))
            .collect();
        self.resize_params(&release, false);
    }

    /// Start the job over from step 0 with the state a first start makes, for the units
    /// `mine` (allocated): the seed's parameters (or the model directory's) and zero optimizer
    /// state. Every rank makes the same seed, so no rank sends any of it.
    fn start_over_whole(
        &mut self,
        comm: &Arc<dyn Communicator>,
        need: &[Part],
        mine: &[Range<usize>],
    ) -> anyhow::Result<Result<(), CommError>> {
        self.step = 0;
        let seed = if self.pretrained() {
            None
        } else {
            Some(self.seed_params()?)
        };
        tch::no_grad(|| {
            for i in (0..self.params.len()).filter(|i| self.holds_param(mine, *i)) {
                if let Some(seed) = &seed {
                    let mut p = self.params[i].shallow_clone();
                    p.set_data(&seed[i].to_device(p.device()));
                }
                let mut g = self.params[i].grad();
                if g.defined() {
                    let _ = g.zero_();
                }
                for mut t in self.opt.state_of(i).into_iter().map(|t| t.shallow_clone()) {
                    let _ = t.zero_();
                }
            }
        });
        match seed {
            Some(_) => Ok(Ok(())),
            None => self.load_pretrained(comm, need),
        }
    }

    /// Give the units `want` their storage back (zeros) where it was released, before they
    /// are received or restored.
    pub(super) fn allocate(&mut self, want: &[Range<usize>]) {
        let grow: Vec<bool> = (0..self.params.len())
            .map(|i| self.holds_param(want, i))
            .collect();
        self.resize_params(&grow, true);
    }

    /// Release (or, with `grow`, give back) the storage of the parameters `which` marks.
    fn resize_params(&mut self, which: &[bool], grow: bool) {
        for (i, _) in which.iter().enumerate().filter(|(_, w)| **w) {
            let p = self.params[i].shallow_clone();
            let full = self.shapes[i].iter().product::<i64>() as usize;
            if (p.numel() == full) == grow {
                continue;
            }
            let mut ts = vec![p.shallow_clone(), p.grad()];
            ts.extend(self.opt.state_of(i).into_iter().map(|t| t.shallow_clone()));
            for mut t in ts.into_iter().filter(|t| t.defined()) {
                let new = if grow {
                    Tensor::zeros(self.shapes[i].as_slice(), (t.kind(), t.device()))
                } else {
                    Tensor::empty([0], (t.kind(), t.device()))
                };
                tch::no_grad(|| t.set_data(&new));
            }
        }
    }

    /// A new process of a sharded job: the seed's optimizer state (zeros), allocated as its
    /// shard of `g` (the whole of it when `g` is not sharded), which it then reports holding.
    /// With full sharding the seed's parameters too: cut to the shard's rows, unless the
    /// model was built cut to them ([`Trainer::new`]); built cut to other rows (the world
    /// changed before this first agreement), the seed is made again, cut to these.
    fn allocate_shard(&mut self, g: &Generation, rank: u32) -> anyhow::Result<()> {
        let shard = g
            .members
            .iter()
            .find(|m| m.rank == rank)
            .map(|m| Self::shard_of(g, m))
            .unwrap_or((1, 0));
        let n = self.params.len();
        let hs = self.holdings_of(&self.held.clone(), 1, 0, shard);
        tch::no_grad(|| {
            for (j, mut t) in self.opt.state.iter().map(|t| t.shallow_clone()).enumerate() {
                let shape = hs[n + j].local_shape();
                t.set_data(&Tensor::zeros(shape.as_slice(), (t.kind(), t.device())));
            }
        });
        let seed = self.model.seed_rows();
        if self.fully_sharded() && seed != shard {
            // (the seed is the same on every rank)
            let mine: Vec<Tensor> = if seed == (1, 0) {
                self.params.iter().map(|p| shard_rows(p, shard)).collect()
            } else {
                tracing::info!(
                    built = ?seed,
                    shard = ?shard,
                    "the seed was cut to another shard place: making it again"
                );
                Model::with_rows(&self.spec, &self.data, self.dev, shard)?
                    .params()
                    .into_iter()
                    .map(|(_, t)| t)
                    .collect()
            };
            tch::no_grad(|| {
                for (mut p, t) in self.params.iter().map(|t| t.shallow_clone()).zip(&mine) {
                    p.set_data(t);
                }
            });
        }
        self.shard_held = shard;
        self.opt_unallocated = false;
        Ok(())
    }

    /// Bytes of parameters and optimizer state this rank holds.
    pub(super) fn state_bytes(&self) -> u64 {
        self.params
            .iter()
            .chain(self.opt.state.iter())
            .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum()
    }

    /// The parameter state tensor `t` belongs to (the parameters, then the optimizer's states,
    /// `per` of them per parameter in parameter order).
    pub(super) fn param_of(&self, t: usize) -> usize {
        let p = self.params.len();
        let per = (self.opt.state.len() / p.max(1)).max(1);
        if t < p {
            t
        } else {
            (t - p) / per
        }
    }

    /// Rank `rank`'s parts of the state when it holds the units in `chunks`: whole tensors
    /// (tensor parallelism would slice them).
    pub(super) fn parts_of(&self, rank: u32, chunks: &[Range<usize>]) -> Vec<Part> {
        (0..self.params.len() + self.opt.state.len())
            .filter(|t| self.holds_param(chunks, self.param_of(*t)))
            .map(|t| {
                let shape: Vec<u64> = self.shapes[self.param_of(t)]
                    .iter()
                    .map(|d| *d as u64)
                    .collect();
                Part {
                    rank,
                    tensor: t,
                    region: whole(&shape),
                }
            })
            .collect()
    }

    /// The most elements (state moves as f32) one pair of ranks moves in one round of a state
    /// transfer: `training.transfer_chunk_kib`, else [`TRANSFER_CHUNK_BYTES`].
    pub(super) fn transfer_chunk(&self) -> u64 {
        let bytes = self
            .spec
            .transfer_chunk_kib
            .map_or(TRANSFER_CHUNK_BYTES, |k| u64::from(k) << 10);
        (bytes / 4).max(1)
    }

    /// Element sizes of the state tensors, for [`redistribute::plan`].
    pub(super) fn elem_sizes(&self) -> Vec<u64> {
        self.tensors()
            .iter()
            .map(|t| t.kind().elt_size_in_bytes() as u64)
            .collect()
    }

    /// Carry out the point-to-point moves of a redistribution plan over this rank's state
    /// ([`super::reshard::transfer`]): it serves from its own tensors, or from a checkpoint
    /// chunk it read (`read`), and receives into its tensors (slices mapped by its holdings).
    pub(super) fn exchange(
        &mut self,
        comm: &Arc<dyn Communicator>,
        moves: &[Move],
        step: u64,
        read: &BTreeMap<usize, (Region, Tensor)>,
    ) -> Result<Received, CommError> {
        let state: Vec<Tensor> = self
            .tensors()
            .into_iter()
            .map(|t| t.shallow_clone())
            .collect();
        // a rank holding tensor slices maps logical regions into its local tensors
        let slices = self.slice_holdings();
        let view = |t: usize, r: &Region| state_view(&state, slices.as_deref(), t, r);
        transfer(
            comm,
            moves,
            step,
            self.transfer_chunk(),
            |m| {
                Ok(match m.via {
                    None => view(m.tensor, &m.region),
                    Some(c) => {
                        let (at, t) = &read[&c];
                        region_of(t, &relative(&m.region, at))
                    }
                })
            },
            |m| Ok(view(m.tensor, &m.region)),
        )
    }

    /// Agree on the state at the start of a generation (see the module's comment), then make
    /// the generation's buddy copies where the job keeps them ([`super::buddy`]). The outer
    /// error stops the worker (no holder and no checkpoint); the inner one re-forms.
    pub(super) fn agree(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        pending: &mut Option<Pending>,
    ) -> anyhow::Result<Result<(), CommError>> {
        let r = self.agree_state(comm, g, pending)?;
        if r.is_err() {
            return Ok(r);
        }
        Ok(self.keep_buddy(comm, g))
    }

    /// [`Trainer::agree`]'s agreement on the state.
    fn agree_state(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        pending: &mut Option<Pending>,
    ) -> anyhow::Result<Result<(), CommError>> {
        self.received = 0;
        if self.opt_unallocated {
            self.allocate_shard(g, comm.rank())?;
        }
        let pend = pending.as_ref().map(|p| p.step as f64).unwrap_or(-1.0);
        // [step, pending step, tensor group size and place of what it holds, shard group size
        // and place, then HELD_SLOTS (start, end) pairs of the chunks it holds, then the
        // digest of what its collectives sum (Trainer::plan_digest)]
        let mut row = vec![
            self.step as f64,
            pend,
            self.tp_held.0 as f64,
            self.tp_held.1 as f64,
            self.shard_held.0 as f64,
            self.shard_held.1 as f64,
        ];
        for k in 0..HELD_SLOTS {
            match self.held.get(k) {
                Some(r) => row.extend([r.start as f64, r.end as f64]),
                // the first free slot says this build gathers buddy rows (an older build reads
                // it as an empty chunk, as it reads a free slot)
                None if k == self.held.len() => row.extend([BUDDY_ROWS; 2]),
                None => row.extend([0.0; 2]),
            }
        }
        assert!(
            self.held.len() <= HELD_SLOTS,
            "a rank holds at most {HELD_SLOTS} chunks"
        );
        let digest_at = row.len();
        row.push(self.plan_digest());
        let rows = match super::gather_rows(comm.as_ref(), &row) {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        if let Some(e) = plan_mismatch(&rows, digest_at, comm.rank()) {
            anyhow::bail!("generation {}: {e}", g.number);
        }
        // buddy copies only where every member's build keeps them (a rolling upgrade mixes
        // builds: the world then moves state as before and makes no copies)
        self.buddy_peers = rows.iter().all(|r| speaks_buddy_rows(&r[6..digest_at]));
        let held_by = |r: &[f64]| -> Vec<Range<usize>> {
            r[6..digest_at]
                .chunks(2)
                .map(|c| c[0] as usize..c[1] as usize)
                .collect()
        };
        let max = rows.iter().map(|r| r[0]).fold(0.0, f64::max);
        // a rank one step behind with that step's reduced gradient pending: the commit went
        // through elsewhere, so it applies it
        let eff = |r: &[f64]| {
            if r[1] >= 0.0 && r[1] == r[0] && r[0] + 1.0 == max {
                max
            } else {
                r[0]
            }
        };
        if let Some(p) = pending.take() {
            if (p.step + 1) as f64 == max {
                self.apply(&p.params, &p.grads, p.step, p.generation, comm.rank());
                tracing::info!(
                    step = self.step,
                    "applied the pending step its commit completed elsewhere"
                );
            }
        }
        let sliced = |r: &Vec<f64>| r[2] > 1.0 || r[4] > 1.0;
        if g.layout.tensor_parallel > 1 || g.layout.dp_shard > 1 || rows.iter().any(sliced) {
            return self.agree_tp(comm, g, &rows, &held_by, &|r| eff(r) == max, max);
        }
        let units = self.units();
        // what this rank holds once the generation trains: its stage's units (the others'
        // copies go stale from the first step on, so they are never offered as holdings)
        let mine = {
            let me = g.members.iter().find(|m| m.rank == comm.rank()).unwrap();
            self.units_of(g, me)
        };
        // what every member needs once the generation trains: its stage's state
        let need: Vec<Part> = g
            .members
            .iter()
            .flat_map(|m| self.parts_of(m.rank, &self.units_of(g, m)))
            .collect();
        if max == 0.0 {
            // a cold start: everyone holds the seed's state (or restores the latest checkpoint)
            // (nobody released any unit yet: a rank releases the units it does not hold
            // after its first step, when their copies go stale)
            if self.ckpt.is_none() && g.resume_step > 0 && self.spec.strategy.pipelined() {
                // every rank is new, but this run had trained: its state went with the ranks
                // that held it, and without a checkpoint the seed is all that is left. A fault
                // report, not an exit: the leader re-forms `fault_retries` times, then fails
                // the job with this reason in its status
                return Ok(Err(CommError::Invalid {
                    op: "agree",
                    reason: format!(
                        "the job had reached step {}, but every rank starts at step 0 and it has no [checkpoint]: stopping rather than starting from the seed",
                        g.resume_step
                    ),
                }));
            }
            let r = self.cold_start(comm, &need)?;
            self.held = mine;
            return Ok(r);
        }
        let step = max as u64;
        let holds = |r: usize, u: usize| eff(&rows[r]) == max && holds_unit(&held_by(&rows[r]), u);
        let missing: Vec<usize> = (0..units)
            .filter(|u| !(0..rows.len()).any(|r| holds(r, *u)))
            .collect();
        if !missing.is_empty() {
            let names: Vec<String> = missing
                .iter()
                .map(|u| self.unit_names[*u].clone())
                .collect();
            if self.ckpt.is_none() {
                anyhow::bail!(
                    "layers {} have no holder at step {step} in generation {} and the job has no checkpoint: stopping rather than starting them from the seed",
                    names.join(", "),
                    g.number
                );
            }
            if comm.rank() == 0 {
                println!(
                    "layers {} have no holder at step {step}: every rank restores its layers from the latest checkpoint",
                    names.join(", ")
                );
            }
            self.step = 0;
            *pending = None;
            self.allocate(&mine);
            let mut r = self.restore(comm, &need)?;
            if r.is_ok() && self.step == 0 {
                // no commit yet: the state a first start makes, in this generation
                if comm.rank() == 0 {
                    println!("the checkpoint URL holds no commit yet: the job starts over from the seed at step 0 (the {step} steps it had taken are lost)");
                }
                r = self.start_over_whole(comm, &need, &mine)?;
            }
            self.hold_only(&mine);
            self.held = mine;
            return Ok(r);
        }
        // who gets which tensor from whom: the redistribution plan over the up-to-date
        // holders, the same on every rank
        let held: Vec<Part> = (0..rows.len())
            .filter(|r| eff(&rows[*r]) == max)
            .flat_map(|r| self.parts_of(r as u32, &held_by(&rows[r])))
            .collect();
        let plan = redistribute::plan(&self.elem_sizes(), &held, &[], &need)
            .map_err(|e| anyhow::anyhow!("state transfer plan at step {step}: {e}"))?;
        let t0 = std::time::Instant::now();
        self.allocate(&mine);
        let got = match self.exchange(comm, &plan.moves, step, &BTreeMap::new()) {
            Ok(b) => b,
            Err(e) => return Ok(Err(e)),
        };
        self.step = step;
        self.received = got.bytes as u64;
        self.hold_only(&mine);
        self.held = mine;
        if got.bytes > 0 {
            tracing::info!(
                step,
                bytes = got.bytes,
                rounds = got.rounds,
                tensors = plan.moves.iter().filter(|m| m.to == comm.rank()).count(),
                ms = t0.elapsed().as_millis() as u64,
                "received layers"
            );
        }
        Ok(Ok(()))
    }

    /// Rank 0 gathers every unit it does not hold from stage `s` of replica 0 (rank s), for
    /// the final weights hash.
    pub(super) fn gather_to_rank0(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> Result<(), CommError> {
        if self.tp_held.0 > 1 || self.shard_held.0 > 1 {
            return self.gather_tp_to_rank0(comm, g);
        }
        let held: Vec<Part> = g
            .members
            .iter()
            .filter(|m| !m.spare && m.dp_rank == 0)
            .flat_map(|m| self.parts_of(m.rank, &self.units_of(g, m)))
            .collect();
        let need = self.parts_of(0, &[0..self.units()]);
        let plan = redistribute::plan(&self.elem_sizes(), &held, &[], &need).map_err(|e| {
            CommError::Invalid {
                op: "gather",
                reason: e.to_string(),
            }
        })?;
        let step = self.step;
        if comm.rank() == 0 {
            self.allocate(&[0..self.units()]);
        }
        self.exchange(comm, &plan.moves, step, &BTreeMap::new())
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::{plan_mismatch, speaks_buddy_rows, BUDDY_ROWS};

    /// The marker rides in a free chunk slot, which every build reads as an empty chunk.
    #[test]
    fn the_buddy_marker_is_an_empty_chunk_to_every_reader() {
        let new = [0.0, 5.0, BUDDY_ROWS, BUDDY_ROWS];
        let old = [0.0, 5.0, 0.0, 0.0];
        assert!(speaks_buddy_rows(&new) && !speaks_buddy_rows(&old));
        // (an older build's reading: `c[0] as usize..c[1] as usize`)
        let chunk = BUDDY_ROWS as usize..BUDDY_ROWS as usize;
        assert!(chunk.is_empty() && chunk == (0..0));
    }

    #[test]
    fn a_rank_whose_plan_digest_differs_is_named() {
        let rows = vec![vec![3.0, 7.0], vec![3.0, 7.0], vec![3.0, 9.0]];
        assert_eq!(
            plan_mismatch(&rows, 1, 0)
                .as_deref()
                .map(|s| s.starts_with("rank 2 (000000000009) cut the model")),
            Some(true)
        );
        // rank 2 sees both others differ from its own
        let e = plan_mismatch(&rows, 1, 2).unwrap();
        assert!(
            e.starts_with("rank 0 (000000000007), rank 1 (000000000007)"),
            "{e}"
        );
        assert!(plan_mismatch(&rows[..2], 1, 1).is_none());
        // a row without the digest (an older build's) differs too
        let short = vec![vec![3.0, 7.0], vec![3.0]];
        assert!(plan_mismatch(&short, 1, 0)
            .unwrap()
            .contains("rank 1 (none)"));
    }
}

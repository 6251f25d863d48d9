//! Full sharding (`training.sharding = "full"`: ZeRO-3, FSDP): each rank of a shard group
//! holds its rows of every parameter, of the parameter's optimizer state, and of the summed
//! gradient ([`ductile_strategies::split_range`] of dim 0, the same boxes ZeRO-1 cuts the state
//! into, so the agreement, the checkpoints and the cold start move and read them as they do
//! any other box). The whole model never exists on a rank between steps.
//!
//! The step runs the model unit by unit (the pipeline's units: the embeddings, each block, the
//! head): forward, each unit's parameters are all-gathered over the shard group, the unit runs
//! without gradients on every micro-batch of the rank, keeping only its input, and the
//! parameters are released; backward, in reverse, each unit is gathered again, run again with
//! gradients from its kept input and its output's gradient, and its parameters' gradients are
//! reduced (reduce-scattered over the shard group; in deterministic mode folded over the
//! logical shards in order, as the unsharded step's all-reduce folds them) while the unit
//! before computes; only the unit being computed and the one being reduced are whole. The
//! gathers and the reductions run in one order on the step's [`CommQueue`] (a thread of
//! their own on the CPU), each overlapping the computation, as FSDP's prefetch and its
//! reduce-scatter stream do. The optimizer then steps the rank's rows alone. Every unit is recomputed
//! (activation checkpointing at unit granularity is what keeps one unit's parameters whole at a
//! time). A parameter two units use (a head tied to the embedding) is reduced once its last
//! use in the backward is done, its contributions summed in the order the unsharded backward
//! sums them.
//!
//! With `reshard_after_forward = false` (FSDP2's option) a unit's gathered parameters stay
//! whole until its backward is done instead: each unit is gathered once per step, runs once
//! with gradients (its output's graph and its input, a leaf, kept), and its backward starts
//! from that graph; only the last unit is gathered in the backward, with its loss. The
//! parameters are whole through the step (ZeRO-2's peak, plus every unit's activations) for
//! one gather less per unit and no forward run twice; with activation checkpointing the
//! blocks still run again in their backward, their parameters still whole.
//!
//! Gradients of a unit are taken with `torch.autograd.grad` (`run_backward`), so no `.grad`
//! of the whole model is ever allocated; each is the same kernel's result as the unsharded
//! backward's, and with the same folds the bits equal the unsharded data-parallel run's.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use ductile_cluster::records::{Generation, Sharding};
use ductile_comm::{CommError, Communicator, Group, ReduceOp};
use ductile_strategies::mesh::Mesh;
use ductile_strategies::{micro_batches, split_batch, split_range};
use tch::{Device, Kind, Tensor};

use super::overlap::{CommQueue, Ticket};
use super::{ledger_line, Trainer};
use crate::model::Tape;

/// The generation whose sharded step was last told in the log (once per generation).
static TOLD: AtomicU64 = AtomicU64::new(u64::MAX);

/// A unit's parameters being gathered on the step's [`CommQueue`] (the next unit's while this
/// one computes): every place's rows, padded.
pub(super) type Gathering = Option<Ticket<Vec<Tensor>>>;

/// How a unit's reduced gradients come back ([`Trainer::submit_reduce`]).
enum How {
    /// Folded over the logical shards in order (deterministic mode): whole.
    Ordered,
    /// Reduce-scattered over the shard group (HSDP: then all-reduced over the members at the
    /// same place of the other shard groups): this place's rows, packed.
    Scattered,
}

/// A unit's gradients being reduced on the step's [`CommQueue`] while the unit before computes.
struct Reducing {
    ids: Vec<usize>,
    how: How,
    ticket: Ticket<Tensor>,
}

/// What a rank computes in a step: its logical shards (deterministic mode) or its share,
/// each as micro-batches of sample indices.
pub(super) struct Part {
    /// The logical shard's index (deterministic mode; 0 otherwise).
    pub(super) k: u64,
    pub(super) micro: Vec<(Tensor, Tensor)>,
}

/// How a sharded step runs, as [`Trainer::tell_step`] says it.
pub(super) struct StepShape {
    /// The gathered parameters kept from a unit's forward for its backward.
    pub keep: bool,
    /// The shard group is a part of the replicas (HSDP): the shard group's rows of the
    /// gradients are then all-reduced over the replicas.
    pub grouped: bool,
    /// The step's collectives run on a thread of their own ([`CommQueue::for_step`]).
    pub threaded: bool,
}

impl Trainer {
    /// Whether the job shards its parameters too (`sharding = "full"`).
    pub(crate) fn fully_sharded(&self) -> bool {
        self.spec.sharding == Sharding::Full
    }

    /// Whether this rank holds rows of the parameters now (a full-sharding job whose shard
    /// group has more than one member).
    pub(crate) fn holds_param_rows(&self) -> bool {
        self.fully_sharded() && self.shard_held.0 > 1
    }

    /// Whether this rank's step runs unit by unit and keeps its rows of the summed gradient
    /// only: `sharding = "full"` at any shard group, one member included (as FSDP2 at a mesh of
    /// one: each unit is all-gathered and its gradients reduce-scattered over that one rank, so
    /// a world of one, on NCCL too, runs the path every size runs), `"gradients"` at a shard
    /// group of more than one. A model in logical tensor slices (a staged or tensor-parallel
    /// job's `tensor_slices`, at a layout of data parallelism alone) steps as ZeRO-1 does
    /// there: the same bits.
    pub(crate) fn reduces_per_unit(&self) -> bool {
        let by_unit = match self.spec.sharding {
            Sharding::Full => true,
            Sharding::Gradients => self.shard_held.0 > 1,
            _ => false,
        };
        by_unit && !self.model.sliced()
    }

    /// The shard group of this rank in `g` (consecutive data-parallel ranks of its stage and
    /// tensor place, [`Mesh::shard_group`]; without stages or tensor groups a data-parallel
    /// rank is its rank): `None` when it is the whole world.
    pub(super) fn shard_group(
        &self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> Result<Option<Group>, CommError> {
        let s = self.shard_held.0;
        if s == comm.world() {
            return Ok(None);
        }
        let mesh = Mesh::new(&g.layout);
        let ranks = match mesh.coords(comm.rank()) {
            Some(c) => mesh.shard_group(c, s),
            None => {
                return Err(CommError::Invalid {
                    op: "shard group",
                    reason: format!("rank {} is a spare of generation {}", comm.rank(), g.number),
                })
            }
        };
        Group::new(comm.clone(), ranks).map(Some)
    }

    /// HSDP's other axis: the members of the other shard groups at this rank's place (of its
    /// stage and tensor place, in replica order), which hold the same rows: `None` when the
    /// shard group is the world (nothing to sum across).
    pub(super) fn replica_group(
        &self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> Result<Option<Group>, CommError> {
        let mesh = Mesh::new(&g.layout);
        let Some(c) = mesh.coords(comm.rank()) else {
            return Err(CommError::Invalid {
                op: "replica group",
                reason: format!("rank {} is a spare of generation {}", comm.rank(), g.number),
            });
        };
        let peers = mesh.shard_peers(c, self.shard_held.0);
        match peers.len() > 1 {
            true => Group::new(comm.clone(), peers).map(Some),
            false => Ok(None),
        }
    }

    /// Rows of parameter `i` (of its shape when whole here: its tensor slice's under tensor
    /// groups) that place `k` of the shard group holds: (first, count).
    pub(super) fn rows(&self, i: usize, k: u32) -> (i64, i64) {
        let r = split_range(self.gathered[i][0] as u64, self.shard_held.0, k);
        (r.start as i64, (r.end - r.start) as i64)
    }

    pub(super) fn row_numel(&self, i: usize) -> i64 {
        self.gathered[i][1..].iter().product()
    }

    /// The parameters unit `u` uses (its own, and a tied one it shares).
    pub(super) fn unit_params(&self, u: usize) -> Vec<usize> {
        (0..self.params.len())
            .filter(|i| self.param_unit[*i] == u || self.param_also[*i] == Some(u))
            .collect()
    }

    /// The unit whose backward is the last to use parameter `i` (the lowest that uses it).
    pub(super) fn done_at(&self, i: usize) -> usize {
        self.param_also[i].map_or(self.param_unit[i], |a| a.min(self.param_unit[i]))
    }

    /// All-gather parameters `idx` whole over the shard group: each parameter's variable is
    /// set to the whole tensor; returns what each held before (its rows), for
    /// [`Trainer::release`].
    pub(super) fn gather_params(
        &mut self,
        comm: &Arc<dyn Communicator>,
        grp: &Option<Group>,
        idx: &[usize],
    ) -> Result<Vec<(usize, Tensor)>, CommError> {
        let pending = self.start_gather(&CommQueue::inline(), comm, grp, idx);
        self.finish_gather(idx, pending)
    }

    /// Submit the all-gather of parameters `idx` (each place's rows, padded to the longest
    /// place's) to `queue`: on the CPU it runs on the queue's thread (the next unit's gather
    /// while this one computes), in the order of everything the step submits, so the
    /// communicator's calls keep one order on every rank. Nothing for ZeRO-2 (whole
    /// parameters) or no parameters.
    pub(super) fn start_gather(
        &self,
        queue: &CommQueue,
        comm: &Arc<dyn Communicator>,
        grp: &Option<Group>,
        idx: &[usize],
    ) -> Gathering {
        if idx.is_empty() || !self.fully_sharded() {
            return None;
        }
        let s = self.shard_held.0;
        let place = self.shard_held.1;
        let size = |k: u32| -> i64 {
            idx.iter()
                .map(|i| self.rows(*i, k).1 * self.row_numel(*i))
                .sum()
        };
        let longest = (0..s).map(size).max().unwrap_or(0);
        let kind = self.params[idx[0]].kind();
        let mut mine: Vec<Tensor> = idx
            .iter()
            .filter(|i| self.rows(**i, place).1 > 0)
            .map(|i| self.own_rows(*i).reshape([-1]))
            .collect();
        let pad = longest - size(place);
        if pad > 0 || mine.is_empty() {
            mine.push(Tensor::zeros([pad], (kind, self.dev)));
        }
        let mine = Tensor::cat(&mine, 0);
        let (comm, grp) = (comm.clone(), grp.clone());
        let gather = move || -> Result<Vec<Tensor>, CommError> {
            match &grp {
                None => {
                    let t = comm.all_gather(&comm.place(&mine))?.into_tensor();
                    Ok((0..s as i64).map(|k| t.get(k)).collect())
                }
                Some(grp) => grp.all_gather(&mine),
            }
        };
        Some(queue.submit("all_gather", gather))
    }

    /// This rank's rows of parameter `i`, whether the parameter holds them alone or is
    /// gathered whole at the moment (a unit's gather started before the unit before it,
    /// which shares the parameter, is released: its rows are the same bits either way).
    fn own_rows(&self, i: usize) -> Tensor {
        let t = self.params[i].detach();
        let (at, n) = self.rows(i, self.shard_held.1);
        match t.size().first() {
            Some(&len) if len != n => t.narrow(0, at, n),
            _ => t,
        }
    }

    /// Wait for a gather [`Trainer::start_gather`] started and set parameters `idx` to the
    /// whole tensors; returns their rows, for [`Trainer::release`].
    pub(super) fn finish_gather(
        &mut self,
        idx: &[usize],
        pending: Gathering,
    ) -> Result<Vec<(usize, Tensor)>, CommError> {
        let Some(pending) = pending else {
            return Ok(Vec::new());
        };
        let all = pending.wait()?;
        let s = self.shard_held.0;
        let kind = self.params[idx[0]].kind();
        let mut off = vec![0i64; s as usize];
        let mut rests = Vec::with_capacity(idx.len());
        for &i in idx {
            let whole = Tensor::empty(self.gathered[i].as_slice(), (kind, self.dev));
            for (k, flat) in all.iter().enumerate() {
                let (at, n) = self.rows(i, k as u32);
                if n == 0 {
                    continue;
                }
                let len = n * self.row_numel(i);
                let shape: Vec<i64> = std::iter::once(n)
                    .chain(self.gathered[i][1..].iter().copied())
                    .collect();
                let src = flat.narrow(0, off[k], len).view(shape.as_slice());
                tch::no_grad(|| whole.narrow(0, at, n).copy_(&src));
                off[k] += len;
            }
            let rest = self.params[i].detach();
            self.params[i].set_data(&whole);
            rests.push((i, rest));
        }
        Ok(rests)
    }

    /// Put back the rows [`Trainer::gather_params`] took out: the whole tensors are freed.
    pub(super) fn release(&mut self, rests: Vec<(usize, Tensor)>) {
        for (i, rest) in rests {
            self.params[i].set_data(&rest);
        }
    }

    /// This rank's samples of step `self.step`: its logical shards in deterministic mode, else
    /// its share, in micro-batches, on the device; the ledger gets one line per part.
    pub(super) fn step_parts(
        &mut self,
        comm: &dyn Communicator,
        g: &Generation,
        rank: u32,
    ) -> Vec<Part> {
        self.step_parts_of(g, (comm.world(), rank), rank, true)
    }

    /// [`Trainer::step_parts`] of replica `d` of `n` (a tensor group's members compute the
    /// same samples: `log` says whether this one writes the ledger's lines).
    pub(super) fn step_parts_of(
        &mut self,
        g: &Generation,
        (n, d): (u32, u32),
        rank: u32,
        log: bool,
    ) -> Vec<Part> {
        let b = self.spec.global_batch as u64;
        let shares: Vec<(u64, ductile_strategies::Share)> = if self.spec.deterministic {
            let shards = self.logical_shards();
            split_range(shards.len() as u64, n, d)
                .map(|k| (k, shards[k as usize]))
                .collect()
        } else {
            vec![(0, split_batch(b, n)[d as usize])]
        };
        let ahead: Vec<(u64, u64)> = shares.iter().map(|(_, s)| (s.start, s.len)).collect();
        self.read_ahead(&ahead);
        let base = self.step * b;
        let mut parts = Vec::with_capacity(shares.len());
        for (k, share) in shares {
            let micro = self
                .spec
                .micro_batch
                .map(|m| m as u64)
                .unwrap_or(share.len.max(1));
            let mut used = Vec::with_capacity(share.len as usize);
            let mut mbs = Vec::new();
            for (start, len) in micro_batches(share, micro) {
                let idx: Vec<u64> = (start..start + len)
                    .map(|p| self.order.sample(base + p))
                    .collect();
                used.extend_from_slice(&idx);
                let (x, y) = self.data.batch(&idx);
                mbs.push((x.to_device(self.dev), y.to_device(self.dev)));
            }
            if log {
                ledger_line(
                    &mut self.ledger,
                    serde_json::json!({"g": g.number, "s": self.step, "r": rank, "idx": used}),
                );
            }
            parts.push(Part { k, micro: mbs });
        }
        parts
    }

    /// Whether a unit's gathered parameters stay whole until its backward is done
    /// (`reshard_after_forward = false`): gathered once per step, each unit run once with
    /// its activations kept.
    fn keeps_gathered(&self) -> bool {
        self.spec.reshard_after_forward == Some(false)
    }

    /// Parameters of unit `u` not already whole (`whole`: kept from an earlier unit's gather).
    fn to_gather(&self, u: usize, whole: &BTreeSet<usize>) -> Vec<usize> {
        self.unit_params(u)
            .into_iter()
            .filter(|i| !whole.contains(i))
            .collect()
    }

    /// The data-parallel step of a fully sharded rank (see the module's comment); returns the
    /// step's mean loss. Parameters kept whole for their backward
    /// ([`Trainer::keeps_gathered`]) get their rows back whatever happens.
    pub(super) fn full_step(
        &mut self,
        arc: &Arc<dyn Communicator>,
        g: &Generation,
        rank: u32,
        t0: Instant,
    ) -> Result<f64, CommError> {
        let mut kept = BTreeMap::new();
        let r = self.full_step_keeping(arc, g, rank, t0, &mut kept);
        if !kept.is_empty() {
            // (a collective failed mid-step)
            self.release(std::mem::take(&mut kept).into_iter().collect());
        }
        r
    }

    /// Say once per generation, in the log, how the sharded step gathers and reduces.
    pub(super) fn tell_step(&self, g: &Generation, units: usize, how: StepShape) {
        let StepShape {
            keep,
            grouped,
            threaded,
        } = how;
        if TOLD.swap(g.number, Ordering::SeqCst) == g.number {
            return;
        }
        let s = self.shard_held.0;
        let params = if self.fully_sharded() {
            let then = if keep { "kept for" } else { "again before" };
            format!("parameters all-gathered over a shard group of {s} before its forward and {then} its backward")
        } else {
            "parameters whole (nothing gathered)".to_string()
        };
        let reduced = match (self.spec.deterministic, grouped) {
            (true, _) => "folded over the logical shards in order",
            (false, true) => {
                "reduce-scattered in the shard group, then all-reduced over the replicas"
            }
            (false, false) => "reduce-scattered",
        };
        let when = match threaded {
            true => "on a communication thread, overlapping the units' computation",
            false => "in turn with the computation",
        };
        tracing::info!(
            generation = g.number,
            shard = s,
            units,
            "sharded step: each of {units} units' {params}, its gradients {reduced} after its backward (this rank keeps its rows of the sum), {when}"
        );
    }

    /// [`Trainer::full_step`]'s work; `kept`: the rows of the parameters kept whole.
    fn full_step_keeping(
        &mut self,
        arc: &Arc<dyn Communicator>,
        g: &Generation,
        rank: u32,
        t0: Instant,
        kept: &mut BTreeMap<usize, Tensor>,
    ) -> Result<f64, CommError> {
        let comm = arc.as_ref();
        let grp = self.shard_group(arc, g)?;
        let across = self.replica_group(arc, g)?;
        let b = self.spec.global_batch as f64;
        let units = self.units();
        let keep = self.keeps_gathered();
        let threaded = self.dev == Device::Cpu;
        let how = StepShape {
            keep,
            grouped: across.is_some(),
            threaded,
        };
        self.tell_step(g, units, how);
        let parts = self.step_parts(comm, g, rank);
        // forward: each unit's input, per part and micro-batch (the last unit runs in the
        // backward, with its loss); keeping the gathered parameters, each unit's input as a
        // leaf, its output, and whether that output holds its graph (a block activation
        // checkpointing recomputes does not)
        let mut inputs: Vec<Vec<Vec<Tensor>>> = parts
            .iter()
            .map(|p| {
                p.micro
                    .iter()
                    .map(|(x, _)| vec![x.shallow_clone()])
                    .collect()
            })
            .collect();
        let mut graphs: Vec<Vec<Vec<(Tensor, Tensor, bool)>>> = parts
            .iter()
            .map(|p| p.micro.iter().map(|_| Vec::new()).collect())
            .collect();
        // the units in the order they are gathered: forward, then backward (keeping them:
        // forward only); each unit's gather starts while the one before computes
        let order: Vec<usize> = if keep {
            (0..units).collect()
        } else {
            (0..units.saturating_sub(1))
                .chain((0..units).rev())
                .collect()
        };
        // the parameters kept whole so far
        let mut whole: BTreeSet<usize> = BTreeSet::new();
        // the step's collectives, in one order: gathers and reductions, each running while
        // the step computes
        // (a thread on the CPU whatever the cores: a unit's collectives wait on the peer more
        // than they compute, and the thread hides that; measured against the gathers alone
        // on a thread, 2 ranks on 2 cores: `ductile-bench ddp-step --sharding full`)
        let queue = CommQueue::for_step(threaded)?;
        let first = self.to_gather(order[0], &whole);
        let mut next = (first.clone(), self.start_gather(&queue, arc, &grp, &first));
        let mut at = 0;
        for u in 0..units.saturating_sub(1) {
            let (idx, pending) = std::mem::take(&mut next);
            let mut rests = self.finish_gather(&idx, pending)?;
            if keep {
                whole.extend(idx.iter().copied());
                kept.extend(std::mem::take(&mut rests));
            }
            at += 1;
            let v = self.to_gather(order[at], &whole);
            next = (v.clone(), self.start_gather(&queue, arc, &grp, &v));
            if keep {
                let block = self.model.recomputes() && self.model.is_block(u);
                for (p, part) in parts.iter().enumerate() {
                    for (m, (x, _)) in part.micro.iter().enumerate() {
                        let acts = &mut graphs[p][m];
                        let xin = match acts.last() {
                            Some((_, y, _)) => y.detach().set_requires_grad(true),
                            None => x.shallow_clone(),
                        };
                        let y = if block {
                            tch::no_grad(|| self.model.unit_forward(u, &xin))
                        } else {
                            self.model.unit_forward(u, &xin)
                        };
                        acts.push((xin, y, !block));
                    }
                }
                continue;
            }
            tch::no_grad(|| {
                for per in inputs.iter_mut() {
                    for acts in per.iter_mut() {
                        let y = self.model.unit_forward(u, acts.last().expect("an input"));
                        acts.push(y);
                    }
                }
            });
            self.release(rests);
        }
        // backward, unit by unit in reverse
        let mut outgrads: Vec<Vec<Option<Tensor>>> = parts
            .iter()
            .map(|p| p.micro.iter().map(|_| None).collect())
            .collect();
        let mut losses: Vec<Tensor> = parts
            .iter()
            .map(|_| Tensor::zeros([1], (Kind::Double, self.dev)))
            .collect();
        // a tied parameter's gradients from its later unit, per part and micro-batch
        let mut later: BTreeMap<usize, Vec<VecDeque<Tensor>>> = BTreeMap::new();
        let mut rows_grad: Vec<Option<Tensor>> = (0..self.params.len()).map(|_| None).collect();
        let mut sumsq: Vec<f64> = vec![0.0; self.params.len()];
        let mut reducing: Option<Reducing> = None;
        for u in (0..units).rev() {
            let idx = self.unit_params(u);
            // (kept: only the last unit is gathered here, its parameters not already whole)
            let mut rests = if keep && u + 1 < units {
                Vec::new()
            } else {
                let (gather, pending) = std::mem::take(&mut next);
                let rests = self.finish_gather(&gather, pending)?;
                at += 1;
                if let Some(&v) = order.get(at) {
                    let v = self.to_gather(v, &whole);
                    next = (v.clone(), self.start_gather(&queue, arc, &grp, &v));
                }
                rests
            };
            if keep {
                whole.extend(rests.iter().map(|(i, _)| *i));
                kept.extend(std::mem::take(&mut rests));
            }
            // this unit's parameter gradients, per part
            let mut acc: Vec<Vec<Option<Tensor>>> = parts
                .iter()
                .map(|_| idx.iter().map(|_| None).collect())
                .collect();
            for (p, part) in parts.iter().enumerate() {
                for (m, (tokens, y)) in part.micro.iter().enumerate() {
                    let (x, out) = if !keep {
                        let x = inputs[p][m].pop().expect("the unit's input");
                        let x = if u > 0 {
                            x.detach().set_requires_grad(true)
                        } else {
                            x
                        };
                        let out = self.model.unit_forward(u, &x);
                        (x, out)
                    } else if u + 1 == units {
                        // the last unit runs here, from the kept output before it
                        let x = match graphs[p][m].last() {
                            Some((_, y, _)) => y.detach().set_requires_grad(true),
                            None => tokens.shallow_clone(),
                        };
                        let out = self.model.unit_forward(u, &x);
                        (x, out)
                    } else {
                        let (x, y, graph) = graphs[p][m].pop().expect("the unit's graph");
                        // (a block activation checkpointing recomputes runs again, whole)
                        let out = if graph {
                            y
                        } else {
                            self.model.unit_forward(u, &x)
                        };
                        (x, out)
                    };
                    let root = if u + 1 == units {
                        let l = self.model.whole_loss(&out, y) / b;
                        losses[p] = &losses[p] + l.detach().to_kind(Kind::Double).reshape([1]);
                        l
                    } else {
                        let go = outgrads[p][m].take().expect("the output's gradient");
                        (&out * &go).sum(Kind::Float)
                    };
                    let mut wrt: Vec<&Tensor> = idx.iter().map(|i| &self.params[*i]).collect();
                    if u > 0 {
                        wrt.push(&x);
                    }
                    let gs = Tensor::run_backward(&[&root], &wrt, false, false);
                    drop(root);
                    drop(out);
                    for (j, &i) in idx.iter().enumerate() {
                        let gr = if gs[j].defined() {
                            gs[j].shallow_clone()
                        } else {
                            self.params[i].zeros_like()
                        };
                        if self.done_at(i) < u {
                            // tied: its earlier unit sums it in
                            later
                                .entry(i)
                                .or_insert_with(|| parts.iter().map(|_| VecDeque::new()).collect())
                                [p]
                                .push_back(gr);
                            continue;
                        }
                        let prior = later.get_mut(&i).and_then(|l| l[p].pop_front());
                        let a = acc[p][j].take();
                        // the unsharded order: a later unit's contribution of this
                        // micro-batch, then this unit's
                        let a = match (a, prior) {
                            (None, None) => gr,
                            (None, Some(l)) => l + gr,
                            (Some(a), None) => a + gr,
                            (Some(a), Some(l)) => (a + l) + gr,
                        };
                        acc[p][j] = Some(a);
                    }
                    if u > 0 {
                        outgrads[p][m] = Some(gs[idx.len()].shallow_clone());
                    }
                }
            }
            if keep {
                // the parameters whose last use is this unit's backward get their rows back
                let back: Vec<(usize, Tensor)> = idx
                    .iter()
                    .filter(|i| self.done_at(**i) == u)
                    .filter_map(|i| kept.remove(i).map(|r| (*i, r)))
                    .collect();
                self.release(back);
            } else {
                self.release(rests);
            }
            let done: Vec<usize> = (0..idx.len())
                .filter(|j| self.done_at(idx[*j]) == u)
                .collect();
            if done.is_empty() {
                continue;
            }
            let ids: Vec<usize> = done.iter().map(|j| idx[*j]).collect();
            let per_part: Vec<Vec<Tensor>> = acc
                .into_iter()
                .map(|a| {
                    done.iter()
                        .map(|j| a[*j].as_ref().expect("a gradient").shallow_clone())
                        .collect()
                })
                .collect();
            // the unit after this one has been reduced meanwhile: keep its rows; this
            // unit's reduction runs while the unit before computes
            if let Some(r) = reducing.take() {
                self.finish_reduce(r, &mut rows_grad, &mut sumsq)?;
            }
            let groups = (&grp, &across);
            reducing = Some(self.submit_reduce(&queue, arc, groups, &parts, ids, per_part));
        }
        if let Some(r) = reducing.take() {
            self.finish_reduce(r, &mut rows_grad, &mut sumsq)?;
        }
        drop(queue);
        self.computed_for(rank, t0);
        // the loss and the checkpoint flags, summed as the unsharded step's riders
        let gen = g.number;
        let riders: Vec<Tensor> = losses
            .into_iter()
            .map(|l| Tensor::cat(&self.riders(l.to_kind(Kind::Float), gen), 0))
            .collect();
        let summed = if self.spec.deterministic {
            let v = self.logical_shards().len() as u64;
            let mine: Vec<_> = parts
                .iter()
                .zip(&riders)
                .map(|(p, r)| (p.k, comm.place(r)))
                .collect();
            comm.ordered_all_reduce(&mine, v)?.into_tensor()
        } else {
            let mut t = comm.place(&riders[0]);
            comm.all_reduce(&mut t, ReduceOp::Sum)?;
            t.into_tensor()
        };
        let tail = Vec::<f32>::try_from(summed.to_device(Device::Cpu))
            .unwrap_or_else(|_| vec![f32::NAN, 0.0, 0.0]);
        let loss = tail[0] as f64;
        self.flags = (tail[1] > 0.0, tail[2] > 0.0);
        self.full_update(arc, g, rank, &grp, rows_grad, sumsq, loss)?;
        Ok(loss)
    }

    /// Submit the sum of parameters `ids`' gradients (`per_part[p][j]`: part p's gradient of
    /// `ids[j]`, whole) over the world to `queue`. Deterministic mode folds the logical shards
    /// in order (the unsharded step's fold, on these parameters); otherwise a shard group that
    /// is the world reduce-scatters, and a smaller one (HSDP, as FSDP2's) reduce-scatters in
    /// the shard group (each member sends every other one its rows and folds what it gets in
    /// group order) and then all-reduces its rows of the sum over the replicas (`across`, a
    /// ring where there are more than two): about half the bytes of all-reducing the whole
    /// gradients over the world. The packing is done here, so the gradients are free once
    /// this returns; [`Trainer::finish_reduce`] keeps this rank's rows.
    fn submit_reduce(
        &self,
        queue: &CommQueue,
        comm: &Arc<dyn Communicator>,
        (grp, across): (&Option<Group>, &Option<Group>),
        parts: &[Part],
        ids: Vec<usize>,
        per_part: Vec<Vec<Tensor>>,
    ) -> Reducing {
        let s = self.shard_held.0;
        let comm = comm.clone();
        if self.spec.deterministic {
            let v = self.logical_shards().len() as u64;
            let mine: Vec<(u64, Tensor)> = parts
                .iter()
                .zip(per_part)
                .map(|(p, gs)| {
                    let flat: Vec<Tensor> = gs.iter().map(|g| g.reshape([-1])).collect();
                    (p.k, Tensor::cat(&flat, 0))
                })
                .collect();
            let ticket = queue.submit("ordered_all_reduce", move || {
                let placed: Vec<_> = mine.iter().map(|(k, t)| (*k, comm.place(t))).collect();
                Ok(comm.ordered_all_reduce(&placed, v)?.into_tensor())
            });
            return Reducing {
                ids,
                how: How::Ordered,
                ticket,
            };
        }
        let gs = per_part.into_iter().next().expect("one part");
        if let Some(grp) = grp {
            let ticket = self.submit_rows(queue, grp, across, &ids, gs);
            return Reducing {
                ids,
                how: How::Scattered,
                ticket,
            };
        }
        // [S, longest]: place k's rows of every parameter, padded
        let size = |k: u32| -> i64 {
            ids.iter()
                .map(|i| self.rows(*i, k).1 * self.row_numel(*i))
                .sum()
        };
        let longest = (0..s).map(size).max().unwrap_or(0);
        let mut pieces = Vec::new();
        for k in 0..s {
            for (j, &i) in ids.iter().enumerate() {
                let (r0, rn) = self.rows(i, k);
                if rn > 0 {
                    pieces.push(gs[j].narrow(0, r0, rn).reshape([-1]));
                }
            }
            let pad = longest - size(k);
            if pad > 0 {
                pieces.push(Tensor::zeros([pad], (Kind::Float, self.dev)));
            }
        }
        let packed = Tensor::cat(&pieces, 0).to_kind(Kind::Float);
        drop(pieces);
        let ticket = queue.submit("reduce_scatter", move || {
            Ok(comm.reduce_scatter(&comm.place(&packed))?.into_tensor())
        });
        Reducing {
            ids,
            how: How::Scattered,
            ticket,
        }
    }

    /// Wait for a reduction [`Trainer::submit_reduce`] submitted and keep this rank's rows of
    /// each parameter's summed gradient in `rows_grad`; in deterministic mode with clipping,
    /// note each parameter's sum of squares from the whole sum (the unsharded clipping's, bit
    /// for bit).
    fn finish_reduce(
        &self,
        r: Reducing,
        rows_grad: &mut [Option<Tensor>],
        sumsq: &mut [f64],
    ) -> Result<(), CommError> {
        let t = r.ticket.wait()?;
        let ids = &r.ids;
        let place = self.shard_held.1;
        match r.how {
            How::Scattered => {
                let mut at = 0;
                for &i in ids {
                    let (_, rn) = self.rows(i, place);
                    let len = rn * self.row_numel(i);
                    let shape: Vec<i64> = std::iter::once(rn)
                        .chain(self.shapes[i][1..].iter().copied())
                        .collect();
                    rows_grad[i] = Some(t.narrow(0, at, len).view(shape.as_slice()).copy());
                    at += len;
                }
                return Ok(());
            }
            How::Ordered if self.spec.max_grad_norm.is_some() => {
                let mut at = 0;
                let mut squares = Vec::with_capacity(ids.len());
                for &i in ids {
                    let n = self.shapes[i].iter().product::<i64>();
                    let g = t.narrow(0, at, n).view(self.shapes[i].as_slice());
                    squares.push(g.to_kind(Kind::Double).square().sum(Kind::Double));
                    at += n;
                }
                let per: Vec<f64> =
                    Vec::<f64>::try_from(Tensor::stack(&squares, 0).to_device(Device::Cpu))
                        .unwrap_or_default();
                for (&i, q) in ids.iter().zip(per) {
                    sumsq[i] = q;
                }
            }
            How::Ordered => {}
        }
        let mut at = 0;
        for &i in ids {
            let n = self.shapes[i].iter().product::<i64>();
            let g = t.narrow(0, at, n).view(self.shapes[i].as_slice());
            let (r0, rn) = self.rows(i, place);
            rows_grad[i] = Some(g.narrow(0, r0, rn).copy());
            at += n;
        }
        Ok(())
    }

    /// The optimizer's step on this rank's rows: clipped first when the job sets
    /// `max_grad_norm` (the global norm: in deterministic mode from each parameter's whole sum,
    /// as the unsharded step computes it; otherwise from the shard group's rows).
    #[allow(clippy::too_many_arguments)]
    fn full_update(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        rank: u32,
        grp: &Option<Group>,
        rows_grad: Vec<Option<Tensor>>,
        sumsq: Vec<f64>,
        loss: f64,
    ) -> Result<(), CommError> {
        let grads = self.rows_or_zeros(rows_grad);
        if let Some(max) = self.spec.max_grad_norm {
            let total = if self.spec.deterministic {
                sumsq.iter().sum::<f64>()
            } else {
                let mine = super::norm::sum_squares(&grads);
                let all = comm.host().all_gather_f64(&[mine])?;
                let members: Vec<u32> = match grp {
                    Some(grp) => grp.members().to_vec(),
                    None => (0..comm.world()).collect(),
                };
                members.iter().map(|r| all[*r as usize][0]).sum::<f64>()
            };
            let norm = total.sqrt();
            super::norm::clip_to(&grads, norm, max);
            self.grad_norm = Some(norm);
        }
        let lr = self.spec.lr_plan().at(self.step);
        if !self.fully_sharded() {
            // ZeRO-2: the rows stepped, then gathered, as ZeRO-1's update
            self.sharded_update(comm, g, &grads, lr, true)?;
        }
        if self.fully_sharded() {
            // the rows to this rank's keeper, and the world's commit, before the step applies
            self.refresh_buddy(comm, &grads)?;
            self.step_rows(&grads, lr);
        }
        ledger_line(
            &mut self.ledger,
            serde_json::json!({"g": g.number, "s": self.step, "r": rank, "applied": true, "lr": lr, "loss": loss}),
        );
        self.step += 1;
        Ok(())
    }

    /// Each parameter's rows of the summed gradient, zeros (of its rows' shape) where it has
    /// none.
    pub(super) fn rows_or_zeros(&self, rows_grad: Vec<Option<Tensor>>) -> Vec<Tensor> {
        rows_grad
            .into_iter()
            .enumerate()
            .map(|(i, g)| g.unwrap_or_else(|| self.params[i].zeros_like()))
            .collect()
    }

    /// The optimizer's step on this rank's rows of every parameter (full sharding), with
    /// `grads` its rows of the summed gradients.
    pub(super) fn step_rows(&mut self, grads: &[Tensor], lr: f64) {
        let per = self.opt.per();
        let step = self.step;
        for (i, gr) in grads.iter().enumerate() {
            if self.params[i].numel() == 0 {
                continue;
            }
            let mut st: Vec<Tensor> = (0..per)
                .map(|j| self.opt.state[per * i + j].shallow_clone())
                .collect();
            let p = self.params[i].detach();
            crate::optim::apply(
                &self.opt.kind,
                self.opt.decays(i),
                &mut st,
                &p,
                gr,
                lr,
                step,
            );
        }
    }

    /// The summed loss over `batches` (this rank's eval samples) of a fully sharded rank:
    /// every rank of the shard group runs the model unit by unit on its own samples, each
    /// unit gathered once.
    pub(super) fn full_eval_sum(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        mut batches: Vec<(Tensor, Tensor)>,
        counts: bool,
    ) -> Result<f64, CommError> {
        let grp = self.shard_group(comm, g)?;
        let units = self.units();
        let mut sum = 0.0;
        for u in 0..units {
            let ps = self.unit_params(u);
            let rests = self.gather_params(comm, &grp, &ps)?;
            let r = tch::no_grad(|| -> Result<(), CommError> {
                for (h, y) in batches.iter_mut() {
                    // (through the tensor group when the model is in one, else whole)
                    let out = self.model.forward_unit(u, h, &mut Tape::default())?;
                    if u + 1 == units {
                        sum += self
                            .model
                            .loss(&out, y, &mut Tape::default())?
                            .double_value(&[]);
                    } else {
                        *h = out;
                    }
                }
                Ok(())
            });
            self.release(rests);
            r?;
        }
        // (a tensor group's members compute the same loss: one counts it)
        Ok(if counts { sum } else { 0.0 })
    }
}

//! Pipeline steps and the state agreement every generation starts with.
//!
//! A pipeline generation (`pipeline_parallel` > 1) runs each data-parallel replica as a chain
//! of stages (`rank = dp_rank · pp + pp_stage`): stage s runs units `[b[s], b[s+1])` of the
//! model over the replica's micro-batches in the schedule's order, activations going forward
//! and their gradients backward point to point (sent from a sender thread, so a stage never
//! blocks on its own send). The replicas of a stage then fold that stage's gradients along a
//! chain in replica order (deterministic mode: one gradient per logical shard, folded in global
//! shard order, as the data-parallel ordered all-reduce does, so the bits match), and a small
//! all-reduce over the whole world (the loss, the checkpoint flags) is the step's commit
//! point: a rank applies its stage's update only after it, and keeps the reduced gradient
//! pending until then. If the commit completed anywhere, every rank had the reduced gradient,
//! so at the next agreement the ranks one step behind apply their pending gradient; if it
//! completed nowhere, the step is dropped everywhere.
//!
//! The agreement ([`Trainer::agree`]): every rank says its step, its pending step and the
//! units it holds; the resume step is the highest; each rank obtains the units of its new
//! stage that it does not hold at that step from a holder (spread over the holders), point to
//! point, as checksummed blobs of parameters and optimizer state, by the redistribution plan
//! ([`ductile_strategies::redistribute`]). A unit nobody holds comes from the latest
//! checkpoint, through the same plan (every rank restores its own stage from it, since the
//! survivors are ahead of it); with no checkpoint the worker stops rather than start those
//! layers from the seed.

use std::collections::{BTreeMap, VecDeque};
use std::io::Write as _;
use std::ops::Range;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use ductile_cluster::records::{Generation, Member};
use ductile_comm::{CommError, Communicator};
use ductile_strategies::pipeline::{send_order, stage_ops, Msg, Op};
use ductile_strategies::redistribute::{self, relative, whole, Move, Part, Region};
use ductile_strategies::{micro_batches, split_batch, split_range};
use tch::{Device, Kind, Tensor};

use super::Trainer;
use crate::optim::lr_at;

/// Receives a step's point-to-point messages: each peer's arrive in the order it sends them
/// ([`send_order`]), and those that come before the one asked for are kept aside (with
/// `interleaved-1f1b` at two stages, one direction carries activations and gradients alike).
pub struct Mailbox {
    expect: BTreeMap<u32, VecDeque<Msg>>,
    early: BTreeMap<Msg, Tensor>,
}

impl Mailbox {
    /// The mailbox of `stage` of the replica whose stage s is rank `replica + s · stride`.
    pub fn new(schedule: &str, p: u32, m: u32, stage: u32, replica: u32, stride: u32) -> Mailbox {
        let mut expect = BTreeMap::new();
        for from in [(stage + p - 1) % p, (stage + 1) % p] {
            if from != stage {
                expect.insert(
                    replica + from * stride,
                    send_order(schedule, p, m, from, stage).into(),
                );
            }
        }
        Mailbox {
            expect,
            early: BTreeMap::new(),
        }
    }

    /// Message `want` from rank `from`, each message sized by `shape`.
    pub fn recv(
        &mut self,
        comm: &dyn Communicator,
        from: u32,
        want: Msg,
        shape: &dyn Fn(Msg) -> Vec<i64>,
    ) -> Result<Tensor, CommError> {
        if let Some(t) = self.early.remove(&want) {
            return Ok(t);
        }
        loop {
            let Some(next) = self.expect.get_mut(&from).and_then(|q| q.pop_front()) else {
                return Err(protocol(
                    comm,
                    from,
                    "pipeline",
                    format!("{want:?} is not among what rank {from} sends this step"),
                ));
            };
            let t = comm.zeros(shape(next).as_slice(), Kind::Float);
            comm.recv(&t, from)?;
            let t = t.into_tensor();
            if next == want {
                return Ok(t);
            }
            self.early.insert(next, t);
        }
    }
}

/// A reduced gradient waiting for its step's commit.
pub struct Pending {
    /// The step it applies (the rank's `step` when it was computed).
    pub step: u64,
    /// The generation that computed it (the ledger's line says so).
    pub generation: u64,
    pub params: Vec<usize>,
    pub grads: Vec<Tensor>,
}

/// Sends queued tensors to peers on a thread of its own.
pub struct Outbox {
    tx: Option<mpsc::Sender<(Tensor, u32)>>,
    handle: Option<JoinHandle<Result<(), CommError>>>,
}

impl Outbox {
    pub fn new(comm: Arc<dyn Communicator>) -> Outbox {
        let (tx, rx) = mpsc::channel::<(Tensor, u32)>();
        let handle = std::thread::Builder::new()
            .name("pipeline-send".into())
            .spawn(move || {
                for (t, peer) in rx {
                    comm.send(&comm.place(&t), peer)?;
                }
                Ok(())
            })
            .expect("spawn the pipeline's sender thread");
        Outbox {
            tx: Some(tx),
            handle: Some(handle),
        }
    }

    pub fn send(&self, t: Tensor, peer: u32) {
        // a closed channel means the thread failed; finish() reports its error
        let _ = self.tx.as_ref().unwrap().send((t, peer));
    }

    /// Wait until everything queued went out.
    pub fn finish(mut self) -> Result<(), CommError> {
        self.join()
    }

    fn join(&mut self) -> Result<(), CommError> {
        drop(self.tx.take());
        match self.handle.take() {
            Some(h) => h.join().unwrap_or(Err(CommError::Invalid {
                op: "send",
                reason: "the pipeline's sender thread panicked".into(),
            })),
            None => Ok(()),
        }
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        // after a failed receive the communicator is aborted, so pending sends fail at once
        let _ = self.join();
    }
}

/// One micro-batch of a replica: (first position in the step, samples, the logical shard it
/// completes).
type Micro = (u64, u64, Option<u64>);

pub(super) fn protocol(
    comm: &dyn Communicator,
    peer: u32,
    op: &'static str,
    reason: String,
) -> CommError {
    CommError::Protocol {
        generation: comm.generation(),
        op,
        peer,
        reason,
    }
}

/// Chunks of units a rank may hold: one per stage, two with `interleaved-1f1b`.
const HELD_SLOTS: usize = 2;

/// Whether unit `u` is in one of `chunks`.
/// The view of `t` that `r` covers.
pub(super) fn region_of(t: &Tensor, r: &Region) -> Tensor {
    let mut v = t.shallow_clone();
    for (d, x) in r.iter().enumerate() {
        v = v.narrow(d as i64, x.start as i64, (x.end - x.start) as i64);
    }
    v
}

pub(super) fn holds_unit(chunks: &[Range<usize>], u: usize) -> bool {
    chunks.iter().any(|c| c.contains(&u))
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

    /// Parameter indices of the units in `chunks`, in index order.
    pub(super) fn params_in(&self, chunks: &[Range<usize>]) -> Vec<usize> {
        (0..self.params.len())
            .filter(|i| holds_unit(chunks, self.param_unit[*i]))
            .collect()
    }

    /// Parameters (with their gradients) and optimizer state of the units in `keep` keep
    /// their storage; every other unit's is released (an empty tensor of the same kind), so
    /// a stage holds its own layers only.
    pub(super) fn hold_only(&mut self, keep: &[Range<usize>]) {
        self.resize_units(|u| !holds_unit(keep, u), false);
    }

    /// Give the units `want` their storage back (zeros) where it was released, before they
    /// are received or restored.
    pub(super) fn allocate(&mut self, want: &[Range<usize>]) {
        self.resize_units(|u| holds_unit(want, u), true);
    }

    fn resize_units(&mut self, which: impl Fn(usize) -> bool, grow: bool) {
        for i in 0..self.params.len() {
            if !which(self.param_unit[i]) {
                continue;
            }
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
            .filter(|t| holds_unit(chunks, self.param_unit[self.param_of(*t)]))
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
    ) -> Result<usize, CommError> {
        let state: Vec<Tensor> = self
            .tensors()
            .into_iter()
            .map(|t| t.shallow_clone())
            .collect();
        // a rank holding tensor slices maps logical regions into its local tensors
        let slices = self.slice_holdings();
        let view =
            |t: usize, r: &Region| super::tensor::state_view(&state, slices.as_deref(), t, r);
        super::reshard::transfer(
            comm,
            moves,
            step,
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

    /// Agree on the state at the start of a generation (see the module's comment). The outer
    /// error stops the worker (no holder and no checkpoint); the inner one re-forms.
    pub(super) fn agree(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> anyhow::Result<Result<(), CommError>> {
        self.received = 0;
        let pend = self.pending.as_ref().map(|p| p.step as f64).unwrap_or(-1.0);
        // [step, pending step, tensor group size and place of what it holds, then HELD_SLOTS
        // (start, end) pairs of the chunks it holds]
        let mut row = vec![
            self.step as f64,
            pend,
            self.tp_held.0 as f64,
            self.tp_held.1 as f64,
        ];
        for k in 0..HELD_SLOTS {
            let r = self.held.get(k).cloned().unwrap_or(0..0);
            row.extend([r.start as f64, r.end as f64]);
        }
        assert!(
            self.held.len() <= HELD_SLOTS,
            "a rank holds at most {HELD_SLOTS} chunks"
        );
        let rows = match super::gather_rows(comm.as_ref(), &row) {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        let held_by = |r: &[f64]| -> Vec<Range<usize>> {
            r[4..]
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
        if let Some(p) = self.pending.take() {
            if (p.step + 1) as f64 == max {
                self.apply(&p.params, &p.grads, p.step, p.generation, comm.rank());
                tracing::info!(
                    step = self.step,
                    "applied the pending step its commit completed elsewhere"
                );
            }
        }
        if g.layout.tensor_parallel > 1 || rows.iter().any(|r| r[2] > 1.0) {
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
            if self.ckpt.is_none() && g.resume_step > 0 && self.spec.pipelined() {
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
            let r = match &self.ckpt {
                Some(_) => self.restore(comm, &need)?,
                None => Ok(()),
            };
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
            self.pending = None;
            self.allocate(&mine);
            let r = self.restore(comm, &need)?;
            if r.is_ok() && self.step == 0 {
                anyhow::bail!(
                    "layers {} have no holder and the checkpoint URL holds no commit: stopping rather than starting them from the seed",
                    names.join(", ")
                );
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
        let bytes = match self.exchange(comm, &plan.moves, step, &BTreeMap::new()) {
            Ok(b) => b,
            Err(e) => return Ok(Err(e)),
        };
        self.step = step;
        self.received = bytes as u64;
        self.hold_only(&mine);
        self.held = mine;
        if bytes > 0 {
            tracing::info!(
                step,
                bytes,
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
        if self.tp_held.0 > 1 {
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

    fn micro_plan(&self, dp: u32, d: u32, p: u32) -> Vec<Micro> {
        let b = self.spec.global_batch as u64;
        let mut out = Vec::new();
        if self.spec.deterministic {
            let shards = self.logical_shards();
            for k in split_range(shards.len() as u64, dp, d) {
                let sh = shards[k as usize];
                let parts = micro_batches(
                    sh,
                    self.spec
                        .micro_batch
                        .map(|m| m as u64)
                        .unwrap_or(sh.len.max(1)),
                );
                let n = parts.len();
                for (j, (s, l)) in parts.into_iter().enumerate() {
                    out.push((s, l, (j + 1 == n).then_some(k)));
                }
            }
        } else {
            let share = split_batch(b, dp)[d as usize];
            let m = self
                .spec
                .pipeline_micro_batches
                .unwrap_or(4 * p)
                .min(share.len as u32)
                .max(1);
            for piece in split_batch(share.len, m) {
                if piece.len > 0 {
                    out.push((share.start + piece.start, piece.len, None));
                }
            }
        }
        out
    }

    /// The gradients of `which`, in one flat tensor (a copy: the next zeroing leaves it be).
    fn flat_of(&self, which: &[usize]) -> Tensor {
        if which.is_empty() {
            return Tensor::zeros([0], (Kind::Float, self.dev));
        }
        Tensor::cat(&self.grad_parts(which.iter().copied()), 0)
    }

    /// Apply a reduced gradient to `which` and log it; `step` is the step it belongs to.
    fn apply(&mut self, which: &[usize], grads: &[Tensor], step: u64, generation: u64, rank: u32) {
        let lr = lr_at(self.spec.lr, step, self.spec.max_steps);
        for (j, i) in which.iter().enumerate() {
            let p = self.params[*i].shallow_clone();
            self.opt.update(*i, &p, &grads[j], lr, step);
        }
        if let Some(f) = &mut self.ledger {
            let _ = writeln!(
                f,
                "{}",
                serde_json::json!({"g": generation, "s": step, "r": rank, "applied": true})
            );
        }
        self.step = step + 1;
    }

    /// One step of a pipeline generation (spares only join the commit).
    pub(super) fn pipe_step(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
    ) -> Result<f64, CommError> {
        let b = self.spec.global_batch as u64;
        let base = self.step * b;
        let (p, dp) = (g.layout.pipeline_parallel.max(1), g.layout.data_parallel);
        let rank = me.rank;
        let mut loss = 0f64;
        let mut which = Vec::new();
        let mut reduced = Vec::new();
        if !me.spare {
            let stage = me.pp_stage;
            let units = self.units();
            // the model's chunks: chunk k holds units [bounds[k], bounds[k+1]); this stage
            // holds chunks stage, stage + p, ... (local chunk j is global j·p + stage)
            let bounds: Vec<usize> = if g.stage_boundaries.len() >= 2 {
                g.stage_boundaries.iter().map(|x| *x as usize).collect()
            } else {
                vec![0, units]
            };
            let v = ((bounds.len() - 1) as u32 / p).max(1);
            let last_chunk = v * p - 1;
            let mine: Vec<Range<usize>> = self.units_of(g, me);
            let which_of: Vec<Vec<usize>> = mine
                .iter()
                .map(|r| self.params_in(std::slice::from_ref(r)))
                .collect();
            which = which_of.concat();
            let mbs = self.micro_plan(dp, me.dp_rank, p);
            let m = mbs.len() as u32;
            let ops = stage_ops(&self.spec.schedule, p, m, stage);
            let (first, last) = (stage == 0, stage + 1 == p);
            // rank = (dp_rank · p + stage) · tp + tp_rank: a stage's peers in the replica are
            // the members of the same place in their tensor groups
            let tp = g.layout.tensor_parallel.max(1);
            let at = |d: u32, s: u32| (d * p + s) * tp + me.tp_rank;
            let replica = at(me.dp_rank, 0);
            let (prev, next) = (
                at(me.dp_rank, (stage + p - 1) % p),
                at(me.dp_rank, (stage + 1) % p),
            );
            // a tensor group's members compute the same loss and read the same samples: one
            // of them counts them
            let counts = me.tp_rank == 0;
            let grp = self.model.tensor_shard().map(|s| s.group.clone());
            let mut tapes: Vec<Option<crate::model::Tape>> = (0..m * v).map(|_| None).collect();
            self.zero_grads();
            let outbox = Outbox::new(comm.clone());
            let mut mail = Mailbox::new(&self.spec.schedule, p, m, stage, replica, tp);
            let shape = |msg: Msg| match msg {
                Msg::Act { mb, chunk } => self
                    .model
                    .boundary_shape(bounds[chunk as usize], mbs[mb as usize].1 as i64),
                Msg::Grad { mb, chunk } => self
                    .model
                    .boundary_shape(bounds[chunk as usize + 1], mbs[mb as usize].1 as i64),
            };
            let key = |i: u32, j: u32| (i * v + j) as usize;
            let mut inputs: Vec<Option<Tensor>> = (0..m * v).map(|_| None).collect();
            let mut outputs: Vec<Option<Tensor>> = (0..m * v).map(|_| None).collect();
            // deterministic mode: each logical shard's gradient, chunk by chunk
            let mut captured: BTreeMap<u64, Vec<Option<Tensor>>> = BTreeMap::new();
            let mut used = Vec::new();
            let mut acc = Tensor::zeros([1], (Kind::Double, self.dev));
            for op in ops {
                match op {
                    Op::Fwd(i, j) => {
                        let k = j * p + stage;
                        let (start, len, _) = mbs[i as usize];
                        let idx: Vec<u64> = (start..start + len)
                            .map(|q| self.order.sample(base + q))
                            .collect();
                        let input = if k == 0 {
                            used.extend_from_slice(&idx);
                            self.data.batch(&idx).0.to_device(self.dev)
                        } else {
                            let want = Msg::Act { mb: i, chunk: k };
                            mail.recv(comm.as_ref(), prev, want, &shape)?
                                .set_requires_grad(true)
                        };
                        let r = &mine[j as usize];
                        let mut tape = crate::model::Tape::default();
                        let out = if grp.is_some() {
                            self.model.forward_tp(r.start, r.end, &input, &mut tape)?
                        } else {
                            self.model.forward_units(r.start, r.end, &input)
                        };
                        if k == last_chunk {
                            let y = self.data.batch(&idx).1.to_device(self.dev);
                            let l = if grp.is_some() {
                                self.model.loss_tp(&out, &y, &mut tape)?
                            } else {
                                self.model.loss_of(&out, &y)
                            } / b as f64;
                            acc += l.detach().to_kind(Kind::Double).reshape([1]);
                            outputs[key(i, j)] = Some(l);
                        } else {
                            outbox.send(out.detach().contiguous(), next);
                            outputs[key(i, j)] = Some(out);
                        }
                        if k != 0 {
                            inputs[key(i, j)] = Some(input);
                        }
                        tapes[key(i, j)] = Some(tape);
                    }
                    Op::Bwd(i, j) => {
                        let k = j * p + stage;
                        let out = outputs[key(i, j)].take().expect("forward before backward");
                        let tape = tapes[key(i, j)].take().expect("forward before backward");
                        let grad = if k == last_chunk {
                            None
                        } else {
                            let want = Msg::Grad { mb: i, chunk: k };
                            Some(mail.recv(comm.as_ref(), next, want, &shape)?)
                        };
                        match (&grp, &grad) {
                            (Some(grp), _) => tape.backward(&out, grad.as_ref(), grp)?,
                            (None, None) => out.backward(),
                            // d/d(out) of sum(out · grad) is grad, bit for bit
                            (None, Some(gr)) => (out * gr).sum(Kind::Float).backward(),
                        }
                        if let Some(input) = inputs[key(i, j)].take() {
                            outbox.send(input.grad().contiguous(), prev);
                        }
                        if let Some(sh) = mbs[i as usize].2 {
                            let parts = captured
                                .entry(sh)
                                .or_insert_with(|| (0..v).map(|_| None).collect());
                            parts[j as usize] = Some(self.flat_of(&which_of[j as usize]));
                            self.zero_grads_of(which_of[j as usize].iter().copied());
                        }
                    }
                }
            }
            let mut shards: Vec<(u64, Tensor)> = captured
                .into_iter()
                .map(|(sh, parts)| {
                    let parts: Vec<Tensor> = parts
                        .into_iter()
                        .map(|t| t.expect("every chunk ran its backward"))
                        .collect();
                    (sh, Tensor::cat(&parts, 0))
                })
                .collect();
            outbox.finish()?;
            if !self.spec.deterministic {
                shards.push((0, self.flat_of(&which)));
            }
            if let (Some(f), true) = (&mut self.ledger, first && counts) {
                let _ = writeln!(
                    f,
                    "{}",
                    serde_json::json!({"g": g.number, "s": self.step, "r": rank, "idx": used})
                );
            }
            // the stage's replicas fold their gradients along a chain in replica order; the
            // last sends the result back to the others
            let group: Vec<u32> = (0..dp).map(|d| at(d, stage)).collect();
            let j = me.dp_rank as usize;
            let mut acc_g = if j > 0 {
                let got = comm.zeros(&shards[0].1.size(), shards[0].1.kind());
                comm.recv(&got, group[j - 1])?;
                let mut t = got.into_tensor();
                for (_, s) in &shards {
                    t += s;
                }
                t
            } else {
                let mut t = shards[0].1.copy();
                for (_, s) in &shards[1..] {
                    t += s;
                }
                t
            };
            let placed = comm.place(&acc_g);
            if j + 1 < group.len() {
                comm.send(&placed, group[j + 1])?;
                comm.recv(&placed, *group.last().unwrap())?;
            } else {
                for peer in &group[..j] {
                    comm.send(&placed, *peer)?;
                }
            }
            acc_g = placed.into_tensor();
            let mut at = 0;
            for i in &which {
                let p = &self.params[*i];
                let k = p.numel() as i64;
                reduced.push(acc_g.narrow(0, at, k).view(p.size().as_slice()));
                at += k;
            }
            if last && counts {
                loss = f64::try_from(acc.to_device(Device::Cpu)).unwrap_or(f64::NAN);
            }
        }
        // the commit: loss and checkpoint flags over the whole world
        self.pending = Some(Pending {
            step: self.step,
            generation: g.number,
            params: which.clone(),
            grads: reduced,
        });
        let (pending_ck, busy) = self
            .ckpt
            .as_ref()
            .map(|c| c.flags(g.number))
            .unwrap_or((0.0, 0.0));
        // control data: on the host face, whatever the backend
        let v = comm
            .host()
            .sum_f64(&[loss, pending_ck as f64, busy as f64])?;
        self.flags = (v[1] > 0.0, v[2] > 0.0);
        let p = self.pending.take().unwrap();
        self.apply(&p.params, &p.grads, p.step, p.generation, rank);
        // the other stages' copies are stale from this step on: release them
        let held = self.held.clone();
        self.hold_only(&held);
        Ok(v[0] as f64)
    }
}

//! Pipeline steps.
//!
//! A pipeline generation (`pipeline_parallel` > 1) runs each data-parallel replica as a chain
//! of stages (laid out by `strategies::mesh`): stage s runs units `[b[s], b[s+1])` of the
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
//! The agreement that starts every generation is [`super::agree`].

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use ductile_cluster::modes::Sharding;
use ductile_cluster::records::{Generation, Member};
use ductile_comm::{CommError, Communicator};
use ductile_strategies::mesh::{Coords, Mesh};
use ductile_strategies::pipeline::{send_order, stage_ops, Msg, Op, Schedule};
use ductile_strategies::{micro_batches, split_batch, split_range};
use tch::{Device, Kind, Tensor};

use super::agree::Pending;
use super::reshard::protocol;
use super::{ledger_line, Trainer};

/// Receives a step's point-to-point messages: each peer's arrive in the order it sends them
/// ([`send_order`]), and those that come before the one asked for are kept aside (with
/// `interleaved-1f1b` at two stages, one direction carries activations and gradients alike).
pub struct Mailbox {
    expect: BTreeMap<u32, VecDeque<Msg>>,
    early: BTreeMap<Msg, Tensor>,
}

impl Mailbox {
    /// The mailbox of `stage` of a replica whose stage s is rank `rank_of(s)`.
    pub fn new(
        schedule: Schedule,
        p: u32,
        m: u32,
        stage: u32,
        rank_of: impl Fn(u32) -> u32,
    ) -> Mailbox {
        let mut expect = BTreeMap::new();
        for from in [(stage + p - 1) % p, (stage + 1) % p] {
            if from != stage {
                expect.insert(
                    rank_of(from),
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

/// Where a member works in a generation's pipeline.
pub(super) struct Place {
    pub stage: u32,
    /// The model's units.
    pub units: usize,
    /// The model's chunks: chunk k holds units `[bounds[k], bounds[k+1])`; a stage holds chunks
    /// stage, stage + p, ... (its local chunk j is global j·p + stage).
    pub bounds: Vec<usize>,
    /// Chunks per stage.
    pub v: u32,
    pub last_chunk: u32,
    /// This member's chunks of units.
    pub mine: Vec<Range<usize>>,
    pub mesh: Mesh,
    pub c: Coords,
    /// The ranks of the previous and the next stage in its replica (the members of the same
    /// place in their tensor groups).
    pub prev: u32,
    pub next: u32,
}

impl Trainer {
    /// Where `me` (not a spare) works in `g`'s pipeline (one stage when `g` has none).
    pub(super) fn pipeline_place(&self, g: &Generation, me: &Member) -> Place {
        let p = g.layout.pipeline_parallel.max(1);
        let stage = me.pp_stage;
        let units = self.units();
        let bounds: Vec<usize> = if g.stage_boundaries.len() >= 2 {
            g.stage_boundaries.iter().map(|x| *x as usize).collect()
        } else {
            vec![0, units]
        };
        let v = ((bounds.len() - 1) as u32 / p).max(1);
        let mesh = Mesh::new(&g.layout);
        let c = Coords {
            dp: me.dp_rank,
            stage,
            tp: me.tp_rank,
        };
        let (prev, next) = (
            mesh.stage_peer(c, (stage + p - 1) % p),
            mesh.stage_peer(c, (stage + 1) % p),
        );
        Place {
            stage,
            units,
            bounds,
            v,
            last_chunk: v * p - 1,
            mine: self.units_of(g, me),
            mesh,
            c,
            prev,
            next,
        }
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

    /// The parameter of `which` (this stage's) that another stage holds too, and that stage:
    /// a tied head's embedding, when its two units are on different stages of `g`.
    fn shared_with(&self, g: &Generation, stage: u32, which: &[usize]) -> Option<(usize, u32)> {
        let units = self.units() as u32;
        which.iter().find_map(|&i| {
            let also = self.param_also[i]?;
            let (a, b) = (
                g.stage_of(self.param_unit[i] as u32, units),
                g.stage_of(also as u32, units),
            );
            match (a == b, stage == a) {
                (true, _) => None,
                (false, true) => Some((i, b)),
                (false, false) => Some((i, a)),
            }
        })
    }

    /// The gradients of `which`, in one flat tensor (a copy: the next zeroing leaves it be).
    fn flat_of(&self, which: &[usize]) -> Tensor {
        if which.is_empty() {
            return Tensor::zeros([0], (Kind::Float, self.dev));
        }
        Tensor::cat(&self.grad_parts(which.iter().copied()), 0)
    }

    /// Deterministic mode, a head tied to the embedding on another stage (`peer`): each
    /// logical shard's gradient of the parameter (at `at`, `n` long in each of `shards`'
    /// flats) summed over the shard's micro-batches in the whole model's order, (sum + the
    /// head's) + the embedding's, as the data-parallel step accumulates it. Each stage sends
    /// the other its gradient of every micro-batch (`parts`, taken) and both fold the same
    /// tensors the same way: the same bits on both, and the data-parallel run's.
    fn fold_tied(
        &self,
        comm: &Arc<dyn Communicator>,
        peer: u32,
        (mbs, parts): (&[Micro], &mut BTreeMap<u32, Tensor>),
        own_is_earlier: bool,
        (shards, at, n): (&mut [(u64, Tensor)], i64, i64),
    ) -> Result<(), CommError> {
        let mut of_shard: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
        let mut run = Vec::new();
        for (q, (_, _, sh)) in mbs.iter().enumerate() {
            run.push(q as u32);
            if let Some(sh) = sh {
                of_shard.insert(*sh, std::mem::take(&mut run));
            }
        }
        for (sh, s) in shards.iter_mut() {
            let own: Vec<Tensor> = of_shard[sh]
                .iter()
                .map(|m| {
                    parts
                        .remove(m)
                        .expect("each micro-batch ran its backward")
                        .reshape([-1])
                })
                .collect();
            let sent = comm.place(&Tensor::cat(&own, 0));
            let theirs = comm.zeros(&[n * own.len() as i64], own[0].kind());
            comm.exchange(&[(peer, &sent)], &[(peer, &theirs)])?;
            let theirs = theirs.into_tensor();
            let mut sum = own[0].zeros_like();
            for (q, o) in own.iter().enumerate() {
                let t = theirs.narrow(0, q as i64 * n, n);
                let (head, emb) = if own_is_earlier { (&t, o) } else { (o, &t) };
                sum = super::fsdp_tp::tied_sum(&sum, head, emb);
            }
            s.narrow(0, at, n).copy_(&sum);
        }
        Ok(())
    }

    /// Apply a reduced gradient to `which` and log it; `step` is the step it belongs to.
    pub(super) fn apply(
        &mut self,
        which: &[usize],
        grads: &[Tensor],
        step: u64,
        generation: u64,
        rank: u32,
    ) {
        let lr = self.spec.lr_plan().at(step);
        for (j, i) in which.iter().enumerate() {
            let p = self.params[*i].shallow_clone();
            self.opt.update(*i, &p, &grads[j], lr, step);
        }
        ledger_line(
            &mut self.ledger,
            serde_json::json!({"g": generation, "s": step, "r": rank, "applied": true}),
        );
        self.step = step + 1;
    }

    /// Replica `q`'s rows (of its shard place, `q` modulo the shard group) of parameter `i`'s
    /// local tensor (a tensor slice's under tensor groups): where they start and how many.
    fn local_rows(&self, i: usize, q: u32) -> (i64, i64) {
        let s = self.shard_held.0;
        let r = split_range(self.params[i].size()[0] as u64, s, q % s);
        (r.start as i64, (r.end - r.start) as i64)
    }

    /// The shape of replica `q`'s rows of parameter `i`.
    fn row_shape(&self, i: usize, q: u32) -> Vec<i64> {
        let mut shape = self.params[i].size();
        shape[0] = self.local_rows(i, q).1;
        shape
    }

    /// Replica `q`'s rows of `t`, parameter `i`'s whole (local) gradient.
    fn rows_of(&self, i: usize, q: u32, t: &Tensor) -> Tensor {
        let (at, n) = self.local_rows(i, q);
        t.narrow(0, at, n)
    }

    /// [`Trainer::apply`] with the optimizer state sharded over the stage's replicas (ZeRO-1):
    /// this rank steps its rows of its stage's parameters and the shard group all-gathers
    /// them ([`Trainer::sharded_update`]).
    fn apply_sharded(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        p: &Pending,
        rank: u32,
    ) -> Result<(), CommError> {
        let lr = self.spec.lr_plan().at(p.step);
        // (another stage's parameters are empty here: no rows to step, so their undefined
        // gradients are never read)
        let mut grads: Vec<Tensor> = (0..self.params.len()).map(|_| Tensor::new()).collect();
        for (j, i) in p.params.iter().enumerate() {
            grads[*i] = p.grads[j].shallow_clone();
        }
        // ("gradients": the pending step holds this rank's rows of the sum alone)
        let rows = self.spec.sharding == Sharding::Gradients;
        self.sharded_update(comm, g, &grads, lr, rows)?;
        ledger_line(
            &mut self.ledger,
            serde_json::json!({"g": p.generation, "s": p.step, "r": rank, "applied": true}),
        );
        self.step = p.step + 1;
        Ok(())
    }

    /// One step of a pipeline generation (spares only join the commit). Under full sharding
    /// (3D: `sharding = "full"` with stages) each rank holds its rows of its stage's
    /// parameters between steps: the step gathers them whole over the shard group first (a
    /// stage runs every micro-batch of the step on them: gathered once, as torchtitan's FSDP
    /// under pipelines with `reshard_after_forward = False`), each replica receives its rows
    /// of the summed gradient (as under "gradients"), and the rows go back before the
    /// optimizer steps them; whatever happens, the rank ends the step holding its rows.
    pub(super) fn pipe_step(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
        pending: &mut Option<Pending>,
    ) -> Result<f64, CommError> {
        let mut rests = Vec::new();
        let r = self.pipe_step_holding(comm, g, me, pending, &mut rests);
        self.release_stage(std::mem::take(&mut rests));
        r
    }

    /// Put back the rows of a stage's parameters [`Trainer::pipe_step`] gathered, freeing
    /// the whole parameters and their gradients.
    fn release_stage(&mut self, rests: Vec<(usize, Tensor)>) {
        for (i, _) in &rests {
            drop(self.take_grad(*i));
        }
        self.release(rests);
    }

    /// The optimizer's step on this rank's rows of its stage's parameters (full sharding
    /// with stages), with `p` holding its rows of the summed gradients.
    fn apply_rows(&mut self, p: &Pending, rank: u32) {
        let lr = self.spec.lr_plan().at(p.step);
        let mut grads: Vec<Tensor> = (0..self.params.len()).map(|_| Tensor::new()).collect();
        for (j, i) in p.params.iter().enumerate() {
            grads[*i] = p.grads[j].shallow_clone();
        }
        // (another stage's parameters, and rows of none, are empty: not stepped)
        self.step_rows(&grads, lr);
        ledger_line(
            &mut self.ledger,
            serde_json::json!({"g": p.generation, "s": p.step, "r": rank, "applied": true}),
        );
        self.step = p.step + 1;
    }

    /// [`Trainer::pipe_step`]'s work; `rests`: the rows of the parameters gathered whole.
    fn pipe_step_holding(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
        pending: &mut Option<Pending>,
        rests: &mut Vec<(usize, Tensor)>,
    ) -> Result<f64, CommError> {
        let b = self.spec.global_batch as u64;
        let base = self.step * b;
        let (p, dp) = (g.layout.pipeline_parallel.max(1), g.layout.data_parallel);
        let rank = me.rank;
        let mut loss = 0f64;
        let mut which = Vec::new();
        let mut reduced = Vec::new();
        // `max_grad_norm`: this rank's pieces of the norm (replica 0 counts them)
        let mut norm_row = Vec::new();
        if !me.spare {
            let Place {
                stage,
                units,
                bounds,
                v,
                last_chunk,
                mine,
                mesh,
                c,
                prev,
                next,
            } = self.pipeline_place(g, me);
            // (a parameter two of this stage's chunks hold, a tied head's, is listed with the
            // first: its gradient is complete after that chunk's backward, which runs last)
            let mut listed = std::collections::BTreeSet::new();
            let which_of: Vec<Vec<usize>> = mine
                .iter()
                .map(|r| {
                    self.params_in(std::slice::from_ref(r))
                        .into_iter()
                        .filter(|i| listed.insert(*i))
                        .collect()
                })
                .collect();
            which = which_of.concat();
            if self.holds_param_rows() {
                let grp = self.shard_group(comm, g)?;
                *rests = self.gather_params(comm, &grp, &which)?;
                for &i in &which {
                    self.start_grad(i);
                }
            }
            let mbs = self.micro_plan(dp, me.dp_rank, p);
            if stage == 0 || mine.iter().any(|r| r.end == units) {
                let ahead: Vec<(u64, u64)> = mbs.iter().map(|(s, l, _)| (*s, *l)).collect();
                self.read_ahead(&ahead);
            }
            let m = mbs.len() as u32;
            let ops = stage_ops(self.spec.schedule, p, m, stage);
            let (first, last) = (stage == 0, stage + 1 == p);
            let counts = Mesh::counts_loss(c);
            let mut tapes: Vec<Option<crate::model::Tape>> = (0..m * v).map(|_| None).collect();
            self.zero_grads();
            let outbox = Outbox::new(comm.clone());
            let mut mail = Mailbox::new(self.spec.schedule, p, m, stage, |s| mesh.stage_peer(c, s));
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
            // and a head tied to the embedding on another stage: its gradient of each
            // micro-batch, kept apart for the fold below
            let tied = self
                .shared_with(g, stage, &which)
                .filter(|_| self.spec.deterministic)
                .and_then(|(t, _)| Some((t, which_of.iter().position(|w| w.contains(&t))?)));
            let mut tied_parts: BTreeMap<u32, Tensor> = BTreeMap::new();
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
                        // compute time: from the input being here to the output sent
                        let t0 = std::time::Instant::now();
                        let r = &mine[j as usize];
                        let mut tape = crate::model::Tape::default();
                        let out = self.model.forward(r.start, r.end, &input, &mut tape)?;
                        if k == last_chunk {
                            let y = self.data.batch(&idx).1.to_device(self.dev);
                            let l = self.model.loss(&out, &y, &mut tape)? / b as f64;
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
                        self.computed += t0.elapsed();
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
                        let t0 = std::time::Instant::now();
                        self.model.backward(tape, &out, grad.as_ref())?;
                        if let Some(input) = inputs[key(i, j)].take() {
                            outbox.send(input.grad().contiguous(), prev);
                        }
                        self.computed += t0.elapsed();
                        if let Some((t, _)) = tied.filter(|(_, at)| *at == j as usize) {
                            tied_parts.insert(i, self.grad_copy(t));
                            self.zero_grads_of([t]);
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
            // a parameter the first and the last stage both hold (a head tied to the
            // embedding): each adds the other's gradient to its own, logical shard by shard,
            // so both copies take the same update (a + b and b + a are the same bits)
            if let Some((i, other)) = self.shared_with(g, stage, &which) {
                let peer = mesh.stage_peer(c, other);
                let at: i64 = which
                    .iter()
                    .take_while(|j| **j != i)
                    .map(|j| self.params[*j].numel() as i64)
                    .sum();
                let n = self.params[i].numel() as i64;
                if tied.is_some() {
                    let earlier = self.param_unit[i].min(self.param_also[i].unwrap_or(usize::MAX));
                    let units = self.units() as u32;
                    let own_is_earlier = g.stage_of(earlier as u32, units) == stage;
                    self.fold_tied(
                        comm,
                        peer,
                        (&mbs, &mut tied_parts),
                        own_is_earlier,
                        (&mut shards, at, n),
                    )?;
                } else {
                    for (_, s) in shards.iter_mut() {
                        let mut mine = s.narrow(0, at, n);
                        let sent = comm.place(&mine.contiguous());
                        let theirs = comm.zeros(&[n], mine.kind());
                        comm.exchange(&[(peer, &sent)], &[(peer, &theirs)])?;
                        mine += theirs.into_tensor();
                    }
                }
            }
            if first && counts {
                ledger_line(
                    &mut self.ledger,
                    serde_json::json!({"g": g.number, "s": self.step, "r": rank, "idx": used}),
                );
            }
            // the stage's replicas fold their gradients along a chain in replica order; the
            // last sends the result back to the others
            let group: Vec<u32> = mesh.replicas(c);
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
            // `sharding = "gradients"` (and "full"): the last replica sends each other one its
            // rows of the summed gradient only (its shard place's, as its optimizer state holds
            // them), and counts the norm on the whole; else every replica gets the whole sum
            // and replica 0 counts the norm
            let rows = matches!(self.spec.sharding, Sharding::Gradients | Sharding::Full)
                && self.shard_held.0 > 1;
            let l = group.len() - 1;
            if j < l {
                comm.send(&placed, group[j + 1])?;
                if rows {
                    let n: i64 = which
                        .iter()
                        .map(|i| self.row_shape(*i, j as u32).iter().product::<i64>())
                        .sum();
                    let got = comm.zeros(&[n], placed.tensor().kind());
                    comm.recv(&got, group[l])?;
                    acc_g = got.into_tensor();
                } else {
                    comm.recv(&placed, group[l])?;
                    acc_g = placed.into_tensor();
                }
            } else {
                if !rows {
                    for peer in &group[..l] {
                        comm.send(&placed, *peer)?;
                    }
                }
                acc_g = placed.into_tensor();
            }
            let whole = j == l || !rows;
            let mut at = 0;
            for i in &which {
                let shape = if whole {
                    self.params[*i].size()
                } else {
                    self.row_shape(*i, j as u32)
                };
                let k = shape.iter().product::<i64>();
                reduced.push(acc_g.narrow(0, at, k).view(shape.as_slice()));
                at += k;
            }
            if last && counts {
                loss = f64::try_from(acc.to_device(Device::Cpu)).unwrap_or(f64::NAN);
            }
            if self.spec.max_grad_norm.is_some() && j == if rows { l } else { 0 } {
                // a replicated parameter is counted by tensor place 0, a tied one by the stage
                // of its own unit
                norm_row = self.norm_row(g, &which, &reduced, |i, replicated| {
                    (!replicated || me.tp_rank == 0)
                        && super::reshard::holds_unit(&mine, self.param_unit[i])
                });
            }
            if rows && j == l {
                for (q, peer) in group[..l].iter().enumerate() {
                    let theirs: Vec<Tensor> = which
                        .iter()
                        .zip(&reduced)
                        .map(|(i, t)| self.rows_of(*i, q as u32, t).reshape([-1]))
                        .collect();
                    comm.send(&comm.place(&Tensor::cat(&theirs, 0)), *peer)?;
                }
                // its own rows, copied: the whole sum goes
                reduced = which
                    .iter()
                    .zip(&reduced)
                    .map(|(i, t)| self.rows_of(*i, l as u32, t).copy())
                    .collect();
            }
        }
        if let Some(max) = self.spec.max_grad_norm {
            // every rank (spares too) adds its row: the norm over every stage, tensor place
            // and shard, the same on every rank; the reduced gradients are clipped before they
            // are applied or kept pending
            if norm_row.is_empty() {
                norm_row = vec![0.0; self.norm_slots(g)];
            }
            let norm = super::norm::row_norm(&comm.host().sum_f64(&norm_row)?);
            super::norm::clip_to(&reduced, norm, max);
            self.grad_norm = Some(norm);
        }
        // the commit: loss and checkpoint flags over the whole world. A step whose commit
        // fails is kept pending (the next agreement applies it if the commit went through
        // elsewhere), except where the optimizer state is sharded: its update needs the shard
        // group, so such a rank is behind and takes its stage's state from a holder
        let p = Pending {
            step: self.step,
            generation: g.number,
            params: which.clone(),
            grads: reduced,
        };
        let kept = if self.shard_held.0 > 1 {
            Some(p)
        } else {
            *pending = Some(p);
            None
        };
        let (pending_ck, busy) = self.ckpt_flags(g.number);
        // control data: on the host face, whatever the backend
        let v = comm
            .host()
            .sum_f64(&[loss, pending_ck as f64, busy as f64])?;
        self.flags = (v[1] > 0.0, v[2] > 0.0);
        match kept {
            Some(p) if self.holds_param_rows() => {
                self.release_stage(std::mem::take(rests));
                self.apply_rows(&p, rank);
            }
            Some(p) => self.apply_sharded(comm, g, &p, rank)?,
            None => {
                let p = pending.take().unwrap();
                self.apply(&p.params, &p.grads, p.step, p.generation, rank);
            }
        }
        // the other stages' copies are stale from this step on: release them
        let held = self.held.clone();
        self.hold_only(&held);
        Ok(v[0])
    }
}

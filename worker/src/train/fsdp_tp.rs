//! Full sharding under tensor groups (`sharding = "full"` with `strategy = "hybrid"`, a fixed
//! `tensor_parallel` and one stage: torchtitan's 2D FSDP + TP). Each rank holds its rows
//! ([`ductile_strategies::split_range`] of dim 0 of its tensor slice's local tensor, the boxes
//! [`super::tensor::shard_rows`] cuts, so the agreement, the checkpoints and the cold start
//! move and read them as any other box) of its slice of every parameter, of its optimizer
//! state and of the summed gradient, over the shard group of its tensor place's replicas.
//!
//! The step runs the model unit by unit, as the data-parallel fully sharded step does
//! ([`super::fsdp`]): forward, each unit's slices are all-gathered over the shard group, the
//! unit runs without gradients (its tensor group's collectives all the same) on every
//! micro-batch, keeping only its input, and the slices are released; backward, in reverse,
//! each unit is gathered again and run again with its cuts on a tape, and its backward
//! ([`crate::model::Model::backward`], through the tensor group's cuts) leaves each
//! parameter's gradient on the gathered slice. Once a parameter's last use is done (a tied
//! head's embedding: after the embedding's unit) its gradient is taken off the parameter and
//! reduce-scattered over the shard group (an all-to-all of rows, folded in group order), then
//! with HSDP all-reduced over the other shard groups' members at the same place. The
//! gathers and the reductions run in one order on the step's [`super::overlap::CommQueue`]:
//! where the node has a core to spare ([`Trainer::comm_thread`], the CPU), on a thread of
//! their own, the next unit's gather while this one computes and a unit's reduction while
//! the unit below it computes (the unit computed and the one gathered are whole); else each
//! in turn with the units (one unit whole at a time). The tensor group's collectives (the
//! cuts inside each unit) stay on the step's thread: the shard group (one tensor place's
//! replicas) and the tensor group (one replica's places) share no peer, and the TCP
//! communicator's point-to-point calls take only their peer's socket, so the two run at
//! once. The optimizer steps the rank's rows alone.
//!
//! Deterministic mode ends with the unsharded tensor layout's bits (its step is
//! [`super::pipe`]'s at one stage): each logical shard's gradient accumulates apart, from
//! zeros, micro-batch by micro-batch on the parameter as that step's does (a tied embedding
//! adds the head's gradient of each micro-batch before its own, as the whole model's backward
//! does), and each unit's are folded along the tensor place's replicas in replica order, each
//! adding its logical shards in order (the chain of that step, so the sum is the fold in
//! global shard order); the last replica sends each one its rows and counts the clipping
//! norm's squares from the whole sums, in that step's pieces. The chain waits on each replica
//! in turn: deterministic mode buys its bits with that. Its sends run on the step's thread,
//! to the shard group's peers, so the gather in flight is waited for before each fold
//! ([`super::overlap::Ticket::settle`]): the gathers still overlap the backward, the folds
//! do not.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use ductile_cluster::records::{Generation, Member};
use ductile_comm::group::fold;
use ductile_comm::{CommError, Communicator, Group};
use ductile_strategies::mesh::{Coords, Mesh};
use ductile_strategies::tensor::{split_of, Split};
use tch::{Device, Kind, Tensor};

use super::fsdp::{Gathering, StepShape};
use super::overlap::{CommQueue, Ticket};
use super::{ledger_line, Trainer};
use crate::model::Tape;

/// One micro-batch: tokens (or features) and targets.
type Micro = (Tensor, Tensor);

impl Trainer {
    /// Whether `g` runs the 2D step: full sharding under tensor groups, one stage.
    pub(super) fn full_under_tp(&self, g: &Generation) -> bool {
        self.fully_sharded() && g.layout.tensor_parallel > 1 && g.layout.pipeline_parallel <= 1
    }

    /// One step of a fully sharded generation with tensor groups (see the module's comment);
    /// spares only join the commit. Returns the step's mean loss.
    pub(super) fn full_tp_step(
        &mut self,
        arc: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
    ) -> Result<f64, CommError> {
        let t0 = Instant::now();
        // this rank's (loss, sum of squares of the gradient rows it counts)
        let mut row = [0f64; 2];
        // deterministic mode with clipping: the tensor layout's row of squares, taken from
        // each parameter's whole sum (a spare's, zeros), so the norm has its bits
        let ordered_norm = self.spec.deterministic && self.spec.max_grad_norm.is_some();
        let mut norm_parts = match ordered_norm {
            true => vec![0.0; self.norm_slots(g)],
            false => Vec::new(),
        };
        let grads = if me.spare {
            Vec::new()
        } else {
            let grads = self.full_tp_grads(arc, g, me, &mut row, &mut norm_parts)?;
            self.computed_for(me.rank, t0);
            grads
        };
        let (pending, busy) = self.ckpt_flags(g.number);
        let mut control = vec![row[0], row[1], pending as f64, busy as f64];
        control.extend(norm_parts);
        // control data: on the host face, over the whole world (spares too)
        let v = arc.host().sum_f64(&control)?;
        self.flags = (v[2] > 0.0, v[3] > 0.0);
        if let Some(max) = self.spec.max_grad_norm {
            let norm = match ordered_norm {
                true => super::norm::row_norm(&v[4..]),
                false => v[1].sqrt(),
            };
            super::norm::clip_to(&grads, norm, max);
            self.grad_norm = Some(norm);
        }
        let lr = self.spec.lr_plan().at(self.step);
        self.step_rows(&grads, lr);
        ledger_line(
            &mut self.ledger,
            serde_json::json!({"g": g.number, "s": self.step, "r": me.rank, "applied": true, "lr": lr, "loss": v[0]}),
        );
        self.step += 1;
        Ok(v[0])
    }

    /// The forward and backward of a working rank: its rows of every parameter's summed
    /// gradient; `row` gets its loss (a tensor group's first member counts it) and, with
    /// `max_grad_norm`, the sum of squares of the rows it counts (shard group 0's members; a
    /// parameter every tensor place holds whole, by place 0), or in deterministic mode
    /// `norm` gets the squares of the pieces the tensor layout counts, from the whole sums.
    fn full_tp_grads(
        &mut self,
        arc: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
        row: &mut [f64; 2],
        norm: &mut [f64],
    ) -> Result<Vec<Tensor>, CommError> {
        let mesh = Mesh::new(&g.layout);
        let c = Coords {
            dp: me.dp_rank,
            stage: me.pp_stage,
            tp: me.tp_rank,
        };
        let s = self.shard_held.0;
        let dp = g.layout.data_parallel.max(1);
        let grp = Some(Group::new(arc.clone(), mesh.shard_group(c, s))?);
        // HSDP: the members of the other shard groups at this place hold the same rows
        let across = self.replica_group(arc, g)?;
        let units = self.units();
        // (a thread where this node has a core to spare for it, [`Trainer::comm_thread`]: at
        // dp2 × tp2 with a rank per core, threaded gathers ran at 0.98× the inline step's
        // samples/s, `ductile-bench fsdp-tp`, and held one unit more)
        let threaded = self.comm_thread(g);
        let how = StepShape {
            keep: false,
            grouped: across.is_some(),
            threaded,
        };
        self.tell_step(g, units, how);
        let counts = Mesh::counts_loss(c);
        // the micro-batches of every part (a logical shard in deterministic mode), in order,
        // and each part's: its logical shard and its micro-batches' range
        let mut spans: Vec<(u64, Range<usize>)> = Vec::new();
        let mut micro: Vec<Micro> = Vec::new();
        for p in self.step_parts_of(g, (dp, me.dp_rank), me.rank, counts) {
            spans.push((p.k, micro.len()..micro.len() + p.micro.len()));
            micro.extend(p.micro);
        }
        let ordered = self.spec.deterministic;
        // (deterministic mode: the chain of this tensor place's replicas, in replica order)
        let chain = mesh.replicas(c);
        // a tied parameter's gradients from its later unit, per micro-batch
        let mut later: BTreeMap<usize, Vec<Tensor>> = BTreeMap::new();
        // each unit's input per micro-batch (the last unit runs in the backward only)
        let mut inputs: Vec<Vec<Tensor>> =
            micro.iter().map(|(x, _)| vec![x.shallow_clone()]).collect();
        let mut go: Vec<Option<Tensor>> = micro.iter().map(|_| None).collect();
        let mut loss = Tensor::zeros([1], (Kind::Double, self.dev));
        let mut rows_grad: Vec<Option<Tensor>> = (0..self.params.len()).map(|_| None).collect();
        // the units in the order they are gathered: forward (but the last), then backward
        let order: Vec<usize> = (0..units.saturating_sub(1))
            .chain((0..units).rev())
            .collect();
        // the shard group's collectives, in one order, on a thread of their own: each unit's
        // gather while the unit before it computes, each unit's reduction while the unit
        // after it (in the backward) computes. The tensor group's collectives stay on this
        // thread; the two groups share no peer, and point-to-point calls take only their
        // peer's socket, so they run at once. Inline, each gather runs when its unit comes
        // (one unit whole at a time).
        let queue = CommQueue::for_step(threaded)?;
        // (threaded: the gather of the unit to come, started while this one computes)
        let mut next: Gathering = None;
        if let (Some(&u0), true) = (order.first(), threaded) {
            next = self.start_gather(&queue, arc, &grp, &self.unit_params(u0));
        }
        let mut reducing: Option<(Vec<usize>, Ticket<Tensor>)> = None;
        for (at, &u) in order.iter().enumerate() {
            let ps = self.unit_params(u);
            // inline, this unit's gather runs now, the unit before released
            let pending = match threaded {
                true => next.take(),
                false => self.start_gather(&queue, arc, &grp, &ps),
            };
            let rests = self.finish_gather(&ps, pending)?;
            // threaded, the next unit's starts now (its rows read even where the two share a
            // parameter, a tied head beside its embedding)
            if let (Some(&v), true) = (order.get(at + 1), threaded) {
                next = self.start_gather(&queue, arc, &grp, &self.unit_params(v));
            }
            if at + 1 < units {
                // forward, without gradients
                let r = tch::no_grad(|| -> Result<(), CommError> {
                    for acts in inputs.iter_mut() {
                        let x = acts.last().expect("an input");
                        let y = self.model.forward_unit(u, x, &mut Tape::default())?;
                        acts.push(y);
                    }
                    Ok(())
                });
                self.release(rests);
                r?;
                continue;
            }
            // backward: the gradients whose last use is this unit's backward
            let done: Vec<usize> = ps
                .iter()
                .copied()
                .filter(|i| self.done_at(*i) == u)
                .collect();
            if ordered {
                // each part's gradients of `done`, flat
                let r = self.unit_backward_ordered(
                    u,
                    (&micro, &spans),
                    (&mut inputs, &mut go),
                    &mut loss,
                    &mut later,
                    &done,
                );
                self.release(rests);
                let per_part = r?;
                if !done.is_empty() {
                    // the fold's sends run here, to the shard group's peers: the gather in
                    // flight is waited for first, so that the two keep their order
                    next = next.take().map(Ticket::settle);
                    self.fold_rows(arc, g, (&chain, me), &done, per_part, &mut rows_grad, norm)?;
                }
                continue;
            }
            let r = self.unit_backward(u, &micro, &mut inputs, &mut go, &mut loss);
            // taken off the parameters
            let gs: Vec<Tensor> = done.iter().map(|i| self.take_grad(*i)).collect();
            self.release(rests);
            r?;
            if !done.is_empty() {
                // the unit after this one has been reduced meanwhile: keep its rows
                if let Some((ids, t)) = reducing.take() {
                    self.keep_rows(&ids, &t.wait()?, &mut rows_grad);
                }
                let shard = grp.as_ref().expect("a shard group");
                let t = self.submit_rows(&queue, shard, &across, &done, gs);
                reducing = Some((done, t));
            }
        }
        if let Some((ids, t)) = reducing.take() {
            self.keep_rows(&ids, &t.wait()?, &mut rows_grad);
        }
        drop(queue);
        if counts {
            row[0] = f64::try_from(loss.to_device(Device::Cpu)).unwrap_or(f64::NAN);
        }
        let grads = self.rows_or_zeros(rows_grad);
        if self.spec.max_grad_norm.is_some() && !ordered && me.dp_rank / s == 0 {
            let arch = self.model.arch();
            let names = self.param_names();
            row[1] = super::norm::sum_squares(
                grads
                    .iter()
                    .zip(&names)
                    .filter(|(_, n)| me.tp_rank == 0 || split_of(arch, n) != Split::Replicated)
                    .map(|(g, _)| g),
            );
        }
        Ok(grads)
    }

    /// Unit `u`'s backward on every micro-batch, its parameters gathered: run again from its
    /// kept input with its cuts on a tape, then backward from the loss (the last unit; its
    /// value added to `loss`) or from the output's gradient in `go`, which gets the input's.
    fn unit_backward(
        &self,
        u: usize,
        micro: &[Micro],
        inputs: &mut [Vec<Tensor>],
        go: &mut [Option<Tensor>],
        loss: &mut Tensor,
    ) -> Result<(), CommError> {
        for i in self.unit_params(u) {
            // the first backward to use a parameter (the head, for one tied to it) starts its
            // gradient from zeros: one taken last step is an empty tensor, and a step that
            // failed midway may have left a partial one
            let first =
                self.param_also[i].map_or(self.param_unit[i], |a| a.max(self.param_unit[i]));
            let mut gr = self.params[i].grad();
            if gr.defined() && (first == u || gr.size() != self.params[i].size()) {
                tch::no_grad(|| gr.set_data(&self.params[i].zeros_like()));
            }
        }
        for m in 0..micro.len() {
            self.micro_backward(u, m, micro, (inputs, go), loss)?;
        }
        Ok(())
    }

    /// Unit `u`'s backward on micro-batch `m` (see [`Trainer::unit_backward`]): its parameters'
    /// gradients accumulate.
    fn micro_backward(
        &self,
        u: usize,
        m: usize,
        micro: &[Micro],
        (inputs, go): (&mut [Vec<Tensor>], &mut [Option<Tensor>]),
        loss: &mut Tensor,
    ) -> Result<(), CommError> {
        let last = u + 1 == self.units();
        let x = inputs[m].pop().expect("the unit's input");
        let x = if u > 0 {
            x.detach().set_requires_grad(true)
        } else {
            x
        };
        let mut tape = Tape::default();
        let out = self.model.forward_unit(u, &x, &mut tape)?;
        if last {
            let l = self.model.loss(&out, &micro[m].1, &mut tape)? / self.spec.global_batch as f64;
            *loss += l.detach().to_kind(Kind::Double).reshape([1]);
            self.model.backward(tape, &l, None)?;
        } else {
            let g = go[m].take().expect("the output's gradient");
            self.model.backward(tape, &out, Some(&g))?;
        }
        if u > 0 {
            let gi = x.grad();
            go[m] = Some(if gi.defined() { gi } else { x.zeros_like() });
        }
        Ok(())
    }

    /// [`Trainer::unit_backward`] in deterministic mode, where each part (logical shard) has
    /// a gradient of its own, accumulated as the tensor layout's step accumulates it: from
    /// zeros, micro-batch by micro-batch on the parameter. A tied parameter's gradient from
    /// its later unit is kept per micro-batch in `later`, and its earlier unit adds, for each
    /// micro-batch, that one and then its own, as the whole model's backward does. Returns
    /// each part's gradients of `done` (flat, in order); their whole tensors are freed.
    fn unit_backward_ordered(
        &self,
        u: usize,
        (micro, spans): (&[Micro], &[(u64, Range<usize>)]),
        (inputs, go): (&mut [Vec<Tensor>], &mut [Option<Tensor>]),
        loss: &mut Tensor,
        later: &mut BTreeMap<usize, Vec<Tensor>>,
        done: &[usize],
    ) -> Result<Vec<(u64, Tensor)>, CommError> {
        let ps = self.unit_params(u);
        // a tied parameter an earlier unit uses too: its gradient of each micro-batch, kept
        let keep: Vec<usize> = ps
            .iter()
            .copied()
            .filter(|i| self.done_at(*i) < u)
            .collect();
        // a tied parameter whose later unit kept its gradients: summed here explicitly
        let adds: Vec<usize> = done
            .iter()
            .copied()
            .filter(|i| later.contains_key(i))
            .collect();
        let mut out = Vec::with_capacity(spans.len());
        for (k, range) in spans {
            for &i in &ps {
                self.start_grad(i);
            }
            let mut sums: BTreeMap<usize, Tensor> = adds
                .iter()
                .map(|&i| (i, self.params[i].zeros_like()))
                .collect();
            for m in range.clone() {
                for &i in keep.iter().chain(&adds) {
                    self.start_grad(i);
                }
                self.micro_backward(u, m, micro, (inputs, go), loss)?;
                for &i in &keep {
                    later.entry(i).or_default().push(self.grad_copy(i));
                }
                for &i in &adds {
                    let h = &later[&i][m];
                    let sum = sums.get_mut(&i).expect("a sum");
                    *sum = tied_sum(sum, h, &self.grad_copy(i));
                }
            }
            let flat: Vec<Tensor> = done
                .iter()
                .map(|i| match sums.get(i) {
                    Some(t) => t.reshape([-1]),
                    None => self.grad_copy(*i).reshape([-1]),
                })
                .collect();
            out.push((*k, Tensor::cat(&flat, 0)));
        }
        for &i in done {
            later.remove(&i);
            drop(self.take_grad(i));
        }
        Ok(out)
    }

    /// Start parameter `i`'s gradient from zeros (in place, as the tensor layout's step
    /// zeroes it); one taken last step (an empty tensor) is replaced.
    pub(super) fn start_grad(&self, i: usize) {
        let mut gr = self.params[i].grad();
        if !gr.defined() {
            return;
        }
        if gr.size() == self.params[i].size() {
            let _ = gr.zero_();
        } else {
            tch::no_grad(|| gr.set_data(&self.params[i].zeros_like()));
        }
    }

    /// A copy of parameter `i`'s gradient, zeros where it has none.
    pub(super) fn grad_copy(&self, i: usize) -> Tensor {
        let gr = self.params[i].grad();
        match gr.defined() && gr.size() == self.params[i].size() {
            true => gr.copy(),
            false => self.params[i].zeros_like(),
        }
    }

    /// Deterministic mode: fold parameters `ids`' gradients (`per_part`: this replica's
    /// logical shards', flat) over the replicas of its tensor place (`chain`, in replica
    /// order) as the tensor layout's step folds them: along the chain, each adding its
    /// logical shards in order, so the sum is the fold in global shard order; the last then
    /// sends each replica its rows and counts the norm's squares in `norm` from the whole sum.
    #[allow(clippy::too_many_arguments)]
    fn fold_rows(
        &self,
        arc: &Arc<dyn Communicator>,
        g: &Generation,
        (chain, me): (&[u32], &Member),
        ids: &[usize],
        per_part: Vec<(u64, Tensor)>,
        rows_grad: &mut [Option<Tensor>],
        norm: &mut [f64],
    ) -> Result<(), CommError> {
        let comm = arc.as_ref();
        let (j, l) = (me.dp_rank as usize, chain.len() - 1);
        let s = self.shard_held.0;
        let numel = |i: usize| -> i64 { self.gathered[i].iter().product() };
        let kind = per_part.first().map_or(Kind::Float, |(_, t)| t.kind());
        let mut parts = per_part.into_iter().map(|(_, t)| t);
        let mut sum = if j > 0 {
            let n: i64 = ids.iter().map(|i| numel(*i)).sum();
            let got = comm.zeros(&[n], kind);
            comm.recv(&got, chain[j - 1])?;
            got.into_tensor()
        } else {
            parts.next().expect("a logical shard").copy()
        };
        for t in parts {
            sum += t;
        }
        // parameter i's whole sum, and its rows at place `k`
        let whole = |t: &Tensor, at: &mut i64, i: usize| -> Tensor {
            let v = t.narrow(0, *at, numel(i)).view(self.gathered[i].as_slice());
            *at += numel(i);
            v
        };
        let rows_at = |t: &Tensor, k: u32| -> Tensor {
            let mut at = 0;
            let pieces: Vec<Tensor> = ids
                .iter()
                .map(|&i| {
                    let (r0, rn) = self.rows(i, k);
                    whole(t, &mut at, i).narrow(0, r0, rn).reshape([-1])
                })
                .collect();
            Tensor::cat(&pieces, 0)
        };
        let mine = if j < l {
            comm.send(&comm.place(&sum), chain[j + 1])?;
            let n: i64 = ids
                .iter()
                .map(|i| self.rows(*i, me.dp_rank % s).1 * self.row_numel(*i))
                .sum();
            let got = comm.zeros(&[n], kind);
            comm.recv(&got, chain[l])?;
            got.into_tensor()
        } else {
            for (q, peer) in chain[..l].iter().enumerate() {
                comm.send(&comm.place(&rows_at(&sum, q as u32 % s)), *peer)?;
            }
            if !norm.is_empty() {
                let mut at = 0;
                let views: Vec<Tensor> = ids.iter().map(|&i| whole(&sum, &mut at, i)).collect();
                let r = self.norm_row(g, ids, &views, |_, replicated| {
                    !replicated || me.tp_rank == 0
                });
                for (a, b) in norm.iter_mut().zip(r) {
                    *a += b;
                }
            }
            rows_at(&sum, me.dp_rank % s)
        };
        self.keep_rows(ids, &mine, rows_grad);
        Ok(())
    }

    /// Keep this rank's rows of parameters `ids`' summed gradients, laid one after the other
    /// in `flat`, in `rows_grad`.
    fn keep_rows(&self, ids: &[usize], flat: &Tensor, rows_grad: &mut [Option<Tensor>]) {
        let mut at = 0;
        for &i in ids {
            let (_, rn) = self.rows(i, self.shard_held.1);
            let len = rn * self.row_numel(i);
            if rn > 0 {
                let mut shape = self.gathered[i].clone();
                shape[0] = rn;
                rows_grad[i] = Some(flat.narrow(0, at, len).view(shape.as_slice()).copy());
            }
            at += len;
        }
    }

    /// Parameter `i`'s gradient, taken off it: the parameter keeps an empty one (the whole
    /// tensor is freed once the caller drops it).
    pub(super) fn take_grad(&self, i: usize) -> Tensor {
        let mut gr = self.params[i].grad();
        if !gr.defined() || gr.size() != self.params[i].size() {
            return self.params[i].zeros_like();
        }
        let taken = gr.detach();
        tch::no_grad(|| gr.set_data(&Tensor::empty([0], (gr.kind(), gr.device()))));
        taken
    }

    /// Submit the sum of parameters `ids`' gradients `gs` (this rank's, of its gathered
    /// slices) over the replicas of its tensor place to `queue`; the ticket answers this
    /// rank's rows of the sums, laid one after the other (for [`Trainer::keep_rows`]). Each
    /// member of the shard group sends every other one their rows (an all-to-all) and folds
    /// what it receives in group order; with HSDP the rows are then summed over the other
    /// shard groups (a ring past two of them). The packing is done here, so the whole
    /// gradients are free once this returns. (Not in deterministic mode, whose folds keep
    /// their order: the data-parallel step's HSDP calls it too.)
    pub(super) fn submit_rows(
        &self,
        queue: &CommQueue,
        grp: &Group,
        across: &Option<Group>,
        ids: &[usize],
        gs: Vec<Tensor>,
    ) -> Ticket<Tensor> {
        let (s, place) = self.shard_held;
        let flat_rows = |k: u32| -> Tensor {
            let pieces: Vec<Tensor> = ids
                .iter()
                .zip(&gs)
                .filter_map(|(i, gr)| {
                    let (r0, rn) = self.rows(*i, k);
                    (rn > 0).then(|| gr.narrow(0, r0, rn).reshape([-1]))
                })
                .collect();
            match pieces.is_empty() {
                true => Tensor::zeros([0], (Kind::Float, self.dev)),
                false => Tensor::cat(&pieces, 0).to_kind(Kind::Float),
            }
        };
        let parts: Vec<Tensor> = (0..s).map(flat_rows).collect();
        drop(gs);
        let mine: i64 = ids
            .iter()
            .map(|i| self.rows(*i, place).1 * self.row_numel(*i))
            .sum();
        let (grp, across) = (grp.clone(), across.clone());
        queue.submit("reduce_scatter", move || {
            let got = grp.all_to_all(&parts, &vec![vec![mine]; s as usize])?;
            drop(parts);
            let sum = fold(&got);
            match &across {
                Some(a) if a.size() > 2 => a.ring_all_reduce_sum(&sum),
                Some(a) => a.all_reduce_sum(&sum),
                None => Ok(sum),
            }
        })
    }
}

/// One micro-batch added to a tied parameter's gradient in the whole model's order (the
/// data-parallel step's: its head's use first, then its own), so that the ordered steps that
/// hold the two uses apart (`unit_backward_ordered`, `pipe_step`'s `fold_tied`) give its bits.
pub(super) fn tied_sum(sum: &Tensor, head: &Tensor, own: &Tensor) -> Tensor {
    (sum + head) + own
}

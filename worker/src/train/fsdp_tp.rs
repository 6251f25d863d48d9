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
//! with HSDP all-reduced over the other shard groups' members at the same place. Only the
//! unit being computed is whole. The gathers and the reductions run on the step's thread (the
//! tensor group's collectives share the communicator with them); the optimizer steps the
//! rank's rows alone. Not bitwise deterministic (refused at submit with `deterministic`).

use std::sync::Arc;
use std::time::Instant;

use ductile_cluster::records::{Generation, Member};
use ductile_comm::group::fold;
use ductile_comm::{CommError, Communicator, Group};
use ductile_strategies::mesh::{Coords, Mesh};
use ductile_strategies::tensor::{split_of, Split};
use tch::{Device, Kind, Tensor};

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
        let grads = if me.spare {
            Vec::new()
        } else {
            let grads = self.full_tp_grads(arc, g, me, &mut row)?;
            self.computed_for(me.rank, t0);
            grads
        };
        let (pending, busy) = self.ckpt_flags(g.number);
        // control data: on the host face, over the whole world (spares too)
        let v = arc
            .host()
            .sum_f64(&[row[0], row[1], pending as f64, busy as f64])?;
        self.flags = (v[2] > 0.0, v[3] > 0.0);
        if let Some(max) = self.spec.max_grad_norm {
            let norm = v[1].sqrt();
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
    /// parameter every tensor place holds whole, by place 0).
    fn full_tp_grads(
        &mut self,
        arc: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
        row: &mut [f64; 2],
    ) -> Result<Vec<Tensor>, CommError> {
        let mesh = Mesh::new(&g.layout);
        let c = Coords {
            dp: me.dp_rank,
            stage: me.pp_stage,
            tp: me.tp_rank,
        };
        let (s, place) = self.shard_held;
        let dp = g.layout.data_parallel.max(1);
        let grp = Some(Group::new(arc.clone(), mesh.shard_group(c, s))?);
        // HSDP: the members of the other shard groups at this place hold the same rows
        let peers: Vec<u32> = (0..dp)
            .filter(|d| d % s == place)
            .map(|d| mesh.rank(Coords { dp: d, ..c }))
            .collect();
        let across = match peers.len() > 1 {
            true => Some(Group::new(arc.clone(), peers)?),
            false => None,
        };
        let units = self.units();
        self.tell_step(g, units, false, across.is_some());
        let counts = Mesh::counts_loss(c);
        let micro: Vec<Micro> = self
            .step_parts_of(g, (dp, me.dp_rank), me.rank, counts)
            .into_iter()
            .flat_map(|p| p.micro)
            .collect();
        // forward: each unit's input per micro-batch (the last unit runs in the backward)
        let mut inputs: Vec<Vec<Tensor>> =
            micro.iter().map(|(x, _)| vec![x.shallow_clone()]).collect();
        for u in 0..units.saturating_sub(1) {
            let ps = self.unit_params(u);
            let rests = self.gather_params(arc, &grp, &ps)?;
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
        }
        // backward, unit by unit in reverse
        let mut go: Vec<Option<Tensor>> = micro.iter().map(|_| None).collect();
        let mut loss = Tensor::zeros([1], (Kind::Double, self.dev));
        let mut rows_grad: Vec<Option<Tensor>> = (0..self.params.len()).map(|_| None).collect();
        for u in (0..units).rev() {
            let ps = self.unit_params(u);
            let rests = self.gather_params(arc, &grp, &ps)?;
            let r = self.unit_backward(u, &micro, &mut inputs, &mut go, &mut loss);
            // the gradients whose last use was this unit's backward, taken off the parameters
            let done: Vec<usize> = ps
                .iter()
                .copied()
                .filter(|i| self.done_at(*i) == u)
                .collect();
            let gs: Vec<Tensor> = done.iter().map(|i| self.take_grad(*i)).collect();
            self.release(rests);
            r?;
            if !done.is_empty() {
                let grp = grp.as_ref().expect("a shard group");
                self.reduce_rows(grp, &across, &done, gs, &mut rows_grad)?;
            }
        }
        if counts {
            row[0] = f64::try_from(loss.to_device(Device::Cpu)).unwrap_or(f64::NAN);
        }
        let grads = self.rows_or_zeros(rows_grad);
        if self.spec.max_grad_norm.is_some() && me.dp_rank / s == 0 {
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
        let last = u + 1 == self.units();
        let b = self.spec.global_batch as f64;
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
        for (m, (_, y)) in micro.iter().enumerate() {
            let x = inputs[m].pop().expect("the unit's input");
            let x = if u > 0 {
                x.detach().set_requires_grad(true)
            } else {
                x
            };
            let mut tape = Tape::default();
            let out = self.model.forward_unit(u, &x, &mut tape)?;
            if last {
                let l = self.model.loss(&out, y, &mut tape)? / b;
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
        }
        Ok(())
    }

    /// Parameter `i`'s gradient, taken off it: the parameter keeps an empty one (the whole
    /// tensor is freed once the caller drops it).
    fn take_grad(&self, i: usize) -> Tensor {
        let mut gr = self.params[i].grad();
        if !gr.defined() || gr.size() != self.params[i].size() {
            return self.params[i].zeros_like();
        }
        let taken = gr.detach();
        tch::no_grad(|| gr.set_data(&Tensor::empty([0], (gr.kind(), gr.device()))));
        taken
    }

    /// Sum parameters `ids`' gradients `gs` (this rank's, of its gathered slices) over the
    /// replicas of its tensor place and keep its rows in `rows_grad`: each member of the shard
    /// group sends every other one their rows (an all-to-all) and folds what it receives in
    /// group order; with HSDP the rows are then summed over the other shard groups.
    fn reduce_rows(
        &self,
        grp: &Group,
        across: &Option<Group>,
        ids: &[usize],
        gs: Vec<Tensor>,
        rows_grad: &mut [Option<Tensor>],
    ) -> Result<(), CommError> {
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
        let got = grp.all_to_all(&parts, &vec![vec![mine]; s as usize])?;
        drop(parts);
        let mut sum = fold(&got);
        if let Some(a) = across {
            sum = a.all_reduce_sum(&sum)?;
        }
        let mut at = 0;
        for &i in ids {
            let (_, rn) = self.rows(i, place);
            let len = rn * self.row_numel(i);
            if rn > 0 {
                let mut shape = self.gathered[i].clone();
                shape[0] = rn;
                rows_grad[i] = Some(sum.narrow(0, at, len).view(shape.as_slice()).copy());
            }
            at += len;
        }
        Ok(())
    }
}

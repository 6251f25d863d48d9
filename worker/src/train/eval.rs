//! The held-out eval loss.
//!
//! A job's eval split is `eval_dataset` (a dataset of its own) or `eval_fraction` (the
//! dataset's last samples by index, which training then never draws); the eval loss is the
//! mean loss over the split's first `eval_samples` samples (default 256), a fixed set.
//!
//! Every `eval_every` committed steps a synchronous job evaluates on its current layout:
//! each data-parallel replica takes a contiguous share of the eval samples and runs them
//! forward through its stages (activations sent point to point, in micro-batch then chunk
//! order, from a sender thread) and tensor groups, without gradients; each replica's last
//! stage (its first tensor rank) adds its losses, and one all-reduce of the sum over the
//! whole world gives every rank the mean. Nothing of training's state changes (no gradient,
//! no random draw, no sample of the training order), so deterministic training keeps its bits.

use std::sync::Arc;

use ductile_cluster::records::{Generation, Member, TrainingSpec};
use ductile_comm::{CommError, Communicator, ReduceOp};
use ductile_strategies::mesh::Mesh;
use ductile_strategies::split_range;
use tch::{Kind, Tensor};

use super::pipe::{Outbox, Place};
use super::Trainer;
use crate::data::Dataset;

/// Eval samples by default.
pub const DEFAULT_EVAL_SAMPLES: u64 = 256;
/// Samples per forward pass of an eval.
const EVAL_MICRO: u64 = 16;

/// Where the eval samples come from.
pub struct EvalSet {
    /// A dataset of its own (`eval_dataset`); `None`: the training dataset's tail.
    own: Option<Dataset>,
    /// The split's first sample in its dataset, and the samples evaluated.
    first: u64,
    count: u64,
}

impl EvalSet {
    /// The samples training draws from, and the job's eval split if it has one.
    pub fn of(
        spec: &TrainingSpec,
        data: &Dataset,
        rt: &tokio::runtime::Handle,
    ) -> anyhow::Result<(u64, Option<EvalSet>)> {
        let n = data.len();
        let want = spec.eval_samples.unwrap_or(DEFAULT_EVAL_SAMPLES);
        if let Some(url) = &spec.eval_dataset {
            let own = Dataset::open(url, spec.model, crate::model::ctx(spec), rt)
                .map_err(|e| anyhow::anyhow!("eval_dataset: {e:#}"))?;
            anyhow::ensure!(!own.is_empty(), "eval_dataset {url} holds no sample");
            if spec.model == ductile_cluster::records::ModelKind::Hf {
                crate::hf::check_stream(spec, &own, rt)
                    .map_err(|e| anyhow::anyhow!("eval_dataset: {e:#}"))?;
            }
            let count = own.len().min(want);
            return Ok((
                n,
                Some(EvalSet {
                    own: Some(own),
                    first: 0,
                    count,
                }),
            ));
        }
        if let Some(f) = spec.eval_fraction {
            let held = ((n as f64 * f).ceil() as u64).max(1);
            anyhow::ensure!(
                held < n,
                "eval_fraction {f} of {n} samples leaves none to train on"
            );
            let train = n - held;
            return Ok((
                train,
                Some(EvalSet {
                    own: None,
                    first: train,
                    count: held.min(want),
                }),
            ));
        }
        Ok((n, None))
    }

    /// The dataset the eval samples are in.
    pub fn data<'a>(&'a self, training: &'a Dataset) -> &'a Dataset {
        self.own.as_ref().unwrap_or(training)
    }

    /// The eval samples' indices in [`EvalSet::data`].
    pub fn samples(&self) -> Vec<u64> {
        (self.first..self.first + self.count).collect()
    }
}

impl Trainer {
    /// The eval loss on this generation's layout (see the module's comment): every rank of
    /// the generation calls it at the same committed step and gets the same value.
    pub(super) fn eval_on_layout(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
    ) -> Result<f64, CommError> {
        // full sharding with stages: the stage's parameters gathered for the eval (and their
        // rows back whatever happens)
        if me.spare || !self.holds_param_rows() || g.layout.pipeline_parallel <= 1 {
            return self.eval_on(comm, g, me);
        }
        let grp = self.shard_group(comm, g)?;
        let which = self.params_in(&self.units_of(g, me));
        let rests = self.gather_params(comm, &grp, &which)?;
        let r = self.eval_on(comm, g, me);
        self.release(rests);
        r
    }

    /// [`Trainer::eval_on_layout`]'s work, the parameters of a stage whole.
    fn eval_on(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
    ) -> Result<f64, CommError> {
        let Some(set) = self.eval.as_ref() else {
            return Err(CommError::Invalid {
                op: "eval",
                reason: "the job has no eval split".into(),
            });
        };
        let all = set.samples();
        let count = all.len() as u64;
        let mut sum = 0f64;
        let p = g.layout.pipeline_parallel.max(1);
        if !me.spare && self.holds_param_rows() && p == 1 {
            let dp = g.layout.data_parallel.max(1);
            let share = split_range(count, dp, me.dp_rank);
            let idx: Vec<u64> = share.map(|i| all[i as usize]).collect();
            let data = set.data(&self.data);
            let batches = idx
                .chunks(EVAL_MICRO as usize)
                .map(|c| {
                    let (x, y) = data.batch(c);
                    (x.to_device(self.dev), y.to_device(self.dev))
                })
                .collect();
            sum = self.full_eval_sum(comm, g, batches, me.tp_rank == 0)?;
        } else if !me.spare {
            let dp = g.layout.data_parallel.max(1);
            let Place {
                stage,
                units,
                bounds,
                last_chunk,
                mine,
                c,
                prev,
                next,
                ..
            } = self.pipeline_place(g, me);
            let share = split_range(count, dp, me.dp_rank);
            let idx: Vec<u64> = share.map(|i| all[i as usize]).collect();
            let outbox = Outbox::new(comm.clone());
            let data = set.data(&self.data);
            let r: Result<(), CommError> = tch::no_grad(|| {
                for mb in idx.chunks(EVAL_MICRO as usize) {
                    let n = mb.len() as i64;
                    let needs_data = (stage == 0) || mine.iter().any(|r| r.end == units);
                    let (x, y) = if needs_data {
                        let (x, y) = data.batch(mb);
                        (Some(x.to_device(self.dev)), Some(y.to_device(self.dev)))
                    } else {
                        (None, None)
                    };
                    for (j, r) in mine.iter().enumerate() {
                        let k = j as u32 * p + stage;
                        let input = if k == 0 {
                            x.as_ref()
                                .expect("the first stage reads the batch")
                                .shallow_clone()
                        } else {
                            let t = comm.zeros(
                                &self.model.boundary_shape(bounds[k as usize], n),
                                Kind::Float,
                            );
                            comm.recv(&t, prev)?;
                            t.into_tensor()
                        };
                        let mut tape = crate::model::Tape::default();
                        let out = self.model.forward(r.start, r.end, &input, &mut tape)?;
                        if k == last_chunk {
                            // every tensor rank takes part in the (vocabulary-parallel) loss;
                            // the first counts it
                            let y = y.as_ref().expect("the last stage reads the targets");
                            let l = self.model.loss(&out, y, &mut tape)?.double_value(&[]);
                            if Mesh::counts_loss(c) {
                                sum += l;
                            }
                        } else {
                            outbox.send(out.contiguous(), next);
                        }
                    }
                }
                Ok(())
            });
            r?;
            outbox.finish()?;
        }
        let mut total = comm.place(&Tensor::from_slice(&[sum as f32]));
        comm.all_reduce(&mut total, ReduceOp::Sum)?;
        let total = total.into_tensor().double_value(&[0]);
        Ok(total / count.max(1) as f64)
    }
}

//! Models, defined with tch, each a [`Network`]: the built-in GPT ([`gpt`]) and MLP ([`mlp`]),
//! and Hugging Face models: the Llama family ([`llama`]) and GPT-2 ([`gpt2`]).
//! Initialised from the job's seed, so every rank builds the same weights. A model runs whole,
//! or as a member of a tensor group on its slices of the split layers (`tp`): one forward
//! serves both.

use std::cell::RefCell;
use std::collections::BTreeMap;

use ductile_cluster::records::{ModelKind, TrainingSpec};
use ductile_comm::CommError;
use tch::nn;
use tch::Tensor;

use crate::data::Dataset;

mod gpt;
mod gpt2;
mod llama;
#[cfg(test)]
pub(crate) use llama::tests as llama_tests;
mod mlp;
mod tp;
use ductile_strategies::tensor::Arch;
use tp::Par;
pub use tp::{logical_slices, Shard, Tape};

/// The context length of a token model (`model_config.ctx`: a GPT's default 32, a Hugging Face
/// model's 2048 or its maximum; the spec was checked at submission).
pub fn ctx(spec: &TrainingSpec) -> usize {
    match spec.model {
        ModelKind::Hf => spec.hf_ctx().unwrap_or(2048) as usize,
        _ => spec.gpt_config().map(|c| c.ctx).unwrap_or(32) as usize,
    }
}

/// One model architecture on the worker: its layers (made from the seed), its units and its
/// forward over them, written once over parallel layers ([`Par`]), and its tensor split rules.
/// Adding a model family is adding one implementation.
trait Network: Send {
    /// Its units (the pipeline's indivisible blocks), as `strategies::arch` lists them by name.
    fn units(&self) -> usize;
    /// The shape of the activation entering unit `unit` (> 0) for `n` samples.
    fn boundary_shape(&self, unit: usize, n: i64) -> Vec<i64>;
    /// Units `[a, b)` on `input` (token ids or features when `a` is 0, else the activation unit
    /// `a − 1` produced), whole or on a member's slices as `p` says.
    fn forward(&self, a: usize, b: usize, input: &Tensor, p: &mut Par)
        -> Result<Tensor, CommError>;
    /// Sum over the batch of each sample's loss, from the network's output.
    fn loss(&self, out: &Tensor, y: &Tensor, p: &mut Par) -> Result<Tensor, CommError>;
    /// The key of its tensor split rules (`strategies::tensor`).
    fn split_rules(&self) -> Arch;
    /// Why `tp` members cannot split it, with its actual sizes, if they cannot.
    fn check_tp(&self, tp: u32) -> Result<(), String>;
    /// Greedy decoding's step on the whole model: the logits of the last of `ids` (`[1, t]`,
    /// the positions after the `cache`'s), each layer's keys and values appended to `cache`.
    fn decode(&self, _ids: &Tensor, _cache: &mut Vec<(Tensor, Tensor)>) -> anyhow::Result<Tensor> {
        anyhow::bail!("this model does not generate text")
    }
}

/// A rank's rows of a parameter at place `place` of a shard group of `s` (full sharding: each
/// rank holds [`ductile_strategies::split_range`] of dim 0; a place with no rows holds an empty
/// tensor). A copy: the whole tensor's storage is freed with it.
pub fn shard_rows(t: &Tensor, (s, place): (u32, u32)) -> Tensor {
    let r = ductile_strategies::split_range(t.size()[0] as u64, s, place);
    if r.is_empty() {
        Tensor::empty([0], (t.kind(), t.device()))
    } else {
        t.narrow(0, r.start as i64, (r.end - r.start) as i64).copy()
    }
}

/// While a model is built, every parameter made so far cut to a rank's rows ([`shard_rows`])
/// at each [`Cut::unit`], which the networks call after each unit they make: so with full
/// sharding a new process never holds more than one unit whole (the seed's draws are still
/// the whole model's, in the same order, so the rows have the bits the whole model's have).
pub(crate) struct Cut<'a> {
    vs: &'a nn::VarStore,
    rows: Option<(u32, u32)>,
    /// Each cut parameter's whole shape.
    whole: RefCell<BTreeMap<String, Vec<i64>>>,
}

impl Cut<'_> {
    /// Cut the parameters made since the last call (nothing without rows to keep).
    pub(crate) fn unit(&self) {
        let Some(rows) = self.rows else { return };
        let mut whole = self.whole.borrow_mut();
        for (name, mut t) in self.vs.variables() {
            if whole.contains_key(&name) {
                continue;
            }
            whole.insert(name, t.size());
            let mine = shard_rows(&t, rows);
            tch::no_grad(|| t.set_data(&mine));
        }
        // the whole tensors just freed sit between rows in the allocator's heap (below its
        // mmap threshold): hand their pages back, or the next units' would add to them
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: glibc's malloc_trim takes no pointer and only releases free pages
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

pub struct Model {
    pub vs: nn::VarStore,
    /// The parameters' whole shapes, in name order.
    shapes: Vec<Vec<i64>>,
    /// The shard rows ([`shard_rows`]) the seed's parameters were cut to as they were made:
    /// (1, 0) when they are whole.
    seed_rows: (u32, u32),
    net: Box<dyn Network>,
    /// This model's tensor group and slices, once [`Model::shard`]ed.
    shard: Option<Shard>,
    /// Deterministic mode's logical slices per split layer (`tensor_slices`).
    slices: Option<u32>,
    /// `precision = "bf16"`: the parallel layers' matrix products in bfloat16.
    bf16: bool,
    /// Activation checkpointing: every block (the units between the first and the last) runs
    /// without gradients forward and again in the backward.
    recompute: bool,
}

impl Model {
    /// Built on the CPU from the seed (so every device kind starts from the same bits), then
    /// moved to `device`.
    pub fn new(spec: &TrainingSpec, data: &Dataset, device: tch::Device) -> anyhow::Result<Model> {
        Model::with_rows(spec, data, device, (1, 0))
    }

    /// [`Model::new`] holding only `rows` (shard group size, place) of every parameter
    /// ([`shard_rows`]): each unit is cut as soon as it is made, so at most one unit is ever
    /// whole; the rows have the whole model's bits. `(1, 0)`: the whole model.
    pub fn with_rows(
        spec: &TrainingSpec,
        data: &Dataset,
        device: tch::Device,
        rows: (u32, u32),
    ) -> anyhow::Result<Model> {
        tch::manual_seed(spec.seed as i64);
        let mut vs = nn::VarStore::new(tch::Device::Cpu);
        let cut = Cut {
            vs: &vs,
            rows: (rows.0 > 1).then_some(rows),
            whole: RefCell::new(BTreeMap::new()),
        };
        let root = vs.root();
        let net: Box<dyn Network> = match (spec.model, data.token_shape(), data) {
            (ModelKind::Gpt, Some((vocab, ctx)), _) => {
                let g = spec.gpt_config()?;
                let vocab = (vocab as i64).max(g.vocab);
                Box::new(gpt::Gpt::new(
                    &root,
                    &cut,
                    g.d_model,
                    g.n_layer,
                    g.n_head,
                    vocab,
                    ctx as i64,
                ))
            }
            (ModelKind::Mlp, _, Dataset::Regression { x, y }) => {
                let (d_in, d_out) = (x.size()[1], y.size()[1]);
                let m = spec.mlp_config()?;
                Box::new(mlp::Mlp::new(&root, &cut, d_in, m.hidden, m.layers, d_out))
            }
            (ModelKind::Hf, Some((_, ctx)), _) => {
                let c = spec.hf_config()?;
                // the dataset was checked against the model's vocabulary when it was opened
                // (a stream's tokens as they are read)
                match c.family {
                    ductile_cluster::hf::Family::Llama => {
                        Box::new(llama::Llama::new(&root, &cut, &c, ctx as i64))
                    }
                    ductile_cluster::hf::Family::Gpt2 => {
                        Box::new(gpt2::Gpt2::new(&root, &cut, &c, ctx as i64))
                    }
                }
            }
            (m, _, _) => anyhow::bail!(
                "model {m:?} does not fit its dataset (gpt and hf need tokens, mlp a regression set)"
            ),
        };
        // (whatever a network made after its last unit)
        cut.unit();
        let whole = cut.whole.into_inner();
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let shapes = named
            .iter()
            .map(|(n, t)| whole.get(n).cloned().unwrap_or_else(|| t.size()))
            .collect();
        drop(root);
        if device != tch::Device::Cpu {
            vs.set_device(device);
        }
        Ok(Model {
            vs,
            shapes,
            seed_rows: if rows.0 > 1 { rows } else { (1, 0) },
            net,
            shard: None,
            slices: spec.tensor_slices.filter(|_| spec.deterministic),
            recompute: spec.activation_checkpointing
                == ductile_cluster::records::ActivationCheckpointing::Full,
            bf16: spec.precision == ductile_cluster::records::Precision::Bf16,
        })
    }

    /// Whether split layers run in logical slices (deterministic `tensor_slices`): such a model
    /// computes through a tensor group even when it has one member.
    pub fn sliced(&self) -> bool {
        self.slices.is_some()
    }

    /// The parameters' whole shapes, in name order (a model built [`Model::with_rows`] holds
    /// rows of them).
    pub fn shapes(&self) -> &[Vec<i64>] {
        &self.shapes
    }

    /// The shard rows its seed's parameters were cut to ([`Model::with_rows`]; (1, 0): whole).
    pub fn seed_rows(&self) -> (u32, u32) {
        self.seed_rows
    }

    /// Parameters in name order (the order of state transfer and of the weights hash).
    pub fn params(&self) -> Vec<(String, Tensor)> {
        let mut v: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// The model's units (the pipeline's indivisible blocks): the GPT's embeddings, each block
    /// and the head; the MLP's hidden layers and its output layer
    /// (`ductile_strategies::pipeline::units` lists the same, by name).
    pub fn units(&self) -> usize {
        self.net.units()
    }

    /// The shape of the activation entering unit `unit` (> 0) for `n` samples.
    pub fn boundary_shape(&self, unit: usize, n: i64) -> Vec<i64> {
        debug_assert!(unit > 0);
        self.net.boundary_shape(unit, n)
    }

    /// How this model runs its layers: on its tensor group's slices when it is in one (the
    /// cuts go on `tape`), else whole.
    fn par<'a>(&'a self, tape: &'a mut Tape) -> Par<'a> {
        match &self.shard {
            Some(s) => Par::Split(s, tape),
            None => Par::Whole,
        }
    }

    /// Run units `[a, b)` on `input`: token ids or features when `a` is 0, else the activation
    /// unit `a − 1` produced. With `b` the last unit, the result is the network's output (in a
    /// tensor group, the GPT's is this member's vocabulary slices of the logits, which
    /// [`Model::loss`] takes). The collectives' cuts go on `tape` ([`Model::backward`]).
    pub fn forward(
        &self,
        a: usize,
        b: usize,
        input: &Tensor,
        tape: &mut Tape,
    ) -> Result<Tensor, CommError> {
        let _compute = tp::Compute::new(self.bf16);
        if !self.recompute {
            return self.net.forward(a, b, input, &mut self.par(tape));
        }
        // activation checkpointing: each block runs without gradients (its collectives all
        // the same), keeping only its input; the units around the blocks run as they are
        let mut h = input.shallow_clone();
        let mut u = a;
        while u < b {
            if self.is_block(u) {
                let x = h;
                let y = tch::no_grad(|| {
                    self.net
                        .forward(u, u + 1, &x.detach(), &mut self.par(&mut Tape::default()))
                })?;
                h = tape.recomputed(u, &x, y);
                u += 1;
            } else {
                let e = (u + 1..b).find(|k| self.is_block(*k)).unwrap_or(b);
                h = self.net.forward(u, e, &h, &mut self.par(tape))?;
                u = e;
            }
        }
        Ok(h)
    }

    /// Unit `u` alone on its tensor group's slices (the cuts on `tape`), never recomputed:
    /// full sharding under tensor groups runs each unit again in its backward already.
    pub fn forward_unit(
        &self,
        u: usize,
        input: &Tensor,
        tape: &mut Tape,
    ) -> Result<Tensor, CommError> {
        let _compute = tp::Compute::new(self.bf16);
        self.net.forward(u, u + 1, input, &mut self.par(tape))
    }

    /// Unit `u` alone, whole (full sharding runs a model unit by unit, each with its gathered
    /// parameters), in the job's precision.
    pub fn unit_forward(&self, u: usize, input: &Tensor) -> Tensor {
        let _compute = tp::Compute::new(self.bf16);
        self.net
            .forward(u, u + 1, input, &mut Par::Whole)
            .expect("a whole unit does not communicate")
    }

    /// The summed loss of the network's output, whole (see [`Model::unit_forward`]).
    pub fn whole_loss(&self, out: &Tensor, y: &Tensor) -> Tensor {
        let _compute = tp::Compute::new(self.bf16);
        self.net
            .loss(out, y, &mut Par::Whole)
            .expect("a whole loss does not communicate")
    }

    /// Whether unit `u` is a block (not the embeddings, the first unit, nor the head, the
    /// last): the units activation checkpointing recomputes.
    pub(crate) fn is_block(&self, u: usize) -> bool {
        u > 0 && u + 1 < self.units()
    }

    /// Forward and backward of the whole model (not in a tensor group) on one micro-batch,
    /// the backward unit by unit from the last: each unit's input is a leaf of its own, so
    /// once unit `u`'s backward is over every parameter whose last use is in `u` holds its
    /// gradient, and `done(u)` is called (a data-parallel step starts reducing those while the
    /// units before still compute, as DDP's buckets do). Each unit's output gradient enters
    /// through `sum(out · grad)`, whose backward is the gradient itself. Parameter gradients
    /// accumulate as [`Model::backward`]'s do; with activation checkpointing the blocks run
    /// without gradients and again in their backward. Returns the loss (the batch's sum /
    /// `scale`), detached.
    pub fn backward_by_unit(
        &self,
        x: &Tensor,
        y: &Tensor,
        scale: f64,
        mut done: impl FnMut(usize),
    ) -> Tensor {
        let units = self.units();
        let block = |u: usize| self.recompute && self.is_block(u);
        let mut ins: Vec<Tensor> = Vec::with_capacity(units);
        let mut outs: Vec<Option<Tensor>> = Vec::with_capacity(units);
        let mut h = x.shallow_clone();
        for u in 0..units {
            let xin = if u > 0 {
                h.detach().set_requires_grad(true)
            } else {
                h
            };
            let out = if block(u) {
                tch::no_grad(|| self.unit_forward(u, &xin))
            } else {
                self.unit_forward(u, &xin)
            };
            h = out.shallow_clone();
            ins.push(xin);
            outs.push((!block(u)).then_some(out));
        }
        let loss = self.whole_loss(&h, y) / scale;
        drop(h);
        let value = loss.detach();
        let mut root = Some(loss);
        let mut go: Option<Tensor> = None;
        for u in (0..units).rev() {
            let xin = ins.pop().expect("a unit's input");
            let out = outs
                .pop()
                .flatten()
                .unwrap_or_else(|| self.unit_forward(u, &xin));
            let r = match root.take() {
                Some(l) => l,
                None => {
                    let g = go.take().expect("the unit's output gradient");
                    (&out * &g).sum(tch::Kind::Float)
                }
            };
            drop(out);
            if r.requires_grad() {
                r.backward();
            }
            drop(r);
            if u > 0 {
                let gi = xin.grad();
                go = Some(if gi.defined() { gi } else { xin.zeros_like() });
            }
            drop(xin);
            done(u);
        }
        value
    }

    /// Whether blocks are recomputed in the backward (`activation_checkpointing = "full"`).
    pub fn recomputes(&self) -> bool {
        self.recompute
    }

    /// Sum over the batch of each sample's loss, from the network's output (in a tensor
    /// group every member gets the same loss).
    pub fn loss(&self, out: &Tensor, y: &Tensor, tape: &mut Tape) -> Result<Tensor, CommError> {
        let _compute = tp::Compute::new(self.bf16);
        self.net.loss(out, y, &mut self.par(tape))
    }

    /// Backward from `out` (a scalar loss when `grad` is `None`, else an activation with the
    /// gradient `grad`), through the cuts a forward recorded on `tape`. Parameter gradients
    /// accumulate.
    pub fn backward(
        &self,
        tape: Tape,
        out: &Tensor,
        grad: Option<&Tensor>,
    ) -> Result<(), CommError> {
        // (a recomputed block runs in the precision it ran in)
        let _compute = tp::Compute::new(self.bf16);
        let group = self.shard.as_ref().map(|s| &s.group);
        let mut rerun = |u: usize, x: &Tensor, inner: &mut Tape| {
            self.net.forward(u, u + 1, x, &mut self.par(inner))
        };
        tape.backward(out, grad, group, &mut rerun)
    }

    /// Greedy continuation of `prompt` (token ids) with a key/value cache: up to `n` new ids,
    /// stopping after `eos`.
    pub fn generate(&self, prompt: &[u32], n: usize, eos: Option<u32>) -> anyhow::Result<Vec<u32>> {
        anyhow::ensure!(!prompt.is_empty(), "an empty prompt");
        let dev = self.vs.device();
        let mut cache = Vec::new();
        let mut out = Vec::new();
        let mut ids = Tensor::from_slice(&prompt.iter().map(|t| *t as i64).collect::<Vec<_>>())
            .to_device(dev)
            .unsqueeze(0);
        tch::no_grad(|| -> anyhow::Result<()> {
            for _ in 0..n {
                let logits = self.net.decode(&ids, &mut cache)?;
                let next = logits.argmax(-1, false).int64_value(&[]) as u32;
                out.push(next);
                if Some(next) == eos {
                    break;
                }
                ids = Tensor::from_slice(&[next as i64])
                    .to_device(dev)
                    .unsqueeze(0);
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Sum over the batch of each sample's loss of the whole model, whatever its tensor group
    /// (evaluation, and the local steps of DiLoCo and async; so / global batch gives the exact
    /// mean).
    pub fn loss_sum(&self, x: &Tensor, y: &Tensor) -> Tensor {
        let _compute = tp::Compute::new(self.bf16);
        let whole = "the whole model does not communicate";
        let out = self
            .net
            .forward(0, self.units(), x, &mut Par::Whole)
            .expect(whole);
        self.net.loss(&out, y, &mut Par::Whole).expect(whole)
    }
}

//! Tensor parallelism (Megatron-style) on the models of [`super`]: a member of a tensor group
//! holds its slices of the split parameters ([`ductile_strategies::tensor`] says which) and
//! runs the layers on them, with the group's collectives where Megatron puts them.
//!
//! tch has no custom autograd functions, so the two collectives whose backward differs from
//! their forward are cuts in the autograd graph, recorded on a [`Tape`]:
//! - **g** (after a row-parallel layer, the vocab-parallel embedding, the cross-entropy's
//!   sums): the forward sums the members' partials; the backward passes the gradient through.
//! - **f** (before a column-parallel layer): the forward passes the activation through; the
//!   backward sums the members' partial input gradients.
//!
//! A cut's output is a fresh leaf. The backward ([`Tape::backward`]) runs the graph after the
//! last cut, then each cut's source in reverse order with its leaf's gradient (summed over the
//! group for an f cut), so every segment is walked once. Plain cuts (identity both ways) at
//! tensors used twice (a block's input, its residual) keep a segment from being walked again.
//!
//! With deterministic `tensor_slices` the same slices run whatever the group size (a data-parallel
//! run computes them through a group of one), so the bits do not depend on the layout.
//!
//! Where the gradient of a replicated parameter flows only through replicated activations
//! after the f cuts (layer norms, biases added after a reduce, the position embedding, an
//! unsplit MLP layer), every member computes the same bits, so no extra reduce is needed.

use std::ops::Range;

use ductile_comm::group::fold;
use ductile_comm::{CommError, Group};
use ductile_strategies::split_range;
use ductile_strategies::tensor::{held_ranges, mlp_role, split_of, Arch};
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use super::Model;

/// The logical slices a split layer runs in over a tensor group of `tp`: the job's
/// (deterministic `tensor_slices`) where they split evenly over the group, else one per member
/// (the planner only picks group sizes that divide them).
pub fn logical_slices(job_slices: Option<u32>, tp: u32) -> u32 {
    match job_slices {
        Some(k) if k % tp == 0 => k,
        _ => tp,
    }
}

/// A member's view of its tensor group. Split layers are computed in `slices` logical slices
/// (K: the group size, or in deterministic mode the job's `tensor_slices`, a multiple of it);
/// this member computes slices `first .. first + per`, and every sum over slices (a
/// row-parallel layer's partials, a column-parallel layer's input gradients, the
/// cross-entropy's) is folded in slice order. Each slice's weights are laid out alike at every
/// group size (a column range is made contiguous before its matmul: the kernels' summation
/// order depends on the layout), so with a fixed K the bits do not depend on the group size.
pub struct Shard {
    pub group: Group,
    pub arch: Arch,
    slices: u32,
    first: u32,
    per: u32,
}

impl Shard {
    /// This member's slices of a dimension of `n`: (offset in its local tensor, length).
    fn local(&self, n: i64) -> Vec<(i64, i64)> {
        let (tp, r) = (self.group.size(), self.group.rank());
        let base = split_range(n as u64, tp, r).start as i64;
        (self.first..self.first + self.per)
            .map(|k| {
                let x = split_range(n as u64, self.slices, k);
                (x.start as i64 - base, (x.end - x.start) as i64)
            })
            .collect()
    }

    /// This member's slices of a dimension of `n`, in the whole tensor.
    fn global(&self, n: i64) -> Vec<Range<i64>> {
        (self.first..self.first + self.per)
            .map(|k| {
                let x = split_range(n as u64, self.slices, k);
                x.start as i64..x.end as i64
            })
            .collect()
    }
}

/// Every slice's tensor (each member's `local`, all of one shape), in slice order.
fn gather_slices(group: &Group, local: &[Tensor]) -> Result<Vec<Tensor>, CommError> {
    if group.size() == 1 {
        return Ok(local.iter().map(|t| t.shallow_clone()).collect());
    }
    let stacked = Tensor::stack(local, 0);
    let members = group.all_gather(&stacked)?;
    Ok(members
        .iter()
        .flat_map(|m| (0..m.size()[0]).map(move |j| m.get(j)))
        .collect())
}

struct Cut {
    sources: Vec<Tensor>,
    leaves: Vec<Tensor>,
    /// The leaves' gradients are gathered over the slices and folded (an f cut).
    fold_grads: bool,
    /// A recomputed unit (activation checkpointing): its index and its input, kept without
    /// its graph; the unit ran without gradients and its output is the leaf.
    rerun: Option<(usize, Tensor)>,
}

/// Runs unit `u` again on its input (a leaf that wants gradients), its cuts on the tape given.
pub type Rerun<'a> = dyn FnMut(usize, &Tensor, &mut Tape) -> Result<Tensor, CommError> + 'a;

/// The cuts of one forward pass, for its backward.
#[derive(Default)]
pub struct Tape {
    cuts: Vec<Cut>,
}

impl Tape {
    /// Identity both ways (a tensor used twice).
    fn plain(&mut self, x: &Tensor) -> Tensor {
        if !x.requires_grad() {
            return x.shallow_clone();
        }
        let leaf = x.detach().set_requires_grad(true);
        self.cuts.push(Cut {
            sources: vec![x.shallow_clone()],
            leaves: vec![leaf.shallow_clone()],
            fold_grads: false,
            rerun: None,
        });
        leaf
    }

    /// Unit `unit` ran on `input` without gradients and gave `out`: its output as a leaf, and
    /// a cut that runs the unit again in the backward (activation checkpointing).
    pub(super) fn recomputed(&mut self, unit: usize, input: &Tensor, out: Tensor) -> Tensor {
        let leaf = out.set_requires_grad(true);
        self.cuts.push(Cut {
            sources: vec![input.shallow_clone()],
            leaves: vec![leaf.shallow_clone()],
            fold_grads: false,
            rerun: Some((unit, input.detach())),
        });
        leaf
    }

    /// Identity forward, one leaf per local slice; backward, every slice's input gradient is
    /// gathered and folded in slice order.
    fn f(&mut self, x: &Tensor, s: &Shard) -> Vec<Tensor> {
        if !x.requires_grad() {
            return (0..s.per).map(|_| x.shallow_clone()).collect();
        }
        let leaves: Vec<Tensor> = (0..s.per)
            .map(|_| x.detach().set_requires_grad(true))
            .collect();
        self.cuts.push(Cut {
            sources: vec![x.shallow_clone()],
            leaves: leaves.iter().map(|l| l.shallow_clone()).collect(),
            fold_grads: true,
            rerun: None,
        });
        leaves
    }

    /// Every slice's partial gathered and folded in slice order forward; identity backward
    /// (each local partial gets the sum's gradient).
    fn g(&mut self, parts: Vec<Tensor>, s: &Shard) -> Result<Tensor, CommError> {
        let detached: Vec<Tensor> = parts.iter().map(|p| p.detach()).collect();
        let sum = fold(&gather_slices(&s.group, &detached)?);
        if !parts.iter().any(|p| p.requires_grad()) {
            return Ok(sum);
        }
        let leaf = sum.set_requires_grad(true);
        self.cuts.push(Cut {
            sources: parts,
            leaves: vec![leaf.shallow_clone()],
            fold_grads: false,
            rerun: None,
        });
        Ok(leaf)
    }

    /// Backward from `out` (a scalar loss when `grad` is `None`, else an activation with the
    /// gradient `grad`), then through every cut in reverse order (a recomputed unit runs again
    /// through `rerun`, and its backward with it). Parameter gradients accumulate as with
    /// `backward()`. `group` is the tensor group, for the cuts of split layers.
    pub fn backward(
        self,
        out: &Tensor,
        grad: Option<&Tensor>,
        group: Option<&Group>,
        rerun: &mut Rerun,
    ) -> Result<(), CommError> {
        backward_with(out, grad);
        for c in self.cuts.into_iter().rev() {
            let grads: Vec<Tensor> = c.leaves.iter().map(|l| l.grad()).collect();
            if grads.iter().all(|g| !g.defined()) {
                // the same on every member: nothing downstream used this cut
                continue;
            }
            if let Some((unit, input)) = &c.rerun {
                let x = input
                    .detach()
                    .set_requires_grad(c.sources[0].requires_grad());
                let mut inner = Tape::default();
                let y = rerun(*unit, &x, &mut inner)?;
                inner.backward(&y, Some(&grads[0]), group, rerun)?;
                let g = x.grad();
                if g.defined() {
                    backward_with(&c.sources[0], Some(&g));
                }
            } else if c.fold_grads {
                let group = group.expect("a split layer's cut has its tensor group");
                let local: Vec<Tensor> = grads
                    .iter()
                    .zip(&c.leaves)
                    .map(|(g, l)| {
                        if g.defined() {
                            g.shallow_clone()
                        } else {
                            l.zeros_like()
                        }
                    })
                    .collect();
                let g = fold(&gather_slices(group, &local)?);
                backward_with(&c.sources[0], Some(&g));
            } else {
                for src in &c.sources {
                    backward_with(src, Some(&grads[0]));
                }
            }
        }
        Ok(())
    }

    /// Cuts recorded (none without gradients).
    pub fn len(&self) -> usize {
        self.cuts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cuts.is_empty()
    }
}

pub(super) fn backward_with(out: &Tensor, grad: Option<&Tensor>) {
    match grad {
        None => out.backward(),
        // d/d out of sum(out · grad) is grad, exactly
        Some(g) => (out * g).sum(Kind::Float).backward(),
    }
}

impl Model {
    /// Make this model member `group.rank()` of a tensor group: each split parameter keeps only
    /// this member's slices (the rest of its storage is released). Every member must start
    /// from the same full weights (the seed's, or the same restored state).
    pub fn shard(&mut self, group: Group) -> anyhow::Result<()> {
        anyhow::ensure!(self.shard.is_none(), "the model is already sharded");
        let (tp, rank) = (group.size(), group.rank());
        let arch = self.arch();
        let check = self.net.check_tp(tp);
        check.map_err(|e| anyhow::anyhow!(e))?;
        for (name, p) in self.params() {
            let shape: Vec<u64> = p.size().iter().map(|d| *d as u64).collect();
            let Some((dim, ranges)) = held_ranges(arch, split_of(arch, &name), &shape, tp, rank)
            else {
                continue;
            };
            let pieces: Vec<Tensor> = ranges
                .iter()
                .map(|r| p.narrow(dim as i64, r.start as i64, (r.end - r.start) as i64))
                .collect();
            let mine = Tensor::cat(&pieces, dim as i64).contiguous();
            let mut p = p;
            tch::no_grad(|| p.set_data(&mine));
        }
        self.shard = None;
        self.set_tensor_group(Some(group));
        Ok(())
    }

    /// Make this model a member of `group` (or of none) whose parameters already are the
    /// member's slices (the state moves put them there); nothing is sliced here.
    pub fn set_tensor_group(&mut self, group: Option<Group>) {
        self.shard = group.map(|group| {
            let (tp, rank) = (group.size(), group.rank());
            // the job's logical slices where they split evenly over the group, else one per
            // member (the planner only picks group sizes that divide them)
            let slices = logical_slices(self.slices, tp);
            let per = slices / tp;
            Shard {
                group,
                arch: self.arch(),
                slices,
                first: rank * per,
                per,
            }
        });
    }

    /// The tensor group this model is a member of, if sharded.
    pub fn tensor_shard(&self) -> Option<&Shard> {
        self.shard.as_ref()
    }

    /// The split rules' name for this model.
    pub fn arch(&self) -> Arch {
        self.net.split_rules()
    }
}

thread_local! {
    /// Whether this thread's matrix products run in bf16 (`precision = "bf16"`): set by the
    /// model around each pass it runs ([`Compute`]).
    static LOW: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While alive, the parallel layers' matrix products on this thread compute in bf16 (when
/// `bf16`): the operands cast to bfloat16, as PyTorch's autocast does for `linear`; a
/// row-parallel layer's partials and the logits come back to f32 before they are summed, so
/// the residual stream, the norms and the loss stay f32, and so do the weights (the casts are
/// in the graph: their gradients arrive in f32).
pub(super) struct Compute(bool);

impl Compute {
    pub(super) fn new(bf16: bool) -> Compute {
        Compute(LOW.with(|l| l.replace(bf16)))
    }
}

impl Drop for Compute {
    fn drop(&mut self) {
        LOW.with(|l| l.set(self.0));
    }
}

fn low() -> bool {
    LOW.with(|l| l.get())
}

/// `x · wᵀ (+ b)` with bf16 operands (and result).
fn low_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let k = Kind::BFloat16;
    let y = x.to_kind(k).matmul(&w.to_kind(k).tr());
    match b {
        Some(b) => y + b.to_kind(k),
        None => y,
    }
}

/// A bf16 result back in f32.
fn wide(t: Tensor) -> Tensor {
    t.to_kind(Kind::Float)
}

/// How a forward pass runs its layers: the whole model, or this member's slices of the split
/// layers through its tensor group, with the collectives' cuts on a [`Tape`]. The model's
/// forward is written once over it, as Megatron's parallel layers are (each layer is its math
/// plus one named collective); with the whole model each layer is its plain op, so the whole
/// model computes the bits it always did.
pub(super) enum Par<'a> {
    Whole,
    Split(&'a Shard, &'a mut Tape),
}

impl Par<'_> {
    /// A tensor used twice (a block's input, its residual): identity both ways.
    pub(super) fn plain(&mut self, x: &Tensor) -> Tensor {
        match self {
            Par::Whole => x.shallow_clone(),
            Par::Split(_, tape) => tape.plain(x),
        }
    }

    /// The input of a column-parallel layer, one per local slice (f: identity forward; the
    /// slices' input gradients are summed backward).
    pub(super) fn f(&mut self, x: &Tensor) -> Vec<Tensor> {
        match self {
            Par::Whole => vec![x.shallow_clone()],
            Par::Split(s, tape) => tape.f(x, s),
        }
    }

    /// A column-parallel linear layer of `n` outputs on its inputs `xs` (one per local slice):
    /// each slice's outputs.
    pub(super) fn column(&self, l: &nn::Linear, xs: &[Tensor], n: i64) -> Vec<Tensor> {
        match self {
            Par::Whole if low() => xs
                .iter()
                .map(|x| low_linear(x, &l.ws, l.bs.as_ref()))
                .collect(),
            Par::Whole => xs.iter().map(|x| x.apply(l)).collect(),
            Par::Split(s, _) if low() => s
                .local(n)
                .into_iter()
                .zip(xs)
                .map(|((off, len), x)| {
                    let w = l.ws.narrow(0, off, len).contiguous();
                    let b = l.bs.as_ref().map(|b| b.narrow(0, off, len));
                    low_linear(x, &w, b.as_ref())
                })
                .collect(),
            Par::Split(s, _) => s
                .local(n)
                .into_iter()
                .zip(xs)
                .map(|((off, len), x)| {
                    // (contiguous: a no-op for a linear layer's rows; a Conv1D's columns are
                    // copied out, so the slice's layout is the same at every group size)
                    let y = x.matmul(&l.ws.narrow(0, off, len).contiguous().tr());
                    match &l.bs {
                        Some(b) => y + b.narrow(0, off, len),
                        None => y,
                    }
                })
                .collect(),
        }
    }

    /// A row-parallel linear layer of `n` inputs on the column layer's slices `xs`: the
    /// slices' partial products summed (g), then the bias.
    pub(super) fn row(
        &mut self,
        l: &nn::Linear,
        xs: &[Tensor],
        n: i64,
    ) -> Result<Tensor, CommError> {
        match self {
            Par::Whole if low() => {
                let y = wide(low_linear(&xs[0], &l.ws, None));
                Ok(match &l.bs {
                    Some(b) => y + b,
                    None => y,
                })
            }
            Par::Whole => Ok(xs[0].apply(l)),
            Par::Split(s, tape) => {
                let parts: Vec<Tensor> = s
                    .local(n)
                    .into_iter()
                    .zip(xs)
                    .map(|((off, len), x)| {
                        let w = l.ws.narrow(1, off, len).contiguous();
                        if low() {
                            wide(low_linear(x, &w, None))
                        } else {
                            x.matmul(&w.tr())
                        }
                    })
                    .collect();
                let sum = tape.g(parts, s)?;
                Ok(match &l.bs {
                    Some(b) => sum + b,
                    None => sum,
                })
            }
        }
    }

    /// The fused Q/K/V projection of width `c` each (column-parallel by heads within each of
    /// Q, K and V) on its inputs `xs`: per local slice, its Q, K and V, each `[b, t, width]`.
    pub(super) fn qkv(&self, l: &nn::Linear, xs: &[Tensor], c: i64) -> Vec<[Tensor; 3]> {
        match self {
            Par::Whole => xs
                .iter()
                .map(|x| {
                    let y = if low() {
                        low_linear(x, &l.ws, l.bs.as_ref())
                    } else {
                        x.apply(l)
                    };
                    let mut qkv = y.split(c, 2).into_iter();
                    let mut next = || qkv.next().expect("three parts");
                    [next(), next(), next()]
                })
                .collect(),
            Par::Split(s, _) => {
                // this member's rows of each of Q, K and V
                let block = l.ws.size()[0] / 3;
                let (w, bias) = (&l.ws, l.bs.as_ref().unwrap());
                s.local(c)
                    .into_iter()
                    .zip(xs)
                    .map(|((off, len), a)| {
                        let proj = |k: i64| {
                            let w = w.narrow(0, k * block + off, len).contiguous();
                            let b = bias.narrow(0, k * block + off, len);
                            if low() {
                                low_linear(a, &w, Some(&b))
                            } else {
                                a.matmul(&w.tr()) + b
                            }
                        };
                        [proj(0), proj(1), proj(2)]
                    })
                    .collect()
            }
        }
    }

    /// The vocabulary-parallel token embedding of a vocabulary of `vocab`: each vocabulary
    /// slice looks up the tokens it holds (the rest are 0), summed (g).
    pub(super) fn embed(
        &mut self,
        tok: &nn::Embedding,
        ids: &Tensor,
        vocab: i64,
    ) -> Result<Tensor, CommError> {
        match self {
            Par::Whole => Ok(tok.forward(ids)),
            Par::Split(s, tape) => {
                let parts: Vec<Tensor> = s
                    .local(vocab)
                    .into_iter()
                    .zip(s.global(vocab))
                    .map(|((off, len), g)| {
                        let inside = ids.ge(g.start).logical_and(&ids.lt(g.end));
                        let idx = (ids - g.start).clamp(0, len - 1);
                        Tensor::embedding(&tok.ws.narrow(0, off, len), &idx, -1, false, false)
                            .multiply(&inside.unsqueeze(-1).to_kind(Kind::Float))
                    })
                    .collect();
                tape.g(parts, s)
            }
        }
    }

    /// The vocabulary-parallel head (no bias, weight `[vocab, width]`: a linear layer's, or a
    /// tied embedding's) of a vocabulary of `vocab`: this member's vocabulary slices of the
    /// logits (the whole model's: all of them).
    pub(super) fn head(&mut self, weight: &Tensor, x: &Tensor, vocab: i64) -> Tensor {
        match self {
            Par::Whole if low() => wide(low_linear(x, weight, None)),
            Par::Whole => x.matmul(&weight.tr()),
            Par::Split(s, tape) => {
                let xs = tape.f(x, s);
                let logits: Vec<Tensor> = s
                    .local(vocab)
                    .into_iter()
                    .zip(&xs)
                    .map(|((off, len), x)| {
                        let w = weight.narrow(0, off, len);
                        if low() {
                            wide(low_linear(x, &w, None))
                        } else {
                            x.matmul(&w.tr())
                        }
                    })
                    .collect();
                Tensor::cat(&logits, -1)
            }
        }
    }

    /// The role of the MLP's layer `u` of `layers`: (column-parallel, row-parallel); the
    /// whole model's layers are plain.
    pub(super) fn mlp_role(&self, layers: u64, u: u64) -> (bool, bool) {
        match self {
            Par::Whole => (false, false),
            Par::Split(..) => mlp_role(layers, u),
        }
    }

    /// The GPT's cross-entropy, summed over the batch of each sample's mean over positions, from
    /// the logits `out` over a vocabulary of `vocab`. Split, it is vocab-parallel: the row
    /// maxima, and per vocabulary slice the sums of exponentials and the target logits, folded
    /// in slice order (the full logits are never gathered); every member gets the same loss.
    pub(super) fn cross_entropy(
        &mut self,
        out: &Tensor,
        y: &Tensor,
        vocab: i64,
    ) -> Result<Tensor, CommError> {
        match self {
            Par::Whole => {
                let (b, t, _) = out.size3().unwrap();
                Ok(out.view([b * t, vocab]).cross_entropy_loss::<Tensor>(
                    &y.view([b * t]),
                    None,
                    tch::Reduction::Sum,
                    -100,
                    0.0,
                ) / t as f64)
            }
            Par::Split(s, tape) => {
                let t = out.size()[1];
                let max = s
                    .group
                    .all_reduce_max(&out.detach().amax([-1].as_slice(), true))?;
                // both sums below read `shifted`: a plain cut keeps the head's backward single
                let shifted = tape.plain(&(out - max));
                let (mut sums, mut targets) = (Vec::new(), Vec::new());
                for ((off, len), g) in s.local(vocab).into_iter().zip(s.global(vocab)) {
                    let part = shifted.narrow(-1, off, len).contiguous();
                    sums.push(
                        part.exp()
                            .sum_dim_intlist([-1].as_slice(), false, Kind::Float),
                    );
                    let inside = y.ge(g.start).logical_and(&y.lt(g.end));
                    let idx = (y - g.start).clamp(0, len - 1);
                    targets.push(
                        part.gather(-1, &idx.unsqueeze(-1), false)
                            .squeeze_dim(-1)
                            .multiply(&inside.to_kind(Kind::Float)),
                    );
                }
                let sum_exp = tape.g(sums, s)?;
                let target = tape.g(targets, s)?;
                Ok((sum_exp.log() - target).sum(Kind::Float) / t as f64)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use ductile_cluster::records::TrainingSpec;
    use ductile_comm::Communicator;
    use ductile_strategies::tensor::held_regions;
    use tch::Device;

    use super::*;
    use crate::data::Dataset;
    use crate::SEEDED;

    async fn mesh(n: u32, generation: u64) -> Vec<Arc<dyn Communicator>> {
        ductile_comm::tcp::loopback_mesh(n, "tp", generation)
            .await
            .unwrap()
    }

    fn spec(json: serde_json::Value) -> TrainingSpec {
        serde_json::from_value(json).unwrap()
    }

    fn gpt() -> (TrainingSpec, Dataset, Tensor, Tensor) {
        let s = spec(serde_json::json!({
            "model": "gpt",
            "model_config": {"d_model": 32, "n_layer": 2, "n_head": 4, "ctx": 8, "vocab": 67},
            "dataset": "file:///unused", "global_batch": 3, "seed": 11,
        }));
        let data = Dataset::Tokens {
            tokens: Vec::new(),
            header: None,
            ctx: 8,
            vocab: 67,
        };
        tch::manual_seed(5);
        let xy = Tensor::randint(67, [3, 9], (Kind::Int64, Device::Cpu));
        let (x, y) = (
            xy.narrow(1, 0, 8).contiguous(),
            xy.narrow(1, 1, 8).contiguous(),
        );
        (s, data, x, y)
    }

    /// A small Llama-family model (`arch` in config.json's `architectures`): GQA (4 query, 2
    /// KV heads), 67 tokens (no tp divides the vocabulary).
    fn hf(arch: &str, tied: bool) -> (TrainingSpec, Dataset, Tensor, Tensor) {
        let s = spec(serde_json::json!({
            "model": "hf", "model_path": "file:///unused", "model_config": {"ctx": 8},
            "hf_config": {"architectures": [arch], "vocab_size": 67, "hidden_size": 32,
                "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 8, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": tied, "initializer_range": 0.2},
            "dataset": "file:///unused", "global_batch": 3, "seed": 11,
        }));
        let (_, d, x, y) = gpt();
        (s, d, x, y)
    }

    fn llama() -> (TrainingSpec, Dataset, Tensor, Tensor) {
        hf("LlamaForCausalLM", false)
    }

    fn qwen2_tied() -> (TrainingSpec, Dataset, Tensor, Tensor) {
        hf("Qwen2ForCausalLM", true)
    }

    /// A small GPT-2 (tied head, Conv1D layouts) with an MLP of 50 (uneven over 4 members).
    fn gpt2() -> (TrainingSpec, Dataset, Tensor, Tensor) {
        let s = spec(serde_json::json!({
            "model": "hf", "model_path": "file:///unused", "model_config": {"ctx": 8},
            "hf_config": {"architectures": ["GPT2LMHeadModel"], "vocab_size": 67, "n_embd": 32,
                "n_layer": 2, "n_head": 4, "n_inner": 50, "n_positions": 8,
                "initializer_range": 0.2},
            "dataset": "file:///unused", "global_batch": 3, "seed": 13,
        }));
        let (_, d, x, y) = gpt();
        (s, d, x, y)
    }

    fn gpt2_sliced() -> (TrainingSpec, Dataset, Tensor, Tensor) {
        let (mut s, d, x, y) = gpt2();
        s.deterministic = true;
        s.tensor_slices = Some(4);
        (s, d, x, y)
    }

    fn llama_sliced() -> (TrainingSpec, Dataset, Tensor, Tensor) {
        let (mut s, d, x, y) = llama();
        s.deterministic = true;
        s.tensor_slices = Some(2);
        (s, d, x, y)
    }

    fn mlp() -> (TrainingSpec, Dataset, Tensor, Tensor) {
        let s = spec(serde_json::json!({
            "model": "mlp",
            "model_config": {"hidden": 10, "layers": 3},
            "dataset": "file:///unused", "global_batch": 5, "seed": 3,
        }));
        tch::manual_seed(6);
        let x = Tensor::randn([5, 6], (Kind::Float, Device::Cpu));
        let y = Tensor::randn([5, 2], (Kind::Float, Device::Cpu));
        let data = Dataset::Regression {
            x: x.shallow_clone(),
            y: y.shallow_clone(),
        };
        (s, data, x, y)
    }

    type Grads = BTreeMap<String, Tensor>;

    fn grads(m: &Model) -> Grads {
        m.params()
            .into_iter()
            .map(|(n, p)| (n, p.grad().copy()))
            .collect()
    }

    /// Every member's loss and gradients at `tp`, from models built from the same seed.
    fn run_tp(
        comms: &[Arc<dyn Communicator>],
        make: &dyn Fn() -> (TrainingSpec, Dataset, Tensor, Tensor),
    ) -> Vec<(f64, Grads, usize)> {
        let tp = comms.len() as u32;
        // built one after another: the seed is global to libtorch
        let models: Vec<(Model, Tensor, Tensor)> = (0..tp)
            .map(|_| {
                let (s, d, x, y) = make();
                (Model::new(&s, &d, Device::Cpu).unwrap(), x, y)
            })
            .collect();
        std::thread::scope(|sc| {
            let hs: Vec<_> = models
                .into_iter()
                .zip(comms)
                .map(|((mut m, x, y), c)| {
                    sc.spawn(move || {
                        let members = (0..tp).collect();
                        m.shard(Group::new(c.clone(), members).unwrap()).unwrap();
                        let mut tape = Tape::default();
                        let out = m.forward(0, m.units(), &x, &mut tape).unwrap();
                        let loss = m.loss(&out, &y, &mut tape).unwrap();
                        let cuts = tape.len();
                        m.backward(tape, &loss, None).unwrap();
                        (loss.double_value(&[]), grads(&m), cuts)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// What member `rank` of `tp` should hold of the full-model tensor `t` named `name`.
    fn slice_of(arch: Arch, name: &str, t: &Tensor, tp: u32, rank: u32) -> Tensor {
        let shape: Vec<u64> = t.size().iter().map(|d| *d as u64).collect();
        let boxes = held_regions(arch, name, &shape, tp, rank);
        let dim = split_of(arch, name).dim() as i64;
        let pieces: Vec<Tensor> = boxes
            .iter()
            .map(|b| {
                b.iter().enumerate().fold(t.shallow_clone(), |v, (d, r)| {
                    v.narrow(d as i64, r.start as i64, (r.end - r.start) as i64)
                })
            })
            .collect();
        Tensor::cat(&pieces, dim)
    }

    /// Tensor-parallel loss and gradients equal the unsplit model's (to float rounding: the
    /// sums run in another order), member by member, and replicated parameters' gradients are
    /// the same bits on every member.
    async fn matches_the_unsplit_model(
        make: &dyn Fn() -> (TrainingSpec, Dataset, Tensor, Tensor),
        tps: &[u32],
        first_generation: u64,
    ) {
        let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
        let (s, d, x, y) = make();
        let full = Model::new(&s, &d, Device::Cpu).unwrap();
        let arch = full.arch();
        let loss = full.loss_sum(&x, &y);
        loss.backward();
        let want_loss = loss.double_value(&[]);
        let want = grads(&full);
        for (i, &tp) in tps.iter().enumerate() {
            let comms = mesh(tp, first_generation + i as u64).await;
            let got = run_tp(&comms, make);
            for (rank, (l, g, cuts)) in got.iter().enumerate() {
                assert!(
                    (l - want_loss).abs() <= 1e-5 * want_loss.abs().max(1.0),
                    "tp {tp} rank {rank}: loss {l} vs {want_loss}"
                );
                assert!(*cuts > 0, "the tape recorded the collectives");
                for (name, w) in &want {
                    let mine = &g[name];
                    let expect = slice_of(arch, name, w, tp, rank as u32);
                    assert_eq!(mine.size(), expect.size(), "tp {tp} rank {rank}: {name}");
                    assert!(
                        mine.allclose(&expect, 1e-4, 1e-6, false),
                        "tp {tp} rank {rank}: gradient of {name} differs by {}",
                        (mine - &expect).abs().max().double_value(&[])
                    );
                    if split_of(arch, name) == ductile_strategies::tensor::Split::Replicated {
                        assert!(mine.equal(&got[0].1[name]), "{name}: same bits everywhere");
                    }
                }
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tensor_parallel_gpt_computes_the_unsplit_models_loss_and_gradients() {
        // 67 tokens: no tp divides the vocabulary, nothing is padded
        matches_the_unsplit_model(&gpt, &[1, 2, 4], 10).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tensor_parallel_mlp_computes_the_unsplit_models_loss_and_gradients() {
        // 10 hidden units over 3 and 4 members: uneven slices
        matches_the_unsplit_model(&mlp, &[1, 2, 3, 4], 20).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tensor_parallel_llama_and_tied_qwen2_compute_the_unsplit_models_loss_and_gradients() {
        // whole query heads and the KV heads they share per member: tp 1 and 2 of 2 KV heads
        matches_the_unsplit_model(&llama, &[1, 2], 60).await;
        matches_the_unsplit_model(&qwen2_tied, &[1, 2], 70).await;
        the_same_bits_at_every_group_size_of(&llama_sliced, &[2], 80).await;
    }

    /// GPT-2's fused Q/K/V split along the columns of its Conv1D weight, each of Q, K and V
    /// by heads; with logical slices, the same bits at every group size.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tensor_parallel_gpt2_computes_the_unsplit_models_loss_and_gradients() {
        matches_the_unsplit_model(&gpt2, &[1, 2, 4], 90).await;
        the_same_bits_at_every_group_size(&gpt2_sliced, 100).await;
    }

    /// With `activation_checkpointing = "full"` (blocks run without gradients, then again in
    /// the backward), the loss and every gradient are the bits of the run that keeps the
    /// activations: the whole model, and members of a tensor group of 2 (the recomputed
    /// blocks' collectives included). GPT-2 (a tied head), the Llama and the built-in GPT.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recomputed_blocks_give_the_same_loss_and_gradients_bit_for_bit() {
        let recomputed = |make: fn() -> (TrainingSpec, Dataset, Tensor, Tensor)| {
            move || {
                let (mut s, d, x, y) = make();
                s.activation_checkpointing =
                    ductile_cluster::records::ActivationCheckpointing::Full;
                (s, d, x, y)
            }
        };
        let whole = |make: &dyn Fn() -> (TrainingSpec, Dataset, Tensor, Tensor)| {
            let (s, d, x, y) = make();
            let m = Model::new(&s, &d, Device::Cpu).unwrap();
            let mut tape = Tape::default();
            let out = m.forward(0, m.units(), &x, &mut tape).unwrap();
            let loss = m.loss(&out, &y, &mut tape).unwrap();
            let cuts = tape.len();
            m.backward(tape, &loss, None).unwrap();
            (loss.double_value(&[]), grads(&m), cuts)
        };
        for (i, make) in [gpt2 as fn() -> _, llama, gpt].into_iter().enumerate() {
            let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
            let r = recomputed(make);
            let (l0, g0, cuts0) = whole(&make);
            let (l1, g1, cuts1) = whole(&r);
            assert_eq!(cuts0, 0, "the whole model keeps its graph");
            assert!(cuts1 > 0, "the blocks were recomputed");
            assert_eq!(l0.to_bits(), l1.to_bits(), "model {i}: loss");
            for (n, g) in &g0 {
                assert!(g.equal(&g1[n]), "model {i}: gradient of {n}");
            }
            let gen = 110 + 2 * i as u64;
            let a = run_tp(&mesh(2, gen).await, &make);
            let b = run_tp(&mesh(2, gen + 1).await, &r);
            for (rank, ((la, ga, _), (lb, gb, _))) in a.iter().zip(&b).enumerate() {
                assert_eq!(la.to_bits(), lb.to_bits(), "model {i} rank {rank}: loss");
                for (n, g) in ga {
                    assert!(g.equal(&gb[n]), "model {i} rank {rank}: gradient of {n}");
                }
            }
        }
    }

    /// A model made holding a shard place's rows (a fully sharded job's new process) holds
    /// exactly those rows of the whole model's parameters, bit for bit, at every place of an
    /// uneven shard group (some places with no rows of a short parameter), and knows the
    /// whole shapes. GPT-2 (tied), the Llama, the built-in GPT and the MLP.
    #[test]
    fn a_model_made_in_rows_holds_the_whole_models_rows_bit_for_bit() {
        for make in [gpt2 as fn() -> _, qwen2_tied, llama, gpt, mlp] {
            let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
            let (s, d, _, _) = make();
            let whole = Model::new(&s, &d, Device::Cpu).unwrap();
            assert_eq!(whole.seed_rows(), (1, 0));
            let shapes: Vec<Vec<i64>> = whole.params().iter().map(|(_, t)| t.size()).collect();
            assert_eq!(whole.shapes(), shapes.as_slice());
            let s_places = 5u32;
            let mut empty = 0;
            for place in 0..s_places {
                let m = Model::with_rows(&s, &d, Device::Cpu, (s_places, place)).unwrap();
                assert_eq!(m.seed_rows(), (s_places, place));
                assert_eq!(
                    m.shapes(),
                    shapes.as_slice(),
                    "whole shapes at place {place}"
                );
                for ((n, w), (n2, r)) in whole.params().iter().zip(m.params()) {
                    assert_eq!(n, &n2);
                    let want = super::super::shard_rows(w, (s_places, place));
                    assert_eq!(r.size(), want.size(), "{n} at place {place}");
                    assert!(r.equal(&want), "{n} at place {place}: other bits");
                    empty += usize::from(r.numel() == 0);
                }
            }
            // (the MLP's output layer, 2 rows, leaves places with none)
            if s.model == ductile_cluster::records::ModelKind::Mlp {
                assert!(empty > 0, "{:?}: some place holds no rows", s.model);
            }
        }
    }

    /// Unit by unit (full sharding's step): each unit run again from its input, its gradients
    /// taken with `run_backward` from its output's gradient, give the whole backward's loss
    /// and gradients bit for bit (a tied parameter's two contributions summed, later unit
    /// first). GPT-2 (tied), the Llama, the built-in GPT and the MLP.
    #[test]
    fn unit_by_unit_gradients_are_the_whole_backward_s_bit_for_bit() {
        for (i, make) in [gpt2 as fn() -> _, llama, gpt, mlp].into_iter().enumerate() {
            let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
            let (s, d, x, y) = make();
            let m = Model::new(&s, &d, Device::Cpu).unwrap();
            let out = m.loss_sum(&x, &y) / 3.0;
            out.backward();
            let g0 = grads(&m);
            let params: Vec<(String, Tensor)> = m.params();
            let units = m.units();
            let mut acts = vec![x.shallow_clone()];
            tch::no_grad(|| {
                for u in 0..units - 1 {
                    let h = m.unit_forward(u, acts.last().unwrap());
                    acts.push(h);
                }
            });
            let mut got: BTreeMap<String, Tensor> = BTreeMap::new();
            let mut go: Option<Tensor> = None;
            let mut loss1 = 0.0;
            for u in (0..units).rev() {
                let xin = acts.pop().unwrap();
                let xin = if u > 0 {
                    xin.detach().set_requires_grad(true)
                } else {
                    xin
                };
                let o = m.unit_forward(u, &xin);
                let root = if u + 1 == units {
                    let l = m.whole_loss(&o, &y) / 3.0;
                    loss1 = l.double_value(&[]);
                    l
                } else {
                    (&o * go.as_ref().unwrap()).sum(Kind::Float)
                };
                let mut wrt: Vec<&Tensor> = params.iter().map(|(_, p)| p).collect();
                if u > 0 {
                    wrt.push(&xin);
                }
                let gs = Tensor::run_backward(&[&root], &wrt, false, false);
                for (j, (n, _)) in params.iter().enumerate() {
                    if gs[j].defined() {
                        let prev = got.remove(n);
                        got.insert(
                            n.clone(),
                            match prev {
                                Some(p) => p + &gs[j],
                                None => gs[j].shallow_clone(),
                            },
                        );
                    }
                }
                if u > 0 {
                    go = Some(gs[params.len()].shallow_clone());
                }
            }
            assert_eq!(
                loss1.to_bits(),
                out.double_value(&[]).to_bits(),
                "model {i}: loss"
            );
            for (n, g) in &g0 {
                assert!(g.equal(&got[n]), "model {i}: gradient of {n}");
            }
        }
    }

    /// [`Model::backward_by_unit`] (the overlapped data-parallel step's backward) gives the
    /// whole backward's loss and gradients bit for bit, with and without activation
    /// checkpointing, and calls back once per unit, last first, each time with more
    /// parameters holding their gradients. GPT-2 (tied), the Llama, the built-in GPT, the MLP.
    #[test]
    fn backward_by_unit_gives_the_whole_backward_s_bits_and_calls_back_last_unit_first() {
        for (i, make) in [gpt2 as fn() -> _, llama, gpt, mlp].into_iter().enumerate() {
            for recompute in [false, true] {
                let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
                let (mut s, d, x, y) = make();
                if recompute {
                    s.activation_checkpointing =
                        ductile_cluster::records::ActivationCheckpointing::Full;
                }
                let whole = Model::new(&s, &d, Device::Cpu).unwrap();
                let l0 = whole.loss_sum(&x, &y) / 3.0;
                l0.backward();
                let g0 = grads(&whole);
                let m = Model::new(&s, &d, Device::Cpu).unwrap();
                let params = m.params();
                let mut calls = Vec::new();
                let l1 = m.backward_by_unit(&x, &y, 3.0, |u| {
                    let ready = params.iter().filter(|(_, p)| p.grad().defined()).count();
                    calls.push((u, ready));
                });
                let units = m.units();
                let order: Vec<usize> = calls.iter().map(|c| c.0).collect();
                assert_eq!(order, (0..units).rev().collect::<Vec<_>>(), "model {i}");
                assert!(
                    calls.windows(2).all(|w| w[0].1 < w[1].1),
                    "model {i}: every unit's backward readies parameters: {calls:?}"
                );
                assert_eq!(calls.last().unwrap().1, params.len(), "model {i}");
                assert!(!l1.requires_grad());
                assert_eq!(
                    l1.double_value(&[]).to_bits(),
                    l0.double_value(&[]).to_bits(),
                    "model {i} (recompute {recompute}): loss"
                );
                let g1 = grads(&m);
                for (n, g) in &g0 {
                    assert!(
                        g.equal(&g1[n]),
                        "model {i} (recompute {recompute}): gradient of {n}"
                    );
                }
            }
        }
    }

    fn gpt2_bf16() -> (TrainingSpec, Dataset, Tensor, Tensor) {
        let (mut s, d, x, y) = gpt2_sliced();
        s.precision = ductile_cluster::records::Precision::Bf16;
        (s, d, x, y)
    }

    /// `precision = "bf16"`: the loss and gradients stay near f32's (bf16 products, f32 sums,
    /// norms and loss), the weights' gradients arrive in f32, and with logical slices the bits
    /// are the same at every tensor-parallel group size.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bf16_products_stay_near_f32_and_give_the_same_bits_at_every_group_size() {
        for (i, make) in [gpt2 as fn() -> _, llama].into_iter().enumerate() {
            let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
            let run = |bf16: bool| {
                let (mut s, d, x, y) = make();
                if bf16 {
                    s.precision = ductile_cluster::records::Precision::Bf16;
                }
                let m = Model::new(&s, &d, Device::Cpu).unwrap();
                let mut tape = Tape::default();
                let out = m.forward(0, m.units(), &x, &mut tape).unwrap();
                let loss = m.loss(&out, &y, &mut tape).unwrap();
                m.backward(tape, &loss, None).unwrap();
                (loss.double_value(&[]), grads(&m))
            };
            let ((l32, g32), (l16, g16)) = (run(false), run(true));
            assert_ne!(
                l32.to_bits(),
                l16.to_bits(),
                "model {i}: bf16 computed in bf16"
            );
            assert!(
                (l16 - l32).abs() < 2e-2 * l32.abs(),
                "model {i}: {l16} vs {l32}"
            );
            for (n, a) in &g32 {
                let b = &g16[n];
                assert_eq!(b.kind(), Kind::Float, "{n}: an f32 gradient");
                let cos = (a * b).sum(Kind::Double).double_value(&[])
                    / (a.norm().double_value(&[]) * b.norm().double_value(&[])).max(1e-30);
                assert!(cos > 0.99, "model {i}: gradient of {n}: cosine {cos}");
            }
        }
        the_same_bits_at_every_group_size(&gpt2_bf16, 120).await;
    }

    fn gpt_sliced() -> (TrainingSpec, Dataset, Tensor, Tensor) {
        let (mut s, d, x, y) = gpt();
        s.deterministic = true;
        s.tensor_slices = Some(4);
        (s, d, x, y)
    }

    fn mlp_sliced() -> (TrainingSpec, Dataset, Tensor, Tensor) {
        let (mut s, d, x, y) = mlp();
        s.deterministic = true;
        s.tensor_slices = Some(4);
        (s, d, x, y)
    }

    /// With a fixed number of logical slices (deterministic `tensor_slices`), the loss and
    /// every gradient are the same bits at tensor_parallel 1, 2 and 4.
    async fn the_same_bits_at_every_group_size(
        make: &dyn Fn() -> (TrainingSpec, Dataset, Tensor, Tensor),
        first_generation: u64,
    ) {
        the_same_bits_at_every_group_size_of(make, &[2, 4], first_generation).await
    }

    async fn the_same_bits_at_every_group_size_of(
        make: &dyn Fn() -> (TrainingSpec, Dataset, Tensor, Tensor),
        tps: &[u32],
        first_generation: u64,
    ) {
        let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
        let one = run_tp(&mesh(1, first_generation).await, make);
        let (want_loss, want, _) = &one[0];
        let arch = {
            let (s, d, _, _) = make();
            Model::new(&s, &d, Device::Cpu).unwrap().arch()
        };
        for (i, &tp) in tps.iter().enumerate() {
            let got = run_tp(&mesh(tp, first_generation + 1 + i as u64).await, make);
            for (rank, (l, g, _)) in got.iter().enumerate() {
                assert_eq!(
                    l.to_bits(),
                    want_loss.to_bits(),
                    "tp {tp} rank {rank}: loss"
                );
                for (name, w) in want {
                    let expect = slice_of(arch, name, w, tp, rank as u32);
                    assert!(
                        g[name].equal(&expect),
                        "tp {tp} rank {rank}: {name} differs"
                    );
                }
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn logical_slices_give_the_same_bits_at_every_group_size() {
        the_same_bits_at_every_group_size(&gpt_sliced, 40).await;
        the_same_bits_at_every_group_size(&mlp_sliced, 50).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tp_the_model_cannot_split_into_is_refused() {
        let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
        let comms = mesh(3, 30).await;
        let (s, d, _, _) = gpt();
        let mut m = Model::new(&s, &d, Device::Cpu).unwrap();
        let e = m
            .shard(Group::new(comms[0].clone(), vec![0, 1, 2]).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("n_head = 4"), "{e}");
        assert!(m.tensor_shard().is_none());
        assert_eq!(
            m.params()[0].1.numel(),
            grads_numel(&s, &d, 0),
            "nothing was sliced"
        );
    }

    fn grads_numel(s: &TrainingSpec, d: &Dataset, i: usize) -> usize {
        Model::new(s, d, Device::Cpu).unwrap().params()[i].1.numel()
    }
}

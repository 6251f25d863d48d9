//! Models, defined with tch: an MLP (regression) and a small decoder-only transformer (GPT-style:
//! token and position embeddings, causal self-attention, MLP, layer norm). Initialised from the
//! job's seed, so every rank builds the same weights.

use ductile_cluster::records::{ModelKind, TrainingSpec};
use ductile_comm::CommError;
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::data::Dataset;

mod tp;
use tp::Par;
pub use tp::{Shard, Tape};

/// The context length of a GPT job (`model_config.ctx`, default 32; the spec was checked at
/// submission).
pub fn ctx(spec: &TrainingSpec) -> usize {
    spec.gpt_config().map(|c| c.ctx).unwrap_or(32) as usize
}

struct Block {
    ln1: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    ln2: nn::LayerNorm,
    fc: nn::Linear,
    fc2: nn::Linear,
    heads: i64,
}

impl Block {
    fn new(p: nn::Path, c: i64, heads: i64) -> Block {
        Block {
            ln1: nn::layer_norm(&p / "ln1", vec![c], Default::default()),
            qkv: nn::linear(&p / "qkv", c, 3 * c, Default::default()),
            proj: nn::linear(&p / "proj", c, c, Default::default()),
            ln2: nn::layer_norm(&p / "ln2", vec![c], Default::default()),
            fc: nn::linear(&p / "fc", c, 4 * c, Default::default()),
            fc2: nn::linear(&p / "fc2", 4 * c, c, Default::default()),
            heads,
        }
    }

    /// The block on `x`: the whole block, or this member's slices of heads and MLP columns.
    fn forward(&self, x: &Tensor, mask: &Tensor, p: &mut Par) -> Result<Tensor, CommError> {
        let c = x.size()[2];
        let hd = c / self.heads;
        let x = p.plain(x);
        let a = p.f(&x.apply(&self.ln1));
        let ys: Vec<Tensor> = p
            .qkv(&self.qkv, &a, c)
            .iter()
            .map(|[q, k, v]| attention(q, k, v, mask, hd))
            .collect();
        let y = p.row(&self.proj, &ys, c)?;
        let x1 = p.plain(&(x + y));
        let hs = p.f(&x1.apply(&self.ln2));
        let us: Vec<Tensor> = p
            .column(&self.fc, &hs, 4 * c)
            .iter()
            .map(|u| u.gelu("none"))
            .collect();
        let h = p.row(&self.fc2, &us, 4 * c)?;
        Ok(x1 + h)
    }
}

/// Causal self-attention over heads of `hd` on `q`, `k`, `v` (`[b, t, width]`, a whole number of
/// heads): the heads' outputs, `[b, t, width]`.
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, hd: i64) -> Tensor {
    let (b, t, w) = q.size3().unwrap();
    let heads = |x: &Tensor| x.view([b, t, w / hd, hd]).transpose(1, 2);
    let (q, k, v) = (heads(q), heads(k), heads(v));
    let att = (q.matmul(&k.transpose(-2, -1)) / (hd as f64).sqrt())
        .masked_fill(mask, f64::NEG_INFINITY)
        .softmax(-1, Kind::Float);
    att.matmul(&v).transpose(1, 2).contiguous().view([b, t, w])
}

enum Net {
    Gpt {
        tok: nn::Embedding,
        pos: nn::Embedding,
        blocks: Vec<Block>,
        ln_f: nn::LayerNorm,
        head: nn::Linear,
        ctx: i64,
        vocab: i64,
        /// The width of every activation between units (d_model).
        width: i64,
    },
    Mlp {
        /// Hidden layers, each followed by tanh.
        hidden: Vec<nn::Linear>,
        out: nn::Linear,
        width: i64,
    },
}

pub struct Model {
    pub vs: nn::VarStore,
    net: Net,
    /// This model's tensor group and slices, once [`Model::shard`]ed.
    shard: Option<Shard>,
    /// Deterministic mode's logical slices per split layer (`tensor_slices`).
    slices: Option<u32>,
}

impl Model {
    /// Built on the CPU from the seed (so every device kind starts from the same bits), then
    /// moved to `device`.
    pub fn new(spec: &TrainingSpec, data: &Dataset, device: tch::Device) -> anyhow::Result<Model> {
        tch::manual_seed(spec.seed as i64);
        let mut vs = nn::VarStore::new(tch::Device::Cpu);
        let root = vs.root();
        let net = match (spec.model, data) {
            (ModelKind::Gpt, Dataset::Tokens { vocab, ctx, .. }) => {
                let g = spec.gpt_config()?;
                let (c, layers, heads) = (g.d_model, g.n_layer, g.n_head);
                let vocab = (*vocab as i64).max(g.vocab);
                Net::Gpt {
                    tok: nn::embedding(&root / "tok", vocab, c, Default::default()),
                    pos: nn::embedding(&root / "pos", *ctx as i64, c, Default::default()),
                    blocks: (0..layers)
                        .map(|i| Block::new(&root / format!("h{i}"), c, heads))
                        .collect(),
                    ln_f: nn::layer_norm(&root / "ln_f", vec![c], Default::default()),
                    head: nn::linear(
                        &root / "head",
                        c,
                        vocab,
                        nn::LinearConfig {
                            bias: false,
                            ..Default::default()
                        },
                    ),
                    ctx: *ctx as i64,
                    vocab,
                    width: c,
                }
            }
            (ModelKind::Mlp, Dataset::Regression { x, y }) => {
                let (d_in, d_out) = (x.size()[1], y.size()[1]);
                let m = spec.mlp_config()?;
                let (width, layers) = (m.hidden, m.layers);
                let mut hidden = Vec::new();
                let mut d = d_in;
                for i in 0..layers {
                    hidden.push(nn::linear(
                        &root / format!("l{i}"),
                        d,
                        width,
                        Default::default(),
                    ));
                    d = width;
                }
                Net::Mlp {
                    hidden,
                    out: nn::linear(&root / "out", d, d_out, Default::default()),
                    width,
                }
            }
            (m, _) => anyhow::bail!(
                "model {m:?} does not fit its dataset (gpt needs tokens, mlp a regression set)"
            ),
        };
        if device != tch::Device::Cpu {
            vs.set_device(device);
        }
        Ok(Model {
            vs,
            net,
            shard: None,
            slices: spec.tensor_slices.filter(|_| spec.deterministic),
        })
    }

    /// Whether split layers run in logical slices (deterministic `tensor_slices`): such a model
    /// computes through a tensor group even when it has one member.
    pub fn sliced(&self) -> bool {
        self.slices.is_some()
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
        match &self.net {
            Net::Gpt { blocks, .. } => blocks.len() + 2,
            Net::Mlp { hidden, .. } => hidden.len() + 1,
        }
    }

    /// The shape of the activation entering unit `unit` (> 0) for `n` samples.
    pub fn boundary_shape(&self, unit: usize, n: i64) -> Vec<i64> {
        debug_assert!(unit > 0);
        match &self.net {
            // from the config, not a weight: a stage may have released the embeddings
            Net::Gpt { ctx, width, .. } => vec![n, *ctx, *width],
            Net::Mlp { width, .. } => vec![n, *width],
        }
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
        self.forward_with(a, b, input, &mut self.par(tape))
    }

    /// Sum over the batch of each sample's loss, from the network's output (in a tensor
    /// group every member gets the same loss).
    pub fn loss(&self, out: &Tensor, y: &Tensor, tape: &mut Tape) -> Result<Tensor, CommError> {
        self.loss_with(out, y, &mut self.par(tape))
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
        match &self.shard {
            Some(s) => tape.backward(out, grad, &s.group),
            None => {
                tp::backward_with(out, grad);
                Ok(())
            }
        }
    }

    /// Sum over the batch of each sample's loss of the whole model, whatever its tensor group
    /// (evaluation, and the local steps of DiLoCo and async; so / global batch gives the exact
    /// mean).
    pub fn loss_sum(&self, x: &Tensor, y: &Tensor) -> Tensor {
        if let Net::Gpt { ctx, .. } = &self.net {
            debug_assert!(x.size()[1] <= *ctx);
        }
        let whole = "the whole model does not communicate";
        let out = self
            .forward_with(0, self.units(), x, &mut Par::Whole)
            .expect(whole);
        self.loss_with(&out, y, &mut Par::Whole).expect(whole)
    }

    fn forward_with(
        &self,
        a: usize,
        b: usize,
        input: &Tensor,
        p: &mut Par,
    ) -> Result<Tensor, CommError> {
        match &self.net {
            Net::Gpt {
                tok,
                pos,
                blocks,
                ln_f,
                head,
                vocab,
                ..
            } => {
                let mut h = input.shallow_clone();
                let mut mask: Option<Tensor> = None;
                for u in a..b {
                    if u == 0 {
                        let t = h.size()[1];
                        let positions = Tensor::arange(t, (Kind::Int64, h.device()));
                        h = p.embed(tok, &h, *vocab)? + pos.forward(&positions);
                    } else if u <= blocks.len() {
                        let t = h.size()[1];
                        let m = mask.get_or_insert_with(|| {
                            Tensor::ones([t, t], (Kind::Bool, h.device()))
                                .tril(0)
                                .logical_not()
                        });
                        h = blocks[u - 1].forward(&h, m, p)?;
                    } else {
                        h = p.head(head, &h.apply(ln_f), *vocab);
                    }
                }
                Ok(h)
            }
            Net::Mlp { hidden, out, width } => {
                let layers = hidden.len() as u64;
                let mut h = input.shallow_clone();
                // a column-parallel layer's output, slice by slice, for the row-parallel next
                let mut sliced: Vec<Tensor> = Vec::new();
                for u in a..b {
                    if u == hidden.len() {
                        h = h.apply(out);
                        continue;
                    }
                    let l = &hidden[u];
                    match p.mlp_role(layers, u as u64) {
                        (true, _) => {
                            let xs = p.f(&h);
                            sliced = p.column(l, &xs, *width).iter().map(|x| x.tanh()).collect();
                        }
                        (_, true) => h = p.row(l, &sliced, *width)?.tanh(),
                        _ => h = h.apply(l).tanh(),
                    }
                }
                Ok(h)
            }
        }
    }

    fn loss_with(&self, out: &Tensor, y: &Tensor, p: &mut Par) -> Result<Tensor, CommError> {
        match &self.net {
            // mean over positions of each sample, summed over samples
            Net::Gpt { vocab, .. } => p.cross_entropy(out, y, *vocab),
            Net::Mlp { .. } => {
                let d = y.size()[1];
                Ok((out - y).square().sum(Kind::Float) / d as f64)
            }
        }
    }
}

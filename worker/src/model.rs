//! Models, defined with tch: an MLP (regression) and a small decoder-only transformer (GPT-style:
//! token and position embeddings, causal self-attention, MLP, layer norm). Initialised from the
//! job's seed, so every rank builds the same weights.

use ductile_cluster::records::{ModelKind, TrainingSpec};
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::data::Dataset;

mod tp;
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

    fn forward(&self, x: &Tensor, mask: &Tensor) -> Tensor {
        let (b, t, c) = x.size3().unwrap();
        let hd = c / self.heads;
        let qkv = x.apply(&self.ln1).apply(&self.qkv);
        let split = qkv.split(c, 2);
        let heads = |t_: &Tensor| t_.view([b, t, self.heads, hd]).transpose(1, 2);
        let (q, k, v) = (heads(&split[0]), heads(&split[1]), heads(&split[2]));
        let att = (q.matmul(&k.transpose(-2, -1)) / (hd as f64).sqrt())
            .masked_fill(mask, f64::NEG_INFINITY)
            .softmax(-1, Kind::Float);
        let y = att.matmul(&v).transpose(1, 2).contiguous().view([b, t, c]);
        let x = x + y.apply(&self.proj);
        let h = x
            .apply(&self.ln2)
            .apply(&self.fc)
            .gelu("none")
            .apply(&self.fc2);
        x + h
    }
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

    /// Run units `[a, b)` on `input`: token ids or features when `a` is 0, else the activation
    /// unit `a − 1` produced. With `b` the last unit, the result is the network's output.
    pub fn forward_units(&self, a: usize, b: usize, input: &Tensor) -> Tensor {
        match &self.net {
            Net::Gpt {
                tok,
                pos,
                blocks,
                ln_f,
                head,
                ..
            } => {
                let mut h = input.shallow_clone();
                let mut mask: Option<Tensor> = None;
                for u in a..b {
                    if u == 0 {
                        let t = h.size()[1];
                        let positions = Tensor::arange(t, (Kind::Int64, h.device()));
                        h = tok.forward(&h) + pos.forward(&positions);
                    } else if u <= blocks.len() {
                        let t = h.size()[1];
                        let m = mask.get_or_insert_with(|| {
                            Tensor::ones([t, t], (Kind::Bool, h.device()))
                                .tril(0)
                                .logical_not()
                        });
                        h = blocks[u - 1].forward(&h, m);
                    } else {
                        h = h.apply(ln_f).apply(head);
                    }
                }
                h
            }
            Net::Mlp { hidden, out, .. } => {
                let mut h = input.shallow_clone();
                for u in a..b {
                    h = if u < hidden.len() {
                        hidden[u].forward(&h).tanh()
                    } else {
                        out.forward(&h)
                    };
                }
                h
            }
        }
    }

    /// Sum over the batch of each sample's loss, from the network's output.
    pub fn loss_of(&self, out: &Tensor, y: &Tensor) -> Tensor {
        match &self.net {
            Net::Gpt { vocab, .. } => {
                let (b, t, _) = out.size3().unwrap();
                // mean over positions of each sample, summed over samples
                out.view([b * t, *vocab]).cross_entropy_loss::<Tensor>(
                    &y.view([b * t]),
                    None,
                    tch::Reduction::Sum,
                    -100,
                    0.0,
                ) / t as f64
            }
            Net::Mlp { .. } => {
                let d = y.size()[1];
                (out - y).square().sum(Kind::Float) / d as f64
            }
        }
    }

    /// Sum over the batch of each sample's loss (so / global batch gives the exact mean).
    pub fn loss_sum(&self, x: &Tensor, y: &Tensor) -> Tensor {
        if let Net::Gpt { ctx, .. } = &self.net {
            debug_assert!(x.size()[1] <= *ctx);
        }
        self.loss_of(&self.forward_units(0, self.units(), x), y)
    }
}

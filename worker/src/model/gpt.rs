//! The built-in GPT: token and learned position embeddings, pre-norm blocks (causal
//! self-attention with a fused Q/K/V, an MLP with exact GELU), a final layer norm and an untied
//! head without bias. Units: `embed` (`tok`, `pos`), the blocks `h0..`, `head` (`ln_f`,
//! `head`).

use ductile_comm::CommError;
use ductile_strategies::tensor::{self, Arch};
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use super::tp::Par;
use super::Network;

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

pub(super) struct Gpt {
    tok: nn::Embedding,
    pos: nn::Embedding,
    blocks: Vec<Block>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
    ctx: i64,
    vocab: i64,
    /// The width of every activation between units (d_model).
    width: i64,
}

impl Gpt {
    /// Its parameters under `root`, made in the order the seed's draws follow.
    pub(super) fn new(
        root: &nn::Path,
        cut: &super::Cut,
        c: i64,
        layers: i64,
        heads: i64,
        vocab: i64,
        ctx: i64,
    ) -> Gpt {
        let tok = nn::embedding(root / "tok", vocab, c, Default::default());
        let pos = nn::embedding(root / "pos", ctx, c, Default::default());
        cut.unit();
        let blocks = (0..layers)
            .map(|i| {
                let b = Block::new(root / format!("h{i}"), c, heads);
                cut.unit();
                b
            })
            .collect();
        Gpt {
            tok,
            pos,
            blocks,
            ln_f: nn::layer_norm(root / "ln_f", vec![c], Default::default()),
            head: nn::linear(
                root / "head",
                c,
                vocab,
                nn::LinearConfig {
                    bias: false,
                    ..Default::default()
                },
            ),
            ctx,
            vocab,
            width: c,
        }
    }
}

impl Network for Gpt {
    fn units(&self) -> usize {
        self.blocks.len() + 2
    }

    /// From the configuration, not a weight: a stage may have released the embeddings.
    fn boundary_shape(&self, _unit: usize, n: i64) -> Vec<i64> {
        vec![n, self.ctx, self.width]
    }

    fn forward(
        &self,
        a: usize,
        b: usize,
        input: &Tensor,
        p: &mut Par,
    ) -> Result<Tensor, CommError> {
        let mut h = input.shallow_clone();
        let mut mask: Option<Tensor> = None;
        for u in a..b {
            if u == 0 {
                let t = h.size()[1];
                debug_assert!(t <= self.ctx);
                let positions = Tensor::arange(t, (Kind::Int64, h.device()));
                h = p.embed(&self.tok, &h, self.vocab)? + self.pos.forward(&positions);
            } else if u <= self.blocks.len() {
                let t = h.size()[1];
                let m = mask.get_or_insert_with(|| {
                    Tensor::ones([t, t], (Kind::Bool, h.device()))
                        .tril(0)
                        .logical_not()
                });
                h = self.blocks[u - 1].forward(&h, m, p)?;
            } else {
                h = p.head(&self.head.ws, &h.apply(&self.ln_f), self.vocab);
            }
        }
        Ok(h)
    }

    /// The cross-entropy: mean over positions of each sample, summed over samples.
    fn loss(&self, out: &Tensor, y: &Tensor, p: &mut Par) -> Result<Tensor, CommError> {
        p.cross_entropy(out, y, self.vocab)
    }

    fn split_rules(&self) -> Arch {
        Arch::Gpt {
            heads: self.blocks.first().map(|b| b.heads as u64).unwrap_or(1),
        }
    }

    fn check_tp(&self, tp: u32) -> Result<(), String> {
        let (c, vocab) = (self.width as u64, self.vocab as u64);
        tensor::check_tp(self.split_rules(), c, vocab, 4 * c, tp)
    }
}

//! GPT-2 (`GPT2LMHeadModel`) with Hugging Face's parameter names and layouts, so loading a
//! model directory and exporting one are copies: learned positions, pre-LayerNorm blocks,
//! fused Q/K/V, Conv1D weights stored `[in, out]` (`y = x · W + b`), `gelu_new`, biases
//! everywhere, a head tied to the token embedding (or an untied `lm_head`).
//!
//! Units: `embed` (`transformer.wte`, `transformer.wpe`), each block (`transformer.h.{i}`),
//! `head` (`transformer.ln_f`, the tied embedding or `lm_head`). Split over a tensor group as
//! Megatron splits GPT-2, on the stored layout: `c_attn` by heads (its columns, in each of Q, K
//! and V) and `c_fc` column-parallel, both `c_proj` row-parallel (their rows: the input), the
//! embedding and head vocabulary-parallel with a vocabulary-parallel cross-entropy. A Conv1D
//! weight enters the parallel layers as the linear layer it is (`W` transposed, a view).

use ductile_cluster::hf::{Act, HfConfig};
use ductile_comm::CommError;
use ductile_strategies::tensor::{self, Arch};
use tch::nn::{self, Init};
use tch::Tensor;

use super::llama::split_heads;
use super::tp::Par;
use super::Network;

/// A Conv1D layer: weight `[in, out]`, bias `[out]`.
struct Conv1D {
    w: Tensor,
    b: Tensor,
}

impl Conv1D {
    fn new(p: nn::Path, i: i64, o: i64, std: f64) -> Conv1D {
        Conv1D {
            w: p.var(
                "weight",
                &[i, o],
                Init::Randn {
                    mean: 0.0,
                    stdev: std,
                },
            ),
            b: p.var("bias", &[o], Init::Const(0.0)),
        }
    }

    /// The linear layer it is: weight `[out, in]` (a transposed view of the stored weight, so
    /// gradients reach it), the same bias.
    fn linear(&self) -> nn::Linear {
        nn::Linear {
            ws: self.w.tr(),
            bs: Some(self.b.shallow_clone()),
        }
    }

    /// `x · W + b`, as transformers' Conv1D computes it.
    fn apply(&self, x: &Tensor) -> Tensor {
        x.matmul(&self.w) + &self.b
    }
}

struct Norm {
    w: Tensor,
    b: Tensor,
}

impl Norm {
    fn new(p: nn::Path, d: i64) -> Norm {
        Norm {
            w: p.var("weight", &[d], Init::Const(1.0)),
            b: p.var("bias", &[d], Init::Const(0.0)),
        }
    }

    fn apply(&self, x: &Tensor, eps: f64) -> Tensor {
        let d = self.w.size()[0];
        x.layer_norm([d], Some(&self.w), Some(&self.b), eps, false)
    }
}

struct Block {
    ln_1: Norm,
    c_attn: Conv1D,
    attn_proj: Conv1D,
    ln_2: Norm,
    c_fc: Conv1D,
    mlp_proj: Conv1D,
}

pub(super) struct Gpt2 {
    c: HfConfig,
    wte: nn::Embedding,
    wpe: Tensor,
    h: Vec<Block>,
    ln_f: Norm,
    /// None when tied: the head is the token embedding.
    lm_head: Option<nn::Linear>,
    ctx: i64,
}

/// Scaled dot-product attention (scale 1/√head_dim, GPT-2's `scale_attn_weights`; one KV
/// head per query head), the heads' outputs merged: `[b, t, heads · hd]`.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Tensor {
    super::llama::attend(q, k, v, 1, causal)
}

impl Gpt2 {
    /// Its parameters under `root`, seeded as transformers initialises GPT-2: normal weights
    /// of `initializer_range` (the `c_proj` weights scaled by 1/√(2·n_layer)), zero biases,
    /// unit LayerNorms.
    pub(super) fn new(root: &nn::Path, cut: &super::Cut, c: &HfConfig, ctx: i64) -> Gpt2 {
        let std = c.initializer_range;
        let proj_std = std / (2.0 * c.n_layer as f64).sqrt();
        let (d, f) = (c.d_model, c.intermediate);
        let w_init = Init::Randn {
            mean: 0.0,
            stdev: std,
        };
        let tr = root / "transformer";
        let wte = nn::embedding(
            &tr / "wte",
            c.vocab,
            d,
            nn::EmbeddingConfig {
                ws_init: w_init,
                ..Default::default()
            },
        );
        let wpe = (&tr / "wpe").var("weight", &[c.max_positions, d], w_init);
        cut.unit();
        let h = (0..c.n_layer)
            .map(|i| {
                let p = &tr / "h" / i;
                let block = Block {
                    ln_1: Norm::new(&p / "ln_1", d),
                    c_attn: Conv1D::new(&p / "attn" / "c_attn", d, 3 * d, std),
                    attn_proj: Conv1D::new(&p / "attn" / "c_proj", d, d, proj_std),
                    ln_2: Norm::new(&p / "ln_2", d),
                    c_fc: Conv1D::new(&p / "mlp" / "c_fc", d, f, std),
                    mlp_proj: Conv1D::new(&p / "mlp" / "c_proj", f, d, proj_std),
                };
                cut.unit();
                block
            })
            .collect();
        let ln_f = Norm::new(&tr / "ln_f", d);
        let lm_head = (!c.tied).then(|| {
            nn::linear(
                root / "lm_head",
                d,
                c.vocab,
                nn::LinearConfig {
                    ws_init: w_init,
                    bs_init: None,
                    bias: false,
                },
            )
        });
        Gpt2 {
            c: c.clone(),
            wte,
            wpe,
            h,
            ln_f,
            lm_head,
            ctx,
        }
    }

    fn head_weight(&self) -> &Tensor {
        match &self.lm_head {
            Some(l) => &l.ws,
            None => &self.wte.ws,
        }
    }

    fn act(&self, x: &Tensor) -> Tensor {
        match self.c.act {
            Act::GeluTanh => x.gelu("tanh"),
            Act::Gelu | Act::Silu => x.gelu("none"),
        }
    }

    fn block(&self, l: &Block, x: &Tensor, p: &mut Par) -> Result<Tensor, CommError> {
        let (d, f, hd, eps) = (
            self.c.d_model,
            self.c.intermediate,
            self.c.head_dim,
            self.c.norm_eps,
        );
        let x = p.plain(x);
        let a = p.f(&l.ln_1.apply(&x, eps));
        let ys: Vec<Tensor> = p
            .qkv(&l.c_attn.linear(), &a, d)
            .iter()
            .map(|[q, k, v]| {
                attend(
                    &split_heads(q, hd),
                    &split_heads(k, hd),
                    &split_heads(v, hd),
                    true,
                )
            })
            .collect();
        let y = p.row(&l.attn_proj.linear(), &ys, d)?;
        let x1 = p.plain(&(x + y));
        let hs = p.f(&l.ln_2.apply(&x1, eps));
        let ms: Vec<Tensor> = p
            .column(&l.c_fc.linear(), &hs, f)
            .iter()
            .map(|m| self.act(m))
            .collect();
        let m = p.row(&l.mlp_proj.linear(), &ms, f)?;
        Ok(x1 + m)
    }
}

impl Network for Gpt2 {
    fn units(&self) -> usize {
        self.h.len() + 2
    }

    fn boundary_shape(&self, _unit: usize, n: i64) -> Vec<i64> {
        vec![n, self.ctx, self.c.d_model]
    }

    fn forward(
        &self,
        a: usize,
        b: usize,
        input: &Tensor,
        p: &mut Par,
    ) -> Result<Tensor, CommError> {
        let mut h = input.shallow_clone();
        for u in a..b {
            if u == 0 {
                let t = h.size()[1];
                h = p.embed(&self.wte, &h, self.c.vocab)? + self.wpe.narrow(0, 0, t);
            } else if u <= self.h.len() {
                h = self.block(&self.h[u - 1], &h, p)?;
            } else {
                let x = self.ln_f.apply(&h, self.c.norm_eps);
                h = p.head(self.head_weight(), &x, self.c.vocab);
            }
        }
        Ok(h)
    }

    fn loss(&self, out: &Tensor, y: &Tensor, p: &mut Par) -> Result<Tensor, CommError> {
        p.cross_entropy(out, y, self.c.vocab)
    }

    fn split_rules(&self) -> Arch {
        Arch::Gpt2 {
            heads: self.c.n_head as u64,
        }
    }

    fn decode(&self, ids: &Tensor, cache: &mut Vec<(Tensor, Tensor)>) -> anyhow::Result<Tensor> {
        let c = &self.c;
        let (d, hd, eps) = (c.d_model, c.head_dim, c.norm_eps);
        let past = cache.first().map(|(k, _)| k.size()[2]).unwrap_or(0);
        let t = ids.size()[1];
        anyhow::ensure!(
            past + t <= c.max_positions,
            "{} positions: past the model's n_positions = {}",
            past + t,
            c.max_positions
        );
        let mut h = (self.wte.ws.index_select(0, &ids.view([-1])) + self.wpe.narrow(0, past, t))
            .unsqueeze(0);
        for (i, l) in self.h.iter().enumerate() {
            let a = l.ln_1.apply(&h, eps);
            let qkv = l.c_attn.apply(&a).split(d, 2);
            let q = split_heads(&qkv[0], hd);
            let (k, v) = (split_heads(&qkv[1], hd), split_heads(&qkv[2], hd));
            let (k, v) = match cache.get(i) {
                Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2), Tensor::cat(&[pv, &v], 2)),
                None => (k, v),
            };
            // (the prompt attends causally; a new token to everything before it)
            let y = attend(&q, &k, &v, t > 1);
            if i < cache.len() {
                cache[i] = (k, v);
            } else {
                cache.push((k, v));
            }
            let x1 = h + l.attn_proj.apply(&y);
            let m = self.act(&l.c_fc.apply(&l.ln_2.apply(&x1, eps)));
            h = &x1 + l.mlp_proj.apply(&m);
        }
        let last = self.ln_f.apply(&h.narrow(1, t - 1, 1), eps);
        Ok(last.matmul(&self.head_weight().tr()).view([-1]))
    }

    fn check_tp(&self, tp: u32) -> Result<(), String> {
        tensor::check_tp(
            self.split_rules(),
            self.c.d_model as u64,
            self.c.vocab as u64,
            self.c.intermediate as u64,
            tp,
        )
    }
}

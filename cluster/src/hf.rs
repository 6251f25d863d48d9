//! Hugging Face model directories as ductile reads them: a `config.json` checked into the
//! sizes and options ductile's decoder implementations honour ([`HfConfig`]). A key whose value
//! they would not honour (a `rope_scaling` type they lack, a sliding window shorter than the
//! trained context, an activation other than the family's) is refused here, naming the key and
//! the value, so a job is refused at submit rather than trained as another model.
//!
//! Both spellings of the rotary settings are read: `rope_theta` and `rope_scaling` at the top
//! level (transformers 4) and `rope_parameters` (transformers 5).
//!
//! Dropout is not implemented (ductile's elastic runs are bitwise reproducible, and a dropout
//! mask would have to be drawn alike at every layout). A non-zero dropout in config.json (GPT-2
//! ships `resid_pdrop = 0.1`) is refused unless the job says `model_config.dropout = "off"`:
//! then the model trains without it, as torchtitan trains ([`HfConfig::parse_without_dropout`]).

use serde_json::Value;

/// The decoder families ductile implements, by `architectures[0]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `LlamaForCausalLM` (Llama 2, 3, 3.1/3.2, TinyLlama, SmolLM), `MistralForCausalLM`,
    /// `Qwen2ForCausalLM`: RMSNorm, rotate-half RoPE, SwiGLU, grouped-query attention.
    Llama,
    /// `GPT2LMHeadModel`: LayerNorm, learned positions, fused Q/K/V in Conv1D layout (weights
    /// stored `[in, out]`), `gelu_new`, biases everywhere, a tied head.
    Gpt2,
}

/// The MLP's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// SwiGLU's SiLU (the Llama family).
    Silu,
    /// GPT-2's `gelu_new` (= `gelu_pytorch_tanh`): the tanh approximation.
    GeluTanh,
    /// The exact (erf) GELU (`gelu`).
    Gelu,
}

/// Llama 3.1's frequency-dependent RoPE scaling (`rope_type = "llama3"`).
#[derive(Clone, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

/// A checked `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// `architectures[0]`, as written.
    pub architecture: String,
    pub family: Family,
    pub act: Act,
    pub vocab: i64,
    pub d_model: i64,
    pub n_layer: i64,
    pub n_head: i64,
    pub n_kv_head: i64,
    pub head_dim: i64,
    pub intermediate: i64,
    pub max_positions: i64,
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub rope_llama3: Option<Llama3Scaling>,
    pub tied: bool,
    /// Biases on the Q, K and V projections (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the attention's output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// Biases on the MLP's projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// The spread of `init = "random"`'s normal weights.
    pub initializer_range: f64,
    /// Mistral's and Qwen2's sliding window, when one is on (checked against the context).
    pub sliding_window: Option<i64>,
    pub eos_token_id: Option<i64>,
}

fn refuse(key: &str, value: &Value, why: &str) -> String {
    format!("config.json: {key} = {value}: {why}")
}

impl HfConfig {
    /// Read and check a `config.json`'s contents for training: a non-zero dropout is refused.
    pub fn parse(v: &Value) -> Result<HfConfig, String> {
        Self::parse_with(v, false)
    }

    /// Read and check a `config.json`'s contents, its dropout keys accepted and not applied
    /// (a job's `model_config.dropout = "off"`; inference, which applies none).
    pub fn parse_without_dropout(v: &Value) -> Result<HfConfig, String> {
        Self::parse_with(v, true)
    }

    fn parse_with(v: &Value, dropout_off: bool) -> Result<HfConfig, String> {
        let obj = v
            .as_object()
            .ok_or_else(|| "config.json is not a JSON object".to_string())?;
        let arch = obj
            .get("architectures")
            .and_then(|a| a.as_array())
            .and_then(|a| a.first())
            .and_then(|a| a.as_str())
            .ok_or_else(|| "config.json: no architectures[0] names the model class".to_string())?;
        let int = |k: &str| -> Result<Option<i64>, String> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_i64()
                    .filter(|n| *n > 0)
                    .map(Some)
                    .ok_or_else(|| refuse(k, x, "must be a positive integer")),
            }
        };
        let need = |k: &str| -> Result<i64, String> {
            int(k)?.ok_or_else(|| format!("config.json: {k} is missing (architecture {arch})"))
        };
        let float = |k: &str| -> Result<Option<f64>, String> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| refuse(k, x, "must be a number")),
            }
        };
        let flag = |k: &str, default: bool| -> Result<bool, String> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(x) => Err(refuse(k, x, "must be true or false")),
            }
        };
        let no_dropout = |keys: &[&str]| -> Result<(), String> {
            for k in keys {
                if let Some(x) = float(k)? {
                    if x != 0.0 && !dropout_off {
                        return Err(refuse(
                            k,
                            &obj[*k],
                            "dropout is not implemented: set model_config = { dropout = \"off\", ... } in the job to train without it, or 0.0 here",
                        ));
                    }
                }
            }
            Ok(())
        };
        let (family, qkv_default) = match arch {
            "LlamaForCausalLM" | "MistralForCausalLM" => (Family::Llama, false),
            "Qwen2ForCausalLM" => (Family::Llama, true),
            "GPT2LMHeadModel" => {
                no_dropout(&["resid_pdrop", "embd_pdrop", "attn_pdrop"])?;
                return Self::gpt2(obj, arch, &int, &float, &flag);
            }
            other => {
                return Err(format!(
                    "config.json: architectures[0] = {other:?} is not implemented (known: \"LlamaForCausalLM\", \"MistralForCausalLM\", \"Qwen2ForCausalLM\", \"GPT2LMHeadModel\")"
                ))
            }
        };
        match obj.get("hidden_act") {
            None => {}
            Some(Value::String(s)) if s == "silu" => {}
            Some(x) => {
                return Err(refuse(
                    "hidden_act",
                    x,
                    "only \"silu\" (SwiGLU) is implemented",
                ))
            }
        }
        if let Some(x) = obj.get("pretraining_tp") {
            if x.as_i64() != Some(1) {
                return Err(refuse("pretraining_tp", x, "only 1 is implemented"));
            }
        }
        no_dropout(&["attention_dropout", "hidden_dropout"])?;
        // attention biases: Qwen2 always has Q/K/V biases; Llama's `attention_bias` puts one on
        // Q, K, V and O; Mistral has none
        let attention_bias = flag("attention_bias", false)?;
        if arch == "MistralForCausalLM" && attention_bias {
            return Err(refuse(
                "attention_bias",
                &obj["attention_bias"],
                "MistralForCausalLM has no attention biases",
            ));
        }
        let qkv_bias = qkv_default || attention_bias;
        let o_bias = !qkv_default && attention_bias;
        let mlp_bias = flag("mlp_bias", false)?;
        if arch == "Qwen2ForCausalLM" && flag("use_sliding_window", false)? {
            return Err(refuse(
                "use_sliding_window",
                &obj["use_sliding_window"],
                "sliding-window attention is not implemented",
            ));
        }
        let sliding_window = if arch == "Qwen2ForCausalLM" {
            None
        } else {
            int("sliding_window")?
        };
        let d_model = need("hidden_size")?;
        let n_head = need("num_attention_heads")?;
        let n_kv_head = int("num_key_value_heads")?.unwrap_or(n_head);
        if n_head % n_kv_head != 0 {
            return Err(format!(
                "config.json: num_attention_heads = {n_head} is not a multiple of num_key_value_heads = {n_kv_head}"
            ));
        }
        let head_dim = int("head_dim")?.unwrap_or(d_model / n_head);
        if obj.get("head_dim").is_none() && d_model % n_head != 0 {
            return Err(format!(
                "config.json: hidden_size = {d_model} does not divide into num_attention_heads = {n_head}"
            ));
        }
        if head_dim % 2 != 0 {
            return Err(format!(
                "config.json: head_dim = {head_dim} is odd (rotate-half RoPE needs pairs)"
            ));
        }
        // the rotary settings, in either spelling
        let rope: Option<&serde_json::Map<String, Value>> = obj
            .get("rope_parameters")
            .and_then(|r| r.as_object())
            .or_else(|| obj.get("rope_scaling").and_then(|r| r.as_object()));
        let rope_key = if obj.get("rope_parameters").is_some_and(|r| r.is_object()) {
            "rope_parameters"
        } else {
            "rope_scaling"
        };
        let rope_theta = rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(|t| t.as_f64())
            .or(float("rope_theta")?)
            .unwrap_or(10_000.0);
        let mut rope_llama3 = None;
        if let Some(r) = rope {
            let ty = r
                .get("rope_type")
                .or_else(|| r.get("type"))
                .and_then(|t| t.as_str())
                .unwrap_or("default");
            match ty {
                "default" => {}
                "llama3" => {
                    let f = |k: &str| -> Result<f64, String> {
                        r.get(k).and_then(|x| x.as_f64()).ok_or_else(|| {
                            format!("config.json: {rope_key}.{k} is missing (rope type \"llama3\")")
                        })
                    };
                    rope_llama3 = Some(Llama3Scaling {
                        factor: f("factor")?,
                        low_freq_factor: f("low_freq_factor")?,
                        high_freq_factor: f("high_freq_factor")?,
                        original_max_position_embeddings: f("original_max_position_embeddings")?,
                    });
                }
                other => {
                    return Err(refuse(
                        &format!("{rope_key}.rope_type"),
                        &Value::String(other.into()),
                        "only \"default\" and \"llama3\" RoPE are implemented",
                    ))
                }
            }
        }
        let c = HfConfig {
            architecture: arch.to_string(),
            family,
            act: Act::Silu,
            vocab: need("vocab_size")?,
            d_model,
            n_layer: need("num_hidden_layers")?,
            n_head,
            n_kv_head,
            head_dim,
            intermediate: need("intermediate_size")?,
            max_positions: int("max_position_embeddings")?.unwrap_or(2048),
            norm_eps: float("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_llama3,
            tied: flag("tie_word_embeddings", false)?,
            qkv_bias,
            o_bias,
            mlp_bias,
            initializer_range: float("initializer_range")?.unwrap_or(0.02),
            sliding_window,
            eos_token_id: obj.get("eos_token_id").and_then(|e| {
                e.as_i64().or_else(|| {
                    e.as_array()
                        .and_then(|a| a.first())
                        .and_then(|x| x.as_i64())
                })
            }),
        };
        c.check_sizes([
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
        ])?;
        Ok(c)
    }

    /// Sizes past what ductile allocates are refused, by their keys in this family's spelling.
    fn check_sizes(&self, keys: [&str; 5]) -> Result<(), String> {
        let hi = [1 << 24, 1 << 17, 1 << 10, 1 << 10, 1 << 19];
        let v = [
            self.vocab,
            self.d_model,
            self.n_layer,
            self.n_head,
            self.intermediate,
        ];
        for ((k, v), hi) in keys.iter().zip(v).zip(hi) {
            if v > hi {
                return Err(format!("config.json: {k} = {v} is over {hi}"));
            }
            if v < 1 {
                return Err(format!("config.json: {k} = {v} must be at least 1"));
            }
        }
        // bounded too, so that no size product wraps (the parameter and memory checks rely
        // on them): head_dim and the position table
        for (k, v, hi) in [
            ("head_dim", self.head_dim, 1i64 << 13),
            (
                "max_position_embeddings / n_positions",
                self.max_positions,
                1 << 24,
            ),
            ("num_key_value_heads", self.n_kv_head, 1 << 10),
        ] {
            if !(1..=hi).contains(&v) {
                return Err(format!("config.json: {k} = {v} must be in 1..={hi}"));
            }
        }
        if let Some(w) = self.sliding_window {
            if w < 1 {
                return Err(format!(
                    "config.json: sliding_window = {w} must be at least 1"
                ));
            }
        }
        Ok(())
    }

    /// `GPT2LMHeadModel`'s config.json (its own key names: `n_embd`, `n_layer`, `n_head`,
    /// `n_inner`, `n_positions`, `layer_norm_epsilon`, `activation_function`).
    fn gpt2(
        obj: &serde_json::Map<String, Value>,
        arch: &str,
        int: &dyn Fn(&str) -> Result<Option<i64>, String>,
        float: &dyn Fn(&str) -> Result<Option<f64>, String>,
        flag: &dyn Fn(&str, bool) -> Result<bool, String>,
    ) -> Result<HfConfig, String> {
        let need = |k: &str| -> Result<i64, String> {
            int(k)?.ok_or_else(|| format!("config.json: {k} is missing (architecture {arch})"))
        };
        let act = match obj.get("activation_function") {
            None => Act::GeluTanh,
            Some(Value::String(s)) if s == "gelu_new" || s == "gelu_pytorch_tanh" => Act::GeluTanh,
            Some(Value::String(s)) if s == "gelu" => Act::Gelu,
            Some(x) => {
                return Err(refuse(
                    "activation_function",
                    x,
                    "only \"gelu_new\", \"gelu_pytorch_tanh\" and \"gelu\" are implemented",
                ))
            }
        };
        for (k, want) in [
            ("scale_attn_weights", true),
            ("scale_attn_by_inverse_layer_idx", false),
            ("add_cross_attention", false),
        ] {
            if flag(k, want)? != want {
                return Err(refuse(k, &obj[k], &format!("only {want} is implemented")));
            }
        }
        let d_model = need("n_embd")?;
        let n_head = need("n_head")?;
        if d_model % n_head != 0 {
            return Err(format!(
                "config.json: n_embd = {d_model} does not divide into n_head = {n_head}"
            ));
        }
        let c = HfConfig {
            architecture: arch.to_string(),
            family: Family::Gpt2,
            act,
            vocab: need("vocab_size")?,
            d_model,
            n_layer: need("n_layer")?,
            n_head,
            n_kv_head: n_head,
            head_dim: d_model / n_head,
            intermediate: int("n_inner")?.unwrap_or(4 * d_model),
            max_positions: int("n_positions")?.unwrap_or(1024),
            norm_eps: float("layer_norm_epsilon")?.unwrap_or(1e-5),
            rope_theta: 0.0,
            rope_llama3: None,
            tied: flag("tie_word_embeddings", true)?,
            qkv_bias: true,
            o_bias: true,
            mlp_bias: true,
            initializer_range: float("initializer_range")?.unwrap_or(0.02),
            sliding_window: None,
            eos_token_id: obj.get("eos_token_id").and_then(|e| e.as_i64()),
        };
        c.check_sizes(["vocab_size", "n_embd", "n_layer", "n_head", "n_inner"])?;
        Ok(c)
    }

    /// Whether a job may train it at context `ctx`: at most `max_position_embeddings`, and
    /// inside a sliding window (a shorter window would change what attention sees).
    pub fn check_ctx(&self, ctx: i64) -> Result<(), String> {
        if ctx > self.max_positions {
            return Err(format!(
                "ctx = {ctx} is over the model's max_position_embeddings = {}",
                self.max_positions
            ));
        }
        if let Some(w) = self.sliding_window {
            if w < ctx {
                return Err(format!(
                    "config.json: sliding_window = {w} is shorter than ctx = {ctx}: sliding-window attention is not implemented (train at ctx <= {w})"
                ));
            }
        }
        Ok(())
    }

    /// Parameters of its units, exactly: (embeddings, one layer, head). A tied head's matrix
    /// is the embedding's, counted there.
    pub fn unit_params(&self) -> (i64, i64, i64) {
        let (d, tied_head) = (
            self.d_model,
            if self.tied {
                0
            } else {
                self.vocab * self.d_model
            },
        );
        if self.family == Family::Gpt2 {
            let f = self.intermediate;
            let layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d;
            return (
                self.vocab * d + self.max_positions * d,
                layer,
                2 * d + tied_head,
            );
        }
        let hd = self.head_dim;
        let q = d * self.n_head * hd;
        let kv = 2 * d * self.n_kv_head * hd;
        let o = self.n_head * hd * d;
        let mlp = 3 * d * self.intermediate;
        let bias = if self.qkv_bias {
            (self.n_head + 2 * self.n_kv_head) * hd
        } else {
            0
        } + if self.o_bias { d } else { 0 }
            + if self.mlp_bias {
                2 * self.intermediate + d
            } else {
                0
            };
        let layer = q + kv + o + mlp + bias + 2 * d;
        (self.vocab * d, layer, d + tied_head)
    }

    /// Parameters, exactly.
    pub fn params(&self) -> i64 {
        let (embed, layer, head) = self.unit_params();
        self.n_layer * layer + embed + head
    }

    /// Parameters of its largest unit (the embeddings, a layer or the head).
    pub fn largest_unit_params(&self) -> i64 {
        let (embed, layer, head) = self.unit_params();
        embed
            .max(head)
            .max(if self.n_layer > 0 { layer } else { 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn llama() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
            "hidden_act": "silu", "tie_word_embeddings": false, "rope_theta": 10000.0,
        })
    }

    #[test]
    fn a_llama_config_reads_with_its_sizes_and_both_rope_spellings() {
        let c = HfConfig::parse(&llama()).unwrap();
        assert_eq!((c.n_head, c.n_kv_head, c.head_dim), (4, 2, 8));
        assert!(!c.tied && !c.qkv_bias);
        let mut v = llama();
        v["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = HfConfig::parse(&v).unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.rope_llama3.unwrap().factor, 32.0);
        let mut q = llama();
        q["architectures"] = json!(["Qwen2ForCausalLM"]);
        assert!(HfConfig::parse(&q).unwrap().qkv_bias);
    }

    /// Sizes whose products would wrap (to 0 or below, passing the parameter and memory
    /// checks) are refused, naming the key.
    #[test]
    fn sizes_that_would_wrap_are_refused() {
        for (k, v, want) in [
            (
                "head_dim",
                json!(1i64 << 40),
                "head_dim = 1099511627776 must be in",
            ),
            ("head_dim", json!(-8), "head_dim = -8"),
            (
                "max_position_embeddings",
                json!(1i64 << 50),
                "max_position_embeddings",
            ),
            ("vocab_size", json!(0), "vocab_size = 0"),
        ] {
            let mut c = llama();
            c[k] = v;
            let e = HfConfig::parse(&c).unwrap_err();
            assert!(e.contains(want), "{k}: {e}");
        }
        let gpt2 = json!({
            "architectures": ["GPT2LMHeadModel"], "vocab_size": 100, "n_embd": 32, "n_layer": 2,
            "n_head": 4, "n_positions": 1i64 << 60, "activation_function": "gelu_new",
        });
        let e = HfConfig::parse_without_dropout(&gpt2).unwrap_err();
        assert!(e.contains("n_positions = 1152921504606846976"), "{e}");
    }

    /// SmolLM2-135M's shape (its config.json's sizes): 134.5 M parameters, of which the tied
    /// embedding is 28.3 M, its largest unit by far (a layer is 3.5 M): what a fully sharded
    /// rank gathers at once is the embedding, not the average unit (4.2 M).
    #[test]
    fn a_language_model_s_largest_unit_is_its_embedding() {
        let c = HfConfig::parse(&json!({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
            "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "intermediate_size": 1536, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": true, "hidden_act": "silu", "rope_theta": 100000.0,
        }))
        .unwrap();
        assert_eq!(c.params(), 134_515_008);
        let (embed, layer, head) = c.unit_params();
        assert_eq!((embed, layer, head), (49152 * 576, 3_540_096, 576));
        assert_eq!(c.largest_unit_params(), 49152 * 576);
        assert!(c.largest_unit_params() > 6 * c.params() / (c.n_layer + 2));
        // untied: the head holds a matrix of its own, as large as the embedding
        let mut u = c.clone();
        u.tied = false;
        assert_eq!(u.params(), c.params() + 49152 * 576);
        assert_eq!(u.unit_params().2, 576 + 49152 * 576);
    }

    #[test]
    fn what_ductile_would_not_honour_is_refused_naming_key_and_value() {
        let cases: Vec<(&str, Value, &str)> = vec![
            (
                "architectures",
                json!(["BertModel"]),
                "\"BertModel\" is not implemented",
            ),
            (
                "rope_scaling",
                json!({"type": "yarn", "factor": 4.0}),
                "rope_scaling.rope_type = \"yarn\"",
            ),
            ("hidden_act", json!("gelu"), "hidden_act = \"gelu\""),
            (
                "num_key_value_heads",
                json!(3),
                "not a multiple of num_key_value_heads = 3",
            ),
        ];
        for (k, v, want) in cases {
            let mut c = llama();
            c[k] = v;
            let e = HfConfig::parse(&c).unwrap_err();
            assert!(e.contains(want), "{k}: {e}");
        }
        let mut gpt2 = json!({
            "architectures": ["GPT2LMHeadModel"], "vocab_size": 100, "n_embd": 32, "n_layer": 2,
            "n_head": 4, "n_positions": 64, "activation_function": "gelu_new",
            "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        });
        let e = HfConfig::parse(&gpt2).unwrap_err();
        assert!(
            e.contains("resid_pdrop = 0.1") && e.contains("dropout = \"off\""),
            "{e}"
        );
        let c = HfConfig::parse_without_dropout(&gpt2).unwrap();
        assert_eq!(
            (c.family, c.act, c.head_dim, c.intermediate, c.tied),
            (Family::Gpt2, Act::GeluTanh, 8, 128, true)
        );
        // wte, wpe, 2 × (ln_1, c_attn, c_proj, ln_2, c_fc, c_proj), ln_f
        assert_eq!(
            c.params(),
            100 * 32 + 64 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32
        );
        // its largest unit is a layer here (12·32² and biases against (100 + 64)·32)
        assert_eq!(c.largest_unit_params(), 12 * 32 * 32 + 13 * 32);
        for (k, v, want) in [
            (
                "activation_function",
                json!("relu"),
                "activation_function = \"relu\"",
            ),
            ("scale_attn_by_inverse_layer_idx", json!(true), "only false"),
            ("add_cross_attention", json!(true), "only false"),
        ] {
            let mut g = gpt2.clone();
            g[k] = v;
            let e = HfConfig::parse_without_dropout(&g).unwrap_err();
            assert!(e.contains(want), "{k}: {e}");
        }
        gpt2["n_head"] = json!(5);
        let e = HfConfig::parse_without_dropout(&gpt2).unwrap_err();
        assert!(
            e.contains("n_embd = 32 does not divide into n_head = 5"),
            "{e}"
        );

        let mut m = llama();
        m["architectures"] = json!(["MistralForCausalLM"]);
        m["sliding_window"] = json!(16);
        let c = HfConfig::parse(&m).unwrap();
        assert!(c.check_ctx(16).is_ok());
        let e = c.check_ctx(32).unwrap_err();
        assert!(e.contains("sliding_window = 16"), "{e}");
        assert!(c
            .check_ctx(65)
            .unwrap_err()
            .contains("max_position_embeddings = 64"));
    }
}

//! The recipe a job sets: its optimizer's settings (`training.optimizer`, a name or a table)
//! and its learning-rate schedule (`[training.lr_schedule]`). The learning rate of step S is
//! a function of the recipe and S alone ([`LrPlan::at`]), so a resize, a kill or a cold restart
//! never changes it; the recipe is recorded in every checkpoint and compared at restore.
//!
//! Without a table, every setting is today's default (AdamW betas (0.9, 0.95), eps 1e-8,
//! weight decay 0.01 on every parameter; SGD momentum 0.9; a warm-up of at most 10 steps then
//! a cosine to 10% of `lr` at `max_steps`), computed with the same operations in the same
//! order: existing jobs and their hashes do not move. The decays take transformers' formulas
//! (`get_cosine_with_min_lr_schedule_with_warmup`, `get_linear_schedule_with_warmup`,
//! `get_wsd_schedule`), so a recipe copied from a Trainer gives the same rate at every step.

use std::fmt;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::modes::{Decay, OptimizerKind, WsdDecay};
use crate::ClusterError;

/// `training.optimizer`: a name (`"adamw"`, `"sgd"`) or a table with the name and settings.
/// A setting left out takes today's default.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptimizerSpec {
    pub name: OptimizerKind,
    /// AdamW: the moments' decay rates.
    pub betas: Option<[f64; 2]>,
    /// AdamW: added to the second moment's root.
    pub eps: Option<f64>,
    /// AdamW: decoupled (`p *= 1 - lr * wd`); SGD: added to the gradient (`g += wd * p`), as
    /// PyTorch's optimizers do.
    pub weight_decay: Option<f64>,
    /// SGD.
    pub momentum: Option<f64>,
    /// SGD: Nesterov's momentum (PyTorch's form).
    pub nesterov: Option<bool>,
    /// Parameters whose name contains one of these take no weight decay (`["norm", "bias"]`
    /// spares every norm's scale and every bias; add `"embed"` for the embeddings). Empty by
    /// default: every parameter decays, as before.
    pub no_decay: Vec<String>,
}

/// The table form, as written.
#[derive(Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct OptimizerTable {
    /// `"adamw"` (default) or `"sgd"`.
    #[serde(default)]
    name: OptimizerKind,
    /// AdamW: the moments' decay rates (default `[0.9, 0.95]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    betas: Option<[f64; 2]>,
    /// AdamW: added to the second moment's root (default 1e-8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    eps: Option<f64>,
    /// AdamW: decoupled (`p *= 1 - lr * wd`); SGD: added to the gradient (`g += wd * p`), as
    /// PyTorch's optimizers do. Default: AdamW 0.01, SGD 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    weight_decay: Option<f64>,
    /// SGD's momentum (default 0.9).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    momentum: Option<f64>,
    /// SGD: Nesterov's momentum (PyTorch's form; default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    nesterov: Option<bool>,
    /// Parameters whose name contains one of these take no weight decay (`["norm", "bias"]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    no_decay: Vec<String>,
}

/// AdamW's settings, resolved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// SGD's settings, resolved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
}

impl OptimizerSpec {
    /// The optimizer `name` with every default.
    pub fn named(name: OptimizerKind) -> Self {
        OptimizerSpec {
            name,
            ..Default::default()
        }
    }

    /// State tensors per parameter.
    pub fn states(&self) -> u32 {
        self.name.states()
    }

    /// Only a name: written back as the string.
    fn is_name_only(&self) -> bool {
        *self == OptimizerSpec::named(self.name)
    }

    pub fn adamw(&self) -> AdamW {
        let [beta1, beta2] = self.betas.unwrap_or([0.9, 0.95]);
        AdamW {
            beta1,
            beta2,
            eps: self.eps.unwrap_or(1e-8),
            weight_decay: self.weight_decay.unwrap_or(0.01),
        }
    }

    pub fn sgd(&self) -> Sgd {
        Sgd {
            momentum: self.momentum.unwrap_or(0.9),
            nesterov: self.nesterov.unwrap_or(false),
            weight_decay: self.weight_decay.unwrap_or(0.0),
        }
    }

    /// Whether the parameter `name` takes weight decay (no `no_decay` pattern in its name).
    pub fn decays(&self, name: &str) -> bool {
        !self.no_decay.iter().any(|p| name.contains(p.as_str()))
    }

    /// Every setting checked, the key named on a refusal.
    pub fn validate(&self) -> Result<(), ClusterError> {
        let key = |k: &str| format!("training.optimizer.{k}");
        let adam = self.name == OptimizerKind::Adamw;
        for (k, set, for_adam) in [
            ("betas", self.betas.is_some(), true),
            ("eps", self.eps.is_some(), true),
            ("momentum", self.momentum.is_some(), false),
            ("nesterov", self.nesterov.is_some(), false),
        ] {
            if set && for_adam != adam {
                return Err(ClusterError::invalid(
                    key(k),
                    format!(
                        "is a setting of {:?}, not of {:?}",
                        if for_adam { "adamw" } else { "sgd" },
                        self.name.as_str()
                    ),
                ));
            }
        }
        if let Some(b) = self.betas {
            for (i, v) in b.iter().enumerate() {
                if !(v.is_finite() && (0.0..1.0).contains(v)) {
                    return Err(ClusterError::invalid(
                        key("betas"),
                        format!("beta{} = {v} is not in [0, 1)", i + 1),
                    ));
                }
            }
        }
        if let Some(e) = self.eps {
            if !(e.is_finite() && e > 0.0) {
                return Err(ClusterError::invalid(
                    key("eps"),
                    format!("{e} is not a positive number"),
                ));
            }
        }
        if let Some(w) = self.weight_decay {
            if !(w.is_finite() && w >= 0.0) {
                return Err(ClusterError::invalid(
                    key("weight_decay"),
                    format!("{w} is not a number at or above 0"),
                ));
            }
        }
        if let Some(m) = self.momentum {
            if !(m.is_finite() && (0.0..1.0).contains(&m)) {
                return Err(ClusterError::invalid(
                    key("momentum"),
                    format!("{m} is not in [0, 1)"),
                ));
            }
        }
        if self.nesterov == Some(true) && self.sgd().momentum == 0.0 {
            return Err(ClusterError::invalid(
                key("nesterov"),
                "Nesterov's momentum needs a momentum above 0",
            ));
        }
        if self.no_decay.len() > 64 {
            return Err(ClusterError::invalid(
                key("no_decay"),
                format!("{} patterns: at most 64", self.no_decay.len()),
            ));
        }
        for p in &self.no_decay {
            if p.is_empty() || p.len() > 256 {
                return Err(ClusterError::invalid(
                    key("no_decay"),
                    format!("{p:?}: a pattern is 1 to 256 bytes of a parameter's name"),
                ));
            }
        }
        Ok(())
    }

    /// What the recipe records of the optimizer: every setting, defaults resolved.
    fn resolved(&self) -> serde_json::Value {
        let mut v = match self.name {
            OptimizerKind::Adamw => {
                let a = self.adamw();
                serde_json::json!({"name": "adamw", "betas": [a.beta1, a.beta2], "eps": a.eps, "weight_decay": a.weight_decay})
            }
            OptimizerKind::Sgd => {
                let s = self.sgd();
                serde_json::json!({"name": "sgd", "momentum": s.momentum, "nesterov": s.nesterov, "weight_decay": s.weight_decay})
            }
        };
        v["no_decay"] = serde_json::json!(self.no_decay);
        v
    }
}

impl Serialize for OptimizerSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.is_name_only() {
            return s.serialize_str(self.name.as_str());
        }
        OptimizerTable {
            name: self.name,
            betas: self.betas,
            eps: self.eps,
            weight_decay: self.weight_decay,
            momentum: self.momentum,
            nesterov: self.nesterov,
            no_decay: self.no_decay.clone(),
        }
        .serialize(s)
    }
}

impl schemars::JsonSchema for OptimizerSpec {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "OptimizerSpec".into()
    }
    fn json_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "anyOf": [g.subschema_for::<OptimizerKind>(), g.subschema_for::<OptimizerTable>()]
        })
    }
}

impl<'de> Deserialize<'de> for OptimizerSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OptimizerSpec;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an optimizer's name (\"adamw\", \"sgd\") or a table with its name and settings")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<OptimizerSpec, E> {
                v.parse().map(OptimizerSpec::named).map_err(E::custom)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<OptimizerSpec, A::Error> {
                let t = OptimizerTable::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(OptimizerSpec {
                    name: t.name,
                    betas: t.betas,
                    eps: t.eps,
                    weight_decay: t.weight_decay,
                    momentum: t.momentum,
                    nesterov: t.nesterov,
                    no_decay: t.no_decay,
                })
            }
        }
        d.deserialize_any(V)
    }
}

/// `[training.lr_schedule]`: a key left out takes today's default.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LrSchedule {
    /// Steps of linear warm-up: step s < warmup_steps runs at lr · (s + 1) / warmup_steps
    /// (or lr · s / warmup_steps with `warmup_from_zero`). Default: a tenth of `max_steps`,
    /// 1 to 10 (10 without `max_steps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<u64>,
    /// transformers' warm-up: the first step runs at rate 0 (lr · s / warmup_steps).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub warmup_from_zero: bool,
    /// After the warm-up: `cosine` (default), `linear`, `sqrt` (1 − √progress), `constant`,
    /// or `wsd` (the peak held, then the last `decay_steps` decayed as `wsd_decay`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decay: Option<Decay>,
    /// The rate the decay reaches at `max_steps`. Default: a tenth of `lr`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_lr: Option<f64>,
    /// `wsd`: the last steps, decayed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decay_steps: Option<u64>,
    /// `wsd`: the shape of those steps (`linear` by default, `cosine`, `sqrt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wsd_decay: Option<WsdDecay>,
}

/// The schedule resolved: what the rate of every step is a function of. Recorded in every
/// checkpoint's `recipe`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrPlan {
    pub lr: f64,
    pub warmup_steps: u64,
    pub warmup_from_zero: bool,
    pub decay: Decay,
    /// The floor as a fraction of `lr` (transformers' `min_lr_rate`).
    pub min_lr_ratio: f64,
    pub decay_steps: Option<u64>,
    pub wsd_decay: WsdDecay,
    pub max_steps: Option<u64>,
}

impl LrPlan {
    /// The plan of a job with peak `lr`, `max_steps` and `schedule` (None: today's default,
    /// with the same operations).
    pub fn new(lr: f64, max_steps: Option<u64>, schedule: Option<&LrSchedule>) -> LrPlan {
        let s = schedule.cloned().unwrap_or_default();
        let default_warmup = max_steps.map(|m| (m / 10).clamp(1, 10)).unwrap_or(10);
        let decay = s.decay.unwrap_or_default();
        LrPlan {
            lr,
            warmup_steps: s.warmup_steps.unwrap_or(default_warmup),
            warmup_from_zero: s.warmup_from_zero,
            decay,
            min_lr_ratio: s.min_lr.map(|m| m / lr).unwrap_or(0.1),
            decay_steps: s.decay_steps,
            wsd_decay: s.wsd_decay.unwrap_or_default(),
            // a constant rate does not depend on it (and a run may be extended)
            max_steps: max_steps.filter(|_| decay != Decay::Constant),
        }
    }

    /// The learning rate of step `step` (0-based).
    pub fn at(&self, step: u64) -> f64 {
        let (lr, warm, r) = (self.lr, self.warmup_steps, self.min_lr_ratio);
        if step < warm {
            return if self.warmup_from_zero {
                lr * (step as f64 / warm as f64)
            } else {
                lr * (step + 1) as f64 / warm as f64
            };
        }
        // a fraction of the decay's span, and the shapes over it (transformers' formulas)
        let progress = |from: u64, len: u64| ((step - from) as f64 / len.max(1) as f64).min(1.0);
        let cosine = |f: f64| 0.5 * (1.0 + (std::f64::consts::PI * f).cos());
        let floor = |g: f64| lr * (r + (1.0 - r) * g);
        let Some(m) = self.max_steps else { return lr };
        match self.decay {
            Decay::Constant => lr,
            Decay::Wsd => {
                let d = self.decay_steps.unwrap_or(0).min(m);
                let from = m - d;
                if step < from {
                    return lr;
                }
                let f = progress(from, d);
                floor(match self.wsd_decay {
                    WsdDecay::Linear => 1.0 - f,
                    WsdDecay::Cosine => cosine(f),
                    WsdDecay::Sqrt => 1.0 - f.sqrt(),
                })
            }
            _ if m <= warm => lr,
            Decay::Cosine => floor(cosine(progress(warm, m - warm))),
            Decay::Linear => floor((m.saturating_sub(step)) as f64 / (m - warm) as f64),
            Decay::Sqrt => floor(1.0 - progress(warm, m - warm).sqrt()),
        }
    }
}

/// The whole recipe, resolved: what a checkpoint records and `dctl status --json` shows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recipe {
    pub optimizer: serde_json::Value,
    pub lr_schedule: LrPlan,
    /// The job set `[training.lr_schedule]`. Without it the default schedule follows
    /// `max_steps` (its warm-up and decay derive from it), as it always did: a run carried on
    /// with a larger `max_steps` is not a change of recipe ([`Recipe::differences`]).
    #[serde(default)]
    pub schedule_given: bool,
}

impl Recipe {
    pub fn new(optimizer: &OptimizerSpec, plan: LrPlan, schedule_given: bool) -> Recipe {
        Recipe {
            optimizer: optimizer.resolved(),
            lr_schedule: plan,
            schedule_given,
        }
    }

    /// What differs between a recorded recipe (`was`, a checkpoint's) and this one, each as
    /// `key: was → now`; empty when they are the same. Between two default schedules, what
    /// derives from `max_steps` (`max_steps`, `warmup_steps`) is left out: extending a run
    /// that never set a schedule goes on as before.
    pub fn differences(&self, was: &serde_json::Value) -> Vec<String> {
        let (mut was, mut now) = (was.clone(), serde_json::to_value(self).unwrap_or_default());
        if !self.schedule_given && !was["schedule_given"].as_bool().unwrap_or(false) {
            // what the default schedule derives from max_steps is not compared
            for v in [&mut was, &mut now] {
                if let Some(plan) = v["lr_schedule"].as_object_mut() {
                    plan.remove("max_steps");
                    plan.remove("warmup_steps");
                }
            }
        }
        let mut out = Vec::new();
        diff("", &was, &now, &mut out);
        out
    }
}

/// The leaves of `a` and `b` that differ, named by their dotted path.
fn diff(path: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                diff(
                    &p,
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    out,
                );
            }
        }
        _ if a != b => out.push(format!("{path}: {a} in the checkpoint, {b} in this job")),
        _ => {}
    }
}

/// The schedule's keys checked against the job's `lr` and `max_steps`.
pub fn validate_schedule(
    s: &LrSchedule,
    lr: f64,
    max_steps: Option<u64>,
) -> Result<(), ClusterError> {
    let key = |k: &str| format!("training.lr_schedule.{k}");
    let decay = s.decay.unwrap_or_default();
    if let (Some(w), Some(m)) = (s.warmup_steps, max_steps) {
        if w > m {
            return Err(ClusterError::invalid(
                key("warmup_steps"),
                format!("{w} is past max_steps = {m}"),
            ));
        }
    }
    if let Some(x) = s.min_lr {
        if !(x.is_finite() && x >= 0.0 && x <= lr) {
            return Err(ClusterError::invalid(
                key("min_lr"),
                format!("{x} is not between 0 and lr = {lr}"),
            ));
        }
    }
    if decay != Decay::Constant && max_steps.is_none() {
        return Err(ClusterError::invalid(
            key("decay"),
            format!("\"{decay}\" decays to min_lr at max_steps: the job needs training.max_steps (or decay = \"constant\")"),
        ));
    }
    match (decay, s.decay_steps) {
        (Decay::Wsd, None) => {
            return Err(ClusterError::invalid(
                key("decay_steps"),
                "decay = \"wsd\" needs the number of last steps to decay",
            ))
        }
        (Decay::Wsd, Some(d)) => {
            let m = max_steps.unwrap_or(0);
            let w = LrPlan::new(lr, max_steps, Some(s)).warmup_steps;
            if d == 0 || w + d > m {
                return Err(ClusterError::invalid(
                    key("decay_steps"),
                    format!("{d}: must be at least 1, and warmup_steps ({w}) + decay_steps at most max_steps ({m})"),
                ));
            }
        }
        (_, Some(_)) => {
            return Err(ClusterError::invalid(
                key("decay_steps"),
                format!("is for decay = \"wsd\" (decay is \"{decay}\")"),
            ))
        }
        (_, None) => {}
    }
    if s.wsd_decay.is_some() && decay != Decay::Wsd {
        return Err(ClusterError::invalid(
            key("wsd_decay"),
            format!("is for decay = \"wsd\" (decay is \"{decay}\")"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Today's schedule, as it was written before the recipe existed.
    fn before(lr: f64, step: u64, max_steps: Option<u64>) -> f64 {
        let warm = max_steps.map(|m| (m / 10).clamp(1, 10)).unwrap_or(10);
        if step < warm {
            return lr * (step + 1) as f64 / warm as f64;
        }
        match max_steps {
            Some(m) if m > warm => {
                let f = ((step - warm) as f64 / (m - warm) as f64).min(1.0);
                lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * f).cos()))
            }
            _ => lr,
        }
    }

    #[test]
    fn the_default_plan_gives_today_s_rates_bit_for_bit() {
        for max in [None, Some(1), Some(5), Some(37), Some(1200), Some(10_000)] {
            for lr in [3e-4, 1e-2, 0.05, 7.0] {
                let p = LrPlan::new(lr, max, None);
                for s in 0..1300 {
                    assert_eq!(
                        p.at(s).to_bits(),
                        before(lr, s, max).to_bits(),
                        "{lr} {s} {max:?}"
                    );
                }
            }
        }
    }

    /// transformers' schedules, as its lr_lambda functions compute them (LambdaLR multiplies
    /// the base rate by the lambda).
    #[test]
    fn the_decays_are_transformers_formulas() {
        let (lr, w, m) = (3e-3, 7u64, 50u64);
        let cos = LrPlan::new(
            lr,
            Some(m),
            Some(&LrSchedule {
                warmup_steps: Some(w),
                warmup_from_zero: true,
                min_lr: Some(3e-4),
                ..Default::default()
            }),
        );
        let lin = LrPlan::new(
            lr,
            Some(m),
            Some(&LrSchedule {
                warmup_steps: Some(w),
                warmup_from_zero: true,
                decay: Some(Decay::Linear),
                min_lr: Some(0.0),
                ..Default::default()
            }),
        );
        let rate = 3e-4 / lr;
        for s in 0..m + 3 {
            let (want_cos, want_lin) = if s < w {
                let f = s as f64 / w.max(1) as f64;
                (f, f)
            } else {
                let p = (s - w) as f64 / (m - w).max(1) as f64;
                let c = 0.5 * (1.0 + (std::f64::consts::PI * 0.5 * 2.0 * p).cos());
                (
                    c * (1.0 - rate) + rate,
                    (0.0f64).max((m as f64 - s as f64) / (m - w).max(1) as f64),
                )
            };
            if s <= m {
                assert_eq!(cos.at(s), lr * want_cos, "cosine at {s}");
                assert_eq!(lin.at(s), lr * want_lin, "linear at {s}");
            }
        }
        // warmup-stable-decay: the peak until the last 10 steps, then 1 - sqrt to the floor
        let wsd = LrPlan::new(
            1.0,
            Some(100),
            Some(&LrSchedule {
                warmup_steps: Some(5),
                decay: Some(Decay::Wsd),
                decay_steps: Some(10),
                wsd_decay: Some(WsdDecay::Sqrt),
                min_lr: Some(0.0),
                ..Default::default()
            }),
        );
        assert_eq!(wsd.at(0), 0.2);
        assert_eq!(wsd.at(4), 1.0);
        assert_eq!(wsd.at(89), 1.0);
        assert_eq!(wsd.at(90), 1.0);
        assert!((wsd.at(95) - (1.0 - 0.5f64.sqrt())).abs() < 1e-15);
        assert_eq!(wsd.at(100), 0.0);
    }

    #[test]
    fn an_optimizer_is_a_name_or_a_table_and_a_name_stays_a_string() {
        #[derive(Serialize, Deserialize)]
        struct T {
            optimizer: OptimizerSpec,
        }
        let t: T = toml::from_str("optimizer = \"sgd\"").unwrap();
        assert_eq!(t.optimizer, OptimizerSpec::named(OptimizerKind::Sgd));
        assert_eq!(toml::to_string(&t).unwrap().trim(), "optimizer = \"sgd\"");
        let t: T = toml::from_str(
            "[optimizer]\nname = \"adamw\"\nbetas = [0.9, 0.99]\nweight_decay = 0.1\nno_decay = [\"norm\", \"bias\"]\n",
        )
        .unwrap();
        assert_eq!(t.optimizer.adamw().beta2, 0.99);
        assert_eq!(t.optimizer.adamw().eps, 1e-8);
        assert!(!t.optimizer.decays("model.layers.0.input_layernorm.weight"));
        assert!(t.optimizer.decays("model.layers.0.mlp.up_proj.weight"));
        let back: T = toml::from_str(&toml::to_string(&t).unwrap()).unwrap();
        assert_eq!(back.optimizer, t.optimizer);
        for (bad, says) in [
            ("optimizer = \"lion\"", "training.optimizer"),
            (
                "[optimizer]\nname = \"adamw\"\nmomentun = 0.9\n",
                "momentun",
            ),
        ] {
            let e = toml::from_str::<T>(bad).err().unwrap().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn bad_recipes_are_refused_naming_the_key() {
        let opt = |t: &str| -> OptimizerSpec {
            #[derive(Deserialize)]
            struct T {
                optimizer: OptimizerSpec,
            }
            toml::from_str::<T>(&format!("[optimizer]\n{t}"))
                .unwrap()
                .optimizer
        };
        for (t, key) in [
            ("weight_decay = -0.1", "training.optimizer.weight_decay"),
            ("betas = [0.9, 1.0]", "training.optimizer.betas"),
            ("eps = 0.0", "training.optimizer.eps"),
            ("momentum = 0.9", "training.optimizer.momentum"),
            (
                "name = \"sgd\"\nbetas = [0.9, 0.9]",
                "training.optimizer.betas",
            ),
            (
                "name = \"sgd\"\nmomentum = 0.0\nnesterov = true",
                "training.optimizer.nesterov",
            ),
            ("no_decay = [\"\"]", "training.optimizer.no_decay"),
        ] {
            let e = opt(t).validate().unwrap_err().to_string();
            assert!(e.contains(key), "{t}: {e}");
        }
        opt("name = \"sgd\"\nmomentum = 0.5\nnesterov = true\nweight_decay = 1e-4")
            .validate()
            .unwrap();
        let sched = |t: &str| -> LrSchedule { toml::from_str(t).unwrap() };
        for (t, max, key) in [
            (
                "warmup_steps = 200",
                Some(100),
                "training.lr_schedule.warmup_steps",
            ),
            ("min_lr = -1e-5", Some(100), "training.lr_schedule.min_lr"),
            ("min_lr = 1.0", Some(100), "training.lr_schedule.min_lr"),
            ("decay = \"linear\"", None, "training.lr_schedule.decay"),
            (
                "decay = \"wsd\"",
                Some(100),
                "training.lr_schedule.decay_steps",
            ),
            (
                "decay = \"wsd\"\nwarmup_steps = 50\ndecay_steps = 60",
                Some(100),
                "training.lr_schedule.decay_steps",
            ),
            (
                "decay_steps = 10",
                Some(100),
                "training.lr_schedule.decay_steps",
            ),
            (
                "wsd_decay = \"sqrt\"",
                Some(100),
                "training.lr_schedule.wsd_decay",
            ),
        ] {
            let e = validate_schedule(&sched(t), 1e-3, max)
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{t}: {e}");
        }
        let e = toml::from_str::<LrSchedule>("decay = \"exponential\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("training.lr_schedule.decay"), "{e}");
        validate_schedule(&sched("decay = \"constant\""), 1e-3, None).unwrap();
    }

    #[test]
    fn a_recipe_names_what_differs_from_a_recorded_one() {
        let adamw = OptimizerSpec::named(OptimizerKind::Adamw);
        let a = Recipe::new(&adamw, LrPlan::new(1e-3, Some(100), None), false);
        let was = serde_json::to_value(&a).unwrap();
        assert!(a.differences(&was).is_empty());
        // the default schedule follows max_steps, as it always did: only the setting differs
        let b = Recipe::new(
            &OptimizerSpec {
                weight_decay: Some(0.1),
                ..adamw.clone()
            },
            LrPlan::new(1e-3, Some(200), None),
            false,
        );
        let d = b.differences(&was);
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(
            d[0].starts_with("optimizer.weight_decay: 0.01 in the checkpoint, 0.1"),
            "{d:?}"
        );
        // a schedule of the job's own: max_steps is part of it
        let cos = LrSchedule {
            warmup_steps: Some(10),
            ..Default::default()
        };
        let c = Recipe::new(&adamw, LrPlan::new(1e-3, Some(100), Some(&cos)), true);
        let was = serde_json::to_value(&c).unwrap();
        let d =
            Recipe::new(&adamw, LrPlan::new(1e-3, Some(200), Some(&cos)), true).differences(&was);
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(
            d[0].starts_with("lr_schedule.max_steps: 100 in the checkpoint, 200"),
            "{d:?}"
        );
    }
}

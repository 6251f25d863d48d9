//! SGD with momentum and AdamW on plain tensors, with a learning-rate schedule by step. Written
//! out here (not tch's C++ optimizers) so that their state is ordinary tensors that can be sent
//! to a newcomer and hashed, and so the arithmetic order is fixed.

use ductile_cluster::recipe::{AdamW, OptimizerSpec, Sgd};
use ductile_cluster::records::OptimizerKind;
use tch::Tensor;

/// The optimizer and its settings (`training.optimizer`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Sgd(Sgd),
    AdamW(AdamW),
}

impl Kind {
    pub fn of(spec: &OptimizerSpec) -> Kind {
        match spec.name {
            OptimizerKind::Sgd => Kind::Sgd(spec.sgd()),
            OptimizerKind::Adamw => Kind::AdamW(spec.adamw()),
        }
    }
}

pub struct Optimizer {
    pub kind: Kind,
    /// Per parameter: the momentum buffer (SGD) or the first and second moments (AdamW).
    pub state: Vec<Tensor>,
    /// Per parameter: whether it takes weight decay (`no_decay`); every one when empty.
    pub decay: Vec<bool>,
}

impl Optimizer {
    pub fn new(spec: &OptimizerSpec, params: &[Tensor]) -> Optimizer {
        let kind = Kind::of(spec);
        let n = spec.states() as usize;
        Optimizer {
            kind,
            state: params
                .iter()
                .flat_map(|p| (0..n).map(|_| p.zeros_like()).collect::<Vec<_>>())
                .collect(),
            decay: Vec::new(),
        }
    }

    /// The optimizer with its state not allocated yet (empty tensors): a sharded job's rank
    /// allocates only its rows, once it knows its shard ([`crate::train::Trainer`]'s agreement).
    pub fn unallocated(spec: &OptimizerSpec, params: &[Tensor]) -> Optimizer {
        let mut o = Optimizer::new(spec, &[]);
        o.state = params
            .iter()
            .flat_map(|p| (0..spec.states()).map(|_| Tensor::empty([0], (p.kind(), p.device()))))
            .collect();
        o
    }

    /// Which of the parameters `names` (in the optimizer's order) take weight decay: those
    /// no `no_decay` pattern of `spec` names.
    pub fn decaying<'a>(
        mut self,
        spec: &OptimizerSpec,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Optimizer {
        self.decay = names.into_iter().map(|n| spec.decays(n)).collect();
        self
    }

    /// Whether parameter `i` takes weight decay.
    pub fn decays(&self, i: usize) -> bool {
        self.decay.get(i).copied().unwrap_or(true)
    }

    /// Apply one update. `step` is the 0-based index of the step being applied.
    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64, step: u64) {
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            self.update(i, p, g, lr, step);
        }
    }

    /// Apply one update to parameter `i` only (a pipeline stage updates its own layers).
    pub fn update(&mut self, i: usize, p: &Tensor, g: &Tensor, lr: f64, step: u64) {
        let per = self.per();
        let (kind, decay) = (self.kind, self.decays(i));
        apply(
            &kind,
            decay,
            &mut self.state[per * i..per * (i + 1)],
            p,
            g,
            lr,
            step,
        );
    }

    /// State tensors per parameter.
    pub fn per(&self) -> usize {
        match self.kind {
            Kind::Sgd(_) => 1,
            Kind::AdamW(_) => 2,
        }
    }

    /// The state tensors of parameter `i`.
    pub fn state_of(&self, i: usize) -> Vec<&Tensor> {
        let per = self.per();
        (0..per).map(|k| &self.state[per * i + k]).collect()
    }
}

/// One update of `p` (in place) with gradient `g` and `state` (the parameter's momentum buffer,
/// or its two moments), all of one shape: elementwise, so a slice of rows updated alone gets
/// the bits the whole tensor's update gives those rows. `decay`: whether `p` takes the weight
/// decay. PyTorch's single-tensor SGD and AdamW (dampening 0, not maximizing, no amsgrad).
pub fn apply(
    kind: &Kind,
    decay: bool,
    state: &mut [Tensor],
    p: &Tensor,
    g: &Tensor,
    lr: f64,
    step: u64,
) {
    tch::no_grad(|| match *kind {
        Kind::Sgd(Sgd {
            momentum,
            nesterov,
            weight_decay,
        }) => {
            // L2 weight decay on the gradient, as torch.optim.SGD
            let decayed;
            let g = if decay && weight_decay != 0.0 {
                decayed = g + p * weight_decay;
                &decayed
            } else {
                g
            };
            let buf = &mut state[0];
            let _ = buf.g_mul_scalar_(momentum).g_add_(g);
            let mut p = p.shallow_clone();
            if nesterov {
                let d = g + &*buf * momentum;
                let _ = p.g_sub_(&(d * lr));
            } else {
                let _ = p.g_sub_(&(&*buf * lr));
            }
        }
        Kind::AdamW(AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        }) => {
            // PyTorch's single-tensor AdamW, in place where it can be (two temporaries
            // of a parameter's size, not eight: the update is memory-bound)
            let t = step as i32 + 1;
            let (c1, c2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
            let mut p = p.shallow_clone();
            if decay && weight_decay != 0.0 {
                let _ = p.g_mul_scalar_(1.0 - lr * weight_decay);
            }
            let _ = state[0].lerp_(g, 1.0 - beta1);
            let v = &mut state[1];
            let _ = v.g_mul_scalar_(beta2).addcmul_(&(g * (1.0 - beta2)), g);
            let mut denom = v.sqrt();
            let _ = denom.g_div_scalar_(c2.sqrt()).g_add_scalar_(eps);
            let mut u = &state[0] / &denom;
            let _ = u.g_mul_scalar_(lr / c1);
            let _ = p.g_sub_(&u);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(v: serde_json::Value) -> OptimizerSpec {
        serde_json::from_value(v).unwrap()
    }

    /// torch.optim.SGD(momentum=0.9, nesterov=True, weight_decay=0.1), worked by hand: the
    /// decay added to the gradient, the buffer, the look-ahead; a parameter `no_decay` names
    /// takes none.
    #[test]
    fn sgd_with_nesterov_and_weight_decay_is_torch_s_and_no_decay_spares_a_parameter() {
        let s = spec(
            serde_json::json!({"name": "sgd", "momentum": 0.9, "nesterov": true, "weight_decay": 0.1, "no_decay": ["bias"]}),
        );
        let p = [Tensor::from_slice(&[1.0f64]), Tensor::from_slice(&[1.0f64])];
        let mut o = Optimizer::new(&s, &p).decaying(&s, ["w", "b.bias"]);
        let g = [Tensor::from_slice(&[0.5f64]), Tensor::from_slice(&[0.5f64])];
        for step in 0..2 {
            o.step(&p, &g, 0.1, step);
        }
        // decayed: g' = 0.6, buf = 0.6, d = 1.14, p = 0.886; then g' = 0.5886,
        // buf = 1.1286, d = 1.60434, p = 0.725566
        assert!((p[0].double_value(&[0]) - 0.725566).abs() < 1e-12);
        // spared: buf = 0.5, d = 0.95, p = 0.905; buf = 0.95, d = 1.355, p = 0.7695
        assert!((p[1].double_value(&[0]) - 0.7695).abs() < 1e-12);
    }

    /// AdamW's decoupled decay: a parameter with no gradient shrinks by (1 - lr·wd) per step
    /// unless `no_decay` names it.
    #[test]
    fn adamw_decays_only_the_parameters_no_decay_leaves() {
        let s =
            spec(serde_json::json!({"name": "adamw", "weight_decay": 0.5, "no_decay": ["norm"]}));
        let p = [Tensor::from_slice(&[2.0f64]), Tensor::from_slice(&[2.0f64])];
        let mut o = Optimizer::new(&s, &p).decaying(
            &s,
            ["layers.0.mlp.weight", "layers.0.input_layernorm.weight"],
        );
        let g = [Tensor::from_slice(&[0.0f64]), Tensor::from_slice(&[0.0f64])];
        o.step(&p, &g, 0.1, 0);
        assert_eq!(p[0].double_value(&[0]), 2.0 * (1.0 - 0.1 * 0.5));
        assert_eq!(p[1].double_value(&[0]), 2.0);
    }
}

//! SGD with momentum and AdamW on plain tensors, with a learning-rate schedule by step. Written
//! out here (not tch's C++ optimizers) so that their state is ordinary tensors that can be sent
//! to a newcomer and hashed, and so the arithmetic order is fixed.

use ductile_cluster::records::OptimizerKind;
use tch::Tensor;

pub enum Kind {
    Sgd {
        momentum: f64,
    },
    AdamW {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
}

pub struct Optimizer {
    pub kind: Kind,
    /// Per parameter: the momentum buffer (SGD) or the first and second moments (AdamW).
    pub state: Vec<Tensor>,
}

impl Optimizer {
    pub fn new(name: OptimizerKind, params: &[Tensor]) -> Optimizer {
        let zeros = |n: usize| {
            params
                .iter()
                .flat_map(|p| (0..n).map(|_| p.zeros_like()).collect::<Vec<_>>())
                .collect()
        };
        match name {
            OptimizerKind::Sgd => Optimizer {
                kind: Kind::Sgd { momentum: 0.9 },
                state: zeros(1),
            },
            OptimizerKind::Adamw => Optimizer {
                kind: Kind::AdamW {
                    beta1: 0.9,
                    beta2: 0.95,
                    eps: 1e-8,
                    weight_decay: 0.01,
                },
                state: zeros(2),
            },
        }
    }

    /// The optimizer with its state not allocated yet (empty tensors): a sharded job's rank
    /// allocates only its rows, once it knows its shard ([`crate::train::Trainer`]'s agreement).
    pub fn unallocated(name: OptimizerKind, params: &[Tensor]) -> Optimizer {
        let mut o = Optimizer::new(name, &[]);
        o.state = params
            .iter()
            .flat_map(|p| (0..name.states()).map(|_| Tensor::empty([0], (p.kind(), p.device()))))
            .collect();
        o
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
        let kind = &self.kind;
        apply(
            kind,
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
            Kind::Sgd { .. } => 1,
            Kind::AdamW { .. } => 2,
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
/// the bits the whole tensor's update gives those rows.
pub fn apply(kind: &Kind, state: &mut [Tensor], p: &Tensor, g: &Tensor, lr: f64, step: u64) {
    tch::no_grad(|| match *kind {
        Kind::Sgd { momentum } => {
            let buf = &mut state[0];
            let _ = buf.g_mul_scalar_(momentum).g_add_(g);
            let mut p = p.shallow_clone();
            let _ = p.g_sub_(&(&*buf * lr));
        }
        Kind::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        } => {
            // PyTorch's single-tensor AdamW, in place where it can be (two temporaries
            // of a parameter's size, not eight: the update is memory-bound)
            let t = step as i32 + 1;
            let (c1, c2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
            let mut p = p.shallow_clone();
            let _ = p.g_mul_scalar_(1.0 - lr * weight_decay);
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

/// Linear warm-up over the first 10 steps (or 10% of max_steps), then cosine decay to 10% of
/// `lr` at `max_steps` (constant after warm-up when there is no max_steps).
pub fn lr_at(lr: f64, step: u64, max_steps: Option<u64>) -> f64 {
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

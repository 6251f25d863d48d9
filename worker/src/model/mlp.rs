//! The built-in MLP (regression): hidden linear layers each followed by tanh, then a linear
//! output layer; the squared error per sample, averaged over outputs. Units: the hidden layers
//! `l0..`, then `out`. In a tensor group its hidden layers pair up column- then row-parallel.

use ductile_comm::CommError;
use ductile_strategies::tensor::{self, Arch};
use tch::nn;
use tch::{Kind, Tensor};

use super::tp::Par;
use super::Network;

pub(super) struct Mlp {
    /// Hidden layers, each followed by tanh.
    hidden: Vec<nn::Linear>,
    out: nn::Linear,
    width: i64,
}

impl Mlp {
    /// Its parameters under `root`, made in the order the seed's draws follow.
    pub(super) fn new(
        root: &nn::Path,
        cut: &super::Cut,
        d_in: i64,
        width: i64,
        layers: i64,
        d_out: i64,
    ) -> Mlp {
        let mut hidden = Vec::new();
        let mut d = d_in;
        for i in 0..layers {
            hidden.push(nn::linear(
                root / format!("l{i}"),
                d,
                width,
                Default::default(),
            ));
            cut.unit();
            d = width;
        }
        Mlp {
            hidden,
            out: nn::linear(root / "out", d, d_out, Default::default()),
            width,
        }
    }
}

impl Network for Mlp {
    fn units(&self) -> usize {
        self.hidden.len() + 1
    }

    fn boundary_shape(&self, _unit: usize, n: i64) -> Vec<i64> {
        vec![n, self.width]
    }

    fn forward(
        &self,
        a: usize,
        b: usize,
        input: &Tensor,
        p: &mut Par,
    ) -> Result<Tensor, CommError> {
        let layers = self.hidden.len() as u64;
        let mut h = input.shallow_clone();
        // a column-parallel layer's output, slice by slice, for the row-parallel next
        let mut sliced: Vec<Tensor> = Vec::new();
        for u in a..b {
            if u == self.hidden.len() {
                h = h.apply(&self.out);
                continue;
            }
            let l = &self.hidden[u];
            match p.mlp_role(layers, u as u64) {
                (true, _) => {
                    let xs = p.f(&h);
                    sliced = p
                        .column(l, &xs, self.width)
                        .iter()
                        .map(|x| x.tanh())
                        .collect();
                }
                (_, true) => h = p.row(l, &sliced, self.width)?.tanh(),
                _ => h = h.apply(l).tanh(),
            }
        }
        Ok(h)
    }

    /// The squared error of each sample, averaged over its outputs, summed over samples.
    fn loss(&self, out: &Tensor, y: &Tensor, _p: &mut Par) -> Result<Tensor, CommError> {
        let d = y.size()[1];
        Ok((out - y).square().sum(Kind::Float) / d as f64)
    }

    fn split_rules(&self) -> Arch {
        Arch::Mlp {
            layers: self.hidden.len() as u64,
        }
    }

    fn check_tp(&self, tp: u32) -> Result<(), String> {
        tensor::check_tp(self.split_rules(), 0, 0, self.width as u64, tp)
    }
}

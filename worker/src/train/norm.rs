//! Clipping by global norm (`max_grad_norm`) at every layout: data parallel (whole or
//! sharded), stages, tensor groups and their products.
//!
//! The norm is folded from pieces: each parameter's gradient whole where the model computes in
//! one slice or the parameter is replicated, else its K logical slices (deterministic mode's
//! `tensor_slices`, each slice's boxes as `strategies::tensor` cuts them, a fused Q/K/V's
//! three). Each piece's sum of squares is taken in f64 on the piece alone (made contiguous),
//! so it is the same bits wherever the same gradient is; the pieces are folded in (parameter,
//! slice) order. A rank that holds slices only counts its own; across ranks the pieces meet in
//! one row summed over the world, where exactly one rank counts each piece (replica 0, tensor
//! place 0 for a replicated parameter, the stage of its own unit for a tied one) and the
//! others add zeros, so the row is exact. With the same K the norm, and so the clipped
//! update, has the same bits at every layout.

use ductile_cluster::records::Generation;
use ductile_strategies::redistribute::Region;
use ductile_strategies::tensor::{held_regions, split_of, Arch, Split};
use tch::{Device, Kind, Tensor};

use super::reshard::{region_of, Holding};
use super::Trainer;

impl Trainer {
    /// Each parameter's pieces, in parameter order: a piece is its boxes of the logical
    /// tensor, and the flag says whether the parameter is replicated over a tensor group.
    fn norm_pieces(&self, names: &[String], k: u32) -> Vec<(Vec<Vec<Region>>, bool)> {
        let arch = self.model.arch();
        names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let shape: Vec<u64> = self.shapes[i].iter().map(|d| *d as u64).collect();
                let replicated = split_of(arch, name) == Split::Replicated;
                let pieces = if pieces_of(arch, name, k) == 1 {
                    vec![vec![shape.iter().map(|d| 0..*d).collect()]]
                } else {
                    (0..k)
                        .map(|s| held_regions(arch, name, &shape, k, s))
                        .collect()
                };
                (pieces, replicated)
            })
            .collect()
    }

    /// The norm's row: one slot per piece of every parameter, each the sum of squares of the
    /// piece of `grads` (the local gradients of parameters `which`, in that order) where this
    /// rank counts it (`counts(parameter, replicated)` and it holds the whole piece), zero
    /// elsewhere.
    pub(super) fn norm_row(
        &self,
        g: &Generation,
        which: &[usize],
        grads: &[Tensor],
        counts: impl Fn(usize, bool) -> bool,
    ) -> Vec<f64> {
        let arch = self.model.arch();
        let names = self.param_names();
        let (tp, place) = self.tp_held;
        let pieces = self.norm_pieces(&names, self.norm_slices(g));
        let mut start = Vec::with_capacity(pieces.len());
        let mut slots = 0;
        for (p, _) in &pieces {
            start.push(slots);
            slots += p.len();
        }
        let mut row = vec![0f64; slots];
        let (mut at, mut squares) = (Vec::new(), Vec::new());
        for (g, &i) in grads.iter().zip(which) {
            let (ps, replicated) = &pieces[i];
            if g.numel() == 0 || !counts(i, *replicated) {
                continue;
            }
            let shape: Vec<u64> = self.shapes[i].iter().map(|d| *d as u64).collect();
            let holding =
                (tp > 1).then(|| Holding::of_tensor_place(arch, &names[i], &shape, tp, place));
            for (s, boxes) in ps.iter().enumerate() {
                let views: Option<Vec<Tensor>> = boxes
                    .iter()
                    .map(|b| match &holding {
                        Some(h) => h.view(g, b),
                        // (a whole parameter: the gradient itself)
                        None if b
                            .iter()
                            .zip(&shape)
                            .all(|(r, d)| r.start == 0 && r.end == *d) =>
                        {
                            Some(g.shallow_clone())
                        }
                        None => Some(region_of(g, b)),
                    })
                    .collect();
                let Some(views) = views else {
                    continue;
                };
                // a piece of several boxes (a slice of a fused Q/K/V): its boxes' sums, in order
                let mut sum: Option<Tensor> = None;
                for v in views {
                    let q = v
                        .contiguous()
                        .to_kind(Kind::Double)
                        .square()
                        .sum(Kind::Double);
                    sum = Some(match sum {
                        Some(a) => a + q,
                        None => q,
                    });
                }
                if let Some(sum) = sum {
                    at.push(start[i] + s);
                    squares.push(sum);
                }
            }
        }
        if !squares.is_empty() {
            // one device→host read for the whole row
            let got: Vec<f64> =
                Vec::<f64>::try_from(Tensor::stack(&squares, 0).to_device(Device::Cpu))
                    .unwrap_or_else(|_| vec![f64::NAN; squares.len()]);
            for (slot, v) in at.into_iter().zip(got) {
                row[slot] = v;
            }
        }
        row
    }

    /// The number of slots of [`Trainer::norm_row`].
    pub(super) fn norm_slots(&self, g: &Generation) -> usize {
        let (arch, k) = (self.model.arch(), self.norm_slices(g));
        self.param_names()
            .iter()
            .map(|name| pieces_of(arch, name, k))
            .sum()
    }

    /// The logical slices the norm cuts a split parameter into in `g`: the model's (K, as
    /// `Model::set_tensor_group` counts them: deterministic `tensor_slices` where they split
    /// over the generation's tensor groups, else the group size). From the job and the layout
    /// alone, so every rank's row has the same slots, a spare's too.
    fn norm_slices(&self, g: &Generation) -> u32 {
        crate::model::logical_slices(
            self.spec.tensor_slices.filter(|_| self.spec.deterministic),
            g.layout.tensor_parallel.max(1),
        )
    }

    /// The parameters' names, in parameter order.
    pub(super) fn param_names(&self) -> Vec<String> {
        self.model.params().into_iter().map(|(n, _)| n).collect()
    }
}

/// How many pieces the norm folds parameter `name` in, cut in `k` logical slices: its K
/// slices where it is split, else itself whole.
fn pieces_of(arch: Arch, name: &str, k: u32) -> usize {
    if k == 1 || split_of(arch, name) == Split::Replicated {
        1
    } else {
        k as usize
    }
}

/// The global norm of a complete row (every piece counted once): its slots folded in order,
/// then the square root.
/// The sum of the squares of every element of `grads`, in f64 (one copy to the host).
pub(super) fn sum_squares<'a>(grads: impl IntoIterator<Item = &'a Tensor>) -> f64 {
    let squares: Vec<Tensor> = grads
        .into_iter()
        .map(|g| g.to_kind(Kind::Double).square().sum(Kind::Double))
        .collect();
    if squares.is_empty() {
        return 0.0;
    }
    Vec::<f64>::try_from(Tensor::stack(&squares, 0).to_device(Device::Cpu))
        .unwrap_or_default()
        .iter()
        .sum()
}

pub(super) fn row_norm(row: &[f64]) -> f64 {
    row.iter().sum::<f64>().sqrt()
}

/// Every gradient scaled in place by max / (norm + 1e-6) when the norm exceeds `max`, as
/// PyTorch's `clip_grad_norm_`.
pub(crate) fn clip_to(grads: &[Tensor], norm: f64, max: f64) {
    let scale = max / (norm + 1e-6);
    if scale < 1.0 {
        for g in grads {
            let mut g = g.shallow_clone();
            let _ = g.g_mul_scalar_(scale);
        }
    }
}

#[cfg(test)]
mod tests {
    use tch::Tensor;

    #[test]
    fn clipping_scales_to_the_global_norm_only_past_it() {
        let g = || {
            vec![
                Tensor::from_slice(&[3.0f32, 0.0]),
                Tensor::from_slice(&[0.0f32, 4.0]),
            ]
        };
        // the pieces' squares 9 and 16: |g| = 5
        let norm = super::row_norm(&[9.0, 16.0]);
        assert_eq!(norm, 5.0);
        // under a max of 10 nothing moves
        let a = g();
        super::clip_to(&a, norm, 10.0);
        assert_eq!(Vec::<f32>::try_from(&a[0]).unwrap(), vec![3.0, 0.0]);
        // past a max of 1, scaled by 1 / (5 + 1e-6), in place
        let b = g();
        super::clip_to(&b, norm, 1.0);
        let s = (1.0 / (5.0 + 1e-6)) as f32;
        assert_eq!(Vec::<f32>::try_from(&b[1]).unwrap(), vec![0.0, 4.0 * s]);
    }
}

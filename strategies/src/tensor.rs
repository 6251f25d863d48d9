//! Tensor parallelism's split rules (Megatron-style), without tch: which parameters a tensor
//! group splits, along which dimension, and which part of each a member holds. The worker's
//! layers and the state plans ([`crate::redistribute`]) both read them, so what a member
//! computes with and what it is said to hold are one rule.
//!
//! - GPT: the token embedding and the head are split by vocabulary rows (vocab-parallel);
//!   Q, K and V are split by heads (the fused `qkv` weight keeps its three blocks: a member
//!   holds the rows of its heads in each); the attention's output projection and the MLP's
//!   second linear are split by input columns (row-parallel), the MLP's first linear by output
//!   rows (column-parallel). Layer norms, the position embedding and the biases added after a
//!   row-parallel layer's reduce are replicated.
//! - GPT-2 (Hugging Face's `GPT2LMHeadModel`, Conv1D weights stored `[in, out]`): as the GPT,
//!   on the stored layout: the fused `c_attn` is split by heads along its columns (each of Q,
//!   K and V), `c_fc` by columns (its output), both `c_proj` by rows (their input); `wte` (and
//!   an untied `lm_head`) by vocabulary rows.
//! - MLP: hidden layers pair up, column-parallel then row-parallel (`l0` rows, `l1` columns,
//!   `l2` rows, ...); an unpaired last hidden layer and the output layer are replicated.
//!
//! Splits need not be even: a dimension of `n` splits into `tp` contiguous ranges that differ
//! by at most one (heads must divide, since a head is indivisible; the vocabulary need not, so
//! nothing is padded).

use std::ops::Range;

use crate::redistribute::Region;
use crate::split_range;

/// How a tensor group splits one parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Replicated,
    /// Along dimension 0 (output features, vocabulary rows; a column-split bias).
    Rows,
    /// Along dimension 1 (input features of a row-parallel layer).
    Cols,
    /// Dimension 0 holds `blocks` equal blocks (Q, K, V), each split by heads.
    HeadRows {
        blocks: u64,
    },
    /// Dimension 1 holds `blocks` equal blocks (a Conv1D's fused Q, K, V), each split by heads.
    HeadCols {
        blocks: u64,
    },
}

impl Split {
    /// The dimension it splits (0 when replicated).
    pub fn dim(self) -> usize {
        match self {
            Split::Cols | Split::HeadCols { .. } => 1,
            Split::Replicated | Split::Rows | Split::HeadRows { .. } => 0,
        }
    }
}

/// What a job's model is, for the split rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Gpt {
        heads: u64,
    },
    Mlp {
        layers: u64,
    },
    /// The Llama family (Hugging Face names): Q by query heads, K and V by KV heads.
    Llama {
        heads: u64,
        kv_heads: u64,
    },
    /// GPT-2 (Hugging Face names, Conv1D layouts).
    Gpt2 {
        heads: u64,
    },
}

/// The split of parameter `name` (a var-store path: `h3.qkv.weight`, `l1.bias`, ...).
pub fn split_of(arch: Arch, name: &str) -> Split {
    let (module, field) = name.rsplit_once('.').unwrap_or((name, ""));
    let last = module.rsplit('.').next().unwrap_or(module);
    match arch {
        Arch::Gpt { .. } => match (last, field) {
            ("tok", _) | ("head", _) | ("fc", _) => Split::Rows,
            ("qkv", _) => Split::HeadRows { blocks: 3 },
            ("proj", "weight") | ("fc2", "weight") => Split::Cols,
            _ => Split::Replicated,
        },
        Arch::Llama { .. } => match (last, field) {
            ("embed_tokens", _) | ("lm_head", _) => Split::Rows,
            // whole heads per member: check_tp makes tp divide the query and the KV heads
            ("q_proj", _) | ("k_proj", _) | ("v_proj", _) => Split::Rows,
            ("gate_proj", _) | ("up_proj", _) => Split::Rows,
            ("o_proj", "weight") | ("down_proj", "weight") => Split::Cols,
            _ => Split::Replicated,
        },
        Arch::Gpt2 { .. } => match (last, field) {
            ("wte", _) | ("lm_head", _) => Split::Rows,
            ("c_attn", "weight") => Split::HeadCols { blocks: 3 },
            ("c_attn", _) => Split::HeadRows { blocks: 3 },
            ("c_fc", "weight") => Split::Cols,
            ("c_fc", _) => Split::Rows,
            ("c_proj", "weight") => Split::Rows,
            _ => Split::Replicated,
        },
        Arch::Mlp { layers } => {
            let Some(i) = last.strip_prefix('l').and_then(|i| i.parse::<u64>().ok()) else {
                return Split::Replicated;
            };
            match (i % 2, field) {
                (0, _) if i + 1 < layers => Split::Rows,
                (1, "weight") => Split::Cols,
                _ => Split::Replicated,
            }
        }
    }
}

/// Whether the layer `l{i}` of an MLP of `layers` hidden layers is column-parallel (its pair's
/// first), row-parallel (second) or replicated: (column, row).
pub fn mlp_role(layers: u64, i: u64) -> (bool, bool) {
    (i.is_multiple_of(2) && i + 1 < layers, !i.is_multiple_of(2))
}

/// The ranges of dimension `dim` of a tensor of `shape` that member `rank` of `tp` holds under
/// `split` (one range, or one per block), and that dimension; `None` when replicated.
pub fn held_ranges(
    arch: Arch,
    split: Split,
    shape: &[u64],
    tp: u32,
    rank: u32,
) -> Option<(usize, Vec<Range<u64>>)> {
    match split {
        Split::Replicated => None,
        Split::Rows => Some((0, vec![split_range(shape[0], tp, rank)])),
        Split::Cols => Some((1, vec![split_range(shape[1], tp, rank)])),
        Split::HeadRows { blocks } | Split::HeadCols { blocks } => {
            let heads = match arch {
                Arch::Gpt { heads } | Arch::Gpt2 { heads } => heads,
                Arch::Mlp { .. } | Arch::Llama { .. } => 1,
            };
            let dim = split.dim();
            let width = shape[dim] / blocks;
            let hd = width / heads;
            let r = split_range(heads, tp, rank);
            Some((
                dim,
                (0..blocks)
                    .map(|b| b * width + r.start * hd..b * width + r.end * hd)
                    .collect(),
            ))
        }
    }
}

/// The boxes of a tensor of `shape` that member `rank` of `tp` holds (the whole tensor when
/// replicated; several boxes for the fused QKV).
pub fn held_regions(arch: Arch, name: &str, shape: &[u64], tp: u32, rank: u32) -> Vec<Region> {
    let whole: Region = shape.iter().map(|d| 0..*d).collect();
    match held_ranges(arch, split_of(arch, name), shape, tp, rank) {
        None => vec![whole],
        Some((dim, ranges)) => ranges
            .into_iter()
            .map(|r| {
                let mut b = whole.clone();
                b[dim] = r;
                b
            })
            .collect(),
    }
}

/// Why `tp` cannot split this model, if it cannot: heads must divide, every split dimension
/// needs at least one row or column per member.
pub fn check_tp(arch: Arch, d_model: u64, vocab: u64, hidden: u64, tp: u32) -> Result<(), String> {
    let tp64 = tp as u64;
    match arch {
        Arch::Gpt { heads } | Arch::Gpt2 { heads } => {
            if hidden < tp64 {
                return Err(format!(
                    "the MLP's width {hidden} is narrower than tensor_parallel = {tp}"
                ));
            }
            if heads % tp64 != 0 {
                return Err(format!(
                    "n_head = {heads} does not split into tensor_parallel = {tp} (heads are indivisible)"
                ));
            }
            if vocab < tp64 {
                return Err(format!(
                    "vocab = {vocab} has fewer rows than tensor_parallel = {tp}"
                ));
            }
            let _ = d_model;
            Ok(())
        }
        Arch::Llama { heads, kv_heads } => {
            if kv_heads % tp64 != 0 {
                return Err(format!(
                    "num_key_value_heads = {kv_heads} (num_attention_heads = {heads}) does not split into tensor_parallel = {tp}: a member holds whole KV heads and the query heads that share them (KV heads are not replicated)"
                ));
            }
            if vocab < tp64 || hidden < tp64 {
                return Err(format!(
                    "vocab_size = {vocab} or intermediate_size = {hidden} is smaller than tensor_parallel = {tp}"
                ));
            }
            let _ = d_model;
            Ok(())
        }
        Arch::Mlp { layers } => {
            if layers < 2 && tp > 1 {
                return Err(format!(
                    "an MLP of {layers} hidden layer(s) has no column/row pair to split over tensor_parallel = {tp}"
                ));
            }
            if hidden < tp64 {
                return Err(format!(
                    "hidden = {hidden} is narrower than tensor_parallel = {tp}"
                ));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redistribute::elements as volume;

    const GPT: Arch = Arch::Gpt { heads: 4 };

    #[test]
    fn the_gpt_splits_as_megatron_does() {
        let cases = [
            ("tok.weight", Split::Rows),
            ("pos.weight", Split::Replicated),
            ("h0.ln1.weight", Split::Replicated),
            ("h0.qkv.weight", Split::HeadRows { blocks: 3 }),
            ("h0.qkv.bias", Split::HeadRows { blocks: 3 }),
            ("h0.proj.weight", Split::Cols),
            ("h0.proj.bias", Split::Replicated),
            ("h12.fc.weight", Split::Rows),
            ("h12.fc.bias", Split::Rows),
            ("h12.fc2.weight", Split::Cols),
            ("h12.fc2.bias", Split::Replicated),
            ("ln_f.bias", Split::Replicated),
            ("head.weight", Split::Rows),
        ];
        for (name, want) in cases {
            assert_eq!(split_of(GPT, name), want, "{name}");
        }
    }

    /// GPT-2's Conv1D weights are `[in, out]`: the same Megatron split on the other dimension.
    #[test]
    fn gpt2_splits_its_conv1d_layouts_as_megatron_does() {
        let a = Arch::Gpt2 { heads: 4 };
        let cases = [
            ("transformer.wte.weight", Split::Rows),
            ("transformer.wpe.weight", Split::Replicated),
            ("transformer.h.0.ln_1.weight", Split::Replicated),
            (
                "transformer.h.0.attn.c_attn.weight",
                Split::HeadCols { blocks: 3 },
            ),
            (
                "transformer.h.0.attn.c_attn.bias",
                Split::HeadRows { blocks: 3 },
            ),
            ("transformer.h.0.attn.c_proj.weight", Split::Rows),
            ("transformer.h.0.attn.c_proj.bias", Split::Replicated),
            ("transformer.h.11.mlp.c_fc.weight", Split::Cols),
            ("transformer.h.11.mlp.c_fc.bias", Split::Rows),
            ("transformer.h.11.mlp.c_proj.weight", Split::Rows),
            ("transformer.h.11.mlp.c_proj.bias", Split::Replicated),
            ("transformer.ln_f.bias", Split::Replicated),
            ("lm_head.weight", Split::Rows),
        ];
        for (name, want) in cases {
            assert_eq!(split_of(a, name), want, "{name}");
        }
        // a member's c_attn columns are its heads in each of Q, K and V
        let b = held_regions(a, "transformer.h.0.attn.c_attn.weight", &[32, 96], 2, 1);
        assert_eq!(
            b.iter()
                .map(|r| (r[0].clone(), r[1].clone()))
                .collect::<Vec<_>>(),
            vec![(0..32, 16..32), (0..32, 48..64), (0..32, 80..96)]
        );
        assert!(check_tp(a, 32, 67, 128, 2).is_ok());
        assert!(check_tp(a, 32, 67, 128, 3)
            .unwrap_err()
            .contains("n_head = 4"));
    }

    #[test]
    fn mlp_layers_pair_column_then_row_and_an_odd_last_one_stays_whole() {
        let a = Arch::Mlp { layers: 3 };
        assert_eq!(split_of(a, "l0.weight"), Split::Rows);
        assert_eq!(split_of(a, "l0.bias"), Split::Rows);
        assert_eq!(split_of(a, "l1.weight"), Split::Cols);
        assert_eq!(split_of(a, "l1.bias"), Split::Replicated);
        assert_eq!(split_of(a, "l2.weight"), Split::Replicated);
        assert_eq!(split_of(a, "out.weight"), Split::Replicated);
        assert_eq!(mlp_role(3, 0), (true, false));
        assert_eq!(mlp_role(3, 1), (false, true));
        assert_eq!(mlp_role(3, 2), (false, false));
    }

    /// The members' boxes of every split tensor tile it exactly, for every tp that fits.
    #[test]
    fn members_boxes_tile_each_tensor_exactly_once() {
        let shapes: [(&str, Vec<u64>); 5] = [
            ("h0.qkv.weight", vec![96, 32]),
            ("h0.qkv.bias", vec![96]),
            ("h0.proj.weight", vec![32, 32]),
            ("tok.weight", vec![67, 32]), // a vocabulary no tp divides
            ("ln_f.weight", vec![32]),
        ];
        for tp in 1..=4u32 {
            for (name, shape) in &shapes {
                let total: u64 = shape.iter().product();
                let boxes: Vec<Region> = (0..tp)
                    .flat_map(|r| held_regions(GPT, name, shape, tp, r))
                    .collect();
                let covered: u64 = boxes.iter().map(|b| volume(b)).sum();
                let replicated = split_of(GPT, name) == Split::Replicated;
                let want = if replicated { total * tp as u64 } else { total };
                assert_eq!(covered, want, "{name} tp {tp}");
                // no two members' boxes of a split tensor overlap
                if !replicated {
                    let mut cells = std::collections::BTreeSet::new();
                    for b in &boxes {
                        let r0 = b[0].clone();
                        let r1 = b.get(1).cloned().unwrap_or(0..1);
                        for i in r0 {
                            for j in r1.clone() {
                                assert!(cells.insert((i, j)), "{name} tp {tp}: ({i},{j}) twice");
                            }
                        }
                    }
                }
            }
        }
        // a member's QKV rows are its heads in each of Q, K and V
        let b = held_regions(GPT, "h0.qkv.weight", &[96, 32], 2, 1);
        assert_eq!(
            b.iter().map(|r| r[0].clone()).collect::<Vec<_>>(),
            vec![16..32, 48..64, 80..96]
        );
    }

    #[test]
    fn tp_that_cannot_split_the_model_is_refused_naming_why() {
        assert!(check_tp(GPT, 32, 64, 128, 2).is_ok());
        let e = check_tp(GPT, 32, 64, 128, 3).unwrap_err();
        assert!(e.contains("n_head = 4"), "{e}");
        assert!(check_tp(GPT, 32, 67, 128, 4).is_ok(), "no padding needed");
        let e = check_tp(Arch::Mlp { layers: 1 }, 0, 0, 64, 2).unwrap_err();
        assert!(e.contains("no column/row pair"), "{e}");
    }
}

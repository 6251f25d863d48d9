//! The closed choices of a job spec (strategy, model, optimizer, communicator, schedule, sync
//! mode, DiLoCo's quantization) as enums. On the wire they stay the strings users write; an
//! unknown string is refused when the spec is read, naming the field and the known values.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ClusterError;

/// `value` of `field` is none of `known`.
fn unknown(field: &str, value: &str, known: &[&str]) -> ClusterError {
    let list = known
        .iter()
        .map(|k| format!("{k:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    ClusterError::invalid(field, format!("{value:?} is unknown (known: {list})"))
}

macro_rules! named {
    (
        $(#[doc = $doc:literal])*
        $name:ident in $field:literal, default $d:ident {
            $($(#[$vm:meta])* $v:ident = $s:literal,)+
        }
    ) => {
        $(#[doc = $doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub enum $name {
            $($(#[$vm])* $v,)+
        }

        impl $name {
            /// The string a spec writes.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$v => $s,)+
                }
            }
        }

        impl schemars::JsonSchema for $name {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($name).into()
            }
            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                let doc: &[&str] = &[$($doc),*];
                let description = doc.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" ");
                schemars::json_schema!({
                    "type": "string",
                    "enum": [$($s),+],
                    "description": description,
                })
            }
        }

        impl Default for $name {
            fn default() -> Self {
                $name::$d
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.pad(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = ClusterError;
            fn from_str(s: &str) -> Result<Self, ClusterError> {
                match s {
                    $($s => Ok($name::$v),)+
                    _ => Err(unknown($field, s, &[$($s),+])),
                }
            }
        }

        impl TryFrom<String> for $name {
            type Error = ClusterError;
            fn try_from(s: String) -> Result<Self, ClusterError> {
                s.parse()
            }
        }

        impl From<$name> for String {
            fn from(v: $name) -> String {
                v.as_str().to_string()
            }
        }
    };
}

named! {
    /// How a job's world is laid out: data parallel only, pipeline stages, stages and tensor
    /// groups, or the planner's choice.
    Strategy in "training.strategy", default DataParallel {
        DataParallel = "data-parallel",
        Pipeline = "pipeline",
        Hybrid = "hybrid",
        Auto = "auto",
    }
}

impl Strategy {
    /// Whether the planner may cut the job into pipeline stages.
    pub fn pipelined(self) -> bool {
        self != Strategy::DataParallel
    }

    /// Whether the planner may split layers over tensor groups.
    pub fn tensor_split(self) -> bool {
        matches!(self, Strategy::Hybrid | Strategy::Auto)
    }
}

named! {
    /// What a job's workers run: ductile's own trainer (`ductile-worker`), the job's own
    /// program under torchrun's worker contract, restarted at every generation, the job's
    /// own TorchFT program in replica groups that live through the others' failures, or the
    /// job's own TensorFlow program (`tf.distribute`'s `TF_CONFIG`), or the job's own Horovod
    /// program (what `horovodrun`'s gloo launcher gives it), each restarted at every
    /// generation as a torchrun program is.
    Runtime in "runtime", default Ductile {
        Ductile = "ductile",
        Torchrun = "torchrun",
        Torchft = "torchft",
        Tf = "tf",
        Horovod = "horovod",
    }
}

impl Runtime {
    pub fn is_ductile(&self) -> bool {
        *self == Runtime::Ductile
    }

    /// The job runs its own program under `ductile-worker launch` (torchrun, torchft, tf or
    /// horovod).
    pub fn runs_program(&self) -> bool {
        matches!(
            self,
            Runtime::Torchrun | Runtime::Torchft | Runtime::Tf | Runtime::Horovod
        )
    }
}

named! {
    /// The built-in models, or a Hugging Face-format directory (`model_path`).
    ModelKind in "training.model", default Gpt {
        Gpt = "gpt",
        Mlp = "mlp",
        Hf = "hf",
    }
}

named! {
    /// Where a Hugging Face model's weights start: its directory's, or seeded random weights of
    /// its `config.json`'s architecture.
    Init in "training.init", default Pretrained {
        Pretrained = "pretrained",
        Random = "random",
    }
}

impl Init {
    pub fn is_pretrained(&self) -> bool {
        *self == Init::Pretrained
    }
}

named! {
    /// The optimizers (written out so their state is plain tensors).
    OptimizerKind in "training.optimizer", default Adamw {
        Adamw = "adamw",
        Sgd = "sgd",
    }
}

impl OptimizerKind {
    /// State tensors per parameter.
    pub fn states(self) -> u32 {
        match self {
            OptimizerKind::Sgd => 1,
            OptimizerKind::Adamw => 2,
        }
    }
}

named! {
    /// The shape of the learning rate's decay after the warm-up (`training.lr_schedule.decay`):
    /// to `min_lr` at `max_steps` by a half cosine, a line or one minus a square root; none; or
    /// warmup-stable-decay (the peak held, then the last `decay_steps` decayed).
    Decay in "training.lr_schedule.decay", default Cosine {
        Cosine = "cosine",
        Linear = "linear",
        Sqrt = "sqrt",
        Constant = "constant",
        Wsd = "wsd",
    }
}

named! {
    /// The shape of a warmup-stable-decay schedule's last steps
    /// (`training.lr_schedule.wsd_decay`).
    WsdDecay in "training.lr_schedule.wsd_decay", default Linear {
        Linear = "linear",
        Cosine = "cosine",
        Sqrt = "sqrt",
    }
}

named! {
    /// How the data-parallel ranks share the training state (`training.sharding`): each
    /// parameter's optimizer state cut by rows over a shard group (`optimizer`, ZeRO-1), its
    /// summed gradient too (`gradients`, ZeRO-2), its parameters as well (`full`, ZeRO-3 /
    /// FSDP), or whole on every rank (`none`); `auto` is made one of them at submit: the least
    /// that fits the slots' memory (`TrainingSpec::resolve_auto_sharding`).
    Sharding in "training.sharding", default None {
        None = "none",
        Optimizer = "optimizer",
        Gradients = "gradients",
        Full = "full",
        Auto = "auto",
    }
}

impl Sharding {
    /// The concrete levels, least sharding first (what `auto` chooses among, and what `dctl
    /// plan` lists).
    pub const LEVELS: [Sharding; 4] = [
        Sharding::None,
        Sharding::Optimizer,
        Sharding::Gradients,
        Sharding::Full,
    ];

    pub fn is_sharded(self) -> bool {
        self != Sharding::None
    }

    /// For serde's `skip_serializing_if`.
    pub fn is_none(&self) -> bool {
        *self == Sharding::None
    }
}

named! {
    /// The communicator a job asks for: NCCL where every member has a GPU of its own
    /// (`auto`), or one of them always.
    CommChoice in "training.comm", default Auto {
        Auto = "auto",
        Nccl = "nccl",
        Tcp = "tcp",
    }
}

named! {
    /// What the model's matrix products compute in: `"fp32"`, or `"bf16"` (operands cast to
    /// bfloat16, as PyTorch's autocast does; the weights, their gradients, the optimizer state,
    /// the residual stream, the norms and the loss stay f32).
    Precision in "training.precision", default Fp32 {
        Fp32 = "fp32",
        Bf16 = "bf16",
    }
}

named! {
    /// Recomputing activations in the backward pass: `"none"` keeps what every block's
    /// backward needs; `"full"` keeps only each transformer block's input and runs the block
    /// again in the backward (about a third more compute, a block's activations held at once).
    ActivationCheckpointing in "training.activation_checkpointing", default Off {
        Off = "none",
        Full = "full",
    }
}

named! {
    /// The pipeline schedule.
    Schedule in "training.schedule", default OneFOneB {
        OneFOneB = "1f1b",
        Gpipe = "gpipe",
        Interleaved1F1B = "interleaved-1f1b",
    }
}

impl Schedule {
    /// Model chunks per stage: 2 for interleaved 1F1B (stage s holds chunks s and s + p of
    /// the 2p contiguous chunks), else 1.
    pub fn chunks_per_stage(self) -> u32 {
        match self {
            Schedule::Interleaved1F1B => 2,
            _ => 1,
        }
    }
}

named! {
    /// How the replicas combine their work.
    SyncMode in "training.sync", default Allreduce {
        /// A synchronous all-reduce of the gradient every step.
        Allreduce = "allreduce",
        /// Local steps, then an outer step on the averaged pseudo-gradient.
        Diloco = "diloco",
        /// Bounded-staleness asynchronous updates.
        Async = "async",
    }
}

named! {
    /// DiLoCo's pseudo-gradient exchange.
    Quantize in "training.diloco.quantize", default None {
        None = "none",
        Fp16 = "fp16",
        Int8 = "int8",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_read_and_write_the_strings_of_a_spec_and_refuse_others_by_name() {
        for s in ["data-parallel", "pipeline", "hybrid", "auto"] {
            let v: Strategy = serde_json::from_value(serde_json::json!(s)).unwrap();
            assert_eq!(serde_json::to_value(v).unwrap(), serde_json::json!(s));
        }
        assert_eq!(
            "interleaved-1f1b".parse::<Schedule>().unwrap(),
            Schedule::Interleaved1F1B
        );
        let e = serde_json::from_value::<SyncMode>(serde_json::json!("gossip"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(r#"invalid training.sync: "gossip" is unknown (known: "allreduce", "diloco", "async")"#),
            "{e}"
        );
    }
}

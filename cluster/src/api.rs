//! Wire types of the daemon's HTTP API (`/v1/...`), shared by `ductiled` and `dctl`. These are
//! the `--json` output of `dctl`: add fields freely, never rename or remove one.

use serde::{Deserialize, Serialize};

use crate::records::{Device, JobState, Reason};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemberView {
    pub node: String,
    pub slot: u32,
    pub rank: u32,
    /// The worker's process id on its node, once its agent reported it.
    pub pid: Option<u32>,
    /// A torchrun job's program (the script its launcher `pid` runs in this generation), once
    /// it started: what torchrun calls the worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program_pid: Option<u32>,
    /// Coordinates in the generation's layout.
    #[serde(default)]
    pub dp_rank: u32,
    #[serde(default)]
    pub pp_stage: u32,
    #[serde(default)]
    pub tp_rank: u32,
    /// The model units its stage holds, `[first, end)` (its first chunk with
    /// `interleaved-1f1b`); absent for a data-parallel job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_units: Option<[u32; 2]>,
    /// Every chunk of units its stage holds, `[first, end)` each (two with
    /// `interleaved-1f1b`); empty for a data-parallel job.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stage_chunks: Vec<[u32; 2]>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub spare: bool,
    /// `runtime = "torchft"`: its replica group (`REPLICA_GROUP_ID`) and the generation the
    /// group's programs started in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_group: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_since: Option<u64>,
    /// Its mean wall time per step and compute time per step (ms) over its last report, in
    /// the current generation: a straggler computes longer than its peers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_ms: Option<f64>,
    /// Its mean wait for data per step (ms), over the same report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_ms: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReformationView {
    pub generation: u64,
    pub reason: Reason,
    pub detail: String,
    pub seconds: f64,
    /// From the triggering event to the new generation's first progress report (training
    /// going again), once the leader saw one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_step_seconds: Option<f64>,
}

/// `dctl status JOB --json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobView {
    pub job: String,
    pub state: JobState,
    pub generation: u64,
    pub world_size: u32,
    /// The current generation's layout (`dp × pp × tp`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<crate::records::Layout>,
    /// Its stage boundaries in model units (empty: one stage).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stage_boundaries: Vec<u32>,
    pub members: Vec<MemberView>,
    pub step: u64,
    /// When the latest progress report was written (unix ms); None: none yet (a script that
    /// does not call `ductile.report` never reports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_at_ms: Option<u64>,
    pub loss: Option<f64>,
    pub samples_per_sec: Option<f64>,
    pub last_reformation: Option<ReformationView>,
    pub min: u32,
    pub max: u32,
    pub desired: u32,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_weights_sha256: Option<String>,
    /// How the replicas combine their work (the spec's `training.sync`; absent without
    /// `[training]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync: Option<String>,
    /// DiLoCo: rounds committed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round: Option<u64>,
    /// Bytes the workers sent each other per committed sample (current generation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_per_sample: Option<f64>,
    /// The latest eval loss (the eval split's first `eval_samples` samples; without a split,
    /// the final weights' on the dataset's first 256) and the step it was computed at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_step: Option<u64>,
    /// The global gradient norm of the last reported step, before clipping (jobs with
    /// `max_grad_norm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// The learning rate of the last reported step (the recipe's rate of that step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// How the data-parallel ranks share the training state (`training.sharding`; `"auto"`
    /// made concrete at submit); absent when every rank holds it whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharding: Option<crate::modes::Sharding>,
    /// The recipe, resolved (ductile's own trainer): the optimizer's settings and the
    /// learning-rate schedule, every default filled in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recipe: Option<crate::recipe::Recipe>,
    /// Async: the staleness of the updates applied (mean, max), the updates dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness_mean: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness_max: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropped_updates: Option<u64>,
    /// `runtime = "torchft"`: the last quorum the lighthouse issued in the job's room.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torchft: Option<TorchftQuorumView>,
    /// The last checkpoint: the latest commit of ductile's trainer, or a program's last
    /// `ductile.saved(step)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_checkpoint: Option<LastCheckpointView>,
}

/// `dctl status`/`watch`: the last checkpoint of a job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastCheckpointView {
    pub step: u64,
    /// When it was committed (or the program said it saved), unix ms.
    pub at_ms: u64,
    /// `commit` (ductile's trainer: committed in etcd, restorable at any layout) or `program`
    /// (the program's own save, as it reported it).
    pub kind: String,
    /// A commit's bytes (every shard) and the world size that wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u32>,
}

/// A torchft job's last quorum (`dctl status`): who is in it, at what step, who heals from whom.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TorchftQuorumView {
    pub quorum_id: i64,
    pub created_ms: u64,
    /// The ductiled replica that issued it, and why it formed.
    pub issued_by: String,
    pub reason: String,
    pub members: Vec<TorchftMemberView>,
    /// The members behind the quorum's highest step, each with the member it heals from (as
    /// TorchFT's managers assign it for their group rank 0).
    pub healing: Vec<TorchftHealView>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TorchftMemberView {
    pub replica_id: String,
    pub step: i64,
    pub world_size: u64,
    pub address: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TorchftHealView {
    pub replica_id: String,
    pub from: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeWorkerView {
    pub job: String,
    pub slot: u32,
    pub rank: u32,
}

/// `dctl nodes --json` (one per node).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    pub name: String,
    pub hostname: String,
    pub slots: u32,
    pub devices: Vec<Device>,
    pub draining: bool,
    pub drain_reason: Option<String>,
    pub agent_pid: u32,
    pub reregistrations: u32,
    pub workers: Vec<NodeWorkerView>,
    /// How the agent contains programs' processes (`cgroup DIR` or `subreaper`).
    #[serde(default)]
    pub containment: Option<String>,
    /// Slots no program may start on, and why (a previous program's processes did not die).
    #[serde(default)]
    pub busy_slots: std::collections::BTreeMap<u32, String>,
    /// The last preemption notice of the node's cloud (`spot_notice`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preemption: Option<crate::records::PreemptionNotice>,
    /// Running jobs the agent's current policy refuses (they keep running), and why.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub refused_running: std::collections::BTreeMap<String, String>,
}

/// Body of `POST /v1/jobs/{job}/scale`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ScaleRequest {
    pub size: u32,
}

/// Body of `POST /v1/nodes/{node}/drain`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DrainBody {
    #[serde(default)]
    pub reason: Option<String>,
}

/// Every error the API returns.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ApiErrorBody {
    pub error: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

/// `GET /v1/jobs/{job}/series?from=STEP&every=N`: the job's chart history from step `from`,
/// at most one point per `every` steps, with every generation as a marker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SeriesView {
    pub job: String,
    pub points: Vec<crate::series::Point>,
    pub marks: Vec<crate::series::Mark>,
    /// Points the stored series holds (before `from` and `every`).
    pub stored_points: usize,
    /// `runtime = "torchft"`: the job's quorums, oldest first (the lighthouse keeps the last 256).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quorums: Vec<crate::series::QuorumMark>,
}

/// `GET /v1/jobs/{job}/logs` (`dctl logs`): what one slot's processes wrote, as its agent keeps
/// it (`LOG_DIR/JOB/slot-S.log`: a `=== generation G rank R pid P ===` mark opens each
/// generation the slot served; every other line `DATE TIME STREAM LINE`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LogView {
    pub job: String,
    pub node: String,
    pub slot: u32,
    /// The rank asked for (none when the request named the node and slot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    /// The generation the rank was looked up in (0 when the request named the node and slot).
    pub generation: u64,
    pub text: String,
    /// Where a follow-up (`offset=`, with this `node` and `slot`) starts.
    pub offset: u64,
    /// Older lines were left out (an answer holds at most 512 KiB).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// The file on the node.
    pub file: String,
}

//! Bounded fuzzing (proptest, in CI): what ductile decodes from users and from etcd must give
//! an error, never a panic. Inputs are random edits of valid documents (so most of them get
//! deep into the parsers) and random bytes; every spec that parses then goes through the
//! submit-time checks, the planner at every allowed size, and an agent's policy.

use ductile_cluster::fuzz::mutate;
use ductile_cluster::records::*;
use proptest::prelude::*;

/// A spec that exercises every section the parser knows.
const SPEC: &str = r#"name = "fuzz"
min = 1
max = 6
desired = 4
command = ["ductile-worker"]
env = { A = "b" }
[training]
strategy = "pipeline"
model = "gpt"
model_config = { n_layer = 4, d_model = 32, n_head = 4, ctx = 16, vocab = 64 }
dataset = "file:///var/lib/ductile/t.bin"
global_batch = 16
max_steps = 100
optimizer = "adamw"
lr = 0.001
seed = 7
deterministic = true
logical_shards = 8
pipeline_parallel = "auto"
pipeline_micro_batches = 4
schedule = "interleaved-1f1b"
memory_per_slot_gib = 4.0
[checkpoint]
url = "s3://bucket/ckpt"
interval = 50
"#;

const GENERATION: &str = r#"{"job":"j","number":3,"world_size":4,"desired":4,"members":[{"node":"n","slot":0,"rank":0,"dp_rank":0,"pp_stage":1,"tp_rank":0}],"reason":"scale","detail":"d","triggered_at_ms":1,"published_at_ms":1,"resume_step":0,"state_source":"peers","layout":{"data_parallel":2,"pipeline_parallel":2,"tensor_parallel":1},"stage_boundaries":[0,2,4,6,8]}"#;
const COMMIT: &str = r#"{"step":10,"generation":2,"manifest":"step-000000000010/g2/manifest.json","manifest_crc32c":7,"bytes":100,"world_size":4,"layout":{"data_parallel":4,"pipeline_parallel":1,"tensor_parallel":1},"committed_at_ms":5}"#;

/// The unedited documents are valid, so the edits start from something the parsers accept.
#[test]
fn the_seed_documents_parse() {
    let spec = JobSpec::from_toml(SPEC).unwrap();
    ductile_strategies::pipeline::check_job(&spec).unwrap();
    let g: Generation = serde_json::from_str(GENERATION).unwrap();
    assert_eq!(g.stage_chunks(1, 8), vec![2..4, 6..8]);
    serde_json::from_str::<CheckpointRecord>(COMMIT).unwrap();
}

/// Everything a daemon and an agent do with a spec that parsed.
fn exercise(spec: &JobSpec) {
    let _ = ductile_strategies::pipeline::check_job(spec);
    let _ = AgentPolicy::default().check(spec);
    if let Some(t) = &spec.training {
        for world in spec.min.max(1)..=spec.max.min(16) {
            let _ = ductile_strategies::pipeline::plan(t, world);
        }
    }
}

fn edits() -> impl proptest::strategy::Strategy<Value = Vec<(usize, u8, u8)>> {
    prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 0..12)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn job_specs_in_toml_never_panic(e in edits()) {
        let text = String::from_utf8_lossy(&mutate(SPEC.as_bytes(), &e)).into_owned();
        if let Ok(spec) = JobSpec::from_toml(&text) {
            exercise(&spec);
        }
    }

    #[test]
    fn job_specs_in_json_never_panic(e in edits()) {
        let json = serde_json::to_vec(&JobSpec::from_toml(SPEC).unwrap()).unwrap();
        if let Ok(spec) = JobSpec::from_json(&mutate(&json, &e)) {
            exercise(&spec);
        }
    }

    #[test]
    fn random_bytes_are_no_spec(b in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = JobSpec::from_json(&b);
        let _ = JobSpec::from_toml(&String::from_utf8_lossy(&b));
    }

    /// Records read from etcd: a generation, a node, a checkpoint commit, a mesh key and a
    /// join record, edited; what the workers compute from a generation does not panic either.
    #[test]
    fn records_from_etcd_never_panic(e in edits(), stage in 0u32..8, units in 0u32..64) {
        if let Ok(g) = serde_json::from_slice::<Generation>(&mutate(GENERATION.as_bytes(), &e)) {
            let _ = g.stage_chunks(stage, units);
        }
        let n = serde_json::to_vec(&NodeRecord::new("n", "h", Vec::new(), 1)).unwrap();
        let _ = serde_json::from_slice::<NodeRecord>(&mutate(&n, &e));
        let k = serde_json::to_vec(&MeshKey::fresh(3)).unwrap();
        if let Ok(k) = serde_json::from_slice::<MeshKey>(&mutate(&k, &e)) {
            let _ = k.bytes();
        }
        let _ = serde_json::from_slice::<CheckpointRecord>(&mutate(COMMIT.as_bytes(), &e));
        let j = serde_json::to_vec(&JoinRecord::default()).unwrap();
        let _ = serde_json::from_slice::<JoinRecord>(&mutate(&j, &e));
    }
}

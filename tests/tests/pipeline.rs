//! Elastic pipeline parallelism: real etcd, daemon, agents and tch workers.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use ductile_cluster::records::{JobState, StateSource};
use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

/// A recipe of the job's own (issue 49): SGD with Nesterov's momentum and weight decay but on
/// the biases, a linear warm-up and decay to 0.
const RECIPE: &str = "optimizer = { name = \"sgd\", momentum = 0.8, nesterov = true, weight_decay = 1e-4, no_decay = [\"bias\"] }\nlr_schedule = { warmup_steps = 50, decay = \"linear\", min_lr = 0.0 }\n";

/// The pipeline promise end to end, with that recipe: a deterministic pipeline job (stages planned per world
/// size) survives a SIGKILLed stage worker (survivors keep their processes and get the lost
/// layers from the other replica, no checkpoint anywhere) and resizes 4 → 2 → 4 that change
/// the number of stages; every sample is used exactly once, every replica of a layer holds the
/// same bytes after the changes, and the final weights equal those of an uninterrupted
/// data-parallel run of the same spec at world 2, bit for bit.
#[test]
fn pipeline_survives_kills_and_resizes_exactly_once_and_bitwise_equal_to_data_parallel() {
    let ledger = TempDir::new("ledger");
    let c = ledger_cluster(&ledger);
    let data = synth(c.dir.path(), "regression", 4_000);
    let steps = 1500u64;
    let train = |name: &str, desired: u32, strategy: &str| {
        format!(
            "{}max_steps = {steps}\ndeterministic = true\nlogical_shards = 4\nstrategy = \"{strategy}\"\npipeline_parallel = \"auto\"\nmodel_config = {{ hidden = 256, layers = 3 }}\n{RECIPE}",
            training_toml(name, 1, 4, desired, "mlp", &data, "restart_budget = 50")
        )
    };
    // the plan is data: dctl plan shows it without changing anything
    c.submit(&train("pp", 4, "pipeline"));
    let plan: serde_json::Value =
        serde_json::from_str(&c.dctl_ok(&["plan", "pp", "--world", "4", "--json"])).unwrap();
    assert_eq!(plan["layout"]["pipeline_parallel"], 2, "{plan}");
    assert_eq!(plan["layout"]["data_parallel"], 2, "{plan}");
    assert_eq!(plan["boundaries"].as_array().unwrap().len(), 3, "{plan}");
    let human = c.dctl_ok(&["plan", "pp", "--world", "3"]);
    assert!(human.contains("layout      dp1×pp"), "{human}");
    // a world the job never has is refused at once (never planned: the search grows with the
    // world), and the daemon stays healthy
    let t0 = std::time::Instant::now();
    let (ok, _, err) = c.dctl(&["plan", "pp", "--world", "4000000000"]);
    assert!(!ok && err.contains("the job's max"), "{err}");
    assert!(t0.elapsed() < S(20), "{:?}", t0.elapsed());
    let (code, _) = http("GET", &format!("{}/healthz", c.endpoint()), &[], b"").unwrap();
    assert_eq!(code, 200);

    let v = c.wait_world("pp", 4, S(30));
    replicas_agree(&c, v.generation);
    let layout = v.layout.unwrap();
    assert_eq!((layout.data_parallel, layout.pipeline_parallel), (2, 2));
    let stages: BTreeSet<u32> = v.members.iter().map(|m| m.pp_stage).collect();
    assert_eq!(stages, BTreeSet::from([0, 1]));
    let table = c.dctl_ok(&["status", "pp"]);
    assert!(table.contains("dp2×pp2×tp1"), "{table}");
    let early = c.wait_step("pp", 1, S(90));
    c.wait_step("pp", 100, S(90));

    // SIGKILL a worker of stage 1: its layers live on in the other replica
    let victim = v
        .members
        .iter()
        .find(|m| m.pp_stage == 1 && m.dp_rank == 0)
        .unwrap()
        .clone();
    let (v3, g3) = kill_and_reform(&c, "pp", victim.pid.unwrap(), 3);
    assert!(g3.layout.pipeline_parallel > 1, "{g3:?}");
    let before: BTreeSet<u32> = v
        .members
        .iter()
        .filter(|m| m.rank != victim.rank)
        .map(|m| m.pid.unwrap())
        .collect();
    let after: BTreeSet<u32> = v3.members.iter().filter_map(|m| m.pid).collect();
    assert!(
        before.is_subset(&after) || before == after,
        "survivors keep their processes: {before:?} {after:?}"
    );
    // each stage holds its own layers and their optimizer state only: at dp1×pp3 the ranks'
    // holdings add up to one model, which the data-parallel run below holds on every rank
    let rt = tokio::runtime::Runtime::new().unwrap();
    let held: Vec<u64> = rt
        .block_on(c.joins("pp", g3.number, 3))
        .iter()
        .map(|j| j.state_bytes)
        .collect();
    let at = c.status("pp").step;
    let later = c.wait_step("pp", at + 100, S(90));
    assert!(
        later.loss.unwrap() < early.loss.unwrap(),
        "loss {} → {}",
        early.loss.unwrap(),
        later.loss.unwrap()
    );
    // the killed slot restarts and rejoins; then 4 → 3 → 2 → 4
    c.wait_world("pp", 4, S(60));
    c.wait_step("pp", c.status("pp").step + 50, S(90));
    c.dctl_ok(&["scale", "pp", "3"]);
    let v3 = c.wait_world("pp", 3, S(30));
    assert_eq!(v3.layout.unwrap().pipeline_parallel, 3);
    c.wait_step("pp", c.status("pp").step + 50, S(90));
    // 3 → 2 takes the last stage's only holder: it stays one generation as a spare and hands
    // its layers over (the job has no checkpoint to fall back on), then leaves
    let staying: BTreeSet<u32> = c.status("pp").members[..2]
        .iter()
        .map(|m| m.pid.unwrap())
        .collect();
    c.dctl_ok(&["scale", "pp", "2"]);
    let v2 = c.wait_world("pp", 2, S(90));
    assert_eq!(v2.layout.unwrap().pipeline_parallel, 2);
    let h = c.history("pp");
    let handover = h
        .iter()
        .find(|g| g.handover)
        .unwrap_or_else(|| panic!("no hand-over generation: {h:?}"));
    assert_eq!(handover.world_size, 3, "{handover:?}");
    assert!(handover.members[2].spare, "{handover:?}");
    assert!(handover.detail.contains("hand-over"), "{}", handover.detail);
    let last = h.last().unwrap();
    assert_eq!(
        (last.world_size, last.state_source, last.handover),
        (2, StateSource::Peers, false),
        "{last:?}"
    );
    let now: BTreeSet<u32> = v2.members.iter().filter_map(|m| m.pid).collect();
    assert_eq!(now, staying, "the members staying keep their processes");
    c.wait_step("pp", c.status("pp").step + 100, S(90));
    c.dctl_ok(&["scale", "pp", "4"]);
    let v4 = c.wait_world("pp", 4, S(60));
    // after the change every replica of a layer holds the same bytes
    replicas_agree(&c, v4.generation);

    let done = c.wait_done("pp", S(300));
    assert_eq!(done.step, steps);
    let h = c.history("pp");
    let pps: BTreeSet<u32> = h.iter().map(|g| g.layout.pipeline_parallel).collect();
    assert!(pps.len() >= 2, "the number of stages changed: {h:?}");

    // every step applied once, every sample used once per epoch (4,000 samples, 32 a step)
    let v = ductile_tests::ledger::violations(ledger.path(), steps, 4_000, 32);
    assert!(v.is_empty(), "{v:#?}");

    // the same spec, data parallel at a fixed world of 2, uninterrupted
    c.submit(&train("dp", 2, "data-parallel"));
    let reference = c.wait_done("dp", S(300));
    let g1 = c.history("dp")[0].clone();
    let whole = rt.block_on(c.joins("dp", g1.number, g1.world_size))[0].state_bytes;
    assert!(whole > 0);
    assert_eq!(g3.layout.data_parallel, 1, "{g3:?}");
    assert_eq!(held.iter().sum::<u64>(), whole, "{held:?} vs {whole}");
    assert!(held.iter().all(|b| *b < whole), "{held:?} vs {whole}");
    assert_eq!(
        done.final_weights_sha256.unwrap(),
        reference.final_weights_sha256.unwrap(),
        "the pipeline's final weights differ from the data-parallel run"
    );
}

/// `schedule = "interleaved-1f1b"` on the GPT (embeddings, 2 blocks, head: four chunks of one
/// unit): each stage holds two chunks of the model (stage s chunks s and s + p), activations
/// wrap from the last stage back to the first, stages that released the embeddings still
/// size their activations, and a kill and a resize later the weights equal an uninterrupted
/// data-parallel run's, bit for bit.
#[test]
fn pipeline_interleaved_holds_two_chunks_per_stage_and_stays_bitwise_equal_to_data_parallel() {
    let c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default().agents(2, 2)
    });
    let data = synth(c.dir.path(), "tokens", 50_000);
    let steps = 400u64;
    let job = |name: &str, desired: u32, strategy: &str| {
        format!(
            "{}max_steps = {steps}\ndeterministic = true\nlogical_shards = 4\nstrategy = \"{strategy}\"\npipeline_parallel = 2\nschedule = \"interleaved-1f1b\"\nmodel_config = {{ n_layer = 2 }}\n",
            training_toml(name, 1, 4, desired, "gpt", &data, "restart_budget = 20")
        )
    };
    c.submit(&job("il", 4, "pipeline"));
    let plan: serde_json::Value =
        serde_json::from_str(&c.dctl_ok(&["plan", "il", "--world", "2", "--json"])).unwrap();
    assert_eq!(plan["boundaries"].as_array().unwrap().len(), 5, "{plan}");
    assert_eq!(
        plan["stages"][0]["chunks"].as_array().unwrap().len(),
        2,
        "{plan}"
    );
    let v = c.wait_world("il", 4, S(30));
    let layout = v.layout.unwrap();
    assert_eq!((layout.data_parallel, layout.pipeline_parallel), (2, 2));
    for m in &v.members {
        assert_eq!(m.stage_chunks.len(), 2, "{m:?}");
        // stage s holds chunks s and s + 2 of the four
        assert_eq!(
            m.stage_chunks[0][0],
            v.members[m.pp_stage as usize].stage_chunks[0][0]
        );
    }
    let table = c.dctl_ok(&["status", "il"]);
    assert!(table.contains('+'), "two chunks per member: {table}");
    c.wait_step("il", 100, S(90));
    // a kill: the stage's other replica keeps its chunks; then down to 2
    unsafe { libc::kill(v.members[1].pid.unwrap() as i32, libc::SIGKILL) };
    c.wait_world("il", 3, S(30));
    c.wait_step("il", c.status("il").step + 50, S(90));
    c.dctl_ok(&["scale", "il", "2"]);
    c.wait_world("il", 2, S(60));
    let done = c.wait_done("il", S(300));
    assert_eq!(done.step, steps);
    let h = c.history("il");
    assert!(
        h.iter().all(|g| g.stage_boundaries.len() == 5),
        "every generation cut the model into 2 × 2 chunks: {h:?}"
    );
    c.submit(&job("dp", 2, "data-parallel"));
    let reference = c.wait_done("dp", S(300));
    assert_eq!(
        done.final_weights_sha256.unwrap(),
        reference.final_weights_sha256.unwrap(),
        "the interleaved pipeline's final weights differ from the data-parallel run"
    );
}

/// A pipeline checkpoint (each stage writes its own layers) restores as data parallel at
/// another size, and that job's checkpoint restores into a pipeline again; the restored runs
/// end where an uninterrupted data-parallel run of the same spec ends, bit for bit.
#[test]
fn pipeline_checkpoints_restore_as_data_parallel_at_another_size_and_back() {
    let c = Cluster::start(Spec::default().agents(2, 2));
    let data = synth(c.dir.path(), "regression", 2_000);
    let ckpt = TempDir::new("pp-ckpt");
    // (each job carries the run at the location on: checkpoint.resume_from names the jobs
    // whose commits it may restore)
    let job = |name: &str, url: &str, steps: u64, desired: u32, strategy: &str| {
        let lineage: Vec<String> = ["p1", "d1"]
            .iter()
            .filter(|j| **j != name)
            .map(|j| format!("{j:?}"))
            .collect();
        format!(
            "{}max_steps = {steps}\ndeterministic = true\nlogical_shards = 4\nstrategy = \"{strategy}\"\nmodel_config = {{ hidden = 64, layers = 3 }}\n[checkpoint]\nurl = \"{url}\"\ninterval = 50\nresume_from = [{}]\n",
            training_toml(name, 1, 4, desired, "mlp", &data, ""),
            lineage.join(", ")
        )
    };
    let url = format!("file://{}/a", ckpt.path().display());
    let steps = 3000;
    let stop_after = |name: &str, step: u64| {
        c.wait_step(name, step, S(120));
        c.dctl_ok(&["stop", name]);
        c.wait_for(S(30), "stopped", || {
            Some(c.status(name)).filter(|v| v.state == JobState::Stopped)
        });
    };
    // a pipeline at world 4 (dp2×pp2) commits some steps, then stops
    c.submit(&job("p1", &url, steps, 4, "pipeline"));
    let v = c.wait_world("p1", 4, S(30));
    assert_eq!(v.layout.unwrap().pipeline_parallel, 2);
    stop_after("p1", 200);
    // restored as data parallel at world 3, on for a while
    c.submit(&job("d1", &url, steps, 3, "data-parallel"));
    c.wait_world("d1", 3, S(30));
    let at = c.wait_step("d1", 1, S(60)).step;
    assert!(
        at >= 100,
        "the data-parallel job restored the pipeline's checkpoint (step {at})"
    );
    assert!(
        c.logs().contains("restored checkpoint step"),
        "a restore, not a fresh start"
    );
    // the restore's plan: every chunk read once, by one rank; each rank read a share and got
    // the rest of the model from its peers
    let rt = tokio::runtime::Runtime::new().unwrap();
    let g = c.history("d1")[0].number;
    let joins = rt.block_on(c.joins("d1", g, 3));
    assert!(
        joins
            .iter()
            .all(|j| j.received_bytes > 0 && j.received_bytes < j.state_bytes),
        "{joins:?}"
    );
    stop_after("d1", at + 150);
    // and that checkpoint into a pipeline at world 2, to the end
    c.submit(&job("p2", &url, steps, 2, "pipeline"));
    let v = c.wait_world("p2", 2, S(30));
    assert_eq!(v.layout.unwrap().pipeline_parallel, 2);
    let at2 = c.wait_step("p2", 1, S(60)).step;
    assert!(
        at2 >= at + 100,
        "the pipeline restored the data-parallel job's checkpoint (step {at2})"
    );
    // each stage read its own layers from the store, and only those: nothing passed between
    // the two stages, and each holds less than the whole model
    let g = c.history("p2")[0].number;
    let joins = rt.block_on(c.joins("p2", g, 2));
    assert!(
        joins
            .iter()
            .all(|j| j.received_bytes == 0 && j.state_bytes > 0),
        "{joins:?}"
    );
    let restored = c.wait_done("p2", S(180));
    // the reference: data parallel at world 2, no interruption
    let ref_url = format!("file://{}/ref", ckpt.path().display());
    c.submit(&job("r", &ref_url, steps, 2, "data-parallel"));
    let reference = c.wait_done("r", S(180));
    assert_eq!(
        restored.final_weights_sha256.unwrap(),
        reference.final_weights_sha256.unwrap()
    );
}

/// A pipeline job without `[checkpoint]` whose every worker dies at once cannot resume: its
/// layers went with them. It stops, saying why, rather than start again from the seed (the
/// docs/checkpoints.md: "never silently from the seed"), and fails once its restart budget is spent.
#[test]
fn pipeline_a_full_loss_without_a_checkpoint_stops_rather_than_restart_from_the_seed() {
    let c = Cluster::start(Spec::default().agents(1, 2));
    let data = synth(c.dir.path(), "regression", 4_000);
    c.submit(&format!(
        "{}max_steps = 1000000\nstrategy = \"pipeline\"\npipeline_parallel = 2\nmodel_config = {{ hidden = 64, layers = 3 }}\n",
        training_toml("nf", 2, 2, 2, "mlp", &data, "restart_budget = 2")
    ));
    let v = c.wait_step("nf", 20, S(120));
    let from_seed = |logs: &str| {
        logs.lines()
            .filter(|l| l.contains("joined generation") && l.contains("at step 0 ("))
            .count()
    };
    let before = from_seed(&c.logs());
    for m in &v.members {
        unsafe { libc::kill(m.pid.unwrap() as i32, libc::SIGKILL) };
    }
    let v = c.wait_for(S(180), "the job to fail, naming why", || {
        Some(c.status("nf")).filter(|v| v.state.is_terminal())
    });
    assert_eq!(v.state, JobState::Failed);
    assert!(
        v.message
            .contains("stopping rather than starting from the seed"),
        "{}",
        v.message
    );
    let logs = c.logs();
    assert_eq!(
        from_seed(&logs),
        before,
        "a worker started the job again from the seed:\n{logs}"
    );
}

#[test]
fn pipeline_bad_specs_are_refused_at_submit_naming_the_field() {
    let c = Cluster::start(Spec::default().agents(1, 2));
    let base = |extra: &str| {
        format!(
            "{}{extra}",
            training_toml("b", 1, 4, 2, "mlp", "file:///d", "")
        )
    };
    let cases = [
        (
            base("strategy = \"pipeline\"\npipeline_parallel = 9\nmodel_config = { layers = 3 }\n"),
            "invalid training.pipeline_parallel: 9 stages but the model has 4 units",
        ),
        (
            base("strategy = \"pipeline\"\npipeline_parallel = 3\npipeline_micro_batches = 2\nmodel_config = { layers = 3 }\n"),
            "invalid training.pipeline_micro_batches: 2 is below pipeline_parallel = 3",
        ),
        (
            base("strategy = \"pipeline\"\npipeline_parallel = 3\nmodel_config = { layers = 8 }\n")
                .replace("max = 4", "max = 2"),
            "no allowed world size",
        ),
        (
            base("strategy = \"pipeline\"\nschedule = \"zigzag\"\n"),
            "invalid training.schedule: \"zigzag\" is unknown",
        ),
        (
            base("strategy = \"pipeline\"\npipeline_parallel = \"many\"\n"),
            "neither \"auto\" nor a number",
        ),
        (
            base("strategy = \"data-parallel\"\ntensor_parallel = 2\n"),
            "invalid training.tensor_parallel: needs strategy = \"hybrid\" or \"auto\"",
        ),
        (
            base("strategy = \"auto\"\nmemory_per_slot_gib = 0.000001\n"),
            "GiB",
        ),
        (
            base("strategy = \"pipeline\"\npipeline_parallel = 2\npipeline_micro_batches = 3\nschedule = \"interleaved-1f1b\"\nmodel_config = { layers = 3 }\n"),
            "invalid training.pipeline_micro_batches: 3 is not a multiple of pipeline_parallel = 2",
        ),
        (
            base("strategy = \"pipeline\"\npipeline_parallel = 2\nschedule = \"interleaved-1f1b\"\nmodel_config = { layers = 2 }\n"),
            "invalid training.schedule: interleaved-1f1b cuts 2 stages into 4 chunks but the model has 3 units",
        ),
    ];
    assert_refused(&c, &cases);
}

/// The weights records of generation `g` (4 ranks, 2 stages): each rank holds one stage's
/// units, and the replicas of a stage hold the same bytes at the same step.
fn replicas_agree(c: &Cluster, g: u64) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ws = rt.block_on(c.weights("pp", g, 4));
    let mut by_units: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for w in &ws {
        let parts: Vec<&str> = w.split(':').collect();
        assert_eq!(parts.len(), 3, "{w}");
        by_units
            .entry(parts[2].to_string())
            .or_default()
            .insert(format!("{}:{}", parts[0], parts[1]));
    }
    assert_eq!(by_units.len(), 2, "generation {g}, two stages: {ws:?}");
    assert!(
        by_units.values().all(|s| s.len() == 1),
        "generation {g}, replicas differ: {ws:?}"
    );
}

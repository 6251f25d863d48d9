//! Elastic tensor parallelism (Megatron-style splits) in hybrid layouts: real etcd, daemon,
//! agents and tch workers.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use ductile_cluster::modes::Sharding;
use ductile_cluster::records::{JobSpec, StateSource};
use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

/// A GPT job with `tensor_parallel = 2` at dp2×tp2 keeps training through a SIGKILLed worker
/// (the survivors re-plan to dp1×tp2 with a spare and move the slices among themselves: no
/// process restarts, no checkpoint) and through resizes 4 → 2 → 4; after each change the
/// replicas of each slice hold the same bytes, the loss falls, and the ledger shows every
/// sample used exactly once per epoch. Its gradients are clipped by global norm
/// (`max_grad_norm`), the norm over both slices on every rank.
#[test]
fn tensor_parallel_survives_a_kill_and_resizes_and_replicas_of_each_slice_agree() {
    let ledger = TempDir::new("tp-ledger");
    let c = ledger_cluster(&ledger);
    // specs the planner cannot place are refused at submit, naming the field
    let refused = [
        (
            "strategy = \"hybrid\"\ntensor_parallel = 3\n",
            "invalid training.tensor_parallel: n_head = 4 does not split into tensor_parallel = 3",
        ),
        (
            "strategy = \"hybrid\"\ntensor_parallel = 2\ndeterministic = true\n",
            "invalid training.tensor_parallel: with deterministic = true needs tensor_slices",
        ),
        (
            "strategy = \"hybrid\"\ntensor_parallel = 2\ndeterministic = true\ntensor_slices = 3\n",
            "invalid training.tensor_slices: 3 does not divide n_head = 4",
        ),
        (
            "strategy = \"hybrid\"\ntensor_parallel = 4\ndeterministic = true\ntensor_slices = 2\n",
            "invalid training.tensor_slices: 2 logical slices do not split over tensor_parallel = 4",
        ),
        (
            "strategy = \"hybrid\"\ntensor_parallel = 2\ntensor_slices = 2\n",
            "invalid training.tensor_slices: 2: logical slices need deterministic = true",
        ),
        (
            "strategy = \"pipeline\"\ntensor_parallel = 2\n",
            "invalid training.tensor_parallel: needs strategy",
        ),
    ];
    let cases: Vec<(String, &str)> = refused
        .iter()
        .map(|(extra, want)| {
            let base = training_toml("bad", 1, 4, 2, "gpt", "file:///d", "");
            (format!("{base}{extra}"), *want)
        })
        .collect();
    assert_refused(&c, &cases);

    let data = synth(c.dir.path(), "tokens", 50_000);
    // (the kill and the resizes end by about step 300)
    let steps = 400u64;
    c.submit(&format!(
        "{}max_steps = {steps}\nstrategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1\nmax_grad_norm = 1.0\n",
        training_toml("tp", 1, 4, 4, "gpt", &data, "restart_budget = 20")
    ));
    let plan: serde_json::Value =
        serde_json::from_str(&c.dctl_ok(&["plan", "tp", "--world", "3", "--json"])).unwrap();
    assert_eq!(plan["layout"]["tensor_parallel"], 2, "{plan}");
    assert_eq!(plan["layout"]["data_parallel"], 1, "{plan}");
    assert_eq!(plan["spares"], 1, "{plan}");

    let v = c.wait_world("tp", 4, S(30));
    let layout = v.layout.unwrap();
    assert_eq!(
        (
            layout.data_parallel,
            layout.pipeline_parallel,
            layout.tensor_parallel
        ),
        (2, 1, 2)
    );
    let coords: BTreeSet<(u32, u32)> = v.members.iter().map(|m| (m.dp_rank, m.tp_rank)).collect();
    assert_eq!(coords.len(), 4, "{:?}", v.members);
    let table = c.dctl_ok(&["status", "tp"]);
    assert!(table.contains("dp2×pp1×tp2"), "{table}");
    slices_agree(&c, v.generation, 4, 2);
    // each member holds its slices only: neither member of a tensor group holds (nearly) all
    // of what the two hold together
    let rt = tokio::runtime::Runtime::new().unwrap();
    let joins = rt.block_on(c.joins("tp", v.generation, 4));
    let held = |r: u32| joins.iter().find(|j| j.rank == r).unwrap().state_bytes;
    for group in [[0, 1], [2, 3]] {
        let (a, b) = (held(group[0]), held(group[1]));
        assert!(a > 0 && b > 0);
        assert!(a.max(b) * 10 < (a + b) * 6, "slices of {a} and {b} bytes");
    }
    let early = c.wait_step("tp", 1, S(90));
    c.wait_step("tp", 60, S(90));

    // SIGKILL a worker: its slice lives on in the other replica
    let victim = v
        .members
        .iter()
        .find(|m| m.dp_rank == 0 && m.tp_rank == 1)
        .unwrap()
        .clone();
    let (v3, g3) = kill_and_reform(&c, "tp", victim.pid.unwrap(), 3);
    assert_eq!(
        (g3.layout.data_parallel, g3.layout.tensor_parallel),
        (1, 2),
        "{g3:?}"
    );
    let before: BTreeSet<u32> = v
        .members
        .iter()
        .filter(|m| m.rank != victim.rank)
        .map(|m| m.pid.unwrap())
        .collect();
    let after: BTreeSet<u32> = v3.members.iter().filter_map(|m| m.pid).collect();
    assert!(
        before.is_subset(&after),
        "survivors keep their processes: {before:?} {after:?}"
    );
    let at = c.status("tp").step;
    assert_loss_fell(&early, &c.wait_step("tp", at + 60, S(90)));
    // the killed slot rejoins; then 4 → 2 → 4
    c.wait_world("tp", 4, S(60));
    c.wait_step("tp", c.status("tp").step + 40, S(90));
    c.dctl_ok(&["scale", "tp", "2"]);
    let v2 = c.wait_world("tp", 2, S(90));
    assert_eq!(v2.layout.unwrap().tensor_parallel, 2);
    c.wait_step("tp", c.status("tp").step + 40, S(90));
    c.dctl_ok(&["scale", "tp", "4"]);
    let v4 = c.wait_world("tp", 4, S(60));
    slices_agree(&c, v4.generation, 4, 2);

    let done = c.wait_done("tp", S(300));
    assert_eq!(done.step, steps);
    assert!(done.final_weights_sha256.is_some());
    // clipped by the norm over both slices (the replicas agreeing above: every rank clipped
    // by the same norm)
    assert!(
        done.grad_norm.is_some_and(|n| n.is_finite() && n > 0.0),
        "{:?}",
        done.grad_norm
    );
    let h = c.history("tp");
    assert!(h.iter().all(|g| g.layout.tensor_parallel == 2), "{h:?}");
    let dps: BTreeSet<u32> = h.iter().map(|g| g.layout.data_parallel).collect();
    assert!(dps.len() >= 2, "the replica count changed: {h:?}");
    let v = ductile_tests::ledger::violations(ledger.path(), steps, (50_000 - 1) / 32, 32);
    assert!(v.is_empty(), "{v:#?}");
}

/// The weights records of generation `g`: the members holding the same slice (the same
/// place in their tensor groups) hold the same bytes at the same step, and there are `tp`
/// slices.
fn slices_agree(c: &Cluster, g: u64, world: u32, tp: u32) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ws = rt.block_on(c.weights("tp", g, world));
    let mut by_slice: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for w in &ws {
        let parts: Vec<&str> = w.split(':').collect();
        assert_eq!(parts.len(), 3, "{w}");
        assert!(parts[2].contains('@'), "a slice: {w}");
        by_slice
            .entry(parts[2].to_string())
            .or_default()
            .insert(format!("{}:{}", parts[0], parts[1]));
    }
    assert_eq!(by_slice.len(), tp as usize, "generation {g}: {ws:?}");
    assert!(
        by_slice.values().all(|s| s.len() == 1),
        "generation {g}, replicas of a slice differ: {ws:?}"
    );
}

/// `"auto"` tensor and pipeline degrees on slots with room for about 8 MiB: the planner walks
/// the job through dp2×pp1×tp2 (4 ranks), dp1×pp3×tp1 (3), dp1×pp1×tp2 (2) and back as it is
/// resized, the state moving between slices and stages each time (hand-overs where a leaver
/// holds the only copy); every sample is used once. With room for half that, 4 ranks run
/// stages and tensor groups at once (dp1×pp2×tp2) and the loss falls.
#[test]
fn auto_layouts_walk_between_tensor_groups_and_stages_as_the_job_resizes() {
    let ledger = TempDir::new("tp-auto-ledger");
    let c = ledger_cluster(&ledger);
    let data = synth(c.dir.path(), "tokens", 30_000);
    let job = |name: &str, min: u32, steps: u64, gib: f64| {
        format!(
            "{}max_steps = {steps}\nstrategy = \"hybrid\"\ntensor_parallel = \"auto\"\npipeline_parallel = \"auto\"\nmemory_per_slot_gib = {gib}\nmodel_config = {{ d_model = 128, n_layer = 2, n_head = 4, ctx = 32, vocab = 256 }}\n",
            training_toml(name, min, 4, 4, "gpt", &data, "restart_budget = 20")
        )
    };
    let steps = 280u64;
    c.submit(&job("auto", 2, steps, 0.008));
    let layout_at = |world: u32| {
        let plan: serde_json::Value = serde_json::from_str(&c.dctl_ok(&[
            "plan",
            "auto",
            "--world",
            &world.to_string(),
            "--json",
        ]))
        .unwrap();
        let l = &plan["layout"];
        format!(
            "dp{}×pp{}×tp{}",
            l["data_parallel"], l["pipeline_parallel"], l["tensor_parallel"]
        )
    };
    assert_eq!(layout_at(4), "dp2×pp1×tp2");
    assert_eq!(layout_at(3), "dp1×pp3×tp1");
    assert_eq!(layout_at(2), "dp1×pp1×tp2");
    c.wait_world("auto", 4, S(30));
    c.wait_step("auto", 40, S(90));
    for world in [3u32, 2, 4] {
        c.dctl_ok(&["scale", "auto", &world.to_string()]);
        let v = c.wait_world("auto", world, S(90));
        let l = v.layout.unwrap();
        assert_eq!(l.to_string(), layout_at(world), "{:?}", c.history("auto"));
        c.wait_step("auto", c.status("auto").step + 40, S(90));
    }
    let done = c.wait_done("auto", S(300));
    assert_eq!(done.step, steps);
    let h = c.history("auto");
    let layouts: BTreeSet<String> = h.iter().map(|g| g.layout.to_string()).collect();
    assert!(layouts.len() >= 3, "{layouts:?}");
    assert!(
        h.iter().all(|g| g.state_source != StateSource::Checkpoint),
        "no checkpoint anywhere: {h:?}"
    );
    let v = ductile_tests::ledger::violations(ledger.path(), steps, (30_000 - 1) / 32, 32);
    assert!(v.is_empty(), "{v:#?}");

    // stages of tensor groups
    c.submit(&job("both", 4, 150, 0.004));
    let v = c.wait_world("both", 4, S(30));
    assert_eq!(v.layout.unwrap().to_string(), "dp1×pp2×tp2");
    let early = c.wait_step("both", 1, S(90));
    let done = c.wait_done("both", S(300));
    assert!(done.final_weights_sha256.is_some());
    assert_loss_fell(&early, &c.status("both"));
}

/// A checkpoint written by tensor groups on S3 (dp2×tp2: each member of replica 0 writes row
/// ranges of the logical tensors; column-split ones gathered over its group) restores into
/// another layout: a data-parallel job reads exactly the weights and optimizer state the
/// tensor-parallel job ended with (their final hashes, from the restored state), and a dp1×tp2
/// job restores them too.
#[test]
fn tensor_parallel_checkpoints_restore_into_other_layouts_bit_for_bit() {
    let c = Cluster::start(Spec {
        s3: true,
        ..Spec::default().agents(2, 2)
    });
    let data = synth(c.dir.path(), "tokens", 20_000);
    let url = format!("s3://{}/jobs/tp", c.s3.as_ref().unwrap().bucket);
    // (the later jobs carry tp's run on: checkpoint.resume_from lets them restore its
    // commits at their location)
    let job = |name: &str, desired: u32, extra: &str| {
        let adopt = match name {
            "tp" => "",
            "dp" => "resume_from = [\"tp\"]\n",
            _ => "resume_from = [\"tp\", \"dp\"]\n",
        };
        format!(
            "{}max_steps = 60\n{extra}\n[checkpoint]\nurl = \"{url}\"\ninterval = 60\n{adopt}",
            training_toml(name, 1, 4, desired, "gpt", &data, "")
        )
    };
    c.submit(&job(
        "tp",
        4,
        "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1",
    ));
    let v = c.wait_world("tp", 4, S(30));
    assert_eq!(v.layout.unwrap().to_string(), "dp2×pp1×tp2");
    let written = c.wait_done("tp", S(180)).final_weights_sha256.unwrap();
    // the commit at step 60 is the state the job ended with: a job that restores it is done
    // at once, and its final hash is over the restored weights
    c.submit(&job("dp", 3, "strategy = \"data-parallel\""));
    let restored = c.wait_done("dp", S(120));
    assert_eq!(restored.step, 60);
    assert!(c.logs().contains("restored checkpoint step 60"));
    assert_eq!(restored.final_weights_sha256.unwrap(), written);
    c.submit(&job(
        "tp3",
        3,
        "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1",
    ));
    let back = c.wait_done("tp3", S(120));
    assert_eq!(back.step, 60);
    assert_eq!(back.final_weights_sha256.unwrap(), written);
    assert_eq!(
        c.history("tp3")[0].layout.to_string(),
        "dp1×pp1×tp2",
        "restored into a tensor group"
    );
    // and the optimizer state: rank 0 of each job hashed all of it at the end
    let logs = c.logs();
    let opt = |job: &str| {
        logs.lines()
            .find(|l| l.contains("optimizer state sha256") && l.contains(&format!("job={job} ")))
            .and_then(|l| l.split("optimizer state sha256 ").nth(1))
            .map(|r| r.split_whitespace().next().unwrap_or("").to_string())
            .unwrap_or_else(|| panic!("no final line of job {job}"))
    };
    assert_eq!(opt("dp"), opt("tp"));
    assert_eq!(opt("tp3"), opt("tp"));
}

/// Deterministic mode with tensor groups (`tensor_slices = 2`: every split layer computed in
/// two logical slices, folded in slice order): a job at dp2×tp2 that loses a worker and is
/// resized 4 → 2 → 4, and one run as stages of tensor groups (dp1×pp2×tp2), end with the same
/// final weights, bit for bit, as the same spec run data parallel at a fixed world of 2; every
/// sample is used once.
#[test]
fn deterministic_tensor_parallelism_ends_bitwise_equal_to_data_parallel() {
    let ledger = TempDir::new("tp-det-ledger");
    let c = ledger_cluster(&ledger);
    let data = synth(c.dir.path(), "tokens", 30_000);
    let steps = 220u64;
    let job = |name: &str, desired: u32, extra: &str| {
        format!(
            "{}max_steps = {steps}\ndeterministic = true\nlogical_shards = 4\ntensor_slices = 2\n{extra}\nmodel_config = {{ d_model = 64, n_layer = 2, n_head = 4, ctx = 32 }}\n",
            training_toml(name, 1, 4, desired, "gpt", &data, "restart_budget = 20")
        )
    };
    c.submit(&job(
        "tp",
        4,
        "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1",
    ));
    let v = c.wait_world("tp", 4, S(30));
    assert_eq!(v.layout.unwrap().to_string(), "dp2×pp1×tp2");
    c.wait_step("tp", 60, S(90));
    let victim = v
        .members
        .iter()
        .find(|m| m.dp_rank == 0 && m.tp_rank == 1)
        .unwrap();
    kill_and_reform(&c, "tp", victim.pid.unwrap(), 3);
    c.wait_step("tp", c.status("tp").step + 40, S(90));
    c.wait_world("tp", 4, S(60));
    c.dctl_ok(&["scale", "tp", "2"]);
    c.wait_world("tp", 2, S(90));
    c.wait_step("tp", c.status("tp").step + 40, S(90));
    c.dctl_ok(&["scale", "tp", "4"]);
    c.wait_world("tp", 4, S(60));
    let done = c.wait_done("tp", S(300));
    let v = ductile_tests::ledger::violations(ledger.path(), steps, (30_000 - 1) / 32, 32);
    assert!(v.is_empty(), "{v:#?}");

    c.submit(&job(
        "both",
        4,
        "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 2",
    ));
    let v = c.wait_world("both", 4, S(30));
    assert_eq!(v.layout.unwrap().to_string(), "dp1×pp2×tp2");
    let both = c.wait_done("both", S(300));

    c.submit(&job("dp", 2, "strategy = \"data-parallel\""));
    let reference = c.wait_done("dp", S(300)).final_weights_sha256.unwrap();
    assert_eq!(
        done.final_weights_sha256.unwrap(),
        reference,
        "the tensor-parallel run's final weights differ from the data-parallel run"
    );
    assert_eq!(
        both.final_weights_sha256.unwrap(),
        reference,
        "the pipeline of tensor groups ends elsewhere than the data-parallel run"
    );
}

/// ZeRO-1 under stages and tensor groups (`sharding = "optimizer"` with `strategy = "hybrid"`):
/// each (stage, tensor place) shards its optimizer state over its replicas. A job at
/// dp2(shard2)×pp2×tp2 holds about half an unsharded rank's state; through a SIGKILL (the lost
/// shard read from the checkpoint), a scale to 4 (the leavers hand their shards over: the
/// state whole on each stage's one replica) and back to 8 (re-cut in place), it ends with the
/// weights and optimizer state of the unsharded data-parallel run, bit for bit; its last
/// checkpoint restores into another layout and shard size (dp3(shard3)×pp1×tp2) with the same
/// bits; stages alone end with them too, with `sharding = "auto"` sharded (dp2(shard2)×pp2×tp1)
/// where the slots hold only the sharded state and whole (dp2×pp2×tp1) where they hold all of
/// it; `sharding = "gradients"` at dp2(shard2)×pp2×tp2 (each replica receives its rows of the
/// summed gradient alone), through a scale to 4 and back, too; and so does `sharding = "full"`
/// there (3D: the parameters' rows too, gathered once a step; three quarters of ZeRO-1's state
/// per rank) through a SIGKILL and a scale to 4 and back. Every run clips its gradients
/// by global norm (`max_grad_norm`, acting at the last step): the norm over stages, tensor
/// slices and shards is the data-parallel run's, bit for bit.
#[test]
fn sharded_optimizer_state_under_stages_and_tensor_groups_gives_the_data_parallel_bits() {
    const MAX_NORM: f64 = 0.1;
    let c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default().agents(2, 4)
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let data = synth(c.dir.path(), "tokens", 30_000);
    // (each job's kill and resizes end by about step 120)
    let steps = 160u64;
    let job = |name: &str, desired: u32, extra: &str| {
        // (the last job carries z's run on: it restores z's last commit at z's location)
        let (adopt, at) = match name {
            "back" => ("resume_from = [\"z\"]\n", "z"),
            _ => ("", name),
        };
        format!(
            "{}max_steps = {steps}\ndeterministic = true\nlogical_shards = 8\ntensor_slices = 2\nmax_grad_norm = {MAX_NORM}\n{extra}\nmodel_config = {{ d_model = 64, n_layer = 2, n_head = 4, ctx = 32 }}\n[checkpoint]\nurl = \"file://{}/ck-{}\"\ninterval = 40\n{adopt}",
            training_toml(name, 1, 8, desired, "gpt", &data, "restart_budget = 50"),
            c.dir.path().display(),
            at
        )
    };
    c.submit(&job("dp", 2, "strategy = \"data-parallel\""));
    let dp_norm = c.wait_done("dp", S(300)).grad_norm;
    println!("the data-parallel run's last gradient norm: {dp_norm:?}");
    assert!(
        dp_norm.is_some_and(|n| n > MAX_NORM),
        "clipping at {MAX_NORM} acts on the last step: {dp_norm:?}"
    );
    let reference = final_hashes(&c, "dp");
    let g = c.history("dp")[0].clone();
    let whole = rt.block_on(c.joins("dp", g.number, g.world_size))[0].state_bytes;

    // its live moves in rounds of 1 KiB per pair of ranks (the default, 64 MiB, moves this
    // model in one)
    let hybrid = "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 2\nsharding = \"optimizer\"\ntransfer_chunk_kib = 1";
    c.submit(&job("z", 8, hybrid));
    let v = c.wait_world("z", 8, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp2(shard2)×pp2×tp2");
    let held = first_state_bytes(&c, &rt, "z");
    // a quarter of the parameters (a stage's tensor slice) and half of its two moments: an
    // eighth of the whole state and a bit (the replicated norms and biases)
    println!("state bytes per rank: unsharded data parallel {whole}, dp2(shard2)×pp2×tp2 {held:?}");
    assert!(held.iter().all(|b| *b * 4 < whole), "{held:?} vs {whole}");
    c.wait_step("z", 60, S(120));
    // the second replica's member at stage 0, tensor place 1: its shard has no other holder
    let victim = v
        .members
        .iter()
        .find(|m| m.dp_rank == 1 && m.pp_stage == 0 && m.tp_rank == 1)
        .unwrap();
    let before = c.history("z").last().unwrap().number;
    unsafe { libc::kill(victim.pid.unwrap() as i32, libc::SIGKILL) };
    let restored = c.wait_for(S(90), "the lost shard restored from the checkpoint", || {
        c.history("z")
            .into_iter()
            .find(|g| g.number > before && g.state_source == StateSource::Checkpoint)
    });
    assert!(
        restored
            .detail
            .contains("optimizer state shards 1 (stage 0, tensor slice 1 of 2) of 2"),
        "{restored:?}"
    );
    c.wait_world("z", 8, S(90));
    c.wait_step("z", c.status("z").step + 30, S(120));
    let before = c.history("z").last().unwrap().number;
    c.dctl_ok(&["scale", "z", "4"]);
    let v = c.wait_world("z", 4, S(90));
    assert_eq!(v.layout.unwrap().to_string(), "dp1×pp2×tp2");
    c.wait_step("z", c.status("z").step + 30, S(120));
    c.dctl_ok(&["scale", "z", "8"]);
    let v = c.wait_world("z", 8, S(90));
    assert_eq!(v.layout.unwrap().to_string(), "dp2(shard2)×pp2×tp2");
    // the re-cuts moved more than a chunk in many rounds: in each, at most 1 KiB (and its
    // header) from each of the 7 peers
    let moved: Vec<(u64, u64)> = c
        .agent_logs()
        .lines()
        .filter(|l| l.contains("tensor slices and shards in place") && l.contains("job=z"))
        .map(|l| {
            let field = |k: &str| -> u64 {
                let v = l
                    .split(&format!(" {k}="))
                    .nth(1)
                    .unwrap_or_else(|| panic!("{l}"));
                v.split(|ch: char| !ch.is_ascii_digit())
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap()
            };
            (field("bytes"), field("rounds"))
        })
        .collect();
    assert!(
        moved.iter().any(|(b, r)| *r > 1 && *b > 1024)
            && moved
                .iter()
                .all(|(b, r)| *b <= *r * 7 * (1024 + 24 + 8 * 256)),
        "bytes and rounds of each rank's moves: {moved:?}"
    );
    let z_norm = c.wait_done("z", S(300)).grad_norm;
    assert_eq!(
        z_norm, dp_norm,
        "the global norm over stages, tensor slices and shards is the data-parallel run's"
    );
    let h = c.history("z");
    assert!(
        h.iter()
            .filter(|g| g.number > before)
            .all(|g| g.state_source != StateSource::Checkpoint),
        "the resizes re-cut the shards in place: {h:#?}"
    );
    assert_eq!(
        final_hashes(&c, "z"),
        reference,
        "the sharded pipeline of tensor groups ends elsewhere than the data-parallel run"
    );

    // "gradients" over stages and tensor groups: each replica receives its rows of the
    // summed gradient alone (the last replica of the chain counts the norm on the whole sum),
    // through a resize to one replica per stage (nothing to shard) and back
    c.submit(&job(
        "zg",
        8,
        "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 2\nsharding = \"gradients\"",
    ));
    let v = c.wait_world("zg", 8, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp2(shard2)×pp2×tp2");
    c.wait_step("zg", 60, S(120));
    // a scale to one replica per stage (nothing to shard) and back, `steps` steps at 4; the
    // job ends with the data-parallel run's norm and bits
    let to_4_and_back = |job: &str, steps: u64| {
        c.dctl_ok(&["scale", job, "4"]);
        let v = c.wait_world(job, 4, S(90));
        assert_eq!(v.layout.unwrap().to_string(), "dp1×pp2×tp2");
        c.wait_step(job, c.status(job).step + steps, S(120));
        c.dctl_ok(&["scale", job, "8"]);
        c.wait_world(job, 8, S(90));
        assert_eq!(c.wait_done(job, S(300)).grad_norm, dp_norm);
        assert_eq!(
            final_hashes(&c, job),
            reference,
            "job {job} ends elsewhere than the data-parallel run"
        );
    };
    to_4_and_back("zg", 30);

    // "full" over stages and tensor groups (3D): between steps each replica holds its rows of
    // its stage's slices too (gathered once a step), through a kill (the lost rows from the
    // checkpoint) and a resize to one replica per stage and back
    c.submit(&job(
        "zf",
        8,
        "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 2\nsharding = \"full\"",
    ));
    let v = c.wait_world("zf", 8, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp2(shard2)×pp2×tp2");
    let full = first_state_bytes(&c, &rt, "zf");
    // half of a stage's slice and half of its two moments, where ZeRO-1 holds the whole
    // slice: three quarters of ZeRO-1's state at each place
    println!("state bytes per rank: 3D fully sharded {full:?}, ZeRO-1 {held:?}");
    assert!(
        full.iter().zip(&held).all(|(f, z)| *f * 100 <= z * 76),
        "{full:?} vs {held:?}"
    );
    c.wait_step("zf", 50, S(120));
    let before = c.history("zf").last().unwrap().number;
    unsafe { libc::kill(v.members[5].pid.unwrap() as i32, libc::SIGKILL) };
    c.wait_for(S(90), "the lost rows restored from the checkpoint", || {
        c.history("zf")
            .into_iter()
            .find(|g| g.number > before && g.state_source == StateSource::Checkpoint)
    });
    c.wait_world("zf", 8, S(90));
    c.wait_step("zf", c.status("zf").step + 20, S(120));
    to_4_and_back("zf", 20);

    // stages alone (tensor places of one): whole tensors' rows. With sharding = "auto" and
    // slots that hold the stages' sharded state but not their whole state, the planner
    // shards it (the figures are its own, for this job at 4 ranks)
    let staged = "strategy = \"pipeline\"\npipeline_parallel = 2";
    let most = |sharding: Sharding| {
        let mut t = JobSpec::from_toml(&job("pp", 4, staged))
            .unwrap()
            .training
            .unwrap();
        t.sharding = sharding;
        let p = ductile_strategies::pipeline::plan(&t, 4).unwrap();
        p.stages.iter().map(|s| s.memory_bytes).max().unwrap()
    };
    let (whole, sharded) = (most(Sharding::None), most(Sharding::Optimizer));
    assert!(sharded < whole, "{sharded} vs {whole}");
    let cap = sharded as f64 / (1u64 << 30) as f64;
    c.submit(&job(
        "pp",
        4,
        &format!("{staged}\nsharding = \"auto\"\nmemory_per_slot_gib = {cap}"),
    ));
    // dctl plan shows each level the job could run at 4: whole state refused (it does not
    // fit the slot), the optimizer state or the summed gradients sharded over the replicas,
    // and marks the planner's choice
    let plan: serde_json::Value =
        serde_json::from_str(&c.dctl_ok(&["plan", "pp", "--world", "4", "--json"])).unwrap();
    let levels = plan["sharding"].as_array().unwrap();
    let row = |k: usize| (levels[k]["sharding"].clone(), levels[k]["chosen"].clone());
    assert_eq!(row(0), ("none".into(), false.into()), "{plan}");
    assert!(
        levels[0]["memory_bytes"].is_null()
            && levels[0]["refused"]
                .as_str()
                .unwrap()
                .contains("a slot has"),
        "{plan}"
    );
    assert_eq!(row(1), ("optimizer".into(), true.into()), "{plan}");
    assert_eq!(levels[1]["layout"], "dp2(shard2)×pp2×tp1", "{plan}");
    assert_eq!(levels[1]["memory_bytes"], sharded, "{plan}");
    assert_eq!(row(2), ("gradients".into(), false.into()), "{plan}");
    let human = c.dctl_ok(&["plan", "pp", "--world", "4"]);
    assert!(
        human.contains("optimizer  dp2(shard2)×pp2×tp1") && human.contains("(this job)"),
        "{human}"
    );
    assert_eq!(c.wait_done("pp", S(300)).grad_norm, dp_norm);
    assert_eq!(c.history("pp")[0].layout.to_string(), "dp2(shard2)×pp2×tp1");
    assert_eq!(final_hashes(&c, "pp"), reference);
    // slots that hold the whole state: the same layout unsharded
    let cap = whole as f64 / (1u64 << 30) as f64;
    c.submit(&job(
        "roomy",
        4,
        &format!("{staged}\nsharding = \"auto\"\nmemory_per_slot_gib = {cap}"),
    ));
    c.wait_done("roomy", S(300));
    assert_eq!(c.history("roomy")[0].layout.to_string(), "dp2×pp2×tp1");
    assert_eq!(final_hashes(&c, "roomy"), reference);

    // a cold start at another layout and shard size reads z's last commit
    c.submit(&job(
        "back",
        6,
        "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1\nsharding = \"optimizer\"",
    ));
    let back = c.wait_done("back", S(120));
    assert_eq!(back.step, steps);
    assert_eq!(
        c.history("back")[0].layout.to_string(),
        "dp3(shard3)×pp1×tp2"
    );
    assert!(c
        .logs()
        .contains(&format!("restored checkpoint step {steps}")));
    assert_eq!(final_hashes(&c, "back"), reference);
}

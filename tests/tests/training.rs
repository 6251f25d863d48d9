//! Elastic data-parallel training: real etcd, daemon, agents and tch workers.

use std::collections::BTreeSet;
use std::time::Duration;

use ductile_cluster::api::JobView;
use ductile_cluster::records::{Generation, Reason, Sharding, StateSource};
use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

#[test]
fn training_a_killed_worker_leaves_survivors_training_in_place_and_the_loss_keeps_falling() {
    let c = Cluster::start(Spec::default().agents(2, 2));
    let data = synth(c.dir.path(), "tokens", 60_000);
    c.submit(&format!(
        "{}max_steps = 100000\n",
        training_toml("t1", 1, 4, 4, "gpt", &data, "restart_budget = 0")
    ));
    let v = c.wait_world("t1", 4, S(30));
    let early = c.wait_step("t1", 30, S(60));
    let victim = v.members.iter().find(|m| m.rank == 2).unwrap().clone();
    unsafe { libc::kill(victim.pid.unwrap() as i32, libc::SIGKILL) };
    let v3 = c.wait_world("t1", 3, S(15));
    let g = c.history("t1").into_iter().last().unwrap();
    assert_eq!(
        (g.reason, g.state_source),
        (Reason::Failure, StateSource::Peers),
        "no checkpoint: state comes from survivors"
    );
    let before: BTreeSet<u32> = v
        .members
        .iter()
        .filter(|m| m.rank != 2)
        .map(|m| m.pid.unwrap())
        .collect();
    let after: BTreeSet<u32> = v3.members.iter().map(|m| m.pid.unwrap()).collect();
    assert_eq!(before, after, "survivors keep their processes");
    let at_kill = c.status("t1").step;
    let later = c.wait_step("t1", at_kill + 150, S(60));
    assert_eq!(later.generation, v3.generation, "it trains on at world 3");
    // one batch's loss is noisy (by more than 0.1 between reports): wait, bounded, for a report 0.3 below the early one
    let early_loss = early.loss.unwrap();
    let fell = c.wait_for(S(90), "the loss to fall 0.3 below its early value", || {
        let s = c.status("t1");
        assert_eq!(s.generation, v3.generation, "it trains on at world 3");
        s.loss.filter(|l| *l < early_loss - 0.3)
    });
    println!("loss {early_loss} at step {} → {fell}", early.step);
}

#[test]
fn training_a_stopped_worker_is_excluded_in_seconds_and_rejoins_after_its_restart() {
    let c = Cluster::start(Spec {
        restart_backoff_ms: 500,
        ..Spec::default().agents(2, 2)
    });
    let data = synth(c.dir.path(), "tokens", 60_000);
    c.submit(&format!(
        "{}max_steps = 100000
",
        training_toml("t8", 1, 4, 4, "gpt", &data, "restart_budget = 3")
    ));
    let v = c.wait_world("t8", 4, S(30));
    c.wait_step("t8", 20, S(60));
    // alive but stuck: its sockets stay open, its heartbeats stop
    let victim = v.members.iter().find(|m| m.rank == 1).unwrap().clone();
    let pid = victim.pid.unwrap();
    let t0 = std::time::Instant::now();
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    let v3 = c.wait_world("t8", 3, S(40));
    let took = t0.elapsed();
    let g = c.history("t8").into_iter().last().unwrap();
    assert_eq!(g.reason, Reason::Failure);
    assert!(
        g.detail.contains(&format!(
            "worker {}/{} failed (excluded",
            victim.node, victim.slot
        )),
        "{}",
        g.detail
    );
    assert!(g.detail.contains("sent nothing"), "{}", g.detail);
    assert!(
        !v3.members.iter().any(|m| m.pid == Some(pid)),
        "the stopped worker is out"
    );
    println!("a SIGSTOPped worker was excluded after {took:?}");
    // its agent stops it (SIGKILL after the grace reaches a stopped process)
    c.wait_for(S(30), "the stopped worker killed", || {
        (!pid_alive(pid)).then_some(())
    });
    // the survivors train on, and the slot rejoins after its restart
    let at = c.status("t8").step;
    c.wait_step("t8", at + 10, S(60));
    let v4 = c.wait_world("t8", 4, S(60));
    assert!(v4
        .members
        .iter()
        .any(|m| m.node == victim.node && m.slot == victim.slot));
    c.wait_step("t8", c.status("t8").step + 10, S(60));
    // the failed generation's keys are gone once the job re-formed
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(c.store());
    let (faults, _) = rt
        .block_on(store.backend.list(&store.keys.all_faults("t8")))
        .unwrap();
    assert!(
        faults
            .iter()
            .all(|kv| !kv.key.contains(&format!("/{:020}/", v.generation))),
        "fault reports of generation {} remain: {:?}",
        v.generation,
        faults.iter().map(|kv| &kv.key).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn training_newcomers_receive_state_and_every_rank_holds_the_same_weights() {
    let c = Cluster::start(Spec::default().agents(2, 2));
    let data = synth(c.dir.path(), "tokens", 60_000);
    c.submit(&format!(
        "{}max_steps = 100000\n",
        training_toml("t2", 1, 4, 3, "gpt", &data, "")
    ));
    c.wait_world("t2", 3, S(30));
    c.wait_step("t2", 20, S(60));
    c.dctl_ok(&["scale", "t2", "2"]);
    let v2 = c.wait_world("t2", 2, S(15));
    let s2 = c.wait_step("t2", c.status("t2").step + 20, S(60));
    c.dctl_ok(&["scale", "t2", "4"]);
    let v4 = c.wait_world("t2", 4, S(20));
    let w = c.weights("t2", v4.generation, 4).await;
    assert!(
        w.windows(2).all(|x| x[0] == x[1]),
        "ranks disagree after the scale-up: {w:?}"
    );
    let step: u64 = w[0].split(':').next().unwrap().parse().unwrap();
    assert!(
        step >= s2.step,
        "newcomers resumed at {step}, not from scratch"
    );
    // two newcomers: slots that were not in the world before
    let old: BTreeSet<(String, u32)> = v2
        .members
        .iter()
        .map(|m| (m.node.clone(), m.slot))
        .collect();
    assert_eq!(
        v4.members
            .iter()
            .filter(|m| !old.contains(&(m.node.clone(), m.slot)))
            .count(),
        2
    );
    c.wait_step("t2", step + 20, S(60));
}

#[test]
fn training_repeated_kills_during_all_reduces_never_hang() {
    let c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default().agents(2, 2)
    });
    let data = synth(c.dir.path(), "tokens", 60_000);
    c.submit(&format!(
        "{}max_steps = 100000\n",
        training_toml("t3", 1, 4, 4, "gpt", &data, "restart_budget = 50")
    ));
    c.wait_world("t3", 4, S(30));
    let mut last = c.wait_step("t3", 10, S(60)).step;
    for round in 0..6u32 {
        let v = c.wait_world("t3", 4, S(30));
        let victim = v.members[(round % 4) as usize].pid.unwrap();
        unsafe { libc::kill(victim as i32, libc::SIGKILL) };
        // training goes on, past where it was
        let now = c.wait_step("t3", last + 10, S(30)).step;
        assert!(now > last, "round {round}: stuck at {last}");
        last = now;
    }
    let v = c.wait_world("t3", 4, S(30));
    let g = v.generation;
    let w = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(c.weights("t3", g, 4));
    assert!(w.windows(2).all(|x| x[0] == x[1]), "{w:?}");
}

#[test]
fn training_every_sample_is_used_exactly_once_per_epoch_across_kills_and_resizes() {
    let ledger = TempDir::new("ledger");
    let spec = Spec {
        restart_backoff_ms: 300,
        agent_env: vec![(
            "DUCTILE_LEDGER_DIR".into(),
            ledger.path().display().to_string(),
        )],
        ..Spec::default().agents(2, 2)
    };
    let c = Cluster::start(spec);
    // 20,000 tokens / ctx 32 → 624 samples; 32 per step → about 19.5 steps an epoch
    let data = synth(c.dir.path(), "tokens", 20_000);
    let steps = 1200u64;
    c.submit(&format!(
        "{}max_steps = {steps}\nmodel_config = {{ d_model = 32, n_layer = 1, n_head = 2 }}\n",
        training_toml("t4", 1, 4, 4, "gpt", &data, "restart_budget = 50")
    ));
    c.wait_world("t4", 4, S(30));
    c.wait_step("t4", 100, S(60));
    let v = c.status("t4");
    unsafe { libc::kill(v.members[1].pid.unwrap() as i32, libc::SIGKILL) };
    c.wait_step("t4", 300, S(60));
    c.dctl_ok(&["scale", "t4", "3"]);
    c.wait_step("t4", 500, S(60));
    let v = c.status("t4");
    unsafe { libc::kill(v.members[0].pid.unwrap() as i32, libc::SIGKILL) };
    c.wait_step("t4", 700, S(60));
    c.dctl_ok(&["scale", "t4", "4"]);
    c.wait_done("t4", S(120));
    assert!(
        c.history("t4").len() >= 5,
        "the run was interrupted several times"
    );

    // every rank's ledger: each step once, each sample once per epoch (624 samples of ctx 32)
    let v = ductile_tests::ledger::violations(ledger.path(), steps, 624, 32);
    assert!(v.is_empty(), "{v:#?}");
}

#[test]
fn training_deterministic_mode_gives_bitwise_equal_weights_despite_kills_and_resizes() {
    let c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default().agents(2, 2)
    });
    let data = synth(c.dir.path(), "regression", 4_000);
    let train = |name: &str, desired: u32| {
        format!(
            "{}max_steps = 2500\ndeterministic = true\noptimizer = \"adamw\"\nlogical_shards = 4\n",
            training_toml(name, 1, 4, desired, "mlp", &data, "restart_budget = 50")
        )
    };
    // an uninterrupted run at a fixed size
    c.submit(&train("fixed", 2));
    let reference = c
        .wait_done("fixed", S(120))
        .final_weights_sha256
        .expect("a final hash");
    // the same job, killed and resized on the way
    c.submit(&train("elastic", 4));
    c.wait_world("elastic", 4, S(30));
    c.wait_step("elastic", 200, S(60));
    let v = c.status("elastic");
    unsafe { libc::kill(v.members[3].pid.unwrap() as i32, libc::SIGKILL) };
    c.wait_step("elastic", 800, S(60));
    c.dctl_ok(&["scale", "elastic", "1"]);
    c.wait_step("elastic", 1300, S(60));
    c.dctl_ok(&["scale", "elastic", "3"]);
    let done = c.wait_done("elastic", S(180));
    let h = c.history("elastic");
    assert!(h.len() >= 4, "{h:?}");
    assert!(
        h.iter().any(|g| g.reason == Reason::Failure) && h.iter().any(|g| g.world_size == 1),
        "{h:?}"
    );
    assert_eq!(
        done.final_weights_sha256.unwrap(),
        reference,
        "final weights differ from the uninterrupted run"
    );
    assert_eq!(done.step, 2500);
}

/// A recipe other than the default (issue 49): AdamW's settings, no decay on biases, a
/// warmup-stable-decay schedule.
const RECIPE: &str = "optimizer = { name = \"adamw\", betas = [0.85, 0.99], eps = 1e-7, weight_decay = 0.05, no_decay = [\"bias\"] }\nlr_schedule = { warmup_steps = 100, decay = \"wsd\", decay_steps = 300, wsd_decay = \"sqrt\", min_lr = 1e-5 }\n";

/// Gradient clipping by global norm (issue 47, item 6), in deterministic mode, with a recipe of
/// the job's own (issue 49): the clipped run ends with the same bits through a kill and resizes
/// as at a fixed size (the norm is taken from the summed gradients, the same at every world
/// size; the rate of a step is the recipe's function of the step); the norm before clipping and
/// the step's rate show in `dctl status --json` and the metrics, and the norm was past the
/// bound, so clipping acted.
#[test]
fn training_clipping_by_global_norm_gives_the_same_bits_through_kills_and_resizes() {
    let c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default().agents(2, 2)
    });
    let data = synth(c.dir.path(), "regression", 4_000);
    let train = |name: &str, desired: u32| {
        format!(
            "{}max_steps = 1200\ndeterministic = true\nlogical_shards = 4\nmax_grad_norm = 0.05\n{RECIPE}",
            training_toml(name, 1, 4, desired, "mlp", &data, "restart_budget = 50")
        )
    };
    c.submit(&train("fixed", 2));
    let norm = c.wait_for(S(60), "a reported gradient norm", || {
        c.status("fixed").grad_norm
    });
    assert!(norm > 0.05, "the norm {norm} never needed clipping");
    let (_, metrics) = http("GET", &format!("{}/metrics", c.endpoint()), &[], b"").unwrap();
    assert!(
        metrics.contains("ductile_job_grad_norm{job=\"fixed\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ductile_job_lr{job=\"fixed\"}"),
        "{metrics}"
    );
    let v = c.status("fixed");
    let recipe = v.recipe.expect("the recipe in the job's status");
    assert_eq!(recipe.optimizer["betas"], serde_json::json!([0.85, 0.99]));
    assert_eq!(
        v.lr,
        Some(recipe.lr_schedule.at(v.step - 1)),
        "the last reported step's rate"
    );
    let reference = c
        .wait_done("fixed", S(120))
        .final_weights_sha256
        .expect("a final hash");
    c.submit(&train("elastic", 4));
    c.wait_world("elastic", 4, S(30));
    c.wait_step("elastic", 150, S(60));
    let v = c.status("elastic");
    unsafe { libc::kill(v.members[3].pid.unwrap() as i32, libc::SIGKILL) };
    c.wait_step("elastic", 500, S(60));
    c.dctl_ok(&["scale", "elastic", "1"]);
    c.wait_step("elastic", 800, S(60));
    c.dctl_ok(&["scale", "elastic", "3"]);
    let done = c.wait_done("elastic", S(180));
    assert_eq!(
        done.final_weights_sha256.unwrap(),
        reference,
        "a clipped run's final weights differ from the uninterrupted run's"
    );
}

/// ZeRO-1 (`sharding = "optimizer"`), with a recipe of the job's own (issue 49): each rank holds
/// its rows of the AdamW state only (and decays the rows of the parameters that take decay).
/// Through
/// a SIGKILL (the lost shard read from the checkpoint), live re-cuts 4 → 3 → 1 → 2, and with
/// `shard_group = 2` (HSDP) a kill made good by the shard's replica, each run ends with the
/// weights and optimizer state of the unsharded run at a fixed world, bit for bit.
#[test]
fn training_sharded_optimizer_state_gives_the_unsharded_bits_through_kills_and_resizes() {
    let c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default().agents(2, 2)
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let data = synth(c.dir.path(), "regression", 4_000);
    let train = |name: &str, desired: u32, extra: &str| {
        format!(
            "{}max_steps = 4000\ndeterministic = true\nlogical_shards = 4\n{RECIPE}{extra}\n[checkpoint]\nurl = \"file://{}/ck-{name}\"\ninterval = 200\n",
            training_toml(name, 1, 4, desired, "mlp", &data, "restart_budget = 50"),
            c.dir.path().display()
        )
    };
    c.submit(&train("whole", 2, ""));
    c.wait_done("whole", S(180));
    let reference = final_hashes(&c, "whole");
    let g1 = c.history("whole")[0].clone();
    let whole = rt.block_on(c.joins("whole", g1.number, g1.world_size))[0].state_bytes;

    c.submit(&train("zero", 4, "sharding = \"optimizer\""));
    let v = c.wait_world("zero", 4, S(30));
    assert_eq!(v.layout.unwrap().to_string(), "dp4(shard4)×pp1×tp1");
    let g = c.history("zero")[0].clone();
    let held: Vec<u64> = rt
        .block_on(c.joins("zero", g.number, g.world_size))
        .iter()
        .map(|j| j.state_bytes)
        .collect();
    // parameters whole, a quarter of the two moments: half of what an unsharded rank holds
    assert!(
        held.iter().all(|b| *b * 10 < whole * 6),
        "{held:?} vs {whole}"
    );
    c.wait_step("zero", 300, S(60));
    let before = c.history("zero").last().unwrap().number;
    unsafe { libc::kill(v.members[3].pid.unwrap() as i32, libc::SIGKILL) };
    let restored = c.wait_for(S(60), "the lost shard restored from the checkpoint", || {
        c.history("zero")
            .into_iter()
            .find(|g| g.number > before && g.state_source == StateSource::Checkpoint)
    });
    assert!(restored.world_size >= 3, "{restored:?}");
    c.wait_world("zero", 4, S(60));
    let before = c.history("zero").last().unwrap().number;
    for world in [3u32, 1, 2] {
        c.dctl_ok(&["scale", "zero", &world.to_string()]);
        c.wait_world("zero", world, S(60));
        c.wait_step("zero", c.status("zero").step + 150, S(60));
    }
    let h = c.history("zero");
    assert!(
        h.iter()
            .filter(|g| g.number > before)
            .all(|g| g.state_source != StateSource::Checkpoint),
        "a resize re-cuts the shards in place: {h:#?}"
    );
    assert!(
        h.iter()
            .any(|g| g.layout.to_string() == "dp3(shard3)×pp1×tp1"),
        "{h:#?}"
    );
    c.wait_done("zero", S(120));
    assert_eq!(
        final_hashes(&c, "zero"),
        reference,
        "the sharded run's final weights or optimizer state differ from the unsharded run's"
    );

    // HSDP: shard groups of 2, replicated twice; a kill loses no shard
    c.submit(&train(
        "hsdp",
        4,
        "sharding = \"optimizer\"\nshard_group = 2",
    ));
    hsdp_kill_loses_no_shard(
        &c,
        300,
        100,
        Some("shard_group 2 does not divide world 3: shard groups of 1"),
    );
    assert_eq!(final_hashes(&c, "hsdp"), reference);

    // refused where it does not run, naming the key
    for (extra, strip_ckpt, says) in [
        (
            "sharding = \"full\"\ntensor_slices = 4",
            false,
            "\"full\" sharding computes each unit whole",
        ),
        (
            "sharding = \"full\"\nstrategy = \"auto\"",
            false,
            "\"full\" needs strategy = \"pipeline\", or \"hybrid\" with a fixed tensor_parallel",
        ),
        (
            "sharding = \"optimizer\"\nstrategy = \"pipeline\"\nshard_group = \"node\"",
            false,
            "pipeline and tensor layouts shard over each stage's replicas",
        ),
        (
            "sharding = \"optimizer\"",
            true,
            "a sharded job needs a [checkpoint]",
        ),
        ("shard_group = 2", false, "training.shard_group"),
    ] {
        let mut spec = train("bad", 2, extra);
        if strip_ckpt {
            spec = spec[..spec.find("[checkpoint]").unwrap()].to_string();
        }
        let path = c.dir.path().join("bad.toml");
        std::fs::write(&path, spec).unwrap();
        let (ok, _, err) = c.dctl(&["submit", path.to_str().unwrap()]);
        assert!(!ok && err.contains(says), "{extra}: {err}");
    }
}

/// SIGKILL member `k` of `v` (a generation of `job` at world 4, sharded without a replica)
/// past step `at`: a generation restores the lost rows from the checkpoint, and the job is
/// back at 4.
fn kill_restores_from_checkpoint(c: &Cluster, job: &str, v: &JobView, k: usize, at: u64) {
    c.wait_step(job, at, S(60));
    let before = c.history(job).last().unwrap().number;
    unsafe { libc::kill(v.members[k].pid.unwrap() as i32, libc::SIGKILL) };
    c.wait_for(S(60), "the lost rows restored from the checkpoint", || {
        c.history(job)
            .into_iter()
            .find(|g| g.number > before && g.state_source == StateSource::Checkpoint)
    });
    c.wait_world(job, 4, S(60));
}

/// SIGKILL rank `k` of `job` (at world 4, 2 nodes of 2) past step `at`: a fully sharded job's
/// buddy copies give its shard (on rank (k + 2) mod 4, the other node): the next generation
/// says so, no generation restores from the checkpoint, and the slot's restarted worker joins.
fn kill_loses_no_step(c: &Cluster, job: &str, v: &JobView, k: usize, at: u64) {
    c.wait_step(job, at, S(60));
    let before = c.history(job).last().unwrap().number;
    unsafe { libc::kill(v.members[k].pid.unwrap() as i32, libc::SIGKILL) };
    let says = format!(
        "shards {k} of 4 come from their buddy copies (generation {before}'s ranks {})",
        (k + 2) % 4
    );
    let g = c.wait_for(S(60), "the generation after the kill", || {
        c.history(job)
            .into_iter()
            .find(|g| g.number > before && g.reason == Reason::Failure)
    });
    assert!(g.detail.contains(&says), "{says}: {}", g.detail);
    c.wait_world(job, 4, S(60));
    let h = c.history(job);
    assert!(no_restore_since(&h, before), "{h:#?}");
}

/// Whether no generation of `h` after generation `before` restores from a checkpoint.
fn no_restore_since(h: &[Generation], before: u64) -> bool {
    h.iter()
        .filter(|g| g.number > before)
        .all(|g| g.state_source != StateSource::Checkpoint)
}

/// `dctl scale` `job` through `worlds`, 30 steps at each: no generation since restores from a
/// checkpoint (the shards are re-cut in place). Returns the job's history.
fn resize_in_place(c: &Cluster, job: &str, worlds: &[u32]) -> Vec<Generation> {
    let before = c.history(job).last().unwrap().number;
    for world in worlds {
        c.dctl_ok(&["scale", job, &world.to_string()]);
        c.wait_world(job, *world, S(60));
        c.wait_step(job, c.status(job).step + 30, S(90));
    }
    let h = c.history(job);
    assert!(
        no_restore_since(&h, before),
        "a resize re-cuts the shards in place: {h:#?}"
    );
    h
}

/// Job "hsdp" (4 ranks in shard groups of 2): a SIGKILL at step `at` loses no shard (the
/// replica holds it: no generation restores from the checkpoint); it trains `then` steps more
/// and ends. `said`: what a world of 3's generation says of the groups it took (a
/// `shard_group` of ranks that does not divide 3), where the job's key gives one.
fn hsdp_kill_loses_no_shard(c: &Cluster, at: u64, then: u64, said: Option<&str>) {
    let v = c.wait_world("hsdp", 4, S(30));
    assert_eq!(v.layout.unwrap().to_string(), "dp4(shard2)×pp1×tp1");
    c.wait_step("hsdp", at, S(60));
    unsafe { libc::kill(v.members[1].pid.unwrap() as i32, libc::SIGKILL) };
    c.wait_step("hsdp", c.status("hsdp").step + then, S(60));
    c.wait_world("hsdp", 4, S(60));
    c.wait_done("hsdp", S(180));
    let h = c.history("hsdp");
    // (the first generation's source is the checkpoint location, empty then)
    assert!(
        h.iter()
            .skip(1)
            .all(|g| g.state_source != StateSource::Checkpoint),
        "the replica held the killed rank's shard: {h:#?}"
    );
    // the world of 3 between the kill and the restart: the groups it took are said
    for g in h.iter().filter(|g| g.world_size == 3) {
        if let Some(said) = said {
            assert!(g.detail.contains(said), "{}", g.detail);
        } else {
            assert!(!g.detail.contains("does not divide"), "{}", g.detail);
        }
    }
}

/// Full sharding (issue 47: ZeRO-3 / FSDP): each rank holds its rows of every parameter, of
/// the optimizer state and of the summed gradient, gathering one unit at a time (ZeRO-2, the
/// same with whole parameters, too). A
/// deterministic GPT job with an eval split at world 4 holds about a quarter of an unsharded
/// rank's state, loses a rank to a SIGKILL (its shard from its buddy copy), is re-cut live
/// 4 → 3 → 1 → 2, and ends with the unsharded run's weights and optimizer state, bit for bit,
/// its evals equal too, gradients clipped by global norm (`max_grad_norm`, acting: the norm
/// is past it) in every run; HSDP (shard groups of 2) survives a kill from the replica; a cold
/// restart at another shard size reads its rows from the checkpoint and goes on.
#[test]
fn training_fully_sharded_parameters_give_the_unsharded_bits_through_kills_and_resizes() {
    let c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default().agents(2, 2)
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let data = synth(c.dir.path(), "tokens", 60_000);
    // (the kills and resizes end by about step 170; the schedule's decay fits the run)
    const STEPS: u64 = 280;
    let recipe = RECIPE.replace("decay_steps = 300", "decay_steps = 160");
    let train = |name: &str, desired: u32, steps: u64, extra: &str| {
        format!(
            "{}max_steps = {steps}\ndeterministic = true\nlogical_shards = 4\neval_fraction = 0.05\neval_every = 50\neval_samples = 64\nmax_grad_norm = 0.3\n{recipe}{extra}\n[training.model_config]\nd_model = 48\nn_layer = 3\nn_head = 4\n[checkpoint]\nurl = \"file://{}/ck-{name}\"\ninterval = 40\n",
            training_toml(name, 1, 4, desired, "gpt", &data, "restart_budget = 50"),
            c.dir.path().display()
        )
    };
    c.submit(&train("whole", 2, STEPS, ""));
    let whole_done = c.wait_done("whole", S(180));
    let reference = final_hashes(&c, "whole");
    let g1 = c.history("whole")[0].clone();
    let whole = rt.block_on(c.joins("whole", g1.number, g1.world_size))[0].state_bytes;

    c.submit(&train("full", 4, STEPS, "sharding = \"full\""));
    let v = c.wait_world("full", 4, S(30));
    assert_eq!(v.layout.unwrap().to_string(), "dp4(shard4)×pp1×tp1");
    let norm = c.wait_step("full", 5, S(60)).grad_norm;
    println!("the fully sharded run's gradient norm at step 5: {norm:?}");
    assert!(
        norm.is_some_and(|n| n > 0.3),
        "clipping at 0.3 acts on the sharded gradients: {norm:?}"
    );
    let held = first_state_bytes(&c, &rt, "full");
    // a quarter of the parameters and of their two moments (rows split unevenly: a little more)
    assert!(
        held.iter().all(|b| *b * 100 < whole * 30),
        "{held:?} vs {whole}"
    );
    // each new process made only its rows of the seed (never the whole model)
    assert!(
        c.logs()
            .contains("made the seed's parameters in their rows, unit by unit shard=4"),
        "the workers made their rows of the seed"
    );
    kill_loses_no_step(&c, "full", &v, 2, 60);
    resize_in_place(&c, "full", &[3, 1, 2]);
    // every world, one included (FSDP2 at a mesh of one), ran the gathers and the reductions
    let logs = c.logs();
    for s in [4, 3, 1, 2] {
        assert!(
            logs.contains(&format!(
                "all-gathered over a shard group of {s} before its forward"
            )),
            "a sharded step at a shard group of {s}"
        );
    }
    let done = c.wait_done("full", S(180));
    assert_eq!(
        final_hashes(&c, "full"),
        reference,
        "the fully sharded run's final weights or optimizer state differ from the unsharded run's"
    );
    assert_eq!(done.eval_loss, whole_done.eval_loss, "the final eval");

    // the gathered parameters kept for the backward (FSDP2's reshard_after_forward = False:
    // one gather per unit, no unit run twice), through a resize; and with activation
    // checkpointing (the blocks run again in their backward, their parameters still whole)
    for (name, extra) in [
        ("kept", ""),
        ("kept-ac", "\nactivation_checkpointing = \"full\""),
    ] {
        c.submit(&train(
            name,
            4,
            STEPS,
            &format!("sharding = \"full\"\nreshard_after_forward = false{extra}"),
        ));
        c.wait_world(name, 4, S(30));
        if name == "kept" {
            c.wait_step(name, 60, S(60));
            c.dctl_ok(&["scale", name, "3"]);
            c.wait_world(name, 3, S(60));
        }
        c.wait_done(name, S(180));
        assert_eq!(
            final_hashes(&c, name),
            reference,
            "{name}: the final weights or optimizer state differ from the unsharded run's"
        );
    }

    // HSDP: shard groups within each node (2 slots on each of 2), replicated across the
    // nodes; a kill loses no shard. Every new process makes its seed's rows for another place
    // than the one its first agreement gives it (as when the world changes between a start
    // and that agreement): it makes them again for its own
    c.submit(
        &train(
            "hsdp",
            4,
            STEPS,
            "sharding = \"full\"\nshard_group = \"node\"",
        )
        .replace(
            "restart_budget = 50",
            "restart_budget = 50\nallow_fault_injection = true\nenv = { DUCTILE_FAULT_STALE_SEED_PLACE = \"1\" }",
        ),
    );
    hsdp_kill_loses_no_shard(&c, 60, 30, None);
    assert_eq!(final_hashes(&c, "hsdp"), reference);
    assert!(
        c.logs()
            .contains("the seed was cut to another shard place: making it again"),
        "the stale seed rows were made again"
    );

    // HSDP without deterministic mode (FSDP2's reduction): each unit's gradients
    // reduce-scattered in the shard group, its rows then all-reduced over the replicas; the
    // run follows the unsharded one to rounding (a missing sum across the replicas would halve
    // the gradient's norm; rows summed into the wrong place would change the final weights)
    // (60 steps: a schedule that fits them)
    let short = |name: &str, desired: u32, extra: &str| {
        train(name, desired, 60, extra)
            .replace("warmup_steps = 100", "warmup_steps = 20")
            .replace("decay_steps = 160", "decay_steps = 30")
    };
    c.submit(&short("whole-short", 2, ""));
    let want = c.wait_done("whole-short", S(120));
    c.submit(
        &short("hsdp-nd", 4, "sharding = \"full\"\nshard_group = 2")
            .replace("deterministic = true\n", ""),
    );
    let v = c.wait_world("hsdp-nd", 4, S(30));
    assert_eq!(v.layout.unwrap().to_string(), "dp4(shard2)×pp1×tp1");
    let got = c.wait_done("hsdp-nd", S(120));
    let close = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => (a - b).abs() <= 1e-3 * b.abs(),
        _ => false,
    };
    // (the final weights' eval loss and the last step's norm: a done job's loss is its last
    // report's, of whichever step that was)
    assert!(
        close(got.eval_loss, want.eval_loss) && close(got.grad_norm, want.grad_norm),
        "HSDP's final eval loss {:?} and last gradient norm {:?} against the unsharded run's {:?} and {:?}",
        got.eval_loss,
        got.grad_norm,
        want.eval_loss,
        want.grad_norm
    );
    assert!(
        c.logs().lines().any(|l| l.contains("job=hsdp-nd")
            && l.contains(
                "reduce-scattered in the shard group, then all-reduced over the replicas"
            )),
        "the HSDP step says how it reduces"
    );
    // and it sends less than sharding over all 4 does (gathers over 2 of half the parameters,
    // a reduce-scatter over 2 and a sum of the rows across 2: 2 parameter sizes a step per
    // rank against 2.25; all-reducing the whole gradients over the world sent 2.5)
    c.submit(&short("full-nd", 4, "sharding = \"full\"").replace("deterministic = true\n", ""));
    let full = c.wait_done("full-nd", S(120));
    let (hsdp_b, full_b) = (
        got.bytes_per_sample.unwrap(),
        full.bytes_per_sample.unwrap(),
    );
    println!(
        "bytes per sample: HSDP (shard groups of 2) {hsdp_b:.0}, full sharding over 4 {full_b:.0}"
    );
    assert!(
        hsdp_b < full_b,
        "HSDP {hsdp_b} bytes a sample, full sharding {full_b}"
    );

    // ZeRO-2: whole parameters, rows of the summed gradient and of the state, through a kill
    // (a lost shard: the checkpoint) and a resize
    c.submit(&train("zero2", 4, STEPS, "sharding = \"gradients\""));
    let v = c.wait_world("zero2", 4, S(30));
    assert_eq!(v.layout.unwrap().to_string(), "dp4(shard4)×pp1×tp1");
    c.wait_step("zero2", 60, S(60));
    unsafe { libc::kill(v.members[1].pid.unwrap() as i32, libc::SIGKILL) };
    c.wait_world("zero2", 4, S(60));
    c.wait_step("zero2", c.status("zero2").step + 30, S(60));
    c.dctl_ok(&["scale", "zero2", "3"]);
    c.wait_world("zero2", 3, S(60));
    c.wait_done("zero2", S(180));
    assert_eq!(final_hashes(&c, "zero2"), reference);

    // sharding = "auto": the least that fits the slots' memory, chosen at submit (here a slot
    // that holds the fully sharded state and not ZeRO-2's), shown by dctl status
    let auto = train("auto", 4, STEPS, "sharding = \"auto\"");
    let need = |s: Sharding| {
        let mut t = ductile_cluster::records::JobSpec::from_toml(&auto)
            .unwrap()
            .training
            .unwrap();
        t.sharding = s;
        t.min_slot_bytes(4).unwrap()
    };
    let cap = (need(Sharding::Full) + need(Sharding::Gradients)) / 2;
    c.submit(&auto.replace(
        "sharding = \"auto\"",
        &format!(
            "sharding = \"auto\"\nmemory_per_slot_gib = {}",
            cap as f64 / (1u64 << 30) as f64
        ),
    ));
    let v = c.wait_done("auto", S(120));
    assert_eq!(v.sharding, Some(Sharding::Full));
    // with strategy = "auto" too: sharded data parallelism before pipeline or tensor layouts
    let gib = cap as f64 / (1u64 << 30) as f64;
    c.submit(&train(
        "planned",
        4,
        STEPS,
        &format!("strategy = \"auto\"\nsharding = \"auto\"\nmemory_per_slot_gib = {gib}"),
    ));
    let p = c.wait_world("planned", 4, S(30));
    assert_eq!(p.sharding, Some(Sharding::Full));
    assert_eq!(p.layout.unwrap().to_string(), "dp4(shard4)×pp1×tp1");
    assert!(c
        .logs()
        .contains("chose \"full\" (strategy \"auto\": data parallel, sharded)"));
    c.wait_done("planned", S(180));
    assert_eq!(final_hashes(&c, "planned"), reference);
    assert!(c.logs().contains("sharding \"auto\" chose \"full\""));
    let (_, out, _) = c.dctl(&["status", "auto"]);
    assert!(out.contains("sharding    full"), "{out}");
    // dctl plan: each level's state per rank at the world asked for, the job's marked
    let plan: serde_json::Value =
        serde_json::from_str(&c.dctl_ok(&["plan", "auto", "--world", "4", "--json"])).unwrap();
    assert_eq!(plan["layout"]["dp_shard"], 4, "{plan}");
    let levels = plan["sharding"].as_array().unwrap();
    let bytes: Vec<u64> = levels
        .iter()
        .map(|l| l["memory_bytes"].as_u64().unwrap())
        .collect();
    assert!(bytes.windows(2).all(|w| w[0] > w[1]), "{plan}");
    assert_eq!(levels[3]["sharding"], "full");
    assert_eq!(levels[3]["chosen"], true);
    assert!(c
        .dctl_ok(&["plan", "auto", "--world", "4"])
        .contains("   (this job)"));
    assert_eq!(final_hashes(&c, "auto"), reference);

    // a cold restart at another shard size: the rows of the world-4 commits, read at 3
    c.submit(
        &(train("again", 3, STEPS + 80, "sharding = \"full\"").replace("ck-again", "ck-full")
            + "resume_from = [\"full\"]\nallow_recipe_change = true\n"),
    );
    let v = c.wait_world("again", 3, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp3(shard3)×pp1×tp1");
    let g = c.history("again")[0].clone();
    let joins = rt.block_on(c.joins("again", g.number, g.world_size));
    assert!(joins.iter().all(|j| j.step == STEPS), "{joins:?}");
    let done = c.wait_done("again", S(180));
    assert_eq!(done.step, STEPS + 80);
}

/// Full sharding under tensor groups (issue 47: torchtitan's 2D FSDP + TP). A GPT job at
/// `tensor_parallel = 2` over 4 ranks shards each tensor place's slices over its 2 replicas
/// (`dp2(shard2)×pp1×tp2`): its ranks hold about half of what the unsharded tensor-parallel
/// run's hold, the log says each unit is gathered and reduced, it goes on through a SIGKILL
/// (the lost rows from the checkpoint, a spare meanwhile) and a resize 4 → 2 → 4 (re-cut in
/// place), clipping by the global norm, and in deterministic mode ends with the unsharded
/// tensor-parallel run's bits (its final weights and optimizer state: each unit's gradients
/// folded over the logical shards in order, as the tensor layout's step folds them); so does
/// HSDP under tensor groups (shard groups of one replica), and a cold start of another layout
/// reads the 2D checkpoint's rows.
/// A fully sharded GPT job of world 4 on 2 nodes (ranks 0 and 1 on the first, 2 and 3 on the
/// second), deterministic, with a checkpoint URL that no commit reaches: its ranks `kill`
/// SIGKILLed at once past step 8. Returns the job's run, and the uninterrupted run's final
/// hashes.
struct ShardedLoss {
    c: Cluster,
    /// The uninterrupted run's final hashes (weights, optimizer state).
    reference: (String, String),
    /// The job's status step read just before the kill (a floor of the step reached).
    killed_at: u64,
    /// The generations published after the kill.
    after: Vec<Generation>,
    /// The job's log lines.
    lines: Vec<String>,
}

fn sharded_job_losing(kill: &[usize], extra: &str, job_extra: &str) -> ShardedLoss {
    let c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default().agents(2, 2)
    });
    let data = synth(c.dir.path(), "tokens", 20_000);
    const STEPS: u64 = 80;
    let recipe = RECIPE
        .replace("warmup_steps = 100", "warmup_steps = 10")
        .replace("decay_steps = 300", "decay_steps = 40");
    let train = |name: &str, extra: &str, job_extra: &str| {
        format!(
            "{}max_steps = {STEPS}\ndeterministic = true\nlogical_shards = 4\nmax_grad_norm = 1.0\n{recipe}{extra}\n[training.model_config]\nd_model = 32\nn_layer = 2\nn_head = 4\n[checkpoint]\nurl = \"file://{}/ck-{name}\"\ninterval = 100000\n",
            training_toml(
                name,
                1,
                4,
                4,
                "gpt",
                &data,
                &format!("restart_budget = 50\n{job_extra}"),
            ),
            c.dir.path().display()
        )
    };
    c.submit(&train(
        "once",
        "sharding = \"full\"\nbuddy_copies = false",
        "",
    ));
    c.wait_done("once", S(180));
    let reference = final_hashes(&c, "once");

    c.submit(&train(
        "lose",
        &format!("sharding = \"full\"\n{extra}"),
        job_extra,
    ));
    let v = c.wait_world("lose", 4, S(30));
    c.wait_step("lose", 8, S(60));
    let before = c.history("lose").last().unwrap().number;
    let killed_at = c.status("lose").step;
    for r in kill {
        unsafe { libc::kill(v.members[*r].pid.unwrap() as i32, libc::SIGKILL) };
    }
    c.wait_done("lose", S(180));
    let after: Vec<Generation> = c
        .history("lose")
        .into_iter()
        .filter(|g| g.number > before)
        .collect();
    let lines = c
        .logs()
        .lines()
        .filter(|l| l.contains("job=lose"))
        .map(str::to_string)
        .collect();
    ShardedLoss {
        c,
        reference,
        killed_at,
        after,
        lines,
    }
}

/// A fully sharded job without buddy copies that loses a rank before its first checkpoint
/// commit: the rows only that rank held are gone and no commit holds them, so the job says
/// once, plainly, that it starts over from the seed at step 0, and does so in the next
/// generation (no cascade of generations, no worker saying it stops); it then ends with the
/// uninterrupted run's bits.
#[test]
fn training_a_sharded_job_without_a_commit_yet_starts_over_from_the_seed_once_and_says_so() {
    let run = sharded_job_losing(&[1], "buddy_copies = false", "");
    let failures: Vec<&Generation> = run
        .after
        .iter()
        .filter(|g| g.reason == Reason::Failure)
        .collect();
    assert_eq!(
        failures.len(),
        1,
        "one generation for the loss: {:#?}",
        run.after
    );
    assert!(
        failures[0]
            .detail
            .contains("no committed checkpoint yet: it starts over from the seed at step 0"),
        "{}",
        failures[0].detail
    );
    assert_eq!(
        run.lines
            .iter()
            .filter(|l| l.contains("the job starts over from the seed at step 0"))
            .count(),
        1,
        "said once: {:#?}",
        run.lines
    );
    assert!(
        !run.lines.iter().any(|l| l.contains("stopping rather than")),
        "no worker says it stops: {:#?}",
        run.lines
    );
    assert_eq!(
        final_hashes(&run.c, "lose"),
        run.reference,
        "the run started over from the seed ends with the uninterrupted run's bits"
    );
}

/// Buddy copies (issue 67, item 6): the same loss costs no step, and so does the loss of a
/// node's two ranks at once. Every rank keeps its ward's shard in host memory on the other
/// node, so the generation after the kill re-shards from the survivors at the step reached: no
/// rank restores anything or starts over, every member joins that generation past the step the
/// job had shown before the kill, the leader's detail says where the lost shards come from, and
/// the run ends with the uninterrupted run's bits (the copies were kept current by the same
/// optimizer update, clipped gradients included).
#[test]
fn training_a_sharded_job_loses_no_step_when_a_rank_or_a_node_dies_its_shards_from_buddy_copies() {
    // (the two SIGKILLs of a node's ranks may reach the leader apart: a generation each; the
    // injected exits land on either side of step 20's commit, rank 1's rows sent to its keeper:
    // then no rank applies the step, or every other rank does)
    let exit = |side: &str| {
        format!("allow_fault_injection = true\nenv = {{ DUCTILE_FAULT_EXIT_AT_COMMIT = \"1:20:{side}\" }}")
    };
    let runs = [
        (
            vec![1],
            "shards 1 of 4 come from their buddy copies (generation 1's ranks 3)",
            String::new(),
            0,
        ),
        (
            vec![0, 1],
            "come from their buddy copies (generation ",
            String::new(),
            0,
        ),
        (
            vec![],
            "shards 1 of 4 come from their buddy copies",
            exit("before"),
            20,
        ),
        (
            vec![],
            "shards 1 of 4 come from their buddy copies",
            exit("after"),
            21,
        ),
    ];
    for (kill, says, job_extra, from) in runs {
        let run = sharded_job_losing(&kill, "", &job_extra);
        let tag = format!("{kill:?} {job_extra}");
        let failures: Vec<&Generation> = run
            .after
            .iter()
            .filter(|g| g.reason == Reason::Failure)
            .collect();
        assert!(
            (1..=kill.len().max(1)).contains(&failures.len()),
            "{tag}: a generation for each loss at most: {:#?}",
            run.after
        );
        for g in &failures {
            assert!(g.detail.contains(says), "{tag}: {}", g.detail);
        }
        let g = failures.last().unwrap();
        // (each member's own line: the job's records of its joins go when it ends)
        let joined = format!("joined generation {} as rank ", g.number);
        let steps: Vec<u64> = run
            .lines
            .iter()
            .filter_map(|l| l.split_once(&joined))
            .filter_map(|(_, rest)| {
                rest.split_once(" at step ")?
                    .1
                    .split(' ')
                    .next()?
                    .parse()
                    .ok()
            })
            .collect();
        let least = run.killed_at.max(from).max(1);
        assert!(
            steps.len() == g.world_size as usize && steps.iter().all(|s| *s >= least),
            "{tag}: every member of generation {} joins at the step reached (at least {least}): {steps:?}",
            g.number,
        );
        for said in [
            "restores",
            "starts over",
            "stopping rather than",
            "no holder",
        ] {
            assert!(
                !run.lines.iter().any(|l| l.contains(said)),
                "{tag}: no rank says \"{said}\": {:#?}",
                run.lines
            );
        }
        assert!(
            run.lines.iter().any(|l| l.contains("buddy copy made")),
            "the ranks say they keep copies: {:#?}",
            run.lines
        );
        assert_eq!(
            final_hashes(&run.c, "lose"),
            run.reference,
            "{tag}: the run that lost ranks ends with the uninterrupted run's bits"
        );
    }
}

#[test]
fn training_fully_sharded_under_tensor_groups_trains_as_the_unsharded_tensor_layout() {
    let c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default().agents(2, 2)
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let data = synth(c.dir.path(), "tokens", 60_000);
    let train = |name: &str, extra: &str| {
        format!(
            "{}max_steps = 200\neval_fraction = 0.05\neval_samples = 64\nmax_grad_norm = 1.0\nstrategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1\n{extra}\n[training.model_config]\nd_model = 48\nn_layer = 3\nn_head = 4\n[checkpoint]\nurl = \"file://{}/ck-{name}\"\ninterval = 40\n",
            training_toml(name, 2, 4, 4, "gpt", &data, "restart_budget = 50"),
            c.dir.path().display()
        )
    };
    let det = "deterministic = true\ntensor_slices = 2\nlogical_shards = 4";
    c.submit(&train("tp", det));
    let v = c.wait_world("tp", 4, S(30));
    assert_eq!(v.layout.unwrap().to_string(), "dp2×pp1×tp2");
    let tp_done = c.wait_done("tp", S(240));
    let g1 = c.history("tp")[0].clone();
    let whole = rt.block_on(c.joins("tp", g1.number, g1.world_size))[0].state_bytes;

    c.submit(&train("full-tp", &format!("sharding = \"full\"\n{det}")));
    let v = c.wait_world("full-tp", 4, S(30));
    assert_eq!(v.layout.unwrap().to_string(), "dp2(shard2)×pp1×tp2");
    let norm = c.wait_step("full-tp", 5, S(60)).grad_norm;
    assert!(norm.is_some_and(|n| n > 0.0), "the global norm: {norm:?}");
    let held = first_state_bytes(&c, &rt, "full-tp");
    // half of each slice's parameters and of their two moments (uneven rows: a little more)
    assert!(
        held.iter().all(|b| *b * 100 < whole * 60),
        "{held:?} vs {whole}"
    );
    assert!(
        c.logs()
            .contains("all-gathered over a shard group of 2 before its forward"),
        "the 2D step gathers each unit over the shard group"
    );
    kill_restores_from_checkpoint(&c, "full-tp", &v, 1, 60);
    let h = resize_in_place(&c, "full-tp", &[2, 4]);
    assert!(
        h.iter().any(|g| g.layout.to_string() == "dp1×pp1×tp2"),
        "{h:#?}"
    );
    c.wait_done("full-tp", S(240));
    assert!(c.logs().contains("folded over the logical shards in order"));
    assert_eq!(
        final_hashes(&c, "full-tp"),
        final_hashes(&c, "tp"),
        "the 2D run's final weights or optimizer state differ from the tensor layout's"
    );
    assert_eq!(tp_done.step, 200);

    // HSDP under tensor groups: shard groups of one replica, the two replicas' sums folded
    // along them; the same bits again
    let hsdp = format!("sharding = \"full\"\nshard_group = 1\n{det}");
    c.submit(&train("hsdp-tp", &hsdp));
    let v = c.wait_world("hsdp-tp", 4, S(30));
    assert_eq!(v.layout.unwrap().to_string(), "dp2×pp1×tp2");
    c.wait_done("hsdp-tp", S(240));
    assert_eq!(
        final_hashes(&c, "hsdp-tp"),
        final_hashes(&c, "tp"),
        "HSDP 2D's final weights or optimizer state differ from the tensor layout's"
    );

    // a cold start of another layout (data parallel, fully sharded over 3) reads the rows the
    // 2D run's checkpoint holds: its step 200, and on
    c.submit(
        &(train("again", "sharding = \"full\"")
            .replace(
                "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1\n",
                "",
            )
            .replace("max_steps = 200", "max_steps = 240")
            .replace("desired = 4", "desired = 3")
            .replace("ck-again", "ck-full-tp")
            + "resume_from = [\"full-tp\"]\nallow_recipe_change = true\n"),
    );
    let v = c.wait_world("again", 3, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp3(shard3)×pp1×tp1");
    let g = c.history("again")[0].clone();
    let joins = rt.block_on(c.joins("again", g.number, g.world_size));
    assert!(joins.iter().all(|j| j.step == 200), "{joins:?}");
    assert_eq!(c.wait_done("again", S(180)).step, 240);
}

/// Outside deterministic mode the data-parallel step all-reduces its gradients in buckets as
/// the backward finishes them (issue 47 item 3), and full sharding reduce-scatters each unit
/// while the unit before computes. At world 2 a sum is one addition (commutative), so both end
/// with the bits of the deterministic run's ordered fold of two logical shards: the overlap
/// changes when the sums run, never what they give. One rank on each of two nodes: each node
/// has a spare core for the communication thread (with a rank per core the buckets follow the
/// backward, as every other training test here runs them).
#[test]
fn training_overlapped_reductions_end_with_the_ordered_fold_s_bits() {
    let c = Cluster::start(Spec::default().agents(2, 1));
    let data = synth(c.dir.path(), "tokens", 60_000);
    // (a sharded job keeps a checkpoint: a shard lost with its rank comes from there)
    let train = |name: &str, extra: &str| {
        format!(
            "{}max_steps = 60\nbucket_mb = 1\n{extra}\n[training.model_config]\nd_model = 128\nn_layer = 3\nn_head = 4\n[checkpoint]\nurl = \"file://{}/ck-{name}\"\ninterval = 50\n",
            training_toml(name, 2, 2, 2, "gpt", &data, ""),
            c.dir.path().display()
        )
    };
    c.submit(&train(
        "ordered",
        "deterministic = true\nlogical_shards = 2",
    ));
    let ordered_done = c.wait_done("ordered", S(180));
    let reference = final_hashes(&c, "ordered");
    for (name, extra) in [("buckets", ""), ("full", "sharding = \"full\"")] {
        c.submit(&train(name, extra));
        let done = c.wait_done(name, S(180));
        assert_eq!(done.step, ordered_done.step);
        assert_eq!(
            final_hashes(&c, name),
            reference,
            "job {name}: the final weights or optimizer state differ from the ordered fold's"
        );
    }
    // the harness's workers check NCCL's rules (`ductile_comm::strict`): every call above,
    // the communication thread's too, was legal on NCCL
    assert!(
        c.logs()
            .contains("NCCL's rules checked on TCP (strict mode)"),
        "strict mode was on"
    );
    // (a machine of one core has no core to spare: the buckets follow the backward there)
    if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 {
        let logs = c.logs();
        let told = logs
            .lines()
            .find(|l| l.contains("job=buckets") && l.contains("on a communication thread"))
            .expect("the bucketed job says how it reduces");
        let n: u32 = told
            .split("all-reduced in ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{told}"));
        assert!(
            n >= 2,
            "a model of several MiB makes several 1 MiB buckets: {told}"
        );
    }
}

/// Full sharding under tensor groups (2D) overlaps too: each unit's gather and its
/// reduction run on a communication thread while the units compute, beside the tensor
/// group's cuts on the step's thread (the two groups share no peer). With two replicas a sum
/// is one addition, and with one micro-batch a replica each replica's gradient is one
/// backward's, so outside deterministic mode the 2D run and HSDP 2D end with the unsharded
/// tensor layout's bits: the overlap changes when the sums run, never what they give; in
/// deterministic mode too (the gathers overlap, the ordered folds wait for them). One
/// rank on each of four nodes: each node has a spare core for the communication thread (with
/// a rank per core the gathers and reductions run in turn with the units, as in every other
/// 2D test here).
#[test]
fn training_overlapped_2d_full_sharding_ends_with_the_tensor_layout_s_bits() {
    let c = Cluster::start(Spec::default().agents(4, 1));
    let data = synth(c.dir.path(), "tokens", 60_000);
    let train = |name: &str, extra: &str| {
        format!(
            "{}max_steps = 60\nstrategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1\npipeline_micro_batches = 1\n{extra}\n[training.model_config]\nd_model = 64\nn_layer = 3\nn_head = 4\n[checkpoint]\nurl = \"file://{}/ck-{name}\"\ninterval = 50\n",
            training_toml(name, 4, 4, 4, "gpt", &data, ""),
            c.dir.path().display()
        )
    };
    c.submit(&train("tp", ""));
    let v = c.wait_world("tp", 4, S(30));
    assert_eq!(v.layout.unwrap().to_string(), "dp2×pp1×tp2");
    let tp_done = c.wait_done("tp", S(180));
    let reference = final_hashes(&c, "tp");
    for (name, extra, layout) in [
        ("full-2d", "sharding = \"full\"", "dp2(shard2)×pp1×tp2"),
        (
            "hsdp-2d",
            "sharding = \"full\"\nshard_group = 1",
            "dp2×pp1×tp2",
        ),
    ] {
        c.submit(&train(name, extra));
        let v = c.wait_world(name, 4, S(30));
        assert_eq!(v.layout.unwrap().to_string(), layout, "job {name}");
        let done = c.wait_done(name, S(180));
        assert_eq!(done.step, tp_done.step);
        assert_eq!(
            final_hashes(&c, name),
            reference,
            "job {name}: the final weights or optimizer state differ from the tensor layout's"
        );
        one_generation(&c, name);
    }
    // deterministic mode: the folds run on the step's thread, after the gather in flight
    let det = "deterministic = true\ntensor_slices = 2\nlogical_shards = 4";
    c.submit(&train("tp-det", det));
    c.wait_done("tp-det", S(180));
    c.submit(&train(
        "full-2d-det",
        &format!("sharding = \"full\"\n{det}"),
    ));
    c.wait_done("full-2d-det", S(180));
    assert_eq!(
        final_hashes(&c, "full-2d-det"),
        final_hashes(&c, "tp-det"),
        "the deterministic 2D run's final state differs from the tensor layout's"
    );
    one_generation(&c, "full-2d-det");
    // (a machine of one core has no core to spare: the collectives run in turn there)
    if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 {
        assert!(
            c.logs().lines().any(|l| l.contains("job=full-2d-det")
                && l.contains("folded over the logical shards in order")
                && l.contains("on a communication thread, overlapping")),
            "the deterministic 2D job overlaps its gathers too"
        );
        assert!(
            c.logs().lines().any(|l| l.contains("job=full-2d")
                && l.contains("all-gathered over a shard group of 2")
                && l.contains("reduce-scattered")
                && l.contains("on a communication thread, overlapping")),
            "the 2D job says its gathers and reductions overlap the units' computation"
        );
    }
}

/// The job ran in one generation: no step failed (two threads' calls to one peer out of
/// order fail the communicator, and the job would re-form in another generation, restoring
/// the same bits from its checkpoint).
fn one_generation(c: &Cluster, job: &str) {
    let h = c.history(job);
    assert_eq!(h.len(), 1, "job {job} re-formed:\n{h:#?}\n{}", c.logs());
}

/// Each rank decides by its own node's cores whether its buckets overlap the backward: a
/// generation with one rank on a node of its own (a spare core: the communication thread) and
/// two on another (none: the buckets after the backward) pairs the same buckets in the same
/// order, and every rank holds the same weights. (Before the two schedules shared one bucket
/// plan, such a generation summed one rank's head with another's embedding, silently.)
#[test]
fn training_ranks_with_and_without_a_spare_core_reduce_the_same_buckets() {
    let c = Cluster::start(Spec {
        agents: vec![("node1".into(), 1), ("node2".into(), 2)],
        ..Spec::default()
    });
    let data = synth(c.dir.path(), "tokens", 60_000);
    c.submit(&format!(
        "{}max_steps = 100000\nbucket_mb = 1\n[training.model_config]\nd_model = 128\nn_layer = 3\nn_head = 4\n",
        training_toml("mixed", 3, 3, 3, "gpt", &data, "")
    ));
    let v = c.wait_world("mixed", 3, S(60));
    c.wait_step("mixed", 40, S(120));
    let w = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(c.weights("mixed", v.generation, 3));
    assert!(w.windows(2).all(|x| x[0] == x[1]), "{w:?}");
    if std::thread::available_parallelism().map_or(1, |n| n.get()) == 2 {
        let logs = c.logs();
        let threaded = logs
            .lines()
            .filter(|l| l.contains("job=mixed") && l.contains("on a communication thread"))
            .count();
        assert_eq!(threaded, 1, "node1's rank alone has a spare core (of 2)");
    }
}

/// Ranks of two builds that cut their gradient buckets differently would add one rank's head
/// to another's embedding without an error (node2's workers plan as builds before the one-plan
/// fix did: `DUCTILE_FAULT_OLD_BUCKET_PLAN`). Each agreement compares the ranks' digests of
/// what their collectives sum, so they stop at their first, naming the ranks, and no step is
/// trained on mismatched sums.
#[test]
fn training_ranks_of_two_builds_stop_rather_than_sum_mismatched_buckets() {
    let c = Cluster::start(Spec {
        agents: vec![("node1".into(), 1), ("node2".into(), 1)],
        ..Spec::default()
    });
    let data = synth(c.dir.path(), "tokens", 20_000);
    c.submit(&format!(
        "{}max_steps = 200\nbucket_mb = 1\n[training.model_config]\nd_model = 128\nn_layer = 3\nn_head = 4\n",
        training_toml(
            "two",
            2,
            2,
            2,
            "gpt",
            &data,
            "restart_budget = 1\nallow_fault_injection = true\nenv = { DUCTILE_FAULT_OLD_BUCKET_PLAN = \"node2\" }"
        )
    ));
    let said = c.wait_for(S(120), "the ranks' refusal", || {
        c.logs()
            .lines()
            .find(|l| l.contains("job=two") && l.contains("gradient buckets otherwise than rank"))
            .map(str::to_string)
    });
    assert!(
        said.contains("do all nodes run the same ductile-worker build"),
        "{said}"
    );
    println!("{said}");
    assert_eq!(
        c.status("two").step,
        0,
        "nothing was trained on mismatched sums"
    );
}

#[test]
fn training_bad_training_specs_are_refused_before_any_worker_starts() {
    let c = Cluster::start(Spec::default().agents(1, 2));
    let cases = [
        (
            training_toml("b1", 1, 2, 2, "resnet", "file:///d", ""),
            "invalid training.model: \"resnet\" is unknown",
        ),
        (
            training_toml("b2", 1, 4, 2, "gpt", "file:///d", "")
                .replace("global_batch = 32", "global_batch = 3"),
            "invalid training.global_batch: 3 cannot be split over max = 4",
        ),
        (
            format!(
                "{}deterministic = true\nlogical_shards = 2\n",
                training_toml("b3", 1, 4, 2, "gpt", "file:///d", "")
            ),
            "invalid training.logical_shards: 2 is below max = 4",
        ),
        (
            training_toml("b4", 1, 2, 2, "gpt", "file:///d", "")
                .replace("dataset = \"file:///d\"\n", ""),
            "missing field `dataset`",
        ),
        (
            training_toml("b5", 1, 2, 2, "gpt", "https://x/d", ""),
            "invalid training.dataset",
        ),
        (
            format!(
                "{}[training.model_config]\nd_model = 64\nn_head = 0\n",
                training_toml("b6", 1, 2, 2, "gpt", "file:///d", "")
            ),
            "invalid training.model_config.n_head: 0 is outside",
        ),
        (
            format!(
                "{}[training.model_config]\nn_layers = 4\n",
                training_toml("b7", 1, 2, 2, "gpt", "file:///d", "")
            ),
            "unknown field `n_layers`",
        ),
        // a bad recipe (issue 49), named by its key
        (
            format!(
                "{}[training.optimizer]\nname = \"adamw\"\nweight_decay = -0.1\n",
                training_toml("b8", 1, 2, 2, "gpt", "file:///d", "")
            ),
            "invalid training.optimizer.weight_decay: -0.1 is not a number at or above 0",
        ),
        (
            format!(
                "{}max_steps = 100\n[training.lr_schedule]\nwarmup_steps = 200\n",
                training_toml("b9", 1, 2, 2, "gpt", "file:///d", "")
            ),
            "invalid training.lr_schedule.warmup_steps: 200 is past max_steps = 100",
        ),
        (
            format!(
                "{}max_steps = 100\n[training.lr_schedule]\ndecay = \"exponential\"\n",
                training_toml("b10", 1, 2, 2, "gpt", "file:///d", "")
            ),
            "invalid training.lr_schedule.decay: \"exponential\" is unknown",
        ),
        (
            format!(
                "{}[training.optimizer]\nname = \"sgd\"\nbetas = [0.9, 0.99]\n",
                training_toml("b11", 1, 2, 2, "gpt", "file:///d", "")
            ),
            "invalid training.optimizer.betas: is a setting of \"adamw\", not of \"sgd\"",
        ),
    ];
    assert_refused(&c, &cases);
    assert!(!c.logs().contains("worker started"));
}

#[test]
fn training_reads_its_dataset_from_s3() {
    let c = Cluster::start(Spec {
        s3: true,
        ..Spec::default().agents(1, 2)
    });
    let s3 = c.s3.as_ref().unwrap();
    let url = synth_to(
        &format!("s3://{}/datasets/tokens.bin", s3.bucket),
        "tokens",
        30_000,
        &s3.env(),
    );
    c.submit(&format!(
        "{}max_steps = 150\n",
        training_toml("s3data", 1, 2, 2, "gpt", &url, "")
    ));
    let v = c.wait_done("s3data", S(120));
    assert_eq!(v.step, 150);
    assert!(v.loss.unwrap() < 3.5, "loss {:?}", v.loss);
    // a missing object is a clear error, and the worker names it
    c.submit(&format!(
        "{}max_steps = 10\n",
        training_toml(
            "s3missing",
            1,
            1,
            1,
            "gpt",
            &format!("s3://{}/datasets/nope.bin", s3.bucket),
            "restart_budget = 0"
        )
    ));
    c.wait_for(S(30), "the missing dataset reported", || {
        c.logs().contains("datasets/nope.bin").then_some(())
    });
}

/// A slot that offers a GPU the machine does not have (GPU 99: none on CI's machine, nor on
/// any GPU machine this runs on): its worker fails at start with a message naming what is
/// missing, is not restarted, the job shows the message in its generation history and status,
/// and trains on without it. No worker hangs.
#[test]
fn training_a_gpu_slot_without_a_gpu_fails_at_start_with_a_clear_error_and_the_job_goes_on() {
    let mut c = Cluster::start(Spec::default().agents(1, 2));
    c.start_agent("gpunode", 1, &["--gpus", "99"]);
    let data = synth(c.dir.path(), "tokens", 60_000);
    c.submit(&format!(
        "{}max_steps = 100000\n",
        training_toml("g1", 1, 3, 3, "gpt", &data, "restart_budget = 5")
    ));
    // the GPU worker leaves at once; the job re-forms with the two CPU slots and trains
    let failed = c.wait_for(S(90), "a generation that names the missing GPU", || {
        c.history("g1")
            .into_iter()
            .find(|g| g.reason == Reason::Failure && g.detail.contains("gpunode/0"))
    });
    assert!(
        failed.detail.contains("exit code 78")
            && failed.detail.contains("cuda:0")
            && failed.detail.contains("CUDA is not usable"),
        "{}",
        failed.detail
    );
    assert_eq!(failed.world_size, 2);
    let v = c.wait_step("g1", failed.resume_step + 20, S(120));
    assert_eq!(v.world_size, 2);
    assert!(v.members.iter().all(|m| m.node == "node1"));
    // not restarted: the restart budget is untouched and the slot stays out
    let nodes = c.dctl_ok(&["nodes", "--json"]);
    assert!(nodes.contains("gpunode"), "{nodes}");
    std::thread::sleep(S(3));
    let later = c.history("g1");
    assert!(
        later
            .iter()
            .filter(|g| g.members.iter().any(|m| m.node == "gpunode"))
            .count()
            <= 1,
        "the GPU slot was tried again: {later:?}"
    );
    // the agent's log holds the worker's own words
    assert!(c.logs().contains("cannot run on gpunode/0"), "{}", c.logs());
}

/// A worker slowed 4× (`DUCTILE_SLOWDOWN`, honoured because the job allows fault injection)
/// stands out in `dctl status` and the metrics: its compute time per step is the longest,
/// while every rank's wall time per step is the same (they wait for it). Without
/// `allow_fault_injection` the variable is refused at submit.
#[test]
fn training_a_slowed_worker_shows_as_the_straggler_in_status_and_metrics() {
    let c = Cluster::start(Spec::default().agents(2, 1));
    let data = synth(c.dir.path(), "tokens", 60_000);
    let spec = |extra: &str| {
        format!(
            "{}max_steps = 1000000\n",
            training_toml("s", 1, 2, 2, "gpt", &data, extra)
        )
    };
    let p = c.dir.path().join("refused.toml");
    std::fs::write(&p, spec("env = { DUCTILE_SLOWDOWN = \"1:4\" }")).unwrap();
    let (ok, _, err) = c.dctl(&["submit", p.to_str().unwrap()]);
    assert!(!ok && err.contains("allow_fault_injection"), "{err}");
    c.submit(&spec(
        "allow_fault_injection = true\nenv = { DUCTILE_SLOWDOWN = \"1:4\" }",
    ));
    c.wait_world("s", 2, S(60));
    let v = c.wait_for(S(60), "both ranks' step figures", || {
        Some(c.status("s")).filter(|v| v.members.iter().all(|m| m.compute_ms.is_some()))
    });
    let compute = |r: u32| {
        v.members
            .iter()
            .find(|m| m.rank == r)
            .and_then(|m| m.compute_ms)
            .unwrap()
    };
    assert!(
        compute(1) > 2.0 * compute(0),
        "rank 1 is the straggler: {:?}",
        v.members
    );
    let (_, out, _) = c.dctl(&["status", "s"]);
    assert!(out.contains("COMPUTE_MS"), "{out}");
    let (code, metrics) = http("GET", &format!("{}/metrics", c.endpoint()), &[], b"").unwrap();
    assert_eq!(code, 200);
    assert!(
        metrics.contains("ductile_rank_compute_seconds{job=\"s\",rank=\"1\"}"),
        "{metrics}"
    );
}

//! DiLoCo (`sync = "diloco"`): local steps, outer steps on averaged pseudo-gradients, elastic
//! and exactly-once across committed rounds. Real etcd, daemon, agents and tch workers.

use std::time::Duration;

use ductile_cluster::records::Reason;
use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

/// A DiLoCo job of the tokens dataset in `data` (624 samples of ctx 32), global batch 32.
fn diloco_toml(name: &str, desired: u32, data: &str, steps: u64, diloco: &str) -> String {
    format!(
        "{}max_steps = {steps}\nsync = \"diloco\"\noptimizer = \"adamw\"\nmodel_config = {{ d_model = 32, n_layer = 1, n_head = 2 }}\n[training.diloco]\n{diloco}\n",
        training_toml(name, 1, 3, desired, "gpt", data, "restart_budget = 50")
    )
}

fn wait_round(c: &Cluster, job: &str, round: u64) -> ductile_cluster::api::JobView {
    c.wait_for(S(120), &format!("job {job} past round {round}"), || {
        Some(c.status(job)).filter(|v| v.round.is_some_and(|r| r >= round))
    })
}

#[test]
fn diloco_a_kill_and_a_join_mid_round_commit_every_sample_once() {
    let ledger = TempDir::new("ledger");
    let c = ledger_cluster(&ledger);
    let data = synth(c.dir.path(), "tokens", 20_000);
    // 3,000 steps of 32 = 96,000 positions, about 154 epochs of 624 samples, in rounds of 50
    let steps = 3000;
    c.submit(&diloco_toml(
        "d1",
        3,
        &data,
        steps,
        "inner_steps = 50\nouter_lr = 0.7\nouter_momentum = 0.9",
    ));
    let v = c.wait_world("d1", 3, S(30));
    let early = wait_round(&c, "d1", 3);
    assert_eq!(early.sync.as_deref(), Some("diloco"));
    // mid-round (the rounds are almost all local steps): the fourth slot joins in its place
    let victim = v.members[1].pid.unwrap();
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    c.wait_for(S(60), "a failure generation", || {
        c.history("d1")
            .into_iter()
            .find(|g| g.reason == Reason::Failure)
    });
    let later = c.wait_world("d1", 3, S(60));
    assert!(
        later.members.iter().all(|m| m.pid != Some(victim)),
        "{later:?}"
    );
    let done = c.wait_done("d1", S(300));
    assert!(done.final_weights_sha256.is_some());
    let last = c.status("d1");
    assert!(
        last.loss.unwrap() < early.loss.unwrap(),
        "{early:?} → {last:?}"
    );
    let (v, rounds) = ductile_tests::ledger::round_violations(ledger.path(), steps * 32, 624);
    assert!(v.is_empty(), "{v:#?}");
    // the round the victim left committed less than a round's 1,600 samples, and its piece
    // went to the next one
    // (round 0 is a probe of a tenth of a round, to measure the replicas' speeds)
    assert_eq!(rounds[0], 160, "{rounds:?}");
    let short = rounds.iter().skip(1).position(|n| *n < 1600).map(|r| r + 1);
    assert!(
        short.is_some_and(|r| rounds.get(r + 1).is_some_and(|n| *n > 1600)),
        "{rounds:?}"
    );
}

#[test]
fn diloco_streaming_int8_fragments_train_through_a_shrink_and_a_grow_and_deterministic_runs_agree()
{
    let ledger = TempDir::new("ledger");
    let c = ledger_cluster(&ledger);
    let data = synth(c.dir.path(), "tokens", 20_000);
    // long enough to outlive the shrink, a report a second later and the grow (rounds take
    // about 80 ms here: 480 steps could end before the grow)
    let steps = 960;
    c.submit(&diloco_toml(
        "d2",
        3,
        &data,
        steps,
        "inner_steps = 16\nquantize = \"int8\"\nfragments = 4",
    ));
    c.wait_world("d2", 3, S(30));
    let early = wait_round(&c, "d2", 2);
    c.dctl_ok(&["scale", "d2", "2"]);
    c.wait_world("d2", 2, S(60));
    let mid = wait_round(&c, "d2", early.round.unwrap() + 3);
    c.dctl_ok(&["scale", "d2", "3"]);
    c.wait_world("d2", 3, S(60));
    let shown = c.dctl_ok(&["status", "d2"]);
    assert!(shown.contains("sync        diloco"), "{shown}");
    let done = c.wait_done("d2", S(300));
    assert!(done.final_weights_sha256.is_some());
    let last = c.status("d2");
    assert!(
        last.loss.unwrap() < early.loss.unwrap(),
        "{early:?} → {last:?}"
    );
    // int8 pseudo-gradients once a round: an f32 all-reduce of the gradient (about 30 K
    // parameters) every step would send 2·(W − 1)·4·N / 32 = 7,500 bytes per sample at W = 2
    let bps = mid.bytes_per_sample.unwrap();
    assert!(bps > 0.0 && bps < 750.0, "{bps} bytes per sample");
    let (v, _) = ductile_tests::ledger::round_violations(ledger.path(), steps * 32, 624);
    assert!(v.is_empty(), "{v:#?}");

    // deterministic mode: the same spec and the same members every round give the same bits
    let det = |name: &str| {
        c.submit(
            &diloco_toml(
                name,
                2,
                &data,
                64,
                "inner_steps = 8\nquantize = \"fp16\"\nfragments = 2",
            )
            .replace("[training]\n", "[training]\ndeterministic = true\n"),
        );
        c.wait_done(name, S(180)).final_weights_sha256.unwrap()
    };
    let (a, b) = (det("d3"), det("d4"));
    assert_eq!(a, b, "two deterministic DiLoCo runs differ");
}

/// Streaming DiLoCo: a member that leaves between two of a round's exchanges has moved the
/// samples it trained before the first into the global weights: the round keeps them (the
/// ledger shows the completed exchange) and only the untrained rest of its piece is trained
/// again, so every sample is still committed once.
#[test]
fn diloco_a_member_lost_between_two_streaming_exchanges_keeps_what_it_exchanged_once() {
    let ledger = TempDir::new("ledger");
    let c = ledger_cluster(&ledger);
    let data = synth(c.dir.path(), "tokens", 20_000);
    let steps = 480;
    c.submit(
        &diloco_toml("d6", 3, &data, steps, "inner_steps = 16\nfragments = 4").replace(
            "restart_budget = 50",
            "restart_budget = 50\nallow_fault_injection = true\nenv = { DUCTILE_FAULT_EXIT_BETWEEN_EXCHANGES = \"1:3\" }",
        ),
    );
    c.wait_world("d6", 3, S(30));
    c.wait_for(S(120), "a failure generation", || {
        c.history("d6")
            .into_iter()
            .find(|g| g.reason == Reason::Failure)
    });
    let done = c.wait_done("d6", S(300));
    assert!(done.final_weights_sha256.is_some());
    let (v, rounds) = ductile_tests::ledger::round_violations(ledger.path(), steps * 32, 624);
    assert!(v.is_empty(), "{v:#?}");
    // round 3 kept the departed member's exchanged samples; the rest of its piece went to
    // round 4
    let kept: Vec<serde_json::Value> = std::fs::read_dir(ledger.path())
        .unwrap()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f.unwrap().path()).unwrap();
            text.lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter(|v| v["round"] == 3 && v["committed"] == true)
                .map(|v| v["kept"].clone())
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        kept.iter().any(|k| k
            .as_array()
            .is_some_and(|a| a.len() == 1 && a[0][2].as_u64() > Some(0))),
        "{kept:?}"
    );
    assert!(rounds[3] < 512 && rounds[4] > 512, "{rounds:?}");
}

#[test]
fn diloco_checkpoints_hold_the_rounds_and_a_cold_start_at_another_size_resumes_them() {
    let ledger = TempDir::new("ledger");
    let c = ledger_cluster(&ledger);
    let data = synth(c.dir.path(), "tokens", 20_000);
    let dir = c.dir.path().join("ckpt-d5");
    // rounds of 10 steps (320 positions; deterministic mode: even pieces, no probe round);
    // the commit of round 3 reaches step 40: a checkpoint
    let job = |desired: u32| {
        format!(
            "{}[checkpoint]\nurl = \"file://{}\"\ninterval = 40\nkeep = 3\n",
            diloco_toml("d5", desired, &data, 60, "inner_steps = 10")
                .replace("[training]\n", "[training]\ndeterministic = true\n")
                // the inner optimizer with a recipe of the job's own (issue 49)
                .replace(
                    "optimizer = \"adamw\"\n",
                    "optimizer = { name = \"adamw\", betas = [0.9, 0.99], weight_decay = 0.1, no_decay = [\"ln\"] }\nlr_schedule = { warmup_steps = 5, decay = \"linear\" }\n",
                ),
            dir.display()
        )
    };
    c.submit(&job(3));
    let first = c.wait_done("d5", S(180));
    let m: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            dir.join(ductile_checkpoint::format::attempt_dir(40, 1))
                .join("manifest.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let x = &m["extra"]["diloco"];
    assert_eq!(
        (&x["round"], &x["cursor"], &x["work"]),
        (
            &serde_json::json!(4),
            &serde_json::json!(1600),
            &serde_json::json!([[1280, 1600]])
        ),
        "{x}"
    );
    // the recipe, resolved, in the checkpoint (a restore compares it with the job's)
    let r = &m["extra"]["recipe"];
    assert_eq!(r["optimizer"]["weight_decay"], 0.1, "{r}");
    assert_eq!(r["lr_schedule"]["decay"], "linear", "{r}");
    let names: Vec<&str> = m["order"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    assert!(
        names.iter().any(|n| n.starts_with("outer_optimizer."))
            && !names.iter().any(|n| n.starts_with("optimizer.")),
        "{names:?}"
    );
    // submitted again at another size: a cold start from step 40, every member the same bits
    c.submit(&job(2));
    let (_, w) = joined_weights(&c, "d5", first.generation + 1);
    assert_eq!(w.len(), 2);
    assert!(
        w.iter().all(|x| x == &w[0] && x.starts_with("40:")),
        "{w:?}"
    );
    let again = c.wait_done("d5", S(180));
    assert_eq!(again.step, 60);
    assert!(again.eval_loss.is_some());
    // rounds 4 and 5 were committed again by the new run's processes; every position once
    let (v, rounds) = ductile_tests::ledger::round_violations(ledger.path(), 60 * 32, 624);
    assert!(v.is_empty(), "{v:#?}");
    assert_eq!(rounds.len(), 6, "{rounds:?}");
}

#[test]
fn diloco_and_async_specs_that_cannot_run_are_refused_at_submit() {
    let c = Cluster::start(Spec::default().agents(1, 1));
    let base = |extra: &str, diloco: &str| {
        format!(
            "{}sync = \"diloco\"\n{extra}[training.diloco]\n{diloco}\n",
            training_toml("r", 1, 2, 2, "gpt", "file:///d", "")
        )
    };
    assert_refused(
        &c,
        &[
            (
                training_toml("r", 1, 2, 2, "gpt", "file:///d", "")
                    + "sync = \"async\"\ndeterministic = true\n",
                "cannot be deterministic",
            ),
            (
                training_toml("r", 1, 2, 2, "gpt", "file:///d", "")
                    + "sync = \"async\"\n[training.async]\nstaleness = 5000\n",
                "staleness",
            ),
            (
                training_toml("r", 1, 2, 2, "gpt", "file:///d", "") + "sync = \"gossip\"\n",
                "unknown",
            ),
            (base("", "inner_steps = 0"), "inner_steps"),
            (base("", "outer_momentum = 1.0"), "outer_momentum"),
            (base("", "quantize = \"int4\""), "quantize"),
            (base("", "inner_steps = 4\nfragments = 8"), "fragments"),
            (base("strategy = \"pipeline\"\n", ""), "data-parallel"),
        ],
    );
}

/// `max_grad_norm` with DiLoCo and async clips each rank's own gradient by its own norm (a
/// rank is the whole replica there): a DiLoCo replica's inner step, an async worker's push.
/// Plain SGD at a large rate trains the model; clipped to a tiny norm, each step moves it by
/// at most rate × that norm, so its held-out loss stays the untrained model's, and the norm
/// reported is the gradient's before clipping, far above the bound.
#[test]
fn diloco_and_async_clip_each_rank_s_gradient_by_its_own_norm() {
    let c = Cluster::start(Spec::default().agents(2, 1));
    let data = synth(c.dir.path(), "tokens", 20_000);
    let job = |name: &str, sync: &str, lr: &str, extra: &str| {
        let mode = match sync {
            "diloco" => "[training.diloco]\ninner_steps = 10\n",
            _ => "[training.async]\nstaleness = 2\n",
        };
        format!(
            "{}max_steps = 60\nsync = \"{sync}\"\neval_fraction = 0.1\neval_samples = 32\noptimizer = {{ name = \"sgd\", momentum = 0.0, weight_decay = 0.0 }}\nlr_schedule = {{ warmup_steps = 0, decay = \"constant\" }}\n{extra}\nmodel_config = {{ d_model = 32, n_layer = 1, n_head = 2 }}\n{mode}",
            training_toml(name, 2, 2, 2, "gpt", &data, "restart_budget = 5")
                .replace("lr = 3e-3", &format!("lr = {lr}"))
        )
    };
    for sync in ["diloco", "async"] {
        let run = |name: &str, lr: &str, extra: &str| {
            c.submit(&job(name, sync, lr, extra));
            c.wait_done(name, S(180))
        };
        // (the untrained model's held-out loss: a rate too small to move it)
        let start = run(&format!("start-{sync}"), "1e-30", "").eval_loss;
        let trained = run(&format!("free-{sync}"), "1.0", "").eval_loss;
        let clipped = run(&format!("clipped-{sync}"), "1.0", "max_grad_norm = 1e-6");
        let (start, trained, end) = (start.unwrap(), trained.unwrap(), clipped.eval_loss.unwrap());
        let norm = clipped.grad_norm;
        println!(
            "{sync}: held-out loss {start:.5} untrained, {trained:.5} trained, {end:.5} clipped to 1e-6 (norm before clipping {norm:?})"
        );
        assert!(
            norm.is_some_and(|n| n > 1e-3),
            "{sync}: the norm before clipping: {norm:?}"
        );
        assert!(
            trained < start - 0.3,
            "{sync}: the unclipped run trains: {start} → {trained}"
        );
        assert!(
            (end - start).abs() < 1e-3,
            "{sync}: the clipped run's held-out loss moved from {start} to {end}"
        );
    }
}

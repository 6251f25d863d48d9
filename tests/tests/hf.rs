//! Hugging Face models (issue 31): Llama and GPT-2 directories written by transformers
//! (tests/hf/make_fixtures.py, run by scripts/setup.sh) train with ductile from their own
//! weights, loaded by plan, at every layout, bit for bit the same through a kill and resizes,
//! and export back to directories transformers loads; what ductile cannot honour is refused
//! at submit.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

/// A corpus of `docs` JSON lines, tokenized with the model's tokenizer by `ductile-worker
/// tokenize`: the stream's URL and its token count.
fn corpus(dir: &Path, model: &Path, docs: usize) -> (String, u64) {
    let jsonl = dir.join("corpus.jsonl");
    let words = [
        "elastic", "training", "keeps", "going", "when", "a", "node", "dies", "Madrid", "Spain",
        "capital", "the", "of", "is", "step", "sample",
    ];
    let mut text = String::new();
    for i in 0..docs {
        let line: Vec<&str> = (0..12)
            .map(|k| words[(i * 7 + k * k * 3 + k) % words.len()])
            .collect();
        text.push_str(&serde_json::json!({"text": format!("{} {i}.", line.join(" "))}).to_string());
        text.push('\n');
    }
    std::fs::write(&jsonl, text).unwrap();
    let out = format!("file://{}/corpus.tok", dir.display());
    let tokens = tokenize(model, &jsonl, &out);
    (out, tokens)
}

/// SHA-256 of a model directory's weights as ductile hashes a job's final weights (each
/// tensor's f32 bytes, in name order), computed by Python's safetensors.
fn directory_weights_sha256(model: &Path) -> String {
    let script = r#"
import glob, hashlib, sys
from safetensors.numpy import load_file
t = {}
for f in sorted(glob.glob(sys.argv[1] + "/model*.safetensors")):
    t.update(load_file(f))
h = hashlib.sha256()
for n in sorted(t):
    h.update(t[n].astype("<f4").tobytes())
print(h.hexdigest())
"#;
    torch_python(script, &[model]).trim().to_string()
}

/// How far the logits transformers computes from the exported directory `out` are from the
/// fixture `model`'s reference logits (relative to their largest magnitude).
fn export_logits_error(out: &Path, model: &Path) -> f64 {
    let said = torch_python(
        r#"
import sys, torch
from transformers import AutoModelForCausalLM
from safetensors.torch import load_file
ref = load_file(sys.argv[2] + "/reference.safetensors")
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, attn_implementation="sdpa")
m.eval()
with torch.no_grad():
    logits = m(input_ids=ref["input_ids"][:, :16]).logits
d = (logits - ref["logits"]).abs().max() / ref["logits"].abs().max()
print(float(d))
"#,
        &[out, model],
    );
    said.trim().parse().unwrap()
}

fn hf_job(name: &str, desired: u32, model: &Path, data: &str, steps: u64, extra: &str) -> String {
    format!(
        "name = \"{name}\"\nmin = 1\nmax = 4\ndesired = {desired}\nrestart_budget = 20\n[training]\nmodel = \"hf\"\nmodel_path = \"file://{}\"\ndataset = \"{data}\"\nglobal_batch = 32\nlr = 3e-3\nseed = 7\nmax_steps = {steps}\nmodel_config = {{ ctx = 16 }}\n{extra}\n",
        model.display()
    )
}

/// The fixture Llama (GQA, Llama 3.1 RoPE, sharded weights) trains from its directory: in
/// deterministic mode a dp2×tp2 run through a kill and resizes 4 → 2 → 4, a pipeline of two
/// stages and a data-parallel run at 2 end with the same weights, every sample used once;
/// loaded by plan at dp1×tp2 with a learning rate too small to move a weight, the final
/// weights are the directory's, bit for bit (and so are DiLoCo's and async's), and the export
/// of its checkpoint gives transformers' reference logits; `init = "random"` starts elsewhere.
#[test]
fn hf_llama_trains_from_its_directory_at_every_layout_bitwise_equal() {
    let model = hf_fixtures().join("llama");
    let ledger = TempDir::new("hf-ledger");
    let c = ledger_cluster(&ledger);
    let (data, tokens) = corpus(c.dir.path(), &model, 600);
    let samples = (tokens - 1) / 16;
    assert!(samples > 200, "{tokens} tokens");

    let steps = 120u64;
    // with a recipe of the job's own (issue 49): AdamW's settings, no decay on the norms, a
    // warm-up from 0 then a sqrt decay
    let det = "deterministic = true\nlogical_shards = 4\ntensor_slices = 2\n\
        optimizer = { name = \"adamw\", betas = [0.9, 0.98], eps = 1e-7, weight_decay = 0.1, no_decay = [\"norm\"] }\n\
        lr_schedule = { warmup_steps = 12, warmup_from_zero = true, decay = \"sqrt\", min_lr = 3e-4 }";
    c.submit(&hf_job(
        "tp",
        4,
        &model,
        &data,
        steps,
        &format!("{det}\nstrategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1"),
    ));
    let v = c.wait_world("tp", 4, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp2×pp1×tp2");
    c.wait_step("tp", 20, S(120));
    let victim = v
        .members
        .iter()
        .find(|m| m.dp_rank == 0 && m.tp_rank == 1)
        .unwrap();
    kill_and_reform(&c, "tp", victim.pid.unwrap(), 3);
    c.wait_step("tp", c.status("tp").step + 15, S(120));
    c.wait_world("tp", 4, S(60));
    c.dctl_ok(&["scale", "tp", "2"]);
    c.wait_world("tp", 2, S(90));
    c.wait_step("tp", c.status("tp").step + 15, S(120));
    c.dctl_ok(&["scale", "tp", "4"]);
    c.wait_world("tp", 4, S(60));
    let tp = c.wait_done("tp", S(300));
    let v = ductile_tests::ledger::violations(ledger.path(), steps, samples, 32);
    assert!(v.is_empty(), "{v:#?}");

    // loaded by plan, gathered whole: the directory's bytes
    let ck = c.dir.path().join("frozen-ck");
    c.submit(&format!(
        "{}[checkpoint]\nurl = \"file://{}\"\ninterval = 3\nkeep = 2\n",
        hf_job(
            "frozen",
            2,
            &model,
            &data,
            3,
            "lr = 1e-30\nstrategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1",
        )
        .replace("lr = 3e-3\n", ""),
        ck.display()
    ));
    let frozen = c.wait_done("frozen", S(120));
    assert_eq!(
        frozen.final_weights_sha256.unwrap(),
        directory_weights_sha256(&model),
        "the weights loaded by plan at tp 2 are not the directory's"
    );
    // DiLoCo's and async's replicas start from the directory too
    let want = directory_weights_sha256(&model);
    for (name, extra) in [
        (
            "frozen-diloco",
            "sync = \"diloco\"\n[training.diloco]\ninner_steps = 2\n",
        ),
        ("frozen-async", "sync = \"async\"\n"),
    ] {
        c.submit(
            &hf_job(
                name,
                2,
                &model,
                &data,
                4,
                &format!("lr = 1e-30\nstrategy = \"data-parallel\"\n{extra}"),
            )
            .replace("lr = 3e-3\n", ""),
        );
        let done = c.wait_done(name, S(120));
        assert_eq!(done.final_weights_sha256.unwrap(), want, "{name}");
    }
    // its checkpoint (saved as two tensor slices), exported, is the model transformers loads
    let out = c.dir.path().join("frozen-export");
    c.dctl_ok(&[
        "export",
        "frozen",
        "--out",
        &format!("file://{}", out.display()),
    ]);
    let d = export_logits_error(&out, &model);
    assert!(
        d < 1e-5,
        "transformers' logits from the export differ by {d:e}"
    );

    c.submit(&hf_job(
        "pp",
        2,
        &model,
        &data,
        steps,
        &format!("{det}\nstrategy = \"pipeline\"\npipeline_parallel = 2"),
    ));
    let v = c.wait_world("pp", 2, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp1×pp2×tp1");
    let pp = c.wait_done("pp", S(300));

    c.submit(&hf_job(
        "dp",
        2,
        &model,
        &data,
        steps,
        &format!("{det}\nstrategy = \"data-parallel\""),
    ));
    let dp = c.wait_done("dp", S(300));
    let reference = dp.final_weights_sha256.clone().unwrap();
    assert_eq!(
        tp.final_weights_sha256.unwrap(),
        reference,
        "dp2×tp2 through a kill and resizes"
    );
    assert_eq!(
        pp.final_weights_sha256.unwrap(),
        reference,
        "two pipeline stages"
    );
    assert!(
        dp.loss.unwrap() < 5.0,
        "training lowered the loss from the random model's ~5.7: {:?}",
        dp.loss
    );

    c.submit(&hf_job(
        "random",
        2,
        &model,
        &data,
        steps,
        &format!("{det}\nstrategy = \"data-parallel\"\ninit = \"random\""),
    ));
    let random = c.wait_done("random", S(300));
    assert_ne!(
        random.final_weights_sha256.unwrap(),
        reference,
        "init = \"random\" starts elsewhere"
    );
}

/// What ductile cannot honour is refused at submit, naming the key and value (or the file),
/// and nothing is stored: no config.json, an unknown architecture, a RoPE type it lacks, a
/// context past the model's, a tensor_parallel that does not divide the KV heads, GPT-2's
/// dropout (unless the job turns it off), a dropout setting other than "off".
#[test]
fn hf_directories_ductile_cannot_train_are_refused_at_submit() {
    let c = Cluster::start(Spec::default().agents(1, 1));
    let dir = c.dir.path();
    let write = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| -> PathBuf {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        let mut v: serde_json::Value = serde_json::from_slice(
            &std::fs::read(hf_fixtures().join("llama/config.json")).unwrap(),
        )
        .unwrap();
        edit(&mut v);
        std::fs::write(d.join("config.json"), v.to_string()).unwrap();
        d
    };
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let bert = write("bert", &|v| {
        v["architectures"] = serde_json::json!(["BertForMaskedLM"])
    });
    let yarn = write(
        "yarn",
        &|v| {
            v["rope_parameters"] =
                serde_json::json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
        },
    );
    // under the agents' allowed paths: the allow-lists are checked before anything is read
    let data = format!("file://{}/unused.tok", std::env::temp_dir().display());
    let job = |m: &Path, extra: &str| hf_job("bad", 1, m, &data, 10, extra);
    let llama = hf_fixtures().join("llama");
    let gpt2 = hf_fixtures().join("gpt2");
    assert_refused(
        &c,
        &[
            (job(&empty, ""), "has no config.json"),
            (
                job(&bert, ""),
                "architectures[0] = \"BertForMaskedLM\" is not implemented",
            ),
            (job(&yarn, ""), "rope_parameters.rope_type = \"yarn\""),
            (
                job(&llama, "").replace("ctx = 16", "ctx = 65"),
                "max_position_embeddings = 64",
            ),
            (
                job(&llama, "strategy = \"hybrid\"\ntensor_parallel = 4"),
                "num_key_value_heads = 2",
            ),
            // GPT-2's stock dropout, unless the job turns it off
            (
                job(&gpt2, ""),
                "resid_pdrop = 0.1: dropout is not implemented",
            ),
            (
                job(&gpt2, "").replace("ctx = 16", "ctx = 16, dropout = \"on\""),
                "training.model_config.dropout",
            ),
        ],
    );
}

/// GPT-2 in the Hub's legacy layout (no `transformer.` prefix, mask buffers beside the
/// weights; config.json with dropout 0.1, turned off by the job) loads by plan at
/// dp1×tp2 (the fused Conv1D Q/K/V split by heads along its columns), checkpoints as tensor
/// slices and exports to a directory transformers loads with the reference logits; in
/// deterministic mode dp2×tp2 through a kill, and dp2×pp2 through a kill and a restart of
/// every worker from its checkpoint (the tied embedding on the first and the last stage,
/// their gradients summed between them; every block
/// recomputed in the backward: `activation_checkpointing = "full"`), end with the bits of a
/// data-parallel run, and so does dp2×pp2×tp2; so do bf16 runs at tp2 and dp2
/// (`precision = "bf16"`).
#[test]
fn gpt2_loads_by_plan_trains_tensor_and_pipeline_parallel_through_kills_bitwise_and_exports() {
    let model = hf_fixtures().join("gpt2");
    let c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default().agents(2, 4)
    });
    let (data, _) = corpus(c.dir.path(), &model, 300);
    let job = |name: &str, desired: u32, steps: u64, extra: &str| {
        hf_job(name, desired, &model, &data, steps, extra)
            .replace("ctx = 16", "ctx = 16, dropout = \"off\"")
    };
    let ck = c.dir.path().join("frozen-ck");
    c.submit(&format!(
        "{}[checkpoint]\nurl = \"file://{}\"\ninterval = 3\nkeep = 2\n",
        job(
            "frozen",
            2,
            3,
            "lr = 1e-30\nstrategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1",
        )
        .replace("lr = 3e-3\n", ""),
        ck.display()
    ));
    let v = c.wait_world("frozen", 2, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp1×pp1×tp2");
    let before = c.wait_done("frozen", S(120)).loss.unwrap();
    let out = c.dir.path().join("frozen-export");
    c.dctl_ok(&[
        "export",
        "frozen",
        "--out",
        &format!("file://{}", out.display()),
    ]);
    let d = export_logits_error(&out, &model);
    assert!(
        d < 1e-5,
        "transformers' logits from the export differ by {d:e}"
    );

    // (8 logical shards: the dp2×pp2×tp2 run may grow to 8 ranks)
    // (clipped by global norm: the norm over the tied head's two stages and the tensor
    // slices is the data-parallel run's, so the bits are too)
    let det = "deterministic = true\nlogical_shards = 8\ntensor_slices = 2\nmax_grad_norm = 0.01";
    // (long enough for a kill to land mid-run: the model is tiny)
    let steps = 200;
    c.submit(&job(
        "tp",
        4,
        steps,
        &format!("{det}\nstrategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1"),
    ));
    let v = c.wait_world("tp", 4, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp2×pp1×tp2");
    c.wait_step("tp", 10, S(120));
    let victim = v
        .members
        .iter()
        .find(|m| m.dp_rank == 1 && m.tp_rank == 1)
        .unwrap();
    // (a free slot of the 8 takes the killed one's place at once: it receives its state from peers)
    kill_and_replace(&c, "tp", victim.pid.unwrap(), 4);
    let tp = c.wait_done("tp", S(300));
    let pp_ck = c.dir.path().join("pp-ck");
    c.submit(&format!(
        "{}[checkpoint]\nurl = \"file://{}\"\ninterval = 20\nkeep = 2\n",
        job(
            "pp",
            4,
            steps,
            &format!("{det}\nstrategy = \"pipeline\"\npipeline_parallel = 2\nactivation_checkpointing = \"full\""),
        ),
        pp_ck.display()
    ));
    let v = c.wait_world("pp", 4, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp2×pp2×tp1");
    c.wait_step("pp", 10, S(120));
    let victim = v
        .members
        .iter()
        .find(|m| m.dp_rank == 0 && m.pp_stage == 1)
        .unwrap();
    kill_and_replace(&c, "pp", victim.pid.unwrap(), 4);
    // then every worker at once: the new ones restore from the last commit, the last stage
    // its copy of the embedding from what the first stage wrote
    let v = c.wait_step("pp", 45, S(120));
    let last_gen = c.history("pp").last().unwrap().number;
    for m in &v.members {
        unsafe { libc::kill(m.pid.unwrap() as i32, libc::SIGKILL) };
    }
    // (no process that held state is left: whatever the leader's generations say while the
    // failures arrive one by one, the restarted workers can only restore the last commit)
    c.wait_for(S(60), "a generation after the restart", || {
        c.history("pp").into_iter().find(|g| g.number > last_gen)
    });
    let pp = c.wait_done("pp", S(300));
    // all three at once: the tied embedding's two stages are tensor-parallel too
    c.submit(
        &job(
            "3d",
            8,
            steps,
            &format!("{det}\nstrategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 2"),
        )
        .replace("max = 4", "max = 8"),
    );
    let v = c.wait_world("3d", 8, S(90));
    assert_eq!(v.layout.unwrap().to_string(), "dp2×pp2×tp2");
    let three = c.wait_done("3d", S(400));
    c.submit(&job(
        "dp",
        2,
        steps,
        &format!("{det}\nstrategy = \"data-parallel\""),
    ));
    let dp = c.wait_done("dp", S(300));
    let reference = dp.final_weights_sha256.clone().unwrap();
    assert_eq!(
        tp.final_weights_sha256.clone().unwrap(),
        reference,
        "dp2×tp2 through a kill against data parallel 2"
    );
    assert_eq!(
        pp.final_weights_sha256.clone().unwrap(),
        reference,
        "dp2×pp2 (a tied head on two stages) through a kill against data parallel 2"
    );
    assert_eq!(
        three.final_weights_sha256.clone().unwrap(),
        reference,
        "dp2×pp2×tp2 against data parallel 2"
    );
    println!("the last step's gradient norm: {:?}", dp.grad_norm);
    assert!(
        dp.grad_norm.is_some_and(|n| n > 0.01),
        "clipping acts: {:?}",
        dp.grad_norm
    );
    for (name, run) in [("dp2×tp2", &tp), ("dp2×pp2", &pp), ("dp2×pp2×tp2", &three)] {
        assert_eq!(run.grad_norm, dp.grad_norm, "{name}'s last gradient norm");
    }
    // full sharding (issue 47): the tied embedding's rows on four ranks, loaded from the
    // directory by plan, through a kill, end with the bits of data parallel at 2 (both
    // without tensor slices: full sharding computes each unit whole)
    let det_whole = "deterministic = true\nlogical_shards = 8";
    c.submit(&job(
        "fsdp",
        4,
        steps,
        &format!("{det_whole}\nstrategy = \"data-parallel\"\nsharding = \"full\"\n[checkpoint]\nurl = \"file://{}/fsdp-ck\"\ninterval = 20", c.dir.path().display()),
    ));
    let v = c.wait_world("fsdp", 4, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp4(shard4)×pp1×tp1");
    c.wait_step("fsdp", 10, S(120));
    // (a lost rank: its shard from its buddy copy, at the step reached)
    let last = c.history("fsdp").last().unwrap().number;
    unsafe { libc::kill(v.members[3].pid.unwrap() as i32, libc::SIGKILL) };
    c.wait_for(S(60), "the generation after the kill", || {
        c.history("fsdp").into_iter().find(|g| g.number > last)
    });
    c.wait_world("fsdp", 4, S(60));
    let fsdp = c.wait_done("fsdp", S(300));
    c.submit(&job(
        "dp-whole",
        2,
        steps,
        &format!("{det_whole}\nstrategy = \"data-parallel\""),
    ));
    let dp_whole = c.wait_done("dp-whole", S(300));
    assert_eq!(
        fsdp.final_weights_sha256, dp_whole.final_weights_sha256,
        "GPT-2 fully sharded at 4 through a kill against data parallel 2"
    );
    assert_eq!(fsdp.eval_loss, dp_whole.eval_loss);
    // bf16 products: a tensor-parallel run and a data-parallel one end with the same bits,
    // and train
    for (name, extra) in [
        (
            "bf16tp",
            "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1",
        ),
        ("bf16dp", "strategy = \"data-parallel\""),
    ] {
        c.submit(&job(
            name,
            2,
            steps,
            &format!("{det}\nprecision = \"bf16\"\n{extra}"),
        ));
    }
    let (a, b) = (c.wait_done("bf16tp", S(300)), c.wait_done("bf16dp", S(300)));
    assert_eq!(
        a.final_weights_sha256, b.final_weights_sha256,
        "bf16 at tp2 and dp2"
    );
    assert_ne!(
        a.final_weights_sha256.unwrap(),
        reference,
        "bf16 is not f32"
    );
    assert!(
        a.loss.unwrap() < before - 0.1,
        "bf16 training lowered the loss from {before}: {:?}",
        a.loss
    );
    // bf16 fully sharded (issue 47): each unit gathered in its f32 rows, its products in
    // bf16, its gradients reduced in f32 onto f32 master rows; the bits of the unsharded bf16
    // run
    for (name, extra) in [
        (
            "bf16full",
            format!(
                "sharding = \"full\"\n[checkpoint]\nurl = \"file://{}/bf16full-ck\"\ninterval = 20",
                c.dir.path().display()
            ),
        ),
        ("bf16whole", String::new()),
    ] {
        c.submit(&job(
            name,
            2,
            steps,
            &format!("{det_whole}\nstrategy = \"data-parallel\"\nprecision = \"bf16\"\n{extra}"),
        ));
    }
    let v = c.wait_world("bf16full", 2, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp2(shard2)×pp1×tp1");
    let (full, whole) = (
        c.wait_done("bf16full", S(300)),
        c.wait_done("bf16whole", S(300)),
    );
    assert_eq!(
        full.final_weights_sha256, whole.final_weights_sha256,
        "bf16 fully sharded at 2 against bf16 data parallel 2"
    );
    assert_ne!(
        whole.final_weights_sha256, dp_whole.final_weights_sha256,
        "bf16 is not f32"
    );
    // its last checkpoint, saved by two stages that both hold the embedding, exports it once:
    // the trained weights
    let out = c.dir.path().join("pp-export");
    c.dctl_ok(&[
        "export",
        "pp",
        "--out",
        &format!("file://{}", out.display()),
    ]);
    assert_eq!(
        directory_weights_sha256(&out),
        reference,
        "the export of the pp run"
    );
    // (the last loss the tensor-parallel run reported: it ran long enough to report again)
    assert!(
        tp.loss.unwrap() < before - 0.1,
        "training lowered the loss from the directory's model's {before}: {:?}",
        tp.loss
    );
}

/// Full sharding under tensor groups on a Hugging Face directory (issue 47, 2D FSDP + TP):
/// GPT-2, whose head is tied to the token embedding (the embedding's gradient sums the head's
/// use and its own across the step's units, its rows gathered for each), at
/// dp2(shard2)×pp1×tp2 trains as the unsharded tensor-parallel run does: its eval loss
/// within rounding, and lower than where it started (the layouts may change as the ranks
/// come: the job's minimum is 1). In deterministic mode it ends with the tensor layout's
/// bits, and so does the pipeline (dp2×pp2: the tied embedding on two stages, several
/// micro-batches to a logical shard), unsharded and fully sharded (each stage's copy in
/// rows between steps).
#[test]
fn gpt2_fully_sharded_under_tensor_groups_trains_as_the_tensor_layout() {
    let model = hf_fixtures().join("gpt2");
    let c = Cluster::start(Spec::default().agents(2, 2));
    let (data, _) = corpus(c.dir.path(), &model, 300);
    let job = |name: &str, steps: u64, extra: &str| {
        format!(
            "{}[checkpoint]\nurl = \"file://{}/{name}-ck\"\ninterval = 20\n",
            hf_job(
                name,
                4,
                &model,
                &data,
                steps,
                &format!(
                    "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1\neval_fraction = 0.1\neval_samples = 32\n{extra}"
                ),
            )
            .replace("ctx = 16", "ctx = 16, dropout = \"off\""),
            c.dir.path().display()
        )
    };
    // (the eval loss: the status's training loss is the last report's, whichever step it was)
    c.submit(&job("start", 1, "lr = 1e-30").replace("lr = 3e-3\n", ""));
    let start = c.wait_done("start", S(120)).eval_loss.unwrap();
    c.submit(&job("tp", 40, ""));
    let tp = c.wait_done("tp", S(300)).eval_loss.unwrap();
    c.submit(&job("full-tp", 40, "sharding = \"full\""));
    let full = c.wait_done("full-tp", S(300)).eval_loss.unwrap();
    let layouts_of = |name: &str| -> Vec<String> {
        c.history(name)
            .iter()
            .map(|g| g.layout.to_string())
            .collect()
    };
    let layouts = layouts_of("full-tp");
    println!(
        "GPT-2's eval loss: {start:.5} at the start, {tp:.5} at tp2, {full:.5} fully sharded at tp2 ({layouts:?})"
    );
    assert!(
        layouts.iter().any(|l| l == "dp2(shard2)×pp1×tp2"),
        "{layouts:?}"
    );
    assert!(
        (full - tp).abs() < 1e-3 * tp.abs(),
        "fully sharded {full} against {tp}"
    );
    assert!(full < start - 0.1, "{full} from {start}");

    // deterministic mode: the same bits as the tensor layout's (the tied embedding's
    // gradient sums, micro-batch by micro-batch, the head's and then its own, as the whole
    // model's backward does)
    let det = "deterministic = true\nlogical_shards = 4\ntensor_slices = 2\nmicro_batch = 4";
    c.submit(&job("tp-det", 12, det));
    c.wait_done("tp-det", S(300));
    c.submit(&job("full-det", 12, &format!("sharding = \"full\"\n{det}")));
    c.wait_done("full-det", S(300));
    let layouts = layouts_of("full-det");
    assert!(
        layouts.iter().any(|l| l == "dp2(shard2)×pp1×tp2"),
        "{layouts:?}"
    );
    assert_eq!(
        final_hashes(&c, "full-det"),
        final_hashes(&c, "tp-det"),
        "the deterministic 2D run's final state differs from the tensor layout's"
    );
    // with stages: the tied embedding on the first and the last stage, each stage keeping
    // its gradient of every micro-batch and both folding them in the whole model's order;
    // unsharded, then fully sharded (3D's pipeline side: each copy held in rows between
    // steps)
    let stages = |name: &str, extra: &str| {
        job(name, 12, &format!("{extra}{det}")).replace(
            "strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 1",
            "strategy = \"pipeline\"\npipeline_parallel = 2",
        )
    };
    for (name, extra, layout) in [
        ("pp-det", "", "dp2×pp2×tp1"),
        (
            "pp-full-det",
            "sharding = \"full\"\n",
            "dp2(shard2)×pp2×tp1",
        ),
    ] {
        c.submit(&stages(name, extra));
        c.wait_done(name, S(300));
        let layouts = layouts_of(name);
        assert!(layouts.iter().any(|l| l == layout), "{name}: {layouts:?}");
        assert_eq!(
            final_hashes(&c, name),
            final_hashes(&c, "tp-det"),
            "{name}: the deterministic pipeline run's final state differs from the tensor layout's"
        );
    }
}

/// SmolLM2-135M-Instruct (9 query and 3 KV heads: tensor_parallel 3) fine-tunes on a pattern
/// through a worker's kill; `dctl export` of its last checkpoint, cut into shards, is a
/// directory transformers loads, whose loss on held-out text of the pattern is lower than the
/// original model's.
#[test]
fn smollm2_fine_tunes_at_tp3_through_a_kill_and_exports_what_transformers_loads() {
    let model = PathBuf::from(
        std::env::var("DUCTILE_SMOLLM2").expect("DUCTILE_SMOLLM2 (scripts/setup.sh)"),
    );
    let c = Cluster::start(Spec {
        restart_backoff_ms: 300,
        ..Spec::default().agents(2, 2)
    });
    let dir = c.dir.path();
    let cities = [
        ("Spain", "Madrid"),
        ("France", "Paris"),
        ("Italy", "Rome"),
        ("Germany", "Berlin"),
        ("Portugal", "Lisbon"),
        ("Austria", "Vienna"),
        ("Greece", "Athens"),
        ("Norway", "Oslo"),
        ("Sweden", "Stockholm"),
        ("Poland", "Warsaw"),
        ("Ireland", "Dublin"),
        ("Hungary", "Budapest"),
    ];
    let doc = |i: usize| {
        let (a, b) = cities[i % cities.len()];
        format!(
            "Record {i}: the city of {b} is the capital of {a}, and {a} has {b} as its capital."
        )
    };
    let jsonl = dir.join("train.jsonl");
    let lines: Vec<String> = (0..400)
        .map(|i| serde_json::json!({ "text": doc(i) }).to_string())
        .collect();
    std::fs::write(&jsonl, lines.join("\n")).unwrap();
    let held_out: String = (1000..1012).map(doc).collect::<Vec<_>>().join(" ");
    let data = format!("file://{}/train.tok", dir.display());
    tokenize(&model, &jsonl, &data);
    let ck = dir.join("ck");
    c.submit(&format!(
        "name = \"smol\"\nmin = 1\nmax = 3\ndesired = 3\nrestart_budget = 20\n[training]\nmodel = \"hf\"\nmodel_path = \"file://{}\"\ndataset = \"{data}\"\nglobal_batch = 6\nlr = 2e-4\nseed = 3\nmax_steps = 24\nstrategy = \"hybrid\"\ntensor_parallel = 3\npipeline_parallel = 1\nmodel_config = {{ ctx = 48 }}\n[checkpoint]\nurl = \"file://{}\"\ninterval = 8\nkeep = 2\n",
        model.display(),
        ck.display()
    ));
    let v = c.wait_world("smol", 3, S(120));
    assert_eq!(v.layout.unwrap().to_string(), "dp1×pp1×tp3");
    c.wait_step("smol", 9, S(600));
    // a member of the tensor group dies: its slices have no other holder, so the group
    // re-forms (its agent restarts it) from the step-8 checkpoint
    let victim = v.members.iter().find(|m| m.tp_rank == 1).unwrap();
    let before = c.status("smol").generation;
    let killed = std::process::Command::new("kill")
        .args(["-9", &victim.pid.unwrap().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    c.wait_for(S(180), "the group re-formed after the kill", || {
        let s = c.status("smol");
        (s.generation > before && s.world_size == 3).then_some(())
    });
    let done = c.wait_done("smol", S(900));
    assert_eq!(done.step, 24);
    let out = dir.join("export");
    let said = c.dctl_ok(&[
        "export",
        "smol",
        "--out",
        &format!("file://{}", out.display()),
        "--max-shard-mb",
        "200",
    ]);
    assert!(said.contains("at step 24"), "{said}");
    assert!(
        out.join("model.safetensors.index.json").exists(),
        "540 MB in shards of 200"
    );
    assert!(out.join("tokenizer.json").exists());
    std::fs::write(dir.join("held_out.txt"), &held_out).unwrap();
    let said = torch_python(
        r#"
import sys, torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM
text = open(sys.argv[3]).read()
ids = torch.tensor([Tokenizer.from_file(sys.argv[2] + "/tokenizer.json").encode(text, add_special_tokens=False).ids])
def loss(d):
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        lg = m(input_ids=ids).logits
    return float(torch.nn.functional.cross_entropy(lg[0, :-1], ids[0, 1:]))
print(loss(sys.argv[1]), loss(sys.argv[2]))
"#,
        &[
            model.as_path(),
            out.as_path(),
            dir.join("held_out.txt").as_path(),
        ],
    );
    let l: Vec<f64> = said
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    assert!(
        l[1] < l[0] * 0.9,
        "held-out loss {} after fine-tuning, {} before",
        l[1],
        l[0]
    );
}

/// The recipe a user copies from transformers' Trainer gives the Trainer's run (issue 49): the
/// fixture Llama, the same samples in the same order (each step's, read from ductile's
/// ledger), global batch 16 and the recipe (AdamW betas (0.9, 0.95), eps 1e-8, weight decay
/// 0.1 with norms and biases excluded, clipping at 1.0, a linear warm-up from 0 over 10 steps
/// then a cosine to 3e-4, no dropout). ductile runs it at data parallel 2 (deterministic);
/// the Trainer in one process. The learning rate of every one of the 50 steps is the same
/// number; each step's loss is within 1e-5 relative (float sums in another order:
/// attention, the gradient's reduction, the norm in f64 here).
#[test]
fn hf_recipe_gives_the_trainer_s_learning_rates_and_losses_step_by_step() {
    let model = hf_fixtures().join("llama");
    let ledger = TempDir::new("recipe-ledger");
    let c = ledger_cluster(&ledger);
    // the fixture's tokenizer over a small corpus: ductile's token stream (header, then u16s)
    let (data, tokens) = corpus(c.dir.path(), &model, 400);
    let ctx = 16u64;
    assert!((tokens - 1) / ctx >= 160, "{tokens} tokens");
    let stream = PathBuf::from(data.strip_prefix("file://").unwrap());
    let (steps, lr, warmup, min_lr) = (50u64, 3e-3, 10u64, 3e-4);
    let recipe = format!(
        "deterministic = true\nmax_grad_norm = 1.0\n\
         optimizer = {{ name = \"adamw\", betas = [0.9, 0.95], eps = 1e-8, weight_decay = 0.1, no_decay = [\"norm\", \"bias\"] }}\n\
         lr_schedule = {{ warmup_steps = {warmup}, warmup_from_zero = true, decay = \"cosine\", min_lr = {min_lr:e} }}\n"
    );
    c.submit(
        &hf_job("recipe", 2, &model, &data, steps, &recipe)
            .replace("min = 1\n", "min = 2\n")
            .replace("global_batch = 32", "global_batch = 16"),
    );
    let done = c.wait_done("recipe", S(300));
    // the recipe, resolved, in the job's status
    let r = done.recipe.expect("the job's status shows its recipe");
    assert_eq!(r.optimizer["weight_decay"], 0.1);
    assert_eq!(r.optimizer["no_decay"], serde_json::json!(["norm", "bias"]));
    assert_eq!(r.lr_schedule.warmup_steps, warmup);
    let last = done
        .lr
        .expect("the job's status shows the last step's learning rate");
    assert_eq!(last, r.lr_schedule.at(steps - 1));

    let run = ductile_tests::ledger::steps(ledger.path()).unwrap();
    assert_eq!(
        run.len() as u64,
        steps,
        "every step applied once in the ledger"
    );
    let order: Vec<Vec<u64>> = run.values().map(|s| s.samples.clone()).collect();
    assert!(order.iter().all(|s| s.len() == 16));
    let spec = c.dir.path().join("trainer-run.json");
    std::fs::write(
        &spec,
        serde_json::json!({
            "model": model, "tokens": stream, "ctx": ctx, "batch": 16, "steps": order,
            "lr": lr, "warmup_steps": warmup, "min_lr": min_lr, "betas": [0.9, 0.95],
            "eps": 1e-8, "weight_decay": 0.1, "max_grad_norm": 1.0,
            "out": c.dir.path().join("trainer-out"),
        })
        .to_string(),
    )
    .unwrap();
    let script = repo_root().join("tests/hf/trainer_recipe.py");
    let o = std::process::Command::new(torch_python_bin())
        .arg(&script)
        .arg(&spec)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "the Trainer's run: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let said: serde_json::Value = serde_json::from_slice(
        o.stdout
            .rsplit(|b| *b == b'\n')
            .find(|l| !l.is_empty())
            .unwrap(),
    )
    .unwrap();
    let (t_lr, t_loss) = (
        said["lr"].as_array().unwrap(),
        said["loss"].as_array().unwrap(),
    );
    assert_eq!(t_lr.len() as u64, steps);
    assert_eq!(t_loss.len() as u64, steps);
    // the same parameters are spared the decay (ductile's patterns, transformers' rule)
    assert_eq!(
        said["no_decay"],
        serde_json::json!([
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.1.input_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight",
            "model.norm.weight"
        ])
    );
    let mut worst = 0f64;
    for (s, (step, t)) in run.values().zip(t_lr.iter().zip(t_loss)).enumerate() {
        let (want_lr, want_loss) = (t.0.as_f64().unwrap(), t.1.as_f64().unwrap());
        assert_eq!(step.lr, want_lr, "the learning rate of step {s}");
        let d = (step.loss - want_loss).abs() / want_loss.abs();
        worst = worst.max(d);
        assert!(
            d < 1e-5,
            "step {s}: ductile's loss {} against the Trainer's {want_loss} ({d:e} relative)",
            step.loss
        );
    }
    eprintln!("the largest relative loss difference over {steps} steps: {worst:e}");
    assert!(
        run[&(steps - 1)].loss < run[&0].loss * 0.9,
        "the run learned: {} → {}",
        run[&0].loss,
        run[&(steps - 1)].loss
    );
}

//! Real datasets (issue 32): sharded token corpora read by range from S3 through kills,
//! resizes, layout changes and a cold restart, every sample once per epoch; a held-out eval
//! split evaluated on the job's layout, equal to what transformers computes from the final
//! weights; Parquet and JSONL in; bad datasets refused at submit; a worker's memory bounded
//! over a gigabyte of tokens. Real etcd, S3 (moto), daemons, agents and workers.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use ductile_cluster::records::StateSource;
use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

/// The corpus of the S3 test: 30,000 tokens in shards of 2,048 (15 shards, the last of 1,328),
/// ctx 32: 14 × 63 + 41 = 923 samples, the last 47 (5%) held out for the eval loss.
const TOKENS: u64 = 30_000;
const SHARD: u64 = 2048;
const SAMPLES: u64 = 14 * 63 + 41;
const HELD: u64 = 47;

/// A sharded corpus on S3 trains through a kill, resizes across tensor-parallel and pipeline
/// layouts, and a SIGKILL of every worker while the job is scaled to another size (a cold
/// restart from its S3 checkpoint at 3): the ledger of global sample indices (across the
/// shards) shows every training sample used once per epoch and no held-out sample ever; the
/// eval loss is computed every 25 steps on whatever layout runs, and each rank reports how
/// long it waited for data.
#[test]
fn training_a_sharded_s3_corpus_is_read_exactly_once_through_layouts_and_a_cold_restart() {
    let ledger = TempDir::new("data-ledger");
    let c = Cluster::start(Spec {
        s3: true,
        restart_backoff_ms: 300,
        agent_env: vec![(
            "DUCTILE_LEDGER_DIR".into(),
            ledger.path().display().to_string(),
        )],
        ..Spec::default().agents(2, 2)
    });
    let s3 = c.s3.as_ref().unwrap();
    let data = synth_shards(
        &format!("s3://{}/corpus/tokens/", s3.bucket),
        TOKENS,
        SHARD,
        &s3.env(),
    );
    let ckpt = format!("s3://{}/jobs/sharded", s3.bucket);
    let steps = 300u64;
    c.submit(&format!(
        "{}max_steps = {steps}\nstrategy = \"hybrid\"\ntensor_parallel = \"auto\"\npipeline_parallel = \"auto\"\nmemory_per_slot_gib = 0.008\nmodel_config = {{ d_model = 128, n_layer = 2, n_head = 4, ctx = 32, vocab = 256 }}\neval_fraction = 0.05\neval_every = 25\neval_samples = 40\n[checkpoint]\nurl = \"{ckpt}\"\ninterval = 20\n",
        training_toml("sharded", 2, 4, 4, "gpt", &data, "restart_budget = 30")
    ));
    let v = c.wait_world("sharded", 4, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp2×pp1×tp2");
    c.wait_step("sharded", 30, S(120));
    let victim = v.members.iter().find(|m| m.rank == 1).unwrap();
    kill_and_replace(&c, "sharded", victim.pid.unwrap(), 4);
    for world in [3u32, 2] {
        c.dctl_ok(&["scale", "sharded", &world.to_string()]);
        c.wait_world("sharded", world, S(90));
        c.wait_step("sharded", c.status("sharded").step + 30, S(120));
    }
    c.dctl_ok(&["scale", "sharded", "4"]);
    c.wait_world("sharded", 4, S(90));
    // every rank says how long its steps waited for data
    let v = c.wait_for(S(30), "every rank's data wait", || {
        let s = c.status("sharded");
        (s.members.len() == 4 && s.members.iter().all(|m| m.data_ms.is_some())).then_some(s)
    });
    assert!(v.members.iter().all(|m| m.data_ms.unwrap() >= 0.0));
    // a checkpoint past this point, then every worker at once while the job shrinks to 3:
    // nothing holds state any more, the restart reads the checkpoint at the new size
    let at = v.step;
    c.wait_for(S(120), "a checkpoint after the resizes", || {
        let out = c.dctl_ok(&["checkpoints", "sharded", "--json"]);
        let list: serde_json::Value = serde_json::from_str(&out).unwrap();
        list["checkpoints"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["state"] == "committed" && k["step"].as_u64().unwrap() > at)
            .then_some(())
    });
    let last_gen = c.history("sharded").last().unwrap().number;
    let v = c.status("sharded");
    c.dctl_ok(&["scale", "sharded", "3"]);
    for m in &v.members {
        unsafe { libc::kill(m.pid.unwrap() as i32, libc::SIGKILL) };
    }
    let cold = c.wait_for(S(90), "a cold start from the checkpoint", || {
        c.history("sharded")
            .into_iter()
            .find(|g| g.number > last_gen && g.state_source == StateSource::Checkpoint)
    });
    assert!(cold.world_size < 4, "{cold:?}");
    let done = c.wait_done("sharded", S(400));
    assert_eq!(done.step, steps);
    let h = c.history("sharded");
    let layouts: BTreeSet<String> = h.iter().map(|g| g.layout.to_string()).collect();
    assert!(
        layouts.contains("dp2×pp1×tp2") && layouts.contains("dp1×pp3×tp1"),
        "{layouts:?}"
    );
    let v = ledger::violations(ledger.path(), steps, SAMPLES - HELD, 32);
    assert!(v.is_empty(), "{v:#?}");
    // the eval split: every 25 steps on the layout of the moment, and at the end
    let logs = c.logs();
    let evals: BTreeSet<u64> = logs
        .lines()
        .filter_map(|l| {
            l.split("eval at step ")
                .nth(1)?
                .split(':')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert!(evals.len() >= 8, "evals at {evals:?}");
    assert!(evals.iter().all(|s| s % 25 == 0));
    assert_eq!(done.eval_step, Some(steps));
    let l = done.eval_loss.unwrap();
    assert!(l.is_finite() && l < (256f64).ln(), "eval loss {l}");
    // a shard that goes missing is a refusal at submit naming it, not a worker's failure
    let data = synth_shards(
        &format!("file://{}/local/", c.dir.path().display()),
        TOKENS,
        SHARD,
        &[],
    );
    std::fs::remove_file(c.dir.path().join("local/shard-00004.tok")).unwrap();
    let p = c.dir.path().join("missing.toml");
    std::fs::write(
        &p,
        format!(
            "{}max_steps = 10\n",
            training_toml("missing", 1, 4, 1, "gpt", &data, "")
        ),
    )
    .unwrap();
    let (ok, _, err) = c.dctl(&["submit", p.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        err.contains("training.dataset")
            && err.contains("shard shard-00004.tok")
            && err.contains("not found"),
        "{err}"
    );
}

fn texts(n: usize, salt: usize) -> Vec<String> {
    let words = [
        "elastic", "training", "keeps", "going", "when", "a", "node", "dies", "Madrid", "Spain",
        "capital", "the", "of", "is", "step", "sample", "shard", "held", "out",
    ];
    (0..n)
        .map(|i| {
            let line: Vec<&str> = (0..14)
                .map(|k| words[(i * 5 + k * k * 3 + k + salt) % words.len()])
                .collect();
            format!("{} {i}.", line.join(" "))
        })
        .collect()
}

/// The fixture Llama trains on a corpus tokenized from JSONL into shards, with a held-out
/// eval set tokenized from Parquet (as Hugging Face datasets ship it): the eval loss the job
/// computes on its dp1×pp2×tp2 layout at its last step, and the one of its final weights, equal
/// the loss transformers computes from the exported checkpoint on the same eval samples.
/// Tokenizing twice gives identical shards; the Parquet and the same texts as JSONL give the
/// same stream; a corpus from another tokenizer is refused at submit.
#[test]
fn training_the_eval_loss_on_the_layout_equals_transformers_on_the_final_weights() {
    let model = hf_fixtures().join("llama");
    let c = Cluster::start(Spec::default().agents(2, 2));
    let dir = c.dir.path();
    let jsonl = dir.join("corpus.jsonl");
    let lines: Vec<String> = texts(300, 0)
        .iter()
        .map(|t| serde_json::json!({"text": t, "source": "test"}).to_string())
        .collect();
    std::fs::write(&jsonl, lines.join("\n") + "\n").unwrap();
    let corpus = format!("file://{}/corpus/", dir.display());
    let a = tokenize_with(&model, &[&jsonl], &corpus, &["--shard-tokens", "1500"]);
    assert!(a["shards"].as_u64().unwrap() >= 4, "{a}");
    let again = format!("file://{}/again/", dir.display());
    tokenize_with(&model, &[&jsonl], &again, &["--shard-tokens", "1500"]);
    for e in std::fs::read_dir(dir.join("corpus")).unwrap() {
        let name = e.unwrap().file_name();
        assert_eq!(
            std::fs::read(dir.join("corpus").join(&name)).unwrap(),
            std::fs::read(dir.join("again").join(&name)).unwrap(),
            "{name:?} differs between two runs"
        );
    }
    // the eval texts as Parquet (pyarrow, snappy, row groups of 16) and as JSONL
    let eval_texts = texts(60, 7);
    let pq = dir.join("eval.parquet");
    torch_python(
        "import json, sys, pyarrow as pa, pyarrow.parquet as pq\n\
         t = json.load(open(sys.argv[2]))\n\
         pq.write_table(pa.table({'text': t, 'n': list(range(len(t)))}), sys.argv[1], row_group_size=16)\n",
        &[pq.to_str().unwrap(), &{
            let p = dir.join("eval.json");
            std::fs::write(&p, serde_json::to_string(&eval_texts).unwrap()).unwrap();
            p.display().to_string()
        }],
    );
    let eval_jsonl = dir.join("eval.jsonl");
    std::fs::write(
        &eval_jsonl,
        eval_texts
            .iter()
            .map(|t| serde_json::json!({ "text": t }).to_string() + "\n")
            .collect::<String>(),
    )
    .unwrap();
    let eval = format!("file://{}/eval.tok", dir.display());
    tokenize_with(&model, &[&pq], &eval, &[]);
    tokenize_with(
        &model,
        &[&eval_jsonl],
        &format!("file://{}/eval-jsonl.tok", dir.display()),
        &[],
    );
    assert_eq!(
        std::fs::read(dir.join("eval.tok")).unwrap(),
        std::fs::read(dir.join("eval-jsonl.tok")).unwrap(),
        "Parquet and JSONL give the same stream"
    );
    // a corpus made with another tokenizer (the model's, written out again: another SHA-256) is refused
    // at submit, naming the field
    let edited = dir.join("other-tok");
    std::fs::create_dir_all(&edited).unwrap();
    let mut tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("tokenizer.json")).unwrap()).unwrap();
    tok["truncation"] = serde_json::Value::Null;
    std::fs::write(
        edited.join("tokenizer.json"),
        serde_json::to_vec_pretty(&tok).unwrap(),
    )
    .unwrap();
    let other = format!("file://{}/other/", dir.display());
    tokenize_with(&edited, &[&jsonl], &other, &["--shard-tokens", "1500"]);
    let job = |name: &str, data: &str, extra: &str| {
        format!(
            "name = \"{name}\"\nmin = 1\nmax = 4\ndesired = 4\n[training]\nmodel = \"hf\"\nmodel_path = \"file://{}\"\ndataset = \"{data}\"\nglobal_batch = 16\nlr = 3e-3\nseed = 7\nmax_steps = 20\nmodel_config = {{ ctx = 16 }}\n{extra}\n",
            model.display()
        )
    };
    let p = dir.join("other.toml");
    std::fs::write(&p, job("other", &other, "")).unwrap();
    let (ok, _, err) = c.dctl(&["submit", p.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        err.contains("training.dataset")
            && err.contains("tokenize it again with the model's tokenizer"),
        "{err}"
    );
    let ck = dir.join("ck");
    c.submit(&format!(
        "{}[checkpoint]\nurl = \"file://{}\"\ninterval = 20\n",
        job(
            "ev",
            &corpus,
            &format!("strategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 2\neval_dataset = \"{eval}\"\neval_every = 10\neval_samples = 24"),
        ),
        ck.display()
    ));
    let v = c.wait_world("ev", 4, S(60));
    assert_eq!(v.layout.unwrap().to_string(), "dp1×pp2×tp2");
    let done = c.wait_done("ev", S(300));
    assert_eq!(done.eval_step, Some(20));
    let final_eval = done.eval_loss.unwrap();
    let logs = c.logs();
    let on_layout: f64 = logs
        .lines()
        .find_map(|l| l.split("eval at step 20: loss ").nth(1))
        .and_then(|r| r.split(|c: char| !(c.is_ascii_digit() || c == '.')).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no eval at step 20 in the logs:\n{logs}"));
    let out = dir.join("export");
    c.dctl_ok(&[
        "export",
        "ev",
        "--out",
        &format!("file://{}", out.display()),
    ]);
    let said = torch_python(
        r#"
import json, struct, sys, torch
from transformers import AutoModelForCausalLM
raw = open(sys.argv[2], "rb").read()
assert raw[:8] == b"DUCTOK01"
n = struct.unpack("<I", raw[8:12])[0]
h = json.loads(raw[12:12 + n])
dt = {2: torch.int16, 4: torch.int32}[h["width"]]
t = torch.frombuffer(bytearray(raw[12 + n:]), dtype=dt).to(torch.int64) & (0xFFFF if h["width"] == 2 else -1)
ctx, m = 16, 24
x = torch.stack([t[k * ctx:k * ctx + ctx] for k in range(m)])
y = torch.stack([t[k * ctx + 1:k * ctx + ctx + 1] for k in range(m)])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, attn_implementation="eager")
model.eval()
with torch.no_grad():
    logits = model(input_ids=x).logits
loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
print(float(loss))
"#,
        &[
            out.to_str().unwrap(),
            dir.join("eval.tok").to_str().unwrap(),
        ],
    );
    let apart: f64 = said.trim().parse().unwrap();
    assert!(
        (final_eval - apart).abs() < 1e-4 * apart.max(1.0),
        "the job's final eval loss {final_eval} vs transformers' {apart}"
    );
    assert!(
        (on_layout - apart).abs() < 2e-4 * apart.max(1.0),
        "the eval on dp1×pp2×tp2 {on_layout} vs transformers' {apart}"
    );
    // evaluating on the layout changes nothing of training: in deterministic mode a run that
    // evaluates every 3 steps ends with the bits of one that never does
    let det = |name: &str, every: &str| {
        job(
            name,
            &corpus,
            &format!("deterministic = true\ntensor_slices = 2\nstrategy = \"hybrid\"\ntensor_parallel = 2\npipeline_parallel = 2\neval_dataset = \"{eval}\"\n{every}"),
        )
        .replace("max_steps = 20", "max_steps = 9")
    };
    c.submit(&det("det-eval", "eval_every = 3"));
    let a = c.wait_done("det-eval", S(300));
    c.submit(&det("det-plain", ""));
    let b = c.wait_done("det-plain", S(300));
    assert!(c.logs().contains("eval at step 9:"));
    assert_eq!(a.final_weights_sha256, b.final_weights_sha256);
    assert!(a.final_weights_sha256.is_some());
    // so does one fully sharded over stages (each stage's parameters gathered for each eval
    // and each step, its rows back after), at dp2(shard2)×pp2×tp1
    c.submit(&format!(
        "{}[checkpoint]\nurl = \"file://{}/ck-full\"\ninterval = 20\n",
        det("det-full", "eval_every = 3\nsharding = \"full\"").replace(
            "strategy = \"hybrid\"\ntensor_parallel = 2\n",
            "strategy = \"pipeline\"\n"
        ),
        dir.display()
    ));
    let f = c.wait_done("det-full", S(300));
    let layouts: Vec<String> = c
        .history("det-full")
        .iter()
        .map(|g| g.layout.to_string())
        .collect();
    assert!(
        layouts.iter().any(|l| l == "dp2(shard2)×pp2×tp1"),
        "{layouts:?}"
    );
    assert!(c
        .logs()
        .lines()
        .any(|l| l.contains("job=det-full") && l.contains("eval at step 9:")));
    assert_eq!(f.final_weights_sha256, b.final_weights_sha256);
}

/// Peak resident memory (VmHWM) of a process, MiB.
fn peak_mib(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = s
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// The worker's peak memory over a run of `job` until it is done.
fn run_peak(c: &Cluster, job: &str) -> f64 {
    let v = c.wait_world(job, 1, S(120));
    let pid = v.members[0].pid.unwrap();
    let t0 = Instant::now();
    let mut peak = 0f64;
    while let Some(p) = peak_mib(pid) {
        peak = peak.max(p);
        if c.status(job).state == ductile_cluster::records::JobState::Succeeded {
            break;
        }
        assert!(t0.elapsed() < S(300), "{job} did not finish");
        std::thread::sleep(Duration::from_millis(200));
    }
    c.wait_done(job, S(60));
    peak
}

/// A worker training over 1 GiB of tokens (512 Mi u16 tokens in 64 shards: 8 Mi samples, so
/// the epoch's order is computed, not stored) holds no more than the read-ahead's budget more
/// than the same worker over 1 Mi tokens: its peak memory differs by less than 256 MiB, and
/// stays under the dataset's size.
#[test]
fn training_over_a_gigabyte_of_tokens_keeps_a_workers_memory_bounded() {
    let c = Cluster::start(Spec::default().agents(1, 1));
    let big = synth_shards(
        &format!("file://{}/big/", c.dir.path().display()),
        512 << 20,
        8 << 20,
        &[],
    );
    let small = synth_shards(
        &format!("file://{}/small/", c.dir.path().display()),
        1 << 20,
        1 << 18,
        &[],
    );
    let job = |name: &str, data: &str| {
        format!(
            "{}max_steps = 60\nmodel_config = {{ d_model = 64, n_layer = 2, n_head = 2, ctx = 64, vocab = 64 }}\n",
            training_toml(name, 1, 1, 1, "gpt", data, "")
        )
    };
    c.submit(&job("small", &small));
    let base = run_peak(&c, "small");
    c.submit(&job("big", &big));
    let peak = run_peak(&c, "big");
    eprintln!("worker peak RSS: {base:.0} MiB over 2 MiB of tokens, {peak:.0} MiB over 1 GiB");
    assert!(peak - base < 256.0, "{peak:.0} MiB vs {base:.0} MiB");
    assert!(peak < 1024.0, "{peak:.0} MiB");
    let done = c.status("big");
    assert_eq!(done.step, 60);
}

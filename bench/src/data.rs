//! Data benchmarks (issue 32).
//!
//! `ductile-bench tokenize`: `ductile-worker tokenize` against Python `tokenizers`' batch
//! encoding (the same tokenizer, the same JSONL documents, the EOS after each, every core),
//! tokens/s and each side's peak memory; the two must give the same number of tokens.
//!
//! `ductile-bench data-step`: the steady step time of one job reading a sharded corpus from
//! local files and then the same corpus from the S3 test server (moto), and each rank's data
//! wait: the read-ahead should hide the store.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ductile_tests::*;

use crate::median;

/// A child's wall time and peak resident memory (its rusage, MiB), and its stdout.
fn timed(cmd: &mut Command) -> anyhow::Result<(f64, f64, String)> {
    let t0 = Instant::now();
    let child = cmd.stdout(std::process::Stdio::piped()).spawn()?;
    let pid = child.id() as i32;
    let mut out = String::new();
    if let Some(mut s) = child.stdout {
        use std::io::Read;
        s.read_to_string(&mut out)?;
    }
    let mut status = 0;
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    anyhow::ensure!(r == pid, "wait4: {}", std::io::Error::last_os_error());
    anyhow::ensure!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{cmd:?} failed: {out}"
    );
    Ok((
        t0.elapsed().as_secs_f64(),
        usage.ru_maxrss as f64 / 1024.0,
        out,
    ))
}

/// JSONL documents of about 4 KiB from the Python sources of the test venv's packages (real
/// text and code, deterministic), `mib` MiB in all.
fn corpus(python: &str, dir: &Path, mib: u64) -> anyhow::Result<PathBuf> {
    let out = dir.join("corpus.jsonl");
    let o = Command::new(python)
        .args([
            "-c",
            r#"
import json, sys, sysconfig, pathlib
root = pathlib.Path(sysconfig.get_paths()["purelib"])
want, n = int(sys.argv[2]) << 20, 0
with open(sys.argv[1], "w") as f:
    for p in sorted(root.glob("*/**/*.py")):
        try:
            t = p.read_text(encoding="utf-8")
        except Exception:
            continue
        for i in range(0, len(t), 4096):
            f.write(json.dumps({"text": t[i:i + 4096]}) + "\n")
            n += len(t[i:i + 4096].encode())
            if n >= want:
                sys.exit(0)
"#,
        ])
        .arg(&out)
        .arg(mib.to_string())
        .output()?;
    anyhow::ensure!(
        o.status.success(),
        "writing the corpus: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(out)
}

pub fn tokenize(model: &Path, mib: u64, runs: usize) -> anyhow::Result<()> {
    let python = std::env::var("DUCTILE_TORCH_PYTHON").map_err(|_| {
        anyhow::anyhow!(
            "DUCTILE_TORCH_PYTHON is not set: run scripts/setup.sh --tests and source its env.sh"
        )
    })?;
    let dir = TempDir::new("bench-tokenize");
    let input = corpus(&python, dir.path(), mib)?;
    let size = std::fs::metadata(&input)?.len();
    let tok = model.join("tokenizer.json");
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    let (mut ours_mem, mut theirs_mem) = (0f64, 0f64);
    let (mut ours_tokens, mut theirs_tokens) = (0u64, 0u64);
    for _ in 0..runs {
        let out = format!("file://{}/out/", dir.path().display());
        let (s, mem, said) = timed(
            Command::new(bin("ductile-worker"))
                .args(["tokenize", "--json", "--tokenizer"])
                .arg(&tok)
                .arg("--input")
                .arg(&input)
                .args(["--out", &out]),
        )?;
        let v: serde_json::Value = serde_json::from_str(said.trim())?;
        ours_tokens = v["tokens"].as_u64().unwrap_or(0);
        ours.push(ours_tokens as f64 / s);
        ours_mem = ours_mem.max(mem);
        let (s, mem, said) = timed(
            Command::new(&python)
                .args([
                    "-c",
                    r#"
import json, sys
from tokenizers import Tokenizer
t = Tokenizer.from_file(sys.argv[1])
eos = int(sys.argv[3])
n, batch = 0, []
def flush():
    global n
    for e in t.encode_batch(batch, add_special_tokens=False):
        n += len(e.ids) + 1
    batch.clear()
for line in open(sys.argv[2], encoding="utf-8"):
    if line.strip():
        batch.append(json.loads(line)["text"])
        if len(batch) == 2048:
            flush()
flush()
print(n)
"#,
                ])
                .arg(&tok)
                .arg(&input)
                .arg(v["eos"].as_u64().unwrap_or(0).to_string()),
        )?;
        theirs_tokens = said.trim().parse()?;
        theirs.push(theirs_tokens as f64 / s);
        theirs_mem = theirs_mem.max(mem);
    }
    anyhow::ensure!(
        ours_tokens == theirs_tokens,
        "ductile wrote {ours_tokens} tokens, tokenizers encoded {theirs_tokens}"
    );
    let (a, b) = (median(&mut ours), median(&mut theirs));
    println!(
        "tokenize, {} ({:.1} MiB of JSONL, {ours_tokens} tokens), {} cores, median of {runs}:\n  ductile-worker tokenize  {a:.0} tokens/s, peak RSS {ours_mem:.0} MiB\n  Python tokenizers batch  {b:.0} tokens/s, peak RSS {theirs_mem:.0} MiB\n  ratio {:.3}",
        model.display(),
        size as f64 / (1 << 20) as f64,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        a / b
    );
    Ok(())
}

/// A process's CPU time (user + system) so far, seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // the fields after the command's closing parenthesis: utime and stime are the 12th and 13th
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz
}

/// The median rank step time (ms) and data wait (ms) of job "bench" over `n` reports after
/// step `after`.
async fn steady(c: &Cluster, after: u64, n: usize) -> (f64, f64) {
    let (mut step, mut wait, mut last, t0) = (Vec::new(), Vec::new(), 0u64, Instant::now());
    while step.len() < n && t0.elapsed() < Duration::from_secs(600) {
        let v = c.status("bench");
        let ms: Vec<f64> = v.members.iter().filter_map(|m| m.step_ms).collect();
        let data: Vec<f64> = v.members.iter().filter_map(|m| m.data_ms).collect();
        if v.step > after && v.step != last && ms.len() == v.members.len() && !ms.is_empty() {
            step.push(ms.iter().sum::<f64>() / ms.len() as f64);
            wait.push(data.iter().sum::<f64>() / data.len().max(1) as f64);
            last = v.step;
        }
        tokio::time::sleep(Duration::from_millis(2100)).await;
    }
    (median(&mut step), median(&mut wait))
}

pub async fn step(
    tokens: u64,
    shard_tokens: u64,
    world: u32,
    reports: usize,
    stores: &[String],
) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for store in stores {
        let store = store.as_str();
        anyhow::ensure!(
            ["file", "s3", "file+s3"].contains(&store),
            "--stores: file, s3 or file+s3 (files, with the S3 server running idle), not {store}"
        );
        let c = Cluster::start(Spec {
            s3: store != "file",
            ..Spec::default().agents(1, world)
        });
        let prefix = match (&c.s3, store) {
            (Some(s3), "s3") => format!("s3://{}/corpus/", s3.bucket),
            _ => format!("file://{}/corpus/", c.dir.path().display()),
        };
        let env = c.s3.as_ref().map(|s| s.env()).unwrap_or_default();
        synth_shards(&prefix, tokens, shard_tokens, &env);
        c.submit(&format!(
            "{}max_steps = 1000000\nmodel_config = {{ d_model = 64, n_layer = 2, n_head = 2, ctx = 128, vocab = 64 }}\n",
            training_toml("bench", 1, world, world, "gpt", &prefix, "")
        ));
        c.wait_world("bench", world, Duration::from_secs(120));
        // the S3 server shares this machine's cores with the workers: its CPU time while the
        // steps are measured is what it cost them
        let server = c.s3.as_ref().and_then(|s| s.proc.as_ref()).map(|p| p.pid());
        let (cpu0, t0) = (server.map(cpu_seconds), Instant::now());
        let (ms, wait) = steady(&c, 20, reports).await;
        let server_cpu = match (server, cpu0) {
            (Some(pid), Some(a)) => format!(
                ", the S3 server used {:.1}% of a core",
                (cpu_seconds(pid) - a) / t0.elapsed().as_secs_f64() * 100.0
            ),
            _ => String::new(),
        };
        println!("  {store:<7} step {ms:.2} ms, data wait {wait:.3} ms per step{server_cpu}");
        rows.push((store, ms, wait));
    }
    let of = |s: &str| {
        rows.iter()
            .filter(|r| r.0 == s)
            .map(|r| r.1)
            .collect::<Vec<f64>>()
    };
    let (mut f, mut s3) = (of("file"), of("s3"));
    if !f.is_empty() && !s3.is_empty() {
        println!(
            "data-step, GPT (d_model 64, 2 layers, ctx 128), global batch 32, {world} CPU workers, {tokens} tokens in shards of {shard_tokens}: S3 / file step time {:.3} (medians over {} and {} runs)",
            median(&mut s3) / median(&mut f),
            s3.len(),
            f.len()
        );
    }
    Ok(())
}

use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ductile-worker",
    version,
    about = "ductile worker: started by ductile-agent; also makes synthetic datasets"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Greedy continuation of a prompt by a Hugging Face model directory or an exported
    /// checkpoint (file://, s3:// or a path), on the CPU, with a key/value cache.
    Generate {
        #[arg(long)]
        model: String,
        #[arg(long)]
        prompt: String,
        #[arg(long, default_value_t = 32)]
        max_new_tokens: usize,
    },
    /// Encode text with a model's tokenizer.json into a token stream a job trains on.
    Tokenize {
        /// A tokenizer.json, or a model directory holding one (file://, s3:// or a path).
        #[arg(long)]
        tokenizer: String,
        /// .txt files (a document each), .jsonl files (a document per line) and .parquet files
        /// (a document per row), read in this order.
        #[arg(long, num_args = 1.., required = true)]
        input: Vec<String>,
        /// Where the stream goes (file:// or s3://); a prefix ending in `/`: shards of
        /// --shard-tokens tokens and their index.json there.
        #[arg(long)]
        out: String,
        /// The JSON field of a .jsonl line, or the string column of a .parquet file, holding
        /// the text.
        #[arg(long, default_value = "text")]
        field: String,
        /// Tokens per shard when --out is a prefix.
        #[arg(long, default_value_t = 1 << 27)]
        shard_tokens: u64,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
        /// The token appended after each document (a token or an id); default: config.json's
        /// eos_token_id, else the tokenizer's end-of-text token.
        #[arg(long)]
        eos: Option<String>,
    },
    /// Run as a worker (the default; the agent sets the DUCTILE_* environment).
    Run,
    /// Run a `runtime = "torchrun"` job's program through its generations under torchrun's
    /// worker contract (the agent starts this; the program is the job's `command`).
    Launch,
    /// Write a small synthetic dataset with a learnable structure.
    SynthData {
        /// tokens (u16 stream from a seeded Markov source) or regression (safetensors x, y from a teacher network)
        #[arg(long)]
        kind: String,
        /// file:///path
        #[arg(long)]
        out: String,
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// Tokens (tokens) or samples (regression).
        #[arg(long, default_value_t = 200_000)]
        size: u64,
        /// Vocabulary size (tokens).
        #[arg(long, default_value_t = 64)]
        vocab: u16,
        /// Tokens per shard, when --out is a prefix ending in `/` (tokens: shards and an
        /// index.json, written as they are generated).
        #[arg(long, default_value_t = 1 << 24)]
        shard_tokens: u64,
    },
}

fn main() {
    ductile_cluster::service::init_logging(ductile_cluster::service::LogFormat::Plain);
    match Cli::parse().cmd {
        Some(Cmd::Generate {
            model,
            prompt,
            max_new_tokens,
        }) => {
            let url = if model.contains("://") {
                model
            } else {
                match std::fs::canonicalize(&model) {
                    Ok(p) => format!("file://{}", p.display()),
                    Err(e) => {
                        eprintln!("ductile-worker generate: {model}: {e}");
                        std::process::exit(1);
                    }
                }
            };
            match ductile_worker::hf::generate(&url, &prompt, max_new_tokens) {
                Ok(text) => println!("{prompt}{text}"),
                Err(e) => {
                    eprintln!("ductile-worker generate: {e:#}");
                    std::process::exit(1);
                }
            }
        }
        Some(Cmd::Tokenize {
            tokenizer,
            input,
            out,
            field,
            eos,
            shard_tokens,
            json,
        }) => {
            if let Err(e) = tokenize(
                &tokenizer,
                &input,
                &out,
                &field,
                eos.as_deref(),
                shard_tokens,
                json,
            ) {
                eprintln!("ductile-worker tokenize: {e:#}");
                std::process::exit(1);
            }
        }
        Some(Cmd::SynthData {
            kind,
            out,
            seed,
            size,
            vocab,
            shard_tokens,
        }) => {
            let r = match kind.as_str() {
                "tokens" => {
                    ductile_worker::synth::tokens(&out, seed, size as usize, vocab, shard_tokens)
                }
                "regression" => ductile_worker::synth::regression(&out, seed, size as i64, 16, 4),
                other => Err(anyhow::anyhow!(
                    "unknown kind {other:?} (tokens, regression)"
                )),
            };
            if let Err(e) = r {
                eprintln!("ductile-worker synth-data: {e:#}");
                std::process::exit(1);
            }
            println!("wrote {kind} dataset to {out}");
        }
        None | Some(Cmd::Run) => run(),
        Some(Cmd::Launch) => launch(),
    }
}

/// The agent's environment for this worker, or exit 2 saying what is missing.
fn worker_env() -> ductile_runtime::WorkerEnv {
    ductile_runtime::WorkerEnv::from_env().unwrap_or_else(|e| {
        eprintln!("ductile-worker: {e:#}");
        std::process::exit(2);
    })
}

/// A worker's async runtime (two threads: the watches and reports; the work is on its own).
fn worker_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// etcd as the agent's environment names it, or the exit code after saying why not.
async fn connect(
    env: &ductile_runtime::WorkerEnv,
) -> Result<Arc<dyn ductile_cluster::KvBackend>, i32> {
    ductile_cluster::connect_etcd_with(&env.etcd, Duration::from_secs(30))
        .await
        .map_err(|e| {
            eprintln!(
                "ductile-worker: cannot reach etcd at {}: {}",
                env.etcd.endpoints,
                ductile_cluster::service::error_chain(&e)
            );
            1
        })
}

/// A torchrun job's worker: `ductile_runtime::launch`.
fn launch() {
    let env = worker_env();
    let rt = worker_runtime();
    let code = rt.block_on(async move {
        let cancel = ductile_cluster::service::shutdown_on_signals();
        match connect(&env).await {
            Ok(backend) => ductile_runtime::launch::run(env, backend, cancel).await,
            Err(code) => code,
        }
    });
    // the launcher's background tasks (watches) end with the process
    rt.shutdown_timeout(Duration::from_millis(200));
    std::process::exit(code);
}

fn run() {
    let env = worker_env();
    // a slot whose device is not there fails now, saying what is missing, before any etcd work
    if let Err(e) =
        ductile_worker::device::parse(&env.device).and_then(ductile_worker::device::check)
    {
        eprintln!(
            "ductile-worker: cannot run on {}/{}: {e}",
            env.node, env.slot
        );
        std::process::exit(ductile_runtime::EXIT_UNUSABLE);
    }
    let rt = worker_runtime();
    let code = rt.block_on(async move {
        let cancel = ductile_cluster::service::shutdown_on_signals();
        let backend = match connect(&env).await {
            Ok(b) => b,
            Err(code) => return code,
        };
        let store =
            ductile_cluster::Store::new(backend.clone(), ductile_cluster::Keys::new(&env.prefix));
        let spec = match store.spec(&env.job).await {
            Ok(Some((s, _))) => s,
            Ok(None) => {
                eprintln!("ductile-worker: job {:?} has no spec", env.job);
                return 2;
            }
            Err(e) => {
                eprintln!("ductile-worker: cannot read the job spec: {e}");
                return 1;
            }
        };
        let Some(training) = spec.training.clone() else {
            return match ductile_runtime::follow_generations(env, backend, cancel.clone()).await {
                Ok(()) if cancel.is_cancelled() => ductile_runtime::EXIT_TERMINATED,
                Ok(()) => ductile_runtime::EXIT_FENCED,
                Err(e) => {
                    eprintln!("ductile-worker: {e:#}");
                    1
                }
            };
        };
        if let Err(e) = ductile_worker::faults::init(spec.allow_fault_injection) {
            eprintln!("ductile-worker: {e:#}");
            return 2;
        }
        ductile_worker::device::prepare_env(&env.device, training.deterministic);
        let cell = Arc::new(ductile_runtime::GenCell::default());
        ductile_runtime::watch_generations(
            store.clone(),
            env.job.clone(),
            cell.clone(),
            cancel.clone(),
        );
        let handle = tokio::runtime::Handle::current();
        let trainer =
            tokio::task::spawn_blocking(move || -> anyhow::Result<ductile_runtime::Left> {
                ductile_worker::train::driver::Driver::new(
                    env,
                    training,
                    spec.checkpoint.clone(),
                    spec.max,
                    store,
                    handle,
                    cell,
                )?
                .run()
            });
        tokio::select! {
            r = trainer => match r {
                Ok(Ok(ductile_runtime::Left::Done)) => ductile_runtime::EXIT_DONE,
                Ok(Ok(ductile_runtime::Left::Fenced)) => ductile_runtime::EXIT_FENCED,
                Ok(Err(e)) if e.downcast_ref::<ductile_runtime::Unusable>().is_some() => {
                    eprintln!("ductile-worker: cannot run on this slot: {e:#}");
                    ductile_runtime::EXIT_UNUSABLE
                }
                Ok(Err(e)) => {
                    eprintln!("ductile-worker: {e:#}");
                    1
                }
                Err(e) => {
                    eprintln!("ductile-worker: training thread failed: {e}");
                    1
                }
            },
            _ = cancel.cancelled() => ductile_runtime::EXIT_TERMINATED,
        }
    });
    std::process::exit(code);
}

fn tokenize(
    tokenizer: &str,
    input: &[String],
    out: &str,
    field: &str,
    eos: Option<&str>,
    shard_tokens: u64,
    json: bool,
) -> anyhow::Result<()> {
    use ductile_worker::hf;
    let rt = tokio::runtime::Runtime::new()?;
    let (tok, config) = rt.block_on(hf::tokenizer_at(tokenizer))?;
    let eos = hf::eos_of(&tok.tok, config.as_ref(), eos)?;
    let s = ductile_worker::tokenize::run(&tok, eos, input, field, out, shard_tokens, &rt)?;
    if json {
        println!("{}", serde_json::to_string(&s)?);
    } else {
        println!(
            "{out}: {} documents, {} tokens of {} bytes in {} shard(s) (vocabulary {}, eos {:?}, tokenizer sha256 {}); {:.0} tokens/s, peak RSS {:.0} MiB",
            s.documents,
            s.tokens,
            s.width,
            s.shards,
            s.vocab,
            s.eos,
            s.tokenizer_sha256,
            s.tokens_per_s,
            s.peak_rss_mib
        );
    }
    Ok(())
}

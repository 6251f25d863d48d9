//! dctl: submit, scale, status, nodes, drain, stop, events, watch, checkpoints, plan, plot, torchft (and torchft-relay).

/// Everything dctl prints goes through [`clean`]: job names, messages, program output and
/// lighthouse clients' replica ids come from tenants and network clients, and a terminal
/// control sequence among them would act on the operator's terminal.
macro_rules! println {
    () => { crate::out("\n") };
    ($($t:tt)*) => { crate::out(&format!("{}\n", crate::clean(&format!($($t)*)))) };
}

/// Writes to standard output; a reader that went away (`dctl status | head`) ends dctl
/// quietly, as other command-line tools end, rather than with a panic.
pub fn out(s: &str) {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    if let Err(e) = o.write_all(s.as_bytes()).and_then(|_| o.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
    }
}
macro_rules! eprintln {
    () => { ::std::eprintln!() };
    ($($t:tt)*) => { ::std::eprintln!("{}", crate::clean(&format!($($t)*))) };
}

/// `s` with its control characters (but newline and tab) shown as `\u{..}` escapes.
pub fn clean(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return std::borrow::Cow::Borrowed(s);
    }
    std::borrow::Cow::Owned(
        s.chars()
            .map(|c| {
                if c.is_control() && c != '\n' && c != '\t' {
                    c.escape_unicode().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

mod export;
mod plot;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ductile_cluster::api::*;
use ductile_cluster::records::{Generation, JobSpec};
use serde::Deserialize;

#[derive(Parser, Debug)]
#[command(name = "dctl", version, about = "Control a ductile cluster")]
struct Cli {
    /// The daemon's API, e.g. https://ductile.example:7420, or http://127.0.0.1:7420 for a
    /// daemon serving plain HTTP on loopback (or DCTL_ENDPOINT, or ~/.config/ductile/dctl.toml).
    #[arg(long, env = "DCTL_ENDPOINT", global = true)]
    endpoint: Option<String>,
    /// CA certificate(s) (PEM) to check the daemon's TLS certificate against, instead of the
    /// system's roots (or DCTL_CA; `ca` in dctl.toml).
    #[arg(long, env = "DCTL_CA", global = true)]
    ca: Option<PathBuf>,
    /// The API bearer token. Prefer DCTL_TOKEN, --token-file or ~/.config/ductile/dctl.toml: a
    /// token on the command line shows in the process list and shell history (dctl warns).
    #[arg(long, env = "DCTL_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    /// A file holding the API token (or DCTL_TOKEN_FILE; `token_file` in dctl.toml).
    #[arg(long, env = "DCTL_TOKEN_FILE", global = true)]
    token_file: Option<PathBuf>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Submit a job spec (TOML).
    Submit {
        file: PathBuf,
        /// Check the spec here and print what would run (runtime, sizes, and for a built-in
        /// training job the plan at its desired size: layout and memory per rank); submits
        /// nothing and needs no daemon or token.
        #[arg(long)]
        dry_run: bool,
    },
    /// List jobs or nodes, as kubectl does: `dctl get jobs [NAME|PREFIX*] [--state S]
    /// [-o wide|json|yaml] [--watch]`.
    Get {
        #[arg(value_enum)]
        what: Kind,
        /// One name, or a prefix ending in `*`.
        name: Option<String>,
        /// wide: more columns; json, yaml: every field.
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<Output>,
        /// Jobs in this state only (running, waiting, succeeded, failed, stopped, ...).
        #[arg(long)]
        state: Option<String>,
        /// Print again every 2 s (Ctrl-C to leave).
        #[arg(short = 'w', long)]
        watch: bool,
    },
    /// Everything about one job (its status and members, its spec, its latest generations) or
    /// one node (its devices, workers, drain, preemption notice).
    Describe {
        #[arg(value_enum)]
        what: Kind,
        name: String,
    },
    /// Forget a finished job's records (status, generations, history: `dctl get jobs` no longer
    /// lists it); refused while it runs (`dctl stop` first). Its checkpoints stay at their URL
    /// unless `--purge`.
    Delete {
        job: String,
        /// Also delete the job's checkpoints at its `[checkpoint] url` (its own directories
        /// only: other jobs' are left, and so are a program's own files).
        #[arg(long)]
        purge: bool,
    },
    /// Run a program as a job without writing a TOML file: `dctl run [--nproc N] [--min M
    /// --max X] -- python3 train.py ARGS...` (a `runtime = "torchrun"` job; a script path that
    /// exists here is made absolute).
    Run {
        /// The job's name (default: the script's name and a few random hex digits).
        #[arg(long)]
        name: Option<String>,
        /// Workers to start (the desired size).
        #[arg(long, default_value_t = 1)]
        nproc: u32,
        /// Fewest workers it runs with (default: --nproc).
        #[arg(long)]
        min: Option<u32>,
        /// Most workers it grows to (default: --nproc).
        #[arg(long)]
        max: Option<u32>,
        /// torchrun, torchft, tf or horovod.
        #[arg(long, default_value = "torchrun")]
        runtime: String,
        /// ductile's integrations to load before the script (transformers, keras).
        #[arg(long, value_delimiter = ',')]
        integrations: Vec<String>,
        /// Worker restarts the whole job may use.
        #[arg(long)]
        restart_budget: Option<u32>,
        /// An environment variable for the program, NAME=VALUE (again for more).
        #[arg(long = "env")]
        env: Vec<String>,
        /// Print the spec it would submit and check it (`submit --dry-run`); submit nothing.
        #[arg(long)]
        dry_run: bool,
        /// The program and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// This dctl's version and the daemon's (`--json`: {"client", "server"}); the server's is
    /// "unreachable: why" when the daemon cannot be asked.
    Version,
    /// The job spec's JSON Schema, generated from ductile's own types (editors read it: put
    /// `#:schema PATH` on a spec's first line for taplo or VS Code's Even Better TOML);
    /// `--markdown`: the reference page made from the same doc comments.
    Schema {
        #[arg(long)]
        markdown: bool,
    },
    /// Print a completion script for a shell: `source <(dctl completion bash)`, or into
    /// `/etc/bash_completion.d/dctl`, zsh's `$fpath`, fish's `completions/dctl.fish`.
    Completion {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Set a job's desired size; `--wait` returns once every member of a generation at that
    /// size joined (progress on the terminal).
    Scale {
        job: String,
        size: u32,
        #[arg(long)]
        wait: bool,
        /// With --wait: give up after this many seconds (the job goes on re-forming).
        #[arg(long, default_value_t = 300)]
        timeout: u64,
    },
    /// Show one job, or all jobs.
    Status { job: Option<String> },
    /// List live nodes.
    Nodes,
    /// Drain a node (no work is placed on it until `--undo`).
    Drain {
        node: String,
        /// Clear the drain (uncordon).
        #[arg(long)]
        undo: bool,
        #[arg(long)]
        reason: Option<String>,
        /// Return once no worker runs on the node any more (progress on the terminal).
        #[arg(long)]
        wait: bool,
        /// With --wait: give up after this many seconds (the drain goes on).
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
    /// Stop a job.
    Stop { job: String },
    /// List a job's generations; `--follow` prints new ones as they are published.
    Events {
        job: String,
        #[arg(long)]
        follow: bool,
        /// With --json, a torchft job's quorums too, as `{"torchft_quorum": ...}` lines between
        /// the generations (the text always shows them).
        #[arg(long)]
        quorums: bool,
    },
    /// What a rank's worker or program wrote to stdout and stderr, as its node's agent keeps it
    /// (each generation the slot served opens with `=== generation G rank R pid P ===`);
    /// through the daemon, with the admin token.
    Logs {
        job: String,
        /// The rank (default 0), in --generation (default the latest).
        #[arg(long)]
        rank: Option<u32>,
        /// Only that generation's lines, and the rank's slot in it.
        #[arg(long)]
        generation: Option<u64>,
        /// The last N lines.
        #[arg(long)]
        tail: Option<u32>,
        /// Then print what the slot writes, as it comes, until the job ends (Ctrl-C to leave).
        #[arg(long, short = 'f')]
        follow: bool,
    },
    /// Follow a job's step (a built-in job's of max_steps, with the time left), loss (with a
    /// sparkline of the recent loss), throughput and
    /// generation until it ends (Ctrl-C to leave).
    Watch { job: String },
    /// Draw a job's loss, throughput or per-rank step time over its steps, every generation a
    /// labelled marker, to an SVG or PNG file.
    Plot {
        job: String,
        /// The file to write: `.svg` or `.png`.
        #[arg(long, required_unless_present = "term")]
        out: Option<PathBuf>,
        /// Draw the chart in the terminal instead (for a shell over SSH), as wide as the
        /// terminal (COLUMNS, else 80).
        #[arg(long, conflicts_with = "out")]
        term: bool,
        #[arg(long, value_enum, default_value = "loss")]
        metric: plot::Metric,
        /// From this step on.
        #[arg(long, default_value_t = 0)]
        from: u64,
        /// At most one point per this many steps.
        #[arg(long, default_value_t = 1)]
        every: u64,
    },
    /// List a job's checkpoints: step, time, size, world size and layout, state.
    Checkpoints { job: String },
    /// TorchFT's lighthouse (ductiled --torchft-listen): the last quorum (id, members, their
    /// step, who issued it), who waits and heartbeats, and the recent quorum ids.
    Torchft,
    /// One local address for TorchFT's TORCHFT_LIGHTHOUSE in front of every ductiled replica
    /// serving the lighthouse: each connection goes to the first replica that accepts, so a
    /// replica's death costs the calls in flight only (`Manager(quorum_retries=N)` retries
    /// them). Needs no token.
    TorchftRelay {
        /// Where TorchFT connects (TORCHFT_LIGHTHOUSE=http://THIS).
        #[arg(long, default_value = "127.0.0.1:29510")]
        listen: String,
        /// The replicas' --torchft-listen addresses, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        to: Vec<String>,
        /// Put the connections' calls in this job's lighthouse room (what a runtime = "torchft"
        /// job's launchers do), with --key-file; without it, the default room (which a replica
        /// serves only with --torchft-default-room).
        #[arg(long, requires = "key_file")]
        job: Option<String>,
        /// The job's lighthouse key (`jobs/JOB/lighthouse_key` in etcd), for --job.
        #[arg(long)]
        key_file: Option<std::path::PathBuf>,
        /// Speak TLS to the replicas (ductiled --torchft-tls-cert), checked against this CA.
        #[arg(long)]
        ca: Option<std::path::PathBuf>,
    },
    /// Write a committed checkpoint of a `model = "hf"` job as a Hugging Face directory
    /// (safetensors, config.json, the tokenizer's files) that transformers loads as it is.
    Export {
        job: String,
        /// The committed step (default: the latest).
        #[arg(long)]
        step: Option<u64>,
        /// Where the directory goes (file:// or s3://).
        #[arg(long)]
        out: String,
        /// Weight files past this size are cut into shards with an index.
        #[arg(long, default_value_t = 5120)]
        max_shard_mb: u64,
    },
    /// The plan the daemon would publish for JOB at `--world N` ranks (layout, stage
    /// boundaries, modelled memory per rank and step time, the runners-up); changes nothing.
    Plan {
        job: String,
        #[arg(long)]
        world: u32,
    },
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    #[value(alias = "job")]
    Jobs,
    #[value(alias = "node")]
    Nodes,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Output {
    Wide,
    Json,
    Yaml,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    endpoint: Option<String>,
    ca: Option<PathBuf>,
    token: Option<String>,
    token_file: Option<PathBuf>,
}

struct Client {
    http: reqwest::Client,
    endpoint: String,
    token: String,
}

impl Client {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> anyhow::Result<serde_json::Value> {
        let url = format!("{}{}", self.endpoint.trim_end_matches('/'), path);
        let mut req = self.http.request(method, &url).bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.map_err(|e| {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg = format!("{msg}: {s}");
                src = s.source();
            }
            anyhow::anyhow!("cannot reach ductiled at {}: {msg}", self.endpoint)
        })?;
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        if status.is_success() {
            return Ok(if text.is_empty() {
                serde_json::Value::Null
            } else {
                serde_json::from_str(&text)?
            });
        }
        let err: Option<ApiErrorBody> = serde_json::from_str(&text).ok();
        let msg = err
            .as_ref()
            .map(|e| e.error.clone())
            .unwrap_or_else(|| text.clone());
        match status.as_u16() {
            401 => anyhow::bail!("the daemon refused the token: {msg}"),
            403 => anyhow::bail!("not allowed with this token: {msg}"),
            _ if msg.trim().is_empty() => anyhow::bail!("HTTP {status}"),
            _ => anyhow::bail!("{msg}"),
        }
    }
}

/// Whether a call's error says the daemon could not be asked (not reached, the token
/// refused, a daemon too old for the path), rather than that it answered no.
fn is_unreachable(e: &anyhow::Error) -> bool {
    let m = format!("{e:#}");
    m.starts_with("cannot reach ductiled")
        || m.starts_with("the daemon refused the token")
        || m.starts_with("not allowed with this token")
        || m.starts_with("HTTP 404")
}

fn print_job(v: &JobView) {
    println!("job         {}", v.job);
    println!("state       {:?}", v.state);
    println!("generation  {}", v.generation);
    println!(
        "world size  {} (desired {}, min {}, max {})",
        v.world_size, v.desired, v.min, v.max
    );
    if let Some(l) = &v.layout {
        let b = if v.stage_boundaries.is_empty() {
            String::new()
        } else {
            format!("   stage boundaries {:?}", v.stage_boundaries)
        };
        println!("layout      {}{b}", l);
    }
    if let Some(s) = v.sharding {
        println!("sharding    {s}");
    }
    let loss = v
        .loss
        .map(|l| format!("{l:.4}"))
        .unwrap_or_else(|| "-".into());
    let sps = v
        .samples_per_sec
        .map(|s| format!("{s:.1}"))
        .unwrap_or_else(|| "-".into());
    if v.progress_at_ms.is_none() {
        println!("step        - (no progress reports yet; a job's own script reports with ductile.report or an integration)");
    } else {
        println!("step        {}   loss {}   samples/s {}", v.step, loss, sps);
    }
    let opt = |x: Option<String>| x.unwrap_or_else(|| "-".into());
    match v.sync.as_deref() {
        Some("diloco") => println!(
            "sync        diloco   rounds {}   bytes/sample {}",
            opt(v.round.map(|r| r.to_string())),
            opt(v.bytes_per_sample.map(|b| format!("{b:.1}")))
        ),
        Some("async") => println!(
            "sync        async   staleness mean {} max {}   dropped updates {}   bytes/sample {}",
            opt(v.staleness_mean.map(|x| format!("{x:.2}"))),
            opt(v.staleness_max.map(|x| x.to_string())),
            opt(v.dropped_updates.map(|x| x.to_string())),
            opt(v.bytes_per_sample.map(|b| format!("{b:.1}")))
        ),
        _ => {}
    }
    if let Some(r) = &v.last_reformation {
        let first = r
            .first_step_seconds
            .map(|f| format!("; training again {f:.3} s after"))
            .unwrap_or_default();
        println!(
            "last change generation {}: {} ({}) in {:.3} s (members joined){first}",
            r.generation, r.reason, r.detail, r.seconds
        );
    }
    if !v.message.is_empty() {
        println!("message     {}", v.message);
    }
    if let Some(h) = &v.final_weights_sha256 {
        println!("weights     sha256 {h}");
    }
    if let Some(q) = &v.torchft {
        println!(
            "quorum      {} of {} replica group(s), issued by {} ({})",
            q.quorum_id,
            q.members.len(),
            q.issued_by,
            q.reason
        );
        for m in &q.members {
            println!(
                "            {} at step {} (world {}, {})",
                m.replica_id, m.step, m.world_size, m.address
            );
        }
        for h in &q.healing {
            println!("            {} heals from {}", h.replica_id, h.from);
        }
    }
    let groups: Vec<String> = v
        .members
        .iter()
        .filter_map(|m| {
            m.replica_group.map(|g| {
                format!(
                    "rank {} group {g} since generation {}",
                    m.rank,
                    m.group_since.unwrap_or(0)
                )
            })
        })
        .collect();
    if !groups.is_empty() {
        println!("groups      {}", groups.join("; "));
    }
    if let Some(c) = &v.last_checkpoint {
        println!("checkpoint  {}", checkpoint_line(c));
    }
    if let Some(l) = v.eval_loss {
        match v.eval_step {
            Some(s) => println!("eval loss   {l:.4} at step {s}"),
            None => println!(
                "eval loss   {l:.4} (the final weights on the dataset's first 256 samples)"
            ),
        }
    }
    if let Some(r) = v.lr {
        let norm = v
            .grad_norm
            .map(|n| format!(", grad norm {n:.4}"))
            .unwrap_or_default();
        println!("lr          {r:.4e} (the last reported step's){norm}");
    }
    if let Some(r) = &v.recipe {
        println!("recipe      {}", recipe_line(r));
    }
    if !v.members.is_empty() {
        println!(
            "\n{:<6} {:<20} {:<6} {:<8} {:<4} {:<6} {:<4} {:<8} {:>9} {:>11} {:>8}",
            "RANK",
            "NODE",
            "SLOT",
            "PID",
            "DP",
            "STAGE",
            "TP",
            "UNITS",
            "STEP_MS",
            "COMPUTE_MS",
            "DATA_MS"
        );
        let ms = |x: Option<f64>| x.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
        for m in &v.members {
            let (stage, units) = if m.spare {
                ("spare".to_string(), "-".to_string())
            } else {
                (
                    m.pp_stage.to_string(),
                    if m.stage_chunks.is_empty() {
                        "all".into()
                    } else {
                        m.stage_chunks
                            .iter()
                            .map(|[a, b]| format!("{a}..{b}"))
                            .collect::<Vec<_>>()
                            .join("+")
                    },
                )
            };
            println!(
                "{:<6} {:<20} {:<6} {:<8} {:<4} {:<6} {:<4} {:<8} {:>9} {:>11} {:>8}",
                m.rank,
                m.node,
                m.slot,
                // a torchrun job's program (what torchrun calls the worker), else the worker
                m.program_pid
                    .or(m.pid)
                    .map(|p| p.to_string())
                    .unwrap_or_else(|| "-".into()),
                m.dp_rank,
                stage,
                m.tp_rank,
                units,
                ms(m.step_ms),
                ms(m.compute_ms),
                ms(m.data_ms)
            );
        }
    }
}

fn print_plan(p: &serde_json::Value) {
    let l: ductile_cluster::records::Layout = serde_json::from_value(p["layout"].clone())
        .unwrap_or(ductile_cluster::records::Layout::data_parallel(0));
    let gib = |b: &serde_json::Value| b.as_f64().unwrap_or(0.0) / (1u64 << 30) as f64;
    println!("world       {}", p["world"]);
    println!("layout      {}   spares {}", l, p["spares"]);
    println!("why         {}", p["reason"].as_str().unwrap_or(""));
    println!(
        "schedule    {}   micro-batches {}   bubble {:.1}%",
        p["schedule"].as_str().unwrap_or(""),
        p["micro_batches"],
        p["bubble"].as_f64().unwrap_or(0.0) * 100.0
    );
    println!(
        "step time   {:.4} s (modelled)   memory per rank up to {:.3} GiB",
        p["step_time_s"].as_f64().unwrap_or(0.0),
        gib(&p["max_memory_bytes"])
    );
    println!(
        "\n{:<6} {:<12} {:<16} {:>12} {:>12} {:>12}",
        "STAGE", "UNITS", "LAYERS", "PARAMS", "MEMORY_GIB", "COMPUTE_S"
    );
    for s in p["stages"].as_array().into_iter().flatten() {
        println!(
            "{:<6} {:<12} {:<16} {:>12} {:>12.4} {:>12.4}",
            s["stage"].to_string(),
            format!("{}..{}", s["first"], s["end"]),
            s["units"].as_str().unwrap_or(""),
            s["params"].to_string(),
            gib(&s["memory_bytes"]),
            s["compute_s"].as_f64().unwrap_or(0.0)
        );
    }
    if let Some(levels) = p["sharding"].as_array() {
        // (stages and tensor groups: each level's layout and fullest rank; data parallel:
        // each level's state per rank)
        let staged = levels
            .iter()
            .any(|l| l.get("layout").is_some() || l.get("refused").is_some());
        if staged {
            println!(
                "\n{:<10} {:<22} {:>14}",
                "SHARDING", "LAYOUT", "MEMORY_GIB/RANK"
            );
        } else {
            println!("\n{:<10} {:>14}", "SHARDING", "STATE_GIB/RANK");
        }
        for l in levels {
            let this = if l["chosen"].as_bool() == Some(true) {
                "   (this job)"
            } else {
                ""
            };
            let level = l["sharding"].as_str().unwrap_or("");
            match (staged, l["refused"].as_str()) {
                (true, Some(why)) => println!("{level:<10} refused: {why}{this}"),
                (true, None) => println!(
                    "{level:<10} {:<22} {:>14.3}{this}",
                    l["layout"].as_str().unwrap_or(""),
                    gib(&l["memory_bytes"])
                ),
                (false, _) => println!("{level:<10} {:>14.3}{this}", gib(&l["memory_bytes"])),
            }
        }
    }
    let others = p["runners_up"].as_array().cloned().unwrap_or_default();
    if !others.is_empty() {
        println!("\nrunners-up:");
        for r in others {
            match r["refused"].as_str() {
                Some(why) => println!(
                    "  {:<16} refused: {why}",
                    r["layout"].as_str().unwrap_or("")
                ),
                None => println!(
                    "  {:<16} step {:.4} s   memory up to {:.3} GiB",
                    r["layout"].as_str().unwrap_or(""),
                    r["step_time_s"].as_f64().unwrap_or(0.0),
                    gib(&r["max_memory_bytes"])
                ),
            }
        }
    }
}

fn print_generation(g: &Generation) {
    let secs = g.published_at_ms as f64 / 1000.0;
    let members: Vec<String> = g
        .members
        .iter()
        .map(|m| format!("{}/{}", m.node, m.slot))
        .collect();
    println!(
        "gen {:<4} {:<8} world {:<3} source {:<10} at {:.3}  {}  [{}]",
        g.number,
        g.reason.to_string(),
        g.world_size,
        format!("{:?}", g.state_source).to_lowercase(),
        secs,
        g.detail,
        members.join(" ")
    );
}

fn print_quorum(q: &ductile_cluster::api::TorchftQuorumView) {
    let members: Vec<String> = q
        .members
        .iter()
        .map(|m| format!("{}@{}", m.replica_id, m.step))
        .collect();
    let healing: Vec<String> = q
        .healing
        .iter()
        .map(|h| format!("{} from {}", h.replica_id, h.from))
        .collect();
    println!(
        "quorum {:<4} torchft   world {:<3} at {:.3}  issued by {} ({}){}  [{}]",
        q.quorum_id,
        q.members.len(),
        q.created_ms as f64 / 1000.0,
        q.issued_by,
        q.reason,
        if healing.is_empty() {
            String::new()
        } else {
            format!("; healing: {}", healing.join(", "))
        },
        members.join(" ")
    );
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Cmd::TorchftRelay {
        listen,
        to,
        job,
        key_file,
        ca,
    } = &cli.cmd
    {
        let room = match (job, key_file) {
            (Some(job), Some(f)) => Some(ductile_cluster::relay::RoomKey {
                job: job.clone(),
                key: std::fs::read_to_string(f)
                    .map_err(|e| anyhow::anyhow!("cannot read --key-file {}: {e}", f.display()))?
                    .trim()
                    .as_bytes()
                    .to_vec(),
            }),
            _ => None,
        };
        return ductile_cluster::relay::run(listen, to.clone(), room, ca.as_deref()).await;
    }
    // what needs no daemon and no token (a dry run asks the daemon too where it can)
    let mut dry: Option<((JobSpec, serde_json::Value), String)> = None;
    match &cli.cmd {
        Cmd::Schema { markdown } => {
            if *markdown {
                print!("{}", ductile_cluster::schema::reference_markdown());
            } else {
                print!("{}", ductile_cluster::schema::job_spec_schema_text());
            }
            return Ok(());
        }
        Cmd::Completion { shell } => {
            use clap::CommandFactory;
            let mut cmd = Cli::command();
            let mut buf = Vec::new();
            clap_complete::generate(*shell, &mut cmd, "dctl", &mut buf);
            out(&String::from_utf8_lossy(&buf));
            return Ok(());
        }
        Cmd::Submit {
            file,
            dry_run: true,
        } => {
            let text = std::fs::read_to_string(file)
                .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", file.display()))?;
            let label = file.display().to_string();
            dry = Some((dry_run(&text, &label, cli.json).await?, label));
        }
        Cmd::Run { dry_run: true, .. } => {
            let text = run_spec(&cli.cmd)?;
            if !cli.json {
                out(&text);
            }
            let label = "the job dctl run makes".to_string();
            dry = Some((dry_run(&text, &label, cli.json).await?, label));
        }
        _ => {}
    }
    let file: FileConfig = match std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".config/ductile/dctl.toml"))
    {
        Some(p) if p.exists() => {
            let text = std::fs::read_to_string(&p)?;
            toml::from_str(&text)
                .map_err(|e| anyhow::anyhow!("{}: {}", p.display(), e.message()))?
        }
        _ => FileConfig::default(),
    };
    let endpoint = cli
        .endpoint
        .or(file.endpoint)
        .unwrap_or_else(|| "http://127.0.0.1:7420".into());
    if std::env::args().any(|a| a == "--token" || a.starts_with("--token=")) {
        eprintln!("warning: --token puts the API token in the process list and the shell history; use DCTL_TOKEN, --token-file FILE or ~/.config/ductile/dctl.toml");
    }
    let read_token = |p: &PathBuf| -> anyhow::Result<String> {
        let t = std::fs::read_to_string(p)
            .map_err(|e| anyhow::anyhow!("cannot read the token file {}: {e}", p.display()))?;
        Ok(t.trim().to_string())
    };
    let token = match (cli.token, cli.token_file, file.token, file.token_file) {
        (Some(t), _, _, _) => Ok(t),
        (None, Some(p), _, _) => read_token(&p),
        (None, None, Some(t), _) => Ok(t),
        (None, None, None, Some(p)) => read_token(&p),
        _ => Err(anyhow::anyhow!("no token: set DCTL_TOKEN, pass --token-file FILE, or put token_file = \"...\" in ~/.config/ductile/dctl.toml")),
    };
    let token = match (token, &dry) {
        (Ok(t), _) => t,
        (Err(e), None) => return Err(e),
        (Err(e), Some(((_, local), _))) => {
            return dry_run_done(local.clone(), None, Some(format!("{e:#}")), cli.json);
        }
    };
    let mut http = reqwest::Client::builder().timeout(Duration::from_secs(15));
    if let Some(ca) = cli.ca.or(file.ca) {
        let pem = std::fs::read(&ca)
            .map_err(|e| anyhow::anyhow!("cannot read the CA file {}: {e}", ca.display()))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
            anyhow::anyhow!("the CA file {} is not PEM certificates: {e}", ca.display())
        })?;
        if certs.is_empty() {
            anyhow::bail!("the CA file {} holds no certificate", ca.display());
        }
        http = http.tls_certs_only(certs);
    } else if endpoint.starts_with("http://") {
        // a plain endpoint never verifies a certificate: skip loading the system's trust
        // store, which costs each call (scripts and `watch` run dctl often) a parse of every
        // system certificate
        http = http.tls_certs_only(Vec::new());
    }
    let http = http.build()?;
    let c = Client {
        http,
        endpoint,
        token,
    };
    use reqwest::Method;
    let json = cli.json;
    if let Some(((spec, local), label)) = dry {
        // the daemon's own checks, nothing stored: the agents that allow it, the sharding it
        // chooses; a daemon that cannot be reached leaves the local checks' answer
        let asked = c
            .call(
                Method::POST,
                "/v1/dry-run",
                Some(serde_json::to_value(&spec)?),
            )
            .await;
        return match asked {
            Ok(v) => dry_run_done(local, Some(v), None, json),
            Err(e) if is_unreachable(&e) => dry_run_done(local, None, Some(format!("{e:#}")), json),
            Err(e) => Err(anyhow::anyhow!("{label}: the daemon refuses it: {e:#}")),
        };
    }
    let out = |v: &serde_json::Value| println!("{}", serde_json::to_string_pretty(v).unwrap());
    match cli.cmd {
        Cmd::Submit { file, .. } => {
            let text = std::fs::read_to_string(&file)
                .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", file.display()))?;
            // Validate here first, so errors name the line; the daemon validates again.
            let (spec, notes) = JobSpec::from_toml_noting(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            for n in notes {
                eprintln!("warning: {}: {n}", file.display());
            }
            let v = c
                .call(Method::POST, "/v1/jobs", Some(serde_json::to_value(&spec)?))
                .await?;
            if json {
                out(&v);
            } else {
                println!(
                    "submitted job {} (min {}, max {}, desired {})",
                    spec.name, spec.min, spec.max, spec.desired
                );
            }
        }
        Cmd::Scale {
            job,
            size,
            wait,
            timeout,
        } => {
            let v = c
                .call(
                    Method::POST,
                    &format!("/v1/jobs/{job}/scale"),
                    Some(serde_json::to_value(ScaleRequest { size })?),
                )
                .await?;
            if !json {
                println!("job {job}: desired size is now {size}");
            }
            let v = if wait {
                let path = format!("/v1/jobs/{job}");
                let done = wait_until(&c, &path, timeout, |v: &JobView| {
                    let formed = v.world_size == size
                        && v.last_reformation.as_ref().map(|r| r.generation) == Some(v.generation);
                    let msg = format!(
                        "job {job}: world {} → {size}, generation {} ({:?})",
                        v.world_size, v.generation, v.state
                    );
                    (formed || v.state.is_terminal(), msg)
                })
                .await?;
                if done.world_size != size {
                    anyhow::bail!(
                        "job {job} ended {:?} at world {} before reaching {size}: {}",
                        done.state,
                        done.world_size,
                        done.message
                    );
                }
                if !json {
                    let secs = done.last_reformation.as_ref().map_or(0.0, |r| r.seconds);
                    println!(
                        "job {job}: generation {} formed at world {size} ({secs:.3} s from the request's trigger)",
                        done.generation
                    );
                }
                serde_json::to_value(done)?
            } else {
                v
            };
            if json {
                out(&v);
            }
        }
        Cmd::Status { job: Some(job) } => {
            let v = c
                .call(Method::GET, &format!("/v1/jobs/{job}"), None)
                .await?;
            if json {
                out(&v);
            } else {
                print_job(&serde_json::from_value(v)?);
            }
        }
        Cmd::Status { job: None } => {
            let v = c.call(Method::GET, "/v1/jobs", None).await?;
            if json {
                out(&v);
            } else {
                let jobs: Vec<JobView> = serde_json::from_value(v)?;
                println!(
                    "{:<24} {:<10} {:<5} {:<6} {:<8} {:<10}",
                    "JOB", "STATE", "GEN", "WORLD", "STEP", "LOSS"
                );
                for j in jobs {
                    println!(
                        "{:<24} {:<10} {:<5} {:<6} {:<8} {:<10}",
                        j.job,
                        format!("{:?}", j.state),
                        j.generation,
                        j.world_size,
                        j.step,
                        j.loss
                            .map(|l| format!("{l:.4}"))
                            .unwrap_or_else(|| "-".into())
                    );
                }
            }
        }
        Cmd::Nodes => {
            let v = c.call(Method::GET, "/v1/nodes", None).await?;
            if json {
                out(&v);
            } else {
                let nodes: Vec<NodeView> = serde_json::from_value(v)?;
                let mut notes = Vec::new();
                println!(
                    "{:<20} {:<6} {:<9} {:<10} {}",
                    "NODE", "SLOTS", "DEVICES", "STATE", "WORKERS"
                );
                for n in nodes {
                    let kind = n
                        .devices
                        .first()
                        .map(|d| format!("{:?}", d.kind).to_lowercase())
                        .unwrap_or_default();
                    let state = if n.draining { "draining" } else { "ready" };
                    let w: Vec<String> = n
                        .workers
                        .iter()
                        .map(|w| format!("{}#{}", w.job, w.rank))
                        .collect();
                    println!(
                        "{:<20} {:<6} {:<9} {:<10} {}",
                        n.name,
                        n.slots,
                        kind,
                        state,
                        w.join(" ")
                    );
                    if let Some(p) = &n.preemption {
                        notes.push(format!("{}: {}", n.name, p.describe()));
                    }
                    for (job, why) in &n.refused_running {
                        notes.push(format!(
                            "{}: running job {job} is refused by the agent's current policy (it keeps running; new starts are refused): {why}",
                            n.name
                        ));
                    }
                }
                // what a column cannot hold, below the table
                for line in notes {
                    println!("{line}");
                }
            }
        }
        Cmd::Drain {
            node,
            undo,
            reason,
            wait,
            timeout,
        } => {
            if undo {
                c.call(Method::DELETE, &format!("/v1/nodes/{node}/drain"), None)
                    .await?;
                println!("node {node}: drain cleared");
            } else {
                c.call(
                    Method::POST,
                    &format!("/v1/nodes/{node}/drain"),
                    Some(serde_json::to_value(DrainBody { reason })?),
                )
                .await?;
                println!("node {node}: draining");
                if wait {
                    let nodes = wait_until(&c, "/v1/nodes", timeout, |ns: &Vec<NodeView>| match ns
                        .iter()
                        .find(|n| n.name == node)
                    {
                        None => (true, format!("node {node}: gone")),
                        Some(n) => {
                            let w: Vec<String> = n
                                .workers
                                .iter()
                                .map(|w| format!("{}#{}", w.job, w.rank))
                                .collect();
                            (
                                w.is_empty(),
                                format!("node {node}: waiting for {}", w.join(" ")),
                            )
                        }
                    })
                    .await?;
                    let left = nodes.iter().any(|n| n.name == node);
                    println!(
                        "node {node}: drained ({})",
                        if left {
                            "no workers left"
                        } else {
                            "its agent left"
                        }
                    );
                }
            }
        }
        Cmd::Plot {
            job,
            out: file,
            metric,
            from,
            every,
            ..
        } => {
            // a file name that cannot be written fails before anything is fetched
            let format = file.as_deref().map(plot::Format::of).transpose()?;
            let v = c
                .call(
                    Method::GET,
                    &format!("/v1/jobs/{job}/series?from={from}&every={every}"),
                    None,
                )
                .await?;
            let s: SeriesView = serde_json::from_value(v)?;
            let (Some(file), Some(format)) = (file, format) else {
                // --term
                let width = std::env::var("COLUMNS")
                    .ok()
                    .and_then(|c| c.parse::<usize>().ok())
                    .unwrap_or(80)
                    .saturating_sub(14)
                    .clamp(20, 400);
                crate::out(&plot::term(&s, metric, width, 16)?);
                return Ok(());
            };
            let n = plot::plot(&s, metric, &file, format)?;
            if json {
                out(&serde_json::json!({
                    "job": job, "out": file, "points": n, "generations": s.marks.len(),
                    "quorums": s.quorums.len()
                }));
            } else {
                println!(
                    "wrote {}: {n} points, {} generation marker(s), {} quorum marker(s)",
                    file.display(),
                    s.marks.len(),
                    s.quorums.len()
                );
            }
        }
        Cmd::Stop { job } => {
            let v = c
                .call(Method::POST, &format!("/v1/jobs/{job}/stop"), None)
                .await?;
            if json {
                out(&v);
            } else {
                println!("job {job}: stop requested");
            }
        }
        Cmd::Completion { .. } | Cmd::Schema { .. } => {
            unreachable!("answered before any token is read")
        }
        Cmd::Get {
            what,
            name,
            output,
            state,
            watch,
        } => loop {
            let path = match what {
                Kind::Jobs => "/v1/jobs",
                Kind::Nodes => "/v1/nodes",
            };
            let v = c.call(Method::GET, path, None).await?;
            let key = if what == Kind::Jobs { "job" } else { "name" };
            let rows: Vec<serde_json::Value> = v
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter(|r| {
                    let n = r[key].as_str().unwrap_or("");
                    name.as_deref()
                        .is_none_or(|want| match want.strip_suffix('*') {
                            Some(prefix) => n.starts_with(prefix),
                            None => n == want,
                        })
                })
                .filter(|r| {
                    state.as_deref().is_none_or(|want| {
                        r["state"]
                            .as_str()
                            .is_some_and(|s| s.eq_ignore_ascii_case(want))
                    })
                })
                .collect();
            let output = if json { Some(Output::Json) } else { output };
            match output {
                Some(Output::Json) => out(&serde_json::Value::Array(rows)),
                Some(Output::Yaml) => crate::out(&serde_norway::to_string(&rows)?),
                wide => print_get(what, &rows, wide == Some(Output::Wide))?,
            }
            if !watch {
                break;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            println!();
        },
        Cmd::Describe { what, name } => match what {
            Kind::Jobs => {
                let v: JobView = serde_json::from_value(
                    c.call(Method::GET, &format!("/v1/jobs/{name}"), None)
                        .await?,
                )?;
                let spec = c
                    .call(Method::GET, &format!("/v1/jobs/{name}/spec"), None)
                    .await?;
                let events = c
                    .call(Method::GET, &format!("/v1/jobs/{name}/events"), None)
                    .await?;
                if json {
                    out(&serde_json::json!({"status": v, "spec": spec, "events": events}));
                } else {
                    print_job(&v);
                    println!("\nspec:");
                    let spec: JobSpec = serde_json::from_value(spec)?;
                    match spec.to_toml() {
                        Ok(t) => {
                            for l in t.lines() {
                                println!("  {l}");
                            }
                        }
                        Err(_) => println!("{}", serde_json::to_string_pretty(&spec)?),
                    }
                    let gens: Vec<Generation> = serde_json::from_value(events)?;
                    let shown = gens.len().saturating_sub(10);
                    println!(
                        "\ngenerations{}:",
                        if shown > 0 {
                            format!(
                                " (the last 10 of {}; dctl events {name} for all)",
                                gens.len()
                            )
                        } else {
                            String::new()
                        }
                    );
                    for g in &gens[shown..] {
                        print_generation(g);
                    }
                }
            }
            Kind::Nodes => {
                let v = c.call(Method::GET, "/v1/nodes", None).await?;
                let node = v
                    .as_array()
                    .and_then(|a| a.iter().find(|n| n["name"] == name.as_str()))
                    .cloned()
                    .ok_or_else(|| {
                        anyhow::anyhow!("no live node named {name:?} (dctl get nodes lists them)")
                    })?;
                if json {
                    out(&node);
                } else {
                    crate::out(&serde_norway::to_string(&node)?);
                }
            }
        },
        Cmd::Delete { job, purge } => {
            let path = if purge {
                format!("/v1/jobs/{job}?purge=true")
            } else {
                format!("/v1/jobs/{job}")
            };
            let v = c.call(Method::DELETE, &path, None).await?;
            if json {
                out(&v);
            } else if let Some(p) = v["purged"].as_object() {
                let n = |k: &str| p.get(k).and_then(|x| x.as_array()).map_or(0, |a| a.len());
                let left = n("foreign") + n("unowned");
                println!(
                    "job {job} deleted (it was {}); its checkpoints at {} purged: {} directories deleted{}",
                    v["state"].as_str().unwrap_or("finished"),
                    p.get("url").and_then(|u| u.as_str()).unwrap_or("?"),
                    n("deleted"),
                    if left > 0 {
                        format!(", {left} left (another job's, or naming no job)")
                    } else {
                        String::new()
                    }
                );
            } else if purge && v.get("purged").is_none() {
                // a daemon from before --purge ignores it
                println!(
                    "job {job} deleted (it was {}); the daemon is older than --purge: its checkpoints were NOT deleted",
                    v["state"].as_str().unwrap_or("finished")
                );
            } else if purge {
                println!(
                    "job {job} deleted (it was {}); it had no checkpoints to purge",
                    v["state"].as_str().unwrap_or("finished")
                );
            } else {
                println!(
                    "job {job} deleted (it was {}); its checkpoints, if any, stay at their URL (--purge deletes them)",
                    v["state"].as_str().unwrap_or("finished")
                );
            }
        }
        Cmd::Run { .. } => {
            let text = run_spec(&cli.cmd)?;
            let spec = JobSpec::from_toml(&text)
                .map_err(|e| anyhow::anyhow!("the job dctl run makes: {e}\n{text}"))?;
            let v = c
                .call(Method::POST, "/v1/jobs", Some(serde_json::to_value(&spec)?))
                .await?;
            if json {
                out(&v);
            } else {
                println!(
                    "submitted job {} (min {}, max {}, desired {}): dctl watch {}, dctl logs {}",
                    spec.name, spec.min, spec.max, spec.desired, spec.name, spec.name
                );
            }
        }
        Cmd::Version => {
            let client = env!("CARGO_PKG_VERSION");
            let server = match c.call(Method::GET, "/v1/version", None).await {
                Ok(v) => v["version"].as_str().unwrap_or("?").to_string(),
                Err(e) => format!("unreachable: {e:#}"),
            };
            if json {
                out(&serde_json::json!({"client": client, "server": server}));
            } else {
                println!("client  dctl {client}");
                println!("server  ductiled {server}");
            }
        }
        Cmd::Plan { job, world } => {
            let v = c
                .call(
                    Method::GET,
                    &format!("/v1/jobs/{job}/plan?world={world}"),
                    None,
                )
                .await?;
            if json {
                out(&v);
            } else {
                print_plan(&v);
            }
        }
        Cmd::Export {
            job,
            step,
            out: dest,
            max_shard_mb,
        } => {
            let v = c
                .call(Method::GET, &format!("/v1/jobs/{job}/spec"), None)
                .await?;
            let spec: JobSpec = serde_json::from_value(v)?;
            let (step, files) = export::export(&spec, step, &dest, max_shard_mb).await?;
            if json {
                out(&serde_json::json!({"job": job, "step": step, "out": dest, "files": files}));
            } else {
                println!(
                    "exported job {job} at step {step} to {dest}: {}",
                    files.join(", ")
                );
            }
        }
        Cmd::TorchftRelay { .. } => unreachable!("handled before the API's token is read"),
        Cmd::Torchft => {
            let v = c.call(Method::GET, "/v1/torchft", None).await?;
            if json {
                out(&v);
            } else {
                print_torchft(&v);
            }
        }
        Cmd::Checkpoints { job } => {
            let v = c
                .call(Method::GET, &format!("/v1/jobs/{job}/checkpoints"), None)
                .await?;
            if json {
                out(&v);
            } else {
                print_checkpoints(&v);
            }
        }
        Cmd::Events {
            job,
            follow,
            quorums: quorums_json,
        } => {
            let mut after = 0;
            let mut after_q: i64 = -1;
            // a torchft job's quorums go between its generations, by time
            let torchft = {
                let spec: ductile_cluster::records::JobSpec = serde_json::from_value(
                    c.call(Method::GET, &format!("/v1/jobs/{job}/spec"), None)
                        .await?,
                )?;
                spec.runtime == ductile_cluster::records::Runtime::Torchft
            };
            loop {
                let v = c
                    .call(
                        Method::GET,
                        &format!("/v1/jobs/{job}/events?after={after}"),
                        None,
                    )
                    .await?;
                let gens: Vec<Generation> = serde_json::from_value(v)?;
                let quorums: Vec<ductile_cluster::api::TorchftQuorumView> =
                    if torchft && (!json || quorums_json) {
                        serde_json::from_value(
                            c.call(
                                Method::GET,
                                &format!("/v1/jobs/{job}/quorums?after={after_q}"),
                                None,
                            )
                            .await?,
                        )?
                    } else {
                        Vec::new()
                    };
                let mut order: Vec<(u64, Option<&Generation>, Option<&_>)> = gens
                    .iter()
                    .map(|g| (g.published_at_ms, Some(g), None))
                    .chain(quorums.iter().map(|q| (q.created_ms, None, Some(q))))
                    .collect();
                order.sort_by_key(|(t, _, _)| *t);
                for (_, g, q) in order {
                    match (g, q) {
                        (Some(g), _) => {
                            if json {
                                println!("{}", serde_json::to_string(g)?);
                            } else {
                                print_generation(g);
                            }
                            after = after.max(g.number);
                        }
                        (None, Some(q)) => {
                            if json {
                                println!("{}", serde_json::json!({ "torchft_quorum": q }));
                            } else {
                                print_quorum(q);
                            }
                            after_q = after_q.max(q.quorum_id);
                        }
                        _ => {}
                    }
                }
                if !follow {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        Cmd::Logs {
            job,
            rank,
            generation,
            tail,
            follow,
        } => {
            let mut query = vec![format!("rank={}", rank.unwrap_or(0))];
            query.extend(generation.map(|g| format!("generation={g}")));
            query.extend(tail.map(|n| format!("tail={n}")));
            let v: ductile_cluster::api::LogView = serde_json::from_value(
                c.call(
                    Method::GET,
                    &format!("/v1/jobs/{job}/logs?{}", query.join("&")),
                    None,
                )
                .await?,
            )?;
            if json {
                println!("{}", serde_json::to_string(&v)?);
            } else {
                if v.truncated {
                    eprintln!("(older lines left out: an answer holds at most 512 KiB; the whole file is {} on node {})", v.file, v.node);
                }
                print!("{}", clean(&v.text));
            }
            let mut offset = v.offset;
            // the same file from there on, until the job has ended and nothing more came
            if follow {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let more: ductile_cluster::api::LogView = serde_json::from_value(
                        c.call(
                            Method::GET,
                            &format!(
                                "/v1/jobs/{job}/logs?node={}&slot={}&offset={offset}",
                                v.node, v.slot
                            ),
                            None,
                        )
                        .await?,
                    )?;
                    if json {
                        if !more.text.is_empty() {
                            println!("{}", serde_json::to_string(&more)?);
                        }
                    } else {
                        print!("{}", clean(&more.text));
                    }
                    // piped (dctl logs -f | grep ...): each answer as it comes
                    let _ = std::io::Write::flush(&mut std::io::stdout());
                    offset = more.offset;
                    if more.text.is_empty() {
                        let s: JobView = serde_json::from_value(
                            c.call(Method::GET, &format!("/v1/jobs/{job}"), None)
                                .await?,
                        )?;
                        if s.state.is_terminal() {
                            break;
                        }
                    }
                }
            }
        }
        Cmd::Watch { job } => {
            let mut last_gen = 0;
            let mut losses: std::collections::VecDeque<f64> = Default::default();
            // a built-in job's end and global batch: step of max_steps and the time left
            let spec: Option<JobSpec> = c
                .call(Method::GET, &format!("/v1/jobs/{job}/spec"), None)
                .await
                .ok()
                .and_then(|v| serde_json::from_value(v).ok());
            let goal = spec
                .as_ref()
                .and_then(|s| s.training.as_ref())
                .and_then(|t| Some((t.max_steps?, t.global_batch)));
            loop {
                let v: JobView = serde_json::from_value(
                    c.call(Method::GET, &format!("/v1/jobs/{job}"), None)
                        .await?,
                )?;
                if json {
                    println!("{}", serde_json::to_string(&v)?);
                } else {
                    if v.generation != last_gen {
                        println!(
                            "-- generation {} world {} {}",
                            v.generation, v.world_size, v.message
                        );
                        last_gen = v.generation;
                    }
                    if let Some(l) = v.loss {
                        if losses.len() == 32 {
                            losses.pop_front();
                        }
                        losses.push_back(l);
                    }
                    println!(
                        "{:?} step {} loss {} samples/s {} ckpt {}  {}",
                        v.state,
                        progress(v.step, v.samples_per_sec, goal),
                        v.loss
                            .map(|l| format!("{l:.4}"))
                            .unwrap_or_else(|| "-".into()),
                        v.samples_per_sec
                            .map(|s| format!("{s:.1}"))
                            .unwrap_or_else(|| "-".into()),
                        v.last_checkpoint
                            .as_ref()
                            .map(|c| c.step.to_string())
                            .unwrap_or_else(|| "-".into()),
                        plot::sparkline(losses.make_contiguous(), 32)
                    );
                }
                if v.state.is_terminal() {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    Ok(())
}

/// The last checkpoint in a line: `step 200, committed 1m20s ago (12.3 MiB at world 4)`.
fn checkpoint_line(c: &ductile_cluster::api::LastCheckpointView) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let ago = if c.at_ms == 0 {
        String::new()
    } else {
        let s = now.saturating_sub(c.at_ms) / 1000;
        match s {
            s if s >= 3600 => format!(" {}h{:02}m ago", s / 3600, s % 3600 / 60),
            s if s >= 60 => format!(" {}m{:02}s ago", s / 60, s % 60),
            s => format!(" {s}s ago"),
        }
    };
    let what = if c.kind == "commit" {
        "committed"
    } else {
        "saved by the program"
    };
    let size = match (c.bytes, c.world_size) {
        (Some(b), Some(w)) => format!(" ({:.1} MiB at world {w})", b as f64 / (1u64 << 20) as f64),
        _ => String::new(),
    };
    format!("step {}, {what}{ago}{size}", c.step)
}

/// `step`, and where the job's end is known (a built-in job's `max_steps`, its global batch):
/// `step/max (pct%, ETA 1h02m)`, the time left at the current samples/s.
fn progress(step: u64, samples_per_sec: Option<f64>, goal: Option<(u64, u32)>) -> String {
    let Some((max, batch)) = goal.filter(|(m, _)| *m > 0) else {
        return step.to_string();
    };
    let pct = (step as f64 / max as f64 * 100.0).min(100.0);
    let eta = match samples_per_sec.filter(|s| *s > 0.0) {
        Some(sps) if step < max => {
            let secs = ((max - step) as f64 * batch as f64 / sps).round() as u64;
            match secs {
                s if s >= 3600 => format!(", ETA {}h{:02}m", s / 3600, s % 3600 / 60),
                s if s >= 60 => format!(", ETA {}m{:02}s", s / 60, s % 60),
                s => format!(", ETA {s}s"),
            }
        }
        _ => String::new(),
    };
    format!("{step}/{max} ({pct:.0}%{eta})")
}

/// Poll `path` every half second until `done` says so (its message on a spinner while the
/// terminal shows one), at most `timeout_s` seconds; the last answer.
async fn wait_until<T: serde::de::DeserializeOwned>(
    c: &Client,
    path: &str,
    timeout_s: u64,
    mut done: impl FnMut(&T) -> (bool, String),
) -> anyhow::Result<T> {
    let bar = indicatif::ProgressBar::new_spinner();
    bar.enable_steady_tick(Duration::from_millis(120));
    let start = std::time::Instant::now();
    let limit = Duration::from_secs(timeout_s);
    loop {
        let v: T = serde_json::from_value(c.call(reqwest::Method::GET, path, None).await?)?;
        let (ok, msg) = done(&v);
        bar.set_message(format!("{msg} [{:.0} s]", start.elapsed().as_secs_f64()));
        if ok {
            bar.finish_and_clear();
            return Ok(v);
        }
        if start.elapsed() >= limit {
            bar.abandon();
            anyhow::bail!("still waiting after {timeout_s} s: {msg}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `dctl get`'s table: jobs (name, state, generation, world, step, loss; wide: desired, min,
/// max, layout, samples/s, message) or nodes (name, slots, devices, state, workers; wide:
/// hostname, agent pid, busy slots, preemption notice).
fn print_get(what: Kind, rows: &[serde_json::Value], wide: bool) -> anyhow::Result<()> {
    let s = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "-".into(),
        v => v.to_string(),
    };
    match what {
        Kind::Jobs => {
            let mut head = format!(
                "{:<24} {:<10} {:>5} {:>5} {:>8} {:>8}",
                "NAME", "STATE", "GEN", "WORLD", "STEP", "LOSS"
            );
            if wide {
                head.push_str(&format!(
                    " {:>7} {:>4} {:>4} {:<16} {:>10}  MESSAGE",
                    "DESIRED", "MIN", "MAX", "LAYOUT", "SAMPLES/S"
                ));
            }
            println!("{head}");
            for r in rows {
                let v: JobView = serde_json::from_value(r.clone())?;
                let mut line = format!(
                    "{:<24} {:<10} {:>5} {:>5} {:>8} {:>8}",
                    v.job,
                    format!("{:?}", v.state),
                    v.generation,
                    v.world_size,
                    v.step,
                    v.loss
                        .map(|l| format!("{l:.4}"))
                        .unwrap_or_else(|| "-".into())
                );
                if wide {
                    line.push_str(&format!(
                        " {:>7} {:>4} {:>4} {:<16} {:>10}  {}",
                        v.desired,
                        v.min,
                        v.max,
                        v.layout
                            .map(|l| l.to_string())
                            .unwrap_or_else(|| "-".into()),
                        v.samples_per_sec
                            .map(|x| format!("{x:.1}"))
                            .unwrap_or_else(|| "-".into()),
                        v.message
                    ));
                }
                println!("{line}");
            }
        }
        Kind::Nodes => {
            let mut head = format!(
                "{:<20} {:>5} {:<8} {:<9} {}",
                "NAME", "SLOTS", "DEVICES", "STATE", "WORKERS"
            );
            if wide {
                head = format!(
                    "{head:<64} {:<20} {:>9} {:<12} PREEMPTION",
                    "HOSTNAME", "AGENT_PID", "BUSY_SLOTS"
                );
            }
            println!("{head}");
            for r in rows {
                let workers: Vec<String> = r["workers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|w| format!("{}#{}", s(&w["job"]), s(&w["rank"])))
                    .collect();
                let devices = r["devices"]
                    .as_array()
                    .and_then(|d| d.first())
                    .map(|d| s(&d["kind"]).to_lowercase())
                    .unwrap_or_default();
                let state = if r["draining"].as_bool() == Some(true) {
                    "draining"
                } else {
                    "ready"
                };
                let mut line = format!(
                    "{:<20} {:>5} {:<8} {:<9} {}",
                    s(&r["name"]),
                    s(&r["slots"]),
                    devices,
                    state,
                    workers.join(" ")
                );
                if wide {
                    let busy: Vec<String> = r["busy_slots"]
                        .as_object()
                        .into_iter()
                        .flatten()
                        .map(|(k, _)| k.clone())
                        .collect();
                    line = format!(
                        "{line:<64} {:<20} {:>9} {:<12} {}",
                        s(&r["hostname"]),
                        s(&r["agent_pid"]),
                        if busy.is_empty() {
                            "-".into()
                        } else {
                            busy.join(",")
                        },
                        s(&r["preemption"])
                    );
                }
                println!("{line}");
            }
        }
    }
    Ok(())
}

/// The job spec (TOML) `dctl run` submits: a program job of `runtime` running `command`, its
/// name the script's and a few random hex digits unless `--name` gives one; a script (or any
/// argument) that names a file here is made absolute.
fn run_spec(cmd: &Cmd) -> anyhow::Result<String> {
    let Cmd::Run {
        name,
        nproc,
        min,
        max,
        runtime,
        integrations,
        restart_budget,
        env,
        command,
        ..
    } = cmd
    else {
        unreachable!("run_spec of a dctl run only")
    };
    let command: Vec<String> = command
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let p = std::path::Path::new(a);
            if i > 0 && p.is_relative() && !a.starts_with('-') && p.is_file() {
                std::path::absolute(p)
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|_| a.clone())
            } else {
                a.clone()
            }
        })
        .collect();
    let name = match name {
        Some(n) => n.clone(),
        None => {
            let script = command
                .iter()
                .skip(1)
                .find(|a| a.ends_with(".py"))
                .and_then(|a| std::path::Path::new(a).file_stem())
                .map(|s| s.to_string_lossy().to_lowercase())
                .or_else(|| {
                    let i = command.iter().position(|a| a == "-m")?;
                    command.get(i + 1).map(|m| m.replace('.', "-"))
                })
                .unwrap_or_else(|| "run".into());
            let script: String = script
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' {
                        c
                    } else {
                        '-'
                    }
                })
                .collect();
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos() ^ std::process::id())
                .unwrap_or(0);
            format!("{script}-{:04x}", nanos & 0xffff)
        }
    };
    let mut t = toml::Table::new();
    t.insert("name".into(), name.into());
    t.insert("runtime".into(), runtime.clone().into());
    t.insert(
        "command".into(),
        toml::Value::Array(command.into_iter().map(toml::Value::from).collect()),
    );
    t.insert("min".into(), i64::from(min.unwrap_or(*nproc)).into());
    t.insert("max".into(), i64::from(max.unwrap_or(*nproc)).into());
    t.insert("desired".into(), i64::from(*nproc).into());
    if let Some(b) = restart_budget {
        t.insert("restart_budget".into(), i64::from(*b).into());
    }
    if !env.is_empty() {
        let mut e = toml::Table::new();
        for kv in env {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("--env {kv:?}: NAME=VALUE"))?;
            e.insert(k.into(), v.into());
        }
        t.insert("env".into(), toml::Value::Table(e));
    }
    if !integrations.is_empty() {
        let mut p = toml::Table::new();
        p.insert(
            "integrations".into(),
            toml::Value::Array(
                integrations
                    .iter()
                    .cloned()
                    .map(toml::Value::from)
                    .collect(),
            ),
        );
        t.insert("program".into(), toml::Value::Table(p));
    }
    Ok(toml::to_string(&t)?)
}

/// `dctl submit --dry-run FILE`: the spec checked here as the daemon checks it at submit, and
/// what would run: the runtime and sizes, and for a built-in training job the plan at its
/// desired size (layout, stages, memory per rank), as `dctl plan` shows a submitted job's.
async fn dry_run(
    text: &str,
    file: &str,
    json: bool,
) -> anyhow::Result<(JobSpec, serde_json::Value)> {
    let (mut spec, notes) =
        JobSpec::from_toml_noting(text).map_err(|e| anyhow::anyhow!("{}: {e}", file))?;
    for n in notes {
        eprintln!("warning: {file}: {n}");
    }
    // a Hugging Face directory's config.json, read as the daemon reads it at submit (the plan
    // and the checks that need the model's shape use it)
    if let Some(t) = spec
        .training
        .as_mut()
        .filter(|t| t.model == ductile_cluster::modes::ModelKind::Hf)
    {
        let url = t.model_path.clone().unwrap_or_default();
        use ductile_checkpoint::hf::{read_config_json, ConfigJsonError};
        t.hf_config = Some(
            read_config_json(&url, "the daemon at submit")
                .await
                .map_err(|e| match e {
                    ConfigJsonError::NotAModel(why) => {
                        anyhow::anyhow!("{file}: training.model_path: {why}")
                    }
                    ConfigJsonError::Store(why) => anyhow::anyhow!(
                        "{file}: training.model_path: cannot read {url} from here: {why}"
                    ),
                })?,
        );
        spec.validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", file))?;
    }
    let plan = match &spec.training {
        Some(t) if spec.runtime == ductile_cluster::records::Runtime::Ductile => Some(
            ductile_strategies::pipeline::plan(t, spec.desired).map_err(|e| {
                anyhow::anyhow!(
                    "{}: no plan at the desired size {}: {e}",
                    file,
                    spec.desired
                )
            })?,
        ),
        _ => None,
    };
    let runtime = serde_json::to_value(spec.runtime)?;
    let report = serde_json::json!({
        "job": spec.name,
        "valid": true,
        "runtime": runtime,
        "min": spec.min,
        "max": spec.max,
        "desired": spec.desired,
        "command": spec.command,
        "plan": plan,
    });
    if json {
        return Ok((spec, report));
    }
    println!(
        "{}: job {} is valid (not submitted): runtime {}, min {}, max {}, desired {}",
        file,
        spec.name,
        runtime.as_str().unwrap_or("?"),
        spec.min,
        spec.max,
        spec.desired
    );
    if !spec.command.is_empty() {
        println!("command     {:?}", spec.command);
    }
    if let Some(p) = plan {
        println!("the plan at the desired size:");
        print_plan(&serde_json::to_value(&p)?);
    }
    Ok((spec, report))
}

/// The end of a dry run: the daemon's answer (`server`: the agents that allow the job) or why
/// it was not asked (`server_not_asked`), after the local checks' report.
fn dry_run_done(
    mut local: serde_json::Value,
    server: Option<serde_json::Value>,
    not_asked: Option<String>,
    json: bool,
) -> anyhow::Result<()> {
    if json {
        local["server"] = server.unwrap_or(serde_json::Value::Null);
        if let Some(w) = not_asked {
            local["server_not_asked"] = w.into();
        }
        println!("{}", serde_json::to_string_pretty(&local)?);
        return Ok(());
    }
    match (server, not_asked) {
        (Some(v), _) => {
            let a = &v["agents"];
            let names = |k: &str| -> Vec<String> {
                a[k].as_array()
                    .map(|l| {
                        l.iter()
                            .filter_map(|n| n.as_str().map(String::from))
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let allowed = names("allowed");
            println!(
                "agents      {} allow it ({} slots not draining){}",
                allowed.len(),
                a["slots"].as_u64().unwrap_or(0),
                if allowed.is_empty() {
                    String::new()
                } else {
                    format!(": {}", allowed.join(", "))
                }
            );
            if let Some(r) = a["refused"].as_object() {
                for (node, why) in r {
                    println!(
                        "            {node} refuses it: {}",
                        why.as_str().unwrap_or("?")
                    );
                }
            }
            if let Some(s) = v["spec"]["training"]["sharding"].as_str() {
                println!("sharding    {s} (as the daemon would store it)");
            }
        }
        (None, Some(why)) => {
            println!("agents      not asked (the daemon: {why}); the checks above are dctl's own")
        }
        (None, None) => {}
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    // a closed pipe (`dctl status | head`) ends dctl quietly, as it does cat or ls: Rust
    // ignores SIGPIPE by default, and println! would panic on the write error
    // SAFETY: setting a signal's disposition to the default, before any thread writes
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // reqwest is built without a default TLS provider (ring builds fast): install ring's
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    if let Err(e) = run(cli).await {
        eprintln!("dctl: {e:#}");
        std::process::exit(1);
    }
}

fn print_checkpoints(v: &serde_json::Value) {
    println!(
        "{} (keep {})",
        v["url"].as_str().unwrap_or("?"),
        v["keep"].as_u64().unwrap_or(0)
    );
    println!(
        "{:>10}  {:>6}  {:<10}  {:<24}  {:>12}  {:>5}  layout",
        "step", "gen", "state", "time (UTC)", "size", "world"
    );
    for c in v["checkpoints"].as_array().into_iter().flatten() {
        let layout = &c["layout"];
        let layout = if layout.is_null() {
            "-".to_string()
        } else {
            format!(
                "dp{}×pp{}×tp{}",
                layout["data_parallel"], layout["pipeline_parallel"], layout["tensor_parallel"]
            )
        };
        println!(
            "{:>10}  {:>6}  {:<10}  {:<24}  {:>12}  {:>5}  {layout}",
            // (a JSON value's Display ignores the width: its text is padded)
            c["step"].to_string(),
            c["generation"].to_string(),
            c["state"].as_str().unwrap_or("?"),
            utc(c["time_ms"].as_u64().unwrap_or(0)),
            human_bytes(c["bytes"].as_u64().unwrap_or(0)),
            c["world_size"].to_string(),
        );
    }
}

fn human_bytes(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{x:.1} {}", units[u])
    }
}

/// `YYYY-MM-DD HH:MM:SS` (UTC) of milliseconds since the epoch.
fn utc(ms: u64) -> String {
    ductile_cluster::records::utc(ms)
}

#[cfg(test)]
mod progress_tests {
    #[test]
    fn progress_says_step_of_max_and_the_time_left_at_the_current_rate() {
        // 40 steps left of 8 samples at 4 samples/s: 80 s
        assert_eq!(
            super::progress(60, Some(4.0), Some((100, 8))),
            "60/100 (60%, ETA 1m20s)"
        );
        assert_eq!(
            super::progress(100, Some(4.0), Some((100, 8))),
            "100/100 (100%)"
        );
        assert_eq!(super::progress(5, None, Some((100, 8))), "5/100 (5%)");
        // a program job: its end is its own
        assert_eq!(super::progress(5, Some(4.0), None), "5");
    }
}

#[cfg(test)]
mod clean_tests {
    #[test]
    fn control_characters_are_shown_not_sent() {
        assert_eq!(super::clean("ok\tline\n"), "ok\tline\n");
        assert_eq!(super::clean("a\x1b[2Jb\x07"), "a\\u{1b}[2Jb\\u{7}");
        assert_eq!(super::clean("\u{9b}31m"), "\\u{9b}31m");
    }
}

#[cfg(test)]
mod checkpoint_tests {
    #[test]
    fn times_and_sizes_read_like_a_person_writes_them() {
        assert_eq!(super::utc(0), "1970-01-01 00:00:00");
        assert_eq!(super::utc(1_795_000_000_000), "2026-11-18 11:06:40");
        assert_eq!(super::human_bytes(512), "512 B");
        assert_eq!(super::human_bytes(3 << 20), "3.0 MiB");
    }
}

/// `dctl torchft`'s table.
fn print_torchft(v: &serde_json::Value) {
    let rooms = v["rooms"].as_array().cloned().unwrap_or_default();
    if rooms.is_empty() {
        println!("no TorchFT lighthouse room yet (no replica has called ductiled's lighthouse)");
    }
    for r in rooms {
        let room = r["room"].as_str().unwrap_or("?");
        match r["quorum"].as_object() {
            Some(q) => {
                println!(
                    "room {room}: quorum {} issued by {} ({})",
                    q["quorum_id"],
                    q["issued_by"].as_str().unwrap_or("?"),
                    q["reason"].as_str().unwrap_or("")
                );
                println!("  {:<48} {:>8} {:>6}  ADDRESS", "REPLICA", "STEP", "WORLD");
                for m in q["participants"].as_array().cloned().unwrap_or_default() {
                    println!(
                        "  {:<48} {:>8} {:>6}  {}",
                        m["replica_id"].as_str().unwrap_or("?"),
                        m["step"].to_string(),
                        m["world_size"].to_string(),
                        m["address"].as_str().unwrap_or("")
                    );
                }
            }
            None => println!("room {room}: no quorum yet"),
        }
        let waiting = r["waiting"].as_array().map_or(0, |w| w.len());
        let beating = r["heartbeats_ms_ago"].as_object().map_or(0, |h| h.len());
        println!("  waiting for a quorum: {waiting}; heartbeating: {beating}");
        for q in r["issued"].as_array().cloned().unwrap_or_default() {
            let members: Vec<String> = q["members"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .filter_map(|m| m.as_str().map(String::from))
                .collect();
            println!(
                "  quorum {:>4} by {}: {}",
                q["quorum_id"],
                q["issued_by"].as_str().unwrap_or("?"),
                members.join(", ")
            );
        }
    }
}

/// The recipe in one line: the optimizer's settings, then the schedule.
fn recipe_line(r: &ductile_cluster::recipe::Recipe) -> String {
    let o = &r.optimizer;
    let settings: Vec<String> = o
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, v)| {
                    *k != "name"
                        && !(*k == "no_decay" && v.as_array().is_some_and(|a| a.is_empty()))
                })
                .map(|(k, v)| format!("{k} {v}"))
                .collect()
        })
        .unwrap_or_default();
    let p = &r.lr_schedule;
    let decay = match (p.decay, p.max_steps) {
        (ductile_cluster::modes::Decay::Constant, _) | (_, None) => "then constant".to_string(),
        (ductile_cluster::modes::Decay::Wsd, Some(m)) => format!(
            "held, then {} over the last {} steps to {:.3e} at step {m}",
            p.wsd_decay,
            p.decay_steps.unwrap_or(0),
            p.lr * p.min_lr_ratio
        ),
        (d, Some(m)) => format!("then {d} to {:.3e} at step {m}", p.lr * p.min_lr_ratio),
    };
    format!(
        "{} ({}); lr {:.3e}, warm-up {} steps{}, {decay}",
        o["name"].as_str().unwrap_or("?"),
        settings.join(", "),
        p.lr,
        p.warmup_steps,
        if p.warmup_from_zero { " from 0" } else { "" },
    )
}

#[cfg(test)]
mod recipe_tests {
    use ductile_cluster::recipe::{LrPlan, LrSchedule, OptimizerSpec, Recipe};
    use ductile_cluster::records::OptimizerKind;

    #[test]
    fn a_recipe_reads_as_one_line() {
        let default = Recipe::new(
            &OptimizerSpec::named(OptimizerKind::Adamw),
            LrPlan::new(3e-4, Some(200), None),
            false,
        );
        assert_eq!(
            super::recipe_line(&default),
            "adamw (betas [0.9,0.95], eps 1e-8, weight_decay 0.01); lr 3.000e-4, warm-up 10 steps, then cosine to 3.000e-5 at step 200"
        );
        let wsd: LrSchedule =
            toml::from_str("warmup_steps = 100\nwarmup_from_zero = true\ndecay = \"wsd\"\ndecay_steps = 50\nmin_lr = 0.0\n").unwrap();
        let sgd = OptimizerSpec {
            no_decay: vec!["bias".into()],
            ..OptimizerSpec::named(OptimizerKind::Sgd)
        };
        assert_eq!(
            super::recipe_line(&Recipe::new(
                &sgd,
                LrPlan::new(0.1, Some(1000), Some(&wsd)),
                true
            )),
            "sgd (momentum 0.9, nesterov false, no_decay [\"bias\"], weight_decay 0.0); lr 1.000e-1, warm-up 100 steps from 0, held, then linear over the last 50 steps to 0.000e0 at step 1000"
        );
    }
}

//! Recovery of the frameworks users bring (issue 48), each against its named peer in the same
//! sitting, at world 2 on CPU, one worker SIGKILLed per round; the time from the kill to the
//! next completed training step of the restarted world (rank 0's step log, written by a
//! callback a wrapper adds around the unmodified script, the same under both: the first step
//! by a process that did not step before the kill).
//!
//! - `ductile-bench trainer-recovery`: Hugging Face's `Trainer` (`examples/transformers/
//!   trainer_lm.py`) under `torchrun --nproc-per-node=2 --max-restarts=N` against ductile's
//!   `runtime = "torchrun"` with `integrations = ["transformers"]` (which also resumes from the
//!   newest checkpoint: torchrun's restarted world starts again at step 0, so its "next step"
//!   is step 1).
//! - `ductile-bench tf-recovery`: a Keras `model.fit` under `MultiWorkerMirroredStrategy`
//!   (`examples/tensorflow/keras_fit.py`, `BackupAndRestore`) restarted by hand (this bench as
//!   the human with instant reflexes: the moment a worker dies, the other is killed and both
//!   start again with a fresh `TF_CONFIG`) against ductile's `runtime = "tf"`.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ductile_tests::*;

use crate::torchrun::{unix_now, StepLog, PAUSE};
use crate::{median, recovery_summary as summary};

/// Wraps a Trainer script: a callback writing rank 0's step log (`unix_time pid world step`),
/// then the script as `python3` would run it.
const TRAINER_WRAPPER: &str = r#"import os, runpy, sys, time
import transformers
log, target = sys.argv[2], sys.argv[3:]
class _StepLog(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.is_world_process_zero:
            with open(log, "a") as f:
                f.write(f"{time.time()} {os.getpid()} {os.environ.get('WORLD_SIZE', '1')} {state.global_step}\n")
_init = transformers.Trainer.__init__
def _init_(self, *a, **kw):
    _init(self, *a, **kw)
    self.add_callback(_StepLog())
transformers.Trainer.__init__ = _init_
sys.argv = target
sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
runpy.run_path(target[0], run_name="__main__")
"#;

/// Wraps a Keras script: a callback in every `fit` writing the chief's step log (the
/// optimizer's iterations), then the script.
const KERAS_WRAPPER: &str = r#"import json, os, runpy, sys, time
import tf_keras as keras
log, target = sys.argv[2], sys.argv[3:]
_cfg = json.loads(os.environ.get("TF_CONFIG", "{}"))
_chief = _cfg.get("task", {}).get("index", 0) == 0
_world = len(_cfg.get("cluster", {}).get("worker", [])) or 1
class _StepLog(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if _chief:
            with open(log, "a") as f:
                f.write(f"{time.time()} {os.getpid()} {_world} {int(self.model.optimizer.iterations.numpy())}\n")
_fit = keras.Model.fit
def _fit_(self, *a, **kw):
    kw["callbacks"] = list(kw.get("callbacks") or []) + [_StepLog()]
    return _fit(self, *a, **kw)
keras.Model.fit = _fit_
sys.argv = target
sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
runpy.run_path(target[0], run_name="__main__")
"#;

fn write_wrapper(dir: &Path, name: &str, text: &str) -> anyhow::Result<String> {
    let p = dir.join(name);
    std::fs::write(&p, text)?;
    Ok(p.display().to_string())
}

fn quoted(command: &[String]) -> String {
    command
        .iter()
        .map(|a| format!("{a:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// ductile's side: the job at world 2 on one agent with 2 slots; rank `round % 2`'s program
/// SIGKILLed per round. (times, rounds without recovery)
async fn ductile_rounds(
    c: &Cluster,
    job: &str,
    steps: &mut StepLog,
    rounds: usize,
    bound: Duration,
) -> anyhow::Result<(Vec<f64>, usize)> {
    let (mut ours, mut failed) = (Vec::new(), 0);
    for round in 0..rounds {
        c.wait_world(job, 2, bound);
        steps.steps(20, bound).await?;
        tokio::time::sleep(PAUSE).await;
        let v = c.status(job);
        let victim = v
            .members
            .iter()
            .find(|m| m.rank as usize == round % 2)
            .and_then(|m| m.program_pid)
            .ok_or_else(|| anyhow::anyhow!("rank {}'s program has not started", round % 2))?;
        let t_kill = unix_now();
        unsafe { libc::kill(victim as i32, libc::SIGKILL) };
        match steps.restarted(t_kill, bound, None).await {
            Some((s, w)) => {
                println!(
                    "ductile, kill {round} (rank {}, pid {victim}): next step of the restarted world (size {w}) after {s:.3} s",
                    round % 2
                );
                ours.push(s);
            }
            None => {
                println!(
                    "ductile, kill {round}: no step within {} s",
                    bound.as_secs()
                );
                failed += 1;
            }
        }
    }
    Ok((ours, failed))
}

fn ratio(ours: &[f64], theirs: &[f64], peer: &str) {
    if !theirs.is_empty() && !ours.is_empty() {
        println!(
            "ratio ductile / {peer} (medians): {:.3}",
            median(&mut ours.to_vec()) / median(&mut theirs.to_vec())
        );
    }
}

pub async fn trainer(rounds: usize) -> anyhow::Result<()> {
    let py = torch_python_bin();
    let script = repo_root()
        .join("examples/transformers/trainer_lm.py")
        .display()
        .to_string();
    let bound = Duration::from_secs(120);
    let args = |out: &Path| -> Vec<String> {
        [
            "--output_dir",
            &out.display().to_string(),
            "--max_steps",
            "1000000",
            "--save_steps",
            "50",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };

    // torchrun itself
    let dir = TempDir::new("bench-trainer-torchrun");
    let wrapper = write_wrapper(dir.path(), "steplog.py", TRAINER_WRAPPER)?;
    let log = dir.path().join("steps.log");
    let mut agent: Child = Command::new(&py)
        .args([
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
        ])
        .arg(format!("--max-restarts={}", rounds + 1))
        .arg(&wrapper)
        .arg("--step-log")
        .arg(&log)
        .arg(&script)
        .args(args(&dir.path().join("out")))
        .env("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("TOKENIZERS_PARALLELISM", "false")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("torchrun.log"))?)
        .spawn()?;
    let mut steps = StepLog::new(&log);
    let (mut theirs, mut theirs_failed) = (Vec::new(), 0);
    steps.steps(20, bound).await?;
    for round in 0..rounds {
        tokio::time::sleep(PAUSE).await;
        let workers = crate::torchrun::children(agent.id());
        anyhow::ensure!(
            workers.len() == 2,
            "torchrun runs {} workers, not 2",
            workers.len()
        );
        let victim = workers[round % 2];
        let t_kill = unix_now();
        unsafe { libc::kill(victim as i32, libc::SIGKILL) };
        match steps.restarted(t_kill, bound, None).await {
            Some((s, _)) => {
                let at = steps.last.map(|e| e.3).unwrap_or(0);
                println!("torchrun, kill {round} (pid {victim}): next step (step {at}: from 0 again) after {s:.3} s");
                theirs.push(s);
                steps.steps(20, bound).await?;
            }
            None => {
                println!(
                    "torchrun, kill {round} (pid {victim}): no step within {} s (see {})",
                    bound.as_secs(),
                    dir.path().join("torchrun.log").display()
                );
                theirs_failed += 1;
                break;
            }
        }
    }
    let _ = agent.kill();
    let _ = agent.wait();
    std::thread::sleep(Duration::from_millis(300));

    // ductile: runtime = "torchrun" with the transformers integration
    let c = {
        let mut c = Cluster::start(Spec::default());
        let flags = torchrun_agent_flags();
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        c.start_agent("node1", 2, &flags);
        c
    };
    let dir = TempDir::new("bench-trainer-ductile");
    let wrapper = write_wrapper(dir.path(), "steplog.py", TRAINER_WRAPPER)?;
    let log = dir.path().join("steps.log");
    let mut command = vec![
        py.clone(),
        wrapper,
        "--step-log".into(),
        log.display().to_string(),
        script.clone(),
    ];
    command.extend(args(&dir.path().join("out")));
    c.submit(&format!(
        "name = \"bench\"\nruntime = \"torchrun\"\ncommand = [{}]\nmin = 1\nmax = 2\ndesired = 2\nrestart_budget = 1000\nenv = {{ HF_HUB_OFFLINE = \"1\", TOKENIZERS_PARALLELISM = \"false\" }}\n[torchrun]\ngrace_s = 5\nintegrations = [\"transformers\"]\n",
        quoted(&command)
    ));
    let mut steps = StepLog::new(&log);
    let (ours, ours_failed) = ductile_rounds(&c, "bench", &mut steps, rounds, bound).await?;
    println!();
    println!("{}", summary("torchrun --nproc-per-node=2 --max-restarts, HF Trainer, SIGKILL of a worker → next step (from step 0)", &theirs, theirs_failed));
    println!("{}", summary("ductile runtime = \"torchrun\" + transformers integration, SIGKILL of a worker → next step (from the newest checkpoint)", &ours, ours_failed));
    ratio(&ours, &theirs, "torchrun");
    Ok(())
}

/// Two workers of `command` with a fresh `TF_CONFIG` (ports picked now), as a user restarting
/// the world by hand does.
fn tf_world(command: &[String], log_dir: &Path) -> anyhow::Result<Vec<Child>> {
    let ports: Vec<u16> = (0..2)
        .map(|_| {
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
        })
        .collect::<Result<_, _>>()?;
    let workers: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    (0..2)
        .map(|i| {
            let cfg = serde_json::json!({
                "cluster": {"worker": workers},
                "task": {"type": "worker", "index": i},
            });
            let err = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log_dir.join(format!("worker{i}.log")))?;
            Ok(Command::new(&command[0])
                .args(&command[1..])
                .env("TF_CONFIG", cfg.to_string())
                .env("TF_CPP_MIN_LOG_LEVEL", "2")
                .stdout(Stdio::null())
                .stderr(err)
                .spawn()?)
        })
        .collect()
}

pub async fn tf(rounds: usize, min: u32) -> anyhow::Result<()> {
    let py = tf_python_bin();
    let script = repo_root()
        .join("examples/tensorflow/keras_fit.py")
        .display()
        .to_string();
    let bound = Duration::from_secs(120);
    let command = |dir: &Path, wrapper: String, log: &Path| -> Vec<String> {
        let mut c = vec![
            py.clone(),
            wrapper,
            "--step-log".into(),
            log.display().to_string(),
            script.clone(),
        ];
        c.extend(
            [
                "--output_dir",
                &dir.join("out").display().to_string(),
                "--epochs",
                "100000",
                "--steps_per_epoch",
                "100",
                "--save_freq",
                "20",
                "--step_sleep",
                "0.02",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        c
    };

    // by hand
    let dir = TempDir::new("bench-tf-hand");
    std::fs::create_dir_all(dir.path().join("out"))?;
    let wrapper = write_wrapper(dir.path(), "steplog.py", KERAS_WRAPPER)?;
    let log = dir.path().join("steps.log");
    let cmd = command(dir.path(), wrapper, &log);
    let mut world = tf_world(&cmd, dir.path())?;
    let mut steps = StepLog::new(&log);
    let (mut theirs, mut theirs_failed) = (Vec::new(), 0);
    steps.steps(20, bound).await?;
    for round in 0..rounds {
        tokio::time::sleep(PAUSE).await;
        let t_kill = unix_now();
        let _ = world[round % 2].kill();
        // the human: the moment one worker is gone, the other goes and both start again
        for w in world.iter_mut() {
            let _ = w.kill();
            let _ = w.wait();
        }
        world = tf_world(&cmd, dir.path())?;
        match steps.restarted(t_kill, bound, None).await {
            Some((s, _)) => {
                println!("by hand, kill {round}: next step of the restarted world after {s:.3} s");
                theirs.push(s);
                steps.steps(20, bound).await?;
            }
            None => {
                println!(
                    "by hand, kill {round}: no step within {} s",
                    bound.as_secs()
                );
                theirs_failed += 1;
            }
        }
    }
    for w in world.iter_mut() {
        let _ = w.kill();
        let _ = w.wait();
    }

    // ductile: runtime = "tf"
    let c = {
        let mut c = Cluster::start(Spec::default());
        let flags = tf_agent_flags();
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        c.start_agent("node1", 2, &flags);
        c
    };
    let dir = TempDir::new("bench-tf-ductile");
    std::fs::create_dir_all(dir.path().join("out"))?;
    let wrapper = write_wrapper(dir.path(), "steplog.py", KERAS_WRAPPER)?;
    let log = dir.path().join("steps.log");
    let cmd = command(dir.path(), wrapper, &log);
    c.submit(&format!(
        "name = \"bench\"\nruntime = \"tf\"\ncommand = [{}]\nmin = {min}\nmax = 2\ndesired = 2\nrestart_budget = 1000\nenv = {{ TF_CPP_MIN_LOG_LEVEL = \"2\" }}\n[torchrun]\ngrace_s = 5\nintegrations = [\"keras\"]\n",
        quoted(&cmd)
    ));
    let mut steps = StepLog::new(&log);
    let (ours, ours_failed) = ductile_rounds(&c, "bench", &mut steps, rounds, bound).await?;
    println!();
    println!("{}", summary("by hand (both workers restarted the moment one dies, fresh TF_CONFIG), Keras fit, SIGKILL of a worker → next step", &theirs, theirs_failed));
    println!(
        "{}",
        summary(
            &format!("ductile runtime = \"tf\" (min {min}) + keras integration, SIGKILL of a worker → next step"),
            &ours,
            ours_failed
        )
    );
    ratio(&ours, &theirs, "by hand");
    Ok(())
}

//! The one training driver: for each generation that includes this worker it forms the
//! communicator, runs the mode's agreement, writes the join record, then drives the mode's
//! units of work and owns every cadence around them: progress (rank 0, at most once a
//! second), each rank's figures (every 2 s), a checkpoint save at every commit point the mode
//! reaches, the generation's first step, and the end of the run (the last save, the gather of
//! the other stages to rank 0, the final hash and evaluation).
//!
//! How the members synchronise is a [`Mode`]: all-reduce (data parallel, pipeline and tensor
//! parallel layouts by the generation's `Mesh`: [`super::allreduce::Allreduce`]), DiLoCo
//! ([`super::diloco::Diloco`]) and bounded-staleness async ([`super::asynch::Async`]). Each
//! owns its own state; the [`Trainer`] holds what they share (model, optimizer, data,
//! checkpoint, reports).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ductile_cluster::records::*;
use ductile_cluster::Store;
use ductile_comm::{CommError, Communicator};
use ductile_runtime::{GenCell, Left, WorkerEnv};

use super::{sha256_params, Trainer};

/// What one unit of a mode's work did.
#[derive(Default)]
pub(super) struct Worked {
    /// Steps this rank computed (its figures count them; a DiLoCo commit computes none).
    pub steps: u64,
    /// The world committed work: a step, a round, an applied update.
    pub commit: Option<Commit>,
    /// The state is whole at a commit point: save now if a checkpoint is due or asked for (the
    /// trainer's `flags` say what every rank saw at it).
    pub checkpoint: bool,
}

/// Work the world committed.
pub(super) struct Commit {
    /// The loss progress reports.
    pub loss: f64,
    /// The samples it committed.
    pub samples: u64,
}

/// How the members of a generation synchronise. The driver calls these, in this order, for
/// each generation: `agree`, `begin`, then `advance` until `finished` or an error, then `end`
/// (with the outcome). Checkpoints are the driver's; a mode says when one is due and what it
/// holds of the mode's own.
pub(super) trait Mode {
    /// Agree with the members of `g` on the state to resume from. The outer error stops the
    /// worker (state no one holds and no checkpoint); the inner one re-forms.
    fn agree(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> anyhow::Result<Result<(), CommError>>;

    /// Start training in `g`, after the join record (what the mode runs beside the loop).
    fn begin(
        &mut self,
        _t: &mut Trainer,
        _comm: &Arc<dyn Communicator>,
        _g: &Generation,
        _rank: u32,
    ) {
    }

    /// Whether the run's work is all trained and committed.
    fn finished(&self, t: &Trainer) -> bool;

    /// One unit of work: a step, a local step or a round's commit, an update.
    fn advance(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
    ) -> Result<Worked, CommError>;

    /// The generation's training ends with `out` (finished, or the error that ends it):
    /// whatever the mode ran beside the loop stops; an error of its own replaces `Ok`.
    fn end(
        &mut self,
        _t: &mut Trainer,
        _comm: &Arc<dyn Communicator>,
        out: Result<(), CommError>,
    ) -> Result<(), CommError> {
        out
    }

    /// Whether a checkpoint is due at this commit point (checkpoints every `interval` steps).
    fn save_due(&self, t: &Trainer, interval: u64) -> bool;

    /// Whether the run's last state is a checkpoint's (its save may have been skipped while
    /// the previous one uploaded): by default when its step is a multiple of the interval.
    fn final_due(&self, t: &Trainer, interval: u64) -> bool {
        t.step.is_multiple_of(interval)
    }

    /// What a checkpoint's `extra` records of the mode's own state, under its key.
    fn extra(&self, _t: &Trainer, _g: &Generation) -> Option<(&'static str, serde_json::Value)> {
        None
    }

    /// Run `f` with the trainer's parameters and optimizer state being what a checkpoint of
    /// this mode holds (by default they are).
    fn with_saved_state(&self, t: &mut Trainer, f: &mut dyn FnMut(&mut Trainer)) {
        f(t)
    }

    /// Rank 0's progress report: `p` holds the driver's figures (loss of the last commit,
    /// samples/s, bytes per sample); the mode adds its own (round, staleness, ...).
    fn report(&mut self, _t: &Trainer, _p: &mut Progress) {}
}

/// Save at a commit point of `mode` if a checkpoint is due there or asked for.
fn save(t: &mut Trainer, mode: &dyn Mode, g: &Generation, rank: u32, flags: (bool, bool)) {
    if t.ckpt.is_some() {
        mode.with_saved_state(t, &mut |t| t.maybe_save(g, rank, flags, mode));
    }
}

/// The run is over: the saves in flight complete (and rank 0 commits them), and the last state
/// is saved if it is a checkpoint's and its save was skipped because the previous one was still
/// uploading (every rank saw that alike, through the commit's flags).
fn final_save(t: &mut Trainer, mode: &dyn Mode, g: &Generation, rank: u32) {
    let Some(ck) = &mut t.ckpt else { return };
    ck.finish(&t.rt);
    let interval = ck.spec.interval;
    if ck.saved_step != Some(t.step) && mode.final_due(t, interval) {
        save(t, mode, g, rank, (false, false));
        if let Some(ck) = &mut t.ckpt {
            ck.finish(&t.rt);
        }
    }
}

/// The console line of a progress report.
fn progress_line(p: &Progress, world: u32) -> String {
    let (loss, sps) = (p.loss.unwrap_or(f64::NAN), p.samples_per_sec.unwrap_or(0.0));
    match (p.round, p.staleness_max) {
        (Some(round), _) => format!(
            "round {round} step {} loss {loss:.4} samples/s {sps:.1} bytes/sample {:.1} world {world}",
            p.step,
            p.bytes_per_sample.unwrap_or(0.0)
        ),
        (None, Some(max)) => format!(
            "step {} loss {loss:.4} applied samples/s {sps:.1} staleness max {max} dropped {} world {world}",
            p.step,
            p.dropped_updates.unwrap_or(0)
        ),
        (None, None) => {
            let norm = p
                .grad_norm
                .map(|n| format!(" grad norm {n:.4}"))
                .unwrap_or_default();
            let lr = p.lr.map(|r| format!(" lr {r:.3e}")).unwrap_or_default();
            format!(
                "step {} loss {loss:.4}{norm}{lr} samples/s {sps:.1} world {world}",
                p.step
            )
        }
    }
}

/// Whether `g` runs the pipeline step: stages, tensor groups, or spares (a layout that leaves
/// ranks idle, or leaving members of a hand-over, which take part in the step's commit).
pub(super) fn pipelined(g: &Generation) -> bool {
    g.layout.pipeline_parallel > 1
        || g.layout.tensor_parallel > 1
        || g.members.iter().any(|m| m.spare)
}

enum Outcome {
    /// The communicator failed or was aborted: join the next generation.
    Reform(CommError),
    Done,
}

/// The trainer and its job's sync mode.
pub struct Driver {
    t: Trainer,
    mode: Box<dyn Mode>,
}

impl Driver {
    pub fn new(
        env: WorkerEnv,
        spec: TrainingSpec,
        checkpoint: Option<CheckpointSpec>,
        max_size: u32,
        store: Store,
        rt: tokio::runtime::Handle,
        cell: Arc<GenCell>,
    ) -> anyhow::Result<Driver> {
        let mut t = Trainer::new(env, spec, max_size, store, rt, cell)?;
        // a DiLoCo checkpoint holds the global weights and the outer optimizer's state
        let (mode, outer): (Box<dyn Mode>, _) = match t.spec.sync {
            SyncMode::Allreduce => (Box::new(super::allreduce::Allreduce::default()), None),
            SyncMode::Diloco => {
                let d = super::diloco::Diloco::new(&t.params, t.spec.diloco.fragments);
                let outer = d.outer_optimizer(&t.spec);
                (Box::new(d), Some(outer))
            }
            SyncMode::Async => (Box::new(super::asynch::Async::default()), None),
        };
        if let Some(c) = checkpoint {
            t.open_checkpoint(c, outer)?;
        }
        Ok(Driver { t, mode })
    }

    /// Train until `max_steps` ([`Left::Done`]) or until a generation leaves this worker out
    /// ([`Left::Fenced`]).
    pub fn run(mut self) -> anyhow::Result<Left> {
        let mut current = 0u64;
        loop {
            let g = self.t.cell.wait_newer(current);
            let seen = super::now_ms();
            current = g.number;
            let Some(me) = g.member(&self.t.env.node, self.t.env.slot).cloned() else {
                println!(
                    "generation {} does not include {}/{}: leaving",
                    g.number, self.t.env.node, self.t.env.slot
                );
                return Ok(Left::Fenced);
            };
            let comm = match self.t.form(&g, me.rank)? {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(generation = g.number, error = %e, "could not form the communicator");
                    self.t.failed_generation(&g, me.rank, &e)?;
                    continue;
                }
            };
            let formed = super::now_ms();
            let aborts = comm.clone();
            self.t
                .cell
                .install(g.number, Arc::new(move || aborts.abort()));
            match self.generation(&g, &comm, &me, (seen, formed))? {
                Outcome::Done => return Ok(Left::Done),
                Outcome::Reform(e) => {
                    tracing::info!(generation = g.number, step = self.t.step, reason = %e, "leaving generation");
                    self.t.failed_generation(&g, me.rank, &e)?;
                }
            }
        }
    }

    /// One generation: the agreement, the join record, then the training loop.
    fn generation(
        &mut self,
        g: &Generation,
        arc: &Arc<dyn Communicator>,
        me: &Member,
        seen_formed: (u64, u64),
    ) -> anyhow::Result<Outcome> {
        let t0 = Instant::now();
        if let Err(e) = self.mode.agree(&mut self.t, arc, g)? {
            return Ok(Outcome::Reform(e));
        }
        let t = &mut self.t;
        t.set_owners(g);
        if t.model.sliced() && g.layout.tensor_parallel <= 1 {
            // logical slices without a tensor group: a group of one, on this generation's mesh
            let solo = ductile_comm::Group::new(arc.clone(), vec![me.rank])
                .map_err(|e| anyhow::anyhow!("a group of one: {e}"))?;
            t.model.set_tensor_group((!me.spare).then_some(solo));
        }
        let pipelined = pipelined(g);
        t.join(g, me, pipelined, seen_formed);
        tracing::info!(
            generation = g.number,
            rank = me.rank,
            step = t.step,
            sync_ms = t0.elapsed().as_millis() as u64,
            "training"
        );
        self.mode.begin(&mut self.t, arc, g, me.rank);
        let trained = self.train(g, arc, me);
        if let Err(e) = self.mode.end(&mut self.t, arc, trained) {
            return Ok(Outcome::Reform(e));
        }
        self.finish_run(g, arc, me.rank, pipelined)
    }

    /// The mode's units of work until the run is over (`Ok`), with the cadences around them.
    fn train(
        &mut self,
        g: &Generation,
        comm: &Arc<dyn Communicator>,
        me: &Member,
    ) -> Result<(), CommError> {
        let rank = me.rank;
        let (t, mode) = (&mut self.t, &mut self.mode);
        let mut last_report = Instant::now() - Duration::from_secs(2);
        let start_bytes = comm.bytes_sent();
        // samples committed in this generation, and since the last progress report
        let (mut committed, mut samples_since) = (0u64, 0u64);
        let mut since = Instant::now();
        // every rank's own figures, every 2 s (a straggler shows in its compute time)
        let (mut rank_since, mut rank_steps) = (Instant::now(), 0u64);
        t.computed = Duration::ZERO;
        let mut first_done = false;
        while !mode.finished(t) {
            let worked = mode.advance(t, comm, g, me)?;
            if worked.checkpoint {
                save(t, mode.as_ref(), g, rank, t.flags);
            }
            rank_steps += worked.steps;
            if let Some(c) = worked.commit {
                if !first_done && rank == 0 {
                    first_done = true;
                    // when the new world completed its first step (recovery benchmarks read it)
                    t.reports.first_step(g.number);
                }
                committed += c.samples;
                samples_since += c.samples;
                if rank == 0 && last_report.elapsed() >= Duration::from_secs(1) {
                    let sps = samples_since as f64 / since.elapsed().as_secs_f64();
                    let bytes = (comm.bytes_sent() - start_bytes) as f64 * g.world_size as f64;
                    let mut p = Progress {
                        generation: g.number,
                        step: t.step,
                        loss: Some(c.loss),
                        samples_per_sec: Some(sps),
                        updated_at_ms: super::now_ms(),
                        bytes_per_sample: (committed > 0).then(|| bytes / committed as f64),
                        eval_loss: t.last_eval.map(|e| e.1),
                        eval_step: t.last_eval.map(|e| e.0),
                        grad_norm: t.grad_norm,
                        lr: t.last_lr(),
                        ..Default::default()
                    };
                    mode.report(t, &mut p);
                    println!("{}", progress_line(&p, g.world_size));
                    t.reports.progress(p);
                    last_report = Instant::now();
                    samples_since = 0;
                    since = Instant::now();
                }
            }
            // (a pipeline rank's compute is its stages' forward and backward, a tensor group's
            // collectives inside them included; not the waits for its neighbours)
            if rank_steps > 0 && rank_since.elapsed() >= Duration::from_secs(2) {
                t.report_rank(g, rank, rank_since, rank_steps);
                (rank_since, rank_steps) = (Instant::now(), 0);
            }
        }
        Ok(())
    }

    /// The end of the run: the last save, the other stages gathered to rank 0, then rank 0's
    /// final hash, evaluation and last progress.
    fn finish_run(
        &mut self,
        g: &Generation,
        comm: &Arc<dyn Communicator>,
        rank: u32,
        pipelined: bool,
    ) -> anyhow::Result<Outcome> {
        final_save(&mut self.t, self.mode.as_ref(), g, rank);
        let t = &mut self.t;
        if pipelined || t.shard_held.0 > 1 {
            // rank 0 gathers the other stages' layers (or shards) for the hash over all of them
            if let Err(e) = t.gather_to_rank0(comm, g) {
                return Ok(Outcome::Reform(e));
            }
        }
        if rank == 0 {
            let sha = sha256_params(&t.params);
            let eval = t.eval_loss();
            // with a split, the final weights' eval is an eval at the last step
            let eval_step = (eval.is_some() && t.eval.is_some()).then_some(t.step);
            let mut p = Progress {
                generation: g.number,
                step: t.step,
                updated_at_ms: super::now_ms(),
                done: true,
                final_weights_sha256: Some(sha.clone()),
                eval_loss: eval,
                eval_step,
                // the last step's rate and norm (the loss is the last report's)
                lr: t.last_lr(),
                grad_norm: t.grad_norm,
                ..Default::default()
            };
            // the mode's own figures as of the run's end (DiLoCo's last round, async's
            // staleness), not those of the last report, which may be up to a second older
            self.mode.report(t, &mut p);
            // rank 0 holds every tensor now (the final gather): the optimizer state's hash lets
            // a restore elsewhere be checked against it. The line goes out before the job is
            // marked done: once it is, the agents stop the ranks, and a reader of the logs who
            // waited for the job's end finds the line there
            println!(
                "finished at step {}: final weights sha256 {sha}, optimizer state sha256 {}, eval loss {}",
                t.step,
                sha256_params(&t.opt.state),
                eval.map(|l| format!("{l:.5}")).unwrap_or_else(|| "-".into())
            );
            t.reports.final_progress(p)?;
        }
        Ok(Outcome::Done)
    }
}

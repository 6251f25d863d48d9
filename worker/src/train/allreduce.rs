//! Synchronous all-reduce training (`sync = "allreduce"`): every step is committed by the whole
//! world. Data parallel generations take the data-parallel step ([`Trainer::train_step`]);
//! pipeline and tensor parallel layouts (and generations with spares) the pipeline step
//! ([`Trainer::pipe_step`], laid out by the generation's `Mesh`), except full sharding under
//! tensor groups ([`Trainer::full_tp_step`]). The agreement is the
//! holdings' ([`Trainer::agree`]).

use std::sync::Arc;

use ductile_cluster::records::{Generation, Member};
use ductile_comm::{CommError, Communicator};

use super::agree::Pending;
use super::driver::{pipelined, Commit, Mode, Worked};
use super::Trainer;

/// The all-reduce mode's state.
#[derive(Default)]
pub struct Allreduce {
    /// A pipeline step's reduced gradient waiting for its commit (the commit failed: the next
    /// agreement applies it if the commit completed elsewhere).
    pending: Option<Pending>,
}

impl Mode for Allreduce {
    fn agree(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> anyhow::Result<Result<(), CommError>> {
        t.agree(comm, g, &mut self.pending)
    }

    fn finished(&self, t: &Trainer) -> bool {
        t.spec.max_steps.is_some_and(|m| t.step >= m)
    }

    fn advance(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
    ) -> Result<Worked, CommError> {
        if t.spec.sharding.is_sharded() && g.handover {
            // a sharded job's hand-over generation: the leaving ranks (the spares) handed their
            // shards over in the agreement; nobody steps until the leader publishes the
            // generation without them, once every member joined (it waits a bounded time)
            if t.cell.newest() > g.number {
                return Err(CommError::Aborted {
                    generation: g.number,
                    op: "hand-over",
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            return Ok(Worked {
                steps: 0,
                commit: None,
                checkpoint: false,
            });
        }
        let loss = if t.full_under_tp(g) {
            t.full_tp_step(comm, g, me)?
        } else if pipelined(g) {
            t.pipe_step(comm, g, me, &mut self.pending)?
        } else {
            t.train_step(comm, g, me.rank)?
        };
        if t.spec.eval_every.is_some_and(|e| t.step.is_multiple_of(e)) && t.eval.is_some() {
            let l = t.eval_on_layout(comm, g, me)?;
            t.last_eval = Some((t.step, l));
            if me.rank == 0 {
                println!("eval at step {}: loss {l:.5}", t.step);
            }
        }
        Ok(Worked {
            steps: 1,
            commit: Some(Commit {
                loss,
                samples: t.spec.global_batch as u64,
            }),
            checkpoint: true,
        })
    }

    fn save_due(&self, t: &Trainer, interval: u64) -> bool {
        t.step.is_multiple_of(interval)
    }
}

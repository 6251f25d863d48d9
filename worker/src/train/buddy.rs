//! Buddy copies of a fully sharded job's state (`training.buddy_copies`, on by default).
//!
//! Where each shard has one holder ([`ductile_strategies::buddy::applies`]), every rank keeps
//! its *ward's* shard (its rows of every parameter and of their optimizer state) in host memory;
//! the ring ([`ductile_strategies::buddy::keepers`]) puts the copy on another node where the job
//! has one. The copy is made whole once per generation, when the agreement is done, and kept
//! current every step by the ward's reduced (clipped) gradient rows, which the ward sends its
//! keeper before anyone applies the step: once the step commits, the keeper folds them in with
//! the same optimizer update the ward runs (elementwise, so the copy has the ward's bits), on a
//! thread of its own while the next step computes; where the commit did not pass on the keeper,
//! the rows wait, and are folded in if the agreement needs the copy at the step after.
//!
//! The step's commit: every rank sends its rows to its keeper, then the world passes a host
//! barrier, then each applies its step. A rank that passes the barrier knows that every keeper
//! holds its ward's rows of this step, so whatever rank is lost afterwards, its state at the
//! step the survivors reach is its own, or its copy plus the rows of that step. The agreement
//! of the next generation offers each copy at the step it can reach
//! ([`Trainer::buddy_row`]), and the redistribution plan takes a lost shard's rows from its
//! keeper like any other holder's; the checkpoint is read only when a rank and its keeper are
//! lost together.

use std::ops::Range;
use std::sync::Arc;

use ductile_cluster::records::Generation;
use ductile_comm::{CommError, Communicator};
use ductile_strategies::redistribute::Part;
use tch::{Device, Kind, Tensor};

use super::reshard::{holding_parts, Holding};
use super::Trainer;

/// The copy of a ward's shard a rank keeps.
pub(crate) struct Buddy {
    /// The rank this rank's own shard is copied to, and the rank whose shard it keeps.
    keeper: u32,
    ward: u32,
    /// The ward's shard place (group size, place) and chunks of units, as the agreement row
    /// says them, and its holding of each state tensor (parameters, then optimizer states).
    shard: (u32, u32),
    chunks: Vec<Range<usize>>,
    holdings: Vec<Holding>,
    /// Host copies, one per state tensor (empty where the ward holds nothing of it).
    tensors: Vec<Tensor>,
    /// The step the copy's tensors are at (once `folding` is done).
    step: u64,
    /// The ward's gradient rows of step `step`, not yet folded in (the step's commit did not
    /// pass here).
    pending: Option<Vec<Tensor>>,
    /// The fold of the last committed step's rows, on a thread of its own.
    folding: Option<std::thread::JoinHandle<()>>,
}

impl Buddy {
    /// Wait for the fold in flight, if any: the tensors are then at `step`.
    fn settle(&mut self) {
        if let Some(h) = self.folding.take() {
            if h.join().is_err() {
                // (a panic in the fold: the copy's bits are unknown, so it offers nothing)
                tracing::error!(
                    ward = self.ward,
                    "the buddy copy's fold panicked: dropping the copy"
                );
                self.holdings.iter_mut().for_each(|h| h.boxes.clear());
                self.chunks.clear();
            }
        }
    }
}

impl Drop for Buddy {
    fn drop(&mut self) {
        self.settle();
    }
}

/// Length of a buddy row in the agreement: [copy step, pending (0/1), shard group size,
/// place, then the chunks' (start, end) pairs]; -1 as the step when a rank keeps no copy.
fn row_len() -> usize {
    4 + 2 * super::agree::HELD_SLOTS
}

/// A holding's local tensors, cut from the flat `buf` one after another, each its own
/// (contiguous) view.
fn split(buf: &Tensor, holdings: &[Holding]) -> Vec<Tensor> {
    let mut at = 0i64;
    holdings
        .iter()
        .map(|h| {
            let shape = h.local_shape();
            let n: i64 = shape.iter().product();
            let t = buf.narrow(0, at, n).view(shape.as_slice());
            at += n;
            t
        })
        .collect()
}

impl Trainer {
    /// This rank's (keeper, ward) in `g`, where the job keeps buddy copies and `g`'s layout
    /// gives each shard one holder.
    fn buddies_of(&self, g: &Generation, rank: u32) -> Option<(u32, u32)> {
        if !self.spec.keeps_buddy_copies() || !self.buddy_peers {
            return None;
        }
        let keepers = ductile_strategies::buddy::of_generation(g)?;
        let keeper = *keepers.get(rank as usize)?;
        let ward = keepers.iter().position(|k| *k == rank)? as u32;
        Some((keeper, ward))
    }

    /// Make this generation's copies, once its agreement is done (every rank at the same step,
    /// holding its shard): each rank sends its whole shard to its keeper and receives its ward's
    /// into host memory. The previous copy is dropped first. Without copies in `g`, none.
    pub(super) fn keep_buddy(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> Result<(), CommError> {
        self.buddy = None;
        let Some((keeper, ward)) = self.buddies_of(g, comm.rank()) else {
            return Ok(());
        };
        let t0 = std::time::Instant::now();
        let w = g
            .members
            .iter()
            .find(|m| m.rank == ward)
            .expect("a ward is a member");
        let chunks = self.units_of(g, w);
        let shard = Self::shard_of(g, w);
        let holdings = self.holdings_of(&chunks, 1, 0, shard);
        let mine: Vec<Tensor> = self.tensors().into_iter().map(|t| t.detach()).collect();
        let send = comm.place(&super::flat(&mine));
        let n: i64 = holdings
            .iter()
            .map(|h| h.local_shape().iter().product::<i64>())
            .sum();
        let recv = comm.zeros(&[n], Kind::Float);
        comm.exchange(&[(keeper, &send)], &[(ward, &recv)])?;
        let host = recv.tensor().to_device(Device::Cpu);
        let tensors = split(&host, &holdings);
        tracing::info!(
            generation = g.number,
            step = self.step,
            keeper,
            ward,
            bytes = 4 * n,
            ms = t0.elapsed().as_millis() as u64,
            "buddy copy made: this rank keeps its ward's shard in host memory, its own is kept by its keeper"
        );
        self.buddy = Some(Buddy {
            keeper,
            ward,
            shard,
            chunks,
            holdings,
            tensors,
            step: self.step,
            pending: None,
            folding: None,
        });
        Ok(())
    }

    /// Fold the copy's pending gradient rows in: the ward's step `step` as the ward ran it
    /// (the same elementwise update on the same bits), on a thread of its own, so the step
    /// goes on meanwhile; [`Buddy::settle`] waits for it before the copy is read or folded again.
    fn fold_buddy(&mut self) {
        let (n, per) = (self.params.len(), self.opt.per());
        let kind = self.opt.kind;
        let decays: Vec<bool> = (0..n).map(|i| self.opt.decays(i)).collect();
        let Some(b) = self.buddy.as_mut() else {
            return;
        };
        b.settle();
        let Some(grads) = b.pending.take() else {
            return;
        };
        let lr = self.spec.lr_plan().at(b.step);
        let step = b.step;
        let tensors: Vec<Tensor> = b.tensors.iter().map(|t| t.shallow_clone()).collect();
        b.step += 1;
        b.folding = Some(std::thread::spawn(move || {
            for (i, gr) in grads.iter().enumerate() {
                if tensors[i].numel() == 0 {
                    continue;
                }
                let mut st: Vec<Tensor> = (0..per)
                    .map(|j| tensors[n + per * i + j].shallow_clone())
                    .collect();
                crate::optim::apply(&kind, decays[i], &mut st, &tensors[i], gr, lr, step);
            }
        }));
    }

    /// A step's refresh, before the step is applied: this rank's gradient rows `grads` (reduced
    /// and clipped: what its optimizer steps with) to its keeper, its ward's kept as pending,
    /// then a barrier of the world (the step's commit: past it, every keeper holds its ward's
    /// rows of this step), then the fold of those rows into the copy starts.
    pub(super) fn refresh_buddy(
        &mut self,
        comm: &Arc<dyn Communicator>,
        grads: &[Tensor],
    ) -> Result<(), CommError> {
        let Some(b) = self.buddy.as_ref() else {
            return Ok(());
        };
        let (keeper, ward) = (b.keeper, b.ward);
        let n = self.params.len();
        let counts: i64 = b.holdings[..n]
            .iter()
            .map(|h| h.local_shape().iter().product::<i64>())
            .sum();
        if b.step + u64::from(b.pending.is_some()) != self.step {
            return Err(CommError::Invalid {
                op: "buddy copy",
                reason: format!(
                    "the copy of rank {ward}'s shard is at step {} (pending {}), this rank at {}",
                    b.step,
                    b.pending.is_some(),
                    self.step
                ),
            });
        }
        let send = comm.place(&super::flat(grads));
        let recv = comm.zeros(&[counts], Kind::Float);
        comm.exchange(&[(keeper, &send)], &[(ward, &recv)])?;
        let host = recv.tensor().to_device(Device::Cpu);
        let b = self.buddy.as_mut().expect("checked above");
        b.settle();
        b.pending = Some(split(&host, &b.holdings[..n]));
        crate::faults::exit_at_commit(comm.generation(), comm.rank(), self.step, false);
        // the step's commit: every rank's rows are with their keepers
        let steps = comm.host().all_gather_f64(&[self.step as f64])?;
        if let Some((r, s)) = steps
            .iter()
            .enumerate()
            .find(|(_, s)| s.first().copied() != Some(self.step as f64))
        {
            return Err(CommError::Protocol {
                generation: comm.generation(),
                op: "buddy copy",
                peer: r as u32,
                reason: format!("at step {:?}, this rank at {}", s.first(), self.step),
            });
        }
        crate::faults::exit_at_commit(comm.generation(), comm.rank(), self.step, true);
        // committed: the copy goes on to the next step beside this rank's own
        self.fold_buddy();
        Ok(())
    }

    /// This rank's row of the agreement's buddy gather ([`row_len`]).
    pub(super) fn buddy_row(&self) -> Vec<f64> {
        let mut row = vec![-1.0; row_len()];
        if let Some(b) = &self.buddy {
            row[0] = b.step as f64;
            row[1] = f64::from(u8::from(b.pending.is_some()));
            row[2] = b.shard.0 as f64;
            row[3] = b.shard.1 as f64;
            for (k, c) in b.chunks.iter().enumerate().take(super::agree::HELD_SLOTS) {
                row[4 + 2 * k] = c.start as f64;
                row[5 + 2 * k] = c.end as f64;
            }
        }
        row
    }

    /// What the copies of `rows` (every rank's [`Trainer::buddy_row`]) can serve at step `step`:
    /// each keeper's parts (as its own rank's), for the redistribution plan; a copy one step
    /// behind with that step's rows pending serves it too (its keeper folds them in first).
    pub(super) fn buddy_parts(&self, rows: &[Vec<f64>], step: u64) -> Vec<Part> {
        let units = self.units() as f64;
        // (a peer's row is checked before it is read: a shard place inside its group, chunks
        // inside the model; a row that is not offers nothing)
        let sound = |r: &[f64]| {
            r.len() == row_len()
                && r[2] >= 1.0
                && (0.0..r[2]).contains(&r[3])
                && r[4..].iter().all(|c| (-1.0..=units).contains(c))
        };
        rows.iter()
            .enumerate()
            .filter(|(_, r)| sound(r) && Self::copy_reaches(r, step))
            .flat_map(|(rank, r)| {
                let chunks: Vec<Range<usize>> = r[4..]
                    .chunks(2)
                    .map(|c| c[0].max(0.0) as usize..c[1].max(0.0) as usize)
                    .filter(|c| !c.is_empty())
                    .collect();
                let hs = self.holdings_of(&chunks, 1, 0, (r[2] as u32, r[3] as u32));
                holding_parts(rank as u32, &hs)
            })
            .collect()
    }

    /// Whether a buddy row's copy can be brought to `step`.
    fn copy_reaches(r: &[f64], step: u64) -> bool {
        r[0] >= 0.0 && (r[0] as u64 == step || (r[1] > 0.0 && r[0] as u64 + 1 == step))
    }

    /// This rank's copy as (tensor, holding) per state tensor, brought to `step` (its pending
    /// rows folded in where that reaches it), for [`super::reshard::move_state`]; none
    /// where the copy cannot reach `step`.
    pub(super) fn buddy_at(&mut self, step: u64) -> Vec<(Tensor, Holding)> {
        if self.buddy.is_none() || !Self::copy_reaches(&self.buddy_row(), step) {
            return Vec::new();
        }
        if self.buddy.as_ref().is_some_and(|b| b.step < step) {
            self.fold_buddy();
        }
        let b = self.buddy.as_mut().expect("checked");
        b.settle();
        b.tensors
            .iter()
            .map(|t| t.shallow_clone())
            .zip(b.holdings.iter().cloned())
            .collect()
    }
}

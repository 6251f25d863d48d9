//! Pipeline steps and the state agreement every generation starts with.
//!
//! A pipeline generation (`pipeline_parallel` > 1) runs each data-parallel replica as a chain
//! of stages (`rank = dp_rank · pp + pp_stage`): stage s runs units `[b[s], b[s+1])` of the
//! model over the replica's micro-batches in the schedule's order, activations going forward
//! and their gradients backward point to point (sent from a sender thread, so a stage never
//! blocks on its own send). The replicas of a stage then fold that stage's gradients along a
//! chain in replica order (deterministic mode: one gradient per logical shard, folded in global
//! shard order, as the data-parallel ordered all-reduce does, so the bits match), and a small
//! all-reduce over the whole world (the loss, the checkpoint flags) is the step's commit
//! point: a rank applies its stage's update only after it, and keeps the reduced gradient
//! pending until then. If the commit completed anywhere, every rank had the reduced gradient,
//! so at the next agreement the ranks one step behind apply their pending gradient; if it
//! completed nowhere, the step is dropped everywhere.
//!
//! The agreement ([`Trainer::agree`]): every rank says its step, its pending step and the
//! units it holds; the resume step is the highest; each rank obtains the units of its new
//! stage that it does not hold at that step from a holder (spread over the holders), point to
//! point, as checksummed blobs of parameters and optimizer state. A unit nobody holds comes
//! from the latest checkpoint (every rank restores it whole, since the survivors are ahead of
//! it); with no checkpoint the worker stops rather than start those layers from the seed.

use std::io::Write as _;
use std::ops::Range;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use ductile_cluster::records::{Generation, Member};
use ductile_comm::{CommError, Communicator, ReduceOp};
use ductile_strategies::pipeline::{stage_ops, Op};
use ductile_strategies::{micro_batches, split_batch, split_range};
use tch::{Device, Kind, Tensor};

use super::{encode_state, load_state, Trainer};
use crate::optim::lr_at;

/// A reduced gradient waiting for its step's commit.
pub struct Pending {
    /// The step it applies (the rank's `step` when it was computed).
    pub step: u64,
    /// The generation that computed it (the ledger's line says so).
    pub generation: u64,
    pub params: Vec<usize>,
    pub grads: Vec<Tensor>,
}

/// Sends queued tensors to peers on a thread of its own.
pub struct Outbox {
    tx: Option<mpsc::Sender<(Tensor, u32)>>,
    handle: Option<JoinHandle<Result<(), CommError>>>,
}

impl Outbox {
    pub fn new(comm: Arc<dyn Communicator>) -> Outbox {
        let (tx, rx) = mpsc::channel::<(Tensor, u32)>();
        let handle = std::thread::Builder::new()
            .name("pipeline-send".into())
            .spawn(move || {
                for (t, peer) in rx {
                    comm.send(&t, peer)?;
                }
                Ok(())
            })
            .expect("spawn the pipeline's sender thread");
        Outbox {
            tx: Some(tx),
            handle: Some(handle),
        }
    }

    pub fn send(&self, t: Tensor, peer: u32) {
        // a closed channel means the thread failed; finish() reports its error
        let _ = self.tx.as_ref().unwrap().send((t, peer));
    }

    /// Wait until everything queued went out.
    pub fn finish(mut self) -> Result<(), CommError> {
        self.join()
    }

    fn join(&mut self) -> Result<(), CommError> {
        drop(self.tx.take());
        match self.handle.take() {
            Some(h) => h.join().unwrap_or(Err(CommError::Invalid {
                op: "send",
                reason: "the pipeline's sender thread panicked".into(),
            })),
            None => Ok(()),
        }
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        // after a failed receive the communicator is aborted, so pending sends fail at once
        let _ = self.join();
    }
}

/// One micro-batch of a replica: (first position in the step, samples, the logical shard it
/// completes).
type Micro = (u64, u64, Option<u64>);

fn protocol(comm: &dyn Communicator, peer: u32, op: &'static str, reason: String) -> CommError {
    CommError::Protocol {
        generation: comm.generation(),
        op,
        peer,
        reason,
    }
}

impl Trainer {
    /// The units a member holds in generation `g` (every unit without stages; none for a
    /// spare).
    pub(super) fn units_of(&self, g: &Generation, m: &Member) -> Range<usize> {
        if m.spare {
            return 0..0;
        }
        let r = g.stage_units(m.pp_stage, self.units() as u32);
        r.start as usize..r.end as usize
    }

    /// Parameter indices of units `r`.
    pub(super) fn params_in(&self, r: &Range<usize>) -> Vec<usize> {
        (0..self.params.len())
            .filter(|i| r.contains(&self.param_unit[*i]))
            .collect()
    }

    /// Parameters and optimizer state of unit `u`, in order.
    fn unit_tensors(&self, u: usize) -> Vec<Tensor> {
        let mut v = Vec::new();
        for i in self.params_in(&(u..u + 1)) {
            v.push(self.params[i].shallow_clone());
            v.extend(self.opt.state_of(i).into_iter().map(|t| t.shallow_clone()));
        }
        v
    }

    fn blob_len(tensors: &[Tensor]) -> usize {
        24 + tensors.iter().map(|t| 8 + 4 * t.numel()).sum::<usize>() + 4
    }

    /// Move units between ranks: `plan` lists (unit, from, to) in the same order on every
    /// rank; this rank queues what it sends, then receives what it gets, in plan order.
    fn move_units(
        &mut self,
        comm: &Arc<dyn Communicator>,
        plan: &[(usize, u32, u32)],
        step: u64,
    ) -> Result<usize, CommError> {
        let me = comm.rank();
        let outbox = Outbox::new(comm.clone());
        for (u, _, to) in plan.iter().filter(|(_, f, _)| *f == me) {
            let ts = self.unit_tensors(*u);
            let refs: Vec<&Tensor> = ts.iter().collect();
            let blob = encode_state(step, &refs);
            // a blob is a whole number of 4-byte words: it travels as f32 (every backend's type)
            let words = Tensor::from_data_size(&blob, &[(blob.len() / 4) as i64], Kind::Float);
            outbox.send(words, *to);
        }
        let mut bytes = 0;
        for (u, from, _) in plan.iter().filter(|(_, _, t)| *t == me) {
            let targets = self.unit_tensors(*u);
            let len = Self::blob_len(&targets);
            let mut buf = Tensor::zeros([(len / 4) as i64], (Kind::Float, Device::Cpu));
            comm.recv(&mut buf, *from)?;
            let mut raw = vec![0u8; len];
            buf.copy_data_u8(&mut raw, buf.numel());
            bytes += raw.len();
            let got = load_state(&raw, &targets).map_err(|e| {
                protocol(
                    comm.as_ref(),
                    *from,
                    "layer transfer",
                    format!("unit {u}: {e}"),
                )
            })?;
            if got != step {
                return Err(protocol(
                    comm.as_ref(),
                    *from,
                    "layer transfer",
                    format!("unit {u} came at step {got}, expected {step}"),
                ));
            }
        }
        outbox.finish()?;
        Ok(bytes)
    }

    /// Agree on the state at the start of a generation (see the module's comment). The outer
    /// error stops the worker (no holder and no checkpoint); the inner one re-forms.
    pub(super) fn agree(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> anyhow::Result<Result<(), CommError>> {
        let pend = self.pending.as_ref().map(|p| p.step as f64).unwrap_or(-1.0);
        let mine = Tensor::from_slice(&[
            self.step as f64,
            pend,
            self.held.start as f64,
            self.held.end as f64,
        ]);
        let all = match comm.all_gather(&mine) {
            Ok(a) => a,
            Err(e) => return Ok(Err(e)),
        };
        let flat = Vec::<f64>::try_from(all.flatten(0, -1).to_device(Device::Cpu))?;
        let rows: Vec<[f64; 4]> = flat.chunks(4).map(|c| [c[0], c[1], c[2], c[3]]).collect();
        let max = rows.iter().map(|r| r[0]).fold(0.0, f64::max);
        // a rank one step behind with that step's reduced gradient pending: the commit went
        // through elsewhere, so it applies it
        let eff = |r: &[f64; 4]| {
            if r[1] >= 0.0 && r[1] == r[0] && r[0] + 1.0 == max {
                max
            } else {
                r[0]
            }
        };
        if let Some(p) = self.pending.take() {
            if (p.step + 1) as f64 == max {
                self.apply(&p.params, &p.grads, p.step, p.generation, comm.rank());
                tracing::info!(
                    step = self.step,
                    "applied the pending step its commit completed elsewhere"
                );
            }
        }
        let units = self.units();
        if max == 0.0 {
            // a cold start: everyone holds the seed's state (or restores the latest checkpoint)
            self.held = 0..units;
            if self.ckpt.is_some() {
                return self.restore(comm.as_ref());
            }
            return Ok(Ok(()));
        }
        let step = max as u64;
        let holds = |r: usize, u: usize| {
            eff(&rows[r]) == max && (rows[r][2] as usize..rows[r][3] as usize).contains(&u)
        };
        let missing: Vec<usize> = (0..units)
            .filter(|u| !(0..rows.len()).any(|r| holds(r, *u)))
            .collect();
        if !missing.is_empty() {
            let names: Vec<String> = missing
                .iter()
                .map(|u| self.unit_names[*u].clone())
                .collect();
            if self.ckpt.is_none() {
                anyhow::bail!(
                    "layers {} have no holder at step {step} in generation {} and the job has no checkpoint: stopping rather than starting them from the seed",
                    names.join(", "),
                    g.number
                );
            }
            if comm.rank() == 0 {
                println!(
                    "layers {} have no holder at step {step}: every rank restores the latest checkpoint",
                    names.join(", ")
                );
            }
            self.step = 0;
            self.pending = None;
            let r = self.restore(comm.as_ref())?;
            if r.is_ok() && self.step == 0 {
                anyhow::bail!(
                    "layers {} have no holder and the checkpoint URL holds no commit: stopping rather than starting them from the seed",
                    names.join(", ")
                );
            }
            self.held = 0..units;
            return Ok(r);
        }
        // who gets which unit from whom: spread over the holders, the same on every rank
        let mut plan = Vec::new();
        for m in &g.members {
            let r = m.rank as usize;
            for u in self.units_of(g, m) {
                if holds(r, u) {
                    continue;
                }
                let hs: Vec<u32> = (0..rows.len())
                    .filter(|h| holds(*h, u))
                    .map(|h| h as u32)
                    .collect();
                plan.push((u, hs[(r + u) % hs.len()], m.rank));
            }
        }
        let t0 = std::time::Instant::now();
        let bytes = match self.move_units(comm, &plan, step) {
            Ok(b) => b,
            Err(e) => return Ok(Err(e)),
        };
        self.step = step;
        let me = g.members.iter().find(|m| m.rank == comm.rank()).unwrap();
        self.held = self.units_of(g, me);
        if bytes > 0 {
            tracing::info!(
                step,
                bytes,
                units = plan.iter().filter(|p| p.2 == comm.rank()).count(),
                ms = t0.elapsed().as_millis() as u64,
                "received layers"
            );
        }
        Ok(Ok(()))
    }

    /// Rank 0 gathers every unit it does not hold from stage `s` of replica 0 (rank s), for
    /// the final weights hash.
    pub(super) fn gather_to_rank0(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> Result<(), CommError> {
        let mut plan = Vec::new();
        for m in g.members.iter().filter(|m| !m.spare && m.dp_rank == 0) {
            if m.rank == 0 {
                continue;
            }
            for u in self.units_of(g, m) {
                plan.push((u, m.rank, 0));
            }
        }
        let step = self.step;
        self.move_units(comm, &plan, step).map(|_| ())
    }

    fn micro_plan(&self, dp: u32, d: u32, p: u32) -> Vec<Micro> {
        let b = self.spec.global_batch as u64;
        let mut out = Vec::new();
        if self.spec.deterministic {
            let shards = self.logical_shards();
            for k in split_range(shards.len() as u64, dp, d) {
                let sh = shards[k as usize];
                let parts = micro_batches(
                    sh,
                    self.spec
                        .micro_batch
                        .map(|m| m as u64)
                        .unwrap_or(sh.len.max(1)),
                );
                let n = parts.len();
                for (j, (s, l)) in parts.into_iter().enumerate() {
                    out.push((s, l, (j + 1 == n).then_some(k)));
                }
            }
        } else {
            let share = split_batch(b, dp)[d as usize];
            let m = self
                .spec
                .pipeline_micro_batches
                .unwrap_or(4 * p)
                .min(share.len as u32)
                .max(1);
            for piece in split_batch(share.len, m) {
                if piece.len > 0 {
                    out.push((share.start + piece.start, piece.len, None));
                }
            }
        }
        out
    }

    /// The gradients of `which`, in one flat tensor (a copy: the next zeroing leaves it be).
    fn flat_of(&self, which: &[usize]) -> Tensor {
        if which.is_empty() {
            return Tensor::zeros([0], (Kind::Float, self.dev));
        }
        Tensor::cat(&self.grad_parts(which.iter().copied()), 0)
    }

    /// Apply a reduced gradient to `which` and log it; `step` is the step it belongs to.
    fn apply(&mut self, which: &[usize], grads: &[Tensor], step: u64, generation: u64, rank: u32) {
        let lr = lr_at(self.spec.lr, step, self.spec.max_steps);
        for (j, i) in which.iter().enumerate() {
            let p = self.params[*i].shallow_clone();
            self.opt.update(*i, &p, &grads[j], lr, step);
        }
        if let Some(f) = &mut self.ledger {
            let _ = writeln!(
                f,
                "{}",
                serde_json::json!({"g": generation, "s": step, "r": rank, "applied": true})
            );
        }
        self.step = step + 1;
    }

    /// One step of a pipeline generation (spares only join the commit).
    pub(super) fn pipe_step(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
    ) -> Result<f64, CommError> {
        let b = self.spec.global_batch as u64;
        let base = self.step * b;
        let (p, dp) = (g.layout.pipeline_parallel.max(1), g.layout.data_parallel);
        let rank = me.rank;
        let mut loss = 0f64;
        let mut which = Vec::new();
        let mut reduced = Vec::new();
        if !me.spare {
            let stage = me.pp_stage;
            let r = self.units_of(g, me);
            which = self.params_in(&r);
            let mbs = self.micro_plan(dp, me.dp_rank, p);
            let ops = stage_ops(&self.spec.schedule, p, mbs.len() as u32, stage);
            let (first, last) = (stage == 0, stage + 1 == p);
            self.zero_grads();
            let outbox = Outbox::new(comm.clone());
            let mut inputs: Vec<Option<Tensor>> = (0..mbs.len()).map(|_| None).collect();
            let mut outputs: Vec<Option<Tensor>> = (0..mbs.len()).map(|_| None).collect();
            let mut shards: Vec<(u64, Tensor)> = Vec::new();
            let mut used = Vec::new();
            let mut acc = Tensor::zeros([1], (Kind::Double, self.dev));
            for op in ops {
                match op {
                    Op::Fwd(i) => {
                        let (start, len, _) = mbs[i as usize];
                        let idx: Vec<u64> = (start..start + len)
                            .map(|q| self.order.sample(base + q))
                            .collect();
                        let input = if first {
                            used.extend_from_slice(&idx);
                            self.data.batch(&idx).0.to_device(self.dev)
                        } else {
                            let shape = self.model.boundary_shape(r.start, len as i64);
                            let mut t = Tensor::zeros(shape.as_slice(), (Kind::Float, self.dev));
                            comm.recv(&mut t, rank - 1)?;
                            t.set_requires_grad(true)
                        };
                        let out = self.model.forward_units(r.start, r.end, &input);
                        if last {
                            let y = self.data.batch(&idx).1.to_device(self.dev);
                            let l = self.model.loss_of(&out, &y) / b as f64;
                            acc += l.detach().to_kind(Kind::Double).reshape([1]);
                            outputs[i as usize] = Some(l);
                        } else {
                            outbox.send(out.detach().contiguous(), rank + 1);
                            outputs[i as usize] = Some(out);
                        }
                        if !first {
                            inputs[i as usize] = Some(input);
                        }
                    }
                    Op::Bwd(i) => {
                        let out = outputs[i as usize].take().expect("forward before backward");
                        if last {
                            out.backward();
                        } else {
                            let mut grad = out.zeros_like();
                            comm.recv(&mut grad, rank + 1)?;
                            // d/d(out) of sum(out · grad) is grad, bit for bit
                            (out * grad).sum(Kind::Float).backward();
                        }
                        if let Some(input) = inputs[i as usize].take() {
                            outbox.send(input.grad().contiguous(), rank - 1);
                        }
                        if let Some(k) = mbs[i as usize].2 {
                            shards.push((k, self.flat_of(&which)));
                            self.zero_grads();
                        }
                    }
                }
            }
            outbox.finish()?;
            if !self.spec.deterministic {
                shards.push((0, self.flat_of(&which)));
            }
            if let (Some(f), true) = (&mut self.ledger, first) {
                let _ = writeln!(
                    f,
                    "{}",
                    serde_json::json!({"g": g.number, "s": self.step, "r": rank, "idx": used})
                );
            }
            // the stage's replicas fold their gradients along a chain in replica order; the
            // last sends the result back to the others
            let group: Vec<u32> = (0..dp).map(|d| d * p + stage).collect();
            let j = me.dp_rank as usize;
            let mut acc_g = if j > 0 {
                let mut t = shards[0].1.zeros_like();
                comm.recv(&mut t, group[j - 1])?;
                for (_, s) in &shards {
                    t += s;
                }
                t
            } else {
                let mut t = shards[0].1.copy();
                for (_, s) in &shards[1..] {
                    t += s;
                }
                t
            };
            if j + 1 < group.len() {
                comm.send(&acc_g, group[j + 1])?;
                comm.recv(&mut acc_g, *group.last().unwrap())?;
            } else {
                for peer in &group[..j] {
                    comm.send(&acc_g, *peer)?;
                }
            }
            let mut at = 0;
            for i in &which {
                let p = &self.params[*i];
                let k = p.numel() as i64;
                reduced.push(acc_g.narrow(0, at, k).view(p.size().as_slice()));
                at += k;
            }
            if last {
                loss = f64::try_from(acc.to_device(Device::Cpu)).unwrap_or(f64::NAN);
            }
        }
        // the commit: loss and checkpoint flags over the whole world
        self.pending = Some(Pending {
            step: self.step,
            generation: g.number,
            params: which.clone(),
            grads: reduced,
        });
        let (pending_ck, busy) = self
            .ckpt
            .as_ref()
            .map(|c| c.flags(g.number))
            .unwrap_or((0.0, 0.0));
        let mut commit = Tensor::from_slice(&[loss as f32, pending_ck, busy]);
        comm.all_reduce(&mut commit, ReduceOp::Sum)?;
        let v = Vec::<f32>::try_from(commit).unwrap_or_else(|_| vec![f32::NAN, 0.0, 0.0]);
        self.flags = (v[1] > 0.0, v[2] > 0.0);
        let p = self.pending.take().unwrap();
        self.apply(&p.params, &p.grads, p.step, p.generation, rank);
        Ok(v[0] as f64)
    }
}

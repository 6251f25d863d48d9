//! DiLoCo (`sync = "diloco"`): each replica takes local optimizer steps over its piece of the
//! round's positions, then the replicas average their pseudo-gradients (the round's global
//! weights minus their own, weighted by the samples each trained) and apply an outer Nesterov
//! step to the global weights, which every replica then starts the next round from.
//!
//! A round's work is the positions handed over by earlier rounds, then the next
//! `inner_steps · global_batch` fresh ones, cut into one piece per member (by the members'
//! measured samples per second, evenly in deterministic mode: `strategies::diloco`); a member
//! with a full share takes `inner_steps` local steps of its share of the global batch.
//!
//! Membership changes. Every generation starts with an agreement: an all-gather of (round,
//! holds round state, piece). The round is the highest any member holds; members behind it (their
//! commit completed elsewhere) and new processes take the global weights and outer momentum
//! from the lowest member at it (a broadcast, only when some member needs it) and train from
//! the next round on. Survivors keep their inner progress and their pieces; the pieces nobody
//! holds any more (their replica left, and its progress with it) are handed to the next round,
//! whole. So a committed round's samples are those of the pieces of the members that
//! committed it, and every position is committed once.

use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ductile_cluster::records::*;
use ductile_comm::quant::{self, Quant};
use ductile_comm::{CommError, Communicator, Group};
use ductile_strategies::diloco::{self as plan, Ranges};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use super::{now_ms, Trainer};
use crate::optim::lr_at;

/// What every member of a round agrees on (sent by the source of a generation's agreement).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RoundMeta {
    pub round: u64,
    /// The next fresh position not yet given to a round.
    pub cursor: u64,
    /// Positions handed to the next round.
    pub debt: Ranges,
    /// This round's pieces, in the order of the members holding them.
    pub pieces: Vec<Ranges>,
}

/// A replica's DiLoCo state.
pub struct Diloco {
    pub meta: RoundMeta,
    /// Whether this process holds the state of `meta.round` (a new process does not).
    pub holds: bool,
    /// This member's place in `meta.pieces` (none: it trains from the next round on).
    pub piece: Option<usize>,
    /// What is left of this member's piece.
    pub todo: Ranges,
    /// Samples trained this round, and their summed loss.
    pub done: u64,
    pub loss_sum: f64,
    /// Compute time this round (for the speed the next round's pieces follow).
    pub busy: Duration,
    /// The round's global weights and the outer Nesterov momentum.
    pub global: Vec<Tensor>,
    pub momentum: Vec<Tensor>,
    /// Commits completed by this process (rounds), and the bytes it sent for them.
    pub rounds: u64,
}

fn flat(ts: &[Tensor]) -> Tensor {
    Tensor::cat(&ts.iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0)
}

fn unflat_into(src: &Tensor, dst: &[Tensor]) {
    let mut at = 0;
    tch::no_grad(|| {
        for t in dst {
            let n = t.numel() as i64;
            let mut t = t.shallow_clone();
            t.copy_(&src.narrow(0, at, n).view(t.size().as_slice()));
            at += n;
        }
    });
}

impl Diloco {
    /// The global weights then the momentum (shallow handles).
    fn outer_state(&self) -> Vec<Tensor> {
        self.global
            .iter()
            .chain(&self.momentum)
            .map(|t| t.shallow_clone())
            .collect()
    }

    pub fn new(params: &[Tensor]) -> Diloco {
        Diloco {
            meta: RoundMeta::default(),
            holds: false,
            piece: None,
            todo: Vec::new(),
            done: 0,
            loss_sum: 0.0,
            busy: Duration::ZERO,
            global: params.iter().map(|p| p.detach().copy()).collect(),
            momentum: params.iter().map(|p| p.zeros_like()).collect(),
            rounds: 0,
        }
    }
}

impl Trainer {
    fn dl(&mut self) -> &mut Diloco {
        self.diloco.as_mut().expect("a DiLoCo job")
    }

    /// Positions of the whole run: `max_steps` global batches.
    fn diloco_end(&self) -> u64 {
        self.spec.max_steps.unwrap_or(u64::MAX / 4) * self.spec.global_batch as u64
    }

    /// The pieces of the round that starts now, over `world` members weighted by `speed`.
    fn plan_round(&mut self, world: u32, speed: &[f64]) {
        let h = self.spec.diloco.inner_steps as u64;
        let b = self.spec.global_batch as u64;
        let end = self.diloco_end();
        let det = self.spec.deterministic;
        let d = self.dl();
        let (work, cursor) = plan::round_work(&d.meta.debt, d.meta.cursor, h * b, end);
        let weights: Vec<f64> = if det {
            vec![1.0; world as usize]
        } else {
            speed.to_vec()
        };
        let sizes = plan::shares(plan::total(&work), &weights);
        d.meta.pieces = plan::cut(&work, &sizes);
        d.meta.cursor = cursor;
        d.meta.debt.clear();
    }

    /// Take this member's piece of the current plan.
    fn take_piece(&mut self, rank: u32) {
        let d = self.dl();
        d.piece = Some(rank as usize).filter(|p| *p < d.meta.pieces.len());
        d.todo = d
            .piece
            .map(|p| d.meta.pieces[p].clone())
            .unwrap_or_default();
        d.done = 0;
        d.loss_sum = 0.0;
        d.busy = Duration::ZERO;
    }

    /// The agreement at the start of a DiLoCo generation (module docs).
    pub(super) fn diloco_agree(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> anyhow::Result<Result<(), CommError>> {
        self.received = 0;
        let rank = comm.rank();
        let d = self.diloco.as_ref().unwrap();
        let row = [
            d.meta.round as f64,
            if d.holds { 1.0 } else { 0.0 },
            d.piece.map(|p| p as f64).unwrap_or(-1.0),
        ];
        let all = match comm.all_gather(&Tensor::from_slice(&row)) {
            Ok(a) => a,
            Err(e) => return Ok(Err(e)),
        };
        let rows: Vec<Vec<f64>> = Vec::<f64>::try_from(all.flatten(0, -1))?
            .chunks(3)
            .map(|c| c.to_vec())
            .collect();
        let max = rows
            .iter()
            .filter(|r| r[1] > 0.0)
            .map(|r| r[0])
            .fold(-1.0, f64::max);
        if max < 0.0 {
            // a cold start: every member holds the seed's weights
            let d = self.dl();
            d.meta = RoundMeta::default();
            d.holds = true;
            let n = self.params.len();
            let fresh = Diloco::new(&self.params);
            let d = self.dl();
            d.global = fresh.global;
            d.momentum = fresh.momentum;
            debug_assert_eq!(d.global.len(), n);
            self.plan_round(g.world_size, &vec![1.0; g.world_size as usize]);
            self.take_piece(rank);
            self.step = 0;
            return Ok(Ok(()));
        }
        let at = |r: &Vec<f64>| r[1] > 0.0 && r[0] == max;
        let src = rows.iter().position(at).unwrap() as u32;
        let mut meta = if rank == src {
            serde_json::to_vec(&self.diloco.as_ref().unwrap().meta)?
        } else {
            Vec::new()
        };
        if let Err(e) = comm.broadcast_vec(&mut meta, src) {
            return Ok(Err(e));
        }
        let meta: RoundMeta = serde_json::from_slice(&meta)
            .map_err(|e| anyhow::anyhow!("the round state rank {src} sent: {e}"))?;
        if !rows.iter().all(at) {
            // some member is behind or new: the global weights and momentum from the source
            let d = self.diloco.as_ref().unwrap();
            let mut state = flat(&d.outer_state());
            if let Err(e) = comm.broadcast(&mut state, src) {
                return Ok(Err(e));
            }
            let mine = at(&rows[rank as usize]);
            if !mine {
                self.received = state.numel() as u64 * 4;
                let d = self.diloco.as_mut().unwrap();
                unflat_into(&state, &d.outer_state());
                tch::no_grad(|| {
                    for (p, g) in self.params.iter().zip(&d.global) {
                        p.shallow_clone().copy_(g);
                    }
                });
                let d = self.dl();
                d.piece = None;
                d.todo.clear();
                d.done = 0;
                d.loss_sum = 0.0;
                d.holds = true;
            }
        }
        // the pieces some member still holds stay with it; the others go to the next round
        let claimed: Vec<(u32, usize)> = rows
            .iter()
            .enumerate()
            .filter(|(_, r)| at(r) && r[2] >= 0.0)
            .map(|(i, r)| (i as u32, r[2] as usize))
            .collect();
        let mut next = RoundMeta {
            round: meta.round,
            cursor: meta.cursor,
            debt: meta.debt.clone(),
            pieces: Vec::new(),
        };
        let mut mine = None;
        for (i, p) in meta.pieces.iter().enumerate() {
            match claimed.iter().find(|(_, c)| *c == i) {
                Some((r, _)) => {
                    if *r == rank {
                        mine = Some(next.pieces.len());
                    }
                    next.pieces.push(p.clone());
                }
                None => next.debt.extend(p.iter().cloned()),
            }
        }
        let lost = plan::total(&next.debt) - plan::total(&meta.debt);
        let d = self.dl();
        d.meta = next;
        d.piece = mine;
        if d.meta.pieces.is_empty() {
            // nobody holds any of the round's work: it starts again over the members
            self.plan_round(g.world_size, &vec![1.0; g.world_size as usize]);
            self.take_piece(rank);
        }
        let h = self.spec.diloco.inner_steps as u64;
        let d = self.diloco.as_ref().unwrap();
        if d.piece.is_none() || !at(&rows[rank as usize]) {
            self.step = d.meta.round * h;
        }
        if lost > 0 {
            tracing::info!(
                round = d.meta.round,
                positions = lost,
                "the pieces of members that left go to the next round"
            );
        }
        Ok(Ok(()))
    }

    /// One local step over up to a global batch's share of this member's piece; false when
    /// the piece is done.
    fn inner_step(&mut self, g: &Generation, rank: u32) -> bool {
        let world = g.world_size.max(1) as u64;
        let b = (self.spec.global_batch as u64).div_ceil(world);
        let t0 = Instant::now();
        let take = {
            let d = self.dl();
            plan::take(&mut d.todo, b)
        };
        if take.is_empty() {
            return false;
        }
        let idx: Vec<u64> = plan::positions(&take)
            .map(|p| self.order.sample(p))
            .collect();
        self.zero_grads();
        let n = idx.len() as f64;
        let micro = self
            .spec
            .micro_batch
            .map(|m| m as usize)
            .unwrap_or(idx.len());
        let mut loss = 0.0;
        for chunk in idx.chunks(micro.max(1)) {
            let (x, y) = self.data.batch(chunk);
            let (x, y) = (x.to_device(self.dev), y.to_device(self.dev));
            let l = self.model.loss_sum(&x, &y) / n;
            l.backward();
            loss += l.double_value(&[]) * n;
        }
        let grads: Vec<Tensor> = self
            .params
            .iter()
            .map(|p| {
                let g = p.grad();
                if g.defined() {
                    g
                } else {
                    p.zeros_like()
                }
            })
            .collect();
        let lr = lr_at(self.spec.lr, self.step, self.spec.max_steps);
        self.opt.step(&self.params, &grads, lr, self.step);
        self.step += 1;
        if let Some(f) = &mut self.ledger {
            let round = self.diloco.as_ref().unwrap().meta.round;
            let _ = writeln!(
                f,
                "{}",
                serde_json::json!({"g": g.number, "round": round, "r": rank, "idx": idx})
            );
        }
        let took = t0.elapsed();
        self.computed_for(rank, t0);
        let d = self.dl();
        d.done += idx.len() as u64;
        d.loss_sum += loss;
        d.busy += took.max(t0.elapsed());
        true
    }

    /// The round's commit: the members' figures, the averaged pseudo-gradient, the outer step,
    /// the next round's pieces. Returns the round's mean loss and the samples it committed.
    fn commit(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        rank: u32,
    ) -> Result<(f64, u64), CommError> {
        let d = self.diloco.as_ref().unwrap();
        let round = d.meta.round;
        let speed = if d.busy > Duration::ZERO && d.done > 0 {
            d.done as f64 / d.busy.as_secs_f64()
        } else {
            0.0
        };
        if let Some(f) = &mut self.ledger {
            let _ = writeln!(
                f,
                "{}",
                serde_json::json!({"g": g.number, "round": round, "r": rank, "contrib": true})
            );
        }
        let d = self.diloco.as_ref().unwrap();
        let row = [d.done as f64, d.loss_sum, speed];
        let all = comm.all_gather(&Tensor::from_slice(&row))?;
        let rows: Vec<f64> = Vec::<f64>::try_from(all.flatten(0, -1)).unwrap_or_default();
        let rows: Vec<&[f64]> = rows.chunks(3).collect();
        let samples: f64 = rows.iter().map(|r| r[0]).sum();
        let loss = rows.iter().map(|r| r[1]).sum::<f64>() / samples.max(1.0);
        let speeds: Vec<f64> = rows.iter().map(|r| r[2]).collect();
        // n_i · (global − local), summed over the members
        let d = self.diloco.as_ref().unwrap();
        let delta = tch::no_grad(|| {
            let parts: Vec<Tensor> = d
                .global
                .iter()
                .zip(&self.params)
                .map(|(gl, p)| ((gl - p) * d.done as f64).reshape([-1]))
                .collect();
            Tensor::cat(&parts, 0)
                .to_kind(Kind::Float)
                .to_device(Device::Cpu)
        });
        let q = Quant::parse(&self.spec.diloco.quantize).unwrap_or(Quant::None);
        let group = Group::new(comm.clone(), (0..comm.world()).collect())?;
        let (sum, _) = quant::all_reduce(&group, &delta, q)?;
        let (lr, mu) = (self.spec.diloco.outer_lr, self.spec.diloco.outer_momentum);
        let sum = sum.to_device(self.dev);
        let d = self.diloco.as_mut().unwrap();
        if samples > 0.0 {
            let avg = sum / samples;
            let mut at = 0;
            tch::no_grad(|| {
                for (gl, m) in d.global.iter().zip(&d.momentum) {
                    let n = gl.numel() as i64;
                    let dg = avg.narrow(0, at, n).view(gl.size().as_slice());
                    at += n;
                    // Nesterov: m ← μm + Δ; global ← global − lr·(Δ + μm)
                    let mut m = m.shallow_clone();
                    let _ = m.g_mul_scalar_(mu).g_add_(&dg);
                    let step = &dg + &m * mu;
                    let mut gl = gl.shallow_clone();
                    let _ = gl.g_sub_(&(step * lr));
                }
            });
        }
        tch::no_grad(|| {
            for (p, gl) in self.params.iter().zip(&d.global) {
                p.shallow_clone().copy_(gl);
            }
        });
        d.meta.round += 1;
        d.rounds += 1;
        if let Some(f) = &mut self.ledger {
            let _ = writeln!(
                f,
                "{}",
                serde_json::json!({"g": g.number, "round": round, "r": rank, "committed": true})
            );
        }
        let h = self.spec.diloco.inner_steps as u64;
        self.step = (round + 1) * h;
        self.plan_round(comm.world(), &speeds);
        self.take_piece(rank);
        Ok((loss, samples as u64))
    }

    /// Whether the run is over: no fresh position left and nothing handed over.
    fn diloco_finished(&self) -> bool {
        let d = self.diloco.as_ref().unwrap();
        d.meta.cursor >= self.diloco_end()
            && d.meta.debt.is_empty()
            && d.meta.pieces.iter().all(|p| p.is_empty())
    }

    /// Train DiLoCo rounds in generation `g` until the run is over (`Ok`) or the communicator
    /// fails or a newer generation appears (`Err`).
    pub(super) fn diloco_rounds(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        rank: u32,
    ) -> Result<(), CommError> {
        let mut report = Instant::now() - Duration::from_secs(2);
        let (mut since, mut samples_since) = (Instant::now(), 0u64);
        let (mut rank_since, mut rank_steps) = (Instant::now(), 0u64);
        let start_bytes = comm.bytes_sent();
        let mut committed = 0u64;
        self.computed = Duration::ZERO;
        loop {
            if self.diloco_finished() {
                if let Some(m) = self.spec.max_steps {
                    self.step = m;
                }
                return Ok(());
            }
            if self.cell.newest() > g.number {
                return Err(CommError::Aborted {
                    generation: g.number,
                    op: "round",
                });
            }
            if self.inner_step(g, rank) {
                rank_steps += 1;
            } else {
                let (loss, samples) = self.commit(comm, g, rank)?;
                committed += samples;
                let round = self.diloco.as_ref().unwrap().meta.round;
                samples_since += samples;
                if rank == 0 && report.elapsed() >= Duration::from_secs(1) {
                    let sps = samples_since as f64 / since.elapsed().as_secs_f64();
                    let bytes = (comm.bytes_sent() - start_bytes) as f64 * comm.world() as f64;
                    let per_sample = bytes / committed.max(1) as f64;
                    let p = Progress {
                        generation: g.number,
                        step: self.step,
                        loss: Some(loss),
                        samples_per_sec: Some(sps),
                        updated_at_ms: now_ms(),
                        done: false,
                        final_weights_sha256: None,
                        sync: Some("diloco".into()),
                        round: Some(round),
                        bytes_per_sample: Some(per_sample),
                        eval_loss: None,
                    };
                    let (store, job) = (self.store.clone(), self.env.job.clone());
                    self.rt.spawn(async move {
                        let _ = store.put_json(&store.keys.progress(&job), &p, None).await;
                    });
                    println!(
                        "round {round} step {} loss {loss:.4} samples/s {sps:.1} bytes/sample {per_sample:.1} world {}",
                        self.step, g.world_size
                    );
                    report = Instant::now();
                    since = Instant::now();
                    samples_since = 0;
                }
            }
            if rank_since.elapsed() >= Duration::from_secs(2) && rank_steps > 0 {
                let n = rank_steps as f64;
                let s = RankStats {
                    generation: g.number,
                    rank,
                    step: self.step,
                    step_ms: rank_since.elapsed().as_secs_f64() * 1e3 / n,
                    compute_ms: self.computed.as_secs_f64() * 1e3 / n,
                    updated_at_ms: now_ms(),
                };
                let (store, job) = (self.store.clone(), self.env.job.clone());
                self.rt.spawn(async move {
                    let _ = store
                        .put_json(&store.keys.rank_stats(&job, rank), &s, None)
                        .await;
                });
                (rank_since, rank_steps, self.computed) = (Instant::now(), 0, Duration::ZERO);
            }
        }
    }
}

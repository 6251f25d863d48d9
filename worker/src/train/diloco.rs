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
//! holds any more (their replica left) are handed to the next round, less what entered an
//! exchange.
//!
//! Streaming (`fragments > 1`): a member that left after some of the round's exchanges has
//! moved its pseudo-gradient, and so the samples it had trained by then, into the global weights
//! of the fragments exchanged. Those samples stay trained: each exchange records, per piece,
//! how much of it the members had trained when it started (`RoundMeta::through`, kept by the
//! members for which the exchange completed, and so by the agreement's source); a departed
//! member's piece keeps that much (`RoundMeta::kept`, committed with the round) and only its
//! untrained rest goes to the next round. (Rolling the exchanged fragments back is not possible:
//! the outer step mixed every member's part.) So a committed round's samples are those of the
//! pieces of the members that committed it and the kept part of the departed members' pieces,
//! and every position is committed once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ductile_cluster::records::*;
use ductile_comm::quant;
use ductile_comm::{CommError, Communicator, Group};
use ductile_strategies::diloco::{self as plan, Ranges};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use super::driver::{Commit, Mode, Worked};
use super::{flat, flat_views, ledger_line, Trainer};
use crate::optim::Optimizer;

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
    /// Positions committed by the rounds before this one.
    #[serde(default)]
    pub committed: u64,
    /// Per piece: how much of it its member had trained when the round's last completed
    /// exchange started (none: no exchange yet).
    #[serde(default)]
    pub through: Vec<Option<Through>>,
    /// What this round keeps of its departed members' pieces (committed with it).
    #[serde(default)]
    pub kept: Vec<Through>,
}

/// The first `n` positions of a piece, trained by the member of rank `r` in generation `g`
/// (who trained them, for the exactly-once ledger).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Through {
    pub g: u64,
    pub r: u32,
    pub n: u64,
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
    /// The step before and after the last commit (a checkpoint is due when a multiple of the
    /// interval lies in between).
    pub last_commit: Option<(u64, u64)>,
    /// The fragments' ranges of the flattened parameters (one: all of them).
    pub fragments: Vec<std::ops::Range<usize>>,
    /// Fragments exchanged this round so far (the last one's exchange is the commit).
    pub synced: usize,
    /// Per fragment: samples this member trained since the fragment's last exchange (its
    /// pseudo-gradient's weight).
    pub since: Vec<u64>,
    /// The streaming exchange in flight (not yet in `synced`).
    pub inflight: Option<Exchange>,
}

/// A fragment's exchange in flight: the sum runs on a thread of its own.
pub struct Exchange {
    fragment: usize,
    /// The round, generation and rank it started in.
    round: u64,
    g: u64,
    rank: u32,
    /// Per piece, how much of it its member had trained when the exchange started (what
    /// `RoundMeta::through` becomes when it completes).
    through: Vec<(usize, Through)>,
    /// This member's weight in it (samples since the fragment's previous exchange).
    weight: u64,
    /// The members' summed weight.
    total: f64,
    /// The member's fragment when the exchange started.
    snapshot: Vec<Tensor>,
    sum: std::thread::JoinHandle<Result<Tensor, CommError>>,
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

    pub fn new(params: &[Tensor], fragments: u32) -> Diloco {
        let n: usize = params.iter().map(|p| p.numel()).sum();
        let fragments = quant::ranges(n, fragments.max(1) as usize);
        Diloco {
            since: vec![0; fragments.len()],
            fragments,
            synced: 0,
            inflight: None,
            meta: RoundMeta::default(),
            holds: false,
            piece: None,
            todo: Vec::new(),
            done: 0,
            loss_sum: 0.0,
            busy: Duration::ZERO,
            global: params.iter().map(|p| p.detach().copy()).collect(),
            momentum: params.iter().map(|p| p.zeros_like()).collect(),
            last_commit: None,
        }
    }

    /// Positions of this member's piece of the round (none: 0).
    fn piece_len(&self) -> u64 {
        self.piece
            .and_then(|p| self.meta.pieces.get(p))
            .map(|p| plan::total(p))
            .unwrap_or(0)
    }

    /// Exchanges started this round (the one in flight included).
    pub fn started(&self) -> usize {
        self.synced + self.inflight.is_some() as usize
    }

    /// Whether the last commit crossed a multiple of `interval` steps.
    pub fn crossed(&self, interval: u64) -> bool {
        self.last_commit
            .is_some_and(|(a, b)| interval > 0 && a / interval < b / interval)
    }

    /// The outer optimizer as an [`Optimizer`] over the momentum (shallow handles): what a
    /// checkpoint saves and restores as optimizer state.
    pub fn outer_optimizer(&self, spec: &TrainingSpec) -> Optimizer {
        Optimizer {
            kind: crate::optim::Kind::Sgd(ductile_cluster::recipe::Sgd {
                momentum: spec.diloco.outer_momentum,
                nesterov: true,
                weight_decay: 0.0,
            }),
            state: self.momentum.iter().map(|t| t.shallow_clone()).collect(),
            decay: Vec::new(),
        }
    }

    /// What a checkpoint's `extra` records of the rounds: the round to start, the positions of
    /// its work not yet trained (in order) and the next fresh position.
    pub fn checkpoint_extra(&self, spec: &DilocoSpec) -> serde_json::Value {
        let mut work: Ranges = self.meta.pieces.iter().flatten().cloned().collect();
        work.extend(self.meta.debt.iter().cloned());
        let work = plan::coalesce(&work);
        serde_json::json!({
            "round": self.meta.round,
            "work": work.iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
            "cursor": self.meta.cursor,
            "committed": self.meta.committed,
            "inner_steps": spec.inner_steps,
            "outer_lr": spec.outer_lr,
            "outer_momentum": spec.outer_momentum,
            "quantize": spec.quantize,
        })
    }
}

impl Diloco {
    /// Run `f` with the outer optimizer in the inner one's place (a checkpoint's save and
    /// restore see the global weights and the outer momentum as the state).
    fn with_outer<T>(&self, t: &mut Trainer, f: impl FnOnce(&mut Trainer) -> T) -> T {
        let outer = self.outer_optimizer(&t.spec);
        let global: Vec<Tensor> = self.global.iter().map(|t| t.shallow_clone()).collect();
        let inner = std::mem::replace(&mut t.opt, outer);
        let local = std::mem::replace(&mut t.params, global);
        let out = f(t);
        t.opt = inner;
        t.params = local;
        out
    }

    /// The pieces of the round that starts now, over `world` members weighted by `speed`. A
    /// probe round (the first of a run, when no member's speed is known, outside deterministic
    /// mode) takes a tenth of the fresh positions, so that the pieces follow measured speeds
    /// from the second round on.
    fn plan_round(&mut self, t: &mut Trainer, world: u32, speed: &[f64], probe: bool) {
        let h = t.spec.diloco.inner_steps as u64;
        let h = if probe && !t.spec.deterministic {
            (h / 10).max(1)
        } else {
            h
        };
        let b = t.spec.global_batch as u64;
        let end = t.run_positions();
        let det = t.spec.deterministic;
        let (work, cursor) = plan::round_work(&self.meta.debt, self.meta.cursor, h * b, end);
        let weights: Vec<f64> = if det {
            vec![1.0; world as usize]
        } else {
            speed.to_vec()
        };
        let sizes = plan::shares(plan::total(&work), &weights);
        self.meta.pieces = plan::cut(&work, &sizes);
        self.meta.cursor = cursor;
        self.meta.debt.clear();
        self.meta.through.clear();
        self.meta.kept.clear();
    }

    /// Take this member's piece of the current plan.
    fn take_piece(&mut self, rank: u32) {
        self.piece = Some(rank as usize).filter(|p| *p < self.meta.pieces.len());
        self.todo = self
            .piece
            .map(|p| self.meta.pieces[p].clone())
            .unwrap_or_default();
        self.done = 0;
        self.loss_sum = 0.0;
        self.busy = Duration::ZERO;
    }

    /// The agreement at the start of a DiLoCo generation (module docs).
    pub(super) fn diloco_agree(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> anyhow::Result<Result<(), CommError>> {
        t.received = 0;
        let rank = comm.rank();
        // an exchange in flight when the last generation ended counts if it completed here
        // (then every member's part was in it); otherwise it never happened for this member
        if let Some(x) = self.inflight.take() {
            let (f, w) = (x.fragment, x.weight);
            match self.finish_exchange(t, x) {
                Ok(()) => self.synced += 1,
                // its samples count in the fragment's next exchange
                Err(_) => self.since[f] += w,
            }
        }
        let row = [
            self.meta.round as f64,
            if self.holds { 1.0 } else { 0.0 },
            self.piece.map(|p| p as f64).unwrap_or(-1.0),
            self.synced as f64,
        ];
        let rows = match super::gather_rows(comm.as_ref(), &row) {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        // the most advanced state: the highest round, then the most fragments exchanged in it
        let best = rows
            .iter()
            .filter(|r| r[1] > 0.0)
            .map(|r| (r[0] as u64, r[3] as usize))
            .max();
        let Some((round, synced)) = best else {
            return self.diloco_cold_start(t, comm, g);
        };
        let in_round = |r: &Vec<f64>| r[1] > 0.0 && r[0] as u64 == round;
        let at = |r: &Vec<f64>| in_round(r) && r[3] as usize == synced;
        let src = rows.iter().position(at).unwrap() as u32;
        let mut meta = if rank == src {
            serde_json::to_vec(&self.meta)?
        } else {
            Vec::new()
        };
        if let Err(e) = comm.host().broadcast_vec(&mut meta, src) {
            return Ok(Err(e));
        }
        let meta: RoundMeta = serde_json::from_slice(&meta)
            .map_err(|e| anyhow::anyhow!("the round state rank {src} sent: {e}"))?;
        if !rows.iter().all(at) {
            // some member is behind or new: the global weights and momentum from the source
            let mut placed = comm.place(&flat(&self.outer_state()));
            if let Err(e) = comm.broadcast(&mut placed, src) {
                return Ok(Err(e));
            }
            let state = placed.into_tensor();
            let me = &rows[rank as usize];
            if !at(me) {
                t.received = state.numel() as u64 * 4;
                unflat_into(&state, &self.outer_state());
                let last = self.fragments.len() - 1;
                // the fragments whose exchange this member missed (its own part in them was
                // counted: an exchange completes only with every member's part) take the
                // global weights; the others keep its local progress
                let missed: Vec<usize> = if me[1] == 0.0 {
                    (0..=last).collect()
                } else if in_round(me) {
                    (me[3] as usize..synced).collect()
                } else {
                    std::iter::once(last).chain(0..synced).collect()
                };
                for f in &missed {
                    let r = self.fragments[*f].clone();
                    tch::no_grad(|| {
                        for (p, gl) in flat_views(&t.params, &r)
                            .iter()
                            .zip(flat_views(&self.global, &r))
                        {
                            p.shallow_clone().copy_(&gl);
                        }
                    });
                    self.since[*f] = 0;
                }
                self.synced = synced;
                self.holds = true;
                if !in_round(me) {
                    // its round was committed elsewhere: it trains from the next one on
                    self.piece = None;
                    self.todo.clear();
                    self.done = 0;
                    self.loss_sum = 0.0;
                }
            }
        }
        // the pieces some member still holds stay with it; the others go to the next round
        let claimed: Vec<(u32, usize)> = rows
            .iter()
            .enumerate()
            .filter(|(_, r)| in_round(r) && r[2] >= 0.0)
            .map(|(i, r)| (i as u32, r[2] as usize))
            .collect();
        let mut next = RoundMeta {
            round: meta.round,
            cursor: meta.cursor,
            debt: meta.debt.clone(),
            pieces: Vec::new(),
            committed: meta.committed,
            through: Vec::new(),
            kept: meta.kept.clone(),
        };
        let mut mine = None;
        for (i, p) in meta.pieces.iter().enumerate() {
            let through = meta.through.get(i).copied().flatten();
            match claimed.iter().find(|(_, c)| *c == i) {
                Some((r, _)) => {
                    if *r == rank {
                        mine = Some(next.pieces.len());
                    }
                    next.pieces.push(p.clone());
                    next.through.push(through);
                }
                None => {
                    // what entered an exchange stays trained; the rest goes to the next round
                    let mut rest = p.clone();
                    if let Some(t) = through.filter(|t| t.n > 0) {
                        plan::take(&mut rest, t.n);
                        next.kept.push(t);
                    }
                    next.debt.extend(rest);
                }
            }
        }
        let lost = plan::total(&next.debt) - plan::total(&meta.debt);
        next.debt = plan::coalesce(&next.debt);
        self.meta = next;
        self.piece = mine;
        if self.meta.pieces.is_empty() && self.synced == 0 {
            // nobody holds any of the round's work: the round starts again over the members
            let work = std::mem::take(&mut self.meta.debt);
            let sizes = plan::shares(plan::total(&work), &vec![1.0; g.world_size as usize]);
            self.meta.pieces = plan::cut(&work, &sizes);
            self.meta.through.clear();
            self.take_piece(rank);
        }
        if self.piece.is_none() {
            t.step = self.meta.committed / t.spec.global_batch as u64;
        }
        if lost > 0 {
            tracing::info!(
                round = self.meta.round,
                positions = lost,
                "the pieces of members that left go to the next round"
            );
        }
        Ok(Ok(()))
    }

    /// No member holds a round's state: every member starts from the latest checkpoint (its
    /// global weights, outer momentum and the round's untrained work), else from the model
    /// directory's weights (`init = "pretrained"`), else from the seed.
    fn diloco_cold_start(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> anyhow::Result<Result<(), CommError>> {
        let rank = comm.rank();
        let fresh = Diloco::new(&t.params, t.spec.diloco.fragments);
        *self = fresh;
        self.holds = true;
        t.step = 0;
        t.restored_extra = None;
        if t.ckpt.is_some() {
            // every member needs the whole state (the global weights and the outer optimizer's
            // in the places of the parameters and the inner optimizer's)
            let restored = self.with_outer(t, |t| t.restore_whole(comm, g))?;
            if let Err(e) = restored {
                return Ok(Err(e));
            }
        }
        if t.restored_extra.is_none() && t.pretrained() {
            // no commit: the model directory's weights, which the rounds then start from
            if let Err(e) = t.load_pretrained_whole(comm, g)? {
                return Ok(Err(e));
            }
            *self = Diloco::new(&t.params, t.spec.diloco.fragments);
            self.holds = true;
        }
        let Some(x) = t.restored_extra.take().map(|x| x["diloco"].clone()) else {
            self.plan_round(t, g.world_size, &vec![1.0; g.world_size as usize], true);
            self.take_piece(rank);
            self.ledger_cold_start(t, g, rank);
            return Ok(Ok(()));
        };
        // the checkpoint's round: its untrained work cut anew over this world
        let field = |k: &str| {
            x[k].as_u64()
                .ok_or_else(|| anyhow::anyhow!("the checkpoint's diloco.{k} is missing"))
        };
        let work: Ranges = serde_json::from_value::<Vec<[u64; 2]>>(x["work"].clone())
            .map_err(|e| anyhow::anyhow!("the checkpoint's diloco.work: {e}"))?
            .into_iter()
            .map(|[a, b]| a..b)
            .collect();
        let (round, cursor) = (field("round")?, field("cursor")?);
        tch::no_grad(|| {
            for (p, gl) in t.params.iter().zip(&self.global) {
                p.shallow_clone().copy_(gl);
            }
        });
        self.meta.round = round;
        self.meta.cursor = cursor;
        self.meta.committed = x["committed"]
            .as_u64()
            .unwrap_or_else(|| cursor - plan::total(&work));
        let sizes = plan::shares(plan::total(&work), &vec![1.0; g.world_size as usize]);
        self.meta.pieces = plan::cut(&work, &sizes);
        self.meta.through.clear();
        self.meta.kept.clear();
        self.take_piece(rank);
        self.ledger_cold_start(t, g, rank);
        Ok(Ok(()))
    }

    /// The ledger's record of a cold start: the rounds from the one it starts at on are
    /// trained anew (what earlier generations committed of them went with their members).
    fn ledger_cold_start(&mut self, t: &mut Trainer, g: &Generation, rank: u32) {
        let round = self.meta.round;
        ledger_line(
            &mut t.ledger,
            serde_json::json!({"g": g.number, "round": round, "r": rank, "cold": true}),
        );
    }

    /// One local step over up to a global batch's share of this member's piece; false when
    /// the piece is done.
    fn inner_step(&mut self, t: &mut Trainer, g: &Generation, rank: u32) -> bool {
        let world = g.world_size.max(1) as u64;
        let b = (t.spec.global_batch as u64).div_ceil(world);
        let t0 = Instant::now();
        let take = { plan::take(&mut self.todo, b) };
        if take.is_empty() {
            return false;
        }
        let (idx, loss) = t.backward_on(&take);
        let grads = t.grads_or_zeros();
        t.clip_own(&grads);
        let lr = t.spec.lr_plan().at(t.step);
        t.opt.step(&t.params, &grads, lr, t.step);
        t.step += 1;
        let round = self.meta.round;
        ledger_line(
            &mut t.ledger,
            serde_json::json!({"g": g.number, "round": round, "r": rank, "idx": idx}),
        );
        let took = t0.elapsed();
        t.computed_for(rank, t0);
        for n in self.since.iter_mut() {
            *n += idx.len() as u64;
        }
        self.done += idx.len() as u64;
        self.loss_sum += loss;
        self.busy += took.max(t0.elapsed());
        true
    }

    /// Start fragment `f`'s exchange: the members' pseudo-gradients of its range (global −
    /// local), weighted by the samples each trained since the fragment's last exchange, summed
    /// on a thread of its own while local steps go on. `total` is the members' summed weight;
    /// `through`, how much of each piece its member had trained (module docs).
    fn start_exchange(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: u64,
        f: usize,
        total: f64,
        through: Vec<(usize, Through)>,
    ) -> Result<Exchange, CommError> {
        let r = self.fragments[f].clone();
        let (global, local) = (flat_views(&self.global, &r), flat_views(&t.params, &r));
        let w = self.since[f] as f64;
        let (delta, snapshot) = tch::no_grad(|| {
            let parts: Vec<Tensor> = global
                .iter()
                .zip(&local)
                .map(|(gl, p)| (gl - p) * w)
                .collect();
            let delta = Tensor::cat(&parts, 0)
                .to_kind(Kind::Float)
                .to_device(Device::Cpu);
            (delta, local.iter().map(|t| t.copy()).collect::<Vec<_>>())
        });
        let q = t.spec.diloco.quantize;
        let group = Group::new(comm.clone(), (0..comm.world()).collect())?;
        let sum = std::thread::spawn(move || quant::all_reduce(&group, &delta, q).map(|x| x.0));
        self.since[f] = 0;
        Ok(Exchange {
            fragment: f,
            round: self.meta.round,
            g,
            rank: comm.rank(),
            through,
            weight: w as u64,
            total,
            snapshot,
            sum,
        })
    }

    /// Finish an exchange: the outer Nesterov step on the fragment's global weights; the
    /// member's fragment takes them, plus what its local steps since the exchange started
    /// changed (kept, and counted in the fragment's next exchange).
    fn finish_exchange(&mut self, t: &mut Trainer, x: Exchange) -> Result<(), CommError> {
        let sum = x.sum.join().map_err(|_| CommError::Invalid {
            op: "diloco exchange",
            reason: "the exchange thread panicked".into(),
        })??;
        let (lr, mu) = (t.spec.diloco.outer_lr, t.spec.diloco.outer_momentum);
        let r = self.fragments[x.fragment].clone();
        let (global, local) = (flat_views(&self.global, &r), flat_views(&t.params, &r));
        let momentum = flat_views(&self.momentum, &r);
        tch::no_grad(|| {
            if x.total > 0.0 {
                let avg = sum.to_device(t.dev) / x.total;
                let mut at = 0;
                for (gl, m) in global.iter().zip(&momentum) {
                    let n = gl.numel() as i64;
                    let dg = avg.narrow(0, at, n);
                    at += n;
                    // Nesterov: m ← μm + Δ; global ← global − lr·(Δ + μm)
                    let mut m = m.shallow_clone();
                    let _ = m.g_mul_scalar_(mu).g_add_(&dg);
                    let step = &dg + &m * mu;
                    let mut gl = gl.shallow_clone();
                    let _ = gl.g_sub_(&(step * lr));
                }
            }
            for ((p, gl), before) in local.iter().zip(&global).zip(&x.snapshot) {
                let moved = p - before;
                p.shallow_clone().copy_(&(gl + moved));
            }
        });
        // every member's part was in it: what each had trained of its piece is in the weights
        if self.meta.round == x.round {
            for (piece, t) in &x.through {
                if self.meta.through.len() <= *piece {
                    self.meta.through.resize(piece + 1, None);
                }
                self.meta.through[*piece] = Some(*t);
            }
        }
        ledger_line(
            &mut t.ledger,
            serde_json::json!({"g": x.g, "round": x.round, "r": x.rank, "fragment": x.fragment, "exchanged": true}),
        );
        Ok(())
    }

    /// Wait for the streaming exchange in flight, if any, and count it.
    fn finish_inflight(&mut self, t: &mut Trainer) -> Result<(), CommError> {
        if let Some(x) = self.inflight.take() {
            self.finish_exchange(t, x)?;
            self.synced += 1;
        }
        Ok(())
    }

    /// The fragment whose exchange is due now (streaming DiLoCo: fragment k of F once this
    /// member trained (k + 1)/F of its piece; the last one's exchange is the commit).
    fn fragment_due(&self) -> Option<usize> {
        let f = self.fragments.len() as u64;
        let k = self.started() as u64;
        (k + 1 < f && self.done * f >= (k + 1) * self.piece_len()).then_some(k as usize)
    }

    /// A streaming fragment's exchange in the middle of a round: it runs while local steps go
    /// on, and completes before the next exchange or the commit.
    fn sync_fragment(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        f: usize,
    ) -> Result<(), CommError> {
        let finished = self.inflight.is_some();
        self.finish_inflight(t)?;
        let rank = comm.rank();
        if finished && self.synced == 1 && self.done > 0 {
            crate::faults::exit_between_exchanges(rank, self.meta.round);
        }
        let row = [
            self.since[f] as f64,
            self.done as f64,
            self.piece.map(|p| p as f64).unwrap_or(-1.0),
        ];
        let (round, done) = (self.meta.round, self.done);
        let rows = super::gather_rows(comm.as_ref(), &row)?;
        let total: f64 = rows.iter().map(|r| r[0]).sum();
        let through = rows
            .iter()
            .enumerate()
            .filter(|(_, r)| r[2] >= 0.0)
            .map(|(m, r)| {
                let t = Through {
                    g: g.number,
                    r: m as u32,
                    n: r[1] as u64,
                };
                (r[2] as usize, t)
            })
            .collect();
        ledger_line(
            &mut t.ledger,
            serde_json::json!({"g": g.number, "round": round, "r": rank, "fragment": f, "done": done}),
        );
        let x = self.start_exchange(t, comm, g.number, f, total, through)?;
        self.inflight = Some(x);
        Ok(())
    }

    /// The round's commit: the members' figures, the last fragment's exchange (all of the
    /// parameters without streaming), the next round's pieces. Returns the round's mean loss
    /// and the samples it committed.
    fn commit(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        rank: u32,
    ) -> Result<(f64, u64), CommError> {
        self.finish_inflight(t)?;
        let round = self.meta.round;
        let last = self.fragments.len() - 1;
        let speed = if self.busy > Duration::ZERO && self.done > 0 {
            self.done as f64 / self.busy.as_secs_f64()
        } else {
            0.0
        };
        ledger_line(
            &mut t.ledger,
            serde_json::json!({"g": g.number, "round": round, "r": rank, "contrib": true}),
        );
        let (pending, busy) = t.ckpt_flags(g.number);
        let row = [
            self.done as f64,
            self.loss_sum,
            speed,
            pending as f64,
            busy as f64,
            self.since[last] as f64,
        ];
        let rows = super::gather_rows(comm.as_ref(), &row)?;
        debug_assert!(self.inflight.is_none());
        t.flags = (
            rows.iter().any(|r| r[3] > 0.0),
            rows.iter().any(|r| r[4] > 0.0),
        );
        let samples: f64 = rows.iter().map(|r| r[0]).sum();
        let loss = rows.iter().map(|r| r[1]).sum::<f64>() / samples.max(1.0);
        let speeds: Vec<f64> = rows.iter().map(|r| r[2]).collect();
        let weight: f64 = rows.iter().map(|r| r[5]).sum();
        let x = self.start_exchange(t, comm, g.number, last, weight, Vec::new())?;
        self.finish_exchange(t, x)?;
        self.meta.round += 1;
        self.synced = 0;
        // the departed members' trained part of their pieces commits with the round
        let kept = std::mem::take(&mut self.meta.kept);
        let samples = samples as u64 + kept.iter().map(|t| t.n).sum::<u64>();
        if t.ledger.is_some() {
            let kept: Vec<[u64; 3]> = kept.iter().map(|t| [t.g, t.r as u64, t.n]).collect();
            ledger_line(
                &mut t.ledger,
                serde_json::json!({"g": g.number, "round": round, "r": rank, "committed": true, "kept": kept}),
            );
        }
        let b = t.spec.global_batch as u64;
        let before = self.meta.committed / b;
        self.meta.committed += samples;
        let after = self.meta.committed / b;
        t.step = after.min(t.spec.max_steps.unwrap_or(u64::MAX));
        self.last_commit = Some((before, after));
        self.plan_round(t, comm.world(), &speeds, false);
        self.take_piece(rank);
        Ok((loss, samples))
    }

    /// Whether the run is over: no fresh position left and nothing handed over.
    fn diloco_finished(&self, t: &Trainer) -> bool {
        self.meta.cursor >= t.run_positions()
            && self.meta.debt.is_empty()
            && self.meta.pieces.iter().all(|p| p.is_empty())
    }
}

impl Mode for Diloco {
    fn agree(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> anyhow::Result<Result<(), CommError>> {
        self.diloco_agree(t, comm, g)
    }

    fn finished(&self, t: &Trainer) -> bool {
        self.diloco_finished(t)
    }

    /// A local step (and the streaming exchanges it makes due), or, with the member's piece
    /// done, the exchanges still due this round and the round's commit.
    fn advance(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
    ) -> Result<Worked, CommError> {
        if t.cell.newest() > g.number {
            return Err(CommError::Aborted {
                generation: g.number,
                op: "round",
            });
        }
        if self.inner_step(t, g, me.rank) {
            while let Some(f) = self.fragment_due() {
                self.sync_fragment(t, comm, g, f)?;
            }
            return Ok(Worked {
                steps: 1,
                ..Default::default()
            });
        }
        while self.started() + 1 < self.fragments.len() {
            let f = self.started();
            self.sync_fragment(t, comm, g, f)?;
        }
        let (loss, samples) = self.commit(t, comm, g, me.rank)?;
        Ok(Worked {
            steps: 0,
            commit: Some(Commit { loss, samples }),
            checkpoint: true,
        })
    }

    /// The run is over: its step is the last one.
    fn end(
        &mut self,
        t: &mut Trainer,
        _comm: &Arc<dyn Communicator>,
        out: Result<(), CommError>,
    ) -> Result<(), CommError> {
        if out.is_ok() {
            if let Some(m) = t.spec.max_steps {
                t.step = m;
            }
        }
        out
    }

    /// A round that crossed a multiple of the interval.
    fn save_due(&self, _t: &Trainer, interval: u64) -> bool {
        self.crossed(interval)
    }

    /// The last round's, if it crossed a multiple of the interval.
    fn final_due(&self, _t: &Trainer, interval: u64) -> bool {
        self.crossed(interval)
    }

    fn extra(&self, t: &Trainer, _g: &Generation) -> Option<(&'static str, serde_json::Value)> {
        Some(("diloco", self.checkpoint_extra(&t.spec.diloco)))
    }

    /// The global weights and the outer optimizer's state are what a checkpoint holds.
    fn with_saved_state(&self, t: &mut Trainer, f: &mut dyn FnMut(&mut Trainer)) {
        self.with_outer(t, f)
    }

    fn report(&mut self, _t: &Trainer, p: &mut Progress) {
        p.sync = Some("diloco".into());
        p.round = Some(self.meta.round);
    }
}

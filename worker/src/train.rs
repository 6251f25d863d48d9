//! The tch trainer: what every sync mode shares (the model, its parameters and optimizer, the
//! data order, the checkpoint, the reports to the control plane), the communicator's forming,
//! and the data-parallel step.
//!
//! The one training loop is [`driver::Driver`]: for each generation that includes this worker it
//! forms the communicator, runs the sync mode's agreement (the highest completed step among the
//! members wins; the ranks behind receive what they need from the holders), writes the join
//! record, then drives the mode's units of work. A new generation aborts the communicator (a
//! pending all-reduce returns at once), the unfinished step is dropped, and the driver joins the
//! new generation in the same process. The modes ([`driver::Mode`]): all-reduce
//! ([`allreduce`]: data parallel, pipeline and tensor parallel layouts), DiLoCo ([`diloco`]) and
//! bounded-staleness async ([`asynch`]), each owning its own state.
//!
//! Step s consumes global positions [s·B, (s+1)·B) of the seeded per-epoch permutation; each
//! rank takes its share (uneven allowed) in micro-batches and the applied gradient is the exact
//! mean over the B samples. In deterministic mode B is cut into V logical shards whose gradients
//! are folded in global shard order by the ordered all-reduce, so the bits do not depend on the
//! world size.

use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ductile_cluster::records::*;
use ductile_cluster::Store;
use ductile_comm::{CommError, Communicator, Rendezvous, TcpComm, TcpConfig};
use ductile_strategies::{split_batch, split_range, Share};
use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};

use crate::data::{Dataset, Order};
use crate::model::Model;
use crate::optim::Optimizer;
use ductile_runtime::report::Reporter;
use ductile_runtime::{GenCell, WorkerEnv};

mod agree;
pub mod allreduce;
pub mod asynch;
mod buddy;
pub mod ckpt;
pub mod diloco;
pub mod driver;
mod eval;
mod fsdp;
mod fsdp_tp;
mod norm;
mod overlap;
pub mod pipe;
pub mod reshard;
mod tensor;

pub struct Trainer {
    pub env: WorkerEnv,
    pub spec: TrainingSpec,
    pub max_size: u32,
    pub store: Store,
    pub rt: tokio::runtime::Handle,
    pub cell: Arc<GenCell>,
    /// Join and fault records, progress and rank figures, to the control plane.
    reports: Reporter,
    /// Where the model, the optimizer state and the batches live.
    dev: Device,
    data: Dataset,
    /// Samples of `data` training draws from (its first; the rest are an `eval_fraction`).
    train_samples: u64,
    /// The held-out samples the eval loss is computed on, if the job has a split.
    eval: Option<eval::EvalSet>,
    order: Order,
    model: Model,
    params: Vec<Tensor>,
    opt: Optimizer,
    step: u64,
    ledger: Option<std::fs::File>,
    ckpt: Option<ckpt::Ckpt>,
    /// The collective checkpoint flags of the last step: (request pending, save in flight).
    flags: (bool, bool),
    /// The model's units (pipeline blocks) by name, and each parameter's unit.
    unit_names: Vec<String>,
    param_unit: Vec<usize>,
    /// The other unit a parameter is used by, if any (a head tied to the embedding): a stage
    /// holding that unit holds the parameter too.
    param_also: Vec<Option<usize>>,
    /// The chunks of units whose parameters and optimizer state this rank holds at `step`.
    held: Vec<std::ops::Range<usize>>,
    /// Bytes of state received from peers when joining the current generation.
    received: u64,
    /// Each parameter's shape (its optimizer state has the same): the storage of units this
    /// rank does not hold is released and comes back, zeroed, before a unit is received.
    shapes: Vec<Vec<i64>>,
    /// The TLS of this node's mesh certificate, for a job with `mesh_tls`.
    mesh_tls: Option<Arc<ductile_comm::mesh_tls::MeshTls>>,
    /// Time spent computing (forward and backward) since the last rank report.
    computed: Duration,
    /// The tensor layout of what this rank holds: (group size, its place in the group); set
    /// with [`Trainer::set_tp_held`].
    tp_held: (u32, u32),
    /// Each parameter's shape when whole on this rank: its tensor slice's under tensor groups,
    /// else `shapes` (full sharding gathers a parameter's rows to it).
    gathered: Vec<Vec<i64>>,
    /// The shard of the optimizer state this rank holds (`training.sharding`): (shard group
    /// size, its place in the group); (1, 0) whole.
    pub(crate) shard_held: (u32, u32),
    /// A sharded job's optimizer state is not allocated yet (a new process, before its first
    /// agreement: it holds the seed's zeros, allocated as its shard of that generation).
    opt_unallocated: bool,
    /// The `extra` of the checkpoint the last restore read.
    restored_extra: Option<serde_json::Value>,
    /// The latest eval: (step, loss).
    last_eval: Option<(u64, f64)>,
    /// What the read-ahead was last asked for: this rank's places in a batch, the step that
    /// asked, and the last step asked for.
    ahead: (Vec<(u64, u64)>, u64, u64),
    /// The data-parallel step's gradient bucket, reused from step to step.
    bucket: Option<Tensor>,
    /// The last step's global gradient norm before clipping (jobs with `max_grad_norm`).
    pub(crate) grad_norm: Option<f64>,
    /// The copy of another rank's shard this rank keeps (`training.buddy_copies`).
    buddy: Option<buddy::Buddy>,
    /// Whether every member of the current generation's build keeps buddy copies (its
    /// agreement row says so).
    buddy_peers: bool,
}

/// Samples of the final evaluation loss.
const EVAL_SAMPLES: u64 = eval::DEFAULT_EVAL_SAMPLES;
/// The most steps whose samples a streamed dataset's read-ahead fetches before they are wanted.
const READ_AHEAD_STEPS: u64 = 256;

fn sha256_params(params: &[Tensor]) -> String {
    let mut h = Sha256::new();
    for p in params {
        let n = p.numel();
        let mut buf = vec![0u8; n * p.kind().elt_size_in_bytes()];
        p.copy_data_u8(&mut buf, n);
        h.update(&buf);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// One line of the exactly-once ledger (`DUCTILE_LEDGER_DIR`), when this worker keeps one.
pub(crate) fn ledger_line(ledger: &mut Option<std::fs::File>, line: serde_json::Value) {
    if let Some(f) = ledger {
        let _ = f.write_all(format!("{line}\n").as_bytes());
    }
}

/// The tensors flattened one after another (on their device).
pub(crate) fn flat(ts: &[Tensor]) -> Tensor {
    Tensor::cat(&ts.iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0)
}

/// Views of `ts`, flattened one after another, that cover the flat range `r`.
pub(crate) fn flat_views(ts: &[Tensor], r: &std::ops::Range<usize>) -> Vec<Tensor> {
    let mut out = Vec::new();
    let mut at = 0usize;
    for t in ts {
        let n = t.numel();
        let (lo, hi) = (r.start.max(at), r.end.min(at + n));
        if lo < hi {
            out.push(
                t.reshape([-1])
                    .narrow(0, (lo - at) as i64, (hi - lo) as i64),
            );
        }
        at += n;
    }
    out
}

/// Every rank's `row` of f64s (the same length everywhere), in rank order: control data, on
/// the generation's host face whatever its backend.
pub(crate) fn gather_rows(
    comm: &dyn Communicator,
    row: &[f64],
) -> Result<Vec<Vec<f64>>, CommError> {
    comm.host().all_gather_f64(row)
}

/// Where a new process of a fully sharded job holds its rows: its place in the newest
/// generation, which includes it (the agent started it for that one; the watcher has it, or
/// will within the bound). Without one, or as a spare, it makes the seed whole, as every other
/// job does, and the first agreement cuts it.
fn seed_place(cell: &GenCell, env: &WorkerEnv) -> (u32, u32) {
    match cell.wait_newer_for(0, Duration::from_secs(10)) {
        Some(g) => match g
            .member(&env.node, env.slot)
            .map(|m| Trainer::shard_of(&g, m))
        {
            Some((s, p)) if s > 1 && crate::faults::stale_seed_place() => (s, (p + 1) % s),
            Some(rows) => rows,
            None => (1, 0),
        },
        None => {
            tracing::info!("no generation yet after 10 s: making the seed whole, to cut it at the first agreement");
            (1, 0)
        }
    }
}

impl Trainer {
    fn new(
        env: WorkerEnv,
        spec: TrainingSpec,
        max_size: u32,
        store: Store,
        rt: tokio::runtime::Handle,
        cell: Arc<GenCell>,
    ) -> anyhow::Result<Trainer> {
        // main() checked at start that the device is usable
        let dev = crate::device::parse(&env.device)?;
        if dev == Device::Cpu {
            // a CPU slot is one core's worth of work; GPU slots keep torch's default threads
            tch::set_num_threads(1);
        } else if spec.deterministic {
            crate::device::set_deterministic(true);
        }
        let data = Dataset::open(&spec.dataset, spec.model, crate::model::ctx(&spec), &rt)?;
        anyhow::ensure!(!data.is_empty(), "dataset {} holds no sample", spec.dataset);
        if spec.model == ModelKind::Hf {
            crate::hf::check_stream(&spec, &data, &rt)?;
        }
        // full sharding: a new process cuts the seed to its rows as it makes it, unit by unit,
        // at its place in the generation that started it, so the whole model never exists on
        // it (the first agreement re-cuts it if the world changed meanwhile)
        let rows = if spec.sharding == Sharding::Full {
            seed_place(&cell, &env)
        } else {
            (1, 0)
        };
        let model = Model::with_rows(&spec, &data, dev, rows)?;
        if rows.0 > 1 {
            let held: i64 = model
                .params()
                .iter()
                .map(|(_, t)| t.numel() as i64 * t.kind().elt_size_in_bytes() as i64)
                .sum();
            tracing::info!(
                shard = rows.0,
                place = rows.1,
                bytes = held,
                "made the seed's parameters in their rows, unit by unit"
            );
        }
        let params: Vec<Tensor> = model.params().into_iter().map(|(_, t)| t).collect();
        // a sharded job's rank allocates its optimizer state's rows only, in its first
        // agreement: the whole state never exists on one rank
        let sharded = spec.sharding.is_sharded();
        let opt = if sharded {
            Optimizer::unallocated(&spec.optimizer, &params)
        } else {
            Optimizer::new(&spec.optimizer, &params)
        }
        .decaying(
            &spec.optimizer,
            model.params().iter().map(|(n, _)| n.as_str()),
        );
        let shapes = model.shapes().to_vec();
        let ledger = match std::env::var("DUCTILE_LEDGER_DIR") {
            Ok(dir) => {
                std::fs::create_dir_all(&dir)?;
                Some(std::fs::File::create(format!(
                    "{dir}/{}-{}-{}.jsonl",
                    env.node,
                    env.slot,
                    std::process::id()
                ))?)
            }
            Err(_) => None,
        };
        let (train_samples, eval) = eval::EvalSet::of(&spec, &data, &rt)?;
        let order = Order::new(train_samples, spec.seed);
        let arch = ductile_strategies::arch::of(&spec).map_err(|e| anyhow::anyhow!(e))?;
        let unit_list = arch.units();
        let shared = arch.shared();
        anyhow::ensure!(
            unit_list.len() == model.units(),
            "the planner counts {} units in this model, the worker {}",
            unit_list.len(),
            model.units()
        );
        let param_unit = model
            .params()
            .iter()
            .map(|(n, _)| {
                ductile_strategies::pipeline::unit_of(&unit_list, n)
                    .ok_or_else(|| anyhow::anyhow!("parameter {n} belongs to no unit"))
            })
            .collect::<anyhow::Result<Vec<usize>>>()?;
        let param_also: Vec<Option<usize>> = model
            .params()
            .iter()
            .map(|(n, _)| {
                shared
                    .as_ref()
                    .and_then(|(name, u)| (name == n).then_some(*u))
            })
            .collect();
        let units = unit_list.len();
        let mesh_tls = if spec.mesh_tls {
            let t = ductile_comm::mesh_tls::MeshTls::from_env()?.ok_or_else(|| {
                anyhow::anyhow!("the job's mesh runs over TLS (mesh_tls) but the agent gave no mesh certificate (DUCTILE_MESH_TLS_CA, _CERT, _KEY)")
            })?;
            Some(Arc::new(t))
        } else {
            None
        };
        let reports = Reporter {
            store: store.clone(),
            rt: rt.clone(),
            job: env.job.clone(),
            node: env.node.clone(),
            slot: env.slot,
            cell: cell.clone(),
        };
        Ok(Trainer {
            reports,
            mesh_tls,
            computed: Duration::ZERO,
            env,
            spec,
            max_size,
            store,
            rt,
            cell,
            dev,
            data,
            train_samples,
            eval,
            order,
            model,
            params,
            opt,
            step: 0,
            ledger,
            ckpt: None,
            flags: (false, false),
            unit_names: unit_list.into_iter().map(|u| u.name).collect(),
            param_unit,
            param_also,
            // a new process holds the seed's state, at step 0
            held: vec![0..units],
            received: 0,
            gathered: shapes.clone(),
            shapes,
            tp_held: (1, 0),
            shard_held: (1, 0),
            opt_unallocated: sharded,
            buddy: None,
            buddy_peers: false,
            restored_extra: None,
            last_eval: None,
            ahead: (Vec::new(), 0, 0),
            bucket: None,
            grad_norm: None,
        })
    }

    /// Open the job's checkpoint: its tensors are the parameters and the optimizer's state, or
    /// with `outer` (DiLoCo) the global weights and the outer optimizer's state under
    /// `outer_optimizer`; and follow the job's checkpoint requests.
    fn open_checkpoint(
        &mut self,
        c: CheckpointSpec,
        outer: Option<Optimizer>,
    ) -> anyhow::Result<()> {
        let names: Vec<String> = self.model.params().into_iter().map(|(n, _)| n).collect();
        let ck = match &outer {
            Some(o) => {
                let mut ck = ckpt::Ckpt::new(c, &names, o, &self.shapes)?;
                ck.state_prefix("outer_optimizer");
                ck
            }
            None => ckpt::Ckpt::new(c, &names, &self.opt, &self.shapes)?,
        };
        ductile_runtime::watch_checkpoint_requests(
            self.store.clone(),
            self.env.job.clone(),
            ck.request.clone(),
            &self.rt,
        );
        self.ckpt = Some(ck);
        Ok(())
    }

    /// The communicator of `g` failed: report it and wait for the next generation
    /// ([`Reporter::failed_generation`]).
    fn failed_generation(&self, g: &Generation, rank: u32, e: &CommError) -> anyhow::Result<()> {
        if let CommError::Rule { .. } = e {
            // a bug in this worker's own calls, which the next generation would repeat
            anyhow::bail!("{e}");
        }
        let (kind, suspects) = e.blame();
        self.reports
            .failed_generation(g, rank, kind, suspects, e.to_string())
    }

    /// Form the generation's communicator on its backend. The outer error is one that no
    /// retry fixes here (NCCL asked for where it cannot load): the worker exits with it.
    fn form(
        &self,
        g: &Generation,
        rank: u32,
    ) -> anyhow::Result<Result<Arc<dyn Communicator>, CommError>> {
        let rdv = match Rendezvous::new(
            self.store.clone(),
            &self.env.job,
            g.number,
            g.world_size,
            rank,
        ) {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        let timeout = Duration::from_secs(30);
        let cell = self.cell.clone();
        let n = g.number;
        let newer = move || {
            let cell = cell.clone();
            async move {
                loop {
                    if cell.newest() > n {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        // no legitimate frame is longer than the whole state (a joiner's transfer) or the
        // ring's chunks; a peer announcing more is refused before anything is allocated
        let elem = self.elem_sizes();
        let full: u64 = self
            .parts_of(0, &[0..self.units()])
            .iter()
            .map(|p| ductile_strategies::redistribute::elements(&p.region) * elem[p.tensor])
            .sum();
        // one op timeout for every backend: the job's comm_timeout_s, else the TCP default
        let env = TcpConfig::from_env();
        let cfg = TcpConfig {
            form_timeout: timeout,
            op_timeout: self
                .spec
                .comm_timeout_s
                .map(Duration::from_secs)
                .unwrap_or(env.op_timeout),
            max_frame_bytes: (full + (1 << 20)).max(64 << 20),
            tls: self.mesh_tls.clone(),
            device: self.dev,
            // NCCL's rules checked where this generation would run on NCCL on GPUs
            strict: env.strict && self.on_nccl_on_gpus(g),
            ..env
        };
        if cfg.strict && g.backend == Backend::Tcp {
            tracing::info!(
                generation = n,
                rank,
                "NCCL's rules checked on TCP (strict mode)"
            );
        }
        if g.backend == Backend::Nccl {
            let Device::Cuda(index) = self.dev else {
                return Err(ductile_runtime::Unusable(format!(
                    "generation {n} uses NCCL (comm = {:?}), but this slot is a CPU slot",
                    self.spec.comm.as_str()
                ))
                .into());
            };
            return crate::nccl::form(&self.rt, &rdv, index, cfg, newer());
        }
        Ok(self.rt.block_on(async move {
            tokio::select! {
                r = TcpComm::form(&rdv, cfg) => r.map(|c| Arc::new(c) as Arc<dyn Communicator>),
                _ = newer() => Err(CommError::Aborted { generation: n, op: "form" }),
            }
        }))
    }

    /// Write this rank's join record of `g` and the weights it joined with (rank, step, the
    /// hash of what it holds; in a pipeline generation also the chunks and tensor slice).
    fn join(
        &mut self,
        g: &Generation,
        me: &Member,
        pipelined: bool,
        (seen_at_ms, formed_at_ms): (u64, u64),
    ) {
        let rank = me.rank;
        let mine = self.params_in(&self.held.clone());
        let held_params: Vec<Tensor> = mine
            .iter()
            .map(|i| self.params[*i].shallow_clone())
            .collect();
        let hash = sha256_params(&held_params);
        println!(
            "joined generation {} as rank {} of {} at step {} ({}; {}) weights {}",
            g.number,
            rank,
            g.world_size,
            self.step,
            g.reason,
            g.detail,
            &hash[..16]
        );
        let join = JoinRecord {
            node: self.env.node.clone(),
            slot: self.env.slot,
            rank,
            pid: std::process::id(),
            joined_at_ms: now_ms(),
            step: self.step,
            seen_at_ms,
            formed_at_ms,
            received_bytes: self.received,
            state_bytes: self.state_bytes(),
        };
        let weights = if pipelined {
            let chunks: Vec<String> = self
                .held
                .iter()
                .map(|r| format!("{}-{}", r.start, r.end))
                .collect();
            let slice = match self.tp_held {
                (tp, k) if tp > 1 => format!("@{k}/{tp}"),
                _ => String::new(),
            };
            format!("{}:{}:{}{slice}", self.step, hash, chunks.join("+"))
        } else {
            format!("{}:{}", self.step, hash)
        };
        self.reports.joined(g.number, rank, join, Some(weights));
    }

    /// Forward and backward of the mean loss over the samples at `positions` (in
    /// micro-batches), on zeroed gradients: the samples and their summed loss.
    fn backward_on(&mut self, positions: &[std::ops::Range<u64>]) -> (Vec<u64>, f64) {
        let idx: Vec<u64> = positions
            .iter()
            .flat_map(|r| r.clone())
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
            let l = if self.model.recomputes() {
                // through the tape: its blocks run again in the backward
                let solo = "a data-parallel model does not communicate inside itself";
                let mut tape = crate::model::Tape::default();
                let out = self
                    .model
                    .forward(0, self.units(), &x, &mut tape)
                    .expect(solo);
                let l = self.model.loss(&out, &y, &mut tape).expect(solo) / n;
                self.model.backward(tape, &l, None).expect(solo);
                l
            } else {
                let l = self.model.loss_sum(&x, &y) / n;
                l.backward();
                l
            };
            loss += l.double_value(&[]) * n;
        }
        (idx, loss)
    }

    /// Positions of the whole run: `max_steps` global batches (DiLoCo and async hand them
    /// out themselves).
    fn run_positions(&self) -> u64 {
        self.spec.max_steps.unwrap_or(u64::MAX / 4) * self.spec.global_batch as u64
    }

    /// Publish this rank's figures over the `steps` steps since `since` (a straggler shows in
    /// its compute time), and start counting compute time anew.
    fn report_rank(&mut self, g: &Generation, rank: u32, since: Instant, steps: u64) {
        let n = steps.max(1) as f64;
        self.reports.rank_stats(RankStats {
            generation: g.number,
            rank,
            step: self.step,
            step_ms: since.elapsed().as_secs_f64() * 1e3 / n,
            compute_ms: self.computed.as_secs_f64() * 1e3 / n,
            data_ms: self.data.take_waited().as_secs_f64() * 1e3 / n,
            updated_at_ms: now_ms(),
        });
        self.computed = Duration::ZERO;
    }

    /// The final weights' mean loss on the eval split's first `eval_samples` samples, or
    /// without a split on the dataset's first [`EVAL_SAMPLES`] (a fixed set, the same for
    /// every mode and layout), when this rank holds the whole model.
    fn eval_loss(&mut self) -> Option<f64> {
        if self.model.sliced() || self.tp_held.0 > 1 {
            return None;
        }
        let (data, idx) = match &self.eval {
            Some(e) => (e.data(&self.data), e.samples()),
            None => (&self.data, (0..self.data.len().min(EVAL_SAMPLES)).collect()),
        };
        let n = idx.len() as u64;
        let mut sum = 0.0;
        tch::no_grad(|| {
            for chunk in idx.chunks(64) {
                let (x, y) = data.batch(chunk);
                let (x, y) = (x.to_device(self.dev), y.to_device(self.dev));
                sum += self.model.loss_sum(&x, &y).double_value(&[]);
            }
        });
        Some(sum / n.max(1) as f64)
    }

    /// The flattened parameters' element count.
    fn numel(&self) -> usize {
        self.params.iter().map(|p| p.numel()).sum()
    }

    /// The seed's parameters, whole, as a first start makes them (in the optimizer's order):
    /// what a job starts over from when no rank and no checkpoint holds its state.
    fn seed_params(&self) -> anyhow::Result<Vec<Tensor>> {
        let seed = Model::new(&self.spec, &self.data, self.dev)?;
        Ok(seed.params().into_iter().map(|(_, t)| t.detach()).collect())
    }

    fn tensors(&self) -> Vec<&Tensor> {
        self.params.iter().chain(self.opt.state.iter()).collect()
    }

    fn zero_grads(&self) {
        self.zero_grads_of(0..self.params.len());
    }

    /// Zero the gradients of parameters `which`.
    fn zero_grads_of(&self, which: impl IntoIterator<Item = usize>) {
        for i in which {
            let mut g = self.params[i].grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }

    /// Every parameter's gradient (the tensor itself), zeros where it has none.
    pub(crate) fn grads_or_zeros(&self) -> Vec<Tensor> {
        self.params
            .iter()
            .map(|p| {
                let g = p.grad();
                if g.defined() {
                    g
                } else {
                    p.zeros_like()
                }
            })
            .collect()
    }

    /// The gradients of parameters `which`, each flattened (zeros where none).
    fn grad_parts(&self, which: impl IntoIterator<Item = usize>) -> Vec<Tensor> {
        which
            .into_iter()
            .map(|i| {
                let p = &self.params[i];
                let g = p.grad();
                if g.defined() {
                    g.reshape([-1])
                } else {
                    p.zeros_like().reshape([-1])
                }
            })
            .collect()
    }

    /// Ask a streamed dataset for this rank's samples of the steps ahead: those at the same
    /// places `(start, len)` in their global batches as this step's. Asked in windows (when
    /// fewer than half the window is left, the next half): a shard's samples of several steps
    /// then come in one coalesced read, not one read a step. The window is up to
    /// [`READ_AHEAD_STEPS`] steps, less when that many would not fit in half the read-ahead's
    /// budget.
    fn read_ahead(&mut self, within: &[(u64, u64)]) {
        if !matches!(self.data, Dataset::Stream { .. }) {
            return;
        }
        let per_step: u64 = within.iter().map(|w| w.1).sum::<u64>().max(1);
        let ctx = self.data.token_shape().map_or(1, |s| s.1 as u64 + 1);
        let fits = (crate::data::stream::budget_bytes() as u64 / 8) / (per_step * ctx).max(1);
        let window = fits.clamp(2, READ_AHEAD_STEPS);
        let (ref asked, since, until) = self.ahead;
        // (a step before the last request's: a cold start went back; ask anew)
        let from = if asked.as_slice() == within && until > self.step && self.step >= since {
            if until >= self.step + window / 2 {
                return;
            }
            until + 1
        } else {
            self.step + 1
        };
        let to = self.step + window;
        let b = self.spec.global_batch as u64;
        let end = self.run_positions();
        let mut want = Vec::new();
        for j in from..=to {
            for &(start, len) in within {
                for p in (j * b + start..j * b + start + len).take_while(|p| *p < end) {
                    want.push(self.order.sample(p));
                }
            }
        }
        self.ahead = (within.to_vec(), self.step, to);
        if !want.is_empty() {
            self.data.prefetch(want);
        }
    }

    /// The global batch cut into the job's logical shards (deterministic mode).
    fn logical_shards(&self) -> Vec<Share> {
        let v = self.spec.logical_shards.unwrap_or(self.max_size).max(1);
        split_batch(self.spec.global_batch as u64, v)
    }

    /// The model's units (the pipeline's blocks).
    fn units(&self) -> usize {
        self.unit_names.len()
    }

    /// The flat gradient with the loss (a [1] tensor on the device) and the checkpoint flags
    /// appended.
    fn flat_grads(&self, loss: Tensor, generation: u64) -> Tensor {
        let mut parts = self.grad_parts(0..self.params.len());
        parts.extend(self.riders(loss, generation));
        Tensor::cat(&parts, 0).contiguous()
    }

    /// This rank's checkpoint flags for `generation` (request pending, save in flight), 0 or 1
    /// each; zeros for a job without checkpoints.
    pub(crate) fn ckpt_flags(&self, generation: u64) -> (f32, f32) {
        self.ckpt
            .as_ref()
            .map(|c| c.flags(generation))
            .unwrap_or((0.0, 0.0))
    }

    /// What rides along with a step's gradients, so every rank sees the same sums: the loss
    /// (a [1] f32 tensor) and the checkpoint flags.
    fn riders(&self, loss: Tensor, generation: u64) -> [Tensor; 2] {
        let (pending, busy) = self.ckpt_flags(generation);
        [
            loss.to_kind(Kind::Float),
            if self.dev == Device::Cpu {
                Tensor::from_slice(&[pending, busy])
            } else {
                // written by kernels: a host→device copy here would wait for the whole backward
                let t = Tensor::zeros([2], (Kind::Float, self.dev));
                let _ = t.get(0).fill_(pending as f64);
                let _ = t.get(1).fill_(busy as f64);
                t
            },
        ]
    }

    /// Sums every parameter's gradient over the world in place, after the whole backward, in
    /// the buckets of [`Trainer::bucket_plan`] (whole parameters of about `training.bucket_mb`,
    /// in the order the backward finishes them; the riders in the last): each bucket is copied
    /// into one buffer, all-reduced, and copied back, so no whole-model copy of the gradients
    /// is ever made. The same buckets in the same order as the overlapped step's
    /// ([`Trainer::overlapped_step`]): the ranks of one generation may take either schedule
    /// (each decides by its own node's cores), and their all-reduces still pair up. Returns
    /// the gradients (a parameter without one gets zeros) and the summed riders (loss,
    /// pending, busy).
    fn reduce_in_buckets(
        &mut self,
        comm: &dyn Communicator,
        loss: Tensor,
        generation: u64,
    ) -> Result<(Vec<Tensor>, Tensor), CommError> {
        let grads = self.grads_or_zeros();
        let riders = Tensor::cat(&self.riders(loss, generation), 0);
        let plan = self.bucket_plan();
        let buf = self.bucket_buffer(&plan);
        let mut summed = None;
        for (j, k) in plan.iter().enumerate() {
            let gs: Vec<Tensor> = k.params.iter().map(|&i| grads[i].shallow_clone()).collect();
            let ride = (j + 1 == plan.len()).then_some(&riders);
            if let Some(r) = overlap::reduce_bucket(comm, &buf, &gs, ride)? {
                summed = Some(r);
            }
        }
        self.bucket = Some(buf);
        Ok((grads, summed.expect("the last bucket carries the riders")))
    }

    /// Forward and backward over `micro` (micro-batches of this rank's part of step
    /// `self.step`, from [`Trainer::step_parts`]); returns the summed loss / B as a [1] f32
    /// tensor on the device (summed in f64; read on the host only with the step's all-reduced
    /// result, so a CUDA step synchronises once).
    fn accumulate(&mut self, micro: &[(Tensor, Tensor)]) -> Tensor {
        let b = self.spec.global_batch as f64;
        let mut acc = Tensor::zeros([1], (Kind::Double, self.dev));
        for (x, y) in micro {
            // a model with logical slices (deterministic tensor_slices) runs them through a
            // group of one: the same ops, in the same order, as a tensor group of any size
            let solo = "a data-parallel step does not communicate inside its model";
            let mut tape = crate::model::Tape::default();
            let out = self
                .model
                .forward(0, self.units(), x, &mut tape)
                .expect(solo);
            let loss = self.model.loss(&out, y, &mut tape).expect(solo) / b;
            self.model.backward(tape, &loss, None).expect(solo);
            acc += loss.detach().to_kind(Kind::Double).reshape([1]);
        }
        acc.to_kind(Kind::Float)
    }

    /// This step computed since `t0`: count it (and, for an injected straggler, wait).
    fn computed_for(&mut self, rank: u32, t0: Instant) {
        let took = t0.elapsed();
        if let Some(more) = crate::faults::slowdown(rank, took) {
            std::thread::sleep(more);
        }
        self.computed += t0.elapsed();
    }

    fn train_step(
        &mut self,
        arc: &Arc<dyn Communicator>,
        g: &Generation,
        rank: u32,
    ) -> Result<f64, CommError> {
        let comm = arc.as_ref();
        let t0 = Instant::now();
        if self.reduces_per_unit() {
            return self.full_step(arc, g, rank, t0);
        }
        if !self.spec.deterministic {
            return self.bucketed_step(arc, g, rank, t0);
        }
        let flat = {
            let v = self.logical_shards().len() as u64;
            let mut mine = Vec::new();
            for part in self.step_parts(comm, g, rank) {
                self.zero_grads();
                let l = self.accumulate(&part.micro);
                mine.push((part.k, self.flat_grads(l, g.number)));
            }
            self.computed_for(rank, t0);
            let mine: Vec<_> = mine.iter().map(|(k, t)| (*k, comm.place(t))).collect();
            comm.ordered_all_reduce(&mine, v)?.into_tensor()
        };
        let n = flat.size()[0];
        // one device→host read of the three scalars riding along
        let tail = Vec::<f32>::try_from(flat.narrow(0, n - 3, 3).to_device(Device::Cpu))
            .unwrap_or_else(|_| vec![f32::NAN, 0.0, 0.0]);
        let loss = tail[0] as f64;
        self.flags = (tail[1] > 0.0, tail[2] > 0.0);
        let mut grads = Vec::with_capacity(self.params.len());
        let mut at = 0;
        for p in &self.params {
            let k = p.numel() as i64;
            grads.push(flat.narrow(0, at, k).view(p.size().as_slice()));
            at += k;
        }
        self.apply_step(arc, g, rank, &grads, loss)?;
        Ok(loss)
    }

    /// The data-parallel step outside deterministic mode: this rank's share of the batch, its
    /// gradients summed over the world in buckets ([`Trainer::reduce_in_buckets`]).
    fn bucketed_step(
        &mut self,
        arc: &Arc<dyn Communicator>,
        g: &Generation,
        rank: u32,
        t0: Instant,
    ) -> Result<f64, CommError> {
        let comm = arc.as_ref();
        let world = comm.world();
        self.zero_grads();
        if world > 1 && crate::faults::oversized_frame_now(rank, self.step) {
            tracing::warn!(
                step = self.step,
                "fault injection: announcing an oversized frame to the next rank"
            );
            comm.inject_oversized_frame((rank + 1) % world)?;
        }
        if self.overlaps(g, world) {
            return self.overlapped_step(arc, g, rank, t0);
        }
        // (outside deterministic mode a rank's step is one part: its share of the batch)
        let parts = self.step_parts(comm, g, rank);
        let l = self.accumulate(&parts[0].micro);
        self.computed_for(rank, t0);
        let (grads, riders) = self.reduce_in_buckets(comm, l, g.number)?;
        // one device→host read of the three scalars that rode along
        let tail = Vec::<f32>::try_from(riders.to_device(Device::Cpu))
            .unwrap_or_else(|_| vec![f32::NAN, 0.0, 0.0]);
        self.flags = (tail[1] > 0.0, tail[2] > 0.0);
        self.apply_step(arc, g, rank, &grads, tail[0] as f64)?;
        Ok(tail[0] as f64)
    }

    /// The rate the last applied step ran at (none before the first).
    pub(crate) fn last_lr(&self) -> Option<f64> {
        self.step.checked_sub(1).map(|s| self.spec.lr_plan().at(s))
    }

    /// Clip this rank's own gradients `grads` to `max_grad_norm` by their own norm, when the
    /// job sets one, and keep the norm for the reports: a DiLoCo replica's inner step and an
    /// async worker's push, where one rank is the whole replica (no shard, stage or tensor
    /// rank to count with).
    pub(crate) fn clip_own(&mut self, grads: &[Tensor]) {
        if let Some(max) = self.spec.max_grad_norm {
            let norm = norm::sum_squares(grads).sqrt();
            norm::clip_to(grads, norm, max);
            self.grad_norm = Some(norm);
        }
    }

    /// The optimizer's step with the summed gradients, recorded in the ledger; clipped first
    /// to `max_grad_norm` when the job sets one. A sharded rank steps its rows and the shard
    /// group gathers them ([`Trainer::sharded_update`]).
    fn apply_step(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        rank: u32,
        grads: &[Tensor],
        loss: f64,
    ) -> Result<(), CommError> {
        if let Some(max) = self.spec.max_grad_norm {
            // every parameter whole here: every piece is this rank's
            let all: Vec<usize> = (0..grads.len()).collect();
            let norm = norm::row_norm(&self.norm_row(g, &all, grads, |_, _| true));
            norm::clip_to(grads, norm, max);
            self.grad_norm = Some(norm);
        }
        let lr = self.spec.lr_plan().at(self.step);
        if self.shard_held.0 > 1 {
            self.sharded_update(comm, g, grads, lr, false)?;
        } else {
            self.opt.step(&self.params, grads, lr, self.step);
        }
        ledger_line(
            &mut self.ledger,
            serde_json::json!({"g": g.number, "s": self.step, "r": rank, "applied": true, "lr": lr, "loss": loss}),
        );
        self.step += 1;
        Ok(())
    }

    /// ZeRO-1's update, bucket by bucket (whole parameters, about `bucket_mb` of them): this
    /// rank steps its rows of each parameter (the rows its optimizer state holds) on copies,
    /// the shard group all-gathers the bucket's updated rows (padded to the longest place's),
    /// then the bucket's parameters and this rank's state are written. Elementwise, so the
    /// bits equal the unsharded update's; what the step holds beyond the state is a bucket
    /// times the shard group. A gather that fails before anything was written leaves the rank
    /// at the step before; after, its parameters are part old and part new, so it stops
    /// offering its state (`held` empty): the agreement takes it from the others, or from the
    /// checkpoint.
    pub(super) fn sharded_update(
        &mut self,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
        grads: &[Tensor],
        lr: f64,
        rows_given: bool,
    ) -> Result<(), CommError> {
        let (s, place) = self.shard_held;
        // the local tensors' shapes: a tensor slice's under tensor groups, empty for another
        // stage's parameter (no rows, nothing to step)
        let shapes: Vec<Vec<i64>> = self.params.iter().map(|p| p.size()).collect();
        let rows = |i: usize, k: u32| {
            let r = split_range(shapes[i][0] as u64, s, k);
            (r.start as i64, (r.end - r.start) as i64)
        };
        let row_numel = |i: usize| shapes[i][1..].iter().product::<i64>();
        let grp = self.shard_group(comm, g)?;
        let step = self.step;
        let kind = self.params[0].kind();
        let cap = (i64::from(self.spec.bucket_mb.unwrap_or(25)) << 20) / 4;
        let per = self.opt.per();
        let mut written = false;
        for b in buckets(shapes.iter().map(|sh| sh.iter().product::<i64>()), cap) {
            let size = |k: u32| -> i64 { b.clone().map(|i| rows(i, k).1 * row_numel(i)).sum() };
            let longest = (0..s).map(size).max().unwrap_or(0);
            if longest == 0 {
                continue;
            }
            let mut updated = Vec::new();
            let mut states = Vec::new();
            for i in b.clone() {
                let (at, n) = rows(i, place);
                if n == 0 {
                    continue;
                }
                let p = tch::no_grad(|| self.params[i].detach().narrow(0, at, n).copy());
                let mut st: Vec<Tensor> = self.opt.state_of(i).iter().map(|t| t.copy()).collect();
                // (ZeRO-2 gives this rank's rows of the summed gradient alone)
                let gr = if rows_given {
                    grads[i].shallow_clone()
                } else {
                    grads[i].narrow(0, at, n)
                };
                crate::optim::apply(
                    &self.opt.kind,
                    self.opt.decays(i),
                    &mut st,
                    &p,
                    &gr,
                    lr,
                    step,
                );
                updated.push(p.reshape([-1]));
                states.push((i, st));
            }
            let pad = longest - size(place);
            if pad > 0 || updated.is_empty() {
                updated.push(Tensor::zeros([pad], (kind, self.dev)));
            }
            let mine = Tensor::cat(&updated, 0);
            drop(updated);
            let all: Result<Vec<Tensor>, CommError> = match &grp {
                None => comm.all_gather(&comm.place(&mine)).map(|t| {
                    let t = t.into_tensor();
                    (0..s as i64).map(|k| t.get(k)).collect()
                }),
                Some(grp) => grp.all_gather(&mine),
            };
            let all = match all {
                Ok(a) => a,
                Err(e) => {
                    if written {
                        self.held = Vec::new();
                        tracing::warn!(step, error = %e, "the sharded update's gather failed part way: this rank's parameters are mixed, it offers no state to the agreement");
                    }
                    return Err(e);
                }
            };
            written = true;
            tch::no_grad(|| {
                for (k, flat) in all.iter().enumerate() {
                    let mut off = 0;
                    for i in b.clone() {
                        let (at, n) = rows(i, k as u32);
                        let len = n * row_numel(i);
                        if len == 0 {
                            continue;
                        }
                        let shape: Vec<i64> = std::iter::once(n)
                            .chain(shapes[i][1..].iter().copied())
                            .collect();
                        let src = flat.narrow(0, off, len).view(shape.as_slice());
                        self.params[i].detach().narrow(0, at, n).copy_(&src);
                        off += len;
                    }
                }
                for (i, st) in states {
                    for (j, t) in st.into_iter().enumerate() {
                        self.opt.state[per * i + j].copy_(&t);
                    }
                }
            });
        }
        Ok(())
    }
}

/// Consecutive ranges of items (of the given sizes, in bytes) of at most `cap` bytes each; an
/// item larger than `cap` is a bucket alone. Never empty: no items make one empty bucket.
pub(crate) fn buckets(sizes: impl Iterator<Item = i64>, cap: i64) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut acc, mut n) = (0usize, 0i64, 0usize);
    for (i, s) in sizes.enumerate() {
        if acc > 0 && acc + s > cap {
            out.push(start..i);
            start = i;
            acc = 0;
        }
        acc += s;
        n = i + 1;
    }
    out.push(start..n);
    out
}

impl Trainer {
    /// Whether `g` runs on NCCL on GPUs (the daemon's choice of `backend`, less the job's
    /// `comm` setting): no stages or tensor groups (their sender threads), no handover, not
    /// async (host messages), no mesh TLS. The TCP backend's strict mode checks NCCL's rules
    /// for these generations on CPU (the CPU's own paths too: the communication thread of
    /// [`Trainer::comm_thread`] is a second thread on the communicator, legal while the two
    /// never call at once).
    pub(crate) fn on_nccl_on_gpus(&self, g: &Generation) -> bool {
        g.layout.pipeline_parallel <= 1
            && g.layout.tensor_parallel <= 1
            && !g.handover
            && self.spec.sync != SyncMode::Async
            && self.mesh_tls.is_none()
    }
}

#[cfg(test)]
mod bucket_tests {
    use super::buckets;

    #[test]
    fn buckets_hold_whole_items_up_to_the_cap() {
        assert_eq!(buckets([10, 10, 10, 10].into_iter(), 25), vec![0..2, 2..4]);
        // an item past the cap is a bucket alone
        assert_eq!(buckets([5, 40, 5].into_iter(), 25), vec![0..1, 1..2, 2..3]);
        assert_eq!(buckets([25, 25].into_iter(), 25), vec![0..1, 1..2]);
        assert_eq!(buckets(std::iter::empty(), 25), vec![0..0]);
    }
}

//! Checkpoints of the elastic loop: save at step boundaries (copy into a host buffer, upload in
//! the background, rank 0 commits), and restore on a cold start (every member at step 0)
//! through the redistribution plan: each chunk read by one rank that needs it, then sent point
//! to point to the others that need it.
//!
//! Whether a step saves is decided collectively: two flags ride on each step's all-reduce (a
//! pending checkpoint request, a save still in flight), so every rank takes the same decision.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ductile_checkpoint::format::{Dtype, Manifest, TensorKind, TensorMeta};
use ductile_checkpoint::restore::{committed, fetch, fetch_in, load_manifest};
use ductile_checkpoint::save::{gather_and_commit, write_shard, CommitInput, ShardLayout};
use ductile_checkpoint::{plan, Bucket, UploadOptions};
use ductile_cluster::records::*;
use ductile_cluster::Store;
use ductile_comm::{CommError, Communicator};
use tch::{Kind, Tensor};

use super::driver::Mode;
use super::reshard::{region_of, state_view};
use super::Trainer;
use ductile_strategies::redistribute::{self, intersect, relative, Chunk, Part, Region};

/// The manifest's chunks as regions of the state tensors (in the manifest's order, which
/// `check_compatible` holds equal to the job's), with their names. The manifest was validated
/// when it was loaded (`Manifest::validate`: every chunk inside its tensor, with its bytes).
/// Tries of a checkpoint read whose store did not answer, before the attempt fails.
const STORE_TRIES: u32 = 3;

/// Whether a restore error is corruption (the commit is unusable) rather than a store that did
/// not answer (retried; never a reason to fall back).
fn is_corrupt(e: &ductile_checkpoint::restore::RestoreError) -> bool {
    use ductile_checkpoint::restore::RestoreError;
    match e {
        RestoreError::Corrupt { .. } => true,
        // the commit names an object the store does not hold: nothing retries that back
        RestoreError::Store(b) => b.is_not_found(),
    }
}

fn manifest_chunks(m: &Manifest) -> (Vec<Chunk>, Vec<plan::ChunkRef>) {
    let mut chunks = Vec::new();
    let mut refs = Vec::new();
    for (ti, (name, t)) in m.ordered().enumerate() {
        for (k, c) in t.chunks.iter().enumerate() {
            let region: Region = c
                .offsets
                .iter()
                .zip(&c.shape)
                .map(|(o, n)| *o..o + n)
                .collect();
            chunks.push(Chunk { tensor: ti, region });
            refs.push((name.clone(), k));
        }
    }
    (chunks, refs)
}

pub struct Ckpt {
    pub spec: CheckpointSpec,
    pub bucket: Bucket,
    metas: Vec<TensorMeta>,
    conditional: Arc<tokio::sync::OnceCell<bool>>,
    in_flight: Option<tokio::task::JoinHandle<()>>,
    pool: Arc<Mutex<Option<Vec<u8>>>>,
    /// CUDA jobs: the page-locked host buffer the state is staged into (pinned once, reused;
    /// the upload reads it in place, and the next save waits for that upload first).
    pinned: Option<Tensor>,
    /// CUDA jobs: how this rank's shard is staged, for the current (world, rank).
    plan: Option<StagePlan>,
    /// The newest checkpoint request seen in etcd (a planned drain).
    pub request: Arc<Mutex<Option<CheckpointRequest>>>,
    answered: Option<String>,
    /// The step of the last save this rank started.
    pub saved_step: Option<u64>,
    /// Pipeline generations: the ranks that hold each saved tensor (a stage writes its own
    /// layers); None: every rank holds everything.
    owners: Option<Vec<Vec<u32>>>,
}

impl Ckpt {
    pub fn new(
        spec: CheckpointSpec,
        names: &[String],
        opt: &crate::optim::Optimizer,
        shapes: &[Vec<i64>],
    ) -> anyhow::Result<Ckpt> {
        let bucket = Bucket::open(&spec.url)?;
        let meta = |name: String, shape: &[i64], kind| TensorMeta {
            name,
            dtype: Dtype::F32,
            shape: shape.iter().map(|d| *d as u64).collect(),
            kind,
        };
        let mut metas: Vec<TensorMeta> = names
            .iter()
            .zip(shapes)
            .map(|(n, s)| meta(n.clone(), s, TensorKind::Parameter))
            .collect();
        let per = opt.state.len() / shapes.len().max(1);
        let suffix: &[&str] = match opt.kind {
            crate::optim::Kind::Sgd(_) => &["momentum_buffer"],
            crate::optim::Kind::AdamW(_) => &["exp_avg", "exp_avg_sq"],
        };
        // (a state tensor has its parameter's shape; a sharded job's is not allocated yet)
        for i in 0..opt.state.len() {
            let name = format!("optimizer.{}.{}", names[i / per], suffix[i % per]);
            metas.push(meta(name, &shapes[i / per], TensorKind::OptimizerState));
        }
        Ok(Ckpt {
            spec,
            bucket,
            metas,
            conditional: Arc::new(tokio::sync::OnceCell::new()),
            in_flight: None,
            pool: Arc::new(Mutex::new(None)),
            pinned: None,
            plan: None,
            request: Arc::new(Mutex::new(None)),
            answered: None,
            saved_step: None,
            owners: None,
        })
    }

    /// Name the optimizer-state tensors `{prefix}.{param}.{state}` (a DiLoCo job saves its
    /// outer optimizer's state as `outer_optimizer.*`).
    pub fn state_prefix(&mut self, prefix: &str) {
        for m in &mut self.metas {
            if m.kind == TensorKind::OptimizerState {
                if let Some(rest) = m.name.strip_prefix("optimizer.") {
                    m.name = format!("{prefix}.{rest}");
                }
            }
        }
    }

    /// The request generation `generation` should answer, if it has not yet. A request names
    /// the generation whose re-formation waits for it: a later generation (newcomers included)
    /// does not answer an old one.
    fn open_request(&self, generation: u64) -> Option<CheckpointRequest> {
        let req = self.request.lock().unwrap().clone()?;
        (req.generation == generation && Some(&req.id) != self.answered.as_ref()).then_some(req)
    }

    /// This rank's flags for the step's all-reduce: (request pending, save in flight).
    pub fn flags(&self, generation: u64) -> (f32, f32) {
        let pending = self.open_request(generation).is_some();
        let busy = self.in_flight.as_ref().is_some_and(|h| !h.is_finished());
        (pending as u8 as f32, busy as u8 as f32)
    }

    /// Wait for a save in flight (before the worker exits).
    pub fn finish(&mut self, rt: &tokio::runtime::Handle) {
        if let Some(h) = self.in_flight.take() {
            let _ = rt.block_on(h);
        }
    }
}

/// The rows of `t` that placement `p` puts in this shard.
fn part_of(t: &Tensor, p: &ductile_checkpoint::format::Placed) -> Tensor {
    if t.dim() == 0 {
        t.shallow_clone()
    } else {
        t.narrow(0, p.row as i64, p.rows as i64)
    }
}

/// A pinned host buffer's bytes, kept alive by the upload that reads them.
struct PinnedBytes {
    t: Tensor,
    len: usize,
}

impl AsRef<[u8]> for PinnedBytes {
    fn as_ref(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.t.data_ptr() as *const u8, self.len) }
    }
}

/// Bytes gathered on the device per device→host copy when staging a CUDA shard.
pub const STAGE_CHUNK: u64 = 64 << 20;

/// How one rank's shard is staged: built once per (world, rank) and reused by every save, since
/// the state tensors keep their storage (every update is in place), so their byte views stay
/// valid. Parts that follow each other in the shard are gathered on the device (their byte views
/// concatenated, at most `chunk` bytes a run) and copied down in one go: a handful of
/// device→host copies instead of one per tensor.
pub struct StagePlan {
    pub layout: ShardLayout,
    /// (first byte, end byte, the byte views to concatenate) per run of device parts.
    runs: Vec<(u64, u64, Vec<Tensor>)>,
    /// Host parts, copied directly: (first byte, end byte, part).
    host: Vec<(u64, u64, Tensor)>,
    /// Every device part was a view of its tensor (contiguous): the plan sees later updates
    /// and can be reused; otherwise it holds copies and is built anew for each save.
    pub reusable: bool,
}

impl StagePlan {
    /// `gather_all` gathers host parts too (the tests check the device path that way on
    /// machines without a GPU).
    pub fn new(layout: ShardLayout, tensors: &[Tensor], gather_all: bool, chunk: u64) -> StagePlan {
        let parts = layout
            .placed
            .iter()
            .map(|p| part_of(&tensors[p.tensor], p))
            .collect();
        StagePlan::from_parts(layout, parts, gather_all, chunk)
    }

    /// The plan when the caller has each placed chunk's data already (`parts[i]` for
    /// `layout.placed[i]`, of its rows).
    pub fn from_parts(
        layout: ShardLayout,
        parts: Vec<Tensor>,
        gather_all: bool,
        chunk: u64,
    ) -> StagePlan {
        let (mut runs, mut host) = (Vec::new(), Vec::new());
        let mut reusable = true;
        let mut cur: Option<(u64, u64, Vec<Tensor>)> = None;
        for (p, part) in layout.placed.iter().zip(parts) {
            if part.device() == tch::Device::Cpu && !gather_all {
                host.push((p.start, p.end, part));
                continue;
            }
            let fits = cur.as_ref().is_some_and(|(from, to, _)| {
                p.start == *to && to - from + (p.end - p.start) <= chunk
            });
            if !fits {
                runs.extend(cur.take());
                cur = Some((p.start, p.start, Vec::new()));
            }
            let run = cur.as_mut().unwrap();
            run.1 = p.end;
            reusable &= part.is_contiguous();
            run.2
                .push(part.contiguous().view([-1]).view_dtype(Kind::Uint8));
        }
        runs.extend(cur);
        StagePlan {
            layout,
            runs,
            host,
            reusable,
        }
    }

    /// Copy the host parts into `buf` (the shard's bytes; the header is the caller's).
    pub fn write_host(&self, buf: &mut [u8]) {
        for (from, to, part) in &self.host {
            part.copy_data_u8(&mut buf[*from as usize..*to as usize], part.numel());
        }
    }

    /// Write the shard (header and parts) into `stage`, a host u8 tensor of at least the
    /// shard's size.
    pub fn write(&self, stage: &Tensor) {
        let size = self.layout.size as usize;
        let buf = unsafe { std::slice::from_raw_parts_mut(stage.data_ptr() as *mut u8, size) };
        buf[..self.layout.header.len()].copy_from_slice(&self.layout.header);
        self.write_host(buf);
        for (from, to, views) in &self.runs {
            let src = Tensor::cat(views.as_slice(), 0);
            let mut dst = stage.narrow(0, *from as i64, (to - from) as i64);
            dst.copy_(&src);
        }
    }
}

/// Stage the shard of a CUDA job into one pinned buffer (pinned once and reused) and hand the
/// upload its bytes in place. The stall is one gather on the device and one device→host copy
/// per run.
pub fn pinned_stage(slot: &mut Option<Tensor>, plan: &StagePlan, index: usize) -> Bytes {
    let size = plan.layout.size as i64;
    let stage = match slot {
        Some(t) if t.numel() as i64 >= size => t.shallow_clone(),
        _ => {
            let t = ductile_comm::staging::pinned_empty(
                size.max(1),
                Kind::Uint8,
                tch::Device::Cuda(index),
            );
            *slot = Some(t.shallow_clone());
            t
        }
    };
    plan.write(&stage);
    tch::Cuda::synchronize(index as i64);
    Bytes::from_owner(PinnedBytes {
        t: stage,
        len: size as usize,
    })
}

async fn bump_stats(store: &Store, job: &str, f: impl FnOnce(&mut CheckpointStats)) {
    let key = store.keys.checkpoint_stats(job);
    let mut s: CheckpointStats = store
        .get_json(&key, "checkpoint stats")
        .await
        .ok()
        .flatten()
        .map(|(s, _)| s)
        .unwrap_or_default();
    f(&mut s);
    let _ = store.put_json(&key, &s, None).await;
}

pub fn kind_of(d: Dtype) -> Kind {
    match d {
        Dtype::F64 => Kind::Double,
        Dtype::F32 => Kind::Float,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::U8 => Kind::Uint8,
    }
}

impl Trainer {
    pub(super) fn state_tensors(&self) -> Vec<Tensor> {
        self.tensors()
            .into_iter()
            .map(|t| t.shallow_clone())
            .collect()
    }

    /// Who writes what in `g`'s checkpoints: in a pipeline generation each tensor (a parameter
    /// or its optimizer state) is written by the replicas of the stage holding its unit.
    pub(super) fn set_owners(&mut self, g: &Generation) {
        let units = self.units() as u32;
        let params = self.params.len();
        let Some(ck) = &mut self.ckpt else { return };
        ck.plan = None;
        if g.stage_boundaries.len() < 2 {
            ck.owners = None;
            return;
        }
        let per = self.opt.state.len() / params.max(1);
        let (p, dp) = (g.layout.pipeline_parallel, g.layout.data_parallel);
        let of_param = |i: usize| -> Vec<u32> {
            let stage = g.stage_of(self.param_unit[i] as u32, units);
            (0..dp).map(|d| d * p + stage).collect()
        };
        let mut owners: Vec<Vec<u32>> = (0..params).map(of_param).collect();
        for j in 0..params * per {
            owners.push(of_param(j / per));
        }
        ck.owners = Some(owners);
    }

    /// What resumes the run exactly, besides the tensors (`mode` adds its own under its key:
    /// `diloco`, `async`; the other is null).
    fn extra_state(&self, g: &Generation, mode: &dyn Mode) -> serde_json::Value {
        let b = self.spec.global_batch as u64;
        // the samples training draws from (an eval_fraction's tail is not among them)
        let n = self.train_samples;
        let pos = self.step * b;
        let mut x = serde_json::json!({
            "step": self.step,
            "data_cursor": {
                "next_position": pos,
                "epoch": pos / n.max(1),
                "position_in_epoch": pos % n.max(1),
                "global_batch": b,
                "dataset": self.spec.dataset,
                "dataset_samples": n,
                "order": if n > crate::data::STORED_ORDER_MAX {
                    "sample(p) = feistel(dataset_samples, seed, p / dataset_samples, p % dataset_samples)"
                } else {
                    "sample(p) = permutation(seed, p / dataset_samples)[p % dataset_samples]"
                },
            },
            "rng": {
                "seed": self.spec.seed,
                "note": "the models have no stochastic layers; the data order derives from (seed, epoch)",
            },
            "optimizer": {
                "name": self.spec.optimizer.name,
                "lr": self.spec.lr,
                "max_steps": self.spec.max_steps,
            },
            // what the rate of every step and the update are a function of, compared at restore
            "recipe": self.spec.recipe(),
            "model": self.spec.model,
            "model_config": self.spec.model_config,
            "deterministic": self.spec.deterministic,
            "logical_shards": self.spec.logical_shards,
            "world_size": g.world_size,
            "layout": g.layout,
            "diloco": null,
            "async": null,
        });
        if let Some((key, value)) = mode.extra(self, g) {
            x[key] = value;
        }
        x
    }

    /// At a commit point of `mode` (step `self.step` completed): save if a checkpoint is due
    /// there or the collective flags ask for one (`pending`), unless one is still uploading
    /// (`busy`).
    pub(super) fn maybe_save(
        &mut self,
        g: &Generation,
        rank: u32,
        (pending, busy): (bool, bool),
        mode: &dyn Mode,
    ) {
        let world = g.world_size;
        let Some(ck) = &self.ckpt else { return };
        let due = mode.save_due(self, ck.spec.interval);
        if !(due || pending) {
            return;
        }
        if busy {
            if due && rank == 0 {
                println!(
                    "checkpoint at step {} skipped: the previous one is still uploading",
                    self.step
                );
                let (store, job) = (self.store.clone(), self.env.job.clone());
                self.rt
                    .spawn(async move { bump_stats(&store, &job, |s| s.skipped_total += 1).await });
            }
            return;
        }
        if let tch::Device::Cuda(index) = self.dev {
            // the step's kernels (the optimizer's) are still queued: the next step waits for
            // them anyway, so the stall counts from when they are done
            tch::Cuda::synchronize(index as i64);
        }
        let t0 = Instant::now();
        let ck = self.ckpt.as_mut().unwrap();
        // a rank that contributed no flag (no logical shard this step) may still be uploading
        if let Some(h) = ck.in_flight.take() {
            let _ = self.rt.block_on(h);
        }
        let tensors = self.state_tensors();
        let ck = self.ckpt.as_mut().unwrap();
        // the plan is kept while the world and rank stay (the state is updated in place)
        let same = |p: &StagePlan| p.reusable && (p.layout.world, p.layout.rank) == (world, rank);
        let sliced = self.tp_held.0 > 1 || self.shard_held.0 > 1;
        if !sliced && !ck.plan.as_ref().is_some_and(same) {
            let layout = match &ck.owners {
                Some(o) => ShardLayout::by_owner(&ck.metas, o, world, rank),
                None => ShardLayout::new(&ck.metas, world, rank),
            };
            ck.plan = Some(StagePlan::new(layout, &tensors, false, STAGE_CHUNK));
        }
        if sliced {
            // tensor groups and stages: each member of replica 0 writes row ranges of the
            // logical tensors (of shard group 0, its rows of the optimizer state); shard groups
            // of data-parallel ranks: each member of group 0 its rows
            let parts = match self.tp_held.0 > 1 || g.layout.pipeline_parallel > 1 {
                true => self.tp_save_parts(g, rank),
                false => Ok(self.shard_save_parts(g, rank)),
            };
            let parts = match parts {
                Ok(p) => p,
                Err(e) => {
                    eprintln!(
                        "checkpoint step {}: rank {rank}: tensor slices not gathered, no save: {e}",
                        self.step
                    );
                    return;
                }
            };
            let ck = self.ckpt.as_mut().unwrap();
            let chunks = parts.iter().map(|(c, _)| *c).collect();
            let layout = ShardLayout::with_chunks(&ck.metas, world, rank, chunks);
            let mut plan = StagePlan::from_parts(
                layout,
                parts.into_iter().map(|(_, t)| t).collect(),
                false,
                STAGE_CHUNK,
            );
            // the slices are gathered anew for every save
            plan.reusable = false;
            ck.plan = Some(plan);
        }
        let ck = self.ckpt.as_mut().unwrap();
        let plan = ck.plan.as_ref().unwrap();
        let data = if let tch::Device::Cuda(index) = self.dev {
            pinned_stage(&mut ck.pinned, plan, index)
        } else {
            let mut buf = ck.pool.lock().unwrap().take().unwrap_or_default();
            plan.layout.prepare(&mut buf);
            plan.write_host(&mut buf);
            Bytes::from(buf)
        };
        let layout = plan.layout.clone();
        let stall_ms = t0.elapsed().as_secs_f64() * 1e3;
        let extra = self.extra_state(g, mode);
        let ck = self.ckpt.as_mut().unwrap();
        let mut request = if pending {
            ck.open_request(g.number).map(|r| r.id)
        } else {
            None
        };
        if pending && request.is_none() {
            // another rank saw the request first: read it, so that rank 0 records it in the
            // commit and this rank does not answer it a second time
            let key = self.store.keys.checkpoint_request(&self.env.job);
            let got = self.rt.block_on(
                self.store
                    .get_json::<CheckpointRequest>(&key, "checkpoint request"),
            );
            request = got
                .ok()
                .flatten()
                .filter(|(r, _)| r.generation == g.number)
                .map(|(r, _)| r.id);
        }
        if pending {
            ck.answered = request.clone();
        }
        let (store, bucket, job) = (self.store.clone(), ck.bucket.clone(), self.env.job.clone());
        let (metas, spec, conditional, pool) = (
            ck.metas.clone(),
            ck.spec.clone(),
            ck.conditional.clone(),
            ck.pool.clone(),
        );
        let (step, gnum, glayout) = (self.step, g.number, g.layout);
        let opts = UploadOptions {
            part_size: (spec.part_size_mib << 20) as usize,
            concurrency: spec.upload_concurrency as usize,
            ..UploadOptions::default()
        };
        tracing::info!(
            step,
            rank,
            bytes = layout.size,
            stall_ms,
            "checkpoint: state copied, uploading"
        );
        ck.saved_step = Some(step);
        ck.in_flight = Some(self.rt.spawn(async move {
            let t0 = Instant::now();
            // a directory of the same step and generation that another job committed (one
            // whose run this job carried on) is never written over: this save is skipped
            let owner = ductile_checkpoint::retention::dir_owner(&bucket, step, gnum).await;
            let r = match owner {
                Ok(Some(o)) if o != job => Err(format!("{} already holds job {o:?}'s commit of step {step}, generation {gnum}: not written over", ductile_checkpoint::format::attempt_dir(step, gnum))),
                Err(e) => Err(format!("cannot tell whose {} is: {e}", ductile_checkpoint::format::attempt_dir(step, gnum))),
                _ => write_shard(&store, &bucket, &job, step, gnum, &metas, &layout, data.clone(), opts).await.map_err(|e| e.to_string()),
            };
            if let Ok(b) = data.try_into_mut() {
                *pool.lock().unwrap() = Some(b.into());
            }
            if let Err(e) = r {
                eprintln!("checkpoint step {step}: rank {rank}: shard upload failed, no commit: {e}");
                // rank 0 abandons the attempt at once instead of waiting for this shard
                ductile_checkpoint::save::report_failure(&store, &job, step, gnum, rank, &e.to_string()).await;
                bump_stats(&store, &job, |s| s.failed_total += 1).await;
                return;
            }
            if rank != 0 {
                return;
            }
            let cond = match conditional.get_or_try_init(|| bucket.probe_conditional_create()).await {
                Ok(c) => {
                    if !*c {
                        tracing::warn!(url = %bucket.url, "this store does not enforce conditional creates: commit records are plain puts (the etcd transaction is the fence)");
                    }
                    *c
                }
                Err(_) => false,
            };
            let input = CommitInput {
                job: &job,
                step,
                generation: gnum,
                world,
                layout: glayout,
                tensors: &metas,
                extra,
                conditional_create: cond,
                request,
                wait: Duration::from_secs(600),
            };
            match gather_and_commit(&store, &bucket, input).await {
                Ok(rec) => {
                    let secs = t0.elapsed().as_secs_f64();
                    println!(
                        "checkpoint step {step} committed: {} bytes from {world} writers, upload {secs:.2} s, stall {stall_ms:.1} ms",
                        rec.bytes
                    );
                    bump_stats(&store, &job, |s| {
                        s.last_stall_ms = stall_ms;
                        s.last_upload_seconds = secs;
                        s.last_bytes = rec.bytes;
                        s.last_step = step;
                        s.committed_total += 1;
                    })
                    .await;
                    let ttl = Duration::from_secs(spec.attempt_ttl_s);
                    match ductile_checkpoint::retention::retain(&bucket, spec.keep as usize, ttl, Some(&rec), Some(&job)).await {
                        Ok(r) if !r.deleted_commits.is_empty() || !r.deleted_attempts.is_empty() => {
                            tracing::info!(deleted = ?r.deleted_commits, attempts = ?r.deleted_attempts, aborted_uploads = r.aborted_uploads, "checkpoint retention")
                        }
                        Ok(_) => {}
                        Err(e) => tracing::warn!(error = %e, "checkpoint retention failed; will retry after the next commit"),
                    }
                }
                Err(e) => {
                    eprintln!("checkpoint step {step}: not committed: {e}");
                    bump_stats(&store, &job, |s| s.failed_total += 1).await;
                }
            }
        }));
    }

    /// Cold start: every member is at step 0. Restore the newest committed checkpoint that
    /// verifies, falling back to older ones loudly; none → start from the seed.
    /// The job's latest-commit record (etcd) and the bucket's commits, with the step a chosen
    /// `restore_step` pins; each read retried with backoff (about 8 s in all) before its error
    /// is the answer.
    fn list_commits(
        &self,
        bucket: &ductile_checkpoint::Bucket,
    ) -> Result<(Option<u64>, Vec<CheckpointRecord>), String> {
        let ck = self.ckpt.as_ref().unwrap();
        let key = self.store.keys.checkpoint(&self.env.job);
        let mut delay = Duration::from_millis(250);
        let mut tries = 0;
        loop {
            tries += 1;
            let got = self.rt.block_on(async {
                let latest = self
                    .store
                    .get_json::<CheckpointRecord>(&key, "checkpoint")
                    .await
                    .map_err(|e| format!("reading {key} from etcd: {e}"))?
                    .map(|(r, _)| r);
                let c = committed(bucket, latest.as_ref())
                    .await
                    .map_err(|e| format!("listing {}: {e}", bucket.url))?;
                // a chosen step applies until this submission commits (submitting it clears
                // the latest-commit record)
                Ok::<_, String>((ck.spec.restore_step.filter(|_| latest.is_none()), c))
            });
            match got {
                Ok(v) => return Ok(v),
                Err(e) if tries >= 6 => return Err(format!("{e} (after {tries} tries)")),
                Err(e) => {
                    eprintln!("checkpoint: {e}; retrying in {delay:?}");
                    std::thread::sleep(delay);
                    delay *= 2;
                }
            }
        }
    }

    /// A cold start in which every member needs the whole state (DiLoCo's, async's): the
    /// latest checkpoint's every part, on every member.
    pub(super) fn restore_whole(
        &mut self,
        arc: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> anyhow::Result<Result<(), CommError>> {
        let need = self.whole_need(g);
        self.restore(arc, &need)
    }

    /// Every member's need of the whole model (the replicas of DiLoCo and async).
    fn whole_need(&self, g: &Generation) -> Vec<Part> {
        let units = self.units();
        g.members
            .iter()
            .flat_map(|m| self.parts_of(m.rank, &[0..units]))
            .collect()
    }

    /// Restore what `need` says each rank needs (whole tensors or regions of them) through the
    /// redistribution plan: each rank reads its chunks, then the ranks exchange what the
    /// others need of them.
    pub(super) fn restore(
        &mut self,
        arc: &Arc<dyn Communicator>,
        need: &[Part],
    ) -> anyhow::Result<Result<(), CommError>> {
        let comm: &dyn Communicator = arc.as_ref();
        let t0 = Instant::now();
        let rank = comm.rank();
        let world = comm.world();
        let ck = self.ckpt.as_ref().unwrap();
        let bucket = ck.bucket.clone();
        // rank 0 lists the commits (and whether a chosen step pins the restore); everyone then
        // walks the same list. "No checkpoint" is only ever an answer, never an error: a failed
        // read of etcd or of the store is retried (bounded), then fails this attempt on every
        // rank with the error (the worker exits; its agent restarts it within the job's budget)
        let mut list = Vec::new();
        if rank == 0 {
            list = serde_json::to_vec(&self.list_commits(&bucket))?;
        }
        if let Err(e) = comm.host().broadcast_vec(&mut list, 0) {
            return Ok(Err(e));
        }
        let listed: Result<(Option<u64>, Vec<CheckpointRecord>), String> =
            serde_json::from_slice(&list)
                .map_err(|e| anyhow::anyhow!("undecodable commit list from rank 0: {e}"))?;
        let (pinned, mut candidates) = listed.map_err(|e| {
            anyhow::anyhow!(
                "checkpoint: cannot tell which checkpoints {} holds: {e}; it does not fall back to the seed",
                bucket.url
            )
        })?;
        // another job's commits at this location (it used the location and has finished):
        // this job would neither restore them nor may it write over their directories (the
        // same step and generation name the same objects), so it does not start here
        let adopted = &ck.spec.resume_from;
        let foreign: Vec<&CheckpointRecord> = candidates
            .iter()
            .filter(|c| {
                c.job
                    .as_deref()
                    .is_some_and(|j| j != self.env.job && !adopted.iter().any(|a| a == j))
            })
            .collect();
        if let Some(f) = foreign.first() {
            let owner = f.job.clone().unwrap_or_default();
            let steps: Vec<u64> = foreign.iter().map(|c| c.step).collect();
            anyhow::bail!(
                "checkpoint.url {} holds job {owner:?}'s checkpoints (steps {steps:?}): a job neither restores, overwrites nor deletes another job's checkpoints; give this job a checkpoint.url of its own, submit it as {owner:?} to resume them, or carry that run on with checkpoint.resume_from = [{owner:?}]",
                bucket.url
            );
        }
        // the commits a pinned restore leaves behind (superseded once it succeeds)
        let mut after = Vec::new();
        if let Some(n) = pinned {
            let steps: Vec<u64> = candidates.iter().map(|c| c.step).collect();
            // (this job's own later commits: another job's are never superseded)
            after = candidates
                .iter()
                .filter(|c| c.step > n && c.job.as_deref().is_none_or(|j| j == self.env.job))
                .cloned()
                .collect();
            candidates.retain(|c| c.step == n);
            if candidates.is_empty() {
                anyhow::bail!(
                    "checkpoint.restore_step = {n}: {} holds no committed checkpoint at step {n} (committed steps: {steps:?})",
                    bucket.url
                );
            }
            if rank == 0 {
                println!("restoring the chosen step {n} (checkpoint.restore_step)");
            }
        }
        if candidates.is_empty() {
            if rank == 0 {
                let from = if self.pretrained() {
                    "the model directory's weights"
                } else {
                    "the seed"
                };
                println!(
                    "no committed checkpoint at {}: starting from {from}",
                    bucket.url
                );
            }
            return Ok(Ok(()));
        }
        let elem = self.elem_sizes();
        for rec in &candidates {
            // every rank reads the manifest (small) and its chunks. Only corruption (a checksum,
            // parse or validation failure, or an object the commit names that the store does
            // not hold) makes the candidate unusable everywhere; a store that fails to answer
            // (unreachable, a 503, a timeout) is retried, then fails this attempt on every rank
            // without falling back: an older commit would roll the job back, and every save
            // would be refused until it passed the lost steps again
            let mut tries = 0u32;
            let (m, planned, got) = loop {
                let m = self.rt.block_on(load_manifest(&bucket, rec));
                if let Ok(m) = &m {
                    // the same manifest everywhere: every rank stops alike
                    self.check_compatible(m)?;
                }
                // the redistribution plan from the manifest's chunks to what each rank needs:
                // every chunk read once, by one of the ranks that need it
                let planned = m.as_ref().map_err(|e| e.to_string()).and_then(|m| {
                    let (chunks, refs) = manifest_chunks(m);
                    let p = redistribute::plan(&elem, &[], &chunks, need)
                        .map_err(|e| format!("the manifest does not cover the state: {e}"))?;
                    Ok((chunks, refs, p))
                });
                let got: Result<Vec<bytes::Bytes>, (bool, String)> = match (&m, &planned) {
                    (Ok(m), Ok((_, refs, p))) => {
                        let mine: Vec<plan::ChunkRef> = p
                            .reads_of(rank)
                            .into_iter()
                            .map(|c| refs[c].clone())
                            .collect();
                        self.rt
                            .block_on(fetch(&bucket, m, &mine, 8))
                            .map_err(|e| (is_corrupt(&e), e.to_string()))
                    }
                    (Err(e), _) => Err((is_corrupt(e), e.to_string())),
                    (Ok(_), Err(e)) => Err((true, e.clone())),
                };
                match &got {
                    Err((false, e)) if tries < STORE_TRIES => {
                        tries += 1;
                        eprintln!(
                            "checkpoint step {}: the store did not answer rank {rank} ({e}); try {tries} of {STORE_TRIES} again",
                            rec.step
                        );
                        std::thread::sleep(Duration::from_millis(500 << tries));
                    }
                    _ => break (m, planned, got),
                }
            };
            if let Err((_, e)) = &got {
                eprintln!("CHECKPOINT STEP {} FAILED on rank {rank}: {e}", rec.step);
            }
            // 1: read and verified; 0: corrupt; 2: the store did not answer
            let mine = match &got {
                Ok(_) => 1u8,
                Err((true, _)) => 0,
                Err((false, _)) => 2,
            };
            let states: Vec<u8> = match comm.host().all_gather_bytes(&[mine]) {
                Ok(rows) => rows
                    .iter()
                    .map(|r| r.first().copied().unwrap_or(0))
                    .collect(),
                Err(e) => return Ok(Err(e)),
            };
            let of = |v: u8| -> Vec<usize> {
                states
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| **s == v)
                    .map(|(i, _)| i)
                    .collect()
            };
            if !of(2).is_empty() {
                anyhow::bail!(
                    "checkpoint step {} (generation {}) at {}: ranks {:?} could not read it (the store did not answer, {STORE_TRIES} retries){}; not falling back to an older commit (that would roll the job back): this attempt fails, and the agent restarts the worker",
                    rec.step,
                    rec.generation,
                    bucket.url,
                    of(2),
                    match &got {
                        Err((false, e)) => format!(": {e}"),
                        _ => String::new(),
                    }
                );
            }
            if !of(0).is_empty() {
                eprintln!(
                    "checkpoint step {} (generation {}) is unusable (ranks {:?} failed to verify their chunks): FALLING BACK to the previous committed checkpoint",
                    rec.step, rec.generation, of(0)
                );
                continue;
            }
            let got = got.map_err(|(_, e)| e);
            let m = m.unwrap();
            let (chunks, _, p) = planned.expect("every rank's check passed");
            let read_bytes = p.read_bytes(rank, &chunks, &elem);
            match self.place(arc, &m, &chunks, &p, got.unwrap(), need) {
                Ok(b) => self.received = b as u64,
                Err(e) => return Ok(Err(e)),
            }
            tracing::info!(
                step = m.step,
                read_bytes,
                received_bytes = self.received,
                "restored this rank's share"
            );
            self.step = m.step;
            self.restored_extra = Some(m.extra.clone());
            // that step is committed already: a save due at it (a job restored at its last
            // step) would only write it again
            if let Some(ck) = &mut self.ckpt {
                ck.saved_step = Some(m.step);
            }
            let secs = t0.elapsed().as_secs_f64();
            if rank == 0 {
                println!(
                    "restored checkpoint step {} (generation {}, saved at world {}) at world {world} in {secs:.2} s ({} bytes)",
                    m.step,
                    m.generation,
                    m.world_size,
                    m.bytes()
                );
                let (store, job, step) = (self.store.clone(), self.env.job.clone(), m.step);
                self.rt.block_on(bump_stats(&store, &job, |s| {
                    s.last_restore_seconds = Some(secs);
                    s.last_restore_step = Some(step);
                }));
                if pinned.is_some() {
                    let why = format!(
                        "job {job} resumed from the chosen step {step} (checkpoint.restore_step)"
                    );
                    match self.rt.block_on(ductile_checkpoint::retention::supersede(
                        &bucket, &after, &why,
                    )) {
                        Ok(v) if v.is_empty() => {}
                        Ok(v) => println!(
                            "superseded the commits after step {step} (kept, not restored automatically): {v:?}"
                        ),
                        // harmless for this run: the latest-commit record now decides
                        Err(e) => eprintln!(
                            "could not mark the commits after step {step} superseded: {e}; a cold start on a fresh etcd could pick them"
                        ),
                    }
                }
            }
            return Ok(Ok(()));
        }
        if let Some(n) = pinned {
            anyhow::bail!(
                "the chosen checkpoint step {n} (checkpoint.restore_step) at {} failed to restore (see the errors above); not falling back to another step",
                bucket.url
            )
        }
        anyhow::bail!(
            "every committed checkpoint at {} failed to restore (see the errors above); refusing to start from the seed over them",
            bucket.url
        )
    }

    /// Put what this rank read (`got`, the chunks `p` has it read, in order) into its own
    /// tensors where it needs it, and serve the other ranks what they need of it (`p.moves`):
    /// bytes received.
    fn place(
        &mut self,
        arc: &Arc<dyn Communicator>,
        m: &Manifest,
        chunks: &[Chunk],
        p: &redistribute::Plan,
        got: Vec<bytes::Bytes>,
        need: &[Part],
    ) -> Result<usize, CommError> {
        let rank = arc.rank();
        let targets = self.state_tensors();
        let slices = self.slice_holdings();
        let mut read = std::collections::BTreeMap::new();
        let mine: Vec<&Part> = need.iter().filter(|n| n.rank == rank).collect();
        for (c, bytes) in p.reads_of(rank).into_iter().zip(got) {
            let chunk = &chunks[c];
            let shape: Vec<i64> = chunk
                .region
                .iter()
                .map(|r| (r.end - r.start) as i64)
                .collect();
            let kind = kind_of(m.tensors[&m.order[chunk.tensor]].dtype);
            // in the state's own kind (a model directory may hold bf16 weights)
            let src =
                Tensor::from_data_size(&bytes, &shape, kind).to_kind(targets[chunk.tensor].kind());
            for n in mine.iter().filter(|n| n.tensor == chunk.tensor) {
                if let Some(x) = intersect(&n.region, &chunk.region) {
                    tch::no_grad(|| {
                        state_view(&targets, slices.as_deref(), chunk.tensor, &x)
                            .copy_(&region_of(&src, &relative(&x, &chunk.region)));
                    });
                }
            }
            read.insert(c, (chunk.region.clone(), src));
        }
        self.exchange(arc, &p.moves, m.step, &read)
            .map(|got| got.bytes)
    }

    /// A cold start's state: the latest committed checkpoint's when the job has one, else
    /// (`model = "hf"`, `init = "pretrained"`) the model directory's weights, else the seed's
    /// (in place already). `need` is what each rank needs.
    pub(super) fn cold_start(
        &mut self,
        arc: &Arc<dyn Communicator>,
        need: &[Part],
    ) -> anyhow::Result<Result<(), CommError>> {
        if self.ckpt.is_some() {
            let r = self.restore(arc, need)?;
            if r.is_err() || self.step > 0 {
                return Ok(r);
            }
        }
        if self.pretrained() {
            return self.load_pretrained(arc, need);
        }
        Ok(Ok(()))
    }

    /// Whether a cold start with no committed checkpoint takes the model directory's weights
    /// (`model = "hf"`, `init = "pretrained"`).
    pub(super) fn pretrained(&self) -> bool {
        self.spec.model == ModelKind::Hf && self.spec.init == Init::Pretrained
    }

    /// [`Trainer::load_pretrained`] of the whole model on every member (DiLoCo's and async's
    /// replicas).
    pub(super) fn load_pretrained_whole(
        &mut self,
        arc: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> anyhow::Result<Result<(), CommError>> {
        let need = self.whole_need(g);
        self.load_pretrained(arc, &need)
    }

    /// Load the parameters from the model directory (`model_path`) by plan: every rank reads
    /// the weight files' headers, then only the chunks (row blocks) the redistribution plan
    /// gives it, of the tensors or slices some rank of its needs, each read once; the ranks
    /// exchange the rest. A missing tensor, a wrong shape, a cut or unreadable file fails the
    /// start on every rank, naming the file and the tensor; nothing half-loaded trains.
    pub(super) fn load_pretrained(
        &mut self,
        arc: &Arc<dyn Communicator>,
        need: &[Part],
    ) -> anyhow::Result<Result<(), CommError>> {
        let t0 = Instant::now();
        let comm: &dyn Communicator = arc.as_ref();
        let rank = comm.rank();
        let url = self.spec.model_path.clone().unwrap_or_default();
        let dir = crate::hf::open(&url)?;
        let n = self.params.len();
        let names: Vec<String> = self.model.params().into_iter().map(|(n, _)| n).collect();
        let wanted: Vec<(String, Vec<u64>)> = names
            .into_iter()
            .zip(&self.shapes)
            .map(|(n, s)| (n, s.iter().map(|d| *d as u64).collect()))
            .collect();
        let need: Vec<Part> = need.iter().filter(|p| p.tensor < n).cloned().collect();
        let elem = self.elem_sizes();
        let read = self.rt.block_on(async {
            let files = ductile_checkpoint::hf::tensors(&dir).await?;
            let m = ductile_checkpoint::hf::manifest(&dir.url, &files, &wanted)?;
            let (chunks, refs) = manifest_chunks(&m);
            let p = redistribute::plan(&elem, &[], &chunks, &need).map_err(|e| {
                anyhow::anyhow!("{url}: the weight files do not cover the model: {e}")
            })?;
            let mine: Vec<plan::ChunkRef> = p
                .reads_of(rank)
                .into_iter()
                .map(|c| refs[c].clone())
                .collect();
            let got = fetch_in(&dir, "", &m, &mine, 8, false)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            anyhow::Ok((m, chunks, p, got))
        });
        // every rank goes on only if every rank read its share
        let ok = read.is_ok() as u8;
        let states = match comm.host().all_gather_bytes(&[ok]) {
            Ok(rows) => rows,
            Err(e) => return Ok(Err(e)),
        };
        let failed: Vec<usize> = (0..states.len())
            .filter(|r| states[*r].first() != Some(&1))
            .collect();
        let (m, chunks, p, got) = match read {
            Err(e) => anyhow::bail!("loading the model's weights from {url}: {e:#}"),
            Ok(_) if !failed.is_empty() => anyhow::bail!(
                "loading the model's weights from {url}: ranks {failed:?} failed (their logs say why); nothing was trained"
            ),
            Ok(r) => r,
        };
        let read_bytes = p.read_bytes(rank, &chunks, &elem);
        let received = match self.place(arc, &m, &chunks, &p, got, &need) {
            Ok(b) => b,
            Err(e) => return Ok(Err(e)),
        };
        let held: u64 = need
            .iter()
            .filter(|p| p.rank == rank)
            .map(|p| redistribute::elements(&p.region) * elem[p.tensor])
            .sum();
        tracing::info!(
            read_bytes,
            received,
            held,
            "loaded this rank's share of the model"
        );
        println!(
            "rank {rank} loaded its share of {url} in {:.2} s: read {read_bytes} bytes, received {received}, holds {held}",
            t0.elapsed().as_secs_f64()
        );
        Ok(Ok(()))
    }

    /// The checkpoint holds this model's tensors, with the same shapes, and the same optimizer.
    fn check_compatible(&self, m: &Manifest) -> anyhow::Result<()> {
        let ck = self.ckpt.as_ref().unwrap();
        let want: Vec<(&str, &Vec<u64>)> = ck
            .metas
            .iter()
            .map(|t| (t.name.as_str(), &t.shape))
            .collect();
        let have: Vec<(&str, &Vec<u64>)> =
            m.ordered().map(|(n, t)| (n.as_str(), &t.shape)).collect();
        if want != have {
            let diff = want
                .iter()
                .zip(&have)
                .find(|(a, b)| a != b)
                .map(|(a, b)| {
                    format!(
                        "this job has {} {:?}, the checkpoint {} {:?}",
                        a.0, a.1, b.0, b.1
                    )
                })
                .unwrap_or_else(|| {
                    format!(
                        "this job has {} tensors, the checkpoint {}",
                        want.len(),
                        have.len()
                    )
                });
            anyhow::bail!(
                "checkpoint step {} at {} does not fit this job's model/optimizer ({diff}); change checkpoint.url or the [training] section",
                m.step,
                ck.bucket.url
            );
        }
        // the data cursor means something only for the same data, batch and order
        let x = &m.extra;
        for (field, have, want) in [
            (
                "dataset",
                &x["data_cursor"]["dataset"],
                serde_json::json!(self.spec.dataset),
            ),
            (
                "global_batch",
                &x["data_cursor"]["global_batch"],
                serde_json::json!(self.spec.global_batch),
            ),
            ("seed", &x["rng"]["seed"], serde_json::json!(self.spec.seed)),
        ] {
            if !have.is_null() && *have != want {
                anyhow::bail!(
                    "checkpoint step {} at {} was saved with training.{field} = {have}, this job has {want}: its data position would not resume this run; change checkpoint.url or training.{field}",
                    m.step,
                    ck.bucket.url
                );
            }
        }
        // the order is over the samples training draws from: the same number, or the cursor
        // lands elsewhere (a dataset rewritten in place, another eval_fraction)
        if let Some(n) = x["data_cursor"]["dataset_samples"].as_u64() {
            if n != self.train_samples {
                anyhow::bail!(
                    "checkpoint step {} at {} was saved drawing from {n} samples of the dataset, this job draws from {} (the dataset changed, or training.eval_fraction): its data position would not resume this run; change checkpoint.url, or the dataset or eval_fraction back",
                    m.step,
                    ck.bucket.url,
                    self.train_samples
                );
            }
        }
        // the rate of step S and the update are the recipe's: another recipe is another run
        if let Some(was) = x.get("recipe").filter(|v| !v.is_null()) {
            let differs = self.spec.recipe().differences(was);
            if !differs.is_empty() {
                if !ck.spec.allow_recipe_change {
                    anyhow::bail!(
                        "checkpoint step {} at {} was saved with another recipe ({}): resumed with this one, its steps would not run at the rates and with the updates of the run it continues; put the [training] keys back, or set checkpoint.allow_recipe_change = true to go on with the new recipe from step {}",
                        m.step,
                        ck.bucket.url,
                        differs.join("; "),
                        m.step
                    );
                }
                tracing::warn!(step = m.step, differs = %differs.join("; "), "restoring a checkpoint saved with another recipe (checkpoint.allow_recipe_change)");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gathered staging path (what CUDA saves take) lays out exactly the bytes of the plain
    /// host path, for several writers of a shard.
    #[test]
    fn gathered_staging_matches_the_plain_shard_bytes() {
        let _turn = crate::SEEDED.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(3);
        let tensors: Vec<Tensor> = [&[37i64, 5][..], &[11], &[], &[300, 4, 2], &[1]]
            .iter()
            .map(|s| Tensor::randn(*s, (Kind::Float, tch::Device::Cpu)))
            .collect();
        let metas: Vec<TensorMeta> = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| TensorMeta {
                name: format!("t{i}"),
                dtype: Dtype::F32,
                shape: t.size().iter().map(|d| *d as u64).collect(),
                kind: TensorKind::Parameter,
            })
            .collect();
        for world in [1u32, 3] {
            for rank in 0..world {
                let layout = ShardLayout::new(&metas, world, rank);
                let mut plain = Vec::new();
                layout.prepare(&mut plain);
                for p in &layout.placed {
                    let part = part_of(&tensors[p.tensor], p);
                    part.copy_data_u8(&mut plain[p.start as usize..p.end as usize], part.numel());
                }
                let stage =
                    Tensor::zeros([layout.size as i64 + 16], (Kind::Uint8, tch::Device::Cpu));
                StagePlan::new(layout.clone(), &tensors, true, 1 << 10).write(&stage);
                let mut got = vec![0u8; layout.size as usize];
                stage
                    .narrow(0, 0, layout.size as i64)
                    .copy_data_u8(&mut got, layout.size as usize);
                assert_eq!(got, plain, "world {world} rank {rank}");
            }
        }
    }
}

//! Communication overlapped with computation: a step's collectives run in submission order on
//! a thread of their own ([`CommQueue`]) while the step goes on computing, as DDP's reducer and
//! FSDP's streams do, or, where that thread would only take turns with the computation, each
//! at the point it is submitted. One queue and one order, so every rank calls the
//! communicator in the same sequence; the step makes no collective call of its own while the
//! queue lives.
//!
//! The data-parallel step outside deterministic mode ([`Trainer::overlapped_step`]), where the
//! node has a core to spare for it ([`Trainer::comm_thread`]), runs its last micro-batch's
//! backward unit by unit ([`crate::model::Model::backward_by_unit`]) and submits each bucket of
//! gradients (whole parameters, about `training.bucket_mb`, in the order the backward finishes
//! them) as soon as the last of its parameters has its gradient: the all-reduce of the head's
//! bucket runs while the blocks below it compute. Without a spare core the buckets follow the
//! whole backward ([`Trainer::reduce_in_buckets`]): a bucket reduced between two units'
//! backwards would make each rank wait for the slowest once per bucket instead of once per
//! step. Full sharding's gathers and reduce-scatters use the same queue on a thread
//! (`fsdp.rs`; under tensor groups, `fsdp_tp.rs`, where a core is spare).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use ductile_cluster::records::Generation;
use ductile_comm::{CommError, Communicator, ReduceOp};
use tch::{Device, Kind, Tensor};

use super::Trainer;

type Job = Box<dyn FnOnce() + Send>;

/// The generation whose overlapped buckets were last told in the log (once per generation).
static LOGGED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);

/// Collectives run in order on one thread (or at once, [`CommQueue::inline`]), each answered through its [`Ticket`]. After one
/// fails, the later ones are not run (they answer that they were not), so the first error is
/// the one the step reports. Dropping the queue waits for what was submitted (each collective
/// has the communicator's own bounds).
pub(crate) struct CommQueue {
    tx: Option<mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
    failed: Arc<AtomicBool>,
}

/// The answer of one submitted collective.
pub(crate) struct Ticket<T>(mpsc::Receiver<Result<T, CommError>>);

impl<T> Ticket<T> {
    /// Wait for the collective now and keep its result: a ticket already answered (the
    /// queue's thread is then free for a call of the step's own to the same peers).
    pub(crate) fn settle(self) -> Ticket<T> {
        let (tx, rx) = mpsc::channel();
        let _ = tx.send(self.wait());
        Ticket(rx)
    }

    /// Wait for the collective's result.
    pub(crate) fn wait(self) -> Result<T, CommError> {
        self.0.recv().unwrap_or_else(|_| {
            Err(CommError::Invalid {
                op: "overlapped collective",
                reason: "the communication thread ended without answering".into(),
            })
        })
    }
}

impl CommQueue {
    /// A queue on a thread of its own (`threaded`, [`Trainer::comm_thread`]), else one that
    /// runs each collective when it is submitted.
    pub(crate) fn for_step(threaded: bool) -> Result<CommQueue, CommError> {
        if threaded {
            CommQueue::new()
        } else {
            Ok(CommQueue::inline())
        }
    }

    /// A queue that runs each collective at once, on the caller's thread.
    pub(crate) fn inline() -> CommQueue {
        CommQueue {
            tx: None,
            thread: None,
            failed: Arc::new(AtomicBool::new(false)),
        }
    }

    pub(crate) fn new() -> Result<CommQueue, CommError> {
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("ductile-comm".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .map_err(|e| CommError::Invalid {
                op: "overlapped collective",
                reason: format!("cannot start the communication thread: {e}"),
            })?;
        Ok(CommQueue {
            tx: Some(tx),
            thread: Some(thread),
            failed: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Run `f` on the queue's thread after everything submitted before it.
    pub(crate) fn submit<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce() -> Result<T, CommError> + Send + 'static,
    ) -> Ticket<T> {
        let (rtx, rrx) = mpsc::channel();
        let failed = self.failed.clone();
        let job: Job = Box::new(move || {
            let r = if failed.load(Ordering::SeqCst) {
                Err(CommError::Invalid {
                    op,
                    reason: "not run: a collective before it in this step failed".into(),
                })
            } else {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
                    Err(CommError::Invalid {
                        op,
                        reason: "the communication thread panicked".into(),
                    })
                })
            };
            if r.is_err() {
                failed.store(true, Ordering::SeqCst);
            }
            let _ = rtx.send(r);
        });
        match &self.tx {
            // a send fails only when the thread is gone: the ticket's wait then says so
            Some(tx) => {
                let _ = tx.send(job);
            }
            None => job(),
        }
        Ticket(rrx)
    }
}

impl Drop for CommQueue {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One bucket of the overlapped step: parameters (indices), in the order the backward
/// finishes them, and the unit after whose backward the last of them is final.
#[derive(Debug, PartialEq)]
pub(crate) struct Bucket {
    pub(crate) params: Vec<usize>,
    pub(crate) after: usize,
}

/// The buckets of an overlapped step: parameters in the order their gradients become final
/// (by `done_at`, the last unit first; by index within a unit), cut greedily at `cap` bytes
/// of f32 (a parameter larger than `cap` alone: [`super::buckets`]; no parameters, one empty
/// bucket for the riders). The same on every rank: a function of the model's shapes only.
pub(crate) fn bucket_plan(
    numels: &[i64],
    done_at: impl Fn(usize) -> usize,
    cap: i64,
) -> Vec<Bucket> {
    let mut order: Vec<usize> = (0..numels.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(done_at(i)), i));
    super::buckets(order.iter().map(|&i| numels[i] * 4), cap)
        .into_iter()
        .map(|r| {
            let params = order[r].to_vec();
            Bucket {
                after: params.last().map_or(0, |&i| done_at(i)),
                params,
            }
        })
        .collect()
}

/// All-reduce (sum) `grads` through `buf` (at least their length plus `riders`'): packed,
/// reduced, and copied back in place; returns the summed riders, if any.
pub(super) fn reduce_bucket(
    comm: &dyn Communicator,
    buf: &Tensor,
    grads: &[Tensor],
    riders: Option<&Tensor>,
) -> Result<Option<Tensor>, CommError> {
    let mut parts: Vec<Tensor> = grads
        .iter()
        .map(|g| g.reshape([-1]).to_kind(Kind::Float))
        .collect();
    if let Some(r) = riders {
        parts.push(r.shallow_clone());
    }
    let n: i64 = parts.iter().map(|p| p.numel() as i64).sum();
    let view = buf.narrow(0, 0, n);
    let _ = Tensor::cat_out(&view, &parts, 0);
    drop(parts);
    let mut placed = comm.place(&view);
    comm.all_reduce(&mut placed, ReduceOp::Sum)?;
    let reduced = placed.into_tensor();
    let mut at = 0;
    for g in grads {
        let k = g.numel() as i64;
        let mut g = g.shallow_clone();
        g.copy_(&reduced.narrow(0, at, k).view(g.size().as_slice()));
        at += k;
    }
    Ok(riders.map(|r| reduced.narrow(0, at, r.numel() as i64).copy()))
}

impl Trainer {
    /// The data-parallel step's buckets ([`bucket_plan`] of this model at `bucket_mb`): the
    /// same on every rank, whichever schedule it takes.
    pub(super) fn bucket_plan(&self) -> Vec<Bucket> {
        let numels: Vec<i64> = self
            .shapes
            .iter()
            .map(|s| s.iter().product::<i64>())
            .collect();
        let cap = i64::from(self.spec.bucket_mb.unwrap_or(25)) << 20;
        if crate::faults::old_bucket_plan(&self.env.node) {
            // (fault injection) a build before the one-plan fix: parameters in index order
            return bucket_plan(&numels, |_| 0, cap);
        }
        bucket_plan(&numels, |i| self.done_at(i), cap)
    }

    /// A digest of what the ranks' collectives sum by position, beyond the step: each
    /// parameter's name, shape and units, and the data-parallel step's buckets (which
    /// parameters each sums, in order). Ranks whose builds cut the model or its buckets
    /// differently would add one rank's tensor to another's without an error (a sum of two
    /// lengths that match is still a sum), so the agreement compares it. 48 bits: exact in
    /// the agreement's f64 row.
    pub(super) fn plan_digest(&self) -> f64 {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for (i, (name, _)) in self.model.params().iter().enumerate() {
            h.update((name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            h.update((self.shapes[i].len() as u64).to_le_bytes());
            for d in &self.shapes[i] {
                h.update(d.to_le_bytes());
            }
            h.update((self.param_unit[i] as u64).to_le_bytes());
            h.update(
                self.param_also[i]
                    .map_or(u64::MAX, |u| u as u64)
                    .to_le_bytes(),
            );
        }
        for b in self.bucket_plan() {
            h.update((b.params.len() as u64).to_le_bytes());
            for i in &b.params {
                h.update((*i as u64).to_le_bytes());
            }
        }
        let d = h.finalize();
        let mut x = [0u8; 8];
        x[..6].copy_from_slice(&d[..6]);
        u64::from_le_bytes(x) as f64
    }

    /// The buffer the buckets of `plan` are packed into (the largest and the three riders),
    /// kept from step to step.
    pub(super) fn bucket_buffer(&mut self, plan: &[Bucket]) -> Tensor {
        let largest = plan
            .iter()
            .map(|k| {
                k.params
                    .iter()
                    .map(|i| self.shapes[*i].iter().product::<i64>())
                    .sum::<i64>()
            })
            .max()
            .unwrap_or(0)
            + 3;
        match self.bucket.take() {
            Some(t) if t.numel() as i64 >= largest && t.device() == self.dev => t,
            _ => Tensor::empty([largest], (Kind::Float, self.dev)),
        }
    }

    /// Whether the data-parallel step's bucket all-reduces can run on a thread of their own:
    /// on the CPU, when this node has a core beyond one per rank of the job on it. A CPU slot
    /// computes on one core (`set_num_threads(1)`), and a bucket's all-reduce is CPU work
    /// (copies and sums): on cores the ranks already fill the thread only takes turns with the
    /// backward (on 2 cores with 2 ranks, 5% slower than the buckets after the backward;
    /// reducing each bucket in turn between units' backwards, 1% slower: `ductile-bench
    /// ddp-step`). On a GPU, NCCL's calls queue on the device's stream and the communicator
    /// refuses a second thread's.
    pub(super) fn comm_thread(&self, g: &Generation) -> bool {
        if self.dev != Device::Cpu {
            return false;
        }
        let here = g
            .members
            .iter()
            .filter(|m| m.node == self.env.node)
            .count()
            .max(1);
        // (read once: on Linux it reads the affinity mask and the cgroup's quota files)
        static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        let cores =
            *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        cores > here
    }

    /// Whether the data-parallel step overlaps its all-reduce with the backward: outside
    /// deterministic mode (its ordered fold needs every logical shard first), with more than
    /// one rank, on a whole model, where a communication thread has a core
    /// ([`Trainer::comm_thread`]: the CPU only).
    pub(super) fn overlaps(&self, g: &Generation, world: u32) -> bool {
        !self.spec.deterministic
            && world > 1
            && !self.model.sliced()
            && !self.params.is_empty()
            && self.comm_thread(g)
    }

    /// The data-parallel step with its gradients' all-reduce overlapped with the backward
    /// (see the module's comment). Micro-batches before the last accumulate as DDP's
    /// `no_sync` ones do; the loss and the checkpoint flags ride in the last bucket.
    pub(super) fn overlapped_step(
        &mut self,
        arc: &Arc<dyn Communicator>,
        g: &Generation,
        rank: u32,
        t0: Instant,
    ) -> Result<f64, CommError> {
        // (outside deterministic mode a rank's step is one part: its share of the batch)
        let parts = self.step_parts(arc.as_ref(), g, rank);
        debug_assert_eq!(parts.len(), 1);
        let micro = &parts[0].micro;
        let b = self.spec.global_batch as f64;
        let plan = self.bucket_plan();
        let buf = self.bucket_buffer(&plan);
        let cap = i64::from(self.spec.bucket_mb.unwrap_or(25)) << 20;
        if LOGGED.swap(g.number, Ordering::SeqCst) != g.number {
            tracing::info!(
                generation = g.number,
                buckets = plan.len(),
                "gradients all-reduced in {} buckets of at most {} MiB on a communication thread, each as soon as the backward finishes it",
                plan.len(),
                cap >> 20
            );
        }
        let solo = "a data-parallel step does not communicate inside its model";
        let mut acc = Tensor::zeros([1], (Kind::Double, self.dev));
        let (last, before) = micro.split_last().expect("a share has a micro-batch");
        for (x, y) in before {
            let mut tape = crate::model::Tape::default();
            let out = self
                .model
                .forward(0, self.units(), x, &mut tape)
                .expect(solo);
            let loss = self.model.loss(&out, y, &mut tape).expect(solo) / b;
            self.model.backward(tape, &loss, None).expect(solo);
            acc += loss.detach().to_kind(Kind::Double).reshape([1]);
        }
        let queue = CommQueue::new()?;
        let mut tickets = Vec::with_capacity(plan.len());
        let mut grads: Vec<Option<Tensor>> = (0..self.params.len()).map(|_| None).collect();
        let params: Vec<Tensor> = self.params.iter().map(|p| p.shallow_clone()).collect();
        let mut next = 0;
        // submit bucket `k` (the loss and the checkpoint flags riding in the last)
        let mut submit = |k: &Bucket, ride: Option<Tensor>| {
            let gs: Vec<Tensor> = k
                .params
                .iter()
                .map(|&i| {
                    let gr = params[i].grad();
                    let gr = if gr.defined() {
                        gr
                    } else {
                        params[i].zeros_like()
                    };
                    grads[i] = Some(gr.shallow_clone());
                    gr
                })
                .collect();
            let (comm, buf) = (arc.clone(), buf.shallow_clone());
            tickets.push(queue.submit("all_reduce", move || {
                reduce_bucket(comm.as_ref(), &buf, &gs, ride.as_ref())
            }));
        };
        let l = self.model.backward_by_unit(&last.0, &last.1, b, |u| {
            // every bucket but the last as soon as its gradients are final
            while next + 1 < plan.len() && plan[next].after >= u {
                submit(&plan[next], None);
                next += 1;
            }
        });
        acc += l.to_kind(Kind::Double).reshape([1]);
        self.computed_for(rank, t0);
        let riders = Tensor::cat(&self.riders(acc.to_kind(Kind::Float), g.number), 0);
        for k in &plan[next..plan.len() - 1] {
            submit(k, None);
        }
        submit(plan.last().expect("a model has parameters"), Some(riders));
        let mut summed = None;
        for t in tickets {
            // the first failure is the step's error (the later ones were not run)
            if let Some(r) = t.wait()? {
                summed = Some(r);
            }
        }
        drop(queue);
        self.bucket = Some(buf);
        let summed = summed.expect("the last bucket carries the riders");
        // one read of the three scalars that rode along
        let tail = Vec::<f32>::try_from(summed.to_device(Device::Cpu))
            .unwrap_or_else(|_| vec![f32::NAN, 0.0, 0.0]);
        self.flags = (tail[1] > 0.0, tail[2] > 0.0);
        let grads: Vec<Tensor> = grads
            .into_iter()
            .zip(&self.params)
            .map(|(g, p)| g.unwrap_or_else(|| p.zeros_like()))
            .collect();
        self.apply_step(arc, g, rank, &grads, tail[0] as f64)?;
        Ok(tail[0] as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Collectives run in submission order, on the queue's thread (the caller goes on
    /// meanwhile) or at once inline; after one fails the later ones are not run, so the first
    /// error is the one a step sees; a panic is an error, not a hang.
    #[test]
    fn the_queue_keeps_order_and_stops_after_the_first_failure() {
        for queue in [CommQueue::new().unwrap(), CommQueue::inline()] {
            let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
            let (go, gate) = mpsc::channel::<()>();
            let threaded = queue.tx.is_some();
            let log = |k: u32| {
                let seen = seen.clone();
                move || -> Result<u32, CommError> {
                    seen.lock().unwrap().push(k);
                    Ok(k)
                }
            };
            let first = if threaded {
                // the thread waits at the gate: the caller is not held up by it
                queue.submit("first", move || {
                    gate.recv().unwrap();
                    Ok(0)
                })
            } else {
                queue.submit("first", || Ok(0))
            };
            let tickets: Vec<_> = (1..4).map(|k| queue.submit("op", log(k))).collect();
            let failing = queue.submit("fails", || -> Result<u32, CommError> {
                Err(CommError::Invalid {
                    op: "fails",
                    reason: "a peer went away".into(),
                })
            });
            let after = queue.submit("after", log(9));
            if threaded {
                assert!(seen.lock().unwrap().is_empty(), "nothing ran past the gate");
                go.send(()).unwrap();
            }
            assert_eq!(first.wait().unwrap(), 0);
            let got: Vec<u32> = tickets.into_iter().map(|t| t.wait().unwrap()).collect();
            assert_eq!(got, vec![1, 2, 3]);
            assert!(failing
                .wait()
                .unwrap_err()
                .to_string()
                .contains("a peer went away"));
            let e = after.wait().unwrap_err().to_string();
            assert!(e.contains("not run"), "{e}");
            assert_eq!(
                *seen.lock().unwrap(),
                vec![1, 2, 3],
                "the later op never ran"
            );
        }
        let q = CommQueue::new().unwrap();
        let e = q
            .submit("boom", || -> Result<(), CommError> {
                panic!("in a collective")
            })
            .wait()
            .unwrap_err();
        assert!(e.to_string().contains("panicked"), "{e}");
    }

    /// Buckets follow the backward (the last unit's parameters first), hold whole parameters
    /// up to the cap (a larger one alone), and each is submitted after its last parameter's
    /// unit.
    #[test]
    fn buckets_follow_the_backward_and_hold_whole_parameters() {
        // parameters 0..5 in units [0, 1, 1, 2, 2] (0 also used by unit 2 would be tied and
        // done at 0); a cap of 25 floats
        let unit = [0usize, 1, 1, 2, 2];
        let numels = [10i64, 4, 4, 3, 30];
        let plan = bucket_plan(&numels, |i| unit[i], 100);
        let b = |params: Vec<usize>, after: usize| Bucket { params, after };
        assert_eq!(
            plan,
            vec![b(vec![3], 2), b(vec![4], 2), b(vec![1, 2, 0], 0)],
            "the last unit's first; 4 (120 bytes) alone; the rest fill the cap"
        );
        // one byte cap: every parameter a bucket of its own, still in backward order
        let each = bucket_plan(&numels, |i| unit[i], 1);
        let order: Vec<usize> = each.iter().flat_map(|k| k.params.clone()).collect();
        assert_eq!(order, vec![3, 4, 1, 2, 0]);
        assert!(each.iter().all(|k| k.params.len() == 1));
        // a cap above the model: one bucket, submitted after unit 0
        let one = bucket_plan(&numels, |i| unit[i], 1 << 20);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].after, 0);
    }
}

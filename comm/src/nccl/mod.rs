//! The NCCL backend for CUDA tensors (feature `cuda`). It compiles and links without CUDA (the
//! CUDA driver through cudarc's dynamic loading, NCCL through [`lib`]), and forming a
//! communicator first checks that the driver, a device and NCCL are there, turning their absence
//! into [`CommError::Unavailable`] (cudarc panics when it calls into a library that is not there).
//!
//! Communicators are created non-blocking (`blocking = 0`), so initialisation and collectives are
//! polled and `abort()` from another thread ends them with `ncclCommAbort` instead of a hang.
//! Where the NCCL found at run time has `ncclCommShrink` (2.27+), [`NcclComm::shrink`] is the fast
//! path for a failure-only shrink.
//!
//! NCCL itself is the copy libtorch loaded ([`lib`]): never one found by name.
//!
//! Re-formation: NCCL spends a fixed time inside `ncclCommAbort` (about 1 s on an H100) and
//! `ncclCommDestroy` (0.5 s). `abort()` and `Drop` therefore hand the old communicator to a
//! background thread that tears it down, and the next generation's communicator is formed at
//! once; its first collective on the stream waits only if an aborted kernel is still there.

use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use cudarc::nccl::sys as nc;
use tch::{Device, Kind, Tensor};

use crate::error::{CommError, Result};
use crate::liveness::Liveness;
use crate::rendezvous::Rendezvous;
use crate::tcp::{TcpComm, TcpConfig};
use crate::{Communicator, DevTensor, HostChannel, ReduceOp};

pub mod lib;
pub use lib::{mapped_copies, nccl, Nccl};

/// Whether NCCL can be used here; the error names what is missing.
pub fn available() -> Result<()> {
    unsafe {
        if !cu::is_culib_present() {
            return Err(CommError::Unavailable("NCCL backend: the CUDA driver (libcuda.so) is not present: this machine has no usable GPU; use the TCP backend".into()));
        }
        if cu::cuInit(0) != cu::CUresult::CUDA_SUCCESS {
            return Err(CommError::Unavailable(
                "NCCL backend: cuInit failed: no usable GPU".into(),
            ));
        }
        let mut n = 0;
        if cu::cuDeviceGetCount(&mut n) != cu::CUresult::CUDA_SUCCESS || n == 0 {
            return Err(CommError::Unavailable(
                "NCCL backend: no CUDA device".into(),
            ));
        }
    }
    nccl().map_err(|e| CommError::Unavailable(format!("NCCL backend: {e}")))?;
    Ok(())
}

/// The loaded NCCL (after [`available`] succeeded).
fn api() -> &'static Nccl {
    nccl().expect("NCCL was checked by available()")
}

/// Tear `comm` down off the caller's thread: `ncclCommAbort` blocks for about a second.
fn abort_in_background(comm: nc::ncclComm_t) {
    struct Ptr(nc::ncclComm_t);
    unsafe impl Send for Ptr {}
    let p = Ptr(comm);
    let spawned = std::thread::Builder::new()
        .name("nccl-abort".into())
        .spawn(move || {
            let p = p;
            unsafe { (api().comm_abort)(p.0) };
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no thread for the NCCL abort: aborting inline");
        unsafe { (api().comm_abort)(comm) };
    }
}

fn nccl_err(generation: u64, op: &'static str, r: nc::ncclResult_t) -> CommError {
    let msg = unsafe { CStr::from_ptr((api().get_error_string)(r)) }
        .to_string_lossy()
        .into_owned();
    CommError::Unavailable(format!(
        "generation {generation}: NCCL {op} failed: {msg} ({r:?})"
    ))
}

fn config() -> nc::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    nc::ncclConfig_t {
        size: std::mem::size_of::<nc::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 22800,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

struct State {
    comm: nc::ncclComm_t,
    in_op: bool,
}

unsafe impl Send for State {}

/// A communicator of one generation over NCCL.
pub struct NcclComm {
    generation: u64,
    rank: u32,
    world: u32,
    device: i32,
    state: Mutex<State>,
    aborted: Arc<AtomicBool>,
    op_timeout: Duration,
    /// Heartbeats beside NCCL (which carries none): a stopped or killed peer aborts the
    /// communicator within the liveness timeout and the op reports it by rank.
    liveness: Option<Liveness>,
    /// The host face: the generation's TCP mesh beside NCCL (control data, never model state).
    host: Option<TcpComm>,
}

unsafe impl Sync for NcclComm {}
unsafe impl Send for NcclComm {}

fn set_device(device: i32) -> Result<()> {
    unsafe {
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        if cu::cuDeviceGet(&mut dev, device) != cu::CUresult::CUDA_SUCCESS
            || cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) != cu::CUresult::CUDA_SUCCESS
            || cu::cuCtxSetCurrent(ctx) != cu::CUresult::CUDA_SUCCESS
        {
            return Err(CommError::Unavailable(format!(
                "cannot make CUDA device {device} current"
            )));
        }
    }
    Ok(())
}

/// Make `device`'s primary context current on this thread unless one already is (torch's
/// kernels on this thread made it current already; a fresh thread has none).
fn ensure_context(device: i32) -> Result<()> {
    let mut cur = std::ptr::null_mut();
    if unsafe { cu::cuCtxGetCurrent(&mut cur) } == cu::CUresult::CUDA_SUCCESS && !cur.is_null() {
        return Ok(());
    }
    set_device(device)
}

impl NcclComm {
    /// Form the communicator of `rdv`'s generation on CUDA device `device`: rank 0 makes the
    /// unique id and publishes it through etcd; every rank initialises (non-blocking, bounded by
    /// `cfg.form_timeout`; every op by the job's `cfg.op_timeout`, as on TCP). Beside it, over
    /// TCP with `cfg`: the host face (a [`TcpComm`]) and, with `heartbeats`, a heartbeat mesh
    /// that aborts NCCL within the liveness timeout when a peer stops or dies.
    pub async fn form(
        rdv: &Rendezvous,
        device: i32,
        cfg: TcpConfig,
        heartbeats: bool,
    ) -> Result<NcclComm> {
        available()?;
        let generation = rdv.generation;
        let (timeout, op_timeout) = (cfg.form_timeout, cfg.op_timeout);
        let id = if rdv.rank == 0 {
            let mut id = nc::ncclUniqueId { internal: [0; 128] };
            let r = unsafe { (api().get_unique_id)(&mut id) };
            if r != nc::ncclResult_t::ncclSuccess {
                return Err(nccl_err(generation, "get unique id", r));
            }
            id
        } else {
            nc::ncclUniqueId { internal: [0; 128] }
        };
        let bytes: Vec<u8> = id.internal.iter().map(|c| *c as u8).collect();
        rdv.publish("nccl", if rdv.rank == 0 { &bytes } else { b"-" })
            .await?;
        let all = rdv.gather("nccl", timeout).await?;
        let mut id = nc::ncclUniqueId { internal: [0; 128] };
        if all[0].len() != 128 {
            return Err(CommError::Protocol {
                generation,
                op: "nccl init",
                peer: 0,
                reason: "unique id is not 128 bytes".into(),
            });
        }
        for (d, s) in id.internal.iter_mut().zip(&all[0]) {
            *d = *s as _;
        }
        let (rank, world) = (rdv.rank, rdv.world);
        let mut c = tokio::task::spawn_blocking(move || {
            Self::init(id, generation, rank, world, device, timeout, op_timeout)
        })
        .await
        .map_err(|e| CommError::Unavailable(format!("nccl init task failed: {e}")))??;
        let host_cfg = TcpConfig {
            device: Device::Cuda(device as usize),
            ..cfg.clone()
        };
        c.host = Some(TcpComm::form(rdv, host_cfg).await?);
        if heartbeats {
            let aborted = c.aborted.clone();
            c.liveness = Some(
                Liveness::form(
                    rdv,
                    &cfg,
                    Arc::new(move |_| aborted.store(true, Ordering::SeqCst)),
                )
                .await?,
            );
        }
        Ok(c)
    }

    fn init(
        mut id: nc::ncclUniqueId,
        generation: u64,
        rank: u32,
        world: u32,
        device: i32,
        timeout: Duration,
        op_timeout: Duration,
    ) -> Result<NcclComm> {
        set_device(device)?;
        let mut comm: nc::ncclComm_t = std::ptr::null_mut();
        let mut cfg = config();
        let r = unsafe {
            (api().comm_init_rank_config)(&mut comm, world as i32, id, rank as i32, &mut cfg)
        };
        let _ = &mut id;
        if r != nc::ncclResult_t::ncclSuccess && r != nc::ncclResult_t::ncclInProgress {
            return Err(nccl_err(generation, "init", r));
        }
        let c = NcclComm {
            generation,
            rank,
            world,
            device,
            state: Mutex::new(State { comm, in_op: false }),
            aborted: Arc::new(AtomicBool::new(false)),
            op_timeout,
            liveness: None,
            host: None,
        };
        c.wait_ready("init", timeout)?;
        Ok(c)
    }

    /// Poll the communicator until its pending work is done, aborting on request or timeout.
    fn wait_ready(&self, op: &'static str, timeout: Duration) -> Result<()> {
        let t0 = Instant::now();
        loop {
            let comm = self.state.lock().unwrap().comm;
            if comm.is_null() || self.aborted.load(Ordering::SeqCst) {
                return Err(CommError::Aborted {
                    generation: self.generation,
                    op,
                });
            }
            let mut st = nc::ncclResult_t::ncclSuccess;
            let r = unsafe { (api().comm_get_async_error)(comm, &mut st) };
            if r != nc::ncclResult_t::ncclSuccess {
                return Err(nccl_err(self.generation, op, r));
            }
            match st {
                nc::ncclResult_t::ncclSuccess => return Ok(()),
                nc::ncclResult_t::ncclInProgress => {}
                other => return Err(nccl_err(self.generation, op, other)),
            }
            if t0.elapsed() > timeout {
                return Err(CommError::Timeout {
                    generation: self.generation,
                    op,
                    peer: u32::MAX,
                    after: timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Run one NCCL call on the default stream and wait for it (polling the stream, so an abort
    /// from another thread ends the wait at once).
    fn call(
        &self,
        op: &'static str,
        f: impl FnOnce(nc::ncclComm_t) -> nc::ncclResult_t,
    ) -> Result<()> {
        ensure_context(self.device)?;
        let comm = {
            let mut st = self.state.lock().unwrap();
            if st.comm.is_null() || self.aborted.load(Ordering::SeqCst) {
                return Err(CommError::Aborted {
                    generation: self.generation,
                    op,
                });
            }
            if st.in_op {
                // NCCL's communicators take one thread's calls at a time: a second thread's
                // op here would interleave with the first on the GPU (the shape that
                // deadlocks point to point); it is a bug in the caller, said at once
                return Err(CommError::Invalid {
                    op,
                    reason: "another thread's call is in flight on this NCCL communicator: issue point-to-point work as one exchange".into(),
                });
            }
            st.in_op = true;
            st.comm
        };
        let out = (|| {
            let r = f(comm);
            if r != nc::ncclResult_t::ncclSuccess && r != nc::ncclResult_t::ncclInProgress {
                return Err(nccl_err(self.generation, op, r));
            }
            self.wait_ready(op, self.op_timeout)?;
            let t0 = Instant::now();
            loop {
                if self.aborted.load(Ordering::SeqCst) {
                    return Err(CommError::Aborted {
                        generation: self.generation,
                        op,
                    });
                }
                match unsafe { cu::cuStreamQuery(std::ptr::null_mut()) } {
                    cu::CUresult::CUDA_SUCCESS => return Ok(()),
                    cu::CUresult::CUDA_ERROR_NOT_READY => {}
                    e => {
                        return Err(CommError::Unavailable(format!(
                            "generation {}: CUDA error during {op}: {e:?}",
                            self.generation
                        )))
                    }
                }
                if t0.elapsed() > self.op_timeout {
                    return Err(CommError::Timeout {
                        generation: self.generation,
                        op,
                        peer: u32::MAX,
                        after: self.op_timeout,
                    });
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        })();
        let mut st = self.state.lock().unwrap();
        st.in_op = false;
        if out.is_err() || self.aborted.load(Ordering::SeqCst) {
            if !st.comm.is_null() {
                abort_in_background(st.comm);
                st.comm = std::ptr::null_mut();
            }
            self.aborted.store(true, Ordering::SeqCst);
        }
        // a peer the heartbeats found stopped or gone is what ended the op: say so, by rank
        match out {
            Err(CommError::Aborted { .. }) | Err(CommError::Timeout { .. }) => Err(self
                .liveness
                .as_ref()
                .and_then(|l| l.error(op))
                .unwrap_or_else(|| out.unwrap_err())),
            other => other,
        }
    }

    /// Abort on this thread and wait for NCCL to finish tearing down (the benchmark's measure
    /// of NCCL's own cost; `abort()` does this in the background).
    pub fn abort_blocking(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        let mut st = self.state.lock().unwrap();
        if !st.comm.is_null() {
            unsafe { (api().comm_abort)(st.comm) };
            st.comm = std::ptr::null_mut();
        }
    }

    /// A new communicator without `exclude` (ranks that failed), for a failure-only shrink,
    /// through `ncclCommShrink` when the NCCL here has it.
    pub fn shrink(&self, exclude: &[u32], generation: u64) -> Result<NcclComm> {
        let st = self.state.lock().unwrap();
        if st.comm.is_null() {
            return Err(CommError::Aborted {
                generation: self.generation,
                op: "shrink",
            });
        }
        let Some(shrink) = api().comm_shrink else {
            return Err(CommError::Unavailable(format!(
                "ncclCommShrink needs NCCL 2.27+, found {} at {}",
                api().version,
                api().path
            )));
        };
        let mut ex: Vec<i32> = exclude.iter().map(|r| *r as i32).collect();
        let mut new: nc::ncclComm_t = std::ptr::null_mut();
        let mut cfg = config();
        // NCCL_SHRINK_ABORT (1): the excluded ranks failed; abort their pending work
        let r = unsafe {
            shrink(
                st.comm,
                ex.as_mut_ptr(),
                ex.len() as i32,
                &mut new,
                &mut cfg,
                1,
            )
        };
        if r != nc::ncclResult_t::ncclSuccess && r != nc::ncclResult_t::ncclInProgress {
            return Err(nccl_err(generation, "shrink", r));
        }
        let rank = self.rank - exclude.iter().filter(|e| **e < self.rank).count() as u32;
        let c = NcclComm {
            generation,
            rank,
            world: self.world - exclude.len() as u32,
            device: self.device,
            state: Mutex::new(State {
                comm: new,
                in_op: false,
            }),
            aborted: Arc::new(AtomicBool::new(false)),
            op_timeout: self.op_timeout,
            // the shrunk generation forms no heartbeat mesh of its own (the op timeout bounds it)
            liveness: None,
            // nor a host face: the benchmark's measure of NCCL's own shrink
            host: None,
        };
        drop(st);
        c.wait_ready("shrink", self.op_timeout)?;
        Ok(c)
    }

    fn dtype(&self, t: &Tensor, op: &'static str) -> Result<nc::ncclDataType_t> {
        if t.device() != Device::Cuda(self.device as usize) {
            return Err(CommError::Invalid {
                op,
                reason: format!(
                    "the NCCL backend needs tensors on cuda:{}, got {:?}",
                    self.device,
                    t.device()
                ),
            });
        }
        if !t.is_contiguous() {
            return Err(CommError::Invalid {
                op,
                reason: "tensor must be contiguous".into(),
            });
        }
        Ok(match t.kind() {
            Kind::Float => nc::ncclDataType_t::ncclFloat32,
            Kind::Double => nc::ncclDataType_t::ncclFloat64,
            Kind::Half => nc::ncclDataType_t::ncclFloat16,
            Kind::BFloat16 => nc::ncclDataType_t::ncclBfloat16,
            // integers move as they are (lengths, counts, bytes)
            Kind::Int64 => nc::ncclDataType_t::ncclInt64,
            Kind::Int => nc::ncclDataType_t::ncclInt32,
            Kind::Uint8 => nc::ncclDataType_t::ncclUint8,
            Kind::Int8 => nc::ncclDataType_t::ncclInt8,
            other => {
                return Err(CommError::Invalid {
                    op,
                    reason: format!("unsupported dtype {other:?}"),
                })
            }
        })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap();
        if !st.comm.is_null() {
            // a destroy costs about 0.5 s inside NCCL; the abort path ends it just as well
            abort_in_background(st.comm);
            st.comm = std::ptr::null_mut();
        }
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> u32 {
        self.rank
    }
    fn world(&self) -> u32 {
        self.world
    }
    fn generation(&self) -> u64 {
        self.generation
    }
    fn device(&self) -> Device {
        Device::Cuda(self.device as usize)
    }
    fn host(&self) -> &dyn HostChannel {
        match &self.host {
            Some(h) => h,
            None => &NoHost,
        }
    }
    fn all_reduce(&self, t: &mut DevTensor, op: ReduceOp) -> Result<()> {
        let t = t.tensor();
        let dt = self.dtype(t, "all_reduce")?;
        let (p, n) = (t.data_ptr(), t.numel());
        self.call("all_reduce", |c| unsafe {
            (api().all_reduce)(
                p,
                p,
                n,
                dt,
                nc::ncclRedOp_t::ncclSum,
                c,
                std::ptr::null_mut(),
            )
        })?;
        crate::finish_avg(&mut t.shallow_clone(), op, self.world)
    }
    fn broadcast(&self, t: &mut DevTensor, root: u32) -> Result<()> {
        let t = t.tensor();
        let dt = self.dtype(t, "broadcast")?;
        let (p, n) = (t.data_ptr(), t.numel());
        self.call("broadcast", |c| unsafe {
            (api().broadcast)(p, p, n, dt, root as i32, c, std::ptr::null_mut())
        })
    }
    fn all_gather(&self, t: &DevTensor) -> Result<DevTensor> {
        let t = t.tensor();
        let dt = self.dtype(t, "all_gather")?;
        let mut shape = vec![self.world as i64];
        shape.extend(t.size());
        let out = self.zeros(&shape, t.kind());
        let (src, dst, n) = (t.data_ptr(), out.tensor().data_ptr(), t.numel());
        self.call("all_gather", |c| unsafe {
            (api().all_gather)(src, dst, n, dt, c, std::ptr::null_mut())
        })?;
        Ok(out)
    }
    fn reduce_scatter(&self, t: &DevTensor) -> Result<DevTensor> {
        let t = t.tensor();
        let dt = self.dtype(t, "reduce_scatter")?;
        let shape = crate::scatter_shape(t, self.world)?;
        let out = self.zeros(&shape, t.kind());
        let (src, dst, n) = (t.data_ptr(), out.tensor().data_ptr(), out.numel());
        self.call("reduce_scatter", |c| unsafe {
            (api().reduce_scatter)(
                src,
                dst,
                n,
                dt,
                nc::ncclRedOp_t::ncclSum,
                c,
                std::ptr::null_mut(),
            )
        })?;
        Ok(out)
    }
    fn exchange(&self, sends: &[(u32, &DevTensor)], recvs: &[(u32, &DevTensor)]) -> Result<()> {
        let op = "exchange";
        let mut ops = Vec::with_capacity(sends.len() + recvs.len());
        for (send, list) in [(true, sends), (false, recvs)] {
            for (peer, t) in list {
                if *peer >= self.world || *peer == self.rank {
                    return Err(CommError::Invalid {
                        op,
                        reason: format!("peer {peer} is not another rank of world {}", self.world),
                    });
                }
                let t = t.tensor();
                if !t.is_contiguous() {
                    return Err(CommError::Invalid {
                        op,
                        reason: "tensor must be contiguous".into(),
                    });
                }
                ops.push((
                    send,
                    *peer as i32,
                    t.data_ptr(),
                    t.numel(),
                    self.dtype(t, op)?,
                ));
            }
        }
        if ops.is_empty() {
            return Ok(());
        }
        // every send and receive of the exchange in one group: NCCL progresses them together,
        // so two ranks that both send first do not wait on each other
        self.call(op, |c| unsafe {
            let r = (api().group_start)();
            if r != nc::ncclResult_t::ncclSuccess {
                return r;
            }
            let mut first_err = nc::ncclResult_t::ncclSuccess;
            for (send, peer, p, n, dt) in &ops {
                let r = if *send {
                    (api().send)(*p, *n, *dt, *peer, c, std::ptr::null_mut())
                } else {
                    (api().recv)(*p, *n, *dt, *peer, c, std::ptr::null_mut())
                };
                if r != nc::ncclResult_t::ncclSuccess
                    && r != nc::ncclResult_t::ncclInProgress
                    && first_err == nc::ncclResult_t::ncclSuccess
                {
                    first_err = r;
                }
            }
            let r = (api().group_end)();
            if first_err != nc::ncclResult_t::ncclSuccess {
                first_err
            } else {
                r
            }
        })
    }
    fn ordered_all_reduce(&self, shards: &[(u64, DevTensor)], total: u64) -> Result<DevTensor> {
        // Fixed order on GPUs: gather every rank's shards to every rank, then fold in index
        // order locally (the same fold, so the same bits, at every world size).
        let op = "ordered_all_reduce";
        let first = crate::first_shard(shards)?;
        let local = Tensor::stack(
            &shards
                .iter()
                .map(|(_, t)| t.tensor().shallow_clone())
                .collect::<Vec<_>>(),
            0,
        );
        // how many shards each rank holds: control data, on the host face
        let counts: Vec<i64> = self
            .host()
            .all_gather_i64(&[shards.len() as i64])?
            .into_iter()
            .map(|r| r[0])
            .collect();
        if counts.iter().any(|c| *c < 1) || counts.iter().sum::<i64>() as u64 != total {
            return Err(CommError::Invalid {
                op,
                reason: format!(
                    "the ranks hold {counts:?} shards, expected {total} in all, at least one each"
                ),
            });
        }
        // bounded: every count is at most `total`, which this rank chose
        let max = *counts.iter().max().unwrap();
        let padded = if (shards.len() as i64) < max {
            Tensor::cat(
                &[
                    local.shallow_clone(),
                    local.narrow(0, 0, 1).repeat([max - shards.len() as i64]),
                ],
                0,
            )
        } else {
            local
        };
        let gathered = self
            .all_gather(&self.place(&padded.contiguous()))?
            .into_tensor();
        let mut acc: Option<Tensor> = None;
        for (r, n) in counts.iter().enumerate() {
            for k in 0..*n {
                let s = gathered.get(r as i64).get(k);
                acc = Some(match acc {
                    None => s.copy(),
                    Some(a) => a + s,
                });
            }
        }
        let _ = first;
        acc.map(|a| self.place(&a))
            .ok_or_else(|| CommError::Invalid {
                op,
                reason: "no shards".into(),
            })
    }
    fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        if let Some(h) = &self.host {
            h.abort();
        }
        let mut st = self.state.lock().unwrap();
        if !st.in_op && !st.comm.is_null() {
            abort_in_background(st.comm);
            st.comm = std::ptr::null_mut();
        }
    }
}

/// The host face of a communicator formed without one (a shrunk one, in the benchmark): every
/// call fails saying so.
struct NoHost;

impl HostChannel for NoHost {
    fn rank(&self) -> u32 {
        0
    }
    fn world(&self) -> u32 {
        0
    }
    fn generation(&self) -> u64 {
        0
    }
    fn all_gather_bytes(&self, _: &[u8]) -> Result<Vec<Vec<u8>>> {
        Err(no_host())
    }
    fn broadcast_vec(&self, _: &mut Vec<u8>, _: u32) -> Result<()> {
        Err(no_host())
    }
    fn send_msg(&self, _: &[u8], _: u32) -> Result<()> {
        Err(no_host())
    }
    fn recv_msg(&self, _: u32) -> Result<Vec<u8>> {
        Err(no_host())
    }
    fn barrier(&self) -> Result<()> {
        Err(no_host())
    }
}

fn no_host() -> CommError {
    CommError::Invalid {
        op: "host",
        reason: "this NCCL communicator was formed without a host face (a shrunk one)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ductile_cluster::{Keys, Store};

    /// On a machine without a GPU (CI's), NCCL is refused with an error that names what is
    /// missing, instead of cudarc's panic; the TCP backend is unaffected.
    #[tokio::test]
    async fn without_a_gpu_forming_fails_with_a_clear_error() {
        if available().is_ok() {
            eprintln!("a GPU and NCCL are present: nothing to check here");
            return;
        }
        let msg = available().unwrap_err().to_string();
        assert!(
            msg.contains("libcuda.so")
                || msg.contains("libnccl.so")
                || msg.contains("GPU")
                || msg.contains("CUDA device"),
            "{msg}"
        );
        let store = Store::new(
            std::sync::Arc::new(ductile_cluster::memory::MemoryBackend::new()),
            Keys::default(),
        );
        store.ensure_mesh_key("j", 1).await.unwrap();
        let rdv = Rendezvous::new(store, "j", 1, 1, 0).unwrap();
        let cfg = TcpConfig {
            form_timeout: Duration::from_secs(1),
            ..TcpConfig::default()
        };
        match NcclComm::form(&rdv, 0, cfg, false).await {
            Err(CommError::Unavailable(m)) => assert_eq!(m, msg),
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("formed an NCCL communicator without a GPU"),
        }
    }
}

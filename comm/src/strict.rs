//! NCCL's rules, checked on the TCP backend (`TcpConfig::strict`, `DUCTILE_COMM_STRICT=1`; the
//! tests turn it on). A layout that passes on CPU in this mode issues its device collectives
//! as NCCL needs them:
//! - **one thread at a time** on a communicator's device face: NCCL's communicators are not
//!   thread-safe, and two threads' calls interleave differently on different ranks (a hang).
//!   A device call that starts while another thread's is in flight on the same communicator
//!   fails, naming both calls;
//! - **the same order on every rank**: the TCP frames already carry each collective's kind and
//!   sequence number, and a frame of another kind or number fails (`calls out of step`); point
//!   to point, the n-th tensor one rank sends is the n-th the other receives;
//! - **no send outside a group whose peer sends too**: NCCL's `ncclSend` completes only when
//!   the peer receives, so two ranks that each send to the other before they receive, each in
//!   an exchange of sends only, wait for each other for good (TCP's socket buffers hide it).
//!   Every point-to-point frame carries, in its header's sequence field, whether it came from
//!   such a lone send and how many frames its sender had received from this rank when it sent
//!   it; a lone frame sent before its sender had received this rank's own last lone frame to
//!   it means both sends were in flight at once, and fails on receipt, naming both.
//!
//! The host face (control data) is not NCCL's on any backend and is not checked.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::{CommError, Result};

/// The lone-send flag in a point-to-point frame's sequence field.
pub(crate) const LONE: u64 = 1 << 63;

/// This thread's number (from 1), for the one-thread rule.
fn thread_no() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static NO: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    NO.with(|n| *n)
}

/// The strict mode's bookkeeping of one communicator.
pub(crate) struct Strict {
    generation: u64,
    rank: u32,
    /// The thread inside a device-face call (0: none), how deep (a call made from inside
    /// another, as staging does), and the outermost call's name.
    owner: AtomicU64,
    depth: AtomicU32,
    op: Mutex<&'static str>,
    /// Per peer: point-to-point frames sent to it, received from it, and the number of the
    /// last frame sent to it from a lone send (0: none).
    sent: Vec<AtomicU64>,
    recvd: Vec<AtomicU64>,
    last_lone: Vec<AtomicU64>,
}

/// A device-face call in progress on this thread; ends when dropped.
pub(crate) struct DeviceCall<'a>(Option<&'a Strict>);

impl Drop for DeviceCall<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.0 {
            if s.depth.fetch_sub(1, Ordering::SeqCst) == 1 {
                s.owner.store(0, Ordering::SeqCst);
            }
        }
    }
}

impl Strict {
    pub(crate) fn new(generation: u64, rank: u32, world: u32) -> Strict {
        let zeros = || (0..world).map(|_| AtomicU64::new(0)).collect();
        Strict {
            generation,
            rank,
            owner: AtomicU64::new(0),
            depth: AtomicU32::new(0),
            op: Mutex::new(""),
            sent: zeros(),
            recvd: zeros(),
            last_lone: zeros(),
        }
    }

    fn rule(&self, op: &'static str, reason: String) -> CommError {
        tracing::error!(
            generation = self.generation,
            rank = self.rank,
            "{op} breaks NCCL's rules: {reason}"
        );
        CommError::Rule {
            generation: self.generation,
            op,
            reason,
        }
    }

    /// Enter a device-face call `op` on this thread: fails while another thread is inside one.
    pub(crate) fn enter(&self, op: &'static str) -> Result<DeviceCall<'_>> {
        let me = thread_no();
        match self
            .owner
            .compare_exchange(0, me, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => *self.op.lock().unwrap() = op,
            Err(cur) if cur == me => {}
            Err(_) => {
                let other = *self.op.lock().unwrap();
                return Err(self.rule(
                    op,
                    format!("rank {} issued it on one thread while another thread's {other} was in flight on the same communicator: NCCL's communicators take one thread's calls at a time (their order would differ between ranks)", self.rank),
                ));
            }
        }
        self.depth.fetch_add(1, Ordering::SeqCst);
        Ok(DeviceCall(Some(self)))
    }

    /// The sequence field of the next point-to-point frame to `peer` (called under the peer's
    /// write lock, so frames are numbered in the order they go out).
    pub(crate) fn on_send(&self, peer: u32, lone: bool) -> u64 {
        let p = peer as usize;
        let n = self.sent[p].fetch_add(1, Ordering::SeqCst) + 1;
        if lone {
            self.last_lone[p].store(n, Ordering::SeqCst);
        }
        let seen = self.recvd[p].load(Ordering::SeqCst) & !LONE;
        seen | if lone { LONE } else { 0 }
    }

    /// A point-to-point frame from `peer` with sequence field `seq` arrived (under the peer's
    /// read lock): counts it, and fails where it and this rank's own lone send to `peer` were
    /// both in flight at once.
    pub(crate) fn on_recv(&self, op: &'static str, peer: u32, seq: u64) -> Result<()> {
        let p = peer as usize;
        let n = self.recvd[p].fetch_add(1, Ordering::SeqCst) + 1;
        if seq & LONE == 0 {
            return Ok(());
        }
        let seen = seq & !LONE;
        let mine = self.last_lone[p].load(Ordering::SeqCst);
        if mine > seen {
            return Err(self.rule(
                op,
                format!("rank {peer} sent its point-to-point frame {n} to rank {} in an exchange of sends only before it had received rank {}'s frame {mine}, itself sent in an exchange of sends only: each sent before receiving, outside one exchange; on NCCL each send would wait for the other's receive for good (put the send and the receive in one exchange)", self.rank, self.rank),
            ));
        }
        Ok(())
    }
}

/// No strict mode: no bookkeeping.
pub(crate) fn off<'a>() -> DeviceCall<'a> {
    DeviceCall(None)
}

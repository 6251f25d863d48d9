//! Asynchronous training with bounded staleness (`sync = "async"`): the parameters and their
//! optimizer state are sharded over the workers (the flattened parameters cut in one even range
//! per member; each member owns one, as a parameter server that lives in the workers), and
//! every worker trains on its own copy of the whole model without waiting for the others.
//!
//! A step of worker i: it computes the gradient of its batch on its copy (pulled with
//! version v_j of every slice j), then, per slice, two messages to the slice's owner:
//! 1. *push*: the gradient's range and v_j. The owner reserves a place in its queue and answers
//!    the staleness the update would have at the latest: σ_j = V_j + (updates queued before it)
//!    − v_j, where V_j counts the updates applied to the slice.
//! 2. *decide*: apply iff max_j σ_j ≤ `staleness`, decided once, at one place: the worker
//!    sends its decision to member 0, which records it (settling the update's batch at the
//!    dispenser, below) and sends it to every owner, itself included, in one order. Each owner
//!    applies the decided updates in queue order (so an update applied is never staler than its
//!    σ) and answers the slice's fresh values and version, which the worker copies.
//!
//! A gradient that is too stale is dropped everywhere and counted; its samples go back to the
//! queue of positions (to another worker first). A worker never waits on a slower one beyond
//! the queue's round trips: a straggler's updates are dropped, not waited for.
//!
//! Data: member 0 also dispenses positions: recording a worker's decision settles its batch
//! (applied: counted once; dropped: re-queued) and hands out its next one (⌈B / world⌉
//! positions: re-queued ones first, then fresh ones). The decision goes to every owner with the
//! dispenser's new state, so every owner holds a copy that reflects every decision it applied
//! (member 0's copies are one history: the one with the highest `seq` includes the others).
//!
//! Generations. A new generation (or a failed peer) ends the engine: the owners apply the
//! updates already decided and keep the undecided ones, and the agreement rebuilds the state
//! from the members: the dispenser from the freshest copy (old member 0's if it stayed; else
//! the owner or worker that saw the most of its history, which holds every decision any
//! surviving owner applied); each owner then applies the updates it kept that this copy says
//! were committed (member 0 recorded the decision, but it reached only some owners before the
//! generation ended) and drops the others, so an update is applied by every surviving owner or
//! by none. Then each old slice comes from its owner if it stayed (values, optimizer state,
//! version), else from the member whose copy of it is freshest (its optimizer state starts
//! anew: the updates the departed owner applied past that copy are lost for its slice, not
//! counted twice: their batches stay settled); every batch in flight is re-queued; and the
//! slices are cut anew over the new members.
//!
//! Checkpoints (`[checkpoint]`): once the positions applied reach the next multiple of
//! `interval` global batches, member 0 stops handing out batches; when every batch in flight is
//! settled, its answers tell the workers so, and each sends every owner a *snap* (with its
//! checkpoint flags). An owner whose queue is empty and that has every worker's snap answers
//! each its slice's values and optimizer state: every worker then holds the whole state as of
//! those positions, with no update half-applied, and saves its share of it through the
//! data-parallel save, with the dispenser and the slices' version in `extra.async`. Member 0
//! hands out batches again at once. A cold start restores that state and the dispenser, so a
//! full loss resumes from the last checkpoint, not from the seed. The run's end sends the
//! optimizer state with the final values, so the last save is whole too.
//!
//! The exactly-once ledger (`DUCTILE_LEDGER_DIR`) does not take the dispenser's word: each
//! worker writes the samples of every update it pushes, and each owner writes every decision it
//! applied or dropped.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ductile_cluster::records::*;
use ductile_comm::quant::ranges;
use ductile_comm::{CommError, Communicator};
use ductile_strategies::diloco::{self as plan, Ranges};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use super::driver::{Commit, Mode, Worked};
use super::{ledger_line, Trainer};
use crate::optim::Optimizer;

/// The dispenser of positions (held by member 0; copies ride on its answers).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Dispenser {
    /// Bumped at every change: the freshest copy has the highest.
    pub seq: u64,
    /// The next fresh position, and the end of the run's positions.
    pub cursor: u64,
    pub end: u64,
    /// Positions handed back (a dropped update's), with the member that dropped them.
    pub requeue: Vec<(Ranges, u32)>,
    /// Each member's batch in flight.
    pub outstanding: BTreeMap<u32, Ranges>,
    /// Positions applied; updates dropped; staleness of the updates applied (sum, count, max).
    pub applied: u64,
    pub dropped: u64,
    pub stale_sum: u64,
    pub stale_n: u64,
    pub stale_max: u64,
    /// Per worker of this generation: its last decided update (id, committed).
    #[serde(default)]
    pub decided: BTreeMap<u32, (u64, bool)>,
    /// Checkpoints: every `ckpt_every` positions applied (0: none), the next at `ckpt_next`.
    #[serde(default)]
    pub ckpt_every: u64,
    #[serde(default)]
    pub ckpt_next: u64,
}

impl Dispenser {
    /// The next batch of up to `b` positions for `rank`: re-queued ones (not the ones it
    /// dropped itself, while others remain) first, then fresh ones.
    fn hand_out(&mut self, rank: u32, b: u64) -> Ranges {
        self.seq += 1;
        if self.paused() {
            // a checkpoint is due: nothing more until the batches in flight are settled and
            // the owners answered the snaps
            return Vec::new();
        }
        let at = self
            .requeue
            .iter()
            .position(|(_, by)| *by != rank)
            .or((self.cursor >= self.end && !self.requeue.is_empty()).then_some(0));
        let mut out = match at {
            Some(i) => {
                let (mut r, by) = self.requeue.remove(i);
                let take = plan::take(&mut r, b);
                if !r.is_empty() {
                    self.requeue.insert(i, (r, by));
                }
                take
            }
            None => Vec::new(),
        };
        let have = plan::total(&out);
        if have < b && self.cursor < self.end && at.is_none() {
            let n = (b - have).min(self.end - self.cursor);
            out.push(self.cursor..self.cursor + n);
            self.cursor += n;
        }
        if !out.is_empty() {
            self.outstanding.insert(rank, out.clone());
        }
        out
    }

    /// `rank`'s update `id`, carrying its batch in flight, was applied (staleness `sigma`) or
    /// dropped.
    fn settle(&mut self, rank: u32, id: u64, applied: bool, sigma: u64) {
        self.seq += 1;
        self.decided.insert(rank, (id, applied));
        let Some(r) = self.outstanding.remove(&rank) else {
            return;
        };
        if applied {
            self.applied += plan::total(&r);
            self.stale_sum += sigma;
            self.stale_n += 1;
            self.stale_max = self.stale_max.max(sigma);
        } else {
            self.dropped += 1;
            self.requeue.push((r, rank));
        }
    }

    /// Every batch in flight goes back to the queue (a new generation).
    fn requeue_outstanding(&mut self) {
        self.seq += 1;
        self.decided.clear();
        let out = std::mem::take(&mut self.outstanding);
        for (rank, r) in out {
            self.requeue.push((r, rank));
        }
    }

    fn done(&self) -> bool {
        self.applied >= self.end
    }

    /// A checkpoint is due (the positions applied reached it): no batch is handed out.
    fn paused(&self) -> bool {
        self.ckpt_every > 0 && self.applied >= self.ckpt_next && !self.done()
    }

    /// A checkpoint is due and no batch is in flight: the workers snap.
    fn snap_due(&self) -> bool {
        self.paused() && self.outstanding.is_empty()
    }

    /// The checkpoint's state went out: the next one is due a multiple of `ckpt_every` on.
    fn schedule_checkpoint(&mut self) {
        self.seq += 1;
        if self.ckpt_every > 0 {
            self.ckpt_next = (self.applied / self.ckpt_every + 1) * self.ckpt_every;
        }
    }
}

/// A slice this member owns: its range of the flattened parameters, the authoritative values,
/// their optimizer and the number of updates applied.
pub struct Owned {
    pub range: Range<usize>,
    pub values: Tensor,
    pub opt: Optimizer,
    pub version: u64,
}

/// A member's asynchronous state, kept across generations.
#[derive(Default)]
pub struct Async {
    /// Whether this process holds state of generation `generation` (a new process does not).
    pub holds: bool,
    pub generation: u64,
    /// The world and this member's rank in that generation.
    pub world: u32,
    pub rank: u32,
    pub owned: Option<Owned>,
    /// The version of each slice of that generation this member's copy holds.
    pub seen: Vec<u64>,
    /// The dispenser (member 0) and the freshest copy of it.
    pub dispenser: Option<Dispenser>,
    pub snapshot: Option<Dispenser>,
    /// The updates in this member's queue still undecided when the generation ended.
    pending: Vec<Reserved>,
    /// The slices' version at the last snap (a checkpoint's `extra.async.version`).
    pub ckpt_version: u64,
    /// Snaps this generation (the ledger numbers them, as the owners do).
    snaps: u64,
    /// Updates this process pushed.
    pub next_id: u64,
    /// The current generation's first reader error.
    failure: Failure,
    /// The current generation's engine (between the driver's `begin` and `end`).
    engine: Option<Engine>,
    /// Every position is applied and the final state received: the run is over.
    over: bool,
}

/// A generation's engine: this member's server thread and the peers' readers, and the
/// client's side of the protocol.
struct Engine {
    post: Post,
    /// The client's inbox.
    rx: Receiver<Inbox>,
    server: std::thread::JoinHandle<Served>,
    readers: Vec<std::thread::JoinHandle<()>>,
    /// The generation's slices of the flattened parameters, one per member.
    slices: Vec<Range<usize>>,
    /// The next batch, whether the run is done, whether to snap for a checkpoint (none: ask
    /// member 0).
    next: Option<(Ranges, bool, bool)>,
    /// Positions applied as of the last update's answers.
    applied: u64,
    /// The losses of the updates since the last progress report.
    loss_sum: f64,
    loss_n: u64,
}

#[derive(Debug, Serialize, Deserialize)]
enum Head {
    Push {
        id: u64,
        version: u64,
    },
    Ack {
        id: u64,
        staleness: u64,
    },
    /// A worker's decision on its update, to member 0; `staleness`: the update's, over every
    /// slice.
    Decide {
        id: u64,
        commit: bool,
        staleness: u64,
    },
    /// Member 0's record of worker `from`'s decision, to every owner: with the worker's next
    /// batch and the dispenser's state after it.
    Decided {
        from: u32,
        id: u64,
        commit: bool,
        staleness: u64,
        batch: Ranges,
        done: bool,
        snapshot: Dispenser,
    },
    Slice {
        id: u64,
        version: u64,
        batch: Option<Ranges>,
        done: bool,
        snapshot: Option<Dispenser>,
    },
    Get,
    Batch {
        batch: Ranges,
        done: bool,
        snapshot: Dispenser,
        /// A checkpoint is due and nothing is in flight: snap.
        #[serde(default)]
        checkpoint: bool,
    },
    /// The run's end: the slice's values, then its optimizer state.
    Final {
        version: u64,
    },
    Bye,
    /// A worker is at a checkpoint (its flags: a request pending, a save still uploading).
    Snap {
        pending: bool,
        busy: bool,
    },
    /// An owner's answer once every worker snapped and its queue is empty: the slice's values,
    /// then its optimizer state; the flags, any worker's.
    SnapState {
        version: u64,
        pending: bool,
        busy: bool,
    },
}

/// A message: its head, and f32 values (a gradient's or a slice's range).
struct Msg {
    head: Head,
    values: Vec<f32>,
}

/// The first error a reader met, for the client to return (so the fault report names the
/// peer it points at).
type Failure = Arc<std::sync::Mutex<Option<CommError>>>;

enum Inbox {
    Msg(u32, Msg),
    /// A reader failed: the communicator is done (the error waits in the [`Failure`]).
    Failed,
}

fn encode(head: &Head, values: &[f32]) -> Vec<u8> {
    let h = serde_json::to_vec(head).expect("a head serializes");
    let mut out = Vec::with_capacity(4 + h.len() + 4 * values.len());
    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
    out.extend_from_slice(&h);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

fn decode(b: &[u8]) -> Result<Msg, String> {
    let n = b
        .get(..4)
        .map(|x| u32::from_le_bytes(x.try_into().unwrap()) as usize)
        .ok_or("a message shorter than its head's length")?;
    let h = b.get(4..4 + n).ok_or("a message shorter than its head")?;
    let head: Head = serde_json::from_slice(h).map_err(|e| format!("a bad head: {e}"))?;
    let rest = &b[4 + n..];
    if !rest.len().is_multiple_of(4) {
        return Err("values of a length that is not a multiple of 4".into());
    }
    let values = rest
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Ok(Msg { head, values })
}

/// A slice's values, then its optimizer state (what a snap and the run's end send).
fn slice_state(owned: &Owned) -> Vec<f32> {
    let mut v = to_vec(&owned.values);
    for t in &owned.opt.state {
        v.extend(to_vec(t));
    }
    v
}

fn to_vec(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_device(Device::Cpu).to_kind(Kind::Float).contiguous())
        .unwrap_or_default()
}

/// Where messages go: a peer over the communicator, or this member's own server or client.
#[derive(Clone)]
struct Post {
    comm: Arc<dyn Communicator>,
    me: u32,
    to_server: Sender<Inbox>,
    to_client: Sender<Inbox>,
}

impl Post {
    /// To `to` over the communicator, or to this member's own side through `local`.
    fn deliver(
        &self,
        local: &Sender<Inbox>,
        to: u32,
        head: Head,
        values: &[f32],
    ) -> Result<(), CommError> {
        if to == self.me {
            let _ = local.send(Inbox::Msg(
                to,
                Msg {
                    head,
                    values: values.to_vec(),
                },
            ));
            return Ok(());
        }
        self.comm.host().send_msg(&encode(&head, values), to)
    }

    /// From this member's client to `to`'s server.
    fn to_server(&self, to: u32, head: Head, values: &[f32]) -> Result<(), CommError> {
        self.deliver(&self.to_server, to, head, values)
    }

    /// From this member's server to `to`'s client.
    fn to_client(&self, to: u32, head: Head, values: &[f32]) -> Result<(), CommError> {
        self.deliver(&self.to_client, to, head, values)
    }
}

/// The messages of peer `p`: those for this member's server and those for its client. Ends
/// after the peer's last ones (its client's goodbye and its server's final values), or when
/// the communicator fails.
fn reader(
    comm: Arc<dyn Communicator>,
    p: u32,
    server: Sender<Inbox>,
    client: Sender<Inbox>,
    failure: Failure,
) {
    let fail = |e: CommError| {
        failure.lock().unwrap().get_or_insert(e);
        let _ = server.send(Inbox::Failed);
        let _ = client.send(Inbox::Failed);
    };
    let (mut bye, mut fin) = (false, false);
    while !(bye && fin) {
        let m = match comm.host().recv_msg(p) {
            Ok(b) => match decode(&b) {
                Ok(m) => m,
                Err(e) => {
                    comm.abort();
                    let e = CommError::Protocol {
                        generation: comm.generation(),
                        op: "async message",
                        peer: p,
                        reason: e,
                    };
                    fail(e);
                    return;
                }
            },
            Err(e) => {
                fail(e);
                return;
            }
        };
        let for_server = matches!(
            m.head,
            Head::Push { .. }
                | Head::Decide { .. }
                | Head::Decided { .. }
                | Head::Get
                | Head::Bye
                | Head::Snap { .. }
        );
        bye |= matches!(m.head, Head::Bye);
        fin |= matches!(m.head, Head::Final { .. });
        let to = if for_server { &server } else { &client };
        if to.send(Inbox::Msg(p, m)).is_err() {
            return;
        }
    }
}

/// An update waiting in an owner's queue.
pub(crate) struct Reserved {
    from: u32,
    id: u64,
    grad: Vec<f32>,
    staleness: u64,
    /// Member 0's decision, with what member 0 answers the worker (its next batch and the
    /// dispenser's state).
    decided: Option<bool>,
    next: Option<(Ranges, bool, Dispenser)>,
}

/// What the owners' server needs of the job.
struct ServerCfg {
    generation: u64,
    /// Each owner writes the decisions it applied or dropped to the exactly-once ledger.
    ledger: Option<std::fs::File>,
    world: u32,
    rules: ApplyRules,
}

/// How an owner applies an update to its slice: the learning-rate schedule by global batches
/// applied (`batch` positions per update).
#[derive(Clone, Copy)]
struct ApplyRules {
    batch: u64,
    global_batch: u64,
    lr: ductile_cluster::recipe::LrPlan,
}

impl ApplyRules {
    fn apply(&self, owned: &mut Owned, grad: &[f32]) {
        let g = Tensor::from_slice(grad);
        let step = owned.version * self.batch / self.global_batch.max(1);
        let lr = self.lr.at(step);
        owned
            .opt
            .step(&[owned.values.shallow_clone()], &[g], lr, owned.version);
        owned.version += 1;
    }
}

/// Write a decision this owner applied or dropped to the ledger (`recovered`: in the next
/// generation's agreement, from the freshest dispenser).
fn record(
    ledger: &mut Option<std::fs::File>,
    generation: u64,
    owner: u32,
    r: &Reserved,
    applied: bool,
    recovered: bool,
) {
    ledger_line(
        ledger,
        serde_json::json!({"g": generation, "owner": owner, "from": r.from, "id": r.id,
            "staleness": r.staleness, "applied": applied, "recovered": recovered}),
    );
}

/// One ledger line, in one write (a member's server and worker threads share the file).
/// What a server returns at the end of its generation.
struct Served {
    owned: Owned,
    /// The dispenser (member 0) and this member's freshest copy of it.
    disp: Option<Dispenser>,
    replica: Option<Dispenser>,
    /// The updates still undecided here.
    pending: Vec<Reserved>,
}

/// The server of this member's slice (and, on member 0, the dispenser and the decisions). Runs
/// until every client said goodbye (then it sends every client its final values) or the
/// communicator failed; returns its slice, with the updates already decided applied, and the
/// undecided ones.
fn serve(
    post: Post,
    rx: Receiver<Inbox>,
    mut owned: Owned,
    mut disp: Option<Dispenser>,
    mut cfg: ServerCfg,
) -> Served {
    let mut queue: VecDeque<Reserved> = VecDeque::new();
    let mut replica: Option<Dispenser> = disp.clone();
    let mut byes = 0u32;
    let (mut snaps, mut snap_flags) = (0u32, (false, false));
    // the snaps answered in this generation (the ledger counts them)
    let mut snapped = 0u64;
    let rules = cfg.rules;
    let me = post.me;
    while let Ok(Inbox::Msg(from, Msg { head, values })) = rx.recv() {
        let mut sent = match head {
            Head::Push { id, version } => {
                let staleness = (owned.version + queue.len() as u64).saturating_sub(version);
                queue.push_back(Reserved {
                    from,
                    id,
                    grad: values,
                    staleness,
                    decided: None,
                    next: None,
                });
                post.to_client(from, Head::Ack { id, staleness }, &[])
            }
            Head::Decide {
                id,
                commit,
                staleness,
            } => match disp.as_mut() {
                None => Err(out_of_step(
                    &post,
                    from,
                    "sent its decision to a member other than 0",
                )),
                Some(d) => {
                    // the one place the decision is made: settled, then sent to every owner
                    // (the others first, this member's own server last)
                    let before = d.applied;
                    d.settle(from, id, commit, staleness);
                    let cut = crate::faults::exit_mid_decide(before, d.applied);
                    let batch = d.hand_out(from, rules.batch);
                    let head = |d: &Dispenser| Head::Decided {
                        from,
                        id,
                        commit,
                        staleness,
                        batch: batch.clone(),
                        done: d.done(),
                        snapshot: d.clone(),
                    };
                    let owners: Vec<u32> =
                        (0..cfg.world).filter(|j| *j != me).chain([me]).collect();
                    let mut res = Ok(());
                    for (k, j) in owners.into_iter().enumerate() {
                        if cut && k == 1 {
                            crate::faults::exit_now(
                                "member 0 recorded a decision and sent it to one owner only",
                            );
                        }
                        res = res.and(post.to_server(j, head(d), &[]));
                    }
                    res
                }
            },
            Head::Decided {
                from: client,
                id,
                commit,
                staleness,
                batch,
                done,
                snapshot,
            } => {
                if replica.as_ref().is_none_or(|r| r.seq < snapshot.seq) {
                    replica = Some(snapshot.clone());
                }
                match queue.iter_mut().find(|r| r.from == client && r.id == id) {
                    Some(r) => {
                        r.decided = Some(commit);
                        // the staleness over every slice, for the record
                        r.staleness = r.staleness.max(staleness);
                        r.next = Some((batch, done, snapshot));
                    }
                    None => tracing::warn!(
                        client,
                        id,
                        "a decision on an update this owner does not hold: ignored"
                    ),
                }
                let mut res = Ok(());
                while queue.front().is_some_and(|r| r.decided.is_some()) {
                    let r = queue.pop_front().unwrap();
                    let commit = r.decided == Some(true);
                    if commit {
                        rules.apply(&mut owned, &r.grad);
                    }
                    record(&mut cfg.ledger, cfg.generation, me, &r, commit, false);
                    // member 0's answer carries the worker's next batch and the dispenser
                    let (batch, done, snapshot) = match (me, r.next) {
                        (0, Some((b, d, s))) => (Some(b), d, Some(s)),
                        _ => (None, false, None),
                    };
                    let head = Head::Slice {
                        id: r.id,
                        version: owned.version,
                        batch,
                        done,
                        snapshot,
                    };
                    res = res.and(post.to_client(r.from, head, &to_vec(&owned.values)));
                }
                res
            }
            Head::Get => match disp.as_mut() {
                None => Err(out_of_step(
                    &post,
                    from,
                    "asked a member other than 0 for a batch",
                )),
                Some(d) => {
                    let batch = if d.outstanding.contains_key(&from) {
                        Vec::new()
                    } else {
                        d.hand_out(from, rules.batch)
                    };
                    let head = Head::Batch {
                        batch,
                        done: d.done(),
                        snapshot: d.clone(),
                        checkpoint: d.snap_due(),
                    };
                    post.to_client(from, head, &[])
                }
            },
            Head::Bye => {
                byes += 1;
                if byes == cfg.world {
                    let v = slice_state(&owned);
                    // the final state, like a snap's, for the ledger
                    ledger_line(
                        &mut cfg.ledger,
                        serde_json::json!({"g": cfg.generation, "owner": me, "snap": snapped + 1}),
                    );
                    let mut res = Ok(());
                    // the remote clients first, this member's own last
                    for to in (0..cfg.world).filter(|t| *t != me).chain([me]) {
                        res = res.and(post.to_client(
                            to,
                            Head::Final {
                                version: owned.version,
                            },
                            &v,
                        ));
                    }
                    let _ = res;
                    break;
                }
                Ok(())
            }
            Head::Snap { pending, busy } => {
                snaps += 1;
                snap_flags = (snap_flags.0 || pending, snap_flags.1 || busy);
                Ok(())
            }
            other => {
                tracing::warn!(
                    ?other,
                    from,
                    "a client's message reached the server: ignored"
                );
                Ok(())
            }
        };
        // a checkpoint: every worker snapped and every decided update is applied here (a
        // decision member 0 sent may arrive after a worker's snap)
        if snaps == cfg.world && queue.is_empty() {
            let v = slice_state(&owned);
            snapped += 1;
            ledger_line(
                &mut cfg.ledger,
                serde_json::json!({"g": cfg.generation, "owner": me, "snap": snapped}),
            );
            let head = || Head::SnapState {
                version: owned.version,
                pending: snap_flags.0,
                busy: snap_flags.1,
            };
            for to in (0..cfg.world).filter(|t| *t != me).chain([me]) {
                sent = sent.and(post.to_client(to, head(), &v));
            }
            if let Some(d) = &mut disp {
                d.schedule_checkpoint();
            }
            (snaps, snap_flags) = (0, (false, false));
        }
        if sent.is_err() {
            break;
        }
    }
    // the updates decided before the end are applied in queue order up to the first
    // undecided one; that one and those behind it are kept for the agreement (member 0 may
    // have decided it, and another owner applied it), still in queue order (so none is
    // applied staler than its σ)
    let mut pending = Vec::new();
    for r in queue {
        match r.decided {
            Some(commit) if pending.is_empty() => {
                if commit {
                    rules.apply(&mut owned, &r.grad);
                }
                record(&mut cfg.ledger, cfg.generation, me, &r, commit, false);
            }
            _ => pending.push(r),
        }
    }
    if let Some(d) = &disp {
        replica = Some(d.clone());
    }
    Served {
        owned,
        disp,
        replica,
        pending,
    }
}

/// A peer sent member-0 business to another member: abort the generation, naming it.
fn out_of_step(post: &Post, from: u32, what: &str) -> CommError {
    tracing::error!(
        from,
        "a peer {what}: only member 0 dispenses and decides; aborting the generation"
    );
    post.comm.abort();
    CommError::Protocol {
        generation: post.comm.generation(),
        op: "async",
        peer: from,
        reason: what.into(),
    }
}

impl Async {
    /// The agreement at the start of an async generation (module docs).
    pub(super) fn async_agree(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> anyhow::Result<Result<(), CommError>> {
        t.received = 0;
        let rank = comm.rank();
        let max = t.max_size.max(g.world_size) as usize;
        // [holds, its generation, its world, its rank, owns a slice, holds the dispenser,
        //  snapshot seq, versions seen of each slice (max entries)]
        let mut row = vec![
            self.holds as u8 as f64,
            self.generation as f64,
            self.world as f64,
            self.rank as f64,
            self.owned.is_some() as u8 as f64,
            self.dispenser.is_some() as u8 as f64,
            self.dispenser
                .iter()
                .chain(&self.snapshot)
                .map(|s| s.seq as f64)
                .fold(-1.0, f64::max),
        ];
        for k in 0..max {
            row.push(self.seen.get(k).map(|v| *v as f64).unwrap_or(-1.0));
        }
        let rows = match super::gather_rows(comm.as_ref(), &row) {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        let newest = rows
            .iter()
            .filter(|r| r[0] > 0.0)
            .map(|r| r[1] as u64)
            .max();
        let n = t.numel();
        let per = t.opt.state.len() / t.params.len().max(1);
        let end = t.run_positions();
        // this member's copy, flattened (the seed's at a cold start)
        let copy = super::flat(&t.params).detach().to_device(Device::Cpu);
        // the whole flattened state every member rebuilds: values, then each optimizer state
        let mut values = Tensor::zeros([n as i64], (Kind::Float, Device::Cpu));
        let opt_full: Vec<Tensor> = (0..per)
            .map(|_| Tensor::zeros([n as i64], (Kind::Float, Device::Cpu)))
            .collect();
        let mut version = 0u64;
        let mut disp: Dispenser;
        // the step restored, and the generation that took that checkpoint
        let mut restored_step: Option<(u64, Option<u64>)> = None;
        match newest {
            None => {
                // a cold start: the latest checkpoint's state and dispenser, else the seed's
                // weights (every member has them) and a fresh dispenser
                let restored = match self.async_restore(t, comm, g) {
                    Ok(Ok(r)) => r,
                    Ok(Err(e)) => return Ok(Err(e)),
                    Err(e) => return Err(e),
                };
                match restored {
                    Some((d, v, taken_in)) => {
                        restored_step = Some((t.step, taken_in));
                        values = super::flat(&t.params).detach().to_device(Device::Cpu);
                        for (k, o) in opt_full.iter().enumerate() {
                            let state: Vec<Tensor> = (0..t.params.len())
                                .map(|i| t.opt.state[per * i + k].shallow_clone())
                                .collect();
                            tch::no_grad(|| {
                                o.shallow_clone()
                                    .copy_(&super::flat(&state).detach().to_device(Device::Cpu))
                            });
                        }
                        disp = d;
                        version = v;
                        // the checkpoint was taken at its due point: the next one is further on
                        disp.ckpt_next = 0;
                    }
                    None => {
                        // the seed's, or the model directory's when it loaded them
                        values = super::flat(&t.params).detach().to_device(Device::Cpu);
                        disp = Dispenser {
                            end,
                            ..Default::default()
                        };
                    }
                }
            }
            Some(gen) => {
                let holder = |r: &Vec<f64>| r[0] > 0.0 && r[1] as u64 == gen;
                let old_world = rows.iter().find(|r| holder(r)).unwrap()[2] as usize;
                // the dispenser: the freshest copy (old member 0's if it stayed), among the
                // members of the newest generation first
                let fresher = |x: &usize, y: &usize| {
                    (rows[*x][6], std::cmp::Reverse(*x))
                        .partial_cmp(&(rows[*y][6], std::cmp::Reverse(*y)))
                        .unwrap()
                };
                let src = (0..rows.len())
                    .filter(|i| holder(&rows[*i]) && rows[*i][6] >= 0.0)
                    .max_by(fresher)
                    .or_else(|| {
                        (0..rows.len())
                            .filter(|i| rows[*i][6] >= 0.0)
                            .max_by(fresher)
                    });
                disp = match src {
                    Some(src) => {
                        let mut bytes = Vec::new();
                        if rank == src as u32 {
                            let d = self
                                .dispenser
                                .iter()
                                .chain(&self.snapshot)
                                .max_by_key(|d| d.seq)
                                .unwrap();
                            bytes = serde_json::to_vec(d)?;
                        }
                        if let Err(e) = comm.host().broadcast_vec(&mut bytes, src as u32) {
                            return Ok(Err(e));
                        }
                        serde_json::from_slice(&bytes)
                            .map_err(|e| anyhow::anyhow!("the dispenser rank {src} sent: {e}"))?
                    }
                    None => anyhow::bail!(
                        "no member holds the async job's data position (nor a copy of it): cannot go on without repeating or skipping samples"
                    ),
                };
                // the updates this owner kept undecided: member 0 may have decided them (and
                // another owner applied them); the freshest dispenser holds every decision any
                // member here applied
                let pending = std::mem::take(&mut self.pending);
                if let (Some(o), true) = (self.owned.as_mut(), self.generation == gen) {
                    let rules = ApplyRules {
                        batch: (t.spec.global_batch as u64).div_ceil(old_world.max(1) as u64),
                        global_batch: t.spec.global_batch as u64,
                        lr: t.spec.lr_plan(),
                    };
                    for r in &pending {
                        // decided here already (queued behind an undecided one), or by member
                        // 0 as its freshest dispenser records
                        let learned = disp
                            .decided
                            .get(&r.from)
                            .filter(|(id, _)| *id == r.id)
                            .map(|(_, c)| *c);
                        let Some(commit) = r.decided.or(learned) else {
                            continue;
                        };
                        if commit {
                            rules.apply(o, &r.grad);
                        }
                        let recovered = r.decided.is_none();
                        record(&mut t.ledger, gen, self.rank, r, commit, recovered);
                        if recovered {
                            tracing::info!(
                                from = r.from,
                                id = r.id,
                                commit,
                                "an update member 0 decided reached this owner only through the agreement: settled now"
                            );
                        }
                    }
                }
                disp.requeue_outstanding();
                let old = ranges(n, old_world);
                for (k, rk) in old.iter().enumerate() {
                    // its owner if it stayed, else the freshest copy
                    let owner = rows
                        .iter()
                        .position(|r| holder(r) && r[4] > 0.0 && r[3] as usize == k);
                    let src = owner.unwrap_or_else(|| {
                        (0..rows.len())
                            .filter(|i| holder(&rows[*i]))
                            .max_by(|x, y| {
                                rows[*x][7 + k]
                                    .partial_cmp(&rows[*y][7 + k])
                                    .unwrap()
                                    .then(y.cmp(x))
                            })
                            .unwrap()
                    }) as u32;
                    let len = rk.len() as i64;
                    let mut buf =
                        Tensor::zeros([len * (1 + per as i64) + 1], (Kind::Float, Device::Cpu));
                    if rank == src {
                        let mut parts: Vec<Tensor> = Vec::new();
                        match (&self.owned, owner.is_some()) {
                            (Some(o), true) => {
                                parts.push(o.values.shallow_clone());
                                parts.extend(o.opt.state.iter().map(|t| t.reshape([-1])));
                                parts.push(Tensor::from_slice(&[o.version as f32]));
                            }
                            _ => {
                                parts.push(copy.narrow(0, rk.start as i64, len));
                                for _ in 0..per {
                                    parts.push(Tensor::zeros([len], (Kind::Float, Device::Cpu)));
                                }
                                let v = self.seen.get(k).copied().unwrap_or(0);
                                parts.push(Tensor::from_slice(&[v as f32]));
                            }
                        }
                        buf = Tensor::cat(&parts, 0);
                    }
                    let mut placed = comm.place(&buf);
                    if let Err(e) = comm.broadcast(&mut placed, src) {
                        return Ok(Err(e));
                    }
                    let buf = placed.into_tensor();
                    if rank != src {
                        t.received += buf.numel() as u64 * 4;
                    }
                    tch::no_grad(|| {
                        values
                            .narrow(0, rk.start as i64, len)
                            .copy_(&buf.narrow(0, 0, len));
                        for (i, o) in opt_full.iter().enumerate() {
                            o.narrow(0, rk.start as i64, len).copy_(&buf.narrow(
                                0,
                                len * (1 + i as i64),
                                len,
                            ));
                        }
                    });
                    let v = buf.double_value(&[len * (1 + per as i64)]) as u64;
                    version = version.max(v);
                    if owner.is_none() {
                        tracing::warn!(
                            slice = k,
                            from = src,
                            version = v,
                            "the slice's owner left: its freshest copy takes its place (its optimizer state starts anew)"
                        );
                    }
                }
            }
        }
        // checkpoints every `interval` global batches applied
        disp.ckpt_every = t
            .ckpt
            .as_ref()
            .map(|c| c.spec.interval * t.spec.global_batch as u64)
            .unwrap_or(0);
        if disp.ckpt_every > 0 && disp.ckpt_next == 0 {
            disp.schedule_checkpoint();
        }
        // this generation's slices
        let mine = ranges(n, g.world_size as usize)[rank as usize].clone();
        let len = mine.len() as i64;
        let slice = values.narrow(0, mine.start as i64, len).copy();
        let mut opt = Optimizer::new(&t.spec.optimizer, &[slice.shallow_clone()]);
        tch::no_grad(|| {
            for (s, o) in opt.state.iter_mut().zip(&opt_full) {
                s.copy_(&o.narrow(0, mine.start as i64, len));
            }
        });
        // every member's copy is the rebuilt state
        tch::no_grad(|| {
            let mut at = 0i64;
            for p in &t.params {
                let k = p.numel() as i64;
                p.shallow_clone().copy_(
                    &values
                        .narrow(0, at, k)
                        .view(p.size().as_slice())
                        .to_device(p.device()),
                );
                at += k;
            }
        });
        self.holds = true;
        self.generation = g.number;
        self.world = g.world_size;
        self.rank = rank;
        self.owned = Some(Owned {
            range: mine,
            values: slice,
            opt,
            version,
        });
        self.seen = vec![version; g.world_size as usize];
        self.snapshot = Some(disp.clone());
        self.dispenser = (rank == 0).then_some(disp);
        let applied = self.snapshot.as_ref().unwrap().applied;
        t.step = applied / t.spec.global_batch as u64;
        // where this generation's state came from: a generation's members, or a checkpoint
        ledger_line(
            &mut t.ledger,
            serde_json::json!({"g": g.number, "r": rank, "agreed": true, "from": newest,
                "restored": restored_step.map(|r| r.0), "restored_from": restored_step.and_then(|r| r.1)}),
        );
        Ok(Ok(()))
    }

    /// A cold start's restore (every member restores the whole state, as a data-parallel
    /// one): the dispenser and the slices' version from the checkpoint's `extra.async`, or none
    /// without a checkpoint (then the model directory's weights for `init = "pretrained"`).
    fn async_restore(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> anyhow::Result<Result<Option<(Dispenser, u64, Option<u64>)>, CommError>> {
        t.restored_extra = None;
        if t.ckpt.is_some() {
            if let Err(e) = t.restore_whole(comm, g)? {
                return Ok(Err(e));
            }
        }
        let Some(x) = t.restored_extra.take() else {
            // no commit: the model directory's weights (`init = "pretrained"`), else the seed's
            if t.pretrained() {
                if let Err(e) = t.load_pretrained_whole(comm, g)? {
                    return Ok(Err(e));
                }
            }
            return Ok(Ok(None));
        };
        let x = &x["async"];
        let disp: Dispenser = serde_json::from_value(x["dispenser"].clone()).map_err(|e| {
            anyhow::anyhow!(
                "the checkpoint's extra.async.dispenser (an async job's data position): {e}"
            )
        })?;
        let version = x["version"]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("the checkpoint's extra.async.version is missing"))?;
        Ok(Ok(Some((disp, version, x["generation"].as_u64()))))
    }

    /// Start generation `g`'s engine: this member's server thread (its slice and, for member
    /// 0, the dispenser) and a reader per peer.
    fn start(&mut self, t: &mut Trainer, comm: &Arc<dyn Communicator>, g: &Generation, rank: u32) {
        let world = g.world_size;
        let (server_tx, server_rx) = channel::<Inbox>();
        let (client_tx, client_rx) = channel::<Inbox>();
        let post = Post {
            comm: comm.clone(),
            me: rank,
            to_server: server_tx.clone(),
            to_client: client_tx.clone(),
        };
        let failure = Failure::default();
        self.failure = failure.clone();
        self.snaps = 0;
        let readers: Vec<_> = (0..world)
            .filter(|p| *p != rank)
            .map(|p| {
                let (c, s, t) = (comm.clone(), server_tx.clone(), client_tx.clone());
                let f = failure.clone();
                std::thread::spawn(move || reader(c, p, s, t, f))
            })
            .collect();
        let owned = self
            .owned
            .take()
            .expect("the agreement gave this member its slice");
        let disp = self.dispenser.take();
        let cfg = ServerCfg {
            generation: g.number,
            ledger: t.ledger.as_ref().and_then(|f| f.try_clone().ok()),
            world,
            rules: ApplyRules {
                batch: (t.spec.global_batch as u64).div_ceil(world as u64),
                global_batch: t.spec.global_batch as u64,
                lr: t.spec.lr_plan(),
            },
        };
        let server = {
            let post = post.clone();
            std::thread::spawn(move || serve(post, server_rx, owned, disp, cfg))
        };
        drop(server_tx);
        self.engine = Some(Engine {
            post,
            rx: client_rx,
            server,
            readers,
            slices: ranges(t.numel(), world as usize),
            next: None,
            applied: self.snapshot.as_ref().map(|d| d.applied).unwrap_or(0),
            loss_sum: 0.0,
            loss_n: 0,
        });
    }

    /// Stop the engine: after an error the communicator is aborted (the server and the readers
    /// end with it); the server hands back the slice, the dispenser and the undecided updates.
    fn stop(&mut self, comm: &Arc<dyn Communicator>, failed: bool) -> Result<(), CommError> {
        let Some(e) = self.engine.take() else {
            return Ok(());
        };
        if failed {
            comm.abort();
            let _ = e.post.to_server.send(Inbox::Failed);
        }
        let served = e.server.join();
        for r in e.readers {
            let _ = r.join();
        }
        let Ok(served) = served else {
            // this member's slice is gone with the thread: the next generation takes the
            // freshest copy from its peers, as when an owner leaves
            comm.abort();
            self.owned = None;
            self.dispenser = None;
            self.pending.clear();
            return Err(CommError::Invalid {
                op: "async",
                reason: "the async server thread panicked; this member's slice goes to the freshest copy".into(),
            });
        };
        self.owned = Some(served.owned);
        self.dispenser = served.disp;
        self.pending = served.pending;
        if let Some(r) = served.replica {
            if self.snapshot.as_ref().is_none_or(|s| s.seq < r.seq) {
                self.snapshot = Some(r);
            }
        }
        Ok(())
    }

    /// Wait for the next message to this member's client (bounded: a newer generation or a
    /// failed reader ends the wait with an error).
    fn next_msg(
        &self,
        t: &Trainer,
        rx: &Receiver<Inbox>,
        g: &Generation,
    ) -> Result<(u32, Msg), CommError> {
        let t0 = Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(Inbox::Msg(from, m)) => return Ok((from, m)),
                Ok(Inbox::Failed) => {
                    let failure = &self.failure;
                    return Err(failure
                        .lock()
                        .unwrap()
                        .take()
                        .unwrap_or(CommError::Aborted {
                            generation: g.number,
                            op: "async",
                        }));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(CommError::Aborted {
                        generation: g.number,
                        op: "async",
                    })
                }
                Err(RecvTimeoutError::Timeout) => {
                    if t.cell.newest() > g.number {
                        return Err(CommError::Aborted {
                            generation: g.number,
                            op: "async",
                        });
                    }
                    if t0.elapsed() > Duration::from_secs(300) {
                        return Err(CommError::Invalid {
                            op: "async",
                            reason: "no answer from the owners within 300 s".into(),
                        });
                    }
                }
            }
        }
    }

    /// One unit of the client's work: an update (its gradient pushed to every owner, the
    /// decision, the fresh slices), a checkpoint's snap, a wait for work, or the run's end.
    fn work(
        &mut self,
        t: &mut Trainer,
        e: &mut Engine,
        g: &Generation,
        rank: u32,
    ) -> Result<Worked, CommError> {
        let world = g.world_size as usize;
        let s = t.spec.async_.staleness as u64;
        let b = t.spec.global_batch as u64;
        let (mut batch, mut done, snap) = match e.next.take() {
            Some(next) => next,
            None => self.get_batch(t, &e.post, &e.rx, g)?,
        };
        if done {
            self.finish(t, e, g, rank)?;
            return Ok(Worked::default());
        }
        // a newer generation ends this one (the messages of a busy engine never leave the
        // reply wait idle long enough to look, and a world of one sends none)
        if t.cell.newest() > g.number {
            return Err(CommError::Aborted {
                generation: g.number,
                op: "async",
            });
        }
        if batch.is_empty() {
            if snap {
                // a checkpoint is due and nothing is in flight
                t.flags = self.snap(t, e, g, rank)?;
                return Ok(Worked {
                    checkpoint: true,
                    ..Default::default()
                });
            }
            // everything is handed out (or a checkpoint waits for the batches in flight), not
            // all applied yet: ask again shortly
            std::thread::sleep(Duration::from_millis(20));
            return Ok(Worked::default());
        }
        let t0 = Instant::now();
        let (idx, l) = t.backward_on(&batch);
        e.loss_sum += l;
        e.loss_n += idx.len() as u64;
        let flat = Tensor::cat(&t.grad_parts(0..t.params.len()), 0);
        t.clip_own(std::slice::from_ref(&flat));
        let grad = to_vec(&flat);
        t.computed_for(rank, t0);
        self.next_id += 1;
        let id = self.next_id;
        let seen = self.seen.clone();
        ledger_line(
            &mut t.ledger,
            serde_json::json!({"g": g.number, "r": rank, "id": id, "idx": idx, "pushed": true}),
        );
        for (j, r) in e.slices.iter().enumerate() {
            e.post.to_server(
                j as u32,
                Head::Push {
                    id,
                    version: seen[j],
                },
                &grad[r.clone()],
            )?;
        }
        let mut sigma = 0u64;
        let mut acks = 0;
        while acks < world {
            match self.next_msg(t, &e.rx, g)? {
                (
                    _,
                    Msg {
                        head: Head::Ack { id: x, staleness },
                        ..
                    },
                ) if x == id => {
                    sigma = sigma.max(staleness);
                    acks += 1;
                }
                (from, m) => return Err(unexpected(g, from, &m.head)),
            }
        }
        // decided once, at member 0, which sends it to every owner
        let commit = sigma <= s;
        e.post.to_server(
            0,
            Head::Decide {
                id,
                commit,
                staleness: sigma,
            },
            &[],
        )?;
        let mut answers = 0;
        while answers < world {
            match self.next_msg(t, &e.rx, g)? {
                (
                    from,
                    Msg {
                        head:
                            Head::Slice {
                                id: x,
                                version,
                                batch: next,
                                done: d,
                                snapshot,
                            },
                        values,
                    },
                ) if x == id => {
                    copy_slice(t, g, from, &e.slices[from as usize], &values)?;
                    self.seen[from as usize] = version;
                    if let Some(next) = next {
                        batch = next;
                        done = d;
                    }
                    if let Some(sn) = snapshot {
                        self.snapshot = Some(sn);
                    }
                    answers += 1;
                }
                (from, m) => return Err(unexpected(g, from, &m.head)),
            }
        }
        e.next = Some((batch, done, snap));
        let applied = self.snapshot.as_ref().map(|d| d.applied).unwrap_or(0);
        t.step = applied / b;
        let samples = applied.saturating_sub(e.applied);
        e.applied = applied;
        Ok(Worked {
            steps: 1,
            commit: Some(Commit {
                loss: l / idx.len().max(1) as f64,
                samples,
            }),
            checkpoint: false,
        })
    }

    /// The run's end: goodbye to every server (this member's own last), then every slice's
    /// final values and optimizer state (the final save is whole).
    fn finish(
        &mut self,
        t: &mut Trainer,
        e: &mut Engine,
        g: &Generation,
        rank: u32,
    ) -> Result<(), CommError> {
        let world = g.world_size;
        for j in (0..world).filter(|j| *j != rank).chain([rank]) {
            e.post.to_server(j, Head::Bye, &[])?;
        }
        let mut finals = 0;
        while finals < world {
            match self.next_msg(t, &e.rx, g)? {
                (
                    from,
                    Msg {
                        head: Head::Final { version },
                        values,
                    },
                ) => {
                    copy_state(t, g, from, &e.slices[from as usize], &values)?;
                    self.ckpt_version = self.ckpt_version.max(version);
                    finals += 1;
                }
                // answers to a last Get may still arrive
                (
                    _,
                    Msg {
                        head: Head::Batch { .. },
                        ..
                    },
                ) => {}
                (from, m) => return Err(unexpected(g, from, &m.head)),
            }
        }
        if let Some(m) = t.spec.max_steps {
            t.step = m;
        }
        let k = self.snaps + 1;
        ledger_line(
            &mut t.ledger,
            serde_json::json!({"g": g.number, "r": rank, "snapped": k, "step": t.step}),
        );
        self.over = true;
        Ok(())
    }

    /// Ask member 0 for a batch: (the batch, whether the run is done, whether to snap for a
    /// checkpoint).
    fn get_batch(
        &mut self,
        t: &mut Trainer,
        post: &Post,
        rx: &Receiver<Inbox>,
        g: &Generation,
    ) -> Result<(Ranges, bool, bool), CommError> {
        post.to_server(0, Head::Get, &[])?;
        match self.next_msg(t, rx, g)? {
            (
                0,
                Msg {
                    head:
                        Head::Batch {
                            batch,
                            done,
                            snapshot,
                            checkpoint,
                        },
                    ..
                },
            ) => {
                self.snapshot = Some(snapshot);
                Ok((batch, done, checkpoint))
            }
            (from, m) => Err(unexpected(g, from, &m.head)),
        }
    }

    /// A checkpoint (module docs): snap to every owner and take the whole state from their
    /// answers; the driver then saves this member's share of it with the flags returned (a
    /// request pending, a save still uploading: any worker's).
    fn snap(
        &mut self,
        t: &mut Trainer,
        e: &Engine,
        g: &Generation,
        rank: u32,
    ) -> Result<(bool, bool), CommError> {
        let (post, rx, slices) = (&e.post, &e.rx, &e.slices);
        let (pending, busy) = t.ckpt_flags(g.number);
        let world = slices.len() as u32;
        for j in (0..world).filter(|j| *j != rank).chain([rank]) {
            let head = Head::Snap {
                pending: pending > 0.0,
                busy: busy > 0.0,
            };
            post.to_server(j, head, &[])?;
        }
        let (mut got, mut version, mut flags) = (0, 0u64, (false, false));
        while got < world {
            match self.next_msg(t, rx, g)? {
                (
                    from,
                    Msg {
                        head:
                            Head::SnapState {
                                version: v,
                                pending,
                                busy,
                            },
                        values,
                    },
                ) => {
                    copy_state(t, g, from, &slices[from as usize], &values)?;
                    self.seen[from as usize] = v;
                    version = version.max(v);
                    flags = (pending, busy);
                    got += 1;
                }
                // a last answer to a Get
                (
                    _,
                    Msg {
                        head: Head::Batch { .. },
                        ..
                    },
                ) => {}
                (from, m) => return Err(unexpected(g, from, &m.head)),
            }
        }
        self.ckpt_version = version;
        let applied = self.snapshot.as_ref().map(|d| d.applied).unwrap_or(0);
        t.step = applied / t.spec.global_batch as u64;
        if rank == 0 {
            println!(
                "async checkpoint at step {} ({applied} positions applied): every worker holds the whole state",
                t.step
            );
        }
        self.snaps += 1;
        let k = self.snaps;
        ledger_line(
            &mut t.ledger,
            serde_json::json!({"g": g.number, "r": rank, "snapped": k, "step": t.step}),
        );
        Ok(flags)
    }
}

impl Mode for Async {
    fn agree(
        &mut self,
        t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        g: &Generation,
    ) -> anyhow::Result<Result<(), CommError>> {
        self.async_agree(t, comm, g)
    }

    fn begin(&mut self, t: &mut Trainer, comm: &Arc<dyn Communicator>, g: &Generation, rank: u32) {
        self.start(t, comm, g, rank);
    }

    fn finished(&self, _t: &Trainer) -> bool {
        self.over
    }

    fn advance(
        &mut self,
        t: &mut Trainer,
        _comm: &Arc<dyn Communicator>,
        g: &Generation,
        me: &Member,
    ) -> Result<Worked, CommError> {
        let mut e = self.engine.take().expect("begin started the engine");
        let worked = self.work(t, &mut e, g, me.rank);
        self.engine = Some(e);
        worked
    }

    fn end(
        &mut self,
        _t: &mut Trainer,
        comm: &Arc<dyn Communicator>,
        out: Result<(), CommError>,
    ) -> Result<(), CommError> {
        let stopped = self.stop(comm, out.is_err());
        out.and(stopped)
    }

    /// Called at a checkpoint's snap, which member 0 made due.
    fn save_due(&self, _t: &Trainer, _interval: u64) -> bool {
        true
    }

    /// The data dispenser (positions applied, re-queued, the next fresh one) and the slices'
    /// update count (the learning-rate schedule's and AdamW's step).
    fn extra(&self, _t: &Trainer, g: &Generation) -> Option<(&'static str, serde_json::Value)> {
        Some((
            "async",
            serde_json::json!({
                "dispenser": self.snapshot,
                "version": self.ckpt_version,
                "generation": g.number,
            }),
        ))
    }

    /// The loss is the mean over the updates since the last report.
    fn report(&mut self, _t: &Trainer, p: &mut Progress) {
        let snap = self.snapshot.clone().unwrap_or_default();
        if let Some(e) = &mut self.engine {
            p.loss = Some(e.loss_sum / e.loss_n.max(1) as f64);
            (e.loss_sum, e.loss_n) = (0.0, 0);
        }
        p.sync = Some("async".into());
        p.staleness_mean = (snap.stale_n > 0).then(|| snap.stale_sum as f64 / snap.stale_n as f64);
        p.staleness_max = Some(snap.stale_max);
        p.dropped_updates = Some(snap.dropped);
    }
}

/// Copy the values and the optimizer state of slice `r` that member `from` sent (a snap's
/// or the run's end) into this member's parameters and optimizer.
fn copy_state(
    t: &Trainer,
    g: &Generation,
    from: u32,
    r: &Range<usize>,
    values: &[f32],
) -> Result<(), CommError> {
    let per = t.opt.state.len() / t.params.len().max(1);
    if values.len() != r.len() * (1 + per) {
        return Err(CommError::Protocol {
            generation: g.number,
            op: "async",
            peer: from,
            reason: format!(
                "{} values for a slice of {} with {per} optimizer tensors",
                values.len(),
                r.len()
            ),
        });
    }
    let (head, rest) = values.split_at(r.len());
    copy_slice(t, g, from, r, head)?;
    for (k, part) in rest.chunks(r.len().max(1)).enumerate().take(per) {
        let state: Vec<Tensor> = (0..t.params.len())
            .map(|i| t.opt.state[per * i + k].shallow_clone())
            .collect();
        copy_into(&state, r, part);
    }
    Ok(())
}

/// Copy the values of slice `r` that member `from` sent into this member's parameters
/// (values of another length are a protocol error naming it).
fn copy_slice(
    t: &Trainer,
    g: &Generation,
    from: u32,
    r: &Range<usize>,
    values: &[f32],
) -> Result<(), CommError> {
    if values.len() != r.len() {
        return Err(CommError::Protocol {
            generation: g.number,
            op: "async",
            peer: from,
            reason: format!("{} values for a slice of {}", values.len(), r.len()),
        });
    }
    copy_into(&t.params, r, values);
    Ok(())
}

/// Copy `values` into range `r` of the flattened `tensors`.
fn copy_into(tensors: &[Tensor], r: &Range<usize>, values: &[f32]) {
    let src = Tensor::from_slice(values);
    let mut at = 0i64;
    tch::no_grad(|| {
        for mut v in super::flat_views(tensors, r) {
            let n = v.numel() as i64;
            v.copy_(&src.narrow(0, at, n).to_device(v.device()));
            at += n;
        }
    });
}

fn unexpected(g: &Generation, from: u32, head: &Head) -> CommError {
    CommError::Protocol {
        generation: g.number,
        op: "async",
        peer: from,
        reason: format!("an unexpected message {head:?}"),
    }
}

//! The reconciler's decision, as a pure function of desired state (the job spec) and observed
//! state (live nodes, drains, failed slots, the current generation). It is idempotent: given
//! the state it produced, it asks for nothing more, so a new leader continues where the old one
//! stopped.

use std::collections::{BTreeMap, BTreeSet};

use ductile_cluster::kv::Revision;
use ductile_cluster::records::*;

/// Everything observed about one job.
#[derive(Clone, Debug, Default)]
pub struct JobObs {
    pub spec: Option<JobSpec>,
    pub spec_revision: Revision,
    /// The etcd revision that created the job's spec: unique to this job in the cluster for
    /// its life (a job submitted again under the name is a new one), the number agents derive
    /// its Unix identity from (`job_users`).
    pub spec_created: Revision,
    pub status: Option<JobStatus>,
    pub status_revision: Revision,
    /// The highest generation number ever published for this job name.
    pub last_number: u64,
    pub generation: Option<(Generation, Revision)>,
    /// Slots whose worker failed, with the record the agent wrote.
    pub failed: BTreeMap<(String, u32), SlotHealth>,
    pub workers: BTreeMap<(String, u32), WorkerRecord>,
    /// Joins of the current generation, by rank.
    pub joined: BTreeMap<u32, JoinRecord>,
    pub progress: Option<Progress>,
    pub stop_requested: bool,
    /// The latest committed checkpoint, the last checkpoint request and the workers' figures.
    pub checkpoint: Option<CheckpointRecord>,
    pub checkpoint_request: Option<CheckpointRequest>,
    pub checkpoint_stats: Option<CheckpointStats>,
    /// Fault reports of the current generation, by rank.
    pub faults: BTreeMap<u32, FaultReport>,
    /// How long ago, on the leader's clock, the first of `faults` was seen.
    pub faults_seen_ms: u64,
    /// How long, on the leader's clock, the current generation has gone without a new step
    /// since the leader saw its last one (or saw the generation); None when not known.
    pub stalled_ms: Option<u64>,
    /// Restarts taken from the job's budget so far.
    pub restarts_used: u32,
    /// The etcd user of the job's workers (etcd auth on).
    pub access: Option<JobAccess>,
    /// Each rank's step figures in the current generation.
    pub rank_stats: BTreeMap<u32, RankStats>,
    /// Keys and bytes (keys' and values') the job's workers hold under `live/{job}/`.
    pub live_keys: u64,
    pub live_bytes: u64,
    /// For each (node, slot) of the current generation, the first generation of its unbroken
    /// run of membership (from the history kept in etcd).
    pub member_since: BTreeMap<(String, u32), u64>,
}

impl JobObs {
    /// Submitted, not asked to stop, not ended: its generation holds slots and agents run it.
    pub fn is_active(&self) -> bool {
        self.spec.is_some()
            && !self.stop_requested
            && !self.status.as_ref().is_some_and(|s| s.state.is_terminal())
    }
}

/// Live membership: nodes with their records, and the nodes asked to drain.
#[derive(Clone, Debug, Default)]
pub struct Fleet {
    pub nodes: BTreeMap<String, NodeRecord>,
    pub drain_requests: BTreeSet<String>,
    /// Leaving nodes' deadlines on the leader's clock (unix ms): when the leader saw the drain
    /// plus the agent's `drain_timeout_ms`.
    pub drain_deadlines: BTreeMap<String, u64>,
    /// Slots held by the current generation of an active job, and which job: a slot (a GPU,
    /// or a CPU slot) runs one job's worker at a time.
    pub held: BTreeMap<(String, u32), String>,
    /// Active jobs below their `min`, and how many slots they lack: free slots are kept for
    /// them before any other job grows past its own `min` (no job starves behind another's
    /// growth).
    pub wanting: BTreeMap<String, u32>,
}

impl Fleet {
    /// Record that `job` now holds exactly `members` (after a publish).
    pub fn hold(&mut self, job: &str, members: &[Member]) {
        self.held.retain(|_, j| j != job);
        for m in members {
            self.held.insert((m.node.clone(), m.slot), job.to_string());
        }
    }
    /// Record what every active job holds and lacks, as observed (the start of a pass).
    pub fn hold_active(&mut self, jobs: &BTreeMap<String, JobObs>) {
        for (name, obs) in jobs.iter().filter(|(_, o)| o.is_active()) {
            let g = obs.generation.as_ref().map(|(g, _)| g);
            for m in g.iter().flat_map(|g| &g.members) {
                self.held.insert((m.node.clone(), m.slot), name.clone());
            }
            let min = obs.spec.as_ref().map_or(0, |s| s.min);
            self.want(name, g.map_or(0, |g| g.world_size), min);
        }
    }
    /// Record how far `job` (now at `world` members) is below its `min`.
    pub fn want(&mut self, job: &str, world: u32, min: u32) {
        if world < min {
            self.wanting.insert(job.to_string(), min - world);
        } else {
            self.wanting.remove(job);
        }
    }
}

impl Fleet {
    pub fn is_draining(&self, node: &str) -> bool {
        self.drain_requests.contains(node) || self.nodes.get(node).is_some_and(|n| n.draining)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    Nothing,
    /// Publish a new generation (fenced on the current one). `debounce`: wait for the burst
    /// of joins to settle before publishing.
    Publish {
        generation: Generation,
        status: JobStatus,
        debounce: bool,
    },
    /// Update the status only.
    Status(JobStatus),
    /// Mark these slots excluded (alive, but their peers cannot reach them), fenced on the
    /// current generation; the next decision re-forms without them.
    Exclude(Vec<(String, u32, SlotHealth)>),
}

/// After the first fault report of a generation, how long the leader waits for the other
/// members' reports before deciding who is at fault (a rank that reported is alive).
pub const FAULT_GRACE_MS: u64 = 1_500;

/// When the reports only say a member closed its connections (it died, most likely), how long
/// the leader leaves it to the member's agent (exit report) or lease (lost node) before it
/// excludes the member itself.
pub const PEER_LOST_GRACE_MS: u64 = 15_000;

/// Whether two statuses differ in anything but their timestamp.
pub fn status_differs(a: &JobStatus, b: &JobStatus) -> bool {
    let mut b2 = b.clone();
    b2.updated_at_ms = a.updated_at_ms;
    *a != b2
}

fn status(
    job: &str,
    state: JobState,
    g: Option<&Generation>,
    prev: Option<&JobStatus>,
    message: String,
    now: u64,
) -> JobStatus {
    JobStatus {
        job: job.to_string(),
        state,
        generation: g.map(|g| g.number).unwrap_or(0),
        world_size: g.map(|g| g.world_size).unwrap_or(0),
        last_reformation: prev.and_then(|p| p.last_reformation.clone()),
        message,
        updated_at_ms: now,
        reformations: prev.map(|p| p.reformations.clone()).unwrap_or_default(),
        reformation_seconds: prev
            .map(|p| p.reformation_seconds.clone())
            .unwrap_or_default(),
    }
}

/// What a planned drain needs from the checkpointer before the job re-forms without the node.
#[derive(Clone, Debug, PartialEq)]
pub enum DrainCheckpoint {
    /// No member of the current generation is on a draining node, or the job keeps no
    /// checkpoints (or turned drain-time ones off), or it has not trained yet.
    NotNeeded,
    /// Ask the workers for a checkpoint now; hold the drain's re-formation until it commits or
    /// the request's deadline passes.
    Ask(CheckpointRequest),
    /// Asked and not committed yet: hold the drain's re-formation until this time (unix ms).
    Wait { id: String, until_ms: u64 },
    /// The requested checkpoint committed, at this step.
    Committed { id: String, step: u64 },
    /// No checkpoint this time (the detail says why): re-form without one.
    NoTime { id: String, detail: String },
}

/// The re-formation is published this long before a leaving agent's deadline, so that its
/// workers leave through a re-formation rather than being stopped.
pub const DRAIN_MARGIN_MS: u64 = 3_000;

/// Whether a planned drain should wait for a checkpoint: a pure function of what is observed,
/// so a new leader continues an earlier leader's wait (the request, with its deadline, is in
/// etcd). The request id names the generation it is for: one request per generation, covering
/// every node draining from it.
pub fn drain_checkpoint(obs: &JobObs, fleet: &Fleet, now: u64) -> DrainCheckpoint {
    use DrainCheckpoint::*;
    let (Some(spec), Some((g, _))) = (&obs.spec, &obs.generation) else {
        return NotNeeded;
    };
    // a torchrun job's program saves its own checkpoints: the request is its notice
    // (`ductile.preempted()`), and the drain waits `drain_notice_s` for it to save
    let torchrun = spec.runtime.runs_program();
    let wait_s = match &spec.checkpoint {
        Some(ck) => ck.drain_wait_s,
        None if torchrun => spec.torchrun_settings().drain_notice_s,
        None => 0,
    };
    if wait_s == 0 {
        return NotNeeded;
    }
    if obs.stop_requested || obs.status.as_ref().is_some_and(|s| s.state.is_terminal()) {
        return NotNeeded;
    }
    // the generation's communicator failed (its workers reported it): no checkpoint can come
    // from it, so the drain's re-formation must not wait for one
    if obs.faults.values().any(|f| f.generation == g.number) {
        return NoTime {
            id: format!("drain-g{}", g.number),
            detail: format!(
                "no drain-time checkpoint: generation {}'s communicator failed",
                g.number
            ),
        };
    }
    // members on nodes that are leaving but still here (a lost node has nothing to save)
    let leaving: BTreeSet<&str> = g
        .members
        .iter()
        .map(|m| m.node.as_str())
        .filter(|n| fleet.nodes.contains_key(*n) && fleet.is_draining(n))
        .collect();
    if leaving.is_empty() || !(torchrun || obs.progress.as_ref().is_some_and(|p| p.step > 0)) {
        return NotNeeded;
    }
    let id = format!("drain-g{}", g.number);
    if let Some(r) = obs.checkpoint_request.as_ref().filter(|r| r.id == id) {
        if let Some(step) = program_saved(obs, r).filter(|_| torchrun) {
            return Committed { id, step };
        }
        return match obs.checkpoint.as_ref() {
            Some(c) if c.request.as_deref() == Some(id.as_str()) => Committed { id, step: c.step },
            _ if now < r.deadline_ms => Wait {
                id,
                until_ms: r.deadline_ms,
            },
            _ if torchrun => NoTime {
                detail: format!(
                    "the program was told of the drain (ductile.preempted()) {:.1} s before",
                    r.deadline_ms.saturating_sub(r.requested_at_ms) as f64 / 1000.0
                ),
                id,
            },
            _ => NoTime {
                detail: format!(
                    "the checkpoint asked for at the drain did not commit within {:.1} s",
                    r.deadline_ms.saturating_sub(r.requested_at_ms) as f64 / 1000.0
                ),
                id,
            },
        };
    }
    let mut deadline = now + wait_s * 1000;
    for n in &leaving {
        if let Some(d) = fleet.drain_deadlines.get(*n).copied() {
            deadline = deadline.min(d.saturating_sub(DRAIN_MARGIN_MS));
        }
    }
    // the last checkpoint's stall and upload tell how long one takes
    let estimate = obs
        .checkpoint_stats
        .as_ref()
        .filter(|s| s.committed_total > 0)
        .map(|s| (s.last_stall_ms + s.last_upload_seconds * 1000.0) as u64)
        .unwrap_or(0);
    if deadline <= now + estimate {
        return NoTime {
            detail: format!(
                "no time for a checkpoint before the node leaves: {:.1} s left, the last one took {:.1} s",
                deadline.saturating_sub(now) as f64 / 1000.0,
                estimate as f64 / 1000.0
            ),
            id,
        };
    }
    let why: Vec<String> = leaving
        .iter()
        .map(|n| {
            let r = fleet.nodes[*n].drain_reason.clone();
            format!(
                "{n} ({})",
                r.unwrap_or_else(|| "drained by the operator".into())
            )
        })
        .collect();
    Ask(CheckpointRequest {
        id,
        reason: format!("planned drain of {}", why.join(", ")),
        requested_at_ms: now,
        generation: g.number,
        deadline_ms: deadline,
    })
}

/// The step a program said it saved at (`ductile.saved`) after request `r` was made, in `r`'s
/// generation.
fn program_saved(obs: &JobObs, r: &CheckpointRequest) -> Option<u64> {
    obs.progress
        .as_ref()
        .filter(|p| {
            p.generation == r.generation && p.saved_at_ms.is_some_and(|t| t >= r.requested_at_ms)
        })
        .and_then(|p| p.saved_step)
}

/// A torchrun, tf or horovod job's resize (`dctl scale`) restarts its world: its program gets a drain's
/// notice first (`ductile.preempted()`; the transformers integration saves at the next step,
/// the keras one backs up through `BackupAndRestore`),
/// and the new generation waits until the program says it saved (`ductile.saved`), at most
/// `drain_notice_s`. Only for a program that reports progress in the current generation (it
/// uses ductile's module): one that does not is resized at once. A pure function of what is
/// observed, as [`drain_checkpoint`].
pub fn resize_notice(obs: &JobObs, now: u64) -> DrainCheckpoint {
    use DrainCheckpoint::*;
    let (Some(spec), Some((g, _))) = (&obs.spec, &obs.generation) else {
        return NotNeeded;
    };
    let wait_s = spec.torchrun_settings().drain_notice_s;
    let reporting = obs
        .progress
        .as_ref()
        .is_some_and(|p| p.generation == g.number);
    if !matches!(
        spec.runtime,
        Runtime::Torchrun | Runtime::Tf | Runtime::Horovod
    ) || wait_s == 0
        || !reporting
        || obs.stop_requested
        || obs.faults.values().any(|f| f.generation == g.number)
    {
        return NotNeeded;
    }
    let id = format!("resize-g{}", g.number);
    match obs.checkpoint_request.as_ref().filter(|r| r.id == id) {
        Some(r) => match program_saved(obs, r) {
            Some(step) => Committed { id, step },
            None if now < r.deadline_ms => Wait {
                id,
                until_ms: r.deadline_ms,
            },
            None => NoTime {
                detail: format!(
                    "the program was told of the resize (ductile.preempted()) {:.1} s before and did not say it saved (ductile.saved)",
                    r.deadline_ms.saturating_sub(r.requested_at_ms) as f64 / 1000.0
                ),
                id,
            },
        },
        None => Ask(CheckpointRequest {
            id,
            reason: format!(
                "resize to {} (dctl scale)",
                spec.desired.clamp(spec.min, spec.max)
            ),
            requested_at_ms: now,
            generation: g.number,
            deadline_ms: now + wait_s * 1000,
        }),
    }
}

/// Decide what one job needs now.
/// How many keys, and bytes, a job's workers may hold under `live/{job}/`: many times what
/// they write (a few keys per rank per generation, a checkpoint's shard reports, each deleted
/// once of no use), far below what would fill etcd.
pub fn live_bound(spec: &JobSpec) -> (u64, u64) {
    let ranks = spec.max.max(1) as u64;
    (1024 + 64 * ranks, (32 << 20) + (1 << 20) * ranks)
}

/// Why the job's `live/` keys are past [`live_bound`], if they are.
fn live_over_bound(spec: &JobSpec, obs: &JobObs) -> Option<String> {
    let (keys, bytes) = live_bound(spec);
    (obs.live_keys > keys || obs.live_bytes > bytes).then(|| {
        format!(
            "the job's workers wrote {} keys ({} bytes) under live/{}/ in etcd, past the bound of {keys} keys and {bytes} bytes for a job of at most {} ranks: failed, and its etcd user removed",
            obs.live_keys, obs.live_bytes, spec.name, spec.max
        )
    })
}

pub fn plan(obs: &JobObs, fleet: &Fleet, now: u64) -> Decision {
    let Some(spec) = &obs.spec else {
        return Decision::Nothing;
    };
    let cur = obs.generation.as_ref().map(|(g, _)| g);
    let prev_status = obs.status.as_ref();
    if prev_status.is_some_and(|s| s.state.is_terminal()) {
        return Decision::Nothing;
    }
    let want = |st: JobStatus| match prev_status {
        Some(p) if !status_differs(p, &st) => Decision::Nothing,
        _ => Decision::Status(st),
    };
    if obs.stop_requested {
        return want(status(
            &spec.name,
            JobState::Stopped,
            cur,
            prev_status,
            "stopped by the operator".into(),
            now,
        ));
    }
    // what the job's etcd user may write is bounded: past the bound the job fails (its etcd
    // user goes with it, and the clean-up of an ended job's live/ keys takes what it wrote)
    if let Some(why) = live_over_bound(spec, obs) {
        return want(status(
            &spec.name,
            JobState::Failed,
            cur,
            prev_status,
            why,
            now,
        ));
    }
    // Rank 0 committed the last step and reported the final weights: the job is done (workers
    // still running are stopped by their agents).
    if let Some(p) = obs.progress.as_ref().filter(|p| p.done) {
        return want(status(
            &spec.name,
            JobState::Succeeded,
            cur,
            prev_status,
            format!("training finished at step {}", p.step),
            now,
        ));
    }
    // Every member of the current generation exited 0: the job is done.
    if let Some(g) = cur {
        let done = !g.members.is_empty()
            && g.members.iter().all(|m| {
                // the record must be of this generation: an earlier run's exit does not count
                obs.workers.get(&(m.node.clone(), m.slot)).is_some_and(|w| {
                    w.state == WorkerState::Exited
                        && w.code == Some(EXIT_DONE)
                        && w.generation == g.number
                })
            });
        if done {
            return want(status(
                &spec.name,
                JobState::Succeeded,
                cur,
                prev_status,
                "all workers finished".into(),
                now,
            ));
        }
    }

    // Live slots no other job holds, in a stable order.
    let mut candidates: Vec<(String, u32)> = Vec::new();
    let mut held_elsewhere = 0;
    for (name, node) in &fleet.nodes {
        if fleet.is_draining(name) {
            continue;
        }
        for slot in 0..node.slots() {
            let key = (name.clone(), slot);
            if fleet.held.get(&key).is_some_and(|j| *j != spec.name)
                || node.busy_slots.contains_key(&slot)
            {
                // (a slot whose last program's processes did not die is held too)
                held_elsewhere += 1;
            } else if !obs.failed.contains_key(&key) {
                candidates.push(key);
            }
        }
    }
    // a torchft job of `group_size` N runs whole groups only: a group's N slots on one node
    // (slots kN..kN+N), all of them free; a partial group would wait for its missing rank
    let group_size = match spec.runtime {
        Runtime::Torchft => spec.torchft_group_size() as usize,
        _ => 0,
    };
    let mut partial_groups = 0;
    if group_size > 1 {
        let mut per_group: BTreeMap<(String, u32), usize> = BTreeMap::new();
        for (n, s) in &candidates {
            *per_group
                .entry((n.clone(), *s / group_size as u32))
                .or_default() += 1;
        }
        partial_groups = per_group.values().filter(|c| **c < group_size).count();
        candidates.retain(|(n, s)| per_group[&(n.clone(), *s / group_size as u32)] == group_size);
    }
    let target = spec.desired.clamp(spec.min, spec.max) as usize;
    if candidates.len() < spec.min as usize {
        let mut msg = format!(
            "waiting: {} live slot(s), the job needs at least {}",
            candidates.len(),
            spec.min
        );
        if partial_groups > 0 {
            msg.push_str(&format!(
                " in whole replica groups of {group_size} ({partial_groups} group(s) lack a free slot)"
            ));
        }
        if held_elsewhere > 0 {
            msg.push_str(&format!(" ({held_elsewhere} more held by other jobs)"));
        }
        // slots this job's own failures took out (no restart left): why, in the latest's words
        let out: Vec<(&(String, u32), &SlotHealth)> =
            obs.failed.iter().filter(|(_, h)| !h.will_restart).collect();
        if let Some(((node, slot), h)) = out.iter().max_by_key(|(_, h)| h.failed_at_ms) {
            msg.push_str(&format!(
                "; {} slot(s) left out after their worker failed with no restart left (restart_budget), the latest {node}/{slot}: {}",
                out.len(),
                h.exit.chars().take(300).collect::<String>()
            ));
        }
        return want(status(
            &spec.name,
            JobState::Waiting,
            cur,
            prev_status,
            msg,
            now,
        ));
    }
    // Keep current members (in rank order), then newcomers in (node, slot) order.
    let cand_set: BTreeSet<&(String, u32)> = candidates.iter().collect();
    let mut chosen: Vec<(String, u32)> = Vec::new();
    if let Some(g) = cur {
        let mut ms = g.members.clone();
        ms.sort_by_key(|m| m.rank);
        for m in ms {
            let k = (m.node.clone(), m.slot);
            if cand_set.contains(&k) && chosen.len() < target {
                chosen.push(k);
            }
        }
    }
    // Newcomers: up to `min` from any free slot; past `min` only from slots no waiting job
    // needs.
    let reserve: usize = fleet
        .wanting
        .iter()
        .filter(|(j, _)| **j != spec.name)
        .map(|(_, n)| *n as usize)
        .sum();
    let mut spare = candidates
        .iter()
        .filter(|c| !chosen.contains(c))
        .count()
        .saturating_sub(reserve);
    for c in &candidates {
        if chosen.len() >= target {
            break;
        }
        if chosen.contains(c) {
            continue;
        }
        if chosen.len() >= spec.min as usize {
            if spare == 0 {
                break;
            }
            spare -= 1;
        }
        chosen.push(c.clone());
    }

    if group_size > 1 {
        whole_groups(&mut chosen, &candidates, group_size, target);
    }
    let old: BTreeSet<(String, u32)> = cur
        .map(|g| g.members.iter().map(|m| (m.node.clone(), m.slot)).collect())
        .unwrap_or_default();
    let new: BTreeSet<(String, u32)> = chosen.iter().cloned().collect();
    if let Some(g) = cur.filter(|_| old == new) {
        if let Some(d) = faults(spec, g, obs, fleet, now) {
            return d;
        }
        // Same world: record how the last re-formation went once everyone joined.
        let mut st = status(
            &spec.name,
            JobState::Running,
            cur,
            prev_status,
            prev_status.map(|p| p.message.clone()).unwrap_or_default(),
            now,
        );
        if prev_status.map(|p| p.state) == Some(JobState::Waiting) || prev_status.is_none() {
            st.message = g.detail.clone();
        }
        let all_joined = (0..g.world_size).all(|r| obs.joined.contains_key(&r));
        if all_joined && st.last_reformation.as_ref().map(|r| r.generation) != Some(g.number) {
            let last_join = obs
                .joined
                .values()
                .map(|j| j.joined_at_ms)
                .max()
                .unwrap_or(now);
            let seconds = last_join.saturating_sub(g.triggered_at_ms) as f64 / 1000.0;
            st.reformation_seconds.observe(seconds);
            st.last_reformation = Some(Reformation {
                generation: g.number,
                reason: g.reason,
                detail: g.detail.clone(),
                seconds,
                first_step_seconds: None,
            });
        }
        // when training went again: the first progress report of this generation
        if let (Some(r), Some(p)) = (st.last_reformation.as_mut(), obs.progress.as_ref()) {
            if r.generation == g.number
                && p.generation == g.number
                && r.first_step_seconds.is_none()
            {
                r.first_step_seconds =
                    Some(p.updated_at_ms.saturating_sub(g.triggered_at_ms) as f64 / 1000.0);
            }
        }
        return want(st);
    }

    // A new generation.
    let removed: Vec<&(String, u32)> = old.difference(&new).collect();
    let added: Vec<&(String, u32)> = new.difference(&old).collect();
    let mut triggered_at = now;
    let (reason, detail) = if cur.is_none() {
        (
            Reason::Start,
            format!("job started with {} worker(s)", chosen.len()),
        )
    } else if let Some((n, s)) = removed
        .iter()
        .find(|(n, s)| !fleet.nodes.contains_key(n) || obs.failed.contains_key(&(n.clone(), *s)))
    {
        if !fleet.nodes.contains_key(n) {
            (Reason::Failure, format!("node {n} was lost"))
        } else {
            let h = &obs.failed[&(n.clone(), *s)];
            triggered_at = triggered_at.min(h.failed_at_ms);
            (
                Reason::Failure,
                format!("worker {n}/{s} failed ({})", h.exit),
            )
        }
    } else if let Some((n, _)) = removed.iter().find(|(n, _)| fleet.is_draining(n)) {
        // the node's own words (a cloud's notice and its deadline, an operator's reason)
        let why = fleet
            .nodes
            .get(n)
            .and_then(|x| x.drain_reason.clone())
            .map(|r| format!(": {r}"))
            .unwrap_or_default();
        (Reason::Drain, format!("node {n} is draining{why}"))
    } else if !removed.is_empty()
        || cur.is_some_and(|g| g.desired != spec.desired)
        || obs
            .generation
            .as_ref()
            .is_some_and(|(_, rev)| obs.spec_revision > *rev)
    {
        // the operator changed the spec since the current generation (`dctl scale`)
        (
            Reason::Scale,
            format!("scaled to {} (desired {})", chosen.len(), spec.desired),
        )
    } else {
        let nodes: BTreeSet<&str> = added.iter().map(|(n, _)| n.as_str()).collect();
        (
            Reason::Join,
            format!(
                "{} slot(s) joined from {}",
                added.len(),
                nodes.into_iter().collect::<Vec<_>>().join(", ")
            ),
        )
    };
    let survivors = old.intersection(&new).count();
    // A planned departure (a scale-down, a drain) of members that are still alive: nobody
    // failed. When they alone hold some layers (or shards of the optimizer state), they stay
    // one generation as spares to hand them over (a hand-over generation), and leave once
    // every member joined it.
    let mut leavers: Vec<(String, u32)> = Vec::new();
    if let (Some(g), Some(t)) = (
        cur,
        spec.training
            .as_ref()
            .filter(|t| t.strategy.pipelined() || t.sharding.is_sharded()),
    ) {
        let alive = |(n, s): &&(String, u32)| {
            fleet.nodes.contains_key(n) && !obs.failed.contains_key(&(n.clone(), *s))
        };
        if removed.iter().all(alive) {
            if g.handover {
                let all_joined = (0..g.world_size).all(|r| obs.joined.contains_key(&r));
                if !all_joined && now < g.published_at_ms + HANDOVER_WAIT_MS {
                    return want(status(
                        &spec.name,
                        JobState::Running,
                        cur,
                        prev_status,
                        format!(
                            "generation {}: leaving members hand their layers over",
                            g.number
                        ),
                        now,
                    ));
                }
            } else if lost_units(g, t, &chosen).is_some() {
                let mut ms = g.members.clone();
                ms.sort_by_key(|m| m.rank);
                leavers = ms
                    .iter()
                    .map(|m| (m.node.clone(), m.slot))
                    .filter(|k| !new.contains(k))
                    .collect();
            }
        }
    }
    build(
        spec,
        obs,
        fleet,
        (&chosen, &leavers),
        survivors,
        (reason, detail),
        triggered_at,
        now,
        0,
    )
}

/// How long the leader waits for a hand-over generation's members to join (its layers to
/// move) before it removes the leaving members anyway; the workers then find the layers
/// without a holder and restore them from the latest checkpoint, or stop and say so.
pub const HANDOVER_WAIT_MS: u64 = 60_000;

/// A new generation of `chosen` (in rank order) and the status that goes with it; `leavers`
/// follow as spares that hand their layers over (a hand-over generation).
#[allow(clippy::too_many_arguments)]
fn build(
    spec: &JobSpec,
    obs: &JobObs,
    fleet: &Fleet,
    (chosen, leavers): (&[(String, u32)], &[(String, u32)]),
    survivors: usize,
    (reason, detail): (Reason, String),
    triggered_at: u64,
    now: u64,
    fault_retries: u32,
) -> Decision {
    let cur = obs.generation.as_ref().map(|(g, _)| g);
    let prev_status = obs.status.as_ref();
    // shard groups within nodes: each node's ranks consecutive (in rank order within a node)
    let node_groups = spec
        .training
        .as_ref()
        .is_some_and(|t| t.sharding.is_sharded() && t.shard_group == Some(ShardGroup::Node));
    let by_node: Vec<(String, u32)>;
    let chosen = if node_groups {
        let mut v = chosen.to_vec();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        by_node = v;
        &by_node[..]
    } else {
        chosen
    };
    let state_source = match (cur, survivors) {
        // a script's state is its own business (its checkpoint, TorchFT's healing)
        _ if spec.runtime.runs_program() => StateSource::Program,
        (Some(_), s) if s > 0 => StateSource::Peers,
        _ if spec.checkpoint.is_some() => StateSource::Checkpoint,
        _ => StateSource::Seed,
    };
    let world = chosen.len() as u32;
    // the plan for this world size: layout, stage boundaries, each member's coordinates
    let (layout, boundaries, plan_us) =
        match spec.training.as_ref().filter(|t| t.strategy.pipelined()) {
            Some(t) => {
                let planning = std::time::Instant::now();
                match ductile_strategies::pipeline::plan(t, world) {
                    Ok(p) => {
                        let us = (planning.elapsed().as_micros() as u64).max(1);
                        (p.layout, p.boundaries, us)
                    }
                    Err(e) => {
                        return Decision::Status(status(
                            &spec.name,
                            JobState::Waiting,
                            cur,
                            prev_status,
                            format!("{world} slot(s) cannot run this job: {e}"),
                            now,
                        ))
                    }
                }
            }
            None => match spec.training.as_ref().filter(|t| t.sharding.is_sharded()) {
                // the optimizer state cut over shard groups of the data-parallel ranks
                Some(t) => (
                    Layout::sharded(
                        world,
                        t.shard_group.map_or(world, |sg| {
                            let mut per: BTreeMap<&str, u32> = BTreeMap::new();
                            for (n, _) in chosen {
                                *per.entry(n.as_str()).or_default() += 1;
                            }
                            sg.size(per.into_values())
                        }),
                    ),
                    Vec::new(),
                    0,
                ),
                None => (Layout::data_parallel(world), Vec::new(), 0),
            },
        };
    let mut state_source = state_source;
    // the layers whose only holders leave (handed over when the leavers stay as spares)
    let lost = cur
        .zip(spec.training.as_ref())
        .and_then(|(g, t)| lost_units(g, t, chosen));
    let mut from_checkpoint = None;
    if let (Some(g), Some(lost), true) = (cur, &lost, survivors > 0 && leavers.is_empty()) {
        if spec.checkpoint.is_some() {
            state_source = StateSource::Checkpoint;
            from_checkpoint = Some(lost.clone());
        } else {
            return Decision::Status(status(
                &spec.name,
                JobState::Failed,
                cur,
                prev_status,
                format!("{lost}: their only holders left generation {} and the job has no checkpoint; stopping rather than starting them from the seed", g.number),
                now,
            ));
        }
    }
    let members: Vec<Member> = chosen
        .iter()
        .chain(leavers)
        .enumerate()
        .map(|(r, (n, s))| {
            let c = ductile_strategies::mesh::Mesh::new(&layout)
                .coords(r as u32)
                .filter(|_| r < chosen.len());
            Member {
                node: n.clone(),
                slot: *s,
                rank: r as u32,
                dp_rank: c.map(|c| c.dp).unwrap_or(0),
                pp_stage: c.map(|c| c.stage).unwrap_or(0),
                tp_rank: c.map(|c| c.tp).unwrap_or(0),
                spare: c.is_none(),
                ..Default::default()
            }
        })
        .collect();
    let mut members = members;
    if spec.runtime == Runtime::Torchft {
        // the groups whose program exited in the current generation start again
        let restart: BTreeSet<(String, u32)> = cur
            .map(|g| {
                obs.faults
                    .values()
                    .filter(|f| f.generation == g.number && f.kind == FaultKind::Exited)
                    .map(|f| (f.node.clone(), f.slot))
                    .collect()
            })
            .unwrap_or_default();
        let number = cur.map(|g| g.number).unwrap_or(0).max(obs.last_number) + 1;
        torchft_groups(
            spec.torchft_group_size(),
            cur,
            &mut members,
            &restart,
            number,
        );
    }
    let mut detail =
        if layout.pipeline_parallel > 1 || layout.tensor_parallel > 1 || layout.dp_shard > 1 {
            format!("{detail}; {layout}")
        } else {
            detail
        };
    if let Some(ShardGroup::Ranks(n)) = spec
        .training
        .as_ref()
        .filter(|t| {
            t.sharding.is_sharded() && layout.pipeline_parallel * layout.tensor_parallel == 1
        })
        .and_then(|t| t.shard_group)
    {
        if layout.dp_shard != n.min(layout.data_parallel) {
            detail = format!(
                "{detail}; shard_group {n} does not divide world {}: shard groups of {}",
                layout.data_parallel, layout.dp_shard
            );
        }
    }
    if let (Some(g), Some(t), true) = (cur, spec.training.as_ref(), leavers.is_empty()) {
        let saved = from_buddies(g, t, chosen);
        if !saved.is_empty() {
            let (shards, keepers): (Vec<String>, Vec<String>) = saved
                .iter()
                .map(|(s, k)| (s.to_string(), k.to_string()))
                .unzip();
            detail = format!(
                "{detail}; shards {} of {} come from their buddy copies (generation {}'s ranks {}) at the step reached, or from the checkpoint where a copy is not current",
                shards.join(", "),
                g.layout.dp_shard,
                g.number,
                keepers.join(", ")
            );
        }
    }
    if let Some(lost) = from_checkpoint {
        // (the workers read the URL itself: the record is what the leader knows of it)
        detail = match obs.checkpoint.as_ref() {
            Some(c) => format!(
                "{detail}; {lost} lost their only holders: read from the latest checkpoint (step {})",
                c.step
            ),
            None => format!(
                "{detail}; {lost} lost their only holders and the job has no committed checkpoint yet: it starts over from the seed at step 0"
            ),
        };
    }
    if !leavers.is_empty() {
        let names: Vec<String> = leavers.iter().map(|(n, s)| format!("{n}/{s}")).collect();
        detail = format!(
            "{detail}; hand-over: {} hand {} to the members staying, then leave",
            names.join(", "),
            lost.unwrap_or_default()
        );
    }
    let handover = !leavers.is_empty();
    let number = cur.map(|g| g.number).unwrap_or(0).max(obs.last_number) + 1;
    let generation = Generation {
        job: spec.name.clone(),
        number,
        world_size: members.len() as u32,
        layout,
        stage_boundaries: boundaries,
        plan_us,
        handover,
        members,
        resume_step: obs.progress.as_ref().map(|p| p.step).unwrap_or(0),
        state_source,
        desired: spec.desired,
        reason,
        detail: detail.clone(),
        triggered_at_ms: triggered_at,
        published_at_ms: now,
        // pipeline stages and tensor groups exchange point to point on TCP (staged through
        // host memory on GPUs): their activations go on a sender thread beside the receiving
        // one, which NCCL's communicators do not allow; async jobs send their updates as host
        // messages, which NCCL does not carry
        backend: if layout.pipeline_parallel > 1
            || layout.tensor_parallel > 1
            || handover
            || spec
                .training
                .as_ref()
                .is_some_and(|t| t.sync == SyncMode::Async)
        {
            Backend::Tcp
        } else {
            Backend::resolve(
                spec.training
                    .as_ref()
                    // NCCL has no TLS: a mesh_tls job's mesh is TCP
                    .map(|t| if t.mesh_tls { CommChoice::Tcp } else { t.comm })
                    .unwrap_or(CommChoice::Tcp),
                &chosen
                    .iter()
                    .map(|(n, s)| {
                        (
                            n.clone(),
                            fleet.nodes.get(n).and_then(|r| r.devices.get(*s as usize)),
                        )
                    })
                    .collect::<Vec<_>>(),
            )
        },
        fault_retries,
        failures: cur.map(|g| g.failures).unwrap_or(0) + u32::from(reason == Reason::Failure),
        early_crash: None,
    };
    let mut st = status(
        &spec.name,
        JobState::Running,
        Some(&generation),
        prev_status,
        detail,
        now,
    );
    *st.reformations.entry(reason.to_string()).or_default() += 1;
    Decision::Publish {
        generation,
        status: st,
        debounce: matches!(reason, Reason::Start | Reason::Join),
    }
}

/// `chosen` cut to whole torchft groups of `size` (slots kN..kN+N of one node): a group chosen
/// in part is completed from `candidates` (all whole groups) while `target` allows, else dropped;
/// the order of first appearance is kept, slots in order within a group.
fn whole_groups(
    chosen: &mut Vec<(String, u32)>,
    candidates: &[(String, u32)],
    size: usize,
    target: usize,
) {
    let key = |(n, s): &(String, u32)| (n.clone(), *s / size as u32);
    let mut order: Vec<(String, u32)> = Vec::new();
    for c in chosen.iter() {
        if !order.contains(&key(c)) {
            order.push(key(c));
        }
    }
    let mut out = Vec::new();
    for g in order {
        if out.len() + size > target {
            break;
        }
        let slots: Vec<(String, u32)> =
            candidates.iter().filter(|c| key(c) == g).cloned().collect();
        if slots.len() == size {
            out.extend(slots);
        }
    }
    *chosen = out;
}

/// A torchft member's group: one node's slots, cut into `group_size` (0: all of them).
fn group_key(m: &Member, group_size: u32) -> (String, u32) {
    (m.node.clone(), m.slot.checked_div(group_size).unwrap_or(0))
}

/// Each member's TorchFT replica group (`replica_group`, `group_since`) in a generation
/// numbered `number` that follows `cur`. A group that `cur` had with the same slots, none of
/// which is in `restart`, keeps its number and its start (its programs keep running); any
/// other group (new, changed, or one of its programs exited) starts in this generation, under
/// its old number when it had one and otherwise the smallest number no group holds.
pub(crate) fn torchft_groups(
    group_size: u32,
    cur: Option<&Generation>,
    members: &mut [Member],
    restart: &BTreeSet<(String, u32)>,
    number: u64,
) {
    type Slots = BTreeSet<(String, u32)>;
    let groups = |ms: &[Member]| -> BTreeMap<(String, u32), Slots> {
        let mut out: BTreeMap<(String, u32), Slots> = BTreeMap::new();
        for m in ms {
            out.entry(group_key(m, group_size))
                .or_default()
                .insert((m.node.clone(), m.slot));
        }
        out
    };
    let before: BTreeMap<(String, u32), (Slots, Option<u32>, u64)> = cur
        .map(|g| {
            groups(&g.members)
                .into_iter()
                .map(|(k, slots)| {
                    let m = g
                        .members
                        .iter()
                        .find(|m| group_key(m, group_size) == k)
                        .expect("a group has a member");
                    (k, (slots, m.replica_group, m.group_since))
                })
                .collect()
        })
        .unwrap_or_default();
    let now = groups(members);
    let mut ids: BTreeMap<(String, u32), u32> = BTreeMap::new();
    let mut since: BTreeMap<(String, u32), u64> = BTreeMap::new();
    for (k, slots) in &now {
        if let Some((old, Some(id), started)) = before.get(k) {
            ids.insert(k.clone(), *id);
            let kept = old == slots && slots.iter().all(|s| !restart.contains(s));
            since.insert(k.clone(), if kept { *started } else { number });
        }
    }
    let mut taken: BTreeSet<u32> = ids.values().copied().collect();
    for k in now.keys() {
        if !ids.contains_key(k) {
            let id = (0..).find(|i| !taken.contains(i)).expect("a free number");
            taken.insert(id);
            ids.insert(k.clone(), id);
            since.insert(k.clone(), number);
        }
    }
    for m in members.iter_mut() {
        let k = group_key(m, group_size);
        m.replica_group = ids.get(&k).copied();
        m.group_since = since.get(&k).copied().unwrap_or(number);
    }
}

/// The model units of `g`'s pipeline (and the shards of its optimizer state) that no member
/// staying in `chosen` holds (in words), or
/// None when every unit has a surviving holder (a generation without stages: every member
/// holds every unit).
fn lost_units(g: &Generation, t: &TrainingSpec, chosen: &[(String, u32)]) -> Option<String> {
    let tp = g.layout.tensor_parallel.max(1);
    let stays = |m: &Member| chosen.iter().any(|(n, s)| *n == m.node && *s == m.slot);
    let shard = g.layout.dp_shard.max(1);
    let pp = g.layout.pipeline_parallel.max(1);
    let mut out = Vec::new();
    let saved = from_buddies(g, t, chosen);
    if shard > 1 {
        // a shard of the optimizer state is lost when none of its replicas stays (under
        // stages and tensor groups, each stage's and tensor place's shards) and no buddy copy
        // of it does
        let lost: Vec<String> = (0..pp)
            .flat_map(|s| (0..tp).map(move |k| (s, k)))
            .flat_map(|(s, k)| (0..shard).map(move |d| (s, k, d)))
            .filter(|(s, k, d)| {
                !g.members.iter().any(|m| {
                    !m.spare
                        && stays(m)
                        && m.pp_stage == *s
                        && m.tp_rank == *k
                        && m.dp_rank % shard == *d
                })
            })
            .filter(|(_, _, d)| !saved.iter().any(|(s, _)| s == d))
            .map(|(s, k, d)| match (pp, tp) {
                (1, 1) => d.to_string(),
                (_, 1) => format!("{d} (stage {s})"),
                _ => format!("{d} (stage {s}, tensor slice {k} of {tp})"),
            })
            .collect();
        if !lost.is_empty() {
            out.push(format!(
                "optimizer state shards {} of {shard}",
                lost.join(", ")
            ));
        }
    }
    if g.stage_boundaries.len() < 2 && tp == 1 {
        return (!out.is_empty()).then(|| out.join("; "));
    }
    let units = ductile_strategies::arch::of(t).ok()?.units();
    // a unit is lost when one of its tensor slices has no staying holder
    let lost: Vec<String> = (0..units.len() as u32)
        .flat_map(|u| (0..tp).map(move |k| (u, k)))
        .filter(|(u, k)| {
            !g.members.iter().any(|m| {
                !m.spare
                    && stays(m)
                    && m.tp_rank == *k
                    && g.stage_chunks(m.pp_stage, units.len() as u32)
                        .iter()
                        .any(|c| c.contains(u))
            })
        })
        .map(|(u, k)| {
            let name = &units[u as usize].name;
            if tp > 1 {
                format!("{name} (tensor slice {k} of {tp})")
            } else {
                name.clone()
            }
        })
        .collect();
    if !lost.is_empty() {
        out.push(format!("layers {}", lost.join(", ")));
    }
    (!out.is_empty()).then(|| out.join("; "))
}

/// The shards of `g` whose one holder leaves while the keeper of its buddy copy stays
/// (`training.buddy_copies`): (shard, the keeper's rank in `g`).
fn from_buddies(g: &Generation, t: &TrainingSpec, chosen: &[(String, u32)]) -> Vec<(u32, u32)> {
    if !t.keeps_buddy_copies() {
        return Vec::new();
    }
    let Some(keepers) = ductile_strategies::buddy::of_generation(g) else {
        return Vec::new();
    };
    let stays = |r: u32| {
        g.members
            .iter()
            .find(|m| m.rank == r)
            .is_some_and(|m| chosen.iter().any(|(n, s)| *n == m.node && *s == m.slot))
    };
    g.members
        .iter()
        .filter(|m| !stays(m.rank) && stays(keepers[m.rank as usize]))
        .map(|m| (m.dp_rank, keepers[m.rank as usize]))
        .collect()
}

/// Slot records that exclude `ranks` of `g`, saying who could not reach each.
fn exclude_ranks(
    g: &Generation,
    named: &BTreeMap<u32, Vec<&FaultReport>>,
    ranks: &[u32],
    now: u64,
) -> Decision {
    let slots = ranks
        .iter()
        .filter_map(|r| g.members.iter().find(|m| m.rank == *r).map(|m| (*r, m)))
        .map(|(r, m)| {
            let by = &named[&r];
            let who: Vec<String> = by.iter().map(|f| f.rank.to_string()).collect();
            // the most telling report: one that is not a closed connection, if any
            let why = by.iter().find(|f| !f.kind.is_weak()).unwrap_or(&by[0]);
            (
                m.node.clone(),
                m.slot,
                SlotHealth {
                    failed_at_ms: now,
                    generation: g.number,
                    exit: format!(
                        "excluded: rank {r} was unreachable for rank(s) {} ({})",
                        who.join(", "),
                        why.error.chars().take(300).collect::<String>()
                    ),
                    will_restart: true,
                    excluded: true,
                },
            )
        })
        .collect();
    Decision::Exclude(slots)
}

/// What the current generation's fault reports, or its stall, call for (None: nothing wrong).
///
/// A rank that reported is alive. Ranks the reports point at that did not report themselves
/// (stopped, wedged, cut off) are excluded once every member has reported or been named, or
/// [`FAULT_GRACE_MS`] after the first report — at once when a report says the rank is silent,
/// timed out or unreachable; after [`PEER_LOST_GRACE_MS`] when the reports only say it closed
/// its connections (a dead worker, which its agent or its lease reports first). When every rank reported (or no one is named),
/// the same members re-form under a new generation; when that already failed once without a
/// step, the rank most reports name is excluded instead (a partition between live workers).
/// After `fault_retries` re-formations in a row without a step, the job fails with the reason.
fn faults(
    spec: &JobSpec,
    g: &Generation,
    obs: &JobObs,
    fleet: &Fleet,
    now: u64,
) -> Option<Decision> {
    let world = g.world_size;
    let reports: Vec<&FaultReport> = obs
        .faults
        .values()
        .filter(|f| f.generation == g.number && f.rank < world)
        .collect();
    // the built-in trainer reports its steps; a torchrun job's program only when it calls
    // `ductile.report` (once it has, its generations are held to the same bound)
    let reports_steps =
        spec.training.is_some() || (spec.runtime.runs_program() && obs.progress.is_some());
    let stalled = spec.stall_timeout_s > 0
        && reports_steps
        && !obs.progress.as_ref().is_some_and(|p| p.done)
        && obs
            .stalled_ms
            .is_some_and(|ms| ms > spec.stall_timeout_s * 1000);
    if reports.is_empty() && !stalled {
        return None;
    }
    let reporters: BTreeSet<u32> = reports.iter().map(|f| f.rank).collect();
    if let Some(d) = program_exit(spec, g, obs, fleet, &reports, now) {
        return Some(d);
    }
    let mut named: BTreeMap<u32, Vec<&FaultReport>> = BTreeMap::new();
    for f in &reports {
        for s in f.suspects.iter().filter(|s| **s < world && **s != f.rank) {
            named.entry(*s).or_default().push(f);
        }
    }
    // A closed connection (`peer_lost`) is what a dead process leaves: its agent's exit report
    // or its node's lease says so, and the membership path re-forms. Only evidence that a peer
    // is alive but unreachable (silence, a timeout, a refused connection, a rendezvous it never
    // joined, garbage on the wire) excludes it at once.
    let strong = |r: &u32| named[r].iter().any(|f| !f.kind.is_weak());
    let silent: Vec<u32> = named
        .keys()
        .filter(|r| !reporters.contains(r) && strong(r))
        .copied()
        .collect();
    let gone: Vec<u32> = named
        .keys()
        .filter(|r| !reporters.contains(r) && !strong(r))
        .copied()
        .collect();
    let accounted = (0..world).all(|r| reporters.contains(&r) || named.contains_key(&r));
    if !reports.is_empty() && !accounted && obs.faults_seen_ms < FAULT_GRACE_MS {
        // the other members' reports are on their way: decide with them
        return Some(Decision::Nothing);
    }
    if silent.is_empty() && !gone.is_empty() {
        if obs.faults_seen_ms < PEER_LOST_GRACE_MS {
            // a member died: its agent or its lease reports it (handled before this)
            return Some(Decision::Nothing);
        }
        // nothing reported it dead: it closed its connections but lives on; exclude it
        let named_gone = gone;
        return Some(exclude_ranks(g, &named, &named_gone, now));
    }
    if !silent.is_empty() {
        return Some(exclude_ranks(g, &named, &silent, now));
    }
    // everyone reported (or no one is named): re-form the same members, bounded
    let progressed = obs
        .progress
        .as_ref()
        .is_some_and(|p| p.step > g.resume_step);
    let retries = if progressed { 1 } else { g.fault_retries + 1 };
    if retries >= 2 && !progressed {
        // the same members failed again without a step: a live pair that cannot talk (a
        // partition between workers). Exclude the rank most reports name (ties: the highest).
        if let Some((r, _)) = named
            .iter()
            .max_by_key(|(r, by)| (by.len(), **r))
            .filter(|_| world > 1)
        {
            return Some(exclude_ranks(g, &named, &[*r], now));
        }
    }
    let what = match reports.first() {
        Some(f) => format!(
            "rank {} reported: {}",
            f.rank,
            f.error.chars().take(300).collect::<String>()
        ),
        None => format!("no step for {} s", obs.stalled_ms.unwrap_or(0) / 1000),
    };
    if retries > spec.fault_retries {
        return Some(failed(
            spec,
            g,
            obs,
            format!(
                "generation {} failed ({what}) after {} re-formation(s) in a row without a step: giving up",
                g.number, g.fault_retries
            ),
            now,
        ));
    }
    let triggered_at = reports
        .iter()
        .map(|f| f.at_ms)
        .min()
        .unwrap_or(now)
        .min(now);
    let detail = format!(
        "generation {} failed ({what}); re-forming the same members (try {retries} of {})",
        g.number, spec.fault_retries
    );
    Some(same_members(
        spec,
        obs,
        fleet,
        g,
        detail,
        (triggered_at, now),
        retries,
    ))
}

/// A program failure this soon after its generation was published, before any progress
/// report, is an early one (a crash loop's mark).
pub const CRASH_WINDOW_MS: u64 = 60_000;
/// The longest back-off before restarting a world after early failures in a row.
pub const CRASH_BACKOFF_MAX_MS: u64 = 30_000;

/// The back-off before the restart after the `streak`-th early failure in a row: none after
/// the first, then 1 s doubling up to [`CRASH_BACKOFF_MAX_MS`] (Kubernetes' CrashLoopBackOff,
/// shorter: a world restart is cheap).
pub fn crash_backoff_ms(streak: u32) -> u64 {
    if streak <= 1 {
        return 0;
    }
    (1_000u64 << (streak - 2).min(16)).min(CRASH_BACKOFF_MAX_MS)
}

/// A torchrun job's program exited by itself (an error, a signal) while its world stood:
/// its peers' programs fail after it (a closed connection) or hang in a collective. The
/// first exit is the root cause, as torchrun reports it. While the job's restart budget
/// lasts, the world restarts at the same size (torchrun's restart; `failures` counts them);
/// then the root cause's slot is left out (the world shrinks), and the job fails when that
/// leaves fewer than `min`.
fn program_exit(
    spec: &JobSpec,
    g: &Generation,
    obs: &JobObs,
    fleet: &Fleet,
    reports: &[&FaultReport],
    now: u64,
) -> Option<Decision> {
    let first = reports
        .iter()
        .filter(|f| f.kind == FaultKind::Exited)
        .min_by_key(|f| (f.at_ms, f.rank))?;
    // a program killed by a signal names itself: it is the root cause beyond doubt;
    // otherwise the others' reports may still come with an earlier exit
    // (a torchft group's exit concerns that group alone: the others keep training, and report
    // nothing)
    let certain = first.suspects.contains(&first.rank) || spec.runtime == Runtime::Torchft;
    let reporters: BTreeSet<u32> = reports.iter().map(|f| f.rank).collect();
    if !certain && reporters.len() < g.world_size as usize && obs.faults_seen_ms < FAULT_GRACE_MS {
        return Some(Decision::Nothing);
    }
    let m = g.members.iter().find(|m| m.rank == first.rank)?;
    let why = format!(
        "rank {}'s program failed first: {}",
        first.rank,
        first.error.chars().take(400).collect::<String>()
    );
    let triggered_at = first.at_ms.min(now);
    // an early failure: soon after the world started, before any progress report
    let reported = obs
        .progress
        .as_ref()
        .is_some_and(|p| p.generation == g.number);
    // (a program killed by a signal was killed: no crash of its own)
    let early = !reported
        && !first.error.starts_with("killed by signal")
        && first.at_ms.saturating_sub(g.published_at_ms) < CRASH_WINDOW_MS;
    let error = EarlyCrash::normalize(&first.error);
    if let (true, Some(prev)) = (early, &g.early_crash) {
        if prev.error == error {
            return Some(failed(
                spec,
                g,
                obs,
                format!(
                    "{why}; the world failed the same way twice in a row, each time within {} s of starting and before any progress report: a crash loop, not restarted again ({} of {} restarts used)",
                    CRASH_WINDOW_MS / 1000,
                    g.failures,
                    spec.restart_budget
                ),
                now,
            ));
        }
    }
    let crash = early.then(|| EarlyCrash {
        streak: g.early_crash.as_ref().map_or(0, |c| c.streak) + 1,
        error,
    });
    if g.failures < spec.restart_budget {
        // early failures in a row back off exponentially: none after the first, then 1 s,
        // 2 s, 4 s, ... up to CRASH_BACKOFF_MAX_MS
        let wait = crash.as_ref().map_or(0, |c| crash_backoff_ms(c.streak));
        if now < triggered_at + wait {
            return Some(Decision::Nothing);
        }
        let backed = if wait > 0 {
            format!(" after a {:.0} s back-off", wait as f64 / 1000.0)
        } else {
            String::new()
        };
        let detail = format!(
            "{why}; the world restarts{backed} (restart {} of {})",
            g.failures + 1,
            spec.restart_budget
        );
        let mut d = same_members(spec, obs, fleet, g, detail, (triggered_at, now), 0);
        if let Decision::Publish { generation, .. } = &mut d {
            generation.early_crash = crash;
        }
        return Some(d);
    }
    if g.world_size <= spec.min {
        return Some(failed(
            spec,
            g,
            obs,
            format!(
                "{why}; the restart budget ({}) is used up and without it fewer than min = {} workers remain",
                spec.restart_budget, spec.min
            ),
            now,
        ));
    }
    Some(Decision::Exclude(vec![(
        m.node.clone(),
        m.slot,
        SlotHealth {
            failed_at_ms: triggered_at,
            generation: g.number,
            exit: format!(
                "{why}; the restart budget ({}) is used up: left out",
                spec.restart_budget
            ),
            will_restart: false,
            excluded: true,
        },
    )]))
}

/// The job fails with `message` (its current generation `g`).
fn failed(spec: &JobSpec, g: &Generation, obs: &JobObs, message: String, now: u64) -> Decision {
    Decision::Status(status(
        &spec.name,
        JobState::Failed,
        Some(g),
        obs.status.as_ref(),
        message,
        now,
    ))
}

/// `g`'s members again at their ranks, under a new generation formed after a failure.
fn same_members(
    spec: &JobSpec,
    obs: &JobObs,
    fleet: &Fleet,
    g: &Generation,
    detail: String,
    (triggered_at, now): (u64, u64),
    retries: u32,
) -> Decision {
    let chosen = g.slots_in_rank_order();
    build(
        spec,
        obs,
        fleet,
        (&chosen, &[]),
        chosen.len(),
        (Reason::Failure, detail),
        triggered_at,
        now,
        retries,
    )
}

/// A generation of job `j` with these (node, slot) members in rank order, for tests.
#[cfg(test)]
pub(crate) fn test_generation(number: u64, members: &[(&str, u32)]) -> Generation {
    Generation::data_parallel("j", number, members)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, slots: u32) -> NodeRecord {
        let devices = (0..slots)
            .map(|i| Device {
                kind: DeviceKind::Cpu,
                index: i,
                name: format!("cpu{i}"),
                memory_mb: None,
            })
            .collect();
        NodeRecord {
            registered_at_ms: 0,
            ..NodeRecord::new(name, "h", devices, 1)
        }
    }
    fn fleet(nodes: &[(&str, u32)]) -> Fleet {
        Fleet {
            nodes: nodes
                .iter()
                .map(|(n, s)| (n.to_string(), node(n, *s)))
                .collect(),
            drain_requests: Default::default(),
            drain_deadlines: Default::default(),
            held: Default::default(),
            wanting: Default::default(),
        }
    }
    fn spec(min: u32, max: u32, desired: u32) -> JobSpec {
        JobSpec::from_toml(&format!(
            "name = \"j\"\nmin = {min}\nmax = {max}\ndesired = {desired}\n"
        ))
        .unwrap()
    }
    /// Apply a decision the way the leader does.
    fn apply(obs: &mut JobObs, d: Decision) -> Option<Generation> {
        match d {
            Decision::Publish {
                generation, status, ..
            } => {
                let rev = obs.generation.as_ref().map(|g| g.1 + 1).unwrap_or(1);
                obs.generation = Some((generation.clone(), rev));
                obs.last_number = generation.number;
                obs.status = Some(status);
                obs.joined.clear();
                Some(generation)
            }
            Decision::Status(s) => {
                obs.status = Some(s);
                None
            }
            Decision::Exclude(slots) => {
                for (n, s, h) in slots {
                    obs.failed.insert((n, s), h);
                }
                None
            }
            Decision::Nothing => None,
        }
    }
    fn step(obs: &mut JobObs, f: &Fleet, now: u64) -> Option<Generation> {
        let d = plan(obs, f, now);
        apply(obs, d)
    }
    fn slots(g: &Generation) -> Vec<(String, u32, u32)> {
        g.members
            .iter()
            .map(|m| (m.node.clone(), m.slot, m.rank))
            .collect()
    }

    /// `auto` on a fleet where every slot has a GPU of its own: NCCL for the sync modes the
    /// NCCL backend runs (all-reduce, DiLoCo), TCP for async (its updates are host messages).
    #[test]
    fn auto_picks_nccl_only_for_what_nccl_runs() {
        let gpus = |name: &str| {
            let devices = (0..2)
                .map(|i| Device {
                    kind: DeviceKind::Gpu,
                    index: i,
                    name: format!("gpu{i}"),
                    memory_mb: Some(80_000),
                })
                .collect();
            NodeRecord {
                registered_at_ms: 0,
                ..NodeRecord::new(name, "h", devices, 1)
            }
        };
        let f = Fleet {
            nodes: [("a".to_string(), gpus("a"))].into_iter().collect(),
            ..fleet(&[])
        };
        for (sync, want) in [
            ("allreduce", Backend::Nccl),
            ("diloco", Backend::Nccl),
            ("async", Backend::Tcp),
        ] {
            let spec = JobSpec::from_toml(&format!(
                "name = \"j\"\nmin = 1\nmax = 2\ndesired = 2\n[training]\nmodel = \"mlp\"\ndataset = \"file:///d\"\nglobal_batch = 8\nsync = \"{sync}\"\n"
            ))
            .unwrap();
            let mut obs = JobObs {
                spec: Some(spec),
                ..Default::default()
            };
            let g = step(&mut obs, &f, 10).expect("a first generation");
            assert_eq!(g.backend, want, "sync = {sync}");
        }
    }

    #[test]
    fn start_takes_all_slots_up_to_desired_and_is_idempotent() {
        let mut obs = JobObs {
            spec: Some(spec(1, 4, 4)),
            ..Default::default()
        };
        let f = fleet(&[("a", 2), ("b", 1), ("c", 2)]);
        let d = plan(&obs, &f, 10);
        assert!(
            matches!(&d, Decision::Publish { debounce: true, generation, .. } if generation.reason == Reason::Start && generation.number == 1)
        );
        let g = apply(&mut obs, d).unwrap();
        assert_eq!(
            slots(&g),
            vec![
                ("a".into(), 0, 0),
                ("a".into(), 1, 1),
                ("b".into(), 0, 2),
                ("c".into(), 0, 3)
            ]
        );
        assert_eq!(g.state_source, StateSource::Seed);
        // nothing changed: nothing to do (statuses already match)
        assert_eq!(plan(&obs, &f, 20), Decision::Nothing);
    }

    #[test]
    fn a_lost_node_makes_a_failure_generation_and_survivors_keep_rank_order() {
        let mut obs = JobObs {
            spec: Some(spec(1, 4, 4)),
            ..Default::default()
        };
        step(&mut obs, &fleet(&[("a", 2), ("b", 2)]), 0);
        let d = plan(&obs, &fleet(&[("b", 2)]), 5);
        let Decision::Publish {
            generation: g,
            debounce,
            ..
        } = d
        else {
            panic!("{d:?}")
        };
        assert!(!debounce, "failures are not debounced");
        assert_eq!(
            (g.number, g.reason, g.state_source),
            (2, Reason::Failure, StateSource::Peers)
        );
        assert_eq!(slots(&g), vec![("b".into(), 0, 0), ("b".into(), 1, 1)]);
        assert!(g.detail.contains("node a was lost"));
    }

    #[test]
    fn failed_slot_scale_drain_join_and_waiting() {
        let mut obs = JobObs {
            spec: Some(spec(2, 4, 3)),
            ..Default::default()
        };
        let mut f = fleet(&[("a", 2), ("b", 2)]);
        let g = step(&mut obs, &f, 0).unwrap();
        assert_eq!(g.world_size, 3);
        // a worker fails: its slot leaves, and the spare slot fills in
        obs.failed.insert(
            ("a".into(), 1),
            SlotHealth {
                failed_at_ms: 3,
                generation: 1,
                exit: "killed by signal 9".into(),
                will_restart: true,
                excluded: false,
            },
        );
        let g = step(&mut obs, &f, 7).unwrap();
        assert_eq!((g.reason, g.triggered_at_ms), (Reason::Failure, 3));
        assert_eq!(
            slots(&g),
            vec![("a".into(), 0, 0), ("b".into(), 0, 1), ("b".into(), 1, 2)]
        );
        // restarted: the slot is back but the world is already at desired
        obs.failed.clear();
        assert!(matches!(
            plan(&obs, &f, 8),
            Decision::Status(_) | Decision::Nothing
        ));
        // scale up
        obs.spec.as_mut().unwrap().desired = 4;
        let g = step(&mut obs, &f, 9).unwrap();
        assert_eq!((g.reason, g.world_size), (Reason::Scale, 4));
        // drain b
        f.drain_requests.insert("b".into());
        let g = step(&mut obs, &f, 10).unwrap();
        assert_eq!((g.reason, g.world_size), (Reason::Drain, 2));
        // below min: waiting, no generation
        obs.failed.insert(
            ("a".into(), 0),
            SlotHealth {
                failed_at_ms: 11,
                generation: 4,
                exit: "exit code 1".into(),
                will_restart: false,
                excluded: false,
            },
        );
        let d = plan(&obs, &f, 12);
        // (and says which of its own slots failed out, and why)
        assert!(
            matches!(&d, Decision::Status(s) if s.state == JobState::Waiting
                && s.message.contains("1 slot(s) left out after their worker failed with no restart left (restart_budget), the latest a/0: exit code 1")),
            "{d:?}"
        );
        apply(&mut obs, d);
        // b comes back: join (debounced)
        f.drain_requests.clear();
        obs.failed.clear();
        let d = plan(&obs, &f, 13);
        assert!(
            matches!(&d, Decision::Publish { debounce: true, generation, .. } if generation.reason == Reason::Join && generation.world_size == 4)
        );
    }

    #[test]
    fn a_scale_down_that_takes_a_stage_s_only_holder_hands_its_layers_over_first() {
        let pipeline = |desired: u32| {
            JobSpec::from_toml(&format!(
                "name = \"j\"\nmin = 1\nmax = 4\ndesired = {desired}\n[training]\nmodel = \"mlp\"\ndataset = \"file:///d\"\nglobal_batch = 32\nlr = 0.01\nseed = 7\nstrategy = \"pipeline\"\npipeline_parallel = \"auto\"\nmodel_config = {{ hidden = 256, layers = 3 }}\n"
            ))
            .unwrap()
        };
        let f = fleet(&[("a", 2), ("b", 2)]);
        // a job at 3 scaled to 2 at time 100: its first generation, then the next
        let scaled_down = || {
            let mut obs = JobObs {
                spec: Some(pipeline(3)),
                ..Default::default()
            };
            let g1 = step(&mut obs, &f, 0).unwrap();
            obs.spec = Some(pipeline(2));
            obs.spec_revision += 1;
            let h = step(&mut obs, &f, 100).unwrap();
            (obs, g1, h)
        };
        let (mut obs, g1, h) = scaled_down();
        assert_eq!((g1.world_size, g1.layout.data_parallel), (3, 1));
        assert!(g1.layout.pipeline_parallel >= 2, "{g1:?}");
        let t = obs.spec.as_ref().unwrap().training.clone().unwrap();
        let two: Vec<(String, u32)> = g1.members[..2]
            .iter()
            .map(|m| (m.node.clone(), m.slot))
            .collect();
        let lost = lost_units(&g1, &t, &two).expect("rank 2 alone holds some layers");
        // scaled to 2: rank 2 stays one generation as a spare to hand its layers over
        assert!(h.handover, "{h:?}");
        assert_eq!(h.world_size, 3);
        assert_eq!(h.layout.data_parallel * h.layout.pipeline_parallel, 2);
        assert_eq!(h.state_source, StateSource::Peers);
        let spares: Vec<u32> = h
            .members
            .iter()
            .filter(|m| m.spare)
            .map(|m| m.rank)
            .collect();
        assert_eq!(spares, vec![2]);
        assert_eq!(
            (h.members[2].node.as_str(), h.members[2].slot),
            (g1.members[2].node.as_str(), g1.members[2].slot)
        );
        assert!(
            h.detail.contains("hand-over") && h.detail.contains(&lost),
            "{}",
            h.detail
        );
        // until every member joined (the layers moved) nobody leaves
        assert!(step(&mut obs, &f, 200).is_none());
        assert!(obs
            .status
            .as_ref()
            .unwrap()
            .message
            .contains("hand their layers over"));
        for r in 0..3 {
            obs.joined.insert(
                r,
                JoinRecord {
                    rank: r,
                    joined_at_ms: 300,
                    ..Default::default()
                },
            );
        }
        let g3 = step(&mut obs, &f, 400).unwrap();
        assert_eq!(
            (g3.world_size, g3.handover, g3.reason),
            (2, false, Reason::Scale)
        );
        assert_eq!(g3.state_source, StateSource::Peers);
        assert!(g3.members.iter().all(|m| !m.spare));

        // a hand-over that does not complete: the leaver goes after HANDOVER_WAIT_MS
        let (mut obs, _, h) = scaled_down();
        assert!(h.handover);
        assert!(step(&mut obs, &f, 100 + HANDOVER_WAIT_MS - 1).is_none());
        let g = step(&mut obs, &f, 100 + HANDOVER_WAIT_MS).unwrap();
        assert_eq!((g.world_size, g.handover), (2, false));

        // a member fails during the hand-over: the failure re-forms at once
        let (mut obs, _, h) = scaled_down();
        obs.failed.insert(
            (h.members[2].node.clone(), h.members[2].slot),
            SlotHealth {
                failed_at_ms: 150,
                generation: h.number,
                exit: "killed by signal 9".into(),
                will_restart: true,
                excluded: false,
            },
        );
        let g = step(&mut obs, &f, 160).unwrap();
        assert_eq!((g.world_size, g.reason), (2, Reason::Failure));
    }

    #[test]
    fn reformation_is_recorded_once_everyone_joined() {
        let mut obs = JobObs {
            spec: Some(spec(1, 2, 2)),
            ..Default::default()
        };
        let f = fleet(&[("a", 2)]);
        let g = step(&mut obs, &f, 1000).unwrap();
        for m in &g.members {
            obs.joined.insert(
                m.rank,
                JoinRecord {
                    node: m.node.clone(),
                    slot: m.slot,
                    rank: m.rank,
                    pid: 1,
                    joined_at_ms: 1000 + 250 * (m.rank as u64 + 1),
                    step: 0,
                    ..Default::default()
                },
            );
        }
        let Decision::Status(st) = plan(&obs, &f, 2000) else {
            panic!()
        };
        let r = st.last_reformation.clone().unwrap();
        assert_eq!((r.generation, r.reason, r.seconds), (1, Reason::Start, 0.5));
        apply(&mut obs, Decision::Status(st));
        assert_eq!(plan(&obs, &f, 3000), Decision::Nothing);
    }

    #[test]
    fn a_planned_drain_asks_for_a_checkpoint_and_holds_until_it_commits_or_time_runs_out() {
        use DrainCheckpoint::*;
        let sp = JobSpec::from_toml(
            "name = \"j\"\nmin = 1\nmax = 2\ndesired = 2\n[checkpoint]\nurl = \"file:///tmp/c\"\ndrain_wait_s = 20\n",
        )
        .unwrap();
        let mut obs = JobObs {
            spec: Some(sp),
            ..Default::default()
        };
        let mut f = fleet(&[("a", 1), ("b", 1)]);
        let g = step(&mut obs, &f, 0).unwrap();
        assert_eq!(drain_checkpoint(&obs, &f, 1), NotNeeded, "no drain");
        f.nodes.get_mut("b").unwrap().draining = true;
        f.nodes.get_mut("b").unwrap().drain_reason = Some("spot interruption notice".into());
        assert_eq!(
            drain_checkpoint(&obs, &f, 1),
            NotNeeded,
            "nothing trained yet"
        );
        obs.progress = Some(Progress {
            generation: g.number,
            step: 7,
            updated_at_ms: 0,
            ..Default::default()
        });
        // the job's wait, capped by the agent's deadline less the margin
        f.drain_deadlines.insert("b".into(), 1_000 + 10_000);
        let Ask(req) = drain_checkpoint(&obs, &f, 1_000) else {
            panic!("a planned drain asks")
        };
        assert_eq!(req.id, "drain-g1");
        assert_eq!(req.generation, 1);
        assert_eq!(req.deadline_ms, 11_000 - DRAIN_MARGIN_MS);
        assert!(
            req.reason.contains("b (spot interruption notice)"),
            "{}",
            req.reason
        );
        // the re-formation the drain causes is held while the request is open
        let d = plan(&obs, &f, 1_000);
        assert!(
            matches!(&d, Decision::Publish { generation, .. } if generation.reason == Reason::Drain)
        );
        obs.checkpoint_request = Some(req.clone());
        assert_eq!(
            drain_checkpoint(&obs, &f, 2_000),
            Wait {
                id: "drain-g1".into(),
                until_ms: 8_000
            }
        );
        // an interval checkpoint is not the one asked for
        let rec = |request: Option<&str>| CheckpointRecord {
            job: None,
            step: 9,
            generation: 1,
            manifest: "m".into(),
            manifest_crc32c: 0,
            bytes: 1,
            world_size: 2,
            layout: Layout::data_parallel(2),
            committed_at_ms: 2_500,
            request: request.map(String::from),
            unrecorded: Vec::new(),
        };
        obs.checkpoint = Some(rec(None));
        assert!(matches!(drain_checkpoint(&obs, &f, 3_000), Wait { .. }));
        obs.checkpoint = Some(rec(Some("drain-g1")));
        assert_eq!(
            drain_checkpoint(&obs, &f, 3_000),
            Committed {
                id: "drain-g1".into(),
                step: 9
            }
        );
        obs.checkpoint = None;
        assert!(matches!(drain_checkpoint(&obs, &f, 8_000), NoTime { .. }));
        // no time: the last checkpoint took longer than what is left before the node leaves
        obs.checkpoint_request = None;
        obs.checkpoint_stats = Some(CheckpointStats {
            last_stall_ms: 100.0,
            last_upload_seconds: 9.0,
            committed_total: 1,
            ..Default::default()
        });
        let NoTime { detail, .. } = drain_checkpoint(&obs, &f, 1_000) else {
            panic!("there is no time")
        };
        assert!(detail.contains("the last one took 9.1 s"), "{detail}");
        // turned off by the job
        obs.spec
            .as_mut()
            .unwrap()
            .checkpoint
            .as_mut()
            .unwrap()
            .drain_wait_s = 0;
        assert_eq!(drain_checkpoint(&obs, &f, 1_000), NotNeeded);
    }

    #[test]
    fn stop_and_success_are_terminal() {
        let mut obs = JobObs {
            spec: Some(spec(1, 1, 1)),
            ..Default::default()
        };
        let f = fleet(&[("a", 1)]);
        step(&mut obs, &f, 0);
        obs.workers.insert(
            ("a".into(), 0),
            WorkerRecord {
                pid: 1,
                generation: 1,
                state: WorkerState::Exited,
                exit: Some("exit code 0".into()),
                code: Some(0),
                started_at_ms: 0,
            },
        );
        let d = plan(&obs, &f, 1);
        assert!(matches!(&d, Decision::Status(s) if s.state == JobState::Succeeded));
        apply(&mut obs, d);
        obs.stop_requested = true;
        assert_eq!(plan(&obs, &f, 2), Decision::Nothing, "terminal states stay");
    }

    fn report(generation: u64, rank: u32, kind: &str, suspects: &[u32]) -> FaultReport {
        FaultReport {
            generation,
            rank,
            node: "a".into(),
            slot: rank,
            kind: serde_json::from_value(serde_json::json!(kind)).unwrap(),
            suspects: suspects.to_vec(),
            error: format!("{kind} from rank {rank}"),
            at_ms: 5,
        }
    }
    fn started(n: u32) -> (JobObs, Fleet) {
        let mut obs = JobObs {
            spec: Some(spec(1, n, n)),
            ..Default::default()
        };
        let f = fleet(&[("a", n)]);
        let g = step(&mut obs, &f, 10).unwrap();
        assert_eq!(g.world_size, n);
        (obs, f)
    }

    #[test]
    fn a_silent_rank_is_excluded_once_the_others_reported_and_the_job_re_forms_without_it() {
        let (mut obs, f) = started(3);
        // rank 1 stopped: rank 2 (which reads from it) found it silent, rank 0 lost rank 2
        obs.faults = [
            (0, report(1, 0, "peer_lost", &[2])),
            (2, report(1, 2, "silent", &[1])),
        ]
        .into();
        match plan(&obs, &f, 20) {
            Decision::Exclude(slots) => {
                assert_eq!(slots.len(), 1);
                let (n, s, h) = &slots[0];
                assert_eq!((n.as_str(), *s), ("a", 1));
                assert!(h.excluded && h.will_restart && h.generation == 1);
                assert!(
                    h.exit.contains("rank 1 was unreachable for rank(s) 2"),
                    "{}",
                    h.exit
                );
                obs.failed.insert((n.clone(), *s), h.clone());
            }
            d => panic!("{d:?}"),
        }
        obs.faults.clear();
        let g = step(&mut obs, &f, 30).unwrap();
        assert_eq!(
            slots(&g),
            vec![("a".into(), 0, 0), ("a".into(), 2, 1)],
            "the survivors keep their order"
        );
        assert_eq!(g.reason, Reason::Failure);
        assert_eq!(g.state_source, StateSource::Peers);
        assert!(g.detail.contains("excluded"), "{}", g.detail);
        assert_eq!(g.fault_retries, 0);
    }

    /// TorchFT groups keep their number and start through generations that leave them
    /// unchanged; a group whose program exited restarts; a new group takes the smallest free
    /// number; with a group size, a node's slots are cut into groups.
    #[test]
    fn torchft_groups_keep_their_number_and_restart_alone() {
        let of = |g: &[Member]| -> Vec<(String, u32, Option<u32>, u64)> {
            g.iter()
                .map(|m| (m.node.clone(), m.slot, m.replica_group, m.group_since))
                .collect()
        };
        let none = BTreeSet::new();
        let mut g1 = test_generation(1, &[("a", 0), ("b", 0), ("c", 0)]);
        torchft_groups(0, None, &mut g1.members, &none, 1);
        let e = |n: &str, id: u32, since: u64| (n.to_string(), 0, Some(id), since);
        assert_eq!(
            of(&g1.members),
            vec![e("a", 0, 1), e("b", 1, 1), e("c", 2, 1)]
        );
        // b's program exited: b restarts under its number, a and c keep running
        let mut g2 = test_generation(2, &[("a", 0), ("b", 0), ("c", 0)]);
        let restart: BTreeSet<(String, u32)> = [("b".to_string(), 0)].into();
        torchft_groups(0, Some(&g1), &mut g2.members, &restart, 2);
        assert_eq!(
            of(&g2.members),
            vec![e("a", 0, 1), e("b", 1, 2), e("c", 2, 1)]
        );
        // a leaves (scale down), then d comes: d takes the number a left
        let mut g3 = test_generation(3, &[("b", 0), ("c", 0)]);
        torchft_groups(0, Some(&g2), &mut g3.members, &none, 3);
        assert_eq!(of(&g3.members), vec![e("b", 1, 2), e("c", 2, 1)]);
        let mut g4 = test_generation(4, &[("b", 0), ("c", 0), ("d", 0)]);
        torchft_groups(0, Some(&g3), &mut g4.members, &none, 4);
        assert_eq!(
            of(&g4.members),
            vec![e("b", 1, 2), e("c", 2, 1), e("d", 0, 4)]
        );
        // group_size 2: a node's four slots are two groups; losing slot 3 restarts its group
        let mut h1 = test_generation(1, &[("a", 0), ("a", 1), ("a", 2), ("a", 3)]);
        torchft_groups(2, None, &mut h1.members, &none, 1);
        let ids: Vec<Option<u32>> = h1.members.iter().map(|m| m.replica_group).collect();
        assert_eq!(ids, vec![Some(0), Some(0), Some(1), Some(1)]);
        let mut h2 = test_generation(2, &[("a", 0), ("a", 1), ("a", 2)]);
        torchft_groups(2, Some(&h1), &mut h2.members, &none, 2);
        let since: Vec<u64> = h2.members.iter().map(|m| m.group_since).collect();
        assert_eq!(since, vec![1, 1, 2]);
    }

    /// A torchft job of `group_size` 2 is planned in whole groups: a node's odd slot, a group
    /// with a failed slot, or a node of three slots never gives a partial group, and a job
    /// that cannot have `min` in whole groups waits, saying why.
    #[test]
    fn torchft_jobs_are_planned_in_whole_groups() {
        let ft = |min: u32, max: u32, desired: u32| {
            JobSpec::from_toml(&format!(
                "name = \"j\"\nruntime = \"torchft\"\ncommand = [\"python3\", \"/s/t.py\"]\nmin = {min}\nmax = {max}\ndesired = {desired}\n[torchft]\ngroup_size = 2\n"
            ))
            .unwrap()
        };
        let mut obs = JobObs {
            spec: Some(ft(2, 6, 6)),
            ..Default::default()
        };
        // a: 3 slots (one whole group and a lone slot), b: 2 slots
        let f = fleet(&[("a", 3), ("b", 2)]);
        let g = step(&mut obs, &f, 10).unwrap();
        let held: Vec<(String, u32)> = g.members.iter().map(|m| (m.node.clone(), m.slot)).collect();
        let pairs = |v: &[(&str, u32)]| -> Vec<(String, u32)> {
            v.iter().map(|(n, s)| (n.to_string(), *s)).collect()
        };
        assert_eq!(held, pairs(&[("a", 0), ("a", 1), ("b", 0), ("b", 1)]));
        // b/1 fails: its whole group leaves, a's group runs on
        obs.failed.insert(
            ("b".into(), 1),
            SlotHealth {
                failed_at_ms: 20,
                generation: g.number,
                exit: "exit code 1".into(),
                will_restart: false,
                excluded: false,
            },
        );
        let g2 = step(&mut obs, &f, 30).unwrap();
        let held: Vec<(String, u32)> = g2
            .members
            .iter()
            .map(|m| (m.node.clone(), m.slot))
            .collect();
        assert_eq!(held, pairs(&[("a", 0), ("a", 1)]));
        assert!(g2.members.iter().all(|m| m.replica_group == Some(0)));
        // min 4 now needs two whole groups, and only one can be had: waiting, and why
        let mut waiting = JobObs {
            spec: Some(ft(4, 6, 6)),
            failed: obs.failed.clone(),
            ..Default::default()
        };
        assert!(step(&mut waiting, &f, 40).is_none());
        let st = waiting.status.clone().unwrap();
        assert_eq!(st.state, JobState::Waiting);
        assert!(
            st.message.contains("whole replica groups of 2"),
            "{}",
            st.message
        );
    }

    fn torchrun_spec(n: u32) -> JobSpec {
        JobSpec::from_toml(&format!(
            "name = \"j\"\nruntime = \"torchrun\"\ncommand = [\"python3\", \"/s/t.py\"]\nmin = 1\nmax = {n}\ndesired = {n}\n[torchrun]\ndrain_notice_s = 6\n"
        ))
        .unwrap()
    }

    /// A torchrun job's programs exited one after the other (the first raised, the others
    /// lost their connections): once all reported, or the grace after the first report (at
    /// once when the first was killed by a signal: it names itself), the first exit is the
    /// root cause. While the restart budget lasts the world restarts at its size (counted in
    /// `failures`: `TORCHELASTIC_RESTART_COUNT`); then the root cause's slot is left out, and
    /// the job fails when that would leave fewer than `min`.
    #[test]
    fn a_torchrun_job_s_first_program_exit_is_the_root_cause() {
        let start = |budget: u32, min: u32| {
            let mut spec = torchrun_spec(3);
            spec.restart_budget = budget;
            spec.min = min;
            let mut obs = JobObs {
                spec: Some(spec),
                ..Default::default()
            };
            let f = fleet(&[("a", 3)]);
            let g = step(&mut obs, &f, 10).unwrap();
            assert_eq!(g.failures, 0);
            (obs, f, g)
        };
        let exited = |g: &Generation, rank: u32, at_ms: u64, error: &str| FaultReport {
            at_ms,
            error: error.into(),
            ..report(g.number, rank, "exited", &[])
        };
        let (mut obs, f, g) = start(2, 1);
        obs.faults = [
            (
                0,
                exited(
                    &g,
                    0,
                    900,
                    "exit code 1: RuntimeError: Connection closed by peer",
                ),
            ),
            (2, exited(&g, 2, 400, "exit code 1: ValueError: boom")),
        ]
        .into();
        obs.faults_seen_ms = 100;
        assert!(
            matches!(plan(&obs, &f, 20), Decision::Nothing),
            "rank 1 may still report"
        );
        obs.faults_seen_ms = FAULT_GRACE_MS + 1;
        let g2 = step(&mut obs, &f, 30).expect("the world restarts");
        assert_eq!(
            (g2.reason, g2.world_size, g2.failures),
            (Reason::Failure, 3, 1)
        );
        assert_eq!(slots(&g2), slots(&g), "the same members at the same ranks");
        assert!(
            g2.detail.contains("rank 2's program failed first: exit code 1: ValueError: boom; the world restarts (restart 1 of 2)"),
            "{}",
            g2.detail
        );
        // a program killed by a signal names itself: decided at once, without the others
        obs.faults = [(
            1,
            FaultReport {
                suspects: vec![1],
                ..exited(&g2, 1, 50, "killed by signal 9")
            },
        )]
        .into();
        obs.faults_seen_ms = 0;
        let g3 = step(&mut obs, &f, 40).expect("restarted at once");
        assert_eq!((g3.failures, g3.world_size), (2, 3));
        // the budget used up: the root cause is left out, not restarted
        obs.faults = [(
            0,
            FaultReport {
                suspects: vec![0],
                ..exited(&g3, 0, 60, "killed by signal 9")
            },
        )]
        .into();
        let Decision::Exclude(out) = plan(&obs, &f, 50) else {
            panic!("left out")
        };
        let (n, s, h) = &out[0];
        assert_eq!((n.as_str(), *s), ("a", 0));
        assert!(h.excluded && !h.will_restart, "{h:?}");
        assert!(
            h.exit.contains("restart budget (2) is used up"),
            "{}",
            h.exit
        );
        obs.failed.insert((n.clone(), *s), h.clone());
        obs.faults.clear();
        let g4 = step(&mut obs, &f, 60).unwrap();
        assert_eq!((g4.world_size, g4.failures), (2, 3));
        // and below min, the job fails with the reason
        let (mut obs, f, g) = start(0, 3);
        obs.faults = [(
            1,
            FaultReport {
                suspects: vec![1],
                ..exited(&g, 1, 50, "exit code 1: OSError: disk full")
            },
        )]
        .into();
        match plan(&obs, &f, 20) {
            Decision::Status(st) => {
                assert_eq!(st.state, JobState::Failed);
                assert!(
                    st.message.contains("OSError: disk full") && st.message.contains("min = 3"),
                    "{}",
                    st.message
                );
            }
            d => panic!("{d:?}"),
        }
    }

    /// What a job's etcd user holds under `live/{job}/` is bounded: past the bound (keys or
    /// bytes) the job fails, saying so; at the bound it runs on.
    #[test]
    fn a_job_past_its_live_bound_fails() {
        let mut obs = JobObs {
            spec: Some(torchrun_spec(3)),
            ..Default::default()
        };
        let f = fleet(&[("a", 3)]);
        step(&mut obs, &f, 10).unwrap();
        let (keys, bytes) = live_bound(obs.spec.as_ref().unwrap());
        (obs.live_keys, obs.live_bytes) = (keys, bytes);
        assert!(
            !matches!(plan(&obs, &f, 20), Decision::Status(ref st) if st.state == JobState::Failed)
        );
        for (k, b) in [(keys + 1, 0), (0, bytes + 1)] {
            (obs.live_keys, obs.live_bytes) = (k, b);
            match plan(&obs, &f, 20) {
                Decision::Status(st) => {
                    assert_eq!(st.state, JobState::Failed);
                    assert!(st.message.contains("past the bound of"), "{}", st.message);
                }
                d => panic!("{d:?}"),
            }
        }
    }

    /// A planned drain of a node a torchrun job runs on: the request is the programs' notice
    /// (`ductile.preempted()`), and the re-formation waits `drain_notice_s` for them to save,
    /// whether or not they report progress.
    /// Early failures (no progress report, soon after the start): the same error twice in a
    /// row fails the job; different ones back off 1 s, 2 s, ... before each restart; a kill
    /// by a signal is no crash of the program's own.
    #[test]
    fn a_torchrun_crash_loop_backs_off_and_fails_on_the_same_error_twice() {
        let mut spec = torchrun_spec(2);
        spec.restart_budget = 20;
        let mut obs = JobObs {
            spec: Some(spec),
            ..Default::default()
        };
        let f = fleet(&[("a", 2)]);
        let g = step(&mut obs, &f, 10).unwrap();
        let fail = |obs: &mut JobObs, g: &Generation, at: u64, error: &str| {
            obs.faults = [(
                0,
                FaultReport {
                    at_ms: at,
                    error: error.into(),
                    suspects: vec![0],
                    ..report(g.number, 0, "exited", &[])
                },
            )]
            .into();
            obs.faults_seen_ms = FAULT_GRACE_MS + 1;
        };
        fail(
            &mut obs,
            &g,
            20,
            "exit code 1: ValueError: bad --lr (pid 41)",
        );
        let g2 = step(&mut obs, &f, 30).expect("the first early failure restarts at once");
        assert_eq!(g2.early_crash.as_ref().unwrap().streak, 1);
        // another error: a back-off of 1 s before the restart
        fail(&mut obs, &g2, 40, "exit code 1: KeyError: 'x'");
        assert!(matches!(plan(&obs, &f, 500), Decision::Nothing));
        let g3 = step(&mut obs, &f, 1_100).expect("restarted after the back-off");
        assert!(g3.detail.contains("after a 1 s back-off"), "{}", g3.detail);
        assert_eq!(g3.early_crash.as_ref().unwrap().streak, 2);
        // the same error again (other digits): a crash loop, the job fails
        fail(&mut obs, &g3, 1_200, "exit code 1: KeyError: 'x'");
        let Decision::Status(st) = plan(&obs, &f, 1_300) else {
            panic!("the job fails")
        };
        assert_eq!(st.state, JobState::Failed);
        assert!(st.message.contains("crash loop"), "{}", st.message);
        assert_eq!(
            EarlyCrash::normalize("pid 41 at 12:03"),
            EarlyCrash::normalize("pid 7 at 1:9")
        );
        assert_eq!(
            (
                crash_backoff_ms(1),
                crash_backoff_ms(2),
                crash_backoff_ms(4),
                crash_backoff_ms(40)
            ),
            (0, 1_000, 4_000, CRASH_BACKOFF_MAX_MS)
        );
        // a kill by a signal resets the streak and restarts at once
        let mut obs2 = JobObs {
            spec: obs.spec.clone(),
            ..Default::default()
        };
        let h = step(&mut obs2, &f, 10).unwrap();
        fail(&mut obs2, &h, 20, "killed by signal 9");
        let h2 = step(&mut obs2, &f, 30).unwrap();
        assert!(h2.early_crash.is_none());
    }

    #[test]
    fn a_torchrun_job_is_told_of_a_drain_before_its_world_re_forms() {
        use DrainCheckpoint::*;
        let mut obs = JobObs {
            spec: Some(torchrun_spec(2)),
            ..Default::default()
        };
        let mut f = fleet(&[("a", 1), ("b", 1)]);
        step(&mut obs, &f, 0).unwrap();
        f.nodes.get_mut("b").unwrap().draining = true;
        let Ask(req) = drain_checkpoint(&obs, &f, 1_000) else {
            panic!("a planned drain tells the programs")
        };
        assert_eq!(req.deadline_ms, 7_000);
        obs.checkpoint_request = Some(req);
        assert!(matches!(
            drain_checkpoint(&obs, &f, 5_000),
            Wait {
                until_ms: 7_000,
                ..
            }
        ));
        let NoTime { detail, .. } = drain_checkpoint(&obs, &f, 7_000) else {
            panic!("the notice's time is up")
        };
        assert!(detail.contains("ductile.preempted()"), "{detail}");
    }

    /// A torchrun job's resize gives its program the drain's notice when it reports progress:
    /// the new generation waits for its `ductile.saved` (then goes ahead at once), at most
    /// `drain_notice_s`; a program that never reported is resized at once.
    #[test]
    fn a_torchrun_resize_waits_for_the_program_s_save_after_its_notice() {
        use DrainCheckpoint::*;
        let mut obs = JobObs {
            spec: Some(torchrun_spec(2)),
            ..Default::default()
        };
        let f = fleet(&[("a", 2)]);
        let g = step(&mut obs, &f, 0).unwrap();
        assert_eq!(resize_notice(&obs, 1_000), NotNeeded, "no report yet");
        obs.progress = Some(Progress {
            generation: g.number,
            step: 40,
            updated_at_ms: 900,
            ..Default::default()
        });
        let Ask(req) = resize_notice(&obs, 1_000) else {
            panic!("the program is told first")
        };
        assert_eq!((req.id.as_str(), req.deadline_ms), ("resize-g1", 7_000));
        obs.checkpoint_request = Some(req);
        assert!(matches!(
            resize_notice(&obs, 2_000),
            Wait {
                until_ms: 7_000,
                ..
            }
        ));
        // an earlier save does not count; the one after the notice does
        obs.progress.as_mut().unwrap().saved_step = Some(30);
        obs.progress.as_mut().unwrap().saved_at_ms = Some(500);
        assert!(matches!(resize_notice(&obs, 2_000), Wait { .. }));
        obs.progress.as_mut().unwrap().saved_step = Some(41);
        obs.progress.as_mut().unwrap().saved_at_ms = Some(1_500);
        assert_eq!(
            resize_notice(&obs, 2_000),
            Committed {
                id: "resize-g1".into(),
                step: 41
            }
        );
        // without the save: the notice's time runs out
        obs.progress.as_mut().unwrap().saved_at_ms = None;
        let NoTime { detail, .. } = resize_notice(&obs, 7_000) else {
            panic!("the time is up")
        };
        assert!(detail.contains("ductile.saved"), "{detail}");
    }

    #[test]
    fn the_leader_waits_a_grace_for_the_other_reports_before_naming_a_culprit() {
        let (mut obs, f) = started(3);
        obs.faults = [(0, report(1, 0, "silent", &[1]))].into();
        // rank 2 has neither reported nor been named: it may be reporting right now
        obs.faults_seen_ms = 200;
        assert_eq!(plan(&obs, &f, 20), Decision::Nothing);
        obs.faults_seen_ms = FAULT_GRACE_MS + 1;
        match plan(&obs, &f, 20) {
            Decision::Exclude(slots) => assert_eq!(slots[0].1, 1),
            d => panic!("{d:?}"),
        }
        // a report of another generation is not about this one
        obs.faults = [(0, report(7, 0, "silent", &[1]))].into();
        assert_eq!(plan(&obs, &f, 20), Decision::Nothing);
    }

    #[test]
    fn when_every_rank_reports_the_same_members_re_form_then_a_culprit_is_excluded() {
        let (mut obs, f) = started(2);
        // a partition between two live workers: each finds the other silent
        obs.faults = [
            (0, report(1, 0, "silent", &[1])),
            (1, report(1, 1, "silent", &[0])),
        ]
        .into();
        let g = step(&mut obs, &f, 20).expect("the same members re-form");
        assert_eq!(g.number, 2);
        assert_eq!(g.fault_retries, 1);
        assert_eq!(slots(&g).len(), 2);
        assert!(g.detail.contains("try 1 of 3"), "{}", g.detail);
        // it fails again without a step: one of the pair goes (the highest rank on a tie)
        obs.faults = [
            (0, report(2, 0, "silent", &[1])),
            (1, report(2, 1, "silent", &[0])),
        ]
        .into();
        match plan(&obs, &f, 30) {
            Decision::Exclude(slots) => assert_eq!((slots[0].0.as_str(), slots[0].1), ("a", 1)),
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn re_formations_without_a_step_are_bounded_then_the_job_fails_with_the_reason() {
        let (mut obs, f) = started(2);
        for want in 1..=3u32 {
            let n = obs.generation.as_ref().unwrap().0.number;
            obs.faults = [
                (0, report(n, 0, "store", &[])),
                (1, report(n, 1, "store", &[])),
            ]
            .into();
            let g = step(&mut obs, &f, 20 + want as u64).expect("re-formed");
            assert_eq!(g.fault_retries, want);
        }
        let n = obs.generation.as_ref().unwrap().0.number;
        obs.faults = [
            (0, report(n, 0, "store", &[])),
            (1, report(n, 1, "store", &[])),
        ]
        .into();
        match plan(&obs, &f, 40) {
            Decision::Status(st) => {
                assert_eq!(st.state, JobState::Failed);
                assert!(st.message.contains("store from rank 0"), "{}", st.message);
                assert!(st.message.contains("giving up"), "{}", st.message);
            }
            d => panic!("{d:?}"),
        }
        // a step in between resets the count
        obs.progress = Some(Progress {
            generation: n,
            step: 9,
            updated_at_ms: 0,
            ..Default::default()
        });
        let g = step(&mut obs, &f, 50).expect("re-formed");
        assert_eq!(g.fault_retries, 1);
    }

    #[test]
    fn a_stalled_training_job_re_forms_after_its_stall_timeout() {
        let mut obs = JobObs {
            spec: Some(
                JobSpec::from_toml(
                    "name = \"j\"\nmin = 1\nmax = 2\ndesired = 2\nstall_timeout_s = 60\n[training]\nmodel = \"mlp\"\ndataset = \"file:///x\"\nglobal_batch = 8\n",
                )
                .unwrap(),
            ),
            ..Default::default()
        };
        let f = fleet(&[("a", 2)]);
        step(&mut obs, &f, 10).unwrap();
        obs.stalled_ms = Some(59_000);
        assert!(matches!(
            plan(&obs, &f, 20),
            Decision::Nothing | Decision::Status(_)
        ));
        obs.stalled_ms = Some(61_000);
        let g = step(&mut obs, &f, 30).expect("re-formed");
        assert!(g.detail.contains("no step for 61 s"), "{}", g.detail);
        assert_eq!(g.fault_retries, 1);
        assert_eq!(g.members.len(), 2);
    }

    #[test]
    fn a_member_that_only_closed_its_connections_is_left_to_its_agent_first() {
        let (mut obs, f) = started(3);
        // rank 2 was killed: the others saw its connections close
        obs.faults = [
            (0, report(1, 0, "peer_lost", &[2])),
            (1, report(1, 1, "peer_lost", &[2])),
        ]
        .into();
        obs.faults_seen_ms = 100;
        assert_eq!(plan(&obs, &f, 20), Decision::Nothing);
        // its agent's exit report arrives: the membership path re-forms without it
        let mut with_exit = obs.clone();
        with_exit.failed.insert(
            ("a".into(), 2),
            SlotHealth {
                failed_at_ms: 15,
                generation: 1,
                exit: "killed by signal 9".into(),
                will_restart: true,
                excluded: false,
            },
        );
        let g = step(&mut with_exit, &f, 30).unwrap();
        assert!(g.detail.contains("killed by signal 9"), "{}", g.detail);
        // nothing ever reports it: past the grace it is excluded all the same
        obs.faults_seen_ms = PEER_LOST_GRACE_MS + 1;
        match plan(&obs, &f, 40) {
            Decision::Exclude(slots) => assert_eq!(slots[0].1, 2),
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn a_slot_runs_one_jobs_worker_a_second_job_waits_for_free_slots() {
        let mut f = fleet(&[("a", 1), ("b", 1), ("c", 1)]);
        let mut first = JobObs {
            spec: Some(spec(1, 2, 2)),
            ..Default::default()
        };
        let g1 = step(&mut first, &f, 10).expect("the first job starts");
        f.hold("j", &g1.members);
        // another job (same helper spec, another name) sees only the free slot
        let mut other = JobObs {
            spec: Some(JobSpec {
                name: "k".into(),
                ..spec(1, 3, 3)
            }),
            ..Default::default()
        };
        let g2 = step(&mut other, &f, 20).expect("the second job starts on what is free");
        assert_eq!(slots(&g2), vec![("c".to_string(), 0, 0)]);
        f.hold("k", &g2.members);
        // a third cannot start at all, and says why
        let mut third = JobObs {
            spec: Some(JobSpec {
                name: "l".into(),
                ..spec(1, 1, 1)
            }),
            ..Default::default()
        };
        match plan(&third, &f, 30) {
            Decision::Status(s) => {
                assert_eq!(s.state, JobState::Waiting);
                assert!(
                    s.message.contains("(3 more held by other jobs)"),
                    "{}",
                    s.message
                );
            }
            d => panic!("{d:?}"),
        }
        // once the first job lets go, the waiting job's need is kept free of k's growth
        f.hold("j", &[]);
        f.want("l", 0, 1);
        match plan(&other, &f, 35) {
            Decision::Publish { generation, .. } => assert_eq!(generation.world_size, 2),
            d => panic!("{d:?}"),
        }
        let g4 = step(&mut third, &f, 40).expect("l starts");
        f.want("l", 1, 1);
        f.hold("l", &g4.members);
        let g3 = step(&mut other, &f, 50000).expect("k grows into what l left");
        assert_eq!(g3.world_size, 2);
        assert!(g3
            .members
            .iter()
            .all(|m| g4.member(&m.node, m.slot).is_none()));
    }
}

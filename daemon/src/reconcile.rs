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
}

/// Live membership: nodes with their records, and the nodes asked to drain.
#[derive(Clone, Debug, Default)]
pub struct Fleet {
    pub nodes: BTreeMap<String, NodeRecord>,
    pub drain_requests: BTreeSet<String>,
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
}

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
    let Some(ck) = spec.checkpoint.as_ref().filter(|c| c.drain_wait_s > 0) else {
        return NotNeeded;
    };
    if obs.stop_requested || obs.status.as_ref().is_some_and(|s| s.state.is_terminal()) {
        return NotNeeded;
    }
    // members on nodes that are leaving but still here (a lost node has nothing to save)
    let leaving: BTreeSet<&str> = g
        .members
        .iter()
        .map(|m| m.node.as_str())
        .filter(|n| fleet.nodes.contains_key(*n) && fleet.is_draining(n))
        .collect();
    if leaving.is_empty() || !obs.progress.as_ref().is_some_and(|p| p.step > 0) {
        return NotNeeded;
    }
    let id = format!("drain-g{}", g.number);
    if let Some(r) = obs.checkpoint_request.as_ref().filter(|r| r.id == id) {
        return match obs.checkpoint.as_ref() {
            Some(c) if c.request.as_deref() == Some(id.as_str()) => Committed { id, step: c.step },
            _ if now < r.deadline_ms => Wait {
                id,
                until_ms: r.deadline_ms,
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
    let mut deadline = now + ck.drain_wait_s * 1000;
    for n in &leaving {
        if let Some(d) = fleet.nodes[*n].drain_deadline_ms {
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

/// Decide what one job needs now.
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
                    w.state == WorkerState::Exited && w.code == Some(0) && w.generation == g.number
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

    // Live slots, in a stable order.
    let mut candidates: Vec<(String, u32)> = Vec::new();
    for (name, node) in &fleet.nodes {
        if fleet.is_draining(name) {
            continue;
        }
        for slot in 0..node.slots() {
            if !obs.failed.contains_key(&(name.clone(), slot)) {
                candidates.push((name.clone(), slot));
            }
        }
    }
    let target = spec.desired.clamp(spec.min, spec.max) as usize;
    if candidates.len() < spec.min as usize {
        let msg = format!(
            "waiting: {} live slot(s), the job needs at least {}",
            candidates.len(),
            spec.min
        );
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
    for c in &candidates {
        if chosen.len() >= target {
            break;
        }
        if !chosen.contains(c) {
            chosen.push(c.clone());
        }
    }

    let old: BTreeSet<(String, u32)> = cur
        .map(|g| g.members.iter().map(|m| (m.node.clone(), m.slot)).collect())
        .unwrap_or_default();
    let new: BTreeSet<(String, u32)> = chosen.iter().cloned().collect();
    if cur.is_some() && old == new {
        let g = cur.unwrap();
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
            st.last_reformation = Some(Reformation {
                generation: g.number,
                reason: g.reason,
                detail: g.detail.clone(),
                seconds: last_join.saturating_sub(g.triggered_at_ms) as f64 / 1000.0,
            });
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
        (Reason::Drain, format!("node {n} is draining"))
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
    let state_source = match (cur, survivors) {
        (Some(_), s) if s > 0 => StateSource::Peers,
        _ if spec.checkpoint.is_some() => StateSource::Checkpoint,
        _ => StateSource::Seed,
    };
    let members: Vec<Member> = chosen
        .iter()
        .enumerate()
        .map(|(r, (n, s))| Member {
            node: n.clone(),
            slot: *s,
            rank: r as u32,
        })
        .collect();
    let number = cur.map(|g| g.number).unwrap_or(0).max(obs.last_number) + 1;
    let generation = Generation {
        job: spec.name.clone(),
        number,
        world_size: members.len() as u32,
        layout: Layout::data_parallel(members.len() as u32),
        members,
        resume_step: obs.progress.as_ref().map(|p| p.step).unwrap_or(0),
        state_source,
        desired: spec.desired,
        reason,
        detail: detail.clone(),
        triggered_at_ms: triggered_at,
        published_at_ms: now,
        backend: Backend::resolve(
            spec.training
                .as_ref()
                .map(|t| t.comm.as_str())
                .unwrap_or("tcp"),
            &chosen
                .iter()
                .map(|(n, s)| {
                    (
                        n.clone(),
                        fleet.nodes.get(n).and_then(|r| r.devices.get(*s as usize)),
                    )
                })
                .collect::<Vec<_>>(),
        ),
    };
    let st = status(
        &spec.name,
        JobState::Running,
        Some(&generation),
        prev_status,
        detail,
        now,
    );
    Decision::Publish {
        generation,
        status: st,
        debounce: matches!(reason, Reason::Start | Reason::Join),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, slots: u32) -> NodeRecord {
        NodeRecord {
            name: name.into(),
            hostname: "h".into(),
            devices: (0..slots)
                .map(|i| Device {
                    kind: DeviceKind::Cpu,
                    index: i,
                    name: format!("cpu{i}"),
                    memory_mb: None,
                })
                .collect(),
            agent_pid: 1,
            registered_at_ms: 0,
            draining: false,
            drain_reason: None,
            drain_deadline_ms: None,
            reregistrations: 0,
        }
    }
    fn fleet(nodes: &[(&str, u32)]) -> Fleet {
        Fleet {
            nodes: nodes
                .iter()
                .map(|(n, s)| (n.to_string(), node(n, *s)))
                .collect(),
            drain_requests: Default::default(),
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
            },
        );
        let d = plan(&obs, &f, 12);
        assert!(
            matches!(&d, Decision::Status(s) if s.state == JobState::Waiting),
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
            loss: None,
            samples_per_sec: None,
            updated_at_ms: 0,
            done: false,
            final_weights_sha256: None,
        });
        // the job's wait, capped by the agent's deadline less the margin
        f.nodes.get_mut("b").unwrap().drain_deadline_ms = Some(1_000 + 10_000);
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
            step: 9,
            generation: 1,
            manifest: "m".into(),
            manifest_crc32c: 0,
            bytes: 1,
            world_size: 2,
            layout: Layout::data_parallel(2),
            committed_at_ms: 2_500,
            request: request.map(String::from),
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
}

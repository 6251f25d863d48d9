//! The per-node view agents watch (`assign/{node}/{job}`): what each node runs, derived by the
//! leader from the jobs' control state and rewritten only where it changed, so that a progress
//! write, a status update or another job's re-formation wakes no agent, and a generation wakes
//! only the agents of the nodes it concerns.

use std::collections::{BTreeMap, HashMap};

use ductile_cluster::kv::{Compare, LeaderKey, Op, Txn};
use ductile_cluster::records::{AssignedSlot, NodeAssignment, SlotHealth};
use ductile_cluster::store::encode;
use ductile_cluster::Store;

use crate::reconcile::JobObs;

/// Each node's view of every active job with a member or a failed slot on it, keyed by
/// (node, job). A pure function of the observed jobs. With `job_users`, a job is shown to its
/// nodes only once it has its etcd user (its workers connect as nothing else).
pub fn node_assignments(
    jobs: &BTreeMap<String, JobObs>,
    job_users: bool,
) -> BTreeMap<(String, String), NodeAssignment> {
    let mut out: BTreeMap<(String, String), NodeAssignment> = BTreeMap::new();
    for (name, obs) in jobs
        .iter()
        .filter(|(_, o)| o.is_active() && (!job_users || o.access.is_some()))
    {
        let (Some(spec), Some((g, _))) = (&obs.spec, &obs.generation) else {
            continue;
        };
        // per node: its slots in the generation, and its excluded slots; a node with a failed
        // slot keeps the job in view even when no generation includes it any more (its agent
        // restarts the slot from the job's budget)
        let mut per_node: BTreeMap<&str, (Vec<AssignedSlot>, BTreeMap<u32, SlotHealth>)> =
            BTreeMap::new();
        for m in &g.members {
            let since = obs
                .member_since
                .get(&(m.node.clone(), m.slot))
                .copied()
                .unwrap_or(g.number);
            per_node.entry(&m.node).or_default().0.push(AssignedSlot {
                slot: m.slot,
                rank: m.rank,
                since,
            });
        }
        for ((node, slot), h) in &obs.failed {
            let e = per_node.entry(node).or_default();
            if h.excluded {
                e.1.insert(*slot, h.clone());
            }
        }
        for (node, (mut slots, excluded)) in per_node {
            slots.sort_by_key(|s| s.slot);
            let view = NodeAssignment {
                job: name.clone(),
                spec: spec.clone(),
                generation: g.number,
                world_size: g.world_size,
                slots,
                excluded,
                restarts_used: obs.restarts_used,
                access: obs.access.clone(),
                job_number: obs.spec_created.max(0) as u64,
            };
            out.insert((node.to_string(), name.clone()), view);
        }
    }
    out
}

/// What the leader last wrote under `assign/`, so that it writes only what changed. Unknown
/// until listed once (a leader that just took over reads what its predecessor left).
#[derive(Default)]
pub struct Assignments {
    written: Option<HashMap<String, Vec<u8>>>,
}

/// At most this many operations per transaction (etcd's default limit is 128).
const OPS_PER_TXN: usize = 64;

impl Assignments {
    /// Bring `assign/` in line with `desired`, fenced on the leader key. Returns Ok(false)
    /// when the fence failed (another leader), Err on an etcd error: what went through is
    /// remembered and the rest is tried again on the next pass.
    pub async fn sync(
        &mut self,
        store: &Store,
        leader: &LeaderKey,
        desired: &BTreeMap<(String, String), NodeAssignment>,
    ) -> ductile_cluster::Result<bool> {
        let k = &store.keys;
        if self.written.is_none() {
            let (kvs, _) = store.backend.list(&k.assignments()).await?;
            self.written = Some(kvs.into_iter().map(|kv| (kv.key, kv.value)).collect());
        }
        let written = self.written.as_mut().expect("listed above");
        let mut want: HashMap<String, Vec<u8>> = HashMap::with_capacity(desired.len());
        for ((node, job), a) in desired {
            want.insert(k.assignment(node, job), encode(a));
        }
        let mut changes: Vec<(String, Option<Vec<u8>>)> = Vec::new();
        for (key, v) in &want {
            if written.get(key) != Some(v) {
                changes.push((key.clone(), Some(v.clone())));
            }
        }
        for key in written.keys() {
            if !want.contains_key(key) {
                changes.push((key.clone(), None));
            }
        }
        changes.sort();
        for chunk in changes.chunks(OPS_PER_TXN) {
            let ops = chunk
                .iter()
                .map(|(key, v)| match v {
                    Some(v) => Op::put(key.clone(), v.clone()),
                    None => Op::Delete { key: key.clone() },
                })
                .collect();
            let txn = Txn {
                compares: vec![Compare::CreateRevision(
                    leader.key.clone(),
                    leader.create_revision,
                )],
                ops,
            };
            if !store.backend.txn(txn).await?.succeeded {
                return Ok(false);
            }
            for (key, v) in chunk {
                match v {
                    Some(v) => written.insert(key.clone(), v.clone()),
                    None => written.remove(key),
                };
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::test_generation;
    use ductile_cluster::records::*;

    fn obs(g: Generation) -> JobObs {
        let spec = JobSpec::from_toml("name = \"j\"\nmin = 1\nmax = 4\ndesired = 2\n").unwrap();
        JobObs {
            spec: Some(spec),
            generation: Some((g, 1)),
            ..Default::default()
        }
    }

    #[test]
    fn each_node_sees_only_its_own_slots_and_exclusions() {
        let mut o = obs(test_generation(3, &[("a", 0), ("b", 0), ("a", 1)]));
        o.member_since.insert(("a".into(), 0), 1);
        o.failed.insert(
            ("c".into(), 0),
            SlotHealth {
                failed_at_ms: 1,
                generation: 2,
                exit: "stopped".into(),
                will_restart: true,
                excluded: true,
            },
        );
        o.failed.insert(
            ("b".into(), 1),
            SlotHealth {
                failed_at_ms: 1,
                generation: 2,
                exit: "exit 1".into(),
                will_restart: true,
                excluded: false, // the agent's own report: not echoed back
            },
        );
        o.restarts_used = 2;
        let jobs = BTreeMap::from([("j".to_string(), o)]);
        let v = node_assignments(&jobs, false);
        assert_eq!(v.len(), 3, "{v:?}");
        let a = &v[&("a".to_string(), "j".to_string())];
        assert_eq!(
            a.slots,
            vec![
                AssignedSlot {
                    slot: 0,
                    rank: 0,
                    since: 1
                },
                AssignedSlot {
                    slot: 1,
                    rank: 2,
                    since: 3
                }
            ]
        );
        assert!(a.member_since(0, 1) && a.member_since(0, 0) && !a.member_since(1, 1));
        assert_eq!(a.restarts_used, 2);
        let b = &v[&("b".to_string(), "j".to_string())];
        assert!(b.excluded.is_empty());
        assert_eq!(b.slots.len(), 1);
        let c = &v[&("c".to_string(), "j".to_string())];
        assert!(c.slots.is_empty() && c.excluded.contains_key(&0));
    }

    #[test]
    fn a_stopped_or_finished_job_is_in_no_view() {
        let mut o = obs(test_generation(1, &[("a", 0)]));
        o.stop_requested = true;
        let jobs = BTreeMap::from([("j".to_string(), o.clone())]);
        assert!(node_assignments(&jobs, false).is_empty());
        o.stop_requested = false;
        o.status = Some(JobStatus {
            job: "j".into(),
            state: JobState::Succeeded,
            generation: 1,
            world_size: 1,
            last_reformation: None,
            message: String::new(),
            updated_at_ms: 0,
            reformations: Default::default(),
            reformation_seconds: Default::default(),
        });
        let jobs = BTreeMap::from([("j".to_string(), o)]);
        assert!(node_assignments(&jobs, false).is_empty());
    }

    #[test]
    fn with_job_users_a_job_reaches_its_nodes_only_with_its_user_and_carries_it() {
        let mut o = obs(test_generation(1, &[("a", 0)]));
        let jobs = BTreeMap::from([("j".to_string(), o.clone())]);
        assert!(node_assignments(&jobs, true).is_empty());
        assert_eq!(node_assignments(&jobs, false).len(), 1);
        let access = ductile_cluster::records::JobAccess {
            user: "ductile-job-j".into(),
            password: "p".into(),
        };
        o.access = Some(access.clone());
        let jobs = BTreeMap::from([("j".to_string(), o)]);
        let v = node_assignments(&jobs, true);
        assert_eq!(v[&("a".to_string(), "j".to_string())].access, Some(access));
    }
}

//! The typed store: records in, records out, over any [`KvBackend`].

use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::keys::Keys;
use crate::kv::*;
use crate::records::*;
use crate::{ClusterError, Result};

/// Decode a JSON record, naming the key when it is not valid.
pub fn decode<T: DeserializeOwned>(kv: &KeyValue, what: &'static str) -> Result<T> {
    serde_json::from_slice(&kv.value).map_err(|source| ClusterError::Decode {
        key: kv.key.clone(),
        what,
        source,
    })
}

pub fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("records always serialize")
}

/// Typed access to ductile's records. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    pub backend: Arc<dyn KvBackend>,
    pub keys: Keys,
}

impl Store {
    pub fn new(backend: Arc<dyn KvBackend>, keys: Keys) -> Self {
        Store { backend, keys }
    }

    pub async fn get_json<T: DeserializeOwned>(
        &self,
        key: &str,
        what: &'static str,
    ) -> Result<Option<(T, KeyValue)>> {
        match self.backend.get(key).await? {
            Some(kv) => Ok(Some((decode(&kv, what)?, kv))),
            None => Ok(None),
        }
    }

    pub async fn put_json<T: Serialize>(
        &self,
        key: &str,
        v: &T,
        lease: Option<LeaseId>,
    ) -> Result<Revision> {
        self.backend.put(key, encode(v), lease).await
    }

    /// Every record under a prefix. A record that does not decode is skipped with a warning
    /// (one bad record must not blind the control plane to the rest).
    pub async fn list_json<T: DeserializeOwned>(
        &self,
        prefix: &str,
        what: &'static str,
    ) -> Result<Vec<(T, KeyValue)>> {
        let (kvs, _) = self.backend.list(prefix).await?;
        Ok(kvs
            .into_iter()
            .filter_map(|kv| match decode(&kv, what) {
                Ok(v) => Some((v, kv)),
                Err(e) => {
                    tracing::warn!(error = %e, "skipping undecodable record");
                    None
                }
            })
            .collect())
    }

    pub async fn nodes(&self) -> Result<Vec<NodeRecord>> {
        Ok(self
            .list_json(&self.keys.nodes(), "node record")
            .await?
            .into_iter()
            .map(|(n, _)| n)
            .collect())
    }

    pub async fn spec(&self, job: &str) -> Result<Option<(JobSpec, KeyValue)>> {
        self.get_json(&self.keys.spec(job), "job spec").await
    }

    pub async fn specs(&self) -> Result<Vec<JobSpec>> {
        let (kvs, _) = self.backend.list(&self.keys.jobs()).await?;
        let mut out = Vec::new();
        for kv in kvs {
            if matches!(
                self.keys.parse(&kv.key),
                crate::keys::KeyKind::JobSpec { .. }
            ) {
                out.push(decode(&kv, "job spec")?);
            }
        }
        Ok(out)
    }

    /// Create a job. Refused if a job of that name exists and is not finished; a finished one
    /// (stopped, succeeded, failed) is replaced, and its old keys are cleared in the same
    /// transaction.
    pub async fn submit(&self, spec: &JobSpec) -> Result<()> {
        spec.validate()?;
        let key = self.keys.spec(&spec.name);
        let mut compares = vec![Compare::Absent(key.clone())];
        let mut ops = Vec::new();
        if let Some((_, kv)) = self.spec(&spec.name).await? {
            let status = self.status(&spec.name).await?;
            match status {
                Some((st, skv)) if st.state.is_terminal() => {
                    compares = vec![
                        Compare::ModRevision(key.clone(), kv.mod_revision),
                        Compare::ModRevision(skv.key.clone(), skv.mod_revision),
                    ];
                    // keep the history: generation numbers never repeat for a name
                    for sub in [
                        "status",
                        "generation",
                        "slots/",
                        "workers/",
                        "restarts",
                        "stop",
                    ] {
                        ops.push(Op::DeletePrefix {
                            prefix: format!("{}{sub}", self.keys.job(&spec.name)),
                        });
                    }
                    // what the last run's workers wrote (its checkpoint figures stay)
                    for sub in ["progress", "joined/", "rdv/", "faults/", "ckpt/", "ranks/"] {
                        ops.push(Op::DeletePrefix {
                            prefix: format!("{}{sub}", self.keys.live_job(&spec.name)),
                        });
                    }
                }
                _ => {
                    return Err(ClusterError::Conflict {
                        key,
                        reason: format!("job {:?} already exists and has not finished", spec.name),
                    });
                }
            }
        }
        if spec
            .checkpoint
            .as_ref()
            .is_some_and(|c| c.restore_step.is_some())
        {
            // resuming from a chosen (earlier) step: the latest-commit record of the history
            // being left must not hold this job's commits above it
            ops.push(Op::Delete {
                key: self.keys.checkpoint(&spec.name),
            });
        }
        ops.push(Op::put(key.clone(), encode(spec)));
        if spec.runtime == crate::records::Runtime::Torchft {
            // a fresh key for each run: its launchers enter its lighthouse room with it
            ops.push(Op::put(
                self.keys.lighthouse_key(&spec.name),
                crate::access::new_password()?.expose().as_bytes().to_vec(),
            ));
        }
        let out = self.backend.txn(Txn { compares, ops }).await?;
        if !out.succeeded {
            return Err(ClusterError::Conflict {
                key,
                reason: "the job changed while it was being submitted; try again".into(),
            });
        }
        Ok(())
    }

    /// Forget a finished job (stopped, succeeded, failed): its spec, status, generations and
    /// history, its workers' records and what its workers wrote, its lighthouse room, in one
    /// transaction fenced on the spec and the status it read. Refused while it has not finished
    /// (stop it first). Its checkpoints at their URL are not touched. Returns the state it had.
    pub async fn delete_job(&self, job: &str) -> Result<crate::records::JobState> {
        let Some((_, kv)) = self.spec(job).await? else {
            return Err(ClusterError::invalid(
                "job",
                format!("no job named {job:?}"),
            ));
        };
        let (st, skv) = match self.status(job).await? {
            Some((st, skv)) if st.state.is_terminal() => (st, skv),
            other => {
                let state = other
                    .map(|(st, _)| format!("{:?}", st.state))
                    .unwrap_or_else(|| "Pending".into());
                return Err(ClusterError::Conflict {
                    key: kv.key.clone(),
                    reason: format!(
                        "job {job:?} is {state}: only a finished job is deleted (dctl stop {job} first)"
                    ),
                });
            }
        };
        let rooms = self.keys.torchft_rooms();
        let out = self
            .backend
            .txn(Txn {
                compares: vec![
                    Compare::ModRevision(kv.key.clone(), kv.mod_revision),
                    Compare::ModRevision(skv.key.clone(), skv.mod_revision),
                ],
                ops: vec![
                    Op::DeletePrefix {
                        prefix: self.keys.job(job),
                    },
                    Op::DeletePrefix {
                        prefix: self.keys.live_job(job),
                    },
                    // (the room's name: the lighthouse's `job_room`)
                    Op::DeletePrefix {
                        prefix: format!("{rooms}job-{job}/"),
                    },
                ],
            })
            .await?;
        if !out.succeeded {
            return Err(ClusterError::Conflict {
                key: kv.key,
                reason: "the job changed while it was being deleted; try again".into(),
            });
        }
        Ok(st.state)
    }

    /// Change a job's desired size; checked against [min, max] and compare-and-swapped.
    pub async fn scale(&self, job: &str, desired: u32) -> Result<JobSpec> {
        loop {
            let Some((mut spec, kv)) = self.spec(job).await? else {
                return Err(ClusterError::invalid(
                    "job",
                    format!("no job named {job:?}"),
                ));
            };
            spec.check_size(desired)
                .map_err(|r| ClusterError::invalid("size", r))?;
            spec.desired = desired;
            let out = self
                .backend
                .txn(Txn {
                    compares: vec![Compare::ModRevision(kv.key.clone(), kv.mod_revision)],
                    ops: vec![Op::put(kv.key.clone(), encode(&spec))],
                })
                .await?;
            if out.succeeded {
                return Ok(spec);
            }
        }
    }

    pub async fn status(&self, job: &str) -> Result<Option<(JobStatus, KeyValue)>> {
        self.get_json(&self.keys.status(job), "job status").await
    }

    pub async fn generation(&self, job: &str) -> Result<Option<(Generation, KeyValue)>> {
        self.get_json(&self.keys.generation(job), "generation")
            .await
    }

    pub async fn history(&self, job: &str) -> Result<Vec<Generation>> {
        Ok(self
            .list_json(&self.keys.history(job), "generation")
            .await?
            .into_iter()
            .map(|(g, _)| g)
            .collect())
    }

    pub async fn progress(&self, job: &str) -> Result<Option<Progress>> {
        Ok(self
            .get_json(&self.keys.progress(job), "progress")
            .await?
            .map(|(p, _)| p))
    }

    /// Publish a generation in one transaction that compares the previous generation's
    /// revision (`prev_mod_revision`, 0 = none yet) and, when given, the leader's key: a deposed
    /// leader, or one that read a stale generation, cannot publish. Returns false if fenced.
    /// `fence` holds the leader key and the spec revision the decision was made against.
    pub async fn publish_generation(
        &self,
        generation: &Generation,
        prev_mod_revision: Revision,
        fence: &Fence<'_>,
        status: &JobStatus,
    ) -> Result<bool> {
        let gkey = self.keys.generation(&generation.job);
        let mut compares = vec![if prev_mod_revision == 0 {
            Compare::Absent(gkey.clone())
        } else {
            Compare::ModRevision(gkey.clone(), prev_mod_revision)
        }];
        compares.extend(fence.compares(&self.keys, &generation.job));
        let ops = vec![
            Op::put(gkey, encode(generation)),
            Op::put(
                self.keys.history_entry(&generation.job, generation.number),
                encode(generation),
            ),
            Op::put(self.keys.status(&generation.job), encode(status)),
            Op::put(
                self.keys.mesh_key(&generation.job),
                encode(&MeshKey::fresh(generation.number)),
            ),
        ];
        Ok(self.backend.txn(Txn { compares, ops }).await?.succeeded)
    }

    /// Make sure `job` has a mesh key for `generation` (or a later one), for meshes formed
    /// without a leader (the tools, benches and tests that form communicators themselves):
    /// the first caller writes a fresh one, the others find it. The leader writes one with
    /// every generation it publishes.
    pub async fn ensure_mesh_key(&self, job: &str, generation: u64) -> Result<()> {
        let key = self.keys.mesh_key(job);
        loop {
            let compare = match self.backend.get(&key).await? {
                None => Compare::Absent(key.clone()),
                Some(kv) => {
                    let r: MeshKey = decode(&kv, "mesh key")?;
                    if r.generation >= generation {
                        return Ok(());
                    }
                    Compare::ModRevision(key.clone(), kv.mod_revision)
                }
            };
            let txn = Txn {
                compares: vec![compare],
                ops: vec![Op::put(&key, encode(&MeshKey::fresh(generation)))],
            };
            if self.backend.txn(txn).await?.succeeded {
                return Ok(());
            }
        }
    }

    /// Mark slots of the current generation excluded (their workers are alive but their peers
    /// cannot reach them), fenced like a publish and on the generation the decision read.
    /// Returns false if fenced.
    pub async fn exclude_slots(
        &self,
        job: &str,
        generation_mod_revision: Revision,
        fence: &Fence<'_>,
        slots: &[(String, u32, SlotHealth)],
    ) -> Result<bool> {
        let mut compares = vec![Compare::ModRevision(
            self.keys.generation(job),
            generation_mod_revision,
        )];
        compares.extend(fence.compares(&self.keys, job));
        let ops = slots
            .iter()
            .map(|(node, slot, h)| Op::put(self.keys.slot(job, node, *slot), encode(h)))
            .collect();
        Ok(self.backend.txn(Txn { compares, ops }).await?.succeeded)
    }

    /// Write a job status, fenced like a publish, and on the status the decision read
    /// (`prev_status_revision`, 0 = none).
    pub async fn put_status(
        &self,
        status: &JobStatus,
        prev_status_revision: Revision,
        fence: &Fence<'_>,
    ) -> Result<bool> {
        let skey = self.keys.status(&status.job);
        let mut compares = vec![if prev_status_revision == 0 {
            Compare::Absent(skey.clone())
        } else {
            Compare::ModRevision(skey.clone(), prev_status_revision)
        }];
        compares.extend(fence.compares(&self.keys, &status.job));
        let ops = vec![Op::put(skey, encode(status))];
        Ok(self.backend.txn(Txn { compares, ops }).await?.succeeded)
    }

    /// Write a job's chart history, fenced like a publish (the leader that kept it, the spec
    /// it read). Returns false if fenced.
    pub async fn put_series(
        &self,
        series: &crate::series::Series,
        fence: &Fence<'_>,
    ) -> Result<bool> {
        let compares = fence.compares(&self.keys, &series.job);
        let ops = vec![Op::put(self.keys.series(&series.job), encode(series))];
        Ok(self.backend.txn(Txn { compares, ops }).await?.succeeded)
    }
}

/// What a leader's write is conditional on: it still leads, and the job's spec is the one its
/// decision read (a job stopped and resubmitted meanwhile is a different job).
pub struct Fence<'a> {
    pub leader: Option<&'a LeaderKey>,
    pub spec_revision: Revision,
}

impl Fence<'_> {
    pub fn compares(&self, keys: &Keys, job: &str) -> Vec<Compare> {
        let mut c = vec![Compare::ModRevision(keys.spec(job), self.spec_revision)];
        if let Some(l) = self.leader {
            c.push(Compare::CreateRevision(l.key.clone(), l.create_revision));
        }
        c
    }
}

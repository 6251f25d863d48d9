//! The etcd key layout. Only this module knows it; everything else asks it for keys.
//!
//! ```text
//! {prefix}/nodes/{node}                        NodeRecord, under the agent's lease
//! {prefix}/drain/{node}                        DrainRequest (operator asked, `dctl drain`)
//! {prefix}/jobs/{job}/spec                     JobSpec (desired size updated by `dctl scale`)
//! {prefix}/jobs/{job}/status                   JobStatus, written by the leader
//! {prefix}/jobs/{job}/generation               Generation, the current one (the fence)
//! {prefix}/jobs/{job}/history/{gen:020}        Generation, every one ever published
//! {prefix}/jobs/{job}/slots/{node}/{slot}      SlotHealth: a slot whose worker failed
//! {prefix}/jobs/{job}/workers/{node}/{slot}    WorkerRecord, under the agent's lease
//! {prefix}/jobs/{job}/restarts                 restart counter (u32 as JSON)
//! {prefix}/jobs/{job}/access                   JobAccess: the etcd user of the job's workers
//! {prefix}/jobs/{job}/stop                     the operator asked the job to stop
//! {prefix}/jobs/{job}/checkpoint               CheckpointRecord, the latest commit
//! {prefix}/jobs/{job}/checkpoint_request       CheckpointRequest (a planned drain)
//! {prefix}/live/{job}/progress                 Progress, from rank 0 (throttled)
//! {prefix}/live/{job}/joined/{gen:020}/{rank}  JoinRecord, a worker joined a generation
//! {prefix}/live/{job}/rdv/{gen:020}/...        per-generation rendezvous data (comm)
//! {prefix}/live/{job}/faults/{gen:020}/{rank}  FaultReport: a worker's communicator failed
//! {prefix}/live/{job}/ckpt/{step}-{gen}/{rank} ShardReport of a checkpoint attempt
//! {prefix}/live/{job}/checkpoint_stats         CheckpointStats, the workers' figures
//! {prefix}/live/{job}/ranks/{rank}             RankStats: a rank's step and compute times
//! {prefix}/assign/{node}/{job}                 NodeAssignment: the leader's per-node view
//! {prefix}/logs/requests/{node}/{id}            LogRequest: a daemon asks an agent for a
//!                                               slot's output (`dctl logs`), under a short lease
//! {prefix}/logs/answers/{id}                    LogAnswer, under the request's lease
//!
//! `jobs/` holds control state; `live/` what workers write as they run, at up to 1 Hz per job,
//! which only the leader and the API read. Agents watch neither: each watches only its own
//! `assign/{node}/`, which the leader derives from `jobs/` and rewrites only when what that
//! node runs changes, so an agent wakes only for changes that concern its node.
//! {prefix}/election                            daemon leader election
//! {prefix}/lighthouses/{replica}               where a ductiled replica serves TorchFT's
//!                                              lighthouse, under the replica's lease
//! {prefix}/torchft/{room}/...                  TorchFT lighthouse state (daemon/src/lighthouse.rs)
//! ```

/// The default prefix under which ductile keeps all its keys.
pub const DEFAULT_PREFIX: &str = "/ductile/v1";

/// Builds keys under one prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

impl Default for Keys {
    fn default() -> Self {
        Keys::new(DEFAULT_PREFIX)
    }
}

/// Which record a key under the prefix names (parsing the other way).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyKind {
    Node {
        node: String,
    },
    Drain {
        node: String,
    },
    JobSpec {
        job: String,
    },
    JobStatus {
        job: String,
    },
    Generation {
        job: String,
    },
    History {
        job: String,
        generation: u64,
    },
    Slot {
        job: String,
        node: String,
        slot: u32,
    },
    Worker {
        job: String,
        node: String,
        slot: u32,
    },
    Joined {
        job: String,
        generation: u64,
        rank: u32,
    },
    Progress {
        job: String,
    },
    Series {
        job: String,
    },
    Stop {
        job: String,
    },
    Restarts {
        job: String,
    },
    Access {
        job: String,
    },
    RankStats {
        job: String,
        rank: u32,
    },
    Checkpoint {
        job: String,
    },
    CheckpointRequest {
        job: String,
    },
    CheckpointStats {
        job: String,
    },
    Fault {
        job: String,
        generation: u64,
        rank: u32,
    },
    /// Any key of a generation's rendezvous space.
    Rendezvous {
        job: String,
        generation: u64,
    },
    Assignment {
        node: String,
        job: String,
    },
    Other,
}

impl Keys {
    pub fn new(prefix: &str) -> Self {
        Keys {
            prefix: prefix.trim_end_matches('/').to_string(),
        }
    }
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    pub fn nodes(&self) -> String {
        format!("{}/nodes/", self.prefix)
    }
    pub fn node(&self, node: &str) -> String {
        format!("{}/nodes/{node}", self.prefix)
    }
    pub fn drains(&self) -> String {
        format!("{}/drain/", self.prefix)
    }
    pub fn drain(&self, node: &str) -> String {
        format!("{}/drain/{node}", self.prefix)
    }
    /// What workers write while they run (progress, rendezvous, joins, fault reports,
    /// checkpoint shard reports and figures), apart from the jobs' control state so that
    /// agents, which watch only `jobs/`, never wake for it.
    pub fn live(&self) -> String {
        format!("{}/live/", self.prefix)
    }
    pub fn live_job(&self, job: &str) -> String {
        format!("{}/live/{job}/", self.prefix)
    }
    /// The job a key under `live/` belongs to (whatever follows its name: a job's etcd user
    /// may write any key under its `live/{job}/`).
    pub fn live_job_of<'a>(&self, key: &'a str) -> Option<&'a str> {
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix("/live/")?;
        let (job, _) = rest.split_once('/')?;
        (!job.is_empty()).then_some(job)
    }
    pub fn jobs(&self) -> String {
        format!("{}/jobs/", self.prefix)
    }
    pub fn job(&self, job: &str) -> String {
        format!("{}/jobs/{job}/", self.prefix)
    }
    pub fn spec(&self, job: &str) -> String {
        format!("{}/jobs/{job}/spec", self.prefix)
    }
    pub fn status(&self, job: &str) -> String {
        format!("{}/jobs/{job}/status", self.prefix)
    }
    pub fn generation(&self, job: &str) -> String {
        format!("{}/jobs/{job}/generation", self.prefix)
    }
    /// The mesh key of the job's current generation ([`crate::records::MeshKey`]): written with
    /// every generation, read by its members to authenticate each other's connections.
    pub fn mesh_key(&self, job: &str) -> String {
        format!("{}/jobs/{job}/mesh_key", self.prefix)
    }
    /// A torchft job's lighthouse key (32 random bytes, hex), written at submit: its launchers
    /// prove they hold it to enter the job's lighthouse room (see [`crate::relay`]).
    pub fn lighthouse_key(&self, job: &str) -> String {
        format!("{}/jobs/{job}/lighthouse_key", self.prefix)
    }
    /// The etcd user the job's workers connect as ([`crate::records::JobAccess`]), made by
    /// the leader when etcd has auth on.
    pub fn access(&self, job: &str) -> String {
        format!("{}/jobs/{job}/access", self.prefix)
    }
    pub fn history(&self, job: &str) -> String {
        format!("{}/jobs/{job}/history/", self.prefix)
    }
    pub fn history_entry(&self, job: &str, generation: u64) -> String {
        format!("{}/jobs/{job}/history/{generation:020}", self.prefix)
    }
    pub fn slots(&self, job: &str) -> String {
        format!("{}/jobs/{job}/slots/", self.prefix)
    }
    pub fn slot(&self, job: &str, node: &str, slot: u32) -> String {
        format!("{}/jobs/{job}/slots/{node}/{slot}", self.prefix)
    }
    pub fn worker(&self, job: &str, node: &str, slot: u32) -> String {
        format!("{}/jobs/{job}/workers/{node}/{slot}", self.prefix)
    }
    pub fn joined(&self, job: &str, generation: u64) -> String {
        format!("{}/live/{job}/joined/{generation:020}/", self.prefix)
    }
    pub fn joined_rank(&self, job: &str, generation: u64, rank: u32) -> String {
        format!("{}/live/{job}/joined/{generation:020}/{rank}", self.prefix)
    }
    pub fn progress(&self, job: &str) -> String {
        format!("{}/live/{job}/progress", self.prefix)
    }
    /// The job's chart history (`series::Series`), kept by the leader.
    pub fn series(&self, job: &str) -> String {
        format!("{}series", self.job(job))
    }
    /// The operator asked the job to stop (`dctl stop`).
    pub fn stop(&self, job: &str) -> String {
        format!("{}/jobs/{job}/stop", self.prefix)
    }
    pub fn restarts(&self, job: &str) -> String {
        format!("{}/jobs/{job}/restarts", self.prefix)
    }
    /// The job's latest committed checkpoint ([`crate::records::CheckpointRecord`]); moved
    /// forward only by a transaction that compares the job's generation.
    pub fn checkpoint(&self, job: &str) -> String {
        format!("{}/jobs/{job}/checkpoint", self.prefix)
    }
    /// Shard reports of one checkpoint attempt (step, generation), one per writing rank.
    pub fn checkpoint_shards(&self, job: &str, step: u64, generation: u64) -> String {
        format!(
            "{}/live/{job}/ckpt/{step:020}-{generation:020}/",
            self.prefix
        )
    }
    /// Every checkpoint attempt's shard reports.
    pub fn checkpoint_attempts(&self, job: &str) -> String {
        format!("{}/live/{job}/ckpt/", self.prefix)
    }
    /// A request for a checkpoint at the next step boundary (a planned drain).
    pub fn checkpoint_request(&self, job: &str) -> String {
        format!("{}/jobs/{job}/checkpoint_request", self.prefix)
    }
    /// A rank's step and compute times ([`crate::records::RankStats`]).
    pub fn rank_stats(&self, job: &str, rank: u32) -> String {
        format!("{}/live/{job}/ranks/{rank}", self.prefix)
    }
    /// The workers' checkpoint figures ([`crate::records::CheckpointStats`]).
    pub fn checkpoint_stats(&self, job: &str) -> String {
        format!("{}/live/{job}/checkpoint_stats", self.prefix)
    }
    /// Rendezvous space of one generation, for the communicator exchange.
    pub fn rendezvous(&self, job: &str, generation: u64) -> String {
        format!("{}/live/{job}/rdv/{generation:020}/", self.prefix)
    }
    /// The weights records of one generation (`step:sha256` each rank published after its
    /// agreement), under its rendezvous space.
    pub fn weights(&self, job: &str, generation: u64) -> String {
        format!("{}weights/", self.rendezvous(job, generation))
    }
    pub fn weights_of(&self, job: &str, generation: u64, rank: u32) -> String {
        format!("{}{rank}", self.weights(job, generation))
    }
    /// When rank 0 finished a generation's first step (ms since the epoch; the benchmarks'
    /// recovery clock).
    pub fn first_step(&self, job: &str, generation: u64) -> String {
        format!("{}first_step", self.rendezvous(job, generation))
    }
    /// Where a torchrun job's rank 0 hosts the c10d store in one generation (`MASTER_ADDR`,
    /// `MASTER_PORT`), as its launcher publishes it.
    pub fn master(&self, job: &str, generation: u64) -> String {
        format!("{}master", self.rendezvous(job, generation))
    }
    /// Where rank `rank` of a tf job's program serves `tf.distribute`'s gRPC in one generation
    /// (its entry in `TF_CONFIG`'s cluster), as its launcher publishes it.
    pub fn tf_worker(&self, job: &str, generation: u64, rank: u32) -> String {
        format!("{}tf-worker-{rank}", self.rendezvous(job, generation))
    }
    /// Where a torchft job's replica group hosts its c10d store (`MASTER_ADDR`, `MASTER_PORT`)
    /// from the generation it started in, as the launcher of its first slot publishes it.
    pub fn torchft_master(&self, job: &str, generation: u64, group: u32) -> String {
        format!("{}torchft-group-{group}", self.rendezvous(job, generation))
    }
    /// Fault reports of one generation: workers whose communicator failed without a newer
    /// generation to go to.
    pub fn faults(&self, job: &str, generation: u64) -> String {
        format!("{}/live/{job}/faults/{generation:020}/", self.prefix)
    }
    pub fn fault(&self, job: &str, generation: u64, rank: u32) -> String {
        format!("{}/live/{job}/faults/{generation:020}/{rank}", self.prefix)
    }
    /// Every generation's fault reports.
    pub fn all_faults(&self, job: &str) -> String {
        format!("{}/live/{job}/faults/", self.prefix)
    }
    /// Every generation's join records.
    pub fn all_joined(&self, job: &str) -> String {
        format!("{}/live/{job}/joined/", self.prefix)
    }
    /// Every generation's rendezvous space.
    pub fn all_rendezvous(&self, job: &str) -> String {
        format!("{}/live/{job}/rdv/", self.prefix)
    }
    /// Every node's view (what the leader writes; it lists them when it takes over).
    pub fn assignments(&self) -> String {
        format!("{}/assign/", self.prefix)
    }
    /// One node's view: what its agent watches (the trailing `/` keeps `n1` from seeing `n10`).
    pub fn node_assignments(&self, node: &str) -> String {
        format!("{}/assign/{node}/", self.prefix)
    }
    pub fn assignment(&self, node: &str, job: &str) -> String {
        format!("{}/assign/{node}/{job}", self.prefix)
    }
    pub fn election(&self) -> String {
        format!("{}/election", self.prefix)
    }
    /// The log requests for `node`'s agent (what it watches).
    pub fn log_requests(&self, node: &str) -> String {
        format!("{}/logs/requests/{node}/", self.prefix)
    }
    pub fn log_request(&self, node: &str, id: &str) -> String {
        format!("{}/logs/requests/{node}/{id}", self.prefix)
    }
    pub fn log_answer(&self, id: &str) -> String {
        format!("{}/logs/answers/{id}", self.prefix)
    }

    /// Where each ductiled replica serves TorchFT's lighthouse (`{"addr": "HOST:PORT"}`, under
    /// the replica's lease): what a torchft job's launchers connect to.
    pub fn lighthouses(&self) -> String {
        format!("{}/lighthouses/", self.prefix)
    }
    pub fn lighthouse(&self, replica: &str) -> String {
        format!("{}{replica}", self.lighthouses())
    }

    /// TorchFT's lighthouse (ductiled `--torchft-listen`): every room under this prefix.
    pub fn torchft_rooms(&self) -> String {
        format!("{}/torchft/", self.prefix)
    }
    /// A room's replica's last heartbeat. Replica ids come from clients: hex-encoded.
    pub fn torchft_heartbeat(&self, room: &str, replica_id: &str) -> String {
        format!("{}{room}/hb/{}", self.torchft_rooms(), hex(replica_id))
    }
    /// A replica waiting in a `Quorum` call.
    pub fn torchft_join(&self, room: &str, replica_id: &str) -> String {
        format!("{}{room}/join/{}", self.torchft_rooms(), hex(replica_id))
    }
    /// Moved by every join and every join's withdrawal: what a quorum decision is fenced on,
    /// one compare whatever the room's size.
    pub fn torchft_joins(&self, room: &str) -> String {
        format!("{}{room}/joins", self.torchft_rooms())
    }
    /// The last quorum a room was issued.
    pub fn torchft_quorum(&self, room: &str) -> String {
        format!("{}{room}/quorum", self.torchft_rooms())
    }
    /// The first quorum issued under `quorum_id` (created where absent only).
    pub fn torchft_issued(&self, room: &str, quorum_id: i64) -> String {
        format!("{}{quorum_id:020}", self.torchft_issued_all(room))
    }
    /// Every quorum id a room was issued.
    pub fn torchft_issued_all(&self, room: &str) -> String {
        format!("{}{room}/quorums/", self.torchft_rooms())
    }

    /// Parse a key under this prefix back into what it names.
    pub fn parse(&self, key: &str) -> KeyKind {
        let Some(rest) = key
            .strip_prefix(&self.prefix)
            .and_then(|r| r.strip_prefix('/'))
        else {
            return KeyKind::Other;
        };
        let parts: Vec<&str> = rest.split('/').collect();
        let s = |x: &str| x.to_string();
        match parts.as_slice() {
            ["nodes", node] => KeyKind::Node { node: s(node) },
            ["drain", node] => KeyKind::Drain { node: s(node) },
            ["assign", node, job] => KeyKind::Assignment {
                node: s(node),
                job: s(job),
            },
            ["jobs", job, "spec"] => KeyKind::JobSpec { job: s(job) },
            ["jobs", job, "status"] => KeyKind::JobStatus { job: s(job) },
            ["jobs", job, "generation"] => KeyKind::Generation { job: s(job) },
            ["live", job, "progress"] => KeyKind::Progress { job: s(job) },
            ["jobs", job, "stop"] => KeyKind::Stop { job: s(job) },
            ["jobs", job, "series"] => KeyKind::Series { job: s(job) },
            ["jobs", job, "restarts"] => KeyKind::Restarts { job: s(job) },
            ["jobs", job, "access"] => KeyKind::Access { job: s(job) },
            ["jobs", job, "checkpoint"] => KeyKind::Checkpoint { job: s(job) },
            ["jobs", job, "checkpoint_request"] => KeyKind::CheckpointRequest { job: s(job) },
            ["live", job, "checkpoint_stats"] => KeyKind::CheckpointStats { job: s(job) },
            ["live", job, "ranks", r] => match r.parse() {
                Ok(rank) => KeyKind::RankStats { job: s(job), rank },
                Err(_) => KeyKind::Other,
            },
            ["jobs", job, "history", g] => match g.parse() {
                Ok(generation) => KeyKind::History {
                    job: s(job),
                    generation,
                },
                Err(_) => KeyKind::Other,
            },
            ["jobs", job, "slots", node, slot] => match slot.parse() {
                Ok(slot) => KeyKind::Slot {
                    job: s(job),
                    node: s(node),
                    slot,
                },
                Err(_) => KeyKind::Other,
            },
            ["jobs", job, "workers", node, slot] => match slot.parse() {
                Ok(slot) => KeyKind::Worker {
                    job: s(job),
                    node: s(node),
                    slot,
                },
                Err(_) => KeyKind::Other,
            },
            ["live", job, "rdv", g, ..] => match g.parse() {
                Ok(generation) => KeyKind::Rendezvous {
                    job: s(job),
                    generation,
                },
                Err(_) => KeyKind::Other,
            },
            ["live", job, "faults", g, r] => match (g.parse(), r.parse()) {
                (Ok(generation), Ok(rank)) => KeyKind::Fault {
                    job: s(job),
                    generation,
                    rank,
                },
                _ => KeyKind::Other,
            },
            ["live", job, "joined", g, r] => match (g.parse(), r.parse()) {
                (Ok(generation), Ok(rank)) => KeyKind::Joined {
                    job: s(job),
                    generation,
                    rank,
                },
                _ => KeyKind::Other,
            },
            _ => KeyKind::Other,
        }
    }
}

/// A client's string as a key segment: its bytes in lowercase hex.
pub fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

/// [`hex`] undone (a malformed segment decodes to what its whole pairs hold).
pub fn unhex(s: &str) -> String {
    let bytes: Vec<u8> = (0..s.len() / 2)
        .filter_map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Names of nodes and jobs become key segments: keep them to a safe alphabet.
pub fn validate_name(field: &str, name: &str) -> crate::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(crate::ClusterError::invalid(
            field,
            format!("{name:?} must be 1-63 characters of [A-Za-z0-9._-], not starting with '.'"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_through_parse() {
        let k = Keys::new("/x/v1/");
        assert_eq!(k.parse(&k.node("n1")), KeyKind::Node { node: "n1".into() });
        assert_eq!(
            k.parse(&k.worker("j", "n1", 3)),
            KeyKind::Worker {
                job: "j".into(),
                node: "n1".into(),
                slot: 3
            }
        );
        assert_eq!(
            k.parse(&k.joined_rank("j", 12, 2)),
            KeyKind::Joined {
                job: "j".into(),
                generation: 12,
                rank: 2
            }
        );
        assert_eq!(
            k.parse(&k.history_entry("j", 7)),
            KeyKind::History {
                job: "j".into(),
                generation: 7
            }
        );
        let j = || "j".to_string();
        assert_eq!(
            k.parse(&k.checkpoint("j")),
            KeyKind::Checkpoint { job: j() }
        );
        assert_eq!(
            k.parse(&k.checkpoint_request("j")),
            KeyKind::CheckpointRequest { job: j() }
        );
        assert_eq!(
            k.parse(&k.checkpoint_stats("j")),
            KeyKind::CheckpointStats { job: j() }
        );
        assert_eq!(
            k.parse(&k.fault("j", 5, 2)),
            KeyKind::Fault {
                job: j(),
                generation: 5,
                rank: 2
            }
        );
        assert!(k.fault("j", 5, 2).starts_with(&k.faults("j", 5)));
        assert_eq!(
            k.parse(&format!("{}tcp/3", k.rendezvous("j", 9))),
            KeyKind::Rendezvous {
                job: j(),
                generation: 9
            }
        );
        assert_eq!(
            k.parse(&k.assignment("n1", "j")),
            KeyKind::Assignment {
                node: "n1".into(),
                job: j()
            }
        );
        assert!(k
            .assignment("n1", "j")
            .starts_with(&k.node_assignments("n1")));
        assert!(!k
            .assignment("n10", "j")
            .starts_with(&k.node_assignments("n1")));
        assert_eq!(k.parse("/other/nodes/n1"), KeyKind::Other);
        // history keys sort numerically because they are zero-padded
        assert!(k.history_entry("j", 9) < k.history_entry("j", 10));
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_name("name", "tiny-gpt_2.a").is_ok());
        for bad in ["", "a/b", ".x", "has space", &"x".repeat(64)] {
            assert!(validate_name("name", bad).is_err(), "{bad:?} accepted");
        }
    }
}

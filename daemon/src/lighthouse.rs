//! TorchFT's lighthouse, served by every ductiled replica (`--torchft-listen HOST:PORT`).
//!
//! TorchFT's training loops ask a lighthouse for a quorum every step (`Quorum`) and heartbeat
//! to it (`Heartbeat`); its own `torchft_lighthouse` is one process holding that state in
//! memory, a single point of failure. Here the state lives in etcd, under
//! `{prefix}/torchft/{room}/`:
//! - `hb/{id}`: a replica's last heartbeat (wall-clock ms of the replica that received it;
//!   written at most every `heartbeat_timeout_ms / 5` per replica, so a flood of heartbeats
//!   costs memory lookups, not etcd writes);
//! - `join/{id}`: a replica waiting in a `Quorum` call (its `QuorumMember` and when it joined);
//! - `quorum`: the last quorum issued; `quorums/{quorum_id}`: the first quorum issued under each
//!   id (created only where absent: one id, one member set, ever).
//!
//! Any replica takes a call: it writes the heartbeat or the join and, for `Quorum`, waits (on
//! its watch of the prefix) for a quorum issued after its join that holds the requester, as
//! TorchFT's lighthouse answers. Only the leader decides, by TorchFT's rules
//! ([`quorum_compute`]), and writes the quorum in one transaction fenced on its leader key and
//! on the revisions it read: a replica that lost leadership mid-decision writes nothing, and
//! two leaders can never issue two different quorums under one id. A replica's death costs
//! its own connections only; a leader's death stops decisions until the next election.
//!
//! Ids from clients become key segments hex-encoded, and are bounded in length; so are a
//! room's replicas and the calls waiting at once.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ductile_cluster::keys::unhex;
use ductile_cluster::kv::{Compare, KeyValue, LeaderKey, Op, Txn};
use ductile_cluster::records::now_ms;
use ductile_cluster::watch::{watch_prefix, KvMap, Snapshot};
use ductile_cluster::Store;
use serde::{Deserialize, Serialize};
use tokio::sync::{watch, Semaphore};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// TorchFT's wire format (proto/torchft.proto).
pub mod pb {
    tonic::include_proto!("torchft");
}

use pb::lighthouse_service_server::{LighthouseService, LighthouseServiceServer};

/// The room of clients that name no job: one quorum, as with `torchft_lighthouse`.
pub const DEFAULT_ROOM: &str = "default";

/// A torchft job's room: its launchers' relays open each connection with
/// `DUCTILE-ROOM {job}\n` ([`ductile_cluster::relay`]), so every job has quorums of its own.
pub fn job_room(job: &str) -> String {
    format!("job-{job}")
}

/// The room a connection entered (its preamble), as tonic hands it to each request: the room,
/// the most replicas it may hold (a job's group count), or why every call is refused.
#[derive(Clone, Debug, Default)]
pub struct RoomInfo {
    pub room: Option<String>,
    pub limit: Option<usize>,
    pub denied: Option<String>,
}

/// An accepted connection (plain TCP, or TLS over it) and the room its preamble named; what
/// was read of it to tell whether it starts with a preamble and is not one comes first.
pub struct RoomConn {
    stream: Box<dyn ductile_cluster::relay::Io>,
    prefix: Vec<u8>,
    info: RoomInfo,
}

impl tonic::transport::server::Connected for RoomConn {
    type ConnectInfo = RoomInfo;
    fn connect_info(&self) -> RoomInfo {
        self.info.clone()
    }
}

impl tokio::io::AsyncRead for RoomConn {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.drain(..n);
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for RoomConn {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Whether `job`'s room may be entered now: the job exists, runs TorchFT and has not finished;
/// its lighthouse key and how many replica groups it may have. What is wrong, in words.
async fn room_key(store: &Store, job: &str) -> Result<(Vec<u8>, usize), String> {
    let read = async {
        let spec = match store.spec(job).await {
            Ok(Some((s, _))) => s,
            Ok(None) => return Err("no such job".to_string()),
            Err(e) => return Err(format!("cannot read the job: {e}")),
        };
        if spec.runtime != ductile_cluster::records::Runtime::Torchft {
            return Err(format!("job {job:?} is not a runtime = \"torchft\" job"));
        }
        match store.status(job).await {
            Ok(Some((st, _))) if st.state.is_terminal() => {
                return Err(format!("job {job:?} has ended ({:?})", st.state))
            }
            Ok(_) => {}
            Err(e) => return Err(format!("cannot read the job's status: {e}")),
        }
        let key = match store.backend.get(&store.keys.lighthouse_key(job)).await {
            Ok(Some(kv)) => kv.value,
            Ok(None) => {
                return Err(format!(
                    "job {job:?} has no lighthouse key (submit it again)"
                ))
            }
            Err(e) => return Err(format!("cannot read the job's lighthouse key: {e}")),
        };
        let groups = match spec.torchft_group_size() {
            0 => spec.max as usize,
            n => (spec.max / n) as usize,
        };
        Ok((key, groups.max(1)))
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .unwrap_or_else(|_| Err("etcd did not answer within 5 s".into()))
}

/// A fresh nonce (32 random bytes, hex).
fn nonce() -> std::io::Result<String> {
    ductile_cluster::access::new_password()
        .map(|s| s.expose().to_string())
        .map_err(|e| std::io::Error::other(e.to_string()))
}

/// Reads a connection's room preamble and the client's proof that it holds the job's
/// lighthouse key, answering the preamble with a fresh nonce ([`ductile_cluster::relay`]);
/// bounded: a client that sends nothing for 10 s, or a preamble that is not a job name, is
/// closed. A room that may not be entered (unknown or finished job, a wrong proof), or no room
/// while the default room is off, still reaches tonic, where every call is refused with
/// `PERMISSION_DENIED` naming why.
async fn read_preamble(
    mut stream: Box<dyn ductile_cluster::relay::Io>,
    store: Store,
    default_room: bool,
) -> std::io::Result<RoomConn> {
    use tokio::io::AsyncReadExt;
    let magic = ductile_cluster::relay::ROOM_PREAMBLE;
    let t0 = tokio::time::Instant::now();
    // the first bytes, until they are the preamble's or cannot be (then they are gRPC's, and
    // go to tonic first)
    let mut head = Vec::with_capacity(magic.len());
    let mut chunk = vec![0u8; magic.len()];
    while head.len() < magic.len() {
        let want = magic.len() - head.len();
        let n = tokio::time::timeout_at(
            t0 + Duration::from_secs(10),
            stream.read(&mut chunk[..want]),
        )
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no request"))??;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        head.extend_from_slice(&chunk[..n]);
        if !magic.starts_with(&head) {
            let denied = (!default_room).then(|| {
                "the lighthouse's default room is off: a torchft job's launchers enter the job's own room (an operator turns the default room on with ductiled --torchft-default-room)".to_string()
            });
            return Ok(RoomConn {
                stream,
                prefix: head,
                info: RoomInfo {
                    room: None,
                    limit: None,
                    denied,
                },
            });
        }
    }
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.len() <= 256 {
        tokio::time::timeout_at(t0 + Duration::from_secs(10), stream.read_exact(&mut b))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no preamble"))??;
        if b[0] == b'\n' {
            let job = String::from_utf8(line)
                .map_err(|_| std::io::Error::other("the room preamble is not UTF-8"))?;
            ductile_cluster::keys::validate_name("job", &job)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            use tokio::io::AsyncWriteExt;
            let n = nonce()?;
            let mut out = ductile_cluster::relay::NONCE_PREAMBLE.to_vec();
            out.extend_from_slice(n.as_bytes());
            out.push(b'\n');
            stream.write_all(&out).await?;
            let mut proof = Vec::new();
            loop {
                tokio::time::timeout_at(t0 + Duration::from_secs(10), stream.read_exact(&mut b))
                    .await
                    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no proof"))??;
                if b[0] == b'\n' {
                    break;
                }
                if proof.len() >= 128 {
                    return Err(std::io::Error::other("the room proof is too long"));
                }
                proof.push(b[0]);
            }
            let proof = String::from_utf8_lossy(&proof).into_owned();
            let room = job_room(&job);
            // one answer for every refusal a stranger could cause (no such job, not a torchft
            // job, ended, a wrong proof): the preamble must not tell whether a job exists; the
            // precise reason goes to this replica's log
            let refused = || {
                format!("lighthouse room {room:?}: this connection may not enter it (no running torchft job of that name holds the key it proved)")
            };
            let (limit, denied) = match room_key(&store, &job).await {
                Ok((key, groups)) => {
                    if ductile_cluster::relay::room_proof_ok(&key, &job, &n, &proof) {
                        (Some(groups), None)
                    } else {
                        tracing::info!(%job, "a lighthouse room refused: the proof of the job's key did not match");
                        (None, Some(refused()))
                    }
                }
                // etcd's trouble is not the job's: said as it is
                Err(why) if why.starts_with("cannot read") || why.starts_with("etcd did not") => {
                    (None, Some(format!("lighthouse room {room:?}: {why}")))
                }
                Err(why) => {
                    tracing::info!(%job, %why, "a lighthouse room refused");
                    (None, Some(refused()))
                }
            };
            return Ok(RoomConn {
                stream,
                prefix: Vec::new(),
                info: RoomInfo {
                    room: Some(room),
                    limit,
                    denied,
                },
            });
        }
        line.push(b[0]);
    }
    Err(std::io::Error::other("the room preamble is too long"))
}

/// The room of a request and the most replicas it may hold: its connection's, else the
/// default one; a connection that could not enter a room is refused, saying why.
fn room_of<T>(req: &Request<T>) -> Result<(String, Option<usize>), Status> {
    let info = req
        .extensions()
        .get::<RoomInfo>()
        .cloned()
        .unwrap_or_default();
    if let Some(why) = info.denied {
        return Err(Status::permission_denied(why));
    }
    Ok((
        info.room.unwrap_or_else(|| DEFAULT_ROOM.to_string()),
        info.limit,
    ))
}
/// The longest replica id, address or store address taken.
pub const MAX_ID_LEN: usize = 512;
/// The most `data` a member may carry (TorchFT 0.2.0 sends none or a few bytes of JSON).
pub const MAX_DATA_LEN: usize = 4 * 1024;
/// The most connections whose room preamble is being read at once.
pub const MAX_PREAMBLES: usize = 1024;
/// The quorum ids a room keeps in its history (`quorums/`: `dctl events`, the chart, the
/// check that no id had two member sets); older ones are deleted by the leader's clean-up.
pub const MAX_ISSUED_KEPT: usize = 256;

/// The most replicas (heartbeating or joined) one room holds; more are refused.
pub const MAX_REPLICAS: usize = 1024;
/// The most `Quorum` calls one replica keeps waiting at once.
pub const MAX_WAITING: usize = 4096;
/// The most `Quorum` calls one room (one job) keeps waiting at once on a replica: four per
/// replica group it may have, at least 8, at most this (the default room's bound).
pub const MAX_WAITING_PER_ROOM: usize = 256;

/// A room's share of the waiting calls, given back when the call ends.
struct RoomPermit {
    map: Arc<Mutex<HashMap<String, usize>>>,
    room: String,
}

impl Drop for RoomPermit {
    fn drop(&mut self) {
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.room) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.room);
            }
        }
    }
}
/// The longest a `Quorum` call waits here (TorchFT's clients give up sooner, with their own
/// timeout).
pub const MAX_WAIT: Duration = Duration::from_secs(3600);

/// TorchFT's lighthouse options (`torchft_lighthouse`'s flags, same defaults).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LighthouseOpt {
    pub min_replicas: u64,
    pub join_timeout_ms: u64,
    pub quorum_tick_ms: u64,
    pub heartbeat_timeout_ms: u64,
    /// Clients that name no job get the shared default room (unauthenticated); off: refused.
    pub default_room: bool,
}

impl Default for LighthouseOpt {
    fn default() -> Self {
        LighthouseOpt {
            min_replicas: 1,
            join_timeout_ms: 60_000,
            quorum_tick_ms: 100,
            heartbeat_timeout_ms: 5_000,
            default_room: false,
        }
    }
}

/// A `QuorumMember` as etcd keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub replica_id: String,
    pub address: String,
    pub store_address: String,
    pub step: i64,
    pub world_size: u64,
    pub shrink_only: bool,
    #[serde(default)]
    pub data: String,
    #[serde(default)]
    pub commit_failures: i64,
}

impl From<pb::QuorumMember> for Member {
    fn from(m: pb::QuorumMember) -> Self {
        Member {
            replica_id: m.replica_id,
            address: m.address,
            store_address: m.store_address,
            step: m.step,
            world_size: m.world_size,
            shrink_only: m.shrink_only,
            data: m.data,
            commit_failures: m.commit_failures,
        }
    }
}

impl From<&Member> for pb::QuorumMember {
    fn from(m: &Member) -> Self {
        pb::QuorumMember {
            replica_id: m.replica_id.clone(),
            address: m.address.clone(),
            store_address: m.store_address.clone(),
            step: m.step,
            world_size: m.world_size,
            shrink_only: m.shrink_only,
            data: m.data.clone(),
            commit_failures: m.commit_failures,
        }
    }
}

/// A replica waiting for a quorum.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Join {
    pub member: Member,
    pub joined_ms: u64,
}

/// A replica's last heartbeat.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Beat {
    pub at_ms: u64,
}

/// A quorum as issued.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuorumRecord {
    pub quorum_id: i64,
    pub participants: Vec<Member>,
    pub created_ms: u64,
    /// The ductiled replica (leader) that issued it.
    pub issued_by: String,
    /// Why it formed (TorchFT's explanation: fast, or valid with how many healthy).
    pub reason: String,
    /// The joins it consumed: every join whose key's revision is at or below this one (TorchFT
    /// clears the participants with each quorum; here the record says so in one key, and the
    /// consumed joins are deleted later in bounded batches).
    #[serde(default)]
    pub joins_through: i64,
}

impl QuorumRecord {
    pub fn ids(&self) -> Vec<&str> {
        self.participants
            .iter()
            .map(|p| p.replica_id.as_str())
            .collect()
    }
    pub fn to_pb(&self) -> pb::Quorum {
        pb::Quorum {
            quorum_id: self.quorum_id,
            participants: self.participants.iter().map(Into::into).collect(),
            created: Some(prost_types::Timestamp {
                seconds: (self.created_ms / 1000) as i64,
                nanos: ((self.created_ms % 1000) * 1_000_000) as i32,
            }),
        }
    }
}

/// Where a room's keys live (`Keys::torchft_*`).
#[derive(Clone, Debug)]
pub struct RoomKeys {
    keys: ductile_cluster::Keys,
    room: String,
}

/// The prefix under which every room lives.
pub fn torchft_prefix(store: &Store) -> String {
    store.keys.torchft_rooms()
}

impl RoomKeys {
    pub fn new(store: &Store, room: &str) -> Self {
        RoomKeys {
            keys: store.keys.clone(),
            room: room.to_string(),
        }
    }
    pub fn hb(&self, id: &str) -> String {
        self.keys.torchft_heartbeat(&self.room, id)
    }
    pub fn join(&self, id: &str) -> String {
        self.keys.torchft_join(&self.room, id)
    }
    pub fn joins(&self) -> String {
        self.keys.torchft_joins(&self.room)
    }
    pub fn quorum(&self) -> String {
        self.keys.torchft_quorum(&self.room)
    }
    pub fn issued(&self, quorum_id: i64) -> String {
        self.keys.torchft_issued(&self.room, quorum_id)
    }
}

/// One room as a snapshot holds it, with the revisions a fenced write compares.
#[derive(Clone, Debug, Default)]
pub struct RoomState {
    /// replica id → (its join, the join key's mod revision)
    pub participants: BTreeMap<String, (Join, i64)>,
    /// replica id → last heartbeat (wall-clock ms)
    pub heartbeats: BTreeMap<String, u64>,
    /// hb key's replica id → (key, mod revision) for garbage collection
    pub hb_keys: BTreeMap<String, (String, i64)>,
    /// The last quorum and its key's mod revision.
    pub prev: Option<(QuorumRecord, i64)>,
    /// The mod revision of the room's `joins` key (0: absent): a decision's one fence on
    /// every join it read.
    pub joins_rev: i64,
    /// Join keys the last quorum consumed (key, mod revision), for the clean-up.
    pub consumed: Vec<(String, i64)>,
    /// replica id → when its manager's port was found closed (wall-clock ms): dead until it
    /// heartbeats again.
    pub dead: HashMap<String, u64>,
}

/// Every room under the prefix, decoded from a snapshot. Undecodable values are skipped with
/// a warning (they are not ductile's writes).
pub fn rooms(prefix: &str, snap: &Snapshot) -> BTreeMap<String, RoomState> {
    let mut out: BTreeMap<String, RoomState> = BTreeMap::new();
    // a room's keys are contiguous in key order (they share the prefix `{prefix}{room}/`)
    let mut current: Option<(&str, Vec<(&String, &KeyValue)>)> = None;
    for (key, kv) in snap.kvs.range(prefix.to_string()..) {
        let Some(rest) = key.strip_prefix(prefix) else {
            break;
        };
        let Some((room, _)) = rest.split_once('/') else {
            continue;
        };
        match &mut current {
            Some((r, entries)) if *r == room => entries.push((key, kv)),
            _ => {
                if let Some((r, entries)) = current.take() {
                    out.insert(r.to_string(), room_from(prefix, r, entries));
                }
                current = Some((room, vec![(key, kv)]));
            }
        }
    }
    if let Some((r, entries)) = current {
        out.insert(r.to_string(), room_from(prefix, r, entries));
    }
    out
}

/// One room, decoded from its keys in `kvs` (None: it has none).
pub fn room(prefix: &str, room: &str, kvs: &KvMap) -> Option<RoomState> {
    let start = format!("{prefix}{room}/");
    let entries: Vec<(&String, &KeyValue)> = kvs
        .range(start.clone()..)
        .take_while(|(k, _)| k.starts_with(&start))
        .collect();
    (!entries.is_empty()).then(|| room_from(prefix, room, entries))
}

/// A room from its keys (all under `{prefix}{room}/`).
fn room_from(prefix: &str, room: &str, entries: Vec<(&String, &KeyValue)>) -> RoomState {
    let mut r = RoomState::default();
    let mut join_keys: BTreeMap<String, String> = BTreeMap::new();
    let base = format!("{prefix}{room}/");
    for (key, kv) in entries {
        let Some(rest) = key.strip_prefix(&base) else {
            continue;
        };
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            ["hb", id] => {
                if let Some(b) = decode::<Beat>(kv) {
                    let id = unhex(id);
                    r.heartbeats.insert(id.clone(), b.at_ms);
                    r.hb_keys.insert(id, (key.clone(), kv.mod_revision));
                }
            }
            ["join", _] => match decode::<Join>(kv) {
                Some(j) => {
                    join_keys.insert(j.member.replica_id.clone(), key.clone());
                    r.participants
                        .insert(j.member.replica_id.clone(), (j, kv.mod_revision));
                }
                None => r.consumed.push((key.clone(), kv.mod_revision)),
            },
            ["joins"] => r.joins_rev = kv.mod_revision,
            ["quorum"] => {
                if let Some(q) = decode::<QuorumRecord>(kv) {
                    r.prev = Some((q, kv.mod_revision));
                }
            }
            _ => {}
        }
    }
    // the joins the last quorum consumed are no participants any more
    if let Some(through) = r.prev.as_ref().map(|(q, _)| q.joins_through) {
        let gone: Vec<(String, i64)> = r
            .participants
            .iter()
            .filter(|(_, (_, rev))| *rev <= through)
            .map(|(id, (_, rev))| (id.clone(), *rev))
            .collect();
        for (id, rev) in gone {
            r.participants.remove(&id);
            if let Some(k) = join_keys.remove(&id) {
                r.consumed.push((k, rev));
            }
        }
    }
    r
}

fn decode<T: serde::de::DeserializeOwned>(kv: &KeyValue) -> Option<T> {
    match serde_json::from_slice(&kv.value) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!(key = %kv.key, error = %e, "undecodable lighthouse record; skipped");
            None
        }
    }
}

/// TorchFT's quorum rule (its lighthouse's `quorum_compute`), on wall-clock milliseconds: the
/// members of a new quorum, sorted by replica id, or why there is none yet.
pub fn quorum_compute(
    now_ms: u64,
    st: &RoomState,
    opt: &LighthouseOpt,
) -> (Option<Vec<Member>>, String) {
    let healthy = |id: &str| {
        st.heartbeats.get(id).is_some_and(|&at| {
            now_ms.saturating_sub(at) < opt.heartbeat_timeout_ms
                && st.dead.get(id).is_none_or(|&d| at > d)
        })
    };
    let healthy_replicas = st.heartbeats.keys().filter(|id| healthy(id)).count();
    let healthy_participants: Vec<&Join> = st
        .participants
        .values()
        .map(|(j, _)| j)
        .filter(|j| healthy(&j.member.replica_id))
        .collect();
    // BTreeMap order: sorted by replica id
    let mut candidates: Vec<Member> = healthy_participants
        .iter()
        .map(|j| j.member.clone())
        .collect();
    let shrink_only = healthy_participants.iter().any(|j| j.member.shrink_only);
    let metadata = format!(
        "[{}/{} participants healthy][{} heartbeating][shrink_only={}]",
        healthy_participants.len(),
        st.participants.len(),
        healthy_replicas,
        shrink_only
    );
    if let Some((prev, _)) = &st.prev {
        if shrink_only {
            candidates.retain(|c| {
                prev.participants
                    .iter()
                    .any(|p| p.replica_id == c.replica_id)
            });
        }
        let fast = prev.participants.iter().all(|p| {
            healthy_participants
                .iter()
                .any(|j| j.member.replica_id == p.replica_id)
        });
        if fast {
            return (Some(candidates), format!("fast quorum {metadata}"));
        }
    }
    if (healthy_participants.len() as u64) < opt.min_replicas {
        return (
            None,
            format!(
                "not ready: {} participants, min_replicas {} {metadata}",
                healthy_participants.len(),
                opt.min_replicas
            ),
        );
    }
    if healthy_participants.len() <= healthy_replicas / 2 {
        return (
            None,
            format!(
                "not ready: {} participants, need more than half of {} healthy {metadata}",
                healthy_participants.len(),
                healthy_replicas
            ),
        );
    }
    let all_joined = healthy_participants.len() == healthy_replicas;
    let first = healthy_participants
        .iter()
        .map(|j| j.joined_ms)
        .min()
        .unwrap_or(now_ms);
    if !all_joined && now_ms.saturating_sub(first) < opt.join_timeout_ms {
        return (
            None,
            format!(
                "valid with {} participants, waiting for {} healthy stragglers {metadata}",
                healthy_participants.len(),
                healthy_replicas - healthy_participants.len()
            ),
        );
    }
    (Some(candidates), format!("valid quorum {metadata}"))
}

/// What the leader writes for a quorum that formed: the quorum, its id's first issue where
/// the members changed, and every join cleared (TorchFT clears the participants), all
/// conditional on its leadership and on the revisions it decided from.
pub fn quorum_txn(
    keys: &RoomKeys,
    st: &RoomState,
    members: Vec<Member>,
    reason: String,
    leader: &LeaderKey,
    issued_by: &str,
    now_ms: u64,
) -> (Txn, QuorumRecord) {
    let prev = st.prev.as_ref().map(|(q, _)| q);
    let ids: Vec<&str> = members.iter().map(|m| m.replica_id.as_str()).collect();
    let changed = prev.is_none_or(|p| p.ids() != ids);
    let quorum_id = prev.map_or(0, |p| p.quorum_id) + i64::from(changed);
    let record = QuorumRecord {
        quorum_id,
        participants: members,
        created_ms: now_ms,
        issued_by: issued_by.to_string(),
        reason,
        joins_through: st.joins_rev,
    };
    let mut compares = vec![
        Compare::CreateRevision(leader.key.clone(), leader.create_revision),
        match &st.prev {
            Some((_, rev)) => Compare::ModRevision(keys.quorum(), *rev),
            None => Compare::Absent(keys.quorum()),
        },
    ];
    let value = serde_json::to_vec(&record).expect("a quorum encodes");
    let mut ops = vec![Op::put(keys.quorum(), value.clone())];
    if changed {
        compares.push(Compare::Absent(keys.issued(quorum_id)));
        ops.push(Op::put(keys.issued(quorum_id), value));
    }
    // one fence on every join read (each join and withdrawal moves `joins`), and the joins
    // consumed by the record itself: the transaction's size does not grow with the room
    compares.push(match st.joins_rev {
        0 => Compare::Absent(keys.joins()),
        rev => Compare::ModRevision(keys.joins(), rev),
    });
    (Txn { compares, ops }, record)
}

/// The lighthouse's shared parts: the store, the watch of every room, the options.
#[derive(Clone)]
pub struct Lighthouse {
    store: Store,
    opt: LighthouseOpt,
    snap: watch::Receiver<Arc<Snapshot>>,
    prefix: String,
    /// (room, replica id) → when this replica last wrote its heartbeat
    written: Arc<Mutex<HashMap<(String, String), Instant>>>,
    waiting: Arc<Semaphore>,
    /// Quorum calls waiting, per room: one room (one job) cannot take the replica's pool.
    room_waiting: Arc<Mutex<HashMap<String, usize>>>,
    /// The rooms as the newest snapshot decoded: the leader's ticks, the admission of new ids
    /// and the clean-up share it, and a newer snapshot decodes again only the rooms whose keys
    /// changed since.
    decoded: Arc<Mutex<Decoded>>,
}

/// Decoded rooms, as of a snapshot's revision (of one listing).
#[derive(Default)]
struct Decoded {
    revision: i64,
    relists: u64,
    rooms: Rooms,
}

/// Every room, each shared: a new decode copies pointers and re-decodes what changed.
pub type Rooms = Arc<BTreeMap<String, Arc<RoomState>>>;

impl Lighthouse {
    /// Starts watching the rooms; until `cancel`.
    pub fn new(store: Store, opt: LighthouseOpt, cancel: CancellationToken) -> Self {
        let prefix = torchft_prefix(&store);
        let snap = watch_prefix(store.backend.clone(), prefix.clone(), cancel);
        Lighthouse {
            store,
            opt,
            snap,
            prefix,
            written: Arc::new(Mutex::new(HashMap::new())),
            waiting: Arc::new(Semaphore::new(MAX_WAITING)),
            room_waiting: Arc::new(Mutex::new(HashMap::new())),
            decoded: Arc::new(Mutex::new(Decoded::default())),
        }
    }

    /// The rooms of `snap`: the rooms decoded from an earlier snapshot of the same listing,
    /// with only those whose keys changed since decoded again (from the snapshot's change log);
    /// everything when the log does not reach back (a re-list). An older snapshot than the
    /// newest decoded is decoded whole, and not kept.
    fn rooms_of(&self, snap: &Snapshot) -> Rooms {
        let mut d = self.decoded.lock().expect("decoded rooms");
        if snap.revision != 0 && d.revision == snap.revision && d.relists == snap.relists {
            return d.rooms.clone();
        }
        let whole = |snap: &Snapshot| -> Rooms {
            Arc::new(
                rooms(&self.prefix, snap)
                    .into_iter()
                    .map(|(k, v)| (k, Arc::new(v)))
                    .collect(),
            )
        };
        if snap.revision == 0 || (snap.relists == d.relists && snap.revision < d.revision) {
            return whole(snap);
        }
        let rooms = match snap.changed_since(d.revision, d.relists) {
            Some(changed) if d.revision != 0 => {
                let touched: std::collections::BTreeSet<&str> = changed
                    .iter()
                    .filter_map(|k| k.strip_prefix(self.prefix.as_str())?.split_once('/'))
                    .map(|(room, _)| room)
                    .collect();
                let mut rooms = (*d.rooms).clone();
                for r in touched {
                    match room(&self.prefix, r, &snap.kvs) {
                        Some(st) => rooms.insert(r.to_string(), Arc::new(st)),
                        None => rooms.remove(r),
                    };
                }
                Arc::new(rooms)
            }
            _ => whole(snap),
        };
        *d = Decoded {
            revision: snap.revision,
            relists: snap.relists,
            rooms: rooms.clone(),
        };
        rooms
    }

    fn room(&self, room: &str) -> (String, RoomKeys) {
        (room.to_string(), RoomKeys::new(&self.store, room))
    }

    /// A snapshot that has listed at least once (bounded: etcd unreachable is an error).
    async fn synced(&self) -> Result<Arc<Snapshot>, Status> {
        let mut rx = self.snap.clone();
        match tokio::time::timeout(
            Duration::from_secs(10),
            ductile_cluster::watch::synced(&mut rx),
        )
        .await
        {
            Ok(s) if s.revision > 0 => Ok(s),
            _ => Err(Status::unavailable(
                "the lighthouse cannot read etcd (no listing of its rooms in 10 s)",
            )),
        }
    }

    /// A new replica id is refused once the room holds `MAX_REPLICAS`.
    /// A replica id another room holds (another job's) is refused.
    fn admit(
        &self,
        snap: &Snapshot,
        room: &str,
        id: &str,
        limit: Option<usize>,
    ) -> Result<(), Status> {
        let rooms = self.rooms_of(snap);
        if let Some((other, _)) = rooms.iter().find(|(name, r)| {
            name.as_str() != room
                && (r.heartbeats.contains_key(id) || r.participants.contains_key(id))
        }) {
            return Err(Status::permission_denied(format!(
                "replica id {id:?} belongs to the lighthouse room {other:?}, not {room:?}"
            )));
        }
        let Some(r) = rooms.get(room) else {
            return Ok(());
        };
        let known = r.heartbeats.contains_key(id) || r.participants.contains_key(id);
        if !known && r.heartbeats.len().max(r.participants.len()) >= MAX_REPLICAS {
            return Err(Status::resource_exhausted(format!(
                "the lighthouse room {room:?} already holds {MAX_REPLICAS} replicas"
            )));
        }
        // a job's room: at most two live replicas per replica group it may have (a group's
        // replica id is new with each start of its program, and the last one's heartbeat
        // lapses only after the heartbeat timeout)
        if let Some(groups) = limit.filter(|_| !known) {
            let now = now_ms();
            let live = r
                .heartbeats
                .values()
                .filter(|at| now.saturating_sub(**at) < self.opt.heartbeat_timeout_ms)
                .count();
            if live >= 2 * groups {
                return Err(Status::resource_exhausted(format!(
                    "the lighthouse room {room:?} already holds {live} live replicas, twice its job's {groups} replica group(s)"
                )));
            }
        }
        Ok(())
    }

    /// Writes a heartbeat unless this replica wrote one for `id` within a fifth of the
    /// heartbeat timeout.
    async fn beat(&self, keys: &RoomKeys, id: &str, force: bool) -> Result<(), Status> {
        let every = Duration::from_millis((self.opt.heartbeat_timeout_ms / 5).max(1));
        let wkey = (keys.room.clone(), id.to_string());
        {
            let mut w = self.written.lock().expect("heartbeat map");
            let now = Instant::now();
            if !force && w.get(&wkey).is_some_and(|t| now.duration_since(*t) < every) {
                return Ok(());
            }
            if w.len() >= 4 * MAX_REPLICAS {
                w.retain(|_, t| now.duration_since(*t) < every);
            }
            w.insert(wkey.clone(), now);
        }
        let value = serde_json::to_vec(&Beat { at_ms: now_ms() }).expect("a beat encodes");
        match self.store.backend.put(&keys.hb(id), value, None).await {
            Ok(_) => Ok(()),
            Err(e) => {
                // not written: the next heartbeat tries again
                self.written.lock().expect("heartbeat map").remove(&wkey);
                Err(Status::unavailable(format!(
                    "the lighthouse cannot write to etcd: {e}"
                )))
            }
        }
    }

    async fn join(&self, keys: &RoomKeys, member: &Member) -> Result<i64, Status> {
        let value = serde_json::to_vec(&Join {
            member: member.clone(),
            joined_ms: now_ms(),
        })
        .expect("a join encodes");
        self.beat(keys, &member.replica_id, true).await?;
        let txn = Txn {
            compares: vec![],
            ops: vec![
                Op::put(keys.join(&member.replica_id), value),
                Op::put(keys.joins(), b"{}".to_vec()),
            ],
        };
        self.store
            .backend
            .txn(txn)
            .await
            .map(|o| o.revision)
            .map_err(|e| Status::unavailable(format!("the lighthouse cannot write to etcd: {e}")))
    }

    /// The Quorum call: join, then wait for a quorum issued after the join that holds the
    /// requester; one that does not, and the requester joins again (as TorchFT's lighthouse).
    pub async fn quorum(&self, room: &str, member: Member) -> Result<QuorumRecord, Status> {
        self.quorum_limited(room, member, None).await
    }

    /// [`Lighthouse::quorum`] in a room that holds at most `limit` replicas.
    pub async fn quorum_limited(
        &self,
        room: &str,
        member: Member,
        limit: Option<usize>,
    ) -> Result<QuorumRecord, Status> {
        check_member(&member)?;
        let _permit = self.waiting.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "this lighthouse replica already has {MAX_WAITING} quorum calls waiting"
            ))
        })?;
        let (room, keys) = self.room(room);
        let _room_permit = {
            let cap = limit
                .map(|l| l.saturating_mul(4).clamp(8, MAX_WAITING_PER_ROOM))
                .unwrap_or(MAX_WAITING_PER_ROOM);
            let mut m = self.room_waiting.lock().unwrap_or_else(|p| p.into_inner());
            let n = m.entry(room.clone()).or_insert(0);
            if *n >= cap {
                return Err(Status::resource_exhausted(format!(
                    "room {room:?} already has {cap} quorum calls waiting on this lighthouse replica (its bound: 4 per replica group it may have)"
                )));
            }
            *n += 1;
            RoomPermit {
                map: self.room_waiting.clone(),
                room: room.clone(),
            }
        };
        let snap = self.synced().await?;
        self.admit(&snap, &room, &member.replica_id, limit)?;
        let mut rx = self.snap.clone();
        let mut joined_at = self.join(&keys, &member).await?;
        // a caller that goes away (its process died, it gave up) leaves the participants, as
        // its join is deleted unless a quorum or a new join replaced it
        let mut guard = JoinGuard {
            store: self.store.clone(),
            joins: keys.joins(),
            key: keys.join(&member.replica_id),
            revision: joined_at,
            done: false,
        };
        let deadline = tokio::time::Instant::now() + MAX_WAIT;
        loop {
            {
                let snap = rx.borrow_and_update().clone();
                if let Some(kv) = snap.kvs.get(&keys.quorum()) {
                    if kv.mod_revision > joined_at {
                        if let Some(q) = decode::<QuorumRecord>(kv) {
                            if q.participants
                                .iter()
                                .any(|p| p.replica_id == member.replica_id)
                            {
                                guard.done = true;
                                return Ok(q);
                            }
                            joined_at = self.join(&keys, &member).await?;
                            guard.revision = joined_at;
                        }
                    }
                }
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() {
                    return Err(Status::unavailable("the lighthouse is shutting down"));
                },
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(Status::deadline_exceeded(format!(
                        "no quorum holding {} within {} s", member.replica_id, MAX_WAIT.as_secs()
                    )));
                }
            }
        }
    }

    /// The Heartbeat call.
    pub async fn heartbeat(&self, room: &str, replica_id: &str) -> Result<(), Status> {
        self.heartbeat_limited(room, replica_id, None).await
    }

    /// [`Lighthouse::heartbeat`] in a room that holds at most `limit` replicas.
    pub async fn heartbeat_limited(
        &self,
        room: &str,
        replica_id: &str,
        limit: Option<usize>,
    ) -> Result<(), Status> {
        check_id("replica_id", replica_id)?;
        let (room, keys) = self.room(room);
        let known = self
            .written
            .lock()
            .expect("heartbeat map")
            .contains_key(&(room.clone(), replica_id.to_string()));
        if !known {
            let snap = self.synced().await?;
            self.admit(&snap, &room, replica_id, limit)?;
        }
        self.beat(&keys, replica_id, false).await
    }

    /// The leader's loop: decide every room on every change and every quorum tick, with
    /// writes fenced on `leader`; until `cancel` (leadership lost).
    pub async fn decide(&self, leader: LeaderKey, issued_by: String, cancel: CancellationToken) {
        let mut rx = self.snap.clone();
        let tick = Duration::from_millis(self.opt.quorum_tick_ms.max(1));
        let mut last_gc = Instant::now();
        let mut last_reason: HashMap<String, String> = HashMap::new();
        let dead: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
        let found = Arc::new(tokio::sync::Notify::new());
        let mut probed: HashMap<String, Instant> = HashMap::new();
        let mut collecting: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                _ = tokio::time::sleep(tick) => {}
                _ = found.notified() => {}
                _ = cancel.cancelled() => return,
            }
            let snap = rx.borrow_and_update().clone();
            if snap.revision == 0 {
                continue;
            }
            let now = now_ms();
            for (room, st) in self.rooms_of(&snap).iter() {
                if st.participants.is_empty() {
                    continue;
                }
                let (room, mut st) = (room.clone(), RoomState::clone(st));
                let keys = RoomKeys::new(&self.store, &room);
                st.dead = dead.lock().expect("dead map").clone();
                let (met, reason) = quorum_compute(now, &st, &self.opt);
                let Some(members) = met else {
                    // the previous quorum's members that hold it up: is their process gone?
                    for m in probe_targets(&st) {
                        let again = probed
                            .get(&m.replica_id)
                            .is_none_or(|t| t.elapsed() >= PROBE_EVERY);
                        if again && probed.len() < 4 * MAX_REPLICAS {
                            probed.insert(m.replica_id.clone(), Instant::now());
                            tokio::spawn(probe(m, dead.clone(), found.clone()));
                        }
                    }
                    if last_reason.get(&room) != Some(&reason) {
                        tracing::debug!(%room, %reason, "no quorum yet");
                        last_reason.insert(room.clone(), reason);
                    }
                    continue;
                };
                let (txn, record) =
                    quorum_txn(&keys, &st, members, reason, &leader, &issued_by, now);
                match self.store.backend.txn(txn).await {
                    Ok(o) if o.succeeded => {
                        tracing::debug!(quorum_id = record.quorum_id, members = ?record.ids(), "quorum issued");
                        if st.prev.as_ref().map(|(p, _)| p.quorum_id) != Some(record.quorum_id) {
                            tracing::info!(%room, quorum_id = record.quorum_id, members = ?record.ids(), reason = %record.reason, "torchft quorum");
                        }
                    }
                    // a join or the quorum moved meanwhile, or leadership is gone: decide
                    // again from the next snapshot (a deposed leader's cancel comes next)
                    Ok(_) => tracing::debug!(%room, "quorum write fenced; deciding again"),
                    Err(e) => {
                        tracing::warn!(%room, error = %e, "quorum write failed; deciding again")
                    }
                }
            }
            if last_gc.elapsed() >= Duration::from_secs(10) {
                last_gc = Instant::now();
                probed.retain(|_, t| t.elapsed() < Duration::from_secs(60));
                let hb_lapse = self.opt.heartbeat_timeout_ms;
                dead.lock()
                    .expect("dead map")
                    .retain(|_, at| now.saturating_sub(*at) < 2 * hb_lapse + 60_000);
                // off the deciding loop: a slow clean-up never delays a quorum
                if collecting
                    .as_ref()
                    .is_none_or(|h: &tokio::task::JoinHandle<()>| h.is_finished())
                {
                    let (lh, snap) = (self.clone(), snap.clone());
                    collecting = Some(tokio::spawn(async move { lh.collect(&snap, now).await }));
                }
            }
        }
    }

    /// Forget replicas whose heartbeat lapsed long ago (ten timeouts, at least a minute), the
    /// joins quorums consumed, the oldest quorum ids past `MAX_ISSUED_KEPT`, and every key of
    /// a job's room once the job has ended or is gone; in transactions of bounded size.
    async fn collect(&self, snap: &Snapshot, now: u64) {
        let stale = (10 * self.opt.heartbeat_timeout_ms).max(60_000);
        let mut batch = crate::batch::Batch::new(self.store.clone());
        for (room, st) in self.rooms_of(snap).iter() {
            let keys = RoomKeys::new(&self.store, room);
            if let Some(job) = room.strip_prefix("job-") {
                let ended = match self.store.status(job).await {
                    Ok(Some((s, _))) => s.state.is_terminal(),
                    Ok(None) => matches!(self.store.spec(job).await, Ok(None)),
                    Err(_) => false,
                };
                if ended {
                    let prefix = format!("{}{room}/", torchft_prefix(&self.store));
                    tracing::info!(%room, "the room's job has ended: its lighthouse records go");
                    if let Err(e) = self
                        .store
                        .backend
                        .txn(Txn {
                            compares: vec![],
                            ops: vec![Op::DeletePrefix { prefix }],
                        })
                        .await
                    {
                        tracing::debug!(error = %e, "lighthouse clean-up failed; next time");
                        return;
                    }
                    continue;
                }
            }
            for (key, rev) in &st.consumed {
                if !batch
                    .add(
                        vec![Compare::ModRevision(key.clone(), *rev)],
                        vec![Op::Delete { key: key.clone() }],
                    )
                    .await
                {
                    return;
                }
            }
            // the quorum ids issued: the last MAX_ISSUED_KEPT stay (new ids only grow, from the
            // `quorum` key, so a pruned id is never issued again)
            let issued = keys.keys.torchft_issued_all(room);
            let ids: Vec<&String> = snap
                .kvs
                .range(issued.clone()..)
                .map(|(k, _)| k)
                .take_while(|k| k.starts_with(&issued))
                .collect();
            if ids.len() > MAX_ISSUED_KEPT {
                for k in &ids[..ids.len() - MAX_ISSUED_KEPT] {
                    if !batch
                        .add(vec![], vec![Op::Delete { key: k.to_string() }])
                        .await
                    {
                        return;
                    }
                }
            }
            for (id, (key, rev)) in &st.hb_keys {
                if now.saturating_sub(st.heartbeats[id]) < stale {
                    continue;
                }
                let mut compares = vec![Compare::ModRevision(key.clone(), *rev)];
                let mut ops = vec![Op::Delete { key: key.clone() }];
                if let Some((_, jrev)) = st.participants.get(id) {
                    compares.push(Compare::ModRevision(keys.join(id), *jrev));
                    ops.push(Op::Delete { key: keys.join(id) });
                    ops.push(Op::put(keys.joins(), b"{}".to_vec()));
                }
                if !batch.add(compares, ops).await {
                    return;
                }
            }
        }
        batch.flush().await;
    }

    /// The gRPC service, with requests bounded in size.
    pub fn service(&self) -> LighthouseServiceServer<Lighthouse> {
        LighthouseServiceServer::new(self.clone())
            .max_decoding_message_size(4 * MAX_ID_LEN + MAX_DATA_LEN + 1024)
    }
}

/// What `GET /v1/torchft` (`dctl torchft`) shows: per room, the last quorum (id, members with
/// their step, who issued it and why), the replicas waiting and heartbeating, and the last
/// `recent` quorum ids issued with their members. Read from etcd (an error is an error).
pub async fn report(store: &Store, recent: usize) -> ductile_cluster::Result<serde_json::Value> {
    let prefix = store.keys.torchft_rooms();
    let (kvs, revision) = store.backend.list(&prefix).await?;
    let snap = Snapshot {
        revision,
        kvs: kvs.iter().map(|kv| (kv.key.clone(), kv.clone())).collect(),
        ..Default::default()
    };
    let now = now_ms();
    let mut out = vec![];
    for (room, st) in rooms(&prefix, &snap) {
        let issued_prefix = store.keys.torchft_issued_all(&room);
        let issued: Vec<serde_json::Value> = kvs
            .iter()
            .filter(|kv| kv.key.starts_with(&issued_prefix))
            .filter_map(decode::<QuorumRecord>)
            .rev()
            .take(recent)
            .map(|q| serde_json::json!({"quorum_id": q.quorum_id, "members": q.ids(), "created_ms": q.created_ms, "issued_by": q.issued_by}))
            .collect();
        out.push(serde_json::json!({
            "room": room,
            "quorum": st.prev.as_ref().map(|(q, _)| q),
            "waiting": st.participants.keys().collect::<Vec<_>>(),
            "heartbeats_ms_ago": st.heartbeats.iter().map(|(k, v)| (k.clone(), now.saturating_sub(*v))).collect::<BTreeMap<_, _>>(),
            "issued": issued,
        }));
    }
    Ok(serde_json::json!({ "rooms": out }))
}

/// Deletes a `Quorum` caller's join when the call ends without a quorum (dropped: the client
/// went away), unless something rewrote the key since.
struct JoinGuard {
    store: Store,
    joins: String,
    key: String,
    revision: i64,
    done: bool,
}

impl Drop for JoinGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        tracing::debug!(key = %self.key, "a quorum caller went away; clearing its join");
        let store = self.store.clone();
        let txn = Txn {
            compares: vec![Compare::ModRevision(self.key.clone(), self.revision)],
            ops: vec![
                Op::Delete {
                    key: self.key.clone(),
                },
                Op::put(self.joins.clone(), b"{}".to_vec()),
            ],
        };
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Err(e) = store.backend.txn(txn).await {
                    tracing::debug!(error = %e, "could not clear a departed caller's join; the next quorum clears it");
                }
            });
        }
    }
}

/// How often one member's port is probed while it holds a quorum up.
pub const PROBE_EVERY: Duration = Duration::from_millis(200);

/// The previous quorum's members that heartbeat (as far as etcd knows) but have not joined:
/// what a quorum waits for.
pub fn probe_targets(st: &RoomState) -> Vec<Member> {
    let Some((prev, _)) = &st.prev else {
        return vec![];
    };
    prev.participants
        .iter()
        .filter(|m| !st.participants.contains_key(&m.replica_id))
        .filter(|m| {
            // heartbeating, and not already found dead since its last heartbeat
            st.heartbeats
                .get(&m.replica_id)
                .is_some_and(|hb| st.dead.get(&m.replica_id).is_none_or(|d| hb > d))
        })
        .cloned()
        .collect()
}

/// A member whose manager's port refuses connections is dead: its process is gone (a host
/// that is gone refuses nothing, and its heartbeats lapse as TorchFT's do). Marked dead at
/// the probe's time; a heartbeat after it revives the member.
async fn probe(m: Member, dead: Arc<Mutex<HashMap<String, u64>>>, found: Arc<tokio::sync::Notify>) {
    let addr = m
        .address
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .to_string();
    let at = now_ms();
    match tokio::time::timeout(
        Duration::from_millis(500),
        tokio::net::TcpStream::connect(&addr),
    )
    .await
    {
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            tracing::info!(replica = %m.replica_id, %addr, "a quorum member's manager refuses connections: its process is gone; it leaves the quorum without waiting for its heartbeat to lapse");
            dead.lock().expect("dead map").insert(m.replica_id, at);
            found.notify_one();
        }
        _ => {}
    }
}

fn check_id(field: &str, v: &str) -> Result<(), Status> {
    if v.len() > MAX_ID_LEN {
        return Err(Status::invalid_argument(format!(
            "{field} is {} bytes long; at most {MAX_ID_LEN}",
            v.len()
        )));
    }
    Ok(())
}

fn check_member(m: &Member) -> Result<(), Status> {
    if m.replica_id.is_empty() {
        return Err(Status::invalid_argument("requester.replica_id is empty"));
    }
    check_id("requester.replica_id", &m.replica_id)?;
    check_id("requester.address", &m.address)?;
    check_id("requester.store_address", &m.store_address)?;
    if m.data.len() > MAX_DATA_LEN {
        return Err(Status::invalid_argument(format!(
            "requester.data is {} bytes long; at most {MAX_DATA_LEN}",
            m.data.len()
        )));
    }
    if m.step < 0 {
        return Err(Status::invalid_argument(format!(
            "requester.step is {}; steps are not negative",
            m.step
        )));
    }
    Ok(())
}

#[tonic::async_trait]
impl LighthouseService for Lighthouse {
    async fn quorum(
        &self,
        request: Request<pb::LighthouseQuorumRequest>,
    ) -> Result<Response<pb::LighthouseQuorumResponse>, Status> {
        let (room, limit) = room_of(&request)?;
        let requester = request
            .into_inner()
            .requester
            .ok_or_else(|| Status::invalid_argument("missing requester"))?;
        let q = Lighthouse::quorum_limited(self, &room, requester.into(), limit).await?;
        Ok(Response::new(pb::LighthouseQuorumResponse {
            quorum: Some(q.to_pb()),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::LighthouseHeartbeatRequest>,
    ) -> Result<Response<pb::LighthouseHeartbeatResponse>, Status> {
        let (room, limit) = room_of(&request)?;
        let id = request.into_inner().replica_id;
        if id.is_empty() {
            return Err(Status::invalid_argument("replica_id is empty"));
        }
        Lighthouse::heartbeat_limited(self, &room, &id, limit).await?;
        Ok(Response::new(pb::LighthouseHeartbeatResponse {}))
    }
}

/// Serves the lighthouse on `listener` and decides quorums whenever `leader` holds this
/// replica's leader key; until `cancel`.
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    store: Store,
    opt: LighthouseOpt,
    listener: tokio::net::TcpListener,
    advertise: String,
    election_ttl: Duration,
    mut leader: watch::Receiver<Option<LeaderKey>>,
    id: String,
    tls: Option<Arc<rustls::ServerConfig>>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    tokio::spawn(announce(
        store.clone(),
        id.clone(),
        advertise,
        election_ttl,
        cancel.clone(),
    ));
    let lh = Lighthouse::new(store, opt, cancel.clone());
    let decider = {
        let lh = lh.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            loop {
                let key = leader.borrow_and_update().clone();
                let lead = cancel.child_token();
                let run = async {
                    if let Some(k) = key {
                        lh.decide(k, id.clone(), lead.clone()).await
                    } else {
                        std::future::pending::<()>().await
                    }
                };
                tokio::select! {
                    _ = run => {}
                    r = leader.changed() => if r.is_err() { lead.cancel(); return },
                    _ = cancel.cancelled() => return,
                }
                lead.cancel();
            }
        })
    };
    // each connection's room preamble is read off the accept loop (bounded), then the
    // connection goes to tonic
    let (conn_tx, conn_rx) = tokio::sync::mpsc::channel::<std::io::Result<RoomConn>>(64);
    let preambles = Arc::new(Semaphore::new(MAX_PREAMBLES));
    let (pre_store, default_room) = (lh.store.clone(), lh.opt.default_room);
    let accept = {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            loop {
                let (stream, peer) = tokio::select! {
                    r = listener.accept() => match r {
                        Ok(a) => a,
                        Err(e) => {
                            tracing::warn!(error = %e, "the lighthouse cannot accept; retrying");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                    _ = cancel.cancelled() => return,
                };
                let _ = stream.set_nodelay(true);
                let tx = conn_tx.clone();
                // preambles read at once are bounded; past that a connection is closed at once
                let Ok(permit) = preambles.clone().try_acquire_owned() else {
                    tracing::warn!(%peer, "lighthouse: {MAX_PREAMBLES} connections are already being admitted; closing");
                    continue;
                };
                let (store, default_room, tls) = (pre_store.clone(), default_room, tls.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    // TLS first when the replica serves it (the handshake bounded with the
                    // preamble: 10 s in all)
                    let stream: Box<dyn ductile_cluster::relay::Io> = match tls {
                        None => Box::new(stream),
                        Some(cfg) => {
                            let accept = tokio_rustls::TlsAcceptor::from(cfg).accept(stream);
                            match tokio::time::timeout(Duration::from_secs(10), accept).await {
                                Ok(Ok(s)) => Box::new(s),
                                Ok(Err(e)) => {
                                    tracing::debug!(%peer, error = %e, "lighthouse TLS handshake failed");
                                    return;
                                }
                                Err(_) => {
                                    tracing::debug!(%peer, "lighthouse TLS handshake: no answer in 10 s");
                                    return;
                                }
                            }
                        }
                    };
                    match read_preamble(stream, store, default_room).await {
                        Ok(c) => {
                            let _ = tx.send(Ok(c)).await;
                        }
                        Err(e) => {
                            tracing::debug!(%peer, error = %e, "lighthouse connection closed")
                        }
                    }
                });
            }
        })
    };
    let c = cancel.clone();
    let r = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(256)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .add_service(lh.service())
        .serve_with_incoming_shutdown(
            tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(conn_rx),
            async move { c.cancelled().await },
        )
        .await;
    accept.abort();
    decider.abort();
    r.map_err(|e| anyhow::anyhow!("the TorchFT lighthouse server failed: {e}"))
}

/// A torchft job's last quorum, as `dctl status` shows it (None before the first).
pub async fn job_quorum(
    store: &Store,
    job: &str,
) -> ductile_cluster::Result<Option<ductile_cluster::api::TorchftQuorumView>> {
    let keys = RoomKeys::new(store, &job_room(job));
    let Some(kv) = store.backend.get(&keys.quorum()).await? else {
        return Ok(None);
    };
    let q: QuorumRecord = serde_json::from_slice(&kv.value).map_err(|e| {
        ductile_cluster::ClusterError::invalid("torchft quorum", format!("undecodable: {e}"))
    })?;
    Ok(Some(quorum_view(&q)))
}

/// A torchft job's quorums with an id past `after`, oldest first (`dctl events`, the chart):
/// the first quorum issued under each id, as its room keeps them (the last
/// [`MAX_ISSUED_KEPT`]).
pub async fn job_quorums(
    store: &Store,
    job: &str,
    after: i64,
) -> ductile_cluster::Result<Vec<ductile_cluster::api::TorchftQuorumView>> {
    let keys = RoomKeys::new(store, &job_room(job));
    let (kvs, _) = store
        .backend
        .list(&keys.keys.torchft_issued_all(&keys.room))
        .await?;
    let mut out = Vec::new();
    for kv in &kvs {
        let q: QuorumRecord = serde_json::from_slice(&kv.value).map_err(|e| {
            ductile_cluster::ClusterError::invalid(
                "torchft quorum",
                format!("{} is undecodable: {e}", kv.key),
            )
        })?;
        if q.quorum_id > after {
            out.push(quorum_view(&q));
        }
    }
    Ok(out)
}

/// A quorum as the API shows it.
pub fn quorum_view(q: &QuorumRecord) -> ductile_cluster::api::TorchftQuorumView {
    use ductile_cluster::api::{TorchftHealView, TorchftMemberView, TorchftQuorumView};
    let healing = healing(q)
        .into_iter()
        .map(|(dst, src)| TorchftHealView {
            replica_id: dst,
            from: src,
        })
        .collect();
    TorchftQuorumView {
        quorum_id: q.quorum_id,
        created_ms: q.created_ms,
        issued_by: q.issued_by.clone(),
        reason: q.reason.clone(),
        members: q
            .participants
            .iter()
            .map(|p| TorchftMemberView {
                replica_id: p.replica_id.clone(),
                step: p.step,
                world_size: p.world_size,
                address: p.address.clone(),
            })
            .collect(),
        healing,
    }
}

/// Who heals from whom in a quorum, as TorchFT's managers assign it for group rank 0 (with its
/// default `init_sync`): participants in replica-id order; those behind the highest step (at
/// step 0, all but the first at it) heal, the i-th of them from the (i mod n)-th of the n others.
pub fn healing(q: &QuorumRecord) -> Vec<(String, String)> {
    let mut ps: Vec<&Member> = q.participants.iter().collect();
    ps.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));
    let Some(max) = ps.iter().map(|p| p.step).max() else {
        return Vec::new();
    };
    let primary = ps
        .iter()
        .find(|p| p.step == max)
        .map(|p| p.replica_id.clone());
    let behind =
        |p: &Member| p.step != max || (max == 0 && Some(&p.replica_id) != primary.as_ref());
    let dst: Vec<&Member> = ps.iter().copied().filter(|p| behind(p)).collect();
    let src: Vec<&Member> = ps.iter().copied().filter(|p| !behind(p)).collect();
    if src.is_empty() {
        return Vec::new();
    }
    dst.iter()
        .enumerate()
        .map(|(i, d)| (d.replica_id.clone(), src[i % src.len()].replica_id.clone()))
        .collect()
}

/// Publishes where this replica serves the lighthouse (`lighthouses/{id}`) under a lease of
/// its own, again whenever the lease is replaced; revoked when `cancel` fires.
async fn announce(
    store: Store,
    id: String,
    addr: String,
    ttl: Duration,
    cancel: CancellationToken,
) {
    let keeper = match ductile_cluster::lease::LeaseKeeper::start(
        store.backend.clone(),
        ttl.as_secs().max(2) as i64,
        cancel.clone(),
    )
    .await
    {
        Ok(k) => k,
        Err(e) => {
            tracing::warn!(error = %e, "the lighthouse's address is not published: no lease");
            return;
        }
    };
    let key = store.keys.lighthouse(&id);
    let value = serde_json::to_vec(&serde_json::json!({ "addr": addr })).expect("encodes");
    let mut rx = keeper.subscribe();
    let mut published: Option<u64> = None;
    loop {
        let lease = *rx.borrow_and_update();
        if published != Some(lease.epoch) {
            match store.backend.put(&key, value.clone(), Some(lease.id)).await {
                Ok(_) => {
                    tracing::info!(%addr, "TorchFT lighthouse address published");
                    published = Some(lease.epoch);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot publish the lighthouse's address; retrying")
                }
            }
        }
        tokio::select! {
            r = rx.changed() => if r.is_err() { break },
            _ = tokio::time::sleep(Duration::from_secs(1)), if published != Some(lease.epoch) => {}
            _ = cancel.cancelled() => break,
        }
    }
    keeper.join().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use ductile_cluster::keys::hex;

    fn member(id: &str, step: i64) -> Member {
        Member {
            replica_id: id.into(),
            address: format!("http://{id}"),
            store_address: format!("{id}:1"),
            step,
            world_size: 1,
            shrink_only: false,
            data: String::new(),
            commit_failures: 0,
        }
    }

    fn state(joined: &[(&str, u64)], beats: &[(&str, u64)], prev: Option<&[&str]>) -> RoomState {
        let mut st = RoomState::default();
        for (id, at) in joined {
            st.participants.insert(
                id.to_string(),
                (
                    Join {
                        member: member(id, 1),
                        joined_ms: *at,
                    },
                    1,
                ),
            );
        }
        for (id, at) in beats {
            st.heartbeats.insert(id.to_string(), *at);
        }
        st.prev = prev.map(|ids| {
            (
                QuorumRecord {
                    quorum_id: 7,
                    participants: ids.iter().map(|i| member(i, 1)).collect(),
                    created_ms: 0,
                    issued_by: "x".into(),
                    reason: String::new(),
                    joins_through: 0,
                },
                3,
            )
        });
        st.joins_rev = 2;
        st
    }

    fn ids(m: &Option<Vec<Member>>) -> Option<Vec<String>> {
        m.as_ref()
            .map(|v| v.iter().map(|m| m.replica_id.clone()).collect())
    }

    #[test]
    fn torchft_quorum_rules() {
        let opt = LighthouseOpt {
            min_replicas: 2,
            join_timeout_ms: 10_000,
            ..Default::default()
        };
        let now = 100_000;
        // below min_replicas: none
        let st = state(&[("a", now)], &[("a", now)], None);
        assert_eq!(quorum_compute(now, &st, &opt).0, None);
        // every heartbeating replica joined: at once, sorted by id
        let st = state(&[("b", now), ("a", now)], &[("a", now), ("b", now)], None);
        assert_eq!(
            ids(&quorum_compute(now, &st, &opt).0),
            Some(vec!["a".into(), "b".into()])
        );
        // a healthy straggler is waited for until the join timeout
        let beats = [("a", now), ("b", now), ("c", now)];
        let st = state(&[("a", now - 1000), ("b", now)], &beats, None);
        let (m, why) = quorum_compute(now, &st, &opt);
        assert_eq!(m, None, "{why}");
        let st = state(&[("a", now - 10_000), ("b", now)], &beats, None);
        assert_eq!(
            ids(&quorum_compute(now, &st, &opt).0),
            Some(vec!["a".into(), "b".into()])
        );
        // a lapsed heartbeat is not healthy: neither waited for nor a member
        let beats = [("a", now), ("b", now), ("c", now - 5_000)];
        let st = state(&[("a", now), ("b", now), ("c", now)], &beats, None);
        assert_eq!(
            ids(&quorum_compute(now, &st, &opt).0),
            Some(vec!["a".into(), "b".into()])
        );
        // split brain: no more than half of the healthy replicas is not enough
        let beats = [("a", now), ("b", now), ("c", now), ("d", now)];
        let st = state(&[("a", now - 60_000), ("b", now)], &beats, None);
        assert_eq!(quorum_compute(now, &st, &opt).0, None);
        // fast quorum: every previous member is back, at once (even below min)
        let opt3 = LighthouseOpt {
            min_replicas: 3,
            ..opt.clone()
        };
        let st = state(
            &[("a", now), ("b", now)],
            &[("a", now), ("b", now), ("c", now)],
            Some(&["a", "b"]),
        );
        assert_eq!(
            ids(&quorum_compute(now, &st, &opt3).0),
            Some(vec!["a".into(), "b".into()])
        );
        // shrink_only keeps the previous members only
        let mut st = state(
            &[("a", now - 60_000), ("b", now), ("c", now)],
            &[("a", now), ("b", now), ("c", now)],
            Some(&["a", "b", "x"]),
        );
        st.participants.get_mut("a").unwrap().0.member.shrink_only = true;
        assert_eq!(
            ids(&quorum_compute(now, &st, &opt).0),
            Some(vec!["a".into(), "b".into()])
        );
    }

    #[tokio::test]
    async fn a_quorum_id_moves_only_with_its_members_and_every_write_is_fenced() {
        let store = Store::new(
            Arc::new(ductile_cluster::memory::MemoryBackend::new()),
            ductile_cluster::Keys::new("/t"),
        );
        let keys = RoomKeys::new(&store, DEFAULT_ROOM);
        let leader = LeaderKey {
            name: "e".into(),
            key: "/t/election/1".into(),
            create_revision: 5,
            lease: 1,
        };
        let st = state(&[("a", 1), ("b", 1)], &[], Some(&["a", "b"]));
        let (txn, rec) = quorum_txn(
            &keys,
            &st,
            vec![member("a", 2), member("b", 2)],
            "r".into(),
            &leader,
            "me",
            9,
        );
        assert_eq!(rec.quorum_id, 7, "same members, same id");
        assert!(!txn
            .ops
            .iter()
            .any(|o| matches!(o, Op::Put { key, .. } if key == &keys.issued(7))));
        assert!(txn
            .compares
            .contains(&Compare::CreateRevision(leader.key.clone(), 5)));
        assert!(txn
            .compares
            .contains(&Compare::ModRevision(keys.quorum(), 3)));
        // one fence on every join, and the joins consumed by the record: no per-participant
        // compare or delete
        assert!(txn
            .compares
            .contains(&Compare::ModRevision(keys.joins(), 2)));
        assert_eq!(rec.joins_through, 2);
        assert!(!txn.ops.iter().any(|o| matches!(o, Op::Delete { .. })));
        let (txn, rec) = quorum_txn(
            &keys,
            &st,
            vec![member("a", 2)],
            "r".into(),
            &leader,
            "me",
            9,
        );
        assert_eq!(rec.quorum_id, 8, "a member left: the id moves");
        assert!(txn.compares.contains(&Compare::Absent(keys.issued(8))));
        assert_eq!((txn.compares.len(), txn.ops.len()), (4, 2));
        // whatever the room's size
        let many: Vec<(String, u64)> = (0..500).map(|i| (format!("r{i}"), 1)).collect();
        let many: Vec<(&str, u64)> = many.iter().map(|(i, t)| (i.as_str(), *t)).collect();
        let big = state(&many, &many, Some(&["a"]));
        let members: Vec<Member> = many.iter().map(|(i, _)| member(i, 2)).collect();
        let (txn, _) = quorum_txn(&keys, &big, members, "r".into(), &leader, "me", 9);
        assert_eq!((txn.compares.len(), txn.ops.len()), (4, 2));
        // ids with any bytes survive the key encoding
        assert_eq!(unhex(&hex("train_ddp_0:1b2/ä")), "train_ddp_0:1b2/ä");
    }

    /// Raw gRPC bodies that are not TorchFT's messages get an error status, never a panic and
    /// never a wait.
    #[tokio::test]
    async fn malformed_requests_are_refused() {
        use http_body_util::BodyExt;
        use prost::Message;
        use tower::ServiceExt;
        let store = Store::new(
            Arc::new(ductile_cluster::memory::MemoryBackend::new()),
            ductile_cluster::Keys::new("/t"),
        );
        let cancel = CancellationToken::new();
        let lh = Lighthouse::new(store, LighthouseOpt::default(), cancel.clone());
        let frame = |msg: &[u8]| {
            let mut f = vec![0u8];
            f.extend((msg.len() as u32).to_be_bytes());
            f.extend(msg);
            f
        };
        let no_requester = pb::LighthouseQuorumRequest { requester: None }.encode_to_vec();
        let bodies = [
            ("Quorum", frame(&[0xff; 9])),
            ("Quorum", vec![1, 2, 3]),
            ("Quorum", frame(&no_requester)),
            ("Quorum", frame(&vec![0u8; 1 << 20])),
            ("Heartbeat", frame(&[0x0a, 0x80])),
        ];
        for (method, body) in bodies {
            let req = http::Request::builder()
                .method("POST")
                .uri(format!("/torchft.LighthouseService/{method}"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(http_body_util::Full::new(bytes::Bytes::from(body.clone())))
                .unwrap();
            let resp = tokio::time::timeout(Duration::from_secs(5), lh.service().oneshot(req))
                .await
                .expect("answered at once")
                .unwrap();
            let head = resp.headers().get("grpc-status").cloned();
            let collected = resp.into_body().collect().await.unwrap();
            let status = head
                .or_else(|| {
                    collected
                        .trailers()
                        .and_then(|t| t.get("grpc-status").cloned())
                })
                .expect("a grpc-status");
            assert_ne!(
                status,
                "0",
                "{method} {:?} was accepted",
                &body[..body.len().min(12)]
            );
        }
        cancel.cancel();
    }

    /// Issue 66: one room (one job) cannot take a replica's pool of waiting quorum calls:
    /// past its own bound its calls are refused at once, while another room's still wait.
    #[tokio::test]
    async fn a_room_s_waiting_quorum_calls_are_bounded_and_leave_the_others_room() {
        let store = Store::new(
            Arc::new(ductile_cluster::memory::MemoryBackend::new()),
            ductile_cluster::Keys::new("/t"),
        );
        let cancel = CancellationToken::new();
        let lh = Arc::new(Lighthouse::new(
            store,
            LighthouseOpt::default(),
            cancel.clone(),
        ));
        // a room of one replica group: 8 calls may wait (no leader decides here: they wait)
        let mut held = Vec::new();
        for _ in 0..8 {
            let lh = lh.clone();
            held.push(tokio::spawn(async move {
                lh.quorum_limited("job-a", member("r0", 1), Some(1)).await
            }));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(held.iter().all(|h| !h.is_finished()), "the 8 wait");
        let ninth = tokio::time::timeout(
            Duration::from_secs(2),
            lh.quorum_limited("job-a", member("r0", 1), Some(1)),
        )
        .await
        .expect("refused at once");
        let e = ninth.unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.message().contains("job-a"), "{}", e.message());
        let other = tokio::time::timeout(
            Duration::from_millis(500),
            lh.quorum_limited("job-b", member("s0", 1), Some(1)),
        )
        .await;
        assert!(
            other.is_err(),
            "another room's call waits, not refused: {other:?}"
        );
        // the calls that end give their share back
        for h in &held {
            h.abort();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(lh
            .room_waiting
            .lock()
            .unwrap()
            .get("job-a")
            .is_none_or(|n| *n == 0));
        cancel.cancel();
    }

    /// A new snapshot decodes again only the rooms whose keys changed (from its change log);
    /// the others are shared as they were, and the result equals a whole decode.
    #[tokio::test]
    async fn rooms_are_decoded_again_only_where_their_keys_changed() {
        let backend: Arc<dyn ductile_cluster::KvBackend> =
            Arc::new(ductile_cluster::memory::MemoryBackend::new());
        let store = Store::new(backend.clone(), ductile_cluster::Keys::new("/t"));
        let cancel = CancellationToken::new();
        let lh = Lighthouse::new(store.clone(), LighthouseOpt::default(), cancel.clone());
        let mut rx = lh.snap.clone();
        let at = |rev: i64| {
            let mut rx = rx.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|s| s.revision >= rev))
                    .await
                    .expect("the watch catches up")
                    .unwrap()
                    .clone()
            }
        };
        let (_, k1) = lh.room("r1");
        let (_, k2) = lh.room("r2");
        lh.join(&k1, &member("a", 1)).await.unwrap();
        let rev = lh.join(&k2, &member("b", 1)).await.unwrap();
        let s1 = at(rev).await;
        let before = lh.rooms_of(&s1);
        assert_eq!(before.len(), 2);
        let rev = lh.join(&k1, &member("c", 1)).await.unwrap();
        let s2 = at(rev).await;
        let after = lh.rooms_of(&s2);
        assert!(
            Arc::ptr_eq(&before["r2"], &after["r2"]),
            "r2 was decoded again"
        );
        assert!(!Arc::ptr_eq(&before["r1"], &after["r1"]));
        let whole = rooms(&lh.prefix, &s2);
        for (name, r) in after.iter() {
            let w = &whole[name];
            assert_eq!(
                r.participants.keys().collect::<Vec<_>>(),
                w.participants.keys().collect::<Vec<_>>()
            );
            assert_eq!(r.joins_rev, w.joins_rev);
        }
        assert_eq!(after["r1"].participants.len(), 2);
        // a room whose keys are all gone is gone; an older snapshot still decodes as it was
        let gone = format!("{}r2/", lh.prefix);
        backend.delete_prefix(&gone).await.unwrap();
        let s3 = tokio::time::timeout(
            Duration::from_secs(5),
            rx.wait_for(|s| s.kvs.keys().all(|k| !k.starts_with(&gone))),
        )
        .await
        .expect("the watch catches up")
        .unwrap()
        .clone();
        assert!(!lh.rooms_of(&s3).contains_key("r2"));
        assert!(lh.rooms_of(&s1).contains_key("r2"));
        cancel.cancel();
    }

    /// Two replicas ask through the service; only a leader's decisions answer them, and a
    /// deposed leader's key decides nothing.
    #[tokio::test]
    async fn quorum_calls_are_answered_by_the_leaders_decision_only() {
        let backend: Arc<dyn ductile_cluster::KvBackend> =
            Arc::new(ductile_cluster::memory::MemoryBackend::new());
        let store = Store::new(backend.clone(), ductile_cluster::Keys::new("/t"));
        let cancel = CancellationToken::new();
        let opt = LighthouseOpt {
            min_replicas: 2,
            ..Default::default()
        };
        let lh = Lighthouse::new(store.clone(), opt, cancel.clone());
        let ask = |id: &'static str| {
            let lh = lh.clone();
            tokio::spawn(async move { lh.quorum(DEFAULT_ROOM, member(id, 3)).await })
        };
        let (a, b) = (ask("a"), ask("b"));
        // a key that no longer leads (never created at that revision) writes nothing
        let stale = LeaderKey {
            name: "e".into(),
            key: "/t/election/x".into(),
            create_revision: 99,
            lease: 1,
        };
        let deposed = cancel.child_token();
        tokio::spawn({
            let lh = lh.clone();
            let d = deposed.clone();
            async move { lh.decide(stale, "old".into(), d).await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !a.is_finished() && !b.is_finished(),
            "a deposed leader answered"
        );
        deposed.cancel();
        let lease = backend.grant(30).await.unwrap();
        let key = backend
            .campaign("/t/election", b"me".to_vec(), lease)
            .await
            .unwrap();
        tokio::spawn({
            let lh = lh.clone();
            let c = cancel.clone();
            async move { lh.decide(key, "me".into(), c).await }
        });
        let qa = tokio::time::timeout(Duration::from_secs(10), a)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let qb = tokio::time::timeout(Duration::from_secs(10), b)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(qa, qb);
        assert_eq!(
            (qa.quorum_id, qa.ids(), qa.issued_by.as_str()),
            (1, vec!["a", "b"], "me")
        );
        // malformed requests are refused, not waited on
        let mut bad = member("c", 1);
        bad.replica_id = "x".repeat(MAX_ID_LEN + 1);
        assert_eq!(
            lh.quorum(DEFAULT_ROOM, bad).await.unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            lh.quorum(DEFAULT_ROOM, member("", 1))
                .await
                .unwrap_err()
                .code(),
            tonic::Code::InvalidArgument
        );
        cancel.cancel();
    }
}

//! The HTTP API that `dctl` uses, and Prometheus metrics. Every replica serves it; writes go to
//! etcd, where the leader's reconciler picks them up.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ductile_cluster::api::*;
use ductile_cluster::keys::KeyKind;
use ductile_cluster::records::*;
use ductile_cluster::store::decode;
use ductile_cluster::{ClusterError, Store};
use serde::Deserialize;

use crate::config::Secret;

#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    pub token: Secret,
    pub is_leader: Arc<AtomicBool>,
    pub id: String,
}

pub struct ApiError(StatusCode, ApiErrorBody);

impl ApiError {
    fn new(code: StatusCode, msg: impl Into<String>) -> Self {
        ApiError(
            code,
            ApiErrorBody {
                error: msg.into(),
                field: None,
            },
        )
    }
    fn not_found(job: &str) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, format!("no job named {job:?}"))
    }
}

impl From<ClusterError> for ApiError {
    fn from(e: ClusterError) -> Self {
        let code = match &e {
            ClusterError::Invalid { .. } | ClusterError::Decode { .. } => StatusCode::BAD_REQUEST,
            ClusterError::Conflict { .. } => StatusCode::CONFLICT,
            ClusterError::Unavailable { .. } | ClusterError::Timeout { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let field = match &e {
            ClusterError::Invalid { field, .. } => Some(field.clone()),
            _ => None,
        };
        ApiError(
            code,
            ApiErrorBody {
                error: ductile_cluster::service::error_chain(&e),
                field,
            },
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(self.1)).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

pub fn router(state: AppState) -> Router {
    let authed = Router::new()
        .route("/v1/jobs", get(list_jobs).post(submit))
        .route("/v1/jobs/{job}", get(job_status))
        .route("/v1/jobs/{job}/scale", post(scale))
        .route("/v1/jobs/{job}/stop", post(stop))
        .route("/v1/jobs/{job}/events", get(events))
        .route("/v1/jobs/{job}/checkpoints", get(checkpoints))
        .route("/v1/nodes", get(nodes))
        .route("/v1/nodes/{node}/drain", post(drain).delete(undrain))
        .route("/v1/leader", get(leader))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .merge(authed)
        .with_state(state)
}

/// Bearer-token check, in constant time.
async fn auth(
    State(st): State<AppState>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        None => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing bearer token (Authorization: Bearer ...)",
        )
        .into_response(),
        Some(t) if !st.token.matches(t) => {
            ApiError::new(StatusCode::UNAUTHORIZED, "invalid token").into_response()
        }
        Some(_) => next.run(req).await,
    }
}

async fn submit(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> ApiResult<(StatusCode, Json<JobView>)> {
    let is_toml = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.contains("toml"));
    let spec = if is_toml {
        let text = std::str::from_utf8(&body)
            .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "job spec is not UTF-8"))?;
        JobSpec::from_toml(text)?
    } else {
        JobSpec::from_json(&body)?
    };
    if let Some(ck) = &spec.checkpoint {
        if let Some(n) = ck.restore_step {
            check_restore_step(&ck.url, n).await?;
        }
    }
    st.store.submit(&spec).await?;
    tracing::info!(job = %spec.name, min = spec.min, max = spec.max, desired = spec.desired, "job submitted");
    Ok((
        StatusCode::CREATED,
        Json(view(&st.store, &spec.name).await?),
    ))
}

/// The checkpoint store at `url`; what fails there is a 502 that names it.
fn store_unavailable(url: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        format!("checkpoint store {url}: {e}"),
    )
}

/// A job submitted with `checkpoint.restore_step` must name a step its URL holds committed.
async fn check_restore_step(url: &str, n: u64) -> ApiResult<()> {
    let unavailable = |e: String| store_unavailable(url, format!("checking restore_step: {e}"));
    let bucket = ductile_checkpoint::Bucket::open(url).map_err(|e| unavailable(e.to_string()))?;
    let committed: Vec<u64> = ductile_checkpoint::restore::committed(&bucket, None)
        .await
        .map_err(|e| unavailable(e.to_string()))?
        .iter()
        .map(|c| c.step)
        .collect();
    if committed.contains(&n) {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::BAD_REQUEST,
        format!(
            "invalid checkpoint.restore_step: {url} holds no committed checkpoint at step {n} (committed steps: {committed:?}); nothing was submitted"
        ),
    ))
}

async fn list_jobs(State(st): State<AppState>) -> ApiResult<Json<Vec<JobView>>> {
    let mut out = Vec::new();
    for spec in st.store.specs().await? {
        out.push(view(&st.store, &spec.name).await?);
    }
    Ok(Json(out))
}

async fn job_status(
    State(st): State<AppState>,
    Path(job): Path<String>,
) -> ApiResult<Json<JobView>> {
    Ok(Json(view(&st.store, &job).await?))
}

async fn scale(
    State(st): State<AppState>,
    Path(job): Path<String>,
    body: axum::body::Bytes,
) -> ApiResult<Json<JobView>> {
    let req: ScaleRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("scale request: {e}")))?;
    if st.store.spec(&job).await?.is_none() {
        return Err(ApiError::not_found(&job));
    }
    let spec = st.store.scale(&job, req.size).await?;
    tracing::info!(job = %job, desired = spec.desired, "scale requested");
    Ok(Json(view(&st.store, &job).await?))
}

async fn stop(State(st): State<AppState>, Path(job): Path<String>) -> ApiResult<Json<JobView>> {
    if st.store.spec(&job).await?.is_none() {
        return Err(ApiError::not_found(&job));
    }
    st.store
        .backend
        .put(&st.store.keys.stop(&job), encode_now(), None)
        .await?;
    tracing::info!(job = %job, "stop requested");
    Ok(Json(view(&st.store, &job).await?))
}

/// What the job's checkpoint URL holds (committed checkpoints and attempts), newest first.
/// The daemon reads the store with its own credentials (the AWS_* environment).
async fn checkpoints(
    State(st): State<AppState>,
    Path(job): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    let Some((spec, _)) = st.store.spec(&job).await? else {
        return Err(ApiError::not_found(&job));
    };
    let Some(ck) = spec.checkpoint else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("job {job:?} has no [checkpoint] section"),
        ));
    };
    let latest: Option<CheckpointRecord> = st
        .store
        .get_json(&st.store.keys.checkpoint(&job), "checkpoint")
        .await?
        .map(|(r, _)| r);
    let bucket =
        ductile_checkpoint::Bucket::open(&ck.url).map_err(|e| store_unavailable(&ck.url, e))?;
    let list = ductile_checkpoint::retention::list(&bucket, latest.as_ref())
        .await
        .map_err(|e| store_unavailable(&ck.url, e))?;
    Ok(Json(serde_json::json!({
        "job": job,
        "url": ck.url,
        "keep": ck.keep,
        "latest": latest,
        "checkpoints": list,
    })))
}

fn encode_now() -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "requested_at_ms": now_ms() })).unwrap()
}

#[derive(Deserialize)]
struct EventsQuery {
    #[serde(default)]
    after: u64,
}

async fn events(
    State(st): State<AppState>,
    Path(job): Path<String>,
    Query(q): Query<EventsQuery>,
) -> ApiResult<Json<Vec<Generation>>> {
    if st.store.spec(&job).await?.is_none() {
        return Err(ApiError::not_found(&job));
    }
    Ok(Json(
        st.store
            .history(&job)
            .await?
            .into_iter()
            .filter(|g| g.number > q.after)
            .collect(),
    ))
}

async fn nodes(State(st): State<AppState>) -> ApiResult<Json<Vec<NodeView>>> {
    let nodes = st.store.nodes().await?;
    let (drains, _) = st.store.backend.list(&st.store.keys.drains()).await?;
    let drained: BTreeMap<String, String> = drains
        .iter()
        .filter_map(|kv| match st.store.keys.parse(&kv.key) {
            KeyKind::Drain { node } => Some((
                node,
                decode::<DrainRequest>(kv, "drain request")
                    .map(|d| d.reason)
                    .unwrap_or_default(),
            )),
            _ => None,
        })
        .collect();
    let mut placed: BTreeMap<String, Vec<NodeWorkerView>> = BTreeMap::new();
    for spec in st.store.specs().await? {
        let terminal = st
            .store
            .status(&spec.name)
            .await?
            .is_some_and(|(s, _)| s.state.is_terminal());
        if terminal {
            continue;
        }
        if let Some((g, _)) = st.store.generation(&spec.name).await? {
            for m in g.members {
                placed
                    .entry(m.node.clone())
                    .or_default()
                    .push(NodeWorkerView {
                        job: spec.name.clone(),
                        slot: m.slot,
                        rank: m.rank,
                    });
            }
        }
    }
    Ok(Json(
        nodes
            .into_iter()
            .map(|n| NodeView {
                slots: n.slots(),
                draining: n.draining || drained.contains_key(&n.name),
                drain_reason: n
                    .drain_reason
                    .clone()
                    .or_else(|| drained.get(&n.name).cloned()),
                workers: placed.remove(&n.name).unwrap_or_default(),
                name: n.name,
                hostname: n.hostname,
                devices: n.devices,
                agent_pid: n.agent_pid,
                reregistrations: n.reregistrations,
            })
            .collect(),
    ))
}

async fn drain(
    State(st): State<AppState>,
    Path(node): Path<String>,
    body: axum::body::Bytes,
) -> ApiResult<StatusCode> {
    ductile_cluster::keys::validate_name("node", &node)?;
    let b: DrainBody = if body.is_empty() {
        DrainBody::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("drain request: {e}")))?
    };
    if st
        .store
        .backend
        .get(&st.store.keys.node(&node))
        .await?
        .is_none()
    {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no live node named {node:?}"),
        ));
    }
    let req = DrainRequest {
        reason: b.reason.unwrap_or_else(|| "drained by the operator".into()),
        requested_at_ms: now_ms(),
    };
    st.store
        .put_json(&st.store.keys.drain(&node), &req, None)
        .await?;
    tracing::info!(node = %node, "drain requested");
    Ok(StatusCode::ACCEPTED)
}

async fn undrain(State(st): State<AppState>, Path(node): Path<String>) -> ApiResult<StatusCode> {
    ductile_cluster::keys::validate_name("node", &node)?;
    st.store.backend.delete(&st.store.keys.drain(&node)).await?;
    Ok(StatusCode::OK)
}

async fn leader(State(st): State<AppState>) -> ApiResult<Json<serde_json::Value>> {
    let leader = st
        .store
        .backend
        .leader(&st.store.keys.election())
        .await?
        .map(|v| String::from_utf8_lossy(&v).into_owned());
    Ok(Json(
        serde_json::json!({ "leader": leader, "this_replica": st.id, "this_replica_leads": st.is_leader.load(Ordering::SeqCst) }),
    ))
}

/// The status view of one job, assembled from its records.
pub async fn view(store: &Store, job: &str) -> ApiResult<JobView> {
    let Some((spec, _)) = store.spec(job).await? else {
        return Err(ApiError::not_found(job));
    };
    let status = store.status(job).await?.map(|(s, _)| s);
    let gen = store.generation(job).await?.map(|(g, _)| g);
    let progress = store.progress(job).await?;
    let (kvs, _) = store
        .backend
        .list(&format!("{}workers/", store.keys.job(job)))
        .await?;
    let mut pids = BTreeMap::new();
    for kv in &kvs {
        if let KeyKind::Worker { node, slot, .. } = store.keys.parse(&kv.key) {
            if let Ok(w) = decode::<WorkerRecord>(kv, "worker record") {
                if w.state == WorkerState::Running {
                    pids.insert((node, slot), w.pid);
                }
            }
        }
    }
    let terminal = status.as_ref().is_some_and(|s| s.state.is_terminal());
    let members = match (&gen, terminal) {
        (Some(g), false) => g
            .members
            .iter()
            .map(|m| MemberView {
                node: m.node.clone(),
                slot: m.slot,
                rank: m.rank,
                pid: pids.get(&(m.node.clone(), m.slot)).copied(),
            })
            .collect(),
        _ => Vec::new(),
    };
    Ok(JobView {
        job: job.to_string(),
        state: status
            .as_ref()
            .map(|s| s.state)
            .unwrap_or(JobState::Pending),
        generation: gen.as_ref().map(|g| g.number).unwrap_or(0),
        world_size: if terminal {
            0
        } else {
            gen.as_ref().map(|g| g.world_size).unwrap_or(0)
        },
        members,
        step: progress.as_ref().map(|p| p.step).unwrap_or(0),
        loss: progress.as_ref().and_then(|p| p.loss),
        samples_per_sec: progress.as_ref().and_then(|p| p.samples_per_sec),
        last_reformation: status
            .as_ref()
            .and_then(|s| s.last_reformation.as_ref())
            .map(|r| ReformationView {
                generation: r.generation,
                reason: r.reason,
                detail: r.detail.clone(),
                seconds: r.seconds,
            }),
        min: spec.min,
        max: spec.max,
        desired: spec.desired,
        message: status
            .as_ref()
            .map(|s| s.message.clone())
            .unwrap_or_else(|| "waiting for the leader to schedule it".into()),
        final_weights_sha256: progress.and_then(|p| p.final_weights_sha256),
    })
}

/// Prometheus text format, read from etcd so any replica answers the same.
async fn metrics(State(st): State<AppState>) -> ApiResult<Response> {
    let mut out = String::new();
    let specs = st.store.specs().await?;
    let nodes = st.store.nodes().await?;
    let _ = writeln!(out, "# HELP ductile_daemon_is_leader 1 if this replica leads.\n# TYPE ductile_daemon_is_leader gauge");
    let _ = writeln!(
        out,
        "ductile_daemon_is_leader {}",
        st.is_leader.load(Ordering::SeqCst) as u8
    );
    let _ = writeln!(
        out,
        "# HELP ductile_nodes Live nodes.\n# TYPE ductile_nodes gauge\nductile_nodes {}",
        nodes.len()
    );
    let _ = writeln!(out, "# HELP ductile_slots Live slots (GPUs or CPU slots).\n# TYPE ductile_slots gauge\nductile_slots {}", nodes.iter().map(|n| n.slots()).sum::<u32>());
    let mut by_state: BTreeMap<String, u32> = BTreeMap::new();
    let mut per_job = String::new();
    let _ = writeln!(per_job, "# HELP ductile_job_world_size World size of the job's current generation.\n# TYPE ductile_job_world_size gauge");
    let mut gens = String::from("# HELP ductile_job_generation Current generation number.\n# TYPE ductile_job_generation gauge\n");
    let mut reform = String::from("# HELP ductile_job_last_reformation_seconds Seconds from the triggering event to the last member joining.\n# TYPE ductile_job_last_reformation_seconds gauge\n");
    let mut count = String::from("# HELP ductile_reformations_total Generations published, by reason.\n# TYPE ductile_reformations_total counter\n");
    let mut ckpt = String::from(concat!(
        "# HELP ductile_checkpoint_stall_ms Training stall of the last checkpoint (copy into host memory).\n# TYPE ductile_checkpoint_stall_ms gauge\n",
    ));
    let mut ckpt_more = String::from(concat!(
        "# HELP ductile_checkpoint_upload_seconds Snapshot-to-commit time of the last committed checkpoint.\n# TYPE ductile_checkpoint_upload_seconds gauge\n",
    ));
    let mut ckpt_bytes = String::from("# HELP ductile_checkpoint_bytes Bytes of the last committed checkpoint.\n# TYPE ductile_checkpoint_bytes gauge\n");
    let mut ckpt_step = String::from("# HELP ductile_checkpoint_last_step Step of the last committed checkpoint.\n# TYPE ductile_checkpoint_last_step gauge\n");
    let mut ckpt_counts = String::from("# HELP ductile_checkpoints_total Checkpoints by outcome (committed, skipped while one was in flight, failed).\n# TYPE ductile_checkpoints_total counter\n");
    let mut ckpt_restore = String::from("# HELP ductile_checkpoint_restore_seconds Time of the last restore from a checkpoint.\n# TYPE ductile_checkpoint_restore_seconds gauge\n");
    for spec in &specs {
        let v = view(&st.store, &spec.name).await?;
        *by_state.entry(format!("{:?}", v.state)).or_default() += 1;
        let _ = writeln!(
            per_job,
            "ductile_job_world_size{{job=\"{}\"}} {}",
            v.job, v.world_size
        );
        let _ = writeln!(
            gens,
            "ductile_job_generation{{job=\"{}\"}} {}",
            v.job, v.generation
        );
        if let Some(r) = &v.last_reformation {
            let _ = writeln!(
                reform,
                "ductile_job_last_reformation_seconds{{job=\"{}\",reason=\"{}\"}} {}",
                v.job, r.reason, r.seconds
            );
        }
        if let Some((c, _)) = st
            .store
            .get_json::<CheckpointStats>(
                &st.store.keys.checkpoint_stats(&spec.name),
                "checkpoint stats",
            )
            .await?
        {
            let j = &v.job;
            let _ = writeln!(
                ckpt,
                "ductile_checkpoint_stall_ms{{job=\"{j}\"}} {}",
                c.last_stall_ms
            );
            let _ = writeln!(
                ckpt_more,
                "ductile_checkpoint_upload_seconds{{job=\"{j}\"}} {}",
                c.last_upload_seconds
            );
            let _ = writeln!(
                ckpt_bytes,
                "ductile_checkpoint_bytes{{job=\"{j}\"}} {}",
                c.last_bytes
            );
            let _ = writeln!(
                ckpt_step,
                "ductile_checkpoint_last_step{{job=\"{j}\"}} {}",
                c.last_step
            );
            for (k, n) in [
                ("committed", c.committed_total),
                ("skipped", c.skipped_total),
                ("failed", c.failed_total),
            ] {
                let _ = writeln!(
                    ckpt_counts,
                    "ductile_checkpoints_total{{job=\"{j}\",outcome=\"{k}\"}} {n}"
                );
            }
            if let Some(r) = c.last_restore_seconds {
                let _ = writeln!(
                    ckpt_restore,
                    "ductile_checkpoint_restore_seconds{{job=\"{j}\"}} {r}"
                );
            }
        }
        // counted at each publish: history is bounded, these counts are not
        let reasons = st
            .store
            .status(&spec.name)
            .await?
            .map(|(s, _)| s.reformations)
            .unwrap_or_default();
        for (r, n) in reasons {
            let _ = writeln!(
                count,
                "ductile_reformations_total{{job=\"{}\",reason=\"{r}\"}} {n}",
                v.job
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP ductile_jobs Jobs by state.\n# TYPE ductile_jobs gauge"
    );
    for (s, n) in by_state {
        let _ = writeln!(out, "ductile_jobs{{state=\"{s}\"}} {n}");
    }
    out.push_str(&per_job);
    out.push_str(&gens);
    out.push_str(&reform);
    out.push_str(&count);
    for s in [
        ckpt,
        ckpt_more,
        ckpt_bytes,
        ckpt_step,
        ckpt_counts,
        ckpt_restore,
    ] {
        out.push_str(&s);
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response())
}

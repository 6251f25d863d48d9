//! The HTTP API that `dctl` uses, and Prometheus metrics. Every replica serves it; writes go to
//! etcd, where the leader's reconciler picks them up.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ductile_cluster::api::*;
use ductile_cluster::keys::KeyKind;
use ductile_cluster::records::*;
use ductile_cluster::store::decode;
use ductile_cluster::{ClusterError, Store};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Deserialize;

use crate::config::Secret;
use crate::observe::{fleet_from, job_kvs, jobs_from, jobs_from_kvs};
use crate::reconcile::JobObs;
use crate::view::{ClusterView, Snapshots};

#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    /// The replica's cached view: reads are served from it (no etcd request per read).
    pub view: ClusterView,
    /// The admin token (every call) and the read-only token (GET calls only), replaced whole
    /// when the daemon reloads its configuration (SIGHUP: token rotation without a restart).
    pub tokens: std::sync::Arc<std::sync::RwLock<Tokens>>,
    /// `/metrics` asks for either token.
    pub metrics_need_token: bool,
    /// GET calls need no token (plain HTTP on loopback only: the config checks).
    pub reads_without_token: bool,
    /// This replica's leader key while it leads.
    pub leader: tokio::sync::watch::Receiver<Option<ductile_cluster::kv::LeaderKey>>,
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
        .route("/v1/dry-run", post(submit_dry))
        .route("/v1/jobs/{job}", get(job_status).delete(delete_job))
        .route("/v1/jobs/{job}/scale", post(scale))
        .route("/v1/jobs/{job}/stop", post(stop))
        .route("/v1/jobs/{job}/events", get(events))
        .route("/v1/jobs/{job}/quorums", get(quorums))
        .route("/v1/jobs/{job}/series", get(series))
        .route("/v1/jobs/{job}/checkpoints", get(checkpoints))
        .route("/v1/jobs/{job}/spec", get(job_spec))
        .route("/v1/jobs/{job}/logs", get(logs))
        .route("/v1/jobs/{job}/plan", get(plan))
        .route("/v1/nodes", get(nodes))
        .route("/v1/nodes/{node}/drain", post(drain).delete(undrain))
        .route("/v1/leader", get(leader))
        .route(
            "/v1/version",
            get(|| async { Json(serde_json::json!({"version": env!("CARGO_PKG_VERSION")})) }),
        )
        .route("/v1/torchft", get(torchft))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/", get(dashboard))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(authed)
        .with_state(state)
}

/// The dashboard: one page, its script and styles inside, built into the binary. It holds no
/// data; what it shows it reads from the API with the token it is given (`/#token=...`, kept
/// for the browser tab) or, with `reads_without_token`, none.
async fn dashboard() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        include_str!("dashboard.html"),
    )
        .into_response()
}

/// What a bearer token may do.
/// The API's tokens as the configuration names them now.
pub struct Tokens {
    pub admin: Secret,
    pub read: Option<Secret>,
    /// Tenants' tokens (`tenants_file`), each for its own jobs.
    pub tenants: Vec<crate::tenants::Tenant>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Scope {
    Read,
    Admin,
    Tenant(Arc<crate::tenants::Tenant>),
}

impl Scope {
    /// Whether this token may see job `job` at all (the admin and read tokens: every job).
    fn sees(&self, job: &str) -> bool {
        match self {
            Scope::Tenant(t) => t.owns(job),
            _ => true,
        }
    }
}

/// What a tenant's token may call: its own jobs (reads; with `submit`, changes too), the job
/// list and nodes (filtered by the handlers), the leader; nothing of the cluster's own. The
/// refusal names the scope the call needs.
fn tenant_allows(t: &crate::tenants::Tenant, method: &Method, path: &str) -> Result<(), String> {
    let read = matches!(*method, Method::GET | Method::HEAD);
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let who = t.describe();
    match parts.as_slice() {
        ["v1", "jobs"] if read => Ok(()),
        ["v1", "jobs"] | ["v1", "dry-run"] if t.submit => Ok(()),
        ["v1", "jobs", job, ..] => {
            if !t.owns(job) {
                return Err(format!(
                    "{who} may act on its own jobs only ({}*): {job:?} is not one of them; that needs the admin token",
                    t.jobs
                ));
            }
            if !read && !t.submit {
                return Err(format!(
                    "{who} cannot {method} {path}: that needs the submit scope"
                ));
            }
            Ok(())
        }
        ["v1", "nodes"] | ["v1", "leader"] | ["v1", "version"] if read => Ok(()),
        _ => Err(format!(
            "{who} cannot {method} {path}: that needs the admin token{}",
            if read { " or the read-only one" } else { "" }
        )),
    }
}

/// The scope of the request's bearer token (compared in constant time), or the 401 to answer.
fn scope(st: &AppState, headers: &HeaderMap) -> Result<Scope, Response> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        None if st.reads_without_token => Ok(Scope::Read),
        None => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing bearer token (Authorization: Bearer ...)",
        )
        .into_response()),
        Some(t) => {
            let tokens = st.tokens.read().unwrap_or_else(|p| p.into_inner());
            if tokens.admin.matches(t) {
                Ok(Scope::Admin)
            } else if tokens.read.as_ref().is_some_and(|r| r.matches(t)) {
                Ok(Scope::Read)
            } else if let Some(tenant) = tokens.tenants.iter().find(|x| x.matches(t)) {
                Ok(Scope::Tenant(Arc::new(tenant.clone())))
            } else {
                Err(ApiError::new(StatusCode::UNAUTHORIZED, "invalid token").into_response())
            }
        }
    }
}

/// Bearer-token check: the admin token may do everything, the read-only token only reads
/// (GET); a change asked with it is a 403 that says so.
async fn auth(
    State(st): State<AppState>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    match scope(&st, &headers) {
        Err(r) => r,
        Ok(Scope::Read) if !matches!(*req.method(), Method::GET | Method::HEAD) => ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "the read-only token cannot {} {}: that needs the admin token",
                req.method(),
                req.uri().path()
            ),
        )
        .into_response(),
        Ok(Scope::Tenant(t)) if tenant_allows(&t, req.method(), req.uri().path()).is_err() => {
            let why = tenant_allows(&t, req.method(), req.uri().path()).unwrap_err();
            ApiError::new(StatusCode::FORBIDDEN, why).into_response()
        }
        Ok(scope) => {
            let mut req = req;
            req.extensions_mut().insert(scope);
            next.run(req).await
        }
    }
}

async fn submit(
    State(st): State<AppState>,
    axum::Extension(scope): axum::Extension<Scope>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> ApiResult<Response> {
    submit_checked(st, scope, headers, body, false).await
}

/// `POST /v1/dry-run` (`dctl submit --dry-run`): every check a submit makes, as the token
/// that asks would be checked, and nothing stored. A path of its own, not a query on
/// `/v1/jobs`, so that a daemon from before it answers 404 rather than submitting the job.
async fn submit_dry(
    State(st): State<AppState>,
    axum::Extension(scope): axum::Extension<Scope>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> ApiResult<Response> {
    submit_checked(st, scope, headers, body, true).await
}

async fn submit_checked(
    st: AppState,
    scope: Scope,
    headers: HeaderMap,
    body: axum::body::Bytes,
    dry_run: bool,
) -> ApiResult<Response> {
    let is_toml = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.contains("toml"));
    let mut spec = if is_toml {
        let text = std::str::from_utf8(&body)
            .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "job spec is not UTF-8"))?;
        JobSpec::from_toml(text)?
    } else {
        JobSpec::from_json(&body)?
    };
    if let Scope::Tenant(t) = &scope {
        tenant_may_submit(&st, t, &spec)?;
    }
    // what the spec alone shows first (a Hugging Face model's layout needs its config.json:
    // checked once that is read), then the allow-lists: the daemon reads only where the job may
    // read (its model directory, its datasets, its checkpoints), and nothing before that
    let check_job = |spec: &JobSpec| {
        ductile_strategies::pipeline::check_job(spec)
            .map_err(|(field, reason)| ClusterError::invalid(field, reason))
    };
    let hf = spec
        .training
        .as_ref()
        .is_some_and(|t| t.model == ductile_cluster::modes::ModelKind::Hf);
    if !hf {
        check_job(&spec)?;
    }
    let nodes = {
        let snaps = current(&st)?;
        fleet_from(&st.store, &snaps.nodes, &snaps.drains).nodes
    };
    check_policies(&nodes, &spec)?;
    check_checkpoint_owner(&st, &spec).await?;
    read_hf_config(&mut spec).await?;
    if hf {
        check_job(&spec)?;
    }
    resolve_sharding(&mut spec, nodes.values());
    check_memory(&spec, nodes.values())?;
    check_datasets(&spec).await?;
    if let Some(ck) = &spec.checkpoint {
        if let Some(n) = ck.restore_step {
            check_restore_step(&ck.url, n, &spec.name).await?;
        }
    }
    if dry_run {
        // what the store's submit would refuse: a job of that name that has not finished
        if st.store.spec(&spec.name).await?.is_some() {
            match st.store.status(&spec.name).await? {
                Some((s, _)) if s.state.is_terminal() => {}
                _ => {
                    return Err(ApiError::new(
                        StatusCode::CONFLICT,
                        format!("job {:?} already exists and has not finished", spec.name),
                    ))
                }
            }
        }
        return Ok(Json(dry_run_view(&spec, &nodes)).into_response());
    }
    st.store.submit(&spec).await?;
    tracing::info!(job = %spec.name, min = spec.min, max = spec.max, desired = spec.desired, "job submitted");
    Ok((
        StatusCode::CREATED,
        Json(view(&st.store, &spec.name).await?),
    )
        .into_response())
}

/// What a dry run answers: the spec as it would be stored (the sharding chosen, a model's
/// config read), and which live agents' policies take it (a refusal names the field and why).
fn dry_run_view(
    spec: &JobSpec,
    nodes: &BTreeMap<String, ductile_cluster::records::NodeRecord>,
) -> serde_json::Value {
    let mut allowed = Vec::new();
    let mut refused = serde_json::Map::new();
    let mut slots = 0u32;
    for (name, node) in nodes {
        match node.policy.as_ref().map(|p| p.check(spec)) {
            None | Some(Ok(())) => {
                allowed.push(name.clone());
                if !node.draining {
                    slots += node.slots();
                }
            }
            Some(Err((field, why))) => {
                refused.insert(name.clone(), format!("{field}: {why}").into());
            }
        }
    }
    serde_json::json!({
        "valid": true,
        "job": spec.name,
        "spec": spec,
        "agents": { "allowed": allowed, "refused": refused, "slots": slots },
    })
}

/// A job no live agent's policy allows is refused, naming the field and an agent's reason
/// (agents from before policies, and a cluster with no agents yet, do not refuse: the agents
/// check again before starting a worker).
fn check_policies(
    nodes: &BTreeMap<String, ductile_cluster::records::NodeRecord>,
    spec: &JobSpec,
) -> ApiResult<()> {
    let mut refusal = None;
    for (name, node) in nodes {
        match node.policy.as_ref().map(|p| p.check(spec)) {
            None | Some(Ok(())) => return Ok(()),
            Some(Err((field, reason))) => {
                refusal.get_or_insert((field, format!("agent {name}: {reason}")));
            }
        }
    }
    match refusal {
        Some((field, reason)) => Err(ClusterError::invalid(
            field,
            format!("no agent's policy allows it ({reason})"),
        )
        .into()),
        None => Ok(()),
    }
}

/// `sharding = "auto"`: the least sharding that fits a slot, against `memory_per_slot_gib` or
/// else the smallest live slot whose memory is known; the spec is stored with the choice.
fn resolve_sharding<'a>(
    spec: &mut JobSpec,
    nodes: impl Iterator<Item = &'a ductile_cluster::records::NodeRecord>,
) {
    // (at every world the job may take, as the memory check)
    let (min, max) = (spec.min, spec.max);
    let name = spec.name.clone();
    let Some(t) = spec.training.as_mut() else {
        return;
    };
    let cap = t
        .memory_per_slot_gib
        .map(|g| (g * (1u64 << 30) as f64) as u64)
        .or_else(|| {
            nodes
                .flat_map(|n| n.devices.iter())
                .filter_map(|d| d.memory_mb)
                .min()
                .map(|mb| mb.saturating_mul(1 << 20))
        });
    if let Some(said) = t.resolve_auto_sharding(min, max, cap) {
        tracing::info!(job = %name, "{said}");
    }
}

/// A job whose state cannot fit any live slot (its parameters, gradients and optimizer state
/// at the layout that splits them most, against the slot's memory: a GPU's, or a CPU slot's
/// share of its node's) is refused at submit, naming the figures: its workers would die at start
/// and spend the restart budget. The check holds at every world size the job may take: a rank
/// needs the most at the fewest ranks, so a job that fits at its max but not at its min (its
/// workers would die when it shrinks there) is refused too, naming the smallest world that
/// fits. Slots of unknown memory (agents from before it was reported) refuse nothing.
fn check_memory<'a>(
    spec: &JobSpec,
    nodes: impl Iterator<Item = &'a ductile_cluster::records::NodeRecord>,
) -> ApiResult<()> {
    let Some(t) = spec.training.as_ref() else {
        return Ok(());
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    // every live slot's memory, the largest named
    let mut slots: Vec<u64> = Vec::new();
    let mut largest: Option<(u64, String)> = None;
    for n in nodes {
        for d in &n.devices {
            let Some(mb) = d.memory_mb else {
                return Ok(());
            };
            slots.push(mb.saturating_mul(1 << 20));
            if largest.as_ref().is_none_or(|(l, _)| mb > *l) {
                largest = Some((mb, format!("{} of node {}", d.name, n.name)));
            }
        }
    }
    let Some((largest_mb, which)) = largest else {
        return Ok(());
    };
    let fitting = |need: u64| slots.iter().filter(|b| **b >= need).count() as u64;
    // a world of w ranks needs w slots that each hold a rank's share at w
    let runs_at = |w: u32| t.min_slot_bytes(w).map(|need| (need, fitting(need)));
    let Some((need_min, fit_min)) = runs_at(spec.min.max(1)) else {
        return Ok(());
    };
    if fit_min >= u64::from(spec.min) {
        return Ok(());
    }
    // (bounded: a world beyond the live slots cannot run anyway)
    let top = spec.max.min(spec.min.saturating_add(slots.len() as u32));
    let from =
        (spec.min + 1..=top).find(|w| runs_at(*w).is_some_and(|(_, fit)| fit >= u64::from(*w)));
    let largest_gib = largest_mb as f64 / 1024.0;
    if let Some(k) = from {
        return Err(ClusterError::invalid(
            "min",
            format!(
                "at its min of {} rank(s) the job needs about {:.1} GiB per slot (parameters, gradients and optimizer state; a rank holds the most at the fewest ranks) on {} slot(s), and {fit_min} live slot(s) have that much (the largest is {which}, {largest_gib:.1} GiB): its workers would fail at start if it shrank there; it fits from {k} ranks up: set min = {k}",
                spec.min,
                gib(need_min),
                spec.min,
            ),
        )
        .into());
    }
    let need_max = t.min_slot_bytes(spec.max.max(1)).unwrap_or(need_min);
    Err(ClusterError::invalid(
        "training.model_config",
        format!(
            "the job needs about {:.1} GiB per slot (parameters, gradients and optimizer state at the layout that splits them most, at its max of {} ranks; {:.1} GiB at its min of {}) on at least min = {} slots, and {fit_min} live slot(s) have that much: the largest is {which}, {largest_gib:.1} GiB",
            gib(need_max),
            spec.max,
            gib(need_min),
            spec.min,
            spec.min,
        ),
    )
    .into())
}

/// The most it reads of a model's `tokenizer.json` (Llama 3's is 9 MB).
const MAX_TOKENIZER_JSON: u64 = 64 << 20;

/// A job's checkpoint URL is its own: one equal to, inside, or around the URL of another job
/// that has not finished is refused at submit (that job's retention would delete this one's
/// commits, or this one's another's). Resubmitting a job under its own name keeps its URL.
async fn check_checkpoint_owner(st: &AppState, spec: &JobSpec) -> ApiResult<()> {
    let mine = checkpoint_urls(spec);
    if mine.is_empty() {
        return Ok(());
    }
    let norm = |u: &str| format!("{}/", u.trim_end_matches('/'));
    // every job's spec and status in one request (not the replica's view: a job submitted
    // at another replica a moment ago counts)
    let (kvs, _) = st.store.backend.list(&st.store.keys.jobs()).await?;
    for (name, obs) in jobs_from_kvs(&st.store, kvs.iter()) {
        let Some(other) = obs.spec.as_ref().filter(|_| name != spec.name) else {
            continue;
        };
        if obs.status.as_ref().is_some_and(|s| s.state.is_terminal()) {
            continue;
        }
        for (field, url) in &mine {
            for (_, t) in checkpoint_urls(other) {
                let (a, b) = (norm(url), norm(t));
                if a.starts_with(&b) || b.starts_with(&a) {
                    return Err(ClusterError::invalid(
                        *field,
                        format!("{url} is job {name:?}'s checkpoint location ({t}) or overlaps it: each job needs a location of its own"),
                    )
                    .into());
                }
            }
        }
    }
    Ok(())
}

/// Where a job keeps checkpoints: (the spec's field, the URL).
fn checkpoint_urls(spec: &JobSpec) -> Vec<(&'static str, &str)> {
    [
        spec.checkpoint
            .as_ref()
            .map(|c| ("checkpoint.url", c.url.as_str())),
        spec.torchrun
            .as_ref()
            .and_then(|t| t.checkpoint_url.as_deref())
            .map(|u| ("program.checkpoint_url", u)),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The checkpoint store at `url`; what fails there is a 502 that names it.
fn store_unavailable(url: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        format!("checkpoint store {url}: {e}"),
    )
}

/// A job submitted with `checkpoint.restore_step` must name a step its URL holds committed.
/// A `model = "hf"` job: read `config.json` from its `model_path` into `training.hf_config`
/// (the workers build exactly that model) and check the spec again with it: an unknown
/// architecture, a key whose value ductile would not honour, a context past the model's, a
/// layout the model cannot take are refused here, naming the key. A directory that cannot be
/// read is a 400 (nothing there) or a 503 (the store did not answer), never a guess.
async fn read_hf_config(spec: &mut JobSpec) -> ApiResult<()> {
    let Some(t) = spec.training.as_mut() else {
        return Ok(());
    };
    if t.model != ductile_cluster::modes::ModelKind::Hf {
        return Ok(());
    }
    let url = t.model_path.clone().unwrap_or_default();
    use ductile_checkpoint::hf::{read_config_json, ConfigJsonError};
    let v = match read_config_json(&url, "the daemon at submit").await {
        Ok(v) => v,
        Err(ConfigJsonError::NotAModel(why)) => {
            return Err(ClusterError::invalid("training.model_path", why).into())
        }
        Err(ConfigJsonError::Store(why)) => return Err(store_unavailable(&url, why)),
    };
    t.hf_config = Some(v);
    spec.validate()?;
    Ok(())
}

/// A sharded dataset (a prefix ending in `/`, as `dataset` or `eval_dataset`) is checked at
/// submit: its index reads and holds together, every shard is there and as long as the index
/// says, and for a Hugging Face model the index's tokenizer is the model's `tokenizer.json`.
/// What is wrong is a 400 naming the field and the shard; a store that does not answer, a 502.
async fn check_datasets(spec: &JobSpec) -> ApiResult<()> {
    let Some(t) = spec.training.as_ref() else {
        return Ok(());
    };
    let mut model_sha: Option<String> = None;
    for (field, url) in [
        ("training.dataset", Some(&t.dataset)),
        ("training.eval_dataset", t.eval_dataset.as_ref()),
    ] {
        let Some(url) = url.filter(|u| u.ends_with('/')) else {
            continue;
        };
        let opened = match ductile_checkpoint::dataset::open_prefix(url).await {
            Ok(o) => o,
            Err(ductile_checkpoint::dataset::DatasetError::Invalid(m)) => {
                return Err(ClusterError::invalid(field, m).into())
            }
            Err(ductile_checkpoint::dataset::DatasetError::Store(m)) => {
                return Err(ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    format!("{field}: dataset store: {m}"),
                ))
            }
        };
        if t.model == ductile_cluster::modes::ModelKind::Hf {
            if model_sha.is_none() {
                let dir = t.model_path.clone().unwrap_or_default();
                let bucket = ductile_checkpoint::Bucket::open(dir.trim_end_matches('/'))
                    .map_err(|e| ClusterError::invalid("training.model_path", e.to_string()))?;
                use ductile_checkpoint::bucket::Capped;
                match bucket.get_capped("tokenizer.json", MAX_TOKENIZER_JSON).await {
                    Ok(Capped::Bytes(b)) => {
                        use sha2::Digest;
                        let h = sha2::Sha256::digest(&b);
                        model_sha = Some(h.iter().map(|x| format!("{x:02x}")).collect());
                    }
                    Ok(Capped::TooLarge(n)) => {
                        return Err(ClusterError::invalid(
                            "training.model_path",
                            format!("{dir}/tokenizer.json is {n} bytes, past the {MAX_TOKENIZER_JSON} the daemon reads at submit"),
                        )
                        .into())
                    }
                    // no tokenizer to compare with: the workers check what they can
                    Ok(Capped::Absent) => model_sha = Some(String::new()),
                    Err(e) => {
                        return Err(store_unavailable(
                            &dir,
                            format!("reading tokenizer.json: {e}"),
                        ))
                    }
                }
            }
            let sha = model_sha.as_deref().unwrap_or("");
            if !sha.is_empty() && sha != opened.index.tokenizer_sha256 {
                return Err(ClusterError::invalid(
                    field,
                    format!(
                        "{url} was made by a tokenizer of SHA-256 {}, but the model's tokenizer.json is {sha}: tokenize it again with the model's tokenizer",
                        opened.index.tokenizer_sha256
                    ),
                )
                .into());
            }
        }
    }
    Ok(())
}

async fn check_restore_step(url: &str, n: u64, job: &str) -> ApiResult<()> {
    let unavailable = |e: String| store_unavailable(url, format!("checking restore_step: {e}"));
    let bucket = ductile_checkpoint::Bucket::open(url).map_err(|e| unavailable(e.to_string()))?;
    let committed: Vec<u64> = ductile_checkpoint::restore::committed_for(&bucket, None, Some(job))
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

/// Readiness, for a load balancer in front of the replicas and for scripts that start one:
/// 200 once this replica has read the cluster's state from etcd and etcd answers it, else 503
/// saying why. `/healthz` says only that the process serves.
async fn readyz(State(st): State<AppState>) -> ApiResult<&'static str> {
    current(&st).map(|_| "ready\n")
}

/// A tenant submits only under its own prefix, and within its `max_slots`: the sum of `max`
/// over its unfinished jobs, this one included (one of the same name that has finished is
/// replaced, so it does not count).
fn tenant_may_submit(st: &AppState, t: &crate::tenants::Tenant, spec: &JobSpec) -> ApiResult<()> {
    if !t.owns(&spec.name) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "{} submits jobs named {}* only: {:?} is not one; that needs the admin token",
                t.describe(),
                t.jobs,
                spec.name
            ),
        ));
    }
    if let Some(cap) = t.max_slots {
        let snaps = current(st)?;
        let held: u64 = jobs_from(&st.store, &[&snaps.jobs])
            .iter()
            .filter(|(name, o)| {
                t.owns(name)
                    && *name != &spec.name
                    && !o.status.as_ref().is_some_and(|s| s.state.is_terminal())
            })
            .filter_map(|(_, o)| o.spec.as_ref().map(|s| s.max as u64))
            .sum();
        if held + spec.max as u64 > cap as u64 {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "{}: its unfinished jobs may ask for {cap} slots (max_slots), and {held} are asked for already: this job's max = {} does not fit; stop one, or ask the operator",
                    t.describe(),
                    spec.max
                ),
            ));
        }
    }
    Ok(())
}

/// The replica's view if it is current, else a 503 that says why.
fn current(st: &AppState) -> ApiResult<Snapshots> {
    st.view
        .current()
        .map_err(|why| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, why))
}

/// One job's observed state from the cached view; None when the view has no such job (yet:
/// a job just submitted may not have reached this replica's watch).
fn cached_obs(st: &AppState, snaps: &Snapshots, job: &str) -> Option<JobObs> {
    let k = &st.store.keys;
    let (jp, lp) = (k.job(job), k.live_job(job));
    let mut jobs = jobs_from_kvs(
        &st.store,
        job_kvs(&snaps.jobs, &jp).chain(job_kvs(&snaps.live, &lp)),
    );
    jobs.remove(job).filter(|o| o.spec.is_some())
}

async fn list_jobs(
    State(st): State<AppState>,
    axum::Extension(scope): axum::Extension<Scope>,
) -> ApiResult<Json<Vec<JobView>>> {
    let snaps = current(&st)?;
    let jobs = jobs_from(&st.store, &[&snaps.jobs, &snaps.live]);
    Ok(Json(
        jobs.iter()
            .filter(|(name, _)| scope.sees(name))
            .filter_map(|(name, obs)| job_view(name, obs))
            .collect(),
    ))
}

async fn job_status(
    State(st): State<AppState>,
    Path(job): Path<String>,
) -> ApiResult<Json<JobView>> {
    let snaps = current(&st)?;
    let mut v = match cached_obs(&st, &snaps, &job).and_then(|o| job_view(&job, &o)) {
        Some(v) => v,
        // not in this replica's view: ask etcd (a job submitted a moment ago, or none)
        None => view(&st.store, &job).await?,
    };
    if v.members.iter().any(|m| m.replica_group.is_some()) {
        v.torchft = crate::lighthouse::job_quorum(&st.store, &job).await?;
    }
    Ok(Json(v))
}

/// The job's spec as stored (with what the daemon filled in at submit: a Hugging Face
/// model's config.json).
/// A job's spec; its `env` values (what an operator may have put credentials in) only to the
/// admin token: the read-only token, which dashboard URLs carry, sees the names alone.
async fn job_spec(
    State(st): State<AppState>,
    axum::Extension(scope): axum::Extension<Scope>,
    Path(job): Path<String>,
) -> ApiResult<Json<JobSpec>> {
    match st.store.spec(&job).await? {
        Some((mut s, _)) => {
            // a tenant sees its own job's values: it set them
            if scope == Scope::Read {
                for v in s.env.values_mut() {
                    *v = "(hidden from the read-only token)".into();
                }
            }
            Ok(Json(s))
        }
        None => Err(ApiError::not_found(&job)),
    }
}

async fn scale(
    State(st): State<AppState>,
    Path(job): Path<String>,
    body: axum::body::Bytes,
) -> ApiResult<Json<JobView>> {
    let req: ScaleRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("scale request: {e}")))?;
    let Some(spec) = st.store.spec(&job).await? else {
        return Err(ApiError::not_found(&job));
    };
    if let Some(t) = &spec.0.training {
        // a size the planner cannot lay out would leave the job waiting: refuse it here
        ductile_strategies::pipeline::plan(t, req.size).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("cannot scale {job} to {}: {e}; nothing changed", req.size),
            )
        })?;
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

/// `dctl delete JOB`: forget a finished job's records (its checkpoints stay at their URL).
#[derive(Deserialize, Default)]
struct DeleteQuery {
    /// Also delete the job's checkpoints at its `[checkpoint] url` (ductile's own trainer).
    #[serde(default)]
    purge: bool,
}

async fn delete_job(
    State(st): State<AppState>,
    Path(job): Path<String>,
    Query(q): Query<DeleteQuery>,
) -> ApiResult<Json<serde_json::Value>> {
    let Some((spec, _)) = st.store.spec(&job).await? else {
        return Err(ApiError::not_found(&job));
    };
    let mut purged = serde_json::Value::Null;
    if q.purge {
        // the checkpoints go first, once the job is known to be finished: a purge that fails
        // leaves the records, and the same delete --purge finishes it
        match st.store.status(&job).await? {
            Some((s, _)) if s.state.is_terminal() => {}
            other => {
                let state = other
                    .map(|(s, _)| format!("{:?}", s.state))
                    .unwrap_or_else(|| "Pending".into());
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    format!("job {job:?} is {state}: only a finished job is deleted (dctl stop {job} first)"),
                ));
            }
        }
        match (&spec.checkpoint, spec.runtime.is_ductile()) {
            (Some(ck), true) => {
                let bucket = ductile_checkpoint::Bucket::open(&ck.url)
                    .map_err(|e| store_unavailable(&ck.url, e))?;
                let p = ductile_checkpoint::retention::purge(&bucket, &job)
                    .await
                    .map_err(|e| {
                        ApiError::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("purging job {job:?}'s checkpoints at {} failed: {e}; the job's records are kept, and what was deleted stays deleted: delete --purge again to finish", ck.url),
                        )
                    })?;
                tracing::info!(job = %job, url = %ck.url, deleted = p.deleted.len(), "checkpoints purged");
                purged = serde_json::json!({
                    "url": ck.url,
                    "deleted": p.deleted,
                    "foreign": p.foreign,
                    "unowned": p.unowned,
                });
            }
            (Some(_), false) => {
                let url = spec
                    .torchrun
                    .as_ref()
                    .and_then(|t| t.checkpoint_url.clone())
                    .unwrap_or_default();
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    format!("job {job:?} runs its own program, whose checkpoints at {url} are in its own format: ductile does not delete them (delete them there, then dctl delete {job} without --purge)"),
                ));
            }
            (None, _)
                if spec
                    .torchrun
                    .as_ref()
                    .is_some_and(|t| t.checkpoint_url.is_some()) =>
            {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    format!("job {job:?} runs its own program, whose checkpoints are in its own format: ductile does not delete them (delete them there, then dctl delete {job} without --purge)"),
                ));
            }
            (None, _) => {}
        }
    }
    let state = st.store.delete_job(&job).await?;
    tracing::info!(job = %job, ?state, "job deleted");
    Ok(Json(
        serde_json::json!({"job": job, "deleted": true, "state": state, "purged": purged}),
    ))
}

#[derive(serde::Deserialize)]
struct PlanQuery {
    world: u32,
}

/// The plan the leader would publish for `job` at `world` ranks; changes nothing.
async fn plan(
    State(st): State<AppState>,
    Path(job): Path<String>,
    axum::extract::Query(q): axum::extract::Query<PlanQuery>,
) -> ApiResult<Json<serde_json::Value>> {
    let Some(spec) = st.store.spec(&job).await? else {
        return Err(ApiError::not_found(&job));
    };
    let Some(t) = &spec.0.training else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("job {job} has no [training] section: nothing to plan"),
        ));
    };
    // bounded by what the job allows (a plan's search grows with the world), and planned off
    // the runtime so a request never holds up the others
    if q.world == 0 || q.world > spec.0.max {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "world {} is outside 1..={} (the job's max): job {job} never runs there",
                q.world, spec.0.max
            ),
        ));
    }
    let (t, world) = (t.clone(), q.world);
    // the plan and each sharding level's, off the async runtime
    let planned = tokio::task::spawn_blocking(move || {
        let plan = ductile_strategies::pipeline::plan(&t, world)?;
        let mut v = serde_json::to_value(&plan).map_err(|e| format!("the plan: {e}"))?;
        sharding_candidates(&t, world, &mut v, &plan);
        Ok::<_, String>(v)
    })
    .await
    .map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("planning failed: {e}"),
        )
    })?;
    let v = planned.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("job {job} at world {}: {e}", q.world),
        )
    })?;
    Ok(Json(v))
}

/// An all-reduce job's plan shows each sharding level at the world (`sharding`: level, bytes
/// per rank, whether it is the job's), and a sharded data-parallel job's layout its shard
/// groups. A job with stages or tensor groups shows, per level it can run (none, optimizer,
/// gradients), the planner's layout with that level and its fullest rank's memory
/// (`memory_bytes`; null and `refused` where no layout fits); under `"auto"` the level the
/// planner chose is the job's.
fn sharding_candidates(
    t: &TrainingSpec,
    world: u32,
    v: &mut serde_json::Value,
    plan: &ductile_strategies::pipeline::Plan,
) {
    use ductile_cluster::modes::{Sharding, Strategy, SyncMode};
    if t.sync != SyncMode::Allreduce {
        return;
    }
    if t.strategy != Strategy::DataParallel {
        let rows: Vec<serde_json::Value> =
            [Sharding::None, Sharding::Optimizer, Sharding::Gradients]
                .into_iter()
                .map(|s| {
                    let mut x = t.clone();
                    x.sharding = s;
                    let chosen = match t.sharding {
                        Sharding::Auto if plan.layout.dp_shard > 1 => s == Sharding::Optimizer,
                        Sharding::Auto => s == Sharding::None,
                        own => own == s,
                    };
                    match ductile_strategies::pipeline::plan(&x, world) {
                        Ok(p) => serde_json::json!({
                            "sharding": s,
                            "memory_bytes": p.max_memory_bytes,
                            "layout": p.layout.to_string(),
                            "chosen": chosen,
                        }),
                        Err(e) => serde_json::json!({
                            "sharding": s,
                            "memory_bytes": null,
                            "refused": e,
                            "chosen": chosen,
                        }),
                    }
                })
                .collect();
        v["sharding"] = serde_json::Value::Array(rows);
        return;
    }
    let rows: Vec<serde_json::Value> = Sharding::LEVELS
        .into_iter()
        .map(|s| {
            let mut x = t.clone();
            x.sharding = s;
            serde_json::json!({
                "sharding": s,
                "memory_bytes": x.min_slot_bytes(world),
                "chosen": t.sharding == s,
            })
        })
        .collect();
    v["sharding"] = serde_json::Value::Array(rows);
    if t.sharding.is_sharded() {
        let group = match t.shard_group {
            Some(ShardGroup::Ranks(n)) => n,
            // (the nodes' sizes are the generation's: a world in one group here)
            Some(ShardGroup::Node) | None => world,
        };
        if let Ok(l) = serde_json::to_value(Layout::sharded(world, group)) {
            v["layout"] = l;
        }
    }
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
struct LogQuery {
    /// The rank (default 0) in `generation` (default the latest) whose slot's output is read.
    rank: Option<u32>,
    generation: Option<u64>,
    tail: Option<u32>,
    /// A follow: the file of this node and slot, from this byte on.
    offset: Option<u64>,
    node: Option<String>,
    slot: Option<u32>,
}

/// Whether `node`'s agent holds its registration (a node record under its lease).
async fn node_registered(st: &AppState, node: &str) -> ApiResult<bool> {
    Ok(st
        .store
        .backend
        .get(&st.store.keys.node(node))
        .await?
        .is_some())
}

/// How long the daemon waits for an agent to answer a log request.
const LOG_ANSWER_WAIT: Duration = Duration::from_secs(10);

/// `dctl logs`: what the slot of `rank` in `generation` wrote (its agent's LOG_DIR/JOB/slot-S.log),
/// asked of that node's agent through etcd (a request under a short lease; the agent answers
/// under the same lease). The admin token only: programs' output may hold what they print.
async fn logs(
    State(st): State<AppState>,
    axum::Extension(scope): axum::Extension<Scope>,
    Path(job): Path<String>,
    Query(q): Query<LogQuery>,
) -> ApiResult<Json<ductile_cluster::api::LogView>> {
    match &scope {
        Scope::Admin => {}
        // its own job's (the middleware checked the name)
        Scope::Tenant(t) if t.submit => {}
        Scope::Tenant(t) => {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                format!("{}: programs' output may hold what they print: logs need the submit scope", t.describe()),
            ))
        }
        Scope::Read => {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "programs' output may hold what they print: logs are read with the admin token, not the read-only one",
            ))
        }
    }
    if st.store.spec(&job).await?.is_none() {
        return Err(ApiError::not_found(&job));
    }
    let history = st.store.history(&job).await?;
    let rank = q.rank.unwrap_or(0);
    let (node, slot, generation) = match (q.node, q.slot) {
        (Some(node), Some(slot)) => {
            ductile_cluster::keys::validate_name("node", &node)?;
            (node, slot, q.generation.unwrap_or(0))
        }
        _ => {
            let g = match q.generation {
                Some(n) => history.iter().find(|g| g.number == n).ok_or_else(|| {
                    ApiError::new(
                        StatusCode::NOT_FOUND,
                        format!(
                            "{job} has no generation {n} (it has {})",
                            history
                                .first()
                                .zip(history.last())
                                .map(|(a, b)| format!("{} to {}", a.number, b.number))
                                .unwrap_or_else(|| "none yet".into())
                        ),
                    )
                })?,
                None => history.last().ok_or_else(|| {
                    ApiError::new(
                        StatusCode::NOT_FOUND,
                        format!("{job} has no generation yet: no program ran"),
                    )
                })?,
            };
            let m = g.members.iter().find(|m| m.rank == rank).ok_or_else(|| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!(
                        "generation {} of {job} has no rank {rank} (world {})",
                        g.number, g.world_size
                    ),
                )
            })?;
            (m.node.clone(), m.slot, g.number)
        }
    };
    let unavailable = |why: String| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, why);
    if !node_registered(&st, &node).await? {
        return Err(unavailable(format!(
            "node {node} is not registered (its agent is gone): slot {slot}'s output is on its disk, in the agent's log directory under {job}/slot-{slot}.log"
        )));
    }
    let lease = st
        .store
        .backend
        .grant(LOG_ANSWER_WAIT.as_secs() as i64 + 5)
        .await?;
    let id = ductile_cluster::records::random_hex(16);
    let req = ductile_cluster::records::LogRequest {
        job: job.clone(),
        slot,
        generation: q.generation.filter(|_| q.offset.is_none()),
        tail: q.tail,
        offset: q.offset,
        lease,
    };
    let body = serde_json::to_vec(&req)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    st.store
        .backend
        .put(&st.store.keys.log_request(&node, &id), body, Some(lease))
        .await?;
    let answer_key = st.store.keys.log_answer(&id);
    let t0 = std::time::Instant::now();
    let answer = loop {
        if let Some(kv) = st.store.backend.get(&answer_key).await? {
            break serde_json::from_slice::<ductile_cluster::records::LogAnswer>(&kv.value)
                .map_err(|e| {
                    unavailable(format!(
                        "node {node}'s agent answered what is not a log answer: {e}"
                    ))
                });
        }
        if t0.elapsed() > LOG_ANSWER_WAIT {
            break Err(unavailable(format!(
                "node {node}'s agent did not answer within {} s (an agent older than dctl logs, or one that cannot reach etcd)",
                LOG_ANSWER_WAIT.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // the request and the answer go with their lease
    let _ = st.store.backend.revoke(lease).await;
    let a = answer?;
    if let Some(e) = a.error {
        return Err(ApiError::new(StatusCode::NOT_FOUND, e));
    }
    Ok(Json(ductile_cluster::api::LogView {
        job,
        node,
        slot,
        rank: q.rank,
        generation,
        text: a.text,
        offset: a.offset,
        truncated: a.truncated,
        file: a.file,
    }))
}

#[derive(Deserialize)]
struct SeriesQuery {
    #[serde(default)]
    from: u64,
    #[serde(default)]
    every: u64,
}

/// The job's chart history as the leader last wrote it, and its latest progress report when
/// that is newer (the leader writes every few seconds; the page wants the step it is at).
async fn series(
    State(st): State<AppState>,
    Path(job): Path<String>,
    Query(q): Query<SeriesQuery>,
) -> ApiResult<Json<SeriesView>> {
    let snaps = current(&st)?;
    let torchft;
    let mut s = match cached_obs(&st, &snaps, &job) {
        Some(obs) => {
            torchft = obs
                .spec
                .as_ref()
                .is_some_and(|s| s.runtime == Runtime::Torchft);
            let mut s = crate::series::stored(&st.store, &snaps.jobs, &job).map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("the stored chart history of {job} cannot be read (the leader replaces it at its next write): {e}"),
                )
            })?;
            if let Some(p) = crate::series::point_of(&obs, &s) {
                if s.points.last().is_none_or(|l| l.t_ms < p.t_ms) {
                    s.push(p);
                }
            }
            s
        }
        None => {
            let Some((spec, _)) = st.store.spec(&job).await? else {
                return Err(ApiError::not_found(&job));
            };
            torchft = spec.runtime == Runtime::Torchft;
            st.store
                .get_json(&st.store.keys.series(&job), "job series")
                .await?
                .map(|(s, _)| s)
                .unwrap_or_else(|| ductile_cluster::series::Series::new(&job))
        }
    };
    let stored_points = s.points.len();
    let points = s.query(q.from, q.every);
    // a torchft job's quorums, from its lighthouse room
    let quorums = if torchft {
        crate::lighthouse::job_quorums(&st.store, &job, -1)
            .await?
            .into_iter()
            .map(|v| ductile_cluster::series::QuorumMark {
                quorum_id: v.quorum_id,
                at_ms: v.created_ms,
                step: v
                    .members
                    .iter()
                    .map(|m| m.step.max(0) as u64)
                    .max()
                    .unwrap_or(0),
                members: v.members.len() as u32,
                healing: v.healing.len() as u32,
            })
            .collect()
    } else {
        Vec::new()
    };
    Ok(Json(SeriesView {
        job,
        points,
        marks: std::mem::take(&mut s.marks),
        stored_points,
        quorums,
    }))
}

#[derive(Deserialize)]
struct QuorumsQuery {
    #[serde(default = "QuorumsQuery::all")]
    after: i64,
}

impl QuorumsQuery {
    fn all() -> i64 {
        -1
    }
}

/// A torchft job's quorums past `after` (a quorum id), oldest first: `dctl events`.
async fn quorums(
    State(st): State<AppState>,
    Path(job): Path<String>,
    Query(q): Query<QuorumsQuery>,
) -> ApiResult<Json<Vec<ductile_cluster::api::TorchftQuorumView>>> {
    ductile_cluster::keys::validate_name("job", &job)?;
    Ok(Json(
        crate::lighthouse::job_quorums(&st.store, &job, q.after).await?,
    ))
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
    let snaps = current(&st)?;
    let history: Vec<Generation> = if snaps.jobs.kvs.contains_key(&st.store.keys.spec(&job)) {
        let prefix = st.store.keys.history(&job);
        job_kvs(&snaps.jobs, &prefix)
            .map(|kv| decode::<Generation>(kv, "generation"))
            .collect::<Result<_, _>>()?
    } else {
        if st.store.spec(&job).await?.is_none() {
            return Err(ApiError::not_found(&job));
        }
        st.store.history(&job).await?
    };
    Ok(Json(
        history.into_iter().filter(|g| g.number > q.after).collect(),
    ))
}

async fn nodes(
    State(st): State<AppState>,
    axum::Extension(scope): axum::Extension<Scope>,
) -> ApiResult<Json<Vec<NodeView>>> {
    let snaps = current(&st)?;
    let k = &st.store.keys;
    let mut nodes = Vec::new();
    for kv in snaps.nodes.kvs.values() {
        if let KeyKind::Node { .. } = k.parse(&kv.key) {
            nodes.push(decode::<NodeRecord>(kv, "node record")?);
        }
    }
    let drained: BTreeMap<String, String> = snaps
        .drains
        .kvs
        .values()
        .filter_map(|kv| match k.parse(&kv.key) {
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
    for (name, obs) in jobs_from(&st.store, &[&snaps.jobs]) {
        if obs.spec.is_none() || obs.status.as_ref().is_some_and(|s| s.state.is_terminal()) {
            continue;
        }
        // a tenant sees its own jobs' workers only
        if !scope.sees(&name) {
            continue;
        }
        if let Some((g, _)) = obs.generation {
            for m in g.members {
                placed
                    .entry(m.node.clone())
                    .or_default()
                    .push(NodeWorkerView {
                        job: name.clone(),
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
                containment: n.containment,
                // (why a slot is busy names the job that left processes behind)
                busy_slots: match &scope {
                    Scope::Tenant(_) => n
                        .busy_slots
                        .into_keys()
                        .map(|k| (k, "busy".to_string()))
                        .collect(),
                    _ => n.busy_slots,
                },
                preemption: n.preemption,
                refused_running: n
                    .refused_running
                    .into_iter()
                    .filter(|(j, _)| scope.sees(j))
                    .collect(),
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
    if !node_registered(&st, &node).await? {
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
        serde_json::json!({ "leader": leader, "this_replica": st.id, "this_replica_leads": st.leader.borrow().is_some() }),
    ))
}

/// TorchFT's lighthouse: each room's last quorum and the recent ones (`dctl torchft`).
async fn torchft(State(st): State<AppState>) -> ApiResult<Json<serde_json::Value>> {
    Ok(Json(crate::lighthouse::report(&st.store, 20).await?))
}

/// The status view of one job, read from etcd (two requests: its control and live keys): what
/// a write answers with, and a read the cached view cannot answer yet.
pub async fn view(store: &Store, job: &str) -> ApiResult<JobView> {
    let (control, _) = store.backend.list(&store.keys.job(job)).await?;
    let (live, _) = store.backend.list(&store.keys.live_job(job)).await?;
    let jobs = jobs_from_kvs(store, control.iter().chain(live.iter()));
    jobs.get(job)
        .and_then(|o| job_view(job, o))
        .ok_or_else(|| ApiError::not_found(job))
}

/// The status view of one job from its observed state (None without a spec).
pub fn job_view(job: &str, obs: &JobObs) -> Option<JobView> {
    let spec = obs.spec.as_ref()?;
    let status = obs.status.as_ref();
    let gen = obs.generation.as_ref().map(|(g, _)| g);
    let progress = obs.progress.as_ref();
    let terminal = status.is_some_and(|s| s.state.is_terminal());
    let members = match (gen, terminal) {
        (Some(g), false) => g
            .members
            .iter()
            .map(|m| MemberView {
                node: m.node.clone(),
                slot: m.slot,
                rank: m.rank,
                pid: obs
                    .workers
                    .get(&(m.node.clone(), m.slot))
                    .filter(|w| w.state == WorkerState::Running)
                    .map(|w| w.pid),
                program_pid: obs
                    .joined
                    .get(&m.rank)
                    .filter(|_| spec.runtime.runs_program())
                    .map(|j| j.pid),
                dp_rank: m.dp_rank,
                pp_stage: m.pp_stage,
                tp_rank: m.tp_rank,
                stage_units: chunks_of(g, m).first().copied(),
                stage_chunks: chunks_of(g, m),
                spare: m.spare,
                replica_group: m.replica_group,
                group_since: m.replica_group.map(|_| m.group_since),
                step_ms: obs.rank_stats.get(&m.rank).map(|s| s.step_ms),
                compute_ms: obs.rank_stats.get(&m.rank).map(|s| s.compute_ms),
                data_ms: obs.rank_stats.get(&m.rank).map(|s| s.data_ms),
            })
            .collect(),
        _ => Vec::new(),
    };
    Some(JobView {
        job: job.to_string(),
        state: status.map(|s| s.state).unwrap_or(JobState::Pending),
        generation: gen.map(|g| g.number).unwrap_or(0),
        world_size: if terminal {
            0
        } else {
            gen.map(|g| g.world_size).unwrap_or(0)
        },
        layout: gen.filter(|_| !terminal).map(|g| g.layout),
        stage_boundaries: gen
            .filter(|_| !terminal)
            .map(|g| g.stage_boundaries.clone())
            .unwrap_or_default(),
        members,
        step: progress.map(|p| p.step).unwrap_or(0),
        progress_at_ms: progress.map(|p| p.updated_at_ms),
        loss: progress.and_then(|p| p.loss),
        samples_per_sec: progress.and_then(|p| p.samples_per_sec),
        sync: spec.training.as_ref().map(|t| t.sync.to_string()),
        round: progress.and_then(|p| p.round),
        bytes_per_sample: progress.and_then(|p| p.bytes_per_sample),
        eval_loss: progress.and_then(|p| p.eval_loss),
        grad_norm: progress.and_then(|p| p.grad_norm),
        lr: progress.and_then(|p| p.lr),
        recipe: spec
            .training
            .as_ref()
            .filter(|_| spec.runtime.is_ductile())
            .map(|t| t.recipe()),
        sharding: spec
            .training
            .as_ref()
            .map(|t| t.sharding)
            .filter(|s| s.is_sharded()),
        eval_step: progress.and_then(|p| p.eval_step),
        staleness_mean: progress.and_then(|p| p.staleness_mean),
        staleness_max: progress.and_then(|p| p.staleness_max),
        dropped_updates: progress.and_then(|p| p.dropped_updates),
        torchft: None,
        last_checkpoint: match (&obs.checkpoint, progress) {
            (Some(c), _) => Some(LastCheckpointView {
                step: c.step,
                at_ms: c.committed_at_ms,
                kind: "commit".into(),
                bytes: Some(c.bytes),
                world_size: Some(c.world_size),
            }),
            (None, Some(p)) => p.saved_step.map(|step| LastCheckpointView {
                step,
                at_ms: p.saved_at_ms.unwrap_or(0),
                kind: "program".into(),
                bytes: None,
                world_size: None,
            }),
            (None, None) => None,
        },
        last_reformation: status.and_then(|s| s.last_reformation.as_ref()).map(|r| {
            ReformationView {
                generation: r.generation,
                reason: r.reason,
                detail: r.detail.clone(),
                seconds: r.seconds,
                first_step_seconds: r.first_step_seconds,
            }
        }),
        min: spec.min,
        max: spec.max,
        desired: spec.desired,
        message: status
            .map(|s| s.message.clone())
            .unwrap_or_else(|| "waiting for the leader to schedule it".into()),
        final_weights_sha256: progress.and_then(|p| p.final_weights_sha256.clone()),
    })
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobLabel {
    job: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    job: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SyncLabels {
    job: String,
    mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RankLabels {
    job: String,
    rank: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    job: String,
    outcome: String,
}

type FGauge = Gauge<f64, AtomicU64>;

/// A histogram the job's status already counted (`JobStatus::reformation_seconds`), encoded
/// as a Prometheus histogram at each scrape.
#[derive(Debug, Default)]
struct StatusHistogram(std::sync::Mutex<SecondsHistogram>);

impl prometheus_client::metrics::TypedMetric for StatusHistogram {
    const TYPE: prometheus_client::metrics::MetricType =
        prometheus_client::metrics::MetricType::Histogram;
}

impl prometheus_client::encoding::EncodeMetric for StatusHistogram {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::MetricEncoder,
    ) -> Result<(), std::fmt::Error> {
        let h = self.0.lock().unwrap();
        encoder.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            h.sum,
            h.count(),
            &h.buckets(),
            None,
        )
    }
    fn metric_type(&self) -> prometheus_client::metrics::MetricType {
        prometheus_client::metrics::MetricType::Histogram
    }
}

/// Prometheus metrics (OpenMetrics text) from the replica's cached view: a scrape costs etcd
/// nothing, and any replica answers the same. `ductile_daemon_etcd_last_answer_seconds` says
/// how current the view is.
async fn metrics(State(st): State<AppState>, headers: HeaderMap) -> ApiResult<Response> {
    if st.metrics_need_token {
        match scope(&st, &headers) {
            Err(r) => return Ok(r),
            // every job's name and figures: the cluster's, not a tenant's
            Ok(Scope::Tenant(t)) => {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    format!(
                        "{} cannot read /metrics (every job's figures): that needs the read-only or the admin token",
                        t.describe()
                    ),
                ))
            }
            Ok(_) => {}
        }
    }
    let snaps = st.view.snapshots();
    if snaps.jobs.revision == 0 || snaps.nodes.revision == 0 {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "this replica has not read the cluster's state from etcd yet",
        ));
    }
    let mut reg = Registry::default();
    let is_leader = Gauge::<i64>::default();
    is_leader.set(st.leader.borrow().is_some() as i64);
    reg.register(
        "ductile_daemon_is_leader",
        "1 if this replica leads",
        is_leader,
    );
    let age = FGauge::default();
    age.set(st.view.age().unwrap_or(f64::INFINITY));
    reg.register(
        "ductile_daemon_etcd_last_answer_seconds",
        "Seconds since etcd last answered this replica (how current these figures are)",
        age,
    );
    let nodes = crate::observe::fleet_from(&st.store, &snaps.nodes, &snaps.drains).nodes;
    let (n_nodes, n_slots) = (Gauge::<i64>::default(), Gauge::<i64>::default());
    n_nodes.set(nodes.len() as i64);
    n_slots.set(nodes.values().map(|n| n.slots() as i64).sum());
    reg.register("ductile_nodes", "Live nodes", n_nodes);
    reg.register("ductile_slots", "Live slots (GPUs or CPU slots)", n_slots);

    let jobs_by_state = Family::<StateLabel, Gauge>::default();
    let world = Family::<JobLabel, Gauge>::default();
    let generation = Family::<JobLabel, Gauge>::default();
    let step = Family::<JobLabel, Gauge>::default();
    let last_reform = Family::<ReasonLabels, FGauge>::default();
    let reform_hist = Family::<JobLabel, StatusHistogram>::default();
    let reformations = Family::<ReasonLabels, Counter>::default();
    let stall = Family::<JobLabel, FGauge>::default();
    let stall_s = Family::<JobLabel, FGauge>::default();
    let upload = Family::<JobLabel, FGauge>::default();
    let bytes = Family::<JobLabel, Gauge>::default();
    let ck_step = Family::<JobLabel, Gauge>::default();
    let ck_total = Family::<OutcomeLabels, Counter>::default();
    let restore = Family::<JobLabel, FGauge>::default();
    let rank_step = Family::<RankLabels, FGauge>::default();
    let rank_compute = Family::<RankLabels, FGauge>::default();
    let rank_data = Family::<RankLabels, FGauge>::default();
    let sync_mode = Family::<SyncLabels, Gauge>::default();
    let loss = Family::<JobLabel, FGauge>::default();
    let eval_loss = Family::<JobLabel, FGauge>::default();
    let grad_norm = Family::<JobLabel, FGauge>::default();
    let lr = Family::<JobLabel, FGauge>::default();
    let eval_step = Family::<JobLabel, Gauge>::default();
    let sps = Family::<JobLabel, FGauge>::default();
    let rounds = Family::<JobLabel, Gauge>::default();
    let bytes_per_sample = Family::<JobLabel, FGauge>::default();
    let stale_mean = Family::<JobLabel, FGauge>::default();
    let stale_max = Family::<JobLabel, Gauge>::default();
    let dropped = Family::<JobLabel, Gauge>::default();
    for (name, obs) in jobs_from(&st.store, &[&snaps.jobs, &snaps.live]) {
        let Some(v) = job_view(&name, &obs) else {
            continue;
        };
        let job = JobLabel { job: name.clone() };
        jobs_by_state
            .get_or_create(&StateLabel {
                state: format!("{:?}", v.state),
            })
            .inc();
        world.get_or_create(&job).set(v.world_size as i64);
        for (rank, s) in &obs.rank_stats {
            let l = RankLabels {
                job: name.clone(),
                rank: rank.to_string(),
            };
            rank_step.get_or_create(&l).set(s.step_ms / 1e3);
            rank_compute.get_or_create(&l).set(s.compute_ms / 1e3);
            rank_data.get_or_create(&l).set(s.data_ms / 1e3);
        }
        generation.get_or_create(&job).set(v.generation as i64);
        step.get_or_create(&job).set(v.step as i64);
        if let Some(m) = &v.sync {
            sync_mode
                .get_or_create(&SyncLabels {
                    job: name.clone(),
                    mode: m.clone(),
                })
                .set(1);
        }
        if let Some(x) = v.loss {
            loss.get_or_create(&job).set(x);
        }
        if let Some(x) = v.eval_loss {
            eval_loss.get_or_create(&job).set(x);
        }
        if let Some(x) = v.grad_norm {
            grad_norm.get_or_create(&job).set(x);
        }
        if let Some(x) = v.lr {
            lr.get_or_create(&job).set(x);
        }
        if let Some(x) = v.eval_step {
            eval_step.get_or_create(&job).set(x as i64);
        }
        if let Some(x) = v.samples_per_sec {
            sps.get_or_create(&job).set(x);
        }
        if let Some(x) = v.round {
            rounds.get_or_create(&job).set(x as i64);
        }
        if let Some(x) = v.bytes_per_sample {
            bytes_per_sample.get_or_create(&job).set(x);
        }
        if let Some(x) = v.staleness_mean {
            stale_mean.get_or_create(&job).set(x);
        }
        if let Some(x) = v.staleness_max {
            stale_max.get_or_create(&job).set(x as i64);
        }
        if let Some(x) = v.dropped_updates {
            dropped.get_or_create(&job).set(x as i64);
        }
        if let Some(r) = &v.last_reformation {
            last_reform
                .get_or_create(&ReasonLabels {
                    job: name.clone(),
                    reason: r.reason.to_string(),
                })
                .set(r.seconds);
        }
        if let Some(h) = obs.status.as_ref().map(|s| &s.reformation_seconds) {
            *reform_hist.get_or_create(&job).0.lock().unwrap() = h.clone();
        }
        // counted at each publish: history is bounded, these counts are not
        for (r, n) in obs.status.iter().flat_map(|s| s.reformations.iter()) {
            reformations
                .get_or_create(&ReasonLabels {
                    job: name.clone(),
                    reason: r.clone(),
                })
                .inc_by(*n);
        }
        if let Some(c) = &obs.checkpoint_stats {
            stall.get_or_create(&job).set(c.last_stall_ms);
            stall_s.get_or_create(&job).set(c.last_stall_ms / 1e3);
            upload.get_or_create(&job).set(c.last_upload_seconds);
            bytes.get_or_create(&job).set(c.last_bytes as i64);
            ck_step.get_or_create(&job).set(c.last_step as i64);
            for (k, n) in [
                ("committed", c.committed_total),
                ("skipped", c.skipped_total),
                ("failed", c.failed_total),
            ] {
                ck_total
                    .get_or_create(&OutcomeLabels {
                        job: name.clone(),
                        outcome: k.into(),
                    })
                    .inc_by(n);
            }
            if let Some(r) = c.last_restore_seconds {
                restore.get_or_create(&job).set(r);
            }
        }
    }
    reg.register("ductile_jobs", "Jobs by state", jobs_by_state);
    reg.register(
        "ductile_job_sync_mode",
        "1 for the job's sync mode (allreduce, diloco, async)",
        sync_mode,
    );
    reg.register(
        "ductile_job_loss",
        "Last training loss rank 0 reported",
        loss,
    );
    reg.register(
        "ductile_job_eval_loss",
        "Latest eval loss: the mean loss on the job's held-out split (eval_dataset or eval_fraction), at ductile_job_eval_step",
        eval_loss,
    );
    reg.register(
        "ductile_job_grad_norm",
        "Global L2 norm of the last reported step's summed gradients, before clipping (jobs with max_grad_norm)",
        grad_norm,
    );
    reg.register(
        "ductile_job_lr",
        "The learning rate the last reported step ran at (the recipe's rate of that step)",
        lr,
    );
    reg.register(
        "ductile_job_eval_step",
        "The step the latest eval loss was computed at",
        eval_step,
    );
    reg.register(
        "ductile_job_samples_per_second",
        "Samples trained (applied, in async mode) per second, as rank 0 last reported",
        sps,
    );
    reg.register(
        "ductile_job_diloco_rounds",
        "DiLoCo rounds committed",
        rounds,
    );
    reg.register(
        "ductile_job_exchanged_bytes_per_sample",
        "Bytes the workers sent each other per trained sample in the current generation",
        bytes_per_sample,
    );
    reg.register(
        "ductile_job_async_staleness_mean",
        "Async: mean staleness (updates) of the updates applied",
        stale_mean,
    );
    reg.register(
        "ductile_job_async_staleness_max",
        "Async: largest staleness of an update applied (at most the job's bound)",
        stale_max,
    );
    reg.register(
        "ductile_job_async_dropped_updates",
        "Async: updates dropped for being staler than the bound (their samples re-queued)",
        dropped,
    );
    reg.register(
        "ductile_rank_step_seconds",
        "Mean wall time per step of each rank of the current generation, over its last report",
        rank_step,
    );
    reg.register(
        "ductile_rank_compute_seconds",
        "Mean time per step each rank spent computing (not waiting for its peers): a straggler's is longer",
        rank_compute,
    );
    reg.register(
        "ductile_rank_data_wait_seconds",
        "Mean time per step each rank waited for its data (what the read-ahead had not fetched yet): a slow store shows here",
        rank_data,
    );
    reg.register(
        "ductile_job_world_size",
        "World size of the job's current generation",
        world,
    );
    reg.register(
        "ductile_job_generation",
        "Current generation number",
        generation,
    );
    reg.register("ductile_job_step", "Last step rank 0 reported", step);
    reg.register(
        "ductile_job_last_reformation_seconds",
        "Seconds from the triggering event to the last member joining",
        last_reform,
    );
    reg.register(
        "ductile_reformations",
        "Generations published, by reason",
        reformations,
    );
    reg.register(
        "ductile_job_reformation_seconds",
        "Re-formations by how long they took, from the triggering event to the last member joining",
        reform_hist,
    );
    reg.register(
        "ductile_checkpoint_stall_seconds",
        "Training stall of the last checkpoint (copy into host memory)",
        stall_s,
    );
    reg.register(
        "ductile_checkpoint_stall_ms",
        "Training stall of the last checkpoint in milliseconds (kept for existing scrapers; prefer ductile_checkpoint_stall_seconds)",
        stall,
    );
    reg.register(
        "ductile_checkpoint_upload_seconds",
        "Snapshot-to-commit time of the last committed checkpoint",
        upload,
    );
    reg.register(
        "ductile_checkpoint_bytes",
        "Bytes of the last committed checkpoint",
        bytes,
    );
    reg.register(
        "ductile_checkpoint_last_step",
        "Step of the last committed checkpoint",
        ck_step,
    );
    reg.register(
        "ductile_checkpoints",
        "Checkpoints by outcome (committed, skipped while one was in flight, failed)",
        ck_total,
    );
    reg.register(
        "ductile_checkpoint_restore_seconds",
        "Time of the last restore from a checkpoint",
        restore,
    );
    let mut out = String::new();
    encode(&mut out, &reg).map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics: {e}"),
        )
    })?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        out,
    )
        .into_response())
}

/// The chunks of units member `m` holds in `g` (none for a data-parallel generation or a
/// spare).
fn chunks_of(g: &Generation, m: &ductile_cluster::records::Member) -> Vec<[u32; 2]> {
    if g.stage_boundaries.len() < 2 || m.spare {
        return Vec::new();
    }
    let units = *g.stage_boundaries.last().unwrap();
    g.stage_chunks(m.pp_stage, units)
        .into_iter()
        .map(|r| [r.start, r.end])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ductile_cluster::records::NodeRecord;

    fn node(name: &str, slots: &[u64]) -> NodeRecord {
        let devices: Vec<serde_json::Value> = slots
            .iter()
            .enumerate()
            .map(|(i, mb)| serde_json::json!({"kind": "gpu", "index": i, "name": format!("gpu{i}"), "memory_mb": mb}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "name": name, "hostname": name, "devices": devices, "agent_pid": 1,
            "registered_at_ms": 0,
        }))
        .unwrap()
    }

    fn job(min: u32, max: u32) -> JobSpec {
        JobSpec::from_toml(&format!(
            "name = \"big\"\nmin = {min}\nmax = {max}\ndesired = {max}\n[training]\nmodel = \"gpt\"\ndataset = \"file:///d.bin\"\nglobal_batch = 64\nsharding = \"full\"\nmodel_config = {{ d_model = 2048, n_layer = 24, n_head = 16, ctx = 1024, vocab = 32000 }}\n[checkpoint]\nurl = \"file:///ck\"\n"
        ))
        .unwrap()
    }

    fn refusal(spec: &JobSpec, nodes: &[NodeRecord]) -> Option<(Option<String>, String)> {
        check_memory(spec, nodes.iter())
            .err()
            .map(|ApiError(_, b)| (b.field, b.error))
    }

    /// The memory check holds at every world the job may take: a fully sharded job that fits
    /// its slots at 8 ranks but not at its min of 1 (it would fail at start when it shrank
    /// there) is refused naming the world it fits from; at min = that world it is accepted;
    /// a slot of unknown memory refuses nothing.
    #[test]
    fn the_memory_check_holds_at_every_world_the_job_may_take() {
        let t = job(1, 8).training.unwrap();
        let gib = |w: u32| t.min_slot_bytes(w).unwrap() as f64 / (1u64 << 30) as f64;
        // about 15 GiB a rank at 1, 3 at 8: slots of 8 GiB hold it from 2 or 3 ranks up
        assert!(gib(1) > 8.0 && gib(8) < 8.0, "{} {}", gib(1), gib(8));
        let from = (1..=8).find(|w| gib(*w) <= 8.0).unwrap();
        let fleet: Vec<NodeRecord> = (0..2).map(|i| node(&format!("n{i}"), &[8192; 4])).collect();
        let (field, why) = refusal(&job(1, 8), &fleet).expect("refused at min = 1");
        assert_eq!(field.as_deref(), Some("min"), "{why}");
        assert!(
            why.contains("at its min of 1 rank(s)")
                && why.contains(&format!("set min = {from}"))
                && why.contains("8.0 GiB"),
            "{why}"
        );
        assert_eq!(refusal(&job(from, 8), &fleet), None);
        // one slot too few at every world: the figures at max and min, not a min to set
        let small: Vec<NodeRecord> = vec![node("n0", &[2048; 4])];
        let (field, why) = refusal(&job(from, 8), &small).expect("refused");
        assert_eq!(field.as_deref(), Some("training.model_config"), "{why}");
        assert!(
            why.contains("GiB per slot") && why.contains("at its max of 8"),
            "{why}"
        );
        // an agent that did not report its memory: nothing is refused
        let mut unknown = fleet.clone();
        unknown[1].devices[0].memory_mb = None;
        assert_eq!(refusal(&job(1, 8), &unknown), None);
    }
}

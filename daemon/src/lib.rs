//! ductiled: the control-plane daemon. Every replica serves the API; the elected leader
//! reconciles each job's desired size against live membership and publishes generations.

pub mod api;
pub mod config;
pub mod leader;
pub mod reconcile;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use ductile_cluster::{Keys, KvBackend, Store};
use tokio_util::sync::CancellationToken;

/// Runs one replica (API + election + leader loop) until `cancel`.
pub async fn run(
    cfg: config::Config,
    backend: Arc<dyn KvBackend>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let store = Store::new(backend, Keys::new(&cfg.prefix));
    let is_leader = Arc::new(AtomicBool::new(false));
    let listener = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", cfg.listen))?;
    tracing::info!(listen = %listener.local_addr()?, id = %cfg.id, "API listening");
    let app = api::router(api::AppState {
        store: store.clone(),
        token: cfg.token.clone(),
        is_leader: is_leader.clone(),
        id: cfg.id.clone(),
    });
    let c = cancel.clone();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { c.cancelled().await })
            .await
    });
    let lcfg = leader::LeaderConfig {
        id: cfg.id.clone(),
        election_ttl: cfg.election_ttl,
        debounce: cfg.debounce,
    };
    let replica = tokio::spawn(leader::run_replica(store, lcfg, is_leader, cancel.clone()));
    ductile_cluster::service::sd_notify("READY=1\nSTATUS=standby");
    if let Some(every) = ductile_cluster::service::watchdog_interval() {
        let c = cancel.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => ductile_cluster::service::sd_notify("WATCHDOG=1"),
                    _ = c.cancelled() => return,
                }
            }
        });
    }
    cancel.cancelled().await;
    ductile_cluster::service::sd_notify("STOPPING=1");
    let _ = replica.await;
    server.await??;
    Ok(())
}
